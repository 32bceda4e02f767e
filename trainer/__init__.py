"""The Stack-100M model and its Lightning entry point.

``python -m trainer fit --config configs/<name>.yaml`` runs ``LightningCLI`` with
``GPTModule`` and ``stacklm.datamodule.StackDataModule`` (see ``trainer.__main__``).
"""

from trainer.model import GPT, GPTConfig, check_batch, lm_loss
from trainer.module import GPTModule, OptimConfig, warmup_cosine

__all__ = ["GPT", "GPTConfig", "GPTModule", "OptimConfig", "check_batch", "lm_loss", "warmup_cosine"]
