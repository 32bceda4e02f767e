"""GPU readiness: the attention kernels against the SDPA reference, and training tokens/s fed
from shards and from stream mode, in one run.

    python bench/gpu.py                              # CUDA: the Stack-100M model at seq_len 2048
    python bench/gpu.py --compile --json gpu.json    # also torch.compile the model; write the numbers
    python bench/gpu.py --device cpu --quick         # toy scale on CPU (what tests/train/test_gpu_bench.py runs)
    python bench/gpu.py --sync-check [--compile]     # CUDA only: part C, lean batches with no host sync

Part A — kernels. Real text (``stacklm.corpus``), tokenized by a BPE trained here (or
``--tokenizer``), is packed best-fit into ``seq_len`` windows; the windows holding the most
documents form the batch. One set of weights runs with ``attention='sdpa'`` (dense mask: the
reference), ``'flex'`` (the compiled FlexAttention kernel on CUDA, eager on CPU) and
``'flash_varlen'`` (CUDA, bf16 only, when ``flash_attn`` imports), in fp32 and under bf16
autocast. Per backend and precision: max |Δlogits| and |Δloss| against SDPA at the same
precision, and for bf16 against fp32 SDPA; the relative error of the full gradient (on the first
``--grad-rows`` rows); and the position contract: a document's logits where it is packed at
offset k of a row equal its logits alone at the start of a row (``doc Δ``).

Weights are drawn with ``--init-std`` 0.06 rather than the training init of 0.02: at 0.02 the
attention scores of a fresh model are nearly uniform, which would hide position and mask
errors. Two controls (SDPA, fp32) prove the checks can fail: the packed row without the
document mask, and each document's position_ids reversed. (A constant shift of one document's
positions would not do: RoPE scores depend on relative positions only.)

Verdicts: fp32 differences within ``--tol`` (1e-4 on CPU, 1e-3 on CUDA); a bf16 kernel is
within ``BF16_SLACK`` times SDPA's own bf16 error against fp32, plus ``--tol`` (its loss within
twice that logits bound: a mean of log-probabilities cannot move more); each control
moves the logits by more than 100 x ``--tol``. The exit status is 1 if any verdict fails.

Part C — no host sync (``--sync-check``, CUDA only, instead of A and B; without CUDA it exits 2
naming why). ``StackDataModule`` shards batches in the lean planes (``stacklm.data.contract``:
int32 ids, padded ``cu_seqlens``, host ``max_seqlen``) go through the module's own transfer
hooks (pinned, non-blocking, planes derived on the device) into training steps with the
varlen/flex mask built from ``cu_seqlens``; after ``--warmup`` steps, ``--steps`` more run under
``torch.cuda.set_sync_debug_mode("error")``, so any host sync raises with its stack. Prints
ms/step and tokens/s.

Part B — throughput. The demo mix (``stacklm/configs/demo.yaml``: offline synthetic sources, best-fit
packing, exact and near dedup), scaled to the steps measured, trains the model with AdamW
(``GPTModule``'s optimizer and schedule), bf16 autocast on CUDA, grad-clip 1.0, fed by
``StackDataModule`` as a user builds it (``setup`` + ``train_dataloader``):

* ``in-memory``: one batch repeated, no loader (the model's own speed, the ceiling);
* ``shards``: ``mode='shards'`` over a ``stacklm.prebuild`` of the mix into a temp dir (or
  ``--data-dir``), ``num_workers=N``;
* ``stream``: ``mode='stream'`` over the same mix on the fly, ``num_workers=N``.

Each step ends with ``loss.item()`` (a per-step loss log does the same), so step times are
device time. Reported after ``--warmup`` steps: step time, tokens/s over all positions and over
non-pad tokens, ``6·N`` model TFLOP/s, and the loader wait fraction: time blocked in
``next(loader)`` / wall time, the definition of ``loader/wait_fraction`` in
``DataStatsCallback``. ``first batch`` is the loader's start-up (workers, graph build).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from stacklm.configs import CONFIG_DIR
from stacklm.corpus import iter_default_corpus
from stacklm.data.packing.pack import collate, pack_best_fit
from stacklm.train.attention import BACKENDS, flash_attn_available, resolve_backend
from stacklm.train.model import GPT, GPTConfig, check_batch, lm_loss

BF16_SLACK = 2.0  # a bf16 kernel may be up to this many times as far from fp32 as bf16 SDPA is
CONTROL_FACTOR = 100.0  # a control must move the logits by this many times the fp32 tolerance

# Sizes: full on CUDA, toy with --quick. Every one can be overridden on the command line. Part A
# feeds every forward the same (rows, T) shape, so each compiled kernel is built once per
# precision and grad mode (each new shape is another compile of the 26-layer model).
FULL = {"seq_len": 2048, "kernel_rows": 8, "doc_checks": 4, "grad_rows": 8, "batch_size": 32, "warmup": 5, "steps": 40,
        "workers": [4], "vocab_size": 32768, "tokenizer_bytes": 8_000_000, "kernel_text_bytes": 6_000_000, "prebuild_workers": 8}
QUICK = {"seq_len": 128, "kernel_rows": 4, "doc_checks": 3, "grad_rows": 4, "batch_size": 4, "warmup": 2, "steps": 6,
         "workers": [1], "vocab_size": 512, "tokenizer_bytes": 300_000, "kernel_text_bytes": 300_000, "prebuild_workers": 1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="toy sizes (tiny model, seq_len 128): a smoke run on CPU")
    p.add_argument("--tokenizer", help="tokenizer artifact (dir or .stacklm.json); default: train one here on the embedded corpus")
    p.add_argument("--data-dir", help="prebuilt shard dir for part B (default: prebuild the demo mix into a temp dir)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--kernel-rows", type=int, help="part A: rows in the packed batch")
    p.add_argument("--doc-checks", type=int, help="part A: documents checked packed vs alone")
    p.add_argument("--grad-rows", type=int, help="part A: rows back-propagated for the gradient check (default: all; fewer saves memory on small GPUs, at one more compile)")
    p.add_argument("--init-std", type=float, default=0.06, help="part A: weight init std (see the module docstring)")
    p.add_argument("--tol", type=float, help="fp32 tolerance on |Δlogits|, |Δloss| and the relative gradient error")
    p.add_argument("--batch-size", type=int, help="part B: rows per step")
    p.add_argument("--warmup", type=int, help="part B: steps before the clock starts (compile, allocator, workers)")
    p.add_argument("--steps", type=int, help="part B: measured steps")
    p.add_argument("--workers", type=int, nargs="+", help="part B: loader worker counts to run (each mode once per count)")
    p.add_argument("--train-attention", default="auto", choices=BACKENDS, help="part B: attention backend (auto: flash_varlen > flex on CUDA, sdpa on CPU)")
    p.add_argument("--precision", choices=("bf16-mixed", "32-true"), help="part B (default: bf16-mixed on CUDA, 32-true on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (part B; part A adds a row: flex in a compiled model)")
    p.add_argument("--vocab-size", type=int, help="vocab of the tokenizer trained here")
    p.add_argument("--tokenizer-bytes", type=int, help="text the tokenizer is trained on")
    p.add_argument("--kernel-text-bytes", type=int, help="text packed for part A")
    p.add_argument("--prebuild-workers", type=int)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--sync-check", action="store_true",
                   help="part C only: training steps on lean loader batches under torch.cuda.set_sync_debug_mode('error'); CUDA only")
    p.add_argument("--json", help="also write every number here")
    args = p.parse_args(argv)
    if args.data_dir and not args.tokenizer:
        p.error("--data-dir needs --tokenizer: the tokenizer the shards were built with")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here; run on a GPU machine or pass --device cpu --quick")
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.prebuild_workers = max(1, min(args.prebuild_workers, os.cpu_count() or 1))
    if args.tol is None:
        args.tol = 1e-3 if args.device == "cuda" else 1e-4
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device == "cuda" else "32-true"
    return args


def model_config(args, vocab_size: int, **overrides) -> GPTConfig:
    """Stack-100M, or the tiny model (vocab cut to the tokenizer's) with --quick."""
    if args.quick:
        return GPTConfig.tiny(vocab_size=vocab_size, seq_len=args.seq_len, d_model=64, **overrides)
    return GPTConfig.stack_100m(seq_len=args.seq_len, **overrides)


def autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------
# Tokenizer and real packed rows
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def corpus_texts(max_bytes: int) -> tuple[str, ...]:
    """The embedded corpus read once (a walk over the standard library) for the tokenizer and part A."""
    return tuple(iter_default_corpus(max_bytes))


def load_or_train_tokenizer(args, workdir: Path):
    from stacklm.tokenizer.bpe import StackTokenizer
    from stacklm.tokenizer.training import train_from_iterable

    if args.tokenizer:
        tok = StackTokenizer.load(args.tokenizer)
        if not args.quick and tok.vocab_size > GPTConfig().vocab_size:
            raise SystemExit(f"--tokenizer {args.tokenizer}: vocab {tok.vocab_size} exceeds the model's {GPTConfig().vocab_size} embedding rows")
        return tok, Path(args.tokenizer)
    t = time.perf_counter()
    texts = corpus_texts(max(args.tokenizer_bytes, args.kernel_text_bytes))
    res = train_from_iterable(_budget(texts, args.tokenizer_bytes), args.vocab_size)
    path = res.tokenizer.save(workdir / "tokenizer" / "tokenizer.stacklm.json")
    print(f"tokenizer: vocab {res.tokenizer.vocab_size}, {res.n_merges} merges on {args.tokenizer_bytes:,} bytes of the "
          f"embedded corpus in {time.perf_counter() - t:.1f}s")
    return res.tokenizer, path.parent


def _budget(texts, max_bytes: int):
    """Whole texts up to ``max_bytes`` of UTF-8."""
    used = 0
    for t in texts:
        used += len(t.encode())
        if used > max_bytes:
            return
        yield t


def packed_rows(args, tok, seq_len: int, rows: int, text_bytes: int) -> np.ndarray:
    """The ``rows`` best-fit windows of real text that hold the most documents."""
    texts = list(_budget(corpus_texts(max(args.tokenizer_bytes, text_bytes)), text_bytes))
    order = np.random.default_rng(0).permutation(len(texts))
    ids = tok.encode_batch([texts[i] for i in order], num_threads=2)
    docs = [{"ids": np.asarray(x, dtype=np.int32), "source": "corpus"} for x in ids if x]
    windows = np.stack(list(pack_best_fit(docs, seq_len, tok.bos_id, tok.eos_id, tok.pad_id, buffer_docs=256)))
    if len(windows) < rows:
        raise SystemExit(f"only {len(windows)} windows from {text_bytes:,} bytes; raise --kernel-text-bytes")
    starts = (windows == tok.bos_id).sum(axis=1)
    return windows[np.argsort(-starts, kind="stable")[:rows]]


def documents_to_check(batch: dict[str, torch.Tensor], bos_id: int, eos_id: int, limit: int) -> list[tuple[int, int, int]]:
    """``(row, start, length)`` of whole documents (``<bos> … <eos>``) packed after another
    one, the latest-starting first, one per row while rows last."""
    found = []
    ids, seq = batch["input_ids"], batch["seq_ids"]
    for r in range(ids.shape[0]):
        for s in seq[r].unique().tolist():
            where = torch.nonzero(seq[r] == s).flatten()
            start, n = int(where[0]), len(where)
            if start > 0 and n >= 4 and int(ids[r, start]) == bos_id and int(ids[r, start + n - 1]) == eos_id:
                found.append((r, start, n))
    found.sort(key=lambda f: -f[1])
    first_per_row = {}
    for f in found:
        first_per_row.setdefault(f[0], f)
    picked = list(first_per_row.values())[:limit]
    picked += [f for f in found if f not in picked][: limit - len(picked)]
    return picked


def alone_rows(batch: dict[str, torch.Tensor], docs: list[tuple[int, int, int]], seq_len: int, bos: int, eos: int, pad: int):
    """Each document at the start of its own row, padded: the contract derived from tokens alone.
    As many rows as ``batch`` (the rest all padding), so the shape matches the packed batch."""
    windows = np.full((max(len(docs), batch["input_ids"].shape[0]), seq_len), pad, dtype=np.int64)
    for j, (r, start, n) in enumerate(docs):
        windows[j, :n] = batch["input_ids"][r, start:start + n].numpy()
    return collate(windows, bos, eos, pad)


# ---------------------------------------------------------------------------------------
# Part A: kernels
# ---------------------------------------------------------------------------------------
def forward(model: GPT, batch: dict[str, torch.Tensor], **replace_fields) -> torch.Tensor:
    b = {**batch, **replace_fields}
    with torch.no_grad():
        return model(b["input_ids"], b["position_ids"], b["seq_ids"]).float()


def doc_diff(packed: torch.Tensor, alone: torch.Tensor, docs) -> float:
    return max(float((packed[r, s:s + n] - alone[j, :n]).abs().max()) for j, (r, s, n) in enumerate(docs))


def gradient(model: GPT, batch: dict[str, torch.Tensor], rows: int, device: torch.device, dtype: str) -> torch.Tensor:
    """The full gradient of the loss on the first ``rows`` rows, flattened to fp32."""
    model.zero_grad(set_to_none=True)
    part = {k: v[:rows] for k, v in batch.items()}
    with autocast(device, dtype):
        loss, _ = lm_loss(model(part["input_ids"], part["position_ids"], part["seq_ids"]), part["targets"])
    loss.backward()
    grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grad


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm().clamp(min=1e-30))


