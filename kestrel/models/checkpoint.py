"""Checkpoints: the model's tensors under their Hugging Face names, loaded shard by shard and saved the same way.

Names follow the family's checkpoints (model-spec section 8): K3 and K3.1 prefix text weights with
`language_model.`; Kimi-Linear does not. Two layouts differ from kestrel's modules:
- routed experts are one tensor per expert (`experts.{e}.w1.weight`, or `.weight_packed` / `.weight_scale` for
  MXFP4), stacked here along a leading expert dim;
- `A_log` is stored as [1, 1, H, 1] (Kimi-Linear) or zero-padded to [max(H, head_dim)] (K3), held here as [H].
Vision weights of the multimodal checkpoints are skipped: kestrel serves the text model.

A tensor-parallel rank loads only its share: the sharding rules (kestrel.distributed.sharding) give the model its
per-rank shapes and name the slice of each checkpoint tensor to read (routed experts outside the rank's EP group
are not read at all); a pipeline stage reads only its own layers' tensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import ModelConfig, is_k3_schema, load_config, to_hf_dict
from ..distributed.parallel import SINGLE, Parallel
from ..distributed.sharding import local_slices, shard_model_
from ..layers.moe import RoutedExperts
from .kimi import KimiForCausalLM

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
K3_PREFIX = "language_model."
_STACKED_EXPERT = re.compile(r"^(?P<base>.*\.experts)\.(?P<w>w[123])(?P<kind>|_packed|_scale)$")
_EXPERT_SUFFIX = {"": "weight", "_packed": "weight_packed", "_scale": "weight_scale"}
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: missing, unexpected or misshapen tensors, or bad files."""


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor lives in the model."""

    param: str                 # the model's state_dict key
    expert: int | None         # index along the stacked expert dim, for routed experts
    shape: tuple[int, ...]     # shape in the checkpoint
    dtype: torch.dtype         # dtype in the checkpoint (as saved by kestrel)


def checkpoint_layout(model: KimiForCausalLM) -> dict[str, Target]:
    """Every tensor a checkpoint of `model` holds, by checkpoint name (works on a meta-device model)."""
    config = model.config
    prefix = K3_PREFIX if is_k3_schema(config) else ""
    layout: dict[str, Target] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stacked = _STACKED_EXPERT.match(name)
        if stacked:
            suffix = _EXPERT_SUFFIX[stacked["kind"]]
            for e in range(tensor.shape[0]):
                layout[f"{prefix}{stacked['base']}.{e}.{stacked['w']}.{suffix}"] = Target(
                    name, e, tuple(tensor.shape[1:]), tensor.dtype)
        elif name.endswith(".A_log"):
            layout[prefix + name] = Target(name, None, _a_log_shape(config), torch.float32)
        else:
            layout[prefix + name] = Target(name, None, tuple(tensor.shape), tensor.dtype)
    return layout


def _a_log_shape(config: ModelConfig) -> tuple[int, ...]:
    heads = config.kda_num_heads
    return (max(heads, config.kda_head_dim),) if is_k3_schema(config) else (1, 1, heads, 1)


def load_model(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
               par: Parallel = SINGLE, embed_last_stage: bool = False, **config_overrides) -> KimiForCausalLM:
    """Load the model folder `path` (config.json plus safetensors, sharded or not) in eval mode; with `par`, this
    tensor-parallel rank's share of it (embed_last_stage: the last pipeline stage holds the embedding too, for model
    drafters).

    Tensors are read one at a time straight into the model's preallocated parameters, so the weights are never
    held twice. dtype defaults to the config's `dtype` / `torch_dtype` (bfloat16 if absent); tensors stored in
    fp32 by the family (A_log, dt_bias, conv weights, o_norm, the router bias) stay fp32.
    """
    folder = Path(path)
    files = checkpoint_files(folder)
    headers = dict(_read_headers(files))
    config = load_config(folder, **config_overrides)
    if not config.index_k_norm_bias and any(n.endswith("indexer.k_norm.bias") for n in headers):
        config = dataclasses.replace(config, index_k_norm_bias=True)   # the checkpoint decides (config.py)
    par.layout.check_model(config)
    dtype = dtype or _config_dtype(folder)
    model = build_model(config, dtype, device="meta", par=par, embed_last_stage=embed_last_stage)
    whole = model if par.layout.pp_size == 1 else build_model(config, dtype, device="meta")
    targets = _match(headers, checkpoint_layout(whole), config.kda_num_heads)    # the whole checkpoint is checked
    if whole is not model:            # a pipeline stage reads its own layers' tensors only
        held = model.state_dict(keep_vars=True)
        targets = {name: target for name, target in targets.items() if target.param in held}
    full_shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    shard_model_(model, par.layout)
    model.to_empty(device=device)
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for file in files:
            with _open(file) as f:
                for name in f.keys():
                    if name in targets:
                        target = targets[name]
                        slices = local_slices(target.param, full_shapes[target.param], par.layout)
                        _load_slice(f, name, params[target.param], target, slices, config)
    if par.layout.redundant_experts:
        for module in model.modules():
            if isinstance(module, RoutedExperts):
                module.fill_redundant_slots()
    return model.eval()


def _load_slice(f, name: str, param: torch.Tensor, target: Target, slices: tuple[slice, ...],
                config: ModelConfig) -> None:
    """Copy this rank's slice of checkpoint tensor `name` into param (reading only that slice from the file)."""
    if target.expert is not None:                 # one expert of a stacked tensor: is it this rank's?
        first, end = slices[0].start, slices[0].stop              # the rules split every expert tensor by EP
        if not first <= target.expert < end:
            return
        target = dataclasses.replace(target, expert=target.expert - first)
        slices = slices[1:]
    if name.endswith(".A_log"):                   # stored padded or [1, 1, H, 1]: read whole, then slice the heads
        tensor = _a_log_heads(f.get_tensor(name), config.kda_num_heads, name)[slices]
    else:
        tensor = f.get_slice(name)[slices] if slices else f.get_tensor(name)
    destination = param[target.expert] if target.expert is not None else param
    destination.copy_(tensor)


