"""The datamodule's checkpoint state shape (``stacklm.datamodule.resume.state``): one shape per
mode, validated before any step with one message; the epoch-length reload written once; shards
mode's next position. Fast: plain dicts and a bare Lightning ``Trainer``."""

from __future__ import annotations

import pytest

from stacklm.datamodule.resume.shards import next_position, resolve_skips, start_position
from stacklm.datamodule.resume.state import SHAPES, EpochReload, check_state
from stacklm.errors import DataConfigError

IDENTITY = {"mode": "shards", "data": "d" * 64, "tokenizer": "t" * 64, "pipeline": "p" * 64, "where": "/data/a"}
SHAPE = {"world_size": 2, "num_workers": 1, "batch_size": 4}


def _state(mode: str, **extra):
    return {"mode": mode, "identity": {**IDENTITY, "mode": mode}, "shape": dict(SHAPE), "seq_len": 64, **extra}


def _check(saved, mode="shards", shape=SHAPE, seq_len=64):
    return check_state(saved, mode=mode, identity={**IDENTITY, "mode": mode}, seq_len=seq_len, shape=shape)


def test_a_state_comes_back_in_its_modes_shape_with_the_optional_keys_filled():
    position = start_position(1, 10, 3)
    out = _check(_state("shards", position=position))
    assert set(out) == set(SHAPES["shards"])
    assert out["position"] == position and out["skips"] == [] and out["accumulate_grad_batches"] == 1
    assert out["delivered"] is None and out["mix_changes"] == []
    streams = {"logical_streams": 4, "quota": 8}
    assert _check(_state("stream", streams=streams), mode="stream")["streams"] == streams


@pytest.mark.parametrize(("saved", "mode", "match"), [
    ({k: v for k, v in _state("shards").items() if k != "identity"}, "shards", "older stacklm \\(no content identity\\)"),
    (_state("stream"), "stream", "older stacklm \\(per-worker stream positions"),
    ({k: v for k, v in _state("sft").items() if k != "shape"}, "sft", "sft-mode data state has no 'shape'"),
    (_state("shards", seq_len=128), "shards", "seq_len 128, this run 64"),
    ({**_state("shards"), "identity": {**IDENTITY, "data": "e" * 64}}, "shards", "different data \\(data: checkpoint e+ vs now d+\\)"),
    (_state("shards"), "stream", "different data \\(mode: checkpoint shards vs now stream"),
])
def test_a_state_this_run_cannot_resume_is_refused_with_one_line(saved, mode, match):
    with pytest.raises(DataConfigError, match=match) as err:
        _check(saved, mode=mode)
    assert str(err.value).startswith("refusing to resume: ") and "\n" not in str(err.value)


def test_sft_resumes_on_its_own_shape_only():
    assert _check(_state("sft"), mode="sft")["shape"] == SHAPE
    with pytest.raises(DataConfigError, match="world_size 2 -> 1, batch_size 4 -> 8") as err:
        _check(_state("preference"), mode="preference", shape={"world_size": 1, "num_workers": 1, "batch_size": 8})
    assert "resume with the checkpoint's devices x nodes" in str(err.value)
    # shards and stream modes re-deal their position: another shape is no refusal
    assert _check(_state("shards"), shape={"world_size": 1, "num_workers": 0, "batch_size": 8})["shape"] == SHAPE


def test_a_short_resumed_epoch_has_lightning_rebuild_the_loader_and_only_that_setting_is_undone():
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    reload = EpochReload()
    reload.after_build(trainer, 7, 7)  # a whole epoch: nothing to do
    assert trainer.reload_dataloaders_every_n_epochs == 0 and not reload.forced
    reload.after_build(trainer, 3, 7)  # a resumed epoch, shorter: rebuild at the next epoch
    assert trainer.reload_dataloaders_every_n_epochs == 1 and reload.forced
    reload.after_build(trainer, 7, 7)  # whole again: set back
    assert trainer.reload_dataloaders_every_n_epochs == 0 and not reload.forced
    user = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     reload_dataloaders_every_n_epochs=2)
    mine = EpochReload()
    mine.after_build(user, 3, 7)
    mine.after_build(user, 7, 7)
    assert user.reload_dataloaders_every_n_epochs == 2 and not mine.forced  # the user's own setting is left alone
    EpochReload().after_build(None, 3, 7)  # no trainer: nothing to tell


def test_a_rebuilt_shards_loader_starts_where_the_last_one_stopped():
    assert next_position(start_position(0, 40, 5), 0, 100) == start_position(0, 40, 5)  # served nothing: the same place
    assert next_position(start_position(0, 40, 5), 5, 100) == start_position(0, 40, 0)  # Lightning counts the epoch from 0
    assert next_position(start_position(2, 100, 13), 13, 100) == start_position(3)  # a finished epoch: the next one


def test_skip_steps_resolve_once_to_stream_positions():
    skips = resolve_skips([], [(2, 3)], start_position(0, 0), now=0, step_rows=10, num_rows=100)
    assert skips == [{"steps": [2, 3], "positions": [20, 40], "step_rows": 10}]
    assert resolve_skips(skips, [(2, 3)], start_position(0, 0), now=0, step_rows=10, num_rows=100) == skips
    with pytest.raises(DataConfigError, match=r"skip_steps \(2, 3\) starts before this run's step 5"):
        resolve_skips([], [(2, 3)], start_position(0, 50), now=5, step_rows=10, num_rows=100)
