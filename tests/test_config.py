"""The one ``Config`` base: unknown keys named by dotted path with the nearest valid name, type
coercion of nested configs, lists, Optional and Literal, one hash, and the configs that use it."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Literal

import pytest

from stacklm.config import Config
from stacklm.configs import CONFIG_DIR, packaged_configs, resolve_config
from stacklm.data.pipeline import PipelineConfig
from stacklm.data.sources.schema import SourceConfig
from stacklm.data.sft import SFTConfig
from stacklm.errors import ConfigError


@dataclass(frozen=True)
class Inner(Config):
    near: bool = True
    size: int = 3


@dataclass(frozen=True)
class Outer(Config):
    name: str
    inner: Inner = field(default_factory=Inner)
    rule: Literal["greedy", "best_fit"] = "best_fit"
    files: tuple[str, ...] = ()
    limit: int | None = None
    ratio: float = 0.5


def test_unknown_key_names_dotted_path_and_nearest_name():
    with pytest.raises(ConfigError) as err:
        Outer.from_dict({"name": "x", "inner": {"nera": False}}, path="data.pipeline")
    msg = str(err.value)
    assert "'data.pipeline.inner.nera'" in msg and "did you mean 'near'" in msg
    with pytest.raises(ConfigError, match="'nme'; did you mean 'name'"):
        Outer.from_dict({"nme": "x"})
    with pytest.raises(ConfigError, match=r"missing required field\(s\) \['name'\]"):
        Outer.from_dict({})


def test_types_are_coerced_and_wrong_types_named():
    cfg = Outer.from_dict({"name": "x", "inner": None, "files": "a/*.jsonl", "limit": 2.0e3, "ratio": 1})
    assert cfg.inner == Inner() and cfg.files == ("a/*.jsonl",) and cfg.limit == 2000 and isinstance(cfg.limit, int)
    assert cfg.ratio == 1 and isinstance(cfg.ratio, int)  # an int stays an int: to_dict keeps what was written
    assert Outer.from_dict({"name": "x", "files": ["a", "b"]}).files == ("a", "b")
    for bad, words in [
        ({"inner": {"size": "3"}}, ["'inner.size'", "integer"]),
        ({"inner": {"near": 1}}, ["'inner.near'", "true or false"]),
        ({"rule": "first_fit"}, ["'rule'", "best_fit"]),
        ({"limit": "many"}, ["'limit'"]),
        ({"files": [1]}, ["'files[0]'", "string"]),
        ({"inner": [1]}, ["'inner'", "mapping"]),
    ]:
        with pytest.raises(ConfigError) as err:
            Outer.from_dict({"name": "x", **bad})
        for w in words:
            assert w in str(err.value), (bad, str(err.value))


def test_round_trip_and_one_hash():
    cfg = Outer.from_dict({"name": "x", "inner": {"size": 4}, "files": ["a"]})
    assert cfg.to_dict() == {"name": "x", "inner": {"near": True, "size": 4}, "rule": "best_fit", "files": ["a"],
                             "limit": None, "ratio": 0.5}
    assert Outer.from_dict(cfg.to_dict()) == cfg and Outer.from_dict(cfg.to_dict()).config_hash() == cfg.config_hash()
    assert cfg.config_hash() != Outer.from_dict({**cfg.to_dict(), "ratio": 0.25}).config_hash()
    assert cfg.config_hash(exclude=("ratio",)) == Outer.from_dict({**cfg.to_dict(), "ratio": 0.25}).config_hash(exclude=("ratio",))
    with pytest.raises(NotImplementedError):
        cfg.build()


def test_pipeline_config_typos_at_every_depth():
    base = {"mix": "stack-100m"}
    for patch, dotted, near in [
        ({"dedup": {"nera": True}}, "data.pipeline.dedup.nera", "near"),
        ({"filters": {"prose": {"min_char": 1}}}, "data.pipeline.filters.prose.min_char", "min_chars"),
        ({"pack_buffer": 8}, "data.pipeline.pack_buffer", "pack_buffer_docs"),
        ({"mix": {"name": "m", "total_tokens": 10, "entries": [{"name": "w", "kind": "synthetic", "domain": "prose",
                                                                 "text_colum": "t"}]}},
         "data.pipeline.mix.entries[0].text_colum", "text_column"),
    ]:
        with pytest.raises(ConfigError) as err:
            PipelineConfig.from_dict({**base, **patch}, path="data.pipeline")
        assert f"{dotted!r}" in str(err.value) and f"did you mean {near!r}" in str(err.value)
    with pytest.raises(ConfigError, match="did you mean 'stack-100m'"):
        PipelineConfig.from_dict({"mix": "stack-10m"})


def test_one_source_schema_for_pretraining_and_sft(tmp_path):
    src = {"name": "chats", "kind": "local", "path": [str(tmp_path / "*.jsonl")], "text_column": "messages"}
    shape = {"seq_len": 64, "batch_size": 2}
    sft = SFTConfig.from_dict({"sources": [src], "pack_buffer_docs": 4, **shape})
    assert isinstance(sft.sources[0], SourceConfig) and sft.sources[0].domain == "chat"
    assert sft.sources[0].paths == [str(tmp_path / "*.jsonl")] and sft.pack_buffer_docs == 4
    pre = PipelineConfig.from_dict({"mix": {"name": "m", "total_tokens": 10, "entries": [
        {**src, "domain": "prose", "text_column": None}]}, **shape})
    assert isinstance(pre.mix.entries[0], SourceConfig) and pre.mix.entries[0].text_column == "text"
    for old, new in [("files", "data_files"), ("column", "text_column")]:  # the SFT names before the merge
        with pytest.raises(ConfigError, match=f"did you mean '{new}'"):
            SFTConfig.from_dict({"sources": [{"name": "c", "path": "x", old: "y"}]}, path="data.pipeline")
    with pytest.raises(ConfigError, match="did you mean 'pack_buffer_docs'"):
        SFTConfig.from_dict({"sources": [src], "pack_buffer": 4})
    node = SourceConfig("w", "synthetic", 1.0, "prose", seed=1, num_docs=3).build()  # the pre-training source node
    node.reset()
    assert [d["source"] for d in node] == ["w"] * 3
    with pytest.raises(ConfigError, match="for pre-training"):  # chat is an SFT domain
        PipelineConfig.from_dict({"mix": {"name": "m", "total_tokens": 10, "entries": [{**src, "domain": "chat"}]}})


def test_packaged_configs_resolve_by_name_and_share_one_layout(tmp_path):
    assert {"demo", "sft", "stack-100m"} <= set(packaged_configs())
    assert resolve_config("demo") == CONFIG_DIR / "demo.yaml" == resolve_config("demo.yaml")
    own = tmp_path / "demo"
    own.write_text("data: {}\n")
    assert resolve_config(own) == own  # an existing file wins over a name
    with pytest.raises(ConfigError, match="did you mean 'demo'"):
        resolve_config("dmeo")
    import yaml

    from stacklm.datamodule.section import DataConfig

    for name in packaged_configs():  # one layout: data.pipeline is a config of its mode
        data = yaml.safe_load(resolve_config(name).read_text())["data"]
        cls = SFTConfig if data["mode"] in ("sft", "preference") else PipelineConfig
        cfg = cls.from_run_config(resolve_config(name))
        built = DataConfig.from_dict(data, path="data").pipeline  # what the trainer and the prebuild build
        assert cfg.config_hash() == built.config_hash() and (cfg.seq_len, cfg.batch_size) == (data["seq_len"], data["batch_size"])
        assert cls.from_dict(cfg.to_dict()).config_hash() == cfg.config_hash()


def test_a_pipeline_takes_seq_len_and_batch_size_from_where_the_run_config_gives_them(tmp_path):
    """Issue 36: ``PipelineConfig.from_dict(yaml["data"]["pipeline"])``, as the README showed, took
    seq_len 2048 and batch_size 8 because the run config gives them one level up, in ``data:``."""
    import yaml

    pipeline = {"mix": {"name": "m", "total_tokens": 1000, "entries": [
        {"name": "w", "kind": "synthetic", "weight": 1.0, "domain": "prose", "num_docs": 10}]}, "shuffle_buffer": 4}
    doc = {"data": {"mode": "stream", "seq_len": 256, "batch_size": 4, "seed": 7, "pipeline": pipeline}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = PipelineConfig.from_run_config(path)
    assert (cfg.seq_len, cfg.batch_size, cfg.seed, cfg.shuffle_buffer) == (256, 4, 7, 4)
    assert PipelineConfig.from_run_config(doc) == cfg  # the parsed mapping too
    with pytest.raises(ConfigError) as err:  # the mapping alone: refused in one line that says where they are
        PipelineConfig.from_dict(yaml.safe_load(path.read_text())["data"]["pipeline"], path="data.pipeline")
    msg = str(err.value)
    assert "\n" not in msg and "no 'seq_len' or 'batch_size'" in msg and "`data:`" in msg and "from_run_config" in msg
    with pytest.raises(ConfigError, match="no 'batch_size'"):  # one of them given: the other is still named
        PipelineConfig.from_dict({**pipeline, "seq_len": 256})
    assert PipelineConfig.from_dict({**pipeline, "seq_len": 256, "batch_size": 4}).seq_len == 256
    # the pipeline's own value wins where it gives one (shards mode; stream mode refuses two values, as the trainer does)
    shards = {"data": {**doc["data"], "mode": "shards", "pipeline": {**pipeline, "seq_len": 128}}}
    assert PipelineConfig.from_run_config(shards).seq_len == 128
    with pytest.raises(ConfigError, match=r"data.pipeline.seq_len \(128\) differs from data.seq_len \(256\)"):
        PipelineConfig.from_run_config({"data": {**shards["data"], "mode": "stream"}})
    with pytest.raises(ConfigError, match=r"data.mode is 'sft'; PipelineConfig is the pipeline of mode\(s\) shards, stream"):
        PipelineConfig.from_run_config({"data": {**doc["data"], "mode": "sft"}})
    with pytest.raises(ConfigError, match=r"run.yaml: unknown field 'data.pipeline.shuffle_bufer'"):
        path.write_text(yaml.safe_dump({"data": {**doc["data"], "pipeline": {**pipeline, "shuffle_bufer": 4}}}))
        PipelineConfig.from_run_config(path)
    with pytest.raises(ConfigError, match="no `data.pipeline` mapping"):
        PipelineConfig.from_run_config({"data": {"seq_len": 256}})


@pytest.mark.parametrize("name", ["demo", "sft"])
def test_print_config_refuses_a_pipeline_typo(tmp_path, name, capsys, monkeypatch):
    """``stacklm-train fit --config X --print_config`` parses ``data.pipeline``: a typo exits
    2 naming the dotted key and the nearest name; the packaged config itself prints. In-process
    (``python -m trainer`` as a program: tests/cli/test_clean_errors.py), so the two runs of each
    config do not pay Lightning's import again (they took 21-24 s a config as subprocesses)."""
    import yaml

    from tests.helpers.cli import run_trainer

    monkeypatch.setattr(sys, "argv", ["stacklm-train"])  # LightningCLI warns about pytest's
    monkeypatch.setenv("STACKLM_DEBUG", "0")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    doc = yaml.safe_load(resolve_config(name).read_text())
    doc["data"]["pipeline"]["shuffle_bufer"] = 8
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps(doc))
    code, out, err = run_trainer(capsys, "fit", "--config", str(bad), "--print_config")
    assert code == 2, out + err
    assert "'data.pipeline.shuffle_bufer'; did you mean 'shuffle_buffer'" in err
    code, out, err = run_trainer(capsys, "fit", "--config", name, "--print_config")
    assert code == 0, err
    printed = yaml.safe_load(out)["data"]["pipeline"]
    assert printed == yaml.safe_load(resolve_config(name).read_text())["data"]["pipeline"]
