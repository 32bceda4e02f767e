"""Shard loader speed vs raw memmap slicing, and prebuild throughput, in one run.

    python3 bench/loader.py [--batch 8] [--seq-len 2048] [--seconds 3] [--prebuild-tokens 400000]
    python3 bench/loader.py --skip-loading --skip-prebuild --stream-seconds 20   # stream mode only
    python3 bench/loader.py --verify-only [--rows 8192]                           # the content-hash check only
    python3 bench/loader.py --remote-only [--remote-rows 8192]                    # s3:// (moto on localhost) vs local

Part 1 — loading. Real text (``stacklm.corpus``) tokenized by a small BPE trained here, packed
best-fit into ``seq_len`` windows and written as shards (tiled to ``--rows`` rows, several
shards, so reads hit the page cache rather than the CPU cache). Every variant reads the same
random batches of rows (the same index arrays, in the same order):

* ``raw``: ``np.memmap`` slicing of the rows (shard and row precomputed, i.e. free) into
  ``torch.long`` ``input_ids``/``targets`` (the shift by one, nothing document-aware): what a
  loader without the batch contract does;
* ``PackedMemmapDataset.get_batch``: index lookup (searchsorted) + the full batch contract
  (``input_ids``, ``position_ids``, ``seq_ids``, masked ``targets``);
* ``pack.collate`` on the same rows: the streaming pipes' reference derivation;
* both again through ``torch.utils.data.DataLoader`` (main process, ``batch_size=None`` over a
  batch sampler), since that is how a trainer consumes them; and per-item ``ds[i]`` + the
  default collate (what ``DistributedSampler`` with ``batch_size=B`` does).

Part 1b — the content-hash check (``--skip-verify`` to leave out, ``--verify-only`` for just
this). ``PackedMemmapDataset(verify_content=True)`` (the default) hashes each shard the first
time a process reads it. Side by side, on the same shards, one whole epoch in the sampler's
random order through ``get_batch`` with the check on and off, each from a fresh dataset (a
fresh process state, as a new loader worker has): a cold-ish first pass (the shard files
dropped from the page cache with ``posix_fadvise(DONTNEED)`` before it, so both variants read
them from disk), a warm first pass (files cached, nothing checked yet) and a second pass
(everything checked: the steady state of a long run). The ratio is the check's cost in loader
throughput.

Part 3 — stream mode (``--skip-stream`` to leave out). ``StackDataModule(mode="stream")`` over
real text (the embedded corpus written as jsonl files, a local source) with exact + near
dedup and best-fit packing, ``--stream-workers`` loader workers: time to the first batch with
each worker start method (``fork``, ``forkserver`` cold and warm, ``spawn``), then steady
tokens/s delivered (non-pad tokens of the batches, from ``data_stats()``) and batches/s.

Part 4 — object storage (``--skip-remote`` to leave out, ``--remote-only`` for just this). The
same shards uploaded to moto's S3 server on localhost (``tests/helpers/s3_server.py``: a real S3
protocol over HTTP, through s3fs; no network, so this measures the code path and the server's
speed, not a cloud store's), read three ways, each from a fresh dataset: the local directory
(memmap), ``s3://`` with a cold cache (an empty ``STACKLM_CACHE_DIR``: manifests, then every
shard downloaded and hash-checked) and ``s3://`` with a warm cache (the mirror is there: only the
manifests are read); then the bounded cache: ``s3://`` streamed into a cache of a quarter of the
set (``shard_window``, ``prefetch``: a prefetcher thread fetching ahead of the reader, cold), and
the local memmap read in that same window order. Time to the first batch (dataset open + first
``get_batch``, content check on), and one epoch's throughput including that start-up, against
the local one.

Part 2 — prebuild. The demo mix (offline synthetic sources) with ``--workers 1`` and ``2``:
MB of raw text read per second per worker (text bytes of every document the sources read,
recomputed exactly from the manifest's per-task counts) and the 1 -> 2 worker speed-up.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from stacklm.configs import CONFIG_DIR
from stacklm.corpus import iter_default_corpus
from stacklm.data.contract import full_batch
from stacklm.data.storage import manifest as mf
from stacklm.data.storage.dataset import PackedMemmapDataset
from stacklm.datamodule.resume.sampler import ElasticSampler
from stacklm.data.packing.pack import collate, pack_best_fit
from stacklm.data.storage.shards import dtype_name, open_tokens, token_dtype, write_shard


def build_shards(directory: Path, tok, seq_len: int, rows: int, rows_per_shard: int, text_bytes: int) -> None:
    texts = list(iter_default_corpus(text_bytes))
    ids = tok.encode_batch(texts, num_threads=2)
    docs = [{"ids": np.asarray(x, dtype=np.int32), "source": "corpus"} for x in ids if x]
    rng = np.random.default_rng(0)
    docs = [docs[i] for i in rng.permutation(len(docs))]
    windows = np.stack(list(pack_best_fit(docs, seq_len, tok.bos_id, tok.eos_id, tok.pad_id, buffer_docs=256)))
    tiled = windows[np.arange(rows) % len(windows)]
    dtype = token_dtype(tok.vocab_size)
    directory.mkdir(parents=True)
    infos = [write_shard(directory, k, tiled[lo : lo + rows_per_shard], dtype).to_dict() for k, lo in enumerate(range(0, rows, rows_per_shard))]
    mf.write_manifest(directory, {
        "format": mf.FORMAT, "version": mf.VERSION, "split": "train", "seq_len": seq_len, "dtype": dtype_name(dtype),
        "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id,
        "tokenizer_hash": mf.tokenizer_hash(tok), "shards": infos, "n_seq": rows,
    })
    starts = (windows == tok.bos_id).sum() / len(windows)
    print(f"shards: {rows:,} rows x {seq_len} ({len(infos)} shards, {rows * seq_len * dtype.itemsize / 1e6:.0f} MB); "
          f"{len(windows)} distinct windows of real text, {starts:.1f} documents starting per window")


def timed(fn, batches: list[np.ndarray], seconds: float) -> float:
    """Batches per CPU-second of this process: cycle through the index batches for ``seconds``
    of CPU time (per CPU-second, not wall: the same cores feed several GPUs)."""
    fn(batches[0])  # warm up
    n, t0 = 0, time.process_time()
    while True:
        for b in batches:
            fn(b)
        n += len(batches)
        if time.process_time() - t0 >= seconds:
            return n / (time.process_time() - t0)


def bench_loading(args, tok) -> list[tuple[str, float]]:
    tmp = Path(tempfile.mkdtemp(prefix="stacklm-bench-"))
    build_shards(tmp / "train", tok, args.seq_len, args.rows, args.rows_per_shard, args.text_bytes)
    ds = PackedMemmapDataset(tmp)
    maps = [open_tokens(ds.path, n, ds.dtype, int(r), ds.seq_len).view(np.ndarray) for n, r in zip(ds.shard_names, ds.shard_rows)]
    sampler = ElasticSampler(ds, args.batch, seed=0, rank=0, world_size=1)
    batches = [b for b, _ in zip(sampler.batches(), range(2048))]
    located = {id(b): ds.locate(b) for b in batches}  # raw gets its (shard, row) for free
    specials = (ds.bos_id, ds.eos_id, ds.pad_id)

    def raw(b):
        shard, row = located[id(b)]
        rows = np.stack([maps[s][r] for s, r in zip(shard.tolist(), row.tolist())])
        return torch.from_numpy(rows[:, :-1].astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64))

    def ours(b):
        return ds.get_batch(b)

    lean_ds = PackedMemmapDataset(tmp, planes="lean")

    def lean(b):
        return lean_ds.get_batch(b)

    lean_fixed = lean_ds.get_batch(batches[0])

    def derive_on_cpu(_):  # what the device derives from a lean batch, here on the CPU for scale
        return full_batch(lean_fixed)

    def reference(b):
        return collate(ds.rows(b), *specials)

    class RawDataset(torch.utils.data.Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, b):
            return raw(b)

    def through_loader(dataset, per_item=False):
        def run(_):
            if per_item:
                loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, sampler=[i for b in batches for i in b.tolist()])
            else:
                loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=batches)
            for _ in loader:
                pass
        return run

    s = args.seconds
    results = [
        ("raw memmap slicing -> long input/targets", timed(raw, batches, s)),
        ("PackedMemmapDataset.get_batch (contract)", timed(ours, batches, s)),
        ("PackedMemmapDataset.get_batch (lean planes)", timed(lean, batches, s)),
        ("pack.collate on the same rows", timed(reference, batches, s)),
        ("derive_planes from lean, on CPU (for scale)", timed(derive_on_cpu, batches, s)),
    ]
    results += bench_shards_loader(args, lean_ds, s)
    results += bench_litdata(args, tmp, batches, s)
    for name, dataset, per_item in (("raw", RawDataset(), False), ("PackedMemmapDataset", ds, False),
                                    ("PackedMemmapDataset lean", lean_ds, False), ("PackedMemmapDataset per-item", ds, True)):
        t0 = time.process_time()
        reps = 0
        while time.process_time() - t0 < s:
            through_loader(dataset, per_item)(None)
            reps += 1
        results.append((f"DataLoader: {name}", reps * len(batches) / (time.process_time() - t0)))
    return results


def cpu_all() -> float:
    """CPU seconds of this process plus its finished children (loader workers, once joined)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def epochs_per_cpu(make_loader, seconds: float) -> float:
    """Batches per CPU-second of every process involved (workers included): whole epochs of a
    fresh loader until ``seconds`` of CPU, so each epoch's workers are joined and counted."""
    for _ in make_loader():  # warm up: page cache, imports in the workers
        pass
    n, t0 = 0, cpu_all()
    while cpu_all() - t0 < seconds or n == 0:
        for _ in make_loader():
            n += 1
    return n / (cpu_all() - t0)


