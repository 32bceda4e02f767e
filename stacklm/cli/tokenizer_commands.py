"""``stacklm train-tokenizer`` and ``stacklm tok-eval``: train, export and evaluate the BPE tokenizer.

Both read text the same way (``stacklm.data.sources.text_input.open_text_input``/``open_text_mix``):
text files, JSON lines or parquet with ``--text-column`` (or each ``--input PATH:COLUMN`` its own),
or a ``datasets`` dataset (``--dataset``); with no input they use the embedded corpus.
``train-tokenizer --config run.yaml`` samples a run config's training mix
(``stacklm.cli.tokenizer_inputs``). ``tok-eval``'s baselines train on the tokenizer's own training
sample (``metadata.training_sample``, recorded by ``train-tokenizer``), never on the text it evaluates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from stacklm.cli.arg_types import OneConfig, int_at_least, int_pair, positive_int
from stacklm.errors import StackLMError, UserError
from stacklm.tokenizer import ARTIFACT_NAME
from stacklm.tokenizer.specials import N_BYTES, SPECIAL_TOKENS

MIN_VOCAB = N_BYTES + len(SPECIAL_TOKENS) + 1  # the bytes, the specials and one merge


# ---------------------------------------------------------------------- reading text
def _column(args: argparse.Namespace) -> str:
    return args.text_column or "text"


def _fmt(args: argparse.Namespace) -> str:
    return "txt" if args.raw_text else "auto"


def _read_options(args: argparse.Namespace, dataset: str | None = None) -> dict:
    """``open_text_input``'s keyword arguments for the command's reading options (column, raw text, dataset)."""
    return dict(text_column=_column(args), fmt=_fmt(args), dataset=dataset,
                dataset_config=args.dataset_config if dataset else None, split=args.split,
                data_files=args.data_files if dataset else None)


def _open(args: argparse.Namespace, max_bytes: int | None, inputs=None, dataset: str | None = None):
    """``open_text_input`` with the command's reading options; ``inputs`` may give each path its
    own column (``PATH:COLUMN``), each file then taking its share by the text it holds."""
    from stacklm.cli.tokenizer_inputs import input_groups
    from stacklm.data.sources.text_input import open_text_input, open_text_mix

    read = _read_options(args, dataset)
    if inputs is not None:
        groups = input_groups(inputs, _column(args), _fmt(args))
        if len(groups) > 1:
            return open_text_mix(groups, max_bytes, weight_by="size")
        inputs, read["text_column"] = list(groups[0].inputs), groups[0].text_column
    return open_text_input(inputs, max_bytes, **read)


def _training_sample(args: argparse.Namespace):
    """``(sample, metadata.inputs, metadata.training_sample without bytes/sha256)`` for the
    command's input: a run config's mix (``--config``), files (``--input``), a dataset, or the
    embedded corpus."""
    from stacklm.cli.tokenizer_inputs import config_groups, groups_record, input_column_error, input_groups, input_paths
    from stacklm.errors import TextColumnError
    from stacklm.prebuild.settings import entry_column_error
    from stacklm.data.sources.text_input import EMBEDDED_CORPUS, open_text_input, open_text_mix, sample_spec
    from stacklm.data.sources.text_sample import resolve_inputs, sample_texts

    given = [f for f, v in (("--config", args.config), ("--input", args.input), ("--dataset", args.dataset)) if v]
    if len(given) > 1:
        raise UserError(f"pass one of --config, --input and --dataset, not {' and '.join(given)} (train on one input; "
                        "list several files with --input, or sources in the config)")
    if args.config and args.text_column:
        raise UserError("--text-column: the sources of a --config name their own column (field 'text_column' of each "
                        "source); leave --text-column out, or use --input PATH:COLUMN")
    if args.weight_by and not (args.config or args.input):
        raise UserError("--weight-by: only with --config or --input (shares between several inputs)")
    max_bytes = args.max_bytes
    if args.config:
        groups, config = config_groups(args.config, _fmt(args))
        weight_by = args.weight_by or "mix"
        try:
            sample = open_text_mix(groups, max_bytes, weight_by=weight_by)
        except TextColumnError as e:  # said as the config's field that sets the column (as the prebuild says it)
            raise entry_column_error(e, args.config, groups) from e
        files = [os.path.abspath(p) for g in groups if g.node is None for p in resolve_inputs(g.inputs)[0]]
        streams = [f"dataset:{g.label}" for g in groups if g.node is not None]
        return sample, files + streams, groups_record(groups, weight_by, max_bytes, config)
    if args.input:
        groups = input_groups(args.input, _column(args), _fmt(args))
        weight_by = args.weight_by or "size"
        paths = input_paths(args.input, _column(args))
        try:
            if len(groups) > 1 or weight_by != "size":
                return open_text_mix(groups, max_bytes, weight_by=weight_by), paths, groups_record(groups, weight_by, max_bytes, None)
            read = {**_read_options(args), "text_column": groups[0].text_column}  # PATH:COLUMN or --text-column
            return open_text_input(paths, max_bytes, **read), paths, sample_spec(paths, max_bytes, **read)
        except TextColumnError as e:  # said in --input's syntax: the fix is PATH:COLUMN
            raise input_column_error(e, args.input, _column(args)) from e
    if args.dataset:
        return (_open(args, max_bytes, dataset=args.dataset), [f"dataset:{args.dataset}"],
                sample_spec(None, max_bytes, **_read_options(args, args.dataset)))
    from stacklm.corpus import iter_default_corpus

    sample = sample_texts(iter_default_corpus(), max_bytes, source="embedded default corpus (Python stdlib)")
    return sample, [EMBEDDED_CORPUS], sample_spec(None, max_bytes)


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from stacklm.tokenizer.training import train_from_iterable
    from stacklm.chat.template_export import export_all

    from stacklm.data.sources.text_input import TRAINING_SAMPLE, SampleDigest

    out = Path(args.out)
    sample, inputs, spec = _training_sample(args)
    digest = SampleDigest(sample)
    try:
        res = train_from_iterable(
            digest,
            args.vocab_size,
            backend=args.backend,
            progress=not args.no_progress,
            total_bytes=args.max_bytes,
        )
    except ValueError as e:
        if isinstance(e, StackLMError) or sample.audit.bytes_yielded:
            raise
        try:
            sample.audit.raise_if_empty()
        except ValueError as empty:
            raise UserError(str(empty)) from e
        raise
    audit = sample.audit
    res.tokenizer.metadata["sample_audit"] = audit.to_dict()
    res.tokenizer.metadata["inputs"] = inputs
    # what tok-eval's baselines train on (the same text, checked by the hash), never the evaluation text
    res.tokenizer.metadata[TRAINING_SAMPLE] = {**spec, "bytes": digest.bytes, "sha256": digest.sha256}
    path = res.tokenizer.save(out / ARTIFACT_NAME)
    exports = export_all(res.tokenizer, out)
    print("\n".join(audit.summary()))
    print(
        f"trained {res.n_merges} merges ({res.backend} backend) on {res.bytes_seen:,} bytes in {res.seconds:.1f}s; "
        f"vocab {res.tokenizer.vocab_size}, shortfall {res.shortfall}"
    )
    print(f"artifact:        {path}")
    print(f"tiktoken ranks:  {exports['tiktoken']}")
    print(f"Hugging Face:    {exports['hf_dir']} (tokenizer.json, tokenizer_config.json)")
    return 0


# ---------------------------------------------------------------------- tok-eval
TIKTOKEN_ENCODINGS = ("gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base")


def _tiktoken_encoding(name: str):
    """A reference tokenizer by tiktoken's name (``--compare gpt2``), from tiktoken's own cache:
    tiktoken downloads a ranks file once and keeps it (``TIKTOKEN_CACHE_DIR``); with no copy
    and no network this is one line saying how to get one."""
    import os

    import tiktoken

    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # noqa: BLE001 -- network or cache errors of every kind
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or "tiktoken's temp-dir cache"
        raise UserError(
            f"--compare {name}: tiktoken has no cached copy of its ranks ({cache}) and could not download them "
            f"({type(e).__name__}); run `python -c \"import tiktoken; tiktoken.get_encoding('{name}')\"` once with network "
            "(set TIKTOKEN_CACHE_DIR to keep it), or give a .tiktoken ranks file with --pattern"
        ) from None


def training_overlap(tokenizer, eval_globs: list[str] | None) -> list[str]:
    """The evaluation inputs that were also in ``tokenizer``'s training sample, by its
    ``metadata.inputs`` (what train-tokenizer read): the files both name (after globbing), or
    the embedded corpus when both use it. Compression measured on training text is optimistic."""
    import glob
    import os

    trained = list((getattr(tokenizer, "metadata", None) or {}).get("inputs") or [])
    if not trained:
        return []
    if eval_globs is None:
        from stacklm.data.sources.text_input import EMBEDDED_CORPUS

        return ["the embedded default corpus"] if EMBEDDED_CORPUS in trained else []

    def files(patterns):
        out = set()
        for g in patterns:
            out |= {os.path.realpath(f) for f in glob.glob(g, recursive=True)} or ({os.path.realpath(g)} if os.path.exists(g) else set())
        return out

    return sorted(files(eval_globs) & files([t for t in trained if not t.startswith(("dataset:", "<"))]))


def _load_for_eval(spec: str, pattern: str | None):
    """A tokenizer from a path: our artifact (file or dir), an HF dir or tokenizer.json, or a
    tiktoken ranks file (ours with its sidecar, or a plain one with ``--pattern``)."""
    from stacklm.tokenizer import imports
    from stacklm.tokenizer.bpe import StackTokenizer
    from stacklm.tokenizer.export import tiktoken_sidecar_path

    p = Path(spec)
    if not p.exists() and spec in TIKTOKEN_ENCODINGS:
        return _tiktoken_encoding(spec)
    if not p.exists():
        raise UserError(f"{spec}: no such tokenizer file or directory (or a tiktoken encoding: {', '.join(TIKTOKEN_ENCODINGS)})")
    if (p.is_dir() and (p / ARTIFACT_NAME).exists()) or p.name.endswith(".stacklm.json"):
        return StackTokenizer.load(p)
    if p.is_file() and p.suffix != ".json" and not tiktoken_sidecar_path(p).exists():
        if pattern is None:
            raise UserError(
                f"{spec}: a plain tiktoken ranks file carries no pre-tokenizer pattern; pass --pattern with a name "
                f"({', '.join(imports.TIKTOKEN_PATTERNS)}) or a regex, e.g. --pattern cl100k"
            )
        return imports.from_tiktoken(p, pattern=imports.resolve_pattern(pattern))
    return imports.load_foreign(p)


def _eval_sources(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """``(domain, open_text_input arguments)`` for every input given to ``tok-eval``."""
    sources: list[tuple[str, dict]] = []
    if args.input:
        sources.append(("input", {"inputs": args.input}))
    by_domain: dict[str, list[str]] = {}
    for item in args.domain_file or []:
        domain, sep, glob = item.partition("=")
        if not sep or not domain or not glob:
            raise UserError(f"--domain-file {item!r}: expected DOMAIN=GLOB, e.g. prose='data/*.txt'")
        by_domain.setdefault(domain, []).append(glob)
    sources += [(domain, {"inputs": globs}) for domain, globs in by_domain.items()]
    if args.dataset:
        sources.append((args.dataset_domain or Path(args.dataset).name or "dataset", {"dataset": args.dataset}))
    names = [d for d, _ in sources]
    if len(set(names)) != len(names):
        raise UserError(f"two inputs share the domain name {min(n for n in names if names.count(n) > 1)!r}; rename one")
    return sources


def _recorded_sample(tokenizer, spec: str) -> dict:
    """The training-sample record of the tokenizer under test (``metadata.training_sample``),
    which tok-eval's baselines train on; refused in one line when it has none."""
    from stacklm.data.sources.text_input import TRAINING_SAMPLE
    from stacklm.errors import TokenizerArtifactError

    record = (getattr(tokenizer, "metadata", None) or {}).get(TRAINING_SAMPLE)
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        raise TokenizerArtifactError(
            f"{spec}: field 'metadata.{TRAINING_SAMPLE}' is missing (a tokenizer not trained by this stacklm's "
            "train-tokenizer): --hf-baseline and --overlap-sizes train on the tokenizer's own training sample, never on "
            "the evaluation text; retrain it with `stacklm train-tokenizer`, or leave those options out")
    return record


