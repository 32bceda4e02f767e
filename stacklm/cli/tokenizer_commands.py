"""``stacklm train-tokenizer`` and ``stacklm tok-eval``: train, export and evaluate the BPE tokenizer."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from stacklm.cli.errors import CliError
from stacklm.tokenizer import ARTIFACT_NAME


# ---------------------------------------------------------------------- train-tokenizer
def _training_texts(inputs: list[str] | None, max_bytes: int | None):
    from stacklm.tokenizer.sample import sample_texts, stream_sample

    if inputs:
        try:
            return stream_sample(inputs, max_bytes)
        except (FileNotFoundError, IsADirectoryError, ValueError) as e:
            raise CliError(str(e)) from None
    from stacklm.corpus import iter_default_corpus

    return sample_texts(iter_default_corpus(), max_bytes, source="embedded default corpus (Python stdlib)")


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from stacklm.tokenizer.bpe import train_from_iterable
    from stacklm.tokenizer.export import export_all

    out = Path(args.out)
    sample = _training_texts(args.input, args.max_bytes)
    res = train_from_iterable(
        sample,
        args.vocab_size,
        backend=args.backend,
        progress=not args.no_progress,
        total_bytes=args.max_bytes,
    )
    audit = sample.audit
    res.tokenizer.metadata["sample_audit"] = audit.to_dict()
    res.tokenizer.metadata["inputs"] = args.input or ["<embedded default corpus>"]
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
def _load_for_eval(spec: str):
    """A tokenizer from a path: our artifact (file or dir), a tiktoken ranks file, or an HF dir."""
    from stacklm.tokenizer import imports
    from stacklm.tokenizer.bpe import StackTokenizer

    p = Path(spec)
    if not p.exists():
        raise CliError(f"{spec}: no such tokenizer file or directory")
    if (p.is_dir() and (p / ARTIFACT_NAME).exists()) or p.name.endswith(".stacklm.json"):
        return StackTokenizer.load(p)
    return imports.load_foreign(p)


def cmd_tok_eval(args: argparse.Namespace) -> int:
    from stacklm.tokenizer import evaluate

    tokenizers = {}
    main_tok = _load_for_eval(args.tokenizer)
    tokenizers["stacklm"] = main_tok
    for spec in args.compare or []:
        name = Path(spec).name
        while name in tokenizers:
            name = f"{Path(spec).parent.name}/{name}"
        tokenizers[name] = _load_for_eval(spec)
    if args.domain_file:
        files = {}
        for item in args.domain_file:
            if "=" not in item:
                raise CliError(f"--domain-file {item!r}: expected DOMAIN=GLOB, e.g. prose='data/*.txt'")
            domain, glob = item.split("=", 1)
            files.setdefault(domain, []).append(glob)
        texts, audits = evaluate.domain_texts_from_files(files, args.max_bytes_per_domain)
    else:
        texts = evaluate.domain_texts_from_corpus(max_bytes=args.max_bytes_per_domain)
    if args.hf_baseline:
        from stacklm.tokenizer.hf_baseline import train_hf_bpe
        from stacklm.tokenizer.sample import sample_texts
        from stacklm.corpus import iter_default_corpus

        t = time.perf_counter()
        sample = sample_texts(iter_default_corpus(), args.hf_baseline_bytes)
        tokenizers[f"hf-bpe@{main_tok.vocab_size}"] = train_hf_bpe(sample, main_tok.vocab_size, pattern=main_tok.pattern)
        print(f"trained the HF BpeTrainer baseline on {args.hf_baseline_bytes:,} bytes in {time.perf_counter() - t:.1f}s")
    rows = evaluate.compression_report(tokenizers, texts, progress=not args.no_progress)
    overlaps = []
    if args.overlap_sizes:
        from stacklm.tokenizer.bpe import train_from_iterable
        from stacklm.tokenizer.sample import sample_texts
        from stacklm.corpus import iter_default_corpus
        import warnings

        small, large = (int(x) for x in args.overlap_sizes.split(","))
        merges = {}
        for size in (small, large):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = train_from_iterable(sample_texts(iter_default_corpus(), size), main_tok.vocab_size, pattern=main_tok.pattern)
            merges[size] = res.tokenizer.merged_tokens
        overlaps = evaluate.merge_overlap_rows(
            merges[small], merges[large], names=(f"{small:,} B sample", f"{large:,} B sample")
        )
    print(evaluate.format_report(rows, overlaps, title=f"tokenizer evaluation: {args.tokenizer}"))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r.to_dict() for r in rows], "overlap": [o.to_dict() for o in overlaps]}, indent=1))
    return 0


# ---------------------------------------------------------------------- parser
def add_tokenizer_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register ``train-tokenizer`` and ``tok-eval`` on the ``stacklm`` CLI's subparsers."""
    t = sub.add_parser("train-tokenizer", help="train the byte-level BPE tokenizer and write it plus its exports")
    t.add_argument("--input", nargs="+", metavar="GLOB", help="text files/globs (default: the embedded corpus)")
    t.add_argument("--max-bytes", type=int, default=100_000_000, help="training sample size in UTF-8 bytes")
    t.add_argument("--vocab-size", type=int, default=32768)
    t.add_argument("--backend", choices=("fast", "python"), default="fast")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train_tokenizer)

    e = sub.add_parser("tok-eval", help="bytes/chars per token per domain, vs other tokenizers")
    e.add_argument("--tokenizer", required=True, help="our artifact (dir or .stacklm.json)")
    e.add_argument("--compare", nargs="+", metavar="PATH", help="tiktoken ranks files or HF tokenizer dirs")
    e.add_argument("--domain-file", nargs="+", metavar="DOMAIN=GLOB", help="evaluate on your files per domain")
    e.add_argument("--max-bytes-per-domain", type=int, default=1_000_000)
    e.add_argument("--hf-baseline", action="store_true", help="also train HF's BpeTrainer at the same vocab")
    e.add_argument("--hf-baseline-bytes", type=int, default=20_000_000)
    e.add_argument("--overlap-sizes", metavar="SMALL,LARGE", help="train on two sample sizes; report merge overlap")
    e.add_argument("--json", help="also write the rows as JSON here")
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=cmd_tok_eval)
