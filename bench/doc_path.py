"""How many of the library's modules run while one batch is pulled from a built pipeline.

    python3 bench/doc_path.py [REPO_ROOT]

A newcomer following one document from its source to a batch opens these files. The graph is
built first (configs, sources, nodes); only the modules whose functions run during the
``next()`` that yields the first batch are counted (``sys.setprofile``), so start-up code,
imports and config parsing are left out. Pass another checkout's root to compare two trees
(the pipeline builder is ``stacklm.data.pipeline``; older trees named it ``stacklm.data.nodes``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

root = str(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve())
sys.path.insert(0, root)

try:
    from stacklm.data.pipeline import PipelineConfig
except ImportError:  # a tree from before the rename
    from stacklm.data.nodes import PipelineConfig
from stacklm import corpus  # noqa: E402
from stacklm.tokenizer.training import train_from_iterable  # noqa: E402


def main() -> None:
    tok = train_from_iterable(list(corpus.iter_default_corpus(200_000)), vocab_size=512).tokenizer
    cfg = {"seq_len": 64, "batch_size": 2, "shuffle_buffer": 8, "pack_buffer_docs": 8, "tokenize_batch_docs": 4,
           "mix": {"name": "t", "total_tokens": 4000, "entries": [
               {"name": "web", "kind": "synthetic", "weight": 0.7, "domain": "prose", "seed": 1, "num_docs": 200},
               {"name": "code", "kind": "synthetic", "weight": 0.3, "domain": "code", "seed": 2, "num_docs": 100}]}}
    batches = iter(PipelineConfig.from_dict(cfg).build(tok).batches)
    ran: set[str] = set()

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(os.path.join(root, "stacklm") + os.sep):
            ran.add(os.path.relpath(name, root))

    sys.setprofile(profile)
    next(batches)
    sys.setprofile(None)
    print(f"{len(ran)} modules in {len({os.path.dirname(m) for m in ran})} folders run while one batch is pulled")
    for module in sorted(ran):
        print("  ", module)


if __name__ == "__main__":
    main()
