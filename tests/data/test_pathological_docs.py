"""No document can take a run down (issue 14 item 2).

Megabyte whitespace runs made tiktoken's Rust regex fail (``encode_to_numpy``: ValueError,
``encode_ordinary_batch``: a Rust panic that ``except Exception`` misses) and with it
tokenizer training and the data pipes. Every such document must now encode through every
fast path, round-trip byte-exactly, and agree with the pure-Python reference encoder.
"""

from __future__ import annotations

import base64
import random
import warnings

import numpy as np
import pytest
from torchdata.nodes import IterableWrapper

from stacklm.data.tokenizing import TokenizeNode
from stacklm.tokenizer.bpe import StackTokenizer
from stacklm.tokenizer.segments import MAX_LETTER_RUN, MAX_WHITESPACE_RUN, split_long_runs
from stacklm.tokenizer.training import train_from_iterable

MB = 1_000_000


def _binaryish(n: int, seed: int) -> str:
    """Random bytes read as text the two usual wrong ways: U+FFFD soup and latin-1 controls."""
    raw = random.Random(seed).randbytes(n)
    return raw[: n // 2].decode("utf-8", "replace") + raw[n // 2 :].decode("latin-1")


def _moderate() -> dict[str, str]:
    """Pathological shapes at sizes the reference encoder handles in well under a second,
    still past ``MAX_WHITESPACE_RUN`` so the run splitting is exercised."""
    rng = random.Random(7)
    n = 3 * MAX_WHITESPACE_RUN + 123
    return {
        "spaces": "a" + " " * n + "b",
        "tabs": "\t" * n,
        "mixed_ws": "x " + "".join(rng.choice(" \t\n\r\u3000\u00a0") for _ in range(n)) + " y",
        "ws_then_digit": "1" + " " * n + "2",
        "ideographic_space": "中" + "\u3000" * n + "文",
        "exactly_limit": "a" + " " * MAX_WHITESPACE_RUN + "b",
        "limit_plus_one": "a" + " " * (MAX_WHITESPACE_RUN + 1) + "b",
        "base64_line": base64.b64encode(rng.randbytes(30_000)).decode(),
        "one_char_line": "a" * 40_000,
        "punct_line": "=" * 20_000 + "-" * 20_000,
        "binaryish": _binaryish(20_000, 1),
        "nuls_and_controls": "\x00\x01\x02\x1b[0m" * 3000,
    }


def _megabyte() -> dict[str, str]:
    rng = random.Random(11)
    return {
        "1MB_spaces": " " * MB,
        "1MB_tabs": "word\t" + "\t" * MB + "word",
        "1MB_space_newline": " \n" * (MB // 2),
        "1MB_base64": base64.b64encode(rng.randbytes(3 * MB // 4)).decode(),
        "1MB_one_char": "a" * MB,
        "1MB_binaryish": _binaryish(MB, 2),
    }


NORMAL = ["Hello world, this is ordinary text.", "def f(x):\n    return x  # code\n", ""]


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


# ----------------------------------------------------------------------------- the split rule
def test_split_long_runs_cuts_only_long_runs_and_keeps_every_character():
    assert split_long_runs("plain text") == ["plain text"]
    assert split_long_runs(" " * MAX_WHITESPACE_RUN) == [" " * MAX_WHITESPACE_RUN]
    rng = random.Random(0)
    for _ in range(40):  # runs at every alignment the sampled pre-check could miss
        left = "x" * rng.randrange(0, 200)
        run_len = rng.randrange(MAX_WHITESPACE_RUN + 1, 3 * MAX_WHITESPACE_RUN)
        text = left + "".join(rng.choice(" \t\n") for _ in range(run_len)) + "y" + " " * rng.randrange(0, 50)
        pieces = split_long_runs(text)
        assert "".join(pieces) == text
        assert len(pieces) == -(-run_len // MAX_WHITESPACE_RUN)  # ceil: one cut per full limit
        assert all(len(p) - len(p.lstrip()) <= MAX_WHITESPACE_RUN for p in pieces)


def test_below_the_limit_ids_equal_plain_tiktoken(tokenizer_1024):
    """Runs up to the limit are not cut: our ids stay those of the exported tiktoken ranks."""
    enc = tokenizer_1024.to_tiktoken()
    for text in ("a" + " " * MAX_WHITESPACE_RUN + "b", "\t\n " * 1000, " " * 100 + "x"):
        assert tokenizer_1024.encode(text) == enc.encode_ordinary(text)


# ----------------------------------------------------------------------------- every fast path
@pytest.mark.parametrize("name", sorted(_moderate()))
def test_moderate_pathological_docs_equal_the_reference(tokenizer_1024, name):
    tok = tokenizer_1024
    text = _moderate()[name]
    ref = tok.encode_reference(text)
    assert tok.decode_bytes(ref) == _utf8(text)
    assert tok.encode(text) == ref
    assert tok.encode_ordinary(text) == ref
    assert tok.encode(text, allowed_special="all") == tok.encode_reference(text, allowed_special="all")
    texts = [NORMAL[0], text, NORMAL[1], text, NORMAL[2]]
    expected = [tok.encode_reference(t) for t in texts]
    assert tok.encode_batch(texts, num_threads=2) == expected
    for threads in (1, 2):
        arrays = tok.encode_batch_numpy(texts, num_threads=threads)
        assert all(a.dtype == np.int32 for a in arrays)
        assert [a.tolist() for a in arrays] == expected
    assert tok.core_fallbacks == 0  # handled by the fast path itself, not the fallback


def test_megabyte_docs_never_crash_and_round_trip(tokenizer_1024):
    tok = tokenizer_1024
    docs = _megabyte()
    texts = [NORMAL[0], *docs.values(), NORMAL[1]]
    batch = tok.encode_batch(texts, num_threads=2)
    arrays = tok.encode_batch_numpy(texts, num_threads=2)
    for text, ids, arr in zip(texts, batch, arrays):
        assert tok.decode_bytes(ids) == _utf8(text)
        assert arr.tolist() == ids
    for name, text in docs.items():
        assert tok.encode(text) == batch[texts.index(text)], name
    assert tok.core_fallbacks == 0


def test_whitespace_run_ids_equal_the_reference_past_the_limit(tokenizer_1024):
    """A 60k run (15 cuts): long enough to matter, short enough for the reference encoder."""
    text = "start" + " \t" * 30_000 + "end"
    assert tokenizer_1024.encode(text) == tokenizer_1024.encode_reference(text)


# ----------------------------------------------------------------------------- loud fallback
class PanicException(BaseException):
    """Stands in for ``pyo3_runtime.PanicException`` (same name, also not an ``Exception``)."""


class _FailingCore:
    """A tiktoken core that fails on texts holding ``marker``, like the Rust regex did."""

    def __init__(self, real, marker: str, error: BaseException) -> None:
        self.real, self.marker, self.error = real, marker, error

    def _check(self, text):
        texts = [text] if isinstance(text, str) else text
        if any(self.marker in t for t in texts):
            raise self.error

    def encode_ordinary(self, text):
        self._check(text)
        return self.real.encode_ordinary(text)

    def encode(self, text, **kw):
        self._check(text)
        return self.real.encode(text, **kw)

    def encode_ordinary_batch(self, texts, **kw):
        self._check(texts)
        return self.real.encode_ordinary_batch(texts, **kw)

    def encode_to_numpy(self, text, **kw):
        self._check(text)
        return self.real.encode_to_numpy(text, **kw)


@pytest.mark.parametrize("error", [PanicException("called `Result::unwrap()` on an `Err` value"),
                                   ValueError("Regex error while tokenizing: Max stack size exceeded")])
def test_a_core_failure_falls_back_to_the_reference_and_is_counted(tokenizer_1024, error, caplog):
    tok = StackTokenizer.from_dict(tokenizer_1024.to_dict())
    tok._tiktoken = _FailingCore(tokenizer_1024.to_tiktoken(), "BOOM", error)
    bad = "a BOOM text"
    texts = [NORMAL[0], bad, NORMAL[1]]
    expected = [tok.encode_reference(t) for t in texts]
    assert tok.encode(bad) == expected[1]
    assert tok.core_fallbacks == 1
    assert tok.encode_batch(texts) == expected
    assert tok.core_fallbacks == 2  # only the failing text, not the batch
    assert [a.tolist() for a in tok.encode_batch_numpy(texts, num_threads=1)] == expected
    assert tok.core_fallbacks == 3
    assert "reference encoder instead" in caplog.text


def test_keyboard_interrupt_is_not_swallowed(tokenizer_1024):
    tok = StackTokenizer.from_dict(tokenizer_1024.to_dict())
    tok._tiktoken = _FailingCore(tokenizer_1024.to_tiktoken(), "x", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        tok.encode("x")
    assert tok.core_fallbacks == 0


# ----------------------------------------------------------------------------- training and pipes
def test_training_survives_megabyte_runs_and_backends_agree(real_docs):
    docs = real_docs[:40] + [" " * MB, "\t" * MB + "x", " \n" * (MB // 2), _binaryish(200_000, 3)]
    results = {}
    for backend in ("fast", "python"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            results[backend] = train_from_iterable(iter(docs), 300, backend=backend)
    fast, python = results["fast"], results["python"]
    assert fast.tokenizer.merged_tokens == python.tokenizer.merged_tokens
    assert fast.docs_seen == python.docs_seen == len(docs)  # documents, not the pieces they were cut into
    assert fast.bytes_seen == sum(len(_utf8(d)) for d in docs)
    tok = fast.tokenizer
    for d in docs[-4:]:
        assert tok.decode_bytes(tok.encode(d)) == _utf8(d)


def test_tokenize_node_carries_pathological_docs(tokenizer_1024):
    tok = tokenizer_1024
    moderate = _moderate()
    texts = [NORMAL[0], *moderate.values(), " " * MB, "\t" * MB, NORMAL[1]]
    docs = [{"text": t, "source": "s", "domain": "d", "doc_id": f"s/{i}"} for i, t in enumerate(texts)]
    node = TokenizeNode(IterableWrapper(docs), tok, batch_docs=4, num_threads=2)
    node.reset()
    out = list(node)
    assert [d["doc_id"] for d in out] == [d["doc_id"] for d in docs]
    for text, doc in zip(texts, out):
        assert tok.decode_bytes(doc["ids"].tolist()) == _utf8(text)
    for text, doc in zip(texts[1 : 1 + len(moderate)], out[1 : 1 + len(moderate)]):
        assert doc["ids"].tolist() == tok.encode_reference(text)


def test_chat_rendering_survives_a_megabyte_whitespace_message(tokenizer_1024):
    from stacklm.chat import render_conversation

    tok = tokenizer_1024
    content = "look:" + " " * MB + "done"
    ids, mask = render_conversation([{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}], tok)
    assert len(ids) == len(mask)
    assert content.encode() in tok.decode_bytes(ids.tolist())


def test_train_tokenizer_cli_on_a_file_with_megabyte_runs(tmp_path, real_docs, capsys):
    """The command users run: a text file with a 2M-space run (the sampler hands the trainer
    1 MiB chunks of pure spaces, which crashed rustbpe), a 1 MB base64 line and, past the
    sniffed head, binary-ish text trains, and the tokenizer encodes the file back exactly."""
    from stacklm.cli import main

    text = "\n".join(real_docs[:60]) + "\n" + " " * (2 * MB) + "x\n" + base64.b64encode(random.Random(5).randbytes(3 * MB // 4)).decode()
    text += "\n" + _binaryish(100_000, 6).replace("\x00", "")
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    rc = main(["train-tokenizer", "--input", str(path), "--vocab-size", "300", "--no-progress", "--out", str(tmp_path / "tok")])
    err = capsys.readouterr().err
    assert rc == 0, err
    tok = StackTokenizer.load(tmp_path / "tok")
    assert tok.metadata["sample_audit"]["bytes_yielded"] == len(path.read_bytes())
    assert tok.decode_bytes(tok.encode(path.read_bytes().decode())) == path.read_bytes()


def _derive_merges_reference(ranks):
    """Every split point of every token (transformers' TikTokenConverter): O(L^2) per token."""
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda x: x[1]):
        local = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
        local.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges.extend(local)
    return merges


def test_derive_merges_equals_the_every_split_reference(tokenizer_1024):
    from stacklm.tokenizer.export import derive_merges

    ranks = tokenizer_1024.mergeable_ranks
    assert derive_merges(ranks) == _derive_merges_reference(ranks)


def test_a_single_line_megabyte_document_trains_and_exports(tmp_path):
    """One 1 MB line of one repeated character. Before, it trained a token of 500,000+ bytes,
    the Hugging Face export tried every split of it (O(L^2): 160 s at 500 kB, issue 23), and
    BPE on the one 1 MB piece was superlinear (33 s at 10 MB). Now the run is cut every
    MAX_LETTER_RUN characters, as whitespace runs are cut: no token is longer than a piece,
    encoding is linear, and both exports read the same bytes back (their ids may differ on such
    a run: the documented exception, segments.py)."""
    from tokenizers import Tokenizer

    from stacklm.chat.template_export import export_hf
    from stacklm.tokenizer.export import load_tiktoken_encoding, save_tiktoken_ranks

    doc = "a" * MB
    assert [len(p) for p in split_long_runs(doc)][:2] == [MAX_LETTER_RUN] * 2
    symbols = "x" + "=" * (3 * MAX_LETTER_RUN) + "y"
    assert "".join(split_long_runs(symbols)) == symbols and len(split_long_runs(symbols)) == 3
    assert split_long_runs("b" * MAX_LETTER_RUN) == ["b" * MAX_LETTER_RUN]  # at the limit: not cut
    tok = train_from_iterable(iter([doc]), 300).tokenizer
    assert max(len(b) for b in tok.merged_tokens) <= MAX_LETTER_RUN
    export_hf(tok, tmp_path / "hf")
    ranks_file = save_tiktoken_ranks(tok, tmp_path / "tok.tiktoken")
    ids = tok.encode(doc)
    assert tok.decode(ids) == doc
    hf = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert hf.decode(hf.encode(doc, add_special_tokens=False).ids) == doc
    tt = load_tiktoken_encoding(ranks_file)
    assert tt.decode(tt.encode_ordinary(doc)) == doc
    piece = doc[:MAX_LETTER_RUN]  # a run at the limit is not cut: there the exports agree id for id
    assert load_tiktoken_encoding(ranks_file).encode_ordinary(piece) == tok.encode(piece)
