"""The node graph: one builder wires the stateful stages into a pipeline.

Per source:   source -> holdout split -> quality filter -> [user stages] -> [decontaminate] -> exact dedup -> near dedup -> tokenize
Then:         budgeted mix (over the sources) -> shuffle buffer -> pack -> batch

Each source gets its own filter/dedup/tokenize chain, so the mixer can pull tokens from
exactly the source whose budget it is filling; dedup indexes are therefore per source
(cross-source duplicates and duplicates read by other readers are what the global pass,
``stacklm.data.dedup.global_index``, removes: the prebuild always runs it, stream mode drops
the ids of a ``stacklm dedup-index`` file given as ``dedup.index``).
The loader's state is the root node's ``state_dict()``, which nests every stage's small
state; a fresh graph ``reset`` with it continues bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.config import PipelineSection
from stacklm.data.contract import PLANES
from stacklm.data.dedup import DedupIndex, DedupNode, ExactDeduper, NearDeduper
from stacklm.data.dedup.config import DedupConfig
from stacklm.data.dedup.shingles import SHINGLES, default_shingle_size
from stacklm.data.doc_refs import DocRefs
from stacklm.data.quality.decontam import DecontamConfig, DecontamNode, ensure_index
from stacklm.data.quality.filters import FilterConfig, FilterNode
from stacklm.data.graph import BuiltPipeline
from stacklm.data.quality.holdout import HoldoutNode
from stacklm.data.quality.user_stages import StageConfig, UserStageNode, check_stages, import_stages
from stacklm.data.mix.mix import MixNode
from stacklm.data.packing.nodes import PackNode, batch_node
from stacklm.data.packing.pack import Collate
from stacklm.data.registry import DataMix
from stacklm.data.shuffle import ShuffleNode
from stacklm.data.stage_clock import StageClock, install
from stacklm.data.sources import ShardSpec, open_source
from stacklm.data.splits import check_split
from stacklm.data.tokenizing import TokenizeNode, tokenize_docs
from stacklm.errors import ConfigError

READ_ORDERS = ("spread", "sequential")


@dataclass(frozen=True)
class PipelineConfig(PipelineSection):
    """Everything that decides the stream's content. ``config_hash`` guards resumes/prebuilds
    (``num_threads`` and ``planes`` are left out of it: they change speed and the batch's layout,
    not the stream)."""

    hash_exclude: ClassVar[tuple[str, ...]] = ("num_threads", "planes")
    modes = ("shards", "stream")  # the data.mode values whose pipeline this is (from_run_config)

    mix: DataMix = field(metadata={"help": "a registered mix name such as 'stack-100m', or a mapping with name, total_tokens, entries"})
    seq_len: int = 2048
    batch_size: int = 8
    strategy: str = "best_fit"
    seed: int = 0
    shuffle_buffer: int = 2000
    pack_buffer_docs: int = 1000
    holdout_fraction: float = 0.001
    filters: FilterConfig = field(default_factory=FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    decontaminate: DecontamConfig | None = None  # evaluation sets whose n-grams leave training
    stages: tuple[StageConfig, ...] = field(default=(), metadata={"help": "user stages after the quality filter: "
                                            "[{fn: 'package.module:name', kwargs: {...}, sources: [...], name: ...}]"})
    tokenize_batch_docs: int = 256
    num_threads: int = 2
    fallback_offline: bool = False
    drop_last: bool = False
    planes: str = field(default="full", metadata={"help": "'full': batches carry the four contract planes; 'lean': int32 "
                                                  "input_ids, cu_seqlens, max_seqlen, last_targets (stacklm.data.contract)"})
    read_order: str = field(default="spread", metadata={"help": "'spread': local files are read in a seeded order of pieces "
                                                        "spread over every file, so a budget below the source takes a sample of all of "
                                                        "it; 'sequential': file by file from the start, as before"})

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ConfigError(f"pipeline config: field 'seq_len' must be >= 2, got {self.seq_len}")
        if self.batch_size < 1:
            raise ConfigError(f"pipeline config: field 'batch_size' must be >= 1, got {self.batch_size}")
        if self.strategy not in ("greedy", "best_fit"):
            raise ConfigError(f"pipeline config: field 'strategy' must be 'greedy' or 'best_fit', got {self.strategy!r}")
        if self.planes not in PLANES:
            raise ConfigError(f"pipeline config: field 'planes' must be one of {PLANES}, got {self.planes!r}")
        if self.read_order not in READ_ORDERS:
            raise ConfigError(f"pipeline config: field 'read_order' must be one of {READ_ORDERS}, got {self.read_order!r}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ConfigError(f"pipeline config: field 'holdout_fraction' must be in [0, 1), got {self.holdout_fraction}")
        # checked here, where the field is named, not first by the stage that uses it (a traceback)
        for name, what in (("shuffle_buffer", "the documents the shuffle holds; 1 = no shuffle"),
                           ("pack_buffer_docs", "the documents the packer holds"),
                           ("tokenize_batch_docs", "documents per encode call"),
                           ("num_threads", "encode threads")):
            if getattr(self, name) < 1:
                raise ConfigError(f"pipeline config: field {name!r} must be >= 1, got {getattr(self, name)} ({what})")
        for name in ("exact_max_docs", "near_max_docs"):
            if getattr(self.dedup, name) < 1:
                raise ConfigError(f"pipeline config: field 'dedup.{name}' must be >= 1, got {getattr(self.dedup, name)}")
        if not 0.0 < self.dedup.near_threshold <= 1.0:
            raise ConfigError(f"pipeline config: field 'dedup.near_threshold' must be in (0, 1] (the fraction of equal MinHash values a verified near copy needs), got {self.dedup.near_threshold}")
        if self.dedup.shingle not in SHINGLES:
            raise ConfigError(f"pipeline config: field 'dedup.shingle' must be one of {SHINGLES} (char or word n-grams), got {self.dedup.shingle!r}")
        size = self.dedup.shingle_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigError(f"pipeline config: field 'dedup.shingle_size' must be an integer >= 1 or null (the {self.dedup.shingle} n-gram's "
                              f"length; null: {default_shingle_size(self.dedup.shingle)}), got {size!r}")
        # the spec only, at parse: importing waits for a command that runs the stages (check_stages_run)
        check_stages(self.stages, [e.name for e in self.mix.entries])

    def check_stages_run(self) -> None:
        """Import and build the user stages, refused in one line naming the field
        (``user_stages.import_stages``): called where they are going to run (a prebuild, a
        stream datamodule, an engine's launch), before any work starts."""
        import_stages(self.stages)

    def config_hash(self, exclude=None) -> str:
        # without decontamination (or user stages) the hash is what it was before the section
        # existed, so earlier prebuilds and checkpoints still resume
        skip = tuple(self.hash_exclude if exclude is None else exclude)
        return super().config_hash(skip + (("decontaminate",) if self.decontaminate is None else ())
                                   + (("stages",) if not self.stages else ()))

    def build(self, tokenizer, split: str = "train", shard: ShardSpec | None = None, epoch: int = 0,
              provenance: bool = False) -> Pipeline:
        """The node graph for one split, one (rank, worker) shard and one pass (``build_pipeline``)."""
        return build_pipeline(self, tokenizer, split, shard, epoch=epoch, provenance=provenance)


@dataclass
class Pipeline(BuiltPipeline):
    """The built pre-training graph plus handles on its mix and shuffle stages."""

    mix: MixNode
    shuffle: ShuffleNode
    clock: StageClock | None = None  # each stage's own seconds (sampled): the workers' summaries carry them

    def stage_seconds(self) -> dict[str, float]:
        """Stage -> estimated seconds of its own work in this reader so far (``StageClock``)."""
        return self.clock.seconds() if self.clock is not None else {}

    def realized(self) -> dict[str, dict[str, Any]]:
        return self.mix.realized()

    def padding_batch(self, batch_size: int, seq_len: int, pad_id: int) -> dict[str, Any]:
        """A batch of padding rows (no loss) in this graph's planes, for a loader worker that ran
        dry (``datamodule.stream``): rows of pad ids collated like any rows."""
        p = self.windows.packer
        return Collate(p.bos_id, p.eos_id, pad_id, self.config.planes)(np.full((batch_size, seq_len), pad_id, dtype=np.int64))

    def phases(self) -> list[dict[str, Any]]:
        """Per mixture phase: planned vs mixed tokens per source (``TokenBudgetMixer.phases``)."""
        return self.mix.phases()


def _near_deduper(config: PipelineConfig):
    if not config.dedup.near:
        return None
    return NearDeduper(config.dedup.near_shingle_size, max_docs=config.dedup.near_max_docs, shingle=config.dedup.shingle)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of pass ``epoch`` over the data: ``seed`` itself for epoch 0 (a one-pass run and
    a prebuild are unchanged), else a value derived from ``(seed, epoch)``, so every epoch draws
    a new order and the same epoch always draws the same one."""
    if epoch == 0:
        return seed
    return int(hashlib.sha256(f"stacklm-epoch:{seed}:{epoch}".encode()).hexdigest()[:15], 16)


def read_order_seed(config: PipelineConfig, name: str, epoch: int = 0) -> int | None:
    """The seed of source ``name``'s spread read order (``read_order: spread``) in pass ``epoch``;
    None for ``sequential``. Per source and per epoch, so every epoch of a stream run whose
    budget binds reads another sample."""
    if config.read_order != "spread":
        return None
    return epoch_seed(config.seed + 2, epoch) ^ zlib.crc32(name.encode())


def document_chain(config: PipelineConfig, entry, split: str, shard: ShardSpec, count_tokens=None, epoch: int = 0) -> dict[str, BaseNode]:
    """One source's chain up to dedup (source -> holdout -> filter -> user stages -> decontaminate): the documents
    a deduper sees. The global dedup pass (``stacklm.data.dedup.global_index``) reads the same,
    so a copy of a contaminated document is never kept in its place. ``count_tokens``: how the
    decontamination report counts the tokens it removed (the tokenizer's encode). ``epoch``:
    the pass, for the source's read order (``read_order_seed``)."""
    src = open_source(entry, shard=shard, fallback_offline=config.fallback_offline,
                      order_seed=read_order_seed(config, entry.name, epoch))
    node: BaseNode = src
    chain: dict[str, BaseNode] = {"source": src}
    if config.holdout_fraction > 0 or split == "val":
        node = chain["holdout"] = HoldoutNode(node, split, config.holdout_fraction, seed=config.seed)
    node = chain["filter"] = FilterNode(node, config.filters, entry.filter_rules())
    for i, stage in enumerate(config.stages):  # after the filter, before decontamination: dedup sees what they keep
        if stage.sources is None or entry.name in stage.sources:
            node = chain[stage.stage_name] = UserStageNode(node, stage, f"pipeline.stages[{i}]")
    if config.decontaminate is not None:
        chain["decontam"] = DecontamNode(node, config.decontaminate, ensure_index(config.decontaminate), count_tokens)
    return chain


def last_document_node(chain: dict[str, BaseNode]) -> BaseNode:
    """The end of a ``document_chain``: what dedup reads. A chain holds its stages in the order
    they run (``build_pipeline`` adds dedup and tokenize after it), so it is the last of the rest."""
    return next(node for stage, node in reversed(chain.items()) if stage not in ("dedup", "tokenize"))


def build_pipeline(
    config: PipelineConfig,
    tokenizer,
    split: str = "train",
    shard: ShardSpec | None = None,
    epoch: int = 0,
    dedup_index: DedupIndex | None = None,
    provenance: bool = False,
) -> Pipeline:
    """Build the whole graph for one split and one (rank, worker) shard of the sources.

    ``epoch`` (a pass over the data) reseeds the mix draws and the shuffle (``epoch_seed``);
    the holdout assignment keeps ``config.seed``, so a document stays in its split every epoch.
    ``dedup_index``: removed ids of a global dedup pass (else ``config.dedup.index`` is loaded
    when set); the prebuild passes its own and turns in-flight dedup off. ``provenance``: the
    packer records each window's document pieces (the prebuild's side files, ``stacklm.data.storage.provenance``).
    """
    check_split(split)
    shard = shard or ShardSpec()
    total = config.mix.total_tokens
    if split == "val":
        total = max(1, round(total * config.holdout_fraction))
    if dedup_index is None and config.dedup.index:
        from stacklm.data.dedup.global_index import load_bound

        dedup_index = load_bound(config.dedup.index, config)  # refused when built from another corpus
    sources: dict[str, BaseNode] = {}
    chains: dict[str, dict[str, BaseNode]] = {}
    tokenized: dict[str, BaseNode] = {}
    # the buffers (dedup's kept group, the tokenizer's read-ahead, shuffle, packer) are checkpointed
    # by position and re-read from these sources on resume (``doc_refs``)
    refs = DocRefs(functools.partial(tokenize_docs, tokenizer, num_threads=config.num_threads), sources)
    for entry in config.mix.entries:
        chain = document_chain(config, entry, split, shard, count_tokens=lambda text: len(tokenizer.encode(text)), epoch=epoch)
        src, node = chain["source"], last_document_node(chain)
        if config.dedup.exact or config.dedup.near or dedup_index is not None:
            exact = ExactDeduper(config.dedup.exact_max_docs) if config.dedup.exact else None
            removed = (dedup_index, split) if dedup_index is not None else None
            node = chain["dedup"] = DedupNode(node, exact, _near_deduper(config), removed=removed, refs=refs)
        node = chain["tokenize"] = TokenizeNode(node, tokenizer, config.tokenize_batch_docs, config.num_threads, refs=refs)
        sources[entry.name] = refs.sources[entry.name] = src
        chains[entry.name] = chain
        tokenized[entry.name] = node
    # A reader mixes its own slice of the budget from its own shard of every source: the
    # schedule's caps see the sources' sizes scaled the same way (sizes are of the whole source).
    split_share = config.holdout_fraction if split == "val" else 1.0 - config.holdout_fraction
    mix = MixNode(tokenized, config.mix.weights, total, seed=epoch_seed(config.seed, epoch), schedule=config.mix.schedule,
                  size_scale=split_share / max(1, shard.count))
    shuffle = ShuffleNode(mix, config.shuffle_buffer, seed=epoch_seed(config.seed + 1, epoch), refs=refs)
    windows = PackNode(
        shuffle, config.seq_len, config.strategy, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, config.pack_buffer_docs,
        sources=[entry.name for entry in config.mix.entries],  # batches count what they deliver per source
        provenance=provenance,
        refs=refs,
    )
    batches = batch_node(windows, config.batch_size, drop_last=config.drop_last, planes=config.planes)
    clock = install(StageClock(), chains, {"mix": mix, "shuffle": shuffle, "pack": windows}, batches)
    return Pipeline(config=config, split=split, shard=shard, sources=sources, chains=chains, windows=windows, batches=batches,
                    mix=mix, shuffle=shuffle, clock=clock)
