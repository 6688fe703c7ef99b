"""``mstar.runtime.malloc``: freed large buffers are reused by the next step instead of being mapped
and zeroed again (page faults counted by the kernel)."""

from __future__ import annotations

import ctypes.util
import os
import resource
import subprocess
import sys

import pytest

from mstar.runtime.malloc import MALLOC_SETTINGS, keep_freed_memory, malloc_environment

# A child process, so the measurement starts from glibc's defaults: allocate, touch and free a 12 MiB
# buffer (a Code2Wav activation at 16 requests) three times; print the minor faults of the last two.
_CHILD = """
import ctypes, resource, sys
from mstar.runtime.malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 12 << 20
def step():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step(); step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(not (ctypes.util.find_library("c") and os.confstr("CS_GNU_LIBC_VERSION")),
                           reason="glibc's malloc only")


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, env=env, check=True)
    return int(out.stdout.strip())


@glibc
def test_freed_buffers_are_reused_without_page_faults():
    pages = (12 << 20) // resource.getpagesize()
    # glibc's default: the later steps fault in fresh pages again (about half of them here, its
    # dynamic thresholds keep the rest); kept: they touch memory already mapped
    assert _faults("default") > pages // 4
    assert _faults("keep") < pages // 50


@glibc
def test_settings_apply_once_and_match_the_environment_form():
    assert keep_freed_memory() and keep_freed_memory()
    env = malloc_environment()
    assert set(env) == {name for name, _ in MALLOC_SETTINGS.values()}
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
