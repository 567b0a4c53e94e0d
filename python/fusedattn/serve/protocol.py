"""The OpenAI API's requests as the server takes them, and its error bodies.

A request body becomes a ``Request`` or raises ``ApiError`` (a 4xx status and
an OpenAI-style ``{"error": {...}}`` body naming the field at fault). Fields
that do not change a reply (user, metadata, store, ...) are ignored, as OpenAI's
clients send many; those that would and that the server does not implement are
refused unless they hold their no-op value (_NO_OP_VALUES).
"""

from __future__ import annotations

import dataclasses
import json

__all__ = ["ApiError", "Request", "error_body", "parse_request"]

MAX_STOPS = 4  # OpenAI's limit on `stop` strings
MAX_LOGIT_BIAS = 300  # tokens a logit_bias may name (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on a chat's `top_logprobs` (its completions' `logprobs` stops at 5)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return error_body(self.message, kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass
class Request:
    chat: bool
    model: str
    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict] | None  # chat completions
    max_tokens: int | None  # None: what the context and the KV cache leave
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    logprobs: int | None  # each token's log-probability and this many alternatives'; None: none
    echo: bool  # completions: the prompt's text (and with logprobs its tokens') before the reply's
    logit_bias: tuple[tuple[int, float], ...]  # (token id, bias in [-100, 100])
    stop: list[str]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage counts


def _number(body: dict, name: str, default, low: float, high: float, low_open: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, got {json.dumps(value)}", name)
    if not (low < value if low_open else low <= value) or value > high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ApiError(400, f"'{name}' must be in {interval}, got {value}", name)
    return value


def _integer(body: dict, name: str, default, low: int, high: int | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(value)}", name)
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(400, f"'{name}' must be {bound}, got {value}", name)
    return value


def _content_text(content, i: int) -> str:
    """A message's content: a string, or OpenAI's list of parts, of which only
    text parts ({"type": "text", "text": ...}) are served, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a non-empty list of text parts "
                   "({\"type\": \"text\", \"text\": ...}); this server takes text only", "messages")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}] must have a role of system, developer, user or assistant", "messages")
    # OpenAI's "developer" role is its newer name for "system", which chat templates know.
    return [{"role": "system" if m["role"] == "developer" else m["role"], "content": _content_text(m.get("content"), i)}
            for i, m in enumerate(messages)]


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _prompt(body: dict) -> str | list[int]:
    """One prompt: a string or a list of token ids (either alone in a list too)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _token_ids(prompt[0])):
        prompt = prompt[0]
    if _token_ids(prompt):
        return prompt
    if isinstance(prompt, list):
        raise ApiError(400, "'prompt' must be one string or one list of token ids (this server takes one prompt "
                       "per request)", "prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string or list of token ids", "prompt")
    return prompt


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    return stops


# OpenAI fields that would change what a reply holds and that this server does not implement:
# refused unless they hold their no-op value, never ignored (a client that asks for logprobs
# must not get a reply without them as if it had).
_NO_OP_VALUES = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"),  # "auto" with no tools offered calls none
    "response_format": (None, {"type": "text"}), "audio": (None,), "prediction": (None,),
}


def _refuse_unimplemented(body: dict) -> None:
    for name, no_op in _NO_OP_VALUES.items():
        value = body.get(name)
        # == with bools apart from numbers (True == 1): 0.0 is 0, true is not 1
        if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in no_op):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ApiError(400, f"'{name}' is not supported by this server (it would change the reply), got {shown}; "
                           "leave it out", name)


def _logprobs(body: dict, chat: bool) -> int | None:
    """A completion's `logprobs` (how many alternatives); a chat's `logprobs` (true or false)
    with its `top_logprobs`."""
    if not chat:
        if body.get("top_logprobs") not in (None, 0) or isinstance(body.get("top_logprobs"), bool):
            raise ApiError(400, "'top_logprobs' is a chat completion's; a completion takes 'logprobs': N",
                           "top_logprobs")
        if body.get("logprobs") is False:  # as some clients send "none"
            return None
        return _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, f"'logprobs' must be true or false, got {json.dumps(wanted)}", "logprobs")
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top and not wanted:  # 0 asks for nothing either way
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, ids as decimal strings."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias")
    pairs = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or str(int(key)) != key or int(key) in pairs:
            raise ApiError(400, f"'logit_bias' keys must be token ids (decimal, once each), got {json.dumps(key)}",
                           "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"'logit_bias' values must be numbers in [-100, 100], got {json.dumps(value)} "
                           f"for token {key}", "logit_bias")
        pairs[int(key)] = float(value)
    return tuple(pairs.items())


def parse_request(raw: bytes, chat: bool) -> Request:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must name the model (GET /v1/models lists it)", "model")
    _refuse_unimplemented(body)
    echo = body.get("echo")
    if (echo is not None and not isinstance(echo, bool)) or (chat and echo):
        raise ApiError(400, "'echo' must be true or false" if not chat else
                       "'echo' is a completion's (POST /v1/completions), not a chat's", "echo")
    if _integer(body, "n", 1, 1, 1) != 1:
        raise ApiError(400, "'n' must be 1", "n")
    max_tokens = _integer(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                          None if chat else 16, 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {json.dumps(stream)}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    return Request(
        chat=chat, model=model, prompt=None if chat else _prompt(body), messages=_messages(body) if chat else None,
        max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), top_k=_integer(body, "top_k", 0, 0),
        seed=_integer(body, "seed", None, -(2**63), 2**63 - 1),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0), logprobs=_logprobs(body, chat),
        echo=bool(echo), logit_bias=_logit_bias(body),
        stop=_stop(body), stream=stream,
        include_usage=bool(options.get("include_usage")))
