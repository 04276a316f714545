"""`moetide serve`: the OpenAI-compatible server on uvicorn.

SIGINT / SIGTERM: stop accepting connections and requests, let in-flight requests finish for up to
`--drain-timeout` seconds, then abort what is left (streams end with finish_reason "abort" and
`[DONE]`), stop the engine thread, exit. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

import uvicorn  # noqa: F401 - an install without it is told so when the CLI registers `serve`

from ..cli import add_engine_args, engine_config_from_args
from ..config import SERVE_KV_TOKENS_PER_SEQ, EngineConfig
from ..errors import ConfigError
from .limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT_S, is_loopback

API_KEY_ENV = "MOETIDE_API_KEY"
# after the drain timeout, the aborted streams get this long to send their last chunk and [DONE]
ABORT_GRACE_S = 5


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
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="start serving without first decoding once at each CUDA-graph batch size and prefilling"
        " once at each fused-kernel tile bucket (captures and kernel compiles then fall on the first clients)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on shutdown before they are cancelled",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer <key>` on every route but /health (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies are refused (413) before they are read (default: 8 MiB)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT_S,
        help="seconds a client gets to send a request's headers, and then its body (default 30)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar, no access log: one line once serving, then only warnings and errors",
    )
    p.set_defaults(func=cmd_serve)


def served_model_name(config: EngineConfig, requested: str | None) -> str:
    from ..engine.llm import demo_model_path

    if requested:
        return requested
    path = config.model_path.resolve()
    return "moetide-demo" if path == demo_model_path().resolve() else Path(config.model).name


def _check_args(args: argparse.Namespace) -> str | None:
    """Refuse bad options before the model loads; returns the API key (None = no authentication)."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if args.drain_timeout < 0:
        raise ConfigError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.max_queue < 1:
        raise ConfigError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not args.read_timeout > 0:
        raise ConfigError(f"--read-timeout must be > 0 seconds, got {args.read_timeout}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise ConfigError(f"the API key (--api-key or ${API_KEY_ENV}) is empty: give a key or leave it unset")
    return api_key


def serve_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options of `moetide serve`: as every command's, but for concurrent clients the
    derived KV reservation holds a chat turn for each of `--max-num-seqs` (SERVE_KV_TOKENS_PER_SEQ)."""
    return dataclasses.replace(engine_config_from_args(args), kv_tokens_per_seq=SERVE_KV_TOKENS_PER_SEQ)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..engine.llm import build_engine
    from .api import create_app
    from .async_engine import AsyncEngine
    from .http import DrainingServer, read_timeout_protocol

    api_key = _check_args(args)
    if api_key is None and not is_loopback(args.host):
        print(
            f"[moetide] warning: no API key and listening on {args.host}: anyone who can reach this port"
            f" can use the server; set --api-key or ${API_KEY_ENV}",
            file=sys.stderr,
            flush=True,
        )
    config = serve_engine_config(args)
    loaded, engine, tokenizer = build_engine(config, progress=not args.quiet)
    if args.warm_up and engine.warm_up(progress=not args.quiet):
        loaded.runtime.metrics.reset()  # the counters /metrics shows start with the first client
    async_engine = AsyncEngine(engine, loaded=loaded, max_queue=args.max_queue)
    name = served_model_name(config, args.served_model_name)
    app = create_app(
        async_engine,
        tokenizer,
        model_name=name,
        model_aliases=[config.model],
        drain_timeout_s=args.drain_timeout,
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        read_timeout_s=args.read_timeout,
    )
    log_level = "warning" if args.quiet else args.log_level
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=log_level,
        access_log=not args.quiet,
        lifespan="on",
        http=read_timeout_protocol(args.read_timeout),
        timeout_graceful_shutdown=int(args.drain_timeout) + ABORT_GRACE_S,
    )
    banner = f"{name!r} (max {engine.max_num_seqs} sequences, context {engine.max_model_len} tokens)"
    try:
        DrainingServer(uv_config, async_engine, args.drain_timeout, banner).run()
    finally:
        async_engine.stop(drain_timeout_s=0)  # no-op after a clean lifespan shutdown
        loaded.runtime.residency.close()
    return 0
