"""Graceful shutdown of `kestrel serve`, and property-based fuzzing of every request schema."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from server_helpers import LiveServer, start_kestrel_serve


def test_sigterm_drains_then_aborts_what_outlives_the_shutdown_timeout(model_folder):
    process, url = start_kestrel_serve("--model", str(model_folder), "--served-model-name", "m",
                                       "--shutdown-timeout", "5")
    try:
        lines: dict[int, list[str]] = {8: [], 4000: []}     # by max_tokens: one drains, one outlives the drain
        started = {n: threading.Event() for n in lines}

        def stream(max_tokens: int) -> None:
            body = {"prompt": "to be", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines[max_tokens].append(line)
                        started[max_tokens].set()
        readers = [threading.Thread(target=stream, args=(n,)) for n in lines]
        for reader in readers:
            reader.start()
        assert all(event.wait(30) for event in started.values())
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "unavailable"
        for reader in readers:
            reader.join(60)
        finish = {n: json.loads(chunks[-2][6:])["choices"][0]["finish_reason"] for n, chunks in lines.items()}
        assert finish == {8: "length", 4000: "abort"} and all(c[-1] == "data: [DONE]" for c in lines.values())
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()


def junk():
    return st.one_of(st.none(), st.booleans(), st.integers(-3, 8), st.integers(2**40, 2**70), st.floats(),
                     st.text(max_size=12), st.lists(st.integers(-2, 500), max_size=6),
                     st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


SCHEMA_FORMAT = st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
    {"name": st.text(max_size=4), "schema": st.one_of(st.just({"type": "object"}), junk())})})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                 "content": st.one_of(st.text(max_size=20), junk())})
FIELDS = {
    "/v1/completions": {"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(0, 399), max_size=20), junk()),
                        "echo": junk(), "logprobs": junk()},
    "/v1/chat/completions": {"messages": st.one_of(st.lists(MESSAGE, max_size=3), junk()),
                             "tools": junk(), "tool_choice": st.one_of(st.sampled_from(["auto", "none",
                                                                                        "required"]), junk()),
                             "response_format": st.one_of(st.just({"type": "json_object"}), junk()),
                             "logprobs": junk(), "top_logprobs": junk()},
    "/tokenize": {"prompt": st.one_of(st.text(max_size=30), junk()), "messages": st.one_of(st.lists(MESSAGE,
                                                                                                     max_size=2),
                                                                                             junk())},
    "/detokenize": {"tokens": st.one_of(st.lists(st.integers(-5, 500), max_size=10), junk())},
}
SHARED = {"max_tokens": st.one_of(st.integers(-1, 6), junk()), "temperature": junk(), "top_p": junk(),
          "top_k": junk(), "n": st.one_of(st.integers(-1, 3), junk()), "stop": junk(), "seed": junk(),
          "stream": st.booleans(), "model": st.one_of(st.just("k3.1-tiny-test"), junk()), "priority": junk(),
          "stop_token_ids": junk(), "min_tokens": junk(), "min_p": junk(), "repetition_penalty": junk(),
          "presence_penalty": junk(), "stream_options": st.one_of(st.just({"include_usage": True}), junk()),
          "response_format": st.one_of(st.just({"type": "json_object"}), SCHEMA_FORMAT, junk()),
          "structured_outputs": st.one_of(st.fixed_dictionaries({"regex": st.text(max_size=8)}), junk()),
          "guided_json": st.one_of(st.just({"type": "object"}), junk()), "regex": junk(), "ebnf": junk(),
          "reasoning_effort": st.one_of(st.sampled_from(["none", "low", "max"]), junk())}


@st.composite
def requests(draw):
    path = draw(st.sampled_from(sorted(FIELDS)))
    fields = {**FIELDS[path], **(SHARED if path.startswith("/v1") else {})}
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), unique=True))
    return path, {name: draw(fields[name]) for name in chosen}


FUZZ_EXAMPLES = int(os.environ.get("KESTREL_FUZZ_EXAMPLES", "150"))
"""Examples per run: 150 in `make test`; tools/fuzz.sh runs thousands with fresh randomness."""


def test_fuzzed_requests_never_get_5xx_and_the_server_survives(model_folder):
    live = LiveServer(model_folder, context_length=64)
    try:
        with live.client(timeout=30) as http:
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
            @given(requests())
            @example(("/v1/completions", {"prompt": "", "seed": 2**64}))           # were 500s
            @example(("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}))
            @example(("/v1/completions", {"prompt": "hi", "seed": 2**64 - 1, "n": 2}))
            def check(request):
                path, body = request
                response = http.post(path, content=json.dumps(body, default=str).encode(),
                                     headers={"content-type": "application/json"})
                assert response.status_code < 500, (path, body, response.text)
                if response.status_code >= 400:
                    assert "error" in response.json()
            check()
            assert http.get("/health").json() == {"status": "ok"}
    finally:
        live.stop()


def test_openapi_document_lists_the_endpoints(server):
    with server.client() as http:
        paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"} <= set(paths)


