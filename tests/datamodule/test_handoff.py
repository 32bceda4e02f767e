"""Loader workers hand batches over through reused shared-memory blocks (``datamodule.handoff``):
the batches equal the main process's, a batch the consumer keeps is never overwritten, and the
blocks are reused once released (a pass makes a handful, not one per batch)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from stacklm.corpus import iter_default_corpus
from stacklm.data.packing.pack import pack_best_fit
from stacklm.data.storage.dataset import PackedMemmapDataset
from stacklm.datamodule.handoff import SLOT_KEY, MainBlocks, WorkerBlocks
from stacklm.datamodule.resume.sampler import ElasticSampler
from stacklm.datamodule.shards_loader import ShardsLoader
from tests.helpers.prebuild import write_shard_set

SEQ_LEN = 129


@pytest.fixture(scope="module")
def shards(tokenizer_2048, tmp_path_factory):
    tok = tokenizer_2048
    ids = tok.encode_batch(list(iter_default_corpus(200_000))[:200])
    docs = [{"ids": np.asarray(x, dtype=np.int32), "source": "s"} for x in ids if x]
    w = np.stack(list(pack_best_fit(docs, SEQ_LEN, tok.bos_id, tok.eos_id, tok.pad_id, buffer_docs=8)))
    root = tmp_path_factory.mktemp("handoff")
    write_shard_set(root / "train", tok, [w[: len(w) // 2], w[len(w) // 2 :]])
    return root


def _digest(batch) -> tuple:
    return tuple(batch[k].clone() if isinstance(batch[k], torch.Tensor) else batch[k] for k in sorted(batch))


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("planes", ["lean", "full"])
def test_worker_batches_equal_the_main_process_and_kept_ones_stay_whole(shards, planes):
    ds = PackedMemmapDataset(shards, planes=planes)
    order = ElasticSampler(ds, 4, seed=0, rank=0, world_size=1)

    def loader(workers):
        return ShardsLoader(ds, order, batch_size=4, rank=0, world_size=1, num_workers=workers)
    want = [_digest(b) for b in loader(0)]
    assert len(want) >= 40
    kept, got = [], []
    for i, b in enumerate(loader(2)):
        got.append(_digest(b))
        if i % 3 == 0:
            kept.append((i, b))  # held to the end: its block must not be written again
    assert len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    assert all(_same(_digest(b), want[i]) for i, b in kept)


def test_released_blocks_are_reused(shards):
    """A consumer that drops each batch: the workers' blocks stay a handful (prefetch and the
    batch in hand), not one per batch; a consumer that keeps all makes one per batch."""
    ds = PackedMemmapDataset(shards, planes="lean")
    order = ElasticSampler(ds, 4, seed=0, rank=0, world_size=1)
    loader = ShardsLoader(ds, order, batch_size=4, rank=0, world_size=1, num_workers=2)
    n = sum(1 for _ in loader)
    assert n >= 40 and len(loader.blocks.blocks) <= 2 * 6, len(loader.blocks.blocks)
    keeper = ShardsLoader(ds, order, batch_size=4, rank=0, world_size=1, num_workers=2)
    kept = list(keeper)
    assert len(kept) == n and len(keeper.blocks.blocks) == n  # none released: each batch its own block


def test_a_block_is_released_only_when_no_view_of_the_batch_is_alive():
    """In one process (the worker's and the main's halves back to back): the busy byte clears
    when the last view of the batch dies, not when the batch dict does."""
    worker, main = WorkerBlocks(), MainBlocks()
    buf = torch.arange(40, dtype=torch.int32)
    batch = {"input_ids": buf[:32].view(4, 8), "cu_seqlens": buf[32:], "max_seqlen": 8}
    msg = worker.pack(batch)
    assert SLOT_KEY in msg and "input_ids" not in msg and msg["max_seqlen"] == 8
    got = main.unpack(msg)
    assert torch.equal(got["input_ids"], batch["input_ids"]) and torch.equal(got["cu_seqlens"], batch["cu_seqlens"])
    view = got["input_ids"][1]  # a view the consumer keeps
    del got
    gc.collect()
    block = worker.blocks[0][1]
    assert block[0] == 1  # still busy: the view reads it
    buf2 = buf + 1
    again = worker.pack({"input_ids": buf2[:32].view(4, 8), "cu_seqlens": buf2[32:], "max_seqlen": 8})
    assert again[SLOT_KEY]["block"] == 1 and len(worker.blocks) == 2  # a new block, the kept one untouched
    assert torch.equal(view, batch["input_ids"][1])
    del view
    gc.collect()
    assert block[0] == 0  # released: the next batch may take it
    assert worker.pack(dict(batch))[SLOT_KEY]["block"] == 0
    mixed = {"a": torch.zeros(2), "b": torch.ones(2)}  # two storages: torch's way, unchanged
    assert worker.pack(mixed) is mixed
