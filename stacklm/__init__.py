"""stacklm: the training-data layer of a small-LM stack.

Raw text in; packed, document-aware, exactly resumable batches out. The names a user starts
from are here (the way tiktoken's face is a handful of names over a fast core)::

    import stacklm

    tok = stacklm.train_tokenizer(texts, vocab_size=32768).tokenizer   # or stacklm.StackTokenizer.load(path)
    tok.save("tok.json")
    config = stacklm.PipelineConfig.from_run_config("run.yaml")       # data.pipeline, seq_len/batch_size from data:
    pipe = config.build(tok)                                          # = stacklm.build_pipeline(config, tok)
    stacklm.prebuild_shards(config, tok, "shards/")                   # the same pipes, written once
    dm = stacklm.StackDataModule(mode="shards", tokenizer="tok.json", data_dir="shards/", seq_len=2048, batch_size=8)

Everything else lives one import deeper, in the folder of its concern (docs/architecture.md
draws the map). Names load on first use (PEP 562), so ``import stacklm`` imports neither
torch, numpy nor Lightning: a command line or a config check that only names the package
stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stacklm.optional import lazy_getattr

__version__ = "0.1.0"

# public name -> (module, attribute in that module)
_WHERE = {
    "StackTokenizer": ("stacklm.tokenizer.bpe", "StackTokenizer"),
    "train_tokenizer": ("stacklm.tokenizer.training", "train_from_iterable"),
    "PipelineConfig": ("stacklm.data.pipeline", "PipelineConfig"),
    "build_pipeline": ("stacklm.data.pipeline", "build_pipeline"),
    # not "prebuild": importing the subpackage stacklm.prebuild sets that attribute of this module
    "prebuild_shards": ("stacklm.prebuild.build", "prebuild"),
    "StackDataModule": ("stacklm.datamodule", "StackDataModule"),
}

__all__ = ["__version__", *_WHERE]

if TYPE_CHECKING:  # pragma: no cover
    from stacklm.data.pipeline import PipelineConfig, build_pipeline  # noqa: F401
    from stacklm.datamodule import StackDataModule  # noqa: F401
    from stacklm.prebuild.build import prebuild as prebuild_shards  # noqa: F401
    from stacklm.tokenizer.bpe import StackTokenizer  # noqa: F401
    from stacklm.tokenizer.training import train_from_iterable as train_tokenizer  # noqa: F401


__getattr__ = lazy_getattr("stacklm", _WHERE, globals())


def __dir__() -> list[str]:
    # the face and the subpackages already imported; not this module's own helpers (lazy_getattr, _WHERE)
    return sorted({*__all__, *(n for n, v in globals().items() if getattr(v, "__package__", None) == f"{__name__}.{n}")})
