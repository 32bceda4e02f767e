"""The ledger adds up across datatrove tasks (issue 22 item 9): the manifest merge checks every
task's own ledger and each split's sum (read = dropped + holdout + buffered + kept, kept =
delivered + remainder) and refuses a planted inconsistency, naming the task and its log; a
task that read documents of its split and wrote nothing fails the run."""

from __future__ import annotations

import json

import pytest

from stacklm.data import ledger
from stacklm.data.pipeline import PipelineConfig
from stacklm.scale.datatrove_executors import describe_task, prebuild_executors
from stacklm.scale.supervise import run_chain
from stacklm.errors import LedgerError, TaskFailed

SEQ_LEN = 64


@pytest.fixture(scope="module")
def tok_dir(tokenizer_512, saved_tokenizer_dir):
    return saved_tokenizer_dir(tokenizer_512)


def small_config() -> PipelineConfig:
    return PipelineConfig.from_dict({
        "seq_len": SEQ_LEN, "batch_size": 2, "strategy": "best_fit", "seed": 0, "shuffle_buffer": 16, "pack_buffer_docs": 8,
        "holdout_fraction": 0.05, "tokenize_batch_docs": 16, "num_threads": 1,  # dedup on (exact + near): every stage runs
        "mix": {"name": "t", "total_tokens": 12_000, "entries": [
            {"name": "web", "kind": "synthetic", "weight": 0.7, "domain": "prose", "seed": 1, "num_docs": 300},
            {"name": "code", "kind": "synthetic", "weight": 0.3, "domain": "code", "seed": 4, "num_docs": 200},
        ]},
    })


def test_merge_checks_each_tasks_ledger_and_refuses_planted_inconsistencies(tmp_path, tok_dir, monkeypatch):
    monkeypatch.delenv(ledger.STRICT_ENV, raising=False)  # the default: the merge refuses
    out = tmp_path / "out"
    main, merge = prebuild_executors(small_config(), tok_dir, out, tasks=2, tokens_per_shard=SEQ_LEN * 8, workers=1)
    run_chain(main, describe=describe_task)  # signatures, decision, main: every task's counts, no manifest yet
    state = out / ".prebuild"
    counts = {p.name: p.read_bytes() for p in state.glob("*.done.json")}
    assert sorted(counts) == ["train-w000.done.json", "train-w001.done.json", "val-w000.done.json", "val-w001.done.json"]
    for name, raw in counts.items():  # each task's ledger adds up on its own, and it read something
        task = json.loads(raw)["ledger"]
        assert ledger.check(task) == [] and sum(u["docs"]["read"] for u in task.values()) > 0, name
    log1 = f"{tmp_path}/out.datatrove-logs/main/logs/task_00001.log"

    def plant(name: str, edit) -> None:
        doc = json.loads(counts[name])
        edit(doc)
        (state / name).write_text(json.dumps(doc))

    def merge_fails() -> str:
        with pytest.raises(TaskFailed) as e:
            run_chain(merge, describe=describe_task)
        assert not (out / "manifest.json").exists() and e.value.stage == "merge"
        return str(e.value)

    # one task counts a document read that no stage accounted for
    plant("train-w001.done.json", lambda d: d["ledger"]["web"]["docs"].__setitem__("read", d["ledger"]["web"]["docs"]["read"] + 1))
    msg = merge_fails()
    assert msg.startswith("datatrove stage 'merge' task 0 raised LedgerError: the token ledger does not add up"), msg
    assert f"split 'train' worker 1 (datatrove stage 'main' task 1, log {log1}): source 'web' docs: read " in msg
    assert "(off by +1)" in msg and "split 'train', summed over its 2 jobs: source 'web' docs" in msg

    # two tasks off in opposite directions: the split's sum adds up, each task's check still refuses
    plant("train-w000.done.json", lambda d: d["ledger"]["code"]["tokens"].__setitem__("kept", d["ledger"]["code"]["tokens"]["kept"] + 5))
    plant("train-w001.done.json", lambda d: d["ledger"]["code"]["tokens"].__setitem__("kept", d["ledger"]["code"]["tokens"]["kept"] - 5))
    merged = ledger.merge(json.loads((state / n).read_text())["ledger"] for n in ("train-w000.done.json", "train-w001.done.json"))
    assert ledger.check(merged) == []
    msg = merge_fails()
    assert "split 'train' worker 0 (datatrove stage 'main' task 0, " in msg and "split 'train' worker 1 (datatrove stage 'main' task 1, " in msg
    assert "summed over" not in msg
    (state / "train-w000.done.json").write_bytes(counts["train-w000.done.json"])

    # a task that read documents of its split and wrote no sequence fails the run, naming it
    plant("train-w001.done.json", lambda d: d.__setitem__("shards", []))
    msg = merge_fails()
    assert "raised PrebuildError: a job produced nothing where input existed: split 'train' worker 1 (datatrove stage 'main' task 1, " in msg
    assert f"log {log1}) read " in msg and "documents of its split and wrote no sequence (code: " in msg and "; web: " in msg

    # the real counts merge, and the manifests' ledgers add up across the tasks
    (state / "train-w001.done.json").write_bytes(counts["train-w001.done.json"])
    run_chain(merge, describe=describe_task)
    top = json.loads((out / "manifest.json").read_text())
    for split in ("train", "val"):
        entry = top["ledger"][split]
        assert entry["ok"] and entry["problems"] == []
        tasks = [json.loads(counts[f"{split}-w{w:03d}.done.json"])["ledger"] for w in range(2)]
        for src in ("web", "code"):  # the manifest's numbers are the tasks' sums
            assert entry["sources"][src]["docs"]["read"] == sum(t[src]["docs"]["read"] for t in tasks)


def test_strict_off_records_the_failed_identities_instead(tmp_path, tok_dir, monkeypatch):
    """STACKLM_LEDGER_STRICT=0: a loud warning, and the manifest records the failed identity."""
    from stacklm.prebuild.manifests import check_tasks

    good = {"split": "train", "worker": 0, "shards": [{"n_seq": 1}], "ledger": {"web": {
        "docs": {"read": 3, "dropped": {"filter/short": 1}, "holdout": 0, "buffered": {}, "kept": 2, "delivered": 2, "remainder": {}},
        "tokens": {"read": 9, "dropped": {}, "holdout": 0, "buffered": {}, "kept": 9, "delivered": 9, "remainder": {}}}}}
    check_tasks([good])  # adds up: nothing said
    bad = json.loads(json.dumps(good))
    bad["ledger"]["web"]["docs"]["kept"] = 1
    with pytest.raises(LedgerError, match=r"split 'train' job 0: source 'web' docs: read 3 != .* \(off by \+1\)"):
        check_tasks([bad])
    monkeypatch.setenv(ledger.STRICT_ENV, "0")
    with pytest.warns(RuntimeWarning, match="split 'train' job 0: source 'web' docs"):
        check_tasks([bad])
