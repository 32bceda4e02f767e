"""The table every prebuild ends with: tokens per source against the target, drops by reason,
how similar the documents dedup removed were to the copies kept, padding and time. Read from the top manifest only, so its numbers are the manifest's (and a
build that was already complete prints the same table)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stacklm.data.audit import INVALID_RECORDS


# Counted by the source stage, before the holdout split: every split reads every record, so
# these are the same in each split's manifest and are counted once, not summed.
READ_BY_EVERY_SPLIT = ("bytes_replaced", "nul_removed", "dropped_binary", "dropped_empty", *INVALID_RECORDS)


def drop_totals(top: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Per source: every drop reason with a non-zero count, summed over the splits (the source
    stage's once: ``READ_BY_EVERY_SPLIT``). ``invalid_records`` is left out: it is the sum of
    the invalid-record reasons listed with it."""
    out: dict[str, dict[str, int]] = {}
    for per_split in top.get("drops", {}).values():
        for src, reasons in per_split.items():
            row = out.setdefault(src, {})
            for reason, n in reasons.items():
                if not n or reason == "invalid_records":
                    continue
                if reason in READ_BY_EVERY_SPLIT:
                    row[reason] = max(row.get(reason, 0), int(n))
                else:
                    row[reason] = row.get(reason, 0) + int(n)
    return out


def summary_table(top: Mapping[str, Any], out: str, seconds: float | None = None) -> str:
    """The summary of the build whose top manifest is ``top`` (``seconds``: this run's time)."""
    build = top.get("build", {})
    when = f"{seconds:.1f}s this run" if seconds is not None else "already complete"
    lines = [f"prebuild summary: {out} (workers {build.get('workers', '?')}, {when})", ""]
    sources = top.get("sources", [])
    width = max([len("source"), len("total")] + [len(s["name"]) for s in sources])
    lines.append(f"  {'source':<{width}}  {'target':>7}  {'realized':>8}  {'train tokens':>14}  {'docs':>10}")
    for s in sources:
        lines.append(
            f"  {s['name']:<{width}}  {s['target_weight']:>7.3f}  {s['realized_weight']:>8.3f}  {s['tokens']:>14,}  {s['docs']:>10,}"
        )
    lines.append(f"  {'total':<{width}}  {'':>7}  {'':>8}  {sum(s['tokens'] for s in sources):>14,}  {sum(s['docs'] for s in sources):>10,}")
    lines += ["", f"  {'split':<6} {'sequences':>10} {'tokens':>14} {'shards':>7} {'padding':>10} {'pad %':>7}"]
    for split, m in top.get("splits", {}).items():
        pack = m.get("packing", {})
        lines.append(
            f"  {split:<6} {m['n_seq']:>10,} {m['n_tokens']:>14,} {m['shards']:>7} {pack.get('pad_tokens', 0):>10,} "
            f"{100 * pack.get('pad_fraction', 0.0):>6.2f}%"
        )
    lines += ["", "  drops by reason (train + val; records every split reads counted once):"]
    drops = drop_totals(top)
    for src in sorted(drops):
        row = drops[src]
        lines.append(f"    {src}: " + (", ".join(f"{r}={n:,}" for r, n in sorted(row.items())) if row else "none"))
    if not drops:
        lines.append("    none")
    lines += removal_similarity_lines(top, out)
    volume = top.get("read_volume")
    if volume:
        index = f"; piece index read once: {volume['index_bytes']:,} bytes" if volume.get("index_bytes") else ""
        lines += ["", f"  read volume per pass (bytes read by all tasks / input {volume['input_total']:,} bytes{index}):"]
        for p in volume["passes"]:
            lines.append(f"    {p['pass']:<17} {p['split']:<6} {p['total']:>14,}  {p['ratio']:>6.2f}x")
    for split, report in (top.get("decontamination") or {}).items():
        from stacklm.data.quality.decontam import format_report  # here: the command line loads no torch before a command

        lines.append(f"  [{split}] " + format_report(report).replace("\n", "\n  "))
    if top.get("warnings"):
        lines.append(f"  warnings: {len(top['warnings'])} (listed in the manifest's 'warnings')")
    return "\n".join(lines)


def removal_similarity_lines(top: Mapping[str, Any], out: str) -> list[str]:
    """Per source, the documents the global dedup decided to remove by how similar each is to
    the copy kept (the decision's evidence, ``global_dedup.removal_similarity``; every split):
    exact copies, then the estimated Jaccard bins. Nothing without global dedup; one line when
    the build kept no evidence."""
    from stacklm.data.dedup.evidence import add_histograms, histogram_labels

    dedup = top.get("global_dedup")
    if not dedup:
        return []
    per_split = dedup.get("removal_similarity")
    if per_split is None:
        return ["", "  dedup removals by similarity: no evidence (an index decided before stacklm kept it); "
                "a new build keeps it"]
    rows: dict[str, dict[str, int]] = {}
    for hist in per_split.values():
        add_histograms(rows, hist)
    labels = histogram_labels()
    width = max([len("source"), len("total")] + [len(s) for s in rows])
    # the decision's removals over everything signed: a budget that stops early reads (and counts
    # among the drops above) only some of them, so say which number this is
    lines = ["", f"  dedup removals by similarity to the kept copy (estimated Jaccard; all splits; every removal the decision "
             f"made over the documents it signed, of which the drops above count those this build read; "
             f"why one was removed: stacklm inspect {out} --why SOURCE/FILE/ROW):",
             f"    {'source':<{width}}  " + "  ".join(f"{lab:>9}" for lab in labels)]
    for src in sorted(rows):
        lines.append(f"    {src:<{width}}  " + "  ".join(f"{rows[src].get(lab, 0):>9,}" for lab in labels))
    if not rows:
        lines.append("    none")
    else:
        lines.append(f"    {'total':<{width}}  " + "  ".join(f"{sum(r.get(lab, 0) for r in rows.values()):>9,}" for lab in labels))
    return lines
