"""A data directory holds data, and every reader checks a manifest the same way (issue 32, parts 4
and 6).

One small prebuilt set (the session's ``small_shards_dir``) is copied per case and changed the
way a user found it changed: a FIFO, a symlink to ``/dev/zero``, to a larger file or to
matching copies outside the directory under a shard's or manifest's name, and four kinds of
tampered manifest. Every reader (``stacklm verify``, ``stacklm inspect`` on the split, with
``--row`` and with ``--step`` of a run's step log, ``stacklm ledger``, and the shards-mode
loader through ``StackDataModule``) must refuse each case in one line naming the file and what
is wrong, and none may block: a FIFO opened before the check would wait forever, so every case
runs under a signal timeout. A symlink to a file inside the split directory is allowed, like
the untouched copy.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from stacklm.cli import main as stacklm_main
from stacklm.data.storage import manifest as mf
from stacklm.datamodule import StackDataModule
from stacklm.errors import DataError
from tests.helpers.datamodule import BATCH, SEQ_LEN

SHARD = "shard_00000"


def _fifo(name: str):
    def plant(out: Path) -> None:
        (out / "train" / name).unlink()
        os.mkfifo(out / "train" / name)
    return plant


def _link_tokens(target) -> callable:
    def plant(out: Path) -> None:
        tokens = out / "train" / f"{SHARD}.tokens.bin"
        to = target(out, tokens)
        tokens.unlink()
        os.symlink(to, tokens)
    return plant


def _larger_outside(out: Path, tokens: Path) -> Path:
    big = out.parent / "big.bin"
    big.write_bytes(tokens.read_bytes() * 3)
    return big


def _outside_copies(out: Path) -> None:
    """Each file of shard 0 moved out of the build and linked back: byte-identical, hashes match."""
    elsewhere = out.parent / "elsewhere"
    elsewhere.mkdir()
    for f in sorted((out / "train").glob(f"{SHARD}.*")):
        shutil.move(f, elsewhere / f.name)
        os.symlink(elsewhere / f.name, f)


def _inside_link(out: Path) -> None:
    store = out / "train" / "store"
    store.mkdir()
    tokens = out / "train" / f"{SHARD}.tokens.bin"
    shutil.move(tokens, store / tokens.name)
    os.symlink(f"store/{tokens.name}", tokens)


def _edit_manifest(change):
    def plant(out: Path) -> None:
        path = out / "train" / "manifest.json"
        m = json.loads(path.read_text())
        change(m)
        path.write_bytes(mf.dumps(m))
    return plant


def _swap_names(m: dict) -> None:
    m["shards"][0]["name"], m["shards"][1]["name"] = m["shards"][1]["name"], m["shards"][0]["name"]


def _truncate_manifest(out: Path) -> None:
    path = out / "train" / "manifest.json"
    path.write_bytes(path.read_bytes()[:300])


# case -> (how the copy is changed, what the one line must say; None: every reader accepts it)
CASES = {
    "untouched": (lambda out: None, None),
    "symlink inside the split": (_inside_link, None),
    "FIFO as tokens": (_fifo(f"{SHARD}.tokens.bin"), f"{SHARD}.tokens.bin is a FIFO (named pipe), not a regular file"),
    "FIFO as provenance": (_fifo(f"{SHARD}.prov.npz"), f"{SHARD}.prov.npz is a FIFO (named pipe), not a regular file"),
    "FIFO as manifest": (_fifo("manifest.json"), "train/manifest.json is a FIFO (named pipe), not a regular file"),
    "symlink to /dev/zero": (_link_tokens(lambda out, t: "/dev/zero"), f"{SHARD}.tokens.bin is a symlink to /dev/zero, outside"),
    "symlink to a larger file outside": (_link_tokens(_larger_outside), "big.bin, outside"),
    "symlinks to matching copies outside": (_outside_copies, f"elsewhere/{SHARD}.tokens.bin, outside"),
    "shard size changed": (_edit_manifest(lambda m: m["shards"][0].__setitem__("n_seq", m["shards"][0]["n_seq"] - 1)),
                           f"{SHARD}.meta.bin says n_seq="),
    "token count changed": (_edit_manifest(lambda m: m.__setitem__("n_seq", m["n_seq"] + 1)), "field 'n_seq' = "),
    "n_tokens changed": (_edit_manifest(lambda m: m.__setitem__("n_tokens", m["n_tokens"] + 64)), "field 'n_tokens' = "),
    "shard names swapped": (_edit_manifest(_swap_names), "but the manifest lists"),
    "shard missing from the list": (_edit_manifest(lambda m: m["shards"].pop()), "but its shards hold"),
    "field of the wrong type": (_edit_manifest(lambda m: m["shards"][0].__setitem__("n_seq", "64")),
                                "field 'shards[0].n_seq' is '64', not an integer"),
    "seq_len of the wrong type": (_edit_manifest(lambda m: m.__setitem__("seq_len", "sixty-four")),
                                  "field 'seq_len' is 'sixty-four', not an integer"),
    "truncated manifest": (_truncate_manifest, "train/manifest.json is not readable JSON"),
}


@pytest.fixture(scope="module")
def run_log(small_shards_dir, tokenizer_dir, tmp_path_factory):
    """A step log of two shards-mode batches, written by the real datamodule over a copy of the set."""
    base = tmp_path_factory.mktemp("run")
    shutil.copytree(small_shards_dir, base / "shards")
    dm = _shards_dm(base / "shards", tokenizer_dir, step_log=str(base / "steplog"))
    batches = iter(dm.train_dataloader())
    next(batches), next(batches)
    dm.teardown("fit")
    return base / "steplog"


def _shards_dm(data_dir: Path, tokenizer_dir, **kw) -> StackDataModule:
    dm = StackDataModule(mode="shards", data_dir=str(data_dir), tokenizer=str(tokenizer_dir), seq_len=SEQ_LEN,
                         batch_size=BATCH, num_workers=0, **kw)
    dm.setup("fit")
    return dm


def _copy_log(log: Path, dest: Path, data_dir: Path) -> Path:
    """The run's step log, pointed at ``data_dir`` (the run read its own copy of the set)."""
    shutil.copytree(log, dest)
    meta_path = next(dest.glob("*/meta.json"))
    meta = json.loads(meta_path.read_text())
    meta["shards"]["data_dir"] = str(data_dir)
    meta_path.write_text(json.dumps(meta))
    return dest


