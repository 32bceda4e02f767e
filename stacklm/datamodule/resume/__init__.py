"""How a run resumes: the datamodule's resume rules, gathered in one folder.

- ``identity``: what the data is (content hashes, not paths), checked when a checkpoint resumes;
- ``logical``: stream mode's logical streams, dealt to (rank x worker) at run time, and their replay.
"""
