"""`moetide serve`: the OpenAI-compatible server on uvicorn.

SIGINT / SIGTERM (uvicorn's handlers): stop accepting connections, let in-flight requests finish for
up to `--drain-timeout` seconds, cancel what is left (their sequences are aborted), stop the engine
thread, exit. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..cli import add_engine_args, engine_config_from_args
from ..config import EngineConfig
from ..errors import ConfigError


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server: completions, chat, SSE, /metrics")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free port)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests allowed to wait for a batch slot; more are answered 429 with Retry-After",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients put in `model` (default: the checkpoint directory's name)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on shutdown before they are cancelled",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def served_model_name(config: EngineConfig, requested: str | None) -> str:
    from ..engine.llm import demo_model_path

    if requested:
        return requested
    path = config.model_path.resolve()
    return "moetide-demo" if path == demo_model_path().resolve() else Path(config.model).name


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine.llm import build_engine
    from .api import create_app
    from .async_engine import AsyncEngine

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if args.drain_timeout < 0:
        raise ConfigError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.max_queue < 1:
        raise ConfigError(f"--max-queue must be >= 1, got {args.max_queue}")
    config = engine_config_from_args(args)
    loaded, engine, tokenizer = build_engine(config, progress=True)
    async_engine = AsyncEngine(engine, loaded=loaded, max_queue=args.max_queue)
    name = served_model_name(config, args.served_model_name)
    app = create_app(
        async_engine,
        tokenizer,
        model_name=name,
        model_aliases=[config.model],
        drain_timeout_s=args.drain_timeout,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(1, round(args.drain_timeout)),
    )
    print(
        f"[moetide] serving {name!r} on http://{args.host}:{args.port}/v1 "
        f"(max {engine.max_num_seqs} sequences, context {engine.max_model_len} tokens)",
        flush=True,
    )
    try:
        uvicorn.Server(uv_config).run()  # handles SIGINT/SIGTERM; the app's lifespan stops the engine
    finally:
        async_engine.stop(drain_timeout_s=0)  # no-op after a clean lifespan shutdown
        loaded.runtime.residency.close()
    return 0
