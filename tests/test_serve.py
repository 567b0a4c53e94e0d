"""fusedattn serve: the OpenAI-compatible server on SmolLM2 (CPU), driven by
the openai client, against the engine's own greedy answers."""

import asyncio
import concurrent.futures
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("transformers", reason="needs the models extra: pip install .[models]")
pytest.importorskip("gguf", reason="needs the models extra: pip install .[models]")
pytest.importorskip("aiohttp", reason="needs the serve extra: pip install .[serve]")
openai = pytest.importorskip("openai", reason="needs the serve extra: pip install .[serve]")

from fusedattn import bench_serve, cli  # noqa: E402
from fusedattn.engine import Engine, SamplingParams, smollm2_path  # noqa: E402
from fusedattn.serve import make_app, model_name  # noqa: E402
from fusedattn.serve.protocol import ApiError, parse_request  # noqa: E402
from fusedattn.serve.running import Running  # noqa: E402
from fusedattn.serve.scheduler import SHUTTING_DOWN, Job, Scheduler  # noqa: E402
from helpers import hf_models  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Attention is all you", "Red, orange, yellow,"]
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    try:
        path = smollm2_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    return Engine.from_gguf(path, cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def server(engine):
    running = Running(make_app(engine, model_name(smollm2_path())))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    (only,) = client.models.list().data
    return only.id


class Reply:
    def __init__(self, status: int, raw: bytes):
        self.status_code, self.raw = status, raw

    def json(self):
        return json.loads(self.raw)


def get(url: str) -> Reply:
    return post(url, None)


def post(url: str, content: bytes | None = None, json_body=None, headers: dict | None = None) -> Reply:
    """A plain HTTP request (POST when there is a body), its status and body whatever the status."""
    if json_body is not None:
        content = json.dumps(json_body).encode()
    request = urllib.request.Request(url, data=content, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return Reply(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read())


def engine_greedy(engine, ids, max_tokens, sampling=None):
    out = []
    for step in engine.generate([ids], max_tokens, sampling):
        if step[0] is not None:
            out.append(step[0])
    return engine.tokenizer.decode(out, skip_special_tokens=True)


def idle(server) -> bool:
    """Whether no request runs or waits and no page of the KV cache is held."""
    pool = get(server.url + "/health").json()["requests"]
    return pool["running"] == pool["waiting"] == pool["kv_pages"]["held"] == 0


def complete(client, model, prompt, **kw):
    return client.completions.create(model=model, prompt=prompt, temperature=0, **kw)


def test_health_and_models(server, model):
    health = get(server.url + "/health").json()
    assert health["status"] == "ok"
    assert {k: health["requests"][k] for k in ("running", "waiting")} == {"running": 0, "waiting": 0}
    assert health["requests"]["kv_pages"]["held"] == 0
    assert model == "SmolLM2-135M-Instruct.Q4_1"


def test_a_completion_is_the_engines_greedy_text_plain_and_streamed(client, model, engine):
    plain = complete(client, model, PROMPTS[0], max_tokens=10)
    expected = engine_greedy(engine, engine.tokenizer.encode(PROMPTS[0]), 10)
    assert plain.choices[0].text == expected and plain.choices[0].finish_reason == "length"
    assert plain.usage.prompt_tokens == len(engine.tokenizer.encode(PROMPTS[0]))
    assert plain.usage.completion_tokens == 10 and plain.usage.total_tokens == plain.usage.prompt_tokens + 10
    chunks = list(complete(client, model, PROMPTS[0], max_tokens=10, stream=True,
                           stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_in_the_models_template_plain_and_streamed(client, model):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=16)
    answer = plain.choices[0].message.content
    assert "Paris" in answer and plain.choices[0].message.role == "assistant"
    assert plain.choices[0].finish_reason == "stop"  # the model ends its turn
    streamed = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=16,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer


def test_concurrent_greedy_requests_each_get_their_own_answer(client, model):
    alone = {p: complete(client, model, p, max_tokens=6).choices[0].text for p in PROMPTS}
    asked = PROMPTS * 3
    with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
        together = list(pool.map(lambda p: complete(client, model, p, max_tokens=6).choices[0].text, asked))
    assert together == [alone[p] for p in asked]


def test_a_stop_string_ends_the_text_before_it(client, model):
    full = complete(client, model, PROMPTS[0], max_tokens=10).choices[0].text
    assert "." in full
    cut = complete(client, model, PROMPTS[0], max_tokens=10, stop=["."])
    assert cut.choices[0].text == full[: full.index(".")] and cut.choices[0].finish_reason == "stop"
    streamed = complete(client, model, PROMPTS[0], max_tokens=10, stop=["."], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_penalties_give_the_engines_penalized_greedy_text(client, model, engine):
    penalties = {"presence_penalty": 0.8, "frequency_penalty": 1.2}
    penalized = complete(client, model, PROMPTS[0], max_tokens=24, **penalties).choices[0].text
    ids = engine.tokenizer.encode(PROMPTS[0])
    assert penalized == engine_greedy(engine, ids, 24, SamplingParams(**penalties))
    assert penalized != engine_greedy(engine, ids, 24)


def test_a_completions_logprobs_name_its_tokens_plain_and_streamed(client, model, engine):
    plain = complete(client, model, PROMPTS[0], max_tokens=12, logprobs=3)
    text, logprobs = plain.choices[0].text, plain.choices[0].logprobs
    assert text == engine_greedy(engine, engine.tokenizer.encode(PROMPTS[0]), 12)  # logprobs change nothing
    assert "".join(logprobs.tokens) == text and len(logprobs.tokens) == plain.usage.completion_tokens
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and max(top.values()) == logprob == top[token] < 0  # greedy: the likeliest
        assert sum(math.exp(p) for p in top.values()) <= 1 + 1e-6
    chunks = [c.choices[0] for c in complete(client, model, PROMPTS[0], max_tokens=12, logprobs=3, stream=True)]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [p for lp in streamed for p in lp.token_logprobs] == logprobs.token_logprobs
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset
    assert complete(client, model, PROMPTS[0], max_tokens=4).choices[0].logprobs is None
    for n in (0, 1):  # sampled tokens outside the top n are in top_logprobs too, as OpenAI's are
        drawn = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=16, temperature=2.0, seed=1,
                                          logprobs=n).choices[0].logprobs
        assert all(token in top and len(top) <= n + 1 for token, top in zip(drawn.tokens, drawn.top_logprobs))
        assert n == 1 or all(len(top) == 1 for top in drawn.top_logprobs)


@pytest.mark.parametrize("stop", [["."], [".\n"], ["zzzzzzzzzz"]], ids=["cut", "cut-mid-token", "held-back"])
def test_logprobs_name_only_the_tokens_of_the_text_sent_and_go_with_it(client, model, stop):
    """A stop string's tokens get no entry, and a stream sends each entry no sooner than the
    chunk its text starts in, however much text the stop strings hold back."""
    plain = complete(client, model, PROMPTS[0], max_tokens=24, logprobs=1, stop=stop).choices[0]
    text, logprobs = plain.text, plain.logprobs
    assert "".join(logprobs.tokens) == text if plain.finish_reason == "stop" else text.startswith(
        "".join(logprobs.tokens[:-1]))
    assert all(offset < len(text) for offset in logprobs.text_offset[:-1])
    sent = ""
    entries = []
    for chunk in complete(client, model, PROMPTS[0], max_tokens=24, logprobs=1, stop=stop, stream=True):
        choice = chunk.choices[0]
        sent += choice.text
        if choice.logprobs is not None:
            assert all(offset < len(sent) or choice.finish_reason for offset in choice.logprobs.text_offset)
            entries += zip(choice.logprobs.tokens, choice.logprobs.text_offset)
    assert sent == text and entries == list(zip(logprobs.tokens, logprobs.text_offset))


def test_a_chats_logprobs_give_each_tokens_bytes_and_alternatives(client, model):
    finishes = set()
    for question in ("Say a word in Japanese.", "What is the capital of France?"):
        messages = [{"role": "user", "content": question}]
        response = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=16,
                                                  logprobs=True, top_logprobs=2)
        reply = response.choices[0]
        content = reply.logprobs.content
        assert len(content) == response.usage.completion_tokens and len(content) > 2
        finishes.add(reply.finish_reason)
        if reply.finish_reason == "stop":  # the end-of-turn token has its entry too
            assert content[-1].token == "<|im_end|>"
            content = content[:-1]
        assert bytes(b for item in content for b in item.bytes).decode() == reply.message.content
        for item in content:
            logprobs = [t.logprob for t in item.top_logprobs]
            assert logprobs == sorted(logprobs, reverse=True) and len(logprobs) == 2
            assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob
        streamed = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=16,
                                                  logprobs=True, stream=True)
        items = [i for c in streamed if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
        assert [(i.token, i.logprob, i.top_logprobs) for i in items] == [
            (i.token, i.logprob, []) for i in reply.logprobs.content]
    assert finishes == {"stop", "length"}
    plain = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=4)
    assert plain.choices[0].logprobs is None


def prompt_logprobs(engine, ids):
    """Each prompt token's log-probability after the ones before it, from one forward of the prompt."""
    c, n = engine.config, len(ids)
    caches = [tuple(torch.zeros(1, c.kv_heads, n, c.head_dim, dtype=engine.dtype) for _ in range(2))
              for _ in range(c.layers)]
    logits = engine.forward_packed(torch.tensor(ids), torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                                   torch.zeros(1, dtype=torch.int32), caches, None, torch.arange(n - 1))
    return logits.double().log_softmax(-1)[torch.arange(n - 1), torch.tensor(ids[1:])].tolist()


def test_echo_gives_the_prompt_and_with_logprobs_its_tokens_as_evaluation_harnesses_read_them(client, model, engine):
    echoed = complete(client, model, PROMPTS[0], max_tokens=5, echo=True).choices[0].text
    assert echoed == PROMPTS[0] + complete(client, model, PROMPTS[0], max_tokens=5).choices[0].text
    (one,) = engine.tokenizer.encode("Hi")  # a prompt of one token: nothing predicts it
    short = complete(client, model, "Hi", max_tokens=2, echo=True, logprobs=0).choices[0]
    assert short.logprobs.tokens[0] == "Hi" and short.logprobs.token_logprobs[0] is None
    assert short.logprobs.text_offset[:2] == [0, 2] and short.text.startswith("Hi")
    ids = engine.tokenizer.encode(PROMPTS[3] + " green")
    for stream in (False, True):  # lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs
        reply = complete(client, model, ids, max_tokens=1, echo=True, logprobs=1, stream=stream)
        choices = [c.choices[0] for c in reply] if stream else [reply.choices[0]]
        logprobs = [c.logprobs for c in choices if c.logprobs is not None]
        tokens = [t for lp in logprobs for t in lp.tokens]
        token_logprobs = [p for lp in logprobs for p in lp.token_logprobs]
        top = [t for lp in logprobs for t in lp.top_logprobs]
        offsets = [o for lp in logprobs for o in lp.text_offset]
        text = "".join(c.text for c in choices)
        assert len(tokens) == len(ids) + 1 and token_logprobs[0] is None and top[0] is None
        assert token_logprobs[1:-1] == pytest.approx(prompt_logprobs(engine, ids), abs=1e-3)
        assert all(len(t) <= 2 and t[token] == p <= max(t.values())  # the likeliest, and the prompt's own
                   for token, t, p in zip(tokens[1:], top[1:], token_logprobs[1:]))
        assert text.startswith(PROMPTS[3] + " green") and offsets[len(ids)] == len(PROMPTS[3] + " green")
        assert [text[o:o + len(t)] for o, t in zip(offsets[:-1], tokens[:-1])] == tokens[:-1]


def test_a_logit_bias_of_minus_100_bans_a_token(client, model, engine):
    (paris,) = engine.tokenizer.encode(" Paris")
    assert complete(client, model, PROMPTS[0], max_tokens=3).choices[0].text.startswith(" Paris")
    banned = complete(client, model, PROMPTS[0], max_tokens=12, logit_bias={str(paris): -100}, logprobs=1)
    assert "Paris" not in banned.choices[0].text.split(".")[0] and " Paris" not in banned.choices[0].logprobs.tokens


def test_sampling_follows_the_seed(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=12, temperature=1.3,
                                         seed=seed).choices[0].text

    assert sample(5) == sample(5)
    assert len({sample(5), sample(6), sample(7)}) > 1


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "hi"}).encode(), 400, "model"),
    (json.dumps({"model": "M"}).encode(), 400, "prompt"),
    (json.dumps({"model": "M", "prompt": "hi", "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "M", "prompt": "hi", "max_tokens": 10**9}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "M", "prompt": "hi " * 9000}).encode(), 400, "prompt"),
    (json.dumps({"model": "M", "prompt": "hi", "temperature": 5}).encode(), 400, "temperature"),
    (json.dumps({"model": "M", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "stop"),
    (json.dumps({"model": "M", "prompt": "hi", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404, "model"),
    (json.dumps({"model": "M", "prompt": "hi", "logprobs": 21}).encode(), 400, "logprobs"),
    (json.dumps({"model": "M", "prompt": "hi", "logprobs": True}).encode(), 400, "logprobs"),
    (json.dumps({"model": "M", "prompt": "hi", "top_logprobs": 2}).encode(), 400, "top_logprobs"),
    (json.dumps({"model": "M", "prompt": "hi", "echo": 1}).encode(), 400, "echo"),
    (json.dumps({"model": "M", "prompt": "hi", "logit_bias": {"x": 1}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": "M", "prompt": "hi", "logit_bias": {"12": 101}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": "M", "prompt": "hi", "logit_bias": {"012": 1}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": "M", "prompt": "hi", "logit_bias": {"9999999": 1}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": "M", "prompt": [1, 2, 10**7]}).encode(), 400, "prompt"),
    (json.dumps({"model": "M", "prompt": [1, -2]}).encode(), 400, "prompt"),
    (json.dumps({"model": "M", "prompt": [[1, 2], [3]]}).encode(), 400, "prompt"),
    (json.dumps({"model": "M", "prompt": "hi", "presence_penalty": 2.5}).encode(), 400, "presence_penalty"),
    (json.dumps({"model": "M", "prompt": "hi", "frequency_penalty": "1"}).encode(), 400, "frequency_penalty"),
])
def test_bad_requests_get_an_openai_error_and_the_server_serves_on(server, model, body, status, param):
    response = post(server.url + "/v1/completions", body.replace(b'"M"', json.dumps(model).encode()))
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert get(server.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_fields_that_would_change_the_reply_are_refused_unless_they_are_no_ops(chat):
    """What this server does not implement (best_of, suffix, tools, a JSON
    response format, ...) is a 400 naming the field, never silently ignored; the same fields at
    their no-op values (as some clients send them) are taken."""
    base = {"model": "M", **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    refused = {"best_of": 2, "suffix": "x",
               "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
               "response_format": {"type": "json_object"}}
    for name, value in refused.items():
        with pytest.raises(ApiError) as e:
            parse_request(json.dumps({**base, name: value}).encode(), chat)
        assert (e.value.status, e.value.param) == (400, name) and "not supported" in e.value.message
    taken = {"logprobs": False if chat else None, "echo": False, "best_of": 1, "logit_bias": {}, "tools": [],
             "tool_choice": "auto",
             "response_format": {"type": "text"}, "top_logprobs": None, "user": "someone"}
    assert parse_request(json.dumps({**base, **taken}).encode(), chat).model == "M"


def test_a_chats_logprobs_fields_are_checked():
    base = {"model": "M", "messages": [{"role": "user", "content": "hi"}]}
    for fields, param in (({"logprobs": 1}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                          ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"echo": True}, "echo")):
        with pytest.raises(ApiError) as e:
            parse_request(json.dumps({**base, **fields}).encode(), True)
        assert (e.value.status, e.value.param) == (400, param)
    for fields, logprobs in (({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0),
                             ({"logprobs": True, "top_logprobs": 5}, 5), ({"logprobs": False, "top_logprobs": 0}, None)):
        assert parse_request(json.dumps({**base, **fields}).encode(), True).logprobs == logprobs
    completion = {"model": "M", "prompt": "hi"}
    for fields, logprobs in (({"logprobs": False}, None), ({"logprobs": 0}, 0), ({"logprobs": 3, "top_logprobs": 0}, 3)):
        assert parse_request(json.dumps({**completion, **fields}).encode(), False).logprobs == logprobs


def test_chat_requests_are_checked_too(server, model):
    for messages in ([], [{"role": "robot", "content": "hi"}], [{"role": "user", "content": 3}],
                     [{"role": "user", "content": []}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]):
        response = post(server.url + "/v1/chat/completions", json_body={"model": model, "messages": messages})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_content_parts_and_the_developer_role_are_the_plain_request(client, model):
    """OpenAI's newer request shapes: content as a list of text parts, and
    "developer" for "system"; each gives the same greedy answer as the plain form."""
    def answer(messages):
        return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                              max_tokens=8).choices[0].message.content

    plain = answer([{"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": "What is the capital of France?"}])
    parts = answer([{"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
                    {"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                                 {"type": "text", "text": "of France?"}]}])
    assert parts == plain


def test_a_model_is_retrieved_by_name(server, client, model):
    assert client.models.retrieve(model).id == model
    missing = get(server.url + "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_without_max_tokens_a_chat_takes_what_the_kv_cache_holds(engine, model):
    """A chat without max_tokens: up to the end of the context, or of a KV
    cache shorter than the context (64 positions here, against SmolLM2's 8192)."""
    running = Running(make_app(engine, model, kv_positions=64))
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to 100."}],
                                               temperature=0)
        assert 1 <= reply.usage.completion_tokens <= 64 - reply.usage.prompt_tokens + 1
        assert reply.choices[0].finish_reason in ("stop", "length")
        long = post(running.url + "/v1/chat/completions",
                    json_body={"model": model, "messages": [{"role": "user", "content": "hi " * 100}]})
        assert long.status_code == 400 and long.json()["error"]["param"] == "messages"
        assert "KV cache" in long.json()["error"]["message"]
        given = post(running.url + "/v1/completions", json_body={"model": model, "prompt": "hi " * 100,
                                                                  "max_tokens": 1})
        assert given.status_code == 400 and given.json()["error"]["param"] == "prompt"  # the prompt, not max_tokens
    finally:
        running.stop()


def test_a_conversation_the_chat_template_refuses_is_a_bad_request(server, engine, model, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    response = post(server.url + "/v1/chat/completions",
                    json_body={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert response.json()["error"]["message"].startswith("the model's chat template refused the conversation")
    assert "roles must alternate" in response.json()["error"]["message"]
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    response = post(server.url + "/v1/chat/completions",
                    json_body={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and "use /v1/completions" in response.json()["error"]["message"]
    assert get(server.url + "/health").json()["status"] == "ok"


def test_a_job_submitted_after_the_scheduler_closed_fails_at_once(engine):
    scheduler = Scheduler(engine, kv_positions=64)
    scheduler.close()

    async def submit():
        job = Job([1, 2, 3], 4, SamplingParams(), [], asyncio.get_running_loop())
        scheduler.submit(job)
        return await asyncio.wait_for(job.events.get(), 10)

    finish = asyncio.run(submit())
    assert finish.reason == "error" and finish.error == SHUTTING_DOWN


def test_a_request_still_running_when_the_server_stops_gets_a_503(engine, model):
    running = Running(make_app(engine, model))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, running.url + "/v1/completions", json_body={
            "model": model, "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0})
        deadline = time.monotonic() + 30
        while get(running.url + "/health").json()["requests"]["running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        running.stop()
        response = reply.result(60)
    assert response.status_code == 503 and SHUTTING_DOWN in response.json()["error"]["message"]


def test_a_thousand_malformed_requests_leave_it_healthy(server, client, model):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for i in range(1000):  # one kept-alive connection, as a client in a loop would
        connection.request("POST", "/v1/completions", body=b"{" * (i % 7 + 1))
        response = connection.getresponse()
        assert response.status == 400 and b'"error"' in response.read()
    connection.close()
    assert complete(client, model, PROMPTS[0], max_tokens=2).choices[0].text


def test_a_client_that_leaves_mid_stream_cancels_its_request(server, model):
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 4000, "temperature": 0, "stream": True}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.close()  # mid-stream
    deadline = time.monotonic() + 20  # the 4000 tokens would take minutes
    while not idle(server):
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.2)


def test_sixty_four_streaming_clients_of_mixed_lengths_are_batched_and_all_complete(server, client, model):
    asked = [(PROMPTS[i % 4] + " " * (i % 3), 4 + i % 13) for i in range(64)]
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], get(server.url + "/health").json()["requests"]["running"])
            time.sleep(0.02)

    def stream(prompt, max_tokens):
        chunks = list(complete(client, model, prompt, max_tokens=max_tokens, stream=True,
                               stream_options={"include_usage": True}))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda a: stream(*a), asked))
    finally:
        done.set()
        watcher.join()
    for (prompt, max_tokens), (text, usage) in zip(asked, results):
        assert usage.completion_tokens <= max_tokens and usage.completion_tokens >= 1
        assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
    # Equal requests stream equal texts, whatever they were batched with.
    by_request = {}
    for request, (text, usage) in zip(asked, results):
        assert by_request.setdefault(request, (text, usage.completion_tokens)) == (text, usage.completion_tokens)
    assert peak[0] > 1  # requests ran together
    assert idle(server)


def test_sixteen_clients_leaving_mid_stream_leave_no_page_held(server, model):
    body = json.dumps({"model": model, "prompt": PROMPTS[1], "max_tokens": 4000, "temperature": 0, "stream": True})
    connections = []
    for _ in range(16):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        connections.append(connection)
    for connection in connections:
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        connection.close()
    deadline = time.monotonic() + 30
    while not idle(server):
        assert time.monotonic() < deadline, get(server.url + "/health").json()
        time.sleep(0.2)


def test_a_kv_cache_that_runs_out_queues_requests_instead_of_failing(engine, model):
    # 12 pages of 16 positions: each request needs up to 4, so they take turns
    # and some are preempted and computed again.
    running = Running(make_app(engine, model, kv_positions=192))
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        asked = [PROMPTS[i % 4] for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
            replies = list(pool.map(lambda p: complete(client, model, p, max_tokens=40), asked))
        assert all(r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
                   for r in replies)
        pool = get(running.url + "/health").json()["requests"]
        assert pool["preemptions"] > 0
        assert pool["kv_pages"]["total"] == 12 and pool["kv_pages"]["held"] == 0
        too_long = post(running.url + "/v1/completions", json_body={"model": model, "prompt": PROMPTS[0],
                                                                     "max_tokens": 500})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
        assert "pages of the KV cache, which has 12" in too_long.json()["error"]["message"]
    finally:
        running.stop()


def test_an_api_key_is_checked_in_constant_time_on_v1_routes(engine, model):
    running = Running(make_app(engine, model, api_key=KEY))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert post(running.url + "/v1/completions", json_body={}).status_code == 401
        keyed = openai.OpenAI(base_url=running.url + "/v1", api_key=KEY, max_retries=0)
        assert keyed.models.list().data[0].id == model
        assert get(running.url + "/health").status_code == 200  # no key needed
    finally:
        running.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_serve_command_serves_and_stops_on_sigterm_mid_stream(tmp_path, model):
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "fusedattn", "serve", "--port", str(port), "--cache-dir",
                                str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except OSError:  # not listening yet
                pass
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.5)
        # Started without --model: the short name "smollm2" names the served file too.
        aliased = post(f"http://127.0.0.1:{port}/v1/completions",
                       json_body={"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0})
        assert aliased.status_code == 200 and aliased.json()["model"] == model, aliased.raw
        assert get(f"http://127.0.0.1:{port}/v1/models/smollm2").json()["id"] == model
        body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 4000, "temperature": 0, "stream": True}
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", "/v1/completions", body=json.dumps(body))
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        process.send_signal(signal.SIGTERM)  # with the request still streaming
        assert process.wait(30) == 0
        try:
            rest = response.read()  # the stream ends: closed by the server, not left hanging
        except (http.client.IncompleteRead, ConnectionError) as e:
            rest = getattr(e, "partial", b"")
        # Cancelled, not run to its 4000 tokens: an error event, then the end of the stream.
        events = [line for line in rest.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]", rest[-300:]
        assert "shutting down" in json.loads(events[-2].removeprefix(b"data: "))["error"]["message"]
        assert not any(b'"finish_reason": "length"' in e for e in events)
        connection.close()
        assert f"http://127.0.0.1:{port}/v1" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["--api-key", ""], "--api-key is empty: give the key clients must send, or leave the option out"),
    (["--model", "/no/such.gguf"], "--model /no/such.gguf: no such file"),
])
def test_serve_command_line_errors(argv, message):
    done = subprocess.run([sys.executable, "-m", "fusedattn", "serve", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"fusedattn serve: error: {message}"]


def test_bench_serve_loads_a_running_server_at_each_rate(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert cli.main(["bench", "--serve", "--url", server.url, "--rates", "5,50", "--requests", "4", "--no-progress",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["rate"] for row in result["online"]] == [5, 50]
    for row in result["online"]:
        assert row["requests"] == 4 and row["failed"] == 0 and row["output_tokens"] >= 4
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"] and 0 < row["itl_ms_p50"] <= row["itl_ms_p99"]
        assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens"] / row["seconds"])
    table = capsys.readouterr().out
    assert "| 50 |" in table and "SmolLM2-135M-Instruct.Q4_1" in table
    assert idle(server)


def test_bench_serve_offline_counts_each_requests_own_tokens(engine, monkeypatch):
    # transformers' model of the file as the bench loads it, from the session's cache.
    monkeypatch.setattr(bench_serve, "_transformers_model",
                        lambda engine, path: hf_models.causal_lm(path, "sdpa", str(engine.device), engine.dtype))
    cfg = bench_serve.ServeConfig(requests=3, prompt_words=[8, 20], output_tokens=[3, 6], max_running=2)
    # generate only: generate_batch's start-up takes half a minute on the CPU (it ran by hand).
    rows = bench_serve.offline(engine, smollm2_path(), cfg, ["generate"], progress=False)
    wanted = sum(n for _, n in bench_serve.requests(cfg))
    assert [r["method"] for r in rows] == ["fusedattn", "generate"]
    assert all(r["output_tokens"] == wanted and r["output_tokens_per_s"] > 0 for r in rows)
    assert rows[0]["fusedattn_x"] == 1.0


def test_bench_serve_says_when_nothing_serves_at_the_url(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--serve", "--url", f"http://127.0.0.1:{_free_port()}"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("fusedattn bench: error: --url http://127.0.0.1:") and "cannot list its models" in line


def test_a_failed_engine_step_fails_its_requests_and_the_server_serves_on(server, client, model, engine, monkeypatch):
    def broken(*args):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(engine, "forward_packed", broken)
    failed = post(server.url + "/v1/completions", json_body={"model": model, "prompt": PROMPTS[0], "max_tokens": 3})
    assert failed.status_code == 500 and "the device fell over" in failed.json()["error"]["message"]
    monkeypatch.undo()
    assert complete(client, model, PROMPTS[0], max_tokens=3).usage.completion_tokens == 3
    assert idle(server)


def test_bench_serve_decode_step_counts_the_bytes_a_step_reads(engine):
    c = engine.config
    step = bench_serve.decode_step(engine, bench_serve.ServeConfig(max_running=4), prompt_tokens=16, steps=3)
    # SmolLM2 ties its embedding to the output layer, and on the CPU the
    # engine keeps the file's blocks: a step reads every tensor of the file once.
    import gguf

    assert step["weight_bytes"] == sum(int(t.n_bytes) for t in gguf.GGUFReader(smollm2_path()).tensors)
    # 4 requests at 16 cached positions, 2 steps of warm-up; the 3 timed steps read 19, 20 and 21 keys of every layer.
    assert step["kv_bytes"] == 4 * c.layers * 20 * 2 * c.kv_heads * c.head_dim * 4
    assert step["step_ms"] > 0 and step["bandwidth_GBps"] > 0
    assert step["x_roofline"] == pytest.approx(step["step_ms"] / step["roofline_ms"])
