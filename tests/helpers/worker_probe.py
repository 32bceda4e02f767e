"""A loader ``worker_init_fn`` that records which heavy modules a worker has imported.

Kept apart from the test modules (which import Lightning), so that unpickling it in a worker
imports nothing but this file."""

from __future__ import annotations

import json
import os
import sys


def probe_modules(worker_id: int) -> None:
    """Writes ``{module: imported?}`` (and the probe variable of the environment) to
    ``$STACKLM_TEST_PROBE<worker_id>``, after the loader's own ``worker_init_fn``."""
    found = {name: name in sys.modules for name in ("lightning", "lightning.pytorch", "wandb")}
    with open(f"{os.environ['STACKLM_TEST_PROBE']}{worker_id}", "w") as f:
        json.dump(found, f)


class ThenProbe:
    """Run the loader's own ``worker_init_fn`` first, then ``probe_modules``."""

    def __init__(self, first) -> None:
        self.first = first

    def __call__(self, worker_id: int) -> None:
        self.first(worker_id)
        probe_modules(worker_id)


class ConfigProbe:
    """Run the loader's own ``worker_init_fn`` first, then write to ``<path><worker_id>`` the
    class of the pipeline config the worker's dataset holds, and count (in
    ``<path><worker_id>.parses``, a line per call) every config parse the worker makes."""

    def __init__(self, first, path: str) -> None:
        self.first, self.path = first, path

    def __call__(self, worker_id: int) -> None:
        from torch.utils.data import get_worker_info

        from stacklm.data.pipeline import PipelineConfig
        from stacklm.data.sft import SFTConfig

        self.first(worker_id)
        parses = f"{self.path}{worker_id}.parses"
        for cls in (PipelineConfig, SFTConfig):
            parse = cls.from_dict.__func__

            def counted(klass, data, path="", _parse=parse):
                with open(parses, "a") as f:
                    f.write(f"{klass.__name__}\n")
                return _parse(klass, data, path)

            cls.from_dict = classmethod(counted)
        config = get_worker_info().dataset.build.config
        with open(f"{self.path}{worker_id}", "w") as f:
            json.dump({"config": f"{type(config).__module__}.{type(config).__qualname__}"}, f)
