"""Real-text conversations and JSON-lines writing, shared by the SFT, preference, inspector and datamodule tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stacklm.corpus import iter_code, iter_prose


def make_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Real-text conversations: stdlib docstrings as questions/answers, code as answers,
    optional system prompts and tool round-trips; lengths from a few tokens to > SEQ."""
    rng = np.random.default_rng(seed)
    prose = [p.strip() for d in iter_prose(300_000) for p in d.split("\n\n") if 20 <= len(p.strip()) <= 900]
    code = [d[:600] for d in iter_code(200_000) if len(d) > 100]
    convs = []
    for _ in range(n):
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": "You are a concise Python expert."})
        for _ in range(int(rng.integers(1, 4))):
            msgs.append({"role": "user", "content": prose[int(rng.integers(len(prose)))][: int(rng.integers(20, 300))]})
            if rng.random() < 0.2:
                msgs.append({"role": "tool_call", "content": json.dumps({"name": "search", "arguments": {"q": "x"}})})
                msgs.append({"role": "tool_result", "content": prose[int(rng.integers(len(prose)))][:120]})
            pool = code if rng.random() < 0.3 else prose
            msgs.append({"role": "assistant", "content": pool[int(rng.integers(len(pool)))][: int(rng.integers(10, 500))]})
        convs.append(msgs)
    return convs


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


def make_pairs(n: int, seed: int = 0) -> list[dict]:
    """Real-text pairs in the three formats, in turn: explicit conversational, implicit
    (full conversations), plain strings. The prompt is a conversation up to its last user turn
    (tool round trips and earlier assistant turns included), the completions two replies."""
    rng = np.random.default_rng(seed)
    convs = [c for c in make_conversations(2 * n, seed) if c[-1]["role"] == "assistant"]
    replies = [c[-1]["content"] for c in convs]
    out = []
    for i, msgs in enumerate(convs[:n]):
        prompt, chosen = msgs[:-1], msgs[-1]
        rejected = {"role": "assistant", "content": replies[int(rng.integers(len(replies)))] + " (no)"}
        kind = i % 3
        if kind == 0:
            out.append({"prompt": prompt, "chosen": [chosen], "rejected": [rejected]})
        elif kind == 1:
            out.append({"chosen": prompt + [chosen], "rejected": prompt + [rejected]})
        else:
            user = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
            out.append({"prompt": user, "chosen": chosen["content"], "rejected": rejected["content"]})
    return out
