"""stacklm: the training-data layer of a small-LM stack.

Raw text in; packed, document-aware, exactly resumable batches out. See
docs/architecture.md for the id layout, batch contract and artifact formats.
"""

__version__ = "0.1.0"
