"""The contract a train loader's checkpoint state keeps (issue 34.3), in shards, stream, SFT and preference mode.

Issue 34 replaced ``torchdata``'s ``StatefulDataLoader`` (stream mode's loader until then) with a plain
``torch.utils.data.DataLoader`` and the project's own worker-state path (``StackDataLoader``,
``stacklm.datamodule.worker_state``). These tests pin what any train loader must keep, on the four
failure classes ``StatefulDataLoader``'s users hit:

a. a snapshot that aliases mutable state (the loader goes on and the saved state changes);
b. ``load_state_dict`` then ``state_dict`` before the first batch (must give the loaded state back);
c. prefetched batches dropped or repeated on resume;
d. a second resume in a row.

Each mode builds one set of runs per module (``runs``), the loaders the datamodule hands
Lightning, with 2 loader workers (prefetch 2 each: up to 4 batches in flight when a snapshot is
taken): an uninterrupted epoch; a loader snapshotted after ``K1`` batches that then runs on; a
fresh loader resumed from that snapshot, snapshotted again ``K2`` batches later; a fresh loader
resumed from the second snapshot; and a fresh loader that reads its state back right after loading
the first one. A snapshot is what Lightning writes: the datamodule's and the loader's state,
serialised by ``torch.save`` and loaded back with ``weights_only=True``; a resume loads the
datamodule's state before it builds the loader, as Lightning does. Batches are compared by their
``input_ids``, exactly.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from stacklm.datamodule import StackDataModule
from tests.helpers.datamodule import SEQ_LEN, stream_dm, stream_pipeline
from tests.helpers.resume import assert_same, assert_same_stream

WORKERS = 2
# Stream workers send their state every SNAPSHOT_EVERY batches: the first snapshot (K1) falls between
# two, so its resume replays from the last one; the second (K1 + K2) falls on one.
SNAPSHOT_EVERY, K1, K2 = 3, 5, 4
STREAM_TOKENS = 4_000  # 30 batches of 2 x 64 in stream mode; shards mode reads small_shards_dir (63)
SFT_CONVERSATIONS = 300  # SFT mode (rendered conversations, 2 x 128): most are too long for 128 and dropped, counted
PREFERENCE_PAIRS = 100  # preference mode: 2 pairs (chosen and rejected rows) a batch, 256 tokens a row


@dataclass
class Snapshot:
    """What a checkpoint holds at one point: the live state objects, a deep copy and the
    ``torch.save`` bytes taken at that moment."""

    live: dict[str, Any]  # {"datamodule": ..., "loader": ...} as the modules returned them
    copied: dict[str, Any]
    saved: bytes

    @classmethod
    def take(cls, dm, loader) -> Snapshot:
        live = {"datamodule": dm.state_dict(), "loader": loader.state_dict()}
        buf = io.BytesIO()
        torch.save(live, buf)
        return cls(live, copy.deepcopy(live), buf.getvalue())

    def loaded(self) -> dict[str, Any]:
        """The state as a resumed run reads it from the checkpoint file."""
        return torch.load(io.BytesIO(self.saved), weights_only=True)


@dataclass
class Runs:
    mode: str
    full: list[torch.Tensor]  # the uninterrupted epoch
    full_delivered: dict[str, Any]
    first: Snapshot  # after K1 batches
    first_at_second: Snapshot  # the same loader after K1 + K2 batches
    interrupted: list[torch.Tensor]  # the snapshotted loader's whole epoch (it ran on after the snapshots)
    resumed: list[torch.Tensor]  # a fresh loader resumed from ``first``, to the end
    resumed_len: int  # its len(): the epoch length Lightning reads after the resume
    second: Snapshot  # ``resumed`` after K2 of its batches
    resumed_again: list[torch.Tensor]  # a fresh loader resumed from ``second``, to the end
    resumed_again_delivered: dict[str, Any]
    read_back: dict[str, Any]  # a fresh loader's states right after loading ``first``, before any batch
    read_back_then_run: list[torch.Tensor]  # that loader's batches afterwards


def _datamodule(mode: str, tokenizer_dir, data_dir) -> StackDataModule:
    if mode in ("sft", "preference"):  # conversations (or preference pairs) rendered with role tokens (``data_dir``: their jsonl)
        pipeline = {"sources": [{"name": "chats", "kind": "local", "path": [str(data_dir)]}], "shuffle_buffer": 16,
                    "holdout_fraction": 0.0, **({"pack_buffer_docs": 8} if mode == "sft" else {})}
        return stream_dm(tokenizer_dir, mode=mode, pipeline=pipeline, seq_len=128 if mode == "sft" else 256, batch_size=2,
                         num_workers=WORKERS, val_batches=0, step_log=False, snapshot_every_n_steps=SNAPSHOT_EVERY)
    if mode == "stream":
        return stream_dm(tokenizer_dir, pipeline=stream_pipeline(total_tokens=STREAM_TOKENS), num_workers=WORKERS, val_batches=0,
                         step_log=False, snapshot_every_n_steps=SNAPSHOT_EVERY)
    return StackDataModule(mode="shards", tokenizer=str(tokenizer_dir), data_dir=str(data_dir), seq_len=SEQ_LEN, batch_size=2,
                           num_workers=WORKERS, val_batches=0, step_log=False)


def _loader(mode: str, tokenizer_dir, data_dir, state: dict[str, Any] | None = None):
    """A fresh datamodule's train loader, resumed from ``state`` in Lightning's order (the
    datamodule's state before the loader is built, then the loader's)."""
    dm = _datamodule(mode, tokenizer_dir, data_dir)
    dm.setup("fit")
    if state is not None:
        dm.load_state_dict(state["datamodule"])
    loader = dm.train_dataloader()
    if state is not None:
        loader.load_state_dict(state["loader"])
    assert loader.num_workers == WORKERS
    return dm, loader


def _ids(batch) -> torch.Tensor:
    """What a batch trains on: its input ids (a preference batch's chosen and rejected rows)."""
    if "input_ids" not in batch:
        return torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    return batch["input_ids"].clone()


@pytest.fixture(scope="module", params=["shards", "stream", "sft", "preference"])
def runs(request, tokenizer_dir, tmp_path_factory) -> Runs:
    mode = request.param
    data_dir = request.getfixturevalue("small_shards_dir") if mode == "shards" else None
    if mode == "sft":
        from tests.helpers.sft import make_conversations, write_jsonl

        data_dir = write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", [{"messages": m} for m in make_conversations(SFT_CONVERSATIONS)])
    if mode == "preference":
        from tests.helpers.sft import make_pairs, write_jsonl

        data_dir = write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", make_pairs(PREFERENCE_PAIRS))
    build = lambda state=None: _loader(mode, tokenizer_dir, data_dir, state)  # noqa: E731

    _, reference = build()
    full = [_ids(b) for b in reference]
    assert len(full) > K1 + K2 + 4, f"{mode}: an epoch of {len(full)} batches is too short for the stops"

    dm, loader = build()
    batches = iter(loader)
    interrupted = [_ids(next(batches)) for _ in range(K1)]
    first = Snapshot.take(dm, loader)
    interrupted += [_ids(next(batches)) for _ in range(K2)]
    first_at_second = Snapshot.take(dm, loader)
    interrupted += [_ids(b) for b in batches]  # the loader goes on: its workers fetch and snapshot more

    dm, loader = build(first.loaded())
    resumed_len = len(loader)
    batches = iter(loader)
    resumed = [_ids(next(batches)) for _ in range(K2)]
    second = Snapshot.take(dm, loader)
    resumed += [_ids(b) for b in batches]

    _, loader = build(second.loaded())
    resumed_again = [_ids(b) for b in loader]
    resumed_again_delivered = loader.delivered.stats()

    dm, loader = build(first.loaded())
    # the datamodule's state first: its stream record then reads a loader that has not started its workers
    read_back = {"datamodule": dm.state_dict(), "loader": loader.state_dict()}
    read_back_then_run = [_ids(b) for b in loader]

    return Runs(mode, full, reference.delivered.stats(), first, first_at_second, interrupted, resumed, resumed_len, second,
                resumed_again, resumed_again_delivered, read_back, read_back_then_run)


def test_a_snapshot_does_not_change_as_the_loader_goes_on(runs):
    """Failure class (a): a state that aliases the loader's mutable state (a buffer, a counter, a
    worker snapshot kept by reference) changes after it was taken, so a checkpoint written later
    (Lightning serialises it after the step, an async writer later still) holds a position past the
    one it claims. The replacement keeps its own worker snapshots and prefetch bookkeeping: each
    must be handed out as a copy. Checked on a first loader and on a resumed one, each after it
    ran to the end of the epoch; taking a snapshot does not change the stream either."""
    for name, snap in (("first snapshot", runs.first), ("second snapshot", runs.first_at_second),
                       ("snapshot of the resumed loader", runs.second)):
        assert_same(snap.live, snap.copied, f"{runs.mode}: {name}")
        assert_same(snap.live, snap.loaded(), f"{runs.mode}: {name} against its bytes at the time")
    assert_same_stream(runs.interrupted, runs.full, f"{runs.mode}: the snapshotted loader's epoch")


def test_b_a_loaded_state_reads_back_before_the_first_batch(runs):
    """Failure class (b): ``load_state_dict`` then ``state_dict`` before the first batch must give
    the loaded state back, not the fresh loader's. Lightning can checkpoint between the restore and
    the first step; a state that forgot the restored position makes that checkpoint resume from the
    wrong place (today's stream loader lost its rows consumed per logical stream and its step
    count here, and a resume of that checkpoint on another worker count was refused). The
    replacement holds a loaded state until its workers start: it must answer from it. The loader
    then still delivers the resumed stream."""
    saved = runs.first.loaded()
    assert_same(runs.read_back["loader"], saved["loader"], f"{runs.mode}: loader state read back")
    assert_same(runs.read_back["datamodule"], saved["datamodule"], f"{runs.mode}: datamodule state read back")
    assert_same_stream(runs.full[:K1] + runs.read_back_then_run, runs.full, f"{runs.mode}: read back, then resumed")


def test_c_prefetched_batches_are_neither_dropped_nor_repeated_on_resume(runs):
    """Failure class (c): with 2 workers each fetching 2 batches ahead, batches fetched but not yet
    handed out at the snapshot must be fetched again on resume (not lost with the old workers),
    and batches handed out must not come again, in the workers' round-robin order. The
    replacement tracks which worker's batch comes next and what each had in flight: the first
    ``K1`` batches plus the resumed loader's must be the uninterrupted epoch, batch for batch,
    and the resumed loader's length (Lightning's epoch length) the whole epoch's."""
    assert_same_stream(runs.full[:K1] + runs.resumed, runs.full, f"{runs.mode}: resumed after {K1}")
    assert runs.resumed_len == len(runs.full)


def test_d_a_second_resume_in_a_row_is_still_exact(runs):
    """Failure class (d): a resumed loader's own snapshot must be as good as a fresh one's. State
    restored but not carried into the next snapshot (a replay count, a worker's position, the
    batches yielded before the resume) shows only at the second resume. The first ``K1`` batches,
    ``K2`` of the first resumed loader and all of the second must be the uninterrupted epoch; the
    resumed loader's snapshot must equal the uninterrupted loader's at the same batch (positions,
    worker states, rows consumed, delivery counts); and the delivery counts (the data ledger's
    input) end at the uninterrupted run's."""
    assert_same(runs.second.loaded(), runs.first_at_second.loaded(), f"{runs.mode}: snapshot after {K1 + K2} batches")
    got = runs.full[:K1] + runs.resumed[:K2] + runs.resumed_again
    assert_same_stream(got, runs.full, f"{runs.mode}: resumed after {K1}, then after {K1 + K2}")
    got, want = runs.resumed_again_delivered, runs.full_delivered
    assert got["delivered"] == want["delivered"] and got["delivered"]["batches"] == len(runs.full)
    assert got["realized"] == want["realized"]


def test_every_worker_snapshots_on_its_last_batch_before_each_checkpoint_step():
    """The stream loader's snapshot rule (``worker_state.snapshot_due``): with ``W`` workers dealt
    round-robin (role ``b % W`` serves the loader's batch ``b``, from any pass offset) and a
    checkpoint every ``N`` loader steps, every role's last batch before each checkpoint carries a
    snapshot (a resume there replays nothing), and a role sends about one per ``N / W`` of its
    batches, not one per batch."""
    from stacklm.datamodule.worker_state import snapshot_due

    for workers in (1, 2, 3, 4):
        for every in (1, 2, 3, 5, 8):
            for offset in (0, 1, 7):
                steps = 12 * every * workers
                due = {(b % workers, b // workers + 1) for b in range(steps)
                       if snapshot_due(b // workers + 1, b % workers, workers, every, offset)}
                for m in range(offset + every - offset % every, offset + steps, every):  # the checkpoint steps in the pass
                    handed = m - offset
                    for role in range(min(workers, handed)):
                        last = (handed - 1 - role) // workers + 1  # the role's batches handed out by then
                        assert (role, last) in due, (workers, every, offset, m, role)
                per_role = len(due) / workers
                assert per_role <= steps / max(1, workers) and per_role <= -(-steps // every) + 1
