"""Soak: a long seeded mix of valid, invalid, streamed, aborted and disconnected requests against one server.

Every answer is checked against what its request asked for (status, error shape, choice count, token count,
finish reason, stop strings absent, JSON mode complete, a stream ending in [DONE]); what the server still holds
afterwards (slots, pages, tasks, memory) is for the caller to check, since only it can see inside the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from dataclasses import dataclass, field

import httpx

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
INVALID_BODIES = [
    {"prompt": "hi", "temperature": -1}, {"prompt": "hi", "n": 0}, {"prompt": "hi", "max_tokens": "many"},
    {"prompt": []}, {"prompt": "hi", "top_p": 0}, {"prompt": [10**9]}, {"prompt": "hi", "seed": 2**64},
    {"prompt": "hi", "model": "no-such-model"}, {"prompt": "hi", "stop_token_ids": [-1]},
    {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
]


@dataclass
class SoakReport:
    """What a soak sent and what came back; `problems` lists every answer that broke its request's contract."""

    sent: int = 0
    answered: int = 0          # valid requests answered in full
    refused: int = 0           # invalid requests answered 4xx in OpenAI's error shape
    abandoned: int = 0         # requests the client aborted or disconnected from on purpose
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SoakRequest:
    path: str
    body: dict
    kind: str                  # "valid", "invalid", "abort" (stream closed after one chunk), "disconnect"


def random_request(rng: random.Random, vocab: int) -> SoakRequest:
    """One request of the mix: 70% valid, 15% invalid, 10% aborted streams, 5% disconnected mid-request."""
    kind = rng.choices(["valid", "invalid", "abort", "disconnect"], [70, 15, 10, 5])[0]
    if kind == "invalid":
        body = rng.choice(INVALID_BODIES)
        return SoakRequest("/v1/chat/completions" if "messages" in body else "/v1/completions", body, kind)
    sampling = {"max_tokens": rng.randint(1, 6), "n": rng.choice([1, 1, 1, 2]), "ignore_eos": rng.random() < 0.5,
                "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 2**32), "stream": rng.random() < 0.5,
                "stream_options": {"include_usage": True}}
    if rng.random() < 0.2:
        sampling["stop"] = [rng.choice(["e", "th", " "])]
    if kind == "abort":
        sampling.update(stream=True, max_tokens=60)
    words = " ".join(rng.choices(WORDS, k=rng.randint(1, 16)))
    if rng.random() < 0.6:
        prompt = words if rng.random() < 0.7 else [rng.randrange(3, vocab) for _ in range(rng.randint(1, 16))]
        return SoakRequest("/v1/completions", {"prompt": prompt, **sampling}, kind)
    body = {"messages": [{"role": "user", "content": words}], **sampling}
    if rng.random() < 0.3:
        body.update(response_format={"type": "json_object"}, max_tokens=rng.randint(8, 24))
    return SoakRequest("/v1/chat/completions", body, kind)


async def soak(base_url: str, num_requests: int, concurrency: int, vocab: int, seed: int = 0) -> SoakReport:
    """Send num_requests requests of the mix, `concurrency` at a time, and check every answer."""
    rng = random.Random(seed)
    requests = [random_request(rng, vocab) for _ in range(num_requests)]
    report = SoakReport()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        queue: asyncio.Queue[SoakRequest] = asyncio.Queue()
        for request in requests:
            queue.put_nowait(request)

        async def worker() -> None:
            while not queue.empty():
                request = queue.get_nowait()
                report.sent += 1
                problem = await _send(http, request, report)
                if problem:
                    report.problems.append(f"{problem}: {request.path} {json.dumps(request.body)[:200]}")
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return report


async def _send(http: httpx.AsyncClient, request: SoakRequest, report: SoakReport) -> str | None:
    """Send one request and check its answer; a description of what was wrong, or None."""
    if request.kind == "disconnect":          # gives up after 10 ms, whether or not the answer came
        with contextlib.suppress(httpx.TimeoutException):
            await http.post(request.path, json=request.body, timeout=0.01)
        report.abandoned += 1
        return None
    async with http.stream("POST", request.path, json=request.body) as response:
        if request.kind == "invalid":
            await response.aread()
            report.refused += 1
            error = response.json().get("error", {}) if response.status_code in range(400, 500) else {}
            return None if {"message", "type", "code"} <= set(error) else f"invalid request got {response.status_code}"
        if response.status_code != 200:
            await response.aread()
            return f"HTTP {response.status_code} {response.text[:200]}"
        if request.kind == "abort":
            lines = response.aiter_lines()          # read one chunk, then close the stream
            await anext(lines)
            report.abandoned += 1
            return None
        if request.body["stream"]:
            answer = await _streamed_answer(response)
        else:
            await response.aread()
            answer = response.json()
    report.answered += 1
    return answer if isinstance(answer, str) else _check_answer(request.body, answer)


async def _streamed_answer(response: httpx.Response) -> dict | str:
    """The answer a stream assembles ({"choices": [{"index", "text", "finish_reason"}], "usage"}), or what broke
    the stream."""
    choices: dict[int, dict] = {}
    usage, last = None, ""
    async for line in response.aiter_lines():
        if not line:
            continue
        last = line
        if line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
            return f"error event {chunk['error']}"
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            entry = choices.setdefault(c["index"], {"index": c["index"], "text": "", "finish_reason": None})
            entry["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            entry["finish_reason"] = c["finish_reason"] or entry["finish_reason"]
    if last != "data: [DONE]":
        return "the stream did not end with [DONE]"
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def _check_answer(body: dict, answer: dict) -> str | None:
    choices, usage = answer["choices"], answer["usage"]
    if sorted(c["index"] for c in choices) != list(range(body["n"])):
        return f"{len(choices)} choices for n={body['n']}"
    for c in choices:
        text = c["text"] if "text" in c else (c.get("message") or {}).get("content") or ""
        if c["finish_reason"] not in ("stop", "length"):
            return f"finish_reason {c['finish_reason']!r}"
        if any(s in text for s in body.get("stop", [])):
            return f"a stop string was returned in {text!r}"
        if "response_format" in body and "stop" not in body and c["finish_reason"] == "stop":   # not cut short
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return f"JSON mode stopped on an incomplete object {text!r}"
    runs_to_length = body["ignore_eos"] and "stop" not in body and "response_format" not in body
    if runs_to_length and usage["completion_tokens"] != body["n"] * body["max_tokens"]:
        return f"{usage['completion_tokens']} tokens for n={body['n']} x max_tokens={body['max_tokens']}"
    return None
