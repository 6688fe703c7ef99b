"""One Worker driven by hand through its messages; its transport only records what it sends."""

import dataclasses

import pytest
import torch

from mstar.placement import Placement, RuntimeLimits
from mstar.runtime.failures import FailureKind
from mstar.runtime.keys import PartitionKey, StreamKey, WalkKey, decode_counts
from mstar.runtime.routing import Routing
from mstar.runtime.wire.messages import (
    CONDUCTOR,
    ExecNode,
    FreeRequest,
    RequestFailed,
    StartWalk,
    StreamPush,
    WalkDone,
)
from mstar.runtime.worker import Worker
from tests.test_conductor import Outbox
from tests.toy_models import STREAM_STEPS, WINDOW, ToyStream


def worker(**limits):
    model = ToyStream()
    placement = Placement.single_rank(model.graph, model=model.name).validate(model.graph)
    if limits:
        placement = dataclasses.replace(placement, limits=RuntimeLimits(**limits))
    box = Outbox()
    return Worker(0, model, Routing(model.graph, placement), box), box


def exec_node(node, rid="r", partition="prod", walk="gen"):
    return ExecNode(rid, partition, walk, 0, node, (0,), {"x": [torch.tensor(0.0)]}, {}, {}, 0)


def test_queue_choice_is_first_come_first_served_across_modules():
    w, _ = worker()
    w.handle(exec_node("summer", "a", "cons", "window"))
    w.handle(exec_node("counter", "b"))
    w.handle(exec_node("counter", "c"))
    base, batch = w.next_batch()
    assert base == "summer" and [i.request_id for i in batch] == ["a"]
    base, batch = w.next_batch()
    assert base == "counter" and [i.request_id for i in batch] == ["b", "c"]
    assert w.next_batch() is None


@pytest.mark.parametrize("scheduling", ["downstream_first", "fcfs"])
def test_downstream_first_runs_the_consumer_partition_unless_an_item_is_overdue(scheduling):
    """``counter`` (partition ``prod``) queued before ``summer`` (``cons``, fed by ``prod``'s stream):
    FCFS runs ``counter`` first; downstream_first runs ``summer`` first, unless ``counter``'s item
    waited longer than ``scheduling_max_wait_ms``."""
    w, _ = worker(scheduling=scheduling, scheduling_max_wait_ms=60_000)  # none overdue unless made so
    w.handle(exec_node("counter", "b"))
    w.handle(exec_node("summer", "a", "cons", "window"))
    first = "summer" if scheduling == "downstream_first" else "counter"
    assert w.next_batch()[0] == first
    assert w.next_batch()[0] != first and w.next_batch() is None
    w.handle(exec_node("counter", "b"))
    w.handle(exec_node("summer", "a", "cons", "window"))
    w.queues["counter"][0].queued_at -= 61.0  # overdue: FCFS among the overdue, whatever the policy
    assert w.next_batch()[0] == "counter"


def test_an_overdue_producer_item_whose_consumer_holds_its_chunks_waits():
    """``counter``'s item for ``b`` is overdue, but the consumer partition of ``b`` on this rank holds
    a chunk from ``prod`` it has not taken: the item is ahead, so ``summer`` (deeper) runs first. Once
    that chunk is taken the same item is overdue again; a request without such a chunk (``c``) keeps
    the guard."""
    w, _ = worker(scheduling_max_wait_ms=0.0)
    w.handle(StreamPush("b", "prod", "cons", "summer", "item", [torch.tensor(1.0)] * WINDOW, 0))
    assert w.inbox.buffers[PartitionKey("b", "cons")].pending_from("prod")
    w.handle(exec_node("counter", "b"))
    w.handle(exec_node("summer", "a", "cons", "window"))
    w.queues["counter"][0].queued_at -= 1.0
    assert w.next_batch()[0] == "summer"
    w.handle(exec_node("summer", "a", "cons", "window"))
    assert w.inbox.buffers[PartitionKey("b", "cons")].pull("summer", "item") is not None  # the consumer takes it
    assert w.next_batch()[0] == "counter"
    w.queues["summer"].clear()
    w.handle(exec_node("counter", "c"))
    w.handle(exec_node("summer", "a", "cons", "window"))
    w.queues["counter"][0].queued_at -= 1.0
    assert w.next_batch()[0] == "counter"


def test_an_overdue_producer_item_waits_while_its_request_has_deeper_work_queued():
    """``counter``'s item for ``b`` is overdue, but ``b`` has a ``summer`` item (a deeper stage) queued
    here: that item runs first. An overdue item of a request without deeper work (``c``) keeps the
    guard, and deeper work of a module that cannot run now (stalled for KV blocks) does not count."""
    w, _ = worker(scheduling_max_wait_ms=0.0)
    w.handle(exec_node("counter", "b"))
    w.handle(exec_node("summer", "b", "cons", "window"))
    w.queues["counter"][0].queued_at -= 1.0
    assert w.next_batch()[0] == "summer"
    assert w.next_batch()[0] == "counter"
    w.handle(exec_node("counter", "b"))
    w.handle(exec_node("summer", "b", "cons", "window"))
    w.queues["counter"][0].queued_at -= 1.0
    w.admission.stalled.add("summer")
    assert w.next_batch()[0] == "counter"
    w.admission.stalled.clear()
    w.queues["summer"].clear()
    w.handle(exec_node("counter", "c"))
    w.handle(exec_node("summer", "a", "cons", "window"))
    w.queues["counter"][0].queued_at -= 1.0
    assert w.next_batch()[0] == "counter"


