"""The runtime: conductor, workers, engines, KV cache, transport."""

from mstar.runtime.api import RequestError, RequestHandle, RequestOutput, Runtime, StreamItem
from mstar.runtime.conductor import RequestStatus

__all__ = ["RequestError", "RequestHandle", "RequestOutput", "RequestStatus", "Runtime", "StreamItem"]
