"""Preference (DPO) data: ``chosen``/``rejected`` pairs that share a prompt, rendered by the chat
renderer, batched with each pair together, resumable and split across ranks like SFT.

Record formats (TRL's preference formats; ``read_pair``):

* conversational, explicit prompt -- ``{"prompt": [messages], "chosen": [messages],
  "rejected": [messages]}``: the completions are the messages after the prompt (usually one
  assistant message; tool calls, reasoning and weights as in ``stacklm.chat.formats``);
* conversational, implicit prompt -- ``{"chosen": [conversation], "rejected": [conversation]}``:
  the prompt is the longest common message prefix of the two (TRL's ``extract_prompt``); a
  string ``prompt`` next to conversational pairs is ignored, as TRL's ``maybe_extract_prompt``
  ignores it;
* plain -- ``{"prompt": str, "chosen": str, "rejected": str}``: a user turn and an assistant
  turn, exactly as a plain prompt/completion SFT record is read, so the text goes through the
  chat layout (and the untrusted-content rule) like every other conversation.

``tools`` (a list or a JSON string) and ``system`` work as in ``chat.formats``. A record that
cannot be a pair raises ``ChatFormatError`` with a reason the pipes count: the chat reasons,
``no_shared_prompt`` (implicit conversations that differ from their first message),
``empty_completion`` (one side is the prompt itself) and ``identical_pair`` (chosen ==
rejected: no preference, no gradient).

Rendering (``render_pair``): each side is the whole conversation ``prompt + completion``
rendered by ``stacklm.chat.assemble`` with the source's ``LossPolicy`` over the completion;
the prompt -- ``<|bos|>``, the prompt turns and the generation prompt ``<|assistant|>`` -- is
never trained, whatever the policy says about assistant turns inside it. So the loss covers
what a sampler would produce after the prompt: the completion text, its ``<|end|>`` and the
final ``<|eos|>`` (the stop token is trained unless ``train_stop_token`` is false). These are
exactly the ids TRL's ``DPOTrainer`` gets from the exported chat template (``to_trl``; the test
runs TRL's own tokenization).

Overlong pairs (the longer side over ``seq_len``), by ``chat.policy.OVERLONG_RULES``, all
counted: ``truncate`` cuts each side's completion after its last trained turn that fits (never
inside a turn, so the stop token stays); ``keep_end`` cuts the shared prompt's earliest turns
after its system turn(s), starting the kept prompt at a user turn; ``drop`` drops the pair; a
pair the rule cannot fit is dropped (``dropped_too_long``).

Batches (``collate_preference``, key order ``PREFERENCE_KEYS``): for each side ``chosen_*`` and
``rejected_*`` -- ``input_ids``, ``position_ids``, ``seq_ids``, ``targets`` -- ``(B, seq_len - 1)``
long tensors, one pair per row index, each side laid out as ``collate_sft`` lays out a window
(the side, then padding, less the last token; padding is its own segment, ``seq_ids`` 1,
positions restarting at 0, targets ``-100``); ``pair_ids`` ``(B,)``,
a stable 63-bit id of each pair from its source location (``-1`` on a filler row of the last,
short batch). ``preference_sides`` splits a batch into two batch-contract dicts.

The graph (``stacklm.data.sft.preference_pipeline.build_preference_pipeline``) mirrors SFT's,
on the same ``SFTConfig``:
``PreferenceSource`` -> [holdout by the prompt's text, so a prompt's pairs are never split
between train and val] -> ``PairRenderNode`` -> [weighted interleave] -> ``ShuffleNode`` ->
``PairBatchNode``. A rendered pair travels as one loss-tagged int32 array (chosen then rejected,
``render.tag_loss``), so the shuffle buffer keeps its compact state; every node has exact
``reset``/``next``/``get_state`` state. Rank and worker shares of the pairs are disjoint
(``sources.assign_parts`` over files, or row striding).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stacklm.chat.formats import ChatRecord, _tools, parse_messages, record_turns
from stacklm.chat.policy import DEFAULT_POLICY, OVERLONG_RULES, LossPolicy
from stacklm.chat.render import (
    DROPPED_TOO_LONG,
    NOTHING_TO_TRAIN,
    TRUNCATED,
    TRUNCATED_START,
    TURNS_CUT,
    assemble,
    chat_tokens,
    loss_targets,
    render_turns,
    tag_loss,
    truncation_point,
    untag_loss,
)
from stacklm.chat.turns import (
    ASSISTANT,
    BAD_MESSAGE,
    DEFAULT_ROLE_ALIASES,
    NO_MESSAGES,
    Turn,
    validate_conversation,
)
from stacklm.constants import IGNORE_INDEX
from stacklm.data.audit import KEPT
from stacklm.data.stats import StageStats
from stacklm.errors import ChatFormatError

NO_SHARED_PROMPT = "no_shared_prompt"
EMPTY_COMPLETION = "empty_completion"
IDENTICAL_PAIR = "identical_pair"
PAIR_REASONS = (NO_SHARED_PROMPT, EMPTY_COMPLETION, IDENTICAL_PAIR)
DROPPED_LAST_BATCH = "dropped_last_batch"  # drop_last: the pairs of a short last batch

SIDES = ("chosen", "rejected")
SIDE_KEYS = ("input_ids", "position_ids", "seq_ids", "targets")
PREFERENCE_KEYS: tuple[str, ...] = (*(f"{s}_{k}" for s in SIDES for k in SIDE_KEYS), "pair_ids")


# ---------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------
@dataclass
class PreferencePair:
    """One pair in canonical form: the shared ``prompt`` messages and each side's completion
    messages (stacklm role names), the ``tools`` schemas, and where it came from."""

    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    tools: list[Any] | None = None
    format: str = "conversational"
    where: str = "pair"

    def turns(self) -> tuple[list[Turn], list[Turn], list[Turn]]:
        """``(prompt, chosen, rejected)`` turns by the exported template's rules
        (``chat.formats.record_turns``); a tools system turn belongs to the prompt."""
        out = []
        for side in (self.chosen, self.rejected):
            turns = record_turns(ChatRecord(self.prompt + side, self.tools, len(self.prompt), "preference", self.where))
            out.append(turns)
        n = sum(1 for t in out[0] if not t.completion)
        return out[0][:n], out[0][n:], out[1][n:]

    def to_trl(self) -> dict[str, Any]:
        """A row of TRL's conversational preference format (explicit prompt) that
        ``DPOTrainer`` tokenizes, with the exported template, to ``render_pair``'s ids. ``tools``
        travel as a JSON string, always present (see ``ChatRecord.to_trl`` for why)."""
        return {"prompt": self.prompt, "chosen": self.chosen, "rejected": self.rejected,
                "tools": json.dumps(self.tools, ensure_ascii=False) if self.tools else None}


def _is_conversational(value: Any) -> bool:
    """A list of messages, or (parquet / hub data often store one so) a JSON string of one: a
    list of objects each with ``role`` or ``from``. Any other string is plain text, so a reply
    that merely looks like JSON is never read as messages."""
    if isinstance(value, (list, tuple)):
        return True
    if not isinstance(value, str) or not value.lstrip().startswith("["):
        return False
    try:
        parsed = json.loads(value)
    except ValueError:
        return False
    return isinstance(parsed, list) and bool(parsed) and all(isinstance(m, Mapping) and ("role" in m or "from" in m) for m in parsed)


def read_pair(record: Mapping[str, Any], *, role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES, where: str = "pair") -> PreferencePair:
    """The canonical ``PreferencePair`` of one dataset row (module docstring for the formats)."""
    if not isinstance(record, Mapping):
        raise ChatFormatError(f"expected a record (object), got {type(record).__name__}", reason=BAD_MESSAGE, where=where)
    missing = [k for k in SIDES if k not in record]
    if missing:
        raise ChatFormatError(f"no {' or '.join(repr(k) for k in missing)} field; fields: {sorted(record)}; a preference "
                              "record has chosen and rejected (and a prompt)", reason=NO_MESSAGES, where=where)
    tools = _tools(record, where)
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    conv = [_is_conversational(v) for v in (chosen, rejected)]
    if conv[0] != conv[1]:
        raise ChatFormatError("chosen and rejected must both be strings (plain) or both lists of messages (conversational)",
                              reason=BAD_MESSAGE, where=where)
    if not conv[0]:
        if not isinstance(prompt, str) or not isinstance(chosen, str) or not isinstance(rejected, str):
            raise ChatFormatError(f"plain pair: prompt, chosen and rejected must be strings (prompt is {type(prompt).__name__}); "
                                  "without a prompt use conversational chosen/rejected", reason=BAD_MESSAGE, where=where)
        p, c, r = [{"role": "user", "content": prompt}], [{"role": ASSISTANT, "content": chosen}], [{"role": ASSISTANT, "content": rejected}]
        fmt = "plain"
    else:
        c = parse_messages(chosen, role_aliases=role_aliases, where=f"{where} chosen")
        r = parse_messages(rejected, role_aliases=role_aliases, where=f"{where} rejected")
        if prompt is not None and _is_conversational(prompt):
            p, fmt = parse_messages(prompt, role_aliases=role_aliases, where=f"{where} prompt"), "conversational"
        else:  # implicit prompt (TRL's extract_prompt: the longest common message prefix)
            n = 0
            while n < min(len(c), len(r)) and c[n] == r[n]:
                n += 1
            if n == 0:
                raise ChatFormatError("chosen and rejected conversations differ from their first message: no shared prompt",
                                      reason=NO_SHARED_PROMPT, where=where)
            p, c, r, fmt = c[:n], c[n:], r[n:], "implicit"
    system = record.get("system")
    if isinstance(system, str) and system.strip() and not (p and p[0]["role"] == "system"):
        p.insert(0, {"role": "system", "content": system})
    if not p:
        raise ChatFormatError("the prompt is empty", reason=NO_SHARED_PROMPT, where=where)
    if not c or not r:
        raise ChatFormatError(f"the {'chosen' if not c else 'rejected'} completion is empty (it is the prompt itself)",
                              reason=EMPTY_COMPLETION, where=where)
    if c == r:
        raise ChatFormatError("chosen and rejected are identical: no preference to learn", reason=IDENTICAL_PAIR, where=where)
    return PreferencePair(p, c, r, tools, fmt, where)


def pair_id(key: str) -> int:
    """A stable 63-bit id of a pair from its location (the same in every process and run)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little") >> 1


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------
@dataclass
class RenderedPair:
    """Both sides' ``(ids, mask)`` (int32 / int8, ``<|bos|> ... <|eos|>``) and the shared prompt's
    length (``<|bos|>``, the prompt turns and, when both completions open with an assistant
    turn, the generation prompt ``<|assistant|>``; no loss there)."""

    chosen: tuple[np.ndarray, np.ndarray]
    rejected: tuple[np.ndarray, np.ndarray]
    n_prompt: int

    def tagged(self) -> np.ndarray:
        """Chosen then rejected, one loss-tagged int32 array (``render.tag_loss``)."""
        return np.concatenate([tag_loss(*self.chosen), tag_loss(*self.rejected)])


