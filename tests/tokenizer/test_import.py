"""Imports: tiktoken ranks files and byte-level BPE tokenizer.json -> StackTokenizer or adapter.

Round trips of our own exports must give back an identical ``StackTokenizer``; foreign
vocabularies (trained here with HF ``tokenizers`` in GPT-2-like layouts) must encode exactly
like the source library on real text.
"""

from __future__ import annotations

import json

import pytest
import tiktoken
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from stacklm import corpus
from stacklm.tokenizer.bpe import StackTokenizer
from stacklm.tokenizer.training import train_from_iterable
from stacklm.chat.template_export import export_all, export_hf
from stacklm.tokenizer.export import (
    build_hf_tokenizer,
    hf_to_token,
    save_tiktoken_ranks,
    tiktoken_ranks_bytes,
)
from stacklm.tokenizer.imports import (
    GPT2_PATTERN,
    ForeignBPETokenizer,
    from_hf_tokenizer_json,
    from_tiktoken,
    load_foreign,
)
from stacklm.errors import TokenizerArtifactError
from stacklm.tokenizer.specials import GPT4_PATTERN, SPECIAL_TOKENS

PROBE = (
    "It's 2024 -- isn't it?\r\n\tdef f(x):\n        return x**2  # 🙂🚀 你好，世界 한국어 "
    "1234567 3.14 <|assistant|> <|endoftext|> <|bos|>" + " " * 20 + "end"
)
ADVERSARIAL = [" " * 3000, "a" * 2000, "ab" * 1500, "\r\n" * 500, "1234567890" * 100, "🙂" * 300, ""]
DOMAIN_BYTES = 120_000  # the pure-Python reference encoders run on this much per domain


@pytest.fixture(scope="module")
def tok(tokenizer_4096):
    return tokenizer_4096


@pytest.fixture(scope="module")
def real_docs():
    return {d: list(corpus.iter_domain(d, DOMAIN_BYTES)) for d in corpus.DOMAINS}


@pytest.fixture(scope="module")
def train_text():
    return list(corpus.iter_default_corpus(600_000))


def _same_tokenizer(a: StackTokenizer, b: StackTokenizer) -> None:
    assert isinstance(b, StackTokenizer)
    assert b.merged_tokens == a.merged_tokens
    for attr in ("pattern", "vocab_size", "n_unused", "special_tokens"):
        assert getattr(b, attr) == getattr(a, attr), attr
    assert b.named_tokens == a.named_tokens


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("which", ["tok", "shortfall_tokenizer"])  # the latter: fillers fill the vocab
def test_roundtrip_tiktoken_and_hf(which, request, tmp_path, real_docs):
    tok = request.getfixturevalue(which)
    out = export_all(tok, tmp_path)
    for back in (from_tiktoken(out["tiktoken"]), from_hf_tokenizer_json(out["hf_dir"]), load_foreign(tmp_path)):
        _same_tokenizer(tok, back)
        assert back.encode(PROBE) == tok.encode(PROBE)
        assert back.encode(PROBE, allowed_special="all") == tok.encode(PROBE, allowed_special="all")
        assert back.encode_batch(real_docs["prose"]) == tok.encode_batch(real_docs["prose"])
        assert back.metadata["imported_from"]


def test_duplicate_token_ids_survive_hf_round_trip(tmp_path):
    """Two merges spelling the same bytes: HF gets a placeholder at the later id, and the import
    restores it; tiktoken's ranks file has a gap there, so that import is the adapter."""
    a, b, c = b"a", b"b", b"c"
    merged = [a + b, b + c, a + b + c, a + b + c, a + b + c + a]  # id 259 duplicates 258
    tok = StackTokenizer(merged, vocab_size=256 + len(merged) + 3 + len(SPECIAL_TOKENS))
    assert tok.duplicate_ids == [259]
    hf = build_hf_tokenizer(tok)
    assert hf.get_vocab_size() == tok.vocab_size
    text = "abcabca abc bc ab"
    assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text)
    export_hf(tok, tmp_path)
    back = from_hf_tokenizer_json(tmp_path)
    _same_tokenizer(tok, back)
    via_tt = from_tiktoken(save_tiktoken_ranks(tok, tmp_path / "t.tiktoken"))
    assert isinstance(via_tt, ForeignBPETokenizer)
    assert via_tt.encode(text) == tok.encode(text) and via_tt.vocab_size == tok.vocab_size


