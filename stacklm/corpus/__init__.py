"""Text that needs no download: the embedded standard-library corpus and the synthetic corpus.

``stdlib``: real code, prose, CJK and math-like text read from the running interpreter's
standard library (the demo, the tokenizer evaluation and the tests' real-text cases).
``synthetic``: deterministic documents built from that text with injected exact and near
duplicates (the offline source and its dedup ground truth).
"""

from stacklm.corpus.stdlib import (
    DOMAINS,
    iter_cjk,
    iter_code,
    iter_default_corpus,
    iter_default_documents,
    iter_domain,
    iter_math,
    iter_prose,
    stdlib_dir,
    stdlib_py_files,
)
from stacklm.corpus.synthetic import (
    EXACT_DUP_EVERY,
    NEAR_DUP_EVERY,
    SYNTHETIC_DOMAINS,
    near_edit,
    synthetic_duplicate_of,
    synthetic_duplicate_of_slot,
    synthetic_text,
)

__all__ = [
    "DOMAINS",
    "EXACT_DUP_EVERY",
    "NEAR_DUP_EVERY",
    "SYNTHETIC_DOMAINS",
    "iter_cjk",
    "iter_code",
    "iter_default_corpus",
    "iter_default_documents",
    "iter_domain",
    "iter_math",
    "iter_prose",
    "near_edit",
    "stdlib_dir",
    "stdlib_py_files",
    "synthetic_duplicate_of",
    "synthetic_duplicate_of_slot",
    "synthetic_text",
]
