"""The token ledger: where every document and every token read went, per source, adding up exactly.

Per source, in documents and in document tokens (the tokenizer's ids, no ``<bos>``/``<eos>``,
the unit of the mix budget)::

    read = dropped (by stage/reason) + holdout + buffered (before the mix) + kept
    kept = delivered + remainder (still in the shuffle / pack buffers) + undelivered

``undelivered`` is only ever non-empty in stream mode with ``drop_last``: the windows of an
incomplete last batch, which the mix kept and the batcher dropped (``drop_last``).

Each term is counted where it happens, independently: ``read`` by the source reader (rows it
owns: ``records_read``), drops by the stage that dropped (source audit and invalid records,
filter, user stages (``pipeline.stages``), decontamination (reason: the evaluation set), dedup, empty after tokenizing; in tokens, what the mix budget cut), ``holdout`` by the
holdout split, ``buffered``/``remainder`` by looking into each node's buffer, ``kept`` by the
mixer and ``delivered`` by the shard writer (prebuild) or the packer's output (stream). So a
stage that lost or repeated a document breaks an identity instead of vanishing in a total.

Tokens exist only from the tokenizer on: a document dropped before it (filter, dedup, holdout,
source) was never tokenized, so it counts in documents only; token ``read`` is what the
tokenizer encoded (handed to the mix, plus its read-ahead).

``check`` returns the failed identities; ``enforce`` raises ``LedgerError`` when strict (tests:
``STACKLM_LEDGER_STRICT=1``) and warns loudly otherwise. Ledgers are additive: ``merge`` sums
those of several jobs or loader workers, and the identities hold for the sum.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from stacklm.data.audit import DROPPED_BINARY, DROPPED_EMPTY, INVALID_RECORDS
from stacklm.data.stats import drops_by_reason
from stacklm.errors import LedgerError

STRICT_ENV = "STACKLM_LEDGER_STRICT"
SOURCE_DROPS = (DROPPED_EMPTY, DROPPED_BINARY, *INVALID_RECORDS)
DEDUP_DROPS = ("exact_dup", "near_dup", "cross_split_dup")
UNITS = ("docs", "tokens")


def _row() -> dict[str, Any]:
    return {"read": 0, "dropped": {}, "holdout": 0, "buffered": {}, "kept": 0, "delivered": 0, "remainder": {}, "undelivered": {}}


def _add(slot: dict[str, int], key: str, n: int) -> None:
    if n:
        slot[key] = slot.get(key, 0) + int(n)


def pipeline_ledger(pipe, delivered: Mapping[str, Iterable[int]] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """The ledger of one built pre-training pipeline (``stacklm.data.pipeline.Pipeline``), now.

    ``delivered``: per source ``[docs, tokens]`` that reached the consumer (the shard writer's
    count); by default what the packer emitted (``PackNode.emitted_by_source``).
    """
    stats = pipe.stats()
    mixed = pipe.realized()
    delivered = dict(delivered) if delivered is not None else pipe.windows.emitted_by_source()
    shuffled = pipe.shuffle.buffered()
    packing = pipe.windows.buffered()
    dropped_last = pipe.windows.dropped_by_source()
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, chain in pipe.chains.items():
        docs, tokens = _row(), _row()
        src = stats.get("source", {}).get(name, {})
        docs["read"] = int(src.get("records_read", 0))
        for reason in SOURCE_DROPS:
            _add(docs["dropped"], f"source/{reason}", src.get(reason, 0))
        docs["holdout"] = int(stats.get("holdout", {}).get(name, {}).get("holdout_other_split", 0))
        for stage in chain:  # the filter, each user stage, decontamination (reason: the evaluation set overlapped)
            if drops_by_reason(stage):
                for reason, n in stats.get(stage, {}).get(name, {}).items():
                    if reason != "kept":
                        _add(docs["dropped"], f"{stage}/{reason}", n)
        for reason in DEDUP_DROPS:
            _add(docs["dropped"], f"dedup/{reason}", stats.get("dedup", {}).get(name, {}).get(reason, 0))
        if "dedup" in chain:
            _add(docs["buffered"], "dedup", sum(1 for d in chain["dedup"]._pending))
        tok_docs, tok_tokens = chain["tokenize"].buffered()
        _add(docs["buffered"], "tokenize", tok_docs)
        _add(tokens["buffered"], "tokenize", tok_tokens)
        tok = stats.get("tokenize", {}).get(name, {})
        tokens["read"] = int(tok.get("tokens", 0)) + tok_tokens
        m = mixed.get(name, {})
        _add(docs["dropped"], "mix/empty_after_tokenize", m.get("empty_docs", 0))
        _add(tokens["dropped"], "mix/cut_by_budget", m.get("truncated_tokens", 0))
        docs["kept"], tokens["kept"] = int(m.get("docs", 0)), int(m.get("tokens", 0))
        d = list(delivered.get(name, (0, 0)))
        docs["delivered"], tokens["delivered"] = int(d[0]), int(d[1])
        for stage, per in (("shuffle", shuffled), ("pack", packing)):
            n_docs, n_tokens = per.get(name, (0, 0))
            _add(docs["remainder"], stage, n_docs)
            _add(tokens["remainder"], stage, n_tokens)
        n_docs, n_tokens = dropped_last.get(name, (0, 0))
        _add(docs["undelivered"], "drop_last", n_docs)
        _add(tokens["undelivered"], "drop_last", n_tokens)
        out[name] = {"docs": docs, "tokens": tokens}
    return out


def merge(ledgers: Iterable[Mapping[str, Mapping[str, Mapping[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Sum ledgers (of jobs, loader workers, ranks); the identities hold for the sum."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for ledger in ledgers:
        for name, units in ledger.items():
            slot = out.setdefault(name, {u: _row() for u in UNITS})
            for unit in UNITS:
                row, into = units[unit], slot[unit]
                for key in ("read", "holdout", "kept", "delivered"):
                    into[key] += int(row.get(key, 0))
                for key in ("dropped", "buffered", "remainder", "undelivered"):
                    for reason, n in row.get(key, {}).items():
                        _add(into[key], reason, n)
    return out


def check(ledger: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """The identities that fail, one message each (empty when the ledger adds up)."""
    problems = []
    for name, units in ledger.items():
        for unit in UNITS:
            r = units[unit]
            dropped, buffered = sum(r["dropped"].values()), sum(r["buffered"].values())
            remainder = sum(r["remainder"].values()) + sum(r.get("undelivered", {}).values())
            accounted = dropped + r["holdout"] + buffered + r["kept"]
            if r["read"] != accounted:
                problems.append(
                    f"source {name!r} {unit}: read {r['read']:,} != dropped {dropped:,} + holdout {r['holdout']:,} + "
                    f"buffered {buffered:,} + kept {r['kept']:,} = {accounted:,} (off by {r['read'] - accounted:+,})"
                )
            if r["kept"] != r["delivered"] + remainder:
                problems.append(
                    f"source {name!r} {unit}: kept {r['kept']:,} != delivered {r['delivered']:,} + remainder (and undelivered) {remainder:,} "
                    f"(off by {r['kept'] - r['delivered'] - remainder:+,})"
                )
    return problems


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def enforce(ledger: Mapping[str, Any], where: str, *, strict_mode: bool | None = None) -> list[str]:
    """Check ``ledger``: a failed identity raises ``LedgerError`` when strict (``STACKLM_LEDGER_STRICT=1``,
    as the tests set), else is a loud ``RuntimeWarning``. Returns the problems."""
    problems = check(ledger)
    if problems:
        message = f"{where}: the token ledger does not add up (a stage lost or repeated data without counting it): " + "; ".join(problems)
        if strict() if strict_mode is None else strict_mode:
            raise LedgerError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return problems


def with_status(ledger: Mapping[str, Any]) -> dict[str, Any]:
    """What the manifest stores: the per-source ledger plus ``ok`` and the failed identities."""
    problems = check(ledger)
    return {"ok": not problems, "problems": problems, "sources": {k: dict(v) for k, v in ledger.items()}}


def data_log_drops(ledger: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The drop side of the trainer's ``data_stats`` protocol (``stacklm.callbacks``) read off a
    ledger: ``dropped_docs`` (stage -> source -> reason, every ``stage/reason`` of the ledger's
    dropped documents), ``dropped_tokens`` (source -> reason: what the mix budget cut) and
    ``holdout_docs`` (source -> documents set aside for the other split). Read from the ledger,
    not counted again, so the data logs show what the ledger shows (``stacklm ledger``)."""
    dropped_docs: dict[str, dict[str, dict[str, int]]] = {}
    dropped_tokens: dict[str, dict[str, int]] = {}
    holdout: dict[str, int] = {}
    for name, units in ledger.items():
        for key, n in units["docs"]["dropped"].items():
            stage, _, reason = key.partition("/")
            if n:
                dropped_docs.setdefault(stage, {}).setdefault(name, {})[reason] = int(n)
        for key, n in units["tokens"]["dropped"].items():
            if n:
                dropped_tokens.setdefault(name, {})[key.partition("/")[2]] = int(n)
        if units["docs"]["holdout"]:
            holdout[name] = int(units["docs"]["holdout"])
    return {"dropped_docs": dropped_docs, "dropped_tokens": dropped_tokens, "holdout_docs": holdout}


