"""Every message that crosses a process boundary, in one place.

Workers and the conductor exchange only these dataclasses, encoded by
``mstar.runtime.wire.serialization`` (msgpack + raw tensor frames). Edge values are lists of tensors.
Stream counts (``stream_offsets``, ``streamed``, ``expected``) are keyed by ``StreamKey.encode()``:
see ``mstar.runtime.keys.encode_counts`` / ``decode_counts``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar.graph.finish import FinishReason
from mstar.runtime.failures import FailureKind
from mstar.runtime.keys import WalkKey
from mstar.runtime.wire.serialization import register_message
from mstar.runtime.work_items import as_values

register_message(FinishReason)  # sent by value

CONDUCTOR = -1  # address of the conductor; workers are addressed by rank


@register_message
@dataclass
class StartWalk:
    """Conductor -> home worker: run ``walk`` of ``partition`` for a request."""

    request_id: str
    partition: str
    walk: str
    walk_seq: int  # how many walks this partition ran before: identifies the walk instance
    inputs: dict[str, Any]
    params: dict[str, Any]
    stream_offsets: dict[str, int] = field(default_factory=dict)  # stream -> items pushed by earlier walks

    @property
    def walk_key(self) -> WalkKey:
        return WalkKey(self.request_id, self.partition, self.walk_seq)


@register_message
@dataclass
class WalkDone:
    """Home worker -> conductor: the walk ended; ``state`` holds the values routed TO_STATE."""

    request_id: str
    partition: str
    walk: str
    state: dict[str, Any] = field(default_factory=dict)
    streamed: dict[str, int] = field(default_factory=dict)  # stream -> items this walk pushed
    finish: FinishReason | None = None  # why it ended, when a dynamic loop of it says (``WalkTracker.finish``)


@register_message
@dataclass(slots=True)
class Emit:
    """Worker -> conductor: a value for the client (EMIT_TO_CLIENT)."""

    request_id: str
    name: str
    value: Any
    modality: str | None
    node: str
    walk: str


@register_message
@dataclass(slots=True)
class EmitRows:
    """Worker -> conductor: the client values of one output of a batched forward, a row each (what
    an ``Emit`` per row would say, made once per forward): row ``i``'s value for ``request_ids[i]``
    is ``values[i]`` (a module's per-row value: a list, a tuple, or one tensor; an empty list or
    tuple sends nothing)."""

    request_ids: list[str]
    walks: list[str]
    name: str
    modality: str | None
    node: str
    values: list

    def value(self, i: int) -> list:
        """Row ``i``'s value as the list an ``Emit`` carries."""
        return as_values(self.values[i])

    def emit(self, i: int) -> Emit:
        """Row ``i`` as an ``Emit``."""
        return Emit(self.request_ids[i], self.name, self.value(i), self.modality, self.node, self.walks[i])


@register_message
@dataclass
class Emits:
    """Worker -> conductor: the ``Emit`` / ``EmitRows`` messages of one worker step (or one handled
    message), in order, as one message; whatever the worker tells the conductor next is sent after
    them."""

    items: list[Emit | EmitRows]
    request_id: None = None  # the items carry their requests


@register_message
@dataclass
class ExecNode:
    """Home worker -> worker holding ``node``: run one node instance, send the result back."""

    request_id: str
    partition: str
    walk: str
    walk_seq: int
    node: str
    iteration: tuple
    inputs: dict[str, Any]
    chunks: dict[str, Any]  # input -> {"start", "new_start", "is_final"} for stream inputs
    params: dict[str, Any]
    home: int

    @property
    def walk_key(self) -> WalkKey:
        return WalkKey(self.request_id, self.partition, self.walk_seq)


@register_message
@dataclass
class NodeResult:
    """Worker -> home worker: outputs of an ExecNode."""

    request_id: str
    partition: str
    walk_seq: int
    node: str
    iteration: tuple
    outputs: dict[str, Any]

    @property
    def walk_key(self) -> WalkKey:
        return WalkKey(self.request_id, self.partition, self.walk_seq)


@register_message
@dataclass
class StreamPush:
    """Producer's worker -> consumer partition's home worker: items for a stream buffer."""

    request_id: str
    from_partition: str
    partition: str
    node: str
    name: str
    items: list
    offset: int  # stream index of items[0]: pushes from different walks/ranks are applied in order


@register_message
@dataclass
class StreamEnd:
    """Conductor -> consumer home: the producing partition finished."""

    request_id: str
    from_partition: str
    partition: str
    expected: dict[str, int] = field(default_factory=dict)  # stream -> total items it carries (all streams
    # of the request; the consumer reads those into ``partition``)


@register_message
@dataclass
class PartitionReady:
    """Consumer home -> conductor: an idle consumer partition has a chunk (or its streams ended)."""

    request_id: str
    partition: str
    streams_done: bool


@register_message
@dataclass
class RequestFailed:
    request_id: str
    error: str
    kind: FailureKind = FailureKind.INTERNAL


@register_message
@dataclass
class FreeRequest:
    """Conductor -> every worker: drop all state of a request (finished, aborted or failed);
    ``keep_trace`` False: its node runs too (a request submitted untraced)."""

    request_id: str
    keep_trace: bool = True


@register_message
@dataclass
class StatsRequest:
    token: int


@register_message
@dataclass
class StatsReply:
    token: int
    rank: int
    stats: dict[str, Any]


@register_message
@dataclass
class TraceRequest:
    """Conductor -> every worker: the node runs it kept of these requests (``trace.NodeRuns``)."""

    token: int
    request_ids: list[str]


@register_message
@dataclass
class TraceReply:
    token: int
    rank: int
    runs: dict[str, Any]  # request id -> {"runs": [...], "not_kept": {...}}


@register_message
@dataclass
class Shutdown:
    reason: str = ""


@register_message
@dataclass
class WorkerStatus:
    """Worker process -> conductor: ready to serve (ok) or failed to start (error holds why)."""

    rank: int
    ok: bool
    error: str = ""
    weight_bytes: int = 0  # ready: bytes its modules' weights hold in memory (prepack.held_weight_bytes)


@register_message
@dataclass
class MigrateKV:
    """Conductor -> worker holding a request's caches of ``module``: send them to ranks ``dests``
    (one ack token each); ``keep``: copy (the source keeps its caches) rather than move."""

    request_id: str
    module: str
    dests: list
    tokens: list
    keep: bool = False


@register_message
@dataclass
class FreeKV:
    """Conductor -> worker: drop a request's copy of ``module``'s caches (the walk that needed it ended)."""

    request_id: str
    module: str


@register_message
@dataclass
class KVImport:
    """Worker -> worker: a request's caches of ``module``: name -> {num_tokens, k: [layer], v: [layer]}."""

    request_id: str
    module: str
    caches: dict[str, Any]
    token: int


@register_message
@dataclass
class KVMoved:
    """Destination worker -> conductor: the caches of a migration are in place."""

    request_id: str
    token: int
