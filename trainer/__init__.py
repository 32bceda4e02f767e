"""The repository's entry point for training: ``python -m trainer fit --config demo``.

A thin shim: the code is ``stacklm.train`` (installed as ``stacklm-train``), so the wheel
installs no top-level ``trainer`` package (a name an unrelated PyPI project owns). This folder
is not packaged; it works from a checkout of the repository.
"""
