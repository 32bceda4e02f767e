"""Elastic stream mode (``stacklm.datamodule.resume.logical``): a checkpoint resumes on another world
size, worker count or batch size, and the epoch delivers the same windows as an uninterrupted
run: the multiset of delivered rows (a row = one window, by the hash of its tokens) of the
interrupted run's head plus the resumed run's tail equals the uninterrupted run's, with no
row twice, and the delivery counts stay true.

The loader-level tests run in this process (one rank; workers and batch size change); the
``Trainer`` tests run ``tests/runners/elastic_stream_fit.py`` as its own program, with real DDP over
gloo for world 1 -> 1 (the checkpoint's own shape, 2 workers: the same batches), 1 -> 2 -> 1,
2 -> 3 and 3 -> 2.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from stacklm.errors import DataConfigError
from tests.helpers.lightning import run_program
from tests.helpers.lightning import row_ids
from tests.helpers.datamodule import stream_dm, stream_pipeline

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "runners" / "elastic_stream_fit.py"


def _loader(tokenizer_dir, state=None, loader_state=None, **kw):  # noqa: F811
    dm = stream_dm(tokenizer_dir, **kw)
    dm.setup("fit")
    if state is not None:
        dm.load_state_dict(state)
    loader = dm.train_dataloader()
    if loader_state is not None:
        loader.load_state_dict(loader_state)
    return dm, loader


def _pad_id(dm) -> int:
    return dm.tokenizer.pad_id


def _take(loader, n=None):
    out, it = [], iter(loader)
    for batch in it:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    return out


def _rows(batches) -> Counter:
    return Counter(r for b in batches for r in row_ids(b) if r is not None)


@pytest.mark.parametrize("L, k, before, after", [
    (4, 7, dict(num_workers=0, batch_size=2), dict(num_workers=2, batch_size=2)),
    (4, 7, dict(num_workers=2, batch_size=2), dict(num_workers=1, batch_size=4)),
    (4, 7, dict(num_workers=1, batch_size=4), dict(num_workers=0, batch_size=2)),
    (8, 1, dict(num_workers=0, batch_size=2), dict(num_workers=2, batch_size=4)),  # most logical streams never read yet
])
def test_a_loader_resumes_on_other_workers_and_batch_size(tokenizer_dir, L, k, before, after):  # noqa: F811
    """Save mid-epoch (not on a snapshot boundary, so the resume replays), resume on another
    shape: every row of the uninterrupted epoch exactly once, the delivery counts' totals equal
    the uninterrupted run's and an independent count of the delivered tokens."""
    kw = dict(logical_streams=L, snapshot_every_n_steps=3)
    _, full_loader = _loader(tokenizer_dir, **kw, **before)
    full = _take(full_loader)
    want = _rows(full)
    assert sum(want.values()) == sum(b["input_ids"].shape[0] for b in full)  # no padding in an uninterrupted epoch
    dm1, loader1 = _loader(tokenizer_dir, **kw, **before)
    head = _take(loader1, k)
    state, loader_state = dm1.state_dict(), loader1.state_dict()
    assert state["streams"]["logical_streams"] == L
    assert sum(state["streams"]["consumed"].values()) == k * before["batch_size"]
    del loader1  # its workers go
    dm2, loader2 = _loader(tokenizer_dir, state=state, loader_state=loader_state, **kw, **after)
    assert len(loader2) - k == len(loader2.dataset) - k  # Lightning's epoch length: the trained batches + the rest
    tail = _take(loader2)
    assert len(tail) == len(loader2) - k, "the loader yields exactly the planned batches"
    got = _rows(head) + _rows(tail)
    assert got == want, f"{sum((got - want).values())} rows extra, {sum((want - got).values())} missing"
    # delivery counts: the resumed counter continues the interrupted one and ends at the full run's totals
    full_stats, resumed = full_loader.delivered.stats(), loader2.delivered.stats()
    assert resumed["delivered"]["tokens"] == full_stats["delivered"]["tokens"]
    assert {s: r["docs"] for s, r in resumed["realized"].items()} == {s: r["docs"] for s, r in full_stats["realized"].items()}
    pad = _pad_id(dm2)
    independent = sum(int((b["input_ids"] != pad).sum()) for b in head + tail)
    assert resumed["delivered"]["tokens"] == independent
    assert resumed["delivered"]["batches"] == k + len(tail)
    # padding rows (the readers' rows left are uneven after a reshape) counted as an independent count finds them
    pad_rows = sum(r is None for b in head + tail for r in row_ids(b))
    assert resumed["delivered"]["padding_rows"] == pad_rows
    assert pad_rows == sum(b["input_ids"].shape[0] for b in head + tail) - sum(want.values())


