"""The Lightning side of stacklm: ``StackDataModule`` and its loaders.

- ``module``: ``StackDataModule`` (``mode`` = ``shards`` / ``stream`` / ``sft``);
- ``modes``: one class per mode, chosen once by the module, with what differs between them;
- ``loader``: ``StackDataLoader`` (per-rank, weights_only-safe checkpoint state);
- ``shards_loader``: ``ShardsLoader`` over a prebuilt directory (elastic O(1) resume);
- ``stream``: ``StreamDataset`` and the per-worker graph builders for stream and sft modes.
- ``identity``: what the data is (content hashes, not paths), checked when a checkpoint resumes.
"""

from stacklm.datamodule.errors import DataConfigError
from stacklm.datamodule.loader import (
    StackDataLoader,
    from_checkpoint_safe,
    gather_from_ranks,
    pick_rank_state,
    to_checkpoint_safe,
)
from stacklm.datamodule.modes import MODES, DataMode, SFTMode, ShardsMode, StreamMode
from stacklm.datamodule.module import DEFAULT_SNAPSHOT_STEPS, StackDataModule
from stacklm.datamodule.shards_loader import ShardsLoader
from stacklm.datamodule.stream import (
    SUMMARY_EVERY_N_BATCHES,
    SUMMARY_KEY,
    PipelineBuilder,
    SFTBuilder,
    StreamDataset,
    merge_worker_summaries,
)

__all__ = [
    "DEFAULT_SNAPSHOT_STEPS", "MODES", "SUMMARY_EVERY_N_BATCHES", "SUMMARY_KEY", "DataConfigError", "DataMode",
    "PipelineBuilder", "SFTBuilder", "SFTMode", "ShardsLoader", "ShardsMode", "StackDataLoader", "StackDataModule",
    "StreamDataset", "StreamMode", "from_checkpoint_safe", "gather_from_ranks", "merge_worker_summaries",
    "pick_rank_state", "to_checkpoint_safe",
]
