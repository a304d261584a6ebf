"""kestrel behind SGLang's router (sglang-router, as users run it), real processes on loopback, the bundled model.

Data parallel: two `kestrel serve` workers behind `--policy cache_aware`; a multi-turn chat session lands on one
worker (its prefix cache hits, the other sees none of it); a worker that goes down is marked unhealthy while the
router keeps answering, and is healthy again once it is back. PD: `--pd-disaggregation` over a prefill and a decode
instance (the prefill one at TP2 x DCP2: its ranks gather each handoff) answers exactly as a unified server does
(greedy; prompts longer than a prefill chunk, n > 1, batches, stop strings, streamed and non-streamed chat); a corrupted byte in transit and a decode side that dies mid-transfer
fail their request with a clear error and leave both sides' pools empty; a prefill instance killed while the decode
side waits on it fails that request at once.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from kestrel.disagg.wire import read_frame, write_frame
from server_helpers import free_port
from test_transport import corrupting_proxy

SERVE_FLAGS = ["--page-size", "4", "--chunked-prefill-size", "8", "--disaggregation-timeout", "30",
               "--dtype", "float32"]       # float32: the TP2 x DCP2 prefill instance's state rounds as one process's
PROMPT = "ROMEO: My lord, the king is dead, and all his men are fled. JULIET:"
SESSION = ["Tell me about the king.", "And what of the queen?", "Who rules after them?"]


class Proc:
    """A child process (kestrel serve or the router) on a loopback port, killed at teardown."""

    def __init__(self, args: list[str], port: int):
        self.args, self.port, self.url = args, port, f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, path: str = "/health", timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while True:
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.time() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.args[2:4]} did not come up: {self.process.communicate()[0][-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def kestrel(*flags: str, port: int | None = None) -> Proc:
    port = port or free_port()
    return Proc([sys.executable, "-m", "kestrel.cli", "serve", "--port", str(port), *SERVE_FLAGS, *flags], port)


def router(*flags: str) -> Proc:
    port = free_port()
    return Proc([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                 "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                 "--health-success-threshold", "1", "--log-level", "warn", *flags], port)


@pytest.fixture(scope="module")
def fleet():
    bootstrap = free_port()
    servers = {"u1": kestrel(), "u2": kestrel(),
               "p": kestrel("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap),
                            "--tp-size", "2", "--dcp-size", "2"),
               "d": kestrel("--disaggregation-mode", "decode")}
    procs = dict(servers)
    try:
        for proc in servers.values():
            proc.wait_ready()
        procs["dp"] = router("--worker-urls", servers["u1"].url, servers["u2"].url, "--policy", "cache_aware")
        procs["pd"] = router("--pd-disaggregation", "--prefill", servers["p"].url, str(bootstrap),
                             "--decode", servers["d"].url)
        for name in ("dp", "pd"):
            procs[name].wait_ready("/readiness")
        yield procs, bootstrap
    finally:
        for proc in procs.values():
            proc.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "k3.1-tiny", **body}, timeout=120)


def streamed_text(url: str, path: str, body: dict) -> list[str]:
    """Each choice's text (or content) put together from a streamed response (each choice finishes once)."""
    texts: dict[int, str] = {}
    finishes: list[int] = []
    with httpx.stream("POST", url + path, json={"model": "k3.1-tiny", **body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                piece = choice.get("text") if "text" in choice else choice["delta"].get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
                finishes += [choice["index"]] if choice["finish_reason"] else []
    assert sorted(finishes) == sorted(texts)
    return [texts[i] for i in sorted(texts)]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def assert_idle(*urls: str) -> None:
    for url in urls:
        assert metric(url, "kestrel_kv_cache_usage_ratio") == 0 and metric(url, "kestrel_num_requests_running") == 0


def test_pd_through_the_router_answers_as_one_server(fleet):
    procs, _ = fleet
    pd, unified = procs["pd"].url, procs["u1"].url
    greedy = {"temperature": 0, "max_tokens": 10}
    bodies = [{"prompt": PROMPT, **greedy}, {"prompt": PROMPT, "n": 2, **greedy},
              {"prompt": [PROMPT, "The queen"], **greedy}, {"prompt": PROMPT, "stop": ["\n"], **greedy}]
    for body in bodies:
        expected = [c["text"] for c in post(unified, "/v1/completions", body).json()["choices"]]
        got = post(pd, "/v1/completions", body).json()
        assert [c["text"] for c in got["choices"]] == expected, body
        assert streamed_text(pd, "/v1/completions", body) == expected, body
    chat = {"messages": [{"role": "user", "content": SESSION[0]}], **greedy}
    expected = post(unified, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    assert post(pd, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"] == expected
    assert streamed_text(pd, "/v1/chat/completions", chat) == [expected]
    assert_idle(procs["p"].url, procs["d"].url)


def generate(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120)


def streamed_generate(url: str, body: dict) -> list[dict]:
    """The last chunk of each sequence of a streamed /generate (SGLang sends cumulative text and output_ids)."""
    last: dict[int, dict] = {}
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                last[chunk.pop("index", 0)] = chunk
    return [last[i] for i in sorted(last)]


@pytest.mark.parametrize("echo", [False, True])
def test_logprobs_through_the_pd_router_equal_one_servers(fleet, echo):
    """The first token's logprobs travel with the handoff, and with echo the prompt's (computed by the prefill
    instance); the rest come from the decode instance."""
    procs, _ = fleet
    body = {"model": "k3.1-tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": echo}
    pd, one = (post(procs[name].url, "/v1/completions", body).json()["choices"][0] for name in ("pd", "u1"))
    assert pd["text"] == one["text"] and pd["logprobs"]["tokens"] == one["logprobs"]["tokens"]
    assert len(one["logprobs"]["tokens"]) > (20 if echo else 0) + 5 - 1
    assert pd["logprobs"]["token_logprobs"] == pytest.approx(one["logprobs"]["token_logprobs"], abs=1e-4)


def test_sglang_generate_answers_as_sglang_and_as_the_openai_endpoint(fleet):
    """SGLang's native /generate: the OpenAI endpoint's greedy text in SGLang's shape on a unified server (a batch
    too, which the router does not forward), and the same answers through the data-parallel router and through the
    PD router (which adds the bootstrap fields to /generate too)."""
    procs, _ = fleet
    unified = procs["u1"].url
    greedy = {"temperature": 0, "max_new_tokens": 6}
    prompts = [PROMPT, "The queen"]
    expected = post(unified, "/v1/completions", {"prompt": prompts, "n": 2, "temperature": 0, "max_tokens": 6}).json()
    batch = {"text": prompts, "sampling_params": {**greedy, "n": 2}}
    assert [x["text"] for x in generate(unified, batch).json()] == [c["text"] for c in expected["choices"]]
    assert [x["text"] for x in streamed_generate(unified, batch)] == [c["text"] for c in expected["choices"]]
    one = generate(unified, {"text": PROMPT, "sampling_params": greedy}).json()
    assert one["text"] == expected["choices"][0]["text"] and len(one["output_ids"]) == 6
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert one["meta_info"]["completion_tokens"] == 6 and one["meta_info"]["cached_tokens"] >= 0
    ids = httpx.post(unified + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert one["meta_info"]["prompt_tokens"] == len(ids)
    stop = {**greedy, "n": 2, "stop": ["\n"], "no_stop_trim": True}
    fields = lambda items: [(x["text"], x["output_ids"], x["meta_info"]["finish_reason"]) for x in items]  # noqa: E731
    for body, want in [({"text": PROMPT, "sampling_params": greedy}, [one]),
                       ({"input_ids": ids, "sampling_params": stop}, None)]:
        want = want or generate(unified, body).json()
        for url in (procs["dp"].url, procs["pd"].url):
            got = generate(url, body).json()
            assert fields(got if isinstance(got, list) else [got]) == fields(want), (url, body)
            assert fields(streamed_generate(url, body)) == fields(want), (url, body)
    refused = generate(unified, {"text": PROMPT, "return_logprob": True})
    assert refused.status_code == 400 and "return_logprob" in refused.json()["error"]["message"]
    assert generate(unified, {"sampling_params": greedy}).status_code == 400
    assert_idle(procs["p"].url, procs["d"].url)


def test_cache_aware_routing_keeps_a_session_on_one_worker(fleet):
    procs, _ = fleet
    workers = [procs["u1"].url, procs["u2"].url]
    before = [(metric(w, "kestrel_prefix_cache_queried_tokens"), metric(w, "kestrel_prefix_cache_hit_tokens"))
              for w in workers]
    messages = []
    for turn in SESSION:
        messages.append({"role": "user", "content": turn})
        reply = post(procs["dp"].url, "/v1/chat/completions", {"messages": messages, "temperature": 0,
                                                              "max_tokens": 8}).json()
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    after = [(metric(w, "kestrel_prefix_cache_queried_tokens"), metric(w, "kestrel_prefix_cache_hit_tokens"))
             for w in workers]
    queried = [a[0] - b[0] for a, b in zip(after, before)]
    hits = [a[1] - b[1] for a, b in zip(after, before)]
    assert sorted(q > 0 for q in queried) == [False, True], queried     # every turn went to the same worker
    assert max(hits) > 0                                                # and its later turns hit its cache


def test_a_worker_that_goes_down_is_taken_out_and_comes_back(fleet):
    procs, _ = fleet
    dp, down = procs["dp"], procs["u2"]

    def healthy() -> dict[str, bool]:
        return {w["url"]: w["is_healthy"] for w in httpx.get(dp.url + "/workers").json()["workers"]}

    def wait_until(condition, what: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while not condition():
            assert time.time() < deadline, what
            time.sleep(0.2)

    down.stop()
    wait_until(lambda: healthy().get(down.url) is False, "the router never marked the dead worker unhealthy")
    for _ in range(4):
        assert post(dp.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}).status_code == 200
    procs["u2"] = kestrel(port=down.port)
    procs["u2"].wait_ready()
    wait_until(lambda: healthy().get(down.url) is True, "the router never took the worker back")


async def _fake_decode_dying_mid_transfer(bootstrap: int, room: int) -> None:
    """Ask the prefill instance for room's handoff, read its header, then hang up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", bootstrap)
    await write_frame(writer, {"room": room, "index": 0})
    header = await read_frame(reader)
    assert header["tensors"]
    writer.close()


def test_faults_fail_their_request_and_leave_pools_empty(fleet):
    procs, bootstrap = fleet
    p, d = procs["p"].url, procs["d"].url
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 6}

    async def corrupted() -> tuple[httpx.Response, httpx.Response]:
        proxy, proxy_port = await corrupting_proxy(bootstrap, flip_at=100_000)
        pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": proxy_port, "bootstrap_room": 11}
        async with httpx.AsyncClient(timeout=120) as client:
            responses = await asyncio.gather(
                client.post(p + "/v1/completions", json={**body, **pd, "bootstrap_port": bootstrap}),
                client.post(d + "/v1/completions", json={**body, **pd}))
        proxy.close()
        return responses

    prefill_reply, decode_reply = asyncio.run(corrupted())
    assert decode_reply.status_code == 502 and "arrived corrupted" in decode_reply.json()["error"]["message"]
    assert prefill_reply.status_code == 502 and "arrived corrupted" in prefill_reply.json()["error"]["message"]

    async def decode_dies() -> httpx.Response:
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 12}
        async with httpx.AsyncClient(timeout=120) as client:
            reply, _ = await asyncio.gather(client.post(p + "/v1/completions", json={**body, **room}),
                                            _fake_decode_dying_mid_transfer(bootstrap, 12))
        return reply
    reply = asyncio.run(decode_dies())
    assert reply.status_code == 502 and "went away mid-transfer" in reply.json()["error"]["message"]
    assert_idle(p, d)

    async def prefill_dies() -> httpx.Response:             # the decode side waits on a room nobody prefills
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 13}
        async with httpx.AsyncClient(timeout=120) as client:
            waiting = asyncio.create_task(client.post(d + "/v1/completions", json={**body, **room}))
            while not _connected(bootstrap):                 # the decode side's fetch is open and waiting
                assert not waiting.done(), waiting.result().text
                await asyncio.sleep(0.1)
            procs["p"].stop()
            return await waiting
    reply = asyncio.run(prefill_dies())
    assert reply.status_code == 502 and "closed the connection" in reply.json()["error"]["message"]
    assert_idle(d)


def _connected(port: int) -> bool:
    """Some process holds an established TCP connection to 127.0.0.1:port."""
    out = subprocess.run(["ss", "-Htn", "state", "established", f"dport = :{port}"], capture_output=True, text=True)
    return bool(out.stdout.strip())
