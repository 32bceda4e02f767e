"""The preference graph: ``PreferenceSource`` -> [``HoldoutNode`` on the prompt's text] ->
``PairRenderNode`` -> [weighted interleave] -> ``ShuffleNode`` -> ``PairBatchNode``, built by
``build_preference_pipeline`` from an ``SFTConfig`` (``StackDataModule(mode="preference")``
builds one per (rank, worker) through ``stacklm.datamodule.stream.PreferenceBuilder``, which
loads the tokenizer: this graph takes it as an argument).

The records, rendering and batch layout are ``stacklm.data.sft.preference``'s; this module is
the stateful part: every node has exact ``reset``/``next``/``get_state`` state, a rendered pair
travels as one loss-tagged array so the shuffle buffer's state stays compact, and rank and
worker shares of the pairs are ``ConversationSource``'s (disjoint, together complete).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode, MultiNodeWeightedSampler, StopCriteria

from stacklm.chat.render import TURNS_CUT, chat_tokens
from stacklm.chat.turns import Turn, validate_conversation
from stacklm.data.audit import KEPT
from stacklm.data.quality.holdout import HoldoutNode
from stacklm.data.packing.nodes import DELIVERY_KEY
from stacklm.data.packing.origins import window_crc
from stacklm.data.sft.sft_config import SFTConfig
from stacklm.data.sft.sft_pipeline import SFTPipeline
from stacklm.data.sft.preference import (
    DROPPED_LAST_BATCH,
    collate_preference,
    pair_id,
    read_pair,
    render_pair,
)
from stacklm.data.sft.reader import (
    ConversationSource,
    conversation_text,
)
from stacklm.data.sft.render_node import RenderNode, where_from
from stacklm.data.shuffle import ShuffleNode
from stacklm.data.sources import ShardSpec
from stacklm.data.splits import check_split
from stacklm.data.stats import StageStats
from stacklm.errors import ChatFormatError, ConfigError


class PreferenceSource(ConversationSource):
    """Pairs of one ``SourceConfig`` as ``{"prompt", "chosen", "rejected": turns, "text": the
    prompt's text, "pair_id", "source", "domain", "doc_id"}``; reading, sharding, rejection
    counting and state are ``ConversationSource``'s."""

    KIND = "preference source"

    def _pair_turns(self, raw: Any, where: str) -> tuple[list[Turn], list[Turn], list[Turn]]:
        parts = read_pair(self._record(raw, where), role_aliases=self.role_aliases, where=where).turns()
        self._repair(*parts)
        prompt = parts[0]
        flags = [f for comp in parts[1:] for f in validate_conversation([*prompt, *comp], require_assistant=False, where=where)]
        self._flag(flags, where)  # a flag of the shared prompt counts once per pair
        return parts

    def _document(self, raw: Any, row: int) -> dict | None:
        where = self._where()
        try:
            prompt, chosen, rejected = self._pair_turns(raw, where)
        except ChatFormatError as e:
            self._reject(e)
            return None
        self.stats.add(self.name, KEPT)
        doc_id = f"{self.name}/{os.path.basename(self._parts[self._assigned[self._k]])}/{row}"
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "text": conversation_text(prompt),
                "pair_id": pair_id(doc_id), "source": self.name, "domain": self.domain, "doc_id": doc_id, **self._provenance()}


class PairRenderNode(RenderNode):
    """Pairs of turns -> ``{"ids": chosen+rejected loss-tagged, "n_chosen", "n_prompt",
    "pair_id", "source", "domain", "doc_id"}``, each side at most ``seq_len`` tokens; every
    outcome counted in ``stats``, and ``counts()`` the pairs, tokens and loss tokens emitted.
    ``RenderNode``'s settings, counters and state; only what one item renders to differs."""

    def next(self) -> dict:
        while True:
            doc = next(self.source)
            src = doc.get("source", "?")
            out, outcome, cut = render_pair(doc["prompt"], doc["chosen"], doc["rejected"], self.tokenizer, self.seq_len,
                                            self.overlong, self.policy)
            self.stats.add(src, outcome)
            if out is None:
                continue
            if cut:
                self.stats.add(src, TURNS_CUT, cut)
            tagged = out.tagged()
            self._counts += (1, len(tagged), int((tagged < 0).sum()))
            return {"ids": tagged, "n_chosen": len(out.chosen[0]), "n_prompt": out.n_prompt, "pair_id": doc["pair_id"],
                    "source": src, "domain": doc.get("domain", "chat"), "doc_id": doc.get("doc_id"), **where_from(doc)}


