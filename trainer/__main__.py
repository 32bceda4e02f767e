"""``python -m trainer fit --config configs/<name>.yaml``: LightningCLI over ``GPTModule``.

The datamodule class is imported by its dotted path only when the CLI starts, so the model
side works (and is testable) on its own. ``STACKLM_DATAMODULE=pkg.module.Class`` swaps in
another ``LightningDataModule`` with the same batch contract (e.g. a tiny one in a demo).
"""

from __future__ import annotations

import importlib
import os

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


def cli_main(args=None, datamodule_class: type | None = None, run: bool = True):
    """Build (and by default run) the CLI; ``args`` as for ``LightningCLI`` (None: sys.argv)."""
    from lightning.pytorch.cli import LightningCLI

    from trainer.module import GPTModule

    if datamodule_class is None:
        datamodule_class = import_class(os.environ.get("STACKLM_DATAMODULE", DEFAULT_DATAMODULE))
    return LightningCLI(
        GPTModule,
        datamodule_class,
        args=args,
        run=run,
        auto_configure_optimizers=False,  # GPTModule.configure_optimizers owns AdamW + schedule
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    cli_main()
