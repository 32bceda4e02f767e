"""Quality stage: decide which documents enter training, before tokenization.

``filters.py`` applies the configured document filters (Gopher-style prose, StarCoder-style code)
and counts each drop by reason; ``normalize.py`` is the text normalization that dedup and
holdout matching share; ``holdout.py`` keeps evaluation documents out of the training stream.
"""
