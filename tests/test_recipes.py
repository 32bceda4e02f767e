"""docs/recipes.md, run as written: every block tagged ``recipe=<letter>`` is extracted from the
markdown and run in order in one working directory, on local files, without network.

The only changes are to sizes (vocabulary, budget, seq_len, model width, steps, worker counts)
and, for recipe c, the hub id swapped for the same ``kind: hf`` entry over a local parquet
file (``datasets``' parquet builder: the code path a hub id takes, minus the download). Every
change is listed below and must match the markdown exactly (a YAML key that exists, a text that
occurs), so the docs cannot drift from what works: a renamed flag or key fails here.

Recipes share the directory recipe a leaves (tok/, shards/, my.yaml, ckpt/), built once by the
``workdir`` fixture; the tests run in the docs' order (e, the resume, before f and g, which
run new fits)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from stacklm.data.contract import BATCH_KEYS, LEAN_KEYS, full_batch

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "recipes.md"
BLOCK = re.compile(r"^```(\w+) recipe=(\w)(?: file=(\S+))?\n(.*?)^```$", re.MULTILINE | re.DOTALL)

# Text substitutions on bash/python blocks: (old, new), each must occur in the recipe's blocks.
TEXT: dict[str, list[tuple[str, str]]] = {
    "a": [("--vocab-size 32768", "--vocab-size 512")],
    "b": [],
    "c": [],
    "d": [("seq_len=1024", "seq_len=64"), ("batch_size=8", "batch_size=4"), ("max_steps=1000", "max_steps=2"),
          ("width: int = 256", "width: int = 32"), ("num_workers=2", "num_workers=1")],
    "e": [("--trainer.max_steps 4000", "--trainer.max_steps 6"), ("--step 3999", "--step 5")],
    "f": [],
    "g": [("--seq-len 1024", "--seq-len 64"), ("--trainer.max_steps 500", "--trainer.max_steps 2")],
    "h": [("seq_len=1024", "seq_len=64"), ("batch_size=8", "batch_size=4")],
    "i": [],
    "j": [],
}
# YAML values set in the recipes' files: {file: {dotted.key: value}}; every key must exist.
TINY_MODEL = {"model.config.vocab_size": 512, "model.config.seq_len": 64, "model.config.n_layer": 1,
              "model.config.n_head": 2, "model.config.d_model": 32, "model.optim.warmup_steps": 1}
YAML: dict[str, dict[str, Any]] = {
    "my.yaml": {"data.seq_len": 64, "data.batch_size": 4, "data.num_workers": 1,
                "data.pipeline.holdout_fraction": 0.1, "data.pipeline.mix.total_tokens": 20_000, **TINY_MODEL,
                "trainer.max_steps": 4, "trainer.val_check_interval": 2, "trainer.limit_val_batches": 1,
                "trainer.log_every_n_steps": 1, "trainer.callbacks.0.init_args.log_every_n_steps": 1,
                "trainer.callbacks.1.init_args.every_n_train_steps": 2},
    "mix.yaml": {"data.seq_len": 64, "data.batch_size": 4, "data.pipeline.holdout_fraction": 0.1,
                 "data.pipeline.mix.total_tokens": 20_000},
    "stream.yaml": {"data.seq_len": 64, "data.batch_size": 4, "data.num_workers": 1,
                    "data.pipeline.holdout_fraction": 0.1, "data.pipeline.shuffle_buffer": 50,
                    "data.pipeline.mix.total_tokens": 20_000,
                    # no network: the hub id becomes datasets' parquet builder over a local file
                    "data.pipeline.mix.entries.0": {"name": "fineweb", "kind": "hf", "path": "parquet",
                                                    "data_files": ["hub/fineweb.parquet"], "weight": 1.0,
                                                    "domain": "prose"},
                    "trainer.callbacks.0.init_args.log_every_n_steps": 1,
                    "trainer.callbacks.1.init_args.every_n_train_steps": 2},
    "clean.yaml": {"data.seq_len": 64, "data.batch_size": 4, "data.pipeline.holdout_fraction": 0.1,
                   "data.pipeline.mix.total_tokens": 20_000},
    "stages.yaml": {"data.seq_len": 64, "data.batch_size": 4, "data.pipeline.holdout_fraction": 0.1,
                    "data.pipeline.mix.total_tokens": 10**6},  # more than the notes hold: every document is read
    "sft.yaml": {"data.seq_len": 64, "data.batch_size": 4, "data.pipeline.shuffle_buffer": 50,
                 "data.pipeline.pack_buffer_docs": 8, "data.pipeline.holdout_fraction": 0.1},
}


def blocks(recipe: str) -> list[tuple[str, str | None, str]]:
    """(language, file name or None, text) of the recipe's tagged blocks, in document order."""
    found = [(lang, name or None, text) for lang, r, name, text in BLOCK.findall(DOC.read_text()) if r == recipe]
    assert found, f"docs/recipes.md has no block tagged recipe={recipe}"
    return found


