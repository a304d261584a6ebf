"""Structured outputs over HTTP: every field a request can state a constraint in (OpenAI's response_format, vLLM's
structured_outputs and guided_*, SGLang's json_schema / regex / ebnf) is enforced on completions and chat, on the
test model in the bundled dialect and on the K3 replica served as downloaded; replies are checked by `jsonschema`
and Python's `re`; tool_choice required or named gets one call of a listed tool with arguments valid for its
schema (the call's layout against the renderers is tested in test_tool_grammar.py). A bad constraint is a 400
naming its field, in one sentence, before anything is generated.

The constraints are bounded (enums, bounded integers, no extra properties, no whitespace between JSON items), so
with max_tokens past that bound every reply must finish with "stop"; on the bundled model too, through the openai
client's `parse()` and forced tool calls, within 60 tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from kestrel.engine.args import BUNDLED_MODEL
from replica import write_k3_replica
from server_helpers import MODEL_NAME, LiveServer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
SCHEMA_TOKENS = 200                     # ample for each bounded constraint here
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
GRAMMAR = 'root ::= "(" num ("+" num)? ")"\nnum ::= [1-9] [0-9]?\n'
GRAMMAR_REGEX = r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)"
CHOICES = ["Paris", "Rome", "Rome, Italy", 'a "quoted" \\ answer']
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": "^[a-z]{1,5}$"}}, "required": ["q"],
        "additionalProperties": False}}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "Who art thou? Answer in JSON."}]


class Person(pydantic.BaseModel):
    """A small reply model with bounded values (the bundled model seldom closes an unbounded string)."""

    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def bundled_server():
    live = LiveServer(BUNDLED_MODEL)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def k3_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3-replica")
    write_k3_replica(folder)
    live = LiveServer(folder, dtype="float32")
    yield live
    live.stop()


def post(server, path: str, body: dict):
    with server.client() as http:
        return http.post(path, json={"max_tokens": 16, "temperature": 1.0, "seed": 0, **body})


def chat_reply(server, body: dict) -> tuple[str, str]:
    """(content, finish_reason) of a chat reply, and checks the streamed reply says the same."""
    body = {"messages": [{"role": "user", "content": "Answer in JSON."}], **body}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    streamed = ""
    with server.client() as http, http.stream("POST", "/v1/chat/completions",
                                               json={"max_tokens": 16, "temperature": 1.0, "seed": 0, **body,
                                                     "stream": True}) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                streamed += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    assert streamed == choice["message"]["content"]
    return choice["message"]["content"], choice["finish_reason"]


@pytest.mark.parametrize("which", ["server", "k3_server"])
def test_response_format_json_schema_on_chat_and_completions(request, which):
    server = request.getfixturevalue(which)
    content, finish = chat_reply(server, {"response_format": JSON_SCHEMA_FORMAT, "max_tokens": SCHEMA_TOKENS})
    assert finish == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)
    completion = post(server, "/v1/completions", {"prompt": "Answer:", "response_format": JSON_SCHEMA_FORMAT,
                                                  "max_tokens": SCHEMA_TOKENS, "n": 2}).json()
    for choice in completion["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def check_date(text: str) -> None:
    assert re.fullmatch(DATE, text), text


def check_grammar(text: str) -> None:
    assert re.fullmatch(GRAMMAR_REGEX, text), text


@pytest.mark.parametrize("fields, check", [
    ({"structured_outputs": {"json": SCHEMA}}, check_json),
    ({"guided_json": SCHEMA}, check_json),
    ({"json_schema": json.dumps(SCHEMA)}, check_json),                      # SGLang: the schema as text
    ({"structured_outputs": {"regex": DATE}}, check_date),
    ({"guided_regex": DATE}, check_date),
    ({"regex": DATE}, check_date),
    ({"structured_outputs": {"grammar": GRAMMAR}}, check_grammar),
    ({"guided_grammar": GRAMMAR}, check_grammar),
    ({"ebnf": GRAMMAR}, check_grammar),
], ids=["structured_outputs.json", "guided_json", "sglang-json_schema", "structured_outputs.regex", "guided_regex",
        "sglang-regex", "structured_outputs.grammar", "guided_grammar", "sglang-ebnf"])
def test_every_constraint_field_is_enforced_on_completions(server, fields, check):
    body = {"prompt": "the quick brown", "n": 2, "max_tokens": SCHEMA_TOKENS, **fields}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        check(choice["text"])


@pytest.mark.parametrize("fields", [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}],
                         ids=["guided_choice", "structured_outputs.choice"])
def test_a_choice_is_enforced_on_completions_and_chat(server, fields):
    completion = post(server, "/v1/completions", {"prompt": "the quick brown", "max_tokens": SCHEMA_TOKENS, **fields})
    assert completion.status_code == 200, completion.text
    (choice,) = completion.json()["choices"]
    assert choice["text"] in CHOICES and choice["finish_reason"] == "stop", choice
    content, finish = chat_reply(server, {"max_tokens": SCHEMA_TOKENS, **fields})
    assert content in CHOICES and finish == "stop", content


def test_the_openai_client_sends_extra_fields(server, k3_server):
    for live in (server, k3_server):
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL_NAME, seed=1,
                                               messages=[{"role": "user", "content": "a date?"}], max_tokens=16,
                                               extra_body={"guided_regex": DATE})
        check_date(reply.choices[0].message.content)
        assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}},
     "response_format", "the JSON schema cannot be compiled"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "the regular expression cannot be compiled"),
    ({"ebnf": "root ::= missing"}, "ebnf", "the grammar cannot be compiled"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "regex": "b"}, "regex", "both constrain the output"),
    ({"guided_choice": []}, "guided_choice", "at least one string"),
], ids=["bad-schema", "no-schema", "bad-regex", "bad-ebnf", "schema-not-json", "two-in-one", "two-fields",
        "empty-choice"])
def test_a_bad_constraint_is_a_400_naming_its_field(server, fields, param, message):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        response = post(server, path, {**body, **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"]
        assert "\n" not in error["message"] and error["message"].endswith(".")


def test_a_constraint_cannot_ride_along_with_forced_tool_calls(server):
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                     "tool_choice": "required", "response_format": JSON_SCHEMA_FORMAT})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("which", ["server", "k3_server"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "search"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_are_well_formed(request, which, tool_choice):
    server = request.getfixturevalue(which)
    names = list(PARAMETERS) if tool_choice == "required" else ["search"]
    for seed in range(2):
        response = post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": TOOLS,
            "tool_choice": tool_choice, "max_tokens": 200, "seed": seed})
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])


def test_openai_parse_finishes_on_the_bundled_model(bundled_server):
    """Given free whitespace, the bundled model filled it until max_tokens (issue #60)."""
    client = openai.OpenAI(base_url=bundled_server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.parse(model=MODEL_NAME, messages=QUESTION, response_format=Person,
                                          max_tokens=60, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(reply.choices[0].message.content) == reply.choices[0].message.parsed


@pytest.mark.parametrize("strict", [True, False], ids=["pydantic_function_tool", "model_json_schema"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "introduce"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_finish_on_the_bundled_model(bundled_server, tool_choice, strict):
    """Without additionalProperties, the bundled model invented keys until max_tokens."""
    tool = openai.pydantic_function_tool(Person, name="introduce") if strict else \
        {"type": "function", "function": {"name": "introduce", "parameters": Person.model_json_schema()}}
    client = openai.OpenAI(base_url=bundled_server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, tools=[tool],
                                           tool_choice=tool_choice, max_tokens=60, temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "introduce"
    jsonschema.validate(json.loads(call.function.arguments), {**Person.model_json_schema(),
                                                              "additionalProperties": False})


def outside_strings(text: str) -> str:
    """JSON text with every string emptied."""
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def test_json_object_is_compact_unless_whitespace_is_asked_for(server):
    compact, finish = chat_reply(server, {"response_format": {"type": "json_object"}, "max_tokens": 60,
                                          "temperature": 0})
    assert finish == "stop" and isinstance(json.loads(compact), dict)
    assert not re.search(r"\s", outside_strings(compact)), compact
    flexible_json = {"json_object": True, "disable_any_whitespace": False}
    flexible, finish = chat_reply(server, {"structured_outputs": flexible_json, "max_tokens": 60, "temperature": 0})
    assert finish == "stop" and isinstance(json.loads(flexible), dict)
    assert re.search(r"\s", outside_strings(flexible)), flexible
