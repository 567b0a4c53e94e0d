"""Continuous batching (fusedattn.batching) on the CPU, over small random
decoders: a request's logits are the same bits alone, in any batch, in any
chunking and from shared prefix pages; pages run out without a failure and
all come back."""

import collections
import gc

import pytest
import torch

import fusedattn.batching as batching
from fusedattn.batching import Batcher
from fusedattn.engine import SamplingParams, _linear
from fusedattn.gguf_blocks import BlockStack
from helpers.tiny_engine import tiny_engine


@pytest.fixture(scope="module", params=[(0, None, None), (100, None, None), (0, "q4_1", None), (0, "q4_1", "q8_0")],
                ids=["llama", "sliding", "llama-q4_1", "llama-q4_1-v-q8_0"])
def engine(request):
    sliding, blocks, value_blocks = request.param
    engine = tiny_engine(sliding_window=sliding, blocks=blocks, value_blocks=value_blocks)
    assert isinstance(engine.layers[0]["qkv"], BlockStack) == (value_blocks is not None)
    return engine


@pytest.fixture
def run(monkeypatch):
    """run(batcher, requests, arrivals=None) adds each (prompt, max_tokens) at
    the step its arrival gives (default: all before the first), steps until
    every request has ended and returns, per request, the logits rows it
    sampled from [steps, vocab] and its tokens."""
    rows = {}  # id(a request's SamplingParams) -> its logits rows
    sample = Batcher._sample

    def recording(self, logits, seqs):
        for row, seq in zip(logits, seqs):
            rows.setdefault(id(seq.sampling), []).append(row.clone())
        return sample(self, logits, seqs)

    monkeypatch.setattr(Batcher, "_sample", recording)

    def run(batcher, requests, arrivals=None, sampling=SamplingParams):
        rows.clear()  # ids of requests of an earlier run may be reused
        arrivals = arrivals or [0] * len(requests)
        seqs, step = [None] * len(requests), 0
        while None in seqs or batcher.busy():
            for i, (prompt, max_tokens) in enumerate(requests):
                if arrivals[i] == step:
                    seqs[i] = batcher.add(prompt, max_tokens, sampling())
            batcher.step()
            step += 1
            assert step < 10_000
        return [torch.stack(rows[id(s.sampling)]) for s in seqs], [s.tokens for s in seqs]

    return run


def count_calls(obj, name):
    """Wraps obj.name so that each call adds one to the list's item, which it returns."""
    count, inner = [0], getattr(obj, name)

    def counting(*args):
        count[0] += 1
        return inner(*args)

    setattr(obj, name, counting)
    return count


def prompts(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def test_linear_rows_do_not_depend_on_the_rows_beside_them():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 64, generator=g), torch.randn(96, 64, generator=g)
    whole = _linear(x, w)
    for rows in ([0], [3, 7, 11], list(range(13)), [39, 0, 5, 6, 20]):
        assert torch.equal(_linear(x[rows], w), whole[rows])


def test_a_request_gives_the_same_bits_alone_and_in_any_batch(engine, run):
    requests = list(zip(prompts(5, 300, 600, 1, 260, 40), [6, 5, 4, 7, 3, 8]))
    alone = [run(Batcher(engine), [r]) for r in requests]
    # Small budgets chunk the long prompts (at multiples of the query tile) and
    # put prefill chunks beside decoding tokens; arrivals are staggered.
    for budget, arrivals in ((256, [0, 0, 1, 2, 2, 5]), (512, [3, 0, 0, 0, 1, 1]), (4096, None)):
        logits, tokens = run(Batcher(engine, token_budget=budget), requests, arrivals)
        for i, (rows, toks) in enumerate(alone):
            assert torch.equal(logits[i], rows[0]), (budget, i)
            assert tokens[i] == toks[0]


