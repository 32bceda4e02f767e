"""``stacklm prebuild``, ``stacklm verify``, ``stacklm prebuild-datatrove`` and ``stacklm dedup-index``:
write token shards (or stream mode's dedup index) once, locally or on a datatrove executor, and
check them. The two datatrove commands share their engine flags (``add_engine_arguments``) and
how a chain is submitted or run (``_run_chain``)."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from stacklm.cli.arg_types import OneConfig, int_at_least, non_negative_float, positive_int
from stacklm.errors import PrebuildError, UserError

PREBUILD_EXAMPLES = """examples:
  stacklm prebuild --config demo --out shards/                  # the packaged demo config
  stacklm prebuild --config my.yaml --tokenizer tok/ --out shards/ --workers 4
  stacklm prebuild --config my.yaml --out shards/ --splits val  # one split only
  (re-run the same command to resume an interrupted build)
"""

VERIFY_EXAMPLES = """examples:
  stacklm verify shards/                   # every split of a prebuild output
  stacklm verify shards/train --tokenizer tok/
"""

LEDGER_EXAMPLES = """examples:
  stacklm ledger shards/                   # every split: a table per source, exit 1 if an identity fails
  stacklm ledger shards/train --json
"""

DEDUP_INDEX_EXAMPLES = """examples:
  stacklm dedup-index --config my.yaml --out dedup.npz            # then set data.pipeline.dedup.index: dedup.npz
  stacklm dedup-index --config my.yaml --out dedup.npz --workers 4 --splits train
  stacklm dedup-index --config my.yaml --out dedup.npz --executor local --tasks 8 --workers 4
  stacklm dedup-index --config my.yaml --out /shared/dedup.npz --executor slurm --tasks 64 --partition cpu \\
      --stage-resources decision=mem_gb:64,time:12:00:00 --wait
  stacklm dedup-index --config my.yaml --out s3://bucket/dedup.npz --executor slurm --tasks 64 --partition cpu \\
      --stage-dir /shared/stage/dedup --wait                       # written there, then uploaded by this command
  (the same file for every engine and --tasks; a re-run after a failed task resumes)
"""

DATATROVE_EXAMPLES = """examples:
  stacklm prebuild-datatrove --config my.yaml --out shards/ --tasks 8 --workers 4
  stacklm prebuild-datatrove --config my.yaml --out /shared/shards --tasks 64 --executor slurm --partition cpu
  stacklm prebuild-datatrove --config my.yaml --out /shared/shards --tasks 64 --executor slurm --partition cpu \\
      --env-command 'source /shared/venv/bin/activate' --stage-resources decision=mem_gb:64,time:12:00:00 --wait
  stacklm prebuild-datatrove --config my.yaml --out s3://bucket/shards --tasks 8     # staged in the cache, then uploaded
  stacklm prebuild-datatrove --config my.yaml --out s3://bucket/shards --tasks 64 --executor slurm --partition cpu \\
      --stage-dir /shared/stage/shards --wait                                     # staged where every node sees it