def _check_sample(record: dict, digest, spec: str) -> None:
    """The sample read again must be the one the tokenizer was trained on (same bytes, same hash)."""
    from stacklm.data.sources.text_input import TRAINING_SAMPLE
    from stacklm.errors import TokenizerArtifactError

    if digest.sha256 != record["sha256"] or digest.bytes != record.get("bytes"):
        raise TokenizerArtifactError(
            f"{spec}: field 'metadata.{TRAINING_SAMPLE}.sha256': the training sample read again from "
            f"{_described(record)[:200]} is {digest.bytes:,} bytes with "
            f"sha256 {digest.sha256[:12]}, the tokenizer was trained on {record.get('bytes') or 0:,} bytes with sha256 "
            f"{record['sha256'][:12]}: the files changed or moved; restore them, or leave out --hf-baseline/--overlap-sizes")


def _described(record: dict) -> str:
    inputs = (record.get("inputs") or [f"source {g.get('name')}" for g in record.get("groups") or []]
              or [f"dataset {record.get('dataset')}"])
    return f"{', '.join(map(str, inputs[:3]))}{', ...' if len(inputs) > 3 else ''}"


def cmd_tok_eval(args: argparse.Namespace) -> int:
    from stacklm.tokenizer import evaluate

    tokenizers = {}
    main_tok = _load_for_eval(args.tokenizer, args.pattern)
    tokenizers["stacklm"] = main_tok
    for spec in args.compare or []:
        name = Path(spec).name
        while name in tokenizers:
            name = f"{Path(spec).parent.name}/{name}"
        tokenizers[name] = _load_for_eval(spec, args.pattern)
    sources = _eval_sources(args)
    if sources:
        texts = {}
        for domain, kw in sources:
            sample = _open(args, args.max_bytes_per_domain, **kw)
            texts[domain] = list(sample)
            if not texts[domain]:
                raise UserError(f"domain {domain!r}: {sample.audit.summary()[0]}; no text to evaluate")
    else:
        texts = evaluate.domain_texts_from_corpus(max_bytes=args.max_bytes_per_domain)
    baselines: dict[str, dict] = {}  # what each trained baseline trained on (--json)
    if args.hf_baseline or args.overlap_sizes:
        from stacklm.cli.tokenizer_inputs import recorded_groups
        from stacklm.data.sources.text_input import SampleDigest, open_recorded_sample

        from stacklm.errors import TextInputError, TokenizerArtifactError

        record = _recorded_sample(main_tok, args.tokenizer)
        groups = recorded_groups(record, args.train_input, args) if "groups" in record else None

        def recorded(max_bytes=None):
            try:
                return open_recorded_sample(record, args.tokenizer, max_bytes=max_bytes, files=args.train_input, groups=groups)
            except TextInputError as e:
                raise TokenizerArtifactError(f"{args.tokenizer}: field 'metadata.training_sample': its training sample cannot "
                                             f"be read again ({e}); restore it, or leave out --hf-baseline/--overlap-sizes") from None

        # read and hashed first, so a sample that changed is refused before any training time is spent
        digest = SampleDigest(recorded())
        for _ in digest:
            pass
        _check_sample(record, digest, args.tokenizer)
    if args.hf_baseline:
        from stacklm.tokenizer.hf_baseline import train_hf_bpe

        t = time.perf_counter()
        name = f"hf-bpe@{main_tok.vocab_size}"
        cap = args.hf_baseline_bytes if args.hf_baseline_bytes and args.hf_baseline_bytes < digest.bytes else None
        metered = SampleDigest(recorded(cap) if cap else recorded())  # the first cap bytes of the same sample
        tokenizers[name] = train_hf_bpe(metered, main_tok.vocab_size, pattern=main_tok.pattern)
        baselines[name] = {"trained_on": "the tokenizer's training sample" + (" (its first bytes)" if cap else ""),
                           "bytes": metered.bytes, "sha256": metered.sha256}
        print(f"trained the HF BpeTrainer baseline on {metered.bytes:,} bytes of {args.tokenizer}'s training sample "
              f"({_described(record)}; {digest.bytes:,} bytes in all) in {time.perf_counter() - t:.1f}s")
    from stacklm.cli.tokenizer_inputs import input_paths

    eval_globs = None if not sources else [g for _, kw in sources for g in input_paths(kw.get("inputs") or [], _column(args))]
    overlap = training_overlap(main_tok, eval_globs)
    if overlap:
        print(f"warning: the evaluation text overlaps {args.tokenizer}'s training sample ({', '.join(overlap[:5])}"
              f"{', ...' if len(overlap) > 5 else ''}): its compression here is optimistic; evaluate on held-out files "
              "(--input / --domain-file)", file=sys.stderr)
    rows = evaluate.compression_report(tokenizers, texts, progress=not args.no_progress)
    overlaps = []
    if args.overlap_sizes:
        import warnings

        from stacklm.tokenizer.training import train_from_iterable

        small, large = args.overlap_sizes
        merges, seen = {}, {}
        for size in (small, large):
            sample = open_recorded_sample(record, args.tokenizer, max_bytes=size, files=args.train_input, groups=groups)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = train_from_iterable(sample, main_tok.vocab_size, pattern=main_tok.pattern)
            merges[size], seen[size] = res.tokenizer.merged_tokens, res.bytes_seen
            print(f"overlap: trained on {res.bytes_seen:,} bytes of {args.tokenizer}'s training input ({_described(record)})")
            baselines[f"overlap@{size}"] = {"trained_on": "the tokenizer's training input", "bytes": res.bytes_seen}
        overlaps = evaluate.merge_overlap_rows(
            merges[small], merges[large], names=(f"{seen[small]:,} B sample", f"{seen[large]:,} B sample")
        )
    print(evaluate.format_report(rows, overlaps, title=f"tokenizer evaluation: {args.tokenizer}"))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r.to_dict() for r in rows], "overlap": [o.to_dict() for o in overlaps],
                                               "baselines": baselines}, indent=1))
    return 0


