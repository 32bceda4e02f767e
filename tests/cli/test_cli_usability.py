"""A CLI that fits its users (issue 14 item 6): ``--version``, help on every option, examples in
every ``--help`` that really parse, out-of-range values refused with the allowed range (exit 2),
and ``inspect`` on a prebuild's output directory as well as on one split."""

from __future__ import annotations

import argparse
import shlex

import pytest

import stacklm
from stacklm.cli import build_parser, main


def _parsers() -> dict[str, argparse.ArgumentParser]:
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {"stacklm": top, **sub.choices}


def _exit_code(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def test_version(capsys):
    code, out, _ = _exit_code(["--version"], capsys)
    assert code == 0 and out.strip() == f"stacklm {stacklm.__version__}"


def test_every_option_has_help_and_every_command_examples():
    for name, parser in _parsers().items():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings or action.dest}"
        assert parser.epilog and "examples" in parser.epilog, name
        assert "examples" in parser.format_help(), name


def test_every_example_parses():
    """The examples are real command lines: each parses, with the command it is listed under."""
    n = 0
    for name, parser in _parsers().items():
        for line in parser.epilog.replace("\\\n", " ").splitlines()[1:]:  # a shell line continued with a backslash
            line = line.split("  #")[0].strip()
            if not line.startswith("stacklm "):
                continue
            argv = shlex.split(line)[1:]
            args = build_parser().parse_args(argv)
            assert name == "stacklm" or args.command == name, line
            n += 1
    assert n >= 20


@pytest.mark.parametrize(
    "argv, message",
    [
        (["prebuild", "--config", "demo", "--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
        (["prebuild", "--config", "demo", "--tokens-per-shard", "-5"], "--tokens-per-shard: must be an integer >= 1, got -5"),
        (["prebuild", "--config", "demo", "--workers", "two"], "--workers: must be an integer >= 1, got 'two'"),
        (["prebuild-datatrove", "--config", "demo", "--tasks", "0"], "--tasks: must be an integer >= 1, got 0"),
        (["prebuild-datatrove", "--config", "demo", "--tasks", "2", "--workers", "0"], "--workers: must be an integer >= 1 or -1 (all), got 0"),
        (["train-tokenizer", "--out", "x", "--max-bytes", "0"], "--max-bytes: must be an integer >= 1, got 0"),
        (["train-tokenizer", "--out", "x", "--vocab-size", "100"], "--vocab-size: must be an integer >= 266, got 100"),
        (["tok-eval", "--tokenizer", "x", "--max-bytes-per-domain", "-1"], "--max-bytes-per-domain: must be an integer >= 1"),
        (["tok-eval", "--tokenizer", "x", "--overlap-sizes", "5000,100"], "--overlap-sizes: expected 0 < SMALL < LARGE"),
        (["inspect", "x", "--tokenizer", "t", "--limit", "0"], "--limit: must be an integer >= 1, got 0"),
        (["inspect", "x", "--tokenizer", "t", "--seq-len", "1"], "--seq-len: must be an integer >= 2, got 1"),
    ],
)
def test_out_of_range_values_are_refused_with_the_range(argv, message, capsys):
    code, _, err = _exit_code(argv, capsys)
    assert code == 2
    assert message in err


def test_accepted_values_parse():
    args = build_parser().parse_args(["prebuild", "--config", "demo", "--workers", "1", "--tokens-per-shard", "1_000"])
    assert args.workers == 1 and args.tokens_per_shard == 1000
    args = build_parser().parse_args(["prebuild-datatrove", "--config", "demo", "--tasks", "3", "--workers", "-1"])
    assert args.workers == -1
    assert build_parser().parse_args(["tok-eval", "--tokenizer", "x", "--overlap-sizes", "10,20"]).overlap_sizes == (10, 20)


# ----------------------------------------------------------------------------- inspect OUT
@pytest.fixture(scope="module")
def built(tmp_path_factory, tokenizer_2048, saved_tokenizer_dir):
    """A real (tiny) prebuild output: OUT/train and OUT/val."""
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.prebuild import prebuild

    tok_dir = saved_tokenizer_dir(tokenizer_2048)
    cfg = PipelineConfig.from_dict({
        "seq_len": 64, "batch_size": 2, "seed": 0, "shuffle_buffer": 8, "pack_buffer_docs": 8, "holdout_fraction": 0.1,
        "tokenize_batch_docs": 8, "num_threads": 1,
        "mix": {"name": "t", "total_tokens": 6000, "entries": [
            {"name": "web", "kind": "synthetic", "weight": 1.0, "domain": "prose", "seed": 1, "num_docs": 2000}]},
    })
    out = tmp_path_factory.mktemp("built") / "shards"
    prebuild(cfg, tok_dir, out, tokens_per_shard=64 * 8, progress=False)
    return out, tok_dir


def test_inspect_takes_a_prebuild_output_directory(built, capsys):
    out, tok_dir = built
    assert (out / "train").is_dir() and (out / "val").is_dir()
    reports = {}
    for argv in ([str(out)], [str(out), "--split", "val"], [str(out / "train")]):
        code = main(["inspect", *argv, "--tokenizer", str(tok_dir), "--json", "-"])
        reports[tuple(argv)] = capsys.readouterr().out
        assert code == 0, argv
    assert reports[(str(out),)] == reports[(str(out / "train"),)]  # the default split is train
    assert str(out / "val") in reports[(str(out), "--split", "val")]
    code = main(["inspect", str(out), "--tokenizer", str(tok_dir), "--split", "test"])
    err = capsys.readouterr().err
    assert code == 2 and "no split 'test'" in err and "train, val" in err
    code = main(["inspect", str(out / "train"), "--tokenizer", str(tok_dir), "--split", "val"])
    err = capsys.readouterr().err
    assert code == 2 and "not 'val'" in err  # never silently the other split
