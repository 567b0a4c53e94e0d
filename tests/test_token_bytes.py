"""fusedattn.token_bytes: each token's own bytes, read through its tokenizer's decoder, put
back together give the text it came from, on SmolLM2's byte-level BPE and Gemma 3's
SentencePiece pieces with byte fallback (real tokenizers); special tokens are their text;
a decoder of a kind it does not read gives no bytes rather than wrong ones."""

import pytest
from tokenizers import Tokenizer, decoders, models

from fusedattn.token_bytes import TokenBytes

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
            assert names.bytes(i) == token.encode() and names.text(i) == token


def test_a_decoder_it_does_not_read_gives_no_bytes():
    class Wrapped:  # a WordPiece tokenizer: "##" joins pieces, which bytes of one token cannot say
        backend_tokenizer = Tokenizer(models.WordPiece({"[UNK]": 0, "play": 1, "##ing": 2}, unk_token="[UNK]"))
        backend_tokenizer.decoder = decoders.WordPiece()

        def decode(self, ids):
            return self.backend_tokenizer.decode(ids)

    names = TokenBytes(Wrapped())
    assert names.bytes(2) is None and names.text(2) == Wrapped().decode([2])
