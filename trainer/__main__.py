"""``python -m trainer fit --config <name or path>``: ``stacklm.train.cli`` from the repository."""

from stacklm.train.cli import main

if __name__ == "__main__":
    main()