def set_key(data: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        data = data[int(part)] if isinstance(data, list) else data[part]
    if isinstance(data, list):
        assert int(last) < len(data), dotted
        data[int(last)] = value
    else:
        assert last in data, f"docs/recipes.md: {dotted} is not in the recipe's YAML (the test shrinks it)"
        data[last] = value


def shrink_text(recipe: str, text: str, used: set[str]) -> str:
    for old, new in TEXT[recipe]:
        if old in text:
            used.add(old)
            text = text.replace(old, new)
    return text


def env(workdir: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(workdir),
            "HF_DATASETS_CACHE": str(workdir / ".hf-cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "NNODES": "1", "NPROC_PER_NODE": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}


def free_port() -> int:
    """A port nothing listens on (recipe f's torchrun; a fixed 29500 would collide with other DDP tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(workdir: Path, script: str, timeout: int = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env(workdir),
                         capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{script}\n--- exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def run_recipe(recipe: str, workdir: Path, between=None, skip_files: tuple[str, ...] = ()) -> list[str]:
    """Write the recipe's files and run its bash blocks in order; ``between(i)`` runs before bash
    block ``i``. Returns each bash block's stdout."""
    used: set[str] = set()
    outputs = []
    for lang, name, text in blocks(recipe):
        if name is not None:
            if name.endswith((".yaml", ".yml")):
                data = yaml.safe_load(text)
                for key, value in YAML.get(name, {}).items():
                    set_key(data, key, value)
                (workdir / name).write_text(yaml.safe_dump(data, sort_keys=False))
            else:
                (workdir / name).write_text(shrink_text(recipe, text, used))
        elif lang == "bash" and name not in skip_files:
            if between is not None:
                between(len(outputs))
            outputs.append(sh(workdir, shrink_text(recipe, text, used)))
    assert used == {old for old, _ in TEXT[recipe]}, f"substitutions not found in recipe {recipe}: " \
        f"{ {old for old, _ in TEXT[recipe]} - used }"
    return outputs


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_parquet(path: Path, column: str, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: texts}), path)


@pytest.fixture(scope="module")
def docs(real_docs) -> list[str]:
    """~1,500 documents of 200-1,000 characters cut from the real-text fixture."""
    return [p for d in real_docs for p in (d[i:i + 1000] for i in range(0, len(d), 1000)) if len(p.strip()) >= 200]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, docs) -> Path:
    """Recipe a, run once: 240 .txt documents -> tok/ -> shards/ -> a 4-step fit with checkpoints."""
    work = tmp_path_factory.mktemp("recipes")
    (work / "data").mkdir()
    for i, text in enumerate(docs[:240]):
        (work / "data" / f"doc{i:03d}.txt").write_text(text)
    run_recipe("a", work)
    return work


def sources(manifest: Path) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads(manifest.read_text())["sources"]}


def ckpt_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


@pytest.mark.slow
def test_recipe_a_text_files_to_tokenizer_shards_and_fit(workdir):
    from stacklm.tokenizer.bpe import StackTokenizer

    tok = StackTokenizer.load(workdir / "tok" / "tokenizer.stacklm.json")
    assert tok.vocab_size == 512
    manifest = json.loads((workdir / "shards" / "train" / "manifest.json").read_text())
    (source,) = manifest["sources"]
    assert manifest["seq_len"] == 64 and source["name"] == "mine" and source["path"] == "data/*.txt"
    assert source["tokens"] == 20_000 and source["docs"] > 0  # the shrunk budget, filled from data/*.txt
    assert manifest["warnings"] == []
    assert manifest["n_seq"] == sum(s["n_seq"] for s in manifest["shards"]) and manifest["n_seq"] * 64 >= 20_000
    assert ckpt_step(workdir / "ckpt" / "last.ckpt") == 4


