"""Storage stage: the on-disk format of prebuilt data and its readers.

``datafiles.py`` is the one way a reader opens a file of a data directory (a regular file
inside it, never blocking); ``shards.py`` writes and opens the uint16/uint32 token shards; ``manifest.py`` reads and
writes the manifest that describes a prebuilt split; ``provenance.py`` stores per-piece
provenance next to the shards; ``dataset.py`` is the map-style dataset that reads rows back
from shards for training. Nothing here runs the streaming pipeline; it only stores its output.
"""