def test_a_resume_refuses_another_number_of_logical_streams(tokenizer_dir):  # noqa: F811
    dm1, loader1 = _loader(tokenizer_dir, logical_streams=4)
    _take(loader1, 3)
    state = dm1.state_dict()
    dm2 = stream_dm(tokenizer_dir, logical_streams=2)
    dm2.setup("fit")
    with pytest.raises(DataConfigError, match="logical_streams=4"):
        dm2.load_state_dict(state)


def test_a_checkpoint_without_logical_streams_is_refused(tokenizer_dir):  # noqa: F811
    """A stream checkpoint of an older stacklm (per-worker positions) cannot be re-dealt: refused, not restarted."""
    dm1, loader1 = _loader(tokenizer_dir)
    _take(loader1, 2)
    state = dm1.state_dict()
    del state["streams"]
    dm2 = stream_dm(tokenizer_dir)
    dm2.setup("fit")
    with pytest.raises(DataConfigError, match="older stacklm"):
        dm2.load_state_dict(state)


def test_a_loader_state_of_the_old_loader_is_refused_naming_it(tokenizer_dir):  # noqa: F811
    """A checkpoint whose loader state is torchdata's ``StatefulDataLoader``'s (before issue 34)
    is refused in one line, on the checkpoint's shape (the loader's own state) and on another
    (the replay of each old worker), not read as a fresh start."""
    import copy

    from stacklm.errors import ResumeRefused

    dm1, loader1 = _loader(tokenizer_dir, logical_streams=2)
    _take(loader1, 3)
    state, loader_state = dm1.state_dict(), loader1.state_dict()
    assert loader_state["per_rank"][0]["loader"]["handed"] == 3
    old = copy.deepcopy(loader_state)
    old["per_rank"][0]["loader"] = {"_snapshot": {"_snapshot_step": 0}, "_steps_since_snapshot": 3}
    for shape in ({}, {"num_workers": 2}):
        dm2, loader2 = _loader(tokenizer_dir, state=state, logical_streams=2, **shape)
        with pytest.raises(ResumeRefused, match="StatefulDataLoader's .* start a new run"):
            loader2.load_state_dict(old)


def test_more_readers_than_logical_streams_is_a_warning(tokenizer_dir):  # noqa: F811
    """A resume with more readers than logical streams leaves some readers padding-only: loud."""
    dm1, loader1 = _loader(tokenizer_dir, logical_streams=2)
    _take(loader1, 2)
    state = dm1.state_dict()
    with pytest.warns(RuntimeWarning, match=r"3 readers .* 2 logical streams: 1 reader\(s\) hold no stream"):
        _loader(tokenizer_dir, state=state, num_workers=3)


def test_logical_streams_default_to_the_first_runs_readers(tokenizer_dir):  # noqa: F811
    dm, loader = _loader(tokenizer_dir, num_workers=2)
    _take(loader, 2)
    assert dm.state_dict()["streams"]["logical_streams"] == 2


# the Trainer runs' corpus: the loader tests' mix, cut to a third of its tokens (every run trains
# a third of the steps; the smallest shape, 3 ranks x batch 2 on 6 logical streams, still gets 10 steps)
FIT_TOKENS = 4_000


