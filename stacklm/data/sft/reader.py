"""``ConversationSource``: conversations of one SFT dataset, validated, every rejection counted."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from stacklm.chat.turns import (
    DEFAULT_ROLE_ALIASES,
    FLAG_REASONS,
    MALFORMED_JSON,
    ConversationFlag,
    Turn,
    validate_conversation,
)
from stacklm.chat.formats import conversation_from_record
from stacklm.data.audit import KEPT, ON_INVALID_SPELLINGS, clean_text
from stacklm.data.sources.schema import SourceConfig
from stacklm.data.sources import (
    DatasetsReader,
    JsonlReader,
    PartNode,
    ShardSpec,
    check_data_files,
    file_format,
    glob_files,
    hub_load_kwargs,
    import_datasets,
    json_error_detail,
    loads_json_line,
)
from stacklm.errors import ChatFormatError, SourceError, SourceNotFoundError
from stacklm.once import first_time

logger = logging.getLogger(__name__)

SFT_DOMAIN = "chat"  # a conversation source's domain when its config names none
CONTENT_REPAIRED = "content_repaired"
INVALID_UTF8_LINES = "invalid_utf8_lines"


def parse_json_line(raw: bytes, where: str) -> tuple[dict, bool]:
    """``(record, had_invalid_utf8)``; malformed lines raise ``ChatFormatError`` at ``where``."""
    try:
        obj, lenient = loads_json_line(raw, invalid_utf8="replace")
    except json.JSONDecodeError as e:
        raise ChatFormatError(
            f"not valid JSON ({json_error_detail(e)}); each line must be one JSON object", reason=MALFORMED_JSON, where=where
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
    """Conversations of one ``SourceConfig`` as ``{"turns", "text", "source", "domain",
    "doc_id"}``, validated (``chat.validate_conversation``) and with every rejection counted.

    Reading is by parts (files, or a hub dataset's shards) split across (rank, worker) with
    ``sources.assign_parts``, through the same machinery as the pre-training sources
    (``sources.PartNode``); the state is theirs plus the first location of each rejection
    reason.
    """

    KIND = "sft source"

    def __init__(
        self,
        spec: SourceConfig,
        *,
        shard: ShardSpec | None = None,
        role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
        on_invalid: str = "skip",
    ) -> None:
        if on_invalid not in ON_INVALID_SPELLINGS:
            raise ValueError(f"on_invalid must be one of {ON_INVALID_SPELLINGS}, got {on_invalid!r}")
        super().__init__(spec.name, spec.domain or SFT_DOMAIN, shard=shard, stage="sft_source")
        self.spec = spec
        self.role_aliases, self.on_invalid = dict(role_aliases), on_invalid
        self.first_where: dict[str, str] = {}
        self.first_flagged: dict[str, str] = {}  # kept but flagged (chat.FLAG_REASONS): reason -> first location

    # parts ---------------------------------------------------------------------------
    def _describe(self) -> str:
        s = self.spec
        if s.kind == "local":
            return f"files {s.paths}"
        extra = " ".join(f"{k}={v}" for k, v in (("name", s.config_name), ("data_files", s.data_files), ("revision", s.revision)) if v)
        return f"datasets {s.path} {extra} split={s.split}".replace("  ", " ")

    def _list_parts(self) -> list[str]:
        s = self.spec
        if s.kind == "local":
            paths = glob_files(s.paths)
            if not paths:
                raise SourceNotFoundError(
                    f"sft source {self.name!r}: {s.paths} matched no files (cwd {os.getcwd()}); check the paths",
                    source=self.name,
                    file=str(s.paths),
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
        check_data_files("sft source", self.name, s.path, s.data_files)
        try:
            self._dataset = import_datasets().load_dataset(s.path, **kwargs)
        except Exception as e:
            raise SourceError(
                f"sft source {self.name!r}: cannot open {self._describe()}: {type(e).__name__}: {e}",
                source=self.name,
                file=s.path,
            ) from e
        return [f"shard{j:05d}" for j in range(self._dataset.n_shards)]

    def _open_part(self, part: int, position: dict | None, piece=None):
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
        self.first_flagged = dict((initial_state or {}).get("first_flagged", {}))

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "first_where": dict(self.first_where), "first_flagged": dict(self.first_flagged)}

    def _reject(self, err: ChatFormatError) -> None:
        self.stats.add(self.name, err.reason)
        if err.reason not in self.first_where:
            self.first_where[err.reason] = str(err)
            if self.on_invalid != "raise" and self.log_rows and first_time(self.KIND, self.name, err.reason):
                logger.warning("sft source %r: dropping conversations (%s); first: %s", self.name, err.reason, err)
        if self.on_invalid == "raise":
            raise err

    def _flag(self, flags: Sequence[ConversationFlag], where: str) -> None:
        """A kept conversation's flags (``chat.validate_conversation``): each reason counted once
        per record, next to ``kept`` (not a drop), and said at its first sight."""
        for reason in dict.fromkeys(f.reason for f in flags):
            self.stats.add(self.name, reason)
            if reason not in self.first_flagged:
                message = next(f.message for f in flags if f.reason == reason)
                self.first_flagged[reason] = f"{where}: {message}"
                if self.log_rows and first_time(self.KIND, self.name, "flagged", reason):
                    logger.warning("%s %r: training conversations flagged %s (counted, kept); first: %s", self.KIND, self.name,
                                   reason, self.first_flagged[reason])

    def _say_drop_counts(self) -> None:
        """At the end of this reader's pass, one line with how many it dropped, by reason: the
        first-sight line of each reason (``_reject``) cannot know the count yet."""
        dropped = self.dropped()
        if dropped and self.on_invalid != "raise" and self.log_rows and first_time(self.KIND, self.name, "dropped_in_pass"):
            logger.warning("%s %r: dropped %d of %d conversations in this reader's pass (%s)", self.KIND, self.name,
                           sum(dropped.values()), self._owned_rows, ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())))

    def dropped(self) -> dict[str, int]:
        """This reader's rejected conversations so far, by reason."""
        return {k: v for k, v in self.stats.to_dict().get(self.name, {}).items() if k != KEPT and k in self.first_where}

    def _record(self, raw: Any, where: str) -> Any:
        """A row as its record: a JSON line parsed (invalid UTF-8 counted), else the row itself."""
        if isinstance(raw, (bytes, bytearray)):
            record, lenient = parse_json_line(bytes(raw), where)
            if lenient:
                self.stats.add(self.name, INVALID_UTF8_LINES)
            return record
        return raw

    def _repair(self, *conversations: list[Turn]) -> None:
        """NULs and lone surrogates in the turns, repaired in place the audit's way; counted
        once per record (``CONTENT_REPAIRED``)."""
        repaired = False
        for turns in conversations:
            for i, t in enumerate(turns):
                text, audit = clean_text(t.content)
                reasoning, r_audit = clean_text(t.reasoning) if t.reasoning else (t.reasoning, None)
                if audit.repaired or (r_audit is not None and r_audit.repaired):
                    turns[i], repaired = Turn(t.role, text, reasoning, t.weight, t.completion), True
        if repaired:
            self.stats.add(self.name, CONTENT_REPAIRED)

    def _turns(self, raw: Any, where: str) -> list[Turn]:
        turns = conversation_from_record(self._record(raw, where), column=self.spec.text_column, format=self.spec.format,
                                         role_aliases=self.role_aliases, where=where)
        self._repair(turns)
        self._flag(validate_conversation(turns, where=where), where)
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
            **self._provenance(),
        }

    def _provenance(self) -> dict[str, int]:
        """``file`` (the part's index in the source's part list) and ``record`` (the 0-based row in
        it: a JSON line, blank lines counted, or a parquet / hub row) of the record read last: the
        packer keeps them per piece, so a run's step log names each conversation it trained on
        (``stacklm.data.storage.steplog``), as pre-training documents carry them."""
        return {"file": int(self._assigned[self._k]), "record": int(self._reader.record)}

    def _check_exhausted(self) -> None:
        if self._emitted:
            self._say_drop_counts()
            return
        if self._owned_rows:
            reasons = {k: v for k, v in self.stats.to_dict().get(self.name, {}).items() if k != KEPT and k not in FLAG_REASONS}
            first = "; ".join(f"{k}: {v}" for k, v in self.first_where.items())
            raise SourceError(
                f"sft source {self.name!r}: all {self._owned_rows} conversations of {self._describe()} were rejected "
                f"({reasons}); first of each: {first}",
                source=self.name,
                file=self._describe(),
            )
        if self._global_row == 0:
            raise SourceError(f"sft source {self.name!r}: {self._describe()} contains no rows", source=self.name, file=self._describe())


