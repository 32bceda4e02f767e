"""What the batches delivered to the training step, counted in the main process.

A loader worker runs ahead of the step by its shuffle and pack buffers and by the loader's
prefetch (``prefetch_factor x num_workers`` batches), so its own counters say what it *read*,
not what was trained on (a toy fit showed 45x). Every stream batch therefore carries the
counts of its own windows (``stacklm.data.packing.origins.delivery_counts`` under ``DELIVERY_KEY``);
``StackDataLoader`` takes them off each batch as it hands the batch to the training loop and
adds them here. Lightning does not fetch ahead of a loader with a length, so "handed to the
loop" is "reached the training step".

The counter is part of the loader's checkpoint state (per rank), so a resumed run continues
its totals; ``stacklm.callbacks`` sums the ranks when it logs.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from stacklm.once import first_time, say_once

# Document-length histogram bins (tokens, <bos>/<eos> included): powers of two up to 1M and beyond.
HIST_EDGES = [0] + [2**k for k in range(3, 21)] + [2**62]


class DeliveryCounter:
    """Per-source tokens, documents (counted at their first token), packed rows (when the batches
    say: shards mode) and a document-length histogram of the delivered batches,
    plus all token positions (so padding is ``1 - tokens / positions``), and the sources that ran
    dry with where and how far off their target share they were."""

    def __init__(self, sources: Sequence[str], target_weights: Mapping[str, float] | None = None, split: str | None = None) -> None:
        self.sources = list(sources)
        self.split = split  # which stream's batches these are ("train", "val"): warnings name it
        total = sum((target_weights or {}).values())
        self.target = {s: (float(target_weights[s]) / total if total else 0.0) for s in self.sources} if target_weights else {}
        self.reset()

    def reset(self) -> None:
        n = len(self.sources)
        self.tokens = np.zeros(n, dtype=np.int64)
        self.docs = np.zeros(n, dtype=np.int64)
        self.rows = np.zeros(n, dtype=np.int64)  # packed rows holding any of the source's tokens (shards mode)
        self.counts_rows = False  # whether the batches carried ``rows``
        # restored from a checkpoint written before rows were counted: a count from the resume on
        # would read as the whole run's, so none is reported for this run
        self.rows_unknown = False
        self.hist = np.zeros((n, len(HIST_EDGES) - 1), dtype=np.int64)
        self.positions = 0
        self.batches = 0
        self.padding_rows = 0  # rows with no data and no loss (elastic stream mode: a dry or finished reader)
        self.ran_dry: dict[str, dict[str, Any]] = {}

    def add(self, positions: int, delivery: Mapping[str, Any] | None, padding_rows: int = 0) -> None:
        """One batch handed to the step: ``positions`` = B x T of its ``input_ids``; ``delivery``
        its counts (None for a batch that carries none, e.g. a padding batch of a dry stream);
        ``padding_rows``: its rows that carry no data (when the batch says so)."""
        self.batches += 1
        self.positions += int(positions)
        self.padding_rows += int(padding_rows)
        if delivery is None:
            return
        tokens = np.asarray(delivery["tokens"], dtype=np.int64)
        if len(tokens) > len(self.sources):
            raise ValueError(f"a batch counts {len(tokens)} sources but the loader knows {len(self.sources)}: {self.sources}")
        self.tokens[: len(tokens)] += tokens
        docs = np.asarray(delivery["docs"], dtype=np.int64)
        self.docs[: len(docs)] += docs
        if "rows" in delivery and not self.rows_unknown:
            rows = np.asarray(delivery["rows"], dtype=np.int64)
            self.rows[: len(rows)] += rows
            self.counts_rows = True
        lengths = np.asarray(delivery["doc_lengths"], dtype=np.int64).reshape(-1, 2)
        if len(lengths):
            bins = np.searchsorted(HIST_EDGES, lengths[:, 1], side="right") - 1
            np.add.at(self.hist, (lengths[:, 0], bins), 1)

    def shares(self) -> dict[str, float]:
        total = int(self.tokens.sum())
        return {s: (int(self.tokens[i]) / total if total else 0.0) for i, s in enumerate(self.sources)}

    def note_dry(self, source: str, *, rank: int, worker: int) -> None:
        """A worker's mix reports ``source`` ran dry: warn once per source, naming the batch and
        the delivered vs target share at that point."""
        if source in self.ran_dry:
            return
        share = self.shares().get(source, 0.0)
        target = self.target.get(source)
        self.ran_dry[source] = {"batch": self.batches, "rank": rank, "worker": worker, "delivered_share": share,
                                "target_share": target}
        if self.split == "val":
            # The val split reads the holdout (holdout_fraction of each source), which a val budget
            # of holdout_fraction x total_tokens outruns whenever the sources are smaller than
            # the budget: expected, and nothing to fix for training. Said once per process, for
            # the first source, as information (every validation pass used to warn with
            # training advice for every source).
            if rank == 0:
                say_once(("val_ran_dry",),
                         f"stacklm: validation read the holdout of source {source!r} to its end (val batch {self.batches} of "
                         "rank 0; other sources may follow): the rest of each validation uses what the holdout has, padded "
                         "rows carry no loss. Information only; data.val_batches sets how many val batches run.")
            return
        first_time("ran_dry", source)  # said here: the callback's data/ran_dry does not say it again
        warnings.warn(
            f"stacklm: source {source!r} ran dry in the {self.split + ' stream' if self.split else 'stream'}, rank {rank} "
            f"worker {worker}, at batch {self.batches} of this rank: "
            f"delivered share so far {share:.4f} vs target {target if target is None else f'{target:.4f}'}; its unmet "
            "budget goes to the other sources. Give it more data or lower its weight / the token budget.",
            RuntimeWarning,
            stacklevel=2,
        )

    def stats(self) -> dict[str, Any]:
        """This rank's part of the ``data_stats`` protocol (``stacklm.callbacks``)."""
        shares = self.shares()
        total = int(self.tokens.sum())
        realized = {s: {"tokens": int(self.tokens[i]), "docs": int(self.docs[i]), "target_weight": self.target.get(s),
                        "realized_weight": shares[s]} for i, s in enumerate(self.sources)}
        if self.counts_rows:
            for i, s in enumerate(self.sources):
                realized[s]["rows"] = int(self.rows[i])
        return {
            "realized": realized,
            "delivered": {"batches": self.batches, "positions": self.positions, "tokens": total, "padding_rows": self.padding_rows},
            "padding_fraction": 1.0 - total / self.positions if self.positions else 0.0,
            "doc_length_hist": {"edges": list(HIST_EDGES),
                                "counts": {s: self.hist[i].tolist() for i, s in enumerate(self.sources)}},
            "ran_dry": {s: dict(v) for s, v in self.ran_dry.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        return {"sources": list(self.sources), "tokens": self.tokens.tolist(), "docs": self.docs.tolist(),
                **({"rows": self.rows.tolist()} if self.counts_rows else {}),
                "hist": self.hist.tolist(), "positions": self.positions, "batches": self.batches, "padding_rows": self.padding_rows,
                "ran_dry": {s: dict(v) for s, v in self.ran_dry.items()}}

    def load_sum(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Add up several counters' states (e.g. every rank's, onto one rank after a reshape)."""
        for state in states:
            if list(state["sources"]) != self.sources:
                raise ValueError(f"delivery counts are for sources {state['sources']} but this loader has {self.sources}")
            self.tokens += np.asarray(state["tokens"], dtype=np.int64)
            self.docs += np.asarray(state["docs"], dtype=np.int64)
            if "rows" in state:
                self.rows += np.asarray(state["rows"], dtype=np.int64)
                self.counts_rows = True
            elif int(state["batches"]):
                self.rows_unknown = True
            self.hist += np.asarray(state["hist"], dtype=np.int64).reshape(self.hist.shape)
            self.positions += int(state["positions"])
            self.batches += int(state["batches"])
            self.padding_rows += int(state.get("padding_rows", 0))
            for s, v in state.get("ran_dry", {}).items():
                self.ran_dry.setdefault(s, dict(v))
        if self.rows_unknown:
            self.counts_rows = False

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["sources"]) != self.sources:
            raise ValueError(f"delivery counts are for sources {state['sources']} but this loader has {self.sources}")
        self.tokens[:] = state["tokens"]
        self.docs[:] = state["docs"]
        self.counts_rows = "rows" in state
        self.rows[:] = state["rows"] if self.counts_rows else 0
        self.rows_unknown = not self.counts_rows and int(state["batches"]) > 0
        self.hist[:] = np.asarray(state["hist"], dtype=np.int64).reshape(self.hist.shape)
        self.positions, self.batches = int(state["positions"]), int(state["batches"])
        self.padding_rows = int(state.get("padding_rows", 0))
        self.ran_dry = {s: dict(v) for s, v in state.get("ran_dry", {}).items()}
