"""Mixture schedules: phases, temperature, caps (against independent computations), realized vs
target per phase, and exact resume mid-phase (mixer node and the whole batches graph)."""

from __future__ import annotations

import numpy as np
import pytest
from torchdata.nodes import BaseNode, IterableWrapper

from stacklm.data.mix.mix import MixNode, TokenBudgetMixer, mix_budgeted
from stacklm.data.pipeline import PipelineConfig, build_pipeline
from stacklm.data.registry import DataMix, SourceConfig
from stacklm.data.mix.schedule import MixScheduleConfig, compile_schedule, merge_phase_reports, temperature_weights
from stacklm.errors import ConfigError
from tests.helpers.resume import check_save_load_state

NAMES = ["web", "code", "math"]
BASE = np.array([0.6, 0.3, 0.1])
MAIN = {"web": 0.7, "code": 0.2, "math": 0.1}
ANNEAL = {"web": 0.3, "code": 0.35, "math": 0.35}


def _docs(source, n, lo, hi, seed):
    rng = np.random.default_rng(seed)
    return [
        {"ids": rng.integers(0, 1000, size=int(rng.integers(lo, hi)), dtype=np.int32), "source": source, "doc_id": f"{source}-{i}"}
        for i in range(n)
    ]


def _sources(scale=1):
    return {"web": _docs("web", 4000 * scale, 5, 60, 0), "code": _docs("code", 900 * scale, 20, 200, 1),
            "math": _docs("math", 1500 * scale, 10, 120, 2)}


def _anneal_schedule(**kw) -> MixScheduleConfig:
    """Constant main phase to 60%, a ramp to the anneal mix over the next 30%, anneal to the end."""
    return MixScheduleConfig.from_dict({
        "phases": [
            {"name": "main", "until": 0.6, "weights": MAIN},
            {"name": "ramp", "until": 0.9, "weights": ANNEAL, "ramp": True},
            {"name": "anneal", "until": 1.0, "weights": ANNEAL},
        ],
        **kw,
    })


# ---------------------------------------------------------------------------------------
# Math against independent computations
# ---------------------------------------------------------------------------------------
def _norm(d):
    v = np.array([d[n] for n in NAMES], dtype=float)
    return v / v.sum()


def _target_at(t):
    """The schedule's share at budget fraction t, written out by hand."""
    if t < 0.6:
        return _norm(MAIN)
    if t < 0.9:
        a = (t - 0.6) / 0.3
        return (1 - a) * _norm(MAIN) + a * _norm(ANNEAL)
    return _norm(ANNEAL)


def test_phase_targets_are_the_integral_of_the_piecewise_linear_mix():
    total = 1_000_000
    plan = compile_schedule(_anneal_schedule(), NAMES, BASE, total)
    assert plan.budgets[-1].sum() == total and plan.ends[-1] == total
    assert plan.phase_bounds == [(0, 600_000), (600_000, 900_000), (900_000, 1_000_000)]
    inc = np.diff(np.vstack([np.zeros((1, 3), np.int64), plan.budgets]), axis=0)
    for p, (a, b) in enumerate(plan.phase_bounds):
        ts = np.linspace(a / total, b / total, 20_001)
        integral = np.trapezoid(np.stack([_target_at(t) for t in ts[:-1] + 1e-12]), ts[:-1], axis=0) / (ts[-2] - ts[0])
        got = inc[plan.phase == p].sum(axis=0) / (b - a)
        assert np.allclose(got, integral, atol=2e-4), (p, got, integral)
    # budget through any point = integral of the target share up to there (within a ramp step)
    half_ramp = plan.ends[np.flatnonzero(plan.phase == 1)[7]]
    ts = np.linspace(0, half_ramp / total, 40_001)
    want = np.trapezoid(np.stack([_target_at(t) for t in ts]), ts, axis=0) * total
    k = int(np.flatnonzero(plan.ends == half_ramp)[0])
    assert np.allclose(plan.budgets[k], want, rtol=2e-3)


