"""A streaming client for any OpenAI-compatible server (kestrel, SGLang, vLLM) that records request timelines."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from .metrics import RequestRecord


class ServerError(RuntimeError):
    """The server cannot be used for the run (unreachable, or it refuses the model)."""


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the endpoint ("completions" or "chat") and its JSON body (without model/stream)."""

    endpoint: str
    body: dict
    prompt_tokens: int = 0          # expected, when the workload knows it


class Client:
    """Sends streaming requests on one connection pool; every request yields a RequestRecord (never raises)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, clock_start: float | None = None,
                 timeout: float = 600):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self.model = model
        self.clock_start = time.perf_counter() if clock_start is None else clock_start

    def now(self) -> float:
        return time.perf_counter() - self.clock_start

    async def close(self) -> None:
        await self.http.aclose()

    async def send(self, spec: RequestSpec) -> tuple[RequestRecord, str]:
        """Stream one request; its record and the generated text."""
        path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
        body = {**spec.body, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        record = RequestRecord(start=self.now(), prompt_tokens=spec.prompt_tokens)
        text: list[str] = []
        for attempt in range(2):
            try:
                async with self.http.stream("POST", path, json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        record.error = f"HTTP {response.status_code}: {_error_message(response)}"
                        return record, ""
                    async for line in response.aiter_lines():
                        self._take(line, record, text)
                break
            except httpx.RemoteProtocolError as e:
                # a kept-alive connection the server closed as it was reused (llama-server closes one after a
                # number of requests): sent again once, on a new connection, when nothing came back
                if attempt or record.chunk_times:
                    record.error = f"{type(e).__name__}: {e}"
                    break
            except httpx.HTTPError as e:
                record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                break
        if record.error is None and not record.chunk_times:
            record.error = "the stream ended without output"
        if record.output_tokens == 0:      # a server that sends no usage: one token per chunk
            record.output_tokens = len(record.chunk_times)
        return record, "".join(text)

    def _take(self, line: str, record: RequestRecord, text: list[str]) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            record.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
            return
        if chunk.get("choices"):
            record.chunk_times.append(self.now())
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                text.append(choice.get("text") or delta.get("content") or "")
        usage = chunk.get("usage")
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
            record.output_tokens = usage.get("completion_tokens", record.output_tokens)
            record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


async def server_info(base_url: str, api_key: str | None = None) -> dict:
    """/v1/models and /metrics (when the server has them); ServerError if it cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=30) as http:
        try:
            models = await http.get("/v1/models")
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {base_url} ({type(e).__name__}); is the server running?") from e
        if models.status_code != 200:
            raise ServerError(f"{base_url}/v1/models answered {models.status_code}: {_error_message(models)}")
        metrics = await http.get("/metrics")
        return {"models": models.json(), "metrics": metrics.text if metrics.status_code == 200 else None}
