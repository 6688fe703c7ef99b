"""``ModelRequest``: the base of a family's typed request.

A request's API params are parsed and validated once, by ``ModelDef.parse_request`` (at
``Runtime.submit``, or by the family's API adapter, which then submits the result): what the
conductor, ``create_state``, ``next_walk``, ``max_kv_tokens`` and the nodes (``ForwardInfo.params``)
see as the request's params is then that one frozen object, read by its typed fields. A subclass is
a frozen dataclass registered with ``register_message`` (``mstar.model.sendable``): it travels with
the request's work items to other ranks.
"""

from __future__ import annotations

__all__ = ["ModelRequest"]


class ModelRequest:
    """A family's parsed request (module docstring)."""

    __slots__ = ()
