"""The OpenAI-compatible HTTP server: routes, errors, admission, streaming; the engine runs on its own thread.

Errors are OpenAI's JSON ({"error": {"message", "type", "param", "code"}}) with the right status: 400 for a bad
body (naming the field and the range it accepts), a prompt past the context or a request that can never run, 401
for a missing or wrong key, 404 for an unknown model, 408 past --request-timeout, 429 with Retry-After past
--max-queued-requests or --max-concurrent-requests-per-key, 503 while shutting down, 500 for a request the engine
failed (the others carry on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from ..cookbook.web import site_files
from ..disagg.wire import TransferError
from ..engine.async_engine import AsyncEngine, RequestFailed, RequestTimedOut
from ..engine.outputs import RequestOutput
from ..engine.sampling import SamplingParams
from ..engine.structured import StructuredOutputsParams
from .access import KeyGate
from .chat import ChatPrompt, ChatTemplateError, ReplyDelta, ReplyParser, prompt_ids, render_chat
from .constraints import RequestedConstraint, requested_constraint
from .tool_grammar import forced_call
from .validation import validation_error
from .errors import ApiError, error_response
from .metrics import Metrics, RequestTimer
from .options import ServerOptions
from .pd import PDRole
from .protocol import (ChatCompletionRequest, ChatTemplateFields, CompletionRequest, DetokenizeRequest, Message,
                       NamedToolChoice, SamplingFields, TokenizeRequest)
from .responses import (chat_delta, chat_finish_reason, chat_logprobs, chat_message, completion_logprobs,
                        completion_tokens, new_id, now, usage)
from .sglang_api import GenerateRequest, add_sglang_routes, generate_item

@dataclass
class ServerState:
    engine: AsyncEngine
    options: ServerOptions
    metrics: Metrics
    draining: bool = False
    cookbook_files: dict[str, tuple[bytes, str]] | None = None
    pd: PDRole | None = None                  # --disaggregation-mode prefill or decode

    @property
    def model_name(self) -> str:
        return self.options.model_name


def create_app(engine: AsyncEngine, options: ServerOptions) -> FastAPI:
    pd = PDRole(engine, options) if options.disaggregation_mode != "null" else None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if pd is not None:
            await pd.start()
        yield
        if pd is not None:
            await pd.stop()

    app = FastAPI(title="kestrel", description="OpenAI-compatible server for the Kimi K3 family", lifespan=lifespan)
    state = ServerState(engine, options, Metrics(engine), pd=pd)
    model_name = options.model_name
    app.state.kestrel = state
    _install_error_handlers(app)
    app.add_middleware(KeyGate, keys=options.api_keys, per_key_limit=options.max_concurrent_requests_per_key)
    add_sglang_routes(app, engine, options)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "draining" if state.draining else "ok"}

    @app.get("/health_generate")
    async def health_generate() -> dict:
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        async for _ in engine.generate(new_id("health"), [engine.engine.config.bos_token_id or 0], params):
            pass
        return {"status": "ok"}

    @app.get("/cookbook")
    async def cookbook_root() -> Response:
        return RedirectResponse("/cookbook/")

    @app.get("/cookbook/{name:path}")
    async def cookbook(name: str) -> Response:
        """The deployment cookbook's page (built once, on first use, in a worker thread: it takes seconds)."""
        if state.cookbook_files is None:
            state.cookbook_files = await asyncio.to_thread(site_files)
        body = state.cookbook_files.get(name or "index.html")
        if body is None:
            raise ApiError(404, f"the cookbook has no file {name!r}.", kind="not_found_error")
        return Response(body[0], media_type=body[1])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        _check_model(state, model_id)
        return _model_card(state)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(state, body.model)
        tokenizer = _tokenizer(state)
        if body.messages is not None:
            prompt = _chat_prompt(state, body, body.messages, body.add_generation_prompt)
            ids = prompt_ids(tokenizer, prompt, body.add_special_tokens)
        elif body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise ApiError(400, "give either prompt or messages.", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.engine.context_length}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(state, body.model)
        vocab = engine.engine.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"tokens must lie in [0, {vocab}).", "tokens")
        return {"prompt": _tokenizer(state).decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        _admit(state)
        return await _completions(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        _admit(state)
        return await _chat(state, body, request)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateRequest, request: Request):
        _admit(state)
        return await _generate(state, body, request)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        body_field = getattr(request.scope.get("route"), "body_field", None)
        return error_response(validation_error(error.errors(), body_field and body_field.field_info.annotation))


def _model_card(state: ServerState) -> dict:
    """The served model as OpenAI's model object (with vLLM's max_model_len)."""
    return {"id": state.model_name, "object": "model", "created": now(), "owned_by": "kestrel",
            "max_model_len": state.engine.engine.context_length}


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}.",
                       "model", "not_found_error")