# ---------------------------------------------------------------------- parser
TRAIN_EXAMPLES = """examples:
  stacklm train-tokenizer --out tok/                                   # the embedded corpus
  stacklm train-tokenizer --input 'books/**/*.txt' --vocab-size 16384 --out tok/
  stacklm train-tokenizer --input data.jsonl.zst --text-column text --out tok/
  stacklm train-tokenizer --input shards/*.parquet --text-column content --max-bytes 500000000 --out tok/
  stacklm train-tokenizer --input a.parquet:content --input b.jsonl:body --input 'c/*.txt' --out tok/
  stacklm train-tokenizer --config run.yaml --vocab-size 32768 --out tok/          # the run's mix, by its weights
  stacklm train-tokenizer --config run.yaml --weight-by size --out tok/            # ... by the text each source holds
  stacklm train-tokenizer --dataset json --data-files a.jsonl b.jsonl --out tok/   # a datasets builder
  stacklm train-tokenizer --dataset HuggingFaceFW/fineweb-edu --dataset-config sample-10BT --out tok/
"""

EVAL_EXAMPLES = """examples:
  stacklm tok-eval --tokenizer tok/                                    # on the embedded corpus
  stacklm tok-eval --tokenizer tok/ --domain-file prose='books/*.txt' code='src/**/*.py'
  stacklm tok-eval --tokenizer tok/ --input held_out.jsonl --hf-baseline --overlap-sizes 1000000,5000000 --train-input data.jsonl
  stacklm tok-eval --tokenizer tok/ --compare cl100k_base.tiktoken --pattern cl100k
  stacklm tok-eval --tokenizer tok/ --compare other-tok/ --json report.json
"""


