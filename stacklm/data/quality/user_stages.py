"""User stages: a document stage the user writes, or one of datatrove's filters, named by import
path in the pipeline config (``pipeline.stages``) and run after the quality filter, before
decontamination and dedup (so dedup sees what the user keeps).

Why our own: the built-in curation is three fixed rule sets; datatrove's filters are
``PipelineStep``s over its ``Document`` objects inside its own executors, and litdata's
``map`` is a function over files, neither of which is a stage of this node graph with its
counters, its checkpoint state and its resume rule. This node is that stage: it counts every
document it keeps or drops in a ``StageStats`` (as ``FilterNode`` does), so its drop reasons
flow into the ledger, the manifests, ``stacklm report`` and the data logs unchanged.

A stage is called with each document (a dict: ``text``, ``source``, ``domain``, ``doc_id``,
``file``, ``record``, ...) and returns

- ``True``: keep it; a dict: keep that document instead (a map; its missing fields are the
  input's, so returning ``{"text": new}`` is enough);
- ``False`` or ``None``: drop it (reason ``dropped``); a string: drop it with that reason.

A datatrove ``BaseFilter`` subclass is adapted (``_DatatroveFilter``): each document becomes a
``datatrove.data.Document`` and ``filter``'s ``False`` / ``(False, reason)`` drops it.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import pickle
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchdata.nodes import BaseNode

from stacklm.config import Config
from stacklm.constants import KEPT
from stacklm.data.stats import BUILT_IN_STAGES, StageStats
from stacklm.errors import ConfigError, ResumeRefused, UserError

DROPPED = "dropped"  # the reason of a stage that returned False or None
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_PLAIN = (str, int, float, bool, type(None))


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


@dataclass(frozen=True)
class StageConfig(Config):
    """One entry of ``pipeline.stages``: what to import, with what arguments, for which sources.
    Hashed with the pipeline (``config_hash``), so a resume or a prebuild refuses another
    stage set."""

    fn: str = field(metadata={"help": "the stage's import path, 'package.module:name' (a function, or a class that is "
                                      "instantiated with kwargs, e.g. 'datatrove.pipeline.filters:GopherQualityFilter')"})
    kwargs: dict[str, Any] = field(default_factory=dict)  # a class's constructor arguments; a function's extra keyword arguments
    sources: tuple[str, ...] | None = None  # the sources it runs on (default: every source)
    name: str | None = None  # its stage name in the ledger and the logs (default: the imported name in snake_case)

    @classmethod
    def label(cls, data: Mapping[str, Any] | None) -> str:
        return f"stage {data.get('fn')!r}" if isinstance(data, Mapping) else "stage"

    @property
    def stage_name(self) -> str:
        return self.name or _snake(self.fn.replace(":", ".").rsplit(".", 1)[-1])

    def resolve(self, where: str = "pipeline.stages") -> Any:
        """The imported object, refused in one line naming ``where`` when it cannot be imported
        or pickled by reference (loader workers and engine tasks import it by name)."""
        return _resolve(self.fn, where)

    def build(self, where: str = "pipeline.stages") -> Callable[[dict], Any]:
        """The callable a node calls per document (a fresh instance of a class: its state is
        this node's). ``kwargs`` are bound to the signature first, so a misspelled argument is
        told apart from a constructor that raises (a TypeError of its own included)."""
        target = self.resolve(where)
        kwargs = dict(self.kwargs)
        is_class = isinstance(target, type)
        if not is_class and not callable(target):
            raise ConfigError(f"field '{where}.fn': {self.fn} is a {type(target).__name__}, not a function or class")
        _bind(target, is_class, kwargs, self.fn, where)
        if not is_class:
            return functools.partial(target, **kwargs) if kwargs else target
        try:
            obj = target(**kwargs)
        except Exception as e:
            args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            raise ConfigError(f"field '{where}.kwargs': {self.fn}({args}) raised {type(e).__name__}: "
                              f"{' '.join(str(e).split())}; fix the constructor's arguments under {where}.kwargs") from None
        base = sys.modules.get("datatrove.pipeline.filters.base_filter")
        if base is not None and isinstance(obj, base.BaseFilter):
            return _DatatroveFilter(obj)
        if not callable(obj):
            raise ConfigError(f"field '{where}.fn': an instance of {self.fn} is not callable; give the class a "
                              f"__call__(self, doc), or name a function or a datatrove filter")
        return obj


def _bind(target: Any, is_class: bool, kwargs: dict, fn: str, where: str) -> None:
    """Refuse ``kwargs`` the signature does not take (a class: its constructor; a function: after
    the document), when the config is checked rather than at the first document."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call will tell
        return
    try:
        sig.bind(**kwargs) if is_class else sig.bind(None, **kwargs)
    except TypeError as e:
        what = "the constructor's arguments" if is_class else "keyword arguments the function takes after the document"
        empty = inspect.Parameter.empty  # the names and defaults say what it takes; annotations would be noise here
        sig = sig.replace(parameters=[q.replace(annotation=empty) for q in sig.parameters.values()], return_annotation=empty)
        raise ConfigError(f"field '{where}.kwargs': {fn}{sig} does not take {sorted(kwargs)} ({e}); give {what}") from None


_FIX = "name a function or class at the top level of an importable module, as 'package.module:name'"


def _split(path: str, where: str) -> tuple[str, str]:
    """``(module, attribute)`` of an import path, refused when it has no module or names the
    script being run; read at parse, without importing (``check_stages``)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"field '{where}.fn' is {path!r}: {_FIX}")
    if module_name in ("__main__", "__mp_main__"):
        raise ConfigError(f"field '{where}.fn' is {path!r}: the script being run cannot be imported by the loader "
                          f"workers and engine tasks; move the stage into a module and {_FIX}")
    return module_name, attr


@functools.lru_cache(maxsize=64)
def _resolve(path: str, where: str) -> Any:
    module_name, attr = _split(path, where)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"field '{where}.fn' is {path!r}: cannot import {module_name!r} ({e}); {_FIX} "
                          f"(on the PYTHONPATH of every process that reads the data)") from None
    except Exception as e:  # the module is found but fails: a SyntaxError, or an exception it raises at import
        at = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) and e.filename else ""
        raise ConfigError(f"field '{where}.fn' is {path!r}: importing {module_name!r} raised {type(e).__name__}: "
                          f"{' '.join(str(e).split())}{at}; fix the module so that `import {module_name}` works") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"field '{where}.fn' is {path!r}: module {module_name!r} has no {attr!r}; {_FIX}")
        obj = getattr(obj, part)
    try:  # by reference: what a worker or a task does to find it again
        pickle.dumps(obj)
    except Exception as e:  # pickle raises PicklingError, TypeError or AttributeError
        raise ConfigError(f"field '{where}.fn' is {path!r}: it cannot be pickled for loader workers and engine tasks "
                          f"({type(e).__name__}: {e}); {_FIX} (not a lambda, a nested function or an instance)") from None
    return obj


def check_stages(stages: tuple[StageConfig, ...], source_names: list[str], path: str = "pipeline.stages") -> None:
    """Refuse, at parse, a stage whose import path is malformed or names the script being run,
    that names an unknown source, has arguments that are not plain data, or a name that is
    taken. Nothing is imported here: a command that never runs the stages (a shards-mode fit,
    ``train-tokenizer``) does not need their module (``import_stages`` is for the others)."""
    seen: set[str] = set()
    for i, stage in enumerate(stages):
        where = f"{path}[{i}]"
        _split(stage.fn, where)
        name = stage.stage_name
        if not _NAME.match(name) or name in BUILT_IN_STAGES or name in seen:
            why = ("is a built-in stage" if name in BUILT_IN_STAGES else "is taken by another stage" if name in seen
                   else "must be lowercase letters, digits and '_'")
            raise ConfigError(f"field '{where}.name': stage name {name!r} {why}; set name: to another (it labels the "
                              f"stage's drops in the ledger and the logs)")
        seen.add(name)
        try:
            json.dumps(stage.kwargs, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"field '{where}.kwargs' must be plain data (numbers, strings, lists, mappings): {e}") from None
        unknown = sorted(set(stage.sources or ()) - set(source_names))
        if unknown:
            raise ConfigError(f"field '{where}.sources' names {unknown}, which are not sources of the mix "
                              f"({sorted(source_names)}); list mix entry names, or leave sources out for all")


def import_stages(stages: tuple[StageConfig, ...], path: str = "pipeline.stages") -> None:
    """Import and build each stage once, refusing in one line naming the field a stage that cannot
    be imported or pickled by name, a kwarg its signature does not take, or a constructor that
    raises. Called where the stages are going to run (a prebuild, a stream datamodule, an
    engine's launch), before any work starts there, so the error is not a worker's traceback."""
    for i, stage in enumerate(stages):
        stage.build(f"{path}[{i}]")


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_is_plain, value))
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _is_plain(v) for k, v in value.items())
    import torch  # a tensor is data torch.load(weights_only=True) reads back

    return isinstance(value, torch.Tensor)


class _DatatroveFilter:
    """A datatrove ``BaseFilter`` as a stage: each document becomes a ``Document`` (text, id,
    metadata: the provenance fields), ``filter`` decides, and a text the filter edited is kept."""

    def __init__(self, step: Any) -> None:
        from datatrove.data import Document

        self.step, self._document = step, Document

    def __call__(self, doc: dict) -> Any:
        text = doc["text"]
        d = self._document(text=text, id=str(doc.get("doc_id", "")),
                           metadata={k: doc[k] for k in ("source", "domain", "file", "record") if k in doc})
        res = self.step.filter(d)
        keep, reason = res if isinstance(res, tuple) else (res, None)
        if not keep:
            return reason or DROPPED
        return {"text": d.text} if d.text is not text else True


class UserStageNode(BaseNode[dict]):
    """Pass on what the stage ``config`` keeps (mapped when it maps), counting every document
    under ``kept`` or its drop reason, per source. Its state: the source's, the counters, the
    stage's identity (a resume refuses another) and, for a stage with ``state_dict`` /
    ``load_state_dict``, the stage's own state (plain data, as checkpoints load it)."""

    def __init__(self, source: BaseNode, config: StageConfig, where: str = "pipeline.stages") -> None:
        super().__init__()
        self.source, self.config, self.where = source, config, where
        self.name = config.stage_name
        self.stage = config.build(where)
        self.identity = config.config_hash()
        self.stats = StageStats(self.name)
        self._stateful = callable(getattr(self.stage, "state_dict", None)) and callable(getattr(self.stage, "load_state_dict", None))
        self._fresh = copy.deepcopy(self.stage.state_dict()) if self._stateful else None

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset(None)
            self.stats.load_dict({})
            if self._stateful:
                self.stage.load_state_dict(copy.deepcopy(self._fresh))
            return
        if initial_state.get("identity") != self.identity:
            raise ResumeRefused(f"refusing to resume: stage {self.name!r} ({self.where}) is not the stage the checkpoint "
                                f"ran ({self.config.fn} with {self.config.kwargs}); resume with the same pipeline.stages")
        self.source.reset(initial_state["source"])
        self.stats.load_dict(initial_state["stats"])
        if self._stateful:
            self.stage.load_state_dict(initial_state["stage"])

    def next(self) -> dict:
        stage, stats = self.stage, self.stats
        while True:
            doc = next(self.source)
            text = doc["text"]
            try:
                out = stage(doc)
            except Exception as e:
                raise self._failed(doc, f"raised {type(e).__name__}: {' '.join(str(e).split())}") from e
            if out is True or isinstance(out, dict):
                if out is True:
                    out = doc
                elif out is not doc:
                    out = {**doc, **out}
                if out["text"] is not text:  # a new text (returned, or set on the input in place)
                    if not isinstance(out["text"], str):
                        raise self._failed(doc, f"returned a document whose 'text' is {type(out['text']).__name__}, not a string")
                    out.pop("seek", None)  # its position reads the old text: checkpointed by content (doc_refs)
                stats.add(doc["source"], KEPT)
                return out
            if out is False or out is None:
                stats.add(doc["source"], DROPPED)
            elif isinstance(out, str):
                stats.add(doc["source"], out)
            else:
                raise self._failed(doc, f"returned {type(out).__name__}; a stage returns True or a document (dict) to keep it, "
                                        "False, None or a reason (str) to drop it")

    def _failed(self, doc: dict, what: str) -> UserError:
        src, doc_id = doc.get("source"), str(doc.get("doc_id", ""))
        path = doc_id[len(src) + 1 :].rpartition("/")[0] if isinstance(src, str) and doc_id.startswith(f"{src}/") else doc_id
        return UserError(f"pipeline stage {self.name!r} ({self.config.fn}, {self.where}) {what} on source {src!r}, file "
                         f"{path!r}, record {doc.get('record')}; fix the stage or take it out of {self.where}")

    def get_state(self) -> dict:
        state = {"source": self.source.state_dict(), "stats": self.stats.to_dict(), "identity": self.identity}
        if self._stateful:
            own = self.stage.state_dict()
            if not _is_plain(own):
                raise UserError(f"pipeline stage {self.name!r} ({self.config.fn}, {self.where}): state_dict() must return plain "
                                f"data (dicts, lists, strings, numbers, tensors) that a checkpoint loads with "
                                f"torch.load(weights_only=True); got {type(own).__name__} holding other objects")
            state["stage"] = copy.deepcopy(own)  # a snapshot: the stage goes on changing its own
        return state
