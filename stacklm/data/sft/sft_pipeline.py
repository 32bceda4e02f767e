"""The SFT node graph: ``build_sft_pipeline`` and the ``SFTPipeline`` it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchdata.nodes import BaseNode, MultiNodeWeightedSampler, StopCriteria

from stacklm.chat.render import chat_tokens
from stacklm.config import Config
from stacklm.data.graph import BuiltPipeline
from stacklm.data.quality.holdout import HoldoutNode
from stacklm.data.packing.nodes import PackBatchNode
from stacklm.data.sft.sft_pack import CollateSFT, SFTPackNode
from stacklm.data.sft.reader import ConversationSource
from stacklm.data.sft.render_node import RenderNode
from stacklm.data.shuffle import ShuffleNode
from stacklm.data.sources import ShardSpec
from stacklm.data.splits import check_split


@dataclass
class SFTPipeline(BuiltPipeline):
    """The built SFT graph (``BuiltPipeline``); its packer also counts by reason."""

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """Counts by stage -> source -> reason (kept, each rejection reason, truncated, ...)."""
        out = super().stats()
        pack = self.windows.packer.stats.to_dict()
        if pack:
            out["pack"] = pack
        return out

    def examples(self) -> dict[str, dict[str, str]]:
        """source -> reason -> the first rejected (or kept but flagged: ``chat.FLAG_REASONS``)
        conversation's located message."""
        return {name: {**src.first_where, **src.first_flagged} for name, src in self.sources.items()
                if src.first_where or src.first_flagged}

    def realized(self) -> dict[str, dict[str, Any]]:
        """Per source: conversations, tokens and loss-bearing tokens rendered, target and
        realized token share (the shape ``StackDataModule.data_stats`` logs)."""
        counts = {name: chain["render"].counts() for name, chain in self.chains.items()}
        total = max(sum(c["tokens"] for c in counts.values()), 1)
        wsum = sum(s.weight for s in self.config.sources)
        weights = {s.name: s.weight / wsum for s in self.config.sources}
        return {
            name: {**c, "target_weight": weights[name], "realized_weight": c["tokens"] / total}
            for name, c in counts.items()
        }


def build_sft_pipeline(config: Config, tokenizer: Any, split: str = "train", shard: ShardSpec | None = None) -> SFTPipeline:
    """The SFT node graph for one split and one (rank, worker) shard of the sources.

    ``config``: an ``SFTConfig``, typed by its base class because ``SFTConfig.build`` imports
    this module (an import back would be a circle). ``tokenizer``: a ``StackTokenizer`` (or an HF tokenizer with the stacklm specials).
    The validation split is the ``holdout_fraction`` of conversations chosen by a hash of
    their text (``holdout.holdout_split``), the same in every run, rank and worker.
    """
    check_split(split)
    if split == "val" and config.holdout_fraction == 0:
        raise ValueError("sft config: holdout_fraction is 0, so there is no validation split; set it > 0 (e.g. 0.01)")
    shard = shard or ShardSpec()
    ct = chat_tokens(tokenizer)
    sources: dict[str, ConversationSource] = {}
    chains: dict[str, dict[str, BaseNode]] = {}
    rendered: dict[str, BaseNode] = {}
    for spec in config.sources:
        src = ConversationSource(spec, shard=shard, role_aliases=config.role_aliases, on_invalid=spec.on_invalid or config.on_invalid)
        chain: dict[str, BaseNode] = {"source": src}
        node: BaseNode = src
        if config.holdout_fraction > 0:
            node = chain["holdout"] = HoldoutNode(node, split, config.holdout_fraction, seed=config.seed)
        node = chain["render"] = RenderNode(node, tokenizer, config.seq_len, spec.overlong or config.overlong, spec.loss_policy())
        sources[spec.name], chains[spec.name], rendered[spec.name] = src, chain, node
    if len(rendered) == 1:
        stream: BaseNode = next(iter(rendered.values()))
    else:
        stream = MultiNodeWeightedSampler(
            rendered,
            {s.name: float(s.weight) for s in config.sources},
            stop_criteria=StopCriteria.ALL_DATASETS_EXHAUSTED,
            rank=shard.rank,
            world_size=shard.world_size,
            seed=config.seed + 2,
        )
    if config.shuffle_buffer > 1:
        stream = ShuffleNode(stream, config.shuffle_buffer, seed=config.seed + 1)
    windows = SFTPackNode(stream, config.seq_len, ct.bos, ct.eos, ct.pad, config.pack_buffer_docs,
                          sources=[s.name for s in config.sources])  # batches count what they deliver per source
    batches = PackBatchNode(windows, config.batch_size, drop_last=config.drop_last, collate=CollateSFT(ct.bos, ct.eos, ct.pad))
    return SFTPipeline(config=config, split=split, shard=shard, sources=sources, chains=chains, windows=windows, batches=batches)