def _fit(tokenizer_dir, out: Path, *, devices=1, workers=1, batch=2, save_at=(), go_on=False, resume=None, L=4, epochs=2) -> dict:  # noqa: F811
    pipeline = out.with_name("pipeline.json")
    if not pipeline.exists():
        pipeline.write_text(json.dumps(stream_pipeline(total_tokens=FIT_TOKENS)))
    args = ["--tokenizer", str(tokenizer_dir), "--out", str(out), "--devices", str(devices), "--workers", str(workers),
            "--batch-size", str(batch), "--logical-streams", str(L), "--epochs", str(epochs), "--pipeline", str(pipeline)]
    if save_at:
        args += ["--save-at", *map(str, save_at)]
    if go_on:  # save and train on: the uninterrupted run is also the interrupted run's head
        args.append("--go-on")
    if resume:
        args += ["--resume", str(resume)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = run_program([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]
    stats = [json.loads((out / f"stats{r}.json").read_text()) for r in range(devices)]
    seen = [json.loads((out / f"seen{r}.json").read_text()) for r in range(devices)]
    return {"ranks": ranks, "stats": stats, "seen": seen, "tokens": sum(s["tokens"] for s in stats), "batches": sum(s["batches"] for s in stats)}


def _delivered(run: dict, epoch: int, *, before: int | None = None, after: int | None = None) -> tuple[Counter, dict[int, int]]:
    """Rows of ``epoch`` trained at global steps ``< before`` / ``>= after``, and each step's rank count."""
    rows: Counter = Counter()
    steps: dict[int, int] = {}
    for records in run["ranks"]:
        for e, step, ids in records:
            if e == epoch and (before is None or step < before) and (after is None or step >= after):
                rows.update(r for r in ids if r is not None)
                steps[step] = steps.get(step, 0) + 1
    return rows, steps


def _steps(run: dict, epoch: int) -> list[tuple[int, list]]:
    """``(global step, rows)`` of every step of ``epoch`` of a one-rank run, in order."""
    (records,) = run["ranks"]
    return [(step, ids) for e, step, ids in records if e == epoch]


@pytest.mark.slow
def test_stream_resume_through_a_trainer_on_another_world_size(tokenizer_dir, tmp_path):  # noqa: F811
    """Resume through Lightning's own loop (``trainer.fit(ckpt_path=...)``) inside the first of
    two epochs, real DDP over gloo (forked ranks), 2 loader workers:

    - on the checkpoint's own shape (one process, 2 workers): the resumed fit trains the very
      batches the uninterrupted one did from the checkpoint on, step for step, both epochs
      (the loader's own worker state: snapshots, replay, the round-robin order);
    - world 1 -> 2 -> 1: the checkpoint at step 7 resumed on 2 ranks (2 workers each), whose
      own checkpoint at step 12 is resumed on one process again (no workers, batch 2 -> 4). The
      rows of the three pieces are the one-process epoch's, every rank trains every step, the
      second epoch (a whole one at the last shape) delivers the reference's second epoch, and
      the delivery counts add up."""
    # the reference (one process, 2 workers, batch 2) is also the first run: it saves at step 7
    # and trains on, so its head is the rows before the checkpoint (one fit fewer)
    reference = _fit(tokenizer_dir, tmp_path / "ref", workers=2, save_at=[7], go_on=True)
    want = [_delivered(reference, e)[0] for e in (0, 1)]
    assert sum(want[0].values()) + sum(want[1].values()) == 2 * reference["batches"]  # one rank, batch 2, no padding

    native = _fit(tokenizer_dir, tmp_path / "native", workers=2, resume=tmp_path / "ref" / "step7.ckpt")
    for epoch in (0, 1):
        got, ref = _steps(native, epoch), _steps(reference, epoch)
        assert got == [s for s in ref if s[0] >= 7], f"epoch {epoch}: the resumed fit's batches differ"
    assert native["tokens"] == reference["tokens"] and native["batches"] == reference["batches"]

    run2 = _fit(tokenizer_dir, tmp_path / "to2", devices=2, workers=2, resume=tmp_path / "ref" / "step7.ckpt", save_at=[12],
                go_on=True)
    run3 = _fit(tokenizer_dir, tmp_path / "to1", devices=1, workers=0, batch=4, resume=tmp_path / "to2" / "step12.ckpt")
    head, _ = _delivered(reference, 0, before=7)
    middle, steps2 = _delivered(run2, 0, after=7, before=12)
    tail, steps3 = _delivered(run3, 0, after=12)
    assert sorted(steps2) == list(range(7, 12)) and all(n == 2 for n in steps2.values()), "every rank trains every step"
    assert steps3 and all(n == 1 for n in steps3.values())
    for name, got in (("1 -> 2", head + _delivered(run2, 0, after=7)[0]), ("1 -> 2 -> 1", head + middle + tail)):
        assert got == want[0], f"{name}: {sum((got - want[0]).values())} rows extra, {sum((want[0] - got).values())} missing"
    def padding(run, before=None):  # padding rows a run trained (before global step ``before`` of epoch 0), over the ranks
        return sum(r is None for records in run["ranks"] for e, step, ids in records for r in ids
                   if before is None or (e == 0 and step < before))

    for name, run, devices, pads in (("1 -> 2", run2, 2, padding(run2)),
                                     ("1 -> 2 -> 1", run3, 1, padding(run2, before=12) + padding(run3))):
        second_epoch, steps = _delivered(run, 1)
        assert all(n == devices for n in steps.values())
        assert second_epoch == want[1], f"{name}: the second epoch at the new shape differs"
        # the delivery counts at the end (summed over the ranks) are the reference's, padding counted
        assert run["tokens"] == reference["tokens"], name
        assert sum(s["padding_rows"] for s in run["stats"]) == pads, name


def _seen_tokens(run: dict, *, before: int | None = None, after: int | None = None) -> int:
    """Non-padding tokens of the batches the model trained on (counted by the fit script from
    ``input_ids``), summed over the ranks, steps ``< before`` / ``>= after``."""
    return sum(n for records in run["seen"] for _, step, n in records
               if (before is None or step < before) and (after is None or step >= after))


@pytest.mark.slow
@pytest.mark.parametrize("L, first, second, k", [
    # (2 x 2 = 4 readers -> 3 readers with L = 6, every new reader holding 2 logical streams, passed
    # too: 134 s on 2 cores; the two cases below cover both directions and a shape that does not divide L)
    # 3 readers -> 2 x 2 = 4 readers, L = 6: two readers hold 2 streams, two hold 1 (they pad at the tail)
    (6, dict(devices=3, workers=1, batch=2), dict(devices=2, workers=2, batch=2), 3),
    # 2 x 2 = 4 readers -> 3 readers, L = 4: 3 does not divide 4, reader 0 holds streams 0 and 3, readers 1, 2 one each
    (4, dict(devices=2, workers=2, batch=2), dict(devices=3, workers=1, batch=2), 4),
], ids=["3to2-L6", "2to3-L4"])
def test_stream_resume_through_a_trainer_on_world_2_and_3(tokenizer_dir, tmp_path, L, first, second, k):  # noqa: F811
    """World 2 <-> 3 mid-epoch through a real ``Trainer`` with gloo DDP (one epoch, to keep it
    short). The design (``logical.py``): a reader takes the logical streams ``l % P == p``, so
    when ``P`` does not divide ``L`` some readers hold fewer streams; each reader yields the
    same batch count (the most rows left over the readers / batch), the readers with fewer rows
    pad, no warning (that is for a reader with none). So: the head's rows plus the tail's are
    the uninterrupted epoch's (on the first shape), none twice; every rank trains every step; the resumed epoch's
    steps are the trained ones plus ``batches_per_reader`` of the rows left at the new shape;
    the padding rows and the delivered tokens (summed over the ranks) equal an independent
    count of the batches the model saw, and the tokens equal the uninterrupted epoch's."""
    import torch

    from stacklm.datamodule.resume.logical import batches_per_reader

    # the uninterrupted run is on the first shape: the quota Q (windows per logical stream) is
    # fixed by the first run's shape (its per-rank batch count x world x batch / L), so a
    # one-process run of the same data may owe each stream a window more
    # it saves at step k and trains on: it is also the interrupted run, whose head is its steps < k
    reference = _fit(tokenizer_dir, tmp_path / "ref", save_at=[k], go_on=True, L=L, epochs=1, **first)
    want, ref_steps = _delivered(reference, 0)
    per_stream = sum(want.values()) // L
    assert sum(want.values()) == L * per_stream and max(want.values()) == 1  # every stream its quota, no window twice
    # readers holding fewer logical streams pad (L=6 on 4 readers: two readers hold one stream each)
    ref_padding = sum(r is None for records in reference["ranks"] for _, _, ids in records for r in ids)
    assert ref_padding == 2 * first["devices"] * len(ref_steps) - sum(want.values()) == sum(s["padding_rows"] for s in reference["stats"])
    assert reference["tokens"] == _seen_tokens(reference)
    run1 = reference
    run2 = _fit(tokenizer_dir, tmp_path / "b", resume=tmp_path / "ref" / f"step{k}.ckpt", L=L, epochs=1, **second)
    head, head_steps = _delivered(run1, 0, before=k)
    tail, steps = _delivered(run2, 0, after=k)
    assert sorted(head_steps) == list(range(k)) and all(n == first["devices"] for n in head_steps.values())
    assert all(n == second["devices"] for n in steps.values()), "every rank trains every step"
    got = head + tail
    assert got == want, f"{sum((got - want).values())} rows extra, {sum((want - got).values())} missing"
    assert max(got.values()) == 1  # no window twice
    # the step count: the rows left (per logical stream, as the checkpoint counts them) dealt to the new readers
    consumed = Counter()
    for records in run1["ranks"]:
        for _, step, ids in records:
            if step < k:
                consumed[None] += sum(r is not None for r in ids)
    assert consumed[None] + sum(r is None for records in run1["ranks"] for _, s, ids in records if s < k for r in ids) \
        == 2 * first["devices"] * k
    record = torch.load(tmp_path / "ref" / f"step{k}.ckpt", weights_only=False)["StackDataModule"]["streams"]
    left = {int(l): int(record["quota"]) - int(n) for l, n in record["consumed"].items()}
    assert int(record["quota"]) == per_stream and sum(left.values()) == sum(want.values()) - consumed[None]
    readers = second["devices"] * max(1, second["workers"])
    assert len(steps) == batches_per_reader(left, L, readers, second["batch"]) * max(1, second["workers"])
    assert sorted(steps) == list(range(k, k + len(steps)))
    # padding and tokens: the counters (summed over the ranks) against an independent count
    padding = sum(r is None for records in run2["ranks"] for _, _, ids in records for r in ids)
    assert sum(s["padding_rows"] for s in run2["stats"]) == padding
    assert padding == 2 * second["devices"] * len(steps) - sum(tail.values())
    assert run2["tokens"] == _seen_tokens(run1, before=k) + _seen_tokens(run2, after=k) == reference["tokens"]
    assert run2["batches"] == first["devices"] * k + second["devices"] * len(steps)
