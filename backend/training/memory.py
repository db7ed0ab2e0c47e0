"""Memory a training step hands back to the operating system."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from typing import Any

__all__ = ["release_memory"]


def release_memory(device: Any = None) -> None:
    """Hand the memory a step freed back to the OS (glibc ``malloc_trim``), and, when the step
    ran on a GPU (``device``), the cached blocks of torch's allocator back to the GPU, where a
    vLLM server started or restarted later needs it free.

    glibc keeps freed memory in the arena of the thread that freed it. Steps run on worker
    threads, and a step's activations are gigabytes: with each step on another thread, the demo's
    process grew by 1-3 GB per step until it was OOM-killed at 17.8 GB (step 7). One worker
    thread per trainer and a trim after each step keep it at one step's peak.
    """
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
