"""``DedupConfig``: the ``dedup`` section of a pipeline config (``PipelineConfig.dedup``).

Its own module, apart from ``stacklm.data.pipeline``, so that what reads only these settings (a
datatrove bucket task, ``stacklm.scale.datatrove_steps``) imports no torchdata and so no torch:
~3 CPU-s of every such task, which does nothing but sort and compare numpy columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from stacklm.config import Config
from stacklm.data.dedup.minhash import MinHasher
from stacklm.data.dedup.shingles import default_shingle_size
from stacklm.data.dedup.verify import DEFAULT_THRESHOLD


@dataclass(frozen=True)
class DedupConfig(Config):
    exact: bool = True
    near: bool = True
    near_max_docs: int = 2_000_000  # per source; the index warns once and stops growing when full
    exact_max_docs: int = 20_000_000  # per source; the same policy (160-320 MB of exact index at the bound)
    # A global index (``stacklm dedup-index``): documents it lists are dropped and counted as
    # exact_dup/near_dup, whatever reader sees them. With exact/near also on, in-flight dedup
    # runs after it (catching only what the index does not list, inside this reader).
    index: str | None = None
    # Near dedup's shingles (``stacklm.data.dedup.shingles``): ``char`` n-grams of the normalised
    # text, or ``word`` n-grams as datatrove/FineWeb take them; ``shingle_size`` n (null: 7 for
    # char, 5 for word). Every near dedup uses them: in-flight, ``dedup-index`` and the prebuild.
    shingle: Literal["char", "word"] = "char"
    shingle_size: int | None = None
    # The global decision's verification (``stacklm.data.dedup.verify``: why 0.75): a candidate
    # pair is a near copy when at least this fraction of its MinHash values are equal.
    # In-flight dedup (no index) does not verify: it holds band keys only.
    near_threshold: float = DEFAULT_THRESHOLD

    # Fields added after configs were hashed: left out of to_dict() at their default, so an
    # existing config keeps its config_hash (a resume is not refused by an upgrade).
    _OMIT_AT_DEFAULT: ClassVar[dict[str, Any]] = {"shingle": "char", "shingle_size": None, "near_threshold": DEFAULT_THRESHOLD}

    @property
    def near_shingle_size(self) -> int:
        """The n of near dedup's shingles (``shingle_size``, or its kind's default)."""
        return default_shingle_size(self.shingle) if self.shingle_size is None else self.shingle_size

    def min_hasher(self) -> MinHasher:
        """The ``MinHasher`` of these settings: what every near dedup signs documents with."""
        return MinHasher(self.near_shingle_size, shingle=self.shingle)

    def index_meta(self) -> dict[str, Any]:
        """These settings as a dedup index records them (``shingle_size`` resolved)."""
        return {**dataclasses.asdict(self), "shingle_size": self.near_shingle_size}

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if d["shingle_size"] == default_shingle_size(self.shingle):  # written out or left null: the same shingles
            d["shingle_size"] = None
        for key, default in self._OMIT_AT_DEFAULT.items():
            if d[key] == default:
                del d[key]
        return d