def _side(prompt, p_segs, comp, c_segs, tokenizer, policy: LossPolicy) -> tuple[np.ndarray, np.ndarray, int]:
    ids, mask = assemble([*prompt, *comp], [*p_segs, *c_segs], tokenizer, policy=policy)
    n_prompt = 1 + sum(len(s) for s in p_segs) + int(comp[0].role == ASSISTANT)
    mask[:n_prompt] = 0  # the prompt is context, whatever the policy says of its assistant turns
    return ids, mask, n_prompt


def render_pair(
    prompt: Sequence[Turn],
    chosen: Sequence[Turn],
    rejected: Sequence[Turn],
    tokenizer: Any,
    seq_len: int | None = None,
    overlong: str = "truncate",
    policy: LossPolicy = DEFAULT_POLICY,
) -> tuple[RenderedPair | None, str, int]:
    """``(RenderedPair or None, outcome, turns cut)``: outcome ``kept``, ``truncated``,
    ``truncated_start``, ``dropped_too_long`` or ``nothing_to_train`` (a side whose completion
    has no trained turn under ``policy``). Each side is at most ``seq_len`` tokens."""
    if overlong not in OVERLONG_RULES:
        raise ValueError(f"overlong must be one of {OVERLONG_RULES}, got {overlong!r}")
    n_p = len(prompt)
    if not all(any(policy.trained([*prompt, *comp])[n_p:]) for comp in (chosen, rejected)):
        return None, NOTHING_TO_TRAIN, 0
    p_segs = render_turns(prompt, tokenizer, policy.reasoning)
    sides = [(list(comp), render_turns(comp, tokenizer, policy.reasoning)) for comp in (chosen, rejected)]
    head = 2 + sum(len(s) for s in p_segs)
    lengths = [head + sum(len(s) for s in segs) for _, segs in sides]
    outcome, cut = KEPT, 0
    if seq_len is not None and max(lengths) > seq_len:
        if overlong == "drop":
            return None, DROPPED_TOO_LONG, 0
        if overlong == "truncate":
            for j, (comp, segs) in enumerate(sides):
                if lengths[j] <= seq_len:
                    continue
                k = truncation_point([*prompt, *comp], [*p_segs, *segs], seq_len, policy) - n_p
                if k <= 0:
                    return None, DROPPED_TOO_LONG, 0
                sides[j], cut = (comp[:k], segs[:k]), cut + len(comp) - k
            outcome = TRUNCATED
        else:  # keep_end: the shortest cut of the prompt's earliest turns that fits both sides
            n_sys = next((i for i, t in enumerate(prompt) if t.role != "system"), n_p)
            need = max(sum(len(s) for s in segs) for _, segs in sides) + 2 + sum(len(s) for s in p_segs[:n_sys])
            tail = np.cumsum([len(s) for s in p_segs[::-1]])[::-1] if n_p else np.zeros(0)
            start = next((i for i in range(n_sys + 1, n_p) if prompt[i].role == "user" and need + int(tail[i]) <= seq_len), 0)
            if start == 0:
                return None, DROPPED_TOO_LONG, 0
            prompt, p_segs, cut = [*prompt[:n_sys], *prompt[start:]], [*p_segs[:n_sys], *p_segs[start:]], start - n_sys
            outcome = TRUNCATED_START
    (c_ids, c_mask, n_c), (r_ids, r_mask, n_r) = (_side(prompt, p_segs, comp, segs, tokenizer, policy) for comp, segs in sides)
    return RenderedPair((c_ids, c_mask), (r_ids, r_mask), min(n_c, n_r)), outcome, cut


