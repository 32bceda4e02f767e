"""Buffers checkpointed by position (``stacklm.data.doc_refs``, issue 34.1).

One graph over every kind of source a run reads -- JSON lines with blank lines (so a record's
line and its ``doc_id`` row differ), gzip and zstd JSON lines, a parquet file of several row groups, a
folder of .txt files, the synthetic corpus, and a parquet file read through ``datasets`` (a hub
stream: it cannot seek, so its documents stay content) -- with in-flight exact and near dedup,
decontamination that cuts texts, a budget that cuts a document, and long documents the packer
splits. Resumed from a ``torch.save``d state loaded with ``weights_only=True`` at several points,
it continues batch for batch; the state holds positions, not token ids, for all but the hub and
edited documents; and a file changed under a checkpoint refuses the resume, naming the document.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stacklm.corpus.stdlib import iter_code, iter_prose
from stacklm.data.doc_refs import BY_POSITION, DocRefs, pack_columns, unpack_columns
from stacklm.errors import ResumeRefused
from tests.helpers.resume import check_save_load_state, round_trip

SEQ_LEN = 128


def checkpoint_round_trip(state):
    """What a Lightning checkpoint gives back: the loader's tensors, ``torch.load(weights_only=True)``."""
    from stacklm.datamodule.loader import from_checkpoint_safe, to_checkpoint_safe

    return from_checkpoint_safe(round_trip(to_checkpoint_safe(state), "torch"))


