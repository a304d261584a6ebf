"""`kestrel verify RECIPE`: run a recipe's smoke benchmark and accuracy check on this machine and write an
evidence record.

Only recipes kestrel can launch here run: today the Unified CPU recipes, served by kestrel's offline engine (`kestrel.LLM`)
in float32 with the recipe's engine arguments.
- Model: the bundled model's recipe (k3.1-tiny) serves the bundled, trained checkpoint (models/k3.1-tiny); the
  other tiny models have no trained checkpoint, so their recipes serve a random one of the preset's architecture.
- Benchmark: one request alone (time to first token, time per output token) and then `requests` requests at
  once (output and total tokens/s), greedy, fixed lengths.
- Accuracy, `heldout_perplexity` (the bundled model only): the perplexity of the model's held-out sample from the
  engine's prompt logprobs, in the model card's protocol (windows of `seq_len` tokens, each after [BOS]; see
  eval.json), must lie within PERPLEXITY_TOLERANCE of the card's float32 value. Random weights have nothing to
  measure, so their records carry speed only (the matrix shows them as "Runs", never "Verified").
- Provenance: the record names the git commit it ran from. A checkout with uncommitted changes is refused, unless
  allow_dirty, and then the record says `"dirty": true`.
"""

from __future__ import annotations

import itertools
import json
import math
import shlex
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import LLM, SamplingParams
from ..config import parse_config
from ..engine.args import BUNDLED_MODEL
from ..models.checkpoint import build_model, save_model
from ..models.init import init_weights
from ..models.presets import tiny_config
from .evidence import DEFAULT_EVIDENCE_DIR, Record, fingerprint, git_state, now, software_versions, write_record
from .hardware import CPU
from .recipes import Recipe, RecipeRequest, make_recipe

ACCURACY_CHECK = "heldout_perplexity"
ACCURACY_DESCRIPTION = ("perplexity of the bundled model's held-out sample from the engine's prompt logprobs, in the "
                        "model card's protocol (windows of seq_len tokens, each after [BOS]), against the card's "
                        "float32 measurement (eval.json)")
PERPLEXITY_TOLERANCE = 1e-3
"""Largest relative difference from the card's perplexity that passes."""
FIRST_TOKEN_ID = 3          # the presets' ids 0-2 are pad, bos, eos


class DirtyTreeError(ValueError):
    """The checkout has uncommitted changes (or is no git checkout), so no record could name what ran."""


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
    if recipe.request.hardware != CPU:
        raise ValueError(f"kestrel verify runs the CPU recipes, and {recipe_id} is a GPU recipe; benchmarks/gpu/run.py "
                         "records a GPU machine's evidence.")
    if recipe.request.mode != "unified":
        raise ValueError(f"kestrel verify runs one Unified instance, and {recipe_id} is one half of a PD deployment; "
                         "tests/disagg/ proves PD output equal to one server's.")
    hardware_id, _ = fingerprint()
    if hardware_id != recipe.request.hardware:
        raise ValueError(f"recipe {recipe_id} is for {recipe.request.hardware} but this machine is {hardware_id}.")
    return recipe


def checked_git_state(allow_dirty: bool) -> dict[str, Any]:
    """The checkout's git state for the record; DirtyTreeError when it has local changes or no commit, unless
    allow_dirty (the record then says so: "dirty" is true, or "commit" is None)."""
    git = git_state()
    if allow_dirty:
        return git
    if git.get("commit") is None:
        raise DirtyTreeError("kestrel verify records the git commit it runs from, but this kestrel is not a git "
                             "checkout; run it from a clone (or pass --allow-dirty to record that).")
    if git["dirty"]:
        raise DirtyTreeError("the checkout has uncommitted changes, so the record could not name the code that ran; "
                             "commit them first (or pass --allow-dirty to mark the record dirty).")
    return git


def write_checkpoint(preset: str, folder: Path, seed: int = 0) -> None:
    """What `kestrel random-model PRESET --out FOLDER --seed SEED` writes (float32)."""
    raw = tiny_config(preset)
    save_model(init_weights(build_model(parse_config(raw), torch.float32), seed=seed), folder, config_json=raw)


@contextmanager
def model_folder(model: str, seed: int) -> Iterator[tuple[Path, str]]:
    """(checkpoint folder, its description): the bundled model for its own name, else a random checkpoint of the
    preset, written to a temporary folder for the duration."""
    if model == BUNDLED_MODEL.name:
        yield BUNDLED_MODEL, f"the bundled {model} (models/{model}, trained)"
        return
    with tempfile.TemporaryDirectory(prefix="kestrel-verify-") as folder:
        write_checkpoint(model, Path(folder), seed)
        yield Path(folder), f"random {model} checkpoint (seed {seed})"


