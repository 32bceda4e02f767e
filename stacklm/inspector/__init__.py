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

from stacklm.inspector.batches import BatchView, check_view, view_batch, view_windows
from stacklm.inspector.conversations import check_conversation
from stacklm.inspector.families import FAMILIES, TemplateFamily, text_findings
from stacklm.inspector.findings import CHECKS, ERROR, INFO, WARNING, Finding
from stacklm.inspector.inputs import (
    inspect_batch_file,
    inspect_conversations,
    inspect_input,
    inspect_shards,
    read_shard_windows,
)
from stacklm.inspector.report import Report, Sample, format_report
from stacklm.inspector.rows import RowScan, scan_row
from stacklm.inspector.tokenizer_view import InspectTokenizer, load_tokenizer

__all__ = [
    "CHECKS", "ERROR", "FAMILIES", "INFO", "WARNING", "BatchView", "Finding", "InspectTokenizer",
    "Report", "RowScan", "Sample", "TemplateFamily", "check_conversation", "check_view", "format_report",
    "inspect_batch_file", "inspect_conversations", "inspect_input", "inspect_shards", "load_tokenizer",
    "read_shard_windows", "scan_row", "text_findings", "view_batch", "view_windows",
]
