"""The Lightning side of stacklm: ``StackDataModule`` and its loaders.

- ``stack_datamodule``: ``StackDataModule`` (``mode`` = ``shards`` / ``stream`` / ``sft`` / ``preference``);
- ``section``: ``DataConfig``, the ``data:`` section parsed once (its pipeline typed), which the
  module keeps and its mode and loader workers get;
- ``modes``: one class per mode, chosen once by the module and called with explicit arguments,
  with what differs between them;
- ``resume/``: every resume rule: the checkpoint state's shape per mode and its checks, what the
  data is (content hashes), shards mode's position and elastic sampler, stream mode's logical
  streams and their replay (its ``__init__`` is the guide);
- ``loader``: ``StackDataLoader`` (per-rank, weights_only-safe checkpoint state);
- ``shards_loader``: ``ShardsLoader`` over a prebuilt directory (elastic O(1) resume);
- ``stream``: ``StreamDataset`` and the per-worker graph builders for stream and sft modes.
- ``workers``: how stream/sft loader workers start (a forkserver that preloads only the data side);
- ``delivery``: per-source counts of what the batches delivered to the training step;
- ``gate``: the data gate, ``stacklm inspect``'s checks on the loader's output before the first step.

Names load on first use (PEP 562): ``import stacklm.datamodule`` imports neither torch nor
lightning (which pulls in transformers through torchmetrics), so a CLI or a config check
that only names the package stays fast, and a loader worker that unpickles ``stream``'s classes
(which imports this package) never imports Lightning or wandb.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stacklm.errors import DataConfigError as DataConfigError  # eager: errors are light
from stacklm.optional import lazy_getattr

_WHERE = {
    "StackDataLoader": "loader", "from_checkpoint_safe": "loader", "gather_from_ranks": "loader",
    "pick_rank_state": "loader", "to_checkpoint_safe": "loader",
    "MODES": "modes", "DataMode": "modes", "SFTMode": "modes", "PreferenceMode": "modes", "ShardsMode": "modes", "StreamMode": "modes",
    "DataConfig": "section",
    "DEFAULT_SNAPSHOT_STEPS": "stack_datamodule", "PipelineSpec": "stack_datamodule", "StackDataModule": "stack_datamodule",
    "check_pipeline": "stack_datamodule",
    "ShardsLoader": "shards_loader",
    "SUMMARY_EVERY_N_BATCHES": "stream", "SUMMARY_KEY": "stream", "PipelineBuilder": "stream", "SFTBuilder": "stream", "PreferenceBuilder": "stream",
    "StreamDataset": "stream", "merge_worker_summaries": "stream",
    "LogicalStreamDataset": "resume.logical",
    "DataGateError": "gate",
}

__all__ = sorted([*_WHERE, "DataConfigError"])

if TYPE_CHECKING:  # pragma: no cover
    from stacklm.datamodule.stack_datamodule import StackDataModule  # noqa: F401


__getattr__ = lazy_getattr("stacklm.datamodule", {n: (f"stacklm.datamodule.{m}", n) for n, m in _WHERE.items()}, globals())
