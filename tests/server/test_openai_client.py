"""The official openai client against a live kestrel server: completions and chat, streamed and not."""

from __future__ import annotations

import json

import openai
import pytest

from server_helpers import MODEL_NAME

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def count_tokens(server, **body) -> int:
    with server.client() as http:
        return http.post("/tokenize", json=body).json()["count"]


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_completion_with_usage_logprobs_and_n(client, server):
    result = client.completions.create(model=MODEL_NAME, prompt="the quick brown", max_tokens=6, n=2,
                                       logprobs=2, seed=3, temperature=1.0)
    assert [c.index for c in result.choices] == [0, 1]
    assert result.usage.prompt_tokens == count_tokens(server, prompt="the quick brown")
    assert result.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in result.choices) == 12
    for choice in result.choices:
        assert choice.finish_reason == "length" and len(choice.logprobs.token_logprobs) == 6
        assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(model=MODEL_NAME, prompt=["to be or", "all the world"], max_tokens=8, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 16


def test_echo_returns_prompt_logprobs(client, server):
    result = client.completions.create(model=MODEL_NAME, prompt="to be or not", max_tokens=1, echo=True,
                                       logprobs=0, temperature=0)
    choice = result.choices[0]
    prompt_tokens = count_tokens(server, prompt="to be or not")
    assert choice.text.startswith("to be or not")
    assert len(choice.logprobs.token_logprobs) == prompt_tokens + 1
    assert choice.logprobs.token_logprobs[0] is None and all(lp < 0 for lp in choice.logprobs.token_logprobs[1:])
    zero = client.completions.create(model=MODEL_NAME, prompt="to be or not", max_tokens=0, echo=True,
                                     logprobs=0)
    assert zero.choices[0].text == "to be or not" and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs[:-1]


def test_chat_streamed_and_whole_agree(client, server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                           n=2, logprobs=True, top_logprobs=2)
    assert whole.usage.prompt_tokens == count_tokens(server, messages=messages)
    reasoning, content = {0: "", 1: ""}, {0: "", 1: ""}
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                            n=2, stream=True)
    for chunk in stream:
        for choice in chunk.choices:
            reasoning[choice.index] += getattr(choice.delta, "reasoning_content", None) or ""
            content[choice.index] += choice.delta.content or ""
    for choice in whole.choices:
        message = choice.message
        assert (getattr(message, "reasoning_content", None) or "") == reasoning[choice.index]
        assert (message.content or "") == content[choice.index]
        assert len(choice.logprobs.content) == 10 and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_named_tool_call_whole_and_streamed(client):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice=WEATHER,
                                           max_tokens=12, temperature=0)
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.function.arguments

    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice=WEATHER,
                                            max_tokens=12, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices and c.choices[0].delta.tool_calls]
    first = deltas[0].tool_calls[0]
    assert first.id and first.function.name == "get_weather"
    pieces = [d.tool_calls[0].function.arguments for d in deltas if d.tool_calls[0].function.arguments]
    assert len(pieces) > 1                                    # arguments stream as they are generated
    assert "".join(pieces) == call.function.arguments


def test_tool_result_round_trip_renders_and_json_mode_completes_the_reply(client):
    """A conversation holding a tool call and its result renders, and the JSON-mode reply after it is one complete
    JSON object. JSON mode only lets the end-of-message token through once the object is complete (structured.py),
    so finish_reason "stop" with room to spare (seed 0 stops after 65 of the 400 tokens) implies json.loads succeeds.
    """
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "reasoning_content": "look it up",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    result = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=400,
                                            temperature=1.0, seed=0, response_format={"type": "json_object"})
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict) and not choice.message.tool_calls


@pytest.mark.parametrize("seed", [0, 14, 15])
def test_json_mode_returns_complete_json_objects(client, seed: int):
    """JSON mode, whole and streamed: finish_reason "stop" well inside max_tokens (seeds picked where the tiny model
    closes its object in 35-56 tokens), so the reply must parse as one JSON object, and the stream must carry the
    same object."""
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "json"}], max_tokens=400,
                  temperature=1.0, seed=seed, response_format={"type": "json_object"})
    result = client.chat.completions.create(**kwargs)
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].finish_reason == "stop"
