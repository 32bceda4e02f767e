"""Deduplication: exact (normalised text digests) and near (MinHash-LSH), and the pipeline stage.

- ``exact``: ``U64HashSet`` (the compact numpy hash set both indexes use) and ``ExactDeduper``;
- ``minhash``: ``MinHasher`` and ``NearDeduper``;
- ``node``: ``DedupNode``, the stage of the pipes (loaded on first use: it is a torchdata node,
  and a task that only decides, such as a datatrove bucket task, should not pay torch's import);
- ``config``: ``DedupConfig``, the ``dedup`` section of a pipeline config;
- ``global_index``: the global pass (signatures -> one decision -> ``DedupIndex`` of removed
  ids) that makes the result independent of how many readers run.

What counts as the same text is ``stacklm.data.quality.normalize.normalize_text``.
"""

from stacklm.data.dedup.exact import ExactDeduper, U64HashSet, count_by_source, per_doc_sources, text_digest, text_digests
from stacklm.data.dedup.global_index import DedupIndex, collect_signatures, decide, id_key, id_keys
from stacklm.data.dedup.minhash import MinHasher, NearDeduper, candidate_probability, jaccard, share_a_band
from stacklm.data.quality.normalize import normalize_text
from stacklm.optional import lazy_getattr

__all__ = [
    "DedupIndex",
    "DedupNode",
    "ExactDeduper",
    "MinHasher",
    "NearDeduper",
    "U64HashSet",
    "candidate_probability",
    "collect_signatures",
    "decide",
    "id_key",
    "id_keys",
    "count_by_source",
    "jaccard",
    "normalize_text",
    "per_doc_sources",
    "share_a_band",
    "text_digest",
    "text_digests",
]

__getattr__ = lazy_getattr("stacklm.data.dedup", {"DedupNode": ("stacklm.data.dedup.node", "DedupNode")}, globals())
