"""``stacklm prebuild``: the streaming pipes, run once, written to token shards.

    stacklm prebuild --config demo --out data/demo [--workers N] [--tokenizer DIR]
    stacklm verify data/demo [--tokenizer DIR]

Work is split into *jobs*, one per (split, worker). Worker ``w`` of ``N`` builds the pipeline
(``nodes.build_pipeline``) over reader ``w`` of ``N`` of every source (``ShardSpec``) with a
``1/N`` share of the token budget, and writes its shards as global indices ``w, w+N, w+2N, ...``
of ``OUT/<split>/``. So the result depends only on the config, the tokenizer and ``N``: the
same ``N`` gives byte-identical output, a different ``N`` a different (equally valid) one.

Crash safety: after each shard is renamed into place the job checkpoints the pipeline's
``state_dict()`` (``OUT/.prebuild/<split>-w<k>.ckpt``, written atomically). A re-run with the
same arguments restores every job from its checkpoint; the pipeline contract (exact resume)
makes the continuation, and so every shard, byte-identical to an uninterrupted run. Shards
written after the last checkpoint are simply rewritten. The manifests are written last, then
``.prebuild/`` is removed: a directory with a top-level ``manifest.json`` is a finished build.
A directory built from another config, tokenizer, worker count or shard size is refused with
the differences named.
"""

from stacklm.prebuild.build import lock_out_dir, prebuild, resolve_tokenizer
from stacklm.prebuild.settings import load_config
from stacklm.prebuild.jobs import job_budget, job_name, remove_own_shards_from, run_job, write_job_shards
from stacklm.prebuild.manifests import finalize, prepare, split_manifest, top_manifest
from stacklm.prebuild.plan import (
    BUILD_FILE,
    DEFAULT_TOKENS_PER_SHARD,
    REVISIONS_FILE,
    SPLITS,
    STATE_DIR,
    PrebuildPlan,
    state_dir_of,
    worker_config,
)
from stacklm.prebuild.progress import BuildProgress

__all__ = [
    "BUILD_FILE", "DEFAULT_TOKENS_PER_SHARD", "REVISIONS_FILE", "SPLITS", "STATE_DIR", "BuildProgress",
    "PrebuildPlan", "finalize", "job_budget", "job_name", "load_config", "lock_out_dir", "prebuild", "prepare",
    "remove_own_shards_from", "resolve_tokenizer", "run_job", "split_manifest", "state_dir_of", "top_manifest",
    "worker_config", "write_job_shards",
]
