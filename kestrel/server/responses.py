"""OpenAI response bodies: completions and chat completions, whole and as stream chunks, with logprobs and usage."""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from ..engine.tokenizer import Tokenizer
from .chat import ParsedToolCall, ReplyDelta


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_text(tokenizer: Tokenizer | None, token: int) -> str:
    return tokenizer.token_text(token) if tokenizer is not None else f"token_id:{token}"


def completion_logprobs(tokenizer: Tokenizer | None, token_ids: list[int], entries: list[TokenLogprobs | None],
                        offset: int) -> dict[str, list]:
    """The legacy completions logprobs object for tokens (an entry of None: the first prompt token, no logprob);
    text offsets start at `offset` and follow the text, in which special tokens do not appear."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    skipped = tokenizer.special_ids if tokenizer is not None else frozenset()
    for token, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry[token].logprob)
        out["top_logprobs"].append(None if entry is None else
                                   {token_text(tokenizer, t): lp.logprob for t, lp in entry.items()})
        out["text_offset"].append(offset)
        offset += 0 if token in skipped else len(text)     # special tokens are not in the text
    return out


def chat_logprobs(tokenizer: Tokenizer | None, token_ids: list[int], entries: list[TokenLogprobs],
                  top: int) -> dict[str, list]:
    """The chat logprobs object: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    content = []
    for token, entry in zip(token_ids, entries):
        alternatives = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top]
        content.append({**_token_logprob(tokenizer, token, entry[token].logprob),
                        "top_logprobs": [_token_logprob(tokenizer, t, lp.logprob) for t, lp in alternatives]})
    return {"content": content}


def _token_logprob(tokenizer: Tokenizer | None, token: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_finish_reason(completion: CompletionOutput, calls: list[ParsedToolCall]) -> str | None:
    if completion.finish_reason is None:
        return None
    return "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason


def chat_message(reasoning: str, content: str, calls: list[ParsedToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message


def chat_delta(delta: ReplyDelta, first: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"role": "assistant"} if first else {}
    if delta.reasoning:
        body["reasoning_content"] = delta.reasoning
    if delta.content:
        body["content"] = delta.content
    items: dict[int, dict[str, Any]] = {}         # one entry per call, as OpenAI sends them
    for call in delta.tool_calls:
        item = items.setdefault(call.index, {"index": call.index, "function": {"arguments": ""}})
        item["function"]["arguments"] += call.arguments
        if call.id is not None:
            item.update(id=call.id, type="function")
            item["function"]["name"] = call.name
    if items:
        body["tool_calls"] = list(items.values())
    return body


def completion_tokens(output: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in output.outputs)
