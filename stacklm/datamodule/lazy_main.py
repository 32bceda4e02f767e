"""A loader worker does not re-run the main script unless something it unpickles lives there.

``multiprocessing`` starts every forkserver (and spawn) child by re-running the parent's main
script as ``__mp_main__`` (``spawn.prepare``), so that objects defined in ``__main__`` can be
unpickled. A training script imports Lightning at its top (``import lightning as L``), so each
stream/sft loader worker imported Lightning again before its first batch: ~6 CPU-s per worker,
per loader (train, and val at every validation), measured as the larger part of a small fit's wall
time. stacklm's workers unpickle stacklm's dataset, which lives in stacklm's modules.

The forkserver that the workers fork from (``stacklm.datamodule.workers``) imports this module
last in its preload. With ``STACKLM_WORKER_MAIN`` in the server's environment (the parent's main,
as ``multiprocessing`` itself reports it: ``{"path": ...}`` or ``{"name": ...}``), it puts a
``LazyMain`` in ``sys.modules["__main__"]`` that carries that path (or module spec name). The
child's ``spawn.prepare`` sees that ``__main__`` already is the parent's main and leaves it; the
script runs, as ``__mp_main__`` exactly as ``multiprocessing`` would, only when a worker looks up
a name that ``__main__`` defines (a user's own filter or callback class, unpickled): nothing is
lost, only the cost of what is never read. Without the variable importing this module does
nothing.
"""

from __future__ import annotations

import json
import os
import sys
import types

ENV = "STACKLM_WORKER_MAIN"


class LazyMain(types.ModuleType):
    """``__main__`` of a worker: the parent's script, run on first use of a name it defines."""

    def __init__(self, path: str | None = None, name: str | None = None) -> None:
        super().__init__("__main__")
        if path is not None:
            self.__file__ = path
        if name is not None:
            from importlib.machinery import ModuleSpec

            self.__spec__ = ModuleSpec(name, None)
        self._stacklm_main = (path, name)

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):  # module metadata lookups do not run a script
            raise AttributeError(attr)
        module = self._load()
        return getattr(module, attr)

    def _load(self) -> types.ModuleType:
        """Run the script as ``multiprocessing`` would (``spawn._fixup_main_from_path``/``_name``)."""
        import runpy

        path, name = self.__dict__["_stacklm_main"]
        module = types.ModuleType("__mp_main__")
        if path is not None:
            module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
        else:
            module.__dict__.update(runpy.run_module(name, run_name="__mp_main__", alter_sys=True))
        sys.modules["__main__"] = sys.modules["__mp_main__"] = module
        return module


def install() -> None:
    raw = os.environ.pop(ENV, None)
    if not raw:
        return
    where = json.loads(raw)
    main = LazyMain(path=where.get("path"), name=where.get("name"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main


def parent_main() -> dict[str, str]:
    """This process's main as ``multiprocessing`` hands it to a child (``{}`` for an interactive one)."""
    from multiprocessing import spawn

    data = spawn.get_preparation_data("stacklm")
    if "init_main_from_name" in data:
        return {"name": data["init_main_from_name"]}
    if "init_main_from_path" in data:
        return {"path": data["init_main_from_path"]}
    return {}


install()
