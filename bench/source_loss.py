"""Cost of per-source loss (``stacklm.source_loss.SourceLossCallback``) as a fraction of step time.

    python3 bench/source_loss.py [--steps 40] [--reps 2] [--batch 8] [--seq-len 256] [--layers 2] [--d-model 128]

A real Lightning fit of ``GPTModule`` (``GPTConfig.tiny``-shaped: ``--layers`` blocks of width
``--d-model``, a ``--vocab``-id BPE trained here) on a stream-mode mix of two synthetic sources,
on the CPU, ``--steps`` optimizer steps per run:

* inside: the time spent in the callback's batch hook (``batch_sources``: each row's pieces to
  per-position sources, plus the per-source sums), timed directly around the hook, over the
  mean step time of the same run (the time between consecutive batch starts) and over the
  step's compute (batch start to batch end: forward, backward, update; no loader wait);
* A/B: mean step time with the callback and without, alternated ``--reps`` times (ABAB..., so
  drift on a shared machine hits both), the first 5 steps of each run not counted.

On a GPU the hook's sums run on the device and only the ``(B, seq_len)`` int16 source map
crosses the bus; the A/B there is what to trust.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import lightning as L  # noqa: E402

from stacklm.corpus import iter_default_corpus  # noqa: E402
from stacklm.source_loss import SourceLossCallback  # noqa: E402

SKIP = 5


class StepClock(L.Callback):
    """Time between consecutive batch starts (a whole step: fetch, forward, backward, update,
    hooks) and from a batch's start to its end (the step without the wait for the loader).
    Registered first, so its batch end is timed before the callback under test runs."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.compute: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.times.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.compute.append(time.perf_counter() - self.times[-1])

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])][SKIP:]


class TimedSourceLoss(SourceLossCallback):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.hook: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        t = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.hook.append(time.perf_counter() - t)


def run(args, tok_dir: str, with_callback: bool) -> tuple[float, float | None]:
    from stacklm.datamodule import StackDataModule
    from stacklm.train import GPTModule
    from stacklm.train.model import GPTConfig

    pipeline = {"mix": {"name": "bench", "total_tokens": 10**9, "entries": [
        {"name": "web", "kind": "synthetic", "weight": 0.7, "domain": "prose", "seed": 1, "num_docs": 200_000},
        {"name": "code", "kind": "synthetic", "weight": 0.3, "domain": "code", "seed": 2, "num_docs": 100_000}]},
        "shuffle_buffer": 64, "pack_buffer_docs": 64, "holdout_fraction": 0.0}
    dm = StackDataModule(mode="stream", tokenizer=tok_dir, pipeline=pipeline, seq_len=args.seq_len, batch_size=args.batch,
                         num_workers=1, val_batches=0, step_log=False, gate=False)
    cfg = GPTConfig.tiny(vocab_size=args.vocab + 16, seq_len=args.seq_len, n_layer=args.layers, d_model=args.d_model)
    module = GPTModule(cfg, {"warmup_steps": 1, "total_steps": args.steps})
    clock = StepClock()
    cbs: list = [clock]
    timed = TimedSourceLoss(log_every_n_steps=10) if with_callback else None
    if timed:
        cbs.append(timed)
    trainer = L.Trainer(accelerator="cpu", max_steps=args.steps, callbacks=cbs, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    return statistics.mean(clock.steps()), statistics.mean(clock.compute[SKIP:]), (statistics.mean(timed.hook[SKIP:]) if timed else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    from stacklm.tokenizer.training import train_from_iterable
    from stacklm.train.model import GPTConfig

    with tempfile.TemporaryDirectory() as tmp:
        tok = train_from_iterable(iter_default_corpus(300_000), args.vocab).tokenizer
        tok.save(Path(tmp) / "tokenizer.stacklm.json")
        params = GPTConfig.tiny(vocab_size=args.vocab + 16, seq_len=args.seq_len, n_layer=args.layers,
                                d_model=args.d_model).num_params()
        print(f"model {params / 1e6:.2f}M params ({args.layers} layers x {args.d_model}, vocab {args.vocab + 16}), "
              f"batch {args.batch} x {args.seq_len}, {args.steps} steps per run")
        on, off, inside, of_compute = [], [], [], []
        for _ in range(args.reps):
            step, compute, hook = run(args, tmp, True)
            on.append(step)
            inside.append(hook / step)
            of_compute.append(hook / compute)
            off.append(run(args, tmp, False)[0])
            print(f"  step with {on[-1] * 1e3:.1f} ms (hook {hook * 1e3:.2f} ms = {inside[-1]:.2%} of the step, "
                  f"{of_compute[-1]:.2%} of its compute {compute * 1e3:.1f} ms), without {off[-1] * 1e3:.1f} ms", flush=True)
        print(f"hook / step: {statistics.mean(inside):.2%}; hook / step compute (no loader wait): {statistics.mean(of_compute):.2%}; "
              f"A/B step time with / without: {statistics.mean(on) / statistics.mean(off):.3f}x")

if __name__ == "__main__":
    main()
