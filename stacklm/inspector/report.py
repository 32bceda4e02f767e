"""The report of one inspection and its printed form."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stacklm.inspector.findings import CHECKS, ERROR, INFO, WARNING, Finding
from stacklm.inspector.tokenizer_view import InspectTokenizer


@dataclass
class Sample:
    """What the report shows for the first sequence."""

    ids: np.ndarray
    trained: np.ndarray
    labels: list[str]
    pos: np.ndarray | None = None
    seg: np.ndarray | None = None


@dataclass
class Report:
    input: str
    kind: str
    tokenizer: str
    findings: list[Finding] = field(default_factory=list)
    sample: Sample | None = None
    sequences: int = 0
    ending_with_eos: int = 0
    chars_tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    eos_id: int | None = None
    trained_tokens: int = 0  # loss-bearing tokens seen, and how many of them were a stop token
    trained_stop_tokens: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # e.g. truncation outcomes (--seq-len)

    N_LOCATIONS = 5

    def groups(self) -> list[dict[str, Any]]:
        """Each distinct finding once: check, severity, the first message, how many times it
        occurred and its first ``N_LOCATIONS`` locations; errors first, then in check order."""
        out: dict[tuple[str, str, str], dict[str, Any]] = {}
        for f in self.findings:
            g = out.get(f.group_key())
            if g is None:
                g = out[f.group_key()] = {"check": f.check, "severity": f.severity, "message": f.message, "count": 0, "where": []}
            g["count"] += 1
            if f.where and len(g["where"]) < self.N_LOCATIONS:
                g["where"].append(f.where)
        order = {c: i for i, c in enumerate(CHECKS)}
        rank = {ERROR: 0, WARNING: 1, INFO: 2}
        return sorted(out.values(), key=lambda g: (order.get(g["check"], len(order)), rank.get(g["severity"], 3)))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    def by_check(self, check: str, severity: str | None = None) -> list[Finding]:
        return [f for f in self.findings if f.check == check and (severity is None or f.severity == severity)]

    def tokens_per_char(self) -> dict[str, float]:
        return {d: (t / c if c else 0.0) for d, (c, t) in sorted(self.chars_tokens.items())}

    def to_dict(self) -> dict[str, Any]:
        return {
            "input": self.input,
            "kind": self.kind,
            "tokenizer": self.tokenizer,
            "sequences": self.sequences,
            "ending_with_eos": self.ending_with_eos,
            "tokens_per_char": self.tokens_per_char(),
            "trained_tokens": self.trained_tokens,
            "trained_stop_tokens": self.trained_stop_tokens,
            "counts": dict(self.counts),
            "findings": self.groups(),
            "errors": len(self.errors),
            "warnings": sum(f.severity == WARNING for f in self.findings),
        }


def format_report(report: Report, tok: InspectTokenizer, n_tokens: int = 48, max_chars: int = 1500) -> str:
    lines = [f"stacklm inspect: {report.input} ({report.kind}, {report.sequences} sequences) with tokenizer {report.tokenizer}"]
    s = report.sample
    if s is not None:
        text = tok.decode(s.ids[s.ids != tok.pad_id] if tok.pad_id is not None else s.ids)
        lines += ["", "== decoded text (first sequence) ==", text if len(text) <= max_chars else text[:max_chars] + f" … [{len(text) - max_chars} more chars]"]
        real = s.ids[s.ids != tok.pad_id] if tok.pad_id is not None else s.ids
        last = int(real[-1]) if len(real) else None
        present = tok.eos_id is not None and tok.eos_id in real.tolist()
        lines += ["", "== EOS check ==",
                  f"last token: {last} {tok.token_repr(last) if last is not None else '-'} | tokenizer EOS id: {tok.eos_id} "
                  f"({tok.token_repr(tok.eos_id) if tok.eos_id is not None else 'none'}) | EOS present: {'yes' if present else 'NO'}",
                  f"sequences containing/ending with EOS: {report.ending_with_eos} of {report.sequences}"]
        lines += ["", f"== first {min(n_tokens, len(s.ids))} tokens (TRAIN = the model is trained to produce this token) ==",
                  f"{'idx':>5} {'id':>7}  {'token':<22} {'role':<14} {'pos':>5} {'seq':>4}  TRAIN"]
        for j in range(min(n_tokens, len(s.ids))):
            tid = int(s.ids[j])
            pos = "" if s.pos is None else int(s.pos[j])
            seg = "" if s.seg is None else int(s.seg[j])
            lines.append(f"{j:>5} {tid:>7}  {tok.token_repr(tid)[:22]:<22} {s.labels[j][:14]:<14} {pos:>5} {seg:>4}  "
                         f"{'TRAIN' if s.trained[j] else '.'}")
    lines += ["", "== tokens per character ==", f"{'domain':<12} {'chars':>10} {'tokens':>10} {'tokens/char':>12}"]
    for d, (c, t) in sorted(report.chars_tokens.items()):
        lines.append(f"{d:<12} {c:>10} {t:>10} {t / c if c else 0:>12.3f}")
    lines += ["", "== checks =="]
    groups = report.groups()
    for check, what in CHECKS.items():
        found = [g for g in groups if g["check"] == check]
        worst = next((sev for sev in (ERROR, WARNING, INFO) if any(g["severity"] == sev for g in found)), None)
        if worst is None:
            lines.append(f"  ok       {check}: {what}")
            continue
        lines.append(f"  {worst.upper():<8} {check}: {sum(g['count'] for g in found)} finding(s)")
        for g in found:  # each distinct message once, with its count and first locations
            times = f" [x{g['count']}]" if g["count"] > 1 else ""
            lines.append(f"           {g['severity']}{times}: {g['message']}")
            if g["where"]:
                more = f" (+{g['count'] - len(g['where'])} more)" if g["count"] > len(g["where"]) else ""
                lines.append(f"             at: {'; '.join(g['where'])}{more}")
    n_err, n_warn = len(report.errors), sum(f.severity == WARNING for f in report.findings)
    lines += ["", f"{n_err} error(s), {n_warn} warning(s)" + (" -> exit status 1" if n_err else "")]
    return "\n".join(lines)
