"""Streaming-pipeline benchmark, side by side in one run on the same real documents.

    python3 bench/pipeline.py [--mb 20] [--dedup-docs 4000] [--vocab 32768] [--only-e2e] [--profile FILE]

1. near dedup (signatures + LSH) vs datasketch           -> bench/dedup.py's run()
2. tokenize stage (TokenizeNode) vs raw tiktoken          -> MB/s, ratio (target >= 90%)
3. the whole graph end to end (local jsonl sources, one per domain; filter, dedup, tokenize,
   mix, shuffle, best-fit pack, batch) vs raw tiktoken on every document, per CPU-second:
   one process with the global dedup index (stack-100m's setting), in-flight dedup, dedup
   off; 2 loader workers with the global index; both again on a 32-document corpus (the fixed start)
                                                          -> tokens per CPU-s, ratio (target >= 1.0x
                                                             with the global index; workers within
                                                             1.2x one process's CPU per token)
4. packing waste greedy vs best-fit at 2048               -> bench/packing.py's run()
5. pipeline state size, and how it grows per million documents

Documents are the embedded corpus (stdlib code, docstrings, pydoc topics, CJK, math).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import sys
import tempfile
import time
import warnings
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from stacklm.corpus import iter_default_corpus, iter_default_documents  # noqa: E402


def _tokenizer(vocab: int, mb: float):
    from stacklm.tokenizer.training import train_from_iterable

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train_from_iterable(iter_default_corpus(int(mb * 1e6)), vocab).tokenizer


def _raw_tiktoken(tok, texts: list[str], threads: int) -> tuple[float, int]:
    enc = tok.to_tiktoken()
    enc.encode_ordinary_batch(texts[:200], num_threads=threads)  # warm-up
    t = time.perf_counter()
    out = enc.encode_ordinary_batch(texts, num_threads=threads)
    return time.perf_counter() - t, sum(map(len, out))


def bench_tokenize(tok, texts: list[str], threads: int, rounds: int = 3) -> dict:
    """TokenizeNode vs raw tiktoken on the same texts, interleaved rounds, best of each."""
    from torchdata.nodes import IterableWrapper

    from stacklm.data.tokenizing import TokenizeNode

    nbytes = sum(len(t.encode()) for t in texts)
    docs = [{"text": t, "source": "stdlib", "domain": "mixed", "doc_id": str(i)} for i, t in enumerate(texts)]
    raw_s = node_s = float("inf")
    for _ in range(rounds):
        secs, n_tokens = _raw_tiktoken(tok, texts, threads)
        raw_s = min(raw_s, secs)
        node = TokenizeNode(IterableWrapper(docs), tok, batch_docs=256, num_threads=threads)
        t = time.perf_counter()
        got = sum(int(d["ids"].size) for d in node)
        node_s = min(node_s, time.perf_counter() - t)
        assert got == n_tokens, (got, n_tokens)
    return {"raw_MBps": nbytes / raw_s / 1e6, "node_MBps": nbytes / node_s / 1e6, "ratio": raw_s / node_s, "tokens": n_tokens}


def _write_sources(docs: list[tuple[str, str]], d: Path, files_per_source: int = 4) -> list[dict]:
    """One local jsonl source per domain, as a real mix routes them (web prose and the CJK
    texts through the prose rules, code through the code rules, math through the math rules),
    weighted by their share of the bytes so they run dry together; several files apiece so
    loader workers split them by whole files. Returns SourceConfig dicts."""
    route = {"prose": "prose", "cjk": "prose", "code": "code", "math": "math"}
    by_domain: dict[str, list[str]] = {}
    for domain, text in docs:
        by_domain.setdefault(route[domain], []).append(text)
    total = sum(len(t) for texts in by_domain.values() for t in texts)
    entries = []
    for domain, texts in sorted(by_domain.items()):
        files = []
        for k in range(files_per_source):
            path = d / f"{domain}{k}.jsonl"
            with open(path, "w") as f:
                for text in texts[k::files_per_source]:
                    f.write(json.dumps({"text": text}) + "\n")
            files.append(str(path))
        weight = sum(map(len, texts)) / total
        entries.append({"name": domain, "kind": "local", "weight": weight, "domain": domain, "data_files": files})
    return entries


class _WorkerCPU:
    """User + system CPU seconds of loader worker processes, read with psutil while they live:
    sampled every few batches, so a worker that exits before the end keeps its last reading."""

    def __init__(self, pids: list[int]) -> None:
        self.seen = dict.fromkeys(pids, 0.0)

    def sample(self) -> float:
        import psutil

        for pid in self.seen:
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.NoSuchProcess:
                continue
            self.seen[pid] = t.user + t.system
        return sum(self.seen.values())


# The dedup settings the end-to-end rows compare: stack-100m's (the global index, in-flight off),
# in-flight exact + near, and none. The global index is built once by ``build_dedup_index``
# (``stacklm dedup-index``'s code) over the same sources and bound to them.
DEDUP_ROWS = ("global", "inflight", "off")


def bench_end_to_end(tok, docs: list[tuple[str, str]], threads: int, seq_len: int = 2048, workers: int = 2, rounds: int = 3,
                     profile: Path | None = None, planes: str = "lean") -> dict:
    """Tokens out of the whole graph per CPU-second (and per wall second), from start to the
    last batch (buffer fills included), side by side with raw tiktoken on every document:
    in-process (one reader) with each of ``DEDUP_ROWS``, and through ``StackDataLoader`` with
    ``workers`` forkserver processes (as the datamodule starts them), global index, each reading
    its own files. CPU is what the process used (``time.process_time``: all its threads); with
    workers, the main process's plus each worker's (psutil, read while they are alive). Rows
    are interleaved for ``rounds`` rounds and each keeps its best, so load elsewhere on the
    machine does not decide the ratio. The "tiny" rows run the first 8 documents of each
    domain: a run's fixed cost (worker start, tokenizer load, graph build), subtracted to
    compare workers with one process per token beyond it. ``profile``: also cProfile one
    in-process global-index run's main thread and write its stats there."""
    from stacklm.data.pipeline import PipelineConfig, build_pipeline
    from stacklm.datamodule import DEFAULT_SNAPSHOT_STEPS, PipelineBuilder, StackDataLoader, StreamDataset
    from stacklm.datamodule.workers import WorkerEnv, worker_context
    from stacklm.prebuild.dedup_pass import build_dedup_index

    texts = [text for _, text in docs]
    out: dict = {"workers": workers}
    # the first documents of each domain: what a run costs before its data does (start, load, build)
    tiny = [dt for domain in ("prose", "cjk", "code", "math") for dt in [x for x in docs if x[0] == domain][:8]]
    with tempfile.TemporaryDirectory() as d:
        tok_dir = Path(d) / "tok"
        tok.save(tok_dir / "tokenizer.stacklm.json")

        def configs(corpus: list[tuple[str, str]], name: str) -> dict:
            (Path(d) / name).mkdir()
            base = {"mix": {"name": "bench", "total_tokens": 10**12, "entries": _write_sources(corpus, Path(d) / name)},
                    "seq_len": seq_len, "batch_size": 8, "holdout_fraction": 0.0, "num_threads": threads}
            index_path = Path(d) / name / "dedup.npz"
            t = time.perf_counter()
            build_dedup_index(PipelineConfig.from_dict({**base, "dedup": {"exact": True, "near": True}}), ("train",), 1, out=index_path)
            out.setdefault("index_build_s", time.perf_counter() - t)
            cfgs = {
                "global": PipelineConfig.from_dict({**base, "dedup": {"index": str(index_path), "exact": False, "near": False}}),
                "inflight": PipelineConfig.from_dict({**base, "dedup": {"exact": True, "near": True}}),
                "off": PipelineConfig.from_dict({**base, "dedup": {"exact": False, "near": False}}),
            }
            # the processes are the parallelism: one encode thread each
            cfgs["workers"] = PipelineConfig.from_dict({**cfgs["global"].to_dict(), "num_threads": 1, "planes": planes})
            return cfgs

        corpora = {"full": configs(docs, "full"), "tiny": configs(tiny, "tiny")}

        def raw() -> tuple[float, float, int]:
            c0 = time.process_time()
            secs, n = _raw_tiktoken(tok, texts, threads)
            return secs, time.process_time() - c0, n

        def in_process(dedup: str, corpus: str = "full") -> tuple[float, float, int]:
            c, t = time.process_time(), time.perf_counter()
            p = build_pipeline(corpora[corpus][dedup], tok)
            n = sum(int((b["input_ids"] != tok.pad_id).sum()) for b in p.batches)
            secs, cpu = time.perf_counter() - t, time.process_time() - c
            stats = p.stats()
            out.setdefault("stats", {})[f"{corpus}/{dedup}"] = {"dedup": stats.get("dedup"), "filter": stats.get("filter"),
                                                                "state_bytes": len(pickle.dumps(p.batches.state_dict()))}
            return secs, cpu, n

        def with_workers(corpus: str = "full", n_workers: int = workers) -> tuple[float, float, int]:
            """The datamodule's loader (``StackDataLoader`` over ``StreamDataset``, as a fit runs it)
            with ``n_workers`` worker processes, or in this process (0)."""
            cfg = corpora[corpus]["workers"]
            ds = StreamDataset(PipelineBuilder(cfg, str(tok_dir), "train"), split="train", rank=0,
                               world_size=1, n_batches_total=10**9, batch_size=8, seq_len=seq_len, pad_id=tok.pad_id,
                               sources=[e.name for e in cfg.mix.entries], target_weights=dict(cfg.mix.weights))
            procs = dict(multiprocessing_context=worker_context(), worker_init_fn=WorkerEnv(os.environ)) if n_workers else {}
            loader = StackDataLoader(ds, batch_size=None, num_workers=n_workers, snapshot_every_n_steps=DEFAULT_SNAPSHOT_STEPS,
                                     persistent_workers=False, **procs)
            c, t = time.process_time(), time.perf_counter()
            n, last, dry, first, cpus = 0, t, 0, None, None
            it = iter(loader)
            for k, b in enumerate(it):
                if first is None:
                    first = time.perf_counter() - t
                    cpus = _WorkerCPU([w.pid for w in loader._iterator._workers]) if n_workers else None  # torch's worker processes
                if cpus is not None and k % 16 == 0:
                    cpus.sample()
                real = int((b["input_ids"] != tok.pad_id).sum())  # either planes: a dry reader's batches are all padding
                if not real:  # a worker ran dry: stop once all have
                    dry += 1
                    if dry >= 2 * max(1, n_workers):
                        break
                    continue
                dry = 0
                n += real
                last = time.perf_counter()
            main_cpu = time.process_time() - c
            worker_cpu = cpus.sample() if cpus is not None else 0.0
            if n_workers:
                out.setdefault("worker_runs", []).append({"corpus": corpus, "main_cpu": round(main_cpu, 3), "worker_cpu": round(worker_cpu, 3),
                                                          "first_batch_s": round(first or 0.0, 3)})
            del it
            return last - t, main_cpu + worker_cpu, n

        rows = {"raw": raw, **{f"one/{k}": functools.partial(in_process, k) for k in DEDUP_ROWS},
                "loader 0 workers/global": functools.partial(with_workers, n_workers=0), "workers/global": with_workers,
                "tiny one/global": functools.partial(in_process, "global", "tiny"),
                "tiny loader 0 workers/global": functools.partial(with_workers, "tiny", n_workers=0),
                "tiny workers/global": functools.partial(with_workers, "tiny")}
        best = {name: (float("inf"), float("inf"), 0) for name in rows}
        for _ in range(rounds):
            for name, fn in rows.items():
                secs, cpu, n = fn()
                best[name] = (min(best[name][0], secs), min(best[name][1], cpu), n)  # n is the same every round
        if profile is not None:
            import cProfile

            prof = cProfile.Profile(time.thread_time)  # the main thread's CPU: its waits on the encode threads are not work
            prof.enable()
            in_process("global")
            prof.disable()
            prof.dump_stats(str(profile))
    raw_per_cpu = best["raw"][2] / best["raw"][1]
    out["rows"] = {name: {"tokens": n, "wall_s": secs, "cpu_s": cpu, "tokens_per_cpu_s": n / cpu, "tokens_per_s": n / secs,
                          "vs_raw_per_cpu": n / cpu / raw_per_cpu}
                   for name, (secs, cpu, n) in best.items()}
    # what the data costs beyond a run's fixed start (the tiny corpus's CPU): per token, workers vs one process
    for kind in ("one/global", "loader 0 workers/global", "workers/global"):
        (_, cpu, n), (_, cpu0, n0) = best[kind], best[f"tiny {kind}"]
        out["rows"][kind]["marginal_tokens_per_cpu_s"] = (n - n0) / (cpu - cpu0)
    return out