def kernel_variants(args, device: torch.device) -> tuple[list[tuple[str, str, bool]], list[str]]:
    """(backend, precision, compile the model) rows to run, and why others are absent."""
    rows = [("sdpa", "fp32", False), ("flex", "fp32", False), ("sdpa", "bf16", False), ("flex", "bf16", False)]
    notes = []
    if device.type == "cpu":
        notes.append("flex gradient: not checked (FlexAttention has no CPU backward; checked on CUDA)")
    if device.type != "cuda":
        notes.append("flash_varlen: not run (CUDA only)")
    elif not flash_attn_available():
        notes.append("flash_varlen: not run (flash-attn is not installed: pip install flash-attn)")
    else:
        rows.append(("flash_varlen", "bf16", False))
        notes.append("flash_varlen: bf16 only (flash-attn has no fp32 kernels)")
    if args.compile:
        rows.append(("flex", "bf16", True))
    return rows, notes


def run_kernels(args, tok, device: torch.device) -> dict:
    windows = packed_rows(args, tok, args.seq_len, args.kernel_rows, args.kernel_text_bytes)
    cpu_batch = collate(windows, tok.bos_id, tok.eos_id, tok.pad_id)
    docs = documents_to_check(cpu_batch, tok.bos_id, tok.eos_id, args.doc_checks)
    if not docs:
        raise SystemExit("no whole document packed after another one in the batch; raise --kernel-text-bytes or --kernel-rows")
    alone = {k: v.to(device) for k, v in alone_rows(cpu_batch, docs, args.seq_len, tok.bos_id, tok.eos_id, tok.pad_id).items()}
    batch = {k: v.to(device) for k, v in cpu_batch.items()}
    segments = [len(batch["seq_ids"][r].unique()) for r in range(len(windows))]
    pad_share = float((batch["input_ids"] == tok.pad_id).float().mean())
    T = batch["input_ids"].shape[1]

    torch.manual_seed(0)
    base = model_config(args, tok.vocab_size, attention="sdpa", init_std=args.init_std)
    reference = GPT(base).to(device)
    weights = reference.state_dict()
    variants, notes = kernel_variants(args, device)
    print(f"\nA. kernels: {'tiny' if args.quick else 'Stack-100M'} model ({reference.num_params():,} params, init std "
          f"{args.init_std}), {len(windows)} packed rows x {T} tokens of real text, segments per row "
          f"{min(segments)}-{max(segments)} (mean {np.mean(segments):.1f}), pad share {pad_share:.1%}; "
          f"{len(docs)} documents packed vs alone (offsets {', '.join(str(s) for _, s, _ in docs)})")

    # Controls on the fp32 reference: what the checks would see if the mask or positions were wrong.
    alone_ref = forward(reference, alone)
    reversed_pos = batch["position_ids"].clone()
    for r, s, n in docs:
        reversed_pos[r, s:s + n] = batch["position_ids"][r, s:s + n].flip(0)
    controls = {
        "no document mask": doc_diff(forward(reference, batch, seq_ids=torch.zeros_like(batch["seq_ids"])), alone_ref, docs),
        "positions reversed in each document": doc_diff(forward(reference, batch, position_ids=reversed_pos), alone_ref, docs),
    }
    del reference, alone_ref

    results, ref_logits, ref_loss, ref_grad = [], {}, {}, {}
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (also inside the compiled flex kernel)
    torch.backends.cudnn.allow_tf32 = False
    for backend, dtype, compiled in variants:
        name = backend + (" (model compiled)" if compiled else "")
        is_reference = backend == "sdpa" and not compiled
        try:
            model = GPT(replace(base, attention=backend)).to(device)
            model.load_state_dict(weights)
            if compiled:
                model.compile()
            with autocast(device, dtype):
                t = time.perf_counter()
                logits = forward(model, batch)
                sync(device)
                first_s = time.perf_counter() - t
                alone_logits = forward(model, alone)
            loss = float(lm_loss(logits, batch["targets"])[0])
            # FlexAttention has no CPU backward (torch raises); its gradient is checked on CUDA only.
            grad = None if backend == "flex" and device.type == "cpu" else gradient(model, batch, args.grad_rows, device, dtype)
        except Exception as err:  # one kernel failing must not hide the others' numbers
            if is_reference:
                raise
            results.append({"backend": name, "precision": dtype, "error": f"{type(err).__name__}: {err}"[:500]})
            model = logits = alone_logits = grad = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if is_reference:
            ref_logits[dtype], ref_loss[dtype], ref_grad[dtype] = logits, loss, grad
        results.append({
            "backend": name, "precision": dtype,
            "max_logit_diff": float((logits - ref_logits[dtype]).abs().max()),
            "loss": loss, "loss_diff": abs(loss - ref_loss[dtype]),
            "grad_rel_err": None if grad is None else rel_err(grad, ref_grad[dtype]),
            "doc_max_diff": doc_diff(logits, alone_logits, docs),
            "vs_fp32": {"max_logit_diff": float((logits - ref_logits["fp32"]).abs().max()),
                        "loss_diff": abs(loss - ref_loss["fp32"]),
                        "grad_rel_err": None if grad is None else rel_err(grad, ref_grad["fp32"])},
            "first_forward_s": first_s,
        })
        del model, logits, alone_logits, grad
        gc.collect()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    verdicts = judge(results, controls, args.tol)
    print_kernels(results, controls, notes, verdicts, args.tol)
    return {"rows": results, "controls": controls, "notes": notes, "verdicts": verdicts,
            "batch": {"rows": len(windows), "tokens_per_row": T, "segments_per_row": segments, "pad_share": pad_share,
                      "documents_checked": [list(d) for d in docs]}}


