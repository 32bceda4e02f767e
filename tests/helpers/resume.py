"""One save/restore check for every resumable stream the tests build.

Modelled on torchdata's ``run_test_save_load_state`` (pytorch/data, ``test/nodes/utils.py``):
run the stream once uninterrupted; then, for each stop point, build a *fresh* graph, take
``stop`` items, save its state, build another fresh graph, restore the state there, and check
that the first graph's head plus the restored graph's continuation is exactly the uninterrupted
stream. Exact means exact: same items in the same order, arrays and tensors of the same type,
dtype, shape and values (``assert_same``), so a resume that drifts by one token fails.

What it adds to torchdata's version: several stop points per call (0, buffer and file
boundaries and the very end are where resume bugs live), an optional serialisation round trip
of the state (``"json"``, ``"pickle"``, ``"torch"``: whatever the code promises a checkpoint
survives), a cap for endless streams, and hooks for what a test checks beyond the stream (the
state's shape, counters after the resume). It works on torchdata nodes (``state_dict()`` /
``reset(state)``) and on loaders (``state_dict()`` / ``load_state_dict(state)``).

Resumes through a real Lightning ``Trainer`` (checkpoint file, crash, fresh trainer) are a
different shape: ``tests.helpers.datamodule.crash_and_resume``.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ROUND_TRIPS = ("json", "pickle", "torch")


def assert_same(a: Any, b: Any, where: str = "item") -> None:
    """Exact equality of two stream items, recursively: mappings (same keys), lists and tuples
    (same length), numpy arrays and torch tensors (same type, dtype, shape, values), anything
    else by ``==``. ``where`` names the place in the message when they differ."""
    if isinstance(a, Mapping):
        assert isinstance(b, Mapping), f"{where}: mapping vs {type(b).__name__}"
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} vs {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {type(a).__name__} of {len(a)} vs {b!r:.80}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{where}: ndarray vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert np.array_equal(a, b), f"{where}: values differ"
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: values differ"
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r:.80} != {b!r:.80}"


def assert_same_stream(got: list, want: list, where: str = "stream") -> None:
    """``assert_same`` over two whole streams, naming the first index that differs."""
    assert len(got) == len(want), f"{where}: {len(got)} items, expected {len(want)}"
    for i, (x, y) in enumerate(zip(got, want)):
        assert_same(x, y, f"{where}[{i}]")


def round_trip(state: Any, how: str | None) -> Any:
    """The state as a checkpoint gives it back: ``None`` (in memory, as is), ``"json"``,
    ``"pickle"`` or ``"torch"`` (``torch.save`` then ``torch.load(weights_only=True)``, what a
    Lightning checkpoint must survive without pickle trust)."""
    if how is None:
        return state
    if how == "json":
        return json.loads(json.dumps(state))
    if how == "pickle":
        return pickle.loads(pickle.dumps(state))
    if how == "torch":
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)
    raise ValueError(f"round trip must be one of {ROUND_TRIPS} or None, got {how!r}")


@dataclass
class Resume:
    """One stop point, handed to the hooks. ``restored`` is ``None`` in ``check_state``."""

    stop: int
    head: list  # the items the interrupted graph yielded before its state was saved
    state: Any  # after the round trip
    interrupted: Any  # what ``build`` returned, run to ``stop`` and saved
    restored: Any  # what ``build`` returned, restored from ``state``
    uninterrupted: Any  # what ``build`` returned for the uninterrupted run (drained)
    full: list  # the uninterrupted stream


Hook = Callable[[Resume], None]


def check_save_load_state(
    build: Callable[[], Any],
    stops: Iterable[int] | Callable[[int], Iterable[int]],
    *,
    node: Callable[[Any], Any] = lambda built: built,
    state_round_trip: str | None = None,
    limit: int | None = None,
    check_state: Hook | None = None,
    check_restored: Hook | None = None,
    check_resumed: Hook | None = None,
) -> list:
    """Check that saving and restoring at every stop continues the stream exactly; returns
    the uninterrupted stream.

    build: makes a fresh graph each call (same config, seed, inputs): a node, a loader, or an
        object that holds one (then ``node`` picks it, e.g. ``lambda pipe: pipe.batches``).
    stops: how many items to take before saving, or a function of the uninterrupted length
        (``lambda n: [0, n // 2, n]``). Each must be ``<= n``; ``n`` itself restores a finished
        stream, which must then yield nothing.
    state_round_trip: ``None``, ``"json"``, ``"pickle"`` or ``"torch"`` (see ``round_trip``).
    limit: compare only the first ``limit`` items (endless streams).
    check_state: called with the saved state (after the round trip), before it is restored.
    check_restored: called right after the restore, before the restored graph yields.
    check_resumed: called after the restored graph's continuation matched.
    """
    uninterrupted = build()
    full = _take(node(uninterrupted), limit)
    points = stops(len(full)) if callable(stops) else stops
    for stop in points:
        assert 0 <= stop <= len(full), f"stop {stop} outside the uninterrupted stream of {len(full)} items"
        interrupted = build()
        source = node(interrupted)
        it = iter(source)
        head = [next(it) for _ in range(stop)]
        record = Resume(stop, head, round_trip(source.state_dict(), state_round_trip), interrupted, None, uninterrupted, full)
        if check_state is not None:
            check_state(record)
        record.restored = build()
        _restore(node(record.restored), record.state)
        if check_restored is not None:
            check_restored(record)
        tail = _take(node(record.restored), None if limit is None else limit - stop)
        assert_same_stream(head + tail, full, f"resumed at {stop}")
        if check_resumed is not None:
            check_resumed(record)
    return full


def _take(source: Any, limit: int | None) -> list:
    it = iter(source)
    if limit is None:
        return list(it)
    return [next(it) for _ in range(limit)]


def _restore(source: Any, state: Any) -> None:
    # loaders (torchdata's Loader, StackDataLoader) load a state; a torchdata node resets to one
    if hasattr(source, "load_state_dict"):
        source.load_state_dict(state)
    else:
        source.reset(state)