"""


def cmd_prebuild(args: argparse.Namespace) -> int:
    from stacklm.errors import TextColumnError
    from stacklm.prebuild import load_config, prebuild
    from stacklm.prebuild.settings import entry_column_error

    config, settings = load_config(args.config)
    tok_path = args.tokenizer or settings["tokenizer"]
    if not tok_path:
        raise PrebuildError(f"{args.config}: no tokenizer: set 'data.tokenizer' in the config or pass --tokenizer DIR")
    if not Path(tok_path).exists():
        raise PrebuildError(f"tokenizer {tok_path} does not exist; train one with `stacklm train-tokenizer --out {tok_path}`", path=tok_path)
    from stacklm.data.storage import remote

    out = remote.file_url_path(args.out or settings["out"])  # file:///x: the local /x
    if not out:
        raise PrebuildError(f"{args.config}: no output directory: pass --out DIR (or set 'data.data_dir' in the config)")
    from stacklm.prebuild.summary import summary_table

    if remote.is_remote(out):
        was_complete = remote.read_bytes(remote.join(out, "manifest.json"), missing_ok=True) is not None
    else:
        was_complete = (Path(out) / "manifest.json").exists()
    t0 = time.perf_counter()
    try:
        top = prebuild(
            config,
            tok_path,
            out,
            workers=args.workers or settings["workers"],
            tokens_per_shard=args.tokens_per_shard or settings["tokens_per_shard"],
            splits=tuple(args.splits or settings["splits"]),
            progress=not args.no_progress,
            provenance=not args.no_provenance,
            sign_margin=args.sign_margin,
        )
    except TextColumnError as e:  # said as the config's field that sets the column
        raise entry_column_error(e, args.config, config.mix.entries) from e
    # stdout, also with --no-progress (which hides only the live bar on stderr)
    print(summary_table(top, str(out), None if was_complete else time.perf_counter() - t0))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from stacklm.data.storage.dataset import verify_shard_set
    from stacklm.tokenizer.bpe import StackTokenizer

    tokenizer = StackTokenizer.load(args.tokenizer) if args.tokenizer else None  # the data layer takes it loaded
    from stacklm.data.storage.remote import file_url_path

    args.dir = file_url_path(args.dir)  # file:///x: the local /x
    report = verify_shard_set(args.dir, tokenizer=tokenizer, progress=not args.no_progress)
    for split, r in report.items():
        print(f"{args.dir} [{split}]: OK — {r['shards']} shards, {r['rows']:,} sequences, {r['tokens']:,} tokens, max id {r['max_id']} < vocab {r['vocab_size']}")
    return 0


def cmd_dedup_index(args: argparse.Namespace) -> int:
    import sys

    from stacklm.prebuild import load_config

    from stacklm.data.storage import remote

    config, settings = load_config(args.config)
    out = remote.file_url_path(args.out or config.dedup.index)  # file:///x: the local /x
    if not out:
        raise PrebuildError(f"{args.config}: no --out given and data.pipeline.dedup.index is not set; say where to write the index")
    if config.dedup.index and not (config.dedup.exact or config.dedup.near):
        # The stream config that *reads* an index turns in-flight dedup off (exact/near false);
        # the index it reads is the full exact + near decision.
        config = dataclasses.replace(config, dedup=dataclasses.replace(config.dedup, exact=True, near=True, index=None))
    if not (config.dedup.exact or config.dedup.near):
        raise PrebuildError(f"{args.config}: dedup.exact and dedup.near are both off and no dedup.index is set; nothing to index")
    config.check_stages_run()  # the readers run the user stages: refused before the output's folder is made
    splits = tuple(args.splits or settings["splits"])
    if args.wait and args.executor != "slurm":
        raise UserError("--wait is for --executor slurm (the other executors wait anyway)")
    url, stage = None, _url_stage(args, out, "dedup-index")
    if stage is not None:  # the file is written in the stage, then uploaded (``stacklm.prebuild.url_output``)
        from stacklm.prebuild.url_output import staged_file

        url, out = str(out), staged_file(str(out), stage)
    if args.executor == "pool":  # in this process and a local process pool, as before the engines
        from stacklm.prebuild.build import worker_pool, pool_starmap
        from stacklm.prebuild.dedup_pass import build_dedup_index

        if args.tasks is not None:
            raise UserError("--tasks is for --executor local/slurm/ray; the pool's processes are --workers N")
        ignored = [*_cluster_flags_set(args), *(f for f, v in (("--logging-dir", args.logging_dir), ("--dedup-ranges", args.dedup_ranges)) if v)]
        if ignored:
            print(f"stacklm dedup-index: warning: {', '.join(ignored)} apply to --executor local/slurm/ray; the pool ignores them", file=sys.stderr)
        workers = max(1, args.workers or 1)
        # the staged decision's signature columns go beside the index (``build_dedup_index``: a temporary folder, removed after)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with worker_pool(workers) as (pool, _):
            index = build_dedup_index(config, splits, workers, None if pool is None else pool_starmap(pool), work_dir=Path(out).parent, out=out)
    else:  # datatrove: signatures -> buckets -> decision -> index (stacklm.scale.datatrove_executors)
        from stacklm.data.dedup.global_index import DedupIndex
        from stacklm.scale.datatrove_executors import dedup_index_executors  # without datatrove: an error naming [scale]

        if args.tasks is None:
            raise UserError(f"--executor {args.executor} needs --tasks T: tasks per split (the index is the same for every T)")
        cluster = _cluster_plan(args, settings)
        kwargs: dict[str, Any] = {}
        if args.executor == "local":
            kwargs["workers"] = args.workers or -1
            _warn_local_ignores(args, "dedup-index")
        elif args.workers is not None:
            print(f"stacklm dedup-index: warning: --workers applies to --executor pool/local; {args.executor} ignores it "
                  "(--cpus-per-task and --stage-resources size its tasks)", file=sys.stderr)
        last = dedup_index_executors(config, out, tasks=args.tasks, splits=splits, executor=args.executor, logging_dir=args.logging_dir,
                                     cluster=cluster, dedup_ranges=args.dedup_ranges or 1, **kwargs)
        if not _run_chain(args, last, cluster, "dedup-index", url or out):
            print(f"when they have completed, {out} is the index: set data.pipeline.dedup.index: {out} for stream mode")
            return 0
        index = DedupIndex.load(out)
    if url is not None:
        from stacklm.prebuild.url_output import upload_staged_file

        upload_staged_file(Path(out), url, say=lambda m: print(f"stacklm dedup-index: {m}", file=sys.stderr))
        out = url
    for split, c in index.counts().items():
        print(f"{out} [{split}]: {index.meta['docs'][split]:,} documents, {c['exact']:,} exact and {c['near']:,} near duplicates and {c['cross_split']:,} copies of documents kept in another split listed")
    if url is not None:  # stream mode reads dedup.index from a local file only
        print(f"stream mode: copy {url} to a local file on each training node and set data.pipeline.dedup.index to that path "
              f"(sha256 {index.content_hash[:16]}...)")
    else:
        print(f"stream mode: set data.pipeline.dedup.index: {out} (sha256 {index.content_hash[:16]}...)")
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    """Print a prebuild's token ledger per split and source; exit 1 when an identity fails."""
    import json

    from stacklm.data import ledger
    from stacklm.data.quality.decontam import format_report

    from stacklm.data.storage import manifest as mf
    from stacklm.data.storage import remote
    from stacklm.data.storage.datafiles import check_data_dir, check_data_file

    from stacklm.data.storage.remote import file_url_path

    args.dir = file_url_path(args.dir)  # file:///x: the local /x
    shown = args.dir
    d = args.dir
    if remote.is_remote(d):  # its manifests, mirrored (no shard is downloaded for a ledger)
        d = str(remote.mirror(d, manifests_only=True))
    top = Path(d) / "manifest.json"
    if check_data_file(top) is None:
        raise UserError(f"{top} is missing: {shown} is not a finished prebuild (run `stacklm prebuild` first)")
    m = mf.read_manifest(d)
    # A ledger vouches for the build: each split passes the loader's checks (manifest fields,
    # shard files, row counts; a mirror of the manifests only: the manifest's). A top manifest
    # alone (copied away to compare) still prints.
    files = not remote.is_remote(args.dir)
    if "shards" in m:
        mf.check_split(d, files=files)
    for name in m.get("splits", {}):
        if check_data_dir(Path(d) / name, d) is not None:
            mf.check_split(Path(d) / name, files=files)
    per_split = m.get("ledger") if "splits" in m else ({m["split"]: m["ledger"]} if "ledger" in m else None)
    if not per_split:
        raise UserError(f"{top} has no 'ledger': built before stacklm kept one (or by prebuild-datatrove); rebuild it to get one")
    decontam = m.get("decontamination") if "splits" in m else ({m["split"]: m["decontamination"]} if "decontamination" in m else {})
    decontam = decontam or {}
    from stacklm.data.dedup.evidence import BUILD_EVIDENCE_DIR, build_evidence_files

    # the dedup decision's evidence, per split and source (``manifests.keep_dedup_evidence``); a top manifest only
    dedup = m.get("global_dedup") if "splits" in m else None
    similarity = (dedup or {}).get("removal_similarity")
    failed = False
    for split, entry in per_split.items():
        if args.json:
            continue
        hist = similarity.get(split, {}) if similarity is not None else None
        print(ledger.format_ledger(entry["sources"], title=f"{args.dir} [{split}]", removal_similarity=hist))
        if dedup and any(r.startswith("dedup/") and n for u in entry["sources"].values() for r, n in u["docs"]["dropped"].items()):
            if hist is None:
                print("  dedup removals by similarity: no evidence kept with this build (decided before stacklm kept it); a new build keeps it")
            elif files and not build_evidence_files(args.dir):
                print(f"  why one was removed: {args.dir}/{BUILD_EVIDENCE_DIR}/ is missing (deleted since the build?), so "
                      "`stacklm inspect --why` cannot answer; the histogram above is the manifest's")
            else:
                print(f"  why one was removed, and for which kept copy: stacklm inspect {args.dir} --why SOURCE/FILE/ROW")
        if decontam.get(split):  # the ledger's decontam/<set> drops, per set with tokens and examples
            print(format_report(decontam[split]))
        failed |= bool(ledger.check(entry["sources"]))
    if args.json:
        print(json.dumps({split: {**entry, **({"decontamination": decontam[split]} if decontam.get(split) else {}),
                                  **({"removal_similarity": similarity.get(split, {})} if similarity is not None else {})}
                          for split, entry in per_split.items()}, indent=1))
        failed = any(ledger.check(e["sources"]) for e in per_split.values())
    return 1 if failed else 0


