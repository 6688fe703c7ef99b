"""``StatsGather``: the conductor's stats calls, each gathering every rank's ``StatsReply`` into one
future (on the conductor's thread)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from mstar.runtime.routing import Routing
from mstar.runtime.wire.messages import StatsReply, StatsRequest

__all__ = ["StatsGather"]


@dataclass
class _StatsCall:
    future: Future
    replies: dict[int, dict] = field(default_factory=dict)  # rank -> its stats


class StatsGather:
    def __init__(self, routing: Routing, transport, running: Callable[[], int]) -> None:
        self.routing, self.transport, self.running = routing, transport, running
        self._calls: dict[int, _StatsCall] = {}
        self._tokens = itertools.count()

    def collect(self, future: Future) -> None:
        """Ask every rank for its stats; ``future`` gets them all (a list in rank order)."""
        token = next(self._tokens)
        self._calls[token] = _StatsCall(future)
        for r in range(self.routing.num_ranks):
            self.transport.send(r, StatsRequest(token))

    def fail(self, error: str) -> None:
        """End every stats call still waiting (a rank is lost: its reply may never come)."""
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.future.set_exception(RuntimeError(f"stats unavailable: {error}"))

    def reply(self, msg: StatsReply) -> None:
        call = self._calls.get(msg.token)
        if call is None:
            return
        call.replies[msg.rank] = msg.stats
        if len(call.replies) == self.routing.num_ranks:
            del self._calls[msg.token]
            call.future.set_result({"ranks": [call.replies[r] for r in sorted(call.replies)],
                                    "running_requests": self.running()})
