"""Global dedup (signatures -> decision -> removed ids): the same removals for any number of
readers, in prebuild (--workers N, datatrove tasks) and in stream mode (dedup.index); the
bounded exact index; prebuild process safety (lock, released claim, workers die with parent)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from stacklm.data.storage import manifest as mf
from stacklm.data.dedup import (
    DedupIndex,
    ExactDeduper,
    MinHasher,
    collect_signatures,
    decide,
    id_key,
)
from tests.helpers.dedup_corpus import dedup_config as _config, real_docs as _docs, write_split_corpus
from tests.helpers.synthetic_edits import inject_edits
from stacklm.data.pipeline import PipelineConfig, build_pipeline
from stacklm.data.sources import ShardSpec
from stacklm.prebuild import lock_out_dir, prebuild, state_dir_of
from stacklm.errors import ConfigError, PrebuildError
from stacklm.prebuild.dedup_pass import build_dedup_index

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real stdlib text in 4 jsonl files; 6 exact (case/space changed) and 6 near copies
    (few edits) planted in *other* files than their originals. Returns (glob, base docs)."""
    root = tmp_path_factory.mktemp("corpus")
    docs = _docs(80)
    rng = np.random.default_rng(0)
    files = [[] for _ in range(4)]
    for i, d in enumerate(docs):
        files[i % 4].append(d)
    for k, i in enumerate(range(0, 24, 2)):
        other = (i % 4 + 1 + k % 3) % 4
        files[other].append(docs[i].upper().replace(" ", "  ") if k < 6 else inject_edits(docs[i], 2, rng))
    for f, rows in enumerate(files):
        (root / f"p{f}.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return str(root / "*.jsonl"), docs


def test_decision_does_not_depend_on_slicing(corpus):
    glob, _ = corpus
    cfg = _config(glob)
    results = []
    for readers in (1, 2, 3):
        index = build_dedup_index(cfg, ("train",), readers)
        results.append((index.content_hash, index.counts()))
    assert len({h for h, _ in results}) == 1
    counts = results[0][1]["train"]
    assert counts["exact"] >= 6 and counts["near"] >= 6  # the planted copies (the stdlib may add its own)


def test_decide_keeps_the_canonical_first_and_clusters_transitively():
    hasher = MinHasher()
    base = _docs(1)[0]
    near = base[:100] + "#" + base[101:]  # one character changed: J > 0.95
    docs = [
        {"text": "something else entirely " * 30, "source": "a", "doc_id": "a/f1/0"},
        {"text": base, "source": "a", "doc_id": "a/f1/1"},
        {"text": base.upper(), "source": "a", "doc_id": "a/f0/5"},  # exact copy, earlier part
        {"text": near, "source": "b", "doc_id": "b/g/0"},  # near copy in a later source
    ]
    src = {"a": 0, "b": 1}
    one = decide([collect_signatures(docs, src, hasher)])
    parts = decide([collect_signatures(docs[2:], src, hasher), collect_signatures(docs[:2], src, hasher)])
    assert one == parts
    assert one["exact"] == ["a/f1/1"] and one["near"] == ["b/g/0"]
    assert one["kept_of"] == {"a/f1/1": "a/f0/5", "b/g/0": "a/f0/5"}


@pytest.mark.slow
def test_prebuild_removes_the_same_for_any_workers(corpus, tokenizer_512, tmp_path):
    glob, _ = corpus
    cfg = _config(glob)
    seen = []
    for workers in (1, 2, 4):
        out = tmp_path / f"w{workers}"
        prebuild(cfg, tokenizer_512, out, workers=workers, tokens_per_shard=128 * 16, splits=("train",), progress=False)
        m = mf.read_manifest(out / "train")
        d = m["stats"]["dedup"]["std"]
        read = m["stats"]["source"]["std"]["kept"]
        tokens = sum(r["tokens"] for r in m["realized"].values())
        assert d["kept"] + d["exact_dup"] + d["near_dup"] == read == 80 + 12
        seen.append((d["exact_dup"], d["near_dup"], d["kept"], tokens))
    assert len(set(seen)) == 1, seen
    index = build_dedup_index(cfg, ("train",), 1)
    assert seen[0][:2] == (index.counts()["train"]["exact"], index.counts()["train"]["near"])


def test_stream_mode_drops_the_index_ids_across_readers(corpus, tokenizer_512, tmp_path, monkeypatch):
    import stacklm.data.dedup.node as dedup_node

    glob, _ = corpus
    index = build_dedup_index(_config(glob), ("train",), 1)
    path = tmp_path / "idx.npz"
    index.save(path)
    assert DedupIndex.load(path).content_hash == index.content_hash
    decision = decide([collect_signatures(_iter_filtered(_config(glob), 0, 1), {"std": 0}, MinHasher())])
    removed = set(decision["exact"]) | set(decision["near"])  # what the index lists, as ids
    cfg = _config(glob, exact=False, near=False, index=str(path))
    normalized = []  # with the index alone nothing reads a normalised text: none is made
    monkeypatch.setattr(dedup_node, "normalize_text", lambda text: normalized.append(text) or text)
    ids, dropped = [], 0
    for k in range(4):  # 4 readers (2 ranks x 2 workers): the copies sit in other readers' files
        pipe = build_pipeline(cfg, tokenizer_512, "train", ShardSpec(k // 2, 2, k % 2, 2))
        node = pipe.chains["std"]["dedup"]
        node.reset(None)
        ids += [d["doc_id"] for d in node]
        st = node.stats.to_dict()["std"]
        dropped += st.get("exact_dup", 0) + st.get("near_dup", 0)
    assert dropped == sum(index.counts()["train"].values())
    assert not removed & set(ids) and len(ids) == 92 - dropped
    assert normalized == []


def test_dedup_index_writes_where_a_stream_config_reads(corpus, tmp_path):
    """``stacklm dedup-index --config C`` on the config a stream run uses (``dedup: {index: P,
    exact: false, near: false}``, as configs/stack-100m.yaml): it writes the full exact + near
    decision to P, the file the run then reads; without --out or an index it says what to give."""
    import yaml

    from stacklm.cli import main

    glob, _ = corpus
    path = tmp_path / "idx.npz"
    cfg = _config(glob, exact=False, near=False, index=str(path)).to_dict()
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"data": {"pipeline": cfg}}))
    assert main(["dedup-index", "--config", str(tmp_path / "c.yaml"), "--splits", "train"]) == 0
    assert DedupIndex.load(path).content_hash == build_dedup_index(_config(glob), ("train",), 1).content_hash
    bare = _config(glob, exact=False, near=False).to_dict()
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump({"data": {"pipeline": bare}}))
    res = subprocess.run([sys.executable, "-m", "stacklm", "dedup-index", "--config", str(tmp_path / "bare.yaml")],
                         capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode != 0 and "no --out given" in res.stderr and "Traceback" not in res.stderr


def _iter_filtered(cfg, reader, readers):
    from stacklm.data.pipeline import document_chain

    node = document_chain(cfg, cfg.mix.entries[0], "train", ShardSpec(0, 1, reader, readers))["filter"]
    node.reset(None)
    yield from node


def test_exact_index_is_bounded_and_counts_what_it_cannot_remember():
    ded = ExactDeduper(max_docs=3)
    with pytest.warns(RuntimeWarning, match="index is full"):
        dup = ded.is_duplicate_batch(["a", "b", "a", "c", "d", "d", "e"])
    # the same decisions as one document at a time: "d" is never remembered, so its copy passes
    assert dup.tolist() == [False, False, True, False, False, False, False]
    one = ExactDeduper(max_docs=3)
    with pytest.warns(RuntimeWarning):
        assert [one.is_duplicate(t) for t in ["a", "b", "a", "c", "d", "d", "e"]] == dup.tolist()
    assert len(ded) == 3 and ded.stats.total("index_full") == 3 == one.stats.total("index_full")
    assert ded.is_duplicate_batch(["d"]).tolist() == [False]  # not remembered: passes, counted
    assert ded.stats.total("index_full") == 4
    state = ded.state_dict()
    again = ExactDeduper(max_docs=3)
    again.load_state_dict(state)
    assert again.is_duplicate_batch(["b", "zz"]).tolist() == [True, False] and len(again) == 3


def test_second_prebuild_is_refused_and_a_failed_build_releases_its_dir(corpus, tokenizer_512, tmp_path):
    glob, _ = corpus
    out = tmp_path / "out"
    state_dir_of(out).mkdir(parents=True)
    held = lock_out_dir(out)  # another prebuild holds the directory
    with pytest.raises(PrebuildError, match="another `stacklm prebuild`"):
        prebuild(_config(glob), tokenizer_512, out, tokens_per_shard=128 * 16, splits=("train",), progress=False)
    held.close()
    bad = tmp_path / "bad"
    with pytest.raises(Exception, match="matched no"):
        prebuild(_config(str(tmp_path / "nothing*.jsonl")), tokenizer_512, bad, tokens_per_shard=128 * 16, splits=("train",), progress=False)
    assert not state_dir_of(bad).exists()  # no claim left: the fixed config just runs
    prebuild(_config(glob, near=False), tokenizer_512, bad, tokens_per_shard=128 * 16, splits=("train",), progress=False)
    assert (bad / "manifest.json").exists()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], check=False, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.slow
