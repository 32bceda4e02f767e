"""Where a reader's time goes, stage by stage: ``StageClock`` (issue 35.3).

Each stage of a built graph (source, holdout, filter, decontaminate, dedup, tokenize per source;
mix, shuffle, pack, batch) is timed in its *own* work: the time in its ``next`` less the time in
the ``next`` of the stages it pulls from, summed over sources by stage name. The loader workers
send these seconds with their summaries, so the logs say which stage a data-bound step waits on.

Every call is timed: about 0.4 µs per stage call, some 3 µs per document through the nine
stages, which is noise beside encoding a document of a few hundred tokens (measured: a 3M-token
synthetic run took 1.59-2.35 CPU-s without the clock and 1.69-1.71 s with it). Sampling one
batch in eight was tried and dropped: the work is bursty (a tokenizer batch, a buffer filling
at the start), so a scaled sample was off by 7x on a short run. Nothing of it is in the state:
a resumed reader counts from its start.

Why our own: torchdata's nodes have no timing hook, and a profiler (cProfile, py-spy) is a
tool for a person at a terminal, not a number that reaches W&B from inside loader workers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any


class StageClock:
    """Installs itself on nodes (``wrap``) and answers ``seconds()``: stage name -> seconds of
    its own work so far, for the stages that have run (elastic stream mode batches a graph's
    windows itself: its ``batch`` stage never runs)."""

    def __init__(self) -> None:
        self._own: dict[str, float] = {}
        self._stack: list[float] = []  # per open call: the seconds its callees took

    def wrap(self, name: str, node: Any) -> None:
        inner = node.next
        own, stack, clock = self._own, self._stack, time.perf_counter

        def timed_next():
            t = clock()
            stack.append(0.0)
            try:
                return inner()
            finally:
                spent = clock() - t
                own[name] = own.get(name, 0.0) + spent - stack.pop()
                if stack:
                    stack[-1] += spent

        node.next = timed_next  # BaseNode.__next__ looks ``next`` up on the instance

    def seconds(self) -> dict[str, float]:
        return dict(self._own)


def install(clock: StageClock, chains: Mapping[str, Mapping[str, Any]], tail: Mapping[str, Any], root: Any) -> StageClock:
    """``clock`` on every node of a built graph: each source chain's stages by their stage
    name, the shared ``tail`` stages (mix, shuffle, pack) by theirs, ``root`` as ``batch``."""
    for chain in chains.values():
        for stage, node in chain.items():
            clock.wrap(stage, node)
    for stage, node in tail.items():
        clock.wrap(stage, node)
    clock.wrap("batch", root)
    return clock
