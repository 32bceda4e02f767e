"""``stacklm report RUN``: one self-contained HTML page of a training run, from its own logs.

For a run without W&B (or to look without opening it): the last step reached, every drop, cut
and holdout count under the key the CSV and W&B log it as (``stacklm.callbacks.drop_rows``), the
loss curve (train and validation, with a line where a resume started), the realized against
the target mix over the steps, documents dropped by stage and reason, the delivered documents'
length histogram per source and the padding fraction. Read from what the run wrote:

- every ``metrics.csv`` a Lightning ``CSVLogger`` wrote under ``RUN`` (one ``version_N`` per fit,
  or one for the whole run when a resume continued it, ``stacklm.run_identity``, whose
  ``run/resumed_at`` rows mark the resumes: a resume's rows continue the first fit's steps; a
  fit that starts over -- a new run in the
  same folder, such as an SFT run after its pre-training -- is another run, and the newest run
  is the one drawn), with the scalars ``DataStatsCallback`` logs;
- ``data_stats.json`` beside them (``stacklm.callbacks.DATA_STATS_FILE``, the newest by step):
  the histograms and drops the scalars do not carry.

Nothing is recomputed: every number drawn is one the run logged. matplotlib draws the PNGs
(``pip install 'stacklm[report]'``); they are embedded in the HTML (base64) and also written
beside it, ``<report>_files/*.png``, so each can be opened on its own.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

from stacklm.errors import UserError


def _version_key(path: Path) -> tuple:
    m = re.search(r"version_(\d+)", str(path))
    return (int(m.group(1)) if m else -1, str(path))


def read_run(run: str | Path) -> dict[str, Any]:
    """The run's logged rows (all fits in order) and its newest data snapshot."""
    from stacklm.callbacks import DATA_STATS_FILE

    run = Path(run)
    if not run.is_dir():
        raise UserError(f"{run}: not a directory; give the run's folder (its trainer.default_root_dir or CSV logger's save_dir)")
    csvs = sorted(run.rglob("metrics.csv"), key=_version_key)
    if not csvs:
        raise UserError(f"{run}: no metrics.csv under it; the report reads a Lightning CSVLogger's files "
                          "(stacklm-train's default logger), so add one to trainer.logger")
    # Runs: a fit whose first logged step lies past the run's first one continues that run (a
    # resume: from the last checkpoint, or from an earlier one after a crash, whose re-logged
    # steps then replace the old ones); a fit that starts at the run's first step again is
    # another run (a new fit, an SFT run started with init_from) logged into the same folder.
    # The report draws the newest run.
    runs: list[list[tuple[Path, list[dict[str, float]]]]] = []
    damaged: list[str] = []  # "path:line" of rows skipped: a fit killed during a flush leaves its last line cut
    for path in csvs:
        fit_rows = []
        with path.open(newline="", errors="replace") as f:
            reader = csv.DictReader(f)
            for r in reader:
                try:
                    if None in r or None in r.values():  # more or fewer fields than the header: a cut or garbled line
                        raise ValueError("field count")
                    values = {k: float(v) for k, v in r.items() if k and v != ""}
                except ValueError:
                    damaged.append(f"{path}:{reader.line_num}")
                    continue
                if "step" in values:
                    fit_rows.append(values)
        if not fit_rows:
            continue
        first = runs[-1][0][1] if runs else None
        if first is not None and min(r["step"] for r in fit_rows) > min(r["step"] for r in first) + 1:
            runs[-1].append((path, fit_rows))
        else:
            runs.append([(path, fit_rows)])
    if not runs:
        raise UserError(f"{run}: its metrics.csv files hold no logged step yet")
    newest = runs[-1]
    rows = [r for _, fit_rows in newest for r in fit_rows]
    starts = [int(min(r["step"] for r in fit_rows)) for _, fit_rows in newest[1:]]
    # a resume that continued the same CSV (stacklm.run_identity) says where, in its own row
    starts = sorted({*starts, *(int(r["run/resumed_at"]) for r in rows if "run/resumed_at" in r)})
    csvs = [p for p, _ in newest]
    others = [str(p) for older in runs[:-1] for p, _ in older]
    snapshots = []
    for path in (p.parent / DATA_STATS_FILE for p in csvs):
        if not path.exists():
            continue
        try:
            snapshots.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not readable JSON ({e}); delete it or re-run the fit") from None
    stats = max(snapshots, key=lambda s: s.get("step", -1)) if snapshots else {}
    return {"run": str(run), "csv": [str(p) for p in csvs], "rows": rows, "resumes": starts, "stats": stats,
            "other_runs": others, "damaged_rows": damaged}