def judge(rows: list[dict], controls: dict[str, float], tol: float) -> list[str]:
    """Failed checks, as sentences (empty: all passed)."""
    failed = []
    bf16_ref = next((r for r in rows if r["backend"] == "sdpa" and r["precision"] == "bf16"), None)
    for r in rows:
        name = f"{r['backend']} {r['precision']}"
        if "error" in r:
            r["ok"] = False
            failed.append(f"{name}: raised {r['error']}")
            continue
        if r["precision"] == "fp32":
            limits = {"max_logit_diff": tol, "loss_diff": tol, "grad_rel_err": tol, "doc_max_diff": tol}
            got = r
        else:
            base = bf16_ref["vs_fp32"]
            limits = {k: BF16_SLACK * base[k] + tol for k in ("max_logit_diff", "grad_rel_err")}
            limits["doc_max_diff"] = BF16_SLACK * base["max_logit_diff"] + tol
            # The loss is a mean of per-token log-probabilities, each within 2 x the largest logit
            # difference; bf16 SDPA's own loss error is a sum of signed errors that can cancel to
            # near zero for one batch (CI: 1.2e-4 against flex's 3.7e-4, same logits bound), so a
            # bound relative to it is luck. Bound it by the logits limit instead.
            limits["loss_diff"] = 2 * limits["max_logit_diff"]
            got = {**r["vs_fp32"], "doc_max_diff": r["doc_max_diff"]}
        r["limits"] = limits
        checked = {k: limit for k, limit in limits.items() if got[k] is not None}
        r["ok"] = all(got[k] <= limit for k, limit in checked.items())
        failed += [f"{name}: {k} = {got[k]:.3g} > {limit:.3g}" for k, limit in checked.items() if not got[k] <= limit]
    for what, diff in controls.items():
        if not diff > CONTROL_FACTOR * tol:
            failed.append(f"control '{what}' moved the logits by only {diff:.3g}: the checks cannot tell a broken kernel")
    return failed