# ---------------------------------------------------------------------- foreign HF tokenizers
def _train_hf(text, pre, normalizer=None, ignore_merges=False, alphabet=True, unk=None, vocab_size=2500):
    tk = Tokenizer(models.BPE(ignore_merges=ignore_merges, unk_token=unk))
    tk.pre_tokenizer = pre
    tk.normalizer = normalizer
    tk.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<pad>"] + ([unk] if unk else [])
    tr = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if alphabet else [])
    tk.train_from_iterator(text, tr)
    return tk


FOREIGN = {
    # GPT-2 style: ByteLevel's own regex, specials at ids 0-1, bytes in the GPT-2 char order
    "gpt2": lambda: dict(pre=pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)),
    "gpt2_prefix_space": lambda: dict(pre=pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)),
    # Llama-3 / Qwen style: Split(GPT-4 regex) + ByteLevel(no regex), NFC, ignore_merges
    "split_nfc_ignore_merges": lambda: dict(
        pre=pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GPT4_PATTERN), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        normalizer=normalizers.NFC(), ignore_merges=True),
}


@pytest.fixture(scope="module")
def foreign_files(train_text, tmp_path_factory):
    d = tmp_path_factory.mktemp("foreign")
    paths = {}
    for name, spec in FOREIGN.items():
        tk = _train_hf(train_text, **spec())
        paths[name] = d / f"{name}.json"
        tk.save(str(paths[name]))
    return paths


@pytest.mark.parametrize("name", list(FOREIGN))
def test_foreign_hf_encodes_like_tokenizers(name, foreign_files, real_docs):
    path = foreign_files[name]
    imp = from_hf_tokenizer_json(path)
    assert isinstance(imp, ForeignBPETokenizer)
    lib = Tokenizer.from_file(str(path))
    lib.encode_special_tokens = True
    assert imp.vocab_size == lib.get_vocab_size() and imp.token_id("<|endoftext|>") == 0
    for domain, docs in [*real_docs.items(), ("adversarial", ADVERSARIAL), ("probe", [PROBE])]:
        want = [e.ids for e in lib.encode_batch(docs, add_special_tokens=False)]
        got = [imp.encode(t) for t in docs]
        bad = [i for i, (x, y) in enumerate(zip(got, want)) if x != y]
        assert not bad, f"{name}/{domain}: {len(bad)} documents differ (first {bad[0]})"
        assert imp.encode_batch(docs) == want
    assert imp.decode(imp.encode(PROBE)) == (" " if name == "gpt2_prefix_space" else "") + PROBE
    assert imp.encode("x<|endoftext|>y", allowed_special="all")[1] == 0


@pytest.mark.parametrize("unk", [None, "<unk>"])
def test_foreign_hf_missing_bytes_follow_the_library(unk, tmp_path):
    """Trained on ASCII without the full byte alphabet: HF drops (or unk-s) unseen bytes."""
    text = ["hello world, the quick brown fox. " * 40, "def f(x): return x + 1\n" * 40]
    tk = _train_hf(text, pre=pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), alphabet=False,
                   unk=unk, vocab_size=300)
    path = tmp_path / "ascii.json"
    tk.save(str(path))
    with pytest.warns(UserWarning, match="byte values have no token"):
        imp = from_hf_tokenizer_json(path)
    tk.encode_special_tokens = True
    for t in ["héllo wörld 🙂🙂 fox", "ééé", "plain ascii hello"]:
        assert imp.encode(t) == tk.encode(t, add_special_tokens=False).ids


