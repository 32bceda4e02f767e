"""StackTokenizer: round trips, trusted specials, decode safety, batch path, artifacts."""

from __future__ import annotations

import json
import random

import pytest

from stacklm.corpus import iter_domain
from stacklm.errors import TokenizerArtifactError
from stacklm.tokenizer.bpe import StackTokenizer
from stacklm.tokenizer.rules import merge_long, merge_short
from stacklm.tokenizer.specials import SPECIAL_TOKENS

PROBE = (
    "Hello, world! It's 2026; we'll ship v0.1.0.\r\n\tdef f(x):\r\n        return x**2  # square\n"
    "emoji 👩‍💻🚀 and CJK 统一码 日本語 한국어, digits 1234567890 3.14159, "
    "the literal <|assistant|> and <|bos|> in user text,   many   spaces\n\n\n"
)


def _random_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(32, 127)] + list("\r\n\t  éßç中文😀👩‍💻\u200b\u0301\ufffd")
    out = []
    for _ in range(n):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        # plus arbitrary code points (no surrogates: a Python str that is valid text)
        s += "".join(chr(rng.choice([rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])) for _ in range(20))
        out.append(s)
    return out


def test_round_trip_real_and_random_text(tokenizer_4096):
    tok = tokenizer_4096
    texts = [PROBE] + _random_strings(300)
    for domain in ("prose", "code", "cjk", "math"):
        texts += list(iter_domain(domain, 60_000))
    for s in texts:
        ids = tok.encode(s)
        assert ids == tok.encode_reference(s)
        assert tok.decode(ids) == s
        assert tok.decode_bytes(ids) == s.encode("utf-8")
        assert all(0 <= i < tok.vocab_size - len(SPECIAL_TOKENS) for i in ids)


def test_merges_compress_real_text(tokenizer_4096):
    text = "".join(iter_domain("prose", 100_000))
    assert len(tokenizer_4096.encode(text)) < len(text.encode()) / 2.5


def test_special_strings_in_untrusted_text_are_bytes(tokenizer_4096):
    tok = tokenizer_4096
    ids = tok.encode("<|assistant|>hi")
    assert tok.special_ids["<|assistant|>"] not in ids
    assert tok.decode(ids) == "<|assistant|>hi"
    assert tok.encode("<|assistant|>hi", allowed_special={"<|assistant|>"})[0] == tok.special_ids["<|assistant|>"]
    # only the allowed one is special
    ids = tok.encode("<|user|>a<|assistant|>", allowed_special={"<|assistant|>"})
    assert tok.special_ids["<|user|>"] not in ids and ids[-1] == tok.special_ids["<|assistant|>"]
    all_ids = tok.encode("<|user|>a<|end|>", allowed_special="all")
    assert all_ids[0] == tok.special_ids["<|user|>"] and all_ids[-1] == tok.special_ids["<|end|>"]
    wrapped = tok.encode("hi", add_special_tokens=True)
    assert wrapped[0] == tok.bos_id and wrapped[-1] == tok.eos_id and tok.decode(wrapped[1:-1]) == "hi"


def test_unknown_special_names_and_string_misuse(tokenizer_4096):
    with pytest.raises(ValueError, match="unknown special token"):
        tokenizer_4096.encode("x", allowed_special={"<|im_start|>"})
    with pytest.raises(TypeError, match="allowed_special"):
        tokenizer_4096.encode("x", allowed_special="<|bos|>")
    with pytest.raises(KeyError, match="unknown special token"):
        tokenizer_4096.token_id("<|nope|>")


def test_decode_is_safe(tokenizer_4096):
    tok = tokenizer_4096
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # truncated UTF-8 sequence
    assert tok.decode_bytes([0xE4, 0xB8]) == b"\xe4\xb8"
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"
    for bad in ([tok.vocab_size], [-1], [0, 10**9]):
        with pytest.raises(ValueError, match="out of range"):
            tok.decode(bad)


def test_encode_batch_equals_reference_encoder(tokenizer_4096):
    tok = tokenizer_4096
    texts = [PROBE] + _random_strings(100, seed=1)
    for domain in ("prose", "code", "cjk", "math"):
        texts += list(iter_domain(domain, 150_000))
    assert tok.encode_batch(texts, num_threads=2) == [tok.encode_reference(t) for t in texts]
    with_specials = tok.encode_batch([PROBE], allowed_special="all", add_special_tokens=True)[0]
    assert with_specials == tok.encode_reference(PROBE, allowed_special="all", add_special_tokens=True)
    assert with_specials == tok.encode(PROBE, allowed_special="all", add_special_tokens=True)


def test_long_chunks_use_heap_merge_with_identical_result(tokenizer_4096):
    tok = tokenizer_4096
    rng = random.Random(3)
    enc = tok.to_tiktoken()
    medium = ["a" * 700, "ab" * 400, "".join(rng.choice("etaoinshr") for _ in range(900)), "=" * 300 + "-" * 99]
    ranks = tok.mergeable_ranks

    def rank_of_pair(left: bytes, right: bytes):
        return ranks.get(left + right)

    for s in medium:  # the heap path and the rescan path agree where both are affordable
        parts = [bytes([b]) for b in s.encode()]
        assert merge_long(list(parts), rank_of_pair) == merge_short(list(parts), rank_of_pair)
    for s in medium + ["a" * 10_000, "".join(rng.choice("etaoinshr") for _ in range(20_000))]:
        assert tok.encode_reference(s) == enc.encode_ordinary(s) == tok.encode(s)


def test_chunk_cache_is_bounded(tokenizer_4096, monkeypatch):
    tok = StackTokenizer(tokenizer_4096.merged_tokens, vocab_size=tokenizer_4096.vocab_size)
    tok._cache.max_entries = 1000
    words = " ".join(f"w{i}x" for i in range(20_000))
    tok.encode_reference(words)
    assert len(tok._cache) <= 1000
    assert tok.decode(tok.encode_reference(words)) == words