def bench_shards_loader(args, lean_ds, seconds: float) -> list[tuple[str, float]]:
    """The datamodule's own loader (``ShardsLoader``, lean planes) over one epoch of the rows, in
    the main process and with ``--loader-workers`` workers (CPU of all processes)."""
    from stacklm.datamodule.shards_loader import ShardsLoader

    sampler = ElasticSampler(lean_ds, args.batch, seed=0, rank=0, world_size=1)

    def make(workers):
        return lambda: ShardsLoader(lean_ds, sampler, batch_size=args.batch, rank=0, world_size=1, num_workers=workers)
    w = args.loader_workers
    return [("ShardsLoader lean (main process)", epochs_per_cpu(make(0), seconds)),
            (f"ShardsLoader lean ({w} workers, CPU of all)", epochs_per_cpu(make(w), seconds))]


def bench_litdata(args, tmp: Path, batches: list[np.ndarray], seconds: float) -> list[tuple[str, float]]:
    """litdata on the same rows (``bench/litdata_rows.py``): ``StreamingDataset`` + ``TokensLoader``
    read per item for the same index batches and stacked (what its loader's collate does), and its
    own ``StreamingDataLoader`` in its own shuffled order (main process). Both deliver the uint16
    token block only: no targets, no document boundaries. Left out when litdata is not installed."""
    try:
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader
        from litdata_rows import write_litdata
    except ImportError:
        print("litdata is not installed: its rows are left out (pip install --no-deps litdata==0.2.76 obstore tifffile)")
        return []
    out = write_litdata(tmp / "litdata", tmp)
    lit = StreamingDataset(str(out), item_loader=TokensLoader(block_size=args.seq_len), shuffle=False)
    assert len(lit) == args.rows and torch.equal(lit[5].long(), torch.from_numpy(PackedMemmapDataset(tmp).rows(np.array([5]))[0].astype(np.int64)))

    def per_item(b):
        return torch.stack([lit[i] for i in b.tolist()])

    def own_loader(n: int):
        ds = StreamingDataset(str(out), item_loader=TokensLoader(block_size=args.seq_len), shuffle=True, seed=0)
        loader = StreamingDataLoader(ds, batch_size=args.batch, num_workers=0)
        t0, done = time.process_time(), 0
        while done < n:
            for _ in loader:
                done += 1
                if done == n:
                    break
        return done / (time.process_time() - t0)

    own_loader(16)  # warm up: index files, first chunks mapped
    n = max(64, round(timed(per_item, batches[:64], min(seconds, 1.0)) * seconds))

    def with_workers():
        ds = StreamingDataset(str(out), item_loader=TokensLoader(block_size=args.seq_len), shuffle=True, seed=0)
        return StreamingDataLoader(ds, batch_size=args.batch, num_workers=args.loader_workers)
    return [("litdata StreamingDataset[i] + stack (same rows)", timed(per_item, batches, seconds)),
            ("litdata StreamingDataLoader (own order, main proc)", own_loader(n)),
            (f"litdata StreamingDataLoader ({args.loader_workers} workers, CPU of all)", epochs_per_cpu(with_workers, seconds))]


