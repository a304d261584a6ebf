"""Bad input, auth, overload, disconnects, failures, concurrency and metrics against live servers on loopback."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from kestrel.server.options import ServerOptions
from server_helpers import MODEL_NAME, LiveServer


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def gauge(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def counter(http: httpx.Client, name: str, labels: str = "") -> float:
    match = re.search(rf"^{name}_total{re.escape(labels)} (\S+)$", http.get("/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("body, status, param, words", [
    (b"{not json", 400, None, "not valid JSON"),
    ({"prompt": 5}, 400, "prompt", "no accepted type"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", "must be at least 0; got -1"),
    ({"prompt": "hi", "top_p": 5}, 400, "top_p", "must be greater than 0 and at most 1; got 5"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream", "valid boolean"),
    ({"prompt": "hi", "echo": 1}, 400, "echo", "valid boolean"),
    ({"prompt": "hi", "best_of": 2}, 400, "best_of", "not supported"),
    ({"prompt": "hi", "suffix": "!"}, 400, "suffix", "not supported"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"prompt": [5] * 60, "max_tokens": 10}, 400, "prompt", "60 tokens) plus max_tokens (10)"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "echo"),
    ({"prompt": [9999]}, 400, "prompt", "integers in [0, 400)"),
])
def test_completion_errors(small_context_server, body, status, param, words):
    with small_context_server.client() as http:
        response = (http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                    if isinstance(body, bytes) else http.post("/v1/completions", json=body))
        error = error_of(response)
        assert response.status_code == status and error["param"] == param and words in error["message"]
        assert http.get("/health").json() == {"status": "ok"}


def test_chat_errors(server):
    with server.client() as http:
        bad_role = http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
        assert bad_role.status_code == 400 and error_of(bad_role)["param"] == "messages.0.role"
        no_tools = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                            "tool_choice": "required"})
        assert no_tools.status_code == 400 and "needs tools" in error_of(no_tools)["message"]
        unknown = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"name": "a"}}],
            "tool_choice": {"type": "function", "function": {"name": "b"}}})
        assert unknown.status_code == 400 and "'b'" in error_of(unknown)["message"]


def test_generate_errors_name_the_field_and_its_range(small_context_server):
    """SGLang's /generate: a bad value inside sampling_params (one object or a list of them) is named with the range
    its field accepts (GenerateSampling's declaration)."""
    cases = [({"max_new_tokens": -5}, "sampling_params.max_new_tokens", f"at least 1 and at most {2**63 - 1}"),
             ([{"temperature": -1}], "sampling_params.0.temperature", "at least 0"),
             ({"top_p": 0}, "sampling_params.top_p", "greater than 0 and at most 1")]
    with small_context_server.client() as http:
        for sampling, field, accepted in cases:
            response = http.post("/generate", json={"text": "hi", "sampling_params": sampling})
            error = error_of(response)
            assert response.status_code == 400 and error["param"] == field
            assert error["message"].startswith(f"{field} must be {accepted}; got ")
        assert error_of(http.post("/generate", json={"text": "hi", "stream": "yes"}))["param"] == "stream"


def test_tokenize_detokenize_models_health(server):
    with server.client() as http:
        ids = http.post("/tokenize", json={"prompt": "to be or not"}).json()
        assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] > 0
        text = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
        assert text.endswith("to be or not")
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL_NAME
        assert http.get(f"/v1/models/{MODEL_NAME}").json() | {"created": 0} == \
            http.get("/v1/models").json()["data"][0] | {"created": 0}
        missing = http.get("/v1/models/gpt-4")
        assert missing.status_code == 404 and error_of(missing)["type"] == "not_found_error"
        assert http.get("/health_generate").json() == {"status": "ok"}
        assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


@pytest.fixture(scope="module")
def small_context_server(model_folder):
    live = LiveServer(model_folder, context_length=64)
    yield live
    live.stop()


def test_overload_answers_429_with_retry_after(model_folder):
    live = LiveServer(model_folder, ServerOptions(MODEL_NAME, max_queued_requests=2), max_mamba_cache_size=1)
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                body = {"prompt": "to be", "max_tokens": 30, "ignore_eos": True}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(8)))
        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429} and codes.count(200) >= 2          # at least the queue's worth ran
        rejected = next(r for r in responses if r.status_code == 429)
        assert rejected.headers["retry-after"] == "1" and error_of(rejected)["type"] == "rate_limit_error"
        with live.client() as http:
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    finally:
        live.stop()