def _add_reading_options(p: argparse.ArgumentParser, what: str) -> None:
    """The text-reading options shared by ``train-tokenizer`` and ``tok-eval``."""
    p.add_argument("--text-column", default=None, metavar="NAME",
                   help="the text field of .jsonl/.parquet inputs (those without their own :COLUMN) and --dataset rows "
                   "(default: text)")
    p.add_argument("--raw-text", action="store_true",
                   help="read every --input file as plain text, even JSON (otherwise refused as a likely mistake)")
    p.add_argument("--dataset", metavar="PATH_OR_ID",
                   help=f"{what} a `datasets` dataset: a hub id, a local dataset directory, or a builder "
                   "(json, parquet, text) with --data-files")
    p.add_argument("--dataset-config", metavar="NAME", help="the dataset's config (subset) name")
    p.add_argument("--split", default="train", help="the dataset split to read (default: train)")
    p.add_argument("--data-files", nargs="+", metavar="FILE", help="files for a --dataset builder such as json or parquet")


def add_tokenizer_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register ``train-tokenizer`` and ``tok-eval`` on the ``stacklm`` CLI's subparsers."""
    fmt = argparse.RawDescriptionHelpFormatter
    t = sub.add_parser(
        "train-tokenizer", help="train the byte-level BPE tokenizer and write it plus its exports",
        description="Train a byte-level BPE tokenizer on your text (or the embedded corpus) and write the artifact, "
        "a tiktoken ranks file and a Hugging Face tokenizer directory.",
        epilog=TRAIN_EXAMPLES, formatter_class=fmt,
    )
    t.add_argument("--config", metavar="RUN_YAML", action=OneConfig,
                   help="sample the training mix of a run config (the YAML of `stacklm prebuild`/`stacklm-train fit`, or a "
                   "packaged config by name): each source's files, format and text_column, by the mix's weights")
    t.add_argument("--input", nargs="+", action="extend", metavar="GLOB[:COLUMN]",
                   help="files/globs: text (.txt, code, ...), JSON lines (.jsonl, .gz/.zst too) or .parquet; "
                   "PATH:COLUMN reads that input's records with its own column (else --text-column); repeatable "
                   "(default: the embedded corpus)")
    t.add_argument("--weight-by", choices=("mix", "size"), default=None,
                   help="how the budget is shared between inputs: mix (the config's weights; each --input spec "
                   "equally) or size (the text each holds; compressed files by their uncompressed size). "
                   "Default: mix with --config, size with --input")
    _add_reading_options(t, "train on")
    t.add_argument("--max-bytes", type=positive_int, default=100_000_000,
                   help="training sample size in UTF-8 bytes (default: 100,000,000)")
    t.add_argument("--vocab-size", type=int_at_least(MIN_VOCAB), default=32768,
                   help=f"ids in all: 256 bytes + merges + {len(SPECIAL_TOKENS)} specials (default: 32768, at least {MIN_VOCAB})")
    t.add_argument("--backend", choices=("fast", "python"), default="fast",
                   help="fast: rustbpe (default); python: the from-scratch reference trainer (same merges, slower)")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train_tokenizer)

    e = sub.add_parser(
        "tok-eval", help="bytes/chars per token per domain, vs other tokenizers",
        description="Compression (bytes and characters per token) per domain of your data or the embedded corpus, "
        "against other tokenizers and optional baselines trained on the tokenizer's own training sample.",
        epilog=EVAL_EXAMPLES, formatter_class=fmt,
    )
    e.add_argument("--tokenizer", required=True, help="our artifact (dir or .stacklm.json)")
    e.add_argument("--compare", nargs="+", metavar="PATH|NAME",
                   help="other tokenizers: our artifacts, HF tokenizer dirs or tokenizer.json, tiktoken ranks files, or a tiktoken encoding name (gpt2, r50k_base, p50k_base, cl100k_base, o200k_base; from tiktoken's cache)")
    e.add_argument("--pattern", metavar="NAME_OR_REGEX",
                   help="pre-tokenizer of plain tiktoken ranks files (--tokenizer, --compare): gpt2, cl100k, o200k or a regex")
    e.add_argument("--input", nargs="+", action="extend", metavar="GLOB[:COLUMN]",
                   help="evaluate on these files as one domain, 'input' (PATH:COLUMN: that file's own column)")
    e.add_argument("--domain-file", nargs="+", metavar="DOMAIN=GLOB", help="evaluate on your files per domain")
    _add_reading_options(e, "evaluate on")
    e.add_argument("--dataset-domain", metavar="NAME", help="the domain name of --dataset in the report (default: its name)")
    e.add_argument("--max-bytes-per-domain", type=positive_int, default=1_000_000,
                   help="UTF-8 bytes read per domain (default: 1,000,000)")
    e.add_argument("--hf-baseline", action="store_true",
                   help="also train HF's BpeTrainer at the same vocab on the tokenizer's own training sample (recorded in "
                   "its artifact and checked by hash; never the evaluation text)")
    e.add_argument("--hf-baseline-bytes", type=positive_int, default=None,
                   help="cap the HF baseline's training at the first N bytes of that sample (default: all of it, as the "
                   "tokenizer saw it)")
    e.add_argument("--overlap-sizes", type=int_pair, metavar="SMALL,LARGE",
                   help="train ours on SMALL and LARGE bytes of the tokenizer's training input; report how many merges both learn")
    e.add_argument("--train-input", nargs="+", metavar="PATH",
                   help="what the tokenizer was trained on, for --hf-baseline/--overlap-sizes: its files (PATH[:COLUMN]), or "
                   "the run config it was trained from with --config (checked against the sha256 its artifact records; the "
                   "paths it records are shown, never opened)")
    e.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.set_defaults(func=cmd_tok_eval)
