"""Nothing read back from disk can run code (issue 23, item 1).

A crafted file is planted in every place stacklm reads a file back: a prebuild's resume
checkpoint and its dedup index (in a half-built output directory, which the docs put on shared
storage), the datatrove dedup signature slices, a shard's provenance side file, a finished
build's dedup evidence, a step-log frame, a batch file for ``inspect`` and a Lightning
checkpoint. Each planted file is a pickle whose ``__reduce__`` creates a marker file (or an
``.npz`` hiding such a pickle in an object array); the control below shows that unpickling it
would indeed create the marker. Every reader must refuse it in one line naming the file, and
the marker must never appear. A legitimate checkpoint in the new format still resumes
byte-identically.
"""

from __future__ import annotations

import errno
import io
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from stacklm import atomic
from stacklm.cli import main as stacklm_main
from stacklm.data.storage import statefile
from stacklm.prebuild import prebuild
from stacklm.errors import PrebuildError, ShardWriteError, StateFileError
from tests.helpers.prebuild import TOKENS_PER_SHARD, config, data_section, tree


class _Planted:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps({"shards": [], "state": _Planted(marker), "tracker": {}})


def evil_npz(marker: Path) -> bytes:
    """A real ``.npz`` whose member is an object array: ``np.load(allow_pickle=True)`` would run it."""
    buf = io.BytesIO()
    np.savez(buf, state=np.array([_Planted(marker)], dtype=object), meta=np.frombuffer(b"{}", np.uint8))
    return buf.getvalue()


PLANTS = {"pickle": evil_pickle, "npz-object-array": evil_npz}


def test_the_planted_files_are_live(tmp_path):
    """Control: loading the planted bytes the trusting way does create the marker."""
    for name, make in PLANTS.items():
        marker = tmp_path / f"ran-{name}"
        data = make(marker)
        if name == "pickle":
            pickle.loads(data)
        else:
            with np.load(io.BytesIO(data), allow_pickle=True) as z:
                z["state"]
        assert marker.exists(), name


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --- the prebuild's resume state ------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(tokenizer_2048, saved_tokenizer_dir):
    return saved_tokenizer_dir(tokenizer_2048)


