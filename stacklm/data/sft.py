"""SFT pipes: conversation files or hub datasets -> validated turns -> rendered ids with an
assistant-only loss -> best-fit packing per conversation -> batches in the batch contract.

    ConversationSource (jsonl / parquet / hub; ``messages`` or ShareGPT ``conversations``)
      -> [HoldoutNode]  -> RenderNode (render, truncate at a turn boundary or drop)
    [-> weighted interleave of several sources] -> ShuffleNode -> SFTPackNode -> batch + collate_sft

A packed row holds whole conversations only (one is never cut across rows), each starting
with ``<|bos|>``, so ``seq_ids`` and ``position_ids`` derive from the tokens exactly as for
pre-training windows (``pack.segment_layout``): no conversation attends to another and
positions restart at 0 for each. ``targets`` is ``-100`` except on assistant tokens.

Loss-tagged ids. Between rendering and collation a conversation travels as ONE int32 array
in which a loss-bearing token ``t`` is stored as ``~t`` (``-t - 1``, always negative) and
every other token as itself (``tag_loss`` / ``untag_loss``). That lets the existing shuffle
buffer and best-fit packer (and their compact checkpoint state: one concatenated token
array) carry the mask with the ids without knowing about it.

Every rejected conversation is counted by reason, per source (``chat.INVALID_REASONS`` in the
source stage; ``truncated`` / ``dropped_too_long`` in the render stage), and the first
location of each reason is kept (``SFTPipeline.examples()``) so a drop is never silent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode, Batcher, Mapper, MultiNodeWeightedSampler, StopCriteria

from stacklm.chat import (
    ASSISTANT,
    DEFAULT_ROLE_ALIASES,
    MALFORMED_JSON,
    ChatFormatError,
    Turn,
    as_turns,
    assemble,
    chat_tokens,
    conversation_from_record,
    render_turns,
    validate_conversation,
)
from stacklm.data.audit import clean_text
from stacklm.data.holdout import HoldoutNode, check_split
from stacklm.data.contract import IGNORE_INDEX, contract_batch, contract_buffer, contract_planes
from stacklm.data.pack import BestFitPacker, PackNode, segment_layout
from stacklm.data.shuffle import ShuffleNode
from stacklm.data.sources import (
    DatasetsReader,
    EmptySourceError,
    JsonlReader,
    PartNode,
    ShardSpec,
    SourceError,
    SourceNotFoundError,
    file_format,
    glob_files,
    hub_load_kwargs,
    import_datasets,
)
from stacklm.data.stats import StageStats, chain_stats

logger = logging.getLogger(__name__)

OVERLONG_RULES = ("truncate", "drop")
ON_INVALID = ("drop", "raise")
KEPT = "kept"
TRUNCATED = "truncated"
TURNS_CUT = "turns_cut"
DROPPED_TOO_LONG = "dropped_too_long"
CONTENT_REPAIRED = "content_repaired"
INVALID_UTF8_LINES = "invalid_utf8_lines"


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------
def _unknown_keys(what: str, data: Mapping[str, Any], cls) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown}; known: {sorted(known)}")


@dataclass(frozen=True)
class SFTSourceConfig:
    """One conversation dataset.

    ``kind="local"``: ``files`` are globs of ``.jsonl``/``.ndjson``/``.json`` (JSON lines,
    optionally ``.gz``/``.zst``) or ``.parquet`` files. ``kind="hf"``:
    ``datasets.load_dataset(path, config_name, split=..., streaming=True, ...)`` -- a hub id, or
    a builder such as ``"json"``/``"parquet"`` with ``data_files``. ``column``: the list of
    messages; ``None`` picks ``messages``, else ``conversations`` (ShareGPT ``from``/``value``).
    """

    name: str
    kind: str = "local"
    files: tuple[str, ...] = ()
    path: str | None = None
    config_name: str | None = None
    split: str = "train"
    data_files: tuple[str, ...] | None = None
    data_dir: str | None = None
    revision: str | None = None
    column: str | None = None
    domain: str = "chat"
    weight: float = 1.0

    def __post_init__(self) -> None:
        where = f"sft source {self.name!r}"
        if self.kind not in ("local", "hf"):
            raise ValueError(f"{where}: field 'kind' must be 'local' or 'hf', got {self.kind!r}")
        if self.kind == "local" and not self.files:
            raise ValueError(f"{where}: field 'files' (globs of .jsonl/.parquet files) is required for kind 'local'")
        if self.kind == "hf" and not self.path:
            raise ValueError(f"{where}: field 'path' (hub id or builder like 'json') is required for kind 'hf'")
        if not self.weight > 0:
            raise ValueError(f"{where}: field 'weight' must be > 0, got {self.weight}")
        for f in ("files", "data_files"):
            v = getattr(self, f)
            if isinstance(v, str):
                object.__setattr__(self, f, (v,))
            elif v is not None:
                object.__setattr__(self, f, tuple(v))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SFTSourceConfig":
        if "name" not in data:
            raise ValueError(f"sft source {dict(data)}: missing field 'name'")
        _unknown_keys(f"sft source {data['name']!r}", data, cls)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["files"] = list(self.files)
        d["data_files"] = list(self.data_files) if self.data_files is not None else None
        return d


@dataclass(frozen=True)
class SFTConfig:
    """Everything that decides the SFT stream. ``config_hash`` guards resumes.

    ``pack_buffer``: conversations held by the best-fit packer (1 = one conversation per row,
    padded). ``overlong``: a conversation longer than ``seq_len`` is cut after the last
    assistant turn that fits (``truncate``) or dropped (``drop``); both counted.
    ``on_invalid``: ``drop`` counts a malformed line / unknown role / empty message / no
    assistant turn and goes on (the first location of each reason is logged and kept);
    ``raise`` stops at the first one.
    """

    sources: tuple[SFTSourceConfig, ...]
    seq_len: int = 2048
    batch_size: int = 8
    seed: int = 0
    shuffle_buffer: int = 1000
    pack_buffer: int = 128
    overlong: str = "truncate"
    on_invalid: str = "drop"
    holdout_fraction: float = 0.01
    role_aliases: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ROLE_ALIASES))
    drop_last: bool = False

    def __post_init__(self) -> None:
        w = "sft config"
        if not self.sources:
            raise ValueError(f"{w}: field 'sources' is empty; list at least one conversation dataset")
        object.__setattr__(self, "sources", tuple(self.sources))
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"{w}: source names must be unique, got {names}")
        if self.seq_len < 8:
            raise ValueError(f"{w}: field 'seq_len' must be >= 8, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"{w}: field 'batch_size' must be >= 1, got {self.batch_size}")
        if self.pack_buffer < 1 or self.shuffle_buffer < 1:
            raise ValueError(f"{w}: fields 'pack_buffer' and 'shuffle_buffer' must be >= 1")
        if self.overlong not in OVERLONG_RULES:
            raise ValueError(f"{w}: field 'overlong' must be one of {OVERLONG_RULES}, got {self.overlong!r}")
        if self.on_invalid not in ON_INVALID:
            raise ValueError(f"{w}: field 'on_invalid' must be one of {ON_INVALID}, got {self.on_invalid!r}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"{w}: field 'holdout_fraction' must be in [0, 1), got {self.holdout_fraction}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SFTConfig":
        """From the ``data.sft`` section of a YAML config (see ``configs/sft.yaml``)."""
        _unknown_keys("sft config", data, cls)
        if "sources" not in data:
            raise ValueError("sft config: missing field 'sources' (a list of {name, kind, files|path, ...})")
        kw = dict(data)
        kw["sources"] = tuple(s if isinstance(s, SFTSourceConfig) else SFTSourceConfig.from_dict(s) for s in data["sources"])
        if kw.get("role_aliases") is not None:
            kw["role_aliases"] = dict(kw["role_aliases"])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["sources"] = [s.to_dict() for s in self.sources]
        d["role_aliases"] = dict(self.role_aliases)
        return d

    def config_hash(self) -> str:
        """sha256 of the canonical config: a resume with another stream is refused on this."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------------------------------
