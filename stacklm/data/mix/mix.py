"""Budgeted weighted mixing of tokenized sources.

Each source gets a token budget ``weight / sum(weights) * total_tokens`` (integers by largest
remainder, so the budgets add up to ``total_tokens`` exactly). Budgets are *met exactly*: the
document that would overshoot its source's budget is truncated to fit, and that truncation is
counted (``truncated_docs`` / ``truncated_tokens``). A source that runs dry before its budget
drops out and its unmet tokens are shared among the sources that still have data in
proportion to their weights (renormalised over them), so the total is still met while any
source has data.

Which source the next document comes from is a seeded draw with probability proportional to
the source's *expected remaining documents* (remaining budget / mean document length so far).
Why not plain ``weights`` like ``torchdata.nodes.MultiNodeWeightedSampler``: those weight
documents, not tokens, so a source with long documents (code) would take far more than its
token share early and then vanish from the end of the stream. Drawing by remaining documents
keeps every source's progress through its budget level along the whole stream, and it
renormalises by itself when a source leaves.

Budgets count document tokens (``ids``, no ``<bos>/<eos>``; packing adds those).

``TokenBudgetMixer`` is the plain logic over iterators; ``MixNode`` is the stateful
``torchdata.nodes`` wrapper whose state holds the children's states, the RNG state and the
per-source counters (a few small int arrays), so a resumed stream continues bit for bit.
"""

from __future__ import annotations

import functools
from bisect import bisect_right

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.data.doc_refs import CUT_FIELD
from stacklm.data.mix.schedule import (
    MixPlan,
    MixScheduleConfig,
    compile_schedule,
    phase_report,
    split_budget,
)
from stacklm.data.stats import StageStats

__all__ = ["MixNode", "TokenBudgetMixer", "mix_budgeted", "split_budget"]

# Per-source status codes (kept as a small int array in the state).
ACTIVE, DONE, DRY = 0, 1, 2
_STATUS_NAMES = {ACTIVE: "active", DONE: "budget_met", DRY: "ran_dry"}


def _validate_weights(names: list[str], weights: Mapping[str, float]) -> np.ndarray:
    if set(names) != set(weights) or len(names) != len(weights):
        raise ValueError(
            f"mix weights must name exactly the sources: sources={sorted(names)}, weights={sorted(weights)}; "
            "give one weight per source"
        )
    w = np.array([float(weights[n]) for n in names], dtype=np.float64)
    bad = [n for n, x in zip(names, w) if not np.isfinite(x) or x <= 0]
    if bad:
        raise ValueError(f"mix weight of source(s) {bad} must be a positive number; drop a source instead of giving it weight 0")
    return w