def render_preference_record(record: Mapping[str, Any], tokenizer: Any, *, policy: LossPolicy = DEFAULT_POLICY,
                             role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES) -> RenderedPair:
    """A record in any preference format, rendered without a length limit (tests, evaluation)."""
    pair = read_pair(record, role_aliases=role_aliases)
    prompt, chosen, rejected = pair.turns()
    validate_conversation([*prompt, *chosen], require_assistant=False, where=pair.where)
    validate_conversation([*prompt, *rejected], require_assistant=False, where=pair.where)
    out, _, _ = render_pair(prompt, chosen, rejected, tokenizer, policy=policy)
    if out is None:
        raise ChatFormatError("a completion has no trained turn under the loss policy", reason=NOTHING_TO_TRAIN, where=pair.where)
    return out


# ---------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------
def _fill_side(planes: np.ndarray, row: int, tagged: np.ndarray, pad_id: int) -> None:
    """One side of one row, as ``collate_sft`` lays out a window of ``seq_len`` tokens (the side,
    then padding): inputs are the window less its last token, targets the window shifted by one
    where it bears loss, so ``targets[i] == input_ids[i + 1]`` wherever both exist."""
    ids, loss = untag_loss(tagged.astype(np.int64))
    width = planes.shape[2]
    if len(ids) > width + 1:
        raise ValueError(f"a rendered side of {len(ids)} tokens does not fit rows of {width + 1}; render it with render_pair(seq_len=...)")
    m = min(len(ids), width)
    inp, pos, seg, tgt = planes[:, row]
    inp[:m], inp[m:] = ids[:m], pad_id
    pos[:m], pos[m:] = np.arange(m), np.arange(width - m)
    seg[:m], seg[m:] = 0, 1
    tgt[:] = IGNORE_INDEX
    tgt[: len(ids) - 1] = loss_targets(ids, loss)