def test_surrogates_never_crash(tokenizer_4096):
    ids = tokenizer_4096.encode("a\ud800b")
    assert ids == tokenizer_4096.encode_reference("a\ud800b")
    assert tokenizer_4096.decode(ids) == "a\ufffdb"
    assert tokenizer_4096.encode_batch(["a\ud800b"]) == [ids]
    # a well-formed surrogate pair spells its character, as in tiktoken
    assert tokenizer_4096.encode("\ud83d\ude00") == tokenizer_4096.encode("😀")
    assert tokenizer_4096.encode_batch(["x\ud83d\ude00"]) == [tokenizer_4096.encode("x😀")]


def test_save_load_round_trip(tokenizer_4096, tmp_path):
    path = tokenizer_4096.save(tmp_path / "tok.json")
    loaded = StackTokenizer.load(path)
    assert loaded.merged_tokens == tokenizer_4096.merged_tokens
    assert loaded.special_ids == tokenizer_4096.special_ids
    assert loaded.pattern == tokenizer_4096.pattern
    assert loaded.encode(PROBE) == tokenizer_4096.encode(PROBE)
    assert [p.name for p in tmp_path.iterdir()] == ["tok.json"]  # no temp files left behind


def test_loaded_tokenizer_keeps_its_own_pattern(tokenizer_4096, tmp_path):
    data = tokenizer_4096.to_dict()
    data["pattern"] = r"\S+|\s+"
    path = tmp_path / "tok.json"
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="differs from"):
        tok = StackTokenizer.load(path)
    assert tok.pattern == r"\S+|\s+"
    assert tok.decode(tok.encode("a b  c")) == "a b  c"


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.update(format="other"), "format"),
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.update(vocab_size=d["vocab_size"] + 1), "vocab_size"),
        (lambda d: d.update(n_merges=d["n_merges"] - 1), "n_merges"),
        (lambda d: d["merged_tokens_b64"].__setitem__(5, "!!notbase64"), "merged_tokens_b64"),
        (lambda d: d["merged_tokens_b64"].__setitem__(0, "enp6eno="), "merged_tokens_b64"),
        (lambda d: d["special_tokens"].__setitem__(0, "bos"), "special_tokens"),
        (lambda d: d.update(pattern="(unclosed"), "pattern"),
        (lambda d: d.update(pattern=r"(\w+)|\s+|[^\w\s]+"), "pattern"),  # a capturing group: findall gave the groups
        (lambda d: d.update(pattern=r"[^a]+"), "pattern"),  # "a" in no piece: encode("xax") dropped it
        (lambda d: d.update(pattern=r"\X"), "pattern"),  # the `regex` module reads it, tiktoken's engine does not
        (lambda d: d.pop("pattern"), "pattern"),
    ],
)
def test_hand_edited_artifact_is_rejected_naming_the_field(tokenizer_4096, tmp_path, edit, field):
    data = tokenizer_4096.to_dict()
    edit(data)
    path = tmp_path / "tok.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TokenizerArtifactError, match=f"{path}.*'{field}'"):
        StackTokenizer.load(path)


def test_truncated_or_missing_artifact(tokenizer_4096, tmp_path):
    path = tokenizer_4096.save(tmp_path / "tok.json")
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(TokenizerArtifactError, match="truncated"):
        StackTokenizer.load(path)
    with pytest.raises(TokenizerArtifactError, match="no tokenizer artifact"):
        StackTokenizer.load(tmp_path / "missing.json")


def test_encode_batch_numpy_equals_encode(tokenizer_4096):
    import numpy as np

    # Texts go to the core joined by the pad token: texts holding that string, other
    # specials, surrogates, empty and whitespace-only texts must still encode on their own
    # (untrusted: never a special id), and chunk edges must not move a token.
    odd = ["<|pad|>", "x<|pad|>y", "<|bos|> hi <|eos|>", " ", "  \n", "\n", "a\ud800b", ""]
    code = list(iter_domain("code", 100_000))
    texts = [PROBE, *odd] + code[:7] + odd + code[7:]
    for threads in (1, 2, 3):
        arrays = tokenizer_4096.encode_batch_numpy(texts, num_threads=threads)
        assert all(a.dtype == np.int32 for a in arrays)
        assert [a.tolist() for a in arrays] == [tokenizer_4096.encode_reference(t) for t in texts]
    assert tokenizer_4096.encode_batch_numpy([]) == []
    assert [a.tolist() for a in tokenizer_4096.encode_batch_numpy(["<|pad|>"] * 3)] == [tokenizer_4096.encode("<|pad|>")] * 3


@pytest.mark.parametrize("pattern, why", [
    (r"(\w+)|\s+|[^\w\s]+", "1 capturing group"),
    (r"[^a]+", "U\\+0061 \\(Ll\\) at 2 .* covered by no piece"),
    (r"\X", "fast encoder \\(tiktoken\\) cannot use it"),
])
def test_a_pattern_that_cannot_encode_every_text_is_refused_in_one_line(tokenizer_4096, tmp_path, pattern, why):
    """Loaded as it was (no refusal), these encoded wrongly: ``encode_reference`` returned ``[]``
    with a capturing group, ``encode("xax")`` lost the ``a``, or the fast encoder raised a
    traceback at the first encode."""
    data = tokenizer_4096.to_dict()
    data["pattern"] = pattern
    path = tmp_path / "tok.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TokenizerArtifactError, match=f"{path}: field 'pattern': .*{why}") as refused:
        StackTokenizer.load(path)
    assert "\n" not in str(refused.value)