def cmd_prebuild_datatrove(args: argparse.Namespace) -> int:
    from stacklm.prebuild import load_config

    from stacklm.scale.datatrove_executors import prebuild_executors  # without datatrove: an error naming [scale]

    config, settings = load_config(args.config)
    cluster = _cluster_plan(args, settings)
    kwargs: dict[str, Any] = {}
    if args.executor == "local":
        kwargs["workers"] = args.workers
        _warn_local_ignores(args, "prebuild-datatrove")
    if args.wait and args.executor != "slurm":
        raise UserError("--wait is for --executor slurm (the local and ray executors wait anyway)")
    from stacklm.data.storage import remote

    out = remote.file_url_path(args.out or settings["out"])  # file:///x: the local /x
    if not out:
        raise UserError("pass --out DIR (or set data.data_dir in the config)")
    stage = _url_stage(args, out, "prebuild-datatrove")

    def build(local) -> bool:
        _, merge = prebuild_executors(
            config, args.tokenizer or settings["tokenizer"], local, tasks=args.tasks,
            tokens_per_shard=args.tokens_per_shard or settings["tokens_per_shard"],
            splits=settings["splits"], executor=args.executor, logging_dir=args.logging_dir, cluster=cluster,
            dedup_ranges=args.dedup_ranges or 1, **kwargs,
        )
        return _run_chain(args, merge, cluster, "prebuild-datatrove", out)

    t0 = time.perf_counter()
    if stage is None:
        if build(out):
            _print_summary(out, time.perf_counter() - t0)
        return 0
    import sys

    from stacklm.data.storage.manifest import read_manifest
    from stacklm.prebuild.build import prebuild_remote
    from stacklm.prebuild.summary import summary_table

    def build_staged(local) -> dict[str, Any]:
        build(local)  # finished when it returns: a URL run waits for every task (``stage_for``: --wait on Slurm)
        return read_manifest(local)

    # built in the stage like a local --out, then uploaded as `prebuild --out URL` uploads
    top = prebuild_remote(out, build_staged, stage=stage, say=lambda m: print(m, file=sys.stderr))
    print(summary_table(top, out, time.perf_counter() - t0))
    return 0


