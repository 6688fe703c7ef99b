"""The runtime: conductor, workers, engines, KV cache, transport."""

from mstar.runtime.api import Runtime
from mstar.runtime.conductor import RequestStatus
from mstar.runtime.handles import RequestError, RequestHandle, RequestOutput, StreamItem

__all__ = ["RequestError", "RequestHandle", "RequestOutput", "RequestStatus", "Runtime", "StreamItem"]
