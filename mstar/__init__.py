"""mstar: serving runtime for composite multimodal models (Walk Graph)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `from mstar import Runtime` without importing torch for users of mstar.graph only
    if name in ("Runtime", "RequestOutput", "RequestStatus", "RequestHandle", "StreamItem", "RequestError"):
        import mstar.runtime as rt

        return getattr(rt, name)
    raise AttributeError(f"module 'mstar' has no attribute {name!r}")
