"""fusedattn.text_stream: a reply's text as its tokens arrive equals the decode of all its
tokens (SmolLM2's real tokenizer: byte-level pieces, multi-byte characters split across
tokens, special tokens among them), while each step decodes a few tokens only; a stop string
ends the text where a search of the whole text would, wherever it falls between tokens."""

import pytest

from fusedattn.text_stream import StopText, TextStream, text_and_offsets

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


@pytest.mark.parametrize("text, stop", [("Q: 東京 and more", [": "]), (TEXTS[0], ["す 🇫🇷"]), (TEXTS[0], [" 東"]),
                                        (TEXTS[2], ["テキスト日"]), (TEXTS[0], ["zz", "€ —"])], ids=str)
def test_a_stop_string_is_seen_at_the_token_that_completes_it(tokenizer, text, stop):
    """Even where that token also starts a multi-byte character the stream holds back (with
    SmolLM2's byte-level pieces a space and the first byte of a CJK character are one token):
    the step a search of the whole decoded text would stop at, with the same text sent."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = StopText(tokenizer, stop)
    sent = ""
    for n in range(1, len(ids) + 1):
        whole = tokenizer.decode(ids[:n], skip_special_tokens=True).rstrip("\ufffd")
        hits = [i for i in (whole.find(s) for s in stop) if i >= 0]
        delta, stopped = stream.push(ids[n - 1])
        sent += delta
        assert stopped == bool(hits), (n, whole)
        if stopped:
            assert sent == whole[:min(hits)]
            return
    pytest.fail("no stop string was met")


def test_the_rest_of_a_reply_stops_at_a_stop_string_too(tokenizer):
    ids = tokenizer.encode("Q: 東", add_special_tokens=False)
    stream = StopText(tokenizer, [": 東"])
    sent = "".join(stream.push(t)[0] for t in ids[:-1])  # the reply ends a token short of the stop's end
    assert sent + stream.rest() == tokenizer.decode(ids[:-1])


def test_offsets_say_where_each_tokens_text_starts(tokenizer):
    """SmolLM2's tokens 459 and 246 split " \u201c": the space is whole after the first, so the
    second's text starts after it."""
    text, offsets = text_and_offsets(tokenizer, [81, 459, 246, 82])
    assert (text, offsets) == ("a \u201cb", [0, 1, 2, 3])
    for sample in TEXTS:
        ids = tokenizer.encode(sample, add_special_tokens=False)
        text, offsets = text_and_offsets(tokenizer, ids)
        assert text == sample and offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)


def test_nothing_is_left_after_a_stop_string(tokenizer):
    stream = StopText(tokenizer, [" Paris"])
    sent, stopped = "", False
    for token in tokenizer.encode("The capital of France is Paris.", add_special_tokens=False):
        delta, stopped = stream.push(token)
        sent += delta
        if stopped:
            break
    assert stopped and sent == "The capital of France is" and stream.rest() == "" and stream.stopped