def test_a_step_mixes_prefill_chunks_and_decoding_tokens(engine):
    batcher = Batcher(engine, token_budget=256)
    short, long = prompts(4, 700)
    first = batcher.add(short, 10)
    batcher.step()  # the short prompt's prefill
    second = batcher.add(long, 2)
    for step, expected_cached in enumerate((256, 512, 700)):
        batcher.step()
        assert second.cached == expected_cached  # chunks of the query tile, then the rest
        assert len(first.tokens) == 2 + step  # a decoding token in every step beside them
    assert len(second.tokens) == 1


def test_shared_prefix_pages_are_computed_once_and_give_the_same_bits(engine, run):
    prefix = prompts(600, seed=1)[0]
    first, second = [prefix + tail for tail in prompts(10, 30, seed=2)]
    fresh = run(Batcher(engine), [(second, 5)])
    batcher = Batcher(engine)
    run(batcher, [(first, 5)])
    usage = batcher.pool.usage()
    # Pages of exact positions (whole query tiles: 512 of 600) stay named once the request ends.
    assert usage["held"] == 0 and usage["cached"] == 512 // 16
    seq = batcher.add(second, 5)
    batcher.step()
    assert seq.cached == len(second)  # one step: 512 positions shared, the rest computed
    while batcher.busy():
        batcher.step()
    again = run(batcher, [(second, 5)])
    assert torch.equal(again[0][0], fresh[0][0]) and again[1] == fresh[1]


def test_pages_that_run_out_make_requests_wait_or_be_preempted_and_every_request_ends(engine, run):
    requests = list(zip(prompts(20, 33, 7, 50, 12, 41), [30] * 6))
    batcher = Batcher(engine, kv_positions=160, page_size=16)  # 10 pages; a request needs up to 6
    logits, tokens = run(batcher, requests)
    counts = batcher.counts()
    assert counts["preemptions"] > 0
    assert [len(t) for t in tokens] == [30] * 6
    assert counts["running"] == counts["waiting"] == 0 and counts["kv_pages"]["held"] == 0
    alone = [run(Batcher(engine), [r]) for r in requests]
    # A request never preempted keeps its bits; the first admitted never is.
    assert torch.equal(logits[0], alone[0][0][0])


def test_sampled_requests_follow_their_own_seed_in_any_batch(engine, run):
    requests = list(zip(prompts(9, 17, 30), [12] * 3))
    seeded = iter(range(100))
    sampled = lambda: SamplingParams(temperature=1.0, top_k=50, seed=next(seeded) % 3)  # noqa: E731
    alone = [run(Batcher(engine), [r], sampling=sampled)[1][0] for r in requests]
    together = run(Batcher(engine), requests, arrivals=[0, 2, 3], sampling=sampled)[1]
    assert together == alone and len({tuple(t) for t in alone}) == 3


def apply_penalties(rows, tokens, presence, frequency, bias=()):
    """The OpenAI formula, row by row: the logits each token was chosen from, plus
    its bias, less frequency per earlier time a token was chosen and presence once."""
    out = rows.clone()
    for token, value in bias:
        out[:, token] += value
    for step in range(len(rows)):
        for token, count in collections.Counter(tokens[:step]).items():
            out[step, token] -= frequency * count + presence
    return out


def test_a_logit_bias_moves_its_tokens_alone_and_in_any_batch(engine, run):
    requests = list(zip(prompts(9, 17, 30), [12] * 3))
    plain_rows, plain = run(Batcher(engine), requests)
    banned, favoured = plain[0][0], 77  # the first request's first greedy token, and a token of none
    bias = ((banned, -100.0), (favoured, 3.0))
    biased = lambda: SamplingParams(logit_bias=bias, frequency_penalty=0.5)  # noqa: E731
    rows, together = run(Batcher(engine), requests, arrivals=[0, 2, 3], sampling=biased)
    alone = [run(Batcher(engine), [r], sampling=biased)[1][0] for r in requests]
    assert together == alone and together[0][0] != banned and banned not in sum(together, [])
    for logits, tokens in zip(rows, together):
        assert apply_penalties(logits, tokens, 0.0, 0.5, bias).argmax(-1).tolist() == tokens
    steps = list(engine.generate([p for p, _ in requests], 12, SamplingParams(logit_bias=bias), stop_tokens=set()))
    assert [list(column) for column in zip(*steps)] == run(Batcher(engine), requests,
                                                           sampling=lambda: SamplingParams(logit_bias=bias))[1]