def test_foreign_tiktoken_layout(foreign_files, real_docs, tmp_path):
    """GPT-2-style ids in a tiktoken ranks file: tiktoken's rule, tiktoken's ids."""
    data = json.loads(foreign_files["gpt2"].read_text())
    named = {t["content"]: t["id"] for t in data["added_tokens"]}
    ranks = {hf_to_token(s): i for s, i in data["model"]["vocab"].items() if s not in named}
    path = tmp_path / "gpt2like.tiktoken"
    path.write_bytes(tiktoken_ranks_bytes(ranks))
    with pytest.raises(TokenizerArtifactError, match="pass pattern"):
        from_tiktoken(path)
    imp = from_tiktoken(path, pattern=GPT2_PATTERN, named_tokens=named)
    assert isinstance(imp, ForeignBPETokenizer) and imp.vocab_size == len(ranks) + len(named)
    enc = tiktoken.Encoding("gpt2like", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=named)
    for domain, docs in [*real_docs.items(), ("adversarial", ADVERSARIAL), ("probe", [PROBE])]:
        assert [imp.encode(t) for t in docs] == enc.encode_ordinary_batch(docs), domain
    assert imp.encode_batch(real_docs["code"]) == enc.encode_ordinary_batch(real_docs["code"])
    t = "a<|endoftext|>b<pad>"
    assert imp.encode(t, allowed_special="all") == enc.encode(t, allowed_special="all")
    assert imp.encode(t) == enc.encode_ordinary(t)
    assert imp.decode(imp.encode(PROBE)) == PROBE
    for odd in ["lone \ud800 surrogate", "pair \ud83d\ude42 spells an emoji"]:
        assert imp.encode(odd) == enc.encode_ordinary(odd), odd


def test_stack_layout_with_plain_training_merges_is_not_misread(tok, tmp_path):
    """A tokenizer.json with our ids but only one merge per token is HF pair-rank BPE, not
    ours: the import must encode as HF does, so it returns the adapter."""
    export_hf(tok, tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    seen, merges = set(), []
    for a, b in data["model"]["merges"]:
        if a + b not in seen:
            seen.add(a + b)
            merges.append([a, b])
    assert len(merges) < len(data["model"]["merges"])
    data["model"]["merges"] = merges
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(data))
    imp = from_hf_tokenizer_json(path)
    assert isinstance(imp, ForeignBPETokenizer)
    lib = Tokenizer.from_file(str(path))
    lib.encode_special_tokens = True
    docs = [PROBE, *ADVERSARIAL, *corpus.iter_code(60_000)]
    assert [imp.encode(d) for d in docs] == [e.ids for e in lib.encode_batch(docs, add_special_tokens=False)]


# ---------------------------------------------------------------------- bad input
def test_unsupported_tokenizer_json_fails_clearly(tmp_path, train_text):
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.train_from_iterator(
        train_text[:20], trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"], show_progress=False)
    )
    wp.save(str(tmp_path / "wp.json"))
    with pytest.raises(TokenizerArtifactError, match=r"wp\.json: field 'model\.type' is 'WordPiece'"):
        from_hf_tokenizer_json(tmp_path / "wp.json")

    meta = _train_hf(train_text[:20], pre=pre_tokenizers.Metaspace(), vocab_size=300)
    meta.decoder = decoders.ByteLevel()
    meta.save(str(tmp_path / "meta.json"))
    with pytest.raises(TokenizerArtifactError, match="pre-tokenizer 'Metaspace' is not supported"):
        from_hf_tokenizer_json(tmp_path / "meta.json")

    bl = _train_hf(train_text[:20], pre=pre_tokenizers.ByteLevel(), vocab_size=300)
    data = json.loads(bl.to_str())
    data["model"]["vocab"]["\n"] = len(data["model"]["vocab"])  # a raw newline: not byte-level
    (tmp_path / "raw.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerArtifactError, match=r"vocab entry '\\n' \(id \d+\) is not in the byte-level alphabet"):
        from_hf_tokenizer_json(tmp_path / "raw.json")

    with pytest.raises(TokenizerArtifactError, match="no tokenizer.json here"):
        from_hf_tokenizer_json(tmp_path / "missing")
    (tmp_path / "broken.json").write_text('{"model": ')
    with pytest.raises(TokenizerArtifactError, match="not valid JSON"):
        from_hf_tokenizer_json(tmp_path / "broken.json")
    with pytest.raises(TokenizerArtifactError, match="no tokenizer.stacklm.json or tokenizer.json"):
        load_foreign(tmp_path)


def test_foreign_decode_and_errors(foreign_files):
    imp = from_hf_tokenizer_json(foreign_files["gpt2"])
    with pytest.raises(ValueError, match="token id 999999 is not in"):
        imp.decode([999999])
    with pytest.raises(TypeError, match="allowed_special="):
        imp.encode("x", allowed_special="<|endoftext|>")
    with pytest.raises(ValueError, match="no <.bos.>"):
        imp.encode("x", add_special_tokens=True)
    assert imp.decode([imp.encode("é")[0]]) == "\ufffd"  # half a character -> U+FFFD, no crash