def test_pool_workers_die_with_a_sigkilled_parent(corpus, tokenizer_512, saved_tokenizer_dir, tmp_path):
    glob, _ = corpus
    tok_dir = saved_tokenizer_dir(tokenizer_512)
    cfg_file = tmp_path / "c.yaml"
    import yaml

    data = json.loads(json.dumps(_config(glob).to_dict()))
    cfg_file.write_text(yaml.safe_dump({"data": {"tokenizer": str(tok_dir), "pipeline": data}}))
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "stacklm", "prebuild", "--config", str(cfg_file), "--out", str(out), "--workers", "2",
         "--tokens-per-shard", "128", "--no-progress"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    kids: list[int] = []
    while time.monotonic() < deadline and proc.poll() is None:
        kids = _children(proc.pid)
        writing = (out / "train").exists() and any((out / "train").glob("*"))
        if len(kids) >= 2 and writing:
            break
        time.sleep(0.01)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    workers = [k for c in kids for k in [c] + _children(c)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(2.0)
    alive = [k for k in workers if Path(f"/proc/{k}").exists() and "Z" not in Path(f"/proc/{k}/stat").read_text().split()[2]]
    assert alive == []
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    time.sleep(1.0)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == files  # nobody keeps writing


def test_an_unfinished_build_with_shards_says_how_to_start_over(corpus, tokenizer_512, tmp_path, monkeypatch):
    import stacklm.prebuild.build as build_mod

    glob, _ = corpus
    out = tmp_path / "half"

    def boom(*a, **k):
        raise RuntimeError("killed before the manifests")

    monkeypatch.setattr(build_mod, "finalize", boom)
    with pytest.raises(RuntimeError):
        prebuild(_config(glob, near=False), tokenizer_512, out, tokens_per_shard=128 * 16, splits=("train",), progress=False)
    monkeypatch.undo()
    assert state_dir_of(out).exists()  # shards were written: the claim stays, so it can resume
    with pytest.raises(PrebuildError, match=r"unfinished.*delete .*half"):
        prebuild(_config(glob), tokenizer_512, out, tokens_per_shard=128 * 16, splits=("train",), progress=False)
    top = prebuild(_config(glob, near=False), tokenizer_512, out, tokens_per_shard=128 * 16, splits=("train",), progress=False)
    assert top["splits"]["train"]["n_seq"] > 0


def test_dedup_index_cli_then_stream_config(corpus, tmp_path, capsys):
    import yaml

    from stacklm.cli import main as stacklm_main

    glob, _ = corpus
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({"data": {"pipeline": json.loads(json.dumps(_config(glob).to_dict()))}}))
    out = tmp_path / "idx.npz"
    assert stacklm_main(["dedup-index", "--config", str(cfg_file), "--out", str(out), "--splits", "train"]) == 0
    printed = capsys.readouterr().out
    index = DedupIndex.load(out)
    c = index.counts()["train"]
    assert f"{c['exact']:,} exact and {c['near']:,} near" in printed and "dedup.index" in printed
    assert index.content_hash == build_dedup_index(_config(glob), ("train",), 2).content_hash
    missing = _config(glob, index=str(tmp_path / "nope.npz"))
    with pytest.raises(Exception, match="stacklm dedup-index"):
        build_pipeline(missing, None, "train")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*ran dry:UserWarning")
