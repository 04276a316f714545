"""OpenAI-compatible serving: an engine thread (`AsyncEngine`), the FastAPI app and `moetide serve`."""

from .async_engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestEvent, RequestStream


def create_app(*args, **kwargs):
    """The FastAPI app (imported on use, so `moetide` commands other than serve need no web stack)."""
    from .api import create_app as _create_app

    return _create_app(*args, **kwargs)


__all__ = [
    "AsyncEngine",
    "EngineStoppedError",
    "QueueFullError",
    "RequestEvent",
    "RequestStream",
    "create_app",
]
