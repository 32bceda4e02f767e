"""Hugging Face streams as a document source, with the offline fallback for opening only."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

from torchdata.nodes import BaseNode

from stacklm.data.sources.files import glob_files
from stacklm.data.sources.parts import DEFAULT_TEXT_COLUMN, FIRST_ROWS_CHECK, TextPartSource
from stacklm.data.sources.readers import DatasetsReader, dataset_rows, import_datasets
from stacklm.data.sources.sharding import ShardSpec, assign_parts
from stacklm.data.sources.synthetic import SyntheticSource
from stacklm.errors import SourceError, SourceNotFoundError, column_error
from stacklm.once import first_time, in_loader_worker

FALLBACK_OFFLINE = "fallback_offline"


def hub_load_kwargs(split: str, **optional: Any) -> dict[str, Any]:
    """``load_dataset`` keyword arguments for a stream: ``split``, ``streaming`` and every
    optional one (``name``, ``data_dir``, ``data_files``, ``revision``) that is set."""
    return {"split": split, "streaming": True, **{k: v for k, v in optional.items() if v is not None}}


# ``datasets``' packaged builders: with one of these as ``path``, ``data_files`` are local paths.
PACKAGED_BUILDERS = frozenset({"json", "parquet", "text", "csv", "arrow", "pandas", "xml", "webdataset"})


def check_data_files(label: str, name: str, path: str, data_files: Sequence[str] | None) -> None:
    """Raise ``SourceNotFoundError`` naming the source and the pattern when a *local* ``data_files``
    glob matches nothing. Why here: ``datasets`` says so as an opaque ``StopIteration`` (json
    builder) or "all the data_files are invalid: {'train': []}", with no pattern in it. Local means
    ``path`` is a packaged builder (patterns relative to the cwd) or an existing folder (relative
    to it); hub ids and URLs are left to ``datasets``."""
    if not data_files:
        return
    if path in PACKAGED_BUILDERS:
        base = None
    elif os.path.isdir(os.path.expanduser(path)):
        base = os.path.expanduser(path)
    else:
        return
    for pattern in data_files:
        if "://" in pattern or glob_files([pattern if base is None else os.path.join(base, pattern)]):
            continue
        where = f"the folder {base}" if base is not None else f"the cwd {os.getcwd()}"
        raise SourceNotFoundError(
            f"{label} {name!r} (kind hf, path {path!r}): data_files {pattern!r} matched no files (relative to {where}); "
            f"check data_files and path",
            source=name,
            file=pattern,
        )


class HFStreamSource(TextPartSource):
    """``datasets.load_dataset(path, name, split=..., streaming=True, ...)``; one part per
    dataset shard. Only *opening* may fall back to the synthetic corpus, only when the user
    opted in (``fallback_offline=True``; off by default) and only for want of a network;
    errors after that propagate. A fallback is a loud warning, and is counted
    (``stats[name]["fallback_offline"]``), which ``data_stats()``, the W&B run config and the
    prebuild manifest report as ``offline_fallback``.
    """

    def __init__(
        self,
        name: str,
        path: str,
        domain: str,
        *,
        config_name: str | None = None,
        split: str = "train",
        data_dir: str | None = None,
        data_files: str | Sequence[str] | None = None,
        revision: str | None = None,
        text_column: str = "text",
        shard: ShardSpec | None = None,
        fallback_offline: bool = False,
        fallback_seed: int = 0,
        fallback_docs: int | None = None,
        first_rows_check: int = FIRST_ROWS_CHECK,
        on_invalid: str = "skip",
    ) -> None:
        super().__init__(
            name, domain, text_column=text_column, shard=shard, first_rows_check=first_rows_check, on_invalid=on_invalid
        )
        self.path, self.config_name, self.split = path, config_name, split
        self.data_dir, self.revision = data_dir, revision
        self.data_files = [data_files] if isinstance(data_files, str) else (list(data_files) if data_files else None)
        self.fallback_offline, self.fallback_seed, self.fallback_docs = fallback_offline, fallback_seed, fallback_docs
        self._fallback: SyntheticSource | None = None

    @classmethod
    def from_entry(cls, entry: Any, *, shard: ShardSpec | None = None, fallback_offline: bool = False) -> HFStreamSource:
        """The stream of a ``SourceConfig`` (typed ``Any``: the schema builds through ``entry``,
        which imports this module, so importing the schema here would be a circle)."""
        return cls(
            entry.name, entry.path, entry.domain, config_name=entry.config_name, split=entry.split,
            data_dir=entry.data_dir, data_files=entry.data_files, revision=entry.revision,
            text_column=entry.text_column or DEFAULT_TEXT_COLUMN, shard=shard, fallback_offline=fallback_offline,
            fallback_seed=entry.seed, fallback_docs=entry.num_docs,
            on_invalid=entry.invalid_policy(),
        )

    def _describe(self) -> str:
        bits = [self.path] + [f"{k}={v}" for k, v in (("name", self.config_name), ("data_dir", self.data_dir),
                                                       ("revision", self.revision)) if v]
        if self.data_files:
            bits.append(f"data_files={self.data_files}")
        return f"datasets stream {' '.join(bits)} split={self.split}"

    def _load(self):
        kwargs = hub_load_kwargs(self.split, name=self.config_name, data_dir=self.data_dir, data_files=self.data_files,
                                 revision=self.revision)
        check_data_files("source", self.name, self.path, self.data_files)
        return import_datasets().load_dataset(self.path, **kwargs)

    def _list_parts(self) -> list[str]:  # opening is done by reset(), which may fall back
        raise AssertionError("HFStreamSource opens its stream in reset()")

    def _use_dataset(self, ds) -> None:
        """Validate the opened stream (errors here never fall back) and split it into parts."""
        columns = list(ds.features) if ds.features is not None else None
        if columns is None:  # features unknown until read: look at the first row
            try:
                first = next(dataset_rows(ds), None)
            except Exception as e:  # e.g. the json builder given parquet files: name the source
                raise SourceError(
                    f"source {self.name!r}: cannot read the first row of {self._describe()}: {type(e).__name__}: {e}. "
                    f"Check that the builder (path) matches the files' format",
                    source=self.name,
                    file=self.path,
                ) from e
            if first is None:
                raise SourceError(f"source {self.name!r}: {self._describe()} contains no rows", source=self.name, file=self.path)
            columns = list(first)
        if self.text_column not in columns:
            raise column_error(self.name, self.text_column, columns, self._describe())
        if len(columns) > 1:
            ds = ds.select_columns([self.text_column])  # convert only the column we use
        self._dataset = ds
        self._parts = [f"shard{j:05d}" for j in range(ds.n_shards)]  # in doc_ids: a dedup index keys on them
        files = shard_files(ds)
        # what provenance names a part by (stacklm.data.storage.provenance.source_files): its file, when it has one
        self.part_labels = [f"shard{j:05d} ({files[j]})" for j in range(ds.n_shards)] if files else list(self._parts)
        self._assigned, self._strided = assign_parts(len(self._parts), self.shard)

    def _open_part(self, part: int, position: dict | None, piece=None):
        return DatasetsReader(self._hub_shard(part), self.text_column, self.name, f"{self._describe()} {self._parts[part]}", position)

    def reset(self, initial_state: dict | None = None) -> None:
        st = initial_state or {}
        if self._parts is None and self._fallback is None:
            if st.get("fallback"):  # a resumed fallback stream stays the same stream
                self._start_fallback(None)
            else:
                try:
                    ds = self._load()
                except SourceNotFoundError:
                    raise  # a user's path, never the network: no fallback, no rewording
                except Exception as e:  # only *opening*, and only for want of a network, may fall back
                    if not (self.fallback_offline and _is_unreachable(e)):
                        # The fix is the source (id, config, files, network); never the synthetic
                        # corpus, which would train on other data than asked for.
                        raise SourceError(
                            f"source {self.name!r}: cannot open {self._describe()}: {type(e).__name__}: {e}. Check the "
                            f"hub id, config, data_files and the network (HF_HUB_OFFLINE=1 needs the dataset in the local cache)",
                            source=self.name,
                            file=self.path,
                        ) from e
                    self._start_fallback(f"{type(e).__name__}: {e}")
                else:
                    self._use_dataset(ds)
        if self._fallback is not None:
            if initial_state is not None and not st.get("fallback"):
                raise SourceError(
                    f"source {self.name!r}: the checkpoint is from the real stream of {self._describe()}, but it could "
                    f"not be opened now; resume where the hub is reachable",
                    source=self.name,
                    file=self.path,
                )
            BaseNode.reset(self, initial_state)
            self._fallback.reset(st.get("synthetic"))
            if initial_state is None:
                self.stats.add(self.name, FALLBACK_OFFLINE)
            return
        if st.get("fallback"):
            raise SourceError(
                f"source {self.name!r}: the checkpoint is from the offline fallback, but this node opened the real "
                f"stream; build it the same way as the checkpointed run",
                source=self.name,
                file=self.path,
            )
        super().reset(initial_state)

    def _start_fallback(self, reason: str | None) -> None:
        self._fallback = SyntheticSource(
            self.name, self.domain, seed=self.fallback_seed, num_docs=self.fallback_docs, shard=self.shard,
            stats=self.stats, label="synthetic-fallback",
        )
        # once per source and process; a loader worker leaves it to the main process, which
        # sees the fallback in the workers' summaries (stacklm.datamodule.loader)
        if reason is not None and not in_loader_worker() and first_time(FALLBACK_OFFLINE, self.name):
            warnings.warn(
                f"stacklm: OFFLINE FALLBACK: source {self.name!r}: could not open {self._describe()} ({reason}); "
                f"training on the synthetic {self.domain} corpus instead, because fallback_offline=True. The run is NOT "
                "reading the real data (recorded in data_stats()['offline_fallback'], the W&B config and the manifest).",
                RuntimeWarning,
                stacklevel=3,
            )

    @property
    def bytes_read(self) -> int:
        """UTF-8 bytes of the records read by this process, the fallback's included."""
        return self.text_bytes + (self._fallback.text_bytes if self._fallback is not None else 0)

    def reread(self, files, seeks, records, rows) -> list[dict]:
        """Only the offline fallback's documents carry a position (``seek``): a hub stream does not
        seek, so its buffered documents are checkpointed as content (``stacklm.data.doc_refs``)."""
        if self._fallback is None:
            raise ValueError(f"source {self.name!r}: a hub stream's documents are not re-read by position")
        return self._fallback.reread(files, seeks, records, rows)

    @property
    def is_fallback(self) -> bool:
        return self._fallback is not None

    def next(self) -> dict:
        if self._fallback is not None:
            return self._fallback.next()
        return super().next()

    def get_state(self) -> dict:
        if self._fallback is not None:
            return {"fallback": 1, "synthetic": self._fallback.get_state()}
        return super().get_state()