@pytest.mark.slow
def test_recipe_b_mix_of_local_files_and_datasets_builders(workdir, docs):
    pool = docs[240:640]
    write_jsonl(workdir / "notes" / "a.jsonl", [{"body": t} for t in pool[0:100]])
    write_parquet(workdir / "code" / "a.parquet", "content", pool[100:200])
    write_jsonl(workdir / "papers" / "a.jsonl", [{"text": t} for t in pool[200:300]])
    write_parquet(workdir / "wiki" / "a.parquet", "text", pool[300:400])
    (printed,) = (p.stdout for p in run_recipe("b", workdir))
    mix = sources(workdir / "mix_shards" / "train" / "manifest.json")
    table, listing = printed.split("\n[", 1)  # prebuild's summary table, then the recipe's JSON print
    assert table.startswith("prebuild summary: mix_shards") and all(name in table for name in mix)
    assert {s["name"]: s for s in json.loads("[" + listing)} == mix
    assert set(mix) == {"notes", "code", "papers", "wiki"}
    total = sum(s["tokens"] for s in mix.values())
    assert total == 20_000
    for name, weight in {"notes": 0.3, "code": 0.2, "papers": 0.2, "wiki": 0.3}.items():
        assert mix[name]["docs"] > 0
        assert mix[name]["tokens"] / total == pytest.approx(weight, abs=0.05), (name, mix[name])


