"""The OpenAI-compatible request schemas (with vLLM's extra sampling fields and vLLM's and SGLang's structured-output
fields) and their SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ..engine.sampling import MODEL_DEFAULT_FIELDS, SamplingParams
from ..engine.structured import StructuredOutputsParams

MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
"""An integer a request may send (token ids, priorities); values outside the field's own range are refused later."""


class Schema(BaseModel):
    """Unknown fields are ignored (clients send many); known fields are type-checked (booleans strictly: "yes" is
    no boolean)."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(Schema):
    include_usage: StrictBool = False


class JsonSchemaFormat(Schema):
    """OpenAI's json_schema response format: the schema the reply must match."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(Schema):
    """vLLM's `structured_outputs` body field: one of json, regex, grammar, json_object, choice."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    choice: list[str] | None = None
    disable_any_whitespace: StrictBool = True

    def fields(self) -> dict[str, Any]:
        """The StructuredOutputsParams fields it sets."""
        return {"json": self.json_, "regex": self.regex, "grammar": self.grammar, "json_object": self.json_object,
                "choice": self.choice, "disable_any_whitespace": self.disable_any_whitespace}


class SamplingFields(Schema):
    """Fields shared by completions and chat, OpenAI's plus vLLM's extensions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0)       # None: the model's default, else 1
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=2**64 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    stop_token_ids: list[Int64] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    priority: Int64 = 0
    # what the output must match, in vLLM's fields (structured_outputs, and the legacy guided_*) or SGLang's
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def sampling_params(self, model_defaults: dict[str, float], max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, skip_special_tokens: bool | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's SamplingParams; the MODEL_DEFAULT_FIELDS it leaves out come from model_defaults (the
        model's generation_config.json), else from SamplingParams' own defaults."""
        chosen = {name: model_defaults.get(name) if getattr(self, name) is None else getattr(self, name)
                  for name in MODEL_DEFAULT_FIELDS}
        return SamplingParams(
            **{name: value for name, value in chosen.items() if value is not None}, n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens) if max_tokens else self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, structured_outputs=structured_outputs)


class BootstrapFields(Schema):
    """SGLang's PD fields, which its router adds to a request it sends to a prefill and a decode instance (lists
    with one entry per prompt for a batch of prompts)."""

    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | None | list[int | None] = None
    bootstrap_room: Annotated[int, Field(ge=0, le=INT64_MAX)] | list[Annotated[int, Field(ge=0, le=INT64_MAX)]] \
        | None = None

    def bootstrap(self, i: int) -> tuple[str | None, int | None, int | None]:
        """Prompt i's (host, port, room), each None where the request lacks it."""
        return tuple(value[i] if isinstance(value, list) and i < len(value) else
                     None if isinstance(value, list) else value
                     for value in (self.bootstrap_host, self.bootstrap_port, self.bootstrap_room))


class CompletionRequest(SamplingFields, BootstrapFields):
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    max_tokens: int | None = Field(default=16, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    response_format: ResponseFormat | None = None
    suffix: str | None = None                 # refused (app.py): kestrel does not insert text
    best_of: int | None = Field(default=None, ge=1, le=128)      # refused unless it equals n

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one text, several texts, one token-id list, or several."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class FunctionCall(Schema):
    name: str
    arguments: str = ""


class ToolCall(Schema):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(Schema):
    type: Literal["text"]
    text: str


class FunctionDefinition(Schema):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Schema):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class Message(Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    tools: list[Tool] | None = None          # on a system message: tools declared mid-conversation

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class NamedToolChoice(Schema):
    type: Literal["function"] = "function"
    function: dict[str, str]


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "max"]
"""OpenAI's reasoning_effort as K3 understands it: "none" turns thinking off, the others are its thinking efforts
("minimal", OpenAI's lowest, is K3's lowest: low)."""


class ChatTemplateFields(Schema):
    """What a chat renders from besides its messages (shared by chat completions and /tokenize)."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None


class ChatCompletionRequest(SamplingFields, ChatTemplateFields, BootstrapFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(Schema):
    model: str | None = None
    tokens: list[Int64]