def shard_files(ds) -> list[str] | None:
    """The file name of each shard of a ``datasets`` stream read from files (one file a shard,
    as the packaged builders ``parquet``/``json``/``text`` make them), else ``None``: so a part
    label names the file a record came from (provenance, step log), not only its shard number.
    Reads the stream's generator arguments (not a public ``datasets`` API, hence the guards)."""
    kwargs = getattr(getattr(ds, "_ex_iterable", None), "kwargs", None)
    files = kwargs.get("files") if isinstance(kwargs, dict) else None
    if not isinstance(files, list) or len(files) != getattr(ds, "n_shards", -1) or not all(isinstance(f, str) for f in files):
        return None
    return [os.path.basename(f.split("::")[0].rstrip("/")) for f in files]


# Exception class names (anywhere in the cause chain) that mean "the hub is unreachable", as
# raised by datasets, huggingface_hub, requests, httpx and urllib3. Anything else (a wrong
# hub id, a corrupt file) is a real error and must not be papered over by the fallback.
_UNREACHABLE = {
    "ConnectionError", "ConnectError", "ConnectTimeout", "ReadTimeout", "Timeout", "TimeoutError",
    "OfflineModeIsEnabled", "LocalEntryNotFoundError", "NameResolutionError", "MaxRetryError", "NewConnectionError",
}


def _is_unreachable(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ in _UNREACHABLE for cls in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