def print_kernels(rows, controls, notes, verdicts, tol) -> None:
    def num(x) -> str:
        return "n/a" if x is None else f"{x:.2e}"

    print(f"{'backend':26s} {'prec':4s} {'max|Δlogit|':>11s} {'|Δloss|':>9s} {'grad rel':>9s} {'doc Δ':>9s}   "
          f"{'vs fp32: |Δlogit|':>17s} {'|Δloss|':>9s} {'grad rel':>9s} {'1st fwd s':>9s}  ok")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:26s} {r['precision']:4s} ERROR {r['error']}")
            continue
        f = r["vs_fp32"]
        print(f"{r['backend']:26s} {r['precision']:4s} {r['max_logit_diff']:11.2e} {r['loss_diff']:9.2e} {num(r['grad_rel_err']):>9s} "
              f"{r['doc_max_diff']:9.2e}   {f['max_logit_diff']:17.2e} {f['loss_diff']:9.2e} {num(f['grad_rel_err']):>9s} "
              f"{r['first_forward_s']:9.2f}  {'ok' if r['ok'] else 'FAIL'}")
    print("first columns: against SDPA at the same precision; 'doc Δ': max |Δlogit| of a document packed vs alone")
    print(f"tolerance: fp32 {tol:g}; bf16: {BF16_SLACK:g} x bf16 SDPA's error against fp32 + {tol:g} (loss: 2 x the logits bound)")
    for what, diff in controls.items():
        print(f"control (sdpa fp32, should be large): {what}: doc Δ = {diff:.3g}")
    for note in notes:
        print(note)
    print("kernels: " + ("all checks passed" if not verdicts else "FAILED:\n  " + "\n  ".join(verdicts)))


