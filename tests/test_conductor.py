"""The conductor driven by hand: fake workers are a transport that records what it is sent, and the
test answers as workers would. No worker, no forward pass."""

from concurrent.futures import Future

import torch

from mstar.graph import DEFAULT_PARTITION
from mstar.placement import Placement
from mstar.runtime.conductor import Conductor, RequestStatus
from mstar.runtime.failures import FailureKind
from mstar.runtime.keys import StreamKey, decode_counts, encode_counts
from mstar.runtime.routing import Routing
from mstar.runtime.wire.messages import (
    Emit,
    EmitRows,
    Emits,
    FreeRequest,
    KVMoved,
    MigrateKV,
    PartitionReady,
    RequestFailed,
    StartWalk,
    StatsReply,
    StatsRequest,
    StreamEnd,
    WalkDone,
)
from tests.test_runtime import PD_SPLIT
from tests.toy_models import EOS, ToyLM, ToyStream


class Outbox:
    def __init__(self):
        self.sent = []

    def send(self, dest, msg):
        self.sent.append((dest, msg))

    def take(self, kind=None):
        out = [(d, m) for d, m in self.sent if kind is None or isinstance(m, kind)]
        self.sent = [(d, m) for d, m in self.sent if not (kind is None or isinstance(m, kind))]
        return out


class Sink:
    def __init__(self):
        self.items, self.end = [], None

    def on_item(self, msg):
        self.items.append(msg.value)

    def on_row(self, rows, i):
        self.items.append(rows.value(i))

    def on_end(self, status, error, failure, finish=None):
        self.end = (status, error, failure)
        self.finish = finish


def conductor(model, placement=None):
    placement = (placement or Placement.single_rank(model.graph, model=model.name)).validate(model.graph)
    box = Outbox()
    return Conductor(model, Routing(model.graph, placement), box), box


def submit(c, rid="r", ids=(1, 2), max_tokens=4):
    sink = Sink()
    c.submit(rid, {"input_ids": [torch.tensor(list(ids))]}, {"max_tokens": max_tokens}, sink)
    return sink


def test_walks_follow_next_walk_and_the_end_frees_every_rank():
    c, box = conductor(ToyLM())
    sink = submit(c)
    [(rank, start)] = box.take()
    assert rank == 0 and isinstance(start, StartWalk)
    assert (start.walk, start.walk_seq, list(start.inputs)) == ("prefill", 0, ["input_ids"])
    c.handle(Emit("r", "token", [torch.tensor(5)], None, "LLM", "prefill"))
    c.handle(WalkDone("r", DEFAULT_PARTITION, "prefill", {"token": [torch.tensor(5)]}))
    [(_, decode)] = box.take()
    assert (decode.walk, decode.walk_seq) == ("decode", 1)
    assert int(decode.inputs["token"][0]) == 5  # what the walk routed TO_STATE feeds the next walk
    c.handle(WalkDone("r", DEFAULT_PARTITION, "decode", {}))
    assert [type(m) for _, m in box.take()] == [FreeRequest]
    assert sink.end == (RequestStatus.FINISHED, None, None) and len(sink.items) == 1
    assert c.num_running() == 0


def test_eos_after_prefill_ends_without_decode():
    c, box = conductor(ToyLM())
    sink = submit(c)
    box.take()
    c.handle(WalkDone("r", DEFAULT_PARTITION, "prefill", {"token": [torch.tensor(EOS)]}))
    assert [type(m) for _, m in box.take()] == [FreeRequest]
    assert sink.end[0] is RequestStatus.FINISHED


def test_failure_keeps_its_kind_and_late_messages_are_ignored():
    c, box = conductor(ToyLM())
    sink = submit(c)
    c.handle(RequestFailed("r", "ValueError: bad", FailureKind.INPUT))
    assert sink.end == (RequestStatus.FAILED, "ValueError: bad", FailureKind.INPUT)
    box.take()
    c.handle(WalkDone("r", DEFAULT_PARTITION, "prefill", {"token": [torch.tensor(5)]}))  # after the end: dropped
    assert box.take() == []


def test_abort_frees_and_reports_aborted():
    c, box = conductor(ToyLM())
    sink = submit(c)
    c.abort("r")
    assert sink.end[0] is RequestStatus.ABORTED and sink.end[2] is FailureKind.ABORTED
    assert any(isinstance(m, FreeRequest) for _, m in box.take())


