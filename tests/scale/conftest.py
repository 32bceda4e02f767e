"""Fixtures the ``tests/scale`` modules share: a fake Slurm on ``PATH`` and a local Ray cluster."""

from __future__ import annotations

import pytest

from tests.helpers import fake_slurm


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """The fake Slurm (``tests/helpers/fake_slurm.py``) first on ``PATH``, 4 array tasks at once."""
    fs = fake_slurm.install(tmp_path / "fake-slurm")
    for k, v in fs.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FAKE_SLURM_PARALLEL", "4")
    return fs


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray cluster of 2 CPUs for one module's in-process Ray tests, its workers with a
    private TMPDIR (datatrove's Ray task writes its log to TMPDIR/ray_logs/logs/task_N.log before
    copying it, a path every stage, build and user of the node would share)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TMPDIR": str(tmp_path_factory.mktemp("ray-tmp"))}})
    yield ray
    ray.shutdown()
