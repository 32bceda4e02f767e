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

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.data.stats import StageStats

# Per-source status codes (kept as a small int array in the state).
ACTIVE, DONE, DRY = 0, 1, 2
_STATUS_NAMES = {ACTIVE: "active", DONE: "budget_met", DRY: "ran_dry"}


def split_budget(total: int, weights: np.ndarray) -> np.ndarray:
    """Integer shares of ``total`` proportional to ``weights`` that sum to ``total`` exactly.

    Largest remainder (ties to the earlier source), so the split is deterministic and no token
    is lost to rounding.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if total <= 0 or weights.sum() <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    exact = weights / weights.sum() * total
    shares = np.floor(exact).astype(np.int64)
    short = int(total - shares.sum())
    if short > 0:
        order = np.argsort(-(exact - shares), kind="stable")
        shares[order[:short]] += 1
    return shares


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
    """

    def __init__(self, names: list[str], weights: Mapping[str, float], total_tokens: int, seed: int = 0) -> None:
        if not names:
            raise ValueError("TokenBudgetMixer needs at least one source")
        if int(total_tokens) <= 0:
            raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
        self.names = list(names)
        self.weights = _validate_weights(self.names, weights)
        self.total_tokens = int(total_tokens)
        self.seed = int(seed)
        self.reset()

    # -- state ---------------------------------------------------------------------------
    def reset(self) -> None:
        n = len(self.names)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        self.budgets = split_budget(self.total_tokens, self.weights)
        self.tokens = np.zeros(n, dtype=np.int64)
        self.docs = np.zeros(n, dtype=np.int64)
        self.truncated_docs = np.zeros(n, dtype=np.int64)
        self.truncated_tokens = np.zeros(n, dtype=np.int64)
        self.empty_docs = np.zeros(n, dtype=np.int64)
        self.status = np.zeros(n, dtype=np.int8)
        # A source whose budget rounds to 0 has nothing to give.
        self.status[self.budgets == 0] = DONE

    def state(self) -> dict[str, Any]:
        return {
            "rng": self.rng.bit_generator.state,
            "budgets": self.budgets.copy(),
            "tokens": self.tokens.copy(),
            "docs": self.docs.copy(),
            "truncated_docs": self.truncated_docs.copy(),
            "truncated_tokens": self.truncated_tokens.copy(),
            "empty_docs": self.empty_docs.copy(),
            "status": self.status.copy(),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.reset()
        self.rng.bit_generator.state = state["rng"]
        for key in ("budgets", "tokens", "docs", "truncated_docs", "truncated_tokens", "empty_docs", "status"):
            arr = np.asarray(state[key])
            if arr.shape != (len(self.names),):
                raise ValueError(f"mix state field {key!r} has shape {arr.shape}, expected ({len(self.names)},): the state belongs to a different source list")
            getattr(self, key)[:] = arr

    # -- mixing --------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return not bool((self.status == ACTIVE).any())

    def pick(self) -> int:
        """Index of the source that gives the next document (``finished`` must be False)."""
        active = np.flatnonzero(self.status == ACTIVE)
        # First pass: every active source gives one document before lengths are estimated,
        # in seeded order.
        unseen = active[self.docs[active] + self.empty_docs[active] == 0]
        if len(unseen):
            return int(unseen[self.rng.integers(len(unseen))])
        remaining = (self.budgets[active] - self.tokens[active]).astype(np.float64)
        mean_len = np.maximum(self.tokens[active] / np.maximum(self.docs[active], 1), 1.0)
        p = np.cumsum(remaining / mean_len)
        return int(active[np.searchsorted(p, self.rng.random() * p[-1], side="right").clip(max=len(active) - 1)])

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
                doc = {**doc, "ids": ids[:room]}
                n = room
            self.status[index] = DONE
        self.tokens[index] += n
        self.docs[index] += 1
        return doc

    def mark_dry(self, index: int) -> None:
        """Source ``index`` has no more documents: share its unmet budget among every source
        that still has data, by their renormalised weights. A source that had already met its
        budget and receives a share becomes active again, so the total is met while any source
        has data, whenever the dry one runs out."""
        self.status[index] = DRY
        deficit = int(self.budgets[index] - self.tokens[index])
        self.budgets[index] = self.tokens[index]
        alive = np.flatnonzero(self.status != DRY)
        if deficit > 0 and len(alive):
            self.budgets[alive] += split_budget(deficit, self.weights[alive])
            self.status[alive[self.budgets[alive] > self.tokens[alive]]] = ACTIVE

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
        moved), target and realized token share, truncation/empty counts, status."""
        total = max(int(self.tokens.sum()), 1)
        wsum = self.weights.sum()
        planned = split_budget(self.total_tokens, self.weights)
        return {
            name: {
                "tokens": int(self.tokens[i]),
                "docs": int(self.docs[i]),
                "planned_budget": int(planned[i]),
                "budget": int(self.budgets[i]),
                "target_weight": float(self.weights[i] / wsum),
                "realized_weight": float(self.tokens[i] / total),
                "truncated_docs": int(self.truncated_docs[i]),
                "truncated_tokens": int(self.truncated_tokens[i]),
                "empty_docs": int(self.empty_docs[i]),
                "status": _STATUS_NAMES[int(self.status[i])],
            }
            for i, name in enumerate(self.names)
        }

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
    sources: Mapping[str, Iterator[dict]], weights: Mapping[str, float], total_tokens: int, seed: int = 0
) -> Iterator[dict]:
    """Convenience: mix plain iterators of tokenized documents to exact token budgets."""
    return TokenBudgetMixer(list(sources), weights, total_tokens, seed)(sources)


class MixNode(BaseNode[dict]):
    """``torchdata.nodes`` wrapper of ``TokenBudgetMixer`` over child nodes.

    Like ``MultiNodeWeightedSampler``, the state holds every child's state next to the
    mixer's own (RNG state + per-source counters); the mixer never buffers, so the children's
    states line up with what has been emitted.
    """

    SOURCES_KEY = "sources"
    MIXER_KEY = "mixer"

    def __init__(self, sources: Mapping[str, BaseNode], weights: Mapping[str, float], total_tokens: int, seed: int = 0) -> None:
        super().__init__()
        self.sources = dict(sources)
        self.mixer = TokenBudgetMixer(list(self.sources), weights, total_tokens, seed)
        self._streams = [self.sources[n] for n in self.mixer.names]

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
