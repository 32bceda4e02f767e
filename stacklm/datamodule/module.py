"""``StackDataModule``: what users hand to ``trainer.fit``.

Modes, one batch contract (``input_ids``, ``position_ids``, ``seq_ids``, ``targets``):
- ``shards``: a prebuilt directory (``stacklm prebuild``) read through memmaps, in one global
  seeded permutation per epoch (seeded by seed x epoch) sliced by rank and worker; the
  position is shape-free (epoch, rows served, steps) in this module's checkpoint state, so
  resume is O(1) and elastic (docs/trainer.md, "Resume").
- ``stream``: the on-the-fly node graph (``stacklm.data.nodes``) straight from the sources,
  as ``logical_streams`` logical streams (each its own graph over its shard of the documents)
  dealt to (rank, worker) at run time, so resume is elastic too (``logical``).
- ``sft``: chat conversations rendered and packed by ``stacklm.data.sft``.
- ``preference``: chosen/rejected pairs (``stacklm.data.sft.preference``) on the SFT config;
  batches of ``chosen_*``/``rejected_*`` tensors and ``pair_ids``.
Each mode is one class in ``modes`` (its loaders, logging numbers and config hash), chosen
once from ``mode``; the module keeps what they share.

Loaders are ``torchdata``'s ``StatefulDataLoader`` (or a thin elastic wrapper in shards
mode): Lightning stores their ``state_dict()`` in the checkpoint and restores it, so a resumed
fit sees exactly the batches the uninterrupted run would have.

DDP: every rank must yield the same number of batches or the last collective hangs. Shards
mode slices the permutation into equal per-rank parts; stream/sft modes give each (rank,
worker) an equal token budget and a fixed batch count (``batches_per_worker``), padding a
stream that runs dry with fully masked batches (counted and warned, never silent).
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np

from stacklm.data.nodes import PipelineConfig
from stacklm.datamodule.errors import DataConfigError
from stacklm.datamodule.modes import MODE_CLASSES
from stacklm.datamodule.section import DataSection, check_pipeline
from stacklm.config import PIPELINE_PATH
from stacklm.once import first_time

DEFAULT_SNAPSHOT_STEPS = 1000  # without a step checkpoint interval to follow; see StackDataModule


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

    Args:
        mode: ``"shards"``, ``"stream"``, ``"sft"`` or ``"preference"``.
        tokenizer: path of the tokenizer artifact (dir or ``tokenizer.stacklm.json``).
        data_dir: prebuilt shard directory (``shards`` mode), local or a remote URL (``s3://bucket/prefix``,
            any fsspec protocol), mirrored into a local cache first (docs/prebuild.md, "Object storage").
        pipeline: the stream pipeline config as a dict (``stream`` mode; see ``PipelineConfig``),
            or the SFT config (``sft`` mode; see ``SFTConfig``); parsed on construction, so an
            unknown key or a wrong type is an error naming ``data.pipeline.<key>``.
        seq_len, batch_size, num_workers, seed: as usual; ``seq_len`` counts the window before
            the next-token shift (batches are ``seq_len - 1`` wide).
        val_batches: validation batches per rank (stream/sft); ``None`` = from the holdout budget
            (stream) or a counting pass (sft); ``0`` disables validation.
        train_batches: sft mode: training batches per rank per epoch; ``None`` = a counting pass.
        snapshot_every_n_steps: how often loader workers send their state to the main process.
            A snapshot copies the shuffle buffer and the dedup indexes (~190 MB per million
            documents), and ``StatefulDataLoader`` takes ``3 x num_workers + 1`` of them (prefetch 2)
            around each multiple of this interval, so it must be rare. A resume replays at most
            this many batches from the last snapshot, deterministically (still exact).
            ``None`` (default): the trainer's step checkpoint interval
            (``ModelCheckpoint(every_n_train_steps=N)``), so a resume replays nothing; else
            ``DEFAULT_SNAPSHOT_STEPS``.
        logical_streams: stream mode: the number of logical streams the data is read as, fixed
            for the run and recorded in the checkpoint (``stacklm.datamodule.logical``); they are
            dealt to (rank x worker) at run time, so a resume may change world size, workers and
            batch size. ``None``: the first run's ranks x workers. Pick a number many shapes
            divide (e.g. 8 or 16): a reader with no logical stream of its own trains on padding.
        step_log: shards and stream modes: log which rows each global step trains on, so
            ``stacklm inspect RUN --step S`` can say which documents were in step ``S``
            (``stacklm.datamodule.steplog``; a fraction of a percent of the token bytes).
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
    ) -> None:
        super().__init__()
        # the one schema of ``data:`` (also the prebuild's): keys, types, mode and ranges
        DataSection.parse(
            mode=mode, tokenizer=tokenizer, data_dir=data_dir, pipeline=pipeline,
            seq_len=seq_len, batch_size=batch_size, num_workers=num_workers, seed=seed, val_batches=val_batches,
            train_batches=train_batches, snapshot_every_n_steps=snapshot_every_n_steps, logical_streams=logical_streams,
            step_log=step_log, verify_shards=verify_shards, gate=gate, skip_steps=skip_steps,
        )
        if tokenizer is None:
            raise DataConfigError("StackDataModule: pass tokenizer=<path to the tokenizer artifact directory>")
        MODE_CLASSES[mode].check_arguments(data_dir=data_dir, pipeline=pipeline)
        if pipeline:
            pipeline = dict(pipeline)
        self.save_hyperparameters()
        self.mode = mode
        self.tokenizer_path = tokenizer
        from stacklm.data.storage import remote

        # A remote data_dir (s3://..., any fsspec URL) is read from its local mirror: manifests
        # read, shards downloaded and hash-checked once per node (``remote.mirror``), then the
        # same memmap path as a local directory. The URL stays in ``data_url`` for messages.
        self.data_url = data_dir if remote.is_remote(data_dir) else None
        self.data_dir = str(remote.mirror(data_dir)) if self.data_url else data_dir
        self.pipeline_dict = dict(pipeline or {})
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.val_batches = val_batches
        self.train_batches = train_batches
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.logical_streams = None if logical_streams is None else int(logical_streams)
        self._logical_streams_arg = self.logical_streams
        self.step_log = step_log
        self.verify_shards = verify_shards
        self._step_log_writer = None  # this fit's (``train_dataloader``); closed at teardown
        self.gate = bool(gate)
        self.skip_steps = _check_skip_steps(skip_steps, mode)
        self._gate = None  # this fit's data gate: True once an sft sample passed, an InFlightGate in pre-training
        self._tok = None
        self._train_loader = None
        self._val_loader = None  # the last val_dataloader(): per-source validation loss reads its batches' rows
        self._identity: dict[str, Any] | None = None  # computed at the first checkpoint
        # Online re-weighting (set_mix_weights): [{"step", "batch" or None, "weights"}], in the checkpoint.
        self.mix_changes: list[dict[str, Any]] = []
        self.rank, self.world_size = 0, 1  # this process's; from the trainer at setup
        self._mode = MODE_CLASSES[mode](self)

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

    def pipeline_config(self) -> PipelineConfig:
        d = dict(self.pipeline_dict)
        d.setdefault("seq_len", self.seq_len)
        d.setdefault("batch_size", self.batch_size)
        d.setdefault("seed", self.seed)
        cfg = PipelineConfig.from_dict(d, path=PIPELINE_PATH)
        if cfg.seq_len != self.seq_len or cfg.batch_size != self.batch_size:
            raise DataConfigError(
                f"StackDataModule: pipeline seq_len/batch_size ({cfg.seq_len}/{cfg.batch_size}) differ from the module's "
                f"({self.seq_len}/{self.batch_size}); set them in one place"
            )
        return cfg

    def data_config_hash(self) -> str:
        return self._mode.data_config_hash()

    # ------------------------------------------------------------------ lightning hooks
    def setup(self, stage: str | None = None) -> None:
        trainer = getattr(self, "trainer", None)
        _quiet_len_warning()
        if trainer is not None:
            self.rank, self.world_size = trainer.global_rank, trainer.world_size

    def snapshot_interval(self) -> int:
        """Steps between worker state snapshots (see ``snapshot_every_n_steps``)."""
        if self.snapshot_every_n_steps is not None:
            return int(self.snapshot_every_n_steps)
        trainer = getattr(self, "trainer", None)
        steps = [getattr(cb, "_every_n_train_steps", 0) or 0 for cb in (trainer.checkpoint_callbacks if trainer else [])]
        steps = [n for n in steps if n > 0]
        return min(steps) if steps else DEFAULT_SNAPSHOT_STEPS

    def train_dataloader(self):
        gate = self._data_gate()
        self._train_loader = self._mode.train_loader()
        writer = self._step_log()
        if writer is not None:
            self._train_loader.step_log = writer
            if self.mode == "shards" and self.rank == 0 and not getattr(writer, "skips_logged", False):
                writer.skips_logged = True  # this generation's record of the skipped steps, once
                start = int(self.trainer.global_step) if getattr(self, "trainer", None) is not None else 0
                for step, epoch, rows in self._mode.skipped_steps():
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
        if not self.gate or getattr(self, "trainer", None) is None:
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
        (``step_log=False``, sft/preference modes, or no trainer and no path)."""
        if self._step_log_writer is not None or self.step_log is False:
            return self._step_log_writer
        if self.mode not in ("shards", "stream"):
            if self.step_log is not True and first_time("step_log", self.mode):  # a path asked for one: say why there is none
                warnings.warn(f"stacklm: step_log={self.step_log!r} is ignored: {self.mode} mode writes no step log (shards "
                              "and stream modes do)", RuntimeWarning, stacklevel=2)
            return None
        trainer = getattr(self, "trainer", None)
        if self.step_log is True and trainer is None:
            return None
        from stacklm.datamodule.steplog import DIR_NAME, StepLogWriter, new_generation

        root = Path(trainer.default_root_dir) / DIR_NAME if self.step_log is True else Path(str(self.step_log))
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
        if self.val_batches == 0:
            return []
        self._val_loader = self._mode.val_loader()
        return self._val_loader

    def batch_sources(self, split: str = "train") -> tuple[list[str], np.ndarray] | None:
        """The sources of the batch the ``split`` loader ("train" or "val") handed out last:
        ``(names, positions)``, ``positions`` an int16 ``(B, seq_len)`` array of each window
        position's source index into ``names`` (-1: padding, or not known). The batch's
        ``targets[:, t]`` is window position ``t + 1``. From the rows' provenance: stream mode's
        per-row document pieces, shards mode's global rows looked up in the prebuild's side
        files. ``None`` when there is none (SFT and preference batches; a prebuild without
        provenance; no batch yet). Read in the main process between the loader handing a batch
        out and the next one: Lightning does not fetch ahead of a loader with a length, so in a
        batch hook it is that batch's (``stacklm.source_loss``)."""
        loader = self._train_loader if split == "train" else getattr(self, "_val_loader", None)
        if loader is None:
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
        from stacklm.data.storage.dataset import PackedMemmapDataset

        ds = PackedMemmapDataset(self.data_dir, split, tokenizer=self.tokenizer, verify_content=self.verify_shards)
        if ds.seq_len != self.seq_len:
            raise DataConfigError(
                f"StackDataModule: {ds.path} was built with seq_len {ds.seq_len} but the module has seq_len {self.seq_len}; "
                "use the same seq_len or rebuild the shards"
            )
        return ds

    def sft_config(self):
        from stacklm.data.sft import SFTConfig

        d = dict(self.pipeline_dict)
        d.setdefault("seq_len", self.seq_len)
        d.setdefault("batch_size", self.batch_size)
        d.setdefault("seed", self.seed)
        return SFTConfig.from_dict(d, path=PIPELINE_PATH)

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
        batch (exact, like a resume; it replays at most ``snapshot_every_n_steps`` batches, so set
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
        """Stored in the checkpoint: what the data is (``identity``, content hashes), the shape
        that read it, in shards mode the shape-free position (``ShardsLoader``), and the online
        re-weightings (``set_mix_weights``)."""
        from stacklm.datamodule.identity import data_identity

        if self._identity is None:
            self._identity = data_identity(self)
        if self._step_log_writer is not None:  # a checkpoint: what trained up to it is on disk too
            self._step_log_writer.flush()
        state: dict[str, Any] = {"mode": self.mode, "identity": dict(self._identity), "shape": self.shape(), "seq_len": self.seq_len}
        if self.mode == "shards":
            state["position"] = self._mode.position()
            state["skips"] = [{k: list(v) if isinstance(v, list) else v for k, v in r.items()} for r in self._mode.skips]
            trainer = getattr(self, "trainer", None)
            state["accumulate_grad_batches"] = int(trainer.accumulate_grad_batches) if trainer is not None else 1
            state["delivered"] = self._mode.delivered_state()
        elif self.mode == "stream":
            state["streams"] = self._mode.stream_state()
        state["mix_changes"] = [dict(c, weights=dict(c["weights"])) for c in self.mix_changes]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse, before the first step, a checkpoint of other data, or (sft mode) of another
        shape; in shards and stream modes, take its position for the next train loader."""
        from stacklm.datamodule.identity import check_identity

        if "identity" not in state:
            raise DataConfigError(
                "refusing to resume: the checkpoint's data state is from an older stacklm (no content identity); "
                "resume it with the stacklm version that wrote it, or start a new run"
            )
        mine = self.state_dict()
        check_identity(state["identity"], mine["identity"])
        if state.get("seq_len") != self.seq_len:
            raise DataConfigError(f"refusing to resume: the checkpoint has seq_len {state.get('seq_len')}, this run {self.seq_len}; use the same seq_len")
        if self.mode == "shards":
            self._mode.restored = state.get("position")
            self._mode.skips = [dict(r) for r in state.get("skips", [])]
            old = state.get("shape") or {}
            if old.get("world_size") and old.get("batch_size"):
                self._mode.restored_step_rows = int(old["world_size"]) * int(old["batch_size"]) * int(state.get("accumulate_grad_batches", 1))
            if state.get("delivered"):
                self._mode.restore_delivered(state["delivered"])
            return
        old, new = state["shape"], mine["shape"]
        if self.mode == "stream":
            self._restore_streams(state)
        elif old != new:
            changed = ", ".join(f"{k} {old.get(k)} -> {new[k]}" for k in new if old.get(k) != new[k])
            raise DataConfigError(
                f"refusing to resume: this {self.mode}-mode checkpoint was written with world_size={old.get('world_size')}, "
                f"num_workers={old.get('num_workers')}, batch_size={old.get('batch_size')} and this run has "
                f"world_size={new['world_size']}, num_workers={new['num_workers']}, batch_size={new['batch_size']} "
                f"({changed}). A {self.mode}-mode position belongs to each (rank, worker) stream and cannot be re-dealt yet: "
                "resume with the checkpoint's devices x nodes, num_workers and batch_size (or use shards mode, "
                "`stacklm prebuild`, which resumes on any shape)."
            )
        # the re-weightings made before the checkpoint replay at the same batches (epoch-relative per-rank batch indices)
        self.mix_changes = [dict(c, weights=dict(c["weights"])) for c in state.get("mix_changes", [])]
        if self._train_loader is not None:
            self._train_loader.dataset.mix_changes = self.resolved_mix_changes()

    def _restore_streams(self, state: dict[str, Any]) -> None:
        """Stream mode: take the checkpoint's logical streams (``logical_streams``, quota,
        position) for the next train loader, which deals them to this run's shape."""
        if "streams" not in state:
            raise DataConfigError(
                "refusing to resume: this stream-mode checkpoint was written by an older stacklm (per-worker stream "
                "positions, no logical streams); resume it with the stacklm version that wrote it, or start a new run"
            )
        rec = state["streams"]
        if rec is None:  # saved before the first train loader: nothing was read yet
            return
        saved = int(rec["logical_streams"])
        if self._logical_streams_arg is not None and self._logical_streams_arg != saved:
            raise DataConfigError(
                f"refusing to resume: the checkpoint reads the data as logical_streams={saved} but this run sets "
                f"logical_streams={self._logical_streams_arg}; the number of logical streams is fixed for a run. Drop the "
                f"argument (it is taken from the checkpoint) or set it to {saved}."
            )
        self.logical_streams = saved
        self._mode.restored = dict(rec)
        self._mode.quota = None


def _check_skip_steps(value: Any, mode: str) -> list[tuple[int, int]]:
    """``skip_steps`` as sorted, disjoint ``(a, b)`` ranges with ``0 <= a <= b``; shards mode only."""
    if not value:
        return []
    if mode != "shards":
        raise DataConfigError(f"field 'data.skip_steps': only shards mode can skip a step range (this module is in {mode!r} "
                              "mode); prebuild the data (`stacklm prebuild`) to skip steps")
    out = []
    for r in value:
        if not isinstance(r, (list, tuple)) or len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in r) \
                or not 0 <= r[0] <= r[1]:
            raise DataConfigError(f"field 'data.skip_steps': each range is [first_step, last_step] with 0 <= first <= last, got {r!r}")
        out.append((int(r[0]), int(r[1])))
    out.sort()
    for (a0, b0), (a1, b1) in zip(out, out[1:]):
        if a1 <= b0:
            raise DataConfigError(f"field 'data.skip_steps': ranges ({a0}, {b0}) and ({a1}, {b1}) overlap; merge them into one")
    return out


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
