"""``ModelDef``: what a model author writes — a Walk Graph, a ``next_walk`` state machine and the
factory of the submodules that compute each node."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from mstar.graph import FinishReason, WalkGraph
from mstar.model.submodule import NodeSubmodule


@dataclass
class WalkState:
    """One request's state as the model's ``next_walk`` sees it, per partition.

    ``tensors`` holds values kept on the request: the request's own inputs plus every value a walk
    routed ``TO_STATE`` (by edge name; a later value replaces an earlier one). ``history`` lists
    the walks this partition has finished, in order. Models subclass this to add their own fields
    (e.g. BAGEL's list of pending prefill steps) and build it in ``ModelDef.create_state``.
    """

    request_id: str
    partition: str
    params: Any  # the request's params as the model parsed them (``ModelDef.parse_request``)
    tensors: dict[str, list[Any]] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)
    stream_done: bool = False  # consumer partitions: the producer finished and the stream is drained
    finish: FinishReason | None = None  # why the last walk ended, when a dynamic loop of it said (a stop flag)

    @property
    def last_walk(self) -> str | None:
        return self.history[-1] if self.history else None


class ModelDef:
    """Base class of every model.

    Subclasses implement ``build_graph`` and ``next_walk``, and ``build_submodules`` to be
    servable. ``views`` maps a node that is a weight-sharing view of another node to that node
    (BAGEL's ``LLM_cfg_text`` -> ``LLM``): the runtime then batches them in one forward and gives
    each its own cache name.
    """

    name: str = "model"
    family: str | None = None  # a placement file written for the family also fits (e.g. "bagel" for "bagel-tiny")
    views: Mapping[str, str] = {}

    def build_graph(self) -> WalkGraph:
        raise NotImplementedError

    @cached_property
    def graph(self) -> WalkGraph:
        g = self.build_graph()
        if not isinstance(g, WalkGraph):
            raise TypeError(f"{type(self).__name__}.build_graph() must return a WalkGraph, got {type(g).__name__}")
        for view, base in self.views.items():
            if view not in g.node_names or base not in g.node_names:
                raise ValueError(f"{type(self).__name__}.views: {view!r} -> {base!r} names a node no walk uses")
        return g

    def __getstate__(self) -> dict:
        # a ModelDef travels to worker processes; its compiled graph (which may hold lambdas, e.g.
        # chunk-policy factories) is rebuilt there from build_graph()
        state = dict(self.__dict__)
        state.pop("graph", None)
        return state

    def create_state(self, request_id: str, partition: str, inputs: Mapping[str, list[Any]],
                     params: Mapping[str, Any]) -> WalkState:
        return WalkState(request_id=request_id, partition=partition, params=params, tensors=dict(inputs))

    def next_walk(self, state: WalkState) -> str | None:
        """Name of the walk this partition of the request runs next, or None when it is finished."""
        raise NotImplementedError

    def finish_reason(self, state: WalkState) -> FinishReason | None:
        """Why this partition of the request ended (``next_walk`` just returned None): by default the
        reason its last walk ended with (``state.finish``: a dynamic loop's stop flag, or ``LENGTH``
        at the loop's bound). A model whose request can end after a walk without a loop (a prefill
        whose first token is the last) reads it from the state. None says nothing: the request's
        reason is then another partition's, or ``STOP``."""
        return state.finish

    def preflight(self) -> None:
        """Cheap checks run where the ``Runtime`` is built, before any worker starts (e.g. that the
        checkpoint directory exists and its configs parse); raise with a clear message."""

    # ``validate_request`` looks up every params key the model uses (it need not use each value):
    # ``Runtime.submit`` then refuses any other key by name instead of ignoring it
    checks_params: bool = False

    # the family's typed request (``mstar.model.request``), when ``parse_request`` makes one
    request_type: type | None = None

    def parse_request(self, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> Any:
        """The request's params, parsed and validated once: what every later hook and node sees as
        its params. A family with a ``request_type`` returns one (a ``ModelRequest``); the default
        checks the mapping with ``validate_request`` and keeps it. ValueError with a clear message
        for bad input (the server answers HTTP 400)."""
        self.validate_request(inputs, params)
        return params

    def validate_request(self, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> None:
        """Raise ValueError with a clear message for bad input (the server answers HTTP 400); a family
        that parses its requests checks them in ``parse_request``."""
        if self.request_type is not None:
            self.parse_request(inputs, params)

    def max_kv_tokens(self, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> Mapping[str, int]:
        """Worst case, per KV module (a base node): the tokens this request may hold in that module's
        caches at once (an LM: prompt + max_tokens). ``Runtime.submit`` rejects a request that could
        never fit in the whole cache (ValueError -> HTTP 400) instead of letting it fail late. Called
        after ``validate_request``; the default ({}) checks nothing."""
        return {}

    def sized_request(self, prompt_tokens: int, output_tokens: int, params: Mapping[str, Any],
                      seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """A request of these sizes with random content (``inputs``, ``params`` as ``Runtime.submit``
        takes them), ``params`` added: what ``mstar plan`` profiles the model with and replays a
        workload as. Its output must run to ``output_tokens`` (no early stop). Default: the model
        cannot be planned."""
        raise NotImplementedError(f"{self.name} makes no sized requests (ModelDef.sized_request): "
                                  f"it cannot be profiled or planned yet")

    def build_submodules(self, node_names: Iterable[str]) -> dict[str, NodeSubmodule]:
        """Modules for ``node_names`` (the nodes placed on one rank). Views map to their base's module."""
        raise NotImplementedError(f"{type(self).__name__} declares a graph but no submodules")

    def api_adapter(self):
        """How the HTTP API talks to this model (``mstar.model.adapter.ApiAdapter``); default: the
        native ``/generate`` route only."""
        from mstar.model.adapter import ApiAdapter

        return ApiAdapter()

    def module_of(self, node: str) -> str:
        """The node whose module computes ``node`` (itself unless it is a view)."""
        return self.views.get(node, node)
