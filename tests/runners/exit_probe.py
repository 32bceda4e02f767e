"""Run by tests/test_program_server.py: prints to both streams, then ends as ``sys.argv[1]`` says
(``raise``: a traceback; ``kill``: SIGKILLs itself; a number: ``sys.exit`` with it) and writes
``sys.argv[2]`` with what it saw of its environment and working directory first."""

from __future__ import annotations

import json
import os
import signal
import sys

if __name__ == "__main__":
    how, out = sys.argv[1], sys.argv[2]
    with open(out, "w") as f:
        json.dump({"cwd": os.getcwd(), "probe": os.environ.get("PROBE_VAR"), "argv": sys.argv[1:], "main": __name__}, f)
    print("to stdout")
    print("to stderr", file=sys.stderr)
    if how == "raise":
        raise ValueError("the probe raised")
    if how == "kill":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(how))
