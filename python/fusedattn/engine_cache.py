"""Converted GGUF models on disk, so that a second start skips the conversion.

Reading a GGUF file means dequantising every tensor and letting transformers
rebuild the tokenizer from the same file: seconds each. The cache keeps, per
(file, dtype), the weights in the engine's layout (loaded with mmap): blocks as
the file stores them where the engine keeps them (gguf_blocks), the others
converted to dtype; the model config and the tokenizer as transformers saves it. The key is the file's real path, size and
modification time: a changed file is a new entry. An entry is written to a
staging folder and renamed into place, so a reader never sees half of one; an
entry that cannot be read is removed and converted again, and a cache that
cannot be written only costs the next start its conversion.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings

import torch

from .gguf_blocks import BlockStack, BlockWeight
from .tokenizer import load as load_saved_tokenizer

__all__ = ["default_cache_dir", "load", "save"]

FORMAT = 6  # bump when what an entry holds changes
_STALE_STAGING_S = 3600  # a staging folder this old was left by a run that died


def default_cache_dir() -> str:
    """fusedattn/ beside torch.hub's folder: in torch's home ($TORCH_HOME, else
    $XDG_CACHE_HOME/torch, else ~/.cache/torch), as torch resolves it."""
    return os.path.join(os.path.dirname(torch.hub.get_dir()), "fusedattn")


def _entry(cache_dir: str, path: str, dtype: torch.dtype) -> str:
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{FORMAT}|{real}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    name = f"{os.path.basename(real)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return os.path.join(cache_dir, "models", name)


def load(cache_dir: str, path: str, dtype: torch.dtype, config_type):
    """(config, weights, tokenizer) of path's entry, or None where there is none
    (an entry that cannot be read is removed)."""
    entry = _entry(cache_dir, path, dtype)
    if not os.path.isfile(os.path.join(entry, "weights.pt")):
        return None
    try:
        with open(os.path.join(entry, "config.json")) as f:
            config = config_type(**json.load(f))
        weights = torch.load(os.path.join(entry, "weights.pt"), mmap=True, weights_only=True)
        with open(os.path.join(entry, "block_formats.json")) as f:
            for name, fmt in json.load(f).items():  # a BlockStack's parts are name.0, name.1, ...
                weights[name] = (BlockWeight(weights[name], fmt) if isinstance(fmt, str) else BlockStack(
                    tuple(BlockWeight(weights.pop(f"{name}.{i}"), part) for i, part in enumerate(fmt))))
        tokenizer = _load_tokenizer(os.path.join(entry, "tokenizer"))
    except Exception as e:  # noqa: BLE001  (any fault of the entry: convert again)
        warnings.warn(f"fusedattn.engine_cache: removing the unreadable entry {entry} ({e})", stacklevel=2)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return config, weights, tokenizer


def _load_tokenizer(folder: str):
    """The tokenizer save_pretrained wrote to folder. transformers' generic
    tokenizers-backed class loads without transformers (fusedattn.tokenizer:
    its import costs a command's start about 0.5 s); any other through
    AutoTokenizer."""
    saved = load_saved_tokenizer(folder)
    if saved is not None:
        return saved
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _remove_stale_staging(folder: str) -> None:
    for name in os.listdir(folder):
        staged = os.path.join(folder, name)
        if name.startswith(".staging-") and time.time() - os.path.getmtime(staged) > _STALE_STAGING_S:
            shutil.rmtree(staged, ignore_errors=True)


def save(cache_dir: str, path: str, dtype: torch.dtype, config, weights: dict, tokenizer) -> str | None:
    """Writes path's entry (weights converted to dtype); returns its folder, or
    None (with a warning) where the cache cannot be written."""
    entry = _entry(cache_dir, path, dtype)
    staging = None
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        _remove_stale_staging(os.path.dirname(entry))
        staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(entry))
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(config), f)
        formats, tensors = {}, {}
        for name, w in weights.items():
            if isinstance(w, BlockWeight):
                formats[name], tensors[name] = w.format, w.blocks
            elif isinstance(w, BlockStack):
                formats[name] = w.formats
                parts = {f"{name}.{i}": part.blocks for i, part in enumerate(w.parts)}
                if parts.keys() & weights.keys():  # a weight named like a part would be lost
                    raise ValueError(f"fusedattn.engine_cache: the weights hold both {name} and one of its parts' "
                                     f"names {sorted(parts.keys() & weights.keys())}")
                tensors.update(parts)
            else:
                tensors[name] = w.to(dtype)
        with open(os.path.join(staging, "block_formats.json"), "w") as f:
            json.dump(formats, f)
        torch.save(tensors, os.path.join(staging, "weights.pt"))
        tokenizer.save_pretrained(os.path.join(staging, "tokenizer"))
        try:
            os.replace(staging, entry)
        except OSError:
            if not os.path.isfile(os.path.join(entry, "weights.pt")):  # not another writer's finished entry
                shutil.rmtree(entry, ignore_errors=True)
                os.replace(staging, entry)
        return entry
    except OSError as e:
        warnings.warn(f"fusedattn.engine_cache: cannot write {entry} ({e.strerror or e}); the next start "
                      "converts the model again", stacklevel=2)
        return None
    finally:
        if staging is not None and os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
