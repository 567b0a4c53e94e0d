"""transformers' models and tokenizers of the offline GGUF files, each loaded
once per test session: on CI's two cores Gemma-3-270M's model takes about
40 s and its tokenizer 15 s, and several test files compare against them.
A caller names the attention implementation it runs and changes no weights."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _causal_lm(path: str, device: str, dtype: torch.dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()


def causal_lm(path: str, attn_implementation: str = "sdpa", device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The GGUF file's model on `device` in `dtype`, running `attn_implementation`."""
    model = _causal_lm(path, device, dtype)
    model.set_attn_implementation(attn_implementation)
    return model


@functools.cache
def tokenizer(path: str):
    """The GGUF file's tokenizer (shared: a caller may set its padding side)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
