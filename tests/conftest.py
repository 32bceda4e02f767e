"""Shared fixtures: small real-text tokenizers trained once per session (fast backend)."""

from __future__ import annotations

import pytest

from stacklm.corpus import iter_default_corpus


@pytest.fixture(scope="session")
def real_docs() -> list[str]:
    """~1.5 MB of real text (stdlib code, docstrings, pydoc topics, CJK, math)."""
    return list(iter_default_corpus(1_500_000))


@pytest.fixture(scope="session")
def small_tokenizer(real_docs):
    from stacklm.tokenizer.bpe import train_from_iterable

    return train_from_iterable(real_docs, vocab_size=4096).tokenizer
