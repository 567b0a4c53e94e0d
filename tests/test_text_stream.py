"""fusedattn.text_stream: a reply's text as its tokens arrive equals the decode of all its
tokens (SmolLM2's real tokenizer: byte-level pieces, multi-byte characters split across
tokens, special tokens among them), while each step decodes a few tokens only; a stop string
ends the text where a search of the whole text would, wherever it falls between tokens."""

import pytest

from fusedattn.text_stream import StopText, TextStream

pytest.importorskip("transformers", reason="needs the models extra: pip install .[models]")
pytest.importorskip("gguf", reason="needs the models extra: pip install .[models]")

from fusedattn.engine import smollm2_path  # noqa: E402
from helpers import hf_models  # noqa: E402

TEXTS = ["The capital of France is Paris. Ça coûte 3 € — 東京は日本の首都です 🇫🇷🙂 ok\n\n  done",
         " leading space, trailing space ", "日本語のテキスト" * 30, "a" * 300 + " b"]


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return hf_models.tokenizer(smollm2_path())
    except RuntimeError as e:
        pytest.skip(str(e))


class Counting:
    """The tokenizer, noting how many tokens each decode is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, tokens, **kwargs):
        self.lengths.append(len(tokens))
        return self.tokenizer.decode(tokens, **kwargs)


def ids_of(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [tokenizer.bos_token_id or 0] + ids[:len(ids) // 2] + [tokenizer.eos_token_id] + ids[len(ids) // 2:]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_the_streamed_text_is_the_whole_decode_and_each_step_decodes_a_few_tokens(tokenizer, text):
    ids = ids_of(tokenizer, text)
    counting = Counting(tokenizer)
    stream = TextStream(counting)
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) + stream.rest() == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)  # no half character is sent
    assert max(counting.lengths) <= 8, max(counting.lengths)  # not the whole reply (up to 300 tokens here)


def test_a_stream_that_ends_inside_a_character_says_so_at_its_end(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # a byte-level tokenizer splits it
    stream = TextStream(tokenizer)
    assert [stream.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.rest() == tokenizer.decode(ids[:-1])


@pytest.mark.parametrize("stop", [["Paris"], [". Ç", "東京"], ["ok\n\n"], ["never there"], ["🙂"]], ids=str)
def test_stop_strings_end_the_text_where_the_whole_text_says(tokenizer, stop):
    text = TEXTS[0]
    ids = ids_of(tokenizer, text)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [i for i in (whole.find(s) for s in stop) if i >= 0]
    stream = StopText(tokenizer, stop)
    sent, stopped = "", False
    for t in ids:
        delta, stopped = stream.push(t)
        sent += delta
        if stopped:
            break
    if hits:
        assert stopped and sent == whole[:min(hits)]
    else:
        assert not stopped and sent + stream.rest() == whole