class TokenBudgetMixer:
    """Mix tokenized documents from several sources to exact per-source token budgets.

    ``pick()`` chooses the source of the next document; ``admit(index, doc)`` accounts for it
    (truncating it to the budget if needed) and returns the document to emit or ``None`` when
    it was dropped (empty). ``mark_dry(index)`` is called when a source runs out. ``__iter__``
    drives all three over plain iterators; ``MixNode`` drives them over nodes.

    With a ``schedule`` (``stacklm.data.mix.schedule``) the budgets are cumulative per segment of
    the schedule: ``pick`` draws among the sources still short of the current segment's budget
    and moves to the next segment once every source met it (a document may overshoot a
    segment's budget, the next segment simply needs that much less; only the final budget
    truncates). Without one there is a single segment and the mix is the plain one above.
    ``set_weights`` replaces the weights for the rest of the budget (online re-weighting).
    """

    def __init__(
        self,
        names: list[str],
        weights: Mapping[str, float],
        total_tokens: int,
        seed: int = 0,
        schedule: MixScheduleConfig | None = None,
        size_scale: float = 1.0,
    ) -> None:
        if not names:
            raise ValueError("TokenBudgetMixer needs at least one source")
        if int(total_tokens) <= 0:
            raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
        self.names = list(names)
        self.weights = _validate_weights(self.names, weights)
        self.total_tokens = int(total_tokens)
        self.seed = int(seed)
        self.schedule = schedule
        self.initial_plan: MixPlan = compile_schedule(schedule, self.names, self.weights, self.total_tokens, size_scale)
        self.reset()

    # -- state ---------------------------------------------------------------------------
    _COUNTERS = ("tokens", "docs", "truncated_docs", "truncated_tokens", "empty_docs", "status")
    _PLAN = ("plan", "seg_weights", "seg_phase", "phase_plan", "phase_tokens", "phase_docs", "phase_entered")

    def reset(self) -> None:
        n = len(self.names)
        plan = self.initial_plan
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        self.plan = plan.budgets.copy()  # (segments, sources) cumulative budgets
        self.seg_weights = plan.weights.copy()
        self.seg_phase = plan.phase.copy()
        self.segment = 0
        inc = np.diff(np.vstack([np.zeros((1, n), np.int64), plan.budgets]), axis=0)
        self.phase_names = list(plan.phase_names)
        self.phase_plan = np.stack([inc[plan.phase == p].sum(axis=0) for p in range(len(self.phase_names))])
        self.phase_tokens = np.zeros_like(self.phase_plan)
        self.phase_docs = np.zeros_like(self.phase_plan)
        self.phase_entered = np.full(len(self.phase_names), -1, dtype=np.int64)  # tokens mixed when entered
        self.phase_entered[0] = 0
        self.tokens = np.zeros(n, dtype=np.int64)
        self.docs = np.zeros(n, dtype=np.int64)
        self.truncated_docs = np.zeros(n, dtype=np.int64)
        self.truncated_tokens = np.zeros(n, dtype=np.int64)
        self.empty_docs = np.zeros(n, dtype=np.int64)
        self.status = np.zeros(n, dtype=np.int8)
        # A source whose budget rounds to 0 has nothing to give.
        self.status[self.budgets == 0] = DONE

    @property
    def budgets(self) -> np.ndarray:
        """Each source's final budget (after dry sources' shares and re-weightings moved)."""
        return self.plan[-1]

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rng": self.rng.bit_generator.state, "segment": self.segment, "phase_names": list(self.phase_names)}
        for key in self._COUNTERS + self._PLAN:
            out[key] = getattr(self, key).copy()
        return out

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.reset()
        n = len(self.names)
        self.rng.bit_generator.state = state["rng"]
        for key in self._COUNTERS:
            arr = np.asarray(state[key])
            if arr.shape != (n,):
                raise ValueError(f"mix state field {key!r} has shape {arr.shape}, expected ({n},): the state belongs to a different source list")
            getattr(self, key)[:] = arr
        if "plan" not in state:  # saved before mixture schedules: one segment, the saved budgets
            if self.schedule is not None:
                raise ValueError("mix state has no schedule plan (saved before mixture schedules); it cannot resume a scheduled mix")
            self.plan = np.asarray(state["budgets"], dtype=np.int64)[None, :].copy()
            self.phase_tokens[0], self.phase_docs[0] = self.tokens, self.docs
            return
        for key in self._PLAN:
            arr = np.array(state[key], dtype=getattr(self, key).dtype)
            if arr.ndim == 2 and arr.shape[1] != n:
                raise ValueError(f"mix state field {key!r} has {arr.shape[1]} sources, expected {n}: the state belongs to a different source list")
            setattr(self, key, arr)
        self.segment = int(state["segment"])
        self.phase_names = [str(x) for x in state["phase_names"]]

    # -- mixing --------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return not bool((self.status == ACTIVE).any())

    def _candidates(self) -> list[int]:
        """Active sources short of the current segment's budget, moving to the next segment
        (and phase) once there are none; on the last segment these are all active sources."""
        tokens = self.tokens.tolist()
        active = [i for i, s in enumerate(self.status.tolist()) if s == ACTIVE]
        while True:
            plan = self.plan[self.segment].tolist()
            short = [i for i in active if tokens[i] < plan[i]]
            if short or self.segment == len(self.plan) - 1:
                return short
            self.segment += 1
            phase = int(self.seg_phase[self.segment])
            if self.phase_entered[phase] < 0:
                self.phase_entered[phase] = int(self.tokens.sum())

    def pick(self) -> int:
        """Index of the source that gives the next document (``finished`` must be False).

        Plain Python over a handful of sources: it runs once per document, and numpy on arrays
        this small cost ~100 us a call (12 % of a reader's main thread, bench/pipeline.py). The
        arithmetic is numpy's, step for step (int -> float64 exactly, IEEE division, a running
        sum as ``np.cumsum``, ``bisect_right`` as ``searchsorted(side="right")``), and the random
        draws are the same calls, so every pick is what it was (tests/data/test_mix.py)."""
        active = self._candidates()
        docs, empty = self.docs.tolist(), self.empty_docs.tolist()
        # First pass: every active source gives one document before lengths are estimated,
        # in seeded order.
        unseen = [i for i in active if docs[i] + empty[i] == 0]
        if unseen:
            return unseen[int(self.rng.integers(len(unseen)))]
        tokens, plan = self.tokens.tolist(), self.plan[self.segment].tolist()
        cumulative, total = [], 0.0
        for i in active:  # remaining tokens / mean document length: the expected documents still to draw
            total += float(plan[i] - tokens[i]) / max(tokens[i] / max(docs[i], 1), 1.0)
            cumulative.append(total)
        return active[min(bisect_right(cumulative, self.rng.random() * total), len(active) - 1)]

    def admit(self, index: int, doc: dict) -> dict | None:
        ids = doc["ids"]
        n = len(ids)
        if n == 0:
            self.empty_docs[index] += 1
            return None
        room = int(self.budgets[index] - self.tokens[index])
        if n >= room:
            if n > room:
                self.truncated_docs[index] += 1
                self.truncated_tokens[index] += n - room
                doc = {**doc, "ids": ids[:room], CUT_FIELD: n}  # the uncut length: a checkpoint re-reads it by position
                n = room
            self.status[index] = DONE
        self.tokens[index] += n
        self.docs[index] += 1
        phase = int(self.seg_phase[self.segment])
        self.phase_tokens[phase, index] += n
        self.phase_docs[phase, index] += 1
        return doc

    def _share(self, segment: int, amount: int, among: np.ndarray) -> np.ndarray:
        """``amount`` tokens split among sources ``among`` by segment ``segment``'s weights
        (the base weights where those are all 0 there)."""
        w = self.seg_weights[segment, among]
        return split_budget(amount, w if w.sum() > 0 else self.weights[among])

    def mark_dry(self, index: int) -> None:
        """Source ``index`` has no more documents: share its unmet budget among every source
        that still has data, segment by segment by the segments' weights. A source that had
        already met its budget and receives a share becomes active again, so the total is met
        while any source has data, whenever the dry one runs out."""
        self.status[index] = DRY
        seg, have = self.segment, int(self.tokens[index])
        cum = np.maximum(self.plan[seg:, index], have)
        deficit = np.diff(np.concatenate([[have], cum]))  # per remaining segment
        self.plan[seg:, index] = have
        alive = np.flatnonzero(self.status != DRY)
        if deficit.sum() > 0 and len(alive):
            add = np.stack([self._share(seg + j, int(d), alive) for j, d in enumerate(deficit)])
            self.plan[seg:, alive] += np.cumsum(add, axis=0)
            self.status[alive[self.budgets[alive] > self.tokens[alive]]] = ACTIVE

    def set_weights(self, weights: Mapping[str, float], name: str) -> None:
        """From here on, mix the rest of the budget by ``weights`` (replacing the schedule's
        remaining phases) as a new phase ``name``. Sources already dry stay out; weights may
        be 0 but not all of the live ones."""
        w = np.array([float(weights[n]) if n in weights else -1.0 for n in self.names])
        if set(weights) != set(self.names) or not np.isfinite(w).all() or (w < 0).any():
            raise ValueError(f"mix weights must give a number >= 0 for exactly the sources {self.names}, got {dict(weights)}")
        alive = np.flatnonzero(self.status != DRY)
        if not len(alive) or w[alive].sum() <= 0:
            raise ValueError(f"mix weights {dict(weights)} give no weight to any source that still has data")
        w = w / w.sum()
        remaining = int(max(0, int(self.budgets[alive].sum() - self.tokens[alive].sum())))
        final = self.tokens.copy()
        final[alive] += split_budget(remaining, w[alive])
        phase = len(self.phase_names)
        self.phase_names.append(str(name))
        self.phase_plan = np.vstack([self.phase_plan, final - self.tokens])
        self.phase_tokens = np.vstack([self.phase_tokens, np.zeros(len(self.names), np.int64)])
        self.phase_docs = np.vstack([self.phase_docs, np.zeros(len(self.names), np.int64)])
        self.phase_entered = np.append(self.phase_entered, int(self.tokens.sum()))
        self.plan, self.seg_weights = final[None, :], w[None, :]
        self.seg_phase, self.segment = np.array([phase], np.int64), 0
        done = self.status != DRY
        self.status[done & (final > self.tokens)] = ACTIVE
        self.status[done & (final <= self.tokens)] = DONE

    def draw(self, streams: Sequence[Iterator[dict]]) -> dict:
        """The next admitted document, pulled from ``streams[i]`` (in ``names`` order) for
        each picked source ``i``; ``StopIteration`` once every budget is met or every source dry."""
        while not self.finished:
            i = self.pick()
            try:
                doc = next(streams[i])
            except StopIteration:
                self.mark_dry(i)
                continue
            out = self.admit(i, doc)
            if out is not None:
                return out
        raise StopIteration

    def __call__(self, sources: Mapping[str, Iterator[dict]]) -> Iterator[dict]:
        """Mix plain iterators (keys must match ``names``)."""
        its = [iter(sources[n]) for n in self.names]
        while True:
            try:
                yield self.draw(its)
            except StopIteration:
                return

    # -- reporting -----------------------------------------------------------------------
    def realized(self) -> dict[str, dict[str, Any]]:
        """Per source: tokens/docs emitted, planned and current budget (after dry sources' shares
        moved), target and realized token share, truncation/empty counts, status. The target
        share is the planned budget's (the schedule's average over the run, caps applied)."""
        total = max(int(self.tokens.sum()), 1)
        planned = self.initial_plan.budgets[-1]
        target = self.weights / self.weights.sum() if self.schedule is None else planned / max(int(planned.sum()), 1)
        return {
            name: {
                "tokens": int(self.tokens[i]),
                "docs": int(self.docs[i]),
                "planned_budget": int(planned[i]),
                "budget": int(self.budgets[i]),
                "target_weight": float(target[i]),
                "realized_weight": float(self.tokens[i] / total),
                "truncated_docs": int(self.truncated_docs[i]),
                "truncated_tokens": int(self.truncated_tokens[i]),
                "empty_docs": int(self.empty_docs[i]),
                "status": _STATUS_NAMES[int(self.status[i])],
            }
            for i, name in enumerate(self.names)
        }

    def phases(self) -> list[dict[str, Any]]:
        """Per phase (schedule phases, then re-weightings): planned and mixed tokens and docs per
        source, target and realized token shares, and the tokens mixed when it began (``None``
        if not reached). ``stacklm.data.mix.schedule.merge_phase_reports`` sums them over readers."""
        return [
            phase_report(name, self.names, self.phase_plan[p], self.phase_tokens[p], self.phase_docs[p],
                         None if self.phase_entered[p] < 0 else int(self.phase_entered[p]))
            for p, name in enumerate(self.phase_names)
        ]

    def stats(self) -> StageStats:
        """Kept/dropped counts in the shared ``StageStats`` shape (documents, plus cut tokens)."""
        st = StageStats("mix")
        for i, name in enumerate(self.names):
            st.add(name, "kept", int(self.docs[i]))
            st.add(name, "truncated_to_budget", int(self.truncated_docs[i]))
            st.add(name, "tokens_cut_by_budget", int(self.truncated_tokens[i]))
            st.add(name, "empty", int(self.empty_docs[i]))
        return st


