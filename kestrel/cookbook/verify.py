"""`kestrel verify RECIPE`: run a recipe's smoke benchmark and accuracy-style check on this machine and write an
evidence record.

Only recipes kestrel can launch here run: today the CPU recipes, which serve a tiny random checkpoint of the
model's architecture with kestrel's offline engine (`kestrel.LLM`), with the recipe's engine arguments.
- Benchmark: one request alone (time to first token, time per output token) and then `requests` requests at
  once (output and total tokens/s), greedy, fixed lengths.
- Accuracy-style check, named `greedy_parity_vs_full_forward`: every token the engine generated under batching,
  paged caches and incremental decoding must equal the argmax of one plain full forward pass over the prompt and the
  engine's own earlier tokens (no cache), and its logprob must equal that pass's log-softmax. With random
  weights this checks the serving path's arithmetic, not the quality of a model; it is not a task accuracy.
"""

from __future__ import annotations

import itertools
import shlex
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import LLM, SamplingParams
from ..config import parse_config
from ..layers.batch import ForwardBatch
from ..models.checkpoint import build_model, save_model
from ..models.init import init_weights
from ..models.presets import tiny_config
from .evidence import DEFAULT_EVIDENCE_DIR, Record, fingerprint, git_state, now, software_versions, write_record
from .recipes import Recipe, RecipeRequest, make_recipe

ACCURACY_CHECK = "greedy_parity_vs_full_forward"
ACCURACY_DESCRIPTION = ("fraction of generated tokens where kestrel's engine (batched requests, paged caches, "
                        "incremental decode) equals the argmax of a plain full forward pass over the prompt and the "
                        "engine's earlier tokens, with logprobs equal to that pass's log-softmax; random weights, so "
                        "it checks the serving path's arithmetic and is not a task accuracy")
LOGPROB_TOLERANCE = 1e-4
FIRST_TOKEN_ID = 3          # the presets' ids 0-2 are pad, bos, eos


@dataclass(frozen=True)
class SmokeSettings:
    """The smoke workload: `requests` prompts of `prompt_len` random ids, `max_tokens` greedy tokens each."""

    requests: int = 8
    prompt_len: int = 48
    max_tokens: int = 32
    seed: int = 0

    def check(self) -> None:
        for name in ("requests", "prompt_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}.")


def runnable_recipe(recipe_id: str) -> Recipe:
    """The recipe, if kestrel can launch it on this machine; a ValueError says why not otherwise."""
    recipe = make_recipe(RecipeRequest.from_id(recipe_id))
    if "kestrel" not in recipe.commands:
        raise ValueError(f"recipe {recipe_id} has no kestrel command to run: {recipe.refusals['kestrel']}.")
    hardware_id, _ = fingerprint()
    if hardware_id != recipe.request.hardware:
        raise ValueError(f"recipe {recipe_id} is for {recipe.request.hardware} but this machine is {hardware_id}.")
    return recipe


def write_checkpoint(preset: str, folder: Path, seed: int = 0) -> None:
    """What `kestrel random-model PRESET --out FOLDER --seed SEED` writes (float32)."""
    raw = tiny_config(preset)
    save_model(init_weights(build_model(parse_config(raw), torch.float32), seed=seed), folder, config_json=raw)


def engine_args(recipe: Recipe) -> dict:
    """The recipe's kestrel engine arguments."""
    return {"device": "cpu", "mem_fraction_static": recipe.plan.request.mem_fraction,
            "mamba_full_memory_ratio": float(recipe.ratio_text), "mamba_ssm_dtype": "float32",
            "kv_cache_dtype": "auto"}


def _prompts(settings: SmokeSettings, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(settings.seed)
    return torch.randint(FIRST_TOKEN_ID, vocab_size, (settings.requests, settings.prompt_len),
                         generator=generator).tolist()


def _greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def _single_request_latency(llm: LLM, prompt: list[int], max_tokens: int) -> dict:
    """Time to first token and mean time per further token of one request alone (seconds)."""
    start = time.perf_counter()
    stamps = [time.perf_counter() for _ in llm.stream({"prompt_token_ids": prompt}, _greedy(max_tokens))]
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft_s": stamps[0] - start, "tpot_s": sum(gaps) / len(gaps) if gaps else None}


def _throughput(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list]:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens, logprobs=0))
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(map(len, prompts))
    return {"wall_s": wall, "requests_per_s": len(prompts) / wall, "output_tokens": generated,
            "output_tokens_per_s": generated / wall, "total_tokens_per_s": (generated + prompt_tokens) / wall}, outputs


@torch.inference_mode()
def greedy_parity(llm: LLM, prompts: list[list[int]], outputs: list) -> dict:
    """Compare every generated token and its logprob with one full forward pass (see the module docstring)."""
    model = llm.engine.model
    positions = agreeing = 0
    worst = 0.0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        sequence = torch.tensor(prompt + completion.token_ids)
        logits = model.compute_logits(model(sequence, ForwardBatch.build([len(sequence)])))
        reference = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:-1]
        for step, token in enumerate(completion.token_ids):
            positions += 1
            agreeing += int(reference[step].argmax()) == token
            worst = max(worst, abs(completion.logprobs[step][token].logprob - float(reference[step, token])))
    return {"check": ACCURACY_CHECK, "description": ACCURACY_DESCRIPTION, "positions": positions,
            "agreeing_positions": agreeing, "value": agreeing / positions, "max_logprob_abs_error": worst,
            "logprob_tolerance": LOGPROB_TOLERANCE,
            "passed": agreeing == positions and worst <= LOGPROB_TOLERANCE}


def command_line(recipe_id: str, settings: SmokeSettings) -> str:
    """The `kestrel verify` invocation that reproduces a run with `settings`."""
    options = [f"--{name.replace('_', '-')}={value}" for name, value in asdict(settings).items()
               if value != getattr(SmokeSettings(), name)]
    return shlex.join(["kestrel", "verify", recipe_id, *options])


def verify(recipe_id: str, settings: SmokeSettings = SmokeSettings(),
           evidence_dir: Path = DEFAULT_EVIDENCE_DIR) -> Record:
    """Run the recipe here and write its evidence record (see the module docstring)."""
    settings.check()
    recipe = runnable_recipe(recipe_id)
    hardware_id, hardware = fingerprint()
    args = engine_args(recipe)
    with tempfile.TemporaryDirectory(prefix="kestrel-verify-") as folder:
        write_checkpoint(recipe.request.model, Path(folder), settings.seed)
        llm = LLM(folder, **args)
        prompts = _prompts(settings, llm.engine.config.vocab_size)
        llm.generate({"prompt_token_ids": prompts[0][:4]}, _greedy(2))       # warm-up, not measured
        latency = _single_request_latency(llm, prompts[0], settings.max_tokens)
        throughput, outputs = _throughput(llm, prompts, settings.max_tokens)
        accuracy = greedy_parity(llm, prompts, outputs)
    benchmark = {"workload": {**asdict(settings), "sampling": "greedy, ignore_eos"}, **latency, **throughput,
                 "concurrency": settings.requests}
    record = Record(recipe=recipe.id, hardware_id=hardware_id, hardware=hardware, software=software_versions(),
                    git=git_state(), command=command_line(recipe.id, settings), created=now(),
                    engine_args={"model": f"random {recipe.request.model} checkpoint (seed {settings.seed})", **args},
                    benchmark=benchmark, accuracy=accuracy)
    write_record(record, evidence_dir)
    return record
