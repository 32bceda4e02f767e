"""Start-up cost of every data-side process, side by side in one run (issue 31.3).

    python3 bench/startup.py [--rounds 3] [--expensive-rounds 1] [--importtime] [--baseline ../other-checkout]
    python3 bench/startup.py --only worker datatrove        # some rows (import torch always: the scale)

Every measurement is a fresh ``python`` process; the numbers are CPU seconds (user + sys), the
median over ``--rounds`` rounds (the rounds interleave the rows, so a burst of load hits them
alike; the expensive rows -- import lightning, StackDataModule, the pool, datatrove -- run in the
first ``--expensive-rounds``). Where the work happens in a worker, the worker's own CPU is taken
(``getrusage`` in the worker, or what the process that reaped it counts), not its parent's.

* **imports**: ``python -c "import X"`` for the bare interpreter, ``torch``, ``lightning``,
  ``stacklm``, and what each data-side process imports before its first work: a shards loader
  worker (the dataset and ``ShardsLoader`` modules; a fork inherits them), a stream loader
  worker (``stacklm.datamodule.workers.PRELOAD``, its forkserver's preload), a prebuild pool
  worker (``stacklm.prebuild.build`` and the job's modules), a datatrove task (the executor,
  the steps, the pipeline and the job's modules); and ``stacklm.train.cli``, which every spawned
  or forkserver worker of ``stacklm-train`` re-runs (``multiprocessing`` re-runs the main script
  in a new worker, and that console script is ``from stacklm.train.cli import main``). The
  last column lists what came along of Lightning, wandb, transformers, datasets, pyarrow,
  matplotlib, torchmetrics, scipy, jsonargparse and the trainer's model.
* **first batch, cold**: python start to the first batch, in one process: shards mode as the
  datamodule builds it (tokenizer loaded and checked against the manifest, ``PackedMemmapDataset``
  with its content check, ``ElasticSampler``, ``ShardsLoader``; no worker), next to litdata's
  ``StreamingDataset`` + ``StreamingDataLoader`` (``TokensLoader``) over the same token rows;
  stream mode (``stacklm.PipelineConfig.from_dict(cfg).build(tok)``, ``next(pipe.batches)``: a
  local jsonl source, exact + near dedup, shuffle 256 / pack 64 documents, the demo config's
  buffers); and the whole ``StackDataModule(mode="shards")`` path, which pays Lightning.
  B=8, seq_len 2048, an 8192-id tokenizer.
* **workers**: a shards loader worker forked by ``ShardsLoader``'s DataLoader and a stream loader
  worker forked from the project's forkserver (``stacklm.datamodule.workers``), started from a
  script whose top is ``stacklm-train``'s, and again from a script whose top imports Lightning (a
  training script of your own): CPU in the worker from the fork to ready
  (``worker_init_fn`` done) and to its first batch, and the forkserver's preload (once per
  process); a prebuild pool worker (``prebuild(..., workers=2)`` on a tiny budget, from a script
  whose top is the ``stacklm`` command's: spawn, imports, one job, exit; per worker) and a
  datatrove local-executor task (``prebuild_executors(..., tasks=2)`` + ``run_executors`` on the
  same: per task, from the forkserver's counts, and that server's preload, once per command).

Targets (issue 31; on an idle machine here ``import torch`` is 1.5 CPU-s): a data-side process
imports torch and nothing heavier (<= 2 CPU-s); a loader worker forked from a preloaded server
<= 0.2 CPU-s; the first shards batch <= litdata's; an engine task's fixed cost <= 2 CPU-s. On a
loaded machine every CPU second stretches, so the absolute targets are shown scaled by this
run's ``import torch`` / 1.5.

``--baseline DIR`` measures another checkout (e.g. a worktree of main) in every round too, on
the same data. ``--importtime`` also prints the import tree (``python -X importtime``) of each
entry, pre-order, entries of at least ``--tree-ms`` (cumulative, wall). litdata is optional
(``pip install --no-deps litdata==0.2.76 obstore tifffile``; its rows are left out without it). With the defaults: ~20 s of
set-up and ~2 minutes of measurements on an idle 2-core machine (``--baseline`` doubles them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the set-up runs from this checkout without installing; each child gets its tree's path

HEAVY = ["lightning", "pytorch_lightning", "wandb", "transformers", "datasets", "pyarrow", "matplotlib", "torchmetrics",
         "scipy", "jsonargparse", "stacklm.train.gpt_module", "trainer"]
SEQ_LEN, BATCH = 2048, 8
TORCH_IDLE = 1.5  # CPU-s of `import torch` on this machine when idle (issue 31)

# A module every measured child can import (it is on their PYTHONPATH): reports CPU and the
# heavy modules, and the loader workers' probe (a worker_init_fn that also stamps the first item).
PROBE = '''
import json, os, resource, sys

HEAVY = {heavy!r}


def cpu(who=resource.RUSAGE_SELF):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def heavy():
    return [m for m in HEAVY if m in sys.modules]


def report(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def proc_cpu(pid):
    """(own, reaped children) CPU seconds of a live process, from /proc."""
    with open(f"/proc/{{pid}}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


class Probe:
    """worker_init_fn: runs the loader's own, then writes the CPU since the fork at 'ready' and,
    through a subclass swapped onto the dataset in this worker, at the first item."""

    def __init__(self, first, path):
        self.first, self.path = first, path

    def __call__(self, worker_id):
        if self.first is not None:
            self.first(worker_id)
        ready = cpu()
        import torch.utils.data as tud

        ds = tud.get_worker_info().dataset
        path, base = self.path, type(ds)

        def stamp():
            with open(path, "w") as f:
                json.dump({{"ready": ready, "first": cpu(), "heavy": heavy()}}, f)

        if isinstance(ds, tud.IterableDataset):
            def __iter__(self):
                it = base.__iter__(self)
                first = next(it)
                stamp()
                yield first
                yield from it
            ds.__class__ = type(base.__name__, (base,), {{"__iter__": __iter__}})
        else:
            done = []

            def __getitem__(self, item):
                out = base.__getitem__(self, item)
                if not done:
                    done.append(1)
                    stamp()
                return out
            ds.__class__ = type(base.__name__, (base,), {{"__getitem__": __getitem__}})
'''.format(heavy=HEAVY)

# Each measured child: a script, so that a spawned or forkserver worker re-runs its top (as it
# re-runs a console script): TOP is that console script's import line.
SCRIPTS = {
    # in-process first batch, then one loader worker forked from this process (ShardsLoader's DataLoader)
    "shards_first": ("", '''
        tok_path, data_dir, probe = sys.argv[1:4]
        import stacklm.datamodule.shards_loader as sl
        from stacklm.data.storage.dataset import PackedMemmapDataset
        from stacklm.datamodule.resume.sampler import ElasticSampler
        from stacklm.tokenizer.bpe import StackTokenizer

        tok = StackTokenizer.load(tok_path)
        ds = PackedMemmapDataset(data_dir, "train", tokenizer=tok)  # content check on, as the datamodule's default
        order = ElasticSampler(ds, BATCH, seed=0, rank=0, world_size=1, shuffle=True, loop=False)
        batch = next(iter(sl.ShardsLoader(ds, order, batch_size=BATCH, rank=0, world_size=1, num_workers=0, tail="pad")))
        assert batch["input_ids"].shape == (BATCH, SEQ_LEN - 1)
        first = cpu()
        own_init = sl.WorkerInit  # the loader's own worker_init_fn, then the probe
        sl.WorkerInit = lambda *a, **k: Probe(own_init(*a, **k), probe)
        next(iter(sl.ShardsLoader(ds, order, batch_size=BATCH, rank=0, world_size=1, num_workers=1, tail="pad")))
        w = json.loads(open(probe).read())
        report(cpu=first, heavy=heavy(), worker=dict(cpu=w["ready"], first=w["first"], heavy=w["heavy"]))
    '''),
    "litdata_first": ("", '''
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        ds = StreamingDataset(sys.argv[1], item_loader=TokensLoader(block_size=SEQ_LEN), shuffle=True)
        batch = next(iter(StreamingDataLoader(ds, batch_size=BATCH, num_workers=0)))
        assert tuple(batch.shape) == (BATCH, SEQ_LEN), batch.shape
        report(cpu=cpu(), heavy=heavy())
    '''),
    "stream_first": ("", '''
        import stacklm

        cfg = json.loads(open(sys.argv[2]).read())
        pipe = stacklm.PipelineConfig.from_dict(cfg).build(stacklm.StackTokenizer.load(sys.argv[1]))
        pipe.batches.reset()
        batch = next(pipe.batches)
        assert batch["input_ids"].shape == (BATCH, SEQ_LEN - 1)
        report(cpu=cpu(), heavy=heavy())
    '''),
    "datamodule_first": ("", '''
        import stacklm

        dm = stacklm.StackDataModule(mode="shards", tokenizer=sys.argv[1], data_dir=sys.argv[2], seq_len=SEQ_LEN, batch_size=BATCH)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))
        report(cpu=cpu(), heavy=heavy())
    '''),
    # `stacklm prebuild --workers 2`: the spawned workers re-run the `stacklm` script's top
    "pool": ("from stacklm.cli.app import main  # noqa: F401 (the stacklm console script's line)", '''
        from stacklm.prebuild import load_config, prebuild

        config, settings = load_config(sys.argv[1])
        t0 = cpu()
        prebuild(config, settings["tokenizer"], sys.argv[2], workers=2, splits=("train",), progress=False, tokens_per_shard=1 << 16)
        report(cpu=cpu(resource.RUSAGE_CHILDREN) / 2, heavy=None, parent=cpu())
    '''),
    # `stacklm prebuild-datatrove --executor local --tasks 2`: tasks fork from multiprocess's forkserver
    "datatrove": ("from stacklm.cli.app import main  # noqa: F401 (the stacklm console script's line)", '''
        import contextlib, glob, io

        from stacklm.prebuild import load_config
        from stacklm.scale.datatrove_executors import prebuild_executors, run_executors

        config, settings = load_config(sys.argv[1])
        logs = sys.argv[2] + ".logs"
        with contextlib.redirect_stderr(io.StringIO()):
            _, merge = prebuild_executors(config, settings["tokenizer"], sys.argv[2], tasks=2, splits=("train",),
                                          executor="local", logging_dir=logs, tokens_per_shard=1 << 16)
            run_executors(merge)
        import multiprocess.forkserver as fs

        own, tasks = proc_cpu(fs._forkserver._forkserver_pid)
        n = len(glob.glob(logs + "/**/completions/*", recursive=True))
        report(cpu=tasks / n, heavy=None, tasks=n, server=own, parent=cpu())
    '''),
    # a stream loader worker of `stacklm-train fit`: forked from the forkserver, re-runs the script's top
    "stream_worker": ("from stacklm.train.cli import main  # noqa: F401 (the stacklm-train console script's line)", '''
        from stacklm.data.pipeline import PipelineConfig
        from stacklm.datamodule.loader import StackDataLoader
        from stacklm.datamodule.stream import PipelineBuilder, StreamDataset
        from stacklm.datamodule.workers import WorkerEnv, worker_context
        from stacklm.tokenizer.bpe import StackTokenizer

        tok_path, cfg_path, out = sys.argv[1:4]
        cfg = PipelineConfig.from_dict(json.loads(open(cfg_path).read()))
        tok = StackTokenizer.load(tok_path)
        ds = StreamDataset(PipelineBuilder(cfg.to_dict(), tok_path, "train"), split="train", rank=0, world_size=1,
                           n_batches_total=4, batch_size=BATCH, seq_len=SEQ_LEN, pad_id=tok.pad_id,
                           sources=[e.name for e in cfg.mix.entries], target_weights=dict(cfg.mix.weights))
        loader = StackDataLoader(ds, batch_size=None, num_workers=1, persistent_workers=False,
                                 multiprocessing_context=worker_context(), worker_init_fn=Probe(WorkerEnv(os.environ), out),
                                 vocab_size=tok.vocab_size)
        batch = next(iter(loader))
        import multiprocessing.forkserver as fs

        server, _ = proc_cpu(fs._forkserver._forkserver_pid)
        w = json.loads(open(out).read())
        report(cpu=w["ready"], first=w["first"], heavy=w["heavy"], server=server)
    '''),
}
# a stream loader worker of a training script of your own: its top imports Lightning
# (stacklm.datamodule.lazy_main: the worker does not re-run it unless it unpickles one of its names)
SCRIPTS["stream_worker_lightning_top"] = ("import lightning  # noqa: F401 (a training script's top)", SCRIPTS["stream_worker"][1])

ENTRY_MODULES = [  # (label, modules imported in one fresh process): what each process imports before its first work
    ("python (nothing)", []),
    ("torch", ["torch"]),
    ("lightning", ["lightning"]),
    ("stacklm", ["stacklm"]),
    ("shards loader worker: dataset, shards_loader", ["stacklm.data.storage.dataset", "stacklm.datamodule.shards_loader"]),
    ("stream loader worker: workers.PRELOAD", ["numpy", "torch", "torchdata.nodes", "stacklm.data.pipeline",
                                               "stacklm.tokenizer.bpe", "stacklm.datamodule.stream",
                                               "stacklm.datamodule.resume.logical"]),
    ("pool worker: prebuild.build, jobs, pipeline", ["stacklm.parent_death", "stacklm.prebuild.build", "stacklm.prebuild.jobs",
                                                     "stacklm.data.pipeline", "stacklm.tokenizer.bpe"]),
    ("datatrove task: executor, steps, pipeline", ["datatrove.executor.local", "stacklm.scale.datatrove_steps",
                                                   "stacklm.data.pipeline", "stacklm.prebuild.jobs", "stacklm.data.dedup.staged"]),
    ("stacklm.train.cli (re-run by every worker)", ["stacklm.train.cli"]),
    ("litdata", ["litdata"]),
]
DATA_SIDE = [label for label, _ in ENTRY_MODULES if " worker: " in label or label.startswith("datatrove task")]


def write_scripts(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "_startup_probe.py").write_text(PROBE)
    for name, (top, body) in SCRIPTS.items():
        code = (f"{top}\n\nif __name__ == \"__main__\":\n    import json, os, resource, sys\n"
                "    from _startup_probe import Probe, cpu, heavy, proc_cpu, report\n"
                f"    SEQ_LEN, BATCH = {SEQ_LEN}, {BATCH}\n" + textwrap.indent(textwrap.dedent(body), "    "))
        (folder / f"m_{name}.py").write_text(code)  # m_: not to shadow a package (datatrove) on the path


def prepare(root: Path, mb: float) -> dict[str, Path]:
    """The data every row reads, built once with this tree: a jsonl corpus, a tokenizer, a
    pipeline config, shards (``stacklm.prebuild_shards``), the same train rows as a litdata set,
    and a tiny-budget config for the pool and datatrove rows."""
    import warnings

    import stacklm
    from stacklm.corpus import iter_default_corpus, iter_default_documents

    data = root / "data"
    data.mkdir(parents=True)
    handles = [open(data / f"part-{k}.jsonl", "w", encoding="utf-8") for k in range(4)]
    for i, (_, text) in enumerate(iter_default_documents(int(mb * 1e6))):
        handles[i % 4].write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    for h in handles:
        h.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = stacklm.train_tokenizer(iter_default_corpus(2_000_000), vocab_size=8192).tokenizer
    (root / "tok").mkdir()
    tok.save(root / "tok" / "tokenizer.stacklm.json")
    entry = {"name": "corpus", "kind": "local", "path": str(data / "*.jsonl"), "weight": 1.0, "domain": "code"}
    cfg = {"seq_len": SEQ_LEN, "batch_size": BATCH, "seed": 0, "strategy": "best_fit", "shuffle_buffer": 256,
           "pack_buffer_docs": 64, "holdout_fraction": 0.01, "num_threads": 1, "dedup": {"exact": True, "near": True},
           "mix": {"name": "bench", "total_tokens": int(mb * 150_000), "entries": [entry]}}  # ~what the text gives
    (root / "pipeline.json").write_text(json.dumps(cfg))
    config = stacklm.PipelineConfig.from_dict(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a source that runs dry a little before the budget
        stacklm.prebuild_shards(config, tok, root / "shards", progress=False, tokens_per_shard=SEQ_LEN * 256)
    tiny = dict(cfg, dedup={"exact": False, "near": False}, mix=dict(cfg["mix"], total_tokens=4 * SEQ_LEN * BATCH))
    (root / "tiny.yaml").write_text(json.dumps({"data": {"tokenizer": str(root / "tok"), "seq_len": SEQ_LEN,
                                                         "batch_size": BATCH, "pipeline": tiny}}))
    paths = {"tok": root / "tok", "shards": root / "shards", "pipeline": root / "pipeline.json", "tiny": root / "tiny.yaml"}
    try:
        from litdata_rows import write_litdata  # bench/, beside this file

        paths["litdata"] = write_litdata(root / "litdata", root / "shards")
    except ImportError:
        print("litdata is not installed: its rows are left out (pip install --no-deps litdata==0.2.76 obstore tifffile)")
    return paths


def run_child(cmd: list[str], repo: Path, scripts: Path, env_extra: dict | None = None) -> dict:
    """One fresh process with ``repo`` first on its path; what its RESULT line says."""
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{scripts}", "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=scripts)
    out, err = proc.stdout, proc.stderr
    if proc.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{err[-3000:]}")
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{cmd} printed no RESULT:\n{out[-2000:]}\n{err[-2000:]}")


def import_cmd(modules: list[str]) -> list[str]:
    code = "".join(f"import {m}\n" for m in modules) + "from _startup_probe import cpu, heavy, report\nreport(cpu=cpu(), heavy=heavy())\n"
    return [sys.executable, "-c", code]


def jobs(paths: dict[str, Path], scripts: Path, tmp: Path) -> list[tuple[bool, list[tuple[str, str]], Callable]]:
    """``(expensive, [(section, label), ...], run)`` for every child: ``run(repo, tag)`` starts it
    with ``repo`` first on its path and returns ``{label: {"cpu": s, "heavy": [...], ...}}``."""
    py = sys.executable
    out = []
    for label, modules in ENTRY_MODULES:
        if "litdata" in modules and "litdata" not in paths:
            continue
        out.append((label == "lightning", [("imports", label)],
                    lambda repo, tag, m=modules, la=label: {la: run_child(import_cmd(m), repo, scripts)}))
    tok, shards, pipe = str(paths["tok"]), str(paths["shards"]), str(paths["pipeline"])

    def probe_file(tag: str) -> str:
        return str(tmp / f"probe-{tag}-{time.monotonic_ns()}.json")

    def shards_first(repo, tag):
        r = run_child([py, "m_shards_first.py", tok, shards, probe_file(tag)], repo, scripts)
        return {"shards: dataset + ShardsLoader": r, "shards loader worker: fork -> ready": r["worker"]}

    out.append((False, [("first batch", "shards: dataset + ShardsLoader"), ("workers", "shards loader worker: fork -> ready")],
                shards_first))
    if "litdata" in paths:
        out.append((False, [("first batch", "litdata: StreamingDataset + Loader")],
                    lambda repo, tag: {"litdata: StreamingDataset + Loader": run_child([py, "m_litdata_first.py", str(paths["litdata"])],
                                                                                       repo, scripts)}))
    out.append((False, [("first batch", "stream: PipelineConfig.build")],
                lambda repo, tag: {"stream: PipelineConfig.build": run_child([py, "m_stream_first.py", tok, pipe], repo, scripts)}))
    out.append((True, [("first batch", "StackDataModule(mode=shards)")],
                lambda repo, tag: {"StackDataModule(mode=shards)": run_child([py, "m_datamodule_first.py", tok, shards], repo, scripts)}))

    def stream_worker(repo, tag):
        r = run_child([py, "m_stream_worker.py", tok, pipe, probe_file(tag)], repo, scripts)
        return {"stream loader worker: fork -> ready": r}

    def pool(repo, tag):
        r = run_child([py, "m_pool.py", str(paths["tiny"]), str(tmp / f"pool-{tag}-{time.monotonic_ns()}")], repo, scripts)
        return {"prebuild pool worker (per worker)": r}

    def datatrove(repo, tag):
        r = run_child([py, "m_datatrove.py", str(paths["tiny"]), str(tmp / f"dt-{tag}-{time.monotonic_ns()}")], repo, scripts)
        return {"datatrove local task (per task)": r}

    def stream_worker_lightning_top(repo, tag):
        r = run_child([py, "m_stream_worker_lightning_top.py", tok, pipe, probe_file(tag)], repo, scripts)
        return {"stream loader worker, script imports lightning": r}

    out.append((False, [("workers", "stream loader worker: fork -> ready")], stream_worker))
    out.append((True, [("workers", "stream loader worker, script imports lightning")], stream_worker_lightning_top))
    out.append((True, [("workers", "prebuild pool worker (per worker)")], pool))
    out.append((True, [("workers", "datatrove local task (per task)")], datatrove))
    return out


def import_tree(modules: list[str], repo: Path, min_ms: float, depth: int = 3) -> str:
    """``python -X importtime`` of ``modules`` as a pre-order tree: entries >= ``min_ms``
    cumulative, ``depth`` levels below each top-level import."""
    code = "".join(f"import {m}\n" for m in modules) or "pass"
    env = {**os.environ, "PYTHONPATH": str(repo)}
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env, capture_output=True, text=True).stderr
    stack: list[tuple[int, str, int, list]] = []  # post-order lines -> tree: a node adopts the deeper ones before it
    for line in err.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2 or "cumulative" in line:
            continue
        _, cum, name = line.split("|")
        level = (len(name) - len(name.lstrip(" ")) - 1) // 2
        node = (level, name.strip(), int(cum), [])
        while stack and stack[-1][0] > level:
            node[3].insert(0, stack.pop())
        stack.append(node)
    lines = []

    def walk(node):
        level, name, cum, kids = node
        if cum / 1e3 >= min_ms and level <= depth:
            lines.append(f"{'  ' * level}{name:<{max(1, 60 - 2 * level)}s} {cum / 1e3:8.0f} ms")
            for k in kids:
                walk(k)

    for node in stack:
        walk(node)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every row; the median is reported")
    ap.add_argument("--expensive-rounds", type=int, default=1,
                    help="rounds of the expensive rows (import lightning, StackDataModule, the pool, datatrove)")
    ap.add_argument("--mb", type=float, default=6.0, help="text behind the shards and the stream source")
    ap.add_argument("--baseline", help="another checkout measured side by side in every round (same data)")
    ap.add_argument("--importtime", action="store_true", help="also print each entry module's import tree")
    ap.add_argument("--tree-ms", type=float, default=40.0, help="--importtime: smallest cumulative time shown")
    ap.add_argument("--tree-depth", type=int, default=3, help="--importtime: levels shown below each import")
    ap.add_argument("--only", nargs="*", help="only the rows whose label contains one of these")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="stacklm-startup-"))
    t0 = time.perf_counter()
    paths = prepare(tmp / "set", args.mb)
    scripts = tmp / "scripts"
    write_scripts(scripts)
    (tmp / "runs").mkdir()
    todo = jobs(paths, scripts, tmp / "runs")
    if args.only:
        todo = [j for j in todo if any(o in label for _, label in j[1] for o in [*args.only, "torch"])]  # torch: the scale
    rows = [row for _, labels, _ in todo for row in labels]
    rows = list(dict.fromkeys(sorted(rows, key=lambda r: ("imports", "first batch", "workers").index(r[0]))))
    trees = [("this tree", ROOT)] + ([("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    print(f"set-up {time.perf_counter() - t0:.0f} s ({tmp}); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"{args.rounds} rounds (the expensive rows {min(args.rounds, args.expensive_rounds)})", flush=True)
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for expensive, _, run in todo:
            if expensive and r >= args.expensive_rounds:
                continue
            for tag, repo in trees:
                for label, record in run(repo, tag.replace(" ", "_")).items():
                    results.setdefault((label, tag), []).append(record)
        print(f"round {r + 1} done ({time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.2f})", flush=True)

    def med(label, tag, key="cpu"):
        vals = [x[key] for x in results.get((label, tag), []) if x.get(key) is not None]
        return statistics.median(vals) if vals else None

    def heavy(label, tag):
        """What the row's process imported of ``HEAVY``; None where it is not probed."""
        got = [x["heavy"] for x in results.get((label, tag), []) if x.get("heavy") is not None]
        return sorted({m for h in got for m in h}) if got else None

    torch_s = med("torch", "this tree") or TORCH_IDLE
    scale = max(1.0, torch_s / TORCH_IDLE)
    print(f"\nCPU seconds (user + sys), median; `import torch` took {torch_s:.2f} here -> scale {scale:.2f} vs idle "
          f"(load average now {os.getloadavg()[0]:.2f})")
    cols = "".join(f" {tag:>10s}" for tag, _ in trees)
    print(f"{'section':12s} {'measurement':46s}{cols}  heavy modules imported")

    def cells(label, key="cpu"):
        return "".join(f" {v:10.2f}" if (v := med(label, tag, key)) is not None else f" {'-':>10s}" for tag, _ in trees)

    for section, label in rows:
        hv = "; ".join((f"{tag}: " if len(trees) > 1 else "") + ("(not probed)" if heavy(label, tag) is None else
                                                                   ", ".join(heavy(label, tag)) or "-") for tag, _ in trees)
        print(f"{section:12s} {label:46s}{cells(label)}  {hv}")
        for key, what in (("first", "to its first batch"), ("parent", "the command's own process"),
                          ("server", "its forkserver's preload (once)")):
            if any(med(label, tag, key) is not None for tag, _ in trees):
                print(f"{'':12s}    {what:43s}{cells(label, key)}")

    # the targets, on this tree
    T = "this tree"
    checks = []  # (what, value, target, scaled?, no heavy module?, note)
    for label in DATA_SIDE:
        v = med(label, T)
        if v is not None:
            bad = heavy(label, T) or []
            checks.append((f"imports: {label.split(':')[0]}", v, 2.0, True, not bad, f"heavy: {', '.join(bad)}" if bad else ""))
    for label in ("stream loader worker: fork -> ready", "shards loader worker: fork -> ready"):
        v = med(label, T)
        if v is not None:
            bad = heavy(label, T) or []
            checks.append((label, v, 0.2, True, not bad, f"heavy: {', '.join(bad)}" if bad else ""))
    lit, ours = med("litdata: StreamingDataset + Loader", T), med("shards: dataset + ShardsLoader", T)
    if lit is not None and ours is not None:
        checks.append(("first shards batch <= litdata's", ours, lit, False, True, ""))
    v = med("datatrove local task (per task)", T)
    if v is not None:
        checks.append(("datatrove local task fixed cost", v, 2.0, True, True, ""))
    print(f"\ntargets (this tree; 'scaled' = the idle-machine target x {scale:.2f}, this run's import torch / {TORCH_IDLE}):")
    for what, v, target, scaled, clean, note in checks:
        limit = target * scale if scaled else target
        ok = clean and v <= limit
        print(f"  {what:44s} {v:6.2f} <= {limit:5.2f}{f' (idle {target:.2f})' if scaled else ' (same run)':13s}: "
              f"{'met' if ok else 'NOT met'}" + (f"  [{note}]" if note else ""))
    if (v := med("prebuild pool worker (per worker)", T)) is not None:
        print(f"  {'prebuild pool worker fixed cost':44s} {v:6.2f}  (no target: a spawned interpreter that imports torch, "
              "runs its job and exits; its imports are the 'pool worker' row above)")

    if args.importtime:
        for label, modules in ENTRY_MODULES:
            if modules and (label != "litdata" or "litdata" in paths):
                print(f"\n-X importtime: import {', '.join(modules)}  (>= {args.tree_ms:g} ms cumulative, wall)")
                print(import_tree(modules, ROOT, args.tree_ms, args.tree_depth))
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