def _evict(paths: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (no root needed), so the next read is cold."""
    import os

    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_verify(args, tok) -> None:
    """Part 1b: an epoch through ``get_batch`` with and without the content-hash check."""
    from stacklm.data.storage.shards import tokens_path

    tmp = Path(tempfile.mkdtemp(prefix="stacklm-bench-verify-"))
    build_shards(tmp / "train", tok, args.seq_len, args.rows, args.rows_per_shard, args.text_bytes)
    probe = PackedMemmapDataset(tmp, verify_content=False)
    files = [tokens_path(probe.path, name) for name in probe.shard_names]
    sampler = ElasticSampler(probe, args.batch, seed=0, rank=0, world_size=1, loop=False)
    batches = list(sampler.batches())  # one epoch, every row once, in random order
    mb = sum(f.stat().st_size for f in files) / 1e6

    def epoch(ds) -> float:
        t0 = time.perf_counter()
        for b in batches:
            ds.get_batch(b)
        return len(batches) / (time.perf_counter() - t0)

    print(f"\ncontent-hash check: {len(files)} shards, {mb:.0f} MB, one epoch = {len(batches)} batches of B={args.batch}, "
          f"T={args.seq_len - 1} in random order, get_batch in one process")
    print(f"{'pass':34s} {'check off b/s':>14s} {'check on b/s':>13s} {'on/off':>7s}")
    for label, cold in (("first pass, page cache dropped", True), ("first pass, files cached", False)):
        rates = {}
        for verify in (False, True, False, True):  # twice each, interleaved; the better of two
            ds = PackedMemmapDataset(tmp, verify_content=verify, sample_rows=0)
            if cold:
                _evict(files)
            rates[verify] = max(rates.get(verify, 0.0), epoch(ds))
        print(f"{label:34s} {rates[False]:14,.0f} {rates[True]:13,.0f} {rates[True] / rates[False]:7.1%}")
    on = PackedMemmapDataset(tmp, sample_rows=0)
    off = PackedMemmapDataset(tmp, verify_content=False, sample_rows=0)
    epoch(on)  # every shard checked from here on
    r_off, r_on = max(epoch(off), epoch(off)), max(epoch(on), epoch(on))
    print(f"{'second pass (all checked)':34s} {r_off:14,.0f} {r_on:13,.0f} {r_on / r_off:7.1%}")
    # The check alone, files cached: less noisy than the difference of two timed epochs on a busy machine.
    hash_s = min(_time_hashes(on) for _ in range(3))
    epoch_s = len(batches) / max(r_off, rates[False])
    print(f"hashing all {len(files)} shards alone: {hash_s * 1e3:.1f} ms ({mb / 1e3 / hash_s:.2f} GB/s) = {hash_s / epoch_s:.1%} of one "
          f"epoch's get_batch time ({epoch_s * 1e3:.0f} ms): a first pass runs at {epoch_s / (epoch_s + hash_s):.1%} of the "
          "unchecked throughput, later passes of the same process at 100%")


def _time_hashes(ds) -> float:
    from stacklm.data.storage.shards import check_content_hash

    t0 = time.perf_counter()
    for entry in ds.manifest["shards"]:
        check_content_hash(ds.path, entry, ds.path / "manifest.json")
    return time.perf_counter() - t0


def bench_remote(args, tok) -> None:
    """Part 4: local memmap vs ``s3://`` with a cold and a warm cache (see the module)."""
    import os

    from tests.helpers.s3_server import S3Server

    tmp = Path(tempfile.mkdtemp(prefix="stacklm-bench-remote-"))
    build_shards(tmp / "train", tok, args.seq_len, args.remote_rows, args.rows_per_shard, args.text_bytes)
    server = S3Server().start()
    os.environ.update(server.env())
    fs = server.filesystem()
    fs.mkdir("bench")
    t0 = time.perf_counter()
    fs.put(str(tmp) + "/", "bench/set", recursive=True)
    mb = sum(p.stat().st_size for p in (tmp / "train").glob("*.tokens.bin")) / 1e6
    print(f"\nobject storage: {mb:.0f} MB of shards uploaded to moto on localhost in {time.perf_counter() - t0:.1f}s")
    url = "s3://bench/set/train"  # build_shards writes one split directory
    probe = PackedMemmapDataset(tmp, verify_content=False, sample_rows=0)
    batches = list(ElasticSampler(probe, args.batch, seed=0, rank=0, world_size=1, loop=False).batches())

    def run(path, cache: Path) -> tuple[float, float]:
        os.environ["STACKLM_CACHE_DIR"] = str(cache)
        t0 = time.perf_counter()
        ds = PackedMemmapDataset(path)
        ds.get_batch(batches[0])
        first = time.perf_counter() - t0
        for b in batches[1:]:
            ds.get_batch(b)
        return first, len(batches) / (time.perf_counter() - t0)

    # The streamed variant: the order is shard-local (``shard_window``), the cache a quarter of
    # the set (2 x window shards); same get_batch loop, with the rank's prefetcher thread
    # (``prefetch.Prefetcher``) fetching ahead and releasing what the loop has passed.
    from stacklm.data.storage import remote
    from stacklm.data.storage.prefetch import Prefetcher, ShardCache

    n_shards = len(probe.shard_names)
    shard_bytes = int(probe.shard_rows.max()) * args.seq_len * 2
    window = max(1, n_shards // 8)
    limit = 2 * window * shard_bytes
    wbatches = list(ElasticSampler(probe, args.batch, seed=0, rank=0, world_size=1, loop=False, shard_window=window).batches())

    def run_streamed(path, cache_dir: Path) -> tuple[float, float, int]:
        os.environ["STACKLM_CACHE_DIR"] = str(cache_dir)
        t0 = time.perf_counter()
        if path == url:
            local = remote.mirror(url, stream=("train",))
            cache = ShardCache(url, local, mf.read_manifest(local), limit)
            ds = PackedMemmapDataset(local, cache=cache)
            pf = Prefetcher(cache, [np.unique(ds.locate(b)[0]) for b in wbatches])
        else:
            ds, pf, cache = PackedMemmapDataset(path), None, None
        ds.get_batch(wbatches[0])
        first = time.perf_counter() - t0
        for t, b in enumerate(wbatches[1:], start=1):
            if pf is not None:
                pf.advance(t)
            ds.get_batch(b)
        bps = len(wbatches) / (time.perf_counter() - t0)
        if pf is not None:
            pf.close()
        if cache is not None:
            fetched.append(cache.downloads)
        return first, bps, cache.peak if cache else 0

    results = {}
    peak, fetched = 0, []
    for rep in range(2):  # the better of two, each with fresh caches
        cache = tmp / f"cache{rep}"
        for name, path, c in (("local memmap", tmp, cache / "unused"), ("s3:// cold cache", url, cache / "s3"),
                              ("s3:// warm cache", url, cache / "s3")):
            first, bps = run(path, c)
            old = results.get(name)
            results[name] = (min(first, old[0]), max(bps, old[1])) if old else (first, bps)
        for name, path, c in ((f"local, window {window}", tmp, cache / "unused"),
                              ("s3:// streamed 1/4", url, cache / "streamed")):
            first, bps, p = run_streamed(path, c)
            peak = max(peak, p)
            old = results.get(name)
            results[name] = (min(first, old[0]), max(bps, old[1])) if old else (first, bps)
    server.stop()
    print(f"one epoch = {len(batches)} batches of B={args.batch}, T={args.seq_len - 1}, random order, get_batch in one "
          "process, content check on; batches/s include the start-up")
    print(f"streamed: {n_shards} shards of {shard_bytes / 1e6:.1f} MB, shard_window={window}, cache limit {limit / 1e6:.1f} MB "
          f"(2 x window shards; peak counted {peak / 1e6:.1f} MB), shards fetched per epoch {fetched}, cold cache, prefetcher thread in the same process; "
          "its order is the window order (the 'local, window' row reads the same order from the local memmap)")
    print(f"{'variant':20s} {'first batch s':>14s} {'batches/s':>10s} {'vs local':>9s}")
    local = results["local memmap"][1]
    for name, (first, bps) in results.items():
        print(f"{name:20s} {first:14.3f} {bps:10,.0f} {bps / local:9.1%}")


def text_bytes_read(out: Path, config) -> dict[str, int]:
    """Exact UTF-8 bytes of every document the synthetic sources read, per split, from the
    manifests' per-task counts (each worker reads documents worker, worker + N, ...)."""
    from stacklm.data.sources import synthetic_text

    entries = {e.name: e for e in config.mix.entries}
    total = {}
    for split in ("train", "val"):
        m = mf.read_manifest(out / split)
        n = len(m["tasks"])
        total[split] = 0
        for task in m["tasks"]:
            for src, count in task["docs_read"].items():
                e = entries[src]
                total[split] += sum(len(synthetic_text(task["worker"] + n * j, e.domain, e.seed).encode()) for j in range(count))
    return total


def bench_prebuild(args, tok) -> list[tuple[int, float, float]]:
    import dataclasses

    from stacklm.prebuild import load_config, prebuild

    config, _ = load_config(CONFIG_DIR / "demo.yaml")
    config = dataclasses.replace(config, mix=dataclasses.replace(config.mix, total_tokens=args.prebuild_tokens))
    rows = []
    for workers in (1, 2):
        out = Path(tempfile.mkdtemp(prefix="stacklm-bench-pb-")) / "shards"
        t0 = time.perf_counter()
        prebuild(config, tok, out, workers=workers, tokens_per_shard=1 << 16, progress=False)
        secs = time.perf_counter() - t0
        rows.append((workers, secs, text_bytes_read(out, config)))
    return rows


def bench_stream(args, tok) -> None:
    """Part 3: the stream loader on real text, per worker start method (module docstring)."""
    import json

    from stacklm.datamodule import StackDataModule
    from stacklm.datamodule.workers import worker_context

    tmp = Path(tempfile.mkdtemp(prefix="stacklm-stream-bench-"))
    tok_dir = tmp / "tok"
    tok.save(tok_dir / "tokenizer.stacklm.json")
    texts = list(iter_default_corpus(args.stream_text_bytes))
    texts = [texts[i] for i in np.random.default_rng(0).permutation(len(texts))]  # the corpus alternates code and prose
    for k in range(4):  # four files: each worker reads its own two
        with open(tmp / f"corpus{k}.jsonl", "w") as f:
            for t in texts[k::4]:
                f.write(json.dumps({"text": t}) + "\n")
    n_bytes = sum(len(t.encode()) for t in texts)
    pipeline = {
        "mix": {"name": "bench", "total_tokens": 10**12, "entries": [
            {"name": "corpus", "kind": "local", "path": str(tmp / "corpus*.jsonl"), "weight": 1.0, "domain": "code"}]},
        "strategy": "best_fit", "shuffle_buffer": 1000, "pack_buffer_docs": 256, "holdout_fraction": 0.0,
        "dedup": {"exact": True, "near": True}, "num_threads": 1,
    }

    def loader():
        dm = StackDataModule(mode="stream", tokenizer=str(tok_dir), pipeline=pipeline, seq_len=args.seq_len,
                             batch_size=args.batch, num_workers=args.stream_workers, val_batches=0)
        dm.setup("fit")
        return dm, dm.train_dataloader()

    print(f"\nstream mode: {n_bytes / 1e6:.1f} MB of real text (stacklm.corpus) as 4 jsonl files, exact + near dedup, best fit, "
          f"B={args.batch}, T={args.seq_len - 1}, {args.stream_workers} loader workers")
    print(f"{'start method':22s} {'first batch s':>14s}")
    for method, label in (("fork", "fork"), ("forkserver", "forkserver (cold)"), ("forkserver", "forkserver (warm)"),
                          ("spawn", "spawn")):
        _, ld = loader()
        ld.multiprocessing_context = worker_context(method)
        t0 = time.perf_counter()
        it = iter(ld)
        next(it)
        print(f"{label:22s} {time.perf_counter() - t0:14.2f}")
        del it
    dm, ld = loader()  # the default (forkserver, warm now): steady state
    it = iter(ld)
    next(it)
    start = dm.data_stats()["delivered"]
    t0 = time.perf_counter()
    n = 0
    dry = False
    while time.perf_counter() - t0 < args.stream_seconds:
        try:
            batch = next(it)
        except StopIteration:
            break
        if not bool((batch["input_ids"] != tok.pad_id).any()):  # the text ran out: padding batches from here
            dry = True
            break
        n += 1
    secs = time.perf_counter() - t0
    end = dm.data_stats()["delivered"]
    tokens = end["tokens"] - start["tokens"]
    positions = end["positions"] - start["positions"] - (batch["input_ids"].numel() if dry else 0)
    print(f"steady: {n} batches in {secs:.1f}s = {n / secs:.2f} batches/s, {tokens / secs:,.0f} delivered tokens/s "
          f"(non-pad), padding {1 - tokens / max(1, positions):.2%}" + (" (stopped: the text ran out)" if dry else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rows", type=int, default=16384, help="rows in the shard set (tiled from the real windows)")
    p.add_argument("--rows-per-shard", type=int, default=4096)
    p.add_argument("--text-bytes", type=int, default=6_000_000, help="real text to tokenize and pack")
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    p.add_argument("--prebuild-tokens", type=int, default=2_000_000, help="train budget of the prebuild runs")
    p.add_argument("--skip-prebuild", action="store_true")
    p.add_argument("--skip-loading", action="store_true")
    p.add_argument("--skip-stream", action="store_true")
    p.add_argument("--skip-verify", action="store_true", help="leave out part 1b (the content-hash check)")
    p.add_argument("--verify-only", action="store_true", help="run only part 1b (the content-hash check)")
    p.add_argument("--skip-remote", action="store_true", help="leave out part 4 (s3:// on moto vs local)")
    p.add_argument("--remote-only", action="store_true", help="run only part 4 (s3:// on moto vs local)")
    p.add_argument("--remote-rows", type=int, default=8192, help="rows in the shard set of part 4")
    p.add_argument("--loader-workers", type=int, default=2, help="workers of the ShardsLoader and litdata rows (part 1)")
    p.add_argument("--stream-workers", type=int, default=2)
    p.add_argument("--stream-seconds", type=float, default=20.0, help="steady-state measurement of the stream loader")
    p.add_argument("--stream-text-bytes", type=int, default=30_000_000, help="real text behind the stream source")
    args = p.parse_args()
    torch.set_num_threads(1)

    from stacklm.tokenizer.training import train_from_iterable

    tok = train_from_iterable(iter_default_corpus(1_000_000), 2048).tokenizer
    tokens_per_batch = args.batch * (args.seq_len - 1)
    if args.verify_only:
        bench_verify(args, tok)
        return
    if args.remote_only:
        bench_remote(args, tok)
        return
    if not args.skip_loading:
        report_loading(args, tok, tokens_per_batch)
    if not args.skip_verify:
        bench_verify(args, tok)
    if not args.skip_remote:
        bench_remote(args, tok)
    if not args.skip_stream:
        bench_stream(args, tok)
    if args.skip_prebuild:
        return
    rows = bench_prebuild(args, tok)
    print(f"\nprebuild (stacklm/configs/demo.yaml mix, train budget {args.prebuild_tokens:,} tokens + val holdout, seq_len 256)")
    print("text MB = raw text the sources read (train jobs + val jobs; the val jobs skip ~1/holdout of what they read)")
    print(f"{'workers':>7s} {'seconds':>8s} {'train MB':>9s} {'val MB':>7s} {'MB/s':>7s} {'MB/s/worker':>12s} {'speed-up':>9s}")
    base = sum(rows[0][2].values()) / rows[0][1]
    for workers, secs, nbytes in rows:
        total = sum(nbytes.values())
        mbs = total / 1e6 / secs
        print(f"{workers:7d} {secs:8.1f} {nbytes['train'] / 1e6:9.1f} {nbytes['val'] / 1e6:7.1f} {mbs:7.2f} {mbs / workers:12.2f} "
              f"{total / secs / base:9.2f}x")


def report_loading(args, tok, tokens_per_batch: int) -> None:
    results = bench_loading(args, tok)
    by = dict(results)
    raw = by["raw memmap slicing -> long input/targets"]
    raw_loader = by["DataLoader: raw"]
    print(f"\nloading: B={args.batch}, T={args.seq_len - 1} ({tokens_per_batch:,} tokens/batch), one process, torch threads=1, "
          "per CPU-second of the process")
    print(f"{'variant':46s} {'batches/s':>10s} {'M tok/s':>9s} {'vs raw':>7s}")
    for name, bps in results:
        base = raw_loader if "Loader" in name else raw
        print(f"{name:46s} {bps:10,.0f} {bps * tokens_per_batch / 1e6:9.1f} {bps / base:7.0%}")
    full, lean = by["PackedMemmapDataset.get_batch (contract)"], by["PackedMemmapDataset.get_batch (lean planes)"]
    lit = by.get("litdata StreamingDataLoader (own order, main proc)")
    w = args.loader_workers
    if lit is not None:
        lit_items = by["litdata StreamingDataset[i] + stack (same rows)"]
        lit_w = by[f"litdata StreamingDataLoader ({w} workers, CPU of all)"]
        print(f"vs litdata (which delivers the uint16 block only), target >= 1.5x: ShardsLoader lean "
              f"{by['ShardsLoader lean (main process)'] / lit:.2f}x its StreamingDataLoader in the main process, "
              f"{by[f'ShardsLoader lean ({w} workers, CPU of all)'] / lit_w:.2f}x with {w} workers each; lean get_batch "
              f"{lean / lit_items:.2f}x its per-item reads of the same rows")
    print(f"lean planes vs the four planes: get_batch {lean / full:.2f}x, through DataLoader "
          f"{by['DataLoader: PackedMemmapDataset lean'] / by['DataLoader: PackedMemmapDataset']:.2f}x; target >= 100 M tok/CPU-s "
          f"-> lean get_batch {lean * tokens_per_batch / 1e6:.0f} M tok/CPU-s ({lean / raw:.0%} of raw)")


if __name__ == "__main__":
    main()
