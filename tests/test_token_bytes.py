"""fusedattn.token_bytes: each token's own bytes, read through its tokenizer's decoder, put
back together give the text it came from, on SmolLM2's byte-level BPE and Gemma 3's
SentencePiece pieces with byte fallback (real tokenizers) and on synthetic ones for each
decoder step it reads; special tokens are their text; a decoder of a kind it does not read
gives no bytes rather than wrong ones."""

import pytest

from fusedattn.token_bytes import TokenBytes

pytest.importorskip("tokenizers", reason="needs the models extra: pip install .[models]")
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models  # noqa: E402

TEXTS = ["The capital of France is Paris. Ça coûte 3 € — 東京は日本の首都です 🇫🇷🙂 ok\n\n  done",
         " leading space,\ttabs\t and trailing  ", "\x00\x07 control bytes \x7f"]


def model_tokenizer(name):
    pytest.importorskip("transformers", reason="needs the models extra: pip install .[models]")
    pytest.importorskip("gguf", reason="needs the models extra: pip install .[models]")
    from fusedattn import engine
    from helpers import hf_models

    try:
        return hf_models.tokenizer(getattr(engine, f"{name}_path")())
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request):
    return model_tokenizer(request.param)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_the_tokens_bytes_put_together_are_the_text(tokenizer, text):
    names = TokenBytes(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(names.bytes(i) for i in ids) == text.encode()


def test_special_tokens_are_their_own_text(tokenizer):
    names = TokenBytes(tokenizer)
    for token in (tokenizer.eos_token, tokenizer.bos_token):
        if token is not None:
            i = tokenizer.convert_tokens_to_ids(token)
            assert names.bytes(i) == token.encode() and names.name(i) == token


class Synthetic:
    """A word-level vocabulary with the given decoder, as transformers' tokenizers show theirs."""

    def __init__(self, decoder):
        vocab = {"[UNK]": 0, "\u2581Hello": 1, "<0xE6>": 2, "\u0120foo": 3, "日本": 4, "  a ": 5}
        self.backend_tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        self.backend_tokenizer.add_tokens([AddedToken("\u2581<PRE>", special=False)])  # id 6, CodeLlama's kind
        self.backend_tokenizer.decoder = decoder

    def decode(self, ids):
        return self.backend_tokenizer.decode(ids)


LLAMA = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                           decoders.Strip(" ", 1, 0)])


@pytest.mark.parametrize("decoder, expected", [
    # The reply's first space goes (Strip after Fuse), a token's own stays; added tokens are decoded too.
    (LLAMA, {1: b" Hello", 2: b"\xe6", 6: b" <PRE>"}),
    (decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Strip(" ", 1, 0), decoders.Fuse()]),
     {1: b"Hello", 5: b" a "}),  # Strip before Fuse: on every token
    (decoders.Metaspace(replacement="\u2581", prepend_scheme="always"), {1: b" Hello"}),
    (decoders.ByteLevel(), {3: b" foo", 4: "日本".encode()}),  # a character outside the byte table: its UTF-8
], ids=["llama", "strip-each", "metaspace", "byte-level"])
def test_decoders_as_data(decoder, expected):
    names = TokenBytes(Synthetic(decoder))
    assert {token: names.bytes(token) for token in expected} == expected


def test_a_partial_character_is_named_by_its_bytes():
    names = TokenBytes(Synthetic(LLAMA))
    assert names.name(2) == "bytes:\\xe6" and names.name(1) == " Hello"


class Opaque:
    def decode_chain(self, tokens):
        return tokens


@pytest.mark.parametrize("decoder", [decoders.WordPiece(), decoders.Replace(Regex("\u2581+"), " "),
                                     decoders.Decoder.custom(Opaque())], ids=["wordpiece", "regex", "custom"])
def test_a_decoder_it_does_not_read_gives_no_bytes(decoder):
    """WordPiece's "##" joins pieces, a regex replaces across them, a Python decoder does not
    describe itself: their tokens have no bytes here, and a name of their own decoding."""
    tokenizer = Synthetic(decoder)
    names = TokenBytes(tokenizer)
    assert names.bytes(1) is None and names.name(1) == tokenizer.decode([1])
