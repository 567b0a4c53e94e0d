"""The text of a token stream as its tokens arrive, for `fusedattn generate` and the server.

Decoding a whole reply again at every new token costs time in its length: with SmolLM2's
tokenizer 0.4 ms a token at 256 tokens, 3.75 ms at 4096, which 32 long streams turn into a
tenth of a second per engine step. A stream here decodes a few tokens a step instead, as
vLLM's incremental detokenizer does: the tokens from `prefix` on, and those from `prefix` to
`read`, both starting at the same token, so that whatever a tokenizer does with a first
token (SentencePiece drops its leading space) it does to both; their difference is the new
text, kept once it ends in a whole character.
"""

from __future__ import annotations

__all__ = ["StopText", "TextStream", "text_and_offsets"]


class TextStream:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""  # the text of the tokens up to `read`
        # The text of the tokens after `read`, which ends inside a multi-byte character (in
        # U+FFFD); the characters before that are whole already.
        self.pending = ""
        self._prefix = self._read = 0

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """The text that token completes ("" while it ends inside a multi-byte character)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self._prefix:self._read])
        new = self._decode(self.tokens[self._prefix:])[len(before):]
        if not new or new.endswith("\ufffd"):
            self.pending = new
            return ""
        self.text += new
        self.pending = ""
        self._prefix, self._read = self._read, len(self.tokens)
        return new

    def rest(self) -> str:
        """The text of the tokens after the last whole character (a character the stream
        ended inside of decodes as U+FFFD), once no token follows."""
        return self.pending

    def whole(self) -> str:
        """The text so far up to its last whole character: a half one's bytes still pending left out."""
        return self.text + self.pending.rstrip("\ufffd")

    def offset(self) -> int:
        """Where the next token's text starts in the text so far (a character split over
        tokens counts from its first)."""
        return len(self.whole())


def text_and_offsets(tokenizer, tokens: list[int]) -> tuple[str, list[int]]:
    """The text of tokens, and where each token's own text starts in it."""
    stream, offsets = TextStream(tokenizer), []
    for token in tokens:
        offsets.append(stream.offset())
        stream.push(token)
    return stream.text + stream.rest(), offsets


class StopText:
    """A request's text as its tokens arrive: what can be sent now. A stop string ends it (and
    is not sent); text that may begin one, or that ends inside a multi-byte character, is held
    back. Each step searches only the text a stop string could end in."""

    def __init__(self, tokenizer, stop: list[str]):
        self.stream, self.stop = TextStream(tokenizer), stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0  # the length of the text given out so far
        self.stopped = False  # whether a stop string ended it
        self.searched = 0  # the length of the text searched at the last step

    def _stop_in(self, text: str) -> int | None:
        """Where the first stop string in text begins, searching from where one could end now."""
        start = max(0, self.searched - self.hold)
        self.searched = len(text)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def offset(self) -> int:
        return self.stream.offset()

    def push(self, token: int) -> tuple[str, bool]:
        """The text now ready to send, and whether a stop string ended it."""
        self.stream.push(token)
        text = self.stream.whole()
        stop = self._stop_in(text)
        if stop is not None:
            delta, self.sent, self.stopped = text[self.sent:stop], stop, True
            return delta, True
        ready = max(len(text) - self.hold, self.sent)
        delta, self.sent = text[self.sent:ready], ready
        return delta, False

    def rest(self) -> str:
        """What is still held back, once the request has ended (up to a stop string in it);
        nothing after a stop string ended it."""
        if self.stopped:
            return ""
        text = self.stream.text + self.stream.rest()
        stop = self._stop_in(text)
        rest = text[self.sent:stop]
        self.sent += len(rest)
        self.stopped = stop is not None
        return rest
