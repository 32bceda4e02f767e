"""Shared fixtures: real-text tokenizers trained once per session (fast backend) and their
saved directories.

Every test module takes its tokenizer from here instead of training its own. There are a few
sizes, not one, because tests assert on them (a vocab size in a manifest or an error message,
a model's embedding size); each fixture's docstring says who depends on what. All are trained
on the embedded corpus (``stacklm.corpus``: stdlib code, docstrings, pydoc topics, CJK, math),
so they are deterministic. They are shared across modules: never mutate one (build a new
``StackTokenizer`` from its ``to_dict()`` to edit), and treat saved directories as read-only.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest

from stacklm.corpus import iter_default_corpus  # no torch: the setting below still comes first

# One torch (OpenMP) thread per test process and per program a test starts (they inherit the
# environment). Two test processes on two cores, each with torch's default of a thread per
# core, plus the programs they start, spin-wait for each other: test_model's 40-step tiny fit
# took 12 s with 2 threads and 4 s with 1 on this machine under load. A value set outside wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late for it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _train(corpus_bytes: int, vocab_size: int):
    from stacklm.tokenizer.training import train_from_iterable

    return train_from_iterable(iter_default_corpus(corpus_bytes), vocab_size)


@pytest.fixture(scope="session")
def real_docs() -> list[str]:
    """~1.5 MB of real text (stdlib code, docstrings, pydoc topics, CJK, math)."""
    return list(iter_default_corpus(1_500_000))


@pytest.fixture(scope="session")
def tokenizer_512():
    """400 kB, 512 ids: the Lightning tests (datamodule, DDP). Their ``TinyLM(512)`` embeds exactly
    this vocab, and a small vocab keeps the real-Trainer and gloo subprocess runs cheap."""
    return _train(400_000, 512).tokenizer


@pytest.fixture(scope="session")
def tokenizer_1024():
    """600 kB, 1,024 ids: the stream-level tests (pipeline, SFT, chat, inspect, pack). test_pack
    puts its own BOS/EOS/PAD at ids 1024..1026, just above these; the others need a real
    tokenizer with the specials, and a small one keeps their encoding cheap."""
    return _train(600_000, 1024).tokenizer


@pytest.fixture(scope="session")
def tokenizer_2048():
    """1 MB, 2,048 ids: the shard tests (dataset, prebuild; bench/loader.py trains the same). They
    assert on the number itself: a manifest's ``vocab_size``, "token id 2051 >= vocab_size 2048"."""
    return _train(1_000_000, 2048).tokenizer


@pytest.fixture(scope="session")
def tokenizer_4096():
    """2 MB, 4,096 ids: the tokenizer tests (encode/decode, save/load, export to tiktoken and
    Hugging Face, import back). The export tests assert ``vocab_size == 4096``."""
    return _train(2_000_000, 4096).tokenizer


@pytest.fixture(scope="session")
def shortfall_tokenizer():
    """300 kB at the full default vocab (32,768 ids): the corpus runs out of pairs long before,
    so ~22k ``<|unused_N|>`` fillers sit between the merges and the 9 specials on the top ids.
    What a user gets when training on too little text; the export and import tests check that
    fillers survive every format."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the expected "ran short" warning
        res = _train(300_000, 32768)
    assert res.shortfall > 0 and res.tokenizer.n_unused == res.shortfall
    return res.tokenizer


@pytest.fixture(scope="session")
def saved_tokenizer_dir(tmp_path_factory):
    """``saved_tokenizer_dir(tok)`` -> a directory holding ``tok`` as ``tokenizer.stacklm.json``
    (what ``--tokenizer DIR``, the datamodule and prebuild read); ``saved_tokenizer_dir(tok, "hf")``
    -> ``tok`` exported for Hugging Face (``export_hf``). Written once per tokenizer and format
    per session and shared: copy it before editing anything in it."""
    written: dict[tuple[int, str], object] = {}

    def save(tok, fmt: str = "stacklm"):
        key = (id(tok), fmt)
        if key not in written:
            directory = tmp_path_factory.mktemp(f"tokenizer_{tok.vocab_size}_{fmt}")
            if fmt == "stacklm":
                tok.save(directory / "tokenizer.stacklm.json")
            elif fmt == "hf":
                from stacklm.chat.template_export import export_hf

                export_hf(tok, directory)
            else:
                raise ValueError(f"saved_tokenizer_dir: format must be 'stacklm' or 'hf', got {fmt!r}")
            written[key] = (tok, directory)  # holding tok keeps its id from being reused
        return written[key][1]

    return save


@pytest.fixture(autouse=True)
def _each_test_is_a_run():
    """``stacklm.once`` says each event once per process run; every test is a run of its own."""
    from stacklm.once import forget

    forget()
    yield


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server (``tests/helpers/s3_server.py``) on a free localhost port for one test module,
    with the environment pointed at it (``AWS_ENDPOINT_URL``, dummy keys) so code that opens
    ``s3://`` URLs through fsspec reaches it; stopped afterwards."""
    import os

    import s3fs

    from tests.helpers.s3_server import S3Server

    server = S3Server().start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket on ``s3_server`` and an ``s3fs.S3FileSystem`` reaching it: ``(fs, name)``.
    The server's injected faults are cleared before and after."""
    import uuid

    s3_server.faults.clear()
    fs = s3_server.filesystem()
    name = f"stacklm-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    yield fs, name
    s3_server.faults.clear()


@pytest.fixture(scope="session")
def tokenizer_dir(tokenizer_512, saved_tokenizer_dir):
    """The 512-id tokenizer saved as a directory: what ``StackDataModule(tokenizer=...)`` takes."""
    return saved_tokenizer_dir(tokenizer_512)


@pytest.fixture(scope="session")
def shards_dir(tokenizer_dir, tmp_path_factory):
    """Prebuilt shards of ``tests.helpers.datamodule.stream_pipeline`` (``build_shards``), built
    once per test process and shared: copy it before changing anything in it."""
    from tests.helpers.datamodule import build_shards

    return build_shards(tokenizer_dir, tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="session")
def small_shards_dir(tokenizer_dir, tmp_path_factory):
    """The same mix prebuilt at 8,000 tokens (126 train rows in two shards): for the tests that run
    a real ``Trainer`` over a whole epoch several times (elastic, DDP, step log); every fit is a
    few dozen steps instead of ``shards_dir``'s ~70 an epoch, and still crosses a shard boundary."""
    from tests.helpers.datamodule import build_shards

    return build_shards(tokenizer_dir, tmp_path_factory.mktemp("small_shards"), total_tokens=8_000)
