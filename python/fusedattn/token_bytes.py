"""Each token's own bytes and name, as the server's logprobs give them.

A token's text in a reply depends on its neighbours (a character split over two tokens, a
leading space a tokenizer drops at the start), so logprobs name each token by its own bytes,
as OpenAI's do: read from the vocabulary through the tokenizer's decoder, which `tokenizers`
describes as data. Byte-level BPE (GPT-2's, SmolLM2's, Qwen's) maps every byte to one
character; SentencePiece vocabularies (Gemma's, Llama 2's) write a space as U+2581 and bytes
that no piece holds as <0xNN>. Added (special) tokens are their text as it stands.
"""

from __future__ import annotations

import functools
import json
import re

__all__ = ["TokenBytes"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_bytes() -> dict[str, int]:
    """Byte-level BPE's character of each byte, inverted: printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in characters):
        characters[b] = chr(256 + n)
    return {c: b for b, c in characters.items()}


def _steps(decoder: dict) -> list[dict]:
    """A decoder's steps in order, sequences flattened."""
    if decoder["type"] != "Sequence":
        return [decoder]
    return [step for inner in decoder["decoders"] for step in _steps(inner)]


def _strip(piece: str, content: str, start: int, stop: int) -> str:
    """tokenizers' Strip on one token: up to `start` leading and `stop` trailing `content`s off."""
    begin = 0
    while begin < min(start, len(piece)) and piece[begin] == content:
        begin += 1
    end = len(piece)
    while len(piece) - end < stop and end > begin and piece[end - 1] == content:
        end -= 1
    return piece[begin:end]


class TokenBytes:
    def __init__(self, tokenizer):
        """tokenizer: transformers' or fusedattn.tokenizer's; without a `tokenizers`
        backend_tokenizer whose decoder is of the kinds read here, tokens have no bytes and
        their name is their decoding."""
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a slow tokenizer has none
        self._backend = backend
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()} if backend else {}
        self._steps = None  # the decoder's steps, where every one is of a kind read here
        try:
            steps = _steps(json.loads(backend.decoder.__getstate__()))
        except Exception:  # noqa: BLE001  (no backend or decoder, or one that does not describe itself)
            steps = []
        known = {"ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}
        if steps and all(s.get("type") in known for s in steps):
            self._steps = steps
        self._known: dict[int, bytes | None] = {}

    def bytes(self, token: int) -> bytes | None:
        """The token's own bytes; None where the tokenizer's decoder is of a kind not read here."""
        if token not in self._known:
            self._known[token] = self._read(token)
        return self._known[token]

    def _read(self, token: int) -> bytes | None:
        if self._steps is None:
            return None
        piece = self._added.get(token) or self._backend.id_to_token(token)  # added tokens are decoded too
        if piece is None:
            return None
        fused = False
        for step in self._steps:
            kind = step["type"]
            if kind == "ByteLevel":  # a token with a character outside the table stands for its UTF-8
                table = _byte_level_bytes()
                return bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
            if kind == "ByteFallback":
                if m := _BYTE_PIECE.fullmatch(piece):
                    return bytes([int(m.group(1), 16)])
            elif kind == "Replace":
                if "String" not in step["pattern"]:  # a regex: not read here
                    return None
                piece = piece.replace(step["pattern"]["String"], step["content"])
            elif kind == "Metaspace":  # the space it takes off a reply's first token is the reply's
                piece = piece.replace(step.get("replacement", "\u2581"), " ")
            elif kind == "Fuse":
                fused = True
            elif not fused:  # Strip: on each token before Fuse; after it, on the reply's ends only
                piece = _strip(piece, step["content"], step["start"], step["stop"])
        return piece.encode()

    def name(self, token: int) -> str:
        """The token as logprobs name it: its text, or where its bytes are not whole UTF-8
        characters, OpenAI's "bytes:\\xe6\\x97" form, so that no two such tokens share a name."""
        own = self.bytes(token)
        try:
            return own.decode("utf-8") if own is not None else self._tokenizer.decode([token])
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in own)
