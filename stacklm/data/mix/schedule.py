"""Mixture schedules: the target mix as a function of the tokens consumed so far.

A schedule is a list of *phases*, each ending at a fraction of the token budget (``until``).
A phase's weights are given (``weights``), derived from source sizes by temperature sampling
(``temperature``: ``p_i ∝ n_i^(1/T)``), or default to the mix entries' weights; a phase with
``ramp: true`` moves linearly from the previous phase's weights to its own over its length
(piecewise-linear mixes, e.g. an annealing phase that upweights math and code). UniMax-style
caps (``max_epochs`` with source ``sizes`` in tokens) bound each source's budget over the
whole run to ``max_epochs`` times its size; the surplus goes to the other sources in
proportion to their weights (water-filling, repeated until no cap is exceeded).

Why compile to *segments with integer budgets* instead of asking for a weight at each draw:
``TokenBudgetMixer`` meets token budgets exactly, and a budget is the integral of the target
share over the consumed tokens. A constant phase is one segment; a ramp is ``ramp_steps``
segments, each at the ramp's value at its midpoint (the exact integral of a linear function).
Each segment's length is split among the sources by largest remainder, and the cumulative
sums are the per-source budgets the mixer fills segment by segment. The plan depends only on
the config and the budget, so a resumed mixer (whose state holds its consumed-token counters
and the plan) continues bit for bit, and every (rank, worker) reader or prebuild worker, each
with its own slice of the budget, follows the same schedule in fractions of its budget.

Sources are read once: ``max_epochs`` is a plan, not a repeat (a repeated document would be
dropped by the per-source dedup anyway). A source that runs dry before its planned budget
drops out as in a plain mix (status ``ran_dry``), its remaining budget shared by the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stacklm.config import Config
from stacklm.errors import ConfigError

SIZE_UNITS = ("tokens", "documents")
DEFAULT_RAMP_STEPS = 16


def split_budget(total: int, weights: np.ndarray) -> np.ndarray:
    """Integer shares of ``total`` proportional to ``weights`` that sum to ``total`` exactly.

    Largest remainder (ties to the earlier source), so the split is deterministic and no token
    is lost to rounding. (Re-exported by ``stacklm.data.mix.mix``.)
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


def temperature_weights(sizes: Sequence[float], temperature: float) -> np.ndarray:
    """``p_i ∝ n_i^(1/T)``, normalised: ``T=1`` is proportional to size, large ``T`` tends to
    uniform (the multilingual "temperature sampling" of XLM/mT5)."""
    n = np.asarray(sizes, dtype=np.float64)
    p = n ** (1.0 / float(temperature))
    return p / p.sum()