def test_a_broken_next_walk_fails_that_request_only():
    class Broken(ToyLM):
        def next_walk(self, state):
            return "no-such-walk"

    c, box = conductor(Broken())
    sink = submit(c)
    assert sink.end[0] is RequestStatus.FAILED and sink.end[2] is FailureKind.INTERNAL


def test_next_walk_moves_the_kv_cache_before_the_walk_starts():
    c, box = conductor(ToyLM(), Placement.from_dict(PD_SPLIT))
    submit(c)
    box.take()
    c.handle(WalkDone("r", DEFAULT_PARTITION, "prefill", {"token": [torch.tensor(5)]}))
    [(src, move)] = box.take()  # the decode walk waits for its cache
    assert src == 0 and isinstance(move, MigrateKV) and move.dests == [1] and not move.keep
    c.handle(KVMoved("r", move.tokens[0]))
    [(dest, start)] = box.take()
    assert dest == 1 and start.walk == "decode"


def test_stats_future_gets_every_rank():
    c, box = conductor(ToyLM(), Placement.from_dict(PD_SPLIT))
    fut = Future()
    c.stats.collect(fut)
    asks = box.take(StatsRequest)
    assert sorted(d for d, _ in asks) == [0, 1]
    token = asks[0][1].token
    c.handle(StatsReply(token, 1, {"rank": 1}))
    assert not fut.done()
    c.handle(StatsReply(token, 0, {"rank": 0}))
    assert fut.result(0) == {"ranks": [{"rank": 0}, {"rank": 1}], "running_requests": 0}


def test_streams_end_with_the_counts_each_consumer_expects():
    c, box = conductor(ToyStream())
    sink = Sink()
    c.submit("r", {"x": [torch.tensor(0.0)]}, {}, sink)
    [(_, gen)] = box.take()
    assert gen.walk == "gen"
    key = StreamKey("cons", "summer", "item")
    c.handle(WalkDone("r", "prod", "gen", {}, encode_counts({key: 10})))
    [(_, end)] = box.take()
    assert isinstance(end, StreamEnd) and (end.from_partition, end.partition) == ("prod", "cons")
    assert decode_counts(end.expected) == {key: 10}
    c.handle(PartitionReady("r", "cons", True))  # streams drained: next_walk says the consumer is done
    assert [type(m) for _, m in box.take()] == [FreeRequest]
    assert sink.end[0] is RequestStatus.FINISHED


def test_stream_keys_survive_any_name():
    key = StreamKey("a/b", "n/o/d", 'e"x')
    assert StreamKey.decode(key.encode()) == key


def test_emit_rows_reach_each_live_request_in_row_order():
    c, _ = conductor(ToyLM())
    a, b = submit(c, "a"), submit(c, "b")
    rows = EmitRows(["a", "gone", "b", "a"], ["decode"] * 4, "token", None, "LLM",
                    [torch.tensor([1]), torch.tensor([2]), [], (torch.tensor([4]),)])
    c.handle(Emits([Emit("b", "token", [torch.tensor(0)], None, "LLM", "decode"), rows]))
    assert [[int(t) for t in v] for v in a.items] == [[1], [4]]  # a tensor row as a one-tensor list
    assert [[int(t) for t in v] for v in b.items] == [[0]]  # an empty row sends nothing


def test_emit_rows_sinks_are_looked_up_again_once_a_request_ends():
    c, _ = conductor(ToyLM())
    a, b = submit(c, "a"), submit(c, "b")
    rids = ["a", "b"]  # the same list at every step, as a worker's running rows send it

    def step(k):
        c.handle(Emits([EmitRows(rids, ["decode"] * 2, "token", None, "LLM", [torch.tensor([k]), torch.tensor([k])])]))

    step(1)
    step(2)
    c.abort("b")
    step(3)  # b ended: its row is dropped, a's still delivered
    c2 = submit(c, "c")  # a start: looked up again too
    step(4)
    assert [int(v[0]) for v in a.items] == [1, 2, 3, 4]
    assert [int(v[0]) for v in b.items] == [1, 2] and b.end[0] is RequestStatus.ABORTED
    assert c2.items == []
