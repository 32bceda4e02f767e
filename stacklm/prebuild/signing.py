"""What a small prebuild signs: only the part of each source its budget can reach.

The global dedup pass signs every document it reads before any packing job runs. A build whose
budget is a small fraction of its sources used to sign all of them: a 200,000-token build over
60 MB spent 9.4 of its 10.3 s in the dedup pass (``bench/small_build.py``, docs/prebuild.md).

With ``read_order: spread`` a budget reads each file's pieces in a seeded order and keeps every
file at about its share of the bytes, so what a split reads of a local source is, file by file, a
prefix of that order. ``signing_plan`` estimates, per split and source, the fraction of each
file's bytes the split's budget needs (its token budget x the source's bytes read per token the
quality filter keeps, sampled, / the split's share of the documents, x ``margin``), and the build signs and reads only each
file's *signed prefix* (``pieces.signed_prefix``: the first pieces of the file's seeded order
holding that fraction of its bytes). The prefix depends on the file, the seed and the fraction,
never on ``--workers``, so the removed ids are the same for any ``--workers N``; the packing
jobs read nothing outside it, so no unsigned document is ever delivered; both splits' prefixes
take part in the one decision, so no duplicate set keeps members in train and val. A job whose
budget needs more than its prefix holds stops with a ``PrebuildError`` naming the source and
the fix (``--sign-margin``, or 0 to sign everything), never a silent short source.

Signed whole (a fraction of 1): a source that is not local files, ``read_order: sequential``
(a budget reads the head of the first files, not a prefix of every one), and a source whose
estimated fraction is at least ``WHOLE_AT`` (little to save, more to risk).
"""

from __future__ import annotations

from typing import Any

SIGN_MARGIN = 3.0  # x the estimate: dedup drops, the sample's error, an uneven split of bytes among --workers
WHOLE_AT = 0.5  # an estimated fraction at least this: sign the source whole
SAMPLE_DOCS = 200  # documents read to measure a source's bytes per token


def _bytes_per_token(config, entry, tokenizer) -> tuple[float, int]:
    """(input bytes read per token kept by the quality filter, the source's size in bytes),
    from the first ``SAMPLE_DOCS`` documents of the source in its spread order (one reader):
    a source whose filter drops half its documents needs twice the bytes."""
    from stacklm.data.pipeline import read_order_seed
    from stacklm.data.quality.filters import filter_reason
    from stacklm.data.sources import ShardSpec, open_source

    src = open_source(entry, shard=ShardSpec(), order_seed=read_order_seed(config, entry.name))
    src.reset(None)
    tokens = 0
    for _, doc in zip(range(SAMPLE_DOCS), src):
        if filter_reason(doc, config.filters, entry.filter_rules()) is None:
            tokens += len(tokenizer.encode(doc["text"])) + 2  # <bos> ... <eos>
    return src.bytes_in / max(tokens, 1), src.input_bytes


def signing_plan(config, tokenizer, splits, margin: float = SIGN_MARGIN) -> dict[str, Any]:
    """``{"margin", "source_tokens": {source: estimate}, "fractions": {split: {source: fraction}}}``:
    the sources each split signs only a prefix of (a source signed whole is not listed), with the
    estimated tokens of every source (for the build's one-line report). ``margin`` <= 0: sign
    everything (``fractions`` empty)."""
    from stacklm.data.mix.mix import TokenBudgetMixer

    plan: dict[str, Any] = {"margin": float(margin), "source_tokens": {}, "fractions": {s: {} for s in splits}}
    if margin <= 0 or config.read_order != "spread":
        return plan
    local = [e for e in config.mix.entries if e.kind == "local"]
    per_source = {e.name: _bytes_per_token(config, e, tokenizer) for e in local}
    plan["source_tokens"] = {name: int(size / bpt) for name, (bpt, size) in per_source.items()}
    names = [e.name for e in config.mix.entries]
    for split in splits:
        share = config.holdout_fraction if split == "val" else 1.0 - config.holdout_fraction
        if share <= 0:  # no holdout: the val split reads nothing it keeps, there is no prefix to sign
            continue
        total = max(1, round(config.mix.total_tokens * config.holdout_fraction)) if split == "val" else config.mix.total_tokens
        budgets = TokenBudgetMixer(names, config.mix.weights, total, schedule=config.mix.schedule, size_scale=share).initial_plan.budgets[-1]
        for name, budget in zip(names, budgets.tolist()):
            if name not in per_source or budget <= 0:  # a source this split takes nothing from: nothing to reach
                continue
            bpt, size = per_source[name]
            fraction = margin * budget * bpt / max(share, 1e-12) / max(size, 1)
            if fraction < WHOLE_AT:
                plan["fractions"][split][name] = round(fraction, 6)
    return plan


def describe(plan: dict[str, Any], total_tokens: int) -> str | None:
    """The build's one line about what it signs; None when it signs everything."""
    if not any(plan["fractions"].values()):
        return None
    have = sum(plan["source_tokens"].values())
    parts = []
    for split, fr in plan["fractions"].items():
        if fr:
            parts.append(f"{split}: " + ", ".join(f"{name} {f:.1%}" for name, f in fr.items()))
    return (f"prebuild: budget {total_tokens:,} tokens is {total_tokens / max(have, 1):.1%} of the ~{have:,} tokens its local sources "
            f"hold after the quality filter (sampled): "
            f"signing only what it can reach ({'; '.join(parts)} of each file's bytes, margin {plan['margin']:g}x; "
            f"other sources and splits whole); --sign-margin 0 signs everything")


def apply(sources: dict[str, Any], fractions: dict[str, float]) -> None:
    """Limit the packing job's source nodes to the signed prefixes its dedup index records."""
    for name, fraction in fractions.items():
        sources[name].limit_to_signed(fraction)


def check_budget_met(realized: dict[str, dict[str, Any]], signed: dict[str, Any], split: str, out) -> None:
    """A source that ran dry inside its signed prefix: the budget needed more than was signed.
    Loud, never a quietly short source (the other sources would fill its share)."""
    from stacklm.errors import PrebuildError

    for name, fraction in signed.get("fractions", {}).get(split, {}).items():
        r = realized[name]
        if r["status"] == "ran_dry" and r["tokens"] < r["planned_budget"]:
            raise PrebuildError(
                f"prebuild {out}: split {split!r}: source {name!r} needed more than its signed prefix ({fraction:.1%} of each file's "
                f"bytes; delivered {r['tokens']:,} of its {r['planned_budget']:,} tokens); delete {out} and re-run with a larger "
                f"--sign-margin (this build: {signed['margin']:g}), or --sign-margin 0 to sign the whole corpus", path=out)