def build_model(config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cpu", par: Parallel = SINGLE, embed_last_stage: bool = False
                ) -> KimiForCausalLM:
    """A model of `config` with uninitialised weights in dtype (the family's fp32 tensors stay fp32); with a `par`
    of several ranks, its modules are one rank's, still at full size (see kestrel.distributed.sharding;
    embed_last_stage: see kestrel.models.kimi)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return KimiForCausalLM(config, par, embed_last_stage)
    finally:
        torch.set_default_dtype(previous)


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, in index order; a clear error if any is missing."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a model folder.")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}).") from e
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shard(s) {', '.join(missing)} listed in {INDEX_FILE} are missing.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no .safetensors weights.")
    return files


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is corrupt or truncated ({e}).") from e


def _read_headers(files: list[Path]) -> Iterator[tuple[str, tuple[tuple[int, ...], str]]]:
    """(name, (shape, dtype string)) of every tensor in every file, read from the headers only."""
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                piece = f.get_slice(name)
                yield name, (tuple(piece.get_shape()), piece.get_dtype())


def _match(headers: dict[str, tuple[tuple[int, ...], str]], layout: dict[str, Target],
           kda_heads: int) -> dict[str, Target]:
    """Checkpoint name -> target for every tensor to load; one error listing every mismatch."""
    targets: dict[str, Target] = {}
    unexpected, misshapen, vision = [], [], 0
    for name, (shape, dtype) in headers.items():
        resolved = _resolve(name, layout)
        if resolved is None:
            if _strip(name).startswith(VISION_PREFIXES):
                vision += 1
            else:
                unexpected.append(name)
            continue
        target = layout[resolved]
        if not _shape_ok(name, shape, target, kda_heads) or (target.dtype == torch.uint8) != (dtype == "U8"):
            misshapen.append(f"{name} {list(shape)} {dtype} (expected {list(target.shape)} "
                             f"{str(target.dtype).removeprefix('torch.')})")
        targets[name] = target
    missing = sorted(set(layout) - {_resolve(n, layout) for n in targets})
    if vision:
        log.info("skipping %d vision tensors: kestrel serves the text model", vision)
    problems = [(f"{len(missing)} missing", missing), (f"{len(unexpected)} unexpected", unexpected),
                (f"{len(misshapen)} wrongly shaped", misshapen)]
    if any(items for _, items in problems):
        lines = [f"  {title}: {', '.join(items[:20])}{' ...' if len(items) > 20 else ''}"
                 for title, items in problems if items]
        raise CheckpointError("the checkpoint does not match its config.json:\n" + "\n".join(lines))
    return targets


def _strip(name: str) -> str:
    return name.removeprefix(K3_PREFIX)


def _resolve(name: str, layout: dict[str, Target]) -> str | None:
    """The layout name a checkpoint name stands for, accepting a missing or extra `language_model.` prefix and
    transformers' `block_sparse_moe.` spelling of the dense layer's `mlp.`."""
    for candidate in (name, _strip(name), K3_PREFIX + name):
        for alias in (candidate, candidate.replace(".block_sparse_moe.", ".mlp.")):
            if alias in layout:
                return alias
    return None


def _shape_ok(name: str, shape: tuple[int, ...], target: Target, heads: int) -> bool:
    """Exact shapes, except A_log in any of its layouts: [1, 1, H, 1], [H] or zero-padded [P > H]."""
    if name.endswith(".A_log"):
        return shape == (1, 1, heads, 1) or (len(shape) == 1 and shape[0] >= heads)
    return shape == target.shape


def _a_log_heads(tensor: torch.Tensor, heads: int, name: str) -> torch.Tensor:
    """A_log as [H], from [1, 1, H, 1], [H] or a zero-padded [P >= H]."""
    flat = tensor.reshape(-1)
    if flat.numel() < heads or flat[heads:].abs().sum() > 0:
        raise CheckpointError(f"{name}: expected {heads} per-head values (zero-padded at most), got shape "
                              f"{list(tensor.shape)} with non-zero padding or too few values.")
    return flat[:heads]


def _config_dtype(folder: Path) -> torch.dtype:
    raw = json.loads((folder / "config.json").read_text())
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    name = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"config.json: dtype {name!r} is not a floating-point torch dtype.")
    return dtype


def save_model(model: KimiForCausalLM, path: str | Path, max_shard_bytes: int = 5 * 2**30,
               config_json: dict | None = None) -> None:
    """Write config.json (config_json, or the model's config in its schema) and the weights under checkpoint
    names, split into shards of at most max_shard_bytes with an index when more than one is needed."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    raw = dict(config_json or to_hf_dict(config))
    raw.setdefault("dtype", str(model.lm_head.weight.dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    params = model.state_dict(keep_vars=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, target in checkpoint_layout(model).items():
        tensor = _checkpoint_tensor(params[target.param], target, config)
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for old in list(folder.glob("*.safetensors")) + [folder / INDEX_FILE]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _checkpoint_tensor(param: torch.Tensor, target: Target, config: ModelConfig) -> torch.Tensor:
    tensor = (param[target.expert] if target.expert is not None else param).detach()
    if target.param.endswith(".A_log"):
        padded = torch.zeros(target.shape[0] if len(target.shape) == 1 else config.kda_num_heads)
        padded[: config.kda_num_heads] = tensor.float()
        tensor = padded.view(target.shape)
    return tensor.to(target.dtype).contiguous()
