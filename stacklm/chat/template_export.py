"""The tokenizer's exports with this wing's chat template: what ``stacklm train-tokenizer`` writes.

``stacklm.tokenizer.export`` writes the files and takes the template as an argument, because the
template is a chat rule (``stacklm.chat.template``: the same ids and the same loss mask as
``stacklm.chat.render``) and ``tokenizer/`` sits below ``chat/``. Exporting from here is how a
tokenizer directory gets the template that matches the renderer it was trained for.
"""

from __future__ import annotations

import os
from pathlib import Path

from stacklm.chat.template import CHAT_TEMPLATE
from stacklm.tokenizer.bpe import StackTokenizer
from stacklm.tokenizer.export import write_exports, write_hf_tokenizer


def export_hf(tok: StackTokenizer, out_dir: str | os.PathLike, *, split_special_tokens: bool = False) -> Path:
    """The Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json`` with
    the chat template, ``special_tokens_map.json``) in ``out_dir``: ``AutoTokenizer.from_pretrained``
    loads a tokenizer that encodes like ``tok`` (``stacklm.tokenizer.export.write_hf_tokenizer``)."""
    return write_hf_tokenizer(tok, out_dir, chat_template=CHAT_TEMPLATE, split_special_tokens=split_special_tokens)


def export_all(tok: StackTokenizer, out_dir: str | os.PathLike, stem: str = "tokenizer") -> dict[str, Path]:
    """Both exports side by side: ``<stem>.tiktoken`` (+ sidecar) and the HF files with the chat
    template, in ``out_dir``."""
    return write_exports(tok, out_dir, stem, chat_template=CHAT_TEMPLATE)
