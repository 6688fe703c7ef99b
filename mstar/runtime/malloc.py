"""Freed memory kept for the next step, and why the runtime asks glibc to keep it.

A step allocates and frees the same large buffers again and again: Code2Wav's activations (16
requests x 128 channels x 24,000 samples is 12 MiB a tensor), logits, prefill activations. glibc's
malloc serves a block above its mmap threshold with a fresh ``mmap`` and returns it with
``munmap``; below it, a free that leaves more than the trim threshold at the top of a heap gives
those pages back to the kernel. Either way the next step's buffer is new memory: one page fault and
one zeroed page per 4 KiB touched, work that a step whose own arithmetic is a few passes over
those buffers (a Code2Wav call) cannot hide.

``keep_freed_memory()`` sets, once per process (``mallopt``, as the ``MALLOC_*_`` environment
variables would at start):

* ``M_MMAP_THRESHOLD`` 32 MiB (glibc's largest): blocks up to that size come from the heap;
* ``M_TRIM_THRESHOLD`` 1 GiB and ``M_TOP_PAD`` 64 MiB: freed memory at a heap's top is kept for
  reuse up to 1 GiB, and a heap grows by 64 MiB at a time.

The process then holds on to what its busiest step used (bounded by the trim threshold, on top of
the model's own memory); a setting the caller made through the environment is left as it is.
Another allocator (LD_PRELOAD'ed tcmalloc or jemalloc) ignores these calls: ``mallopt`` is then
not glibc's, or does nothing.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MALLOC_SETTINGS", "keep_freed_memory", "malloc_environment"]

# mallopt parameter -> (environment variable that sets it at process start, value)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MALLOC_SETTINGS = {
    _M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", 32 << 20),
    _M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", 1 << 30),
    _M_TOP_PAD: ("MALLOC_TOP_PAD_", 64 << 20),
}
_done = False


def keep_freed_memory() -> bool:
    """Apply ``MALLOC_SETTINGS`` to this process (module docstring); True when glibc took them.
    Idempotent; settings given through the environment win."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = True
    for param, (env, value) in MALLOC_SETTINGS.items():
        if env not in os.environ:
            ok = mallopt(param, value) == 1 and ok
    _done = ok
    return ok


def malloc_environment() -> dict[str, str]:
    """The same settings as environment variables, for a process started by another program (a
    benchmark peer), so that it runs with the allocator behaviour mstar's own processes have."""
    return {env: str(value) for env, value in MALLOC_SETTINGS.values()}
