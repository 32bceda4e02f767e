"""PackedMemmapDataset (batch contract, indexing, validation) and the elastic sampler."""

from __future__ import annotations

import itertools
import pickle
import re

import numpy as np
import pytest
import torch
from torchdata.nodes import Loader, Mapper

from stacklm.corpus import iter_default_corpus
from stacklm.data.storage import manifest as mf
from stacklm.data.storage.dataset import PackedMemmapDataset, derive_batch, verify_shard_set
from stacklm.datamodule.resume.sampler import ElasticBatchNode, ElasticSampler
from stacklm.data.packing.pack import collate, pack_best_fit, pack_greedy, window_to_example
from stacklm.data.storage.shards import token_dtype, tokens_path, write_shard
from stacklm.errors import DataError
from tests.helpers.prebuild import write_shard_set
from tests.helpers.resume import check_save_load_state

SEQ_LEN = 64


@pytest.fixture(scope="module")
def tok(tokenizer_2048):
    return tokenizer_2048


@pytest.fixture(scope="module")
def windows(tok):
    """Real text packed both ways: full windows, cut documents, padding."""
    texts = list(iter_default_corpus(400_000))[:300]
    ids = tok.encode_batch(texts)
    docs = [{"ids": np.asarray(x, dtype=np.int32), "source": "s", "doc_id": str(i)} for i, x in enumerate(ids) if x]
    specials = (tok.bos_id, tok.eos_id, tok.pad_id)
    best = np.stack(list(pack_best_fit(docs, SEQ_LEN, *specials, buffer_docs=16)))
    greedy = np.stack(list(pack_greedy(docs[:50], SEQ_LEN, *specials)))
    return {"best_fit": best, "greedy": greedy}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.long, k
        assert torch.equal(a[k], b[k]), k


def _one_buffer(batch: dict) -> None:
    """Like collate's: one buffer per batch, so a loader worker ships one shared-memory block."""
    assert len({t.untyped_storage().data_ptr() for t in batch.values()}) == 1
    assert all(t.is_contiguous() for t in batch.values())


# ---------------------------------------------------------------------------------------
# Batch contract: shards derive exactly what the stream's collate derives
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["best_fit", "greedy"])
def test_derive_batch_equals_collate_on_packed_text(tok, windows, strategy):
    w = windows[strategy]
    stored = w.astype(token_dtype(tok.vocab_size))  # what a shard holds
    specials = (tok.bos_id, tok.eos_id, tok.pad_id)
    for lo in range(0, len(w), 7):
        got = derive_batch(stored[lo : lo + 7], *specials)
        _same(got, collate(w[lo : lo + 7], *specials))
        _one_buffer(got)


def test_derive_batch_equals_collate_on_adversarial_rows():
    """Specials everywhere: adjacent bos/eos, pad runs mid-row, pad at column 0, eos last."""
    rng = np.random.default_rng(0)
    bos, eos, pad = 13, 14, 15
    for dtype in (np.uint16, np.uint32, np.int32):
        for _ in range(300):
            B, L = int(rng.integers(1, 5)), int(rng.integers(2, 14))
            rows = rng.integers(10, 16, size=(B, L)).astype(dtype)
            _same(derive_batch(rows, bos, eos, pad), collate(rows.astype(np.int64), bos, eos, pad))


# ---------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------
@pytest.fixture()
def shard_set(tmp_path, tok, windows):
    w = windows["best_fit"][:11]
    parts = [w[:3], w[3:4], w[4:9], w[9:11]]  # unequal shard sizes
    write_shard_set(tmp_path / "train", tok, parts)
    return tmp_path, w