def _url_stage(args: argparse.Namespace, out, command: str):
    """The local staging folder of a URL ``--out`` (``stacklm.prebuild.url_output``: an output
    the run cannot serve is refused here, before any work); None for a local ``--out``."""
    from stacklm.data.storage import remote

    if not remote.is_remote(out):
        if args.stage_dir:
            raise UserError(f"--stage-dir is for a URL --out; {out} is a local path, built in place")
        return None
    from stacklm.prebuild.url_output import stage_for

    return stage_for(str(out), command=command, executor=args.executor, stage_dir=args.stage_dir, wait=args.wait)


def _cluster_plan(args: argparse.Namespace, settings: dict[str, Any]):
    """The stages' resources and Slurm options: the config's ``prebuild.cluster``, then the flags."""
    from stacklm.scale.resources import ClusterPlan, parse_sbatch_args, parse_stage_resources

    return ClusterPlan.resolve(
        settings["cluster"], stage_flags=parse_stage_resources(args.stage_resources or ()),
        cpus_per_task=args.cpus_per_task, mem_per_cpu_gb=args.mem_per_cpu_gb, time=args.time,
        partition=args.partition, qos=args.qos, env_command=args.env_command, sbatch_args=parse_sbatch_args(args.sbatch_arg or ()),
        max_array_size=args.max_array_size,
    )


