"""What a small build pays for the global dedup pass: a 200,000-token build over ~60 MB of sources.

    python3 bench/small_build.py [--mb 60] [--budget 200000] [--workers 1] [--root DIR] [--sign-margin M] [--profile]

Writes two sources of real text (``stacklm.corpus``: code and prose, cut into documents of at
most 3,000 characters and repeated with a per-copy word change until the size is reached: so
the copies are other documents, not exact duplicates) as 8 JSON-lines files each, trains a
2,048-id tokenizer, and runs ``stacklm prebuild`` with exact + near dedup (the default) and the
default quality filters, timing the whole build and the dedup pass (its last stderr lines).
``--sign-margin 0`` signs the whole corpus (what every build did before ``stacklm.prebuild.signing``). ``--profile`` runs
``dedup_pass.signature_slice`` for the train split under cProfile and prints the top functions.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_WORD = re.compile(r"[A-Za-z]{4,}")


def _variant(text: str, copy: int) -> str:
    """Copy ``copy`` of ``text``: every word of 4+ letters whose crc with the copy number is 0
    mod 4 is reversed, so copies share text but are different documents (copy 0 is the text)."""
    if copy == 0:
        return text
    return _WORD.sub(lambda m: m.group(0)[::-1] if zlib.crc32(f"{copy}:{m.group(0)}".encode()) % 4 == 0 else m.group(0), text)


def write_corpus(root: Path, mb: float, files_per_source: int = 8) -> dict[str, list[Path]]:
    from stacklm.corpus.stdlib import iter_code, iter_prose

    target = int(mb * 1e6 / 2)  # bytes per source
    out: dict[str, list[Path]] = {}
    for name, it in (("code", iter_code), ("prose", iter_prose)):
        base = [d[i : i + 3000] for d in it() for i in range(0, len(d), 3000) if d[i : i + 3000].strip()]
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        paths = [folder / f"part{k:02d}.jsonl" for k in range(files_per_source)]
        handles = [open(p, "w") for p in paths]
        written, copy, n = 0, 0, 0
        while written < target:
            for doc in base:
                line = json.dumps({"text": _variant(doc, copy)}) + "\n"
                handles[n % files_per_source].write(line)
                written += len(line)
                n += 1
                if written >= target:
                    break
            copy += 1
        for h in handles:
            h.close()
        out[name] = paths
    return out


def write_config(root: Path, budget: int, tokenizer: Path) -> Path:
    data = {"tokenizer": str(tokenizer), "seq_len": 512, "batch_size": 4, "seed": 0, "pipeline": {
        "shuffle_buffer": 256, "pack_buffer_docs": 64, "holdout_fraction": 0.01, "tokenize_batch_docs": 64, "num_threads": 1,
        "mix": {"name": "small", "total_tokens": budget, "entries": [
            {"name": "code", "kind": "local", "path": str(root / "code" / "*.jsonl"), "weight": 0.4, "domain": "code"},
            {"name": "prose", "kind": "local", "path": str(root / "prose" / "*.jsonl"), "weight": 0.6, "domain": "prose"},
        ]}}}
    path = root / "small.yaml"
    path.write_text(json.dumps({"data": data}))  # JSON is YAML
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=60)
    ap.add_argument("--budget", type=int, default=200_000)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--root", type=Path, default=Path("/tmp/small_build"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sign-margin", default=None, help="passed to stacklm prebuild (0: sign the whole corpus, as before)")
    args = ap.parse_args()

    root = args.root
    if not (root / "code").is_dir():
        write_corpus(root, args.mb)
    tok_dir = root / "tokenizer"
    if not tok_dir.is_dir():
        from stacklm.corpus import iter_default_corpus
        from stacklm.tokenizer.training import train_from_iterable

        tok_dir.mkdir()
        train_from_iterable(iter_default_corpus(1_000_000), 2048).tokenizer.save(tok_dir / "tokenizer.stacklm.json")
    cfg = write_config(root, args.budget, tok_dir)
    size = sum(p.stat().st_size for p in root.glob("*/*.jsonl"))
    print(f"corpus: {size / 1e6:.1f} MB in {len(list(root.glob('*/*.jsonl')))} files; budget {args.budget:,} tokens")

    if args.profile:
        import cProfile
        import pstats

        from stacklm.prebuild import load_config
        from stacklm.prebuild.dedup_pass import signature_slice

        pcfg = load_config(str(cfg))[0]
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        sig = signature_slice(pcfg.to_dict(), "train", 0, 1)
        prof.disable()
        print(f"signature_slice train: {len(sig['ids']):,} documents in {time.perf_counter() - t0:.1f}s")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return

    out = root / "out"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    cmd = [sys.executable, "-m", "stacklm", "prebuild", "--config", str(cfg), "--out", str(out), "--workers", str(args.workers)]
    cmd += ["--sign-margin", args.sign_margin] if args.sign_margin is not None else []
    print("$ " + " ".join(cmd))
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    said = [line.split("\r")[-1] for line in run.stderr.splitlines() if line.strip()]
    print(run.stdout)
    print("\n".join(line for line in said if not line.startswith(("mixed", "[")))[-3000:])
    print(f"wall {wall:.1f}s (exit {run.returncode})")


if __name__ == "__main__":
    main()
