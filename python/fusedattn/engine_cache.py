"""Converted GGUF models on disk, so that a second start skips the conversion.

Reading a GGUF file means dequantising every tensor and letting transformers
rebuild the tokenizer from the same file: seconds each. The cache keeps, per
(file, dtype), the dequantised weights in the engine's dtype (loaded with
mmap), the model config and the tokenizer as transformers saves it. The key is
the file's real path, size and modification time: a changed file is a new
entry. An entry is written to a temporary folder and renamed into place, so a
reader never sees half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile

import torch

__all__ = ["default_cache_dir", "load", "save"]

FORMAT = 1  # bump when what an entry holds changes


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/fusedattn, or ~/.cache/fusedattn."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fusedattn")


def _entry(cache_dir: str, path: str, dtype: torch.dtype) -> str:
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{FORMAT}|{real}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    name = f"{os.path.basename(real)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return os.path.join(cache_dir, "models", name)


def load(cache_dir: str, path: str, dtype: torch.dtype, config_type):
    """(config, weights, tokenizer) of path's entry, or None where there is none."""
    entry = _entry(cache_dir, path, dtype)
    if not os.path.isfile(os.path.join(entry, "weights.pt")):
        return None
    from transformers import AutoTokenizer

    with open(os.path.join(entry, "config.json")) as f:
        config = config_type(**json.load(f))
    weights = torch.load(os.path.join(entry, "weights.pt"), mmap=True, weights_only=True)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(entry, "tokenizer"))
    return config, weights, tokenizer


def save(cache_dir: str, path: str, dtype: torch.dtype, config, weights: dict, tokenizer) -> str:
    """Writes path's entry (weights converted to dtype); returns its folder."""
    entry = _entry(cache_dir, path, dtype)
    os.makedirs(os.path.dirname(entry), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(entry))
    try:
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(config), f)
        torch.save({name: t.to(dtype) for name, t in weights.items()}, os.path.join(staging, "weights.pt"))
        tokenizer.save_pretrained(os.path.join(staging, "tokenizer"))
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(staging, entry)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return entry
