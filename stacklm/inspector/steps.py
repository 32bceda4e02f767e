"""``stacklm inspect RUN --step S``: every row of global step ``S`` of a training run, with where
each of its pieces came from, from the run's step log (``stacklm.data.storage.steplog``).

Shards mode logged global row indices: each row's tokens and pieces are the prebuild's
(``stacklm.data.storage.provenance.RowProvenance``). Stream mode logged each row's pieces and the
CRC-32 of its window: the tokens are rebuilt here from the source records, through the same
source nodes and tokenizer the run used (a record's text as the source yields it, encoded on
the same fast path, wrapped ``<bos> ids <eos>``), and checked against the CRC, so a source
file changed since the run shows up as ``"verified": false`` rather than as wrong tokens.
SFT and preference modes logged the same: per row its conversations (sft: those packed in the
row) or its pair (preference: one piece, the chosen side's range), each named by source, file and
record; they are read back and rendered as the run rendered them (the source's loss policy and
overlong rule) and checked against the logged CRC the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.storage.datafiles import check_data_file, read_data_bytes
from stacklm.data.storage.steplog import find_step
from stacklm.errors import DataError


def step_provenance(path: str | Path, step: int) -> dict[str, Any]:
    """``{"step", "mode", "generation", "world_size", "rows": [...]}``; each row: ``rank``,
    ``epoch``, ``batch`` (the rank's batch index in its epoch), ``row_in_batch``, then as
    ``stacklm inspect DIR --row N``: ``input_ids`` (the window) and ``segments`` (``source``,
    ``file``, ``record``, ``row_start``, ``row_end``, ``doc_offset``); shards mode adds the
    global ``row``, stream mode ``verified`` (the rebuilt window's CRC is the logged one).
    Padding rows (no data, no loss) are ``{"padding": true}``. A step inside a ``skip_steps``
    range also lists the rows it would have had, each ``"skipped": true`` (``skip_steps``: the
    range), beside the rows it trained (those of a later step)."""
    generation, meta, records = find_step(path, step)
    rows: list[dict[str, Any]] = []
    if meta["mode"] == "shards":
        fill = _shard_rows(meta)
    elif meta["mode"] == "stream":
        fill = _StreamRows(meta)
    elif meta["mode"] in ("sft", "preference"):
        fill = _ConversationRows(meta)
    else:
        raise DataError(f"{generation}: mode {meta['mode']!r} has no step log reader")
    for rec in records:
        where = {"rank": rec["rank"], "epoch": rec["epoch"], "batch": rec["batch"]}
        if rec.get("skipped"):  # skip_steps passed over these rows: what the step would have had
            where["skipped"] = True
        real = fill(rec)
        for i, row in enumerate(real):
            rows.append({**where, "row_in_batch": i, **row})
        for j in range(rec["n_pad"]):
            rows.append({**where, "row_in_batch": len(real) + j, "padding": True, "input_ids": None, "segments": []})
    return {"step": int(step), "mode": meta["mode"], "generation": generation.name, "world_size": meta["world_size"],
            "batch_size": meta["batch_size"], "accumulate_grad_batches": meta.get("accumulate_grad_batches", 1),
            "tokenizer": meta["tokenizer"], "skip_steps": [r for r in meta.get("skip_steps", [])
                                                           if r["steps"][0] <= step <= r["steps"][1]], "rows": rows}


def _shard_rows(meta: dict[str, Any]):
    from stacklm.data.storage.provenance import RowProvenance

    shards = meta["shards"]
    data_dir = Path(shards["data_dir"])
    manifest = data_dir / "manifest.json"
    if check_data_file(manifest) is None:
        raise DataError(f"the run read the prebuild {data_dir}, which is gone (no {manifest}); pass the step log of a run "
                           "whose shards are still there")
    if shards.get("manifest_hash") and hashlib.sha256(read_data_bytes(manifest)).hexdigest() != shards["manifest_hash"]:
        raise DataError(f"{manifest} changed since the run (another build in the same place): its rows are not the rows "
                           "the run trained on")

    rows = RowProvenance(data_dir, shards["split"])

    def fill(rec: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for row in rec["rows"]:
            got = rows(int(row))
            out.append({"row": int(row), "input_ids": got["input_ids"], "segments": got["segments"]})
        return out

    return fill


@contextlib.contextmanager
def _cwd(path: str) -> Iterator[None]:
    """A run's relative globs are relative to where it ran; the records it skipped (invalid
    rows, logged by the sources as they read) were reported by the run, not again here."""
    before = os.getcwd()
    sources_log = logging.getLogger("stacklm.data.sources")
    level = sources_log.level
    os.chdir(path)
    sources_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        os.chdir(before)
        sources_log.setLevel(level)


class _SourceRows:
    """Rebuilds the rows a run logged as pieces (stream, sft and preference modes) from the source
    records they name: each source opened once (one reader over all its parts), each needed
    record read by scanning its file from the top. A mode says how a source is opened
    (``_node``), what a record becomes (``_store``) and how a row is put together and checked
    against its logged CRC (``_row``)."""

    def __init__(self, meta: dict[str, Any], config: Any, names: Sequence[str]) -> None:
        from stacklm.data.storage.manifest import tokenizer_hash
        from stacklm.tokenizer.bpe import StackTokenizer

        self.config, self.names = config, list(names)
        self.cwd = meta["stream"]["cwd"]
        self.seq_len = int(meta["seq_len"])
        self.tok = StackTokenizer.load(meta["tokenizer"])
        if tokenizer_hash(self.tok) != meta["tokenizer_hash"]:
            raise DataError(f"the tokenizer at {meta['tokenizer']} changed since the run; the rows cannot be rebuilt")
        self._labels: dict[int, list[str]] = {}
        self._built: dict[tuple[int, int, int], Any] = {}  # (source, file, record) -> what ``_store`` made of it

    def _node(self, src: int):
        raise NotImplementedError

    def _store(self, docs: dict[tuple[int, int, int], dict]) -> None:
        raise NotImplementedError

    def _row(self, pieces: Sequence[Sequence[int]], crc: int) -> tuple[list[int] | None, bool]:
        raise NotImplementedError

    def labels(self, src: int) -> list[str]:
        if src not in self._labels:
            from stacklm.data.storage.provenance import source_files

            node = self._node(src)
            with _cwd(self.cwd):
                node.reset()
            self._labels[src] = source_files(node)
        return self._labels[src]

    def _load(self, needed: set[tuple[int, int, int]]) -> None:
        """Read the records of ``needed`` (source, file, record) not read yet, and ``_store`` them."""
        from stacklm.data.sources.entry import part_documents

        by_part: dict[tuple[int, int], set[int]] = {}
        for src, fid, rec in sorted(needed - set(self._built)):
            by_part.setdefault((src, fid), set()).add(rec)
        docs: dict[tuple[int, int, int], dict] = {}
        for (src, fid), records in by_part.items():
            with _cwd(self.cwd):
                for doc in part_documents(self._node(src), fid):
                    r = int(doc.get("record", -1))
                    if r > max(records):
                        break
                    if r in records:
                        docs[(src, fid, r)] = doc
        self._store(docs)

    def __call__(self, rec: dict[str, Any]) -> list[dict[str, Any]]:
        self._load({(int(p[0]), int(p[1]), int(p[2])) for row in rec["pieces"] if row for p in row if None not in p[:3]})
        out = []
        for pieces, crc in zip(rec["pieces"], rec["crc"]):
            if pieces is None:  # a window restored from a checkpoint written before the packer kept pieces
                out.append({"input_ids": None, "verified": False, "segments": None})
                continue
            ids, verified = self._row(pieces, int(crc))
            segments = [{"source": self.names[s], "file": self.labels(s)[f] if f is not None and f < len(self.labels(s)) else None,
                         "record": r, "row_start": a, "row_end": b, "doc_offset": off} for s, f, r, a, b, off in pieces]
            out.append({"input_ids": ids, "verified": verified, "segments": segments})
        return out


class _StreamRows(_SourceRows):
    """Stream mode: a record's text as the source yields it, encoded on the same fast path and
    wrapped ``<bos> ids <eos>``; a window is its pieces of those."""

    def __init__(self, meta: dict[str, Any]) -> None:
        from stacklm.data.pipeline import PipelineConfig

        config = PipelineConfig.from_dict(meta["stream"]["pipeline"])
        self.entries = list(config.mix.entries)
        super().__init__(meta, config, [e.name for e in self.entries])

    def _node(self, src: int):
        from stacklm.data.sources import ShardSpec, open_source

        return open_source(self.entries[src], shard=ShardSpec())

    def _store(self, docs: dict[tuple[int, int, int], dict]) -> None:
        from stacklm.data.tokenizing import tokenize_docs

        keys = list(docs)
        for key, doc in zip(keys, tokenize_docs(self.tok, [docs[k] for k in keys], num_threads=1)):
            ids = np.asarray(doc["ids"], dtype=np.int32)
            self._built[key] = np.concatenate([[self.tok.bos_id], ids, [self.tok.eos_id]]).astype(np.int32)

    def _row(self, pieces: Sequence[Sequence[int]], crc: int) -> tuple[list[int] | None, bool]:
        from stacklm.data.packing.origins import window_crc

        window, verified = self._rebuild(pieces, crc, window_crc)
        return (None if window is None else window.tolist()), verified

    def _rebuild(self, pieces: Sequence[Sequence[int]], crc: int, window_crc) -> tuple[np.ndarray | None, bool]:
        """The row's window from its records, and whether its CRC is the logged one. A document
        the mix budget cut ends early in ``<eos>``; a piece that ends inside the row without
        reaching its document's end is such a cut, and the last piece of a full row may be one."""
        eos = self.tok.eos_id
        window = np.full(self.seq_len, self.tok.pad_id, dtype=np.int32)
        last_may_be_cut = False
        for i, (src, fid, rec, a, b, off) in enumerate(pieces):
            wrapped = self._built.get((src, fid, rec))
            if wrapped is None or off is None or off + (b - a) > len(wrapped):
                return None, False  # the record is gone or shorter: the source changed
            window[a:b] = wrapped[off : off + b - a]
            if off + (b - a) < len(wrapped):  # the document goes on past this piece
                if b < self.seq_len or i < len(pieces) - 1:
                    window[b - 1] = eos
                else:
                    last_may_be_cut = True
        if window_crc(window) == crc:
            return window, True
        if last_may_be_cut:
            cut = window.copy()
            cut[pieces[-1][4] - 1] = eos
            if window_crc(cut) == crc:
                return cut, True
        return window, False


class _ConversationRows(_SourceRows):
    """SFT and preference modes: each named record rendered as the run rendered it (the
    source's loss policy and overlong rule, the run's seq_len). An sft window is its
    conversations' loss-tagged ids at their ranges (padding elsewhere), ``input_ids`` without the
    tags; a preference row's CRC is that of its pair's tagged ids (both sides), ``input_ids`` its
    chosen side."""

    def __init__(self, meta: dict[str, Any]) -> None:
        from stacklm.data.sft import SFTConfig

        self.preference = meta["mode"] == "preference"
        config = SFTConfig.from_dict(meta["stream"]["pipeline"])
        self.specs = list(config.sources)
        super().__init__(meta, config, [s.name for s in self.specs])

    def _node(self, src: int):
        from stacklm.data.sft.reader import ConversationSource
        from stacklm.data.sources import ShardSpec

        if self.preference:
            from stacklm.data.sft.preference_pipeline import PreferenceSource as cls
        else:
            cls = ConversationSource
        node = cls(self.specs[src], shard=ShardSpec(), role_aliases=self.config.role_aliases, on_invalid="skip")
        node.log_rows = False  # the run reported its rejected records; a read-back does not again
        return node

    def _store(self, docs: dict[tuple[int, int, int], dict]) -> None:
        for (src, fid, rec), doc in docs.items():
            spec = self.specs[src]
            overlong = spec.overlong or self.config.overlong
            if self.preference:
                from stacklm.data.sft.preference import render_pair

                out = render_pair(doc["prompt"], doc["chosen"], doc["rejected"], self.tok, self.seq_len, overlong,
                                  spec.loss_policy())[0]
                self._built[(src, fid, rec)] = None if out is None else out.tagged()
            else:
                from stacklm.chat.render import render_for_sft

                self._built[(src, fid, rec)] = render_for_sft(doc["turns"], self.tok, self.seq_len, overlong, spec.loss_policy())[0]

    def _row(self, pieces: Sequence[Sequence[int]], crc: int) -> tuple[list[int] | None, bool]:
        from stacklm.chat.render import untag_loss
        from stacklm.data.packing.origins import window_crc

        parts = [self._built.get((s, f, r)) for s, f, r, *_ in pieces]
        if any(p is None for p in parts):  # gone from its file, or no longer renders
            return None, False
        if self.preference:  # one pair: its tagged ids are what the CRC covers; the chosen side is the row shown
            tagged = parts[0]
            ids = untag_loss(tagged[: pieces[0][4]])[0]
        else:
            tagged = np.full(self.seq_len, self.tok.pad_id, dtype=np.int32)
            for (_, _, _, a, b, off), part in zip(pieces, parts):
                tagged[a:b] = part[off : off + b - a] if off + (b - a) <= len(part) else self.tok.pad_id
            ids = untag_loss(tagged)[0]
        return ids.tolist(), window_crc(tagged) == crc
