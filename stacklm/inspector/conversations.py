"""Conversations: render with the tokenizer's own template and run every check on it."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from stacklm.chat import ASSISTANT, Turn, render_conversation
from stacklm.inspector.batches import BatchView, check_view
from stacklm.inspector.families import text_findings
from stacklm.inspector.findings import ERROR, INFO, Finding
from stacklm.inspector.tokenizer_view import InspectTokenizer

TEMPLATE_TEXT_HINT = ("; if the data legitimately discusses chat templates, pass --allow-template-text "
                      "(special strings in content stay bytes either way)")


def check_conversation(
    turns: Sequence[Turn], tok: InspectTokenizer, where: str, allow_template_text: bool = False,
    rendered: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[list[Finding], np.ndarray, np.ndarray]:
    """Render with the tokenizer's template and run every check; ``(findings, ids, mask)``.
    The turns passed ``chat.validate_conversation`` (the rule the SFT pipes apply) first.
    Any chat-format marker in a message is an error unless ``allow_template_text``.
    ``rendered``: the ``(ids, mask)`` a pipeline made of it (stacklm layout; a preference side,
    whose prompt bears no loss): its ids must be the template's, and the checks judge its mask."""
    out: list[Finding] = []
    for i, t in enumerate(turns):
        for f in text_findings(t.text(), tok.family, tok.special_strings, f"{where} message {i} ({t.role})", strict=not allow_template_text):
            if f.severity == ERROR and f.check in ("foreign_template", "special_string_in_text") and not allow_template_text:
                f.message += TEMPLATE_TEXT_HINT
            out.append(f)
    try:
        ids, mask = tok.render(turns)
    except Exception as e:  # a template that raises (unknown role, ...) is a finding, not a crash
        out.append(Finding("invalid_conversation", ERROR, f"the chat template cannot render it: {type(e).__name__}: {e}", where))
        return out, np.zeros(0, np.int64), np.zeros(0, np.int8)
    if any(s in t.text() for t in turns for s in tok.special_strings):
        out += _special_injection(turns, ids, tok, where)
    if tok.layout is not None:
        if tok.is_hf:
            ref_ids, ref_mask = render_conversation(turns, tok.raw)
            if ref_ids.tolist() != ids.tolist() or ref_mask.tolist() != mask.tolist():
                k = next((i for i, (a, b) in enumerate(zip(ids.tolist(), ref_ids.tolist())) if a != b), min(len(ids), len(ref_ids)))
                out.append(Finding("template_mismatch", ERROR, f"the chat template renders {len(ids)} tokens, render_conversation "
                                   f"{len(ref_ids)} (first difference at token {k}"
                                   + ("" if ref_ids.tolist() != ids.tolist() else "; the assistant masks differ") + ")", where))
        if rendered is not None:
            if np.asarray(rendered[0]).tolist() != ids.tolist():
                out.append(Finding("template_mismatch", ERROR, f"the chat template renders {len(ids)} tokens, the pipeline "
                                   f"{len(rendered[0])}", where))
            ids, mask = np.asarray(rendered[0], np.int64), np.asarray(rendered[1], np.int8)
        view = BatchView(ids[None], mask[None].astype(bool), np.zeros((1, len(ids)), np.int64), np.arange(len(ids))[None], "stacklm")
        out += check_view(view, tok, where, complete=True)[0]
    else:
        out += _foreign_mask_findings(turns, ids, mask, tok, where)
    return out, ids, mask


def _special_injection(turns: Sequence[Turn], ids: np.ndarray, tok: InspectTokenizer, where: str) -> list[Finding]:
    """Did a special string in content become a special id? Compare with the same conversation
    whose special strings are neutralised."""
    pattern = re.compile("|".join(re.escape(s) for s in tok.special_strings))
    clean = [Turn(t.role, pattern.sub("x", t.content), pattern.sub("x", t.reasoning) if t.reasoning else t.reasoning, t.weight, t.completion)
             for t in turns]
    try:
        clean_ids, _ = tok.render(clean)
    except Exception:  # noqa: BLE001 - the original rendered; judge on that alone
        return []
    n = sum(int(i) in tok.special_ids for i in ids.tolist())
    n_clean = sum(int(i) in tok.special_ids for i in clean_ids.tolist())
    if n > n_clean:
        return [Finding("special_string_in_text", ERROR, f"{n - n_clean} special-token string(s) in content became special ids: "
                        "a message can forge turns; escape content or encode it with split_special_tokens=True", where)]
    return [Finding("special_string_in_text", INFO, "special-token strings in content stayed bytes (checked)", where)]


def _foreign_mask_findings(turns: Sequence[Turn], ids: np.ndarray, mask: np.ndarray, tok: InspectTokenizer, where: str) -> list[Finding]:
    out: list[Finding] = []
    if any(t.role == ASSISTANT for t in turns) and not mask.any():
        has_gen = re.search(r"\{%-?\s*generation\s*-?%\}", str(tok.chat_template or ""))
        hint = "" if has_gen else " (the template has no {% generation %} block, so transformers cannot mark assistant tokens)"
        out.append(Finding("no_assistant_loss", ERROR, f"the assistant mask is all zeros{hint}", where))
    spans = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])) == -1) - 1
    for last in spans:
        if int(ids[last]) not in tok.special_ids:
            out.append(Finding("assistant_turn_not_closed", ERROR, f"an assistant span ends on {tok.token_repr(int(ids[last]))!r}, "
                               "not on an end-of-turn/EOS special: the model never learns to stop", where))
            break
    if tok.eos_id is None or tok.eos_id not in ids.tolist():
        out.append(Finding("missing_eos", ERROR, f"the rendered sequence has no EOS (id {tok.eos_id})", where))
    return out
