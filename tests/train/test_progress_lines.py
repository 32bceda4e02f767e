"""Progress where jobs run (``stacklm.progress_lines``): the line writer's interval, format and
knobs, and the fit's bars -- on a terminal the Rich bar counts ``global_step`` of ``max_steps``
after a resume, elsewhere the CLI picks the plain lines. A real fit and its resume with stdout
and stderr in a file: ``tests/test_run_identity.py`` (its two fits, asserted on once more);
prebuild: ``tests/prebuild/test_prebuild.py``; tokenizer training: ``tests/tokenizer/test_train.py``."""

from __future__ import annotations

import re

import lightning as L
import pytest

from stacklm.progress_lines import SECONDS_ENV, STYLE_ENV, ProgressLines, duration, eta, rate, wants_lines

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (?P<what>[^:]+): (?P<body>.*)$")


def test_the_rich_bar_counts_steps_of_max_steps_after_a_resume(tmp_path):
    """On a terminal: a fit resumed at step 21 of 26 shows 21/26, then 22/26 (Lightning's own bar
    counted the epoch's batch index against the batches left: ``26/5``)."""
    from stacklm.train.cli import _progress_bar
    from lightning.pytorch.callbacks import ModelSummary

    from stacklm.train.progress import LineProgressBar, StepProgressBar

    (bar,) = _progress_bar({"callbacks": []}, [], terminal=True)
    assert isinstance(bar, StepProgressBar)
    # in a log: the plain lines, and Lightning's plain model summary (not Rich's box-drawn table)
    assert [type(b) for b in _progress_bar({"callbacks": []}, [], terminal=False)] == [LineProgressBar, ModelSummary]
    assert [type(b) for b in _progress_bar({"callbacks": [], "enable_model_summary": False}, [], terminal=False)] == [LineProgressBar]
    assert [type(b) for b in _progress_bar({"callbacks": [LineProgressBar()]}, [], terminal=False)] == [ModelSummary]
    trainer = L.Trainer(max_steps=26, callbacks=[bar], logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit_loop.max_epochs = -1  # as fit() sets it for max_steps alone
    trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = 21  # global_step
    bar.setup(trainer, None, "fit")
    bar.on_train_start(trainer, None)
    bar.on_train_epoch_start(trainer, None)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.completed, task.total) == (21, 26)
    assert task.speed is None  # the resumed steps are not counted as progress made now
    trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = 22
    bar.on_train_batch_end(trainer, L.LightningModule(), None, None, batch_idx=25)
    assert (task.completed, task.total) == (22, 26)
    bar.teardown(trainer, None, "fit")


def test_the_line_writer_and_its_knobs(monkeypatch):
    import io

    now = [100.0]
    stream = io.StringIO()
    lines = ProgressLines("job", seconds=30, every=5, stream=stream, clock=lambda: now[0])
    assert not lines.due(4)
    assert lines.due(5)  # every 5 units ...
    now[0] += 30
    assert lines.due(0)  # ... or 30 s, whichever first
    text = lines.write([("", "done"), ("tokens", "1,000")], n=5)
    assert LINE.match(text)["body"] == "done  tokens 1,000" and stream.getvalue() == text + "\n"
    assert not lines.due(9) and lines.due(10)
    assert (rate(8312), rate(1.2e6), rate(0.5), duration(3725), duration(90061), eta(0, 0), eta(10, 0), eta(100, 4)) == \
        ("8.31k", "1.2M", "0.5", "1:02:05", "1d 1:01:01", "0:00:00", "?", "0:00:25")
    monkeypatch.setenv(STYLE_ENV, "lines")
    assert wants_lines()
    monkeypatch.setenv(STYLE_ENV, "bar")
    assert not wants_lines()
    monkeypatch.setenv(STYLE_ENV, "fancy")
    with pytest.raises(ValueError, match="STACKLM_PROGRESS='fancy': expected one of bar, lines"):
        wants_lines()
    monkeypatch.setenv(SECONDS_ENV, "soon")
    with pytest.raises(ValueError, match="STACKLM_PROGRESS_SECONDS='soon'"):
        ProgressLines("x")


def test_the_fit_lines_leave_the_start_up_out_of_the_pace(tmp_path, capsys, monkeypatch):
    """A resume at step 40 of 50 whose first step ends 60 s after the start (the checkpoint's
    load, the loaders' first batches), then a step a second: the first line has no pace yet
    (``ETA ?``; it read ``ETA 0:09:00`` for 9 s of work), the next ones the pace since then."""
    import functools

    import stacklm.train.progress as progress
    from stacklm.train.progress import LineProgressBar

    now = [1000.0]
    monkeypatch.setattr(progress, "ProgressLines", functools.partial(progress.ProgressLines, clock=lambda: now[0]))
    bar = LineProgressBar(every_n_steps=1, every_seconds=3600)
    trainer = L.Trainer(max_steps=50, callbacks=[bar], logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit_loop.max_epochs = -1
    step = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    step.completed = 40
    bar.setup(trainer, None, "fit")
    bar.on_train_start(trainer, None)
    for t, s in [(60, 41), (61, 42), (62, 43), (69, 50)]:
        now[0], step.completed = 1000.0 + t, s
        bar.on_train_batch_end(trainer, L.LightningModule(), {"loss": 1.0}, None, batch_idx=s)
    bar.on_train_end(trainer, None)
    # the progress lines only: the Trainer may say its own things on stderr (GPU/TPU available, ...)
    lines = [m["body"] for line in capsys.readouterr().err.splitlines() if (m := LINE.match(line))]
    assert [line.split("  elapsed ")[1] for line in lines] == ["0:01:00  ETA ?", "0:01:01  ETA 0:00:08", "0:01:02  ETA 0:00:07",
                                                               "0:01:09  ETA 0:00:00", "0:01:09"], lines
    assert lines[0].startswith("step 41/50 (82%)") and lines[-1].startswith("done  step 50/50 (100%)"), lines
