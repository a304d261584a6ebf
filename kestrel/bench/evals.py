"""Accuracy evals through any OpenAI-compatible completions API.

- perplexity: of a text, from prompt logprobs (`echo` with `max_tokens` 0), in windows of the context length;
- choice: multiple choice by log-likelihood of each continuation (plus the length-normalised variant);
- generate: greedy generation with exact-match answers extracted GSM8K-style ("#### N", else the last number).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

from .client import ServerError

DATA = Path(__file__).with_name("data")


@dataclass
class EvalClient:
    base_url: str
    model: str
    api_key: str | None = None

    def post(self, path: str, body: dict) -> dict:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            response = httpx.post(self.base_url.rstrip("/") + path, json=body, headers=headers, timeout=600)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.base_url} ({type(e).__name__}); is the server running?") from e
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            raise ServerError(f"{path} answered {response.status_code}: {message}")
        return response.json()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], int]:
        """Token ids and the server's context length."""
        out = self.post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens})
        return out["tokens"], out.get("max_model_len", 2048)

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """Logprob of each token after the first, given the ones before it."""
        out = self.post("/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 0, "echo": True,
                                            "logprobs": 0, "temperature": 0})
        return out["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]


def perplexity(client: EvalClient, text: str) -> dict:
    """exp of the mean negative log-likelihood per token, scored in non-overlapping windows."""
    ids, context = client.tokenize(text)
    window = max(2, min(context - 1, 2048))
    logprobs: list[float] = []
    for start in range(0, len(ids) - 1, window - 1):
        logprobs += client.prompt_logprobs(ids[start:start + window])
    if not logprobs:
        raise ValueError("the text is too short to score: it needs at least two tokens.")
    return {"tokens": len(logprobs), "perplexity": math.exp(-sum(logprobs) / len(logprobs))}


def choice(client: EvalClient, tasks: list[dict]) -> dict:
    """Each task: {"context", "choices": [...], "answer": index}. Accuracy by summed and by per-token logprob."""
    correct = correct_norm = 0
    for i, task in enumerate(tasks):
        _check(task, ("context", "choices", "answer"), i)
        context_ids, _ = client.tokenize(task["context"])
        scores, norms = [], []
        for continuation in task["choices"]:
            ids, _ = client.tokenize(task["context"] + continuation)
            shared = next((k for k, (a, b) in enumerate(zip(context_ids, ids)) if a != b), len(context_ids))
            tail = client.prompt_logprobs(ids)[max(shared, 1) - 1:]
            scores.append(sum(tail))
            norms.append(sum(tail) / max(1, len(tail)))
        correct += scores.index(max(scores)) == task["answer"]
        correct_norm += norms.index(max(norms)) == task["answer"]
    return {"tasks": len(tasks), "accuracy": correct / len(tasks), "accuracy_norm": correct_norm / len(tasks)}


def generate(client: EvalClient, tasks: list[dict], max_tokens: int = 64) -> dict:
    """Each task: {"prompt", "answer"}; exact match of the extracted answer."""
    correct = 0
    for i, task in enumerate(tasks):
        _check(task, ("prompt", "answer"), i)
        out = client.post("/v1/completions", {"model": client.model, "prompt": task["prompt"],
                                              "max_tokens": max_tokens, "temperature": 0, "stop": ["\n\n"]})
        correct += extract_answer(out["choices"][0]["text"]) == str(task["answer"]).strip()
    return {"tasks": len(tasks), "exact_match": correct / len(tasks)}


def extract_answer(text: str) -> str | None:
    """GSM8K-style: the number after "####", else the last number in the text (commas dropped)."""
    marked = re.search(r"####\s*(-?[\d,]*\.?\d+)", text)
    numbers = re.findall(r"-?[\d,]*\.?\d+", text)
    found = marked.group(1) if marked else (numbers[-1] if numbers else None)
    return None if found is None else found.replace(",", "").rstrip(".")


def read_tasks(path: Path) -> list[dict]:
    try:
        tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSONL task file ({e}).") from e
    if not tasks:
        raise ValueError(f"{path} holds no tasks.")
    return tasks


def _check(task: dict, keys: tuple[str, ...], index: int) -> None:
    missing = [k for k in keys if k not in task]
    if missing:
        raise ValueError(f"task {index + 1} lacks {', '.join(missing)}.")
