"""How a run resumes: every resume rule of the datamodule, in one folder.

A checkpoint holds ``StackDataModule.state_dict()`` (the datamodule's part) and each train
loader's own ``state_dict()`` (Lightning's loop state). Read in this order:

- ``state``: the one state shape per mode (a few common keys, the fingerprint ``identity``, the
  mode's position) and ``check_state``, which refuses a checkpoint this run cannot resume
  before any step, with one message naming what differs and the fix; ``EpochReload``, the one
  place that asks Lightning to rebuild a loader whose resumed epoch is shorter than a whole one.
- ``identity``: what the data *is* (content hashes of shards or config, tokenizer, order),
  never where it lies: a moved copy resumes, other data at the same path is refused.
- ``shards``: shards mode's shape-free position ``(epoch, rows_served, steps)`` and the
  ``skip_steps`` ranges resolved to stream positions; ``sampler``: ``ElasticSampler``, the one
  seeded permutation per epoch that the position counts into. So a resume deals the rows left
  to any world size, worker count and batch size (``ShardsLoader``).
- ``logical``: stream mode's ``L`` logical streams, fixed for the run and dealt to
  (rank x worker) at run time; a resume on another shape replays each old worker from its last
  snapshot to the delivered batch and re-deals the logical streams (``LogicalStreamDataset``).
- ``checkpoint_file``: the checkpoint file itself is whole or absent (``WholeCheckpointIO``,
  written beside its name and renamed), so a full disk never leaves a half checkpoint to resume from.
- sft and preference modes keep their position in each (rank, worker) loader state, so they
  resume on the checkpoint's shape only (``state`` refuses another one).

The modes (``stacklm.datamodule.modes``) apply these rules: each takes the checked state in
``restore`` and returns its part of the next one from ``state``. docs/trainer.md ("Resume")
says what a user sees; docs/architecture.md how it fits.
"""
