"""``stacklm inspect``: the encode -> decode -> read loop as a command, plus the named checks
that catch the silent SFT bugs (a loss that still falls on a quietly worse model).

Inputs: a conversations file (``.jsonl``/``.parquet``, ``messages`` or ShareGPT
``conversations``), a prebuilt shard directory (``shard_*.tokens.bin`` + ``manifest.json``), or
a saved batch (``torch.save`` of a dict: the stacklm contract ``input_ids/targets/position_ids/
seq_ids``, or HF style ``input_ids/labels[/attention_mask][/position_ids]``). Tokenizer: our
artifact, or any Hugging Face tokenizer directory (a chat template is needed to render
conversations).

It prints the decoded text, the EOS check, a per-token TRAIN table, tokens per character by
domain, then every check by name. Exit status 1 when an error-level finding is present.

The checks (``CHECKS``) work on token ids and a per-token "trained" flag, so the same code
judges a rendered conversation, a packed batch and a shard window. Roles per token are read
from the stacklm layout (``<|role|> ... <|end|>``); for a foreign tokenizer the role checks
fall back to what its template's ``{% generation %}`` mask says.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.chat import (
    ASSISTANT,
    DEFAULT_ROLE_ALIASES,
    IGNORE_INDEX,
    ChatFormatError,
    ChatTokens,
    Turn,
    chat_tokens,
    conversation_from_record,
    render_conversation,
    validate_conversation,
)
from stacklm.errors import StackLMError

ERROR, WARNING, INFO = "error", "warning", "info"
ARTIFACT_NAME = "tokenizer.stacklm.json"

# The named checks, in report order.
CHECKS: dict[str, str] = {
    "invalid_conversation": "rows that cannot be trained on (malformed JSON, unknown role, empty message, no assistant)",
    "foreign_template": "role markers of another chat-template family inside content or text",
    "special_string_in_text": "special-token strings in untrusted text (must stay bytes)",
    "template_mismatch": "the tokenizer's chat template renders other ids/mask than stacklm's render_conversation",
    "assistant_turn_not_closed": "an assistant turn not closed by end-of-turn/EOS",
    "missing_eos": "a sequence or conversation without EOS",
    "cross_conversation_attention": "packed rows whose attention segments span two conversations",
    "positions_not_reset": "position ids that do not restart at 0 for each conversation",
    "targets_not_shifted": "targets that are not the next token (labels = input_ids in a shifted contract)",
    "loss_on_non_assistant": "loss-bearing targets on system/user/tool/marker tokens",
    "no_assistant_loss": "conversations whose assistant tokens carry no loss (all-zero assistant mask)",
}


@dataclass
class Finding:
    check: str
    severity: str
    message: str
    where: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"check": self.check, "severity": self.severity, "message": self.message, "where": self.where}


# ---------------------------------------------------------------------------------------
# Template families: how to recognise a hand-concatenated chat format in text
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TemplateFamily:
    name: str
    markers: tuple[str, ...]  # strings that mark the family (bare: a warning)
    structure: re.Pattern  # a role-structured use of them (a rendered turn: an error)


FAMILIES: tuple[TemplateFamily, ...] = (
    TemplateFamily("chatml", ("<|im_start|>", "<|im_end|>"), re.compile(r"<\|im_start\|>\s*(system|user|assistant|tool)\b")),
    TemplateFamily(
        "llama3",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"),
        re.compile(r"<\|start_header_id\|>\s*(system|user|assistant|ipython|tool)\s*<\|end_header_id\|>"),
    ),
    TemplateFamily("llama2", ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"), re.compile(r"\[INST\][\s\S]*?\[/INST\]|<<SYS>>[\s\S]*?<</SYS>>")),
    TemplateFamily("gemma", ("<start_of_turn>", "<end_of_turn>"), re.compile(r"<start_of_turn>\s*(user|model|system)\b")),
    TemplateFamily("deepseek", ("<｜User｜>", "<｜Assistant｜>"), re.compile(r"<｜(User|Assistant)｜>")),
    TemplateFamily("alpaca", ("### Instruction:", "### Response:"), re.compile(r"### Instruction:[\s\S]*?### Response:")),
    TemplateFamily(
        "stacklm",
        ("<|system|>", "<|user|>", "<|assistant|>", "<|tool_call|>", "<|tool_result|>", "<|end|>", "<|bos|>", "<|eos|>"),
        re.compile(r"<\|(system|user|assistant|tool_call|tool_result)\|>[\s\S]*?<\|end\|>"),
    ),
)


def text_findings(text: str, own_family: str | None, specials: Sequence[str], where: str) -> list[Finding]:
    """Markers of other families (``foreign_template``) and this tokenizer's own special
    strings (``special_string_in_text``) in one piece of untrusted text."""
    out: list[Finding] = []
    for fam in FAMILIES:
        if fam.name == own_family:
            continue
        m = fam.structure.search(text)
        if m:
            out.append(Finding("foreign_template", ERROR, f"{fam.name} turn {_snip(m.group())} in text: a hand-concatenated "
                               f"foreign chat format; render turns with this tokenizer's template instead", where))
            continue
        bare = [s for s in fam.markers if s in text and s not in specials]
        if bare:
            out.append(Finding("foreign_template", WARNING, f"{fam.name} marker(s) {bare} in text", where))
    own = [s for s in specials if s in text]
    if own:
        out.append(Finding("special_string_in_text", WARNING, f"special-token string(s) {own[:4]} in untrusted text", where))
    return out


def _snip(s: str, n: int = 40) -> str:
    s = s if len(s) <= n else s[: n - 1] + "…"
    return repr(s)


# ---------------------------------------------------------------------------------------
# Tokenizers: ours or any Hugging Face directory
# ---------------------------------------------------------------------------------------
class InspectError(StackLMError):
    """Bad input to ``inspect`` (a path, a tokenizer without template, ...): exit status 2."""


class InspectTokenizer:
    """A uniform view of a ``StackTokenizer`` or a transformers tokenizer for inspection."""

    def __init__(self, raw: Any, name: str) -> None:
        self.raw, self.name = raw, name
        self.is_hf = hasattr(raw, "convert_tokens_to_ids")
        try:
            self.layout: ChatTokens | None = chat_tokens(raw)
        except KeyError:
            self.layout = None  # a foreign tokenizer: roles come from its template's mask
        template = getattr(raw, "chat_template", None) if self.is_hf else None
        if self.layout is not None and isinstance(template, str) and "<|assistant|>" not in template:
            self.layout = None  # our specials, but a template of another family renders the chats
        if self.is_hf:
            added = getattr(raw, "added_tokens_decoder", {}) or {}
            specials = {int(i): str(t) for i, t in added.items() if getattr(t, "special", True)}
            for i in raw.all_special_ids:
                specials.setdefault(int(i), raw.convert_ids_to_tokens(int(i)))
            self.bos_id, self.eos_id, self.pad_id = raw.bos_token_id, raw.eos_token_id, raw.pad_token_id
            self.vocab_size = len(raw)
            self.chat_template = getattr(raw, "chat_template", None)
        else:
            specials = {i: t for t, i in raw.named_tokens.items()}
            self.bos_id, self.eos_id, self.pad_id = raw.bos_id, raw.eos_id, raw.pad_id
            self.vocab_size = raw.vocab_size
            self.chat_template = "stacklm"  # render_conversation is the template
        self.special_names = specials
        self.special_ids = set(specials)
        self.special_strings = sorted(set(specials.values()), key=len, reverse=True)
        self.family = "stacklm" if self.layout is not None else next(
            (f.name for f in FAMILIES if any(m in self.special_strings for m in f.markers)), None
        )

    # text ------------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        if self.is_hf:
            return self.raw.encode(text, add_special_tokens=False, split_special_tokens=True)
        return self.raw.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.is_hf:
            return self.raw.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self.raw.decode(ids)

    def token_repr(self, i: int) -> str:
        if i in self.special_names:
            return self.special_names[i]
        return repr(self.decode([i]))

    def text_runs(self, ids: Sequence[int]) -> list[str]:
        """The decoded text between special ids (what came from untrusted text)."""
        runs, cur = [], []
        for t in ids:
            if int(t) in self.special_ids:
                if cur:
                    runs.append(self.decode(cur))
                cur = []
            else:
                cur.append(int(t))
        if cur:
            runs.append(self.decode(cur))
        return runs

    # chat ------------------------------------------------------------------------------
    def messages_for_template(self, turns: Sequence[Turn]) -> list[dict[str, str]]:
        """Our turns in the roles this tokenizer's template knows (stacklm roles for our
        layout; the common ``tool`` role and assistant tool calls for a foreign template)."""
        if self.layout is not None:
            return [t.to_message() for t in turns]
        names = {"tool_result": "tool", "tool_call": "assistant"}
        return [{"role": names.get(t.role, t.role), "content": t.content} for t in turns]

    def render(self, turns: Sequence[Turn]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` the way this tokenizer's chat template renders the conversation."""
        if not self.is_hf:
            return render_conversation(turns, self.raw)
        out = self.raw.apply_chat_template(
            self.messages_for_template(turns), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = np.asarray(out["input_ids"], dtype=np.int64)
        mask = np.asarray(out.get("assistant_masks", np.zeros(len(ids))), dtype=np.int8)
        return ids, mask


def load_tokenizer(spec: str | Path, prefer_hf: bool = False) -> InspectTokenizer:
    """Our artifact (a ``.stacklm.json`` or a directory holding one) or an HF tokenizer dir."""
    p = Path(spec)
    if not p.exists():
        raise InspectError(f"{p}: no such tokenizer file or directory")
    ours = p if p.is_file() else p / ARTIFACT_NAME
    hf_files = p.is_dir() and any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    if ours.is_file() and not (prefer_hf and hf_files):
        from stacklm.tokenizer.bpe import StackTokenizer

        return InspectTokenizer(StackTokenizer.load(ours), str(p))
    if not hf_files:
        raise InspectError(
            f"{p}: neither a stacklm tokenizer ({ARTIFACT_NAME}) nor a Hugging Face tokenizer directory "
            "(tokenizer.json / tokenizer_config.json)"
        )
    import transformers

    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is a bad directory to the user
        raise InspectError(f"{p}: transformers cannot load this tokenizer directory: {type(e).__name__}: {e}") from None
    return InspectTokenizer(hf, str(p))


# ---------------------------------------------------------------------------------------
# Per-token roles in the stacklm layout
# ---------------------------------------------------------------------------------------
# What a token may be trained on: assistant content, the <|end|> closing an assistant turn,
# the <|eos|> right after it, and plain (non-chat) text with its <|eos|> (pre-training).
TRAINABLE = {"assistant", "end:assistant", "eos:assistant", "text", "eos:text"}
UNKNOWN = "unknown"  # the start of a row cut from a conversation whose role marker is in another row
UNJUDGED = {UNKNOWN, f"end:{UNKNOWN}", f"eos:{UNKNOWN}"}


@dataclass
class RowScan:
    labels: list[str]
    conv: np.ndarray  # conversation index per token (-1 before the first <|bos|>; pad = -2)
    unclosed: list[tuple[int, str]]  # (token index, why) of assistant turns left open
    no_eos: list[int]  # start index of conversations that end without <|eos|>


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
    if any(t in role_of or t == end for t in ids[:first_bos]):
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
            lab = f"eos:{after}" if after in (ASSISTANT, UNKNOWN) else ("eos" if in_chat else "eos:text")
            seen_eos = True
        else:
            lab = role if role else ("outside" if in_chat else "text")
        if lab != "pad":
            conv[j] = c
        labels.append(lab)
        prev_label = lab
    if complete and labels and labels[-1] != "pad":
        close_conv(len(ids), "the sequence ends")
        if not seen_eos:
            no_eos.append(start)
    return RowScan(labels, conv, unclosed, no_eos)


# ---------------------------------------------------------------------------------------
# Batches: one view over the stacklm contract and HF-style dicts
# ---------------------------------------------------------------------------------------
@dataclass
class BatchView:
    """Window tokens with what the batch says about them: ``loss[b, j]`` = token j is a
    trained target; ``seg``/``pos`` = the attention segment and position the batch assigns."""

    ids: np.ndarray
    loss: np.ndarray
    seg: np.ndarray
    pos: np.ndarray
    layout: str  # "stacklm" (shifted targets) or "hf" (unshifted labels)
    findings: list[Finding] = field(default_factory=list)


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    return a[None] if a.ndim == 1 else a


def view_batch(batch: Mapping[str, Any], pad_id: int | None, where: str = "batch") -> BatchView:
    """Normalise a batch dict (stacklm contract or HF ``labels`` style) into a ``BatchView``."""
    if "input_ids" not in batch:
        raise InspectError(f"{where}: no 'input_ids' in the batch; keys: {sorted(batch)}")
    x = _np(batch["input_ids"]).astype(np.int64)
    B, T = x.shape
    findings: list[Finding] = []
    if "targets" in batch:  # stacklm: targets[i] is the token after input_ids[i]
        y = _np(batch["targets"]).astype(np.int64)
        if y.shape != x.shape:
            raise InspectError(f"{where}: targets shape {y.shape} != input_ids shape {x.shape}")
        has = y != IGNORE_INDEX
        last = np.where(has[:, -1], y[:, -1], pad_id if pad_id is not None else -1)
        ids = np.concatenate([x, last[:, None]], axis=1)
        loss = np.zeros((B, T + 1), dtype=bool)
        loss[:, 1:] = has
        bad = has[:, :-1] & (y[:, :-1] != x[:, 1:])
        if bad.any():
            same = has & (y == x)
            hint = " -- targets equal input_ids: the labels were never shifted" if same.sum() >= 0.9 * has.sum() else ""
            findings.append(Finding("targets_not_shifted", ERROR, f"{int(bad.sum())} of {int(has[:, :-1].sum())} targets differ from "
                                    f"the next input token{hint}", where))
        seq = _np(batch["seq_ids"]).astype(np.int64) if "seq_ids" in batch else np.zeros_like(x)
        pos = _np(batch["position_ids"]).astype(np.int64) if "position_ids" in batch else np.broadcast_to(np.arange(T), (B, T))
        seg = np.concatenate([seq, np.where(has[:, -1], seq[:, -1], seq[:, -1] + 1)[:, None]], axis=1)
        pos = np.concatenate([pos, np.where(has[:, -1], pos[:, -1] + 1, 0)[:, None]], axis=1)
        return BatchView(ids, loss, seg, pos, "stacklm", findings)
    labels = batch.get("labels")
    if labels is None:
        raise InspectError(f"{where}: neither 'targets' (stacklm) nor 'labels' (HF) in the batch; keys: {sorted(batch)}")
    y = _np(labels).astype(np.int64)
    loss = y != IGNORE_INDEX
    loss[:, 0] = False  # HF shifts inside the model: the first label of a row is never used
    bad = loss & (y != x)
    if bad.any():
        findings.append(Finding("targets_not_shifted", ERROR, f"{int(bad.sum())} labels differ from input_ids; HF-style labels "
                                "are the unshifted input ids (the model shifts)", where))
    att = _np(batch["attention_mask"]).astype(bool) if "attention_mask" in batch else np.ones_like(x, dtype=bool)
    if "position_ids" in batch:  # flattened packing: a segment starts where positions restart
        pos = _np(batch["position_ids"]).astype(np.int64)
        start = pos == 0
    else:
        pos = np.broadcast_to(np.arange(T), (B, T)).copy()
        start = np.zeros_like(x, dtype=bool)
    start[:, 1:] |= att[:, 1:] != att[:, :-1]
    start[:, 0] = True
    seg = np.cumsum(start, axis=1) - 1
    return BatchView(x, loss, seg, pos, "hf", findings)


def view_windows(windows: np.ndarray, tok: InspectTokenizer) -> BatchView:
    """Shard windows -> the stacklm batch contract (as a training run derives it) -> a view."""
    from stacklm.data.pack import collate

    if None in (tok.bos_id, tok.eos_id, tok.pad_id):
        raise InspectError(f"{tok.name}: shards need a tokenizer with bos/eos/pad ids")
    return view_batch(collate(np.asarray(windows, dtype=np.int64), tok.bos_id, tok.eos_id, tok.pad_id), tok.pad_id, "shard")


def check_view(view: BatchView, tok: InspectTokenizer, where: str, complete: bool = False) -> tuple[list[Finding], list[RowScan]]:
    """Every batch-level check over a ``BatchView``."""
    out = list(view.findings)
    B, L = view.ids.shape
    scans = [scan_row(view.ids[b], tok, complete) for b in range(B)]
    pad = view.ids == tok.pad_id if tok.pad_id is not None else np.zeros_like(view.ids, dtype=bool)
    if tok.bos_id is None:
        out.append(Finding("cross_conversation_attention", INFO, "the tokenizer has no BOS: conversation boundaries unknown, "
                           "attention/position checks skipped", where))
    else:
        conv = np.stack([s.conv for s in scans])
        same_seg = view.seg[:, 1:] == view.seg[:, :-1]
        real = ~pad[:, 1:] & ~pad[:, :-1]
        cross = same_seg & real & (conv[:, 1:] != conv[:, :-1])
        if cross.any():
            rows = np.flatnonzero(cross.any(axis=1))
            out.append(Finding("cross_conversation_attention", ERROR, f"{int(cross.sum())} conversation boundaries inside one attention "
                               f"segment in {len(rows)} of {B} rows (first: row {rows[0]}): packed conversations attend to each "
                               "other; give each its own seq_ids (or position_ids restarting at 0 for HF flattening)", where))
        at_bos = (view.ids == tok.bos_id) & (view.pos != 0)
        stride = same_seg & real & (view.pos[:, 1:] != view.pos[:, :-1] + 1)
        if at_bos.any() or stride.any():
            out.append(Finding("positions_not_reset", ERROR, f"{int(at_bos.sum())} conversation starts with position != 0 and "
                               f"{int(stride.sum())} steps that are not +1 inside a segment", where))
    if tok.layout is not None:
        out += _role_findings(view, scans, where)
    for b, s in enumerate(scans):
        for j, why in s.unclosed[:1]:
            out.append(Finding("assistant_turn_not_closed", ERROR, f"an assistant turn is not closed by <|end|> before token {j} "
                               f"({why})", f"{where} row {b}"))
        for j in s.no_eos[:1]:
            out.append(Finding("missing_eos", ERROR, f"the conversation starting at token {j} ends without EOS "
                               f"(id {tok.eos_id})", f"{where} row {b}"))
    return out, scans


def _role_findings(view: BatchView, scans: list[RowScan], where: str) -> list[Finding]:
    out: list[Finding] = []
    wrong: Counter[str] = Counter()
    silent_convs = total_convs = 0
    for b, s in enumerate(scans):
        labels = np.array(s.labels)
        trained = view.loss[b]
        bad = trained & ~np.isin(labels, list(TRAINABLE | UNJUDGED))
        wrong.update(labels[bad].tolist())
        for c in np.unique(s.conv[s.conv >= 0]):
            sel = s.conv == c
            asst = sel & np.isin(labels, ["assistant", "end:assistant"])
            if asst.any():
                total_convs += 1
                if not trained[asst].any():
                    silent_convs += 1
    if wrong:
        parts = ", ".join(f"{n} {lab}" for lab, n in wrong.most_common())
        out.append(Finding("loss_on_non_assistant", ERROR, f"loss on {sum(wrong.values())} tokens that are not the assistant's: "
                           f"{parts}; targets must be -100 outside assistant turns", where))
    if silent_convs:
        out.append(Finding("no_assistant_loss", ERROR, f"{silent_convs} of {total_convs} conversations have no loss on any "
                           "assistant token (an all-zero assistant mask)", where))
    return out


# ---------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------
def check_conversation(turns: Sequence[Turn], tok: InspectTokenizer, where: str) -> tuple[list[Finding], np.ndarray, np.ndarray]:
    """Render with the tokenizer's template and run every check; ``(findings, ids, mask)``."""
    out: list[Finding] = []
    for i, t in enumerate(turns):
        out += text_findings(t.content, tok.family, tok.special_strings, f"{where} message {i} ({t.role})")
    try:
        ids, mask = tok.render(turns)
    except Exception as e:  # a template that raises (unknown role, ...) is a finding, not a crash
        out.append(Finding("invalid_conversation", ERROR, f"the chat template cannot render it: {type(e).__name__}: {e}", where))
        return out, np.zeros(0, np.int64), np.zeros(0, np.int8)
    if any(s in t.content for t in turns for s in tok.special_strings):
        out += _special_injection(turns, ids, tok, where)
    if tok.layout is not None:
        if tok.is_hf:
            ref_ids, ref_mask = render_conversation(turns, tok.raw)
            if ref_ids.tolist() != ids.tolist() or ref_mask.tolist() != mask.tolist():
                k = next((i for i, (a, b) in enumerate(zip(ids.tolist(), ref_ids.tolist())) if a != b), min(len(ids), len(ref_ids)))
                out.append(Finding("template_mismatch", ERROR, f"the chat template renders {len(ids)} tokens, render_conversation "
                                   f"{len(ref_ids)} (first difference at token {k}"
                                   + ("" if ref_ids.tolist() != ids.tolist() else "; the assistant masks differ") + ")", where))
        view = BatchView(ids[None], mask[None].astype(bool), np.zeros((1, len(ids)), np.int64), np.arange(len(ids))[None], "stacklm")
        out += check_view(view, tok, where, complete=True)[0]
    else:
        out += _foreign_mask_findings(turns, ids, mask, tok, where)
    return out, ids, mask


def _special_injection(turns: Sequence[Turn], ids: np.ndarray, tok: InspectTokenizer, where: str) -> list[Finding]:
    """Did a special string in content become a special id? Compare with the same conversation
    whose special strings are neutralised."""
    pattern = re.compile("|".join(re.escape(s) for s in tok.special_strings))
    clean = [Turn(t.role, pattern.sub("x", t.content)) for t in turns]
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


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------
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
            "findings": [f.to_dict() for f in self.findings],
            "errors": len(self.errors),
        }


