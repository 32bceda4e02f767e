"""From-scratch byte-level BPE trainer.

Why keep our own beside the fast Rust backend (``backends.py``): it is the executable
specification of the id layout and of the tie-break rule (highest pair count, then the
smallest ``(left_id, right_id)``), small enough to read in one sitting, and the reference the
fast backend is tested against merge for merge. It is also what runs where the Rust wheel
is unavailable.

Algorithm (the classic incremental design): pre-tokenize the stream into distinct chunks
with counts (memory grows with distinct chunks, not corpus bytes), keep global pair counts
plus, per pair, the set of words it occurs in, and a max-heap of ``(-count, pair)`` with
lazy deletion: a popped entry whose count is stale is re-pushed with its true count. Merging
a pair touches only the words that contain it and updates counts by local deltas.
``train_naive`` is the straightforward version (rescan every word for every merge); it exists
for the benchmark and as a second reference in tests.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import regex

from stacklm.tokenizer.specials import N_BYTES

Pair = tuple[int, int]


@dataclass
class BpeTrainOutput:
    """What a training backend returns: merged token bytes in training (= id) order."""

    token_bytes: list[bytes]  # bytes of ids 256, 257, ... in merge order
    merges: list[Pair] | None  # (left_id, right_id) per merge when the backend exposes them
    unique_chunks: int
    total_chunks: int
    pair_counts: list[int] = field(default_factory=list)  # count of each merge when chosen


def count_chunks(docs: Iterable[str], pattern: str, progress: Callable[[int], None] | None = None) -> Counter[str]:
    """Pre-tokenize ``docs`` and count distinct chunks; ``progress`` gets UTF-8 bytes consumed."""
    compiled = regex.compile(pattern)
    counts: Counter[str] = Counter()
    for doc in docs:
        counts.update(compiled.findall(doc))
        if progress is not None:
            progress(len(doc.encode("utf-8", "surrogatepass")))
    return counts


def _words_from_counts(counts: Counter[str]) -> tuple[list[list[int]], list[int]]:
    words: list[list[int]] = []
    freqs: list[int] = []
    for chunk, c in counts.items():
        b = chunk.encode("utf-8", "surrogatepass")
        if len(b) >= 2:  # single-byte chunks carry no pairs
            words.append(list(b))
            freqs.append(c)
    return words, freqs


def _merge_word(ids: list[int], a: int, b: int, new_id: int) -> tuple[list[int], list[tuple[Pair, int]]]:
    """Merge non-overlapping ``(a, b)`` left to right; return the new ids and pair deltas.

    The deltas use the already-merged left neighbour, so they are exact also for runs such as
    ``a a a a`` (this is the rule the Rust backend applies too).
    """
    out: list[int] = []
    deltas: list[tuple[Pair, int]] = []
    n = len(ids)
    i = 0
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            if out:
                x = out[-1]
                deltas.append(((x, a), -1))
                deltas.append(((x, new_id), 1))
            deltas.append(((a, b), -1))
            if i + 2 < n:
                y = ids[i + 2]
                deltas.append(((b, y), -1))
                deltas.append(((new_id, y), 1))
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out, deltas


def train_bpe(
    counts: Counter[str],
    num_merges: int,
    progress: Callable[[int], None] | None = None,
) -> BpeTrainOutput:
    """Heap-based incremental BPE over chunk counts; at most ``num_merges`` merges."""
    words, freqs = _words_from_counts(counts)
    pair_counts: dict[Pair, int] = {}
    where: dict[Pair, set[int]] = {}
    for wi, ids in enumerate(words):
        f = freqs[wi]
        for pair in zip(ids, ids[1:]):
            pair_counts[pair] = pair_counts.get(pair, 0) + f
            s = where.get(pair)
            if s is None:
                where[pair] = {wi}
            else:
                s.add(wi)
    heap = [(-c, p) for p, c in pair_counts.items() if c > 0]
    heapq.heapify(heap)

    token_bytes = [bytes([i]) for i in range(N_BYTES)]
    merges: list[Pair] = []
    chosen_counts: list[int] = []
    while len(merges) < num_merges and heap:
        neg, pair = heapq.heappop(heap)
        current = pair_counts.get(pair, 0)
        if -neg != current:  # stale entry: re-queue with the true count (counts only shrink)
            if current > 0:
                heapq.heappush(heap, (-current, pair))
            continue
        if current <= 0:
            break
        new_id = N_BYTES + len(merges)
        a, b = pair
        merges.append(pair)
        chosen_counts.append(current)
        token_bytes.append(token_bytes[a] + token_bytes[b])
        created: dict[Pair, None] = {}
        for wi in where.pop(pair, ()):
            ids = words[wi]
            if len(ids) < 2:
                continue
            new_ids, deltas = _merge_word(ids, a, b, new_id)
            if not deltas:
                continue  # the pair no longer occurs in this word
            words[wi] = new_ids
            f = freqs[wi]
            for p, d in deltas:
                pair_counts[p] = pair_counts.get(p, 0) + d * f
                if d > 0:
                    s = where.get(p)
                    if s is None:
                        where[p] = {wi}
                    else:
                        s.add(wi)
                    created[p] = None
        pair_counts.pop(pair, None)
        for p in created:
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
        if progress is not None:
            progress(1)
    return BpeTrainOutput(
        token_bytes=token_bytes[N_BYTES:],
        merges=merges,
        unique_chunks=len(counts),
        total_chunks=sum(counts.values()),
        pair_counts=chosen_counts,
    )


def train_naive(counts: Counter[str], num_merges: int) -> BpeTrainOutput:
    """The straightforward version: recount every pair of every word after each merge.

    Quadratic in practice; only for the benchmark baseline and as a test oracle on small data.
    """
    words, freqs = _words_from_counts(counts)
    token_bytes = [bytes([i]) for i in range(N_BYTES)]
    merges: list[Pair] = []
    chosen: list[int] = []
    while len(merges) < num_merges:
        pair_counts: dict[Pair, int] = {}
        for ids, f in zip(words, freqs):
            for pair in zip(ids, ids[1:]):
                pair_counts[pair] = pair_counts.get(pair, 0) + f
        if not pair_counts:
            break
        best = min(pair_counts, key=lambda p: (-pair_counts[p], p))
        new_id = N_BYTES + len(merges)
        a, b = best
        for wi, ids in enumerate(words):
            if len(ids) >= 2:
                words[wi] = _merge_word(ids, a, b, new_id)[0]
        merges.append(best)
        chosen.append(pair_counts[best])
        token_bytes.append(token_bytes[a] + token_bytes[b])
    return BpeTrainOutput(token_bytes[N_BYTES:], merges, len(counts), sum(counts.values()), chosen)
