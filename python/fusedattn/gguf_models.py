"""What the engine reads from a GGUF file: its header (before any load, for
the checks), the architectures it runs and their configs, and the weights in
the engine's layout.

Architectures: ``llama`` (SmolLM2, Llama, Mistral without rope scaling),
``gemma3`` (Gemma 3: QK-norm, norms after attention and after the MLP, GeGLU,
sliding-window layers with their own rotary base, embeddings scaled by
sqrt(hidden)) and ``qwen2`` (Qwen2 and Qwen2.5: biases on Q, K and V, pairs
rotated as halves). What a file's metadata or tensors say is read from them; what
neither carries is the architecture's own constant, as llama.cpp and
transformers also hard-code it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import struct
import threading

import torch
from torch import Tensor

from .gguf_blocks import FORMATS, BlockStack, BlockWeight, stack_blocks

__all__ = ["ARCHITECTURES", "ModelConfig", "describe", "fuse_weights", "gguf_metadata", "read_model", "read_tokenizer"]

ARCHITECTURES = ("llama", "gemma3", "qwen2")


@dataclasses.dataclass
class ModelConfig:
    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_base: float
    norm_eps: float
    context: int
    # What Gemma 3 adds; the defaults are llama's.
    rope_halves: bool = False  # rotate pairs (x[i], x[i + d/2]); llama's GGUF permutes Q/K for adjacent pairs
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included (0: no sliding layers)
    global_every: int = 0  # with a sliding window: every global_every-th layer sees all keys
    local_rope_base: float = 0.0  # the sliding layers' rotary base
    gelu: bool = False  # GeGLU (tanh GELU) where llama has SwiGLU
    embed_scale: float = 1.0
    end_tokens: tuple[int, ...] = ()  # ids besides end of text that end a reply (end_tokens())

    def sliding(self, layer: int) -> bool:
        return self.sliding_window > 0 and (layer + 1) % self.global_every != 0

    def window(self, layer: int) -> tuple[int, int] | None:
        """The layer's attention window, as fusedattn's window argument (None: causal over everything)."""
        return (self.sliding_window - 1, 0) if self.sliding(layer) else None

    def rope_base_of(self, layer: int) -> float:
        return self.local_rope_base if self.sliding(layer) else self.rope_base


# GGUF metadata value types (the gguf spec): fixed-size scalars by struct code.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Header:
    """A GGUF file's header read in large chunks and parsed from memory: walking
    past a tokenizer's 100K-string arrays costs milliseconds, not a read and a
    seek per string."""

    _CHUNK = 1 << 22

    def __init__(self, f, path: str, order: str, count: str):
        self.f, self.path, self.order = f, path, order
        self.buf, self.pos = b"", 0
        self.count = struct.Struct(order + count)

    def need(self, n: int) -> None:
        """Makes buf[pos:pos + n] hold the next n bytes."""
        if self.pos + n <= len(self.buf):
            return
        if self.pos > len(self.buf):  # a skip went past what was read
            self.f.seek(self.pos - len(self.buf), 1)
            self.buf = b""
        else:
            self.buf = self.buf[self.pos:]
        self.pos = 0
        self.buf += self.f.read(max(n - len(self.buf), self._CHUNK))
        if n > len(self.buf):
            raise ValueError(f"{self.path}: the GGUF header ends early")

    def value(self, fmt: str):
        size = struct.calcsize(fmt)
        self.need(size)
        (v,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def length(self) -> int:
        self.need(self.count.size)
        (n,) = self.count.unpack_from(self.buf, self.pos)
        self.pos += self.count.size
        return n

    def string(self) -> str:
        n = self.length()
        self.need(n)
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8", "replace")

    def skip(self, kind: int) -> None:
        if kind in _GGUF_SCALARS:
            self.pos += struct.calcsize(_GGUF_SCALARS[kind])
        elif kind == _GGUF_STRING:
            n = self.length()  # read before pos is: length() moves it
            self.pos += n
        elif kind == _GGUF_ARRAY:
            item, n = self.value("I"), self.length()
            if item in _GGUF_SCALARS:
                self.pos += n * struct.calcsize(_GGUF_SCALARS[item])
            elif item == _GGUF_STRING:  # a tokenizer's vocabulary and merges: the loop kept tight
                size, unpack = self.count.size, self.count.unpack_from
                for _ in range(n):
                    if self.pos + size > len(self.buf):
                        self.need(size)
                    self.pos += size + unpack(self.buf, self.pos)[0]
            else:
                for _ in range(n):
                    self.skip(item)
        else:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")


def gguf_metadata(path: str, keys: tuple[str, ...] = ("general.architecture",)) -> dict:
    """The scalar and string metadata values named by ``keys`` that the GGUF
    file at ``path`` holds, read from its header without loading the tensors
    (the check that runs before a load). Raises ValueError when the file is not
    a GGUF file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
        # Version 1 counted in 32 bits, later versions in 64; a big-endian file
        # reads its version byte-swapped.
        order = "<" if struct.unpack("<I", head[4:])[0] < 0x10000 else ">"
        version = struct.unpack(order + "I", head[4:])[0]
        header = _Header(f, path, order, "I" if version == 1 else "Q")
        header.length()  # tensor count
        found: dict = {}
        for _ in range(header.length()):
            key, kind = header.string(), header.value("I")
            if key in keys and kind in _GGUF_SCALARS:
                found[key] = header.value(_GGUF_SCALARS[kind])
            elif key in keys and kind == _GGUF_STRING:
                found[key] = header.string()
            else:
                header.skip(kind)
            if len(found) == len(keys):
                break
    return found


