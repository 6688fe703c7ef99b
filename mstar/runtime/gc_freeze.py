"""Objects that live as long as the runtime, kept out of Python's full garbage collections.

A process that has imported torch and transformers and built a model holds about a million Python
objects. Every so often the collector's oldest generation is collected, and that walks all of them
in the middle of whichever step was running: a pause longer than many whole steps, landing on
whichever requests happen to be in flight. The runtime's own
steps allocate few long-lived objects, so nearly everything a full collection walks was there
before the first request.

``freeze_startup_objects()`` collects once, then moves every object alive into the permanent
generation (``gc.freeze``), which later collections skip; the young generations are collected as
before, so a step's garbage goes as it did. A worker process freezes after building its worker and
keeps that to its end. ``Runtime.start()`` freezes the serving process's objects; its
``shutdown()`` calls ``thaw()``, so objects that outlive their use by then (a model shut down
while a test run goes on) are collectable again.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_objects", "thaw"]


def freeze_startup_objects() -> int:
    """Collect, then freeze every object alive (module docstring); returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Frozen objects back into the oldest generation (collected again by later full collections)."""
    gc.unfreeze()