def collate_preference(pairs: Sequence[Mapping[str, Any]], seq_len: int, pad_id: int, batch_size: int | None = None) -> dict[str, torch.Tensor]:
    """Rendered pairs (``{"ids": tagged chosen+rejected, "n_chosen", "pair_id"}``) -> a
    preference batch (``PREFERENCE_KEYS``); rows past ``len(pairs)`` up to ``batch_size`` are
    fillers: padding, no loss, ``pair_ids`` -1. One buffer for the eight planes, as the batch
    contract does (one shared-memory block per batch)."""
    B = max(len(pairs), batch_size or 0)
    if B == 0:
        raise ValueError("collate_preference needs at least one pair or a batch_size")
    width = seq_len - 1
    buf = np.empty((2, len(SIDE_KEYS), B, width), dtype=np.int64)
    buf[:, 0], buf[:, 1], buf[:, 2], buf[:, 3] = pad_id, np.arange(width), 1, IGNORE_INDEX
    ids = np.full(B, -1, dtype=np.int64)
    for row, p in enumerate(pairs):
        tagged, n_c = np.asarray(p["ids"]), int(p["n_chosen"])
        _fill_side(buf[0], row, tagged[:n_c], pad_id)
        _fill_side(buf[1], row, tagged[n_c:], pad_id)
        ids[row] = int(p["pair_id"])
    planes = torch.from_numpy(buf)
    out = {f"{side}_{key}": planes[s, k] for s, side in enumerate(SIDES) for k, key in enumerate(SIDE_KEYS)}
    out["pair_ids"] = torch.from_numpy(ids)
    return out


