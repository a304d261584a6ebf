"""Every kernel launch of the Triton wrappers compiles for the H200 (sm_90), without a GPU.

The interpreter runs the kernels' arithmetic but not the GPU compiler, which rejects programs the interpreter
accepts (operand types of tl.dot, block sizes, layouts) and decides shared memory. Here each wrapper is called on
model-sized CPU inputs with its kernels replaced by recorders; the recorded launches (argument types, block sizes,
num_warps, num_stages) are compiled by Triton's compiler and ptxas for sm_90 in a separate process
(sm90_compiler.py, free of the interpreter), and each must fit the H200's 227 KiB of shared memory per block.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.jit import mangle_type

from kestrel.ops.torch.kda_decode import KDALayerParams
from kestrel.ops.torch.moe import ExpertWeights, GLUActivation
from kestrel.ops.triton import attn_res, indexer, kda_decode, kda_prefill, mla_decode, moe

SHARED_MEMORY_LIMIT = 227 * 1024
BF16 = torch.bfloat16
LAUNCH_OPTIONS = ("num_warps", "num_stages")
COMPILER = Path(__file__).with_name("sm90_compiler.py")


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, module, name: str):
        self.module, self.name = module.__name__, name
        self.parameters = inspect.signature(getattr(module, name).fn).parameters
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        return self.record

    def record(self, *args, **kwargs) -> None:
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        bound = dict(zip(self.parameters, args)) | kwargs
        constexprs = {n: bound[n] for n, p in self.parameters.items() if "constexpr" in str(p.annotation)}
        signature = {n: "constexpr" if n in constexprs else mangle_type(v) for n, v in bound.items()}
        self.launches.append(dict(module=self.module, kernel=self.name, signature=signature, constexprs=constexprs,
                                  options=options))


def record_launches(module, names: list[str], call) -> list[dict]:
    """Run call() with module's kernels `names` replaced by recorders; returns the recorded launches."""
    recorders = [Recorder(module, name) for name in names]
    with pytest.MonkeyPatch.context() as patch:
        for recorder in recorders:
            patch.setattr(module, recorder.name, recorder)
        call()
    return [launch for recorder in recorders for launch in recorder.launches]


def kda_decode_call(keep: bool):
    tokens, heads, dim = 4, 32, 128
    channels = 3 * heads * dim
    params = KDALayerParams(torch.zeros(channels, 4), torch.zeros(heads), torch.zeros(heads * dim), torch.ones(dim),
                            -5.0, 1e-5)
    return lambda: kda_decode.kda_decode(
        torch.zeros(tokens, channels, dtype=BF16), torch.zeros(tokens, heads, dim, dtype=BF16),
        torch.zeros(tokens, heads, dtype=BF16), torch.zeros(tokens, heads, dim, dtype=BF16), params,
        torch.zeros(2, 3, channels, dtype=BF16), torch.zeros(2, heads, dim, dim), torch.tensor([1, 0]),
        torch.tensor([0, 2, 4]), torch.tensor([True, False]), keep_token_states=keep)


def kda_prefill_call():
    tokens, heads, dim = 80, 32, 128
    q = F.normalize(torch.randn(tokens, heads, dim), dim=-1)
    v, g = torch.zeros(tokens, heads, dim, dtype=BF16), -torch.rand(tokens, heads, dim)
    return lambda: kda_prefill.kda_prefill(q, q, v, g, torch.rand(tokens, heads), torch.tensor([0, 50, 80]),
                                           torch.zeros(2, heads, dim, dim), torch.tensor([1, 0]),
                                           torch.tensor([True, True]), chunk_size=32, output_chunk_states=True)


def mla_call(fp8: bool, sparse: bool):
    heads, rows = 32, 256
    values = torch.zeros(rows, 576, dtype=torch.float8_e4m3fn if fp8 else BF16)
    return lambda: mla_decode.paged_mla_decode(
        torch.zeros(2, heads, 576, dtype=BF16), values, torch.ones(rows) if fp8 else None,
        torch.arange(4).view(2, 2), 64, torch.tensor([0, 1]), torch.tensor([100, 30]), 0.07, 512,
        torch.zeros(2, 2048, dtype=torch.int64) if sparse else None)


