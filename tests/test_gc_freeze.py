"""The runtime keeps what it was built with out of Python's full collections (gc_freeze.py)."""

from __future__ import annotations

import gc
import weakref

import torch

from mstar.models.llama.model import LlamaTiny
from mstar.runtime import Runtime
from mstar.runtime.gc_freeze import freeze_startup_objects, thaw


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_and_thaw():
    try:
        alive = _Cycle()
        assert freeze_startup_objects() > 0
        frozen = gc.get_freeze_count()
        ref = weakref.ref(alive)
        del alive  # garbage now, but frozen: a full collection does not see it
        gc.collect()
        assert ref() is not None
        thaw()
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert ref() is None and frozen > 0
    finally:
        thaw()


def test_runtime_freezes_at_start_and_thaws_at_shutdown():
    before = _Cycle()
    ref = weakref.ref(before)
    with Runtime(LlamaTiny()) as rt:
        assert gc.get_freeze_count() > 0  # the model, the libraries, the cycle above
        [out] = rt.generate([{"input_ids": torch.tensor([3, 4, 5])}],
                            {"max_tokens": 3, "sampling": {"temperature": 0.0, "ignore_eos": True}})
        assert out.finished
        del before
        gc.collect()
        assert ref() is not None  # frozen while the runtime serves
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # collectable again after shutdown