def print_profile(path: Path, top: int = 10) -> None:
    """The main thread's top functions by own CPU time, with their share of its total."""
    import pstats

    st = pstats.Stats(str(path))
    total = st.total_tt
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    print(f"main thread: {total:.2f} CPU-s profiled (cProfile's own overhead included)")
    print("| own s | share | cum s | calls | function |\n|---:|---:|---:|---:|---|")
    for (file, line, fn), (_cc, calls, tt, ct, _callers) in rows:
        where = f"{Path(file).name}:{line}" if line else file
        print(f"| {tt:.2f} | {tt / total:.1%} | {ct:.2f} | {calls} | {fn} ({where}) |")


def state_growth(tok, texts: list[str]) -> dict:
    """State bytes after n and 2n documents: the slope is the per-document growth (dedup indexes)."""
    from stacklm.data.dedup import ExactDeduper, NearDeduper

    n = len(texts) // 2
    sizes = []
    for k in (n, 2 * n):
        ex, near = ExactDeduper(), NearDeduper()
        for t in texts[:k]:
            if not ex.is_duplicate(t):
                near.is_duplicate(t)
        sizes.append(len(pickle.dumps((ex.state_dict(), near.state_dict()))))
    per_doc = (sizes[1] - sizes[0]) / n
    return {"per_doc_bytes": per_doc, "per_million_docs_MB": per_doc * 1e6 / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=20.0, help="MB of real documents")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dedup-docs", type=int, default=4000)
    ap.add_argument("--skip-dedup", action="store_true")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the end-to-end rows (each keeps its best)")
    ap.add_argument("--planes", choices=("lean", "full"), default="lean", help="the loader rows' batch planes (the datamodule's default: lean)")
    ap.add_argument("--only-e2e", action="store_true", help="section 3 only (the end-to-end rows)")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile one in-process global-index run; print its top 10")
    args = ap.parse_args()

    docs = list(iter_default_documents(int(args.mb * 1e6)))
    texts = [text for _, text in docs]
    print(f"corpus: {len(texts)} documents, {sum(len(t.encode()) for t in texts) / 1e6:.1f} MB")
    tok = _tokenizer(args.vocab, 20)

    if not (args.skip_dedup or args.only_e2e):
        import dedup as dedup_bench

        print("\n== 1. near dedup vs datasketch")
        res = dedup_bench.run(args.dedup_docs)
        print(json.dumps(res, indent=1, default=str))

    if not args.only_e2e:
        print(f"\n== 2. tokenize stage vs raw tiktoken ({args.threads} threads)")
        r = bench_tokenize(tok, texts, args.threads)
        print(f"raw tiktoken {r['raw_MBps']:.1f} MB/s | TokenizeNode {r['node_MBps']:.1f} MB/s | ratio {r['ratio']:.0%} (target >= 90%)")

    print("\n== 3. whole graph end to end vs raw tiktoken, per CPU-second")
    e = bench_end_to_end(tok, docs, args.threads, rounds=args.rounds, profile=args.profile, planes=args.planes)
    print(f"global dedup index built in {e['index_build_s']:.1f}s")
    print("| row | tokens | wall s | CPU s | M tok per CPU-s | M tok/s | vs raw per CPU-s |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, r in e["rows"].items():
        print(f"| {name} | {r['tokens']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['tokens_per_cpu_s'] / 1e6:.2f} "
              f"| {r['tokens_per_s'] / 1e6:.2f} | {r['vs_raw_per_cpu']:.2f}x |")
    one, wk = e["rows"]["loader 0 workers/global"], e["rows"]["workers/global"]
    graph = e["rows"]["one/global"]
    print(f"the loader, {e['workers']} workers vs in this process, CPU per token: {one['tokens_per_cpu_s'] / wk['tokens_per_cpu_s']:.2f}x "
          f"all in, {one['marginal_tokens_per_cpu_s'] / wk['marginal_tokens_per_cpu_s']:.2f}x beyond the fixed start (the tiny rows' "
          f"CPU; target <= 1.2x); the loader in this process vs the bare graph: "
          f"{graph['marginal_tokens_per_cpu_s'] / one['marginal_tokens_per_cpu_s']:.2f}x\nworker runs: {e['worker_runs']}")
    for name, st in e["stats"].items():
        print(f"{name}: {st}")
    if args.profile:
        print_profile(args.profile)
    if args.only_e2e:
        return

    print("\n== 4. packing waste at 2048 (best-fit vs greedy)")
    import packing as packing_bench

    ids = [a for a in tok.encode_batch_numpy(texts, num_threads=args.threads)]
    pk = packing_bench.run(seq_len=2048, buffers=(100, 1000), token_docs=ids, vocab_size=tok.vocab_size)
    for row in pk["rows"]:
        print(f"{row['strategy'] + ('*' if row.get('unbounded_wait') else ''):<9} buffer={row.get('buffer_docs')!s:<5} "
              f"pad={row['pad_fraction']:.3%} "
              f"docs_cut={row['docs_cut']} fitting_docs_cut={row['fitting_docs_cut']} windows={row['windows']}")

    print("\n== 5. state growth")
    g = state_growth(tok, texts[:4000])
    print(f"dedup indexes: {g['per_doc_bytes']:.0f} bytes/document -> {g['per_million_docs_MB']:.0f} MB per million documents "
          "(everything else in the state is bounded by buffer sizes)")


if __name__ == "__main__":
    main()
