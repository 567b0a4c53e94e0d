"""A reply's logprobs in OpenAI's two shapes: a completion's parallel lists, a chat's
object per token (with the token's bytes). Tokens are named as TokenBytes.name names them."""

from __future__ import annotations

from ..token_bytes import TokenBytes
from .scheduler import TokenLogprob

__all__ = ["chat_logprobs", "completion_logprobs"]


def completion_logprobs(entries: list[TokenLogprob], names: TokenBytes) -> dict:
    def alternatives(entry: TokenLogprob) -> dict[str, float] | None:
        if entry.top is None:  # the prompt's first token
            return None
        top: dict[str, float] = {}
        for token, logprob in entry.top:  # most likely first: where two share a name, the likelier stays
            top.setdefault(names.name(token), logprob)
        top.setdefault(names.name(entry.token), entry.logprob)  # OpenAI's: the chosen token's always
        return top

    return {"tokens": [names.name(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [alternatives(e) for e in entries], "text_offset": [e.offset for e in entries]}


def chat_logprobs(entries: list[TokenLogprob], names: TokenBytes) -> dict:
    def item(token: int, logprob: float) -> dict:
        own = names.bytes(token)
        return {"token": names.name(token), "logprob": logprob, "bytes": None if own is None else list(own)}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, p) for t, p in e.top]}
                        for e in entries], "refusal": None}