def _cluster_flags_set(args: argparse.Namespace) -> list[str]:
    """The Slurm/Ray flags given on the command line (the local executor ignores them)."""
    return [f for f, v in (("--partition", args.partition), ("--time", args.time), ("--cpus-per-task", args.cpus_per_task),
                           ("--mem-per-cpu-gb", args.mem_per_cpu_gb), ("--stage-resources", args.stage_resources),
                           ("--qos", args.qos), ("--env-command", args.env_command), ("--sbatch-arg", args.sbatch_arg)) if v]


def _warn_local_ignores(args: argparse.Namespace, command: str) -> None:
    import sys

    set_here = _cluster_flags_set(args)
    if set_here:
        print(f"stacklm {command}: warning: {', '.join(set_here)} apply to --executor slurm/ray; the local executor ignores them",
              file=sys.stderr)


def _run_chain(args: argparse.Namespace, last, cluster, command: str, out) -> bool:
    """Run (local, Ray) or submit (Slurm) the chain ending in ``last``; True when it has finished
    (Slurm: only with ``--wait``). Local and Ray go stage by stage; a task that dies or raises is
    ``TaskFailed``, one line naming it and its log. Slurm ``--wait``: the same at the first
    failed task (``wait_for_chain``)."""
    import sys

    from stacklm.scale.datatrove_executors import run_executors, stage_chain

    if getattr(last, "stacklm_complete", False):  # ``prebuild_executors``: the same build is there already
        print(f"{out}: already complete (same config, tokenizer and tasks); nothing to run", file=sys.stderr)
        return True
    chain = stage_chain(last)
    if args.executor != "local":
        table = cluster.table(args.executor, [ex.stacklm_stage for ex in chain])
        print(f"stacklm {command}: per-task resources: {table}", file=sys.stderr)
    if args.executor != "slurm":
        run_executors(last)
        return True
    from stacklm.scale.slurm import submit_chain, wait_for_chain

    submit_chain(chain)
    jobs = ", ".join(f"{ex.stacklm_stage} {ex.job_id}" for ex in chain if ex.job_id not in (None, -1))
    print(f"submitted slurm jobs: {jobs or 'none (every task had completed)'}")
    if not args.wait:
        print("watch them with squeue; rerun with --wait to wait and exit non-zero naming a failed task and its log")
        return False
    wait_for_chain(chain, poll_seconds=args.poll_seconds, say=lambda m: print(m, file=sys.stderr))
    print(f"{out}: every slurm task completed")
    return True


def _print_summary(out, seconds: float) -> None:
    """The same summary table as ``stacklm prebuild`` ends with, from the merged top manifest."""
    import json

    from stacklm.prebuild.summary import summary_table

    top = Path(out) / "manifest.json"
    if top.exists():
        print(summary_table(json.loads(top.read_text()), str(out), seconds))