def test_stream_mode_with_a_real_trainer_drops_what_the_index_lists(corpus, tokenizer_512, saved_tokenizer_dir, tmp_path):
    """StackDataModule stream mode, 2 DataLoader workers, a real Trainer: each worker reads its
    whole slice (the budget is larger than the corpus), and the copies dropped across both
    workers are exactly the index's, though each copy sits in another worker's files."""
    import lightning as L

    from stacklm.datamodule import StackDataModule
    from tests.helpers.lightning import TinyLM

    glob, _ = corpus
    path = tmp_path / "idx.npz"
    index = build_dedup_index(_config(glob), ("train",), 1)
    index.save(path)
    pipeline = json.loads(json.dumps(_config(glob, exact=False, near=False, index=str(path)).to_dict()))
    pipeline["mix"]["total_tokens"] = 400_000
    for key in ("seq_len", "batch_size", "num_threads"):
        pipeline.pop(key)
    dm = StackDataModule(mode="stream", tokenizer=str(saved_tokenizer_dir(tokenizer_512)), pipeline=pipeline, seq_len=512,
                         batch_size=8, num_workers=2, val_batches=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(TinyLM(512), datamodule=dm)
    dropped = dm.data_stats()["dropped_docs"]["dedup"]["std"]
    c = index.counts()["train"]
    assert (dropped.get("exact_dup", 0), dropped.get("near_dup", 0)) == (c["exact"], c["near"])
    assert c["exact"] >= 6 and c["near"] >= 6


@pytest.fixture(scope="module")
def split_corpus(tmp_path_factory):
    """60 real documents, each with one planted copy in another file; a holdout of 0.5 deals them
    into train and val (``write_split_corpus``). Returns (glob, {text: pair})."""
    return write_split_corpus(tmp_path_factory.mktemp("split_corpus"))


def _split_docs(cfg, split):
    from stacklm.data.pipeline import document_chain

    node = document_chain(cfg, cfg.mix.entries[0], split, ShardSpec(0, 1, 0, 1))["filter"]
    node.reset(None)
    return [(d["doc_id"], d["text"]) for d in node]


def _leaks(kept: dict[str, set[str]], docs: dict[str, list], pair_of: dict[str, int]) -> set[int]:
    """Planted pairs with a kept copy in train and a kept copy in val."""
    where: dict[int, set[str]] = {}
    for split, rows in docs.items():
        for doc_id, text in rows:
            if doc_id in kept[split] and text in pair_of:
                where.setdefault(pair_of[text], set()).add(split)
    return {p for p, s in where.items() if len(s) == 2}


@pytest.mark.filterwarnings("ignore:.*ran dry")
def test_no_duplicate_set_keeps_members_in_train_and_val(split_corpus, tokenizer_512, tmp_path):
    glob, pair_of = split_corpus
    cfg = dataclasses_replace_holdout(_config(glob), 0.5)
    docs = {s: _split_docs(cfg, s) for s in ("train", "val")}
    hasher = MinHasher()
    straddle = {pair_of[t] for _, t in docs["val"] if t in pair_of} & {pair_of[t] for _, t in docs["train"] if t in pair_of}
    # Exact copies never straddle: the holdout hashes the normalised text the exact digest
    # hashes. Near copies do: these pairs had one copy put in each split.
    assert len(straddle) >= 8 and all(p % 2 == 0 for p in straddle)

    # before: one decision per split (what the pass did until now) leaks every straddling pair
    per_split = {s: decide([collect_signatures(iter([{"text": t, "doc_id": i, "source": "std"} for i, t in rows]), {"std": 0}, hasher)])
                 for s, rows in docs.items()}
    kept_before = {s: {i for i, _ in rows} - set(per_split[s]["exact"]) - set(per_split[s]["near"]) for s, rows in docs.items()}
    before = _leaks(kept_before, docs, pair_of)
    assert before <= straddle and len(before) >= 8  # (a stdlib duplicate of its own may remove one copy in-split)

    # after: one decision over both splits; the val copy wins, the train copy is cross_split
    index = build_dedup_index(cfg, ("train", "val"), 2)
    kept_after = {}
    for s, rows in docs.items():
        code = index.lookup(s, np.array([id_key(i) for i, _ in rows], dtype=np.uint64))
        kept_after[s] = {i for (i, _), c in zip(rows, code) if c == 0}
    assert _leaks(kept_after, docs, pair_of) == set()
    train_copy = {pair_of[t]: i for i, t in docs["train"] if t in pair_of}
    val_copy = {pair_of[t]: i for i, t in docs["val"] if t in pair_of}
    cross = set(index.splits["train"]["cross_split"].tolist())
    assert all(id_key(train_copy[p]) in cross for p in before)
    assert all(val_copy[p] in kept_after["val"] for p in before)
    assert index.counts()["val"]["cross_split"] == 0 and index.counts()["train"]["cross_split"] >= len(before)
    print(f"planted pairs straddling train/val: {len(straddle)}; leaked before {len(before)}, after 0; "
          f"cross_split removed {index.counts()['train']['cross_split']}")

    # the prebuild drops them and counts them in the manifests' drops and the ledger
    out = tmp_path / "out"
    prebuild(cfg, tokenizer_512, out, workers=2, tokens_per_shard=128 * 16, progress=False)
    for s in ("train", "val"):
        m = mf.read_manifest(out / s)
        c = index.counts()[s]
        assert m["drops"]["std"]["cross_split_dup"] == c["cross_split"]
        assert (m["drops"]["std"]["exact_dup"], m["drops"]["std"]["near_dup"]) == (c["exact"], c["near"])
        assert m["ledger"]["sources"]["std"]["docs"]["dropped"].get("dedup/cross_split_dup", 0) == c["cross_split"]
        assert m["ledger"]["ok"], m["ledger"]["problems"]


def dataclasses_replace_holdout(cfg, fraction):
    import dataclasses

    return dataclasses.replace(cfg, holdout_fraction=fraction)


def _delivered_docs(out: Path, split: str = "train") -> set[tuple[str, str, int]]:
    """Every (source, file, record) a piece of some row of the split's shards comes from."""
    from stacklm.data.storage.provenance import decode_rows, prov_path

    m = mf.read_manifest(out / split)
    prov, docs = m["provenance"], set()
    for shard in m["shards"]:
        _, pieces = decode_rows(prov_path(out / split, shard["name"]).read_bytes())
        for src, fid, rec in pieces[:, :3].tolist():
            name = prov["sources"][src]
            docs.add((name, prov["files"][name][fid], rec))
    return docs


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*ran dry")
def test_what_is_and_is_not_the_same_for_any_workers(corpus, tokenizer_512, tmp_path):
    """What docs/prebuild.md promises across ``--workers N``: the dedup decision and, with a
    budget the corpus does not fill, the delivered documents are the same for every N. With a
    budget that binds (here a third of the corpus), the totals per source are exact for every N
    but *which* documents fill them is not: each job stops in its own slice. (If this last
    assertion starts failing, the kept set became invariant: update the docs.)"""
    glob, _ = corpus
    seen = {}
    for budget in (10**9, 6000):
        d = _config(glob).to_dict()
        d["mix"]["total_tokens"] = budget
        cfg = PipelineConfig.from_dict(d)
        for workers in (1, 2):
            out = tmp_path / f"b{budget}w{workers}"
            prebuild(cfg, tokenizer_512, out, workers=workers, tokens_per_shard=128 * 16, splits=("train",), progress=False)
            top, m = mf.read_manifest(out), mf.read_manifest(out / "train")
            seen[budget, workers] = (top["global_dedup"]["index_sha256"], {s: r["tokens"] for s, r in m["realized"].items()},
                                     _delivered_docs(out))
    for budget in (10**9, 6000):
        (h1, t1, d1), (h2, t2, d2) = seen[budget, 1], seen[budget, 2]
        assert h1 == h2 and t1 == t2  # the same removals, the same tokens per source
    assert seen[6000, 1][1]["std"] == 6000
    assert seen[10**9, 1][2] == seen[10**9, 2][2]  # budget not binding: the same documents
    assert seen[6000, 1][2] != seen[6000, 2][2]  # binding: other documents fill the same totals
    a, b = seen[6000, 1][2], seen[6000, 2][2]
    print(f"binding budget: workers 1 delivers {len(a)} documents, workers 2 {len(b)}, {len(a ^ b)} differ; "
          f"non-binding: {len(seen[10**9, 1][2])} the same")


def _planted_records(n: int, rng, nb: int = 12):
    """Signature records with planted exact copies (same digest, hence the same signature: the
    same normalised text) and near copies (each MinHash value taken from the original with
    probability 0.95, 0.85, 0.7 or 0.5, so some pass verification and some only share a band;
    copies of copies make drift chains), over 3 sources, 7 parts and both splits; ids are
    ``source/part/row`` like a real source's. Bands are folded from the values as
    ``MinHasher.band_keys`` folds them."""
    hasher = MinHasher(num_bands=nb)
    values = rng.integers(1, 2**63, size=(n, hasher.num_perm), dtype=np.uint64)
    digest = rng.integers(1, 2**63, size=n, dtype=np.uint64)
    for _ in range(n // 4):
        a, b = rng.integers(0, n, size=2)
        if rng.random() < 0.4:
            digest[b] = digest[a]
        else:
            take = rng.random(hasher.num_perm) < rng.choice([0.95, 0.85, 0.7, 0.5])
            values[b, take] = values[a, take]
    _, first, inv = np.unique(digest, return_index=True, return_inverse=True)
    values = values[first[inv.reshape(-1)]]
    src = rng.integers(0, 3, size=n)
    ids = np.array([f"s{src[i]}/part{i % 7}/{i * 13 % 100_003}" for i in range(n)])
    split = np.where(rng.random(n) < 0.2, "val", "train")
    return ids, src, digest, hasher.band_keys(values), (values & np.uint64(0xFFFF_FFFF)).astype(np.uint32), split


@pytest.mark.filterwarnings("ignore:.*ran dry")
def test_prebuild_and_dedup_index_remove_what_the_one_process_decision_removed(split_corpus, tokenizer_512, tmp_path):
    """``stacklm prebuild`` (the local pool) and ``stacklm dedup-index`` make the decision as the
    staged one (signatures written by the workers, buckets and cluster in one process): on
    planted exact, near and cross-split copies, the removed ids are ``decide_splits``'s (the
    one-process decision they ran before) for 1 and 3 readers, the merged index has its hash,
    counts and meta, and a ``--workers 2`` prebuild drops exactly those ids, from one
    removed-id shard per job."""
    from stacklm.data.dedup.global_index import decide_splits
    from stacklm.prebuild.dedup_pass import signature_slice

    glob, _ = split_corpus
    cfg = dataclasses_replace_holdout(_config(glob), 0.5)
    slices = {s: [signature_slice(cfg.to_dict(), s, 0, 1)] for s in ("train", "val")}
    ref = DedupIndex.from_decisions(decide_splits(slices))
    counts = ref.counts()
    assert counts["train"]["cross_split"] >= 8 and counts["train"]["exact"] + counts["val"]["exact"] > 0
    assert counts["train"]["near"] + counts["val"]["near"] > 0
    for readers in (1, 3):
        index = build_dedup_index(cfg, ("train", "val"), readers, work_dir=tmp_path)
        assert index.content_hash == ref.content_hash and index.counts() == counts, readers
        assert index.meta["docs"] == {s: len(slices[s][0]["ids"]) for s in slices}
        assert index.meta["removed"] == counts
        assert not list(tmp_path.glob(".dedup-index-*"))  # its signature columns are gone
    out = tmp_path / "out"
    prebuild(cfg, tokenizer_512, out, workers=2, tokens_per_shard=128 * 16, progress=False)
    top = mf.read_manifest(out)
    assert top["global_dedup"]["index_sha256"] == ref.content_hash and top["global_dedup"]["removed"] == counts
    for s in ("train", "val"):
        drops = mf.read_manifest(out / s)["drops"]["std"]
        c = counts[s]
        assert (drops.get("exact_dup", 0), drops.get("near_dup", 0), drops.get("cross_split_dup", 0)) == (c["exact"], c["near"], c["cross_split"])


def test_staged_decision_is_the_single_process_one_for_every_task_count(tmp_path):
    """Signatures -> per-band/range verified buckets -> partitioned decision -> sharded removed
    ids gives exactly ``decide_splits``'s removed ids (reasons included, the val copy winning
    across splits), for T = 1/2/4 slices per split, 1 or 3 key ranges per band, bucket tasks
    that sort 300 records at a time and 1 or 3 decision partitions; each shard lists only its
    own slice's ids. The rule is verified and does not chain: every near removal names a kept
    document with >= 75 % of its MinHash values equal (counted here from the values), and
    pairs that only share a band are not removed."""
    from stacklm.data.dedup import shards as shards_mod
    from stacklm.data.dedup import decision as decision_mod, staged
    from stacklm.data.dedup.evidence import DedupEvidence, evidence_path
    from stacklm.data.dedup.global_index import REASONS, decide_splits

    ids, src, digest, bands, minhash, split = _planted_records(2000, np.random.default_rng(3))
    row_of = {d: i for i, d in enumerate(ids.tolist())}

    def slices(t):
        return {s: [{"ids": ids[q], "source": src[q], "digest": digest[q], "bands": bands[q], "minhash": minhash[q]}
                    for q in (np.flatnonzero(split == s)[w::t] for w in range(t))] for s in ("val", "train")}

    ref = decide_splits(slices(1))
    want = {s: {r: set(ref[s][r]) for r in REASONS} for s in ref}
    assert want["train"]["cross_split"] and want["train"]["near"] and want["train"]["exact"] and want["val"]["near"]
    removed_ids = {d for s in want for r in REASONS for d in want[s][r]}
    equal = lambda a, b: int((minhash[row_of[a]] == minhash[row_of[b]]).sum())  # noqa: E731
    for s in ref:  # verified, for a kept document
        for d, k in ref[s]["kept_of"].items():
            assert k not in removed_ids and equal(d, k) >= 90 and ref[s]["similarity"][d] == pytest.approx(equal(d, k) / 120)
    shares_band_only = [(a, b) for a in range(len(ids)) for b in np.flatnonzero((bands == bands[a]).any(axis=1)).tolist()
                        if b > a and (minhash[a] == minhash[b]).sum() < 90 and digest[a] != digest[b]]
    assert shares_band_only and any(ids[a] not in removed_ids and ids[b] not in removed_ids for a, b in shares_band_only)
    want_hash = DedupIndex.from_decisions(ref).content_hash
    for t in (1, 2, 4):
        dirs, own = [], []
        for s, parts in slices(t).items():
            for w, p in enumerate(parts):
                dirs.append(tmp_path / f"t{t}" / f"{s}-w{w:03d}")
                staged.write_signature_dir(p, s, dirs[-1])
                own.append((s, set(p["ids"].tolist())))
        for ranges, chunk, partitions in ((1, 10**9, 1), (3, 300, 3)):
            with decision_mod.staged_decision(dirs, ranges, ranges, chunk=chunk, partitions=partitions) as decision:
                removed = decision.removed
                # exact copies of near-removed documents took the path that renames their kept copy
                assert decision.stats["reclassified"] > 0 and decision.folder.is_dir()
            assert not decision.folder.exists()  # the spool goes with the decision
            got = {s: {r: set() for r in REASONS} for s in ("val", "train")}
            for f, per in removed.items():
                s, mine = own[f]
                names = slices(t)[s][int(dirs[f].name[-3:])]["ids"]
                for r, rows in per.items():
                    got[s][r] |= {names[i] for i in rows.tolist()}
                assert {names[i] for rows in per.values() for i in rows.tolist()} <= mine
            assert got == want, (t, ranges)
        shards = tmp_path / f"t{t}" / "index"
        shards_mod.write_index_shards(dirs, decision_mod.staged_decision(dirs), shards)
        merged = shards_mod.load_shards(shards_mod.index_shard_paths(shards))
        assert merged.content_hash == want_hash
        for per_range in (1 << 24, 7):  # the finalize's identity, in one key range or in dozens
            ident = shards_mod.merged_identity(shards_mod.index_shard_paths(shards), ids_per_range=per_range)
            assert (ident.content_hash, ident.counts(), ident.meta) == (want_hash, merged.counts(), merged.meta)
        for (s, mine), d in zip(own, dirs):  # a job's shard: its own split, its own documents' ids only
            shard = DedupIndex.load(shards / f"{d.name}.npz")
            assert list(shard.splits) == [s]
            listed = np.concatenate(list(shard.splits[s].values()))
            assert np.isin(listed, np.array([id_key(i) for i in mine], dtype=np.uint64)).all()
            evidence = DedupEvidence.load(evidence_path(shards / f"{d.name}.npz"))  # why each was removed
            assert len(evidence) == listed.size
            for doc in evidence.splits[s]["removed"].tolist():
                why = evidence.why(s, doc)
                assert why["kept"] not in removed_ids and doc in want[s][why["reason"]]
                # exactly the count's fraction (108 of 120 is 0.9, at a 0.9 threshold, not 0.89999998)
                assert why["similarity"] == (1.0 if why["reason"] == "exact" else equal(doc, why["kept"]) / 120)
                assert (why["kept_split"] != s) == (why["reason"] == "cross_split")


def test_the_decision_does_not_chain_and_is_linear_in_a_long_chain(tmp_path):
    """A drift chain A0~A1~...~A_n (each link takes 95 % of the previous one's MinHash values,
    so documents a few links apart are similar and the ends are unrelated): connected
    components would keep A0 alone; the rule keeps a document every few links (each one not
    verified-similar to the kept one before it) and removes the others each for a kept earlier
    one with >= 90 of 120 values equal, staged and reference alike; 20,000 links decide in one
    linear pass (the remainder), not 20,000 rounds."""
    from stacklm.data.dedup import decision as decision_mod, staged
    from stacklm.data.dedup.global_index import decide_splits

    hasher, rng, n = MinHasher(), np.random.default_rng(5), 20_000
    values = np.empty((n, hasher.num_perm), dtype=np.uint64)
    values[0] = rng.integers(1, 2**63, size=hasher.num_perm, dtype=np.uint64)
    for i in range(1, n):  # each link keeps 95 % of the previous values: J(A_i, A_i+2) ~ 0.9, J(A_i, A_i+4) ~ 0.81 ...
        values[i] = np.where(rng.random(hasher.num_perm) < 0.95, values[i - 1], rng.integers(1, 2**63, size=hasher.num_perm, dtype=np.uint64))
    rec = {"ids": np.array([f"s/p0/{i}" for i in range(n)]), "source": np.zeros(n, np.int32),
           "digest": np.arange(1, n + 1, dtype=np.uint64), "bands": hasher.band_keys(values),
           "minhash": (values & np.uint64(0xFFFF_FFFF)).astype(np.uint32)}
    ref = decide_splits({"train": [rec]})["train"]
    removed = set(ref["near"])
    low = rec["minhash"]
    for d, k in ref["kept_of"].items():  # each removed link names an earlier kept one it is verified-similar to
        i, j = int(d.rsplit("/", 1)[1]), int(k.rsplit("/", 1)[1])
        assert k not in removed and j < i and (low[i] == low[j]).sum() >= 90
    kept = sorted(set(range(n)) - {int(d.rsplit("/", 1)[1]) for d in removed})
    assert kept[0] == 0 and "s/p0/1" in removed and len(kept) > n / 20
    for a, b in zip(kept, kept[1:]):  # consecutive kept documents are not near copies (J >= 0.9 that share a band)
        assert (low[a] == low[b]).sum() < 108 or not (rec["bands"][a] == rec["bands"][b]).any()
    staged.write_signature_dir(rec, "train", tmp_path / "train-w000")
    decision = decision_mod.staged_decision([tmp_path / "train-w000"], partitions=2)
    assert {f"s/p0/{i}" for i in decision.removed[0]["near"].tolist()} == removed
    assert decision.stats["remainder_edges"] > 0.5 * n  # the chain was decided by the linear pass


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*ran dry")
def test_datatrove_staged_dedup_is_the_same_for_tasks_1_2_4_and_leaks_nothing(split_corpus, tokenizer_512, tmp_path):
    """prebuild-datatrove's staged decision (signatures, 13 bucket tasks, one cluster, one
    shard per packing task) on a corpus whose planted pairs straddle train and val: the same
    index (hash and counts) for T = 1/2/4, equal to the single-process ``build_dedup_index``
    whose leakage test_no_duplicate_set_keeps_members_in_train_and_val pins at 0, and at T = 2
    byte-identical output to ``stacklm prebuild --workers 2``."""
    from stacklm.scale.datatrove_executors import prebuild_executors, run_executors

    from tests.helpers.prebuild import tree

    glob, _ = split_corpus
    cfg = dataclasses_replace_holdout(_config(glob), 0.5)
    ref = build_dedup_index(cfg, ("train", "val"), 1)
    assert ref.counts()["train"]["cross_split"] >= 8
    seen = set()
    for t in (1, 2, 4):
        out = tmp_path / f"dt{t}"
        main, merge = prebuild_executors(cfg, tokenizer_512, out, tasks=t, tokens_per_shard=128 * 16, workers=2)  # two tasks at a time: the 2 cores
        run_executors(merge)
        top = mf.read_manifest(out)
        seen.add((top["global_dedup"]["index_sha256"], json.dumps(top["global_dedup"]["removed"], sort_keys=True)))
        for s in ("train", "val"):
            m = mf.read_manifest(out / s)
            assert m["drops"]["std"].get("cross_split_dup", 0) == ref.counts()[s]["cross_split"]
            assert m["ledger"]["ok"], m["ledger"]["problems"]
        if t == 2:
            pool = tmp_path / "pool2"
            prebuild(cfg, tokenizer_512, pool, workers=2, tokens_per_shard=128 * 16, progress=False)
            assert tree(out) == tree(pool)
    assert seen == {(ref.content_hash, json.dumps(ref.counts(), sort_keys=True))}


def test_an_empty_slice_takes_part_in_the_staged_decision(tmp_path):
    """A reader slice with no documents (more readers than pieces: the README's example) writes
    an empty signature directory, and the decision over it and a full slice is the full one's."""
    from stacklm.data.dedup import decision as decision_mod, staged

    hasher = MinHasher()
    texts = ["alpha beta gamma delta " * 20, "alpha beta gamma delta " * 20, "something else entirely " * 20]
    full = collect_signatures(iter([{"text": t, "doc_id": f"s/p0/{i}", "source": "s"} for i, t in enumerate(texts)]), {"s": 0}, hasher)
    empty = collect_signatures(iter([]), {"s": 0}, hasher)
    dirs = [tmp_path / "train-w000", tmp_path / "train-w001"]
    staged.write_signature_dir(full, "train", dirs[0])
    assert staged.write_signature_dir(empty, "train", dirs[1])["n"] == 0
    removed = decision_mod.staged_decision(dirs).removed
    assert {f: {r: a.tolist() for r, a in per.items()} for f, per in removed.items()} == {0: {"exact": [1]}}


def test_a_stream_index_is_refused_on_any_other_corpus_or_split_naming_the_source_and_file(corpus, tokenizer_512, tmp_path):
    """Issue 32.1: the index's ids are positions (source/part/row). Built on one corpus, then
    applied to it with one record inserted at the top of one file, it drops unique documents and
    keeps copies twice; so a stream run refuses it in one line naming the source and the file.
    A copy of the same corpus elsewhere is the same corpus (labels are relative)."""
    import shutil

    glob, _ = corpus
    src = tmp_path / "corpus"
    shutil.copytree(Path(glob).parent, src)
    path = tmp_path / "idx.npz"
    build_dedup_index(_config(str(src / "*.jsonl")), ("train",), 1).save(path)

    def first_dedup_docs(cfg):
        node = build_pipeline(cfg, tokenizer_512, "train").chains["std"]["dedup"]
        node.reset(None)
        return [d["doc_id"] for d in node]

    moved = tmp_path / "elsewhere"
    shutil.copytree(src, moved)  # the same files in another folder: accepted
    kept = first_dedup_docs(_config(str(moved / "*.jsonl"), exact=False, near=False, index=str(path)))
    assert len(kept) == 92 - sum(DedupIndex.load(path).counts()["train"].values())

    def refused(cfg) -> str:
        with pytest.raises(ConfigError) as e:
            build_pipeline(cfg, tokenizer_512, "train")
        line = str(e.value)
        assert "\n" not in line and cfg.dedup.index in line and "stacklm dedup-index" in line, line
        return line

    stream = _config(str(src / "*.jsonl"), exact=False, near=False, index=str(path))
    lines = (src / "p1.jsonl").read_text().splitlines(keepends=True)
    (src / "p1.jsonl").write_text(json.dumps({"text": "a new record at the top"}) + "\n" + "".join(lines))
    assert "source 'std': file p1.jsonl was" in refused(stream) and "bytes, it is" in refused(stream)
    (src / "p1.jsonl").write_text("".join(lines))  # back as it was: accepted again
    assert first_dedup_docs(stream) == kept
    swapped = lines[1:2] + lines[:1] + lines[2:]  # same bytes, two records swapped: positions differ
    (src / "p1.jsonl").write_text("".join(swapped))
    assert "file p1.jsonl has the same size" in refused(stream)
    (src / "p1.jsonl").write_text("".join(lines))
    (src / "p4.jsonl").write_text(lines[0])
    assert "file p4.jsonl was not there when it was built" in refused(stream)
    (src / "p4.jsonl").unlink()
    import dataclasses

    assert "holdout_fraction 0.0, this config has 0.5" in refused(dataclasses.replace(stream, holdout_fraction=0.5))
    old = DedupIndex.load(path)
    DedupIndex(old.splits, {k: v for k, v in old.meta.items() if k != "corpus"}).save(tmp_path / "old.npz")
    assert "records no fingerprint" in refused(_config(str(src / "*.jsonl"), exact=False, near=False, index=str(tmp_path / "old.npz")))


def test_an_unfinished_build_resumed_on_a_changed_corpus_is_refused(corpus, tokenizer_512, tmp_path, monkeypatch):
    """Issue 32.1: a prebuild's own removed ids and written shards were decided on the corpus it
    began with; a resume after a file changed refuses naming the source and the file."""
    import shutil

    import stacklm.prebuild.build as build_mod

    glob, _ = corpus
    src = tmp_path / "corpus"
    shutil.copytree(Path(glob).parent, src)
    cfg, out = _config(str(src / "*.jsonl"), near=False), tmp_path / "half"
    monkeypatch.setattr(build_mod, "finalize", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed before the manifests")))
    with pytest.raises(RuntimeError):
        prebuild(cfg, tokenizer_512, out, tokens_per_shard=128 * 16, splits=("train",), progress=False)
    monkeypatch.undo()
    before = (src / "p2.jsonl").read_bytes()
    (src / "p2.jsonl").write_bytes(before + b'{"text": "appended after the build began"}\n')
    with pytest.raises(PrebuildError, match=r"source 'std': file p2\.jsonl was [\d,]+ bytes, it is [\d,]+ now; restore the corpus"):
        prebuild(cfg, tokenizer_512, out, tokens_per_shard=128 * 16, splits=("train",), progress=False)
    from stacklm.scale.datatrove_executors import prebuild_executors

    with pytest.raises(PrebuildError, match=r"file p2\.jsonl was [\d,]+ bytes"):  # the engine's resume checks the same
        prebuild_executors(cfg, tokenizer_512, out, tasks=1, tokens_per_shard=128 * 16, splits=("train",), executor="local")
    (src / "p2.jsonl").write_bytes(before)
    assert prebuild(cfg, tokenizer_512, out, tokens_per_shard=128 * 16, splits=("train",), progress=False)["splits"]["train"]["n_seq"] > 0
