"""``stacklm inspect PAIRS.jsonl``: a preference file (TRL standard or conversational, with or
without an explicit prompt) is read as pairs, each side rendered as the preference pipes render
it (``render_pair``: prompt without loss, stop token trained) and run through the SFT checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stacklm.data.sft.preference import read_pair, render_pair
from stacklm.inspector import inspect_input
from tests.helpers.cli import run

PROMPT = "What is the capital of France?"
STANDARD = [{"prompt": PROMPT, "chosen": "Paris is the capital.", "rejected": "Berlin, I think."},
            {"prompt": "Name a prime number.", "chosen": "Seven.", "rejected": "Nine."}]
CONVERSATIONAL_EXPLICIT = [{"prompt": [{"role": "user", "content": PROMPT}],
                            "chosen": [{"role": "assistant", "content": "Paris is the capital."}],
                            "rejected": [{"role": "assistant", "content": "Berlin, I think."}]}]
CONVERSATIONAL_IMPLICIT = [{"chosen": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Paris is the capital."}],
                            "rejected": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Berlin, I think."}]}]
FORMATS = {"standard": STANDARD, "conversational": CONVERSATIONAL_EXPLICIT, "implicit prompt": CONVERSATIONAL_IMPLICIT}


@pytest.fixture(scope="module")
def dirs(tokenizer_1024, saved_tokenizer_dir):
    return {"ours": saved_tokenizer_dir(tokenizer_1024), "hf": saved_tokenizer_dir(tokenizer_1024, "hf")}


def write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("which", ["ours", "hf"])
def test_each_trl_format_is_read_as_pairs(fmt, which, tmp_path, dirs, tokenizer_1024):
    rows = FORMATS[fmt]
    report = inspect_input(write(tmp_path, rows), dirs[which], prefer_hf=which == "hf")
    assert report.kind.startswith("preference pairs") and not report.errors, [f.message for f in report.findings]
    assert report.sequences == 2 * len(rows)
    # the loss is the pipeline's: an independent render_pair of the same records
    stops = {tokenizer_1024.token_id("<|end|>"), tokenizer_1024.eos_id}
    expected_trained = expected_stops = 0
    for r in rows:
        prompt, chosen, rejected = read_pair(r).turns()
        pair, _, _ = render_pair(prompt, chosen, rejected, tokenizer_1024)
        for ids, mask in (pair.chosen, pair.rejected):
            expected_trained += int(mask.sum())
            expected_stops += sum(int(i) in stops for i in ids[mask.astype(bool)].tolist())
            assert not mask[: pair.n_prompt].any()
    assert report.trained_tokens == expected_trained
    assert report.trained_stop_tokens == expected_stops >= 2 * len(rows)  # each side's stop token is trained
    # the sample is the first chosen side: no loss on the prompt, loss on the reply
    text = tokenizer_1024.decode(report.sample.ids.tolist())
    assert PROMPT in text and "Paris is the capital." in text
    trained = tokenizer_1024.decode(np.asarray(report.sample.ids)[np.asarray(report.sample.trained, bool)].tolist())
    assert "Paris is the capital." in trained and PROMPT not in trained


def test_cli_reports_pairs_and_overlong_outcomes(tmp_path, dirs):
    path = write(tmp_path, STANDARD + CONVERSATIONAL_EXPLICIT)
    code, out = run(path, "--tokenizer", dirs["ours"], "--seq-len", 14, "--overlong", "drop")
    assert code == 0, out
    assert "preference pairs" in out and "6 sequences" in out
    assert "of 3 pairs -- " in out and "dropped_too_long" in out
    code, out = run(path, "--tokenizer", dirs["ours"], "--json", "-")
    assert code == 0 and json.loads(out)["kind"].startswith("preference pairs")


def test_a_broken_pair_is_an_error_finding(tmp_path, dirs):
    rows = [STANDARD[0], {"prompt": "hi", "chosen": "same", "rejected": "same"}, {"chosen": "no prompt and no rejected"}]
    path = write(tmp_path, rows)
    code, out = run(path, "--tokenizer", dirs["ours"])
    assert code == 1, out
    assert "invalid_conversation" in out and "pairs.jsonl:2" in out and "identical_pair" in out
