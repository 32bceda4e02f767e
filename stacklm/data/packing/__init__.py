"""Packing stage: turn tokenized documents into fixed-length training rows.

``pack.py`` packs documents (bos/eos, cuts, padding) into rows and collates them to the
batch contract; ``nodes.py`` runs that as ``torchdata.nodes`` (windows, then batches that carry
what they deliver); ``origins.py`` records where each window of a row came from (source, document,
offset) so deliveries can be counted; ``masks.py`` turns a packed batch's ``seq_ids`` into the
attention masks the model uses (dense, ``cu_seqlens``, FlexAttention ``BlockMask``).
"""