def mix_budgeted(
    sources: Mapping[str, Iterator[dict]], weights: Mapping[str, float], total_tokens: int, seed: int = 0,
    schedule: MixScheduleConfig | None = None,
) -> Iterator[dict]:
    """Convenience: mix plain iterators of tokenized documents to exact token budgets."""
    return TokenBudgetMixer(list(sources), weights, total_tokens, seed, schedule)(sources)


class MixNode(BaseNode[dict]):
    """``torchdata.nodes`` wrapper of ``TokenBudgetMixer`` over child nodes.

    Like ``MultiNodeWeightedSampler``, the state holds every child's state next to the
    mixer's own (RNG state + per-source counters); the mixer never buffers, so the children's
    states line up with what has been emitted.
    """

    SOURCES_KEY = "sources"
    MIXER_KEY = "mixer"

    def __init__(
        self,
        sources: Mapping[str, BaseNode],
        weights: Mapping[str, float],
        total_tokens: int,
        seed: int = 0,
        schedule: MixScheduleConfig | None = None,
        size_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.sources = dict(sources)
        self.mixer = TokenBudgetMixer(list(self.sources), weights, total_tokens, seed, schedule, size_scale)
        self._streams = [self.sources[n] for n in self.mixer.names]
        for i, node in enumerate(self._streams):
            if hasattr(node, "demand"):  # a TokenizeNode: read about what this source's budget still takes
                node.demand = functools.partial(self._demand, i)

    def _demand(self, index: int) -> int:
        """Tokens source ``index`` may still give (its final budget less what it gave)."""
        m = self.mixer
        return int(m.budgets[index] - m.tokens[index]) if m.status[index] == ACTIVE else 0

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.mixer.reset()
            for node in self.sources.values():
                node.reset()
            return
        missing = set(self.sources) - set(initial_state[self.SOURCES_KEY])
        if missing:
            raise ValueError(f"MixNode state has no entry for source(s) {sorted(missing)}; it was saved with a different mix")
        self.mixer.load_state(initial_state[self.MIXER_KEY])
        for name, node in self.sources.items():
            node.reset(initial_state[self.SOURCES_KEY][name])

    def next(self) -> dict:
        return self.mixer.draw(self._streams)

    def get_state(self) -> dict[str, Any]:
        return {
            self.MIXER_KEY: self.mixer.state(),
            self.SOURCES_KEY: {name: node.state_dict() for name, node in self.sources.items()},
        }

    def realized(self) -> dict[str, dict[str, Any]]:
        return self.mixer.realized()

    def phases(self) -> list[dict[str, Any]]:
        return self.mixer.phases()

    def set_weights(self, weights: Mapping[str, float], name: str) -> None:
        """Re-weight the rest of the budget from the next document on (``TokenBudgetMixer.set_weights``)."""
        self.mixer.set_weights(weights, name)
