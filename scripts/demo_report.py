"""Print what the demo did: realized mix, token counts, loss curve, resume, artifact paths.

    python3 scripts/demo_report.py artifacts/demo
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path


def _losses(out: Path) -> list[tuple[int, float, str]]:
    rows = []
    for metrics in sorted(out.glob("csv/version_*/metrics.csv")):
        for r in csv.DictReader(metrics.open()):
            if r.get("train/loss"):
                rows.append((int(r["step"]), float(r["train/loss"]), metrics.parent.name))
    return rows


def _val(out: Path) -> list[tuple[int, float]]:
    vals = []
    for metrics in sorted(out.glob("csv/version_*/metrics.csv")):
        vals += [(int(r["step"]), float(r["val/loss"])) for r in csv.DictReader(metrics.open()) if r.get("val/loss")]
    return vals


def main(out: Path) -> int:
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    print("== realized mix (prebuilt train split)")
    print(f"{'source':<8}{'target':>8}{'realized':>10}{'tokens':>12}{'docs':>8}")
    for s in manifest["sources"]:
        print(f"{s['name']:<8}{s['target_weight']:>8.3f}{s['realized_weight']:>10.3f}{s['tokens']:>12,}{s['docs']:>8,}")
    drops = manifest["drops"]["train"]
    reasons: dict[str, int] = {}
    for per in drops.values():
        for k, v in per.items():
            reasons[k] = reasons.get(k, 0) + v
    print("dropped / changed before packing: " + ", ".join(f"{k}={v}" for k, v in sorted(reasons.items()) if v))
    split = manifest["splits"]["train"]
    print(f"shards: train {split['n_seq']:,} sequences = {split['n_tokens']:,} tokens "
          f"(padding {split['packing']['pad_fraction']:.2%}), val {manifest['splits']['val']['n_seq']:,} sequences")

    losses = _losses(out)
    if not losses:
        print("no training metrics found", file=sys.stderr)
        return 1
    k = max(1, len(losses) // 5)
    first = sum(v for _, v, _ in losses[:k]) / k
    last = sum(v for _, v, _ in losses[-k:]) / k
    print("\n== training")
    print(f"loss: first {k} logs mean {first:.3f} -> last {k} logs mean {last:.3f} "
          f"(steps {losses[0][0]}..{losses[-1][0]}; chance level ln(vocab) = {__import__('math').log(manifest['vocab_size']):.2f})")
    runs = sorted({v for _, _, v in losses})
    # stacklm-train continues the run's CSV folder on a resume and marks it with run/resumed_at
    marks = [int(float(r["run/resumed_at"])) for m in sorted(out.glob("csv/version_*/metrics.csv"))
             for r in csv.DictReader(m.open()) if r.get("run/resumed_at")]
    if len(runs) > 1 or marks:
        resumed_at = marks[-1] if marks else min(s for s, _, v in losses if v == runs[-1])
        print(f"resumed once: the second run restored the checkpoint (model, optimizer, loader position) "
              f"and logged from step {resumed_at} on")
    for step, v in _val(out):
        print(f"val loss at step {step}: {v:.3f}")
    print(f"{'FALLS' if last < first - 0.5 else 'DID NOT FALL CLEARLY'}: loss {first:.2f} -> {last:.2f}")

    print("\n== artifacts")
    print(f"tokenizer:   {out / 'tokenizer'} (tokenizer.stacklm.json, tokenizer.tiktoken, tokenizer.json)")
    print(f"shards:      {out / 'shards'} (manifest.json, train/, val/)")
    print(f"checkpoints: {out / 'checkpoints'}")
    runs_dir = sorted((out / "wandb").glob("offline-run-*"))
    if runs_dir:
        print(f"W&B offline runs: {', '.join(str(p) for p in runs_dir)}  (upload later with `wandb sync <dir>`)")
    print(f"metrics CSV: {out / 'csv'}")
    return 0 if last < first - 0.5 else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "artifacts/demo")))
