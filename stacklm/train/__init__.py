"""The Stack-100M model and its Lightning entry point.

``python -m trainer fit --config <name or path>`` (from the repository) and the installed
``stacklm-train fit --config <name or path>`` run ``LightningCLI`` with ``GPTModule`` and
``stacklm.datamodule.StackDataModule`` (see ``stacklm.train.cli``). The code lives here, under
the project's own name, so the wheel claims no top-level ``trainer`` package.

Names load on first use (PEP 562), so importing ``stacklm.train.cli`` does not import
Lightning. That matters beyond the command's own start: a loader worker started through a
forkserver or by spawn re-runs the main script first (``multiprocessing`` does, to find what
``__main__`` defines), and the ``stacklm-train`` console script is ``from stacklm.train.cli
import main``; with an eager package every stream/sft loader worker of ``stacklm-train fit``
imported Lightning again (~6 CPU-s each), which the trainer already has (bench/startup.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stacklm.optional import lazy_getattr

_WHERE = {
    "GPT": "model", "GPTConfig": "model", "check_batch": "model", "lm_loss": "model",
    "GPTModule": "gpt_module", "OptimConfig": "gpt_module", "warmup_cosine": "gpt_module",
}

__all__ = ["GPT", "GPTConfig", "GPTModule", "OptimConfig", "check_batch", "lm_loss", "warmup_cosine"]

if TYPE_CHECKING:  # pragma: no cover
    from stacklm.train.gpt_module import GPTModule, OptimConfig, warmup_cosine  # noqa: F401
    from stacklm.train.model import GPT, GPTConfig, check_batch, lm_loss  # noqa: F401


__getattr__ = lazy_getattr("stacklm.train", {n: (f"stacklm.train.{m}", n) for n, m in _WHERE.items()}, globals())


def __dir__() -> list[str]:
    # the names above and the submodules imported so far; not this module's own helpers (lazy_getattr)
    return sorted({*__all__, *(n for n, v in globals().items() if getattr(v, "__name__", None) == f"{__name__}.{n}")})