def test_temperature_weights_match_the_formula():
    sizes = [9e9, 1e9, 1e8]
    for t in (1.0, 2.0, 5.0, 100.0):
        p = temperature_weights(sizes, t)
        want = np.array([s ** (1 / t) for s in sizes])
        assert np.allclose(p, want / want.sum())
    assert np.allclose(temperature_weights(sizes, 1.0), np.array(sizes) / sum(sizes))
    assert np.allclose(temperature_weights(sizes, 1e6), 1 / 3, atol=1e-4)
    # a phase by temperature: the mixer's plan has those shares
    sched = MixScheduleConfig.from_dict({"temperature": 3.0, "sizes": dict(zip(NAMES, sizes))})
    plan = compile_schedule(sched, NAMES, BASE, 10_000_000)
    assert np.allclose(plan.budgets[-1] / 10_000_000, temperature_weights(sizes, 3.0), atol=1e-6)


def _unimax(total, sizes, epochs):
    """UniMax (Chung et al. 2023, Algorithm 1): uniform budget, smallest source first, each
    capped at epochs x size, the rest spread over the remaining sources."""
    order = np.argsort(sizes)
    alloc = np.zeros(len(sizes))
    left = float(total)
    for j, i in enumerate(order):
        per = left / (len(sizes) - j)
        alloc[i] = min(per, epochs * sizes[i])
        left -= alloc[i]
    return alloc


def _water_fill(total, weights, caps):
    """alloc_i = min(cap_i, lam * w_i) with sum = total, lam by bisection."""
    lo, hi = 0.0, total / weights.min() * 10
    for _ in range(200):
        lam = (lo + hi) / 2
        if np.minimum(caps, lam * weights).sum() < total:
            lo = lam
        else:
            hi = lam
    return np.minimum(caps, hi * weights)


def test_unimax_caps_match_the_paper_algorithm():
    sizes = np.array([50_000.0, 300_000.0, 2_000_000.0])
    total = 1_000_000
    for epochs in (1.0, 2.0, 4.0):
        sched = MixScheduleConfig.from_dict({
            "phases": [{"until": 1.0, "weights": dict(zip(NAMES, [1, 1, 1]))}],
            "sizes": dict(zip(NAMES, sizes.tolist())), "max_epochs": epochs,
        })
        got = compile_schedule(sched, NAMES, BASE, total).budgets[-1]
        want = _unimax(total, sizes, epochs)
        assert got.sum() == total
        assert np.abs(got - want).max() <= 2, (epochs, got, want)
        assert (got <= np.floor(epochs * sizes)).all()


def test_caps_with_phases_and_temperature_water_fill():
    sizes = {"web": 5e6, "code": 2e5, "math": 4e4}
    sched = _anneal_schedule(sizes=sizes, max_epochs=2.0)
    total = 1_000_000
    plan = compile_schedule(sched, NAMES, BASE, total)
    inc = np.diff(np.vstack([np.zeros((1, 3), np.int64), plan.budgets]), axis=0)
    caps = np.floor(2.0 * np.array([sizes[n] for n in NAMES]))
    final = plan.budgets[-1]
    assert final.sum() == total and (final <= caps).all()
    assert final[2] == caps[2]  # math hits its cap; its surplus went to the others
    # each segment still sums to its length; the capped source is scaled evenly over segments
    assert (inc.sum(axis=1) == np.diff(np.concatenate([[0], plan.ends]))).all()
    uncapped = compile_schedule(_anneal_schedule(), NAMES, BASE, total)
    uinc = np.diff(np.vstack([np.zeros((1, 3), np.int64), uncapped.budgets]), axis=0)
    assert np.allclose(inc[:, 2] / uinc[:, 2].clip(min=1), caps[2] / uinc[:, 2].sum(), atol=0.01)
    # one flat phase with temperature weights: the water-filling closed form
    flat = MixScheduleConfig.from_dict({"temperature": 2.0, "sizes": sizes, "max_epochs": 1.5})
    got = compile_schedule(flat, NAMES, BASE, total).budgets[-1]
    w = temperature_weights([sizes[n] for n in NAMES], 2.0)
    want = _water_fill(total, w, np.floor(1.5 * np.array([sizes[n] for n in NAMES])))
    assert np.abs(got - want).max() <= 2, (got, want)


