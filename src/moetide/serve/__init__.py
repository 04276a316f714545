"""OpenAI-compatible serving: an engine thread (`AsyncEngine`), the FastAPI app and `moetide serve`."""

_ENGINE_NAMES = ("AsyncEngine", "EngineStoppedError", "QueueFullError", "RequestEvent", "RequestStream")


def __getattr__(name: str):
    """The engine thread's classes, imported on first use: `moetide serve --help` needs no torch."""
    if name in _ENGINE_NAMES:
        from . import async_engine

        return getattr(async_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
