"""Data-side processes import nothing of Lightning, wandb or the trainer (issue 31.3;
``bench/startup.py`` measures what they cost).

A prebuild pool worker, a datatrove task and a loader worker import the modules listed here
(their entry points, what they unpickle, what their forkserver preloads); a spawned or
forkserver worker also re-runs the main script, which for ``stacklm-train`` is
``from stacklm.train.cli import main``. One fresh interpreter imports them all and reports what
came along."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stacklm.datamodule.workers import PRELOAD

ROOT = Path(__file__).resolve().parents[1]

# Never in a data-side process. jsonargparse: the trainer's CLI parser (stacklm.prebuild.settings
# registers its type with it only when the trainer asks).
FORBIDDEN = ["lightning", "pytorch_lightning", "wandb", "transformers", "torchmetrics", "stacklm.train", "trainer", "jsonargparse"]

POOL_WORKER = ["stacklm.parent_death", "stacklm.prebuild.build", "stacklm.prebuild.jobs", "stacklm.prebuild.dedup_pass",
               "stacklm.data.pipeline", "stacklm.tokenizer.bpe", "stacklm.cli.app"]  # cli.app: the `stacklm` script's line
LOADER_WORKER = [*PRELOAD, "stacklm.datamodule.workers", "stacklm.datamodule.shards_loader", "stacklm.data.storage.dataset",
                 "stacklm.datamodule.loader"]
HAS_DATATROVE = importlib.util.find_spec("datatrove") is not None


def _imported(modules: list[str], then: list[str] | None = None) -> dict[str, list[str]]:
    """Import ``modules`` in a fresh interpreter: the FORBIDDEN modules it then holds; with
    ``then``, also import those and report again."""
    code = (
        "import importlib, json, sys\n"
        f"forbidden = {FORBIDDEN!r}\n"
        "seen = lambda: [m for m in forbidden if m in sys.modules]\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "out = {'first': seen()}\n"
        f"for m in {then or []!r}: importlib.import_module(m)\n"
        "out['then'] = seen()\n"
        "print(json.dumps(out))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_worker_and_task_modules_import_no_lightning_wandb_or_trainer():
    """Pool worker, loader workers (PRELOAD: the stream loaders' forkserver) and, with datatrove,
    an engine task (the executor, the steps, ``TASK_PRELOAD``: its forkserver) in one process;
    then ``stacklm.train.cli``, which every spawned or forkserver worker of ``stacklm-train``
    re-runs: it may bring its own package, nothing heavier (it brought Lightning, ~6 CPU-s per
    worker, while ``stacklm.train`` imported its model eagerly)."""
    modules = POOL_WORKER + LOADER_WORKER
    if HAS_DATATROVE:
        from stacklm.scale.datatrove_steps import TASK_PRELOAD

        modules += ["datatrove.executor.local", "stacklm.scale.datatrove_steps", "stacklm.scale.supervise", *TASK_PRELOAD]
    got = _imported(list(dict.fromkeys(modules)), then=["stacklm.train.cli"])
    assert got["first"] == [], f"a data-side process imported {got['first']}"
    assert got["then"] == ["stacklm.train"], f"re-running the stacklm-train script imported {got['then']}"


@pytest.mark.skipif(not HAS_DATATROVE, reason="needs datatrove (stacklm[scale])")
def test_datatrove_tasks_fork_from_a_server_that_preloads_their_modules():
    """``run_chain``'s local forkserver imports the executor's and steps' modules (those this
    process has imported: they import cleanly) and then the extra ones, once; ``__main__`` first."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.base import PipelineStep

    from stacklm.scale.supervise import forkserver_preload

    class Unimported(PipelineStep):  # its module is taken only when this process has imported it
        __module__ = "not.imported.anywhere"

        def run(self, data=None, rank: int = 0, world_size: int = 1):
            return data

    class Step(PipelineStep):
        def run(self, data=None, rank: int = 0, world_size: int = 1):
            return data

    first = LocalPipelineExecutor([Step()], tasks=1, logging_dir="/nonexistent/a")
    second = LocalPipelineExecutor([Unimported(), Step()], tasks=1, logging_dir="/nonexistent/b", depends=first)
    second.depends = first
    assert forkserver_preload([first, second], ["torch", __name__]) == [
        "__main__", "datatrove.executor.local", __name__, "torch"]


def test_a_slurm_bucket_task_imports_neither_torch_nor_ray(tmp_path):
    """What a datatrove Slurm task of the dedup ``buckets`` stage runs in a fresh interpreter
    (``launch_pickled_pipeline``, the steps, the task's resource log line, ``bucket_tasks``, the
    bucket step's imports) needs neither torch nor Ray: it sorts and compares numpy columns.
    They cost every such task ~3 and ~1 CPU-s (13 bucket tasks a chain) while the bucket step read
    its settings through ``stacklm.data.pipeline`` and the log line imported Ray to find it unused."""
    config = {"mix": "stack-100m"}  # a pipeline config; its dedup section: the defaults (exact and near)
    code = (
        "import json, sys\n"
        "from datatrove.tools.launch_pickled_pipeline import main\n"
        "from stacklm.scale.datatrove_steps import StackDedupBuckets, TaskPlan, bucket_tasks\n"
        "from stacklm.scale.resources import LogTaskResources\n"
        "from stacklm.data.dedup.staged import run_bucket_task\n"
        "from stacklm.prebuild.plan import STATE_DIR\n"
        f"plan = TaskPlan(config=json.loads({json.dumps(config)!r}), tokenizer={{}}, out={str(tmp_path)!r}, tasks_per_split=2, tokens_per_shard=1024)\n"
        "tasks = bucket_tasks(plan)\n"
        "LogTaskResources('buckets', 'cpus:1,mem_gb:4,time:04:00:00')(None, 0, len(tasks))\n"
        "print(json.dumps({'tasks': len(tasks), 'heavy': [m for m in ('torch', 'torchdata', 'ray') if m in sys.modules]}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"tasks": 13, "heavy": []}  # the digest range and 12 bands; nothing heavy came along
