"""Limits a user sets and what can never run, answered at once in OpenAI's error shape while the server keeps
serving: API keys and per-key concurrency, request timeout, prompt length, n past the engine, and the queue limit
counted in requests."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from kestrel.server.options import ServerOptions
from server_helpers import MODEL_NAME, LiveServer
from test_serving import error_of, gauge

LONG = {"prompt": "to be", "max_tokens": 4000, "ignore_eos": True}
"""A request that runs for many seconds (4,000 tokens) unless something stops it."""


def wait_until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.02)


def assert_memory_freed(live: LiveServer) -> None:
    with live.client() as http:
        wait_until(lambda: gauge(http, "kestrel_kv_cache_usage_ratio") == 0
                   and gauge(http, "kestrel_state_pool_usage_ratio") == 0, "a finished request still holds memory")


def test_api_keys_and_concurrent_requests_per_key(model_folder):
    live = LiveServer(model_folder, ServerOptions(MODEL_NAME, api_keys=("alpha", "beta"),
                                                  max_concurrent_requests_per_key=1))
    alpha, beta = ({"Authorization": f"Bearer {key}"} for key in ("alpha", "beta"))
    short = {"prompt": "hi", "max_tokens": 1}
    try:
        with live.client(timeout=60) as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "alpha"}):
                response = http.post("/v1/completions", json=short, headers=headers)
                assert response.status_code == 401 and error_of(response)["type"] == "authentication_error"
            assert http.get("/health").status_code == 200
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}, headers=alpha) as stream:
                lines = stream.iter_lines()                      # (kept: a dropped iterator closes the stream)
                next(lines)                                      # alpha's one request is running
                refused = http.post("/v1/chat/completions", headers=alpha,
                                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                assert "--max-concurrent-requests-per-key" in error_of(refused)["message"]
                assert http.post("/v1/completions", json=short, headers=beta).status_code == 200
                assert http.post("/tokenize", json={"prompt": "hi"}, headers=alpha).status_code == 200
            wait_until(lambda: http.post("/v1/completions", json=short, headers=alpha).status_code == 200,
                       "alpha's slot was not given back when its stream closed")
    finally:
        live.stop()


def slow_steps(live: LiveServer, seconds: float) -> None:
    """Make every engine step take at least `seconds` longer, however fast the machine."""
    step = live.engine.engine.step

    def slow_step(*args, **kwargs):
        time.sleep(seconds)
        return step(*args, **kwargs)
    live.engine.engine.step = slow_step


def test_request_timeout_and_prompt_limit(model_folder):
    live = LiveServer(model_folder, ServerOptions(MODEL_NAME, request_timeout=0.2), max_prompt_tokens=16)
    slow_steps(live, 0.01)            # LONG's 4,000 steps take 40 s at least: the 0.2 s limit always cuts them
    try:
        with live.client(timeout=60) as http:
            too_long = http.post("/v1/completions", json={"prompt": [5] * 17, "max_tokens": 1})
            assert too_long.status_code == 400 and "limit of 16 (--max-prompt-tokens)" in error_of(too_long)["message"]
            timed_out = http.post("/v1/completions", json=LONG)
            assert timed_out.status_code == 408 and error_of(timed_out)["type"] == "timeout_error"
            assert "--request-timeout" in error_of(timed_out)["message"]
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
                lines = [line for line in stream.iter_lines() if line]
            assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == 408
        assert_memory_freed(live)
    finally:
        live.stop()


def test_n_past_the_engine_is_400_and_the_queue_limit_counts_requests(model_folder):
    live = LiveServer(model_folder, ServerOptions(MODEL_NAME, max_queued_requests=1), max_running_requests=2)
    try:
        with live.client(timeout=60) as http:
            refused = http.post("/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 1})
            assert refused.status_code == 400 and "runs at most 2" in error_of(refused)["message"]

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                async with http.stream("POST", "/v1/completions", json={**LONG, "n": 2, "stream": True}) as first:
                    lines = first.aiter_lines()                   # (kept: a dropped iterator closes the stream)
                    await anext(lines)                            # one request, two running sequences
                    queued = asyncio.create_task(http.post("/v1/completions", json={**LONG, "max_tokens": 1}))
                    while live.engine.num_requests < 2:
                        assert not queued.done(), queued.result().text       # it must wait, not be refused
                        await asyncio.sleep(0.01)
                    over = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                queued_response = await queued
                return [over.status_code, queued_response.status_code]
        # one request queued (the second), so the third is over the limit of 1; counting the running request's
        # two sequences against two open requests would have let it in
        assert asyncio.run(burst()) == [429, 200]
        assert_memory_freed(live)
    finally:
        live.stop()