def write_corpus(root: Path) -> dict[str, list[str]]:
    def chunks(texts, size):
        return [t[i : i + size] for t in texts for i in range(0, len(t), size) if t[i : i + size].strip()]

    prose = chunks(iter_prose(max_bytes=300_000), 1_200)
    code = chunks(iter_code(max_bytes=300_000), 3_000)
    texts = {"jsonl": prose[:90], "gz": prose[90:160], "parquet": code[:60], "txt": code[60:80], "hub": prose[160:220]}
    (root / "j").mkdir(parents=True)
    with open(root / "j" / "a.jsonl", "w") as f:
        for i, t in enumerate(texts["jsonl"]):
            f.write(json.dumps({"text": t}) + "\n" + ("\n" if i % 7 == 3 else ""))  # blank lines: line != row
    with gzip.open(root / "j" / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts["gz"][::2])
    import zstandard  # a zstd file is read forward only: its positions re-read in one pass

    (root / "j" / "e.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in texts["gz"][1::2]).encode()))
    (root / "p").mkdir()
    pq.write_table(pa.table({"content": texts["parquet"]}), root / "p" / "c.parquet", row_group_size=16)
    (root / "t").mkdir()
    for i, t in enumerate(texts["txt"]):
        (root / "t" / f"{i:03d}.txt").write_text(t)
    (root / "h").mkdir()
    pq.write_table(pa.table({"text": texts["hub"]}), root / "h" / "d.parquet")
    (root / "eval").mkdir()
    # an evaluation set holding a passage of a training text: decontamination cuts it out of that text
    words = texts["jsonl"][5].split()
    (root / "eval" / "qa.jsonl").write_text(json.dumps({"q": " ".join(words[10:40])}) + "\n")
    return texts


def config(root: Path, total: int = 60_000, **over):
    from stacklm.data.pipeline import PipelineConfig

    entries = [
        {"name": "web", "kind": "local", "path": str(root / "j" / "*"), "weight": 0.3, "domain": "prose", "filters": "none"},
        {"name": "code", "kind": "local", "path": str(root / "p" / "*.parquet"), "text_column": "content", "weight": 0.2,
         "domain": "code", "filters": "none"},
        {"name": "notes", "kind": "local", "path": str(root / "t" / "*.txt"), "weight": 0.15, "domain": "code", "filters": "none"},
        {"name": "synth", "kind": "synthetic", "weight": 0.15, "domain": "prose", "seed": 2, "num_docs": 400},
        {"name": "hub", "kind": "hf", "path": "parquet", "data_files": [str(root / "h" / "d.parquet")], "weight": 0.2,
         "domain": "prose", "filters": "none"},
    ]
    d = {"seq_len": SEQ_LEN, "batch_size": 2, "shuffle_buffer": 48, "pack_buffer_docs": 12, "holdout_fraction": 0.0,
         "tokenize_batch_docs": 8, "num_threads": 1, "seed": 5, "dedup": {"exact": True, "near": True},
         "decontaminate": {"sets": [{"name": "qa", "files": [str(root / "eval" / "qa.jsonl")], "fields": ["q"]}], "mode": "cut", "n": 8},
         "mix": {"name": "refs", "total_tokens": total, "entries": entries}, **over}
    return PipelineConfig.from_dict(d)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("doc_refs")
    return root, write_corpus(root)


def buffer_states(state: dict) -> list[dict]:
    """Every by-position buffer state nested in a graph state."""
    out = []

    def walk(x):
        if isinstance(x, dict):
            if x.get(BY_POSITION):
                out.append(x)
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return out


def test_a_resumed_graph_rereads_its_buffers_and_continues_exactly(corpus, tokenizer_1024):
    from stacklm.data.pipeline import build_pipeline

    root, _ = corpus
    cfg = config(root)
    files: set[tuple[str, int]] = set()  # (source, part) of the documents saved by position
    seen: dict[str, int] = {"states": 0, "by_position": 0, "content": 0, "hub_content": 0, "cut": 0, "edited": 0}

    def check_state(record):
        states = buffer_states(record.state)
        assert states, "the graph's buffers are saved by position"
        seen["states"] += 1
        for st in states:
            n_content = len(np.asarray(st.get("content_at", [])))
            seen["by_position"] += int(st["n"]) - n_content
            seen["content"] += n_content
            refs = unpack_columns(st["refs"])
            seen["cut"] += int((refs[6] > 0).sum())
            files.update((st["names"][s], f) for s, f in zip(refs[0].tolist(), refs[1].tolist()))
            if n_content and st["tokenized"]:
                from stacklm.data.doc_refs import decode_docs

                docs = decode_docs(st["content"])
                seen["hub_content"] += sum(d["source"] == "hub" for d in docs)
                # only documents without a position are kept whole: the hub stream's, and texts decontamination cut
                assert all(d["source"] == "hub" or "seek" not in d for d in docs)
                seen["edited"] += sum(d["source"] != "hub" for d in docs)

    full = check_save_load_state(lambda: build_pipeline(cfg, tokenizer_1024), lambda n: [1, n // 3, (2 * n) // 3],
                                 node=lambda p: p.batches, state_round_trip="pickle", check_state=check_state)
    assert len(full) > 30
    # what the test covered: most buffered documents by position, the hub's by content, a budget cut
    assert seen["by_position"] > 2 * seen["content"] > 0, seen
    assert seen["hub_content"] > 0, seen
    # every seekable kind: web's a.jsonl, b.jsonl.gz, e.jsonl.zst (parts 0-2), code's parquet, notes' .txt, synth
    assert {("web", 0), ("web", 1), ("web", 2), ("code", 0), ("synth", 0)} <= files and any(s == "notes" for s, _ in files), files


def test_the_budget_cut_and_edited_documents_round_trip(corpus, tokenizer_1024):
    """A document the mix cut to its budget is re-read, re-tokenized and cut again; a text
    decontamination cut keeps its content (its position reads the uncut text)."""
    from stacklm.data.pipeline import build_pipeline

    root, texts = corpus
    cfg = config(root, total=8_000, shuffle_buffer=400, pack_buffer_docs=400)  # the budget ends inside the buffers
    pipe = build_pipeline(cfg, tokenizer_1024)
    it = iter(pipe.batches)
    next(it)
    buf = pipe.shuffle.shuffler.buffer
    cut = [d for d in buf if "full_len" in d]
    assert cut, "the budget cut a buffered document"
    state = checkpoint_round_trip(pipe.batches.state_dict())
    again = build_pipeline(cfg, tokenizer_1024)
    again.batches.reset(state)
    rebuilt = again.shuffle.shuffler.buffer
    assert len(rebuilt) == len(buf)
    for a, b in zip(buf, rebuilt):
        assert a.keys() == b.keys() and np.array_equal(a["ids"], b["ids"]) and all(a[k] == b[k] for k in a if k != "ids")

    # no shuffle: a document the budget cut goes straight to the packer, which holds it a while
    cfg = config(root, total=8_000, shuffle_buffer=1, pack_buffer_docs=24)
    pipe = build_pipeline(cfg, tokenizer_1024)
    packer = pipe.windows.packer
    it = iter(pipe.batches)
    for first in it:  # on to a batch after which a document the budget cut waits in the packer
        if any("full_len" in d for d, _ in packer._docs.values()):
            break
    assert any("full_len" in d for d, _ in packer._docs.values()), "the budget cut a document the packer holds"
    state = checkpoint_round_trip(pipe.batches.state_dict())
    again = build_pipeline(cfg, tokenizer_1024)
    again.batches.reset(state)
    assert packer._pieces.keys() == again.windows.packer._pieces.keys()
    assert all(np.array_equal(packer._pieces[a], again.windows.packer._pieces[a]) for a in packer._pieces)
    rest, resumed = list(it), list(again.batches)
    assert first is not None and len(rest) == len(resumed) > 0
    assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(rest, resumed))


def test_a_changed_file_refuses_the_resume_naming_the_document(corpus, tokenizer_1024, tmp_path):
    import shutil

    from stacklm.data.pipeline import build_pipeline

    root, texts = corpus
    copy = tmp_path / "c"
    shutil.copytree(root, copy)
    cfg = config(copy)
    pipe = build_pipeline(cfg, tokenizer_1024)
    it = iter(pipe.batches)
    for _ in range(3):
        next(it)
    state = checkpoint_round_trip(pipe.batches.state_dict())
    # the same number of lines, each text changed in one word: every position still parses
    path = copy / "j" / "a.jsonl"
    lines = path.read_text().split("\n")
    path.write_text("\n".join(json.dumps({"text": json.loads(l)["text"].replace(" the ", " teh ", 1)}) if l else l for l in lines))
    with pytest.raises(ResumeRefused, match=r"refusing to resume: document 'web/.*a\.jsonl/\d+'.*changed"):
        build_pipeline(cfg, tokenizer_1024).batches.reset(state)
    # a file added to a source's pattern (it sorts first) or one removed: its positions index the old list
    (copy / "t" / "000-new.txt").write_text("a new note")
    with pytest.raises(ResumeRefused, match=r"source 'notes': .* now lists 21 part\(s\), not the 20 the checkpoint read"):
        build_pipeline(cfg, tokenizer_1024).batches.reset(state)
    (copy / "t" / "000-new.txt").unlink()
    (copy / "j" / "b.jsonl.gz").unlink()
    with pytest.raises(ResumeRefused, match=r"source 'web': .* now lists 2 part\(s\), not the 3"):
        build_pipeline(cfg, tokenizer_1024).batches.reset(state)


def test_columns_pack_narrow_and_round_trip():
    cols = np.array([[0, 1, 1, 255], [3, -2, 70_000, 0], [2**40, 5, 6, 7]], dtype=np.int64)
    packed = pack_columns(cols)
    assert np.array_equal(unpack_columns(packed), cols)
    assert packed["dtypes"] == [np.dtype(np.uint8).str, np.dtype(np.int32).str, np.dtype(np.int64).str]
    # a buffer with no seekable documents is all content, and loads without sources
    refs = DocRefs()
    docs = [{"ids": np.arange(5, dtype=np.int32), "source": "x", "doc_id": "x/0"}]
    st = refs.save(docs)
    assert st["content_at"].tolist() == [0] and refs.bytes_by_content == 5 * 2
    out = refs.load(st)[0]
    assert np.array_equal(out[0]["ids"], docs[0]["ids"]) and out[0]["doc_id"] == "x/0"
