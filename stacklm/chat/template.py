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

# The content escape is the tokenizer export's (its normalizer undoes it), so it lives below.
from stacklm.tokenizer.specials import ESCAPED_SPECIAL_OPEN, ROLE_TOKENS, SPECIAL_OPEN

BOS, EOS, END = "<|bos|>", "<|eos|>", "<|end|>"
GENERATION_ROLE = "assistant"


# How the parts of a turn other than plain content become text (``stacklm.chat`` renders the
# same strings): an assistant's ``reasoning_content`` opens its turn as a think block, the
# ``tools`` schemas go into the system turn (one JSON object per line after a header), and an
# OpenAI tool call is ``{"name": ..., "arguments": ...}`` -- arguments given as a JSON string
# are written as they are (a template cannot parse JSON), an object through ``tojson``.
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"
TOOLS_HEADER = "# Tools\n"
TOOLS_SEPARATOR = "\n\n"  # between a system message's own text and the tools block
# Role names the template takes besides ``ROLE_TOKENS``: OpenAI's tool result role.
TEMPLATE_ROLE_ALIASES = {"tool": "tool_result"}


def build_chat_template(role_tokens: Mapping[str, str] = ROLE_TOKENS) -> str:
    """The Jinja source for ``role_tokens`` (role name -> the special token opening its turn).

    Besides ``{"role", "content"}`` messages it renders what ``stacklm.chat.formats`` reads:
    an assistant message's ``tool_calls`` (content may be null) as ``tool_call`` turns,
    ``role: "tool"`` as a ``tool_result`` turn, ``reasoning_content`` as a think block,
    ``tools=`` into the system turn, and ``weight: 0`` as an assistant turn without loss.
    """
    roles = ", ".join(f'"{r}": "{t}"' for r, t in {**role_tokens, **{a: role_tokens[r] for a, r in TEMPLATE_ROLE_ALIASES.items()}}.items())
    esc = " | replace('" + SPECIAL_OPEN + "', '" + ESCAPED_SPECIAL_OPEN + "')"
    known = ", ".join([*role_tokens, *TEMPLATE_ROLE_ALIASES])
    gen = role_tokens[GENERATION_ROLE]
    sys_tok = role_tokens["system"]
    call_tok = role_tokens["tool_call"]
    j = lambda s: s.replace("\n", "\\n")  # a Python str as a Jinja string literal body
    # Whitespace control ({%- -%}) everywhere: the rendered text must be exactly the tokens,
    # with no stray newlines from the template's own layout.
    return (
        "{%- set role_tokens = {" + roles + "} -%}\n"
        "{%- if tools -%}{%- set tools_text = '" + j(TOOLS_HEADER) + "' ~ (tools | map('tojson') | join('\\n')) -%}"
        "{%- else -%}{%- set tools_text = '' -%}{%- endif -%}\n"
        "{{- '" + BOS + "' -}}\n"
        "{%- if tools_text and (messages | length == 0 or messages[0]['role'] != 'system') -%}\n"
        "  {{- '" + sys_tok + "' ~ (tools_text" + esc + ") ~ '" + END + "' -}}\n"
        "{%- endif -%}\n"
        "{%- for message in messages -%}\n"
        "  {%- if message['role'] not in role_tokens -%}\n"
        "    {{- raise_exception('unknown chat role ' ~ message['role'] ~ ' in message ' ~ loop.index0"
        " ~ '; this tokenizer knows: " + known + "') -}}\n"
        "  {%- endif -%}\n"
        "  {%- set calls = message.tool_calls if message['role'] == '" + GENERATION_ROLE + "' and message.tool_calls is defined"
        " and message.tool_calls else [] -%}\n"
        "  {%- if message.content is defined and message.content is string -%}{%- set text = message.content -%}\n"
        "  {%- elif calls and (message.content is not defined or message.content is none) -%}{%- set text = '' -%}\n"
        "  {%- else -%}\n"
        "    {{- raise_exception('message ' ~ loop.index0 ~ ' (' ~ message['role'] ~ ') has no string content;"
        " pass content as a str') -}}\n"
        "  {%- endif -%}\n"
        "  {%- if loop.first and message['role'] == 'system' and tools_text -%}"
        "{%- set text = text ~ '" + j(TOOLS_SEPARATOR) + "' ~ tools_text -%}{%- endif -%}\n"
        "  {%- if message['role'] == '" + GENERATION_ROLE + "' -%}\n"
        "    {%- if message.reasoning_content is defined and message.reasoning_content -%}"
        "{%- set text = '" + j(THINK_OPEN) + "' ~ message.reasoning_content ~ '" + j(THINK_CLOSE) + "' ~ text -%}{%- endif -%}\n"
        "    {%- set trained = not (message.weight is defined and message.weight is not none and message.weight == 0) -%}\n"
        "    {%- if text or not calls -%}\n"
        "      {{- '" + gen + "' -}}\n"
        "      {%- if trained -%}\n"
        "        {%- generation -%}\n"
        "          {{- (text" + esc + ") ~ '" + END + "' -}}\n"
        "          {%- if loop.last and not calls and not add_generation_prompt -%}{{- '" + EOS + "' -}}{%- endif -%}\n"
        "        {%- endgeneration -%}\n"
        "      {%- else -%}\n"
        "        {{- (text" + esc + ") ~ '" + END + "' -}}\n"
        "        {%- if loop.last and not calls and not add_generation_prompt -%}{{- '" + EOS + "' -}}{%- endif -%}\n"
        "      {%- endif -%}\n"
        "    {%- endif -%}\n"
        "    {%- for call in calls -%}\n"
        "      {%- set fn = call.function if call.function is defined and call.function else call -%}\n"
        "      {%- set args = fn.arguments if fn.arguments is defined else {} -%}\n"
        "      {%- set call_text = '{\"name\": ' ~ (fn.name | tojson) ~ ', \"arguments\": ' ~ "
        "(args if args is string else (args | tojson)) ~ '}' -%}\n"
        "      {{- '" + call_tok + "' ~ (call_text" + esc + ") ~ '" + END + "' -}}\n"
        "    {%- endfor -%}\n"
        "    {%- if loop.last and calls and not add_generation_prompt -%}{{- '" + EOS + "' -}}{%- endif -%}\n"
        "  {%- else -%}\n"
        "    {{- role_tokens[message['role']] ~ (text" + esc + ") ~ '" + END + "' -}}\n"
        "    {%- if loop.last and not add_generation_prompt -%}{{- '" + EOS + "' -}}{%- endif -%}\n"
        "  {%- endif -%}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n"
        "  {{- '" + gen + "' -}}\n"
        "{%- elif messages | length == 0 -%}\n"
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
    ``convert_tokens_to_ids``). This is the per-turn reference for plain ``{"role", "content"}``
    messages, and the escape hatch for HF users whose content may contain special-token
    strings; tool calls, ``tools``, reasoning and weights go through
    ``stacklm.chat.formats.render_record`` (what the template is tested against on every format).
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
