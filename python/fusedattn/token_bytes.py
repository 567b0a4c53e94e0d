"""Each token's own bytes and text, as the server's logprobs give them.

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


class TokenBytes:
    def __init__(self, tokenizer):
        """tokenizer: transformers' or fusedattn.tokenizer's; without a `tokenizers`
        backend_tokenizer, tokens have no bytes here and their text is their decoding."""
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a slow tokenizer has none
        self._backend = backend
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()} if backend else {}
        decoder = backend.decoder if backend else None
        self._steps = _steps(json.loads(decoder.__getstate__())) if decoder is not None else []
        known = {"ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}
        self._understood = bool(self._steps) and all(s["type"] in known for s in self._steps)
        self._known: dict[int, bytes | None] = {}

    def bytes(self, token: int) -> bytes | None:
        """The token's own bytes; None where the tokenizer's decoder is of a kind not read here."""
        if token not in self._known:
            self._known[token] = self._read(token)
        return self._known[token]

    def _read(self, token: int) -> bytes | None:
        if token in self._added:
            return self._added[token].encode()
        if not self._understood:
            return None
        piece = self._backend.id_to_token(token)
        if piece is None:
            return None
        for step in self._steps:
            kind = step["type"]
            if kind == "ByteLevel":
                table = _byte_level_bytes()
                if not all(c in table for c in piece):
                    return None
                return bytes(table[c] for c in piece)
            if kind == "Replace" and "String" in step["pattern"]:
                piece = piece.replace(step["pattern"]["String"], step["content"])
            elif kind == "Metaspace":
                piece = piece.replace(step.get("replacement", "\u2581"), " ")
            elif kind == "ByteFallback" and (m := _BYTE_PIECE.fullmatch(piece)):
                return bytes([int(m.group(1), 16)])
            elif kind == "Replace":  # a regex pattern: not read here
                return None
            # Fuse joins pieces and Strip trims a sequence's ends: neither changes one token's bytes.
        return piece.encode()

    def text(self, token: int) -> str:
        """The token's own text: its bytes as UTF-8 (U+FFFD for part of a character)."""
        own = self.bytes(token)
        return own.decode("utf-8", errors="replace") if own is not None else self._tokenizer.decode([token])