def indexer_call(fp8: bool):
    rows = 256
    keys = torch.zeros(rows, 128, dtype=torch.float8_e4m3fn if fp8 else BF16)
    return lambda: indexer.paged_indexer_scores(
        torch.zeros(2, 32, 128, dtype=BF16), torch.zeros(2, 32), keys, torch.ones(rows) if fp8 else None,
        torch.arange(4).view(2, 2), 64, torch.tensor([0, 1]), torch.tensor([100, 30]), 128)


def moe_call(mxfp4: bool, mxfp8: bool = False):
    experts, dim, inter = 2, 3584, 3072
    shapes = ((experts, inter, dim), (experts, inter, dim), (experts, dim, inter))
    if mxfp4:
        weights = ExpertWeights(*(torch.zeros(e, o, i // 2, dtype=torch.uint8) for e, o, i in shapes),
                                *(torch.zeros(e, o, i // 32, dtype=torch.uint8) for e, o, i in shapes))
    else:
        weights = ExpertWeights(*(torch.zeros(e, o, i, dtype=BF16) for e, o, i in shapes))
    activation = GLUActivation("situ", 4.0, 25.0) if mxfp4 else GLUActivation("silu")
    return lambda: moe.moe_experts(torch.zeros(3, dim, dtype=BF16), torch.tensor([[0, 1], [1, 0], [0, 1]]),
                                   torch.rand(3, 2), weights, activation, mxfp8)


def attn_res_call():
    dim = 7168
    return lambda: attn_res.attn_res_mix_norm(torch.zeros(9, 2, dim, dtype=BF16), torch.ones(dim), torch.ones(dim),
                                              1e-5, torch.ones(dim), 1e-5)


CASES = {
    "kda_decode": (kda_decode, ["_kda_decode_kernel"], lambda: kda_decode_call(False)),
    "kda_decode token states": (kda_decode, ["_kda_decode_kernel"], lambda: kda_decode_call(True)),
    "kda_prefill": (kda_prefill, ["_intra_chunk_kernel", "_state_scan_kernel"], kda_prefill_call),
    "mla bf16": (mla_decode, ["_partial_kernel", "_combine_kernel"], lambda: mla_call(False, False)),
    "mla fp8 sparse": (mla_decode, ["_partial_kernel", "_combine_kernel"], lambda: mla_call(True, True)),
    "indexer fp8": (indexer, ["_scores_kernel"], lambda: indexer_call(True)),
    "moe bf16": (moe, ["_gate_up_kernel", "_down_kernel"], lambda: moe_call(False)),
    "moe mxfp4": (moe, ["_gate_up_kernel", "_down_kernel"], lambda: moe_call(True)),
    "moe mxfp4 mxfp8": (moe, ["_gate_up_kernel", "_down_kernel"], lambda: moe_call(True, True)),
    "moe bf16 mxfp8": (moe, ["_gate_up_kernel", "_down_kernel"], lambda: moe_call(False, True)),
    "attn_res": (attn_res, ["_mix_norm_kernel"], attn_res_call),
}


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[dict]]:
    """Every case's launches compiled for sm_90 in one separate process: {case: [{"shared"} or {"error"}]}."""
    launches = {case: record_launches(module, names, make_call()) for case, (module, names, make_call) in CASES.items()}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    flat = [launch for case_launches in launches.values() for launch in case_launches]
    done = subprocess.run([sys.executable, str(COMPILER)], input=json.dumps(flat), capture_output=True, text=True,
                          env=env, check=True)
    results = iter(json.loads(done.stdout))
    return {case: [next(results) for _ in case_launches] for case, case_launches in launches.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_launches_compile_for_h200(case: str, compiled: dict[str, list[dict]]) -> None:
    module, names, _ = CASES[case]
    assert len(compiled[case]) >= len(names)
    for result in compiled[case]:
        assert "error" not in result, result["error"]
        assert result["shared"] <= SHARED_MEMORY_LIMIT
