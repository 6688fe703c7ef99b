"""Idle OpenMP thread pools, and why the runtime frees them.

PyTorch's CPU build runs its parallel operators on GNU OpenMP (libgomp). Every thread that runs a
parallel region keeps a pool of worker threads for the next one. libgomp counts the workers of
ALL pools, and once a process has more of them than CPUs it stops spinning between regions
("throttled") and parks its workers on a futex instead, so every later region pays a wake-up.
On a machine with few cores that wake-up is larger than a small operator itself: the runtime's
thread is throttled as soon as the main thread has a pool too (the main thread built the model),
and a model made of many small operators (Qwen3-Omni's code predictor and MoE experts) then spends
its steps waking threads rather than computing.

The inline runtime computes on its own thread, so it frees the other pools it can reach:

* the caller's pool at ``Runtime.start()`` and at each ``submit`` (the thread that built the
  model or ran other torch work before it; freed pools are recreated on demand, once);
* its own pool whenever it goes idle, so that torch work on other threads between requests (a
  baseline in the same process, a client's preprocessing) is not throttled by it.

``omp_pause_resource_all`` (OpenMP 5.0) frees the calling thread's pool only; it is a cheap
no-op when the thread has none. With another OpenMP runtime (or none) these calls do nothing.
Worker processes compute on their main thread and are not affected.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Callable

__all__ = ["release_thread_pool"]

_OMP_PAUSE_SOFT = 1
_pause: Callable[[int], int] | None = None
_looked_up = False


def _find_pause() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all`` as loaded by torch, or None."""
    import torch

    candidates = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    for name in [*candidates, "libgomp.so.1"]:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only one already loaded
        except OSError:
            continue
        fn = getattr(lib, "omp_pause_resource_all", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's idle OpenMP worker pool (module docstring); True when libgomp took
    the call. Must not be called from inside a parallel region (it is not: Python never runs there)."""
    global _pause, _looked_up
    if not _looked_up:
        _pause, _looked_up = _find_pause(), True
    return _pause is not None and _pause(_OMP_PAUSE_SOFT) == 0
