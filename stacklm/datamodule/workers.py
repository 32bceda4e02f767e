"""How stream- and sft-mode loader workers start: from a forkserver that imports only the data side.

Why not ``fork`` (torch's default on Linux): Lightning builds the loaders after it has
imported wandb and started the logger, so the main process runs wandb's service threads and
import hooks. A forked worker inherits that state without the threads: wandb raises
``ForkedError`` as soon as the worker imports ``datasets`` (its first source read), and any
lock another thread held at fork time stays locked in the child forever.

Why not ``spawn``: every worker of every loader (train, and val at each validation) starts a
fresh interpreter and imports torch, numpy and the node graph again, about a second or more per
worker on a busy machine (``bench/loader.py --start-methods`` measures all three).

``forkserver``: one clean server process, started once per main process, imports the modules in
``PRELOAD`` (and ``datasets`` when a source reads through it) once; each worker is a fork of that
single-threaded server, so it starts fast and has never seen Lightning or wandb. The dataset
and its graph builder reach the worker pickled; they live in modules that import neither
(``stacklm.datamodule`` loads ``StackDataModule`` lazily for this reason). ``multiprocessing``
would also re-run the main script in each worker (as ``__mp_main__``), and a training script
imports Lightning at its top: the server's last preload, ``stacklm.datamodule.lazy_main``, makes
that run happen only if a worker unpickles something the script defines
(``bench/startup.py`` measures a worker from fork to its first batch).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Mapping

from stacklm.parent_death import die_with_parent

START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_START_METHOD = "forkserver"

# Imported once by the forkserver; everything a stream worker needs, nothing that starts threads.
PRELOAD = ["numpy", "torch", "torchdata.nodes", "stacklm.data.pipeline",
           "stacklm.tokenizer.bpe", "stacklm.datamodule.stream", "stacklm.datamodule.resume.logical"]


def worker_context(method: str = DEFAULT_START_METHOD, *, needs_datasets: bool = False):
    """The ``multiprocessing`` context the loader workers start from (``DataLoader``'s
    ``multiprocessing_context``). ``needs_datasets``: also preload ``datasets`` in the
    forkserver (importing it takes seconds; worth it only when a source reads through it)."""
    if method not in START_METHODS:
        raise ValueError(f"worker start method must be one of {START_METHODS}, got {method!r}")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Applies when the server starts (the first loader); a later call cannot change a running server,
        # which is harmless: a worker imports what is missing itself, in a clean process.
        ctx.set_forkserver_preload(PRELOAD + (["datasets"] if needs_datasets else []) + ["stacklm.datamodule.lazy_main"])
        _start_forkserver()
    return ctx


def _start_forkserver() -> None:
    """Start the forkserver now (``multiprocessing`` would at the first worker), with this
    process's main script in its environment for ``lazy_main`` (a no-op when it runs already)."""
    from multiprocessing import forkserver

    from stacklm.datamodule.lazy_main import ENV, parent_main

    main = parent_main()
    if not main:
        return
    saved = os.environ.get(ENV)
    os.environ[ENV] = json.dumps(main)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


class WorkerEnv:
    """``worker_init_fn`` that gives a worker the main process's environment as of the loader's
    creation. Why: a forkserver keeps the environment it started with (the first loader's), so
    a variable set later in the main process (``HF_HUB_OFFLINE``, ``HF_TOKEN``, a cache path)
    would not reach the workers of later loaders. Modules the server preloaded have already
    read their import-time settings (``datasets.config``), so set those before the run starts.

    First of all it makes the worker die with the main process (``stacklm.parent_death``): the
    forkserver exits when the main process does, and its workers with it, at once."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.parent = os.getpid()

    def __call__(self, worker_id: int) -> None:
        die_with_parent(self.parent)
        os.environ.clear()
        os.environ.update(self.env)
