"""Lean batch planes (``stacklm.data.contract.lean_batch``/``derive_planes``) and the masks built
from the loader's padded ``cu_seqlens``: the derived planes equal today's four exactly, on real
packed text (shards and stream, greedy and best_fit, cut documents, padding rows) and on
adversarial rows; no helper needs a host sync (they run on ``meta`` tensors, where ``.item()``
and data-dependent shapes raise)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stacklm.corpus import iter_default_corpus
from stacklm.data.contract import (
    BATCH_KEYS, IGNORE_INDEX, LEAN_KEYS, SEGMENT_TOKENS, cu_capacity, derive_planes, full_batch, is_lean, lean_batch,
    padding_batch,
)
from stacklm.data.packing.masks import (
    block_mask, block_mask_from_cu, cu_seqlens, dense_mask, dense_mask_from_cu_seqlens, segments_from_cu,
)
from stacklm.data.packing.pack import Collate, collate, pack_best_fit, pack_greedy
from stacklm.data.storage.dataset import PackedMemmapDataset
from tests.helpers.prebuild import write_shard_set

SEQ_LEN = 257  # T = 256: two 128-token FlexAttention tiles per row


@pytest.fixture(scope="module")
def packed(tokenizer_2048):
    """Real text packed both ways at SEQ_LEN: greedy cuts documents across windows, best-fit
    pads the windows it cannot fill."""
    tok = tokenizer_2048
    texts = list(iter_default_corpus(300_000))[:250]
    ids = tok.encode_batch(texts)
    docs = [{"ids": np.asarray(x, dtype=np.int32), "source": "s", "doc_id": str(i)} for i, x in enumerate(ids) if x]
    specials = (tok.bos_id, tok.eos_id, tok.pad_id)
    out = {"best_fit": np.stack(list(pack_best_fit(docs, SEQ_LEN, *specials, buffer_docs=8))),
           "greedy": np.stack(list(pack_greedy(docs, SEQ_LEN, *specials)))}
    pad = tok.pad_id
    assert (out["best_fit"] == pad).any(axis=1).sum() >= 3  # padding in several windows
    assert (out["greedy"][:, 0] != tok.bos_id).sum() >= 3  # documents cut across windows
    return tok, specials, out


def _assert_full_equal(got: dict, want: dict) -> None:
    for k in BATCH_KEYS:
        assert got[k].dtype == torch.long, k
        assert torch.equal(got[k], want[k]), k


def _assert_lean(batch: dict, B: int, T: int) -> None:
    """The lean layout: int32 planes in one buffer, cu_seqlens padded by the documented rule."""
    assert is_lean(batch) and set(LEAN_KEYS) <= batch.keys()
    assert batch["input_ids"].dtype == batch["cu_seqlens"].dtype == batch["last_targets"].dtype == torch.int32
    assert tuple(batch["input_ids"].shape) == (B, T) and tuple(batch["last_targets"].shape) == (B,)
    assert len({batch[k].untyped_storage().data_ptr() for k in ("input_ids", "cu_seqlens", "last_targets")}) == 1
    cu = batch["cu_seqlens"]
    seq = segments_from_cu(cu, B, T)
    n = int((cu < B * T).sum())  # real segments: boundaries below the end
    assert len(cu) == cu_capacity(B, T, n) and cu[0] == 0 and bool((cu[n:] == B * T).all())  # repeat the last one
    assert bool((cu[1:] >= cu[:-1]).all()) and bool((cu[1 : n] > cu[: n - 1]).all())  # only padded segments are empty
    lengths = cu[1:] - cu[:-1]
    assert isinstance(batch["max_seqlen"], int) and batch["max_seqlen"] == int(lengths.max())
    assert int(seq.max()) == n - 1


@pytest.mark.parametrize("strategy", ["best_fit", "greedy"])
def test_stream_collate_lean_derives_todays_planes(packed, strategy):
    tok, specials, windows = packed
    w = windows[strategy]
    lean_collate = Collate(*specials, planes="lean")
    for lo in range(0, len(w), 6):
        rows = w[lo : lo + 6]
        batch = lean_collate(list(rows))
        _assert_lean(batch, len(rows), SEQ_LEN - 1)
        want = collate(rows, *specials)
        _assert_full_equal(full_batch(batch), want)
        # cu_seqlens describes the same segments the seq_ids do, and the old helper finds them too
        old_cu, old_max = cu_seqlens(want)
        n = len(old_cu) - 1
        assert torch.equal(batch["cu_seqlens"][: n + 1], old_cu) and batch["max_seqlen"] == old_max


def test_shards_get_batch_lean_with_padding_rows(packed, tmp_path):
    """Shards mode: the lean ``get_batch`` (and its padding rows, as the shards loader asks for
    them) derives the four planes the full ``get_batch`` returns."""
    tok, specials, windows = packed
    w = np.concatenate([windows["best_fit"][:9], windows["greedy"][:9]])
    write_shard_set(tmp_path / "train", tok, [w[:5], w[5:12], w[12:]])
    full = PackedMemmapDataset(tmp_path, tokenizer=tok)
    lean = PackedMemmapDataset(tmp_path, tokenizer=tok, planes="lean")
    assert lean.get_batch([0], planes="full").keys() == set(BATCH_KEYS)
    rng = np.random.default_rng(0)
    for n_pad in (0, 2, 0, 3):
        idx = rng.choice(len(w), size=5, replace=False)
        batch = lean.get_batch(idx, n_pad)
        _assert_lean(batch, 5 + n_pad, SEQ_LEN - 1)
        want = full.get_batch(idx, n_pad)
        _assert_full_equal(full_batch(batch), want)
        _assert_full_equal(want, collate(np.concatenate([w[idx], np.full((n_pad, SEQ_LEN), tok.pad_id)]), *specials))
        if n_pad:
            assert bool((want["targets"][5:] == IGNORE_INDEX).all())
    assert lean.get_batch([], 2)["cu_seqlens"][:3].tolist() == [0, SEQ_LEN - 1, 2 * (SEQ_LEN - 1)]  # padding only
    one = lean[3]  # one row for the default collate: the four planes
    assert one.keys() == set(BATCH_KEYS) and one["input_ids"].shape == (SEQ_LEN - 1,)
    with pytest.raises(Exception, match="planes must be one of"):
        PackedMemmapDataset(tmp_path, tokenizer=tok, planes="thin")


def test_adversarial_rows_and_capacity():
    """Specials everywhere (adjacent bos/eos, pad runs mid-row, pad at column 0, eos last), so
    segments are short enough to outgrow the fixed capacity: it doubles, never past B*T + 1."""
    rng = np.random.default_rng(1)
    bos, eos, pad = 13, 14, 15
    lengths = set()
    for dtype in (np.uint16, np.int32):
        for _ in range(250):
            B, L = int(rng.integers(1, 5)), int(rng.integers(2, 140))
            rows = rng.integers(10, 16, size=(B, L)).astype(dtype)
            batch = lean_batch(rows, bos, eos, pad)
            _assert_lean(batch, B, L - 1)
            _assert_full_equal(full_batch(batch), collate(rows.astype(np.int64), bos, eos, pad))
            lengths.add((B, L - 1, len(batch["cu_seqlens"])))
    assert any(n > cu_capacity(B, T) for B, T, n in lengths)  # some batches outgrew the base length
    assert cu_capacity(8, 2047) == 8 * 32 + 1  # one boundary per SEGMENT_TOKENS tokens
    assert cu_capacity(8, 2047, 257) == 8 * 32 * 2 + 1 and cu_capacity(2, 3, 10**6) == 7
    assert SEGMENT_TOKENS == 64


def test_helpers_need_no_host_sync():
    """On ``meta`` tensors (no data: ``.item()`` and data-dependent shapes raise) the lean
    helpers run, so they run on a GPU without a sync; the old ``cu_seqlens`` does not."""
    B, T = 4, 256
    ids = torch.empty(B, T, dtype=torch.int32, device="meta")
    cu = torch.empty(cu_capacity(B, T), dtype=torch.int32, device="meta")
    last = torch.empty(B, dtype=torch.int32, device="meta")
    planes = derive_planes(ids, cu, last, pad_id=7)
    assert {k: (tuple(v.shape), v.dtype) for k, v in planes.items()} == {
        k: ((B, T), torch.long) for k in ("position_ids", "seq_ids", "targets")}
    bm = block_mask_from_cu(cu, B, T)
    assert bm.kv_num_blocks.device.type == "meta" and tuple(bm.kv_num_blocks.shape) == (B, 1, 2)
    with pytest.raises((RuntimeError, NotImplementedError)):
        cu_seqlens(planes["seq_ids"])


@pytest.mark.parametrize("strategy", ["best_fit", "greedy"])
def test_block_mask_from_cu_equals_dense_mask(packed, strategy):
    """The BlockMask built from ``cu_seqlens`` has the tiles ``create_block_mask`` finds, and
    FlexAttention with it equals SDPA under ``dense_mask``; at a tile size that does not divide
    T as well."""
    tok, specials, windows = packed
    rows = windows[strategy][:4]
    batch = lean_batch(rows, *specials)
    full = full_batch(batch)
    B, T = full["seq_ids"].shape
    cu = batch["cu_seqlens"]
    dense = dense_mask(full)
    assert torch.equal(dense_mask_from_cu_seqlens(cu, B, T), dense)
    ours, ref = block_mask_from_cu(cu, B, T, block_size=64), block_mask(full, block_size=64)
    for a, b in ((ours.kv_num_blocks, ref.kv_num_blocks), (ours.full_kv_num_blocks, ref.full_kv_num_blocks)):
        assert torch.equal(a, b)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert int(ours.full_kv_num_blocks.sum()) > 0 and int(ours.kv_num_blocks.sum()) > 0
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 2, T, 16, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None])
    for size in (64, 96):
        with warnings.catch_warnings():  # eager FlexAttention (CPU): the unfused reference, as wanted here
            warnings.simplefilter("ignore", UserWarning)
            got = flex_attention(q, k, v, block_mask=block_mask_from_cu(cu, B, T, block_size=size))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_padding_batch_in_both_planes():
    """What a dry loader yields: rows of padding, no loss, one segment per row, in either layout."""
    full, lean = padding_batch(3, 9, 7, "full"), padding_batch(3, 9, 7, "lean")
    assert set(full) == set(BATCH_KEYS) and bool((full["targets"] == IGNORE_INDEX).all())
    assert full["position_ids"][2].tolist() == list(range(8)) and int(full["seq_ids"].abs().sum()) == 0
    _assert_lean(lean, 3, 8)
    _assert_full_equal(full_batch(lean), full)
    _assert_full_equal(full, collate(np.full((3, 9), 7), 1, 2, 7))
