"""A loader ``worker_init_fn`` that records which heavy modules a worker has imported.

Kept apart from the test modules (which import Lightning), so that unpickling it in a worker
imports nothing but this file."""

from __future__ import annotations

import json
import os
import sys


def probe_modules(worker_id: int) -> None:
    found = {name: name in sys.modules for name in ("lightning", "lightning.pytorch", "wandb")}
    with open(f"{os.environ['STACKLM_TEST_PROBE']}{worker_id}", "w") as f:
        json.dump(found, f)
