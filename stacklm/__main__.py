"""``python -m stacklm ...``: the same program as ``stacklm ...``."""

import sys

from stacklm.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