def test_rows_and_items_match_the_windows(tok, shard_set):
    root, w = shard_set
    ds = PackedMemmapDataset(root, tokenizer=tok)  # the top dir resolves to train/
    specials = (tok.bos_id, tok.eos_id, tok.pad_id)
    assert len(ds) == 11 and ds.seq_len == SEQ_LEN and ds.num_tokens == 11 * SEQ_LEN
    shard, local = ds.locate(np.arange(11))
    assert shard.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3]
    assert local.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1]
    for i in range(11):
        _same(ds[i], window_to_example(w[i], *specials))
    _same(ds[[10, 0, 4, 4]], collate(w[[10, 0, 4, 4]], *specials))  # across shards, repeats
    _same(ds[2:5], collate(w[2:5], *specials))
    _same(ds[-1], window_to_example(w[-1], *specials))
    with pytest.raises(IndexError):
        ds[11]
    assert ds.get_batch(np.array([3, 9]))["input_ids"].shape == (2, SEQ_LEN - 1)


def test_pickling_carries_no_data(shard_set):
    root, _ = shard_set
    ds = PackedMemmapDataset(root / "train")
    ds[0]  # opens the memmaps
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000
    again = pickle.loads(blob)
    _same(again[5], ds[5])


def test_distributed_sampler_with_dataloader_workers(tok, shard_set):
    root, w = shard_set
    ds = PackedMemmapDataset(root)
    specials = (tok.bos_id, tok.eos_id, tok.pad_id)
    seen = []
    for rank in range(2):
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        order = list(sampler)
        loader = torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2)
        got = list(loader)
        for k, batch in enumerate(got):
            _same(batch, collate(w[order[2 * k : 2 * k + 2]], *specials))
        seen += order
    assert sorted(set(seen)) == list(range(11))


class _Batches(torch.utils.data.Dataset):
    def __init__(self, ds, batches) -> None:
        self.ds, self.batches = ds, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        return self.ds.get_batch(self.batches[i])