def test_caps_that_cannot_hold_the_budget_are_a_config_error():
    sched = MixScheduleConfig.from_dict({"sizes": {"web": 10, "code": 10, "math": 10}, "max_epochs": 1})
    with pytest.raises(ConfigError, match="max_epochs"):
        compile_schedule(sched, NAMES, BASE, 1000)


@pytest.mark.parametrize("bad, match", [
    ({"phases": [{"until": 0.5}]}, "last phase must end"),
    ({"phases": [{"until": 0.5}, {"until": 0.4}, {"until": 1.0}]}, "'until' must increase"),
    ({"phases": [{"until": 1.0, "ramp": True}]}, "first phase cannot 'ramp'"),
    ({"phases": [{"until": 1.0, "weights": {"web": 1}}]}, r"phases\[0\].weights.*exactly the sources"),
    ({"phases": [{"until": 1.0, "wieghts": {}}]}, r"phases\[0\]"),
    ({"temperature": 2.0}, "needs 'sizes'"),
    ({"max_epochs": 2, "sizes": {"web": 1, "code": 1, "math": 1}, "size_unit": "documents"}, "in tokens"),
    ({"tempreature": 2.0}, "unknown field"),
])
def test_bad_schedules_name_the_field(bad, match):
    entries = [SourceConfig(n, "synthetic", float(w), "prose") for n, w in zip(NAMES, BASE)]
    with pytest.raises(ConfigError, match=match):
        DataMix.from_dict({"name": "m", "total_tokens": 1000, "entries": [e.to_dict() for e in entries], "schedule": bad})


def test_data_mix_round_trips_and_old_configs_hash_as_before():
    entries = tuple(SourceConfig(n, "synthetic", float(w), "prose") for n, w in zip(NAMES, BASE))
    plain = DataMix("m", 1000, entries)
    assert "schedule" not in plain.to_dict()
    with_sched = DataMix("m", 1000, entries, schedule=_anneal_schedule())
    again = DataMix.from_dict(with_sched.to_dict())
    assert again == with_sched and again.schedule.phases[1].ramp
    assert PipelineConfig(with_sched).config_hash() != PipelineConfig(plain).config_hash()
    tw = with_sched.target_weights()
    assert abs(sum(tw.values()) - 1) < 1e-9 and tw["math"] > 0.1


# ---------------------------------------------------------------------------------------
# The mixer following a schedule
# ---------------------------------------------------------------------------------------
def test_realized_share_per_phase_is_close_to_target():
    total = 150_000
    mixer = TokenBudgetMixer(NAMES, dict(zip(NAMES, BASE)), total, seed=4, schedule=_anneal_schedule())
    srcs = _sources()
    stream = list(mixer(srcs))
    assert sum(len(d["ids"]) for d in stream) == total
    phases = mixer.phases()
    assert [p["name"] for p in phases] == ["main", "ramp", "anneal"]
    # the phases' own token counts, recounted from the stream by position
    pos = np.cumsum([len(d["ids"]) for d in stream])
    for p, (a, b) in zip(phases, [(0, 90_000), (90_000, 135_000), (135_000, 150_000)]):
        assert abs(p["entered_at_tokens"] - a) < 600  # a phase starts within a few documents of its point
        for n in NAMES:
            assert abs(p["realized_share"][n] - p["target_share"][n]) < 0.02, (p["name"], n, p)
        sel = [d for d, end in zip(stream, pos) if a < end <= b]
        recount = sum(len(d["ids"]) for d in sel)
        assert abs(recount - sum(p["tokens"].values())) < 600
    assert sum(sum(p["tokens"].values()) for p in phases) == total
    # whole run: the planned average, not the entries' weights
    real = mixer.realized()
    for n in NAMES:
        assert abs(real[n]["realized_weight"] - real[n]["target_weight"]) < 1e-3
    # merged reports add up (two readers with the same schedule)
    merged = merge_phase_reports([phases, phases])
    assert merged[0]["tokens"]["web"] == 2 * phases[0]["tokens"]["web"]
    assert merged[2]["realized_share"] == phases[2]["realized_share"]


