"""``RequestHandle``'s hand-over between the runtime's thread (``on_item`` / ``on_end``, lock-free)
and its consumers (sync and async iteration, ``result``): every item once, in order, no wake-up lost."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from mstar.graph import FinishReason
from mstar.runtime.conductor import RequestStatus
from mstar.runtime.failures import FailureKind
from mstar.runtime.handles import RequestError, RequestHandle, held_wakeups
from mstar.runtime.wire.messages import Emit, EmitRows

N = 3000


def _emit(i: int, name: str = "token") -> Emit:
    return Emit("r", name, [torch.tensor([i])], "text", "llm", "decode")


def _produce(h: RequestHandle, n: int, status: RequestStatus = RequestStatus.FINISHED) -> threading.Thread:
    """A thread playing the runtime's: ``n`` items in bursts, then the end."""

    def run() -> None:
        for i in range(n):
            h.on_item(_emit(i, "token" if i % 3 else "other"))
            if i % 97 == 0:
                threading.Event().wait(0.0005)  # let the consumer catch up and wait again
        h.on_end(status, "boom" if status is RequestStatus.FAILED else None,
                 FailureKind.INTERNAL if status is RequestStatus.FAILED else None)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_sync_iteration_sees_every_item_in_order() -> None:
    h = RequestHandle("r")
    t = _produce(h, N)
    got = [int(item.value[0]) for item in h]
    t.join()
    assert got == list(range(N))
    assert list(h) == []  # a later iteration ends at once
    out = h.result(timeout=10)
    assert out.finished
    assert [int(v) for v in out.tensors("other")] == list(range(0, N, 3))
    assert len(out.tensors("token")) == N - len(range(0, N, 3))


def test_iterations_share_one_cursor_and_results_gather_once() -> None:
    h = RequestHandle("r")
    for i in range(5):
        h.on_item(_emit(i))
    it = iter(h)
    assert [int(next(it).value[0]) for _ in range(2)] == [0, 1]
    h.on_end(RequestStatus.FINISHED, None, None)
    assert [int(x.value[0]) for x in h] == [2, 3, 4]  # a new iteration goes on where the first stopped
    first = h.result()
    assert h.result() is first and len(first.tensors("token")) == 5
    assert repr(first).endswith("outputs={'token': 5 values})")  # names and counts, not the tensors