def _admit(state: ServerState) -> None:
    if state.draining:
        raise ApiError(503, "the server is shutting down; retry against another replica.", kind="unavailable")
    limit = state.options.max_queued_requests
    if limit is not None:
        queued = state.engine.num_requests - state.engine.stats().running_requests
        if queued >= limit:
            raise ApiError(429, f"too many queued requests ({queued}); retry shortly.", kind="rate_limit_error",
                           headers={"Retry-After": "1"})


def _tokenizer(state: ServerState):
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer.json or tiktoken.model; send token ids to "
                           "/v1/completions.")
    return tokenizer


def _render_chat(tokenizer, messages: list[Message], **options) -> ChatPrompt:
    try:
        return render_chat(tokenizer, messages, **options)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), e.param) from e


def _sampling_params(body: SamplingFields, state: ServerState, *args, **kwargs) -> SamplingParams:
    """body.sampling_params with the model's defaults; a combination SamplingParams refuses is a 400."""
    try:
        return body.sampling_params(state.engine.sampling_defaults, *args, **kwargs)
    except ValueError as e:
        raise ApiError(400, str(e)) from e


async def _compiled(state: ServerState, requested: RequestedConstraint | None) -> StructuredOutputsParams | None:
    """The request's output constraint, compiled on the grammar compiler's threads before the request goes on (so
    a bad one is a 400 at once and the engine finds it in the grammar cache), or None."""
    if requested is None:
        return None
    grammars = state.engine.grammars
    if grammars is None:
        raise ApiError(400, f"{requested.field} needs the model's tokenizer with an end-of-sequence token, which "
                            "this model lacks.", requested.field)
    try:
        await asyncio.wrap_future(grammars.submit(requested.params))
    except ValueError as e:
        raise ApiError(400, f"{requested.field}: {e}", requested.field) from e
    return requested.params


def _max_tokens(requested: int | None) -> int | None:
    return None if requested is None else max(requested, 1)


async def _outputs(state: ServerState, request_id: str, prompt, params: SamplingParams, priority: int,
                   bootstrap: tuple = (None, None, None), cache_point: int | None = None
                   ) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request (this instance's side of it under PD disaggregation, at the bootstrap
    (host, port, room) the router added), with bad requests and failures turned into ApiErrors. cache_point: where
    the prefix cache saves the prompt's state (LLMEngine.add_request)."""
    try:
        if state.pd is None:
            outputs = state.engine.generate(request_id, prompt, params, priority, state.options.request_timeout,
                                            cache_point=cache_point)
        else:
            outputs = state.pd.generate(request_id, prompt, params, priority, bootstrap)
        async for output in outputs:
            yield output
    except TransferError as e:
        raise ApiError(502, str(e), kind="server_error") from e
    except ValueError as e:
        raise ApiError(400, str(e), "prompt") from e
    except RequestTimedOut as e:
        raise ApiError(408, str(e), kind="timeout_error") from e
    except RequestFailed as e:
        raise ApiError(500, str(e), kind="server_error") from e


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come: (stream index, output)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _event_stream(chunks: AsyncIterator[str], timer: RequestTimer) -> StreamingResponse:
    """A streamed response: the SSE chunks, then [DONE]. An ApiError mid-stream becomes an error event; errors and
    aborts are recorded on the timer here, success by `chunks` itself (it knows the token counts)."""
    async def events() -> AsyncIterator[str]:
        async with contextlib.aclosing(chunks):
            try:
                async for chunk in chunks:
                    yield chunk
            except ApiError as e:
                timer.done("error", 0)
                yield _stream_error(e)
            except asyncio.CancelledError:
                timer.done("abort", 0)
                raise
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


def _stream_error(error: ApiError) -> str:
    return _sse(error.body())


