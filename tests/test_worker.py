"""One Worker driven by hand through its messages; its transport only records what it sends."""

import torch

from mstar.placement import Placement
from mstar.runtime.failures import FailureKind
from mstar.runtime.keys import StreamKey, decode_counts
from mstar.runtime.messages import (
    CONDUCTOR,
    ExecNode,
    FreeRequest,
    RequestFailed,
    StartWalk,
    StreamPush,
    WalkDone,
)
from mstar.runtime.routing import Routing
from mstar.runtime.worker import Worker
from tests.test_conductor import Outbox
from tests.toy_models import STREAM_STEPS, ToyStream


def worker():
    model = ToyStream()
    placement = Placement.single_rank(model.graph, model=model.name).validate(model.graph)
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


def test_batches_respect_the_module_limit():
    w, _ = worker()
    w.max_batch["counter"] = 2
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
    assert w.walks == {}


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
