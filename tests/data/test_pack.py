"""Packing invariants, the batch contract, mask helpers and exact resume of the pack node."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchdata.nodes import IterableWrapper

from stacklm.corpus import iter_default_corpus
from stacklm.data.packing.masks import block_mask, cu_seqlens, dense_mask, dense_mask_from_cu_seqlens
from stacklm.data.packing.nodes import PackNode, batch_node
from stacklm.data.packing.pack import (
    IGNORE_INDEX,
    BestFitPacker,
    GreedyPacker,
    collate,
    pack_best_fit,
    pack_greedy,
    window_to_example,
)
from stacklm.tokenizer.specials import GPT4_PATTERN
from tests.helpers.resume import check_save_load_state

VOCAB = 1024
BOS, EOS, PAD = VOCAB, VOCAB + 1, VOCAB + 2


def _doc(ids, i, source="s"):
    return {"ids": np.asarray(ids, dtype=np.int32), "source": source, "domain": "prose", "doc_id": f"{source}-{i}"}


@pytest.fixture(scope="module")
def real_docs(tokenizer_1024):
    """Real text (the stdlib corpus) as ids of the shared 1,024-id tokenizer trained on it
    (plain text, no specials: every id < VOCAB, so BOS/EOS/PAD above never collide)."""
    texts = list(iter_default_corpus(600_000))
    assert tokenizer_1024.vocab_size == VOCAB
    rng = np.random.default_rng(0)
    order = rng.permutation(len(texts))
    ids = tokenizer_1024.encode_batch([texts[i] for i in order])
    return [_doc(x, i, source=("code" if i % 2 else "prose")) for i, x in enumerate(ids) if len(x)]


def _random_docs(n, seed, max_len=40, long_every=7, long_len=70):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = long_len + int(rng.integers(0, 30)) if i % long_every == 3 else int(rng.integers(1, max_len))
        out.append(_doc(rng.integers(0, VOCAB, size=length), i))
    return out


def _pieces(docs):
    return [np.concatenate([[BOS], d["ids"], [EOS]]).astype(np.int32) for d in docs]


# ---------------------------------------------------------------------------------------
# Packers
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq_len", [16, 33, 256])
def test_greedy_keeps_every_token_in_order_and_pads_only_the_last_window(real_docs, seq_len):
    docs = real_docs[:400]
    packer = GreedyPacker(seq_len, BOS, EOS, PAD)
    windows = list(packer(docs))
    stream = np.concatenate(_pieces(docs))
    flat = np.concatenate(windows)
    assert all(len(w) == seq_len and w.dtype == np.int32 for w in windows)
    assert not (np.concatenate(windows[:-1]) == PAD).any()
    n_pad = int((windows[-1] == PAD).sum())
    assert (windows[-1][seq_len - n_pad :] == PAD).all()
    np.testing.assert_array_equal(flat[flat != PAD], stream)
    s = packer.summary()
    assert s["windows"] == len(windows) and s["pad_tokens"] == n_pad == len(flat) - len(stream)
    assert s["doc_tokens"] == len(stream) and s["docs"] == len(docs)
    # A document is cut exactly when its piece crosses a window edge.
    ends = np.cumsum([len(p) for p in _pieces(docs)])
    starts = ends - np.array([len(p) for p in _pieces(docs)])
    assert s["docs_cut"] == int(((starts // seq_len) != ((ends - 1) // seq_len)).sum())
    assert sum(per.get("cut_across_windows", 0) for per in packer.stats.to_dict().values()) == s["docs_cut"]


def _segments(window):
    """Independent reading of a window: list of token runs split after <eos>, before <bos>, at padding."""
    segs, cur = [], []
    for t in window.tolist():
        if cur and (t == BOS or cur[-1] == EOS or (t == PAD) != (cur[-1] == PAD)):
            segs.append(cur)
            cur = []
        cur.append(t)
    segs.append(cur)
    return segs


@pytest.mark.parametrize("seq_len,buffer_docs", [(64, 8), (256, 64), (2048, 200)])
def test_best_fit_never_cuts_a_document_that_fits(real_docs, seq_len, buffer_docs):
    packer = BestFitPacker(seq_len, BOS, EOS, PAD, buffer_docs)
    windows = list(packer(real_docs))
    pieces = _pieces(real_docs)
    fitting = Counter(tuple(p.tolist()) for p in pieces if len(p) <= seq_len)
    whole = Counter()
    for w in windows:
        for seg in _segments(w):
            if seg[0] == BOS and seg[-1] == EOS:
                whole[tuple(seg)] += 1
    assert whole == fitting  # every fitting doc appears intact, exactly once (and nothing else is "whole")
    long_docs = sum(len(p) > seq_len for p in pieces)
    s = packer.summary()
    assert s["docs_cut"] == long_docs
    # Token conservation and padding accounting.
    flat = np.concatenate(windows)
    np.testing.assert_array_equal(np.sort(flat[flat != PAD]), np.sort(np.concatenate(pieces)))
    assert s["pad_tokens"] == int((flat == PAD).sum()) and s["windows"] == len(windows)
    for w in windows:  # padding only at the tail of a window
        n_pad = int((w == PAD).sum())
        assert (w[len(w) - n_pad :] == PAD).all()


def test_best_fit_pads_under_one_percent_on_real_text(real_docs):
    # The real corpus at 2048 (bench/packing.py runs the full corpus); here ~600 KB of it.
    packer = BestFitPacker(2048, BOS, EOS, PAD, 1000)
    windows = list(packer(real_docs))
    assert len(windows) > 50
    assert packer.summary()["pad_fraction"] <= 0.01
    greedy = GreedyPacker(2048, BOS, EOS, PAD)
    list(greedy(real_docs))
    assert packer.docs_cut < greedy.docs_cut


@pytest.mark.parametrize("buffer_docs", [64, 256])
def test_best_fit_bounds_how_long_a_short_document_waits(buffer_docs):
    """Best-fit-decreasing keeps short documents as gap fillers; without a bound on the wait
    they stay in the buffer for much of the stream (a short-document source delivered late).
    With it, no document waits much more than one buffer turnover, and padding does not grow.
    Document lengths: heavy-tailed like real text (log-normal, median 60 tokens, some > 2048)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(60), 1.6, 4000).astype(int), 1, 6000)
    docs = [{"ids": np.full(n, 7, dtype=np.int32), "source": "s", "file": 0, "record": k} for k, n in enumerate(lengths)]

    def waits(packer) -> tuple[np.ndarray, float]:
        """Per document, the documents pushed after it before its first piece was placed."""
        placed: dict[int, int] = {}
        for k, d in enumerate(docs):
            for _ in packer.push(d):
                for piece in packer.origins.popleft().pieces:
                    placed.setdefault(piece[2], k)
        for _ in packer.finish():
            for piece in packer.origins.popleft().pieces:
                placed.setdefault(piece[2], len(docs))
        assert sorted(placed) == list(range(len(docs)))  # every document once
        return np.array([placed[k] - k for k in range(len(docs))])[: -2 * buffer_docs], packer.summary()["pad_fraction"]

    bounded, pad = waits(BestFitPacker(2048, BOS, EOS, PAD, buffer_docs, sources=["s"], provenance=True))
    unbounded, pad_unbounded = waits(BestFitPacker(2048, BOS, EOS, PAD, buffer_docs, sources=["s"], provenance=True,
                                                   max_wait=1 << 62))
    assert bounded.max() <= 2 * buffer_docs
    assert unbounded.max() > 4 * bounded.max()
    assert pad <= pad_unbounded + 0.001