async def _completions(state: ServerState, body: CompletionRequest, request: Request):
    prompts = body.prompts()
    if not prompts:
        raise ApiError(400, "prompt must not be empty.", "prompt")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens 0 only makes sense with echo.", "max_tokens")
    _refuse_unsupported(body)
    want_prompt_logprobs = body.echo and body.logprobs is not None
    constraint = await _compiled(state, requested_constraint(body, body.response_format))
    params = _sampling_params(body, state, _max_tokens(body.max_tokens), body.logprobs,
                              body.logprobs if want_prompt_logprobs else None, structured_outputs=constraint)
    request_id = new_id("cmpl")
    streams = [_outputs(state, f"{request_id}-{i}", p, params, body.priority, body.bootstrap(i))
               for i, p in enumerate(prompts)]
    tokenizer, n = state.engine.tokenizer, body.n
    generated = body.max_tokens != 0
    timer = RequestTimer(state.metrics)

    def choice(prompt_index: int, output: RequestOutput, j: int, text_from: int, tokens_from: int,
               echo_prompt: bool) -> dict:
        c = output.outputs[j]
        text, ids, entries = (c.text[text_from:], c.token_ids[tokens_from:],
                              (c.logprobs or [])[tokens_from:]) if generated else ("", [], [])
        prompt_text = ""
        if body.echo:           # offsets count the echoed prompt, which the first chunk carries
            prompt_text = output.prompt if output.prompt is not None else _decode(tokenizer, output.prompt_token_ids)
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, ids, entries, len(prompt_text) + text_from)
            if echo_prompt:
                head = completion_logprobs(tokenizer, output.prompt_token_ids, output.prompt_logprobs or [], 0)
                logprobs = {k: head[k] + logprobs[k] for k in head}
        return {"index": prompt_index * n + j, "text": prompt_text + text if echo_prompt else text,
                "logprobs": logprobs, "finish_reason": _finish(c.finish_reason, generated)}

    if body.stream:
        async def chunks() -> AsyncIterator[str]:
            sent, closed = {}, set()       # closed: choices whose finish_reason went out (sent once)
            finals: dict[int, RequestOutput] = {}
            async for i, output in _merged(streams):
                chunk_choices = []
                for j, c in enumerate(output.outputs):
                    text_from, tokens_from = sent.get((i, j), (0, 0))
                    first = (i, j) not in sent
                    if (i, j) in closed or (len(c.token_ids) == tokens_from and not c.finish_reason
                                            and not (body.echo and first)):
                        continue
                    if c.finish_reason:
                        closed.add((i, j))
                    chunk_choices.append(choice(i, output, j, text_from, tokens_from, body.echo and first))
                    sent[(i, j)] = (len(c.text), len(c.token_ids))
                finals[i] = output
                timer.tokens_seen(sum(completion_tokens(o) for o in finals.values()))
                if chunk_choices:
                    yield _sse({"id": request_id, "object": "text_completion", "created": now(),
                                "model": state.model_name, "choices": chunk_choices})
            if body.stream_options and body.stream_options.include_usage:
                yield _sse({"id": request_id, "object": "text_completion", "created": now(),
                            "model": state.model_name, "choices": [],
                            "usage": _usage(finals.values(), generated)})
            timer.done("success", sum(len(o.prompt_token_ids) for o in finals.values()))
        return _event_stream(chunks(), timer)

    finals = await _collect(state, streams, request, timer)
    choices = [choice(i, finals[i], j, 0, 0, body.echo) for i in range(len(prompts))
               for j in range(len(finals[i].outputs))]
    return {"id": request_id, "object": "text_completion", "created": now(), "model": state.model_name,
            "choices": choices, "usage": _usage(finals.values(), generated)}


def _refuse_unsupported(body: CompletionRequest) -> None:
    """A 400 for completion fields kestrel does not implement, rather than ignoring them."""
    if body.suffix:
        raise ApiError(400, "suffix (text inserted after the completion) is not supported; leave it out.", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, f"best_of {body.best_of} is not supported (kestrel returns every sequence it samples); "
                            f"leave it out or set it to n ({body.n}).", "best_of")


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids) if tokenizer is not None else ""


def _finish(reason: str | None, generated: bool) -> str | None:
    return reason if generated or reason is None else "length"


def _usage(outputs, generated: bool) -> dict:
    outputs = list(outputs)
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(completion_tokens(o) for o in outputs) if generated else 0,
                 sum(o.num_cached_tokens for o in outputs))


