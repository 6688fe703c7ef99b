"""Small helpers several test modules share."""

from __future__ import annotations


def kv_blocks_in_use(runtime) -> int:
    """KV blocks held across every rank and KV module of a running ``Runtime``."""
    return sum(kv["blocks_used"] for r in runtime.stats()["ranks"] for kv in r["kv"].values())


def until_response_done(conn) -> list:
    """A realtime connection's events up to and including ``response.done``."""
    events = []
    for event in conn:
        events.append(event)
        if event.type == "response.done":
            return events
    raise AssertionError(f"the connection closed before response.done: {[e.type for e in events]}")
