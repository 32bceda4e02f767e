"""What a fit prints: stacklm's warnings as one line each (no file path and no echoed
``warnings.warn(`` source line), and no ``Epoch 0/-2`` in a ``max_steps`` run's progress bar."""

from __future__ import annotations

import subprocess
import sys

import lightning as L

from stacklm.train.cli import _progress_bar
from stacklm.train.progress import StepProgressBar


def test_stacklm_warnings_are_one_line_on_the_command_line():
    code = ("import warnings\nfrom stacklm.once import one_line_warnings\none_line_warnings()\n"
            "warnings.warn(\"stacklm: source 'code' ran dry in the train stream\", RuntimeWarning)\n"
            "warnings.warn('someone else', UserWarning)\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    lines = err.splitlines()
    assert lines[0] == "stacklm: source 'code' ran dry in the train stream", err
    assert "UserWarning: someone else" in lines[1], err  # another package's warning keeps Python's format
    assert err.count("warnings.warn(") == 0 and len(lines) == 2, err


def test_a_max_steps_run_has_no_negative_epoch_bound(tmp_path):
    bars = _progress_bar({"enable_progress_bar": None, "callbacks": []}, [], terminal=True)
    assert [type(b) for b in bars] == [StepProgressBar]
    trainer = L.Trainer(max_steps=3, callbacks=bars, logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.progress_bar_callback.setup(trainer, None, "fit")  # as fit() does: the bar learns its trainer
    trainer.fit_loop.max_epochs = -1  # what fit() sets for max_steps alone: "no epoch limit" (its bar: "Epoch 0/-2")
    assert trainer.progress_bar_callback._get_train_description(0).strip() == "Epoch 0"
    trainer = L.Trainer(max_epochs=2, callbacks=_progress_bar({}, [], terminal=True), logger=False, enable_checkpointing=False,
                        default_root_dir=tmp_path)
    trainer.progress_bar_callback.setup(trainer, None, "fit")
    assert trainer.progress_bar_callback._get_train_description(1).strip() == "Epoch 1/1"
    assert _progress_bar({"enable_progress_bar": False}, [], terminal=True) == []
    # no bar in a log either, but the model summary in plain text (Rich's default is box-drawn)
    assert [type(b) for b in _progress_bar({"enable_progress_bar": False}, [], terminal=False)] == [L.pytorch.callbacks.ModelSummary]
