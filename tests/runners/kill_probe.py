"""Kill a real ``stacklm prebuild --workers N`` with SIGKILL and watch what its workers do after;
or be the parent of a shards loader's workers, to be killed.

Run as a script (``tests/test_parent_death.py`` does), so that it can make itself a *child
subreaper* (``PR_SET_CHILD_SUBREAPER``) without touching the test process: orphans of the killed
prebuild are then re-parented to this script instead of PID 1, as they are under
``docker --init``, tini, systemd or any supervisor that sets it. That matters because a worker
that only checks ``os.getppid() == 1`` does not notice its parent is gone there.

    python tests/runners/kill_probe.py prebuild --config C --out OUT --workers 2 --kill-at SHARDS|startup [--subreaper]
    python tests/runners/kill_probe.py loader --data SPLIT_DIR --context fork|forkserver

``--kill-at startup``: as soon as the pool's worker processes exist (they are still importing,
before their initializer runs: the race ``PR_SET_PDEATHSIG`` alone leaves open).
``--kill-at N``: once ``OUT/train`` holds N shards. Prints one JSON object: the prebuild's child
processes at the kill, the shard count at the signal, once the parent had exited (reaped) and
at the end, how long until none of its processes ran (from the parent's exit), the directory
listing (name, size, mtime_ns) once they were gone and 2 s later, and the ``.tmp-*`` files at
each point.

``loader``: iterate a ``ShardsLoader`` with 2 workers (fork: what shards mode uses) or a
``DataLoader`` with the stream modes' forkserver context and ``WorkerEnv``, print
``ready`` once the first batch is in, then sleep until killed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def children(pid: int) -> dict[int, str]:
    """Live (not zombie) processes whose parent is ``pid``: pid -> command line."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state not in "ZX":
            out[int(entry)] = cmd.strip()
    return out


def running(pids) -> list[int]:
    """Those of ``pids`` that still run (gone or zombie = not running)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in "ZX":
            alive.append(pid)
    return alive


def reap() -> None:
    """Collect exited orphans re-parented to this subreaper (they would stay zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def listing(out: Path) -> dict[str, list[int]]:
    return {str(p.relative_to(out)): [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(out.rglob("*")) if p.is_file()}


def shard_count(out: Path) -> int:
    d = out / "train"
    return len(list(d.glob("*.meta.bin"))) if d.is_dir() else 0


def loader_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--context", choices=("fork", "forkserver"), required=True)
    args = p.parse_args(argv)
    import torch

    from stacklm.data.storage.dataset import PackedMemmapDataset
    from stacklm.datamodule.resume.sampler import ElasticSampler

    ds = PackedMemmapDataset(args.data)
    if args.context == "fork":  # shards mode's loader, as the datamodule builds it
        from stacklm.datamodule.shards_loader import ShardsLoader

        loader = ShardsLoader(ds, ElasticSampler(ds, 2, rank=0, world_size=1), batch_size=2, rank=0, world_size=1, num_workers=2)
    else:  # the stream modes' worker start-up (forkserver + WorkerEnv) on the same rows
        from stacklm.datamodule.workers import WorkerEnv, worker_context

        loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=worker_context("forkserver"),
                                             worker_init_fn=WorkerEnv(os.environ))
    it = iter(loader)
    next(it)
    print("ready", flush=True)
    time.sleep(600)


def main() -> None:
    if sys.argv[1] == "loader":
        return loader_main(sys.argv[2:])
    assert sys.argv[1] == "prebuild", sys.argv
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tokens-per-shard", default="1024")
    p.add_argument("--kill-at", required=True)
    p.add_argument("--subreaper", action="store_true")
    p.add_argument("--timeout", type=float, default=240)
    args = p.parse_args(sys.argv[2:])
    if args.subreaper:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    out = Path(args.out)
    cmd = [sys.executable, "-m", "stacklm", "prebuild", "--config", args.config, "--out", str(out), "--workers",
           str(args.workers), "--tokens-per-shard", args.tokens_per_shard, "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + args.timeout
    pool: dict[int, str] = {}
    while proc.poll() is None and time.monotonic() < deadline:
        kids = children(proc.pid)
        pool = {k: c for k, c in kids.items() if "multiprocessing.spawn" in c or "spawn_main" in c}
        if args.kill_at == "startup" and len(pool) >= args.workers:
            break
        if args.kill_at != "startup" and shard_count(out) >= int(args.kill_at):
            break
        time.sleep(0.002)
    else:
        raise SystemExit(f"the prebuild ended (rc={proc.poll()}) or timed out before the kill: {proc.stderr.read().decode()[-3000:]}")
    kids = children(proc.pid)  # every process of the prebuild at the kill (pool workers, resource tracker)
    shards_at_kill = shard_count(out)
    t_signal = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # The kernel tells the workers (PR_SET_PDEATHSIG) and re-parents them only once the parent
    # has exited, after it tore down its memory: jobs run on until then.
    t_kill = time.monotonic()
    shards_at_death = shard_count(out)
    while running(kids) and time.monotonic() - t_kill < 10:
        reap()
        time.sleep(0.005)
    gone_after = time.monotonic() - t_kill
    still = running(kids)
    first = listing(out)
    time.sleep(2.0)
    reap()
    second = listing(out)
    tmp = lambda lst: sorted(k for k in lst if Path(k).name.startswith(".tmp-"))  # noqa: E731
    print(json.dumps({
        "kill_at": args.kill_at, "shards_at_kill": shards_at_kill, "shards_at_parent_death": shards_at_death,
        "shards_after": shard_count(out), "parent_exit_seconds": round(t_kill - t_signal, 3),
        "processes": {str(k): v for k, v in kids.items()}, "pool_workers": sorted(pool),
        "seconds_until_none_ran": round(gone_after, 3), "still_running": still,
        "changed_after": sorted(k for k in set(first) | set(second) if first.get(k) != second.get(k)),
        "tmp_when_gone": tmp(first), "tmp_2s_later": tmp(second),
    }))


if __name__ == "__main__":
    main()
