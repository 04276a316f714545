"""OpenAI-compatible serving: an engine thread (`AsyncEngine`), the FastAPI app and `moetide serve`."""

from .api import create_app
from .async_engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestEvent, RequestStream

__all__ = [
    "AsyncEngine",
    "EngineStoppedError",
    "QueueFullError",
    "RequestEvent",
    "RequestStream",
    "create_app",
]
