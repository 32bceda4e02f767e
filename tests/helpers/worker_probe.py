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
