"""Optional dependencies: the heavy libraries a feature needs are imported where it runs.

``stacklm``'s core (tokenizer, pipes, shards, ``StackDataModule``) needs none of them; each
belongs to an extra: ``[hf]`` (``transformers``, ``datasets``: hub streams, parquet files,
Hugging Face tokenizers), ``[wandb]`` (the W&B mix table), ``[scale]`` (``datatrove``
executors), ``[ray]`` (``ray``, for datatrove's Ray executor). ``require`` imports one and,
when it is missing, raises a ``StackLMError`` that names the package and the ``pip install``
that fixes it -- one line from the CLI, exit 2 -- instead of a bare ``ModuleNotFoundError``
from deep inside a pipe.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from stacklm.errors import EXTRAS, MissingDependencyError


def require(module: str, extra: str, purpose: str | None = None) -> ModuleType:
    """``import module``, or ``MissingDependencyError`` naming it and ``pip install "stacklm[extra]"``.

    Only the module itself being absent is translated: an import error raised from inside an
    installed package (a broken install of something else) keeps its own traceback.
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; extras: {sorted(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is not None and e.name.split(".")[0] != top:
            raise
        why = f"{purpose} needs" if purpose else "this needs"
        raise MissingDependencyError(
            f"{why} the optional package {top!r}, which is not installed: pip install \"stacklm[{extra}]\""
        ) from None


def lazy_getattr(package: str, where: Mapping[str, tuple[str, str]], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` (PEP 562): ``name`` in ``where`` -> ``(module,
    attribute)`` is imported on first use and kept in ``namespace`` (the package's globals), so
    importing the package stays light (the worker paths import no Lightning through it)."""

    def __getattr__(name: str) -> Any:
        if name in where:
            module, attribute = where[name]
            value = getattr(importlib.import_module(module), attribute)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