# ---------------------------------------------------------------------------------------
# Part B: training throughput
# ---------------------------------------------------------------------------------------
def pipeline_dict(args, total_tokens: int) -> dict:
    """The demo mix (stacklm/configs/demo.yaml) at this run's seq_len/batch size and token budget; the
    synthetic sources scale with the budget (the demo sizes them for 1M tokens): up for a bigger
    one, down for a smaller one with 4x headroom for filtering and dedup (``--quick`` needs ~7k
    tokens: the demo's 40,000 documents made its prebuild's dedup pass ~30 s of a 1-minute run)."""
    import yaml

    doc = yaml.safe_load((CONFIG_DIR / "demo.yaml").read_text())
    d = copy.deepcopy(doc["data"]["pipeline"])
    d.update(seq_len=args.seq_len, batch_size=args.batch_size, seed=0)
    scale = total_tokens / d["mix"]["total_tokens"]
    if scale < 1.0:
        scale = min(1.0, 4 * scale)
    d["mix"]["total_tokens"] = int(total_tokens)
    for e in d["mix"]["entries"]:
        if e.get("num_docs"):
            e["num_docs"] = math.ceil(e["num_docs"] * scale)
    return d


def prebuild_shards(args, pipeline: dict, tok_dir: Path, workdir: Path) -> Path:
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.prebuild import prebuild

    out = workdir / "shards"
    t = time.perf_counter()
    prebuild(PipelineConfig.from_dict(pipeline), tok_dir, out, workers=args.prebuild_workers, splits=("train",), progress=False)
    print(f"prebuild: {pipeline['mix']['total_tokens']:,}-token demo mix -> {out} in {time.perf_counter() - t:.1f}s "
          f"({args.prebuild_workers} workers)")
    return out