def share_with_caps(amounts: np.ndarray, weights: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Per segment (rows of ``weights``) split ``amounts[k]`` tokens by the row's weights, then
    cap each source's total (column sum) at ``caps``: a source over its cap is scaled down
    across the segments and its surplus in each segment goes to the uncapped sources by that
    segment's weights; repeated until no cap is exceeded (water-filling). Integers throughout,
    rows sum to ``amounts`` exactly. Raises ``ConfigError`` when the caps cannot hold the budget."""
    amounts = np.asarray(amounts, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float64)
    inc = np.stack([split_budget(int(a), w) for a, w in zip(amounts, weights)]) if len(amounts) else np.zeros((0, len(caps)), np.int64)
    capped = np.zeros(len(caps), dtype=bool)
    while True:
        over = ~capped & (inc.sum(axis=0) > caps)
        if not over.any():
            return inc
        for i in np.flatnonzero(over):
            inc[:, i] = split_budget(int(caps[i]), inc[:, i])
        capped |= over
        free = np.flatnonzero(~capped)
        if not len(free):
            raise ConfigError(
                f"mix schedule: field 'max_epochs' caps every source below the token budget ({int(amounts.sum()):,} tokens "
                f"but the caps hold {int(caps.sum()):,}); raise max_epochs or sizes, or lower total_tokens"
            )
        fallback = weights[:, free].sum(axis=0)
        for k in range(len(amounts)):
            surplus = int(amounts[k] - inc[k].sum())
            if surplus > 0:
                w = weights[k, free]
                inc[k, free] += split_budget(surplus, w if w.sum() > 0 else (fallback if fallback.sum() > 0 else np.ones(len(free))))


@dataclass(frozen=True)
class MixPhaseConfig(Config):
    """One phase: ends at ``until`` (fraction of the budget); weights given, by temperature, or
    the mix entries' weights; ``ramp`` = move linearly from the previous phase's weights."""

    until: float
    name: str | None = None
    weights: Mapping[str, float] | None = None
    temperature: float | None = None
    ramp: bool = False


@dataclass(frozen=True)
class MixScheduleConfig(Config):
    """The ``schedule`` section of a data mix (``DataMix.schedule``). See the module docstring.

    ``sizes`` (per source, in ``size_unit``) feed ``temperature`` and the ``max_epochs`` caps;
    caps need tokens. With no ``phases``, one phase over the whole budget (weights by the
    top-level ``temperature`` if given, else the entries' weights).
    """

    phases: tuple[MixPhaseConfig, ...] = ()
    temperature: float | None = None
    sizes: Mapping[str, float] | None = None
    size_unit: str = "tokens"
    max_epochs: float | None = None
    ramp_steps: int = DEFAULT_RAMP_STEPS

    def __post_init__(self) -> None:
        object.__setattr__(self, "phases", tuple(MixPhaseConfig.coerce(p, f"phases[{i}]") for i, p in enumerate(self.phases)))
        self.validate()

    def validate(self) -> None:
        if self.size_unit not in SIZE_UNITS:
            raise ConfigError(f"mix schedule: field 'size_unit' must be one of {SIZE_UNITS}, got {self.size_unit!r}")
        if isinstance(self.ramp_steps, bool) or not isinstance(self.ramp_steps, int) or self.ramp_steps < 1:
            raise ConfigError(f"mix schedule: field 'ramp_steps' must be an int >= 1, got {self.ramp_steps!r}")
        if self.sizes is not None:
            bad = {k: v for k, v in self.sizes.items() if not _positive(v)}
            if bad:
                raise ConfigError(f"mix schedule: field 'sizes' must be numbers > 0, got {bad}")
        temps = [self.temperature] + [p.temperature for p in self.phases]
        for t in temps:
            if t is not None and not _positive(t):
                raise ConfigError(f"mix schedule: field 'temperature' must be a number > 0, got {t!r}")
        if any(t is not None for t in temps) and self.sizes is None:
            raise ConfigError("mix schedule: field 'temperature' needs 'sizes' (tokens or documents per source)")
        if self.max_epochs is not None:
            if not _positive(self.max_epochs):
                raise ConfigError(f"mix schedule: field 'max_epochs' must be a number > 0, got {self.max_epochs!r}")
            if self.sizes is None or self.size_unit != "tokens":
                raise ConfigError("mix schedule: field 'max_epochs' needs 'sizes' in tokens (size_unit: tokens)")
        last = 0.0
        for i, p in enumerate(self.phases):
            where = f"mix schedule: phases[{i}]"
            if not isinstance(p.until, (int, float)) or isinstance(p.until, bool) or not last < p.until <= 1.0:
                raise ConfigError(f"{where}: field 'until' must increase along the phases within (0, 1], got {p.until!r} after {last}")
            last = float(p.until)
            if p.weights is not None and p.temperature is not None:
                raise ConfigError(f"{where}: give 'weights' or 'temperature', not both")
            if p.ramp and i == 0:
                raise ConfigError(f"{where}: the first phase cannot 'ramp' (there is no previous phase to ramp from)")
        if self.phases and self.phases[-1].until != 1.0:
            raise ConfigError(f"mix schedule: the last phase must end at until: 1.0, got {self.phases[-1].until}")

    def check_sources(self, names: Sequence[str]) -> None:
        """Every name the schedule gives must be a source, and weights/sizes name them all."""
        known = set(names)
        maps = [("sizes", self.sizes)] + [(f"phases[{i}].weights", p.weights) for i, p in enumerate(self.phases)]
        for label, m in maps:
            if m is None:
                continue
            if set(m) != known:
                raise ConfigError(
                    f"mix schedule: field {label!r} must name exactly the sources {sorted(known)}, got {sorted(m)}"
                )
            bad = {k: v for k, v in m.items() if not (_number(v) and v >= 0)}
            if bad or (label != "sizes" and sum(m.values()) <= 0):
                raise ConfigError(f"mix schedule: field {label!r} needs numbers >= 0 with a positive sum, got {dict(m)}")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x: Any) -> bool:
    return _number(x) and x > 0


@dataclass
class MixPlan:
    """A compiled schedule for one mixer: segment ends (cumulative tokens), each segment's
    target shares (rows sum to 1) and phase, cumulative integer budgets per source (caps
    applied), and the phases' names and token ranges."""

    ends: np.ndarray  # (S,) int64, last == total
    weights: np.ndarray  # (S, n) float64
    phase: np.ndarray  # (S,) int64
    budgets: np.ndarray  # (S, n) int64 cumulative
    phase_names: list[str] = field(default_factory=list)

    @property
    def phase_bounds(self) -> list[tuple[int, int]]:
        """``[start, end)`` in planned tokens of every phase."""
        out = []
        for p in range(len(self.phase_names)):
            segs = np.flatnonzero(self.phase == p)
            start = int(self.ends[segs[0] - 1]) if segs[0] > 0 else 0
            out.append((start, int(self.ends[segs[-1]])))
        return out


def compile_schedule(
    config: MixScheduleConfig | None,
    names: Sequence[str],
    base_weights: np.ndarray,
    total_tokens: int,
    size_scale: float = 1.0,
) -> MixPlan:
    """Compile ``config`` (``None`` = the fixed mix ``base_weights``) for a mixer of ``total_tokens``.

    ``size_scale`` scales the given source sizes to this mixer's share of them (a reader of a
    ``1/k`` shard of every source has ``size_scale = 1/k``; it only matters for the caps,
    temperature depends on ratios)."""
    names = list(names)
    base = np.asarray(base_weights, dtype=np.float64) / np.sum(base_weights)
    if config is None:
        w = base[None, :]
        budgets = split_budget(total_tokens, base)[None, :]
        return MixPlan(np.array([total_tokens], np.int64), w, np.zeros(1, np.int64), budgets.astype(np.int64), ["all"])
    config.check_sources(names)
    sizes = np.array([float(config.sizes[n]) for n in names]) if config.sizes is not None else None

    def phase_weights(weights: Mapping[str, float] | None, temperature: float | None) -> np.ndarray:
        if weights is not None:
            v = np.array([float(weights[n]) for n in names])
            return v / v.sum()
        if temperature is not None:
            return temperature_weights(sizes, temperature)
        return base

    phases = config.phases or (MixPhaseConfig(until=1.0, name="all", temperature=config.temperature),)
    ends: list[int] = []
    rows: list[np.ndarray] = []
    seg_phase: list[int] = []
    start, prev_w = 0, None
    for p_idx, p in enumerate(phases):
        end = total_tokens if p.until == 1.0 else round(p.until * total_tokens)
        w = phase_weights(p.weights, p.temperature if p.temperature is not None else config.temperature if p.weights is None else None)
        steps = config.ramp_steps if p.ramp else 1
        for j in range(steps):
            seg_end = start + round((end - start) * (j + 1) / steps)
            if p.ramp:
                mid = (j + 0.5) / steps
                row = (1.0 - mid) * prev_w + mid * w
            else:
                row = w
            ends.append(seg_end)
            rows.append(row)
            seg_phase.append(p_idx)
        start, prev_w = end, w
    ends_a = np.array(ends, dtype=np.int64)
    weights = np.stack(rows)
    lengths = np.diff(np.concatenate([[0], ends_a]))
    if config.max_epochs is not None:
        caps = np.floor(config.max_epochs * sizes * size_scale).astype(np.int64)
        inc = share_with_caps(lengths, weights, caps)
    else:
        inc = np.stack([split_budget(int(n), w) for n, w in zip(lengths, weights)])
    names_out = [p.name or f"phase{i}" for i, p in enumerate(phases)]
    return MixPlan(ends_a, weights, np.array(seg_phase, np.int64), np.cumsum(inc, axis=0), names_out)


def weight_at(plan: MixPlan, tokens: float) -> np.ndarray:
    """Target shares of the segment holding token position ``tokens`` (for logging)."""
    k = int(np.searchsorted(plan.ends, tokens, side="right").clip(max=len(plan.ends) - 1))
    return plan.weights[k]


def _shares(counts: Mapping[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: (v / total if total else 0.0) for k, v in counts.items()}


def phase_report(name: str, names: Sequence[str], planned, tokens, docs, entered_at: int | None) -> dict[str, Any]:
    """One phase's row of ``TokenBudgetMixer.phases()`` (plain ints/floats, JSON-ready)."""
    planned_d = {n: int(x) for n, x in zip(names, planned)}
    tokens_d = {n: int(x) for n, x in zip(names, tokens)}
    return {
        "name": name,
        "entered_at_tokens": entered_at,
        "planned_tokens": planned_d,
        "tokens": tokens_d,
        "docs": {n: int(x) for n, x in zip(names, docs)},
        "target_share": _shares(planned_d),
        "realized_share": _shares(tokens_d),
    }


def merge_phase_reports(reports: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Sum per-reader phase reports (same schedule, so same phase names in the same order;
    a re-weighting every reader applied has one name) and recompute the shares from the sums.
    ``entered_at_tokens`` becomes the sum over the readers that reached the phase."""
    out: dict[str, dict[str, Any]] = {}
    for report in reports:
        for row in report:
            m = out.setdefault(row["name"], {"name": row["name"], "entered_at_tokens": None, "readers_entered": 0,
                                             "planned_tokens": {}, "tokens": {}, "docs": {}})
            for key in ("planned_tokens", "tokens", "docs"):
                for src, v in row[key].items():
                    m[key][src] = m[key].get(src, 0) + int(v)
            if row["entered_at_tokens"] is not None:
                m["entered_at_tokens"] = (m["entered_at_tokens"] or 0) + int(row["entered_at_tokens"])
                m["readers_entered"] += 1
    for m in out.values():
        m["target_share"] = _shares(m["planned_tokens"])
        m["realized_share"] = _shares(m["tokens"])
    return list(out.values())