# Plain logic: loss tags, truncation, rendering for SFT, collation
# ---------------------------------------------------------------------------------------
def tag_loss(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """One int32 array carrying ids and loss mask: loss-bearing ``t`` stored as ``~t``."""
    ids = np.asarray(ids, dtype=np.int32)
    return np.where(np.asarray(mask, dtype=bool), ~ids, ids).astype(np.int32, copy=False)


def untag_loss(tagged: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``tag_loss``: ``(ids, loss_mask)``, any shape."""
    tagged = np.asarray(tagged)
    loss = tagged < 0
    return np.where(loss, ~tagged, tagged), loss


def truncation_point(turns: Sequence[Turn], segments: Sequence[np.ndarray], seq_len: int) -> int:
    """Number of leading turns to keep: the longest prefix that ends on an assistant turn and
    renders (``<|bos|>`` + turns + ``<|eos|>``) within ``seq_len`` tokens; 0 when none does."""
    ends = 2 + np.cumsum([len(s) for s in segments])
    ok = (ends <= seq_len) & np.array([t.role == ASSISTANT for t in turns])
    hits = np.flatnonzero(ok)
    return int(hits[-1]) + 1 if hits.size else 0


def render_for_sft(
    turns: Sequence[Turn], tokenizer: Any, seq_len: int, overlong: str = "truncate"
) -> tuple[np.ndarray | None, str, int]:
    """``(loss-tagged ids or None, outcome, turns cut)``; outcome is ``kept``, ``truncated``
    or ``dropped_too_long``. The ids are at most ``seq_len`` long."""
    if overlong not in OVERLONG_RULES:
        raise ValueError(f"overlong must be one of {OVERLONG_RULES}, got {overlong!r}")
    segments = render_turns(turns, tokenizer)
    if 2 + sum(len(s) for s in segments) <= seq_len:
        return tag_loss(*assemble(turns, segments, tokenizer)), KEPT, 0
    k = truncation_point(turns, segments, seq_len) if overlong == "truncate" else 0
    if k == 0:
        return None, DROPPED_TOO_LONG, len(turns)
    return tag_loss(*assemble(turns[:k], segments[:k], tokenizer)), TRUNCATED, len(turns) - k


def collate_sft(windows: Sequence[np.ndarray] | np.ndarray, bos_id: int, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Loss-tagged windows (each ``seq_len``) -> the batch contract, ``(B, seq_len - 1)`` long
    tensors; ``targets`` is the next token where it bears loss, else ``-100``."""
    w = np.asarray(windows) if isinstance(windows, np.ndarray) else np.stack(windows)
    if w.ndim != 2 or w.shape[1] < 2:
        raise ValueError(f"expected windows of shape (batch, seq_len >= 2), got {w.shape}")
    ids, loss = untag_loss(w.astype(np.int64, copy=False))
    seg, pos = segment_layout(ids, bos_id, eos_id, pad_id)
    out = contract_buffer(ids.shape[0], ids.shape[1] - 1)
    planes = contract_planes(out)
    planes.input_ids[:] = ids[:, :-1]
    np.copyto(planes.targets, np.where(loss[:, 1:], ids[:, 1:], IGNORE_INDEX))
    planes.position_ids[:] = pos[:, :-1]
    planes.seq_ids[:] = seg[:, :-1]
    return contract_batch(out)


class CollateSFT:
    """Picklable ``collate_sft`` bound to the special ids."""

    def __init__(self, bos_id: int, eos_id: int, pad_id: int) -> None:
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    def __call__(self, windows: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        return collate_sft(windows, self.bos_id, self.eos_id, self.pad_id)


class ConversationPacker(BestFitPacker):
    """Best-fit packing of rendered conversations (loss-tagged, already ``<bos> ... <eos>``).

    The same buffer, placement rule and state as ``BestFitPacker``; only the piece differs:
    a conversation arrives rendered, so it is taken as it is (never wrapped, never cut).
    """

    def _wrap(self, doc: dict) -> np.ndarray:
        piece = np.asarray(doc["ids"], dtype=np.int32)
        if len(piece) > self.seq_len:
            raise ValueError(
                f"conversation {doc.get('doc_id')!r} of source {doc.get('source')!r} has {len(piece)} tokens > "
                f"seq_len={self.seq_len}; render it with render_for_sft (truncates or drops overlong ones)"
            )
        if len(piece) == 0 or int(piece[0]) != self.bos_id:  # <|bos|> never bears loss, so it is untagged
            raise ValueError(f"conversation {doc.get('doc_id')!r}: a rendered conversation starts with <|bos|>")
        self.docs += 1
        self.doc_tokens += len(piece)
        self.stats.add(doc.get("source", "?"), KEPT)
        return piece


def sft_batch(
    conversations: Iterable[Any],
    tokenizer: Any,
    seq_len: int,
    *,
    overlong: str = "truncate",
    pack_buffer: int | None = None,
    role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
    stats: StageStats | None = None,
) -> dict[str, torch.Tensor]:
    """One packed SFT batch from a list of conversations, without any nodes.

    Each conversation is a list of ``Turn``/``{"role", "content"}`` or a record with a
    ``messages``/``conversations`` field. Invalid conversations raise ``ChatFormatError``
    (a list in hand is fixed, not filtered); overlong ones follow ``overlong`` and are
    counted in ``stats`` (``kept`` / ``truncated`` / ``dropped_too_long``). All conversations
    share one best-fit buffer unless ``pack_buffer`` is given, so the rows are as full as the
    lengths allow.
    """
    ct = chat_tokens(tokenizer)
    conversations = list(conversations)
    packer = ConversationPacker(seq_len, ct.bos, ct.eos, ct.pad, buffer_docs=pack_buffer or max(1, len(conversations)))
    stats = stats if stats is not None else StageStats("render")
    windows: list[np.ndarray] = []
    for i, conv in enumerate(conversations):
        where = f"conversation {i}"
        if isinstance(conv, Mapping):
            turns = conversation_from_record(conv, role_aliases=role_aliases, where=where)
        else:
            try:
                turns = as_turns(conv)
            except ChatFormatError as e:
                raise ChatFormatError(str(e), reason=e.reason, where=where) from None
        validate_conversation(turns, where=where)
        piece, outcome, cut = render_for_sft(turns, tokenizer, seq_len, overlong)
        stats.add("batch", outcome)
        if cut and piece is not None:
            stats.add("batch", TURNS_CUT, cut)
        if piece is not None:
            windows += packer.push({"ids": piece, "source": "batch", "doc_id": where})
    windows += packer.finish()
    if not windows:
        raise ValueError(f"no conversation fits in seq_len={seq_len} (dropped: {stats.total(DROPPED_TOO_LONG)})")
    return collate_sft(windows, ct.bos, ct.eos, ct.pad)


# ---------------------------------------------------------------------------------------
# Source node
# ---------------------------------------------------------------------------------------
def _parse_json_line(raw: bytes, where: str) -> tuple[dict, bool]:
    """``(record, had_invalid_utf8)``; malformed lines raise ``ChatFormatError`` at ``where``."""
    lenient = False
    try:
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError:
            obj, lenient = json.loads(raw.decode("utf-8", errors="replace")), True
    except json.JSONDecodeError as e:
        raise ChatFormatError(
            f"not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object", reason=MALFORMED_JSON, where=where
        ) from None
    except RecursionError:
        raise ChatFormatError("JSON nested too deeply", reason=MALFORMED_JSON, where=where) from None
    if not isinstance(obj, dict):
        raise ChatFormatError(f"expected a JSON object per line, got {type(obj).__name__}", reason=MALFORMED_JSON, where=where)
    return obj, lenient


def conversation_text(turns: Sequence[Turn]) -> str:
    """A canonical text of the conversation (the holdout hashes it)."""
    return "\n".join(f"{t.role}: {t.content}" for t in turns)


class ConversationSource(PartNode):
    """Conversations of one ``SFTSourceConfig`` as ``{"turns", "text", "source", "domain",
    "doc_id"}``, validated (``chat.validate_conversation``) and with every rejection counted.

    Reading is by parts (files, or a hub dataset's shards) split across (rank, worker) with
    ``sources.assign_parts``, through the same machinery as the pre-training sources
    (``sources.PartNode``); the state is theirs plus the first location of each rejection
    reason.
    """

    KIND = "sft source"

    def __init__(
        self,
        spec: SFTSourceConfig,
        *,
        shard: ShardSpec | None = None,
        role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
        on_invalid: str = "drop",
    ) -> None:
        if on_invalid not in ON_INVALID:
            raise ValueError(f"on_invalid must be one of {ON_INVALID}, got {on_invalid!r}")
        super().__init__(spec.name, spec.domain, shard=shard, stage="sft_source")
        self.spec = spec
        self.role_aliases, self.on_invalid = dict(role_aliases), on_invalid
        self.first_where: dict[str, str] = {}

    # parts ---------------------------------------------------------------------------
    def _describe(self) -> str:
        s = self.spec
        if s.kind == "local":
            return f"files {list(s.files)}"
        extra = " ".join(f"{k}={v}" for k, v in (("name", s.config_name), ("data_files", s.data_files), ("revision", s.revision)) if v)
        return f"datasets {s.path} {extra} split={s.split}".replace("  ", " ")

    def _list_parts(self) -> list[str]:
        s = self.spec
        if s.kind == "local":
            paths = glob_files(s.files)
            if not paths:
                raise SourceNotFoundError(
                    f"sft source {self.name!r}: {list(s.files)} matched no files (cwd {os.getcwd()}); check the paths",
                    source=self.name,
                    file=str(list(s.files)),
                )
            for p in paths:
                try:
                    fmt = file_format(p)
                except ValueError as e:
                    raise SourceError(f"sft source {self.name!r}: {e}", source=self.name, file=p) from None
                if fmt == "txt":
                    raise SourceError(
                        f"sft source {self.name!r}: {p} is plain text; conversations come as JSON lines or parquet",
                        source=self.name,
                        file=p,
                    )
            return paths
        kwargs = hub_load_kwargs(s.split, name=s.config_name, data_dir=s.data_dir, revision=s.revision,
                                 data_files=list(s.data_files) if s.data_files else None)
        try:
            self._dataset = import_datasets().load_dataset(s.path, **kwargs)
        except Exception as e:
            raise SourceError(
                f"sft source {self.name!r}: cannot open {self._describe()}: {type(e).__name__}: {e}",
                source=self.name,
                file=s.path,
            ) from e
        return [f"shard{j:05d}" for j in range(self._dataset.n_shards)]

    def _open_part(self, part: int, position: dict | None):
        if self.spec.kind == "hf":
            return DatasetsReader(self._hub_shard(part), "", self.name, f"{self._describe()} {self._parts[part]}", position)
        path = self._parts[part]
        if file_format(path) == "jsonl":
            return JsonlReader(path, "", self.name, position)
        ds = import_datasets().load_dataset("parquet", data_files=[path], split="train", streaming=True)
        return DatasetsReader(ds, "", self.name, path, position)

    def _where(self) -> str:
        r = self._reader
        if isinstance(r, JsonlReader):
            return f"{r.path}:{r.line}"
        return f"{r.label} row {r.row - 1}"

    # node ----------------------------------------------------------------------------
    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.first_where = dict((initial_state or {}).get("first_where", {}))

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "first_where": dict(self.first_where)}

    def _reject(self, err: ChatFormatError) -> None:
        self.stats.add(self.name, err.reason)
        if err.reason not in self.first_where:
            self.first_where[err.reason] = str(err)
            if self.on_invalid == "drop":
                logger.warning("sft source %r: dropping conversations (%s); first: %s", self.name, err.reason, err)
        if self.on_invalid == "raise":
            raise err

    def _turns(self, raw: Any, where: str) -> list[Turn]:
        if isinstance(raw, (bytes, bytearray)):
            record, lenient = _parse_json_line(bytes(raw), where)
            if lenient:
                self.stats.add(self.name, INVALID_UTF8_LINES)
        else:
            record = raw
        turns = conversation_from_record(record, column=self.spec.column, role_aliases=self.role_aliases, where=where)
        repaired = False
        for i, t in enumerate(turns):  # NULs and lone surrogates: repaired the audit's way, counted
            text, audit = clean_text(t.content)
            if audit.repaired:
                turns[i], repaired = Turn(t.role, text), True
        if repaired:
            self.stats.add(self.name, CONTENT_REPAIRED)
        validate_conversation(turns, where=where)
        return turns

    def _document(self, raw: Any, row: int) -> dict | None:
        try:
            turns = self._turns(raw, self._where())
        except ChatFormatError as e:
            self._reject(e)
            return None
        self.stats.add(self.name, KEPT)
        return {
            "turns": turns,
            "text": conversation_text(turns),
            "source": self.name,
            "domain": self.domain,
            "doc_id": f"{self.name}/{os.path.basename(self._parts[self._assigned[self._k]])}/{row}",
        }

    def _check_exhausted(self) -> None:
        if self._emitted:
            return
        if self._owned_rows:
            reasons = {k: v for k, v in self.stats.to_dict().get(self.name, {}).items() if k != KEPT}
            first = "; ".join(f"{k}: {v}" for k, v in self.first_where.items())
            raise EmptySourceError(
                f"sft source {self.name!r}: all {self._owned_rows} conversations of {self._describe()} were rejected "
                f"({reasons}); first of each: {first}",
                source=self.name,
                file=self._describe(),
            )
        if self._global_row == 0:
            raise EmptySourceError(f"sft source {self.name!r}: {self._describe()} contains no rows", source=self.name, file=self._describe())


# ---------------------------------------------------------------------------------------
# Render and pack nodes
# ---------------------------------------------------------------------------------------
class RenderNode(BaseNode[dict]):
    """Turns -> ``{"ids": loss-tagged int32, "source", "domain", "doc_id"}`` of at most
    ``seq_len`` tokens; overlong conversations truncated at a turn boundary or dropped, and
    counted in ``stats``. ``counts()`` gives the conversations, tokens and loss-bearing tokens
    emitted (kept apart from ``stats``, whose non-``kept`` reasons are read as data lost)."""

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[dict], tokenizer: Any, seq_len: int, overlong: str = "truncate") -> None:
        super().__init__()
        if overlong not in OVERLONG_RULES:
            raise ValueError(f"overlong must be one of {OVERLONG_RULES}, got {overlong!r}")
        self.source, self.tokenizer, self.seq_len, self.overlong = source, tokenizer, int(seq_len), overlong
        self.stats = StageStats("render")
        self._counts = np.zeros(3, dtype=np.int64)  # conversations, tokens, loss tokens emitted

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {}
        self.source.reset(st.get(self.SOURCE_KEY))
        self.stats.load_dict(st.get("stats", {}))
        self._counts = np.array(st.get("counts", np.zeros(3)), dtype=np.int64)

    def counts(self) -> dict[str, int]:
        docs, tokens, loss = (int(x) for x in self._counts)
        return {"docs": docs, "tokens": tokens, "loss_tokens": loss}

    def next(self) -> dict:
        while True:
            conv = next(self.source)
            src = conv.get("source", "?")
            piece, outcome, cut = render_for_sft(conv["turns"], self.tokenizer, self.seq_len, self.overlong)
            self.stats.add(src, outcome)
            if piece is None:
                continue
            if cut:
                self.stats.add(src, TURNS_CUT, cut)
            self._counts += (1, len(piece), int((piece < 0).sum()))
            return {"ids": piece, "source": src, "domain": conv.get("domain", "chat"), "doc_id": conv.get("doc_id")}

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), "stats": self.stats.to_dict(), "counts": self._counts.copy()}