def _count_text(report: Report, domain: str, text: str, tok: InspectTokenizer) -> None:
    ct = report.chars_tokens[domain]
    ct[0] += len(text)
    ct[1] += len(tok.encode_text(text))


def _read_records(path: Path, limit: int) -> list[tuple[str, Any]]:
    """``(where, raw)`` for up to ``limit`` rows: bytes per JSON line, dicts for parquet."""
    from stacklm.data.sources import _open_binary, file_format

    try:
        fmt = file_format(str(path))
    except ValueError as e:
        raise InspectError(str(e)) from None
    rows: list[tuple[str, Any]] = []
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=min(limit, 1024)):
            for r in batch.to_pylist():
                rows.append((f"{path} row {len(rows)}", r))
                if len(rows) >= limit:
                    return rows
        return rows
    if fmt != "jsonl":
        raise InspectError(f"{path}: conversations come as JSON lines or parquet, not {fmt}")
    with _open_binary(str(path)) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                rows.append((f"{path}:{lineno}", line))
                if len(rows) >= limit:
                    break
    return rows


def inspect_conversations(path: Path, tok: InspectTokenizer, limit: int = 200) -> Report:
    from stacklm.data.sft import _parse_json_line

    if not tok.chat_template:
        raise InspectError(
            f"{tok.name}: this tokenizer directory has no chat template (tokenizer_config.json 'chat_template'), so it cannot "
            "render conversations; use a tokenizer with one, e.g. an `export_hf` directory or our tokenizer.stacklm.json"
        )
    report = Report(str(path), "conversations", tok.name, eos_id=tok.eos_id)
    for where, raw in _read_records(path, limit):
        try:
            record = _parse_json_line(raw, where)[0] if isinstance(raw, bytes) else raw
            turns = conversation_from_record(record, role_aliases=DEFAULT_ROLE_ALIASES, where=where)
            validate_conversation(turns, where=where)
        except ChatFormatError as e:
            report.findings.append(Finding("invalid_conversation", ERROR, f"[{e.reason}] {e.detail}", e.where or where))
            continue
        found, ids, mask = check_conversation(turns, tok, where)
        report.findings += found
        if not len(ids):
            continue
        report.sequences += 1
        report.ending_with_eos += int(ids[-1] == tok.eos_id)
        domain = str(record.get("domain") or record.get("source") or "chat")
        for t in turns:
            _count_text(report, domain, t.content, tok)
        if report.sample is None:
            view = BatchView(ids[None], mask[None].astype(bool), np.zeros((1, len(ids)), np.int64), np.arange(len(ids))[None], "x")
            labels = scan_row(ids, tok, True).labels if tok.layout is not None else ["assistant" if m else "" for m in mask]
            report.sample = Sample(ids, view.loss[0], labels, view.pos[0], view.seg[0])
    if report.sequences == 0 and not report.findings:
        raise InspectError(f"{path}: no conversations in the file")
    return report


