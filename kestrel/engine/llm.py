"""The offline API in vLLM's style: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from .args import EngineArgs
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling import SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    """A model with its engine. Prompts are strings, {"prompt": str} or {"prompt_token_ids": [...]}."""

    def __init__(self, model: str, **engine_args: Any):
        self.engine = LLMEngine(EngineArgs(model=str(model), **engine_args))
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params uses: vLLM's defaults, with the sampling fields the model's
        generation_config.json sets (as vLLM's LLM does)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (batched by the engine); one finished output per prompt, in order."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _params_per_prompt(sampling_params, len(prompts))
        ids = self._add_all(prompts, params)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generating", unit="prompt") as bar:
            while len(done) < len(ids):
                for output in self._step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        return [done[i] for i in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding its cumulative output after every step that changed it."""
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        (request_id,) = self._add_all([prompt], [params])
        try:
            while True:
                for output in self._step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def _step(self) -> list[RequestOutput]:
        """One engine step; a RuntimeError where nothing can run, since nothing else would ever change that."""
        outputs = self.engine.step()
        if self.engine.stalled and self.engine.has_unfinished_requests():
            raise RuntimeError("the engine cannot schedule any of its requests; this is a kestrel bug, "
                               "please report it with the engine arguments used.")
        return outputs

    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        """Queue every prompt, or none of them if any is invalid (grammars are compiled first, here)."""
        for p in params:
            if p.structured_outputs is not None and self.engine.grammars is not None:
                self.engine.grammars.compile(p.structured_outputs)      # a bad constraint raises here, at once
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], _prompt_input(prompt), p)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return ids


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}.")


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams], count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts; give one, or one per prompt.")
    return params
