"""The Lightning side of stacklm: ``StackDataModule`` and its loaders.

- ``module``: ``StackDataModule`` (``mode`` = ``shards`` / ``stream`` / ``sft``);
- ``modes``: one class per mode, chosen once by the module, with what differs between them;
- ``loader``: ``StackDataLoader`` (per-rank, weights_only-safe checkpoint state);
- ``shards_loader``: ``ShardsLoader`` over a prebuilt directory (elastic O(1) resume);
- ``stream``: ``StreamDataset`` and the per-worker graph builders for stream and sft modes.

``StackDataModule`` (the only Lightning import) is loaded on first access: loader workers
unpickle ``stream``'s classes, which imports this package, and a worker must not import
Lightning or wandb (``stacklm.datamodule.workers``).
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


def __getattr__(name: str):
    if name in ("StackDataModule", "DEFAULT_SNAPSHOT_STEPS"):
        from stacklm.datamodule import module

        return getattr(module, name)
    raise AttributeError(f"module 'stacklm.datamodule' has no attribute {name!r}")
