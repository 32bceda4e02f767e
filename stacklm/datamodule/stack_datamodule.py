"""``StackDataModule``: what users hand to ``trainer.fit``.

Modes, one batch contract (``input_ids``, ``position_ids``, ``seq_ids``, ``targets``):
- ``shards``: a prebuilt directory (``stacklm prebuild``) read through memmaps, in one global
  seeded permutation per epoch (seeded by seed x epoch) sliced by rank and worker; the
  position is shape-free (epoch, rows served, steps) in this module's checkpoint state, so
  resume is O(1) and elastic (docs/trainer.md, "Resume").
- ``stream``: the on-the-fly node graph (``stacklm.data.pipeline``) straight from the sources,
  as ``logical_streams`` logical streams (each its own graph over its shard of the documents)
  dealt to (rank, worker) at run time, so resume is elastic too (``resume.logical``).
- ``sft``: chat conversations rendered and packed by ``stacklm.data.sft``.
- ``preference``: chosen/rejected pairs (``stacklm.data.sft.preference``) on the SFT config;
  batches of ``chosen_*``/``rejected_*`` tensors and ``pair_ids``.
Each mode is one class in ``modes`` (its loaders, logging numbers, config hash and its part of
the checkpoint state), chosen once from ``mode`` and called with explicit arguments; the module
keeps what they share. How a checkpoint resumes (what is stored, what is refused, how a
position is re-dealt to another shape) is in ``stacklm.datamodule.resume``.

Loaders are plain ``DataLoader``s with the project's own state: ``StackDataLoader`` (stream,
sft, preference; its worker snapshots in ``worker_state``) and ``ShardsLoader``: Lightning stores their ``state_dict()`` in the checkpoint and restores it, so a resumed
fit sees exactly the batches the uninterrupted run would have.

DDP: every rank must yield the same number of batches or the last collective hangs. Shards
mode slices the permutation into equal per-rank parts; stream/sft modes give each (rank,
worker) an equal token budget and a fixed batch count (``batches_per_worker``), padding a
stream that runs dry with fully masked batches (counted and warned, never silent).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np

from stacklm.data.pipeline import PipelineConfig
from stacklm.data.sft import SFTConfig
from stacklm.datamodule.modes import MODE_CLASSES, ModeArgs, Run
from stacklm.datamodule.resume.state import EpochReload
from stacklm.datamodule.section import DataConfig, check_pipeline
from stacklm.datamodule.transfer import after_transfer, to_device
from stacklm.errors import DataConfigError

DEFAULT_SNAPSHOT_STEPS = 1000  # without a step checkpoint interval to follow; see StackDataModule
_ARGUMENTS = frozenset(f.name for f in dataclasses.fields(DataConfig))  # read back as attributes (``__getattr__``)


class PipelineSpec(dict):
    """The type of ``StackDataModule``'s ``pipeline`` argument: a plain dict, which
    ``check_pipeline`` parses when ``LightningCLI`` reads the YAML (registered with jsonargparse
    below), so ``python -m trainer fit --config X --print_config`` already refuses a typo."""


try:  # jsonargparse comes with lightning's CLI; without it there is no CLI to check for
    from jsonargparse.typing import register_type

    register_type(PipelineSpec, serializer=dict, deserializer=check_pipeline)
except ImportError:  # pragma: no cover
    pass


class StackDataModule(L.LightningDataModule):
    """Lightning data module over stacklm's shards, streams or SFT conversations.

    The arguments are parsed once, on construction, into ``config``: a frozen, picklable
    ``DataConfig`` (``section``: the one schema of ``data:``, with their types and checks; the
    signature repeats names and defaults for jsonargparse and type checkers, a test holds them
    equal), whose pipeline is a ``PipelineConfig`` or ``SFTConfig`` by the time the mode and the
    loader workers get it. Arguments read back as attributes (``dm.gate``), but ``data_dir`` is
    local (a remote one's mirror; the URL: ``data_url``) and ``tokenizer`` loaded (``tokenizer_path``).

    Args:
        mode: ``"shards"``, ``"stream"``, ``"sft"`` or ``"preference"``.
        tokenizer: path of the tokenizer artifact (dir or ``tokenizer.stacklm.json``).
        data_dir: prebuilt shard directory (``shards`` mode), local or a remote URL (``s3://bucket/prefix``,
            any fsspec protocol), mirrored into a local cache first (docs/prebuild.md, "Object storage").
        pipeline: the stream pipeline config as a dict (``stream`` mode; see ``PipelineConfig``),
            or the SFT config (``sft``/``preference`` mode; see ``SFTConfig``); parsed on
            construction (``seq_len``, ``batch_size`` and ``seed`` default to the module's), so
            an unknown key or a wrong type is an error naming ``data.pipeline.<key>``.
        seq_len, batch_size, num_workers, seed: as usual; ``seq_len`` counts the window before
            the next-token shift (batches are ``seq_len - 1`` wide).
        val_batches: validation batches per rank (stream/sft); ``None`` = from the holdout budget
            (stream) or a counting pass (sft); ``0`` disables validation.
        train_batches: sft mode: training batches per rank per epoch; ``None`` = a counting pass.
        snapshot_every_n_steps: how often loader workers send their state to the main process.
            A snapshot holds the worker's stream state (buffered documents by position, and
            in-flight dedup's indexes) and is pickled to the main process: each worker sends one at every multiple of this
            many loader steps (on its last batch before it), so it must be rare. A resume replays
            fewer than this many batches from the last snapshot, deterministically (still exact).
            ``None`` (default): the trainer's step checkpoint interval
            (``ModelCheckpoint(every_n_train_steps=N)``), so a resume replays nothing; else
            ``DEFAULT_SNAPSHOT_STEPS``.
        logical_streams: stream mode: the number of logical streams the data is read as, fixed
            for the run and recorded in the checkpoint (``stacklm.datamodule.resume.logical``); they are
            dealt to (rank x worker) at run time, so a resume may change world size, workers and
            batch size. ``None``: the first run's ranks x workers. Pick a number many shapes
            divide (e.g. 8 or 16): a reader with no logical stream of its own trains on padding.
        step_log: log which rows each global step trains on, so ``stacklm inspect RUN --step S``
            can say which documents (sft: conversations; preference: pairs) were in step ``S``
            (``stacklm.data.storage.steplog``; a fraction of a percent of the token bytes).
            ``True`` (default): under ``<trainer.default_root_dir>/steplog``; a path: there;
            ``False``: off.
        verify_shards: shards mode: check each shard's content hash against its manifest the
            first time a process (the main one or a loader worker) reads a row of it, before
            the row reaches a batch (``PackedMemmapDataset(verify_content=...)``), so bit rot
            that stays inside the vocabulary is an error naming the shard and ``stacklm verify``
            rather than training data. ``True`` (default); ``False`` skips it (cost:
            ``bench/loader.py``, docs/prebuild.md).
        gate: run ``stacklm inspect``'s checks on a sample of the real loader output before the
            first step (``stacklm.datamodule.gate``): sft/preference modes on this rank's first
            batches, drawn from fresh pipeline graphs before the train loader exists; shards and
            stream modes on the first batches the train loader hands out. An error finding
            (a turn closer or stop token never trained, loss outside the policy's turns,
            attention across conversations, positions not reset, ids out of range, a reply cut at
            the row end, ...) raises ``DataGateError`` naming it, where it was seen and the fix,
            before any step. ``False`` (``data.gate: false``) turns it off.
        skip_steps: shards mode: ranges ``[(a, b), ...]`` of global steps (``a..b`` inclusive)
            whose data the run passes over, the way a large run steps around a loss spike: resume
            from a checkpoint at or before step ``a`` with ``skip_steps=[(a, b)]`` and step ``a``
            trains what step ``b + 1`` would have, step ``k >= a`` what step ``k + b - a + 1``
            would have. Resolved to stream positions at the first train loader (at the rows per
            step of the run that wrote the checkpoint), kept in the checkpoint and the step log,
            so it is exact on resume and on another world size; ``stacklm inspect RUN --step S``
            lists a skipped step's rows as skipped.
        shard_window: shards mode: read the train split shard-locally: each epoch puts the
            shards in a seeded random order, cuts it into windows of ``shard_window`` shards and
            shuffles the rows within each window (``dataset.window_permutation``), instead of one
            permutation of all rows. With a remote ``data_dir`` the train split is then streamed
            into a bounded local cache ahead of the reader instead of mirrored whole
            (``stacklm.data.storage.prefetch``; docs/prebuild.md, "Streaming into a bounded
            cache"). It changes the order, so it is part of the data identity a resume checks.
            ``None`` (default): the global permutation.
        cache_max_bytes: the local cache limit for a remote ``data_dir`` (default the
            ``STACKLM_CACHE_MAX_BYTES`` environment variable; none: unbounded).
        planes: shards/stream modes: the loader's batch layout (``stacklm.data.contract``): ``"lean"`` (default;
            the four planes derived on the device, ``transfer``) or ``"full"`` (always so in sft/preference).
    """

    def __init__(
        self,
        mode: Literal["shards", "stream", "sft", "preference"] = "shards",
        tokenizer: str | None = None,
        data_dir: str | None = None,
        pipeline: PipelineSpec | None = None,
        seq_len: int = 2048,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
        val_batches: int | None = None,
        train_batches: int | None = None,
        snapshot_every_n_steps: int | None = None,
        logical_streams: int | None = None,
        step_log: bool | str = True,
        verify_shards: bool = True,
        gate: bool = True,
        skip_steps: list[tuple[int, int]] | None = None,
        shard_window: int | None = None,
        cache_max_bytes: int | None = None,
        planes: Literal["lean", "full"] = "lean",
    ) -> None:
        super().__init__()
        # parsed once: the one schema of ``data:`` (also the prebuild's), the pipeline as its mode's config
        config = DataConfig.parse(locals())
        if tokenizer is None:
            raise DataConfigError("StackDataModule: pass tokenizer=<path to the tokenizer artifact directory>")
        MODE_CLASSES[mode].check_arguments(config)
        if pipeline:
            pipeline = dict(pipeline)  # the hyperparameters keep it as written, a plain dict
        self.save_hyperparameters()
        self.config = config  # the typed, frozen arguments (``section.DataConfig``); its mode gets it too
        self.tokenizer_path = config.tokenizer
        from stacklm.data.storage import remote

        # A remote data_dir (s3://..., any fsspec URL) is read from its local mirror: manifests
        # read, shards downloaded and hash-checked once per node (``remote.mirror``), then the
        # same memmap path as a local directory. The URL stays in ``data_url`` for messages.
        self.data_url = config.data_dir if remote.is_remote(config.data_dir) else None
        # With ``shard_window`` a remote train split is not mirrored whole but streamed into a
        # bounded cache ahead of the reader (``prefetch``); the other splits are mirrored.
        self.cache_limit = config.cache_max_bytes if config.cache_max_bytes is not None else remote._max_bytes()
        self._stream = bool(self.data_url and config.shard_window and mode == "shards")
        self.data_dir = (str(remote.mirror(self.data_url, stream=("train",) if self._stream else (), limit=self.cache_limit))
                         if self.data_url else config.data_dir)
        self._shard_cache = None
        self._step_log_writer = None  # this fit's (``train_dataloader``); closed at teardown
        self._gate = None  # this fit's data gate: True once an sft sample passed, an InFlightGate in pre-training
        self._tok = None
        self._train_loader = None
        self._val_loader = None  # the last val_dataloader(): per-source validation loss reads its batches' rows
        self._identity: dict[str, Any] | None = None  # computed at the first checkpoint
        # Online re-weighting (set_mix_weights): [{"step", "batch" or None, "weights"}], in the checkpoint.
        self.mix_changes: list[dict[str, Any]] = []
        self.rank, self.world_size = 0, 1  # this process's; from the trainer at setup
        self._mode = MODE_CLASSES[mode](ModeArgs(config, data_dir=self.data_dir, data_url=self.data_url,
                                                 shard_cache=self.shard_cache()))
        self._reload = EpochReload()  # asks Lightning to rebuild a train loader whose resumed epoch is short

    def __getattr__(self, name: str) -> Any:
        """An argument read back (``dm.seq_len``, ``dm.gate``, ``dm.mode``): ``config``'s field."""
        config = self.__dict__.get("config")
        if config is None or name not in _ARGUMENTS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(config, name)

    # ------------------------------------------------------------------ shared facts
    @property
    def tokenizer(self):
        if self._tok is None:
            from stacklm.tokenizer.bpe import StackTokenizer

            self._tok = StackTokenizer.load(self.tokenizer_path)
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def tokenizer_hash(self) -> str:
        """Content hash of the tokenizer (ids, not training metadata): the one manifests carry."""
        from stacklm.data.storage.manifest import tokenizer_hash

        return tokenizer_hash(self.tokenizer)

    def pipeline_config(self) -> PipelineConfig | None:
        """The pipeline, parsed once (``self.config.pipeline``): an ``SFTConfig`` in sft and preference modes."""
        return self.config.pipeline

    def sft_config(self) -> SFTConfig:
        return self.config.pipeline

    def data_config_hash(self) -> str:
        return self._mode.data_config_hash()

    # ------------------------------------------------------------------ lightning hooks
    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        moved = to_device(batch, device)  # pinned, one non-blocking copy per buffer (``transfer``); CPU: the default
        return super().transfer_batch_to_device(batch, device, dataloader_idx) if moved is None else moved

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return after_transfer(batch)  # lean planes -> the four, on the device

    def setup(self, stage: str | None = None) -> None:
        trainer = getattr(self, "trainer", None)
        _quiet_len_warning()
        if trainer is not None:
            from stacklm.datamodule.resume.checkpoint_file import use_whole_checkpoints

            self.rank, self.world_size = trainer.global_rank, trainer.world_size
            use_whole_checkpoints(trainer)  # a full disk leaves no half checkpoint under a checkpoint's name

    def snapshot_interval(self) -> int:
        """Steps between worker state snapshots (see ``snapshot_every_n_steps``)."""
        if self.config.snapshot_every_n_steps is not None:
            return int(self.config.snapshot_every_n_steps)
        trainer = getattr(self, "trainer", None)
        steps = [getattr(cb, "_every_n_train_steps", 0) or 0 for cb in (trainer.checkpoint_callbacks if trainer else [])]
        steps = [n for n in steps if n > 0]
        return min(steps) if steps else DEFAULT_SNAPSHOT_STEPS

    def _run(self, *, mix_changes: bool = False) -> Run:
        """The fit the mode serves now (``modes.Run``): the trainer's rank, step and epoch; with
        ``mix_changes``, the re-weightings resolved to batch indices (which fixes them: only
        when a train loader takes them)."""
        trainer = getattr(self, "trainer", None)
        changes = tuple(self.resolved_mix_changes()) if mix_changes else ()
        if trainer is None:
            return Run(tokenizer=self.tokenizer, rank=self.rank, world_size=self.world_size,
                       snapshot_interval=self.snapshot_interval(), mix_changes=changes)
        return Run(tokenizer=self.tokenizer, rank=self.rank, world_size=self.world_size,
                   current_epoch=lambda: trainer.current_epoch, step=int(trainer.global_step),
                   accumulate=int(trainer.accumulate_grad_batches), snapshot_interval=self.snapshot_interval(),
                   last_step=int(trainer.max_steps) - 1 if int(trainer.max_steps or -1) > 0 else None,
                   mix_changes=changes)

    def train_dataloader(self):
        gate = self._data_gate()
        run = self._run(mix_changes=self.mode == "stream")
        self._train_loader = self._mode.train_loader(run, self._train_loader)
        lengths = self._mode.epoch_lengths(self._train_loader)
        if lengths is not None:
            self._reload.after_build(getattr(self, "trainer", None), *lengths)
        writer = self._step_log()
        if writer is not None:
            self._train_loader.step_log = writer
            if self.mode == "shards" and self.rank == 0 and not getattr(writer, "skips_logged", False):
                writer.skips_logged = True  # this generation's record of the skipped steps, once
                start = int(self.trainer.global_step) if getattr(self, "trainer", None) is not None else 0
                for step, epoch, rows in self._mode.skipped_steps(run):
                    if step >= start:
                        writer.add_skipped(step, epoch, rows)
        if gate is not None and gate.checked < gate.n_batches:
            self._train_loader.gate = gate
        return self._train_loader

    def _data_gate(self):
        """Under a trainer's fit with ``gate`` on: in sft/preference modes, check a fresh sample
        now (raises ``DataGateError``); in pre-training modes, the ``InFlightGate`` the train
        loader runs on its first batches. Once per fit (a loader rebuilt per epoch is not
        re-gated)."""
        if not self.config.gate or getattr(self, "trainer", None) is None:
            return None
        from stacklm.datamodule import gate as data_gate

        if self._gate is None:
            if self.mode in ("sft", "preference"):
                found = data_gate.check_batches(data_gate.sample_sft(self), data_gate.inspect_tokenizer(self),
                                                data_gate.GateRules.of(self))
                data_gate.judge(found, f"the first {self.mode} training batches")
                self._gate = True
            else:
                self._gate = data_gate.InFlightGate(self)
        return self._gate if isinstance(self._gate, data_gate.InFlightGate) else None

    def _step_log(self):
        """This fit's ``StepLogWriter`` (one generation per fit; ``steplog``), ``None`` when off
        (``step_log=False``, or no trainer and no path). Every mode writes one: shards mode the
        global rows, the others each row's pieces (sft: the conversations packed in it;
        preference: its pair) as their batches carry them."""
        step_log = self.config.step_log
        if self._step_log_writer is not None or step_log is False:
            return self._step_log_writer
        trainer = getattr(self, "trainer", None)
        if step_log is True and trainer is None:
            return None
        from stacklm.data.storage.steplog import DIR_NAME, StepLogWriter, new_generation

        root = Path(trainer.default_root_dir) / DIR_NAME if step_log is True else Path(str(step_log))
        generation = new_generation()  # a collective under DDP: train_dataloader runs on every rank
        meta = self._step_log_meta(generation) if self.rank == 0 else None
        step_of = (lambda: trainer.global_step) if trainer is not None else None
        self._step_log_writer = StepLogWriter(root / generation, self.rank, meta=meta, step_of=step_of)
        return self._step_log_writer

    def _step_log_meta(self, generation: str) -> dict[str, Any]:
        """What ``stacklm inspect --step`` needs to answer from this generation: the mode, the
        shape, and the data and tokenizer it read (absolute paths, the working directory for a
        pipeline's relative globs)."""
        import os

        trainer = getattr(self, "trainer", None)
        meta: dict[str, Any] = {
            "generation": generation, "mode": self.mode, "world_size": self.world_size, "num_workers": self.num_workers,
            "batch_size": self.batch_size, "seq_len": self.seq_len, "seed": self.seed,
            "accumulate_grad_batches": int(trainer.accumulate_grad_batches) if trainer is not None else 1,
            "start_step": int(trainer.global_step) if trainer is not None else 0,
            "tokenizer": str(Path(self.tokenizer_path).resolve()), "tokenizer_hash": self.tokenizer_hash(),
        }
        if self.mode == "shards":
            meta["skip_steps"] = [dict(r) for r in self._mode.skips]
            meta["shards"] = {"data_dir": str(Path(self.data_dir).resolve()), "split": "train",
                              "manifest_hash": self.hashes["manifest"]}
        else:
            meta["stream"] = {"pipeline": self.pipeline_config().to_dict(), "cwd": os.getcwd(), "split": "train"}
        return meta

    def teardown(self, stage: str) -> None:
        if stage == "fit":
            self._gate = None  # the next fit is gated afresh
        if stage == "fit" and self._step_log_writer is not None:
            self._step_log_writer.close()
            self._step_log_writer = None

    def val_dataloader(self):
        if self.config.val_batches == 0:
            return []
        self._val_loader = self._mode.val_loader(self._run())
        return self._val_loader

    def batch_sources(self, split: str = "train") -> tuple[list[str], np.ndarray] | None:
        """The sources of the batch the ``split`` loader ("train" or "val") handed out last:
        ``(names, positions)``, ``positions`` an int16 ``(B, seq_len)`` array of each window
        position's source index into ``names`` (-1: padding, or not known). The batch's
        ``targets[:, t]`` is window position ``t + 1``. From the rows' provenance: stream mode's
        per-row document pieces, shards mode's global rows looked up in the prebuild's side
        files, SFT's packed conversations. ``None`` when there is none (preference batches: a
        row is a pair, not one window of targets; a prebuild without provenance; no batch yet). Read in the main process between the loader handing a batch
        out and the next one: Lightning does not fetch ahead of a loader with a length, so in a
        batch hook it is that batch's (``stacklm.source_loss``)."""
        loader = self._train_loader if split == "train" else getattr(self, "_val_loader", None)
        if loader is None or self.mode == "preference":
            return None
        from stacklm.data.storage import provenance

        last = getattr(loader, "last_rows", None)
        if last is not None:  # shards mode
            spans = self._mode.row_sources(split)
            return None if spans is None else (spans.names, spans.positions(last[0], last[1]))
        last = getattr(loader, "last_pieces", None)
        names = list(getattr(loader.dataset, "sources", None) or ())
        if last is None or last[0] is None or not names:
            return None
        pieces, n_rows = last
        return names, provenance.pieces_positions(pieces, self.seq_len, n_rows - len(pieces))

    def shards_dataset(self, split: str):
        """The prebuilt ``split`` (shards mode's ``ShardsMode.dataset``)."""
        from stacklm.datamodule.modes import shards_dataset

        return shards_dataset(self._mode.args, split, self.tokenizer)

    def shard_cache(self):
        """The train split's streamed cache (``prefetch.ShardCache``), or None when it is read
        from a whole local copy. Its limit is what ``cache_max_bytes`` leaves after the
        mirrored rest of the set (the val split, manifests, side files)."""
        if not self._stream:
            return None
        if self._shard_cache is None:
            from stacklm.data.storage import remote
            from stacklm.data.storage.manifest import read_manifest
            from stacklm.data.storage.prefetch import ShardCache

            top = read_manifest(self.data_dir)
            rel = None if "shards" in top else top["splits"]["train"]["path"]  # data_dir may be the split itself
            local = Path(self.data_dir) / rel if rel else Path(self.data_dir)
            limit = self.cache_limit
            cache = ShardCache(remote.join(self.data_url, rel) if rel else self.data_url, local, read_manifest(local), limit)
            if limit is not None:  # what the mirrored rest takes (all but the streamed token files)
                cache.rest_bytes = remote._du(Path(self.data_dir)) - cache.used_bytes()
                cache.limit = limit - cache.rest_bytes
            self._shard_cache = cache
        return self._shard_cache

    def mix_phase(self) -> str | None:
        """The mixture phase (of a ``schedule:``, or a re-weighting) the training step is in:
        where the tokens delivered to training on this rank fall among the phases' planned
        token ranges, summed over this rank's readers (from their latest summaries). Not the
        phase the readers are drawing in: they run ahead of the step by the prefetch and the
        shuffle and packing buffers. ``None`` without a schedule (one phase) or before any
        summary. Near a boundary a step holds documents of both phases (the shuffle buffer
        mixes them), and delivered tokens count ``<bos>``/``<eos>``, planned ones do not."""
        loader = self._train_loader
        summaries = list(getattr(loader, "worker_summaries", {}).values())
        reports = [s["mix_phases"] for s in summaries if s.get("mix_phases")]
        if not reports or len(reports[0]) < 2:
            return None
        from stacklm.data.mix.schedule import merge_phase_reports

        phases = merge_phase_reports(reports)
        delivered = int(np.sum(loader.delivered.tokens))
        end = 0
        for phase in phases:
            end += sum(phase["planned_tokens"].values())
            if delivered < end:
                return str(phase["name"])
        return str(phases[-1]["name"])

    # ------------------------------------------------------------------ online re-weighting
    def set_mix_weights(self, weights: Mapping[str, float], at_step: int | None = None) -> None:
        """From optimizer step ``at_step`` (default: the next one) on, mix the rest of the token
        budget by ``weights`` (one number >= 0 per source of the mix, not all 0; normalised).

        For DoReMi/ODM-style methods: call it from a callback (e.g. ``on_train_batch_end``),
        on every rank with the same arguments (checked under DDP). Every (rank, worker) reader
        re-weights its own remaining budget before the first batch it deals at that step, so the
        change takes effect at the same step boundary everywhere; documents already in the
        shuffle and packing buffers were drawn before it. Loader workers run ahead of the step by
        the prefetch, so registering a change rebuilds them from the loader state at the current
        batch (exact, like a resume; it replays fewer than ``snapshot_every_n_steps`` batches, so set
        that to the re-weighting interval when re-weighting often). The changes are stored in
        the checkpoint (``state_dict``) and replay exactly on resume. Stream mode, first epoch.
        With gradient accumulation, call it at an optimizer-step boundary (``on_train_batch_end``
        after the step): the batch index is counted from the batches handed out so far.
        """
        if self.mode != "stream":
            raise DataConfigError(f"StackDataModule.set_mix_weights: only stream mode mixes on the fly, this module is in {self.mode!r} mode")
        names = [e.name for e in self.pipeline_config().mix.entries]
        if set(weights) != set(names) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf") for v in weights.values()
        ) or sum(weights.values()) <= 0:
            raise DataConfigError(
                f"StackDataModule.set_mix_weights: weights must give a number >= 0 for exactly the sources {names} "
                f"(not all 0), got {dict(weights)}"
            )
        trainer = getattr(self, "trainer", None)
        now = int(trainer.global_step) if trainer is not None else 0
        step = now if at_step is None else int(at_step)
        if step < now:
            raise DataConfigError(f"StackDataModule.set_mix_weights: at_step={step} is before the current step {now}; give a step >= {now}")
        if trainer is not None and trainer.current_epoch > 0:
            raise DataConfigError("StackDataModule.set_mix_weights: a stream is one pass; re-weighting after the first epoch is not supported")
        change = {"step": step, "batch": None, "weights": {n: float(weights[n]) for n in names}}
        _check_same_on_ranks(change)
        loader = self._train_loader
        if loader is not None and trainer is not None:
            change["batch"] = loader.batches_yielded + (step - now) * int(trainer.accumulate_grad_batches)
        self.mix_changes.append(change)
        if loader is not None:
            loader.dataset.mix_changes = self.resolved_mix_changes()
            loader.restart_from_state()

    def resolved_mix_changes(self) -> list[dict[str, Any]]:
        """The changes with their per-rank loader batch index (a change registered before the
        loader existed starts at ``step x accumulate_grad_batches``), sorted by it."""
        trainer = getattr(self, "trainer", None)
        accumulate = int(trainer.accumulate_grad_batches) if trainer is not None else 1
        for c in self.mix_changes:
            if c["batch"] is None:
                c["batch"] = int(c["step"]) * accumulate
        return sorted((dict(c) for c in self.mix_changes), key=lambda c: c["batch"])

    # ------------------------------------------------------------------ logging protocol
    def data_stats(self) -> dict[str, Any]:
        """This rank's cumulative data numbers for ``stacklm.callbacks.DataStatsCallback``."""
        out: dict[str, Any] = {"hashes": dict(self.hashes)}
        if self._train_loader is not None:
            out.update(self._mode.loader_stats(self._train_loader))
        return out

    @functools.cached_property
    def hashes(self) -> dict[str, str | None]:
        """Tokenizer, manifest and data-config hashes: fixed for the module's life, so computed
        once (logging asks for them every few steps, checkpoints at every save)."""
        manifest = None
        if self.data_dir is not None and (Path(self.data_dir) / "manifest.json").exists():
            manifest = hashlib.sha256((Path(self.data_dir) / "manifest.json").read_bytes()).hexdigest()
        return {"tokenizer": self.tokenizer_hash(), "manifest": manifest, "data_config": self.data_config_hash()}

    # ------------------------------------------------------------------ checkpoint guard
    def shape(self) -> dict[str, int]:
        """How this run reads the data: world size, loader workers, batch size."""
        return {"world_size": self.world_size, "num_workers": self.num_workers, "batch_size": self.batch_size}

    def state_dict(self) -> dict[str, Any]:
        """Stored in the checkpoint, in its mode's shape (``resume.state``): what the data is
        (``identity``, content hashes: the fingerprint), the shape that read it, the mode's
        position (``modes``, e.g. shards mode's shape-free ``ShardsLoader`` position) and the
        online re-weightings (``set_mix_weights``)."""
        if self._step_log_writer is not None:  # a checkpoint: what trained up to it is on disk too
            self._step_log_writer.flush()
        state: dict[str, Any] = {"mode": self.mode, "identity": dict(self._data_identity()), "shape": self.shape(),
                                 "seq_len": self.seq_len}
        state.update(self._mode.state(self._train_loader, self._run()))
        state["mix_changes"] = [dict(c, weights=dict(c["weights"])) for c in self.mix_changes]
        return state

    def _data_identity(self) -> dict[str, Any]:
        """Computed once, at the first checkpoint or resume (``resume.identity``)."""
        from stacklm.datamodule.resume.identity import data_identity

        if self._identity is None:
            self._identity = data_identity(self)
        return self._identity

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse, before the first step, a checkpoint this run cannot resume
        (``resume.state.check_state``: other data, another seq_len, an older state, or in sft
        mode another shape); else hand the mode its part for the next train loader."""
        from stacklm.datamodule.resume.state import check_state

        saved = check_state(state, mode=self.mode, identity=self._data_identity(), seq_len=self.seq_len, shape=self.shape())
        self._mode.restore(saved)
        if self.mode == "shards":
            return
        # the re-weightings made before the checkpoint replay at the same batches (epoch-relative per-rank batch indices)
        self.mix_changes = [dict(c, weights=dict(c["weights"])) for c in saved["mix_changes"]]
        if self._train_loader is not None:
            self._train_loader.dataset.mix_changes = self.resolved_mix_changes()


def _quiet_len_warning() -> None:
    """Lightning warns on every fit whose loader's dataset is an ``IterableDataset`` with a
    ``__len__`` that it "could be inaccurate ... duplicate data" with several workers. Ours is
    not: a stream's or an elastic loader's dataset hands each (rank, worker) its own disjoint
    share of a batch plan made before the workers start, and ``__len__`` is that plan's length
    (tests/datamodule/test_stream_fit.py and test_elastic*.py count every delivered batch against it).
    Dropping ``__len__`` would cost the progress bar, ``val_check_interval`` and the schedule
    their epoch length, so the one false sentence is ignored by its exact text instead."""
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined", category=UserWarning)


def _check_same_on_ranks(change: dict[str, Any]) -> None:
    """Under DDP every rank must register the same change at the same step (each rank's
    readers re-weight their own share), else the ranks' mixes drift apart silently."""
    from stacklm.dist import rank_world

    _, world = rank_world()
    if world == 1:
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, (change["step"], sorted(change["weights"].items())))
    if any(s != seen[0] for s in seen):
        raise DataConfigError(
            f"StackDataModule.set_mix_weights: the ranks registered different changes {seen}; call it on every rank "
            "with the same weights and at_step (e.g. broadcast them from rank 0 first)"
        )
