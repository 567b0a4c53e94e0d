"""Peak memory of one call beyond what was allocated before it, on CPU or CUDA,
and handing the CPU heap that Python and C libraries freed back to the OS."""

from __future__ import annotations

import ctypes
import gc
from typing import Callable

import torch


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def release_freed_cpu_memory() -> None:
    """Collects garbage, then returns the heap's free pages to the OS (glibc's
    malloc_trim; elsewhere nothing). Not during a CUDA graph capture on another
    thread: the collection may free tensors the capture uses."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back to the OS
    except (OSError, AttributeError):
        pass


def cpu_peak_bytes(fn: Callable[[], object]) -> int | None:
    """Growth of the process's peak resident memory during fn() (Linux only).

    Writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current
    resident size, so the difference is what fn() needed at its peak. Returns
    None where /proc does not allow it.
    """
    try:
        release_freed_cpu_memory()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_status_kib("VmRSS")
        result = fn()
        peak = _proc_status_kib("VmHWM")
    except OSError:
        return None
    del result
    return max(0, peak - before) * 1024


def cuda_peak_bytes(fn: Callable[[], object], device=None) -> int:
    """Peak of torch's CUDA allocator during fn() above what was allocated before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del result
    return peak - before


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    return cuda_peak_bytes(fn, device) if device.type == "cuda" else cpu_peak_bytes(fn)