def format_ledger(ledger: Mapping[str, Mapping[str, Mapping[str, Any]]], title: str = "",
                  removal_similarity: Mapping[str, Mapping[str, int]] | None = None) -> str:
    """A table per source: each term in documents and tokens, then the two identities.
    ``removal_similarity`` (per source, the dedup evidence's histogram,
    ``DedupEvidence.histogram``): under a source's dedup drops, how similar the removed
    documents were to the copies kept."""
    from stacklm.data.dedup.evidence import compact_histogram

    lines = [title] if title else []
    for name, units in ledger.items():
        d, t = units["docs"], units["tokens"]
        lines.append(f"source {name}")
        lines.append(f"  {'':38} {'docs':>14} {'tokens':>16}")

        def line(label: str, a: Any, b: Any) -> None:
            lines.append(f"  {label:38} {a if isinstance(a, str) else f'{a:,}':>14} {b if isinstance(b, str) else f'{b:,}':>16}")

        line("read", d["read"], t["read"])
        for reason in sorted(set(d["dropped"]) | set(t["dropped"])):
            line(f"- dropped {reason}", d["dropped"].get(reason, "-"), t["dropped"].get(reason, "-"))  # "-": not counted in that unit
        dropped = sum(n for r, n in d["dropped"].items() if r.startswith("dedup/"))
        if removal_similarity is not None and dropped:
            hist = removal_similarity.get(name, {})
            decided = sum(hist.values())
            # a budget that stops before a source's end reads fewer documents than the decision removed
            more = f" (all {decided:,} the decision removed; {dropped:,} were in what this build read)" if decided != dropped else ""
            lines.append(f"    dedup removals by similarity to the kept copy: {compact_histogram(hist)}{more}")
        line("- holdout (other split)", d["holdout"], "-")
        for stage in sorted(set(d["buffered"]) | set(t["buffered"])):
            line(f"- buffered before the mix: {stage}", d["buffered"].get(stage, 0), t["buffered"].get(stage, "-"))
        line("= kept (mixed)", d["kept"], t["kept"])
        line("  delivered", d["delivered"], t["delivered"])
        for stage in sorted(set(d["remainder"]) | set(t["remainder"])):
            line(f"  + remainder: {stage}", d["remainder"].get(stage, 0), t["remainder"].get(stage, 0))
        for why in sorted(set(d.get("undelivered", {})) | set(t.get("undelivered", {}))):
            line(f"  + undelivered: {why}", d["undelivered"].get(why, 0), t["undelivered"].get(why, 0))
        bad = check({name: units})
        lines.append("  identities: " + ("OK" if not bad else "FAIL\n    " + "\n    ".join(bad)))
    return "\n".join(lines)
