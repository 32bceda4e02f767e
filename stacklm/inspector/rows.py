"""Per-token roles in the stacklm layout: label every token of a row, find unclosed
assistant turns and conversations without EOS."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stacklm.chat import ASSISTANT
from stacklm.inspector.tokenizer_view import InspectTokenizer

# What a token may be trained on: assistant content, the <|end|> closing an assistant turn,
# the <|eos|> right after it, and plain (non-chat) text with its <|eos|> (pre-training).
# A tool call is the assistant's own output (``roles_to_train: [assistant, tool_call]``).
TRAINABLE = {"assistant", "end:assistant", "eos:assistant", "tool_call", "end:tool_call", "eos:tool_call", "text", "eos:text"}
UNKNOWN = "unknown"  # the start of a row cut from a conversation whose role marker is in another row
UNJUDGED = {UNKNOWN, f"end:{UNKNOWN}", f"eos:{UNKNOWN}"}


@dataclass
class RowScan:
    labels: list[str]
    conv: np.ndarray  # conversation index per token (-1 before the first <|bos|>; pad = -2)
    unclosed: list[tuple[int, str]]  # (token index, why) of assistant turns left open
    no_eos: list[int]  # start index of conversations that end without <|eos|>
    tail_role: str | None = None  # the turn still open where the row ends (no padding, no EOS after it)
    starts_inside: bool = False  # the row starts inside a conversation cut by the window


def scan_row(ids: Sequence[int], tok: InspectTokenizer, complete: bool) -> RowScan:
    """Label every token of a row and find unclosed assistant turns / conversations without
    EOS. ``complete``: the row is a whole sequence (else its tail may be cut by the window,
    and what runs into the row's end is not judged)."""
    ids = [int(t) for t in ids]
    lay = tok.layout
    role_of = {v: k for k, v in lay.role.items()} if lay is not None else {}
    bos, eos, pad = tok.bos_id, tok.eos_id, tok.pad_id
    end = lay.end if lay is not None else None
    labels: list[str] = []
    conv = np.full(len(ids), -1, dtype=np.int64)
    unclosed: list[tuple[int, str]] = []
    no_eos: list[int] = []
    c, start, role, in_chat, prev_label, seen_eos = -1, 0, None, False, "", False
    # A row that starts inside a conversation cut by the window (greedy packing): its leading
    # tokens belong to a turn whose role marker is in the previous row. They are "unknown",
    # never judged, rather than guessed.
    first_bos = next((j for j, t in enumerate(ids) if t == bos), len(ids)) if bos is not None else len(ids)
    starts_inside = any(t in role_of or t == end for t in ids[:first_bos])
    if starts_inside:
        role, in_chat = UNKNOWN, True

    def close_conv(j: int, why: str) -> None:
        nonlocal role
        if role == ASSISTANT:
            unclosed.append((j, why))
        role = None

    for j, t in enumerate(ids):
        if t == pad and pad is not None:
            if labels and labels[-1] != "pad":
                close_conv(j, "padding follows")
                if not seen_eos:
                    no_eos.append(start)
            lab = "pad"
            conv[j] = -2
        elif t == bos and bos is not None:
            if j > 0 and labels[-1] != "pad":
                close_conv(j, "a new conversation starts")
                if not seen_eos:
                    no_eos.append(start)
            c, start, in_chat, seen_eos, role = c + 1, j, False, False, None
            lab = "bos"
        elif t in role_of:
            close_conv(j, f"<|{role_of[t]}|> starts")
            role, in_chat = role_of[t], True
            lab = "marker"
        elif end is not None and t == end:
            lab = f"end:{role}" if role else "end:?"
            role = None
        elif t == eos and eos is not None:
            close_conv(j, "<|eos|> follows")
            after = prev_label.split(":", 1)[1] if prev_label.startswith("end:") else ""
            lab = f"eos:{after}" if after in (ASSISTANT, UNKNOWN, "tool_call") else ("eos" if in_chat else "eos:text")
            seen_eos = True
        else:
            lab = role if role else ("outside" if in_chat else "text")
        if lab != "pad":
            conv[j] = c
        labels.append(lab)
        prev_label = lab
    tail_role = role if labels and labels[-1] != "pad" else None
    if complete and labels and labels[-1] != "pad":
        close_conv(len(ids), "the sequence ends")
        if not seen_eos:
            no_eos.append(start)
    return RowScan(labels, conv, unclosed, no_eos, tail_role, starts_inside)