@pytest.fixture(scope="module")
def built(tmp_path_factory, tok_dir):
    """(a half-built directory holding checkpoints and a dedup index, its config file): a build
    stopped by a full disk mid-train."""
    root = tmp_path_factory.mktemp("nopickle")
    half = root / "half"
    calls = {"n": 0}
    real = atomic._write_all

    def fills_up(f, data):
        # the 16th write once the dedup index is in place: mid-train, whatever the index wrote
        calls["n"] += (half / ".prebuild" / "dedup-index").is_dir()
        if calls["n"] == 16:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, data)

    atomic._write_all = fills_up
    try:
        with pytest.raises(ShardWriteError):
            prebuild(config(), tok_dir, half, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    finally:
        atomic._write_all = real
    assert (half / ".prebuild" / "train-w000.ckpt").exists() and (half / ".prebuild" / "dedup-index" / "train-w000.npz").exists()
    cfg = root / "c.yaml"
    cfg.write_text(json.dumps({"data": {"tokenizer": str(tok_dir), "pipeline": data_section()}}))
    return half, cfg


def _cli_prebuild(cfg: Path, out: Path) -> int:
    return stacklm_main(["prebuild", "--config", str(cfg), "--out", str(out), "--tokens-per-shard", str(TOKENS_PER_SHARD),
                         "--no-progress"])


@pytest.fixture(scope="module")
def finished(built, tmp_path_factory):
    """The half-built directory resumed through the CLI from its (data-only) checkpoints."""
    half, cfg = built
    out = tmp_path_factory.mktemp("nopickle-resumed") / "out"
    shutil.copytree(half, out)
    ckpt = (out / ".prebuild" / "train-w000.ckpt").read_bytes()
    assert ckpt[:2] == b"PK"  # a zip of .npy members, not a pickle
    state = statefile.loads(ckpt, "ckpt", "")
    assert {"shards", "state", "tracker"} <= state.keys() and state["shards"]
    assert _cli_prebuild(cfg, out) == 0
    return out


@pytest.mark.slow
def test_a_checkpoint_is_data_only_and_resumes_byte_identically(finished, tok_dir, tmp_path):
    """Resuming from the new-format checkpoint gives the uninterrupted build's bytes."""
    ref = tmp_path / "ref"
    prebuild(config(), tok_dir, ref, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    assert tree(finished) == tree(ref)


@pytest.mark.parametrize("plant", sorted(PLANTS))
@pytest.mark.parametrize("place", ["train-w000.ckpt", "dedup-index/train-w000.npz"])
def test_a_planted_prebuild_state_file_is_refused_and_never_runs(built, tok_dir, tmp_path, capsys, place, plant):
    half, cfg = built
    out = tmp_path / "out"
    shutil.copytree(half, out)
    target = out / ".prebuild" / place
    marker = tmp_path / "pwned"
    target.write_bytes(PLANTS[plant](marker))
    assert _cli_prebuild(cfg, out) == 2
    line = one_line(capsys.readouterr().err)
    assert str(target) in line and "delete it" in line and "re-run the same command" in line, line
    assert not marker.exists()
    assert not (out / "manifest.json").exists()
    # the library says the same, as a PrebuildError
    with pytest.raises(PrebuildError, match="delete it"):
        prebuild(config(), tok_dir, out, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    assert not marker.exists()


def test_a_checkpoint_that_is_no_prebuild_state_is_refused(built, tmp_path, capsys):
    """A well-formed state file that is not a checkpoint (wrong fields) is also one line."""
    half, cfg = built
    out = tmp_path / "out"
    shutil.copytree(half, out)
    (out / ".prebuild" / "train-w000.ckpt").write_bytes(statefile.dumps({"hello": 1}))
    assert _cli_prebuild(cfg, out) == 2
    assert "not a prebuild checkpoint" in one_line(capsys.readouterr().err)


# --- the other readers ---------------------------------------------------------------------
def test_datatrove_dedup_stage_files_are_refused(built, tmp_path):
    """The staged dedup decision reads back signature columns (bucket tasks) and edge files (the
    decision task): a planted pickle or object array in either is refused naming the file, and
    never runs."""
    from stacklm.data.dedup.staged import write_signature_dir
    from stacklm.scale.datatrove_steps import PAIRS_DIR, StackDedupBuckets, StackDedupCluster, TaskPlan, _sig_dirs, bucket_tasks
    from stacklm.tokenizer.bpe import StackTokenizer

    _, cfg = built
    tok = StackTokenizer.load(json.loads(cfg.read_text())["data"]["tokenizer"])
    out = tmp_path / "dt"
    plan = TaskPlan(config().to_dict(), tok.to_dict(), str(out), 1, TOKENS_PER_SHARD)
    for d in _sig_dirs(plan):  # real signature columns of one record per slice
        rec = {"ids": np.array([f"web/p0/{d.name}"]), "source": np.zeros(1, np.int32), "digest": np.array([7], np.uint64),
               "bands": np.arange(1, 13, dtype=np.uint64).reshape(1, 12), "minhash": np.arange(120, dtype=np.uint32).reshape(1, 120)}
        write_signature_dir(rec, d.name.split("-")[0], d)
    tasks = bucket_tasks(plan)
    marker = tmp_path / "pwned"
    for plant, make in PLANTS.items():
        column = _sig_dirs(plan)[0] / "band0_key.npy"
        good = column.read_bytes()
        column.write_bytes(make(marker))
        band0 = [t[0] for t in tasks].index("band0")
        with pytest.raises(ValueError) as e:
            list(StackDedupBuckets(plan).run(rank=band0, world_size=len(tasks)))
        line = str(e.value)
        assert "\n" not in line and str(column) in line and "delete it" in line, (plant, line)
        column.write_bytes(good)
        for rank in range(len(tasks)):  # the real pairs, then one planted pair file
            list(StackDedupBuckets(plan).run(rank=rank, world_size=len(tasks)))
        pairs = out / ".prebuild" / PAIRS_DIR / "band3-r0000.p0000.npy"
        pairs.write_bytes(make(marker))
        with pytest.raises(ValueError) as e:
            list(StackDedupCluster(plan).run())
        line = str(e.value)
        assert "\n" not in line and str(pairs) in line and "delete it" in line, (plant, line)
        assert not marker.exists(), plant


@pytest.mark.slow
def test_a_provenance_side_file_is_refused(finished, tmp_path, capsys):
    out = tmp_path / "ref"
    shutil.copytree(finished, out)
    marker = tmp_path / "pwned"
    for plant, make in PLANTS.items():
        side = out / "train" / "shard_00000.prov.npz"
        side.write_bytes(make(marker))
        assert stacklm_main(["inspect", str(out), "--row", "0"]) == 2, plant
        line = one_line(capsys.readouterr().err)
        assert str(side) in line and "not a stacklm provenance side file" in line and "rebuild" in line, line
        assert not marker.exists(), plant


@pytest.mark.slow
def test_a_dedup_evidence_file_is_refused(finished, tmp_path, capsys):
    """``stacklm inspect OUT --why ID`` reads the build's dedup evidence (``OUT/dedup-evidence/``)."""
    out = tmp_path / "ref"
    shutil.copytree(finished, out)
    marker = tmp_path / "pwned"
    (out / "dedup-evidence").mkdir(exist_ok=True)
    for plant, make in PLANTS.items():
        evidence = out / "dedup-evidence" / "train-w000.evidence.npz"
        evidence.write_bytes(make(marker))
        assert stacklm_main(["inspect", str(out), "--why", "web/x/0"]) == 2, plant
        line = one_line(capsys.readouterr().err)
        assert str(evidence) in line and "not a stacklm dedup evidence file" in line, line
        assert not marker.exists(), plant


def test_a_step_log_frame_is_refused(tmp_path):
    from stacklm.data.storage.steplog import _HEADER, MAGIC, read_frames
    from stacklm.errors import DataError

    marker = tmp_path / "pwned"
    for plant, make in PLANTS.items():
        payload = make(marker)
        path = tmp_path / "rank-00000.frames"
        path.write_bytes(_HEADER.pack(MAGIC, len(payload)) + payload)
        with pytest.raises(DataError) as e:
            list(read_frames(path))
        assert "\n" not in str(e.value) and str(path) in str(e.value), str(e.value)
        assert not marker.exists(), plant


def test_a_batch_file_and_a_lightning_checkpoint_load_weights_only(built, tmp_path, capsys):
    """``inspect BATCH.pt``, a fit's ``--ckpt_path`` (Lightning's ``TorchCheckpointIO``, which
    leaves ``weights_only`` to torch's default, True since torch 2.6) and ``model.init_from``
    refuse a planted pickle."""
    import torch
    from lightning.pytorch.plugins.io.torch_plugin import TorchCheckpointIO

    _, cfg = built
    marker = tmp_path / "pwned"
    evil = tmp_path / "batch.pt"
    torch.save({"input_ids": _Planted(marker)}, evil)  # torch.save pickles; loading it trustingly would run it
    assert stacklm_main(["inspect", str(evil), "--tokenizer", json.loads(cfg.read_text())["data"]["tokenizer"]]) == 2
    assert str(evil) in one_line(capsys.readouterr().err)
    with pytest.raises(pickle.UnpicklingError):
        TorchCheckpointIO().load_checkpoint(evil)
    from stacklm.errors import ConfigError
    from stacklm.train.gpt_module import load_init_weights

    with pytest.raises(ConfigError, match=r"^model\.init_from: .*batch\.pt: not a readable checkpoint \(UnpicklingError"):
        load_init_weights(None, str(evil))  # `model.init_from`: refused before the module is touched
    assert not marker.exists()


def test_state_files_round_trip_types_and_refuse_what_is_not_data():
    state = {"a": (1, 2.5, None), "b": [np.arange(3, dtype=np.uint16), np.int64(7), np.float32(0.5)], 3: b"\x00x",
             "$t": "a user key", "big": 2**100, "text": "caf\u00e9 \ud800", "nan": float("inf")}
    back = statefile.loads(statefile.dumps(state), "x", "")
    assert back.keys() == state.keys() and back["a"] == (1, 2.5, None) and back[3] == b"\x00x"
    assert back["b"][0].dtype == np.uint16 and back["b"][0].tolist() == [0, 1, 2]
    assert type(back["b"][1]) is np.int64 and type(back["b"][2]) is np.float32
    assert back["$t"] == "a user key" and back["big"] == 2**100 and back["text"] == "caf\u00e9 \ud800"
    with pytest.raises(TypeError, match=r"state\.x.*object array"):
        statefile.dumps({"x": np.array([object()], dtype=object)})
    with pytest.raises(TypeError, match=r"state\.y: a builtins\.object cannot go into a state file"):
        statefile.dumps({"y": object()})
    with pytest.raises(StateFileError, match=r"^f\.ckpt: not a stacklm state file \(it holds pickled data"):
        statefile.loads(pickle.dumps(1), "f.ckpt", "delete it")
    with pytest.raises(StateFileError, match="format"):
        buf = io.BytesIO()
        np.savez(buf, state=np.frombuffer(json.dumps({"format": "other"}).encode(), np.uint8))
        statefile.loads(buf.getvalue(), "f", "")


def test_a_file_that_is_no_pickle_is_not_called_one(tmp_path):
    """numpy says "pickled data" of any file that is neither .npy nor .npz; a truncated text file
    given as ``dedup.index`` was said to hold pickled data. Only a real pickle is called one."""
    import pickle

    from stacklm.data.dedup.global_index import DedupIndex
    from stacklm.errors import ConfigError

    text = tmp_path / "notes.txt"
    text.write_text("dedup index notes, cut off mid-wor")
    with pytest.raises(ConfigError, match=r"notes\.txt is not a stacklm dedup index \(neither a \.npz nor a \.npy file: "
                                          r"it starts with b'dedup index '\)") as refused:
        DedupIndex.load(text)
    assert "pickled" not in str(refused.value)
    planted = tmp_path / "index.npz"
    planted.write_bytes(pickle.dumps({"meta": 1}))
    with pytest.raises(ConfigError, match=r"index\.npz is not a stacklm dedup index \(it holds pickled data, which stacklm never loads\)"):
        DedupIndex.load(planted)
