"""The fit's progress bar, for step-driven runs.

Why: a run bounded by ``max_steps`` leaves ``max_epochs`` at -1 (Lightning's "no epoch limit"),
and Lightning's ``RichProgressBar`` prints ``Epoch {n}/{max_epochs - 1}``, i.e. ``Epoch 0/-2``.
This bar prints the epoch bound only when there is one.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """``RichProgressBar`` that says ``Epoch 0`` (no ``/-2``) when the epochs are unbounded."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            description += f"/{max_epochs - 1}"
        if len(self.validation_description) > len(description):  # as Lightning pads it: no flicker
            description = f"{description:{len(self.validation_description)}}"
        return description