def datamodule_loader(mode: str, args, tok_dir: Path, workers: int, data_dir: Path | None = None, pipeline: dict | None = None):
    from stacklm.datamodule import StackDataModule

    dm = StackDataModule(mode=mode, tokenizer=str(tok_dir), data_dir=None if data_dir is None else str(data_dir),
                         pipeline=pipeline, seq_len=args.seq_len, batch_size=args.batch_size, num_workers=workers,
                         seed=0, val_batches=0)
    dm.setup("fit")
    return dm.train_dataloader()


def train(args, config: GPTConfig, loader, device: torch.device, pad_id: int) -> dict:
    """Warm-up, then ``args.steps`` timed steps from ``loader``; the numbers of the timed part."""
    from stacklm.train.gpt_module import GPTModule, OptimConfig

    total = args.warmup + args.steps
    torch.manual_seed(0)
    module = GPTModule(config, OptimConfig(warmup_steps=max(1, total // 10), total_steps=total)).to(device)
    if args.compile:
        module.model.compile()
    opt = module.configure_optimizers()
    optimizer, scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    precision = "bf16" if args.precision == "bf16-mixed" else "fp32"
    it = iter(loader)
    wait = tokens = nonpad = 0
    masked = torch.zeros((), dtype=torch.long, device=device)  # read once at the end: no per-step sync for it
    losses = []
    t0 = first_batch_s = None
    for step in range(total):
        if step == args.warmup:
            sync(device)
            t0, wait, tokens, nonpad = time.perf_counter(), 0.0, 0, 0
            masked.zero_()
        tw = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            raise RuntimeError(f"the loader ran out after {step} batches; the data budget is too small for --warmup + --steps") from None
        waited = time.perf_counter() - tw
        wait += waited
        ids = batch["input_ids"]
        tokens += ids.numel()
        nonpad += int((ids != pad_id).sum())  # on the host copy
        batch = to_device_batch(batch, device)  # as StackDataModule's transfer hooks do: pinned, lean planes derived
        if step == 0:
            first_batch_s = waited
            check_batch(batch, config)
        masked += (batch["targets"] == -100).all()
        loss = train_step(module, optimizer, scheduler, batch, device, precision)
        losses.append(loss.item())  # the per-step host sync a loss log does
    wall = time.perf_counter() - t0
    close = getattr(it, "close", None)
    if close is not None:
        close()  # a generator (shards mode) shuts its DataLoader's workers down now
    del it, module, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"steps": args.steps, "wall_s": wall, "step_ms": 1e3 * wall / args.steps, "tokens_per_s": tokens / wall,
            "nonpad_tokens_per_s": nonpad / wall, "wait_fraction": min(1.0, wait / wall), "first_batch_s": first_batch_s,
            "model_tflops": 6 * config.num_params() * tokens / wall / 1e12, "masked_batches": int(masked),
            "loss_first": losses[0], "loss_last": losses[-1]}


def train_step(module, optimizer, scheduler, batch: dict, device: torch.device, precision: str) -> torch.Tensor:
    """One AdamW step on a device batch (grad-clip 1.0); the loss, detached, still on the device."""
    with autocast(device, precision):
        loss, _ = lm_loss(module(batch), batch["targets"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def to_device_batch(batch: dict, device: torch.device) -> dict:
    """``batch`` on ``device`` the way ``StackDataModule``'s Lightning hooks move it: pinned,
    non-blocking, one copy per buffer on CUDA (``stacklm.datamodule.transfer``), then a lean
    batch's planes derived there."""
    from stacklm.datamodule.transfer import after_transfer, to_device

    moved = to_device(batch, device)
    if moved is None:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return after_transfer(moved)


class RepeatBatch:
    """One batch, served ``n`` times: the model's speed with a loader that costs nothing."""

    def __init__(self, batch: dict[str, torch.Tensor], n: int) -> None:
        self.batch, self.n = batch, n

    def __iter__(self):
        return (self.batch for _ in range(self.n))


def run_throughput(args, tok, tok_dir: Path, device: torch.device, workdir: Path) -> dict:
    needed = (args.warmup + args.steps + 2) * args.batch_size * args.seq_len
    pipeline = pipeline_dict(args, int(needed * 1.3))  # headroom: packing and dedup spend some of the budget
    data_dir = Path(args.data_dir) if args.data_dir else prebuild_shards(args, pipeline, tok_dir, workdir)
    config = model_config(args, tok.vocab_size if args.quick else GPTConfig().vocab_size, attention=args.train_attention)
    backend = resolve_backend(args.train_attention, device)
    first = next(iter(datamodule_loader("shards", args, tok_dir, 0, data_dir=data_dir)))
    runs = [("in-memory", "-", lambda: RepeatBatch(first, args.warmup + args.steps))]
    for n in args.workers:
        runs.append(("shards", n, lambda n=n: datamodule_loader("shards", args, tok_dir, n, data_dir=data_dir)))
        runs.append(("stream", n, lambda n=n: datamodule_loader("stream", args, tok_dir, n, pipeline=pipeline)))
    T = args.seq_len - 1
    print(f"\nB. training throughput: {'tiny' if args.quick else 'Stack-100M'} model ({config.num_params():,} params), "
          f"AdamW, {args.precision}, attention={backend}, compile={'on' if args.compile else 'off'}; "
          f"B={args.batch_size} x T={T} ({args.batch_size * T:,} positions/step); {args.steps} steps timed after {args.warmup}")
    print(f"{'feed':10s} {'workers':>7s} {'step ms':>8s} {'tok/s':>10s} {'non-pad tok/s':>13s} {'6N TFLOP/s':>10s} "
          f"{'wait frac':>9s} {'1st batch s':>11s} {'vs mem':>6s}")
    rows = []
    for name, workers, make in runs:
        try:
            r = train(args, config, make(), device, tok.pad_id)
        except Exception as err:  # noqa: BLE001 - e.g. out of memory: keep the other runs' numbers
            rows.append({"feed": name, "workers": workers, "error": f"{type(err).__name__}: {err}"[:500]})
            print(f"{name:10s} {workers!s:>7s} ERROR {rows[-1]['error']}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        r.update(feed=name, workers=workers)
        rows.append(r)
        base = rows[0].get("tokens_per_s")
        ratio = f"{r['tokens_per_s'] / base:6.0%}" if base else f"{'-':>6s}"
        print(f"{name:10s} {workers!s:>7s} {r['step_ms']:8.1f} {r['tokens_per_s']:10,.0f} {r['nonpad_tokens_per_s']:13,.0f} "
              f"{r['model_tflops']:10.2f} {r['wait_fraction']:9.3f} {r['first_batch_s']:11.2f} {ratio}"
              + (f"  ({r['masked_batches']} fully masked batches: the stream ran dry)" if r["masked_batches"] else ""))
    print("wait frac = time blocked in next(loader) / wall (DataStatsCallback's loader/wait_fraction); "
          "6N TFLOP/s = 6 x params x tokens/s (attention not counted)")
    return {"rows": rows, "attention": backend, "data_dir": str(data_dir), "pipeline": pipeline}


def run_sync_check(args, tok, tok_dir: Path, device: torch.device, workdir: Path) -> dict:
    """Part C: ``--warmup`` steps (compile, allocator, workers: syncs allowed), then ``--steps``
    training steps of the model on ``StackDataModule`` shards batches in the lean planes, moved and
    derived by its own transfer hooks, with the varlen/flex mask from the loader's ``cu_seqlens``,
    under ``torch.cuda.set_sync_debug_mode("error")``: any host sync in the transfer, the planes'
    derivation, the mask, forward, backward or the optimizer raises with its stack. The loss stays
    on the device until the clock stops. Prints the step throughput."""
    from stacklm.datamodule import StackDataModule
    from stacklm.train.gpt_module import GPTModule, OptimConfig

    needed = (args.warmup + args.steps + 2) * args.batch_size * args.seq_len
    pipeline = pipeline_dict(args, int(needed * 1.3))
    data_dir = Path(args.data_dir) if args.data_dir else prebuild_shards(args, pipeline, tok_dir, workdir)
    config = model_config(args, tok.vocab_size if args.quick else GPTConfig().vocab_size, attention=args.train_attention)
    backend = resolve_backend(args.train_attention, device)
    if backend == "sdpa":
        raise SystemExit("bench/gpu.py --sync-check checks the varlen/flex path; --train-attention sdpa builds a dense mask")
    dm = StackDataModule(mode="shards", tokenizer=str(tok_dir), data_dir=str(data_dir), seq_len=args.seq_len,
                         batch_size=args.batch_size, num_workers=args.workers[0], seed=0, val_batches=0, planes="lean")
    dm.setup("fit")
    torch.manual_seed(0)
    module = GPTModule(config, OptimConfig(warmup_steps=1, total_steps=args.warmup + args.steps)).to(device)
    if args.compile:
        module.model.compile()
    opt = module.configure_optimizers()
    optimizer, scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    precision = "bf16" if args.precision == "bf16-mixed" else "fp32"

    def step(batch) -> torch.Tensor:
        batch = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, device, 0), 0)
        return train_step(module, optimizer, scheduler, batch, device, precision)

    it = iter(dm.train_dataloader())
    first = next(it)
    if "cu_seqlens" not in first or first["input_ids"].dtype != torch.int32:
        raise SystemExit(f"bench/gpu.py --sync-check: the loader's batch is not lean (keys {sorted(first)})")
    losses = [step(first)]
    for _ in range(args.warmup - 1):
        losses.append(step(next(it)))
    sync(device)
    tokens, t0 = 0, time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(args.steps):
            batch = next(it)
            tokens += batch["input_ids"].numel()
            losses.append(step(batch))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sync(device)
    wall = time.perf_counter() - t0
    loss_last = float(losses[-1])
    close = getattr(it, "close", None)
    if close is not None:
        close()
    out = {"steps": args.steps, "attention": backend, "compile": bool(args.compile), "step_ms": 1e3 * wall / args.steps,
           "tokens_per_s": tokens / wall, "loss_first": float(losses[0]), "loss_last": loss_last, "syncs": 0}
    print(f"\nC. no host sync: {args.steps} steps of the {'tiny' if args.quick else 'Stack-100M'} model on lean shards batches "
          f"(attention={backend}, compile={'on' if args.compile else 'off'}, B={args.batch_size} x T={args.seq_len - 1}) under "
          f"set_sync_debug_mode('error'): no sync; {out['step_ms']:.1f} ms/step, {out['tokens_per_s']:,.0f} tok/s, "
          f"loss {out['loss_first']:.3f} -> {loss_last:.3f}")
    return out


# ---------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": str(device), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    if flash_attn_available():
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    # The compiled flex kernel meets one (shape, dtype, grad mode) signature per part-A variant
    # and part-B run (a training run meets two); past Dynamo's default limit of 8 recompiles it
    # would quietly fall back to eager flex and time the wrong kernel.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    started = time.perf_counter()
    device = torch.device(args.device)
    if args.sync_check and (device.type != "cuda" or not torch.cuda.is_available()):
        # loud, not skipped: the check is what a lent GPU is for, and CPU has no device syncs to find
        print("bench/gpu.py --sync-check needs a CUDA device (torch.cuda.set_sync_debug_mode); none here "
              f"(device={args.device}, cuda available: {torch.cuda.is_available()})", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)  # steadier on a shared CPU; a CPU run is a smoke test, not a benchmark
    report = {"environment": environment(device), "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    print(" ".join(f"{k}={v}" for k, v in report["environment"].items()) + (" (quick)" if args.quick else ""))
    with tempfile.TemporaryDirectory(prefix="stacklm-gpu-bench-") as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        workdir = Path(tmp)
        tok, tok_dir = load_or_train_tokenizer(args, workdir)
        if args.sync_check:
            report["sync_check"] = run_sync_check(args, tok, tok_dir, device, workdir)
        if not args.skip_kernels and not args.sync_check:
            report["kernels"] = run_kernels(args, tok, device)
        if not args.skip_throughput and not args.sync_check:
            report["throughput"] = run_throughput(args, tok, tok_dir, device, workdir)
    print(f"\ndone in {time.perf_counter() - started:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    failed_runs = [r for r in report.get("throughput", {}).get("rows", []) if "error" in r]
    return 1 if report.get("kernels", {}).get("verdicts") or failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
