"""Run by tests/datamodule/test_rank_world.py under ``python -m torch.distributed.run --nproc_per_node 2``:
every rank records the slice it reads (ShardSpec, a sharded source, the elastic sampler, the
DataLoader workers' shards) before and after ``init_process_group`` (gloo, CPU), to
``<out>/rank<RANK>.json``. The test checks the ranks' slices are disjoint and complete."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from stacklm.datamodule.resume.sampler import ElasticSampler  # noqa: E402
from stacklm.data.sources import ShardSpec, SyntheticSource  # noqa: E402
from stacklm.dist import rank_world  # noqa: E402

N_DOCS, N_SAMPLES, BATCH, STEPS = 40, 50, 3, 4


class WorkerShards(torch.utils.data.IterableDataset):
    """Yields the ``ShardSpec`` each DataLoader worker of this rank sees."""

    def __iter__(self):
        spec = ShardSpec.current()
        yield [spec.rank, spec.world_size, spec.worker, spec.num_workers]


def snapshot() -> dict:
    spec = ShardSpec.current()
    docs = [d["doc_id"] for d in SyntheticSource("s", "prose", num_docs=N_DOCS, shard=spec)]
    sampler = ElasticSampler(N_SAMPLES, BATCH, seed=3)
    it = iter(sampler)
    sampled = [next(it) for _ in range(BATCH * STEPS)]
    loader = torch.utils.data.DataLoader(WorkerShards(), batch_size=None, num_workers=2)
    workers = sorted(list(w) for w in loader)
    return {
        "rank_world": list(rank_world()),
        "spec": [spec.rank, spec.world_size, spec.worker, spec.num_workers],
        "docs": docs,
        "sampler": [sampler.rank, sampler.world_size],
        "sampled": sampled,
        "workers": workers,
    }


def main() -> None:
    out = Path(sys.argv[1])
    before = snapshot()
    dist.init_process_group("gloo")
    after = snapshot()
    after["group"] = [dist.get_rank(), dist.get_world_size()]
    dist.barrier()
    dist.destroy_process_group()
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps({"before": before, "after": after}))


if __name__ == "__main__":
    main()