def _series(rows: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    pts = sorted({r["step"]: r[key] for r in rows if key in r}.items())
    return [p[0] for p in pts], [p[1] for p in pts]


def _plot(ax, xs: list[float], ys: list[float], *args: Any, **kw: Any) -> None:
    """``ax.plot``, with a marker for a series of one point (a line of one point draws nothing)."""
    if len(xs) == 1:
        kw.setdefault("marker", "o")
    ax.plot(xs, ys, *args, **kw)


def _columns(rows: list[dict[str, float]], prefix: str) -> list[str]:
    return sorted({k[len(prefix):] for r in rows for k in r if k.startswith(prefix)})


def figures(data: dict[str, Any]) -> dict[str, Any]:
    """name -> matplotlib Figure, for every picture the run has data for."""
    import matplotlib

    from stacklm.callbacks import dropped_docs_by_reason

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, stats, out = data["rows"], data["stats"], {}

    def resumes(ax) -> None:
        for s in data["resumes"]:
            ax.axvline(s, color="grey", ls=":", lw=1)
            ax.annotate("resumed", (s, 1), xycoords=("data", "axes fraction"), fontsize=8, color="grey",
                        ha="left", va="top", xytext=(2, -2), textcoords="offset points")

    steps, loss = _series(rows, "train/loss")
    if steps:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        _plot(ax, steps, loss, lw=1.2, label="train/loss")
        vs, vl = _series(rows, "val/loss")
        if vs:
            ax.plot(vs, vl, "o-", ms=4, label="val/loss")
        resumes(ax)
        ax.set(xlabel="step", ylabel="loss", title="Loss")
        ax.legend()
        out["loss"] = fig
    sources = _columns(rows, "data/realized_weight/")
    if sources:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for i, src in enumerate(sources):
            color = f"C{i}"
            _plot(ax, *_series(rows, f"data/realized_weight/{src}"), color=color, lw=1.5, label=f"{src} realized")
            _plot(ax, *_series(rows, f"data/target_weight/{src}"), color=color, lw=1, ls="--", label=f"{src} target")
        resumes(ax)
        ax.set(xlabel="step", ylabel="share of tokens delivered", title="Mix: realized (solid) vs target (dashed)", ylim=(0, None))
        ax.legend(fontsize=7, ncol=2)
        out["mix"] = fig
    drops = {label: n for label, n in dropped_docs_by_reason(stats).items() if n}  # the W&B drops chart's
    if drops:
        names = sorted(drops, key=drops.get)
        fig, ax = plt.subplots(figsize=(7, max(2.2, 0.9 + 0.32 * len(names))))
        ax.barh(names, [drops[n] for n in names], color="C3")
        for y, n in enumerate(names):
            ax.annotate(f"{drops[n]:,}", (drops[n], y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.set(xlabel="documents", title=f"Dropped documents by stage and reason (to step {stats.get('step')})")
        out["drops"] = fig
    hist = stats.get("doc_length_hist") or {}
    if hist.get("counts") and any(sum(c) for c in hist["counts"].values()):
        # Only the bins up to the last one holding a document, the open last bin (its edge is a
        # huge sentinel) drawn as twice the width of the one before it.
        used = max(i for c in hist["counts"].values() for i, n in enumerate(c) if n) + 1
        lo = min(i for c in hist["counts"].values() for i, n in enumerate(c) if n)
        edges = list(hist["edges"][: used + 1])
        if used == len(hist["edges"]) - 1 and len(edges) > 2:
            edges[-1] = 2 * edges[-2]
        edges[0] = max(edges[0], 1)  # a log axis: the first bin [0, 8) drawn from 1
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for i, (src, counts) in enumerate(sorted(hist["counts"].items())):
            ax.stairs(counts[lo:used], edges[lo:], label=f"{src} ({sum(counts):,} docs)", color=f"C{i}", lw=1.5)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="document length (tokens)", ylabel="documents", title="Delivered document lengths per source")
        ax.legend(fontsize=8)
        out["doc_lengths"] = fig
    ws, wait = _series(rows, "loader/wait_fraction")
    if ws:
        fig, ax = plt.subplots(figsize=(7, 2.8))
        _plot(ax, ws, [100 * w for w in wait], color="C4", label="slowest rank")
        ms, mean = _series(rows, "loader/wait_fraction_mean")
        if ms:
            _plot(ax, ms, [100 * w for w in mean], color="C4", ls="--", lw=1, label="mean over ranks")
        resumes(ax)
        clock = "GPU clock" if any(v for _, v in zip(*_series(rows, "loader/wait_on_device"))) else "host clock"
        ax.set(xlabel="step", ylabel="% of the window", ylim=(0, 100), title=f"Step waiting for its batch ({clock})")
        ax.legend(fontsize=8)
        out["loader_wait"] = fig
    ps, pad = _series(rows, "data/padding_fraction")
    if ps:
        fig, ax = plt.subplots(figsize=(7, 2.8))
        _plot(ax, ps, [100 * p for p in pad], color="C2")
        resumes(ax)
        ax.set(xlabel="step", ylabel="% of positions", title="Padding (of all positions delivered so far)", ylim=(0, None))
        out["padding"] = fig
    for fig in out.values():
        fig.tight_layout()
    return out


def summary(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows of the page's table: the run's last logged values."""
    rows, stats = data["rows"], data["stats"]
    items: list[tuple[str, str]] = [("run", data["run"]), ("fits (CSV versions)", f"{len(data['csv'])}: "
                                     + ", ".join(Path(p).parent.name for p in data["csv"]))]
    if data.get("other_runs"):
        items.append(("other runs in this folder (not drawn)", ", ".join(Path(p).parent.name for p in data["other_runs"])))
    if data.get("damaged_rows"):
        items.append(("damaged CSV rows skipped", ", ".join(data["damaged_rows"])))
    reached = last_step(data)
    if reached is not None:
        items.append(("last step reached", f"{reached:,}"))
    steps, loss = _series(rows, "train/loss")
    if steps:
        items.append(("last train/loss", f"{loss[-1]:.4f} at step {int(steps[-1]):,}"))
    vs, vl = _series(rows, "val/loss")
    if vs:
        items.append(("last val/loss", f"{vl[-1]:.4f} at step {int(vs[-1]):,}"))
    if stats:
        items.append(("data counts", f"to step {int(stats.get('step', -1)):,} (data_stats.json)"))
    for src, r in sorted((stats.get("realized") or {}).items()):
        # a document counts once, in the batch (stream) or packed row (shards) that holds its
        # first token: a source of documents longer than a row has tokens before any document
        rows_held = f" in {int(r['rows']):,} packed rows" if "rows" in r else ""  # shards mode delivers rows, not documents
        items.append((f"source {src}", f"{int(r.get('tokens', 0)):,} tokens{rows_held}, {int(r.get('docs', 0)):,} documents "
                      f"begun (first token delivered); realized {float(r.get('realized_weight') or 0):.3f} vs target "
                      f"{float(r.get('target_weight') or 0):.3f}"))
    delivered = stats.get("delivered") or {}
    if delivered.get("batches"):
        items.append(("delivered", f"{int(delivered['batches']):,} batches, {int(delivered.get('positions', 0)):,} positions, "
                      f"{int(delivered.get('tokens', 0)):,} tokens"))
    if "padding_fraction" in stats:
        items.append(("padding", f"{100 * float(stats['padding_fraction']):.2f}% of positions"))
    clock = stats.get("stage_seconds") or {}
    if sum(clock.values()) > 0:  # where the loader workers' time went, largest first
        total = sum(clock.values())
        items.append(("loader workers' time by stage", f"{total:,.1f} s: " + ", ".join(
            f"{stage} {100 * sec / total:.0f}%" for stage, sec in sorted(clock.items(), key=lambda kv: -kv[1]) if sec / total >= 0.005)))
    ws, wait = _series(rows, "loader/wait_fraction")
    if ws:
        items.append(("step waiting for its batch", f"{100 * wait[-1]:.1f}% of the last window (slowest rank), "
                      f"{100 * sum(wait) / len(wait):.1f}% averaged over {len(wait):,} windows"))
    return items


def last_step(data: dict[str, Any]) -> int | None:
    """The last step the run reached: the largest step any row logged (the data callback logs
    the final step when the fit ends, whatever the logging interval) or the data snapshot's."""
    steps = [r["step"] for r in data["rows"]] + ([data["stats"]["step"]] if "step" in data["stats"] else [])
    return int(max(steps)) if steps else None


def drop_table(stats: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(what, source, count, logged as) of every non-zero drop, cut and set-aside count
    (``stacklm.callbacks.drop_rows``: the keys the CSV and W&B hold)."""
    from stacklm.callbacks import drop_rows

    kinds = {"dropped_docs": "dropped", "dropped_tokens": "dropped", "holdout_docs": "set aside (not a drop)",
             "cut_docs": "kept, cut short", "decontam": "evaluation-set overlap"}
    return [(f"{kinds[r['kind']]}: {r['label']}", r["source"] or "all", f"{r['count']:,} {r['unit']}", r["key"])
            for r in drop_rows(stats) if r["count"]]


def write_report(run: str | Path, out: str | Path | None = None) -> Path:
    """Write ``out`` (default ``RUN/report.html``) and its PNGs; returns the HTML's path."""
    data = read_run(run)
    try:
        figs = figures(data)
    except ModuleNotFoundError as e:
        raise UserError(f"stacklm report draws with matplotlib ({e}); pip install 'stacklm[report]'") from None
    out = Path(out) if out else Path(run) / "report.html"
    files = out.parent / f"{out.stem}_files"
    files.mkdir(parents=True, exist_ok=True)
    parts = [f"<!doctype html><meta charset='utf-8'><title>stacklm report: {html.escape(data['run'])}</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}td{padding:2px 10px}"
             "img{max-width:100%;border:1px solid #ddd;margin:8px 0}</style>",
             f"<h1>Run report</h1><table>"]
    parts += [f"<tr><td><b>{html.escape(k)}</b></td><td>{html.escape(v)}</td></tr>" for k, v in summary(data)]
    parts.append("</table>")
    drops = drop_table(data["stats"])
    if drops:
        parts.append(f"<h2>Drops, cuts and holdout (to step {data['stats'].get('step')})</h2><table>"
                     "<tr><th>what</th><th>source</th><th>count</th><th>logged as</th></tr>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in drops]
        parts.append("</table>")
    import matplotlib.pyplot as plt

    for name, fig in figs.items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        (files / f"{name}.png").write_bytes(buf.getvalue())
        parts.append(f"<h2>{html.escape(name.replace('_', ' '))}</h2>"
                     f"<img alt='{name}' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>")
    if not figs:
        parts.append("<p>No step was logged yet.</p>")
    parts.append(f"<p><small>From {len(data['csv'])} metrics.csv file(s) and data_stats.json at step "
                 f"{data['stats'].get('step', '-')}.</small></p>")
    out.write_text("\n".join(parts))
    for where in data["damaged_rows"]:
        print(f"stacklm report: skipped the damaged row at {where} (cut or garbled: a fit killed while it wrote its log)",
              file=sys.stderr)
    return out