def test_bad_shard_sets_give_clear_errors(tmp_path, tok, windows):
    from stacklm.tokenizer.bpe import StackTokenizer

    w = windows["best_fit"][:40]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is empty.*stacklm prebuild"):
        PackedMemmapDataset(tmp_path / "empty")

    def fresh(name, parts=(w[:20], w[20:])):
        d = tmp_path / name / "train"
        write_shard_set(d, tok, list(parts))
        return d

    d = fresh("nomanifest")
    (d / "manifest.json").unlink()
    with pytest.raises(DataError, match="manifest.json is missing"):
        PackedMemmapDataset(d)

    d = fresh("truncated")
    with open(tokens_path(d, "shard_00001"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"shard_00001.tokens.bin is 100 bytes .* truncated"):
        PackedMemmapDataset(d)

    d = fresh("nometa")
    (d / "shard_00000.meta.bin").unlink()
    with pytest.raises(DataError, match="shard_00000.meta.bin is missing"):
        PackedMemmapDataset(d)

    other = StackTokenizer([b"ab"], vocab_size=tok.vocab_size)
    with pytest.raises(DataError, match="tokenizer .* ids would mean other tokens"):
        PackedMemmapDataset(fresh("othertok"), tokenizer=other)
    with pytest.raises(TypeError, match=r"pass the loaded tokenizer"):  # data/ never loads a tokenizer itself
        PackedMemmapDataset(fresh("bypath"), tokenizer=tmp_path)

    d = fresh("stray")
    write_shard(d, 7, w[:2], token_dtype(tok.vocab_size))
    with pytest.raises(DataError, match="does not list.*shard_00007"):
        PackedMemmapDataset(d)

    bad = w.copy()
    bad[33, 5] = tok.vocab_size + 3  # fits uint16, not the vocab
    d = fresh("overvocab", (bad[:20], bad[20:]))
    with pytest.raises(DataError, match=r"shard_00001.tokens.bin: row 13 holds token id 2051 >= vocab_size 2048"):
        PackedMemmapDataset(d)
    unchecked = PackedMemmapDataset(d, sample_rows=0)  # the sample check skipped on open
    unchecked.get_batch([0, 1, 32])  # rows without the bad id are served
    with pytest.raises(DataError, match=r"shard_00001.tokens.bin: row 13 holds token id 2051 >= vocab_size 2048"):
        unchecked.get_batch([4, 33, 2])  # every batch is checked before it reaches the model
    loader = torch.utils.data.DataLoader(_Batches(unchecked, [[0, 1], [33, 3]]), batch_size=None, num_workers=1)
    with pytest.raises(DataError, match=r"shard_00001.tokens.bin: row 13"):  # the same from a loader worker
        list(loader)
    with pytest.raises(DataError, match=r"shard_00001.tokens.bin: row 13 holds token id 2051"):
        verify_shard_set(d, progress=False)

    d = fresh("wrongbos")
    m = mf.read_manifest(d)
    m["bos_id"] = 7  # an ordinary byte id: never a document start
    mf.write_manifest(d, m)
    with pytest.raises(DataError, match="bos_id 7 occurs in none"):
        PackedMemmapDataset(d)

    d = fresh("edited")
    raw = bytearray(tokens_path(d, "shard_00000").read_bytes())
    raw[10] ^= 1
    tokens_path(d, "shard_00000").write_bytes(bytes(raw))
    PackedMemmapDataset(d)  # size and sampled ids are fine (opening does not hash)...
    with pytest.raises(DataError, match="content hash"):
        verify_shard_set(d, progress=False)  # ...the full check is not
    report = verify_shard_set(fresh("good"), tokenizer=tok, progress=False)
    assert report["train"]["rows"] == 40 and report["train"]["max_id"] < tok.vocab_size


def _flip_inside_vocab(path, tok, at: int) -> None:
    """Flip the lowest bit of the ``at``-th token id of a shard file: an even id becomes the next
    odd one and vice versa, so with an even vocab size it stays inside the vocabulary."""
    raw = bytearray(path.read_bytes())
    assert tok.vocab_size % 2 == 0 and token_dtype(tok.vocab_size).itemsize == 2
    raw[2 * at] ^= 1  # little-endian: the low byte comes first
    path.write_bytes(bytes(raw))


def test_content_hash_is_checked_where_rows_are_first_read(tmp_path, tok, windows):
    """Bit rot inside the vocabulary, a zeroed or garbled hash in the manifest: each is an error
    naming the shard, the manifest and `stacklm verify` at the first read of that shard (the
    main process and each loader worker for itself); untouched data and the opt-out read on."""
    w = windows["best_fit"][:40]
    specials = (tok.bos_id, tok.eos_id, tok.pad_id)

    def fresh(name):
        d = tmp_path / name / "train"
        write_shard_set(d, tok, [w[:20], w[20:]])
        return d

    good = PackedMemmapDataset(fresh("good"))
    _same(good.get_batch(np.arange(40)), collate(w, *specials))  # every shard hashed, every row served
    assert good._all_verified_in is not None

    d = fresh("flipped")
    _flip_inside_vocab(tokens_path(d, "shard_00001"), tok, at=5 * SEQ_LEN + 7)  # row 25 of the split
    rotten = PackedMemmapDataset(d)  # opening checks sizes and a sample of ids: all fine
    _same(rotten.get_batch([0, 19]), collate(w[[0, 19]], *specials))  # shard 0 is intact: served
    msg = (rf"{re.escape(str(tokens_path(d, 'shard_00001')))}: content hash [0-9a-f]{{16}} differs from [0-9a-f]{{16}} "
           rf"listed for shard 'shard_00001' in {re.escape(str(d / 'manifest.json'))}: .*`stacklm verify {re.escape(str(d))}`")
    for _ in range(2):  # and again: a failed check is not remembered as passed
        with pytest.raises(DataError, match=msg):
            rotten.get_batch([3, 21])
    loader = torch.utils.data.DataLoader(_Batches(PackedMemmapDataset(d), [[0, 1], [30, 2]]), batch_size=None, num_workers=1)
    with pytest.raises(DataError, match="shard_00001.tokens.bin: content hash"):  # from a loader worker
        list(loader)
    quiet = PackedMemmapDataset(d, verify_content=False)  # the opt-out reads it without a word
    flipped = quiet.rows(np.arange(40))
    assert (flipped != w).sum() == 1 and flipped.max() < tok.vocab_size
    _same(quiet.get_batch(np.arange(40)), collate(flipped, *specials))

    # Checked per process: the main process has checked both shards, then one rots; a loader
    # worker (forked, so it inherits the main process's attributes) checks for itself.
    d = fresh("rots_later")
    ds = PackedMemmapDataset(d)
    ds.get_batch(np.arange(40))
    _flip_inside_vocab(tokens_path(d, "shard_00000"), tok, at=3)
    ds.get_batch([0])  # this process checked shard 0 already: not hashed again
    loader = torch.utils.data.DataLoader(_Batches(ds, [[0]]), batch_size=None, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(DataError, match="shard_00000.tokens.bin: content hash"):
        list(loader)

    for label, value in (("zeroed", "0" * 16), ("garbled", "not-a-hash"), ("empty", ""), ("missing", None)):
        d = fresh(label)
        m = mf.read_manifest(d)
        if value is None:
            del m["shards"][1]["xxh64"]
        else:
            m["shards"][1]["xxh64"] = value
        mf.write_manifest(d, m)
        ds = PackedMemmapDataset(d)
        ds.get_batch([0, 1])  # shard 0's hash is intact
        if label == "zeroed":  # well formed, just wrong
            match = rf"differs from 0{{16}} listed for shard 'shard_00001' in {re.escape(str(d / 'manifest.json'))}"
        else:
            match = rf"{re.escape(str(d / 'manifest.json'))}: shard 'shard_00001' lists content hash \(field 'xxh64'\) .*not 16 hex digits"
        with pytest.raises(DataError, match=match + ".*stacklm verify"):  # the loader sends its user to `verify`
            ds.get_batch([33])
        with pytest.raises(DataError, match=match) as refused:
            verify_shard_set(d, progress=False)  # `verify` refuses the same manifest the same way ...
        assert "stacklm verify" not in str(refused.value)  # ... without telling its user to run itself
        PackedMemmapDataset(d, verify_content=False).get_batch([33])
    with pytest.raises(TypeError, match="verify_content must be True or False"):
        PackedMemmapDataset(fresh("typed"), verify_content="no")


# ---------------------------------------------------------------------------------------
# Elastic sampler
# ---------------------------------------------------------------------------------------
N = 23  # samples: prime, so no step size divides an epoch


def _expected(positions: int, seed: int) -> list[int]:
    """The global order: epoch permutations concatenated."""
    ref = ElasticSampler(N, 1, seed=seed, rank=0, world_size=1)
    return ref.positions_to_indices(0, positions).tolist()


def _run_segment(state, world, workers, batch, steps, seed):
    """``steps`` global steps with ``world`` ranks x ``workers`` loader workers; returns the
    global consumption order and the checkpoint state after them."""
    per_rank = []
    for rank in range(world):
        iters = []
        for k in range(workers):
            s = ElasticSampler(N, batch, seed=seed, rank=rank, world_size=world)
            if state is not None:
                s.load_state_dict(state)
            iters.append((s, s.batches(k, workers)))
        # DataLoader order: step t comes from worker t % workers
        got = [next(iters[t % workers][1]).tolist() for t in range(steps)]
        last = iters[(steps - 1) % workers][0]
        per_rank.append((got, last.state_dict()))
    states = {str(st) for _, st in per_rank}
    assert len(states) == 1, "every rank must checkpoint the same state"
    order = [i for t in range(steps) for got, _ in per_rank for i in got[t]]
    return order, per_rank[0][1]


SHAPES = [(w, k, b) for w, k, b in itertools.product((1, 2, 3), (1, 2, 3), (1, 2, 5))]


@pytest.mark.parametrize("first", SHAPES, ids=[f"W{w}K{k}B{b}" for w, k, b in SHAPES])
def test_elastic_resume_grid(first):
    """Change world size, worker count and batch size at every resume: the concatenated
    consumption is exactly the global order (nothing dropped, nothing repeated)."""
    seed = 11
    i = SHAPES.index(first)
    segments = [first, SHAPES[(i + 7) % len(SHAPES)], SHAPES[(i + 13) % len(SHAPES)]]
    state, order = None, []
    for step_count, (w, k, b) in zip((4, 3, 5), segments):
        got, state = _run_segment(state, w, k, b, step_count, seed)
        order += got
    assert order == _expected(len(order), seed)
    assert state["epoch"] * N + state["consumed"] == len(order)
    for e in range(len(order) // N):  # each whole epoch is a permutation
        assert sorted(order[e * N : (e + 1) * N]) == list(range(N))


def test_single_pass_covers_the_epoch_once():
    for world, batch in itertools.product((1, 2, 4), (1, 3, 5)):
        got = []
        lengths = []
        for rank in range(world):
            s = ElasticSampler(N, batch, seed=2, rank=rank, world_size=world, loop=False)
            lengths.append(len(s))
            mine = list(s)
            assert len(mine) == lengths[-1]
            got += mine
            assert s.state_dict()["epoch"] == 1 and s.state_dict()["consumed"] == 0
        assert sorted(got) == list(range(N))
        dropping = [ElasticSampler(N, batch, seed=2, rank=r, world_size=world, loop=False, drop_last=True) for r in range(world)]
        kept = [i for s in dropping for i in s]
        assert len(set(kept)) == len(kept) == N - N % (world * batch)
        assert all(s.dropped_tail == N % (world * batch) for s in dropping)


def test_epochs_reshuffle_and_set_epoch_keeps_a_resume():
    s = ElasticSampler(N, 4, seed=5, rank=0, world_size=1, loop=False)
    assert not np.array_equal(s.permutation(0), s.permutation(1))
    it = s.batches()
    first = [next(it).tolist() for _ in range(2)]
    state = s.state_dict()
    assert state == {"seed": 5, "epoch": 0, "consumed": 8, "num_samples": N}
    resumed = ElasticSampler(N, 4, seed=5, rank=0, world_size=1, loop=False)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # what Lightning calls when it resumes mid-epoch: no reset
    rest = list(resumed)
    assert first[0] + first[1] + rest == s.permutation(0).tolist()
    resumed.set_epoch(3)
    assert list(resumed) == s.permutation(3).tolist()
    with pytest.raises(TypeError, match="endless"):
        len(ElasticSampler(N, 4, rank=0, world_size=1))
    with pytest.raises(ValueError, match="changed since the checkpoint"):
        ElasticSampler(N + 1, 4, seed=5, rank=0, world_size=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        ElasticSampler(N, 4, seed=6, rank=0, world_size=1).load_state_dict(state)


def test_torch_dataloader_and_state_after_prefetch(shard_set, tok):
    root, w = shard_set
    ds = PackedMemmapDataset(root)
    sampler = ElasticSampler(ds, 2, seed=1, rank=0, world_size=1)
    loader = iter(torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2))
    ref = ElasticSampler(len(ds), 2, seed=1, rank=0, world_size=1).batches()
    specials = (tok.bos_id, tok.eos_id, tok.pad_id)
    for _ in range(4):
        _same(next(loader), collate(w[next(ref)], *specials))
    # the workers prefetched ahead of the consumer: checkpoint what was consumed
    state = sampler.state_after(4)
    assert state["epoch"] * len(ds) + state["consumed"] == 8
    again = ElasticSampler(ds, 2, seed=1, rank=0, world_size=1)
    again.load_state_dict(state)
    _same(ds.get_batch(next(again.batches())), collate(w[next(ref)], *specials))


def test_torchdata_nodes_resume(shard_set):
    root, _ = shard_set
    ds = PackedMemmapDataset(root)

    def loader():
        return Loader(Mapper(ElasticBatchNode(ElasticSampler(ds, 3, seed=4, rank=1, world_size=2)), ds.get_batch))

    expected = check_save_load_state(loader, [4], limit=9)  # the sampler loops: the first 9 batches
    assert all(v.dtype == torch.long for batch in expected for v in batch.values())  # and so are the resumed ones
