"""The SGLang server endpoints that SGLang's router (sglang-router) calls on its workers, answered as SGLang does.

What the router calls (sglang-router 0.3.2, read from sgl-model-gateway/src and observed against a stub worker):
- registering a worker: GET /health, GET /server_info (model_path, served_model_name, dp_size, ...),
  GET /model_info (model_path, model_type, architectures, ...); the model id is served_model_name or the model
  path's last part;
- health checks: GET /health every --health-check-interval-secs;
- its own /get_model_info and /get_server_info: proxied to a worker's GET /get_model_info (and /get_server_info);
- its /get_loads: GET /get_load on every worker (SGLang's list of per-DP-rank loads; the router reads num_tokens);
- its /flush_cache: POST /flush_cache on every worker;
- generation: /v1/completions, /v1/chat/completions and /generate, forwarded with the body re-serialized (and, in
  PD mode, bootstrap_host, bootstrap_port and bootstrap_room added).
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from ..engine.async_engine import AsyncEngine
from .options import ServerOptions

FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
           "the operation will not be performed.)\n")


def add_sglang_routes(app: FastAPI, engine: AsyncEngine, options: ServerOptions) -> None:
    """Add /server_info, /model_info, /get_load and /flush_cache (and SGLang's older get_ spellings) to app."""

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        return _server_info(engine, options)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        folder = engine.engine.args.model
        hf_config = json.loads((Path(folder) / "config.json").read_text())
        return {"model_path": folder, "tokenizer_path": folder, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": hf_config.get("model_type"),
                "architectures": hf_config.get("architectures")}

    @app.get("/get_load")
    async def get_load() -> list[dict]:
        stats = engine.stats()
        page_size = engine.engine.args.page_size
        return [{"dp_rank": 0, "num_reqs": stats.running + stats.waiting, "num_waiting_reqs": stats.waiting,
                 "num_tokens": stats.kv_pages_used * page_size}]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        flushed = await engine.flush_cache()
        return PlainTextResponse(FLUSHED, status_code=200 if flushed else 400)


def _server_info(engine: AsyncEngine, options: ServerOptions) -> dict:
    """SGLang's server arguments that the router and clients read, with kestrel's values."""
    args, stats = engine.engine.args, engine.stats()
    return {
        "model_path": args.model, "tokenizer_path": args.model, "served_model_name": options.model_name,
        "dp_size": 1, "tp_size": args.tp_size, "page_size": args.page_size,
        "context_length": engine.engine.context_length, "chunked_prefill_size": args.chunked_prefill_size,
        "max_prefill_tokens": args.max_prefill_tokens, "max_running_requests": engine.engine.scheduler.max_running,
        "max_total_tokens": stats.kv_pages_total * args.page_size, "disable_radix_cache": args.disable_radix_cache,
        "disaggregation_mode": options.disaggregation_mode,
        "disaggregation_bootstrap_port": options.disaggregation_bootstrap_port,
        "disaggregation_transfer_backend": options.disaggregation_transfer_backend,
        "version": _version(),
        "internal_states": [{"num_running_reqs": stats.running, "num_waiting_reqs": stats.waiting}],
    }


def _version() -> str:
    try:
        return "kestrel-" + version("kestrel")
    except PackageNotFoundError:
        return "dev"
