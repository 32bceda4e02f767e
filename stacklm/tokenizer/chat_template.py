"""The Jinja chat template shipped in the Hugging Face export, and the rule it encodes.

Layout (docs/architecture.md; the same ids as ``stacklm.chat.render_conversation``)::

    <|bos|> <|role|> content <|end|> <|role|> content <|end|> ... <|eos|>

or, with ``add_generation_prompt=True``, a trailing ``<|assistant|>`` in place of ``<|eos|>``.
Roles are exactly ``specials.ROLE_TOKENS``; any other role makes the template raise, because
a silently mapped role (``"tool"`` rendered as user text, say) is the kind of SFT bug that
only shows up as a quietly worse model.

``{% generation %}`` brackets what the model is trained to produce: each assistant turn's
content and its closing ``<|end|>``, plus the final ``<|eos|>`` when the conversation ends on
an assistant turn. ``apply_chat_template(..., return_assistant_tokens_mask=True)`` turns that
into a mask over token ids.

Special strings in content (see ``docs/tokenizer.md``): the template produces *text* and
transformers tokenizes it in one pass, so a ``<|end|>`` typed inside content would look exactly
like the marker the template writes. The template escapes every ``<|`` in content as ``<``
U+FDD0 ``|``; added tokens are matched on the raw text, so the escaped content never becomes a
special id, and the exported tokenizer's normalizer restores ``<|`` before BPE, so the content
bytes encode exactly as ``StackTokenizer.encode(content)``. ``encode_chat`` is the per-turn
reference the template is tested against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stacklm.tokenizer.specials import ROLE_TOKENS

BOS, EOS, END = "<|bos|>", "<|eos|>", "<|end|>"
GENERATION_ROLE = "assistant"
# Every "<|" inside message content is rendered as "<" + U+FDD0 + "|": a special-token string in
# content then cannot match an added token, and the exported tokenizer's normalizer turns the
# sequence back into "<|" before BPE, so the content bytes are encoded exactly. U+FDD0 is a
# Unicode noncharacter (reserved for internal use), so real text essentially never holds it.
CONTENT_ESCAPE_CHAR = "\ufdd0"
SPECIAL_OPEN = "<|"
ESCAPED_SPECIAL_OPEN = "<" + CONTENT_ESCAPE_CHAR + "|"


def build_chat_template(role_tokens: Mapping[str, str] = ROLE_TOKENS) -> str:
    """The Jinja source for ``role_tokens`` (role name -> the special token opening its turn)."""
    roles = ", ".join(f'"{r}": "{t}"' for r, t in role_tokens.items())
    content = "(message['content'] | replace('" + SPECIAL_OPEN + "', '" + ESCAPED_SPECIAL_OPEN + "'))"
    known = ", ".join(role_tokens)
    gen = role_tokens[GENERATION_ROLE]
    # Whitespace control ({%- -%}) everywhere: the rendered text must be exactly the tokens,
    # with no stray newlines from the template's own layout.
    return (
        "{%- set role_tokens = {" + roles + "} -%}\n"
        "{{- '" + BOS + "' -}}\n"
        "{%- for message in messages -%}\n"
        "  {%- if message['role'] not in role_tokens -%}\n"
        "    {{- raise_exception('unknown chat role ' ~ message['role'] ~ ' in message ' ~ loop.index0"
        " ~ '; this tokenizer knows: " + known + "') -}}\n"
        "  {%- endif -%}\n"
        "  {%- if message['content'] is not string -%}\n"
        "    {{- raise_exception('message ' ~ loop.index0 ~ ' (' ~ message['role'] ~ ') has no string content;"
        " pass content as a str') -}}\n"
        "  {%- endif -%}\n"
        "  {{- role_tokens[message['role']] -}}\n"
        "  {%- if message['role'] == '" + GENERATION_ROLE + "' -%}\n"
        "    {%- generation -%}\n"
        "      {{- " + content + " ~ '" + END + "' -}}\n"
        "      {%- if loop.last and not add_generation_prompt -%}{{- '" + EOS + "' -}}{%- endif -%}\n"
        "    {%- endgeneration -%}\n"
        "  {%- else -%}\n"
        "    {{- " + content + " ~ '" + END + "' -}}\n"
        "  {%- endif -%}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n"
        "  {{- '" + gen + "' -}}\n"
        "{%- elif messages | length == 0 or messages[-1]['role'] != '" + GENERATION_ROLE + "' -%}\n"
        "  {{- '" + EOS + "' -}}\n"
        "{%- endif -%}"
    )


CHAT_TEMPLATE = build_chat_template()


def _check_messages(messages: Sequence[Mapping[str, Any]], role_tokens: Mapping[str, str]) -> None:
    if not messages:
        raise ValueError("empty conversation: pass at least one message")  # as apply_chat_template
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in role_tokens:
            raise ValueError(
                f"unknown chat role {role!r} in message {i}; this tokenizer knows: {', '.join(role_tokens)}"
            )
        if not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} ({role}) has no string content; pass content as a str")


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    role_tokens: Mapping[str, str] = ROLE_TOKENS,
) -> tuple[list[int], list[int]]:
    """``(ids, assistant_mask)`` for ``messages`` the way the template lays them out, with content
    encoded as untrusted text (special strings stay bytes) and markers as special ids.

    Works with a ``StackTokenizer`` or a Hugging Face tokenizer (anything with
    ``convert_tokens_to_ids``). This is the reference the exported template is tested against,
    and the escape hatch for HF users whose content may contain special-token strings.
    """
    _check_messages(messages, role_tokens)
    if hasattr(tokenizer, "convert_tokens_to_ids"):  # transformers tokenizer
        tid = tokenizer.convert_tokens_to_ids

        def text_ids(s: str) -> list[int]:
            return tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True)
    else:
        tid = tokenizer.token_id

        def text_ids(s: str) -> list[int]:
            return tokenizer.encode(s)

    ids, mask = [tid(BOS)], [0]
    for i, m in enumerate(messages):
        is_gen = m["role"] == GENERATION_ROLE
        body = text_ids(m["content"]) + [tid(END)]
        if is_gen and i == len(messages) - 1 and not add_generation_prompt:
            body.append(tid(EOS))
        ids.append(tid(role_tokens[m["role"]]))
        mask.append(0)
        ids += body
        mask += [int(is_gen)] * len(body)
    if add_generation_prompt:
        ids.append(tid(role_tokens[GENERATION_ROLE]))
        mask.append(0)
    elif not messages or messages[-1]["role"] != GENERATION_ROLE:
        ids.append(tid(EOS))
        mask.append(0)
    return ids, mask
