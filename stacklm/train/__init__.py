"""The Stack-100M model and its Lightning entry point.

``python -m trainer fit --config <name or path>`` (from the repository) and the installed
``stacklm-train fit --config <name or path>`` run ``LightningCLI`` with ``GPTModule`` and
``stacklm.datamodule.StackDataModule`` (see ``stacklm.train.cli``). The code lives here, under
the project's own name, so the wheel claims no top-level ``trainer`` package.
"""

from stacklm.train.model import GPT, GPTConfig, check_batch, lm_loss
from stacklm.train.gpt_module import GPTModule, OptimConfig, warmup_cosine

__all__ = ["GPT", "GPTConfig", "GPTModule", "OptimConfig", "check_batch", "lm_loss", "warmup_cosine"]
