"""``stacklm inspect --why SOURCE/FILE/ROW`` (why the global dedup removed a document), the
evidence a finished prebuild keeps, and the removal-similarity histogram the prebuild summary
and ``stacklm ledger`` show; on hand-made evidence files (``DedupEvidence``), so each answer is
known before the command runs."""

from __future__ import annotations

import json

import numpy as np
import yaml

from stacklm.data.dedup.evidence import DedupEvidence, evidence_path
from stacklm.data.dedup.minhash import MinHasher, jaccard
from stacklm.prebuild.manifests import keep_dedup_evidence
from stacklm.prebuild.summary import summary_table
from tests.helpers.cli import run
from tests.helpers.dedup_corpus import dedup_config, real_docs
from tests.helpers.synthetic_edits import inject_edits


def _evidence(rows: list[tuple[str, str, int, float]], split: str = "train", kept_split: str | None = None) -> DedupEvidence:
    """Evidence of one split from ``(removed, kept, reason code, estimated similarity)`` rows."""
    return DedupEvidence({split: {
        "removed": np.array([r[0] for r in rows]), "kept": np.array([r[1] for r in rows]),
        "kept_split": np.array([kept_split or split] * len(rows)), "reason": np.array([r[2] for r in rows], np.int8),
        "similarity": np.array([r[3] for r in rows], np.float32)}})


def test_why_shows_the_kept_copy_the_estimate_and_the_exact_jaccard_from_the_texts(tmp_path):
    """A stream config's ``dedup.index`` with hand-made evidence beside it: ``--why`` names the
    kept document, prints the decision's estimate and the exact Jaccard of the two texts over
    the config's shingles (computed here from the texts written), and each text with the record
    ``--row`` would name (a blank line: record 1 is row 0); a document not removed, a malformed
    or foreign name, a kept copy gone from the sources and an index without evidence each say
    so in one line."""
    base, other = real_docs(2)
    near = inject_edits(base, 3, np.random.default_rng(0))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in (base, other)))
    (tmp_path / "b.jsonl").write_text("\n" + json.dumps({"text": near}) + "\n" + json.dumps({"text": other.upper()}) + "\n")
    index = tmp_path / "idx.npz"
    cfg = dedup_config(str(tmp_path / "*.jsonl"), exact=False, near=False, index=str(index))
    config = tmp_path / "stream.yaml"
    config.write_text(yaml.safe_dump({"data": {"pipeline": json.loads(json.dumps(cfg.to_dict()))}}))
    _evidence([("std/b.jsonl/0", "std/a.jsonl/0", 2, 0.9), ("std/b.jsonl/1", "std/a.jsonl/1", 1, 1.0),
               ("std/b.jsonl/7", "std/a.jsonl/9", 2, 0.85)]).save(evidence_path(index))
    hasher = MinHasher(7)  # the config's shingles: char 7-grams
    truth = jaccard(hasher.shingle_set(near), hasher.shingle_set(base))
    assert 0.3 < truth < 1.0  # a near copy, not an exact one: the exact value is not the estimate

    code, out = run(config, "--why", "std/b.jsonl/0")
    lines = out.strip().splitlines()
    assert code == 0 and lines[0] == "std/b.jsonl/0 [train]: removed (near) as a copy of std/a.jsonl/0, which is kept"
    assert f"estimated 0.900 (fraction of equal MinHash values), exact Jaccard {truth:.3f}" in lines[1] and "char 7-grams" in lines[1]
    assert lines[2].startswith("  removed std/b.jsonl/0 (record 1): " + repr(near[:40])[:-1])
    assert lines[3].startswith("  kept    std/a.jsonl/0 (record 0): " + repr(base[:40])[:-1])

    code, out = run(config, "--why", "std/b.jsonl/1", "--json")
    got = json.loads(out)
    assert code == 0 and (got["reason"], got["kept"], got["similarity"], got["exact_jaccard"]) == ("exact", "std/a.jsonl/1", 1.0, 1.0)
    assert got["text_removed"] == other.upper()[:160] and got["record_removed"] == 2

    code, out = run(config, "--why", "std/a.jsonl/0")
    assert code == 0 and out.strip() == "std/a.jsonl/0: not removed by the dedup decision (none of its 3 removals in train is this document)"
    code, out = run(config, "--why", "std/b.jsonl/0", "--split", "val")
    assert code == 2 and "--split val: the dedup decision has no split 'val' (it has train)" in out

    code, out = run(config, "--why", "std/b.jsonl/7")  # the kept copy is not in the sources: the estimate still shows
    assert code == 0 and "estimated 0.850" in out and "exact Jaccard" not in out.splitlines()[1]
    assert "texts not read, no exact Jaccard: std/b.jsonl/7, std/a.jsonl/9 not found in the sources" in out

    for bad, said in (("std/b.jsonl", "a document is named SOURCE/FILE/ROW"), ("web/a.jsonl/0", "source 'web' is not in the config's mix (std)")):
        code, out = run(config, "--why", bad)
        assert code == 2 and said in out and len(out.strip().splitlines()) == 1, out
    code, out = run(config, "--why", "std/b.jsonl/0", "--row", "3")
    assert code == 2 and "not --row and --why" in out

    evidence_path(index).unlink()  # an index decided before stacklm wrote evidence
    code, out = run(config, "--why", "std/b.jsonl/0")
    assert code == 2 and len(out.strip().splitlines()) == 1
    assert f"no dedup evidence beside the index {index}" in out and f"stacklm dedup-index --config {config} --out {index}" in out


