"""``Config``: the one base of every config class (OLMo-core's pattern).

A config is a dataclass that subclasses ``Config``. The base gives each of them the same
parse / validate / hash / build path, so a YAML typo is caught the same way everywhere:

- ``from_dict(data, path)`` / ``from_yaml(file, key)``: checks keys (an unknown key is a
  ``ConfigError`` naming its dotted path, e.g. ``data.pipeline.dedup.nera``, and the nearest
  valid name) and coerces each value to its field's type annotation -- nested configs, tuples
  and lists, ``Optional``, unions, ``Literal``, int/float/str/bool; a wrong type names the
  field. The class's own ``__post_init__`` then checks the values' meaning.
- ``to_dict()``: plain JSON types, the form that round-trips through ``from_dict``.
- ``config_hash()``: sha256 of the canonical JSON of ``to_dict()`` (keys sorted, no spaces),
  minus ``hash_exclude``: the one hash that guards resumes and prebuilds.
- ``build(...)``: what the config describes, where a config builds something.

A subclass may set ``config_error`` (the ``ConfigError`` subclass it raises), ``hash_exclude``,
``label(data)`` (how messages name an instance, e.g. ``source 'web'``) and ``_from_value``
(accept a non-mapping, e.g. a registered mix name). A field's ``metadata={"help": ...}`` is
shown when it is missing; ``metadata={"coerce": False}`` passes its value as written, for the
class's ``__post_init__`` to parse (a field whose type depends on another, e.g.
``DataConfig.pipeline`` on ``mode``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Union

from stacklm.errors import ConfigError

_MISSING = dataclasses.MISSING
# The one YAML layout (``python -m trainer fit``, ``stacklm prebuild``, the docs): ``data:`` holds
# ``StackDataModule``'s arguments and the pipeline config (pre-training or SFT) sits here.
PIPELINE_PATH = "data.pipeline"
# Fields of a pipeline config that a run config gives one level up, in ``data:``: the pipeline
# takes them from there when its own mapping leaves them out (``with_module_fields``).
MODULE_FIELDS = ("seq_len", "batch_size", "seed")


def nearest(name: str, options: Sequence[str]) -> str | None:
    """The closest valid name to a typo (``difflib``), or ``None`` when nothing is close."""
    found = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(name: str, options: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` or ``""``: the hint appended to an unknown-name error."""
    near = nearest(name, options)
    return f"; did you mean {near!r}?" if near else ""


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if isinstance(hint, type):
        return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}.get(
            hint.__name__, hint.__name__
        )
    return str(hint).replace("typing.", "")


