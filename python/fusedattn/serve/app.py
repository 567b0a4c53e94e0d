"""The HTTP side: an aiohttp application with OpenAI's routes.

GET /health (no key needed; the request pool), GET /v1/models, POST
/v1/completions and POST /v1/chat/completions, plain or streamed as
server-sent events that end with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import random
import time
import uuid

from aiohttp import web

from ..engine import Engine, SamplingParams
from ..text_stream import text_and_offsets
from ..token_bytes import TokenBytes
from .logprobs import chat_logprobs, completion_logprobs
from .protocol import ApiError, Request, error_body, parse_request
from .scheduler import SHUTTING_DOWN, Finish, Job, Scheduler, TokenLogprob

__all__ = ["make_app"]

_SCHEDULER = web.AppKey("scheduler", Scheduler)
_MODEL = web.AppKey("model", str)
_ALIASES = web.AppKey("aliases", frozenset)
_TOKEN_NAMES = web.AppKey("token_names", TokenBytes)


def _json(body: dict, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


def make_app(engine: Engine, model_name: str, api_key: str | None = None, aliases: tuple[str, ...] = (),
             **batching) -> web.Application:
    """The application serving engine under model_name (requests may name it by aliases too,
    e.g. the short name it was started with); api_key: the bearer key every /v1 request
    needs; batching: fusedattn.batching.Batcher's options (max_running, kv_positions,
    page_size, token_budget, prefix_caching)."""

    @web.middleware
    async def errors_and_key(request: web.Request, handler):
        if api_key is not None and request.path.startswith("/v1"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _json(ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)").body(), 401)
        try:
            return await handler(request)
        except ApiError as e:
            return _json(e.body(), e.status)
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method
            return _json(error_body(e.reason, "invalid_request_error"), e.status)

    app = web.Application(middlewares=[errors_and_key])
    app[_SCHEDULER] = Scheduler(engine, **batching)
    app[_MODEL] = model_name
    app[_ALIASES] = frozenset(aliases) | {model_name}
    app[_TOKEN_NAMES] = TokenBytes(engine.tokenizer)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)

    async def close(app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, app[_SCHEDULER].close)

    # On shutdown, before aiohttp waits for the handlers: every request still
    # running ends with an error finish, so a stream sends its error event and
    # [DONE] instead of being cut off.
    app.on_shutdown.append(close)
    return app


async def _health(request: web.Request) -> web.Response:
    return _json({"status": "ok", "requests": request.app[_SCHEDULER].pool()})


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "fusedattn"}


async def _models(request: web.Request) -> web.Response:
    return _json({"object": "list", "data": [_model_card(request.app[_MODEL])]})


def _served(request: web.Request, name: str) -> None:
    if name not in request.app[_ALIASES]:
        raise ApiError(404, f"the model '{name}' does not exist (this server has '{request.app[_MODEL]}')", "model",
                       "model_not_found")


async def _model(request: web.Request) -> web.Response:
    _served(request, request.match_info["model"])
    return _json(_model_card(request.app[_MODEL]))


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


def _prompt_ids(engine: Engine, req: Request) -> list[int]:
    if not req.chat:
        if isinstance(req.prompt, str):
            return engine.tokenizer.encode(req.prompt)
        vocab = engine.config.vocab
        if max(req.prompt) >= vocab:
            raise ApiError(400, f"'prompt' holds token id {max(req.prompt)}; this model's ids are below {vocab}",
                           "prompt")
        return req.prompt
    if not getattr(engine.tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
    try:
        return engine.chat_prompt(req.messages)
    except ValueError as e:  # the template refused the messages
        raise ApiError(400, str(e).removeprefix("fusedattn.engine: "), "messages") from None


def _job(request: web.Request, req: Request) -> Job:
    engine = request.app[_SCHEDULER].engine
    _served(request, req.model)
    ids = _prompt_ids(engine, req)
    context = engine.config.context
    room = context - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt is {len(ids)} tokens; the model's context is {context}", "messages"
                       if req.chat else "prompt", "context_length_exceeded")
    batcher = request.app[_SCHEDULER].batcher
    kv_room = batcher.room(len(ids))
    if kv_room < 1:
        raise ApiError(400, f"the prompt is {len(ids)} tokens, more than this server's KV cache holds",
                       "messages" if req.chat else "prompt", "context_length_exceeded")
    # Without max_tokens: as many as the context and the KV cache leave.
    max_tokens = req.max_tokens if req.max_tokens is not None else min(room, kv_room)
    if max_tokens > room:
        raise ApiError(400, f"the prompt ({len(ids)} tokens) and max_tokens ({max_tokens}) exceed the model's "
                       f"context of {context} tokens", "max_tokens", "context_length_exceeded")
    try:
        batcher.check(len(ids), max_tokens)
    except ValueError as e:  # more than the whole KV cache holds
        raise ApiError(400, str(e).removeprefix("fusedattn.batching: "), "max_tokens") from None
    seed = req.seed if req.seed is not None else random.SystemRandom().randrange(2**63)
    vocab = engine.config.vocab
    if any(token >= vocab for token, _ in req.logit_bias):
        raise ApiError(400, f"'logit_bias' names a token id past this model's vocabulary of {vocab}", "logit_bias")
    sampling = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              logit_bias=req.logit_bias)
    return Job(ids, max_tokens, sampling, req.stop, asyncio.get_running_loop(), req.logprobs)


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    req = parse_request(await request.read(), chat)
    job = _job(request, req)
    scheduler = request.app[_SCHEDULER]
    if req.echo:  # the prompt decoded once, off the event loop: its text, and where each token's starts
        job.echo, job.echo_offsets = await asyncio.to_thread(text_and_offsets, scheduler.engine.tokenizer, job.ids)
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": request.app[_MODEL]}  # the served id, also where the request named an alias
    usage = lambda finish: {"prompt_tokens": len(job.ids), "completion_tokens": finish.completion_tokens,  # noqa: E731
                            "total_tokens": len(job.ids) + finish.completion_tokens}
    scheduler.submit(job)
    try:
        if not req.stream:
            parts, tokens = [], []
            while not isinstance(event := await job.events.get(), Finish):
                if isinstance(event, list):
                    tokens += event
                else:
                    parts.append(event)
            _raise_failed(event)
            text = "".join(parts)
            logprobs = _logprobs(request, req, tokens)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs} if chat
                      else {"index": 0, "text": text, "logprobs": logprobs})
            return _json({**head, "object": "chat.completion" if chat else "text_completion",
                          "choices": [{**choice, "finish_reason": event.reason}], "usage": usage(event)})
        return await _stream(request, req, job, head, usage)
    finally:
        job.cancelled.set()  # a finished job ignores it; one whose client left stops at its next token


def _logprobs(request: web.Request, req: Request, tokens: list[TokenLogprob]) -> dict | None:
    """The logprobs of a reply or of a chunk of it: None where the request asked for none."""
    if req.logprobs is None:
        return None
    shape = chat_logprobs if req.chat else completion_logprobs
    return shape(tokens, request.app[_TOKEN_NAMES])


def _raise_failed(finish: Finish) -> None:
    if finish.error == SHUTTING_DOWN:
        raise ApiError(503, f"the request was cancelled: {SHUTTING_DOWN}")
    if finish.error is not None:
        raise ApiError(500, f"the generation failed: {finish.error}")


async def _stream(request: web.Request, req: Request, job: Job, head: dict, usage) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    kind = "chat.completion.chunk" if req.chat else "text_completion"

    async def send(choice: dict | None, **extra) -> None:
        chunk = {**head, "object": kind, "choices": [] if choice is None else [{"index": 0, **choice}], **extra}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

    if req.chat:
        await send({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
    tokens = []  # the TokenLogprobs since the last chunk: they go with the next text
    while not isinstance(event := await job.events.get(), Finish):
        if isinstance(event, list):
            tokens += event
            continue
        logprobs, tokens = _logprobs(request, req, tokens), []
        await send({"delta": {"content": event}, "logprobs": logprobs, "finish_reason": None} if req.chat
                   else {"text": event, "logprobs": logprobs, "finish_reason": None})
    if event.error is not None:  # the status is sent already: an error event, then the end
        await response.write(f"data: {json.dumps(ApiError(500, event.error).body())}\n\n".encode())
    else:
        logprobs = _logprobs(request, req, tokens) if tokens else None  # a last token with no text of its own
        await send({"delta": {}, "logprobs": logprobs, "finish_reason": event.reason} if req.chat
                   else {"text": "", "logprobs": logprobs, "finish_reason": event.reason})
        if req.include_usage:
            await send(None, usage=usage(event))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def model_name(path: str) -> str:
    """The id a GGUF file is served under: its file name without .gguf."""
    return os.path.basename(path).removesuffix(".gguf")