def test_a_finished_build_keeps_its_evidence_and_the_summary_shows_its_histogram(tmp_path):
    """``keep_dedup_evidence`` (the prebuild's finalize) moves each job's evidence out of the
    state folder, which is removed next, and returns the per-split histogram the top manifest
    records; the summary table prints it per source (exact copies apart, near ones by the
    estimate); without evidence it says so in one line, without global dedup it says nothing."""
    state, out = tmp_path / "out" / ".prebuild" / "dedup-index", tmp_path / "out"
    state.mkdir(parents=True)
    for job in ("train-w000", "val-w000"):
        (state / f"{job}.npz").write_bytes(b"an index shard")  # only its name matters here
    assert keep_dedup_evidence(state, out) is None and not (out / "dedup-evidence").exists()  # an index without evidence
    _evidence([("web/a/1", "web/a/0", 1, 1.0), ("web/a/2", "web/a/0", 2, 0.97), ("code/c/5", "web/a/0", 2, 0.91),
               ("code/c/6", "code/c/0", 2, 0.82)]).save(evidence_path(state / "train-w000.npz"))
    _evidence([("web/v/3", "web/v/0", 2, 0.96)], split="val").save(evidence_path(state / "val-w000.npz"))
    want = {"train": {"web": {"exact": 1, "0.95-1.00": 1}, "code": {"0.90-0.95": 1, "0.80-0.85": 1}},
            "val": {"web": {"0.95-1.00": 1}}}
    for _ in range(2):  # again after a crash between the move and the top manifest: the same answer
        hist = keep_dedup_evidence(state, out)
        assert {s: {src: {k: n for k, n in row.items() if n} for src, row in h.items()} for s, h in hist.items()} == want
    assert sorted(p.name for p in (out / "dedup-evidence").iterdir()) == ["train-w000.evidence.npz", "val-w000.evidence.npz"]
    assert not list(state.glob("*.evidence.npz"))

    top = {"build": {"workers": 1}, "sources": [], "splits": {}, "drops": {},
           "global_dedup": {"removed": {}, "removal_similarity": hist}}
    table = summary_table(top, "OUT").splitlines()
    head = next(i for i, line in enumerate(table) if "dedup removals by similarity" in line)
    assert "stacklm inspect OUT --why SOURCE/FILE/ROW" in table[head]
    assert table[head + 1].split() == ["source", "exact", "0.95-1.00", "0.90-0.95", "0.85-0.90", "0.80-0.85", "0.00-0.80"]
    assert table[head + 2].split() == ["code", "0", "0", "1", "0", "1", "0"]
    assert table[head + 3].split() == ["web", "1", "2", "0", "0", "0", "0"]  # train and val together
    assert table[head + 4].split() == ["total", "1", "2", "1", "0", "1", "0"]
    del top["global_dedup"]["removal_similarity"]
    assert "no evidence (an index decided before stacklm kept it)" in summary_table(top, "OUT")
    del top["global_dedup"]
    assert "dedup removals" not in summary_table(top, "OUT")