def _inspect_view(report: Report, view: BatchView, tok: InspectTokenizer, where: str) -> Report:
    found, scans = check_view(view, tok, where)
    report.findings += found
    for b in range(view.ids.shape[0]):
        row = view.ids[b]
        real = row[row != tok.pad_id] if tok.pad_id is not None else row
        report.sequences += 1
        report.ending_with_eos += int(tok.eos_id is not None and tok.eos_id in real.tolist())
        labels = np.array(scans[b].labels)
        for c in np.unique(scans[b].conv[scans[b].conv >= -1]):
            sel = scans[b].conv == c
            seg_ids = row[sel]
            domain = "chat" if any(lab == "marker" or lab.startswith("end:") for lab in labels[sel]) else "text"
            for text in tok.text_runs(seg_ids):
                report.findings += text_findings(text, tok.family, tok.special_strings, f"{where} row {b}")
                report.chars_tokens[domain][0] += len(text)
            report.chars_tokens[domain][1] += int(sum(int(t) not in tok.special_ids for t in seg_ids))
    report.sample = Sample(view.ids[0], view.loss[0], scans[0].labels, view.pos[0], view.seg[0])
    return report


def inspect_batch_file(path: Path, tok: InspectTokenizer, limit: int = 64) -> Report:
    import torch

    try:
        batch = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise InspectError(f"{path}: cannot load a saved batch ({type(e).__name__}: {e}); save one with torch.save(batch_dict, path)") from None
    if not isinstance(batch, Mapping):
        raise InspectError(f"{path}: expected a dict of tensors (a batch), got {type(batch).__name__}")
    batch = {k: (v[:limit] if hasattr(v, "ndim") and v.ndim == 2 else v) for k, v in batch.items()}
    view = view_batch(batch, tok.pad_id, str(path))
    _check_vocab(view.ids, tok, str(path))
    return _inspect_view(Report(str(path), f"batch ({view.layout} layout)", tok.name, eos_id=tok.eos_id), view, tok, str(path))


