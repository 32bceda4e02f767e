"""Document sources: Hugging Face streams, local files, and an offline synthetic corpus.

Every source is a ``torchdata.nodes.BaseNode`` yielding documents
``{"text", "source", "domain", "doc_id"}`` after the byte-loss audit (``audit.clean_text``),
with its counts in ``node.stats`` (a ``StageStats``).

One module per stage of reading:

- ``sharding``: which rows a (rank, worker) reader takes (``ShardSpec``, ``assign_parts``);
- ``readers``: raw rows of one file or hub shard with an exact position (jsonl, txt, zstd,
  parquet through pyarrow, ``datasets`` streams);
- ``parts``: the part-reading node every source shares (also ``sft``'s conversation source)
  and the text source of files and hub streams;
- ``files``: local files (``LocalFileSource``, ``file_format``, ``glob_files``);
- ``hub``: Hugging Face streams with the offline fallback (``HFStreamSource``);
- ``synthetic``: the offline synthetic corpus as a node (``SyntheticSource``; the text itself
  is ``stacklm.corpus.synthetic``);
- ``schema``: ``SourceConfig``, the one source schema (pre-training and SFT; its SFT-only fields
  are ``stacklm.chat.source_fields``), which the data mix (``stacklm.data.registry``) lists;
- ``entry``: ``open_source``, the node for one ``SourceConfig``;
- ``errors``: the errors, each naming the source and the file or hub path.
- ``text_sample`` / ``text_input``: the tokenizer's training and evaluation text (an audited,
  byte-budgeted sample of text files, records or strings); the tokenizer takes texts and
  never reads files, so its readers live here.
"""

from stacklm.corpus.synthetic import (
    EXACT_DUP_EVERY,
    NEAR_DUP_EVERY,
    near_edit,
    synthetic_duplicate_of,
    synthetic_duplicate_of_slot,
    synthetic_text,
)
from stacklm.data.sources.entry import open_source
from stacklm.data.sources.files import LocalFileSource, file_format, glob_files
from stacklm.data.sources.hub import FALLBACK_OFFLINE, HFStreamSource, check_data_files, hub_load_kwargs
from stacklm.data.sources.parts import BLANK_LINES, FIRST_ROWS_CHECK, PartNode, TextPartSource
from stacklm.data.sources.readers import (
    DatasetsReader,
    JsonlReader,
    ParquetReader,
    TextFileReader,
    dataset_rows,
    import_datasets,
    json_error_detail,
    loads_json_line,
    open_binary,
)
from stacklm.data.sources.sharding import ShardSpec, assign_parts, owns_row
from stacklm.data.sources.synthetic import DEFAULT_SYNTHETIC_DOCS, SyntheticSource

__all__ = [
    "BLANK_LINES",
    "DEFAULT_SYNTHETIC_DOCS",
    "EXACT_DUP_EVERY",
    "FALLBACK_OFFLINE",
    "FIRST_ROWS_CHECK",
    "NEAR_DUP_EVERY",
    "DatasetsReader",
    "HFStreamSource",
    "JsonlReader",
    "LocalFileSource",
    "ParquetReader",
    "PartNode",
    "ShardSpec",
    "SyntheticSource",
    "TextFileReader",
    "TextPartSource",
    "assign_parts",
    "dataset_rows",
    "file_format",
    "glob_files",
    "hub_load_kwargs",
    "import_datasets",
    "check_data_files",
    "json_error_detail",
    "loads_json_line",
    "near_edit",
    "open_binary",
    "open_source",
    "owns_row",
    "synthetic_duplicate_of",
    "synthetic_duplicate_of_slot",
    "synthetic_text",
]
