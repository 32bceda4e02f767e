"""stacklm: the training-data layer of a small-LM stack.

Raw text in; packed, document-aware, exactly resumable batches out. See DESIGN.md
(shared with the team) for the id layout, batch contract and artifact formats.
"""

__version__ = "0.1.0"