def add_prebuild_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``prebuild``, ``verify``, ``ledger``, ``dedup-index`` and ``prebuild-datatrove`` on the CLI's subparsers."""
    from stacklm.prebuild import DEFAULT_TOKENS_PER_SHARD, SPLITS
    from stacklm.prebuild.signing import SIGN_MARGIN

    p = subparsers.add_parser(
        "prebuild", help="run the data pipes once and write train/val token shards",
        description="Run the data pipes of a config once and write train/val token shards (OUT/train, OUT/val), "
        "resumable and identical for the same --workers.",
        epilog=PREBUILD_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, action=OneConfig, help="YAML config in the trainer's layout (data.pipeline), or a packaged config by name: demo, stack-100m")
    p.add_argument("--out", help="output directory (default: data.data_dir of the config); re-run the same command to resume")
    p.add_argument("--tokenizer", help="tokenizer artifact or its directory (default: data.tokenizer of the config)")
    p.add_argument("--workers", type=positive_int, help="parallel jobs (>= 1); the output is identical for the same N (default 1)")
    p.add_argument("--tokens-per-shard", type=positive_int, help=f"shard size in tokens (default {DEFAULT_TOKENS_PER_SHARD:,})")
    p.add_argument("--splits", nargs="+", choices=SPLITS, help="which splits to build (default: train val)")
    p.add_argument("--no-progress", action="store_true", help="hide the live progress bar (stderr); the summary table (stdout) is printed anyway")
    p.add_argument("--no-provenance", action="store_true",
                   help="do not write the per-shard provenance side files (`stacklm inspect OUT --row N` needs them)")
    p.add_argument("--sign-margin", type=non_negative_float, default=SIGN_MARGIN,
                   help=f"a budget well under its sources signs (global dedup) and reads only this many times the share of each "
                        f"file it needs (default {SIGN_MARGIN:g}); 0 signs the whole corpus")
    p.set_defaults(func=cmd_prebuild)

    v = subparsers.add_parser(
        "verify", help="check every shard and every token id of a prebuilt directory",
        description="Check every shard's size and content hash and every token id of a prebuilt directory.",
        epilog=VERIFY_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument("dir", help="a prebuilt directory (top level or one split)")
    v.add_argument("--tokenizer", help="also check the shards were built with this tokenizer")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.set_defaults(func=cmd_verify)

    g = subparsers.add_parser(
        "ledger", help="print a prebuild's token ledger (read = dropped + holdout + buffered + kept; kept = delivered + remainder)",
        description="The token ledger of a prebuilt directory, per split and source, in documents and tokens. "
        "Exit status 1 when an identity does not hold.",
        epilog=LEDGER_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g.add_argument("dir", help="a prebuilt directory (top level or one split)")
    g.add_argument("--json", action="store_true", help="print the ledger as JSON")
    g.set_defaults(func=cmd_ledger)

    x = subparsers.add_parser(
        "dedup-index",
        help="list the duplicate documents of a config's sources once (global exact + near pass) for stream mode",
        description="Global dedup over every source of the config (holdout and filters applied): the ids of the "
        "documents to drop, per split. Stream mode drops them when the pipeline config sets dedup.index: FILE. "
        "Runs here (--executor pool) or as datatrove stages on a local, Slurm or Ray executor (`pip install 'stacklm[scale]'`).",
        epilog=DEDUP_INDEX_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    x.add_argument("--config", required=True, action=OneConfig, help="a YAML path or a packaged config name (its data.pipeline sources)")
    x.add_argument("--out", help="index file to write (.npz; default: the config's data.pipeline.dedup.index); "
                   "on slurm/ray on a filesystem every node sees; or a URL (s3://...: written in --stage-dir, then uploaded)")
    x.add_argument("--splits", nargs="+", choices=SPLITS, help="splits to index (default: all)")
    x.add_argument("--executor", choices=("pool", "local", "slurm", "ray"), default="pool",
                   help="pool (default): this process and --workers local processes; local, slurm, ray: the prebuild's "
                   "datatrove stages (signatures, buckets, decision) and a one-task index stage; the file is the same")
    x.add_argument("--workers", type=positive_int,
                   help="pool: processes computing signatures (default 1); local: tasks run at once (default: all); "
                   "the result does not depend on it")
    x.add_argument("--tasks", type=positive_int,
                   help="local/slurm/ray (required there): signature tasks per split; the index is the same for every value")
    add_engine_arguments(x, ("signatures", "buckets", "decision", "index"))
    x.set_defaults(func=cmd_dedup_index)

    d = subparsers.add_parser(
        "prebuild-datatrove",
        help="`prebuild` as datatrove pipeline steps on a local, Slurm or Ray executor",
        description="The same shard set as `stacklm prebuild --workers TASKS`, built by datatrove tasks "
        "(stacklm.scale.datatrove_steps); needs `pip install 'stacklm[scale]'`.",
        epilog=DATATROVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument("--config", required=True, action=OneConfig, help="as for `prebuild`: a YAML path or a packaged config name")
    d.add_argument("--out", help="output directory on a filesystem every node sees (default: data.data_dir); or a URL "
                   "(s3://...: built in --stage-dir, then uploaded as `prebuild --out URL` uploads)")
    d.add_argument("--tokenizer", help="tokenizer artifact or its directory (default: data.tokenizer of the config)")
    d.add_argument("--tasks", type=positive_int, required=True, help="tasks per split (the result equals `stacklm prebuild --workers TASKS`)")
    d.add_argument("--tokens-per-shard", type=positive_int, help=f"shard size in tokens (default {DEFAULT_TOKENS_PER_SHARD:,})")
    d.add_argument("--executor", choices=("local", "slurm", "ray"), default="local", help="where the tasks run (default: local)")
    d.add_argument("--workers", type=int_at_least(1, also=(-1,), what=" (all)"), default=-1,
                   help="local: tasks run at once (default -1: all)")
    add_engine_arguments(d, ("signatures", "buckets", "decision", "main", "merge"))
    d.set_defaults(func=cmd_prebuild_datatrove)


def add_engine_arguments(p: argparse.ArgumentParser, stages: tuple[str, ...]) -> None:
    """The datatrove engine's flags of ``prebuild-datatrove`` and ``dedup-index`` (one list for
    both): logs, dedup key ranges, Slurm and Ray resources and options, ``--wait``. ``stages``:
    the command's stage names, for the help."""
    from stacklm.prebuild.cluster import STAGES

    parallel = ", ".join(s for s in stages if STAGES[s][0])
    p.add_argument("--logging-dir", help="datatrove logs/completions (default: OUT.datatrove-logs beside --out, or beside --stage-dir)")
    p.add_argument("--stage-dir", help="with a URL --out (s3://..., any fsspec URL): the local folder the tasks build in before this "
                   "command uploads the result; slurm/ray: required, a folder every node sees (local/pool default: "
                   "$STACKLM_CACHE_DIR/staging)")
    p.add_argument("--dedup-ranges", type=positive_int,
                   help="dedup bucket stage: key ranges per MinHash band and digest ranges, so 13 x this many tasks (default 1); "
                        "more spreads a large corpus over more nodes, the decision is the same")
    p.add_argument("--partition", help="slurm partition (required for slurm, here or as prebuild.cluster.partition)")
    p.add_argument("--qos", help="slurm QOS (default: the cluster's default; none is passed)")
    p.add_argument("--env-command", help="slurm: shell line each batch script runs first, e.g. 'source /shared/venv/bin/activate' "
                   "(default: none; the job inherits the submitting shell's environment)")
    p.add_argument("--sbatch-arg", action="append", metavar="KEY=VALUE",
                   help="slurm: extra '#SBATCH --KEY=VALUE' line for every job (repeatable), e.g. account=myproj")
    p.add_argument("--max-array-size", type=positive_int,
                   help="slurm: the cluster's MaxArraySize (`scontrol show config`); a stage with more tasks is several job arrays (default 1001)")
    p.add_argument("--stage-resources", action="append", metavar="STAGE=cpus:N,mem_gb:G,time:HH:MM:SS",
                   help=f"slurm/ray: one stage's per-task resources (repeatable; stages: {', '.join(stages)}; "
                   "any subset of the fields), e.g. decision=mem_gb:64,time:12:00:00")
    p.add_argument("--time", help=f"slurm: time limit per task of the parallel stages ({parallel}; default 04:00:00)")
    p.add_argument("--cpus-per-task", type=positive_int, help=f"slurm/ray: CPUs per task of the parallel stages ({parallel}; default 2)")
    p.add_argument("--mem-per-cpu-gb", type=positive_int, help=f"slurm/ray: memory per CPU in GB for the parallel stages ({parallel}; default 4)")
    p.add_argument("--wait", action="store_true",
                   help="slurm: wait for every job; exit non-zero at the first failed task, naming it and its log")
    p.add_argument("--poll-seconds", type=float, default=30.0, help="slurm --wait: seconds between queue checks (default 30)")