def _unsupported(path: str, arch) -> ValueError:
    if not arch:
        return ValueError(f"{path}: its header names no architecture (general.architecture); fusedattn's "
                          f"engine runs {', '.join(ARCHITECTURES)} GGUF files")
    return ValueError(f"{path}: its architecture is {arch!r}; fusedattn's engine runs "
                      f"{', '.join(ARCHITECTURES)} GGUF files")


def describe(path: str) -> dict:
    """From the header alone: the architecture, head dim and context of a file
    the engine runs. Raises ValueError (starting with path) for any other file.
    A file unchanged since the last call (same size and modification time) is
    not read again: the CLI's check and the engine's load both ask."""
    stat = os.stat(path)
    return dict(_describe(path, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _describe(path: str, _size: int, _mtime_ns: int) -> dict:
    arch = gguf_metadata(path).get("general.architecture")
    if arch not in ARCHITECTURES:
        raise _unsupported(path, arch)
    keys = ("embedding_length", "attention.head_count", "attention.key_length", "context_length")
    meta = gguf_metadata(path, tuple(f"{arch}.{k}" for k in keys))
    hidden, heads = meta.get(f"{arch}.embedding_length"), meta.get(f"{arch}.attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length") or (hidden // heads if hidden and heads else None)
    return {"arch": arch, "head_dim": head_dim, "context": meta.get(f"{arch}.context_length")}


def read_model(path: str, keep_blocks: bool = False,
               reader=None) -> tuple[ModelConfig, dict[str, Tensor | BlockWeight | BlockStack]]:
    """The config and the weights (float32, fuse_weights' layout) of a GGUF file;
    with keep_blocks, the matrices of a format gguf_blocks.FORMATS lists stay
    as the file's blocks (BlockWeight; a fused matrix of several such formats,
    BlockStack). reader: the file's gguf.GGUFReader, if
    it is open already."""
    import gguf
    import numpy as np

    if reader is None:
        reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    if arch not in ARCHITECTURES:
        raise _unsupported(path, arch)
    field = lambda name: reader.fields[f"{arch}.{name}"].contents()  # noqa: E731
    optional = lambda name: reader.fields[f"{arch}.{name}"].contents() if f"{arch}.{name}" in reader.fields else None  # noqa: E731
    names = {t.name for t in reader.tensors}
    scaling = optional("rope.scaling.type")
    if "rope_freqs.weight" in names or scaling not in (None, "none"):
        raise ValueError(f"fusedattn.engine: {path} scales its rotary frequencies "
                         f"({'rope_freqs' if scaling in (None, 'none') else scaling}), which this engine does not "
                         "implement")
    hidden, heads = field("embedding_length"), field("attention.head_count")
    config = ModelConfig(
        arch=arch, layers=field("block_count"), hidden=hidden, ffn=field("feed_forward_length"), heads=heads,
        kv_heads=field("attention.head_count_kv"), head_dim=optional("attention.key_length") or hidden // heads,
        vocab=0, rope_base=field("rope.freq_base"), norm_eps=field("attention.layer_norm_rms_epsilon"),
        context=field("context_length"))
    config = dataclasses.replace(config, end_tokens=end_tokens(reader))
    if arch == "qwen2":  # llama.cpp converts Qwen2 without permuting Q and K: its pairs are halves
        config = dataclasses.replace(config, rope_halves=True)
    if arch == "gemma3":
        # Gemma 3's layer pattern and local rotary base are in neither the metadata nor the tensors.
        config = dataclasses.replace(config, rope_halves=True, sliding_window=optional("attention.sliding_window") or 0,
                                     global_every=6, local_rope_base=10000.0, gelu=True,
                                     embed_scale=math.sqrt(hidden))

    def weight(t) -> Tensor | BlockWeight:
        if keep_blocks and t.tensor_type.name in FORMATS and len(t.data.shape) == 2:
            return BlockWeight(torch.from_numpy(np.array(t.data)), FORMATS[t.tensor_type.name][0])
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()

    weights = {t.name: weight(t) for t in reader.tensors}
    config.vocab = weights["token_embd.weight"].shape[0]
    return config, fuse_weights(weights)


def end_tokens(reader) -> tuple[int, ...]:
    """The file's end-of-turn and end-of-message ids, where it names them: chat models whose
    turn ends on a token other than end of text (Llama 3's <|eot_id|>) stop there."""
    keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return tuple(int(reader.fields[k].contents()) for k in keys if k in reader.fields)


def read_tokenizer(path: str, reader):
    """transformers' tokenizer of a GGUF file, built from reader, the file's
    open gguf.GGUFReader: transformers opens the file with gguf.GGUFReader
    itself, a parse of seconds, so for this path it is handed this one."""
    from unittest import mock

    import gguf
    from transformers import AutoTokenizer

    own, real = os.path.realpath(path), gguf.GGUFReader

    def reuse(p, *args, **kwargs):
        return reader if os.path.realpath(p) == own and not args and not kwargs else real(p, *args, **kwargs)

    # The patch is process-wide: one load at a time holds it, so no thread keeps another's.
    with _READER_PATCH, mock.patch.object(gguf, "GGUFReader", reuse):
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


_READER_PATCH = threading.Lock()


def _stack(parts: list[Tensor | BlockWeight]) -> Tensor | BlockWeight | BlockStack:
    """The parts' rows in one matrix: blocks where every part is blocks, else float32."""
    if all(isinstance(p, BlockWeight) for p in parts):
        return stack_blocks(parts)
    return torch.cat([p.dequantize() if isinstance(p, BlockWeight) else p for p in parts])


def fuse_weights(gguf_weights: dict[str, Tensor | BlockWeight]) -> dict[str, Tensor | BlockWeight | BlockStack]:
    """The engine's weights from a GGUF file's tensors: per layer, the
    projections that read the same input fused into one matrix each (Q|K|V
    and gate|up: fewer, larger GEMMs per token), and Q|K|V's biases where the
    file has them (Qwen2); the norms as they are (Gemma's GGUF already holds
    1 + w)."""
    w = gguf_weights
    fused = {"embed": w["token_embd.weight"], "output_norm": w["output_norm.weight"]}
    if "output.weight" in w:
        fused["lm_head"] = w["output.weight"]
    norms = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
             "post_attn_norm": "post_attention_norm", "post_ffn_norm": "post_ffw_norm"}
    i = 0
    while f"blk.{i}.attn_norm.weight" in w:
        b = f"blk.{i}"
        fused.update({f"{b}.{ours}": w[f"{b}.{theirs}.weight"] for ours, theirs in norms.items()
                      if f"{b}.{theirs}.weight" in w})
        fused.update({
            f"{b}.qkv": _stack([w[f"{b}.attn_{x}.weight"] for x in "qkv"]),
            f"{b}.out": w[f"{b}.attn_output.weight"], f"{b}.down": w[f"{b}.ffn_down.weight"],
            f"{b}.gate_up": _stack([w[f"{b}.ffn_gate.weight"], w[f"{b}.ffn_up.weight"]])})
        if f"{b}.attn_q.bias" in w:
            fused[f"{b}.qkv_bias"] = torch.cat([w[f"{b}.attn_{x}.bias"] for x in "qkv"])
        i += 1
    return fused
