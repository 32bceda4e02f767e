"""CLIs run in-process: ``stacklm inspect`` (``run``: its exit code and everything it printed,
shared by the inspector and step-log tests) and the trainer's ``main`` (``run_trainer``: the
config and --print_config tests; in-process because a ``python -m trainer`` subprocess pays
Lightning's import, ~6 CPU-s, where the test process has it already)."""

from __future__ import annotations

from stacklm.cli import main


def run(*argv) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["inspect", *(str(a) for a in argv)])
    return code, out.getvalue()


def run_trainer(capsys, *argv: str) -> tuple[int | str | None, str, str]:
    """``stacklm.train.cli.main(argv)``, which always ends in ``SystemExit``: its code, stdout
    and stderr. The caller sets ``sys.argv`` to one plain word first (LightningCLI warns about
    pytest's) and ``STACKLM_DEBUG`` back after it (``--debug`` sets it)."""
    import logging
    import sys

    import pytest

    from stacklm.train.cli import main as trainer_main

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # their handlers hold an earlier test's captured stream
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.stream = sys.stderr  # not setStream: it flushes the closed one
    with pytest.raises(SystemExit) as info:
        trainer_main(list(argv))
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err