async def _collect(state: ServerState, streams: list[AsyncIterator[RequestOutput]], request: Request,
                   timer: RequestTimer) -> dict[int, RequestOutput]:
    """Run requests to the end (aborting them if the client goes away); the final output of each."""
    finals: dict[int, RequestOutput] = {}
    merged = _merged(streams)
    try:
        async for i, output in merged:
            finals[i] = output
            timer.tokens_seen(sum(completion_tokens(o) for o in finals.values()))
            if await request.is_disconnected():
                timer.done("abort", 0)
                raise ApiError(499, "the client disconnected.")
    except ApiError as e:
        if e.status != 499:
            timer.done("error", 0)
        raise
    finally:
        await merged.aclose()
    timer.done("success", sum(len(o.prompt_token_ids) for o in finals.values()))
    return finals


def _chat_prompt(state: ServerState, body: ChatTemplateFields, messages: list[Message],
                 add_generation_prompt: bool = True, constrained: bool | None = None) -> ChatPrompt:
    """The rendered chat, with the start of the reply that tool_choice (required or named) and an output constraint
    force (a constrained reply starts in the content channel; constrained None: as response_format says); the same
    for a chat request and for /tokenize. The renderer gets the caller's tool_choice only: K3's writes a note for
    the one given, as Moonshot's does, and none for a chat that gives none."""
    choice = body.tool_choice
    if choice not in (None, "none") and not body.tools:
        raise ApiError(400, "tool_choice needs tools.", "tool_choice")
    name = None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name", "")
        if name not in {t.function.name for t in body.tools}:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools.", "tool_choice")
    return _render_chat(_tokenizer(state), messages, tools=body.tools, tool_choice=None if name else choice,
                        tool_name=name, json_mode=_json_format(body) if constrained is None else constrained,
                        reasoning_effort=body.reasoning_effort,
                        response_format=body.response_format, add_generation_prompt=add_generation_prompt)


def _shared(ids: list[int], history: list[int]) -> int:
    """How many leading ids a chat prompt shares with its messages plus a reply rendered as history: where the
    next turn's prompt, which renders this reply as history (K3's without its reasoning), stops sharing it."""
    return next((i for i, (a, b) in enumerate(zip(ids, history)) if a != b), min(len(ids), len(history)))


def _json_format(body: ChatTemplateFields) -> bool:
    """response_format asks for JSON (json_object or json_schema)."""
    return body.response_format is not None and body.response_format.type != "text"