class PairBatchNode(BaseNode[dict]):
    """``batch_size`` rendered pairs -> one preference batch. A short last batch is filled with
    filler rows (``drop_last=False``, counted as ``pad_rows``) or its pairs dropped and counted
    (``dropped_last_batch``), so every batch has the same shape. ``delivered()``: per source, the
    pairs, tokens and loss tokens in the batches handed out -- counted here, after the shuffle
    buffer, because the render stage's counts include the pairs still buffered. State: the
    source's and the counters.

    With ``sources`` (the config's source names, in order) each batch also carries what it
    delivers per source under ``DELIVERY_KEY`` (non-pad ids of both sides, pairs, their
    lengths), which the loader counts in the main process as the batch reaches the step."""

    SOURCE_KEY = "source"

    def __init__(
        self, source: BaseNode[dict], batch_size: int, seq_len: int, pad_id: int, drop_last: bool = False,
        sources: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.source, self.batch_size, self.seq_len, self.pad_id, self.drop_last = source, int(batch_size), int(seq_len), pad_id, drop_last
        self.sources = list(sources) if sources is not None else None
        self.stats = StageStats("batch")
        self._counts = np.zeros(5, dtype=np.int64)
        self._delivered: dict[str, list[int]] = {}

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {}
        self.source.reset(st.get(self.SOURCE_KEY))
        self.stats.load_dict(st.get("stats", {}))
        self._counts = np.array(st.get("counts", np.zeros(5)), dtype=np.int64)
        self._delivered = {src: [int(x) for x in v] for src, v in st.get("delivered", {}).items()}

    def delivered(self) -> dict[str, dict[str, int]]:
        return {src: {"docs": v[0], "tokens": v[1], "loss_tokens": v[2]} for src, v in self._delivered.items()}

    def next(self) -> dict[str, torch.Tensor]:
        pairs = []
        for _ in range(self.batch_size):
            try:
                pairs.append(next(self.source))
            except StopIteration:
                break
        if not pairs:
            raise StopIteration
        if len(pairs) < self.batch_size and self.drop_last:
            for p in pairs:
                self.stats.add(p.get("source", "?"), DROPPED_LAST_BATCH)
            raise StopIteration
        batch = collate_preference(pairs, self.seq_len, self.pad_id, self.batch_size)
        real = sum(len(p["ids"]) for p in pairs)  # both sides' tokens, over windows of seq_len (as the SFT packer counts)
        total = 2 * self.batch_size * self.seq_len
        self._counts += (1, len(pairs), real, total - real, self.batch_size - len(pairs))
        for p in pairs:
            d = self._delivered.setdefault(p.get("source", "?"), [0, 0, 0])
            d[0], d[1], d[2] = d[0] + 1, d[1] + len(p["ids"]), d[2] + int((p["ids"] < 0).sum())
        if self.sources is not None:
            batch[DELIVERY_KEY] = self._delivery(batch, pairs)
        return batch

    def _delivery(self, batch: dict[str, torch.Tensor], pairs: list[dict]) -> dict[str, torch.Tensor]:
        n = len(self.sources)
        index = np.array([self.sources.index(p.get("source", "?")) for p in pairs], dtype=np.int64)
        rows = len(pairs)
        per_row = ((batch["chosen_input_ids"][:rows] != self.pad_id).sum(1) + (batch["rejected_input_ids"][:rows] != self.pad_id).sum(1)).numpy()
        tokens = np.bincount(index, weights=per_row, minlength=n).astype(np.int64)
        lengths = np.array([(i, len(p["ids"])) for i, p in zip(index.tolist(), pairs)], dtype=np.int64).reshape(-1, 2)
        # plain lists: they travel pickled with the batch, not as shared-memory blocks (stacklm.data.packing.origins)
        out = {"tokens": tokens.tolist(), "docs": np.bincount(index, minlength=n).tolist(), "doc_lengths": lengths.tolist()}
        # what the step log keeps of each row (stacklm.data.storage.steplog): its pair as one piece (source, file,
        # record, the chosen side's [0, n_chosen), offset 0) and the CRC of the pair's rendered ids
        out["pieces"] = [[(int(i), int(p["file"]), int(p["record"]), 0, int(p["n_chosen"]), 0)] if "file" in p else None
                         for i, p in zip(index.tolist(), pairs)]
        out["crc"] = [window_crc(p["ids"]) for p in pairs]
        return out

    def summary(self) -> dict[str, Any]:
        batches, pairs, tokens, pad, pad_rows = (int(x) for x in self._counts)
        total = tokens + pad
        return {"batches": batches, "pairs": pairs, "doc_tokens": tokens, "pad_tokens": pad, "pad_rows": pad_rows,
                "pad_fraction": pad / total if total else 0.0}

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), "stats": self.stats.to_dict(), "counts": self._counts.copy(),
                "delivered": {src: list(v) for src, v in self._delivered.items()}}


