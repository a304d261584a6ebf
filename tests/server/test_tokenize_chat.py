"""/tokenize with messages and tools returns the ids the model sees, and chat serves a folder without a template.

The replica of a published K3 folder (tests/replica.py: tiktoken.model, the published special-token table, no
chat template) is served as users would serve a download: kestrel renders its chats with K3's renderer (xtml.py,
checked against Moonshot's format in test_chat_render.py). The oracle for the ids is the tiktoken library over the
folder's own files, used as Moonshot's encoder uses it: each rendered segment encoded on its own, control segments
with their control tokens, text segments with `disallowed_special=()` (text that spells a control token stays text).
"""

from __future__ import annotations

import json

import pytest

from kestrel.engine.tokenizer import Tokenizer
from kestrel.server.chat import render_chat
from kestrel.server.protocol import Message, Tool
from kestrel.server.xtml import render
from replica import tiktoken_encoding, write_k3_replica
from server_helpers import LiveServer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris? <|close|>message<|sep|>"},
    {"role": "assistant", "content": None, "reasoning_content": "look it up", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True}}


@pytest.fixture(scope="module")
def k3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3-replica")
    write_k3_replica(folder)
    return folder


@pytest.fixture(scope="module")
def k3_server(k3_folder):
    live = LiveServer(k3_folder, dtype="float32")
    yield live
    live.stop()


def error_of(response) -> dict:
    return response.json()["error"]


def tokenize(server, **body) -> dict:
    with server.client() as http:
        response = http.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        return response.json()


def test_tokenize_gives_the_ids_of_the_k3_render(k3_server, k3_folder):
    oracle = tiktoken_encoding(k3_folder)
    got = tokenize(k3_server, messages=CONVERSATION, tools=TOOLS, reasoning_effort="low")["tokens"]
    segments = render([Message.model_validate(m) for m in CONVERSATION], [Tool.model_validate(t) for t in TOOLS],
                      thinking_effort="low")
    want = [i for s in segments for i in (oracle.encode(s.text, allowed_special="all") if s.control
                                          else oracle.encode(s.text, disallowed_special=()))]
    assert got == want
    assert oracle.encode("".join(s.text for s in segments), allowed_special="all") != want    # segments matter
    assert oracle.decode(got) == "".join(s.text for s in segments)
    close = oracle.encode_single_token("<|close|>")
    assert got.count(close) == sum(s.text == "<|close|>" and s.control for s in segments)  # the user's stays text
    bare = tokenize(k3_server, messages=CONVERSATION, tools=TOOLS, add_generation_prompt=False)["tokens"]
    assert oracle.decode(bare) == "".join(
        s.text for s in render([Message.model_validate(m) for m in CONVERSATION],
                               [Tool.model_validate(t) for t in TOOLS], thinking_effort="max",
                               add_generation_prompt=False))


def test_tokenize_declares_a_json_schema_and_chat_sees_the_same_ids(k3_server, k3_folder):
    ids = tokenize(k3_server, messages=CONVERSATION[:2], response_format=SCHEMA)["tokens"]
    assert "The JSON data must match the following schema:\n```json\n{\"type\":\"object\"}\n```" in \
        tiktoken_encoding(k3_folder).decode(ids)
    with k3_server.client() as http:
        chat = http.post("/v1/chat/completions", json={"messages": CONVERSATION[:2], "response_format": SCHEMA,
                                                       "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(ids)
        effort = http.post("/tokenize", json={"messages": CONVERSATION[:2], "reasoning_effort": "extreme"})
        assert effort.status_code == 400 and error_of(effort)["param"] == "reasoning_effort"
        orphan = http.post("/tokenize", json={"messages": [{"role": "tool", "content": "x"}]})
        assert orphan.status_code == 400 and "tool name" in error_of(orphan)["message"]


def test_tokenize_with_a_folder_template_encodes_its_render(server, model_folder):
    tokenizer = Tokenizer.from_folder(model_folder)
    body = {"messages": CONVERSATION[:2], "tools": TOOLS}
    text = render_chat(tokenizer, [Message.model_validate(m) for m in CONVERSATION[:2]],
                       tools=[Tool.model_validate(t) for t in TOOLS]).text
    assert text.startswith("<|open|>tools<|sep|>")                     # the bundled dialect, from the template
    assert tokenize(server, **body)["tokens"] == tokenizer.encode(text)


def test_the_tool_choice_note_is_written_only_for_a_tool_choice_given(k3_server, k3_folder):
    """Moonshot's renderer writes the tool-choice note only for a tool_choice the caller passes; a plain chat, or
    tools without a tool_choice, get none. Chat prompts are the /tokenize ids."""
    decode = tiktoken_encoding(k3_folder).decode
    note = '<|open|>message role="system" type="tool-choice"<|sep|>'
    chat = CONVERSATION[:2]
    for extras, noted in (({}, False), ({"tools": TOOLS}, False), ({"tools": TOOLS, "tool_choice": "none"}, True)):
        ids = tokenize(k3_server, messages=chat, **extras)["tokens"]
        assert (note in decode(ids)) == noted, extras
        with k3_server.client() as http:
            reply = http.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 1, **extras})
        assert reply.json()["usage"]["prompt_tokens"] == len(ids)


def test_reasoning_effort_minimal_is_k3s_lowest(k3_server):
    low = tokenize(k3_server, messages=CONVERSATION[:2], reasoning_effort="low")["tokens"]
    assert tokenize(k3_server, messages=CONVERSATION[:2], reasoning_effort="minimal")["tokens"] == low
    assert tokenize(k3_server, messages=CONVERSATION[:2], reasoning_effort="medium")["tokens"] != low


@pytest.mark.parametrize("extras", [
    {"tools": TOOLS, "reasoning_effort": "low"},
    {"tools": TOOLS, "tool_choice": "required"},
    {"response_format": {"type": "json_object"}, "reasoning_effort": "none"},
], ids=["effort", "required", "json"])
def test_chat_prompt_tokens_equal_tokenize(k3_server, extras):
    body = {"messages": CONVERSATION, **extras}
    with k3_server.client() as http:
        chat = http.post("/v1/chat/completions", json={**body, "max_tokens": 2, "temperature": 0})
        assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == tokenize(k3_server, **body)["count"]


def test_k3_chat_whole_and_streamed_agree(k3_server):
    body = {"messages": CONVERSATION, "tools": TOOLS, "max_tokens": 24, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with k3_server.client() as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        reasoning = content = ""
        calls: dict[int, dict] = {}
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"]
                    reasoning += delta.get("reasoning_content") or ""
                    content += delta.get("content") or ""
                    for call in delta.get("tool_calls") or []:
                        entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
                        entry["name"] = call["function"].get("name") or entry["name"]
                        entry["arguments"] += call["function"]["arguments"]
    first = whole["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["id"].startswith("call_")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == \
        [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert (whole.get("reasoning_content") or "", whole["content"] or "") == (reasoning, content)