SURFACES = {
    "verify": ["verify", "{out}", "--no-progress"],
    "inspect": ["inspect", "{out}", "--tokenizer", "{tok}", "--json", "-"],
    "inspect --row": ["inspect", "{out}", "--row", "0", "--json"],
    "inspect --step": ["inspect", "{log}", "--step", "0", "--json"],
    "ledger": ["ledger", "{out}"],
}


@pytest.mark.timeout(60, method="signal")  # a reader that opens a FIFO blocks: the timeout fails the case instead
@pytest.mark.parametrize("case", list(CASES))
def test_every_reader_refuses_what_is_not_the_builds_data_in_one_line(case, small_shards_dir, tokenizer_dir, run_log,
                                                                      tmp_path, capsys):
    out = tmp_path / "shards"
    shutil.copytree(small_shards_dir, out)
    log = _copy_log(run_log, tmp_path / "steplog", out)
    plant, says = CASES[case]
    plant(out)
    capsys.readouterr()
    table = {}
    for surface, argv in SURFACES.items():
        code = stacklm_main([a.format(out=out, tok=tokenizer_dir, log=log) for a in argv])
        captured = capsys.readouterr()
        table[surface] = (code, [ln for ln in captured.err.splitlines() if ln.strip()], captured.out)
    try:
        _shards_dm(out, tokenizer_dir, step_log=False).train_dataloader()
        table["loader"] = (0, [], "")
    except DataError as e:
        table["loader"] = (2, str(e).splitlines(), "")
    if says is None:
        assert {s: code for s, (code, _, _) in table.items()} == dict.fromkeys(table, 0), table
        assert "identities: OK" in table["ledger"][2] and "[train]: OK" in table["verify"][2]
        return
    wrong = {s: (code, lines) for s, (code, lines, stdout) in table.items()
             if code != 2 or len(lines) != 1 or says not in lines[0] or "Traceback" in "".join(lines) or ": OK" in stdout}
    assert wrong == {}, f"{case}: each reader must refuse in one line saying {says!r}"
