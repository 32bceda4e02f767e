"""Readers split files into pieces (byte ranges / row groups) when a source has fewer files than
readers: each input read once per pass, the same documents with the same ids for every reader
count, exact resume inside a piece (``stacklm.data.sources.pieces``, ``sharding.assign_pieces``)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os

import pytest

from stacklm.data.sources import LocalFileSource, ShardSpec
from stacklm.data.sources.pieces import file_pieces, line_pieces


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("pieces")
    jl = d / "a.jsonl"
    with open(jl, "w") as f:
        for i in range(600):
            f.write(json.dumps({"text": f"line doc {i} " + "w" * (i % 61)}) + "\n")
            if i % 37 == 0:
                f.write("\n  \n")  # blank lines: numbered as lines, not as rows
        f.write(json.dumps({"text": "last, no newline"}))
    pa_path = d / "b.parquet"
    pq.write_table(pa.table({"text": [f"parquet doc {i}" for i in range(300)]}), pa_path, row_group_size=40)
    gz = d / "c.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        for i in range(90):
            f.write(json.dumps({"text": f"gz doc {i}"}) + "\n")
    return {"jsonl": str(jl), "parquet": str(pa_path), "gz": str(gz)}


def _read(paths, readers, stop_after=None, strided=None):
    """Every reader's documents as (doc_id, file, record, text), the input bytes each read, and
    whether each split the files (not strided); ``stop_after``: checkpoint and resume there."""
    docs, volume, modes = [], [], []
    for r in range(readers):
        src = LocalFileSource("s", paths, "prose", shard=ShardSpec(0, 1, r, readers))
        if strided is not None:
            src._list_pieces = lambda: None  # the whole-file assignment of before
        src.reset(None)
        got = []
        if stop_after:
            it = iter(src)
            for _ in range(stop_after):
                got.append(next(it, None))
            got = [d for d in got if d is not None]
            state = src.get_state()
            src = LocalFileSource("s", paths, "prose", shard=ShardSpec(0, 1, r, readers))
            src.reset(state)
        got += list(src)
        docs += [(d["doc_id"], d["file"], d["record"], d["text"]) for d in got]
        volume.append(src.bytes_in)
        modes.append(not src._strided)
    return sorted(docs), volume, modes


def test_line_pieces_cut_at_line_starts_with_whole_file_numbers(files):
    path = files["jsonl"]
    size = os.path.getsize(path)
    pieces = line_pieces(path, size)
    assert len(pieces) > 8 and pieces[0][:1] == (0,) and pieces[-1][1] == size
    data = open(path, "rb").read()
    for (start, end, line, row), nxt in zip(pieces, pieces[1:] + [(size,)]):
        assert end == nxt[0] and (start == 0 or data[start - 1 : start] == b"\n")
        before = data[:start].split(b"\n")[:-1] if start else []
        assert line == len(before) and row == sum(1 for ln in before if ln.strip())


@pytest.mark.parametrize("kind", [["jsonl"], ["parquet"], ["jsonl", "parquet"], ["jsonl", "parquet", "gz"]])
def test_every_reader_count_reads_the_same_documents_with_the_same_ids_once(files, kind):
    paths = [files[k] for k in kind]
    size = sum(os.path.getsize(p) for p in paths)
    whole, volume, _ = _read(paths, 1)
    assert sum(volume) == size
    for readers in (2, 3, 4, 7):
        docs, volume, split = _read(paths, readers)
        assert docs == whole  # the same documents, doc_ids, provenance (file, record) for every count
        if readers > len(paths):
            assert all(split)  # pieces, not every reader scanning every file
            assert sum(volume) == size  # each input byte read by exactly one reader
            before = _read(paths, readers, strided=True)
            assert before[0] == whole and sum(before[1]) >= (readers - len(paths) + 1) * min(map(os.path.getsize, paths))


def test_resume_inside_a_piece_is_exact(files):
    paths = [files["jsonl"], files["parquet"]]
    for readers in (3, 5):
        assert _read(paths, readers, stop_after=23) == _read(paths, readers)


def test_unsplittable_inputs_fall_back_to_striding(files):
    """One .gz file (no random access): every reader reads it all and keeps every N-th row, as
    before; the read volume says so."""
    whole, _, _ = _read([files["gz"]], 1)
    docs, volume, split = _read([files["gz"]], 3)
    assert docs == whole and not any(split)
    assert volume == [os.path.getsize(files["gz"])] * 3
    assert [p.nbytes for p in file_pieces(0, files["gz"], "jsonl")] == [os.path.getsize(files["gz"])]


def _delivered(out, split="train"):
    from stacklm.data.storage import manifest as mf
    from stacklm.data.storage.provenance import decode_rows, prov_path

    m = mf.read_manifest(out / split)
    prov, docs = m["provenance"], set()
    for shard in m["shards"]:
        _, rows = decode_rows(prov_path(out / split, shard["name"]).read_bytes())
        for src, fid, rec in rows[:, :3].tolist():
            docs.add((prov["sources"][src], prov["files"][prov["sources"][src]][fid], rec))
    return docs


@pytest.mark.slow
def test_prebuild_reads_one_file_once_per_pass_and_says_so(files, tokenizer_512, tmp_path):
    """One JSON-lines file, ``--workers 1`` and ``3``: the same delivered documents (budget not
    binding), and the manifest's read volume is 1.0x per pass (global dedup signatures, packing)
    for both (each of the 3 tasks scanned the whole file before: 3.0x)."""
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.data.storage import manifest as mf
    from stacklm.prebuild import prebuild
    from stacklm.prebuild.summary import summary_table

    cfg = PipelineConfig.from_dict({
        "seq_len": 64, "batch_size": 2, "seed": 0, "shuffle_buffer": 16, "pack_buffer_docs": 8, "holdout_fraction": 0.0,
        "num_threads": 1, "tokenize_batch_docs": 16,
        "mix": {"name": "t", "total_tokens": 10**8, "entries": [
            {"name": "one", "kind": "local", "path": files["jsonl"], "weight": 1.0, "domain": "code", "filters": "none"}]},
    })
    size = os.path.getsize(files["jsonl"])
    delivered = {}
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        with pytest.warns(RuntimeWarning, match="ran dry"):
            prebuild(cfg, tokenizer_512, out, workers=workers, tokens_per_shard=64 * 32, splits=("train",), progress=False)
        top = mf.read_manifest(out)
        vol = top["read_volume"]
        assert vol["input_total"] == size
        assert [(p["pass"], p["split"], p["total"]) for p in vol["passes"]] == [("dedup_signatures", "train", size), ("packing", "train", size)]
        assert vol["index_bytes"] == size  # the piece index (pieces for the spread order too): one counting scan per build
        assert "packing           train" in summary_table(top, str(out)) and "1.00x" in summary_table(top, str(out))
        delivered[workers] = _delivered(out)
    assert delivered[1] == delivered[3] and len(delivered[1]) == 601


# -- the spread read order (read_order: spread): a budget takes a sample of every file -----------

def _four_files(folder, sizes=(1, 4, 16, 64), unit=60):
    """Four JSON-lines files of very different sizes (``unit * size`` documents each)."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, size in enumerate(sizes):
        with open(folder / f"f{k}.jsonl", "w") as f:
            for i in range(unit * size):
                f.write(json.dumps({"text": f"file {k} document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(40))}) + "\n")
    return str(folder / "*.jsonl")


def test_spread_order_gives_every_file_its_share_at_every_prefix(tmp_path):
    from stacklm.data.sources.pieces import spread_order

    glob = _four_files(tmp_path / "d")
    src = LocalFileSource("s", glob, "prose", order_seed=5)
    src.reset(None)
    order = src._pieces
    sizes = {p: os.path.getsize(path) for p, path in enumerate(src._paths)}
    total = sum(sizes.values())
    taken = dict.fromkeys(sizes, 0)
    for n, piece in enumerate(order, 1):
        taken[piece.part] += piece.nbytes
        done = sum(taken.values())
        if n <= len(sizes):  # the first round: one piece of every file
            assert len({p.part for p in order[:n]}) == n
            continue
        for part, size in sizes.items():  # then no file more than two pieces ahead of or behind its share
            assert abs(taken[part] - done * size / total) <= 2 * max(p.nbytes for p in order if p.part == part) + 1
    assert sorted(order, key=lambda p: (p.part, p.lo)) == sorted(src._pieces, key=lambda p: (p.part, p.lo))
    assert spread_order(order, 5) == spread_order(order, 5)  # deterministic in the seed
    again = LocalFileSource("s", glob, "prose", order_seed=5)
    again.reset(None)
    assert again._pieces == order
    other = LocalFileSource("s", glob, "prose", order_seed=6)
    other.reset(None)
    assert other._pieces != order
    # every document once, with the ids of the file-order read
    seq = LocalFileSource("s", glob, "prose")
    seq.reset(None)
    spread = LocalFileSource("s", glob, "prose", order_seed=5)
    spread.reset(None)
    key = lambda d: (d["doc_id"], d["file"], d["record"], d["text"])  # noqa: E731
    assert sorted(map(key, spread)) == sorted(map(key, seq))


def test_spread_resume_is_exact(tmp_path):
    glob = _four_files(tmp_path / "d", unit=20)
    for readers in (1, 3, 6):
        docs_full, docs_cut = [], []
        for r in range(readers):
            a = LocalFileSource("s", glob, "prose", shard=ShardSpec(0, 1, r, readers), order_seed=1)
            a.reset(None)
            docs_full += [d["doc_id"] for d in a]
            b = LocalFileSource("s", glob, "prose", shard=ShardSpec(0, 1, r, readers), order_seed=1)
            b.reset(None)
            it = iter(b)
            head = [next(it)["doc_id"] for _ in range(17)]
            c = LocalFileSource("s", glob, "prose", shard=ShardSpec(0, 1, r, readers), order_seed=1)
            c.reset(b.get_state())
            docs_cut += head + [d["doc_id"] for d in c]
        assert docs_cut == docs_full and len(set(docs_full)) == 20 * 85


@pytest.mark.slow
def test_a_small_budget_takes_every_file_in_proportion_and_tokenizes_about_what_it_keeps(tmp_path, tokenizer_512, capsys):
    """Issue 25's shape: four inputs of very different sizes (1 : 4 : 16 : 64) and a budget of
    about 5% of the corpus. Every file contributes, about in proportion to its size, the ledger
    adds up (``stacklm ledger`` exits 0), and the documents tokenized are about those kept.
    With ``read_order: sequential`` (file by file, as before) the largest file gives nothing."""
    from stacklm.cli import main as stacklm_main
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.data.storage import manifest as mf
    from stacklm.prebuild import prebuild

    glob = _four_files(tmp_path / "d")
    sizes = [os.path.getsize(tmp_path / "d" / f"f{k}.jsonl") for k in range(4)]
    shares = {}
    for order in ("spread", "sequential"):
        cfg = PipelineConfig.from_dict({
            "seq_len": 64, "batch_size": 2, "seed": 0, "shuffle_buffer": 16, "pack_buffer_docs": 8, "holdout_fraction": 0.0,
            "num_threads": 1, "read_order": order, "dedup": {"exact": False, "near": False},
            "mix": {"name": "t", "total_tokens": 30_000, "entries": [
                {"name": "four", "kind": "local", "path": glob, "weight": 1.0, "domain": "code", "filters": "none"}]},
        })
        out = tmp_path / order
        prebuild(cfg, tokenizer_512, out, tokens_per_shard=64 * 32, splits=("train",), progress=False)
        got = {f"f{k}.jsonl": 0 for k in range(4)}
        for _src, name, _rec in _delivered(out):
            got[name] += 1
        shares[order] = [got[f"f{k}.jsonl"] / sum(got.values()) for k in range(4)]
        led = mf.read_manifest(out)["ledger"]["train"]["sources"]["four"]
        shares[order].append(led["tokens"]["read"] / led["tokens"]["kept"])
        assert stacklm_main(["ledger", str(out)]) == 0
    capsys.readouterr()
    spread, seq = shares["spread"], shares["sequential"]
    for k in range(4):
        expected = sizes[k] / sum(sizes)
        assert spread[k] > 0 and abs(spread[k] - expected) < 0.5 * expected + 0.02, (k, spread, expected)
    assert seq[3] == 0  # the head of the files: the largest never reached
    assert spread[4] < 1.5  # tokenized / kept
    print(f"per-file shares spread {spread[:4]} vs sizes {[s / sum(sizes) for s in sizes]}; sequential {seq[:4]}; "
          f"tokenized/kept {spread[4]:.2f} (sequential {seq[4]:.2f})")


@pytest.mark.slow
def test_a_small_build_signs_only_what_its_budget_reaches_and_says_so(tmp_path, tokenizer_512, capsys):
    """Issue 33 part 6: a budget of a few % of its source signs (global dedup, exact + near) only
    each file's signed prefix (``stacklm.prebuild.signing``), says so in one line, and delivers
    only signed documents: the same removed ids (index hash) and signed volume for ``--workers 1``
    and ``2``, no two delivered documents equal. A margin too small to reach the budget stops the
    build in one line naming the source and ``--sign-margin``, not a quietly short source."""
    from stacklm.data.pipeline import PipelineConfig, read_order_seed
    from stacklm.data.storage import manifest as mf
    from stacklm.data.sources.pieces import signed_prefix
    from stacklm.errors import PrebuildError
    from stacklm.prebuild import prebuild
    from stacklm.prebuild.signing import signing_plan

    (tmp_path / "d").mkdir()
    for k, size in enumerate((1, 4, 16, 64)):  # as ``_four_files``, each body its own, every 10th a near copy of the one before
        with open(tmp_path / "d" / f"f{k}.jsonl", "w") as f:
            for i in range(60 * size):
                body = " ".join(f"w{(k * 100_003 + (i - (i % 10 == 9)) * 7919 + j * 104_729) % 5003}" for j in range(40))
                f.write(json.dumps({"text": f"file {k} document {i}: {body}"}) + "\n")
    glob = str(tmp_path / "d" / "*.jsonl")
    cfg = PipelineConfig.from_dict({
        "seq_len": 64, "batch_size": 2, "seed": 0, "shuffle_buffer": 16, "pack_buffer_docs": 8, "holdout_fraction": 0.0,
        "num_threads": 1, "tokenize_batch_docs": 16,
        "mix": {"name": "t", "total_tokens": 6_000, "entries": [
            {"name": "four", "kind": "local", "path": glob, "weight": 1.0, "domain": "code", "filters": "none"}]},
    })
    seed = read_order_seed(cfg, "four")
    fraction = signing_plan(cfg, tokenizer_512, ("train",))["fractions"]["train"]["four"]  # what the builds below sign
    texts, dedup, signed_bytes = {}, {}, {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prebuild(cfg, tokenizer_512, out, workers=workers, tokens_per_shard=64 * 32, splits=("train",), progress=False)
        said = capsys.readouterr().err
        assert "prebuild: budget 6,000 tokens is" in said and "signing only what it can reach (train: four " in said
        top = mf.read_manifest(out)
        vol = {p["pass"]: p for p in top["read_volume"]["passes"]}
        signed_bytes[workers] = vol["dedup_signatures"]["total"]
        assert signed_bytes[workers] < 0.25 * top["read_volume"]["input_total"]  # the whole corpus before
        assert vol["packing"]["total"] <= signed_bytes[workers]
        dedup[workers] = top["global_dedup"]
        # every delivered document lies in the signed prefix of its file (the rows of its signed pieces)
        rows = {}
        for k in range(4):
            path = str(tmp_path / "d" / f"f{k}.jsonl")
            pieces = file_pieces(k, path, "jsonl")
            ends = {p.lo: q.row for p, q in zip(pieces, pieces[1:])}
            rows[f"f{k}.jsonl"] = {r for p in signed_prefix(pieces, seed, fraction)
                                   for r in range(p.row, ends.get(p.lo, 10**9))}
        delivered = _delivered(out)
        assert delivered and all(rec in rows[name] for _src, name, rec in delivered)
        lines = {name: open(tmp_path / "d" / name).read().splitlines() for name in rows}
        texts[workers] = [json.loads(lines[name][rec])["text"].split(": ", 1)[1] for _src, name, rec in delivered]
        assert len(set(texts[workers])) == len(texts[workers])  # near copies (same words, other header) were removed
    assert dedup[1] == dedup[2] and dedup[1]["removed"]["train"]["near"] > 0 and signed_bytes[1] == signed_bytes[2]

    more = dataclasses.replace(cfg, mix=dataclasses.replace(cfg.mix, total_tokens=60_000))
    with pytest.raises(PrebuildError, match=r"source 'four' needed more than its signed prefix .*--sign-margin"):
        prebuild(more, tokenizer_512, tmp_path / "short", tokens_per_shard=64 * 32, splits=("train",), progress=False, sign_margin=0.2)


def test_no_holdout_signs_no_val_prefix_and_a_zero_budget_is_met(tmp_path, tokenizer_512):
    """``holdout_fraction: 0`` with a small budget over two sources: the val split (which keeps
    nothing) signs no prefix, where it signed 0.0% of a source whose val budget rounded to 0 and
    then stopped the build with "needed more than its signed prefix ... 0 of its 0 tokens"."""
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.prebuild.signing import check_budget_met, signing_plan

    for name in ("a", "b"):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(400):
                f.write(json.dumps({"text": f"{name} document {i}: " + " ".join(f"w{(i * 31 + j) % 997}" for j in range(40))}) + "\n")
    cfg = PipelineConfig.from_dict({
        "seq_len": 64, "batch_size": 2, "holdout_fraction": 0.0,
        "mix": {"name": "t", "total_tokens": 2_000, "entries": [
            {"name": n, "kind": "local", "path": str(tmp_path / f"{n}.jsonl"), "weight": w, "domain": "code", "filters": "none"}
            for n, w in (("a", 0.7), ("b", 0.3))]},
    })
    plan = signing_plan(cfg, tokenizer_512, ("train", "val"))
    assert plan["fractions"]["val"] == {} and set(plan["fractions"]["train"]) == {"a", "b"}
    dry_at_zero = {"b": {"status": "ran_dry", "tokens": 0, "planned_budget": 0}}
    check_budget_met(dry_at_zero, {"fractions": {"val": {"b": 0.0}}, "margin": 3.0}, "val", tmp_path)  # met: nothing asked
    with pytest.raises(Exception, match="needed more than its signed prefix"):
        check_budget_met({"b": {"status": "ran_dry", "tokens": 5, "planned_budget": 9}}, {"fractions": {"val": {"b": 0.1}}, "margin": 3.0},
                         "val", tmp_path)
