"""Small helpers several test modules share."""

from __future__ import annotations


def kv_blocks_in_use(runtime) -> int:
    """KV blocks held across every rank and KV module of a running ``Runtime``."""
    return sum(kv["blocks_used"] for r in runtime.stats()["ranks"] for kv in r["kv"].values())