def _forced_call(state: ServerState, body: ChatCompletionRequest) -> RequestedConstraint | None:
    """For tool_choice required or a named function: the constraint that makes the reply a well-formed call of a
    listed tool (tool_grammar.py), in the dialect the prompt continues; else None."""
    choice = body.tool_choice
    name = choice.function.get("name") if isinstance(choice, NamedToolChoice) else None
    if choice != "required" and name is None:
        return None
    bundled = bool(_tokenizer(state).chat_template)        # a folder template: the bundled dialect (chat.py)
    return RequestedConstraint(forced_call(body.tools, name, bundled), "tools")


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request):
    if body.max_tokens == 0:
        raise ApiError(400, "max_tokens must be at least 1 for a chat completion.", "max_tokens")
    requested = requested_constraint(body, body.response_format)
    if requested is not None and body.tools and body.tool_choice not in (None, "none"):
        raise ApiError(400, f"{requested.field} cannot be combined with tool calls; set tool_choice to none.",
                       requested.field)
    prompt = _chat_prompt(state, body, body.messages, constrained=requested is not None)
    constraint = await _compiled(state, requested or _forced_call(state, body))
    top = body.top_logprobs or 0
    params = _sampling_params(body, state, _max_tokens(body.max_completion_tokens or body.max_tokens),
                              top if body.logprobs else None, skip_special_tokens=False,
                              structured_outputs=constraint)
    request_id = new_id("chatcmpl")
    ids = prompt_ids(state.engine.tokenizer, prompt)
    as_history = _chat_prompt(state, body, [*body.messages, Message(role="assistant", content="x")],
                              add_generation_prompt=False, constrained=requested is not None)
    stream = _outputs(state, request_id, ids, params, body.priority, body.bootstrap(0),
                      _shared(ids, prompt_ids(state.engine.tokenizer, as_history)))
    parsers = [ReplyParser(prompt.reply_start) for _ in range(body.n)]
    tokenizer = state.engine.tokenizer
    timer = RequestTimer(state.metrics)

    if body.stream:
        async def chunks() -> AsyncIterator[str]:
            sent: dict[int, tuple[int, int]] = {}
            closed: set[int] = set()       # choices whose finish_reason went out (sent once)
            final: RequestOutput | None = None
            async for _, output in _merged([stream]):
                final = output
                timer.tokens_seen(completion_tokens(output))
                for j, c in enumerate(output.outputs):
                    if j in closed:
                        continue
                    text_from, tokens_from = sent.get(j, (0, 0))
                    delta = parsers[j].feed(c.text[text_from:])
                    if c.finish_reason is not None:
                        tail = parsers[j].finish()
                        delta = ReplyDelta(delta.reasoning + tail.reasoning, delta.content + tail.content,
                                           delta.tool_calls + tail.tool_calls)
                        closed.add(j)
                    first = j not in sent
                    if not (delta or first or c.finish_reason):
                        sent[j] = (len(c.text), tokens_from)      # their logprobs go with the next chunk
                        continue
                    sent[j] = (len(c.text), len(c.token_ids))
                    logprobs = (chat_logprobs(tokenizer, c.token_ids[tokens_from:],
                                              (c.logprobs or [])[tokens_from:], top) if body.logprobs else None)
                    yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": now(),
                                "model": state.model_name, "choices": [{
                                    "index": j, "delta": chat_delta(delta, first), "logprobs": logprobs,
                                    "finish_reason": chat_finish_reason(c, parsers[j].calls)}]})
            if body.stream_options and body.stream_options.include_usage and final is not None:
                yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": now(),
                            "model": state.model_name, "choices": [], "usage": _usage([final], True)})
            timer.done("success", len(final.prompt_token_ids) if final else 0)
        return _event_stream(chunks(), timer)

    final = (await _collect(state, [stream], request, timer))[0]
    choices = []
    for j, c in enumerate(final.outputs):
        parser = parsers[j]
        delta = parser.feed(c.text)
        tail = parser.finish()
        choices.append({
            "index": j,
            "message": chat_message(delta.reasoning + tail.reasoning, delta.content + tail.content, parser.calls),
            "logprobs": chat_logprobs(tokenizer, c.token_ids, c.logprobs or [], top) if body.logprobs else None,
            "finish_reason": chat_finish_reason(c, parser.calls)})
    return {"id": request_id, "object": "chat.completion", "created": now(), "model": state.model_name,
            "choices": choices, "usage": _usage([final], True)}


async def _generate(state: ServerState, body: GenerateRequest, request: Request):
    """SGLang's native /generate: one answer (a list for a batch or n > 1, prompt by prompt), or SSE chunks with the
    cumulative text of a sequence (with its index in that list for a batch or n > 1)."""
    try:
        prompts = body.prompts()
        samplings = [s.fields() for s in body.samplings(len(prompts))]
    except ValueError as e:
        raise ApiError(400, str(e)) from e
    params = [_sampling_params(f, state, f.max_tokens, None,
                               structured_outputs=await _compiled(state, requested_constraint(f, None)))
              for f in samplings]
    request_id, started = new_id("gen"), time.perf_counter()
    streams = [_outputs(state, f"{request_id}-{i}", p, params[i], body.priority or 0, body.bootstrap(i))
               for i, p in enumerate(prompts)]
    first_index = [sum(p.n for p in params[:i]) for i in range(len(params))]
    single = first_index == [0] and params[0].n == 1
    timer = RequestTimer(state.metrics)

    def item(i: int, output: RequestOutput, j: int) -> dict:
        index = first_index[i] + j
        return generate_item(output, j, request_id if single else f"{request_id}-{index}",
                             time.perf_counter() - started)

    if body.stream:
        async def chunks() -> AsyncIterator[str]:
            sent: dict[tuple[int, int], tuple[int, str | None]] = {}
            finals: dict[int, RequestOutput] = {}
            async for i, output in _merged(streams):
                finals[i] = output
                timer.tokens_seen(sum(completion_tokens(o) for o in finals.values()))
                for j, c in enumerate(output.outputs):
                    if sent.get((i, j)) != (len(c.token_ids), c.finish_reason):
                        sent[(i, j)] = (len(c.token_ids), c.finish_reason)
                        index = {} if single else {"index": first_index[i] + j}
                        yield _sse(item(i, output, j) | index)
            timer.done("success", sum(len(o.prompt_token_ids) for o in finals.values()))
        return _event_stream(chunks(), timer)

    finals = await _collect(state, streams, request, timer)
    items = [item(i, finals[i], j) for i in range(len(prompts)) for j in range(len(finals[i].outputs))]
    return items[0] if single else items
