"""Data pipes: source -> filter -> dedup -> tokenize -> mix -> shuffle -> pack -> batch.

Conventions shared by every stage:
- a *document* is a dict ``{"text": str, "source": str, "domain": str, "doc_id": str}``
  (``domain`` is one of ``"prose"``, ``"code"``, ``"math"``);
- after tokenization it becomes ``{"ids": np.ndarray[int32], "source", "domain", "doc_id"}``
  (ids without bos/eos; packing adds them);
- each stage's logic lives in plain functions/classes testable without torchdata, and a thin
  ``torchdata.nodes.BaseNode`` wrapper makes it stateful; ``pipeline.py`` wires the stages into
  the pre-training graph (``PipelineConfig``, ``build_pipeline``), ``graph.py`` is the built one;
- each stage counts kept/dropped-by-reason per source in a ``StageStats``.
"""
