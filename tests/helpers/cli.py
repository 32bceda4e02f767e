"""``stacklm inspect`` run in-process, its exit code and everything it printed, shared by the inspector and step-log tests."""

from __future__ import annotations

from stacklm.cli import main


def run(*argv) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["inspect", *(str(a) for a in argv)])
    return code, out.getvalue()