class SFTPackNode(PackNode):
    """``PackNode`` (same buffering and exact state) over a ``ConversationPacker``."""

    def __init__(self, source: BaseNode[dict], seq_len: int, bos_id: int, eos_id: int, pad_id: int, buffer_docs: int = 128) -> None:
        super().__init__(source, seq_len, "best_fit", bos_id, eos_id, pad_id, buffer_docs)
        self.packer = ConversationPacker(seq_len, bos_id, eos_id, pad_id, buffer_docs)


# ---------------------------------------------------------------------------------------
# The graph
# ---------------------------------------------------------------------------------------
@dataclass
class SFTPipeline:
    """The built SFT graph; ``batches`` is what a loader iterates (its ``state_dict()`` is the
    whole graph's exact position)."""

    config: SFTConfig
    split: str
    shard: ShardSpec
    sources: dict[str, ConversationSource]
    chains: dict[str, dict[str, BaseNode]]
    windows: SFTPackNode
    batches: BaseNode

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """Counts by stage -> source -> reason (kept, each rejection reason, truncated, ...)."""
        out = chain_stats(self.chains)
        pack = self.windows.packer.stats.to_dict()
        if pack:
            out["pack"] = pack
        return out

    def examples(self) -> dict[str, dict[str, str]]:
        """source -> reason -> the first rejected conversation's located message."""
        return {name: dict(src.first_where) for name, src in self.sources.items() if src.first_where}

    def packing(self) -> dict[str, Any]:
        return self.windows.summary()

    def realized(self) -> dict[str, dict[str, Any]]:
        """Per source: conversations, tokens and loss-bearing tokens rendered, target and
        realized token share (the shape ``StackDataModule.data_stats`` logs)."""
        counts = {name: chain["render"].counts() for name, chain in self.chains.items()}
        total = max(sum(c["tokens"] for c in counts.values()), 1)
        wsum = sum(s.weight for s in self.config.sources)
        weights = {s.name: s.weight / wsum for s in self.config.sources}
        return {
            name: {**c, "target_weight": weights[name], "realized_weight": c["tokens"] / total}
            for name, c in counts.items()
        }