def read_shard_windows(directory: Path, limit: int) -> tuple[np.ndarray, dict[str, Any]]:
    """The first ``limit`` windows of a shard directory, read per DESIGN.md "Shards on disk"
    (``shard_XXXXX.tokens.bin`` flat n_seq x seq_len, dtype and seq_len from ``manifest.json``)."""
    files = sorted(directory.glob("shard_*.tokens.bin"))
    if not files:
        raise InspectError(f"{directory}: no shard_*.tokens.bin files; is this a prebuilt shard directory?")
    manifest: dict[str, Any] = {}
    mpath = directory / "manifest.json"
    if mpath.exists():
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise InspectError(f"{mpath}: not valid JSON ({e.msg} at line {e.lineno})") from None
    seq_len = manifest.get("seq_len")
    dtype = manifest.get("dtype")
    meta = files[0].with_name(files[0].name.replace(".tokens.bin", ".meta.bin"))
    if seq_len is None and meta.exists():
        seq_len = int(np.fromfile(meta, dtype="<i8")[1])
    if seq_len is None:
        raise InspectError(f"{directory}: neither manifest.json nor {meta.name} gives seq_len")
    if dtype is None:
        dtype = "uint16" if int(manifest.get("vocab_size", 65536)) <= 65536 else "uint32"
    dt = np.dtype(dtype).newbyteorder("<")
    rows = []
    for f in files:
        arr = np.memmap(f, dtype=dt, mode="r")
        if arr.size % seq_len:
            raise InspectError(f"{f}: {arr.size} tokens is not a multiple of seq_len={seq_len}; the shard is truncated")
        w = arr.reshape(-1, seq_len)
        rows.append(np.asarray(w[: limit - sum(len(r) for r in rows)], dtype=np.int64))
        if sum(len(r) for r in rows) >= limit:
            break
    return np.concatenate(rows), manifest