def engine_args(recipe: Recipe) -> dict:
    """The recipe's kestrel engine arguments."""
    return {"device": "cpu", "dtype": "float32", "mem_fraction_static": recipe.plan.request.mem_fraction,
            "mamba_full_memory_ratio": float(recipe.ratio_text), "mamba_ssm_dtype": "float32",
            "kv_cache_dtype": "auto"}


def _prompts(settings: SmokeSettings, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(settings.seed)
    return torch.randint(FIRST_TOKEN_ID, vocab_size, (settings.requests, settings.prompt_len),
                         generator=generator).tolist()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _single_request_latency(llm: LLM, prompt: list[int], max_tokens: int) -> dict:
    """Time to first token and mean time per further token of one request alone (seconds)."""
    start = time.perf_counter()
    stamps = [time.perf_counter() for _ in llm.stream({"prompt_token_ids": prompt}, _greedy(max_tokens))]
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft_s": stamps[0] - start, "tpot_s": sum(gaps) / len(gaps) if gaps else None}


def _throughput(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens))
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(map(len, prompts))
    return {"wall_s": wall, "requests_per_s": len(prompts) / wall, "output_tokens": generated,
            "output_tokens_per_s": generated / wall, "total_tokens_per_s": (generated + prompt_tokens) / wall}


def heldout_windows(llm: LLM, folder: Path) -> tuple[list[list[int]], dict]:
    """The model card's evaluation windows of its held-out sample ([BOS] then up to seq_len ids; the card's protocol
    skips a last window of fewer than 2 ids), and the card's eval.json."""
    card = json.loads((folder / "eval.json").read_text())
    tokenizer, seq_len = llm.engine.tokenizer, card["protocol"]["seq_len"]
    ids = tokenizer.encode((folder / card["sample"]["file"]).read_text(), add_special_tokens=False)
    windows = [[tokenizer.bos_token_id, *ids[i:i + seq_len]] for i in range(0, len(ids), seq_len)
               if len(ids[i:i + seq_len]) >= 2]
    return windows, card


def heldout_perplexity(llm: LLM, folder: Path) -> dict:
    """The accuracy check (see the module docstring): every window's prompt logprobs in one batch."""
    windows, card = heldout_windows(llm, folder)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params)
    logprobs = [output.prompt_logprobs[i][token].logprob
                for window, output in zip(windows, outputs) for i, token in enumerate(window) if i > 0]
    value = math.exp(-sum(logprobs) / len(logprobs))
    reference = card["sample"]["perplexity"]
    difference = value / reference - 1
    return {"check": ACCURACY_CHECK, "description": ACCURACY_DESCRIPTION, "text": card["sample"]["file"],
            "tokens": len(logprobs), "reference_tokens": card["sample"]["tokens"], "value": value,
            "reference": reference, "relative_difference": difference, "tolerance": PERPLEXITY_TOLERANCE,
            "passed": len(logprobs) == card["sample"]["tokens"] and abs(difference) <= PERPLEXITY_TOLERANCE}


def command_line(recipe_id: str, settings: SmokeSettings, allow_dirty: bool = False) -> str:
    """The `kestrel verify` invocation that reproduces a run with `settings`."""
    options = [f"--{name.replace('_', '-')}={value}" for name, value in asdict(settings).items()
               if value != getattr(SmokeSettings(), name)]
    return shlex.join(["kestrel", "verify", recipe_id, *options, *(["--allow-dirty"] if allow_dirty else [])])


def verify(recipe_id: str, settings: SmokeSettings = SmokeSettings(), evidence_dir: Path = DEFAULT_EVIDENCE_DIR,
           allow_dirty: bool = False) -> Record:
    """Run the recipe here and write its evidence record (see the module docstring)."""
    settings.check()
    recipe = runnable_recipe(recipe_id)
    git = checked_git_state(allow_dirty)
    hardware_id, hardware = fingerprint()
    args = engine_args(recipe)
    with model_folder(recipe.request.model, settings.seed) as (folder, description):
        llm = LLM(str(folder), **args)
        prompts = _prompts(settings, llm.engine.config.vocab_size)
        llm.generate({"prompt_token_ids": prompts[0][:4]}, _greedy(2))       # warm-up, not measured
        latency = _single_request_latency(llm, prompts[0], settings.max_tokens)
        throughput = _throughput(llm, prompts, settings.max_tokens)
        accuracy = heldout_perplexity(llm, folder) if folder == BUNDLED_MODEL else None
    benchmark = {"workload": {**asdict(settings), "sampling": "greedy, ignore_eos"}, **latency, **throughput,
                 "concurrency": settings.requests}
    record = Record(recipe=recipe.id, hardware_id=hardware_id, hardware=hardware, software=software_versions(),
                    git=git, command=command_line(recipe.id, settings, allow_dirty), created=now(),
                    engine_args={"model": description, **args}, benchmark=benchmark, accuracy=accuracy)
    write_record(record, evidence_dir)
    return record