def test_a_source_running_dry_mid_schedule_hands_its_budget_on():
    srcs = _sources()
    srcs["math"] = srcs["math"][:200]
    total = 120_000
    mixer = TokenBudgetMixer(NAMES, dict(zip(NAMES, BASE)), total, seed=1, schedule=_anneal_schedule())
    stream = list(mixer(srcs))
    assert sum(len(d["ids"]) for d in stream) == total
    real = mixer.realized()
    assert real["math"]["status"] == "ran_dry" and real["math"]["tokens"] == sum(len(d["ids"]) for d in srcs["math"])


def _node(srcs, schedule, total=60_000, seed=9):
    return MixNode({k: IterableWrapper(v) for k, v in srcs.items()}, dict(zip(NAMES, BASE)), total, seed, schedule=schedule)


def test_mix_node_with_a_schedule_resumes_exactly_mid_phase():
    srcs = _sources()
    sched = _anneal_schedule()

    def check_resumed(r):
        assert r.restored.phases() == r.uninterrupted.phases()
        assert r.restored.realized() == r.uninterrupted.realized()

    full = check_save_load_state(
        lambda: _node(srcs, sched), lambda n: (0, 1, n // 3, int(n * 0.75), n - 1, n),  # main, ramp, anneal
        state_round_trip="pickle", check_resumed=check_resumed,
    )
    assert [d["doc_id"] for d in full] == [d["doc_id"] for d in mix_budgeted(srcs, dict(zip(NAMES, BASE)), 60_000, 9, sched)]


def test_set_weights_takes_the_rest_of_the_budget_and_resumes_exactly():
    srcs = _sources()
    new = {"web": 0.1, "code": 0.1, "math": 0.8}

    def build():
        node = _node(srcs, None, total=40_000)
        return _Reweighted(node, at_doc=300, weights=new)

    full = check_save_load_state(build, lambda n: (0, 299, 300, 301, n // 2, n), state_round_trip="pickle")
    node = build()
    out = list(node)
    assert [d["doc_id"] for d in out] == [d["doc_id"] for d in full]
    phases = node.node.phases()
    assert [p["name"] for p in phases] == ["all", "set@300"]
    assert sum(len(d["ids"]) for d in out) == 40_000
    late = phases[1]
    assert late["entered_at_tokens"] == sum(len(d["ids"]) for d in out[:300])
    assert abs(late["realized_share"]["math"] - 0.8) < 0.02
    assert sum(late["tokens"].values()) == sum(len(d["ids"]) for d in out[300:])


class _Reweighted(BaseNode):
    """A MixNode that calls ``set_weights`` before its ``at_doc``-th document (state: the count)."""

    def __init__(self, node, at_doc, weights):
        super().__init__()
        self.node, self.at_doc, self.weights, self.n = node, at_doc, weights, 0

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.node.reset(None if initial_state is None else initial_state["node"])
        self.n = 0 if initial_state is None else initial_state["n"]

    def next(self):
        if self.n == self.at_doc:
            self.node.set_weights(self.weights, f"set@{self.at_doc}")
        doc = next(self.node)
        self.n += 1
        return doc

    def get_state(self):
        return {"node": self.node.state_dict(), "n": self.n}


# ---------------------------------------------------------------------------------------
# Through the whole graph
# ---------------------------------------------------------------------------------------
def _pipe_config(total=60_000) -> PipelineConfig:
    mix = DataMix(
        "sched", total,
        (
            SourceConfig("web", "synthetic", 0.6, "prose", seed=1, num_docs=1500),
            SourceConfig("code", "synthetic", 0.3, "code", seed=2, num_docs=600),
            SourceConfig("math", "synthetic", 0.1, "math", seed=3, num_docs=600),
        ),
        schedule=_anneal_schedule(),
    )
    return PipelineConfig(mix, seq_len=128, batch_size=4, shuffle_buffer=64, pack_buffer_docs=32, holdout_fraction=0.05,
                          tokenize_batch_docs=16)


def test_pipeline_batches_resume_exactly_mid_phase(tokenizer_1024):
    cfg = _pipe_config()
    mid_main, mid_ramp = 30, 90  # of ~117 batches: inside the main phase and inside the ramp

    def phases_continue(r):
        assert r.restored.phases() == r.uninterrupted.phases()

    full = check_save_load_state(lambda: build_pipeline(cfg, tokenizer_1024), [mid_main, mid_ramp], node=lambda p: p.batches,
                                 state_round_trip="pickle", check_resumed=phases_continue)
    assert len(full) > mid_ramp + 10
    p = build_pipeline(cfg, tokenizer_1024)
    longest = _record_longest(p)
    list(p.batches)
    phases = p.phases()
    assert [ph["name"] for ph in phases] == ["main", "ramp", "anneal"]
    assert phases[1]["entered_at_tokens"] is not None and phases[2]["entered_at_tokens"] is not None
    _assert_phases_track_the_plan(phases, longest[0])


def _record_longest(pipe):
    """Wrap the mixer's ``admit`` to record the longest document it admits (an independent count)."""
    longest = [0]
    orig = pipe.mix.mixer.admit

    def admit(i, doc):
        longest[0] = max(longest[0], len(doc["ids"]))
        return orig(i, doc)

    pipe.mix.mixer.admit = admit
    return longest


def _assert_phases_track_the_plan(phases, slack):
    """Through the end of every phase, each source's mixed tokens are at or above its planned
    budget and less than ``slack`` (one document per reader) above it: a phase ends once every
    source met its budget, and only the document crossing it overshoots. Documents here are
    long next to the toy phases (~600 tokens vs a 3,000-token anneal), so this, not the
    per-phase share, is the tight check; the run's total is met exactly."""
    cum_tok = {n: 0 for n in NAMES}
    cum_plan = {n: 0 for n in NAMES}
    for ph in phases:
        for n in NAMES:
            cum_tok[n] += ph["tokens"][n]
            cum_plan[n] += ph["planned_tokens"][n]
            assert 0 <= cum_tok[n] - cum_plan[n] < slack, (ph["name"], n, cum_tok[n], cum_plan[n], slack)
    assert cum_tok == cum_plan


def test_prebuild_follows_the_same_schedule_and_logs_phases(tmp_path, tokenizer_1024, saved_tokenizer_dir):
    """Prebuild (2 workers) with the schedule: the manifest's per-phase report adds up to the
    mixed tokens, each worker's phases are the stream graph's for the same reader, and the
    realized shares per phase are close to the targets."""
    from stacklm.data.storage import manifest as mf
    from stacklm.data.sources import ShardSpec
    from stacklm.prebuild import prebuild
    from stacklm.prebuild.plan import worker_config

    cfg = _pipe_config(total=50_000)
    out = tmp_path / "shards"
    prebuild(cfg, saved_tokenizer_dir(tokenizer_1024), out, tokens_per_shard=128 * 8, workers=2, progress=False)
    train = mf.read_manifest(out / "train")
    phases = train["mix_phases"]
    assert [p["name"] for p in phases] == ["main", "ramp", "anneal"]
    assert sum(sum(p["tokens"].values()) for p in phases) == sum(r["tokens"] for r in train["realized"].values())
    assert mf.read_manifest(out)["mix_phases"] == phases
    assert {s["name"]: s["target_weight"] for s in train["sources"]} == cfg.mix.target_weights()
    # the same reader in stream form mixes the same phases (same graph, same schedule)
    readers, longest = [], 0
    for w in range(2):
        pipe = build_pipeline(worker_config(cfg, w, 2), tokenizer_1024, shard=ShardSpec(0, 1, w, 2))
        seen = _record_longest(pipe)
        list(pipe.batches)
        readers.append(pipe.phases())
        longest = max(longest, seen[0])
        _assert_phases_track_the_plan(readers[-1], longest)
    assert merge_phase_reports(readers) == phases
    _assert_phases_track_the_plan(phases, 2 * longest)


def test_phase_shares_reach_the_logged_scalars():
    from stacklm.callbacks import data_scalars, merge_data_stats

    mixer = TokenBudgetMixer(NAMES, dict(zip(NAMES, BASE)), 30_000, seed=2, schedule=_anneal_schedule())
    list(mixer(_sources()))
    rank = {"realized": {}, "mix_phases": mixer.phases()}
    merged = merge_data_stats([rank, rank])  # two ranks
    assert merged["mix_phases"][0]["tokens"]["web"] == 2 * mixer.phases()[0]["tokens"]["web"]
    scalars = data_scalars(merged)
    for p in mixer.phases():
        for n in NAMES:
            assert scalars[f"data/phase/{p['name']}/realized_share/{n}"] == p["realized_share"][n]
            assert scalars[f"data/phase/{p['name']}/target_share/{n}"] == p["target_share"][n]


def test_a_mix_state_saved_before_schedules_still_resumes():
    srcs = _sources()
    full = list(mix_budgeted(srcs, dict(zip(NAMES, BASE)), 20_000, seed=3))
    mixer = TokenBudgetMixer(NAMES, dict(zip(NAMES, BASE)), 20_000, seed=3)
    its = [iter(srcs[n]) for n in NAMES]
    head = [mixer.draw(its) for _ in range(100)]
    consumed = [sum(1 for d in head if d["source"] == n) for n in NAMES]
    old = {k: v for k, v in mixer.state().items() if k not in TokenBudgetMixer._PLAN + ("segment", "phase_names")}
    old["budgets"] = mixer.budgets.copy()
    again = TokenBudgetMixer(NAMES, dict(zip(NAMES, BASE)), 20_000, seed=3)
    again.load_state(old)
    rest = list(again({n: iter(srcs[n][c:]) for n, c in zip(NAMES, consumed)}))
    assert [d["doc_id"] for d in head + rest] == [d["doc_id"] for d in full]
    with pytest.raises(ValueError, match="schedule"):
        TokenBudgetMixer(NAMES, dict(zip(NAMES, BASE)), 20_000, seed=3, schedule=_anneal_schedule()).load_state(old)


def _numpy_pick(mixer: TokenBudgetMixer) -> int:
    """The mixer's pick as it was written in numpy (before the plain-Python one): the reference."""
    active = np.flatnonzero(mixer.status == 0)  # ACTIVE
    while True:
        short = active[mixer.tokens[active] < mixer.plan[mixer.segment, active]]
        if len(short) or mixer.segment == len(mixer.plan) - 1:
            break
        mixer.segment += 1
    active = short
    unseen = active[mixer.docs[active] + mixer.empty_docs[active] == 0]
    if len(unseen):
        return int(unseen[mixer.rng.integers(len(unseen))])
    remaining = (mixer.plan[mixer.segment, active] - mixer.tokens[active]).astype(np.float64)
    mean_len = np.maximum(mixer.tokens[active] / np.maximum(mixer.docs[active], 1), 1.0)
    p = np.cumsum(remaining / mean_len)
    return int(active[np.searchsorted(p, mixer.rng.random() * p[-1], side="right").clip(max=len(active) - 1)])


def test_pick_draws_what_the_numpy_pick_drew():
    """Every pick of a scheduled mix (phases, a source running dry, empty documents, truncation
    at the budget) equals the numpy reference's on a copy of the same state and generator."""
    import copy

    mixer = TokenBudgetMixer(NAMES, dict(zip(NAMES, BASE)), 150_000, seed=7, schedule=_anneal_schedule())
    lengths = np.random.default_rng(0).integers(0, 900, size=100_000)
    picks, k = 0, 0
    while not mixer.finished:
        ref = copy.deepcopy(mixer)
        want = _numpy_pick(ref)
        got = mixer.pick()
        assert got == want and mixer.rng.random() == ref.rng.random(), (picks, got, want)
        if got == 1 and picks > 150:
            mixer.mark_dry(got)  # a source that runs dry part-way: its budget moves to the others
        else:
            mixer.admit(got, {"ids": np.zeros(int(lengths[k]), dtype=np.int32)})
        picks, k = picks + 1, k + 1
    assert picks > 300 and mixer.segment > 0 and int(mixer.tokens.sum()) == 150_000 and mixer.status[1] == 2  # DRY
