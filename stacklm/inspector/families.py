"""Template families: how to recognise a hand-concatenated chat format in text."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from stacklm.inspector.findings import ERROR, WARNING, Finding


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
    TemplateFamily("phi3", ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>"), re.compile(r"<\|(system|user|assistant)\|>[\s\S]*?<\|end\|>")),
    TemplateFamily("mistral", ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[TOOL_RESULTS]"),
                   re.compile(r"\[(SYSTEM_PROMPT|AVAILABLE_TOOLS|TOOL_RESULTS)\][\s\S]*?\[/\1\]|\[TOOL_CALLS\]\s*\[")),
    TemplateFamily("gpt", ("<|endoftext|>", "<|endofprompt|>"), re.compile(r"(?!)")),  # document separators, no turns
    TemplateFamily("alpaca", ("### Instruction:", "### Response:"), re.compile(r"### Instruction:[\s\S]*?### Response:")),
    TemplateFamily(
        "stacklm",
        ("<|system|>", "<|user|>", "<|assistant|>", "<|tool_call|>", "<|tool_result|>", "<|end|>", "<|bos|>", "<|eos|>"),
        re.compile(r"<\|(system|user|assistant|tool_call|tool_result)\|>[\s\S]*?<\|end\|>"),
    ),
)


def text_findings(text: str, own_family: str | None, specials: Sequence[str], where: str, strict: bool = False) -> list[Finding]:
    """Markers of other families (``foreign_template``) and this tokenizer's own special
    strings (``special_string_in_text``) in one piece of untrusted text.

    ``strict`` (message content of SFT data, unless ``--allow-template-text``): any marker is an
    error -- a hand-typed template inside a message trains the model on a format it will never
    see at inference, or teaches it to emit role markers as text. Otherwise (pre-training text)
    a bare marker is a warning and only a role-structured turn is an error."""
    out: list[Finding] = []
    bare_level = ERROR if strict else WARNING
    for fam in FAMILIES:
        if fam.name == own_family or all(m in specials for m in fam.markers):
            continue  # its markers are this tokenizer's own specials: reported below, once
        m = fam.structure.search(text)
        if m:
            out.append(Finding("foreign_template", ERROR, f"{fam.name} turn {_snip(m.group())} in text: a hand-concatenated "
                               f"foreign chat format; render turns with this tokenizer's template instead", where,
                               key=f"{fam.name} turn in text"))
            continue
        bare = [s for s in fam.markers if s in text and s not in specials]
        if bare:
            out.append(Finding("foreign_template", bare_level, f"{fam.name} marker(s) {bare} in text", where,
                               key=f"{fam.name} markers in text"))
    own = [s for s in specials if s in text]
    if own:
        out.append(Finding("special_string_in_text", bare_level, f"special-token string(s) {own[:4]} in untrusted text", where,
                           key="this tokenizer's special strings in text"))
    return out


def _snip(s: str, n: int = 40) -> str:
    s = s if len(s) <= n else s[: n - 1] + "…"
    return repr(s)
