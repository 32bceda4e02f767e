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

The loss mask is not made here: ``stacklm.chat.render`` renders each conversation with its
mask and carries both as one loss-tagged int32 array (``tag_loss``; a loss-bearing ``t`` is
``~t``), which the shuffle buffer and the best-fit packer move without knowing about it, and
turns a mask into targets (``loss_targets``, called by ``collate_sft``).

Every rejected conversation is counted by reason, per source (``chat.INVALID_REASONS`` in the
source stage; ``truncated`` / ``dropped_too_long`` in the render stage), and the first
location of each reason is kept (``SFTPipeline.examples()``) so a drop is never silent. What
is dropped and what is kept but flagged (``chat.FLAG_REASONS``, counted next to ``kept``) is
``chat.validate_conversation``'s rule, the one ``stacklm inspect`` reports by.

One module per job: ``sft_config`` (``SFTConfig``; its sources are ``sources.schema.SourceConfig``), ``reader``
(``ConversationSource``), ``render_node`` (``RenderNode``, the render stage), ``sft_pack``
(``ConversationPacker``, ``SFTPackNode``, ``collate_sft``, ``sft_batch``) and ``sft_pipeline``
(``build_sft_pipeline``, ``SFTPipeline``); preference pairs in ``preference`` and
``preference_pipeline``.
"""

from stacklm.data.sft.sft_config import OVERLONG_RULES, SFTConfig
from stacklm.data.sft.sft_pack import CollateSFT, ConversationPacker, SFTPackNode, collate_sft, sft_batch
from stacklm.data.sft.sft_pipeline import SFTPipeline, build_sft_pipeline
from stacklm.data.sft.reader import (
    CONTENT_REPAIRED,
    INVALID_UTF8_LINES,
    ConversationSource,
    conversation_text,
    parse_json_line,
    quiet_readers,
    say_split_drops,
)
from stacklm.data.sft.render_node import RenderNode

__all__ = [
    "CONTENT_REPAIRED",
    "CollateSFT",
    "ConversationPacker",
    "ConversationSource",
    "INVALID_UTF8_LINES",
    "OVERLONG_RULES",
    "RenderNode",
    "SFTConfig",
    "SFTPackNode",
    "SFTPipeline",
    "build_sft_pipeline",
    "collate_sft",
    "conversation_text",
    "parse_json_line",
    "quiet_readers",
    "say_split_drops",
    "sft_batch",
]
