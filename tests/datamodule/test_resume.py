"""The shared save/restore check (tests/helpers/resume.py) fails on the resume bugs it exists to catch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchdata.nodes import BaseNode, Loader

from tests.helpers.resume import assert_same, check_save_load_state, round_trip


class Counter(BaseNode[dict]):
    """Yields ``{"i": i, "ids": arange(i)}`` for i < n; ``skew`` makes a restore land off by that
    many items, ``dtype_after_restore`` changes the array dtype of items yielded after a restore."""

    def __init__(self, n: int, skew: int = 0, dtype_after_restore=None) -> None:
        super().__init__()
        self.n, self.skew, self.dtype_after_restore = n, skew, dtype_after_restore
        self.restored = False

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.i = 0 if initial_state is None else int(initial_state["i"]) + self.skew
        self.restored = initial_state is not None

    def next(self) -> dict:
        if self.i >= self.n:
            raise StopIteration
        dtype = self.dtype_after_restore if self.restored and self.dtype_after_restore else np.int64
        item = {"i": self.i, "ids": np.arange(self.i, dtype=dtype)}
        self.i += 1
        return item

    def get_state(self) -> dict:
        return {"i": self.i}


@pytest.mark.parametrize("how", [None, "json", "pickle", "torch"])
def test_an_exact_resume_passes_at_every_stop_and_round_trip(how):
    seen = []
    full = check_save_load_state(lambda: Counter(12), lambda n: range(n + 1), state_round_trip=how,
                                 check_state=lambda r: seen.append(("state", r.stop, r.state["i"])),
                                 check_resumed=lambda r: seen.append(("resumed", r.stop, r.restored.i)))
    assert [x["i"] for x in full] == list(range(12))
    assert seen == [(kind, k, k if kind == "state" else 12) for k in range(13) for kind in ("state", "resumed")]
    # a loader: its own state_dict / load_state_dict, an endless-stream cap
    assert len(check_save_load_state(lambda: Loader(Counter(12)), [0, 3, 7], limit=7)) == 7


@pytest.mark.parametrize("skew", [-1, 1])
def test_a_resume_off_by_one_item_fails(skew):
    with pytest.raises(AssertionError, match="resumed at 5"):
        check_save_load_state(lambda: Counter(12, skew=skew), [5])


def test_same_values_in_another_dtype_fail():
    with pytest.raises(AssertionError, match=r"resumed at 4\[4\]\['ids'\]: int32"):
        check_save_load_state(lambda: Counter(12, dtype_after_restore=np.int32), [4])
    with pytest.raises(AssertionError, match="int32"):
        assert_same(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(AssertionError, match="keys"):
        assert_same({"a": 1, "b": 2}, {"b": 2, "a": 1})
    with pytest.raises(AssertionError):
        assert_same([1, 2], (1, 2))


def test_bad_stops_and_round_trips_are_refused():
    with pytest.raises(AssertionError, match="stop 13 outside"):
        check_save_load_state(lambda: Counter(12), [13])
    with pytest.raises(ValueError, match="round trip"):
        round_trip({}, "yaml")
    with pytest.raises(Exception):  # numpy arrays need pickle trust: refused by weights_only
        round_trip({"a": np.zeros(2)}, "torch")
