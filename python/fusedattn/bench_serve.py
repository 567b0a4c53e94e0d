"""``fusedattn bench --serve``: the engine as a server, under load and against transformers.

Online: streamed greedy completions arrive at the server as a Poisson process
at each request rate, with prompts and output lengths drawn from a mix; per
rate the output tokens/s, the time to the first token and between tokens
(p50, p99; measured per piece of streamed text, which is a token but where the
server holds text back, e.g. half of a multi-byte character) and the server's
preemptions (fusedattn's /health). Without ``url`` the benchmark serves the
engine itself (SmolLM2 by default) in this process, where the client shares
the interpreter with the server; ``fusedattn serve`` and ``url`` keep them apart.

The decode step (a served engine only): max_running requests decoding
together against the step's roofline, the bytes it reads at a large copy's
bandwidth.

Offline (``against``): the same requests handed over at once, each run to its
output length (end-of-text ignored): fusedattn's ``Batcher`` against
transformers' continuous batching (``generate_batch``) and its ``generate``
over batches of ``max_running`` prompts padded on the left with a static
cache (compiled on CUDA), output tokens/s of each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import time

import torch

__all__ = ["ServeConfig", "decode_step", "format_table", "offline", "online"]

_WORDS = ("the of and to in is was for on that with as by at from his her an were which this be or are had not "
          "one all their there been has when who will more no if out so said what up its about into than them can "
          "only other new some could time these two may then do first any my now such like our over man me even "
          "most made after also did many before must through back years where much your way well down should "
          "because each just those people how too little state good very make world still own see men work long "
          "get here between both life being under never day same another know while last might us great old year "
          "off come since against go came right used take three").split()


@dataclasses.dataclass
class ServeConfig:
    rates: list[float] = dataclasses.field(default_factory=lambda: [1.0, 4.0, 16.0])  # requests per second
    requests: int = 32  # per rate
    prompt_words: list[int] = dataclasses.field(default_factory=lambda: [16, 64, 256])
    output_tokens: list[int] = dataclasses.field(default_factory=lambda: [16, 64, 128])
    max_running: int = 32
    seed: int = 0


def requests(cfg: ServeConfig, salt: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs of the mix: prompts of random words."""
    rng = random.Random(cfg.seed * 1000 + salt)
    return [(" ".join(rng.choice(_WORDS) for _ in range(rng.choice(cfg.prompt_words))),
             rng.choice(cfg.output_tokens)) for _ in range(cfg.requests)]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclasses.dataclass
class _Timing:
    sent: float
    chunks: list[float] = dataclasses.field(default_factory=list)  # arrival of each piece of text
    ended: float = 0.0
    completion_tokens: int = 0
    error: str | None = None


async def _stream(session, url: str, model: str, prompt: str, max_tokens: int, delay: float) -> _Timing:
    await asyncio.sleep(delay)
    timing = _Timing(time.perf_counter())
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            timing.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            return timing
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                timing.error = chunk["error"]["message"]
            elif chunk.get("usage"):
                timing.completion_tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                timing.chunks.append(time.perf_counter())
    timing.ended = time.perf_counter()
    return timing


async def _load(url: str, model: str, load: list[tuple[str, int]], rate: float, seed: int, progress) -> list[_Timing]:
    import aiohttp

    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in load:
        delays.append(t)
        t += rng.expovariate(rate)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(prompt, max_tokens, delay):
            timing = await _stream(session, url, model, prompt, max_tokens, delay)
            progress.update(1)
            return timing

        return await asyncio.gather(*(one(p, m, d) for (p, m), d in zip(load, delays)))


