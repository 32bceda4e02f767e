"""A corpus with planted drops (filtered, duplicated, invalid records) and its data section, shared by the ledger and provenance tests."""

from __future__ import annotations

import json
from pathlib import Path
import random

import pyarrow as pa
import pyarrow.parquet as pq


SEQ_LEN = 64
HOLDOUT = 0.2
SEED = 0
BIG = 10**7  # a budget the corpus cannot fill: every record is read, every kept document delivered


def words(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(400)]


def good_text(rng: random.Random, vocab: list[str]) -> str:
    return " ".join(rng.choice(vocab) for _ in range(rng.randint(45, 110))) + "."


def write_corpus(root: Path) -> dict[str, list[tuple[str, int, object]]]:
    """Two sources: ``web`` (two jsonl files) and ``books`` (a parquet file), with planted drops.
    Returns per source its records in read order as (file label, record index, value): a str
    text, None (null), or the raw bytes of a malformed line; blank lines are not records."""
    rng = random.Random(7)
    vocab = words(rng)
    web = root / "web"
    web.mkdir(parents=True)
    records: dict[str, list[tuple[str, int, object]]] = {"web": [], "books": []}
    seen: list[str] = []
    for fname, n_good in (("a.jsonl", 40), ("b.jsonl", 20)):
        lines: list[bytes] = []

        def add(value, raw: bytes | None = None) -> None:
            lines.append(raw if raw is not None else json.dumps({"text": value}).encode())
            records["web"].append((fname, len(lines) - 1, value if raw is None else raw))

        for i in range(n_good):
            t = good_text(rng, vocab)
            seen.append(t)
            add(t)
            if i % 8 == 3:
                add(rng.choice(seen))  # an exact duplicate of an earlier document of the source
            if i % 10 == 5:
                add(f"too short {fname} {i}")  # the prose filter's min_chars
            if i % 13 == 2:
                add(None, b'{"text": "unterminated')  # malformed JSON
            if i % 11 == 4:
                add(None)  # null text
            if i % 17 == 6:
                add("")  # empty text: dropped by the source audit
            if i % 9 == 1:
                lines.append(b"")  # a blank line: not a record, but it has a line number
        (web / fname).write_bytes(b"\n".join(lines) + b"\n")
    books = root / "books"
    books.mkdir()
    texts: list[str | None] = []
    for i in range(30):
        texts.append(good_text(rng, vocab))
        if i % 9 == 2:
            texts.append(None)
        if i % 7 == 3:
            texts.append(texts[i // 2] if texts[i // 2] is not None else texts[0])
    pq.write_table(pa.table({"text": texts}), books / "c.parquet", row_group_size=16)
    records["books"] = [("c.parquet", i, t) for i, t in enumerate(texts)]
    return records


def data_section(root: Path, total: int = BIG, **kw) -> dict:
    return {
        "seq_len": SEQ_LEN, "batch_size": 4, "strategy": "best_fit", "seed": SEED, "shuffle_buffer": 16,
        "pack_buffer_docs": 8, "holdout_fraction": HOLDOUT, "tokenize_batch_docs": 8, "num_threads": 1,
        "mix": {"name": "t", "total_tokens": total, "entries": [
            {"name": "web", "kind": "local", "path": str(root / "web" / "*.jsonl"), "weight": 0.6, "domain": "prose"},
            {"name": "books", "kind": "local", "path": str(root / "books" / "*.parquet"), "weight": 0.4, "domain": "prose"},
        ]},
        **kw,
    }