def test_async_iteration_sees_every_item_in_order() -> None:
    async def consume(h: RequestHandle) -> list[int]:
        return [int(item.value[0]) async for item in h]

    async def main() -> list[list[int]]:
        handles = [RequestHandle(f"r{i}") for i in range(4)]  # several handles on one loop's mailbox
        threads = [_produce(h, N // 4) for h in handles]
        got = await asyncio.gather(*(consume(h) for h in handles))
        for t in threads:
            t.join()
        return got

    for got in asyncio.run(main()):
        assert got == list(range(N // 4))


def test_held_wakeups_wake_each_loop_once_when_they_end() -> None:
    """Bursts delivered inside ``held_wakeups`` (as the drivers deliver a pass of messages): the
    waiting consumers' loop is not woken inside, once at the end, and every item arrives in order."""
    bursts, per_burst = 4, 5
    inside: list[int] = []

    seen: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}

    async def consume(h: RequestHandle) -> list[int]:
        got = seen[h.request_id]
        async for item in h:
            got.append(int(item.value[0]))
        return got

    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        calls: list[object] = []
        schedule = loop.call_soon_threadsafe

        def counted(*args):
            calls.append(args)
            return schedule(*args)

        loop.call_soon_threadsafe = counted
        handles = [RequestHandle(f"r{i}") for i in range(3)]
        tasks = [asyncio.create_task(consume(h)) for h in handles]
        woken = [asyncio.Event() for _ in range(bursts)]

        def produce() -> None:  # the runtime's thread: each burst once the consumers wait again
            for b in range(bursts):
                for _ in range(30_000):
                    if all(len(seen[h.request_id]) == b * per_burst and h._async_waiting for h in handles):
                        break
                    threading.Event().wait(0.001)  # every consumer took the last burst and waits again
                before = len(calls)
                with held_wakeups():
                    for i in range(b * per_burst, (b + 1) * per_burst):
                        for h in handles:
                            h.on_item(_emit(i))
                    inside.append(len(calls) - before)
                loop.call_soon_threadsafe(woken[b].set)
            for h in handles:
                h.on_end(RequestStatus.FINISHED, None, None)

        t = threading.Thread(target=produce)
        t.start()
        got = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        t.join()
        await asyncio.wait_for(asyncio.gather(*(w.wait() for w in woken)), 30)
        del loop.call_soon_threadsafe
        return got, len(calls)

    got, calls = asyncio.run(main())
    assert got == [list(range(bursts * per_burst))] * 3
    assert inside == [0] * bursts  # nothing scheduled inside a held pass
    # per burst: one wake-up of the loop (its mailbox) and the test's own marker; the ends: at most 3
    assert 2 * bursts <= calls <= 2 * bursts + 3


def test_failure_ends_either_iteration_with_the_error() -> None:
    h = RequestHandle("r")
    t = _produce(h, 50, RequestStatus.FAILED)
    with pytest.raises(RequestError, match="boom"):
        for _ in h:
            pass
    t.join()



def test_async_after_sync_goes_on_and_sync_after_async_is_refused() -> None:
    h = RequestHandle("r")
    for i in range(4):
        h.on_item(_emit(i))
    assert int(next(iter(h)).value[0]) == 0
    h.on_end(RequestStatus.FINISHED, None, None)

    async def consume() -> list[int]:
        return [int(item.value[0]) async for item in h]

    assert asyncio.run(consume()) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="asynchronously"):
        next(iter(h))


def _ping_pong(h: RequestHandle, acks: threading.Semaphore, n: int) -> threading.Thread:
    """The runtime's thread delivers item i only after the consumer took item i - 1: each item
    must wake a waiting consumer by itself (the end's wake-up would hide a lost one)."""
    missed: list[int] = []

    def run() -> None:
        for i in range(n):
            h.on_item(_emit(i))
            if not acks.acquire(timeout=10):
                missed.append(i)
                break
        h.on_end(RequestStatus.FINISHED, None, None)

    t = threading.Thread(target=run)
    t.missed = missed
    t.start()
    return t


def test_each_item_wakes_a_waiting_consumer() -> None:
    h, acks = RequestHandle("r"), threading.Semaphore(0)
    t = _ping_pong(h, acks, 200)
    for _ in h:
        acks.release()
    t.join()
    assert t.missed == []

    async def consume(h: RequestHandle, acks: threading.Semaphore) -> None:
        async for _ in h:
            acks.release()

    h, acks = RequestHandle("r"), threading.Semaphore(0)
    t = _ping_pong(h, acks, 200)
    asyncio.run(consume(h, acks))
    t.join()
    assert t.missed == []


def test_rows_of_a_batched_emit_read_as_items() -> None:
    rows = EmitRows(["x", "r"], ["a", "decode"], "token", "text", "llm", [torch.tensor([9]), torch.tensor([7])])
    h = RequestHandle("r")
    h.on_item(_emit(6))
    h.on_row(rows, 1)
    h.on_end(RequestStatus.FINISHED, None, None)
    items = list(h)
    assert [(int(i.value[0]), i.walk, i.modality) for i in items] == [(6, "decode", "text"), (7, "decode", "text")]
    assert [int(t) for t in h.result().tensors("token")] == [6, 7]


def test_rows_are_logged_without_a_tuple_each_and_read_in_order() -> None:
    """A row is logged as its ``EmitRows`` and index (no tuple kept per row for the collector to walk);
    sync and async readers, and the gathered outputs, see rows and single items in delivery order."""
    steps = [EmitRows(["r", "s"], ["decode", "decode"], "token", "text", "llm", [torch.tensor([k]), torch.tensor([-k])])
             for k in range(5)]
    other = EmitRows(["s", "r"], ["w", "decode"], "code", None, "cp", [torch.tensor([0]), torch.tensor([50])])

    def fill(h: RequestHandle) -> None:
        for k, rows in enumerate(steps):
            h.on_row(rows, 0)
            if k == 2:
                h.on_item(_emit(99))
                h.on_row(other, 1)
        h.on_end(RequestStatus.FINISHED, None, None)

    want = [("token", 0), ("token", 1), ("token", 2), ("token", 99), ("code", 50), ("token", 3), ("token", 4)]
    h = RequestHandle("r")
    fill(h)
    assert not any(type(e) is tuple for e in h._log)
    assert [(i.name, int(i.value[0])) for i in h] == want

    async def read(h: RequestHandle) -> list:
        return [(i.name, int(i.value[0])) async for i in h]

    h = RequestHandle("r")
    fill(h)
    assert asyncio.run(read(h)) == want
    out = h.result().outputs
    assert {k: [int(v[0]) for v in vals] for k, vals in out.items()} == {"token": [0, 1, 2, 99, 3, 4], "code": [50]}


def test_the_end_carries_a_finish_reason() -> None:
    reasons = []
    for status, finish in [(RequestStatus.FINISHED, FinishReason.LENGTH), (RequestStatus.FINISHED, None),
                           (RequestStatus.ABORTED, None), (RequestStatus.FAILED, None)]:
        h = RequestHandle("r")
        h.on_end(status, None, None, finish)
        reasons.append(h.result().finish_reason)
    assert reasons == [FinishReason.LENGTH, FinishReason.STOP, FinishReason.ABORT, FinishReason.ERROR]