def _health(url: str) -> dict | None:
    """fusedattn serve's pool (GET /health); None from a server without it."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            pool = json.loads(r.read())["requests"]
        return pool if "preemptions" in pool else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def online(url: str, model: str, cfg: ServeConfig, progress: bool = True) -> list[dict]:
    """One row per rate: the load's throughput, latencies and the server's preemptions."""
    from tqdm import tqdm

    rows = []
    with tqdm(total=cfg.requests * len(cfg.rates), desc="fusedattn bench --serve", unit="request",
              disable=not progress) as bar:
        for i, rate in enumerate(cfg.rates):
            load = requests(cfg, salt=i)
            before = _health(url)
            timings = asyncio.run(_load(url, model, load, rate, cfg.seed * 1000 + i, bar))
            after = _health(url)
            done = [t for t in timings if t.error is None]
            span = max((t.ended for t in done), default=0.0) - min((t.sent for t in timings), default=0.0)
            tokens = sum(t.completion_tokens for t in done)
            gaps = [b - a for t in done for a, b in zip(t.chunks, t.chunks[1:])]
            ttft = [t.chunks[0] - t.sent for t in done if t.chunks]  # a reply of no text has no first token
            rows.append({
                "rate": rate, "requests": len(load), "failed": len(timings) - len(done),
                "errors": sorted({t.error for t in timings if t.error})[:3],
                "output_tokens": tokens, "seconds": span, "output_tokens_per_s": tokens / span if span > 0 else 0.0,
                "ttft_ms_p50": 1e3 * _percentile(ttft, 50), "ttft_ms_p99": 1e3 * _percentile(ttft, 99),
                "itl_ms_p50": 1e3 * _percentile(gaps, 50), "itl_ms_p99": 1e3 * _percentile(gaps, 99),
                "preemptions": None if before is None or after is None else
                after["preemptions"] - before["preemptions"]})
    return rows


def offline(engine, path: str, cfg: ServeConfig, against: list[str], progress: bool = True) -> list[dict]:
    """The first rate's requests at once, each to its output length: output
    tokens/s of fusedattn's Batcher and of each transformers method asked for
    ("generate_batch", "generate") on the model of the GGUF file at path."""
    from tqdm import tqdm

    load = [(engine.tokenizer.encode(p), n) for p, n in requests(cfg)]
    # generate last: on CUDA it compiles its decoding step.
    methods = ["fusedattn"] + sorted(against, key=lambda m: m == "generate")
    model = _transformers_model(engine, path) if against else None
    rows = []
    for method in tqdm(methods, desc="fusedattn bench --serve offline", disable=not progress, unit="method"):
        run = {"fusedattn": _fusedattn_offline, "generate_batch": _transformers_batch,
               "generate": _transformers_static}[method]
        try:
            seconds, tokens = run(engine, model, load, cfg)
        except Exception as e:  # noqa: BLE001  (a transformers method that fails is reported; ours is not caught)
            if method == "fusedattn":
                raise
            first_line = (str(e).strip().splitlines() or [""])[0]
            rows.append({"method": method, "error": f"{type(e).__name__}: {first_line}"})
            continue
        rows.append({"method": method, "requests": len(load), "output_tokens": tokens, "seconds": seconds,
                     "output_tokens_per_s": tokens / seconds})
    fusedattn_rate = rows[0]["output_tokens_per_s"]
    for row in rows:
        if "error" not in row:
            row["fusedattn_x"] = fusedattn_rate / row["output_tokens_per_s"]
    return rows


def decode_step(engine, cfg: ServeConfig, prompt_tokens: int = 64, steps: int = 8) -> dict:
    """A step of max_running requests decoding together, after their prefill,
    against its roofline: the bytes it must read (every weight once, every
    request's keys and values of each layer, a sliding layer's window only) at
    the bandwidth a large copy reaches on the device."""
    from .batching import Batcher

    c, rng = engine.config, random.Random(cfg.seed)
    warmup = 2  # steps of every request decoding before the clock
    # No request ends during the clock, and the pages hold what each decodes
    # while the others prefill (128 steps of it): nobody is preempted.
    positions = cfg.max_running * (prompt_tokens + 128 + warmup + steps)
    batcher = Batcher(engine, max_running=cfg.max_running, kv_positions=positions)
    longest = min(c.context, positions) - prompt_tokens  # more than any request decodes here
    seqs = [batcher.add([rng.randrange(c.vocab) for _ in range(prompt_tokens)], longest)
            for _ in range(cfg.max_running)]
    while not all(s.tokens for s in seqs):  # the prefills (and a first decode for some)
        batcher.step()
    for _ in range(warmup):
        batcher.step()
    start_positions = [s.cached for s in seqs]
    _sync(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        batcher.step()
    _sync(engine.device)
    seconds = (time.perf_counter() - start) / steps
    if batcher.preemptions or any(s.finish is not None for s in seqs):
        raise RuntimeError(f"fusedattn bench --serve: the decode step's {cfg.max_running} requests did not all "
                           f"decode to the end of the clock ({batcher.preemptions} preempted); use a smaller "
                           f"--max-running")
    weight_bytes = engine.weight_bytes - engine.embed.nbytes * (
        engine.lm_head is not engine.embed)  # an untied embedding is read a row at a time
    position_bytes = 2 * c.kv_heads * c.head_dim * engine.dtype.itemsize  # a key and a value
    kv_bytes = 0
    for i in range(c.layers):
        window = c.window(i)
        for p in start_positions:
            mean_keys = p + (steps + 1) / 2  # over the timed steps
            kv_bytes += position_bytes * (min(mean_keys, window[0] + 1) if window else mean_keys)
    bandwidth = _copy_bandwidth(engine.device)
    roofline = (weight_bytes + kv_bytes) / bandwidth
    return {"requests": cfg.max_running, "prompt_tokens": prompt_tokens, "step_ms": 1e3 * seconds,
            "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bandwidth_GBps": bandwidth / 1e9,
            "roofline_ms": 1e3 * roofline, "x_roofline": seconds / roofline}


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes a second a large copy reads and writes on the device (the best of 5)."""
    size = (1 << 30) if device.type == "cuda" else (1 << 28)
    src = torch.ones(size // 4, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fusedattn_offline(engine, model, load, cfg: ServeConfig) -> tuple[float, int]:
    from .batching import Batcher

    def run(batcher, requests):
        seqs = [batcher.add(ids, n) for ids, n in requests]  # no stop token: each runs to its length
        while batcher.busy():
            batcher.step()
        return sum(len(s.tokens) for s in seqs)

    run(Batcher(engine, max_running=cfg.max_running), load[:1])  # warm-up
    batcher = Batcher(engine, max_running=cfg.max_running)  # its prefix cache empty
    _sync(engine.device)
    start = time.perf_counter()
    tokens = run(batcher, load)
    _sync(engine.device)
    return time.perf_counter() - start, tokens


def _transformers_model(engine, path: str):
    import os

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              local_files_only=True)
    return model.to(device=engine.device, dtype=engine.dtype).eval()