def preference_sides(batch: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(chosen, rejected)``: each a batch-contract dict (``BATCH_KEYS``) a model runs as is."""
    return tuple({k: batch[f"{side}_{k}"] for k in SIDE_KEYS} for side in SIDES)  # type: ignore[return-value]


def preference_batch(records: Sequence[Mapping[str, Any]], tokenizer: Any, seq_len: int, *, overlong: str = "truncate",
                     policy: LossPolicy = DEFAULT_POLICY, stats: StageStats | None = None) -> dict[str, torch.Tensor]:
    """One preference batch from records in hand, without nodes; overlong pairs follow
    ``overlong`` and every outcome is counted in ``stats``; invalid records raise."""
    ct = chat_tokens(tokenizer)
    stats = stats if stats is not None else StageStats("render")
    pairs = []
    for i, rec in enumerate(records):
        pair = read_pair(rec, where=f"pair {i}")
        prompt, chosen, rejected = pair.turns()
        flags = [f.reason for comp in (chosen, rejected) for f in validate_conversation([*prompt, *comp], require_assistant=False, where=pair.where)]
        for reason in dict.fromkeys(flags):  # kept, and counted once per pair (chat.FLAG_REASONS)
            stats.add("batch", reason)
        out, outcome, cut = render_pair(prompt, chosen, rejected, tokenizer, seq_len, overlong, policy)
        stats.add("batch", outcome)
        if out is not None:
            if cut:
                stats.add("batch", TURNS_CUT, cut)
            pairs.append({"ids": out.tagged(), "n_chosen": len(out.chosen[0]), "pair_id": i})
    if not pairs:
        raise ValueError(f"no pair fits in seq_len={seq_len} (dropped: {stats.total(DROPPED_TOO_LONG)})")
    return collate_preference(pairs, seq_len, ct.pad)


# ---------------------------------------------------------------------------------------
# TRL
# ---------------------------------------------------------------------------------------
def dpo_dataset(records: Sequence[Mapping[str, Any]], *, role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES):
    """A ``datasets.Dataset`` that TRL's ``DPOTrainer`` takes with the exported HF tokenizer
    (``stacklm.tokenizer.export.export_hf``): TRL's conversational preference format with an
    explicit prompt (``prompt``/``chosen``/``rejected`` message lists, ``tools`` as JSON), from
    records in any of our preference formats. Plain pairs become a user and an assistant turn,
    as we render them, so TRL's ids are ours. Invalid records raise ``ChatFormatError``."""
    from stacklm.data.sources import import_datasets

    rows = [read_pair(r, role_aliases=role_aliases, where=f"pair {i}").to_trl() for i, r in enumerate(records)]
    return import_datasets().Dataset.from_list(rows)
