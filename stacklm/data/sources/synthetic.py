"""The offline synthetic corpus as a document source (``stacklm.corpus.synthetic`` writes the text)."""

from __future__ import annotations

from torchdata.nodes import BaseNode

from stacklm.corpus.synthetic import SYNTHETIC_DOMAINS, synthetic_text
from stacklm.data.audit import clean_text, record_audit
from stacklm.data.sources.sharding import ShardSpec
from stacklm.data.stats import StageStats

DEFAULT_SYNTHETIC_DOCS = 100_000


class SyntheticSource(BaseNode[dict]):
    """Deterministic offline corpus with injected exact (every 97th) and near (every 53rd)
    duplicates. Random access by index, so the state is one int and sharding strides it."""

    def __init__(
        self,
        name: str = "synthetic",
        domain: str = "prose",
        *,
        seed: int = 0,
        num_docs: int | None = None,
        shard: ShardSpec | None = None,
        stats: StageStats | None = None,
        label: str = "synthetic",
    ) -> None:
        super().__init__()
        if domain not in SYNTHETIC_DOMAINS:
            raise ValueError(f"synthetic source {name!r}: domain must be one of {sorted(SYNTHETIC_DOMAINS)}, got {domain!r}")
        self.name, self.domain, self.seed, self.label = name, domain, seed, label
        self.num_docs = DEFAULT_SYNTHETIC_DOCS if num_docs is None else num_docs
        self.shard = shard or ShardSpec()
        self.stats = stats if stats is not None else StageStats("source")

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {}
        self._next = int(st.get("next", self.shard.index))
        self.stats.load_dict(st.get("stats", {}))

    def get_state(self) -> dict:
        return {"next": self._next, "stats": self.stats.to_dict()}

    def next(self) -> dict:
        while self._next < self.num_docs:
            i = self._next
            self._next += self.shard.count
            text, audit = clean_text(synthetic_text(i, self.domain, self.seed))
            if record_audit(self.stats, self.name, audit):
                return {"text": text, "source": self.name, "domain": self.domain, "doc_id": f"{self.name}/{self.label}/{i}"}
        raise StopIteration
