"""A URL ``--out`` (``s3://bucket/prefix``, any fsspec URL) for the commands whose work runs as
datatrove tasks, ``prebuild-datatrove`` and ``dedup-index``: where the output is staged, what is
refused before any work starts, and the upload of a staged index file.

The tasks write local files, so a URL output is built in a local staging folder and uploaded
from the command's own process once every task has completed: a shard set through
``build.prebuild_remote`` (the path ``stacklm prebuild --out URL`` takes: shards, then
manifests, the top manifest last, resumed from the staging folder after a crash), stream
mode's index file with one PUT (``remote.put_file``: an object appears whole or not at all).

Where the staging folder lives: with the local executor (and ``dedup-index``'s pool), this
machine's cache (``remote.staging_dir``, a folder per command and URL). On Slurm and Ray the
tasks run on other nodes, so the folder must be one every node sees and only the user knows
one: ``--stage-dir`` is required there. Slurm needs ``--wait`` too: without it the command
returns once the jobs are submitted, and no process would be left to upload.
"""

from __future__ import annotations

from pathlib import Path

from stacklm.data.storage import remote
from stacklm.errors import UserError

# the executors whose tasks run on other machines than the command's
CLUSTER_EXECUTORS = ("slurm", "ray")


def stage_for(url: str, *, command: str, executor: str, stage_dir: str | None, wait: bool) -> Path:
    """The local folder a ``command --out URL`` run builds in, after the checks that refuse, in
    one line and before anything is written, a URL the run could not serve: a protocol without
    a filesystem here (unknown, or its package missing), a missing bucket or refused
    credentials, a cluster run without a staging folder every node sees, Slurm without ``--wait``."""
    remote.filesystem(url)
    if executor in CLUSTER_EXECUTORS and not stage_dir:
        raise UserError(f"--out {url} with --executor {executor}: the tasks run on other nodes and build into a staging folder "
                        "that this command uploads once every task has completed; pass --stage-dir DIR, a folder every node "
                        "sees (e.g. beside the run's logs)")
    if executor == "slurm" and not wait:
        raise UserError(f"--out {url} with --executor slurm needs --wait: the upload runs in this command once every task "
                        "has completed")
    remote.check_reachable(url)
    return Path(stage_dir).absolute() if stage_dir else remote.staging_dir(url, command)


def staged_file(url: str, stage: Path) -> Path:
    """Where ``dedup-index --out URL`` writes the file before uploading it: the URL's file name
    in ``stage``; a URL that names no file (a bare bucket, a trailing ``/``) is refused."""
    name = url.split("://", 1)[1].rsplit("/", 1)
    if len(name) < 2 or not name[1] or name[1] in (".", ".."):
        raise UserError(f"--out {url} names no file; give the index file's URL, e.g. {url.rstrip('/')}/dedup.npz")
    return stage / name[1]


def upload_staged_file(local: Path, url: str, say=None) -> None:
    """Upload the finished ``local`` file to ``url`` (retried on throttling, one error line naming
    the URL on a permanent failure), then remove it; the folder around it stays if anything else
    is in it (the run's logs). An index's evidence beside it (``X.evidence.npz``) goes first, to
    the same place."""
    from stacklm.data.dedup.evidence import evidence_path

    why = evidence_path(local)
    if why.exists():
        remote.put_file(why, url.rsplit("/", 1)[0] + "/" + why.name)
        why.unlink()
    remote.put_file(local, url)
    local.unlink()
    if local.parent == remote.staging_dir(url, "dedup-index") and not any(local.parent.iterdir()):
        local.parent.rmdir()  # the cache's stage with nothing else in it (the pool's); never a --stage-dir
    if say is not None:
        say(f"uploaded {local.name} to {url}")
