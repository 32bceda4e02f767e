"""Tokenizers for inspection: ours or any Hugging Face directory, behind one view."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.chat import ChatTokens, Turn, chat_tokens, render_conversation
from stacklm.errors import UserError
from stacklm.inspector.families import FAMILIES
from stacklm.tokenizer import ARTIFACT_NAME


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
        raise UserError(f"{p}: no such tokenizer file or directory")
    ours = p if p.is_file() else p / ARTIFACT_NAME
    hf_files = p.is_dir() and any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    if ours.is_file() and not (prefer_hf and hf_files):
        from stacklm.tokenizer.bpe import StackTokenizer

        return InspectTokenizer(StackTokenizer.load(ours), str(p))
    if not hf_files:
        raise UserError(
            f"{p}: neither a stacklm tokenizer ({ARTIFACT_NAME}) nor a Hugging Face tokenizer directory "
            "(tokenizer.json / tokenizer_config.json)"
        )
    from stacklm.optional import require

    transformers = require("transformers", "hf", "a Hugging Face tokenizer directory")

    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is a bad directory to the user
        raise UserError(f"{p}: transformers cannot load this tokenizer directory: {type(e).__name__}: {e}") from None
    return InspectTokenizer(hf, str(p))