def _transformers_batch(engine, model, load, cfg: ServeConfig) -> tuple[float, int]:
    """transformers' continuous batching: a manager started (and warmed up) before the clock, then
    every request added with its own max_new_tokens and the results collected."""
    from transformers import GenerationConfig

    if not hasattr(model, "continuous_batching_context_manager"):
        raise RuntimeError("this transformers has no continuous batching (generate_batch); leave it out of --against")
    config = GenerationConfig(max_new_tokens=max(n for _, n in load), eos_token_id=None, do_sample=False)
    with model.continuous_batching_context_manager(generation_config=config) as manager:
        def run(requests) -> int:
            ids = [manager.add_request(i, max_new_tokens=n) for i, n in requests]
            made = {}
            while len(made) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    made[result.request_id] = len(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before its requests ended")
            return sum(min(made[i], n) for i, (_, n) in zip(ids, requests))

        run(load[:1])  # warm-up
        _sync(engine.device)
        start = time.perf_counter()
        tokens = run(load)
        _sync(engine.device)
    return time.perf_counter() - start, tokens


def _transformers_static(engine, model, load, cfg: ServeConfig) -> tuple[float, int]:
    """transformers' generate over batches of max_running prompts padded on the left, a static
    cache, each batch to its longest output; the first batch once before the clock. On CUDA
    generate compiles its decoding step itself where the cache is static (compiling the forward
    as well breaks its CUDA graphs)."""
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
    batches = [load[i:i + cfg.max_running] for i in range(0, len(load), cfg.max_running)]

    def run(batch) -> int:
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([[pad] * (width - len(i)) + i for i, _ in batch], device=engine.device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i, _ in batch], device=engine.device)
        new = max(n for _, n in batch)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 cache_implementation="static", pad_token_id=pad)
        made = out.shape[1] - width  # every row of the batch
        return sum(min(made, n) for _, n in batch)  # a request counts its own tokens, not the batch's padding

    run(batches[0])  # warm-up at the timed shape (and the compile on CUDA)
    _sync(engine.device)
    start = time.perf_counter()
    tokens = sum(run(b) for b in batches)
    _sync(engine.device)
    return time.perf_counter() - start, tokens


def format_table(result: dict) -> str:
    lines = [f"fusedattn serve under load: {result['model']} on {result['device']}, {result['requests']} requests a "
             f"rate, prompts of {result['prompt_words']} words, outputs of {result['output_tokens']} tokens",
             "", "| rate (req/s) | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | preemptions | failed |",
             "|---|---|---|---|---|---|"]
    for r in result["online"]:
        preemptions = "n/a" if r["preemptions"] is None else r["preemptions"]
        lines.append(f"| {r['rate']:g} | {r['output_tokens_per_s']:.1f} | {r['ttft_ms_p50']:.0f} / "
                     f"{r['ttft_ms_p99']:.0f} | {r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f} | {preemptions} | "
                     f"{r['failed']} |")
    for r in result["online"]:
        for error in r["errors"]:
            lines.append(f"rate {r['rate']:g}: {error}")
    step = result.get("decode_step")
    if step:
        lines += ["", f"decode step of {step['requests']} requests (after {step['prompt_tokens']}-token prompts): "
                  f"{step['step_ms']:.2f} ms, its roofline {step['roofline_ms']:.2f} ms (weights "
                  f"{step['weight_bytes'] / 1e6:.0f} MB + keys and values {step['kv_bytes'] / 1e6:.1f} MB at "
                  f"{step['bandwidth_GBps']:.0f} GB/s, a large copy's rate): {step['x_roofline']:.2f}x"]
    if result.get("offline"):
        lines += ["", "offline, the first rate's requests at once, each to its output length (fusedattn x: "
                  "fusedattn's tokens/s over the method's):", "",
                  "| method | output tok/s | fusedattn x |", "|---|---|---|"]
        lines += [f"| {r['method']} | failed: {r['error']} | |" if "error" in r else
                  f"| {r['method']} | {r['output_tokens_per_s']:.1f} | {r['fusedattn_x']:.2f} |"
                  for r in result["offline"]]
    return "\n".join(lines)


def summary(model: str, device: str, cfg: ServeConfig, online_rows, offline_rows, step: dict | None) -> dict:
    return {"kind": "serve", "model": model, "device": device, "requests": cfg.requests,
            "prompt_words": cfg.prompt_words, "output_tokens": cfg.output_tokens, "max_running": cfg.max_running,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "online": online_rows,
            "offline": offline_rows, "decode_step": step, "mean_output_tokens": statistics.mean(cfg.output_tokens)}