class Config:
    """Base of the config dataclasses (subclasses are ``@dataclass``, usually frozen)."""

    # Class attributes without annotations: ``typing.get_type_hints(Sub, Sub's module globals)``
    # evaluates every base's annotations in the subclass's module, so a ``ClassVar[...]`` here
    # failed to resolve where a config module does not import ClassVar; jsonargparse then
    # treated every field of e.g. ``OptimConfig`` as unvalidated and warned that the ``betas``
    # tuple does not round-trip (issue 25). Subclasses override them the same way or with
    # their own ``ClassVar`` annotation.
    config_error = ConfigError  # type[ConfigError]: the ConfigError subclass this config raises
    hash_exclude = ()  # tuple[str, ...]: fields config_hash() leaves out
    renamed_fields = {}  # dict[str, str]: an earlier (or another tool's) field name -> ours, for the unknown-field hint
    mapping_requires = ()  # tuple[str, ...]: fields with a default that a mapping (from_dict) must still give

    @classmethod
    def absent_message(cls, absent: Sequence[str], where: str) -> str:
        """The refusal of a mapping without ``mapping_requires`` fields (``absent``)."""
        return f"{where}: missing field(s) {list(absent)}"

    # ------------------------------------------------------------------ parse
    @classmethod
    def label(cls, data: Mapping[str, Any] | None) -> str:
        """How messages name this config (the class name; sources say ``source 'web'``)."""
        return cls.__name__

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = ""):
        """Parse ``data`` (a YAML mapping); ``path`` is where it sits in the file (``data.pipeline``)."""
        err = cls.config_error
        where = f"{path} ({cls.label(data)})" if path else cls.label(data)
        if not isinstance(data, Mapping):
            raise err(f"{where}: expected a mapping of fields, got {type(data).__name__} {data!r}")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        for key in data:
            if key not in fields:
                hint = (f"; did you mean {cls.renamed_fields[key]!r}?" if key in cls.renamed_fields
                        else did_you_mean(str(key), sorted(fields)))
                raise err(
                    f"unknown field {join_path(path, str(key))!r}{hint} "
                    f"({cls.label(data)} fields: {', '.join(sorted(fields))})"
                )
        missing = [n for n, f in fields.items() if n not in data and f.default is _MISSING and f.default_factory is _MISSING]
        if missing:
            helps = [f"{n}: {fields[n].metadata['help']}" for n in missing if "help" in fields[n].metadata]
            raise err(f"{where}: missing required field(s) {missing}" + (f" ({'; '.join(helps)})" if helps else ""))
        hints = _hints(cls)
        kw = {key: coerce(hints[key], value, join_path(path, key), err) if fields[key].metadata.get("coerce", True) else value
              for key, value in data.items()}
        absent = [n for n in cls.mapping_requires if n not in data]
        if absent:  # after the fields' own errors, which name a key that is there
            raise err(cls.absent_message(absent, where))
        return cls(**kw)

    @classmethod
    def from_yaml(cls, file: str | Path, key: str | None = None):
        """Parse a YAML file, or its dotted section ``key`` (e.g. ``"data.pipeline"``)."""
        import yaml

        try:
            doc = yaml.safe_load(Path(file).read_text())
        except FileNotFoundError:
            raise cls.config_error(f"{file}: no such config file") from None
        except yaml.YAMLError as e:
            raise cls.config_error(f"{file}: not valid YAML ({e})") from None
        for part in key.split(".") if key else ():
            if not isinstance(doc, Mapping) or part not in doc:
                raise cls.config_error(f"{file}: no section {key!r}")
            doc = doc[part]
        return cls.from_dict(doc, path=key or "")

    @classmethod
    def coerce(cls, value: Any, path: str = ""):
        """``cls`` from an instance, a mapping, or ``None`` (all defaults)."""
        if isinstance(value, cls):
            return value
        if value is None:
            try:
                return cls()
            except TypeError:
                raise cls.config_error(f"field {path or cls.__name__!r} must be set (a mapping of {cls.__name__} fields)") from None
        if isinstance(value, Mapping):
            return cls.from_dict(value, path)
        return cls._from_value(value, path)

    @classmethod
    def _from_value(cls, value: Any, path: str):
        raise cls.config_error(f"field {path or cls.__name__!r} must be a mapping of {cls.__name__} fields, got {value!r}")

    # ------------------------------------------------------------------ out
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (tuples become lists): what ``from_dict`` reads back."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def config_hash(self, exclude: Sequence[str] | None = None) -> str:
        """sha256 of the canonical JSON of ``to_dict()`` without ``exclude`` (default ``hash_exclude``)."""
        skip = self.hash_exclude if exclude is None else tuple(exclude)
        d = {k: v for k, v in self.to_dict().items() if k not in skip}
        return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def build(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} describes settings; it builds nothing")


def with_module_fields(pipeline: Mapping[str, Any], module: Mapping[str, Any]) -> dict[str, Any]:
    """``pipeline`` (a ``data.pipeline`` mapping) with each of ``MODULE_FIELDS`` it leaves out
    taken from ``module`` (the ``data:`` section's values): the rule by which the trainer, the
    prebuild and ``PipelineSection.from_run_config`` read a run config."""
    return {**{k: module[k] for k in MODULE_FIELDS if k in module and k not in pipeline}, **pipeline}


