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

SGLang's native POST /generate (its request and response shapes, read from sglang's GenerateReqInput, SamplingParams
and TokenizerManager): GenerateRequest and generate_item; the server's app.py runs it.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import Field, StrictBool

from ..engine.async_engine import AsyncEngine
from ..engine.outputs import CompletionOutput, RequestOutput
from .options import ServerOptions
from .protocol import INT64_MAX, BootstrapFields, Int64, SamplingFields, Schema

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
        "dp_size": 1, "tp_size": args.tp_size, "pp_size": args.pp_size, "page_size": args.page_size,
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


class GenerateSampling(Schema):
    """SGLang's sampling_params (its names and defaults); unknown keys are ignored as SGLang's own server would not."""

    max_new_tokens: int | None = Field(default=128, ge=1, le=INT64_MAX)
    min_new_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    n: int = Field(default=1, ge=1, le=128)
    sampling_seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def fields(self) -> SamplingFields:
        """The same request in the OpenAI server's fields (validated here already)."""
        return SamplingFields.model_construct(
            max_tokens=self.max_new_tokens, min_tokens=self.min_new_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.no_stop_trim, n=self.n,
            seed=self.sampling_seed, json_schema=self.json_schema, regex=self.regex, ebnf=self.ebnf)


class GenerateRequest(BootstrapFields):
    """SGLang's GenerateReqInput: text or input_ids (one prompt or a batch), sampling_params (one for all prompts or
    one each), stream; return_logprob is refused (see prompts)."""

    text: str | list[str] | None = None
    input_ids: list[Int64] | list[list[Int64]] | None = None
    sampling_params: GenerateSampling | list[GenerateSampling] | None = None
    stream: StrictBool = False
    return_logprob: StrictBool | list[StrictBool] | None = None
    priority: Int64 | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts; a ValueError (one sentence, for a 400) for a request kestrel cannot answer as SGLang would."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give either text or input_ids.")
        if self.return_logprob is True or isinstance(self.return_logprob, list) and any(self.return_logprob):
            raise ValueError("return_logprob is not supported by /generate; use /v1/completions with logprobs.")
        if self.text is not None:
            prompts = [self.text] if isinstance(self.text, str) else list(self.text)
        else:
            ids = self.input_ids
            prompts = [list(ids)] if ids and all(isinstance(t, int) for t in ids) else [list(p) for p in ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt must be non-empty.")
        return prompts

    def samplings(self, count: int) -> list[GenerateSampling]:
        """Each prompt's sampling params; a ValueError if a list of them does not have one per prompt."""
        given = self.sampling_params
        if isinstance(given, list):
            if len(given) != count:
                raise ValueError(f"sampling_params lists {len(given)} entries for {count} prompts; give one each "
                                 "or a single object.")
            return given
        return [given or GenerateSampling()] * count


def finish_reason(choice: CompletionOutput) -> dict[str, Any] | None:
    """SGLang's finish_reason: {"type": "stop", "matched": token id or stop string}, {"type": "length", "length"}."""
    if choice.finish_reason is None:
        return None
    if choice.finish_reason == "stop":
        return {"type": "stop", "matched": choice.token_ids[-1] if choice.stop_reason is None else choice.stop_reason}
    if choice.finish_reason == "length":
        return {"type": "length", "length": len(choice.token_ids)}
    return {"type": "abort", "message": str(choice.stop_reason)}


def generate_item(output: RequestOutput, j: int, item_id: str, e2e_latency: float | None) -> dict[str, Any]:
    """One sequence of a /generate answer as SGLang shapes it: cumulative text and output_ids, and meta_info (with
    e2e_latency, seconds, once the sequence finished)."""
    choice = output.outputs[j]
    meta = {"id": item_id, "finish_reason": finish_reason(choice), "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": len(choice.token_ids), "cached_tokens": output.num_cached_tokens,
            "weight_version": "default"}
    if e2e_latency is not None and choice.finish_reason is not None:
        meta["e2e_latency"] = e2e_latency
    return {"text": choice.text, "output_ids": list(choice.token_ids), "meta_info": meta}