def test_batches_respect_the_module_limit():
    w, _ = worker()
    w.sched.max_batch["counter"] = 2
    for rid in "abc":
        w.handle(exec_node("counter", rid))
    assert [len(w.next_batch()[1]) for _ in range(2)] == [2, 1]


def test_a_walk_streams_in_order_and_reports_its_counts():
    w, box = worker()
    w.handle(StartWalk("r", "prod", "gen", 0, {"x": [torch.tensor(0.0)]}, {}))
    while w.step():
        pass
    pushes = [m for d, m in box.sent if isinstance(m, StreamPush)]
    assert [p.offset for p in pushes] == list(range(STREAM_STEPS))
    assert [float(p.items[0]) for p in pushes] == [10.0 * i for i in range(STREAM_STEPS)]
    [done] = [m for d, m in box.sent if d == CONDUCTOR and isinstance(m, WalkDone)]
    assert decode_counts(done.streamed) == {StreamKey("cons", "summer", "item"): STREAM_STEPS}
    assert not w.walks


def test_bad_walk_inputs_fail_the_request_as_input():
    w, box = worker()
    w.handle(StartWalk("r", "prod", "gen", 0, {}, {}))
    [(dest, failed)] = box.take(RequestFailed)
    assert dest == CONDUCTOR and failed.kind is FailureKind.INPUT and "needs inputs" in failed.error


def test_messages_of_a_freed_request_are_dropped():
    w, _ = worker()
    w.handle(exec_node("counter", "r"))
    w.handle(FreeRequest("r"))
    assert w.next_batch() is None
    w.handle(exec_node("counter", "r"))  # sent before its sender learned of the end
    assert w.next_batch() is None


# -- KV pressure: a small cache (4 blocks of 4 tokens) on one LM worker ----------------------------------
def lm_worker():
    from tests.toy_models import ToyLM

    model = ToyLM()
    placement = Placement.from_dict({"model": model.name, "node_groups": [{"node_names": ["LLM"], "ranks": [0]}],
                                     "runtime": {"kv_cache_blocks": 4, "kv_block_size": 4}}).validate(model.graph)
    box = Outbox()
    return Worker(0, model, Routing(model.graph, placement), box), box


def prefill(w, rid, n, max_tokens=8):
    w.handle(StartWalk(rid, "main", "prefill", 0, {"input_ids": [torch.arange(1, n + 1)]}, {"max_tokens": max_tokens}))


def decode(w, box, rid, max_tokens=8):
    [done] = [m for _, m in box.sent if isinstance(m, WalkDone) and m.request_id == rid and m.walk == "prefill"]
    w.handle(StartWalk(rid, "main", "decode", 1, {"token": done.state["token"]}, {"max_tokens": max_tokens}))


def test_an_item_without_blocks_waits_for_an_older_request():
    w, box = lm_worker()
    prefill(w, "a", 12)
    prefill(w, "b", 8)
    assert w.step()  # a's prefill runs (3 blocks); b's does not fit and waits, first in the queue
    assert w.stats()["waiting"] == {"LLM": 1} and [it.request_id for it in w.queues["LLM"]] == ["b"]
    assert not w.step()  # only a, older, holds blocks: b waits (nothing is preempted, nothing fails)
    assert w.stats()["preemptions"] == {"LLM": 0} and not box.take(RequestFailed)
    w.handle(FreeRequest("a"))
    assert w.step() and w.stats()["waiting"] == {"LLM": 0}


def test_a_long_prompt_is_not_overtaken_by_younger_short_ones():
    w, box = lm_worker()
    prefill(w, "a", 8)
    assert w.step()  # a holds 2 of the 4 blocks
    prefill(w, "long", 12)
    assert not w.step()  # waits for a's blocks
    prefill(w, "short", 4)  # would fit in the 2 free blocks, but waits behind the older long prompt
    assert not w.step()
    assert w.stats()["waiting"] == {"LLM": 2} and w.engines["LLM"].holders() == ["a"]
    w.handle(FreeRequest("a"))
    assert w.step() and {m.request_id for _, m in box.take(WalkDone)} == {"a", "long"}
    assert w.step() and [m.request_id for _, m in box.take(WalkDone)] == ["short"]


def test_the_youngest_holder_is_swapped_out_for_an_older_request_and_resumes():
    w, box = lm_worker()
    prefill(w, "a", 3)
    prefill(w, "b", 12)
    assert w.step()  # both prefills: 1 + 3 blocks, the cache is full
    decode(w, box, "a")
    while not w.engines["LLM"].is_swapped("b"):  # a's 5th token needs a block: b, younger, gives its own
        assert w.step()
    assert w.stats()["preemptions"] == {"LLM": 1} and w.stats()["kv"]["LLM"]["swapped_requests"] == 1
    decode(w, box, "b")
    while w.step():
        pass
    assert not box.take(RequestFailed) and set(w.walks.keys()) == {WalkKey("b", "main", 1)}  # b waits for a
    w.handle(FreeRequest("a"))
    while w.step():
        pass
    assert not w.walks and not w.engines["LLM"].is_swapped("b")


def test_a_request_larger_than_the_cache_fails_out_of_memory():
    w, box = lm_worker()
    prefill(w, "big", 20)
    assert w.step() and not w.queues["LLM"]
    [(_, failed)] = box.take(RequestFailed)
    assert failed.kind is FailureKind.OUT_OF_MEMORY and "4 blocks of 4 tokens" in failed.error
    assert w.engines["LLM"].manager.pool.num_used == 0
