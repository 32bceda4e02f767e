"""``data:`` is parsed once into a typed, frozen, picklable ``DataConfig`` that travels to the
modes and the loader workers (issue 31): its ``pipeline`` is a ``PipelineConfig`` or
``SFTConfig`` from construction on, and nothing downstream parses a dict again. Cheap: no
Trainer."""

from __future__ import annotations

import json
import pickle

import pytest
import yaml

from stacklm.configs import CONFIG_DIR
from stacklm.data.pipeline import PipelineConfig
from stacklm.data.sft import SFTConfig
from stacklm.datamodule.section import DATA_PATH, DataConfig
from stacklm.errors import DataConfigError
from tests.helpers.datamodule import SEQ_LEN, stream_dm, stream_pipeline
from tests.helpers.worker_probe import ConfigProbe


@pytest.mark.parametrize("name", ["demo", "stack-100m", "sft", "preference"])
def test_the_packaged_data_sections_parse_into_one_picklable_typed_object(name):
    data = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())["data"]
    config = DataConfig.from_dict(data, path=DATA_PATH)
    typed = SFTConfig if data["mode"] in ("sft", "preference") else PipelineConfig
    assert type(config.pipeline) is typed
    assert (config.pipeline.seq_len, config.pipeline.batch_size) == (config.seq_len, config.batch_size)  # the module's defaults
    assert pickle.loads(pickle.dumps(config)) == config
    assert DataConfig.from_dict(config.to_dict(), path=DATA_PATH) == config


def _count_parses(monkeypatch) -> list[str]:
    calls: list[str] = []
    for cls in (PipelineConfig, SFTConfig):
        parse = cls.from_dict.__func__

        def counted(klass, data, path="", _parse=parse):
            calls.append(klass.__name__)
            return _parse(klass, data, path)

        monkeypatch.setattr(cls, "from_dict", classmethod(counted))
    return calls


def _sft_pipeline(tmp_path) -> dict:
    from tests.helpers.sft import make_conversations, write_jsonl

    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in make_conversations(40)])
    return {"sources": [{"name": "chats", "kind": "local", "path": [str(path)]}], "shuffle_buffer": 8,
            "pack_buffer_docs": 4, "holdout_fraction": 0.1}


@pytest.mark.parametrize("mode", ["stream", "sft"])
def test_the_pipeline_is_parsed_once_per_datamodule(tokenizer_dir, tmp_path, monkeypatch, mode):
    """Construction parses it; set-up, both loaders (graphs built in this process), the data
    gate's sample, the logging numbers, the hashes and the checkpoint state parse nothing."""
    from stacklm.datamodule.gate import GateRules, sample_sft

    calls = _count_parses(monkeypatch)
    extra = {} if mode == "stream" else {"mode": "sft", "pipeline": _sft_pipeline(tmp_path), "seq_len": 128}
    dm = stream_dm(tokenizer_dir, **extra)
    assert calls == [type(dm.config.pipeline).__name__]
    dm.setup("fit")
    train = dm.train_dataloader()
    for _ in train:
        pass
    for _ in dm.val_dataloader():
        pass
    if mode == "sft":
        GateRules.of(dm)
        sample_sft(dm, n_batches=1)
    dm.data_stats()
    dm.state_dict()
    assert len(calls) == 1, calls
    assert dm._mode.config is dm.config and train.dataset.build.config is dm.config.pipeline


def test_the_arguments_read_back_as_attributes_of_the_one_config(tokenizer_dir):
    dm = stream_dm(tokenizer_dir, gate=False, val_batches=3)
    assert (dm.mode, dm.seq_len, dm.gate, dm.val_batches, dm.logical_streams) == ("stream", SEQ_LEN, False, 3, None)
    assert dm.pipeline is dm.config.pipeline and dm.tokenizer_path == str(tokenizer_dir)
    assert not hasattr(dm, "pipeline_dict")  # no dict travels beside it
    with pytest.raises(AttributeError, match="no_such_argument"):
        dm.no_such_argument  # noqa: B018


def test_a_loader_worker_receives_the_typed_pipeline_and_parses_nothing(tokenizer_dir, tmp_path):
    dm = stream_dm(tokenizer_dir, num_workers=1)
    dm.setup("fit")
    loader = dm.train_dataloader()
    loader.worker_init_fn = ConfigProbe(loader.worker_init_fn, str(tmp_path / "probe"))
    next(iter(loader))  # the worker built its graph from what it was handed
    assert json.loads((tmp_path / "probe0").read_text()) == {"config": "stacklm.data.pipeline.PipelineConfig"}
    assert not (tmp_path / "probe0.parses").exists()


@pytest.mark.parametrize("pipeline, mode, must", [
    ({**stream_pipeline(), "seq_len": 2 * SEQ_LEN}, "stream", ["data.pipeline", "seq_len", "set them in one place"]),
    ({**stream_pipeline(), "dedup": {"nera": True}}, "stream", ["data.pipeline.dedup.nera", "did you mean 'near'"]),
    (stream_pipeline(), "sft", ["data.pipeline", "mix"]),  # sft mode reads an SFTConfig
    ({"sources": [{"name": "c", "kind": "local", "path": ["x.jsonl"]}]}, "stream", ["data.pipeline.sources"]),
])
def test_a_bad_pipeline_is_one_line_naming_the_field_at_construction(tokenizer_dir, pipeline, mode, must):
    with pytest.raises(DataConfigError) as info:
        stream_dm(tokenizer_dir, mode=mode, pipeline=pipeline)
    text = str(info.value)
    assert "\n" not in text and all(m in text for m in must), text


def test_the_command_lines_check_parses_a_mapping_it_accepted_once(monkeypatch):
    """jsonargparse deserializes ``data.pipeline`` several times while it reads one command line
    (five for a ``fit --config``): the check parses the same mapping once, a changed one again."""
    from stacklm.datamodule import section
    from stacklm.datamodule.section import check_pipeline

    monkeypatch.setattr(section, "_last_checked", [])  # as in a fresh process
    calls = _count_parses(monkeypatch)
    pipeline = stream_pipeline()
    for _ in range(3):
        assert check_pipeline(pipeline) == pipeline
    assert len(calls) == 1
    check_pipeline({**pipeline, "seed": 7})
    assert len(calls) == 2
    with pytest.raises(DataConfigError, match="nera"):
        check_pipeline({**pipeline, "dedup": {"nera": True}})
