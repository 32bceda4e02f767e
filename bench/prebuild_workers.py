"""`stacklm prebuild --workers 2` against `--workers 1`, side by side in one run (issue 22.8).

    python3 bench/prebuild_workers.py [--mb 34] [--files 4] [--rounds 2] [--workers 1 2] [--profile]
    python3 bench/prebuild_workers.py --synthetic 60000     # 2 x 60k synthetic documents, ~254 MB
    python3 bench/prebuild_workers.py --synthetic 60000 --pin   # each build on as many cores as workers
    python3 bench/prebuild_workers.py --root DIR --baseline ../other-checkout   # reuse DIR's corpus; another tree side by side

Corpus: the embedded standard-library corpus (``iter_default_documents``: code, prose, CJK,
math; ~9.5k documents, 34 MB at the default), one JSON-lines source per domain, each dealt
into ``--files`` files, every source under its domain's default quality filter, exact and
near dedup on (the global decision), a 0.5% holdout and a budget that does not bind -- the
shape of ``configs/stack-100m.yaml``. Tokenizer: 8,192 ids trained on 3 MB of the same text.

Each round builds the same config once per ``--workers`` value, in a fresh process (so no
run inherits another's imports or caches), alternating; the best round of each is reported:
wall seconds, CPU seconds (the build process and its children, from ``wait4``), the speed-up
over the first value and the CPU ratio, and the build's own phase times (its last progress
line: piece index, global dedup pass, packing jobs, merge).
``--profile`` also profiles a one-worker build's main process (``cProfile``, top functions by
own time) -- the per-core cost the cluster projection uses.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_corpus(root: Path, mb: float, files: int, synthetic: int = 0) -> dict:
    from stacklm.corpus import iter_default_documents, synthetic_text

    per: dict[str, list[str]] = {}
    if synthetic:  # a larger corpus: synthetic prose and code (stdlib text, ~1 in 20 an exact or near copy)
        for domain in ("prose", "code"):
            per[domain] = [synthetic_text(i, domain) for i in range(synthetic)]
    else:
        for domain, text in iter_default_documents(int(mb * 1e6)):
            per.setdefault(domain, []).append(text)
    entries = []
    for domain, docs in sorted(per.items()):
        folder = root / "data" / domain
        folder.mkdir(parents=True)
        handles = [open(folder / f"part-{k:02d}.jsonl", "w", encoding="utf-8") for k in range(files)]
        for i, d in enumerate(docs):
            handles[i % files].write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        for h in handles:
            h.close()
        entries.append({"name": domain, "kind": "local", "path": str(folder / "*.jsonl"), "weight": len(docs),
                        "domain": {"cjk": "text"}.get(domain, domain)})  # a label with a filter rule set
    return {"entries": entries, "docs": {d: len(v) for d, v in per.items()},
            "bytes": sum(p.stat().st_size for p in (root / "data").rglob("*.jsonl"))}


def run_build(root: Path, workers: int, tag: str, pin: bool = False, repo: Path = ROOT) -> dict:
    """One `stacklm prebuild` in a child process: wall and CPU seconds, phase times. ``pin``:
    the build (and every process it starts) may use only ``workers`` cores -- the per-core
    comparison: a one-worker build overlaps its encoding with its Python work on a second
    thread, so unpinned it already uses more than one core of a two-core machine."""
    out = root / f"out-{tag}"
    env = {**os.environ, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, "-m", "stacklm.cli", "prebuild", "--config", str(root / "config.yaml"), "--tokenizer", str(root / "tok"),
           "--out", str(out), "--workers", str(workers)]
    t0 = time.perf_counter()
    cores = sorted(os.sched_getaffinity(0))[:workers] if pin else None
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.stdout.read()
    stderr = proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"prebuild --workers {workers} failed ({proc.returncode}):\n{stderr[-3000:]}")
    phases = {}  # from the last progress line: "(..., workers=2; index 0.1s, dedup 9.8s, jobs 30.2s, merge 0.1s)"
    for line in stderr.splitlines():
        if line.startswith("prebuild: ") and "; " in line:
            for part in line.rsplit("; ", 1)[1].rstrip(")").split(", "):
                name, secs = part.rsplit(" ", 1)
                phases[name] = float(secs.rstrip("s"))
    top = json.loads((out / "manifest.json").read_text())
    tokens = sum(s["n_tokens"] for s in top["splits"].values())
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "phases": phases, "tokens": tokens, "out": str(out)}


def profile_one(root: Path, top_n: int = 25) -> str:
    code = (
        "import cProfile, pstats, io, sys\n"
        "from stacklm.cli.app import main\n"
        f"argv = ['prebuild', '--config', {str(root / 'config.yaml')!r}, '--tokenizer', {str(root / 'tok')!r}, "
        f"'--out', {str(root / 'out-profile')!r}, '--workers', '1', '--no-progress']\n"
        "pr = cProfile.Profile(); pr.enable()\n"
        "try:\n    main(argv)\nexcept SystemExit:\n    pass\n"
        "pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats('tottime').print_stats(" + str(top_n) + ")\n"
        "print(s.getvalue())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    return res.stdout[-12000:] + res.stderr[-2000:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=34.0, help="corpus size in MB (the embedded corpus is ~34 MB)")
    ap.add_argument("--files", type=int, default=4, help="files per source")
    ap.add_argument("--synthetic", type=int, default=0, help="instead: this many synthetic documents per source (prose, code; ~2 kB each)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--pin", action="store_true", help="give each build only as many cores as --workers (the per-core rate)")
    ap.add_argument("--baseline", help="another checkout (e.g. a worktree of main) built side by side in every round")
    ap.add_argument("--root", help="work folder (default: a new temporary folder); an earlier run's folder is reused as it is")
    args = ap.parse_args()

    import warnings

    from stacklm.corpus import iter_default_corpus
    from stacklm.tokenizer.training import train_from_iterable

    root = Path(args.root or tempfile.mkdtemp(prefix="prebuild_workers_"))
    if (root / "corpus.json").exists():  # a --root of an earlier run: its corpus, tokenizer and config again
        corpus = json.loads((root / "corpus.json").read_text())
        for old in root.glob("out-*"):
            shutil.rmtree(old)
    else:
        corpus = write_corpus(root, args.mb, args.files, args.synthetic)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = train_from_iterable(iter_default_corpus(3_000_000), 8192).tokenizer
        (root / "tok").mkdir()
        tok.save(root / "tok" / "tokenizer.stacklm.json")
        pipeline = {"seq_len": 2048, "batch_size": 8, "seed": 0, "holdout_fraction": 0.005, "tokenize_batch_docs": 64,
                    "num_threads": 1, "dedup": {"exact": True, "near": True},
                    "mix": {"name": "bench", "total_tokens": 10**12, "entries": corpus["entries"]}}
        (root / "config.yaml").write_text(json.dumps({"data": {"pipeline": pipeline}}))
        (root / "corpus.json").write_text(json.dumps(corpus))
    print(f"corpus: {sum(corpus['docs'].values()):,} documents, {corpus['bytes'] / 1e6:.1f} MB in {len(corpus['entries'])} sources x "
          f"{args.files} files ({corpus['docs']}); {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")

    trees = [("this tree", ROOT)] + ([("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    best: dict[tuple[str, int], dict] = {}
    for r in range(args.rounds):
        for w in args.workers:
            for label, repo in trees:
                res = run_build(root, w, f"w{w}-r{r}-{label.replace(' ', '_')}", pin=args.pin, repo=repo)
                print(f"round {r}: {label}: --workers {w}: {res['wall']:.1f} s wall, {res['cpu']:.1f} s CPU, {res['tokens']:,} tokens, "
                      f"phases {json.dumps({k: round(v, 1) for k, v in res['phases'].items()})}", flush=True)
                if (label, w) not in best or res["wall"] < best[label, w]["wall"]:
                    best[label, w] = res
    pinned = ", each build pinned to as many cores as workers" if args.pin else ""
    print(f"\nbest of {args.rounds} rounds{pinned} (load average now {os.getloadavg()[0]:.2f}):")
    for (label, w), res in best.items():
        base = best[label, args.workers[0]]
        print(f"{label:>9}  --workers {w}: {res['wall']:7.1f} s wall  {res['cpu']:7.1f} s CPU  speed-up {base['wall'] / res['wall']:.2f}x  "
              f"CPU {res['cpu'] / base['cpu']:.2f}x  {res['tokens'] / res['wall'] / 1e6:.2f} M tok/s  "
              f"(at the CPU bound of {min(w, os.cpu_count() or 1)} cores: {res['cpu'] / min(w, os.cpu_count() or 1) / res['wall']:.0%})")
    if args.profile:
        print("\nprofile of --workers 1 (main process, by own time):")
        print(profile_one(root))


if __name__ == "__main__":
    main()