def build_sft_pipeline(config: SFTConfig, tokenizer: Any, split: str = "train", shard: ShardSpec | None = None) -> SFTPipeline:
    """The SFT node graph for one split and one (rank, worker) shard of the sources.

    ``tokenizer``: a ``StackTokenizer`` (or an HF tokenizer with the stacklm specials).
    The validation split is the ``holdout_fraction`` of conversations chosen by a hash of
    their text (``holdout.holdout_split``), the same in every run, rank and worker.
    """
    check_split(split)
    if split == "val" and config.holdout_fraction == 0:
        raise ValueError("sft config: holdout_fraction is 0, so there is no validation split; set it > 0 (e.g. 0.01)")
    shard = shard or ShardSpec()
    ct = chat_tokens(tokenizer)
    sources: dict[str, ConversationSource] = {}
    chains: dict[str, dict[str, BaseNode]] = {}
    rendered: dict[str, BaseNode] = {}
    for spec in config.sources:
        src = ConversationSource(spec, shard=shard, role_aliases=config.role_aliases, on_invalid=config.on_invalid)
        chain: dict[str, BaseNode] = {"source": src}
        node: BaseNode = src
        if config.holdout_fraction > 0:
            node = chain["holdout"] = HoldoutNode(node, split, config.holdout_fraction, seed=config.seed)
        node = chain["render"] = RenderNode(node, tokenizer, config.seq_len, config.overlong)
        sources[spec.name], chains[spec.name], rendered[spec.name] = src, chain, node
    if len(rendered) == 1:
        stream: BaseNode = next(iter(rendered.values()))
    else:
        stream = MultiNodeWeightedSampler(
            rendered,
            {s.name: float(s.weight) for s in config.sources},
            stop_criteria=StopCriteria.ALL_DATASETS_EXHAUSTED,
            rank=shard.rank,
            world_size=shard.world_size,
            seed=config.seed + 2,
        )
    if config.shuffle_buffer > 1:
        stream = ShuffleNode(stream, config.shuffle_buffer, seed=config.seed + 1)
    windows = SFTPackNode(stream, config.seq_len, ct.bos, ct.eos, ct.pad, config.pack_buffer)
    batches = Mapper(Batcher(windows, config.batch_size, drop_last=config.drop_last), CollateSFT(ct.bos, ct.eos, ct.pad))
    return SFTPipeline(config, split, shard, sources, chains, windows, batches)
