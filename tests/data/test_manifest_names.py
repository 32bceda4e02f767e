"""Names from a manifest are names (issue 23, item 2).

A split manifest's shard ``name`` (and the top manifest's split names and paths) are joined to
the manifest's directory by every reader. Planted in a real prebuilt manifest, a name that
leaves the directory (``../../elsewhere/x``, an absolute path, ``a/b``) must be refused by the
loader, ``stacklm verify``, ``stacklm inspect`` and ``stacklm ledger``, each in one line naming
the manifest, the field and the value, with exit status 2. The files the names point at exist
(copies of a real shard), so following them would have "worked": the refusal is the check, not
a missing file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stacklm.cli import main as stacklm_main
from stacklm.data.storage import manifest as mf
from stacklm.data.storage.dataset import PackedMemmapDataset
from stacklm.errors import DataError
from stacklm.prebuild import prebuild
from tests.helpers.prebuild import TOKENS_PER_SHARD, config


@pytest.fixture(scope="module")
def tok_dir(tokenizer_2048, saved_tokenizer_dir):
    return saved_tokenizer_dir(tokenizer_2048)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, tok_dir):
    out = tmp_path_factory.mktemp("names") / "shards"
    prebuild(config(total=20_000), tok_dir, out, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    return out


def _copy_shard(src_dir: Path, name: str, dest: Path) -> None:
    """Shard ``name``'s files (and side file) as ``dest`` + suffix: a real shard a traversal could reach."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    for suffix in (".tokens.bin", ".meta.bin", ".prov.npz"):
        shutil.copyfile(src_dir / f"{name}{suffix}", f"{dest}{suffix}")


BAD = {
    "up-and-out": lambda root: ("../../elsewhere/x", root.parent / "elsewhere" / "x"),
    "absolute": lambda root: (str(root.parent / "abs" / "x"), root.parent / "abs" / "x"),
    "subdir": lambda root: ("a/b", root / "train" / "a" / "b"),
}


@pytest.fixture(params=sorted(BAD))
def planted(request, ref, tmp_path):
    """A copy of the build whose train manifest's first shard name is replaced by a bad one
    (the manifest otherwise intact, the named files present)."""
    out = tmp_path / "build" / "shards"
    shutil.copytree(ref, out)
    name, target = BAD[request.param](out)
    m = json.loads((out / "train" / "manifest.json").read_text())
    _copy_shard(out / "train", m["shards"][0]["name"], target)
    assert (out / "train" / f"{name}.tokens.bin").resolve() == Path(f"{target}.tokens.bin").resolve()
    m["shards"][0]["name"] = name
    (out / "train" / "manifest.json").write_bytes(mf.dumps(m))
    return out, name


def _refused_line(err: str, out: Path, name: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert str(out / "train" / "manifest.json") in line and "shards[0].name" in line and repr(name) in line, line
    return line


def test_the_unplanted_build_passes_every_entry_point(ref, tok_dir, capsys):
    """Control: the same commands on the intact build succeed."""
    assert len(PackedMemmapDataset(ref / "train")) > 0
    assert stacklm_main(["verify", str(ref), "--no-progress"]) == 0
    assert stacklm_main(["inspect", str(ref), "--tokenizer", str(tok_dir)]) == 0
    assert stacklm_main(["inspect", str(ref), "--row", "0", "--json"]) == 0
    assert stacklm_main(["ledger", str(ref), "--json"]) == 0
    capsys.readouterr()


def test_the_loader_refuses_a_name_that_leaves_the_split(planted):
    out, name = planted
    with pytest.raises(DataError) as e:
        PackedMemmapDataset(out / "train")
    _refused_line(str(e.value), out, name)


@pytest.mark.parametrize("argv", [
    ["verify", "{out}", "--no-progress"],
    ["verify", "{out}/train", "--no-progress"],
    ["inspect", "{out}", "--tokenizer", "{tok}"],
    ["inspect", "{out}", "--row", "0"],
    ["ledger", "{out}"],
    ["ledger", "{out}/train"],
], ids=lambda a: " ".join(a[:1] + a[2:]).replace("{tok}", "TOK"))
def test_every_command_refuses_it_in_one_line(planted, tok_dir, capsys, argv):
    out, name = planted
    capsys.readouterr()
    assert stacklm_main([a.format(out=out, tok=tok_dir) for a in argv]) == 2
    captured = capsys.readouterr()
    _refused_line(captured.err, out, name)
    assert "[train]: OK" not in captured.out


@pytest.mark.parametrize("field,value", [("key", "../train"), ("path", "../../elsewhere"), ("path", "/abs/train")])
def test_a_split_name_or_path_that_leaves_the_build_is_refused(ref, tmp_path, capsys, field, value):
    """The top manifest's split names and paths are joined to OUT the same way."""
    out = tmp_path / "shards"
    shutil.copytree(ref, out)
    m = json.loads((out / "manifest.json").read_text())
    if field == "key":
        m["splits"][value] = m["splits"].pop("train")
    else:
        m["splits"]["train"]["path"] = value
    (out / "manifest.json").write_bytes(mf.dumps(m))
    for argv in (["verify", str(out), "--no-progress"], ["ledger", str(out)], ["inspect", str(out), "--row", "0"]):
        assert stacklm_main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and str(out / "manifest.json") in lines[0] and repr(value) in lines[0], (argv, err)
        assert "'splits" in lines[0], lines[0]


@pytest.mark.parametrize("name", ["", ".", "..", "x\\y", "x\0y", 7, None])
def test_other_non_names(name):
    with pytest.raises(DataError, match=r"field 'shards\[1\]\.name' is .*not a plain shard file name"):
        mf.check_names({"shards": [{"name": "shard_00000"}, {"name": name}]}, Path("/d/train/manifest.json"))
    assert mf.is_plain_name("shard_00000") and mf.is_plain_name("shard..x")