@dataclass
class PreferencePipeline(SFTPipeline):
    """The built preference graph (``BuiltPipeline``); ``windows`` is the ``PairBatchNode``."""

    @staticmethod
    def padding_batch(batch_size: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
        """A batch of filler rows only (no loss): what a loader worker that ran dry yields so
        every rank takes the same number of steps (``datamodule.stream``)."""
        return collate_preference([], seq_len, pad_id, batch_size)

    def realized(self) -> dict[str, dict[str, Any]]:
        """Per source: pairs, tokens (both sides) and loss tokens delivered in batches, with the
        target and realized token share (the shape ``StackDataModule.data_stats`` logs)."""
        counts = self.windows.delivered()
        total = max(sum(c["tokens"] for c in counts.values()), 1)
        wsum = sum(s.weight for s in self.config.sources)
        return {s.name: {**counts.get(s.name, {"docs": 0, "tokens": 0, "loss_tokens": 0}), "target_weight": s.weight / wsum,
                         "realized_weight": counts.get(s.name, {}).get("tokens", 0) / total} for s in self.config.sources}

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        out = super(SFTPipeline, self).stats()
        batch = self.windows.stats.to_dict()
        if batch:
            out["batch"] = batch
        return out


def build_preference_pipeline(config: SFTConfig, tokenizer: Any, split: str = "train", shard: ShardSpec | None = None) -> PreferencePipeline:
    """The preference graph for one split and one (rank, worker) shard, from an ``SFTConfig``
    whose sources hold preference records (``pack_buffer_docs`` is unused: pairs are not packed)."""
    check_split(split)
    if split == "val" and config.holdout_fraction == 0:
        raise ValueError("preference config: holdout_fraction is 0, so there is no validation split; set it > 0 (e.g. 0.01)")
    for s in config.sources:
        if s.format != "auto":
            raise ConfigError(f"preference source {s.name!r}: field 'format' must be 'auto' (the pair format is read from the "
                              f"fields: prompt/chosen/rejected), got {s.format!r}")
    shard = shard or ShardSpec()
    ct = chat_tokens(tokenizer)
    sources, chains, rendered = {}, {}, {}
    for spec in config.sources:
        src = PreferenceSource(spec, shard=shard, role_aliases=config.role_aliases, on_invalid=config.on_invalid)
        chain: dict[str, BaseNode] = {"source": src}
        node: BaseNode = src
        if config.holdout_fraction > 0:
            node = chain["holdout"] = HoldoutNode(node, split, config.holdout_fraction, seed=config.seed)
        node = chain["render"] = PairRenderNode(node, tokenizer, config.seq_len, spec.overlong or config.overlong, spec.loss_policy())
        sources[spec.name], chains[spec.name], rendered[spec.name] = src, chain, node
    if len(rendered) == 1:
        stream: BaseNode = next(iter(rendered.values()))
    else:
        stream = MultiNodeWeightedSampler(rendered, {s.name: float(s.weight) for s in config.sources},
                                          stop_criteria=StopCriteria.ALL_DATASETS_EXHAUSTED, rank=shard.rank,
                                          world_size=shard.world_size, seed=config.seed + 2)
    if config.shuffle_buffer > 1:
        stream = ShuffleNode(stream, config.shuffle_buffer, seed=config.seed + 1)
    batches = PairBatchNode(stream, config.batch_size, config.seq_len, ct.pad, config.drop_last,
                            sources=[s.name for s in config.sources])  # batches count what they deliver per source
    return PreferencePipeline(config=config, split=split, shard=shard, sources=sources, chains=chains, windows=batches, batches=batches)

