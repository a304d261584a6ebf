"""The Triton backend: GPU kernels for the ops whose torch references are in `kestrel.ops.torch`.

One module per kernel family, each function with the same signature as its reference:
- kda_decode: the fused KDA decode step over the state pool (`ops.torch.kda_decode.kda_decode`);
- kda_prefill: chunked KDA prefill over the state pool (`ops.torch.kda_prefill.kda_prefill`);
- mla_decode: absorbed MLA decode over the paged latent cache, dense or sparse (`ops.torch.paged_attention`);
- indexer: the lightning indexer's scores over the paged key cache (`ops.torch.paged_indexer`);
- moe: the routed experts' grouped GEMM with MXFP4 dequantized in the kernel (`ops.torch.moe.moe_experts`);
- attn_res: the AttnRes depth mix fused with the next RMSNorm (`ops.torch.attn_res.attn_res_mix_norm`).
Importing this package imports triton; `kestrel.ops.backend` picks between the two backends.
"""