@pytest.mark.slow
def test_recipe_c_stream_from_a_datasets_source(workdir, docs):
    write_parquet(workdir / "hub" / "fineweb.parquet", "text", docs[640:940])
    run_recipe("c", workdir)
    ckpt = torch.load(workdir / "ckpt_stream" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4  # my.yaml's max_steps, stream.yaml's data
    data = ckpt["datamodule_hyper_parameters"]
    assert data["mode"] == "stream" and data["pipeline"]["mix"]["entries"][0]["data_files"] == ["hub/fineweb.parquet"]
    assert ckpt["StackDataModule"]["mode"] == "stream" and ckpt["StackDataModule"]["shape"]["num_workers"] == 1


@pytest.mark.slow
def test_recipe_d_own_lightning_module(workdir):
    (out,) = run_recipe("d", workdir)
    assert "trained 2 steps" in out.stdout


@pytest.mark.slow
def test_recipe_e_resume_with_ckpt_path(workdir):
    assert ckpt_step(workdir / "ckpt" / "last.ckpt") == 4
    out, step = run_recipe("e", workdir)
    assert "Restored all states from the checkpoint" in out.stdout + out.stderr  # resumed, not restarted
    ckpt = torch.load(workdir / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 6
    assert ckpt["StackDataModule"]["position"] == {"epoch": 0, "rows_served": 24, "steps": 6}  # 6 steps x 4 rows
    # step 5 (the resumed fit's second) from the step log: its 4 rows, each a prebuilt row with its pieces
    assert "step 5 (shards mode" in step.stdout and "4 rows, 0 padding rows" in step.stdout
    assert step.stdout.count("= prebuilt row ") == 4 and "record" in step.stdout


@pytest.mark.slow
def test_recipe_f_torchrun_slurm_command_and_datatrove(workdir):
    _, sbatch, _ = blocks("f")
    assert sbatch[1] == "train.sbatch"
    srun = next(line for line in sbatch[2].splitlines() if line.startswith("srun "))
    # Slurm itself is not here: the command srun runs must parse with the sbatch script's values.
    printed = sh(workdir, srun.removeprefix("srun ") + " --print_config").stdout
    assert yaml.safe_load(printed)["trainer"]["num_nodes"] == 4
    run_recipe("f", workdir)
    # torchrun: two CPU ranks (gloo) of a 4-step fit, NNODES=1 NPROC_PER_NODE=2 from the environment;
    # a new run into recipe a's ckpt/ gets Lightning's -v1 names (the docs say so)
    ckpt = torch.load(workdir / "ckpt" / "last-v1.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4 and ckpt["StackDataModule"]["shape"]["world_size"] == 2
    assert ckpt["StackDataModule"]["position"]["rows_served"] == 4 * 4 * 2  # steps x batch x ranks
    dt = json.loads((workdir / "shards_dt" / "train" / "manifest.json").read_text())
    assert dt["sources"][0]["name"] == "mine" and dt["sources"][0]["tokens"] == 20_000 and dt["warnings"] == []


@pytest.mark.slow
def test_recipe_g_sft_on_your_conversations(workdir):
    def more_conversations(i: int) -> None:
        if i == 1:  # the block wrote two conversations; a 2-step fit with a val split needs a few more
            rows = [{"messages": [{"role": "user", "content": f"What is {n} + {n}?"},
                                  {"role": "assistant", "content": f"{n} + {n} = {2 * n}."}]} for n in range(60)]
            with open(workdir / "chats.jsonl", "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))

    pre = torch.load(workdir / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    inspected, fit, pairs = run_recipe("g", workdir, between=more_conversations)
    assert "chats.jsonl (conversations, 2 sequences)" in inspected.stdout  # the block's own two, before the fit
    assert "<|assistant|>4.<|end|><|eos|>" in inspected.stdout and "of 2 conversations -- kept: 2" in inspected.stdout
    # pre-training -> SFT: started from recipe a's weights, as a new run (steps from 0)
    assert "model.init_from: " in fit.stdout and f"that run's step {pre['global_step']}" in fit.stdout
    ckpt = torch.load(workdir / "ckpt_sft" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2 and ckpt["StackDataModule"]["mode"] == "sft"
    assert ckpt["hyper_parameters"]["init_from"] == "ckpt/last.ckpt"
    # -> preference data: both sides of both pairs, the completions trained
    assert "pairs.jsonl (preference pairs (chosen and rejected sides), 4 sequences)" in pairs.stdout
    assert ckpt["datamodule_hyper_parameters"]["pipeline"]["sources"][0]["path"] == ["chats.jsonl"]


@pytest.mark.slow
def test_recipe_h_inspect_shards_and_a_saved_batch(workdir):
    shards, saved = run_recipe("h", workdir)
    assert "shards/train (shards, 4 sequences)" in shards.stdout and "shards/val (shards, " in shards.stdout
    assert shards.stdout.count("0 error(s)") == 2
    findings = json.loads((workdir / "val_findings.json").read_text())
    val_rows = json.loads((workdir / "shards" / "val" / "manifest.json").read_text())["n_seq"]
    assert findings["kind"] == "shards" and findings["input"] == "shards/val"
    assert findings["sequences"] == min(64, val_rows) and findings["errors"] == 0  # --limit's default: 64 rows
    batch = torch.load(workdir / "batch.pt", weights_only=True)  # the loader's lean planes; inspect derives the four
    assert set(batch) == set(LEAN_KEYS) and batch["input_ids"].shape == (4, 63)
    assert set(full_batch(batch)) >= set(BATCH_KEYS)
    assert "batch.pt" in saved.stdout and "4 sequences" in saved.stdout and "0 error(s)" in saved.stdout


@pytest.mark.slow
def test_recipe_i_decontaminate_against_an_evaluation_set(workdir, docs, monkeypatch):
    from stacklm.data.quality.filters import FilterConfig, filter_reason
    from stacklm.data.quality.holdout import holdout_split
    from stacklm.data.quality.ngrams import words_of

    monkeypatch.setenv("STACKLM_CACHE_DIR", str(workdir / "cache"))
    pool = docs[240:340]
    write_jsonl(workdir / "notes" / "a.jsonl", [{"body": t} for t in pool])  # as recipe b writes it
    # five early training documents (read within the shrunk budget) become evaluation records
    leaked = [t for t in pool[:30] if filter_reason({"text": t}, FilterConfig(), "prose") is None
              and holdout_split(t, 0.1, 0) == "train"][:5]
    assert len(leaked) == 5
    write_jsonl(workdir / "eval" / "my_eval.jsonl", [{"question": t[: len(t) // 2], "answer": t[len(t) // 2:]} for t in leaked])
    (printed,) = run_recipe("i", workdir)
    top = json.loads((workdir / "clean_shards" / "manifest.json").read_text())
    report = top["decontamination"]["train"]["sets"]["my_eval"]
    # the five copies, and any other document that shares 13 words with them (real text repeats phrases)
    assert report["docs"] >= 5 and top["drops"]["train"]["notes"]["decontaminated"] == report["docs"]
    assert report["examples"] and all(ex["ngram"] in " ".join(words_of(" ".join(leaked))) for ex in report["examples"])
    assert "dropped decontam/my_eval" in printed.stdout and "my_eval" in printed.stdout and "e.g. notes" in printed.stdout
    assert len(list((workdir / "cache" / "decontam").iterdir())) == 1


@pytest.mark.slow
def test_recipe_j_user_stages_and_datatroves_filters(workdir, docs):
    """Recipe j's drops, stage by stage, against the recipe's own functions and datatrove's
    filters called here on the notes file's training documents."""
    from datatrove.data import Document
    from datatrove.pipeline.filters import FineWebQualityFilter, GopherRepetitionFilter

    from stacklm.data.quality.filters import FilterConfig, filter_reason
    from stacklm.data.quality.holdout import holdout_split

    pool = docs[340:440]
    rows = pool[8:] + [t.upper() for t in pool[:8]]  # eight documents in capitals, for no_shouting
    write_jsonl(workdir / "notes" / "a.jsonl", [{"body": t} for t in rows])  # where recipe b writes it
    (printed,) = run_recipe("j", workdir)
    mine: dict[str, Any] = {}
    exec(next(t for _, name, t in blocks("j") if name == "my_stages.py"), mine)
    gopher, fineweb = GopherRepetitionFilter(), FineWebQualityFilter(line_punct_thr=0.12)
    want: dict[str, int] = {}
    for t in rows:
        if holdout_split(t, 0.1, 0) != "train" or filter_reason({"text": t}, FilterConfig(), "prose") is not None:
            continue
        for stage, verdict in (("no_shouting", lambda: mine["no_shouting"]({"text": t}, max_upper=0.3)),
                               ("gopher_repetition_filter", lambda: gopher.filter(Document(text=t, id=""))),
                               ("fineweb", lambda: fineweb.filter(Document(text=t, id="")))):
            v = verdict()
            if v is not True:
                key = f"{stage}/{v if isinstance(v, str) else v[1]}"
                want[key] = want.get(key, 0) + 1
                break
    assert want.get("no_shouting/shouting", 0) >= 1 and any(k.startswith("fineweb/") for k in want)
    top = json.loads((workdir / "staged_shards" / "manifest.json").read_text())
    dropped = top["ledger"]["train"]["sources"]["notes"]["docs"]["dropped"]
    assert {k: n for k, n in dropped.items() if k.split("/")[0] in ("no_shouting", "gopher_repetition_filter", "fineweb")} == want
    assert top["ledger"]["train"]["ok"] and "dropped no_shouting/shouting" in printed.stdout
    assert "identities: OK" in printed.stdout and "FAIL" not in printed.stdout


def test_every_recipe_is_tagged_and_its_configs_and_shrinks_are_valid(tmp_path, monkeypatch):
    """Fast (not slow): the drift guard without running anything. Every recipe a-j has blocks;
    every shrink still matches the markdown; every config's ``data:`` section is accepted by
    ``StackDataModule`` (an unknown key under ``data.pipeline`` is refused at construction) and its
    user stages import and build where they run (``check_stages_run``: the recipes' Python files
    are put on the path, as the recipe's ``export PYTHONPATH`` does); the SFT recipe keeps the packaged ``sft.yaml``'s pipeline settings."""
    from stacklm.configs import resolve_config
    from stacklm.datamodule import StackDataModule

    monkeypatch.syspath_prepend(str(tmp_path))
    for recipe in "abcdefghij":
        found = blocks(recipe)
        for _, name, body in found:
            if name is not None and name.endswith(".py"):
                (tmp_path / name).write_text(body)
        text = "\n".join(t for _, name, t in found if name is None or not name.endswith(".yaml"))
        missing = [old for old, _ in TEXT[recipe] if old not in text]
        assert not missing, f"recipe {recipe}: the test's substitutions {missing} no longer match docs/recipes.md"
        for _, name, body in found:
            if name is not None and name.endswith(".yaml"):
                config = yaml.safe_load(body)
                for key, value in YAML.get(name, {}).items():
                    set_key(config, key, value)  # asserts the key exists
                dm = StackDataModule(**yaml.safe_load(body)["data"])
                assert dm.mode == config["data"]["mode"]
                if getattr(dm.config.pipeline, "stages", None):  # a shards-mode module does not import them itself
                    dm.config.pipeline.check_stages_run()
    sft = yaml.safe_load(next(t for _, name, t in blocks("g") if name == "sft.yaml"))["data"]
    packaged = yaml.safe_load(resolve_config("sft").read_text())["data"]
    assert sft["mode"] == packaged["mode"] == "sft"
    assert {k: v for k, v in sft["pipeline"].items() if k != "sources"} == \
        {k: v for k, v in packaged["pipeline"].items() if k != "sources"}
