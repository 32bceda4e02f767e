"""``stacklm inspect --why SOURCE/FILE/ROW`` (why the global dedup removed a document), the
evidence a finished prebuild keeps, and the removal-similarity histogram the prebuild summary
and ``stacklm ledger`` show; on hand-made evidence files (``DedupEvidence``), so each answer is
known before the command runs."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import yaml

from stacklm.data.dedup.evidence import DedupEvidence, evidence_path
from stacklm.data.dedup.global_index import DedupIndex, id_keys
from stacklm.data.dedup.minhash import MinHasher, jaccard
from stacklm.prebuild.manifests import keep_dedup_evidence
from stacklm.prebuild.summary import summary_table
from tests.helpers.cli import run
from tests.helpers.dedup_corpus import dedup_config, real_docs, write_split_corpus
from tests.helpers.synthetic_edits import inject_edits


def _evidence(rows: list[tuple[str, str, int, float]], split: str = "train", kept_split: str | None = None, meta=None) -> DedupEvidence:
    """Evidence of one split from ``(removed, kept, reason code, estimated similarity)`` rows."""
    return DedupEvidence({split: {
        "removed": np.array([r[0] for r in rows]), "kept": np.array([r[1] for r in rows]),
        "kept_split": np.array([kept_split or split] * len(rows)), "reason": np.array([r[2] for r in rows], np.int8),
        "similarity": np.array([r[3] for r in rows], np.float64)}}, meta)


def test_why_shows_the_kept_copy_the_estimate_and_the_exact_jaccard_from_the_texts(tmp_path):
    """A stream config's ``dedup.index`` with hand-made evidence beside it: ``--why`` names the
    kept document, prints the decision's estimate and the exact Jaccard of the two texts over
    the config's shingles (computed here from the texts written), and each text with the record
    ``--row`` would name (a blank line: record 1 is row 0); a document not removed, a malformed
    or foreign name, a kept copy gone from the sources and an index without evidence each say
    so in one line."""
    base, other = real_docs(2)
    near = base[:200] + inject_edits(base[200:], 3, np.random.default_rng(0))  # the same opening, then edits
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in (base, other)))
    (tmp_path / "b.jsonl").write_text("\n" + json.dumps({"text": near}) + "\n" + json.dumps({"text": other.upper()}) + "\n")
    index = tmp_path / "idx.npz"
    cfg = dedup_config(str(tmp_path / "*.jsonl"), exact=False, near=False, index=str(index))
    config = tmp_path / "stream.yaml"
    config.write_text(yaml.safe_dump({"data": {"pipeline": json.loads(json.dumps(cfg.to_dict()))}}))
    rows = [("std/b.jsonl/0", "std/a.jsonl/0", 2, 0.9), ("std/b.jsonl/1", "std/a.jsonl/1", 1, 1.0), ("std/b.jsonl/7", "std/a.jsonl/9", 2, 0.85)]
    the_index = DedupIndex({"train": {"near": id_keys(["std/b.jsonl/0", "std/b.jsonl/7"]), "exact": id_keys(["std/b.jsonl/1"])}})
    the_index.save(index)
    _evidence(rows, meta={"index_sha256": the_index.content_hash}).save(evidence_path(index))
    hasher = MinHasher(7)  # the config's shingles: char 7-grams
    truth = jaccard(hasher.shingle_set(near), hasher.shingle_set(base))
    assert 0.3 < truth < 1.0  # a near copy, not an exact one: the exact value is not the estimate

    code, out = run(config, "--why", "std/b.jsonl/0")
    lines = out.strip().splitlines()
    assert code == 0 and lines[0] == "std/b.jsonl/0 [train]: removed (near) as a copy of std/a.jsonl/0, which is kept"
    assert f"estimated 0.900 (fraction of equal MinHash values), exact Jaccard {truth:.3f}" in lines[1] and "char 7-grams" in lines[1]
    start = next(i for i, (x, y) in enumerate(zip(near, base)) if x != y) - 40  # from just before the first difference
    assert start > 0 and lines[2] == f"  both texts from character {start:,} (just before the first difference):"
    assert lines[3] == f"  removed std/b.jsonl/0 (record 1): {near[start:start + 160]!r}"
    assert lines[4] == f"  kept    std/a.jsonl/0 (record 0): {base[start:start + 160]!r}"

    code, out = run(config, "--why", "std/b.jsonl/1", "--json")
    got = json.loads(out)
    assert code == 0 and (got["reason"], got["kept"], got["similarity"], got["exact_jaccard"]) == ("exact", "std/a.jsonl/1", 1.0, 1.0)
    assert got["excerpt_from"] == 0 and got["text_removed"] == other.upper()[:160] and got["record_removed"] == 2

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
    # a name that is no document is not a kept one: one line, not "not removed"
    for bad, said in (("std/a.jsonl/5", "no such document: file 'a.jsonl' of source 'std' has no row 5"),
                      ("std/c.jsonl/0", "no such document: source 'std' has no file 'c.jsonl'")):
        code, out = run(config, "--why", bad)
        assert code == 2 and said in out and len(out.strip().splitlines()) == 1, out
    _evidence(rows, meta={"index_sha256": "0" * 64}).save(evidence_path(index))  # evidence of another index beside it
    code, out = run(config, "--why", "std/b.jsonl/0")
    assert code == 2 and "is the evidence of another index" in out and len(out.strip().splitlines()) == 1

    evidence_path(index).unlink()  # an index decided before stacklm wrote evidence
    code, out = run(config, "--why", "std/b.jsonl/0")
    assert code == 2 and len(out.strip().splitlines()) == 1
    assert f"no dedup evidence beside the index {index} (deleted, or" in out and f"stacklm dedup-index --config {config} --out {index}" in out


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


@pytest.mark.filterwarnings("ignore:.*ran dry")
def test_a_prebuild_of_planted_copies_explains_its_removals_and_counts_them_as_the_ledger_does(tokenizer_512, tmp_path, capsys):
    """A real prebuild of 60 real documents, each with a planted exact or near copy, dealt into
    train and val (``write_split_corpus``): every removal its evidence lists is explained by
    ``--why`` with a kept document of the corpus and, for a near one, a similarity at or above
    the threshold, whose exact Jaccard is the one computed here from the files; the histogram
    the summary and the ledger print counts, per split, exactly the ledger's dedup drops (counted
    by the packing jobs, independently of the evidence)."""
    from stacklm.cli import main
    from stacklm.data.dedup.evidence import build_evidence_files
    from stacklm.data.quality.normalize import normalize_text
    from stacklm.data.storage import manifest as mf
    from stacklm.prebuild import prebuild

    (tmp_path / "corpus").mkdir()
    glob, _ = write_split_corpus(tmp_path / "corpus")
    cfg = dataclasses.replace(dedup_config(glob), holdout_fraction=0.5)
    out = tmp_path / "out"
    prebuild(cfg, tokenizer_512, out, workers=1, tokens_per_shard=128 * 16, progress=False)
    text_of = {}  # doc_id -> text, read from the files written (no pipeline code)
    for f in sorted((tmp_path / "corpus").glob("*.jsonl")):
        for row, line in enumerate(f.read_text().splitlines()):
            text_of[f"std/{f.name}/{row}"] = json.loads(line)["text"]

    evidence = [DedupEvidence.load(p) for p in build_evidence_files(out)]
    assert [p.name for p in build_evidence_files(out)] == ["train-w000.evidence.npz", "val-w000.evidence.npz"]
    removals = [(s, r) for ev in evidence for s, cols in ev.splits.items() for r in cols["removed"].tolist()]
    threshold = cfg.dedup.near_threshold
    hasher = cfg.dedup.min_hasher()
    reasons = set()
    for split, doc_id in removals:
        code, said = main(["inspect", str(out), "--why", doc_id, "--json"]), capsys.readouterr().out
        why = json.loads(said)
        assert code == 0 and why["removed"] and why["split"] == split and why["kept"] in text_of, why
        removed, kept = text_of[doc_id], text_of[why["kept"]]
        truth = jaccard(hasher.shingle_set(removed), hasher.shingle_set(kept))
        assert why["exact_jaccard"] == pytest.approx(truth) and abs(why["similarity"] - truth) < 0.1  # the estimate is of this pair
        if why["reason"] == "exact":
            assert normalize_text(removed) == normalize_text(kept) and why["similarity"] == 1.0
        else:
            assert why["similarity"] >= threshold, why
        reasons.add(why["reason"])
    assert reasons == {"exact", "near", "cross_split"}
    assert main(["inspect", str(out / "train"), "--why", removals[0][1]]) == 2
    assert "one split's directory; pass the prebuild output directory (its parent)" in capsys.readouterr().err

    code, said = main(["ledger", str(out), "--json"]), capsys.readouterr().out
    per_split = json.loads(said)
    top = mf.read_manifest(out)
    for split, entry in per_split.items():
        dropped = entry["sources"]["std"]["docs"]["dropped"]
        dedup_drops = sum(n for reason, n in dropped.items() if reason.startswith("dedup/"))
        hist = entry["removal_similarity"]["std"]
        assert sum(hist.values()) == dedup_drops == sum(1 for s, _ in removals if s == split) > 0, split
        assert hist == top["global_dedup"]["removal_similarity"][split]["std"]
    total = [line for line in summary_table(top, str(out)).splitlines() if line.split()[:1] == ["total"]][-1]  # the histogram's
    assert sum(int(n.replace(",", "")) for n in total.split()[1:]) == len(removals)
    code, said = main(["ledger", str(out)]), capsys.readouterr().out
    assert code == 0 and said.count("dedup removals by similarity to the kept copy: ") == 2
    assert f"why one was removed, and for which kept copy: stacklm inspect {out} --why SOURCE/FILE/ROW" in said
    in_train = next(d for s, d in removals if s == "train")  # asked in the other split: said where it is removed
    assert main(["inspect", str(out), "--why", in_train, "--split", "val"]) == 0
    assert capsys.readouterr().out.strip().endswith("; it is removed in train: leave --split out to see why")
    shutil.rmtree(out / "dedup-evidence")  # deleted since the build: the ledger no longer offers --why
    code, said = main(["ledger", str(out)]), capsys.readouterr().out
    assert code == 0 and "--why SOURCE/FILE/ROW" not in said and f"{out}/dedup-evidence/ is missing (deleted since the build?)" in said