def quiet_readers(graph: Any) -> Any:
    """``graph`` with its conversation readers silenced (they still count every rejection).

    Why: the same records are read by more than one process -- the data gate's sample and the
    counting pass read them in the main process, the loader's workers again in theirs, where
    ``stacklm.once`` cannot see what was said. One of them says the drops; the others are quiet."""
    readers = getattr(graph, "sources", None)
    for source in readers.values() if isinstance(readers, dict) else ():
        source.log_rows = False
    return graph


def say_split_drops(readers: Sequence[ConversationSource], split: str) -> None:
    """What the quiet readers of every (rank, worker) of a counting pass dropped, said once for
    the whole split: per source, each reason with where it was first seen (the line a reader says
    itself), then one count line by reason (``dropped 12 of the 612 conversations read, before the
    train/val holdout``: a record is checked when it is read, before the holdout gives it a split)."""
    by_name: dict[str, list[ConversationSource]] = {}
    for r in readers:
        by_name.setdefault(r.name, []).append(r)
    for name, group in by_name.items():
        dropped: dict[str, int] = {}
        first: dict[str, str] = {}
        for r in group:
            for reason, n in r.dropped().items():
                dropped[reason] = dropped.get(reason, 0) + n
                first.setdefault(reason, r.first_where[reason])
        kind = group[0].KIND
        _say_split_flags(group, kind, name, split)
        if not dropped or group[0].on_invalid == "raise" or not first_time(kind, name, "dropped_in_split", split):
            continue
        for reason in sorted(first):
            if first_time(kind, name, reason):
                logger.warning("%s %r: dropping conversations (%s); first: %s", kind, name, reason, first[reason])
        # rows read: every record, whatever split the holdout gives it (a record is checked before it has a split)
        logger.warning("%s %r: dropped %d of the %d conversations read, before the train/val holdout (%s)", kind, name,
                       sum(dropped.values()), sum(r._owned_rows for r in group), ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())))


def _say_split_flags(group: Sequence[ConversationSource], kind: str, name: str, split: str) -> None:
    """The kept-but-flagged conversations (``chat.FLAG_REASONS``) of one source's quiet readers:
    each reason's first location, then one count line."""
    flagged: dict[str, int] = {}
    first: dict[str, str] = {}
    for r in group:
        for reason, n in r.stats.to_dict().get(r.name, {}).items():
            if reason in r.first_flagged:
                flagged[reason] = flagged.get(reason, 0) + n
                first.setdefault(reason, r.first_flagged[reason])
    if not flagged or not first_time(kind, name, "flagged_in_split", split):
        return
    for reason in sorted(first):
        if first_time(kind, name, "flagged", reason):
            logger.warning("%s %r: training conversations flagged %s (counted, kept); first: %s", kind, name, reason, first[reason])
    logger.warning("%s %r: flagged and kept %s of the %d conversations read", kind, name,
                   ", ".join(f"{k} {v}" for k, v in sorted(flagged.items())), sum(r._owned_rows for r in group))