def test_best_fit_buffer_is_bounded_and_long_docs_stream_out():
    packer = BestFitPacker(32, BOS, EOS, PAD, buffer_docs=5)
    for d in _random_docs(200, seed=1, max_len=20, long_every=5, long_len=100):
        out = packer.push(d)
        assert len(packer) < 5
        assert all(len(w) == 32 for w in out)


def test_rejects_documents_holding_special_ids():
    with pytest.raises(ValueError, match="doc 's-0' of source 's'.*special ids"):
        GreedyPacker(8, BOS, EOS, PAD).push(_doc([5, EOS, 6], 0))


# ---------------------------------------------------------------------------------------
# Batch contract
# ---------------------------------------------------------------------------------------
def test_contract_on_a_hand_checked_example():
    """seq_len 8; docs [10,11,12] and [20..28]. Window 2 starts with a continued fragment."""
    docs = [_doc([10, 11, 12], 0), _doc(list(range(20, 29)), 1)]
    windows = list(pack_greedy(docs, 8, BOS, EOS, PAD))
    b = collate(windows, BOS, EOS, PAD)
    I = IGNORE_INDEX
    assert [w.tolist() for w in windows] == [
        [BOS, 10, 11, 12, EOS, BOS, 20, 21],
        [22, 23, 24, 25, 26, 27, 28, EOS],
    ]
    assert b["input_ids"].tolist() == [[BOS, 10, 11, 12, EOS, BOS, 20], [22, 23, 24, 25, 26, 27, 28]]
    # last doc token -> <eos> is trained on; <eos> -> next <bos> is not.
    assert b["targets"].tolist() == [[10, 11, 12, EOS, I, 20, 21], [23, 24, 25, 26, 27, 28, EOS]]
    # the fragment in row 1 is segment 0 and restarts its positions at 0.
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
    assert b["seq_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0]]
    assert all(v.dtype == torch.long and v.shape == (2, 7) for v in b.values())
    ex = window_to_example(windows[0], BOS, EOS, PAD)
    assert all(torch.equal(ex[k], b[k][0]) for k in b)


def test_contract_for_a_fragment_after_another_document_and_padding():
    # best-fit places the tail of a long document (no <bos>) after a whole document.
    window = np.array([BOS, 7, EOS, 30, 31, EOS, PAD, PAD], dtype=np.int32)
    b = window_to_example(window, BOS, EOS, PAD)
    I = IGNORE_INDEX
    assert b["seq_ids"].tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert b["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert b["targets"].tolist() == [7, EOS, I, 31, EOS, I, I]


def _reference_example(window):
    """Per-token Python reference of the contract, from an independent segmentation."""
    inputs, targets, pos, seg = [], [], [], []
    for s_idx, run in enumerate(_segments(window)):
        for off, t in enumerate(run):
            inputs.append(t)
            pos.append(off)
            seg.append(s_idx)
    L = len(window)
    for i in range(L - 1):
        nxt = int(window[i + 1])
        targets.append(IGNORE_INDEX if nxt == PAD or seg[i + 1] != seg[i] else nxt)
    return inputs[:-1], targets, pos[:-1], seg[:-1]


@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
def test_collate_matches_a_per_token_reference(strategy):
    docs = _random_docs(120, seed=3)
    pack = pack_greedy(docs, 24, BOS, EOS, PAD) if strategy == "greedy" else pack_best_fit(docs, 24, BOS, EOS, PAD, 6)
    windows = list(pack)
    b = collate(windows, BOS, EOS, PAD)
    assert b["input_ids"].shape == (len(windows), 23)
    for r, w in enumerate(windows):
        inputs, targets, pos, seg = _reference_example(w)
        assert b["input_ids"][r].tolist() == inputs
        assert b["targets"][r].tolist() == targets
        assert b["position_ids"][r].tolist() == pos
        assert b["seq_ids"][r].tolist() == seg
    assert int(b["position_ids"].min()) >= 0 and int(b["position_ids"].max()) < 24
    # seq_ids count 0, 1, 2, ... in order of appearance.
    steps = torch.diff(b["seq_ids"], dim=1)
    assert bool(((steps == 0) | (steps == 1)).all()) and bool((b["seq_ids"][:, 0] == 0).all())


def test_collate_fields_are_contiguous_views_of_one_buffer():
    """A loader worker sends one shared-memory block per batch, not four (one fd round trip)."""
    b = collate(list(pack_greedy(_random_docs(40, seed=1), 24, BOS, EOS, PAD))[:5], BOS, EOS, PAD)
    storages = {t.untyped_storage().data_ptr() for t in b.values()}
    assert len(storages) == 1
    assert all(t.is_contiguous() and t.dtype == torch.long and t.shape == (5, 23) for t in b.values())
    b["targets"][:] = 7  # the views do not overlap
    assert not bool((b["input_ids"] == 7).all()) and not bool((b["seq_ids"] == 7).all())


def test_targets_follow_true_document_membership():
    """Label every token with the document it came from (greedy: known from the stream) and
    check -100 is set exactly where the next token is padding or another document's."""
    docs = _random_docs(60, seed=5)
    L = 20
    stream_doc = np.concatenate([np.full(len(d["ids"]) + 2, i) for i, d in enumerate(docs)])
    windows = list(pack_greedy(docs, L, BOS, EOS, PAD))
    n = len(stream_doc)
    owner = np.full(len(windows) * L, -1)
    owner[:n] = stream_doc
    owner = owner.reshape(-1, L)
    b = collate(windows, BOS, EOS, PAD)
    expected_valid = (owner[:, 1:] == owner[:, :-1]) & (owner[:, 1:] >= 0)
    assert np.array_equal(b["targets"].numpy() != IGNORE_INDEX, expected_valid)
    # the same membership gives the segments
    same = b["seq_ids"][:, :, None] == b["seq_ids"][:, None, :]
    own = torch.from_numpy(owner[:, :-1])
    assert torch.equal(same, own[:, :, None] == own[:, None, :])


# ---------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------
def test_mask_helpers_agree(real_docs):
    windows = list(pack_best_fit(real_docs[:300], 129, BOS, EOS, PAD, 16))[:4]
    b = collate(windows, BOS, EOS, PAD)
    B, T = b["seq_ids"].shape
    dense = dense_mask(b)
    s = b["seq_ids"]
    for i in range(0, T, 17):  # spot-check the rule directly
        for j in range(0, T, 13):
            assert bool(dense[1, i, j]) == (bool(s[1, i] == s[1, j]) and j <= i)
    cu, max_len = cu_seqlens(b)
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == B * T
    lengths = torch.diff(cu)
    assert int(lengths.max()) == max_len and bool((lengths > 0).all())
    assert torch.equal(dense_mask_from_cu_seqlens(cu, B, T), dense)
    assert len(cu) - 1 == int((s.max(dim=1).values + 1).sum())  # one varlen sequence per segment

    bm = block_mask(b, block_size=32, device="cpu")
    assert tuple(bm.shape) == (B, 1, T, T)
    # FlexAttention with the BlockMask == SDPA with the dense mask.
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 2, T, 16, generator=g) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "called without torch.compile": fine for a check
        out_flex = flex_attention(q, k, v, block_mask=bm)
    out_ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None])
    torch.testing.assert_close(out_flex, out_ref, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# Nodes: exact resume
# ---------------------------------------------------------------------------------------
def _pack_node(docs, strategy, seq_len=48, buffer_docs=6):
    return PackNode(IterableWrapper(docs), seq_len, strategy, BOS, EOS, PAD, buffer_docs)


@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
def test_pack_node_matches_plain_packer_and_resumes_exactly(strategy):
    docs = _random_docs(150, seed=11, long_every=9, long_len=130)

    def compact(r):  # the buffer is arrays, not per-document objects
        assert all(isinstance(v, (np.ndarray, int, dict)) for v in r.state["packer"].values())
        assert isinstance(r.state["ready"], np.ndarray)

    full = check_save_load_state(
        lambda: _pack_node(docs, strategy), lambda n: (0, 1, 7, n // 2, n - 2, n), state_round_trip="pickle", check_state=compact,
    )
    plain = list(pack_greedy(docs, 48, BOS, EOS, PAD) if strategy == "greedy" else pack_best_fit(docs, 48, BOS, EOS, PAD, 6))
    assert len(full) == len(plain) and all(np.array_equal(a, b) for a, b in zip(full, plain))


def test_pack_node_counters_survive_resume():
    docs = _random_docs(80, seed=2)

    def same_summary(r):
        assert r.restored.summary() == r.uninterrupted.summary()

    check_save_load_state(lambda: _pack_node(docs, "best_fit"), [10], check_resumed=same_summary)


def test_batched_node_resumes_exactly(real_docs):
    def build():
        return batch_node(PackNode(IterableWrapper(real_docs[:300]), 128, "best_fit", BOS, EOS, PAD, 32), batch_size=4)

    full = check_save_load_state(build, [3])
    assert len(full) > 6
    for a in full:  # the resumed stream is exactly this one
        assert a["input_ids"].shape == (4, 127) and a["input_ids"].dtype == torch.long


def test_mix_shuffle_pack_batch_chain_resumes_exactly(real_docs):
    """The pipeline's tail as one graph: mix -> shuffle -> best-fit pack -> batch."""
    from stacklm.data.mix.mix import MixNode
    from stacklm.data.shuffle import ShuffleNode

    code = [d for d in real_docs if d["source"] == "code"][:150]
    prose = [d for d in real_docs if d["source"] == "prose"][:150]

    def build():
        mixed = MixNode({"code": IterableWrapper(code), "prose": IterableWrapper(prose)}, {"code": 0.7, "prose": 0.3}, 60_000, seed=1)
        packed = PackNode(ShuffleNode(mixed, 32, seed=2), 256, "best_fit", BOS, EOS, PAD, 24)
        return batch_node(packed, batch_size=3)

    full = check_save_load_state(build, lambda n: (2, n // 2, n - 1), state_round_trip="pickle")
    assert len(full) > 10


def test_the_mask_example_in_the_docs_runs():
    """docs/architecture.md's mask example (dense mask -> SDPA, BlockMask -> FlexAttention,
    cu_seqlens), run exactly as written."""
    import re
    import warnings
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    (block,) = re.findall(r"^```python example=masks\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        exec(compile(block, "docs/architecture.md:masks", "exec"), {})
