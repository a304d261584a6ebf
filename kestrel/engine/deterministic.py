"""Deterministic inference (`--enable-deterministic-inference`, SGLang's flag): a request's tokens and logprobs are
bit for bit the same however it is batched.

Two things make it so. The operators (kestrel.ops.batch_invariant) compute each token's numbers in an order that
depends on nothing but that token's inputs, whatever else shares a step; and every layer runs its token-by-token
form for every token (`prepare`): KDA's recurrence and the absorbed MLA over the pages, as a decode step runs them,
for prefill chunks and verifications too, never the chunked (WY) KDA or the expanded MLA of a long prefill, which
sum in other orders. So a token gets the same numbers alone or among any other requests, prefilled in one chunk
or several (`--chunked-prefill-size`), decoded, verified as a draft, recomputed, or read back from the prefix cache
(its KDA snapshots are the recurrence's own states); and teacher forcing (`echo` with `logprobs`) reports exactly the
logprobs sampling reported. Seeded sampling draws from the request's own generator (kestrel.engine.sampling).

It runs where those operators exist: on the CPU (float32 or bfloat16), eagerly (the compiled steps sum in their own
orders), on one rank or under tensor (and expert) and pipeline parallelism, deterministic within a layout: every
rank runs the operators, and sums over ranks add the ranks' parts in rank order (kestrel.distributed.parallel), so a
layout gives the same bits run after run, though not the bits of another layout. `refusal` names any setting outside
that (data parallelism and decode context parallelism are not proven yet), and the engine refuses to start with it
rather than serve outputs that are not what the flag promises.
"""

from __future__ import annotations

from torch import nn

from ..layers.kda import KimiDeltaAttention
from ..ops import cpu
from ..layers.mla import ABSORBED, GatedMLA
from .args import EngineArgs

FLAG = "--enable-deterministic-inference"


def refusal(args: EngineArgs) -> str | None:
    """Why args cannot run deterministically (one sentence), or None."""
    if not args.enable_deterministic_inference:
        return None
    conflicts = [flag for flag, on in (
        (f"--device {args.device}", args.device != "cpu"),
        ("--enable-torch-compile", args.enable_torch_compile),
        ("--enable-background-compile", args.enable_background_compile),
        ("--moe-mxfp8-activations", args.moe_mxfp8_activations),
        ("--moe-onednn-experts", args.moe_onednn_experts),
        (f"--dp-size {args.dp_size}", args.dp_size > 1),
        (f"--dcp-size {args.dcp_size}", args.dcp_size > 1),
        (f"--moe-a2a-backend {args.moe_a2a_backend}", args.moe_a2a_backend != "none"),
        ("--enable-eplb", args.enable_eplb),
        ("a triton ops backend", "triton" in (args.attention_backend, args.moe_backend, args.kda_backend,
                                              args.norm_backend)),
    ) if on]
    if not conflicts:
        return None
    return (f"{FLAG} runs on the CPU, eagerly, with tensor and pipeline parallelism only, where kestrel's "
            f"batch-invariant operators are; drop {', '.join(conflicts)}.")


def prepare(model: nn.Module) -> None:
    """Make every attention layer of model run its token-by-token form for all tokens (module docstring); a
    ValueError where kestrel's CPU kernels, which the operators run on, could not be built."""
    if not cpu.load():
        raise ValueError(f"{FLAG} needs kestrel's CPU kernels, which could not be built here (the log says why).")
    for module in model.modules():
        if isinstance(module, GatedMLA):
            module.form = ABSORBED
        elif isinstance(module, KimiDeltaAttention):
            module.token_wise = True