class PipelineSection(Config):
    """Base of the configs that sit at ``data.pipeline`` of a run config (``PipelineConfig``,
    ``SFTConfig``).

    Why: in a run config ``seq_len``, ``batch_size`` and ``seed`` sit one level up, in ``data:``
    (``StackDataModule``'s arguments), and the pipeline takes them from there. ``from_dict`` of
    the ``data.pipeline`` mapping alone cannot see them, and used to take 2048 and 8 silently;
    it now refuses a mapping without ``seq_len`` and ``batch_size`` in one line that says where
    they are, and ``from_run_config`` reads a whole run config (a file or its parsed mapping)
    the way the trainer does."""

    mapping_requires = ("seq_len", "batch_size")
    modes = ()  # tuple[str, ...]: the data.mode values whose pipeline is this config

    @classmethod
    def absent_message(cls, absent: Sequence[str], where: str) -> str:
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name in absent}
        return (f"{where}: no {' or '.join(repr(a) for a in absent)} in this mapping (the defaults "
                f"{', '.join(f'{k}={v}' for k, v in defaults.items())} would be used silently). In a run config they sit one "
                f"level up, in `data:` beside `pipeline:`: read the file with {cls.__name__}.from_run_config('run.yaml'), which "
                f"takes them from there as the trainer does, or give them in this mapping")

    @classmethod
    def from_run_config(cls, config: str | Path | Mapping[str, Any]):
        """The pipeline of a run config (a YAML file, or the mapping it holds), as the trainer
        and the prebuild read it: ``data.pipeline``, with ``seq_len``, ``batch_size`` and ``seed``
        from ``data:`` where the pipeline leaves them out (``data:``'s defaults where neither
        gives them: those of ``StackDataModule``, the same numbers as this class's)."""
        err = cls.config_error
        if isinstance(config, Mapping):
            doc, name = config, "run config"
        else:
            import yaml

            name = str(config)
            try:
                doc = yaml.safe_load(Path(config).read_text())
            except FileNotFoundError:
                raise err(f"{name}: no such config file") from None
            except yaml.YAMLError as e:
                raise err(f"{name}: not valid YAML ({e})") from None
        data = doc.get("data") if isinstance(doc, Mapping) else None
        if not isinstance(data, Mapping) or not isinstance(data.get("pipeline"), Mapping):
            raise err(f"{name}: no `data.pipeline` mapping (a run config holds the pipeline at {PIPELINE_PATH}, with seq_len "
                      "and batch_size in data:)")
        mode = data.get("mode", "shards")
        if cls.modes and mode not in cls.modes:
            raise err(f"{name}: data.mode is {mode!r}; {cls.__name__} is the pipeline of mode(s) {', '.join(cls.modes)}: read this "
                      "file with the config class of its mode")
        pipeline = data["pipeline"]
        module = {**{f.name: f.default for f in dataclasses.fields(cls) if f.name in MODULE_FIELDS}, **data}
        if mode == "stream":  # one place for the window's shape (the trainer refuses two)
            for key in ("seq_len", "batch_size"):
                if key in pipeline and pipeline[key] != module[key]:
                    raise err(f"{name}: {PIPELINE_PATH}.{key} ({pipeline[key]}) differs from data.{key} ({module[key]}); set it in "
                              "one place")
        try:
            return cls.from_dict(with_module_fields(pipeline, module), path=PIPELINE_PATH)
        except ConfigError as e:
            raise type(e)(e.args[0] if name in str(e) else f"{name}: {e}") from None


def _plain(value: Any) -> Any:
    if isinstance(value, Config):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def coerce(hint: Any, value: Any, path: str, err: type[ConfigError] = ConfigError) -> Any:
    """``value`` as the annotation ``hint`` says, or ``err`` naming ``path``."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        for arm in arms:  # an exact type match first: 1 stays an int in ``int | str``
            if isinstance(arm, type) and not issubclass(arm, Config) and type(value) is arm:
                return value
        last: ConfigError | None = None
        for arm in arms:
            try:
                return coerce(arm, value, path, err)
            except ConfigError as e:
                last = e
        if len(arms) == 1 and last is not None:
            raise last
        names = " or ".join(_type_name(a) for a in args)
        raise err(f"field {path!r} must be {names}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise err(f"field {path!r} must be one of {args}, got {value!r}{did_you_mean(str(value), [str(a) for a in args])}")
        return value
    if isinstance(hint, type) and issubclass(hint, Config):
        return hint.coerce(value, path)
    if value is None:
        raise err(f"field {path!r} must be {_type_name(hint)}, got null")
    if origin in (tuple, list, Sequence) or hint in (tuple, list):
        item = args[0] if args else Any
        if isinstance(value, str) and item is str and origin is tuple:
            value = [value]  # one glob where a list is expected
        if not isinstance(value, (list, tuple)):
            raise err(f"field {path!r} must be a list, got {value!r}")
        items = [coerce(item, v, join_path(path, i), err) for i, v in enumerate(value)]
        return list(items) if origin is list or hint is list else tuple(items)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise err(f"field {path!r} must be a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {coerce(kt, k, join_path(path, str(k)), err): coerce(vt, v, join_path(path, str(k)), err) for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise err(f"field {path!r} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, float) and value.is_integer():  # YAML "2.0e10" is a float
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise err(f"field {path!r} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise err(f"field {path!r} must be a number, got {value!r}")
        return value  # an int stays an int, so to_dict (and the hash) keeps what was written
    if hint is str:
        if not isinstance(value, str):
            raise err(f"field {path!r} must be a string, got {value!r}")
        return value
    return value
