"""SFT pipes: conversation files or hub datasets -> validated turns -> rendered ids with an
assistant-only loss -> best-fit packing per conversation -> batches in the batch contract.

    ConversationSource (jsonl / parquet / hub; messages, ShareGPT, prompt/completion, Alpaca)
      -> [HoldoutNode]  -> RenderNode (render with the source's loss policy; overlong: truncate,
                                      keep_end or drop)
    [-> weighted interleave of several sources] -> ShuffleNode -> SFTPackNode -> batch + collate_sft

A packed row holds whole conversations only (one is never cut across rows), each starting
with ``<|bos|>``, so ``seq_ids`` and ``position_ids`` derive from the tokens exactly as for
pre-training windows (``pack.segment_layout``): no conversation attends to another and
positions restart at 0 for each. ``targets`` is ``-100`` except on assistant tokens.

Loss-tagged ids. Between rendering and collation a conversation travels as ONE int32 array
in which a loss-bearing token ``t`` is stored as ``~t`` (``-t - 1``, always negative) and
every other token as itself (``tag_loss`` / ``untag_loss``). That lets the existing shuffle
buffer and best-fit packer (and their compact checkpoint state: one concatenated token
array) carry the mask with the ids without knowing about it.

Every rejected conversation is counted by reason, per source (``chat.INVALID_REASONS`` in the
source stage; ``truncated`` / ``dropped_too_long`` in the render stage), and the first
location of each reason is kept (``SFTPipeline.examples()``) so a drop is never silent.

One module per job: ``config`` (``SFTConfig``; its sources are ``registry.SourceConfig``), ``reader``
(``ConversationSource``), ``render`` (loss tags, truncation, ``RenderNode``), ``pack``
(``ConversationPacker``, ``SFTPackNode``, ``collate_sft``, ``sft_batch``) and ``pipeline``
(``build_sft_pipeline``, ``SFTPipeline``).
"""

from stacklm.data.sft.config import ON_INVALID, OVERLONG_RULES, SFTConfig
from stacklm.data.sft.pack import CollateSFT, ConversationPacker, SFTPackNode, collate_sft, sft_batch
from stacklm.data.sft.pipeline import SFTPipeline, build_sft_pipeline
from stacklm.data.sft.reader import CONTENT_REPAIRED, INVALID_UTF8_LINES, ConversationSource, conversation_text, parse_json_line
from stacklm.data.sft.render import (
    DROPPED_TOO_LONG,
    NOTHING_TO_TRAIN,
    TRUNCATED,
    TRUNCATED_START,
    TURNS_CUT,
    RenderNode,
    keep_end_start,
    render_for_sft,
    tag_loss,
    truncation_point,
    untag_loss,
)

__all__ = [
    "CONTENT_REPAIRED",
    "CollateSFT",
    "ConversationPacker",
    "ConversationSource",
    "DROPPED_TOO_LONG",
    "INVALID_UTF8_LINES",
    "NOTHING_TO_TRAIN",
    "ON_INVALID",
    "OVERLONG_RULES",
    "RenderNode",
    "SFTConfig",
    "SFTPackNode",
    "SFTPipeline",
    "TRUNCATED",
    "TRUNCATED_START",
    "TURNS_CUT",
    "build_sft_pipeline",
    "collate_sft",
    "conversation_text",
    "keep_end_start",
    "parse_json_line",
    "render_for_sft",
    "sft_batch",
    "tag_loss",
    "truncation_point",
    "untag_loss",
]