def test_64_concurrent_streams_complete_and_metrics_agree(model_folder):
    live = LiveServer(model_folder, page_size=4)
    try:
        async def one(http: httpx.AsyncClient, i: int) -> int:
            body = {"prompt": f"all the world {i}", "max_tokens": 4 + i % 5, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            usage = None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        usage = httpx.Response(200, content=line[6:]).json()["usage"]
            return usage["completion_tokens"]

        async def run():
            async with httpx.AsyncClient(base_url=live.url, timeout=120) as http:
                return await asyncio.gather(*(one(http, i) for i in range(64)))
        tokens = asyncio.run(run())
        assert tokens == [4 + i % 5 for i in range(64)]
        with live.client() as http:
            assert counter(http, "kestrel_requests", '{outcome="success"}') == 64
            assert counter(http, "kestrel_generation_tokens") == sum(tokens)
            assert "kestrel_time_to_first_token_seconds_count 64.0" in http.get("/metrics").text
            assert gauge(http, "kestrel_num_requests_running") == 0
    finally:
        live.stop()


def test_disconnect_mid_stream_frees_memory(model_folder):
    live = LiveServer(model_folder, page_size=4)
    try:
        with live.client() as http:
            body = {"prompt": "to be", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()        # (kept open: a dropped iterator closes the stream)
                for _ in range(7):
                    next(lines)
                assert gauge(http, "kestrel_kv_cache_usage_ratio") > 0
            deadline = time.time() + 10
            while gauge(http, "kestrel_kv_cache_usage_ratio") > 0 or gauge(http, "kestrel_state_pool_usage_ratio"):
                assert time.time() < deadline, "the aborted request still holds memory"
                time.sleep(0.05)
            assert counter(http, "kestrel_requests", '{outcome="abort"}') == 1
    finally:
        live.stop()


def test_a_failing_request_gets_500_and_the_others_finish(model_folder, monkeypatch):
    live = LiveServer(model_folder, page_size=4)
    engine = live.engine.engine
    original = engine._append

    def fail_one(seq, token, result, row):
        if seq.request.prompt_ids[-1] == 13:          # the poisoned request
            raise RuntimeError("detokenizer exploded")
        original(seq, token, result, row)
    monkeypatch.setattr(engine, "_append", fail_one)
    try:
        async def run():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                bodies = [{"prompt": [5, 6, t], "max_tokens": 5} for t in (11, 12, 13, 14)]
                return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
        responses = asyncio.run(run())
        assert [r.status_code for r in responses] == [200, 200, 500, 200]
        assert "detokenizer exploded" in error_of(responses[2])["message"]
        with live.client() as http:
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        live.stop()


def test_cookbook_page_is_served(server):
    with server.client(follow_redirects=False) as http:
        assert http.get("/cookbook").headers["location"] == "/cookbook/"
        page = http.get("/cookbook/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        data = http.get("/cookbook/data.js")
        assert data.status_code == 200 and data.text.startswith("window.COOKBOOK")
        assert http.get("/cookbook/nope.js").status_code == 404


def test_a_repeated_prompt_reports_its_cached_tokens(server):
    body = {"prompt": "all the world's a stage, and all the men and women merely players " * 3, "max_tokens": 3}
    with server.client() as http:
        before = gauge(http, "kestrel_prefix_cache_hit_tokens")
        first, second = (http.post("/v1/completions", json=body).json()["usage"] for _ in range(2))
        assert second["prompt_tokens"] == first["prompt_tokens"] > 20
        assert second["prompt_tokens_details"] == {"cached_tokens": second["prompt_tokens"] - 1}
        assert gauge(http, "kestrel_prefix_cache_hit_tokens") - before == \
            first["prompt_tokens_details"]["cached_tokens"] + second["prompt_tokens"] - 1
        assert gauge(http, "kestrel_prefix_cache_snapshots") > 0


def test_the_next_turn_of_a_chat_resumes_where_the_turns_prompts_part(server):
    """A chat prompt's state is saved where its messages end and the reply's opening begins, so the next turn
    (the reply rendered as history, then a new message) resumes exactly where the two prompts part."""
    messages, prompts, cached = [], [], []
    with server.client() as http:
        for turn in ("to be or not to be", "that is the question", "whether tis nobler"):
            messages.append({"role": "user", "content": turn})
            prompts.append(http.post("/tokenize", json={"messages": messages}).json()["tokens"])
            answer = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4,
                                                             "temperature": 0}).json()
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    parted = [next(i for i, (a, b) in enumerate(zip(p, q)) if a != b) for p, q in zip(prompts, prompts[1:])]
    assert cached[1:] == parted and min(parted) > 10


def test_speculative_decoding_counts_reach_metrics(model_folder):
    live = LiveServer(model_folder, page_size=4, speculative_algorithm="NEXTN")
    try:
        with live.client() as http:
            body = {"prompt": "to be or not to be, to be or not to be, to be or not", "max_tokens": 12,
                    "temperature": 0, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
            assert gauge(http, "kestrel_spec_verifications") > 0
            drafted, accepted = gauge(http, "kestrel_spec_draft_tokens"), gauge(http, "kestrel_spec_accepted_tokens")
            assert drafted >= accepted >= 0 and gauge(http, "kestrel_spec_acceptance_length") >= 1
            steps = sum(float(n) for n in re.findall(r'^kestrel_spec_accepted_verifications\{accepted="\d+"\} (\S+)$',
                                                       http.get("/metrics").text, re.M))
            assert steps == gauge(http, "kestrel_spec_verifications")
            assert gauge(http, "kestrel_spec_verify_seconds") > 0 and gauge(http, "kestrel_spec_draft_seconds") > 0
    finally:
        live.stop()