def _check_vocab(ids: np.ndarray, tok: InspectTokenizer, where: str) -> None:
    if ids.size and (ids.max() >= tok.vocab_size or ids.min() < 0):
        raise InspectError(f"{where}: token id {int(ids.max())} is outside this tokenizer's vocab ({tok.vocab_size}); "
                           "inspect with the tokenizer the data was built with")


def inspect_shards(directory: Path, tok: InspectTokenizer, limit: int = 64) -> Report:
    windows, manifest = read_shard_windows(directory, limit)
    if manifest.get("vocab_size") not in (None, tok.vocab_size):
        raise InspectError(f"{directory}: shards were built with vocab_size {manifest['vocab_size']}, the tokenizer has "
                           f"{tok.vocab_size}; pass the tokenizer the shards were built with")
    _check_vocab(windows, tok, str(directory))
    return _inspect_view(Report(str(directory), "shards", tok.name, eos_id=tok.eos_id), view_windows(windows, tok), tok, str(directory))


def inspect_input(path: str | Path, tokenizer: str | Path | InspectTokenizer, *, limit: int | None = None, prefer_hf: bool = False) -> Report:
    """Inspect a conversations file, a shard directory or a saved batch (chosen by what it is)."""
    tok = tokenizer if isinstance(tokenizer, InspectTokenizer) else load_tokenizer(tokenizer, prefer_hf)
    p = Path(path)
    if not p.exists():
        raise InspectError(f"{p}: no such file or directory")
    if p.is_file() and p.name.startswith("shard_") and p.name.endswith(".tokens.bin"):
        p = p.parent  # a shard file: read it with its manifest
    if p.is_dir():
        return inspect_shards(p, tok, limit or 64)
    if p.suffix in (".pt", ".pth", ".bin") or p.name.endswith(".batch"):
        return inspect_batch_file(p, tok, limit or 64)
    return inspect_conversations(p, tok, limit or 200)


# ---------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------
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
    for check, what in CHECKS.items():
        found = report.by_check(check)
        worst = next((sev for sev in (ERROR, WARNING, INFO) if any(f.severity == sev for f in found)), None)
        if worst is None:
            lines.append(f"  ok       {check}: {what}")
            continue
        lines.append(f"  {worst.upper():<8} {check}: {len(found)} finding(s)")
        for f in sorted(found, key=lambda f: (f.severity != ERROR, f.severity != WARNING))[:3]:
            lines.append(f"           {f.severity}: {f.where}: {f.message}" if f.where else f"           {f.severity}: {f.message}")
    n_err, n_warn = len(report.errors), sum(f.severity == WARNING for f in report.findings)
    lines += ["", f"{n_err} error(s), {n_warn} warning(s)" + (" -> exit status 1" if n_err else "")]
    return "\n".join(lines)