def test_a_logit_bias_bans_tokens_from_sampled_requests_too(engine, run):
    requests = list(zip(prompts(9, 17, 30), [16] * 3))
    seeds = iter(range(100))
    drawn = lambda **bias: lambda: SamplingParams(temperature=1.5, seed=next(seeds) % 3, **bias)  # noqa: E731
    free = sum(run(Batcher(engine), requests, sampling=drawn())[1], [])
    banned = sorted(set(free))[: len(set(free)) // 2]  # half the tokens the unbiased draws took
    biased = sum(run(Batcher(engine), requests, sampling=drawn(logit_bias=tuple((t, -100.0) for t in banned)))[1], [])
    assert not set(biased) & set(banned) and len(biased) == len(free)


@pytest.mark.parametrize("presence, frequency", [(0.0, 1.5), (2.0, 0.0), (-0.5, 1.5)])
def test_penalties_take_each_earlier_token_off_its_logit_alone_and_in_any_batch(engine, run, presence, frequency):
    requests = list(zip(prompts(9, 17, 30), [16] * 3))
    penalized = lambda: SamplingParams(presence_penalty=presence, frequency_penalty=frequency)  # noqa: E731
    rows, alone = zip(*[(r[0], t[0]) for r, t in (run(Batcher(engine), [q], sampling=penalized) for q in requests)])
    together = run(Batcher(engine), requests, arrivals=[0, 2, 3], sampling=penalized)[1]
    plain = run(Batcher(engine), requests, arrivals=[0, 2, 3])[1]
    assert list(alone) == together
    assert together != plain  # the penalties changed some tokens
    for logits, tokens in zip(rows, alone):  # greedy over the penalized logits
        assert apply_penalties(logits, tokens, presence, frequency).argmax(-1).tolist() == tokens


def test_generate_applies_the_penalties_as_the_batcher_does(engine, run):
    sampling = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    requests = list(zip(prompts(9, 17), [12] * 2))
    batched = run(Batcher(engine), requests, sampling=lambda: sampling)[1]
    steps = list(engine.generate([p for p, _ in requests], 12, sampling, stop_tokens=set()))
    assert [list(column) for column in zip(*steps)] == batched


def test_logprobs_are_the_log_softmax_of_the_logits_each_token_came_from(engine, run, monkeypatch):
    events = []
    step = Batcher.step
    monkeypatch.setattr(Batcher, "step", lambda self: events.extend(e := step(self)) or e)
    requests = list(zip(prompts(9, 17), [8, 8]))
    sampling = iter([SamplingParams(), SamplingParams(temperature=1.0, seed=3, frequency_penalty=0.5)])
    batcher = Batcher(engine)
    add = batcher.add
    batcher.add = lambda *args: add(*args, logprobs=4)
    rows, tokens = run(batcher, requests, sampling=lambda: next(sampling))
    for logits, toks in zip(rows, tokens):
        mine = [e for e in events if e.sequence.tokens is toks]
        assert [e.token for e in mine] == toks
        expected = logits.double().log_softmax(-1)
        for e, row in zip(mine, expected):
            assert e.logprob == pytest.approx(float(row[e.token]), abs=1e-5)
            best = row.topk(4)
            assert [t for t, _ in e.top] == best.indices.tolist()
            assert [p for _, p in e.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    plain = [e for e in events if e.sequence.tokens is tokens[0]]
    assert all(e.token == e.top[0][0] for e in plain)  # greedy: the likeliest


@pytest.mark.gpu
def test_on_cuda_adjusted_and_scored_requests_follow_the_formula_through_the_graphs(run, monkeypatch):
    """Penalties, a logit bias and logprobs on CUDA, where decoding steps replay captured graphs
    (whose logits buffer nothing may write into): each token is the argmax of its recorded
    logits so adjusted, and each logprob their log-softmax."""
    engine = tiny_engine(head_dim=64, device="cuda")
    events = []
    step = Batcher.step
    monkeypatch.setattr(Batcher, "step", lambda self: events.extend(e := step(self)) or e)
    bias = ((3, -100.0), (200, 2.0))
    adjusted = lambda: SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, logit_bias=bias)  # noqa: E731
    requests = list(zip(prompts(9, 40, 17), [10] * 3))

    batcher = Batcher(engine, max_running=4)
    add = batcher.add
    batcher.add = lambda *args: add(*args, logprobs=2)
    decode_steps = count_calls(batcher, "_run_decode")
    rows, together = run(batcher, requests, sampling=adjusted)
    assert decode_steps[0] > 0
    for logits, tokens in zip(rows, together):
        logits = logits.float().cpu()
        assert apply_penalties(logits, tokens, 0.5, 0.5, bias).argmax(-1).tolist() == tokens
        mine = [e for e in events if e.sequence.tokens is tokens]
        expected = logits.double().log_softmax(-1)
        assert [e.logprob for e in mine] == pytest.approx([float(r[t]) for r, t in zip(expected, tokens)], abs=1e-4)


def test_prompt_logprobs_come_from_every_prompt_position_in_any_chunking_and_share_no_prefix(engine):
    shared = prompts(520, seed=1)[0]  # two query tiles (256 on the CPU) that a prefix could share
    requests = [shared + [5, 6], shared + [7], prompts(300)[0], [9]]
    batcher = Batcher(engine, token_budget=1)  # the least: prompts in chunks of a query tile
    seqs = [batcher.add(shared + [1], 3)]  # a request without prompt logprobs that names the shared pages
    while batcher.busy():
        batcher.step()
    seqs = [batcher.add(prompt, 3, logprobs=2, prompt_logprobs=True) for prompt in requests]
    steps = 0
    while batcher.busy():
        batcher.step()
        steps += 1
    assert steps > 3 and batcher.pool.usage()["held"] == 0
    for seq, prompt in zip(seqs, requests):
        n = len(prompt)
        caches = [tuple(torch.zeros(1, engine.config.kv_heads, n, engine.config.head_dim) for _ in range(2))
                  for _ in range(engine.config.layers)]
        logits = engine.forward_packed(torch.tensor(prompt), torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                                       torch.zeros(1, dtype=torch.int32), caches, None, torch.arange(n))
        expected = logits.double().log_softmax(-1)
        assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == n
        for position in range(1, n):
            logprob, top = seq.prompt_logprobs[position]
            row = expected[position - 1]
            assert logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
            assert [t for t, _ in top] == row.topk(2).indices.tolist()


def test_a_preempted_request_keeps_its_prompt_logprobs_and_does_not_compute_them_again(engine, monkeypatch):
    batcher = Batcher(engine, max_running=4, kv_positions=1024, token_budget=1)  # too few pages for all four
    requests = [prompts(300, seed=s)[0] for s in range(4)]
    rows = []
    run = Batcher._run

    def counting(self, batch):
        logits, prompt_rows = run(self, batch)
        rows.extend((seq, position, len(seq.tokens)) for seq, position in prompt_rows)
        return logits, prompt_rows

    monkeypatch.setattr(Batcher, "_run", counting)
    seqs = [batcher.add(prompt, 100, logprobs=1, prompt_logprobs=True) for prompt in requests]
    while batcher.busy():
        batcher.step()
    assert batcher.preemptions > 0 and all(len(seq.tokens) == 100 for seq in seqs)
    assert all(sampled == 0 for _, _, sampled in rows)  # none computed again once the request has sampled
    assert {(id(seq), position) for seq, position, _ in rows} == {
        (id(seq), position) for seq in seqs for position in range(1, len(seq.prompt))}
    for seq in seqs:
        alone = Batcher(engine)
        again = alone.add(seq.prompt, 1, logprobs=1, prompt_logprobs=True)
        while alone.busy():
            alone.step()
        assert seq.prompt_logprobs == again.prompt_logprobs


def test_prompt_logprobs_need_logprobs(engine):
    with pytest.raises(ValueError, match="prompt_logprobs needs logprobs"):
        Batcher(engine).add([1, 2], 3, prompt_logprobs=True)


def test_stop_tokens_and_cancellation_end_requests_and_give_pages_back(engine):
    batcher = Batcher(engine)
    probe = batcher.add(prompts(8)[0], 3)
    while batcher.busy():
        batcher.step()
    stop = probe.tokens[1]
    until_stop = probe.tokens[: probe.tokens.index(stop) + 1]  # [t, stop], or [stop] where t is stop too
    stopping = batcher.add(prompts(8)[0], 50, stop_tokens={stop})
    cancelled = batcher.add(prompts(40)[0], 50)
    events = []
    while stopping.finish is None:
        events += batcher.step()
    assert stopping.finish == "stop" and stopping.tokens == until_stop
    assert [e.finish for e in events if e.sequence is stopping] == [None] * (len(until_stop) - 1) + ["stop"]
    batcher.cancel(cancelled)
    batcher.cancel(cancelled)  # a second cancel does nothing
    assert cancelled.finish == "cancelled" and not batcher.busy()
    assert batcher.pool.usage()["held"] == 0 and batcher.step() == []


@pytest.mark.parametrize("prompt, max_tokens, message", [
    ([], 4, "a prompt of at least one token and max_tokens >= 1, got 0 tokens"),
    ([1, 2], 0, "max_tokens >= 1, got 2 tokens and max_tokens=0"),
    ([1] * 2000, 100, "the prompt (2000 tokens) and max_tokens (100) exceed the model's context of 2048"),
    ([1] * 100, 100, "the request needs 13 pages of the KV cache, which has 8"),
])
def test_requests_that_cannot_run_are_refused(prompt, max_tokens, message):
    batcher = Batcher(tiny_engine(), kv_positions=128)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        batcher.add(prompt, max_tokens)
    assert not batcher.busy()


@pytest.mark.parametrize("option", ["max_running", "kv_positions", "page_size", "token_budget"])
def test_sizes_below_one_are_refused(option):
    with pytest.raises(ValueError, match=f"{option} must be at least 1, got 0"):
        Batcher(tiny_engine(), **{option: 0})


def test_steps_where_every_request_decodes_run_the_decoder_and_the_bits_stay(engine, run):
    # Such steps are Engine.decoder's (a CUDA graph per row count on CUDA), the others packed calls.
    requests = list(zip(prompts(5, 300, 40, 1), [6, 5, 8, 7]))
    alone = [run(Batcher(engine), [r])[0][0] for r in requests]
    batcher = Batcher(engine, max_running=2)
    decode_steps = count_calls(batcher, "_run_decode")
    logits, tokens = run(batcher, requests, arrivals=[0, 0, 0, 1])  # two rows: the others wait their turn
    assert all(torch.equal(a, b) for a, b in zip(logits, alone))
    assert decode_steps[0] > 0 and 2 in batcher._decoders
    assert batcher.pool.usage()["held"] == 0


def test_decoding_requests_get_their_token_before_an_older_requests_prefill(engine):
    batcher = Batcher(engine, max_running=4, token_budget=512)  # a prefill chunk could take all 512
    decoding = batcher.add(prompts(4)[0], 20)
    batcher.step()
    older = batcher.add(prompts(1900)[0], 2)
    batcher.step()
    batcher._running.reverse()  # as if the long prompt had come first
    for _ in range(3):
        before = len(decoding.tokens)
        batcher.step()
        assert len(decoding.tokens) == before + 1
    assert older.cached < len(older.prompt)  # it prefills beside the decoding token, in whole query tiles


def test_a_failed_step_fails_its_requests_only_and_the_batcher_goes_on(engine, monkeypatch):
    batcher = Batcher(engine)
    failing = [batcher.add(p, 5) for p in prompts(6, 9)]
    forward = engine.forward_packed
    monkeypatch.setattr(engine, "forward_packed", lambda *a: (_ for _ in ()).throw(RuntimeError("no memory")))
    events = batcher.step()
    assert [(e.sequence, e.token, e.finish, e.error) for e in events] == [
        (s, None, "error", "RuntimeError: no memory") for s in failing]
    assert not batcher.busy() and batcher.pool.usage()["held"] == 0
    monkeypatch.setattr(engine, "forward_packed", forward)
    after = batcher.add(prompts(6)[0], 3)
    while batcher.busy():
        batcher.step()
    assert len(after.tokens) == 3 and after.finish == "length"


def test_pages_are_read_only_where_written(engine, run):
    # The pool's memory starts uninitialised (no resident memory for unused pages):
    # NaN in every page before the requests must not reach their logits.
    requests = list(zip(prompts(5, 300, 17), [6, 5, 8]))
    clean = run(Batcher(engine), requests)[0]
    poisoned = Batcher(engine)
    for k, v in poisoned.pool.caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    logits = run(poisoned, requests)[0]
    assert all(torch.equal(a, b) for a, b in zip(logits, clean))


def test_a_request_whose_sampling_fails_leaves_alone(engine, monkeypatch):
    batcher = Batcher(engine)
    doomed, fine = (batcher.add(p, 4, SamplingParams(temperature=t)) for p, t in zip(prompts(6, 9), (1.0, 0.0)))
    sample = batching.sample

    def failing(logits, sampling, generator):
        if sampling is doomed.sampling:
            raise RuntimeError("probability tensor contains nan")
        return sample(logits, sampling, generator)

    monkeypatch.setattr(batching, "sample", failing)
    events = batcher.step()
    assert [(e.sequence, e.finish) for e in events] == [(doomed, "error"), (fine, None)]
    assert events[0].error == "RuntimeError: probability tensor contains nan" and doomed.finish == "error"
    while batcher.busy():
        batcher.step()
    assert len(fine.tokens) == 4 and batcher.pool.usage()["held"] == 0


@pytest.mark.parametrize("wants", [{}, {"logprobs": 2}, {"logprobs": 2, "prompt_logprobs": True}],
                         ids=["greedy", "logprobs", "prompt-logprobs"])
def test_a_request_whose_logits_are_not_finite_leaves_alone(engine, monkeypatch, wants):
    """NaN logits fail the request they are of: its greedy choice or its log-probabilities
    would be garbage; the requests beside it go on."""
    batcher = Batcher(engine)
    doomed = batcher.add(prompts(6)[0], 4, SamplingParams(presence_penalty=0.5), **wants)
    fine = batcher.add(prompts(9)[0], 4, logprobs=2)
    run = Batcher._run

    def poisoned(self, batch):  # the prompt rows alone where it has them, else its sampling row
        logits, prompt_rows = run(self, batch)
        if prompt_rows:
            logits[len(batch):][[i for i, (seq, _) in enumerate(prompt_rows) if seq is doomed]] = float("nan")
        else:
            logits[[i for i, (seq, _) in enumerate(batch) if seq is doomed]] = float("nan")
        return logits, prompt_rows

    monkeypatch.setattr(Batcher, "_run", poisoned)
    events = batcher.step()
    assert [(e.sequence, e.finish) for e in events] == [(doomed, "error"), (fine, None)]
    assert "not finite" in events[0].error and doomed.counts is None
    while batcher.busy():
        batcher.step()
    assert len(fine.tokens) == 4 and batcher.pool.usage()["held"] == 0


def teacher_forced_logits(engine, prompt, tokens):
    """The logits rows that sampled ``tokens`` after ``prompt``, from one
    prefill of prompt + tokens[:-1] into a contiguous cache."""
    ids = torch.tensor(prompt + tokens[:-1])
    c, n = engine.config, len(ids)
    caches = [tuple(torch.zeros(1, c.kv_heads, n, c.head_dim, dtype=engine.dtype) for _ in range(2))
              for _ in range(c.layers)]
    return engine.forward_packed(ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                                 torch.zeros(1, dtype=torch.int32), caches, None,
                                 torch.arange(len(prompt) - 1, n))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("sliding", [0, 100], ids=["llama", "sliding"])
def test_batched_requests_follow_a_float32_prefill_of_their_own_tokens(device, sliding, run):
    # float16 on CUDA.
    engine = tiny_engine(sliding_window=sliding, head_dim=64, device=device)
    reference = tiny_engine(sliding_window=sliding, head_dim=64) if device == "cuda" else engine
    batcher = Batcher(engine, max_running=4, kv_positions=2048, token_budget=256)
    requests = list(zip(prompts(5, 300, 600, 1, 260, 40), [6, 5, 4, 7, 3, 8]))
    decode_steps = count_calls(batcher, "_run_decode")
    logits, tokens = run(batcher, requests, arrivals=[0, 0, 1, 2, 2, 5])
    assert decode_steps[0] > 0  # on CUDA they replay a captured decode()
    for (prompt, _), rows, toks in zip(requests, logits, tokens):
        expected = teacher_forced_logits(reference, prompt, toks)
        assert torch.allclose(rows.float().cpu(), expected, atol=0.02 * float(expected.abs().max()) + 1e-5)
    assert batcher.pool.usage()["held"] == 0


@pytest.mark.gpu
def test_no_garbage_collection_runs_inside_a_capture(run, monkeypatch):
    """A collection inside a capture may destroy an unreachable earlier graph (a finished
    Batcher's), which CUDA forbids while a stream captures: the capture failed now and then
    in the GPU suite. The engine collects before each capture and lets none run during it."""
    engine = tiny_engine(head_dim=64, device="cuda")
    seen = []  # (capturing, collections enabled) at each decode()
    decode = engine.decode

    def recording(*args):
        seen.append((torch.cuda.is_current_stream_capturing(), gc.isenabled()))
        return decode(*args)

    monkeypatch.setattr(engine, "decode", recording)
    batcher = Batcher(engine, max_running=2, kv_positions=256)
    captured = [enabled for capturing, enabled in seen if capturing]
    assert captured and not any(captured), seen
    assert gc.isenabled()
    logits, _ = run(batcher, [(list(range(1, 9)), 3)])
    assert all(torch.isfinite(rows).all() for rows in logits)


def test_with_cuda_graphs_decoding_steps_run_at_a_few_row_counts_captured_up_front(run, monkeypatch):
    # CUDA's path, on the CPU: 3 decoding requests run as 4 rows, the 4th decoding a token 0 into a spare page.
    engine = tiny_engine()
    captured = []

    def capture(tokens, lengths, caches, block_table):  # a capture that runs eagerly at every replay
        captured.append(len(tokens))
        return lambda new_tokens: engine.decode(new_tokens, lengths, caches, block_table)

    monkeypatch.setattr(engine, "cuda_graph", True)
    monkeypatch.setattr(engine, "_capture_decode", capture)
    requests = list(zip(prompts(5, 300, 40), [6, 5, 8]))
    alone = [run(Batcher(tiny_engine()), [r])[0][0] for r in requests]
    batcher = Batcher(engine, max_running=12)
    assert captured == [1, 2, 4, 8, 12] and sorted(batcher._decoders) == [1, 2, 4, 8, 12]
    assert batcher.pool.usage() == {"total": batcher.pool.pages, "held": 0, "cached": 0, "free": batcher.pool.pages}
    rows = []
    decode_rows = batcher._decode_rows
    monkeypatch.setattr(batcher, "_decode_rows", lambda seqs, n: (rows.append((len(seqs), n)), decode_rows(seqs, n))[1])
    logits, tokens = run(batcher, requests)
    assert all(torch.equal(a, b) for a, b in zip(logits, alone))
    assert (3, 4) in rows and (1, 1) in rows and captured == [1, 2, 4, 8, 12]  # nothing captured while serving
