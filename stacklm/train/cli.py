"""``stacklm-train fit --config <name or path>`` (or ``python -m trainer fit`` from the
repository): LightningCLI over ``GPTModule``.

``--config demo`` / ``--config stack-100m`` name the packaged configs (``stacklm.configs``);
any other value is a YAML path. The datamodule class is imported by its dotted path only when
the CLI starts, so the model side works (and is testable) on its own.
``STACKLM_DATAMODULE=pkg.module.Class`` swaps in another ``LightningDataModule`` with the same
batch contract (e.g. a tiny one in a demo).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

DEFAULT_DATAMODULE = "stacklm.datamodule.StackDataModule"


def import_class(path: str) -> type:
    """``"pkg.module.Class"`` -> the class, with an error that names the path."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"expected a dotted class path like {DEFAULT_DATAMODULE!r}, got {path!r}")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"cannot import datamodule class {path!r}: {err}") from err


def resolve_config_args(args: Sequence[str]) -> list[str]:
    """``args`` with each ``--config NAME`` (or ``--config=NAME``) that is not a file replaced by
    the packaged config of that name; anything else is left for LightningCLI to report."""
    from stacklm.configs import packaged_configs, resolve_config

    def fix(value: str) -> str:
        name = value[: -len(".yaml")] if value.endswith(".yaml") else value
        if Path(value).exists() or name not in packaged_configs():
            return value
        return str(resolve_config(name))

    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = fix(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + fix(arg[len("--config="):])
    return out


def cli_main(args=None, datamodule_class: type | None = None, run: bool = True):
    """Build (and by default run) the CLI; ``args`` as for ``LightningCLI`` (None: sys.argv)."""
    from lightning.pytorch.cli import LightningCLI

    from stacklm.train.module import GPTModule

    if datamodule_class is None:
        datamodule_class = import_class(os.environ.get("STACKLM_DATAMODULE", DEFAULT_DATAMODULE))
    if args is None:
        args = resolve_config_args(sys.argv[1:])
    elif isinstance(args, (list, tuple)):
        args = resolve_config_args(args)
    return LightningCLI(
        GPTModule,
        datamodule_class,
        args=args,
        run=run,
        auto_configure_optimizers=False,  # GPTModule.configure_optimizers owns AdamW + schedule
        save_config_kwargs={"overwrite": True},
    )


def main() -> None:
    """The ``stacklm-train`` console script."""
    cli_main()


if __name__ == "__main__":
    main()
