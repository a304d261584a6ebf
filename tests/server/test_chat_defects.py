"""Chat replies of the bundled model (models/k3.1-tiny, a trained model whose greedy reply opens by closing the
reasoning its prompt opened: `<|close|>think<|sep|>I ...`), cut anywhere by max_tokens.

Invariants: no control token or cut-off marker reaches reasoning or content; a reply cut short is a prefix of the
longer one (greedy decoding: its tokens are the longer reply's first tokens); streamed and whole replies carry the
same text and a logprob for every generated token; reasoning_effort none skips the reasoning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel.engine.tokenizer import Tokenizer
from kestrel.server.chat import CONTROL_TOKENS
from kestrel.server.options import ServerOptions
from server_helpers import LiveServer

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "k3.1-tiny"
HI = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "logprobs": True}


@pytest.fixture(scope="module")
def bundled():
    live = LiveServer(BUNDLED, ServerOptions("k3.1-tiny"))
    yield live
    live.stop()


def whole(http, **extra) -> tuple[str, str, list[str], int]:
    """(reasoning, content, logprob tokens, completion tokens) of a whole reply."""
    response = http.post("/v1/chat/completions", json={**HI, **extra})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    message = choice["message"]
    return (message.get("reasoning_content") or "", message["content"] or "",
            [t["token"] for t in choice["logprobs"]["content"]], response.json()["usage"]["completion_tokens"])


def streamed(http, **extra) -> tuple[str, str, list[str]]:
    """(reasoning, content, logprob tokens) of a streamed reply; every chunk says something."""
    reasoning = content = ""
    tokens: list[str] = []
    with http.stream("POST", "/v1/chat/completions", json={**HI, **extra, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            assert choice["delta"] or choice["finish_reason"], line            # no empty delta
            reasoning += choice["delta"].get("reasoning_content") or ""
            content += choice["delta"].get("content") or ""
            tokens += [t["token"] for t in (choice["logprobs"] or {"content": []})["content"]]
    return reasoning, content, tokens


def test_markers_never_reach_a_cut_reply_and_streamed_equals_whole(bundled):
    with bundled.client() as http:
        full_reasoning, full_content, full_tokens, _ = whole(http, max_tokens=12)
        assert full_tokens[0] == "<|close|>" and "I" in full_tokens     # the case in question: a marker, then text
        for max_tokens in range(1, 9):
            reasoning, content, tokens, count = whole(http, max_tokens=max_tokens)
            assert not any(t in reasoning + content for t in CONTROL_TOKENS), (max_tokens, reasoning, content)
            assert full_reasoning.startswith(reasoning) and full_content.startswith(content), max_tokens
            assert tokens == full_tokens[:max_tokens] and len(tokens) == count
            assert streamed(http, max_tokens=max_tokens) == (reasoning, content, tokens), max_tokens


def test_max_tokens_0_is_refused_for_chat(bundled):
    with bundled.client() as http:
        response = http.post("/v1/chat/completions", json={**HI, "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_reasoning_effort_none_skips_the_reasoning_and_efforts_the_template_lacks_are_refused(bundled):
    with bundled.client() as http:
        reasoning, content, tokens, _ = whole(http, max_tokens=6, reasoning_effort="none")
        assert reasoning == "" and content and tokens[0] != "<|close|>"
        default = http.post("/tokenize", json={"messages": HI["messages"]}).json()["tokens"]
        none = http.post("/tokenize", json={"messages": HI["messages"], "reasoning_effort": "none"}).json()
        closed = Tokenizer.from_folder(BUNDLED).encode("<|close|>think<|sep|>", add_special_tokens=False,
                                                       allow_special=True)
        assert none["tokens"] == default + closed                        # the prompt closes the reasoning
        for effort in ("minimal", "low", "max"):                         # its template has no thinking effort
            refused = http.post("/v1/chat/completions", json={**HI, "reasoning_effort": effort})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
