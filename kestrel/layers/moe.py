"""Feed-forward layers: the dense gated MLP and the (latent) mixture of experts with MXFP4 routed experts.

MoE (model-spec section 6): a sigmoid router whose correction bias only steers selection; the routed experts
read a latent projection of x (K3: 7168 -> 3584) when the model has one, and their RMSNormed sum is projected
back; shared experts read x itself.

Under tensor parallelism the dense MLP and the shared experts split their intermediate width; routed experts are
split by expert over the EP groups and by intermediate width inside each group (kestrel.distributed.layout). The
router runs whole on every rank (same weights, same input: the same selection everywhere); each rank computes its
experts' share of every token's sum, and one all-reduce combines the routed and shared partial outputs. With the
all-to-all MoE (layout.moe_a2a) each rank routes its own share of its attention group's tokens and dispatches them
to the experts' ranks (kestrel.layers.expert_dispatch); the shared experts and dense MLPs split over the attention
group.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed.eplb import initial_placement
from ..distributed.parallel import SINGLE, Parallel
from ..ops import backend
from ..ops.torch.moe import ExpertWeights
from .activation import glu_activation
from .expert_dispatch import dispatch_and_combine, own_rows
from . import linear as linear_layers
from .linear import Linear, LinearGroup, pack_onednn
from .norm import RMSNorm
from .parallel import RowParallelLinear


EXPERT_PACKED_MIN_WEIGHT = 1 << 16
"""The fewest elements of an expert's w2 ([D, I]) for which pack_onednn_experts packs float32 routed experts.
Measured against the torch op's plain products (AMD EPYC, 2 threads, 64 or 32 experts, 1 to 16 rows per expert):
at 65,536 elements ([256, 256]) 0.57-1.0x the time, at 32,768 ([256, 128]) 0.76-1.5x (slower at 1-2 rows), at
18,432 ([192, 96], the bundled model's) 1.0-2.7x. On an Intel Xeon (AVX-512 and AMX, 2 threads; 11 layers of the
437M K3's experts, 64 of [512, 512] and [512, 256], top-4; eager, alternating, medians of 6) they took 1.2-1.4x
the time of the torch op's grouped GEMM (MKL) up to 128 tokens and as long at 512 (per layer, 8 tokens: 3.21
against 2.60 ms; 32: 8.08 against 5.64; 128: 12.66 against 9.97; 512: 21.44 against 22.21), so they are packed
only where the CPU prefers oneDNN (kestrel.layers.linear.ONEDNN: any but Intel's)."""


def onednn_experts_pay(w2_elements: int) -> bool:
    """Whether oneDNN-packed copies speed up float32 CPU experts of w2_elements per expert's w2 on this machine: a
    CPU that prefers oneDNN, and at least EXPERT_PACKED_MIN_WEIGHT of them."""
    return linear_layers.ONEDNN and w2_elements >= EXPERT_PACKED_MIN_WEIGHT


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj x, up_proj x)); the dense layer 0 and the shared experts.

    Under tensor parallelism each rank holds a share of the intermediate width; reduce=False leaves the sum of the
    ranks' partial outputs to the caller (MoE fuses it with the routed experts').
    """

    def __init__(self, config: ModelConfig, hidden: int, intermediate: int, par: Parallel = SINGLE,
                 reduce: bool = True):
        super().__init__()
        self.activation = glu_activation(config)
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = (RowParallelLinear(intermediate, hidden, par) if reduce
                          else Linear(intermediate, hidden, bias=False))
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project_down(*self.gate_up(x))

    def project_down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The output [T, hidden] from the gate and up projections [T, intermediate]."""
        return self.down_proj(self.activation(gate, up))


class Router(nn.Module):
    """Sigmoid top-k routing (`gate.weight` [E, hidden], `gate.e_score_correction_bias` [E])."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k, self.groups, self.topk_group = config.num_experts_per_token, config.num_expert_group, config.topk_group
        self.renormalize, self.scaling = config.moe_renormalize, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k] int64, routing weights [T, k] fp32)."""
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        choice = scores.detach() + self.e_score_correction_bias.float()
        if self.groups > 1:
            choice = self._keep_top_groups(choice)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling

    def _keep_top_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: only experts of the topk_group groups with the best top-2 sums stay eligible."""
        grouped = choice.view(choice.shape[0], self.groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


class RoutedExperts(nn.Module):
    """E experts of act(w1 z, w3 z) -> w2, held stacked: dense `w1, w3` [E, I, D], `w2` [E, D, I], or MXFP4
    `w{1,3,2}_packed` (uint8, two values per byte along the input dim) with `w{1,3,2}_scale` (E8M0 per 32).

    Packed experts stay packed in memory; the experts a batch uses are expanded when it runs (by the Triton kernel
    on CUDA, inside its GEMM; one expert tile at a time by the torch op), unless `hold_dense_copy` keeps a dense copy
    (the CPU trade of memory for time, costs in `kestrel.ops.torch.moe`). With `mxfp8_activations` (off by default;
    `--moe-mxfp8-activations`) the GEMM inputs are rounded to MXFP8, as the family's quantization-aware training did
    (W4A8).

    With expert parallelism the experts are held in slots: (E + R) / ep per EP rank (R redundant slots, EPLB's), the
    rank's slots [first_slot, first_slot + slots) of E + R in all. `placement` [E + R] names the (logical) expert
    each slot holds, the same on every rank; it starts as `eplb.initial_placement` (each rank's contiguous share of
    the experts, its redundant slots copying them) and kestrel.engine.expert_balance moves it. `route` turns the
    router's expert ids into slots (a token's replicas chosen round-robin), and the rank computes only the
    token-slot pairs of its own slots. `load` [E] counts the token-expert pairs this rank routed, `computed` the
    pairs it computed, since the balancer last read them.
    """

    def __init__(self, config: ModelConfig, dim: int, par: Parallel = SINGLE):
        super().__init__()
        rank, parts = par.layout.axis("ep")
        self.num_experts = config.num_experts
        self.slots = par.layout.slots_per_rank(config.num_experts)
        self.first_slot = rank * self.slots
        with torch.device("cpu"):       # host-side tables, whatever device the model is built on
            self.set_placement(initial_placement(self.num_experts, parts, self.slots))
        self.activation = glu_activation(config)
        self.mxfp4 = config.experts_mxfp4
        self.mxfp8_activations = False
        e, i = config.num_experts, config.moe_intermediate_size
        shapes = {"w1": (e, i, dim), "w3": (e, i, dim), "w2": (e, dim, i)}
        for name, shape in shapes.items():
            if self.mxfp4:
                *lead, cols = shape
                self.register_buffer(f"{name}_packed", torch.zeros(*lead, cols // 2, dtype=torch.uint8))
                self.register_buffer(f"{name}_scale", torch.zeros(*lead, cols // 32, dtype=torch.uint8))
            else:
                setattr(self, name, nn.Parameter(torch.zeros(shape)))
        if self.mxfp4:
            self.register_buffer("w13_dense", None, persistent=False)     # w1 then w3 [E, 2I, D]
            self.register_buffer("w2_dense", None, persistent=False)
        self.onednn: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None   # pack_onednn's

    def hold_dense_copy(self, dtype: torch.dtype | None) -> None:
        """Compute from a dense copy of the packed experts in dtype (w1 and w3 stacked as w13 [E, 2I, D], so that one
        GEMM computes both; w2 [E, D, I]; bfloat16 holds every MXFP4 value exactly) instead of expanding packed
        tiles each call; None drops the copy. The copy is taken now, so call this after loading weights; it moves
        with the module and is not saved. It drops oneDNN copies (pack_onednn)."""
        if not self.mxfp4:
            raise ValueError("these routed experts are already dense; only MXFP4 experts can hold a dense copy.")
        self.onednn = None
        w13 = w2 = None
        if dtype is not None:
            packed = self._packed()
            w13 = torch.cat([packed.dense("w1", None, dtype), packed.dense("w3", None, dtype)], dim=1)
            w2 = packed.dense("w2", None, dtype)
        self.register_buffer("w13_dense", w13, persistent=False)
        self.register_buffer("w2_dense", w2, persistent=False)

    def weights(self) -> ExpertWeights:
        """The experts as the op takes them: the dense parameters or the held dense copy (with their oneDNN copies,
        once packed, except in a traced graph, whose products never read them), or the packed buffers."""
        if not self.mxfp4:
            dense = ExpertWeights(self.w1, self.w3, self.w2)
        elif self.w13_dense is not None:
            w1, w3 = self.w13_dense.chunk(2, dim=1)
            dense = ExpertWeights(w1, w3, self.w2_dense, w13=self.w13_dense)
        else:
            return self._packed()
        if self.onednn is None or torch.compiler.is_dynamo_compiling():
            return dense
        return dataclasses.replace(dense, onednn_w13=self.onednn[0], onednn_w2=self.onednn[1])

    def pack_onednn(self) -> int:
        """Hold each dense expert's w1 and w3 ([2I, D], one matrix) and w2 ([D, I]) a second time in oneDNN's packed
        layout (kestrel.layers.linear.pack_onednn), which the torch op's float32 products take in their place;
        returns the bytes the copies take. For inference: they do not follow later changes to the weights."""
        dense = self.weights()
        w13 = dense.w13 if dense.w13 is not None else torch.cat([dense.w1, dense.w3], dim=1)
        self.onednn = tuple(pack_onednn(w) for w in w13), tuple(pack_onednn(w) for w in dense.w2)
        return w13.nbytes + dense.w2.nbytes

    def _packed(self) -> ExpertWeights:
        return ExpertWeights(self.w1_packed, self.w3_packed, self.w2_packed, self.w1_scale, self.w3_scale,
                             self.w2_scale)

    def forward(self, z: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """z [T, D], slots/weights [T, k] (slot ids, `route`'s) -> sum_k weights * expert_k(z) over this rank's
        slots, [T, D] in z's dtype."""
        op = backend.get_op("moe_experts", z.device)
        if self.slots == self.placement.numel():
            return op(z, slots, weights, self.weights(), self.activation, self.mxfp8_activations)
        local = slots - self.first_slot
        token, k = ((local >= 0) & (local < self.slots)).nonzero(as_tuple=True)     # this rank's pairs
        if not torch.compiler.is_dynamo_compiling():
            self.computed += token.numel()
        pairs = op(z[token], local[token, k].unsqueeze(1), weights[token, k].unsqueeze(1), self.weights(),
                   self.activation, self.mxfp8_activations)
        return torch.zeros(z.shape, dtype=torch.float32, device=z.device).index_add(0, token, pairs.float()).to(z.dtype)

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """The weights as loaded, held per slot [slots, ...] (not the copies made from them: refresh_copies)."""
        names = [f"{w}_{part}" for w in ("w1", "w3", "w2") for part in ("packed", "scale")] if self.mxfp4 \
            else ["w1", "w3", "w2"]
        return {name: getattr(self, name) for name in names}

    def refresh_copies(self) -> None:
        """Make the dense and oneDNN copies again from the slots' weights (after they changed)."""
        packed = self.onednn is not None
        if self.mxfp4 and self.w13_dense is not None:
            self.hold_dense_copy(self.w13_dense.dtype)
        if packed:
            self.pack_onednn()

    def fill_redundant_slots(self) -> None:
        """Give a freshly loaded rank (its share of the experts, E / ep rows) its redundant slots, as the initial
        placement says: copies of its own experts."""
        own = self.placement[self.first_slot:self.first_slot + self.slots]
        for tensor in self.slot_tensors().values():
            if tensor.shape[0] != self.slots:
                tensor.data = tensor.data[(own - own[0]).to(tensor.device)]

    def route(self, ids: torch.Tensor, salt: int = 0) -> torch.Tensor:
        """The router's expert ids [T, k] -> the slots that compute them [T, k]: an expert's replicas in turn, by
        the pair's place (token t + salt + k). With expert parallelism, counts the pairs in `load`."""
        if self.slots == self.placement.numel():
            return ids
        if self.load.device != ids.device:
            self.load, self._replicas, self._replica_count = (t.to(ids.device) for t in
                                                              (self.load, self._replicas, self._replica_count))
        if not torch.compiler.is_dynamo_compiling():        # a compiled step does not count
            self.load += torch.bincount(ids.flatten(), minlength=self.num_experts)
        if self._identity:
            return ids
        turn = torch.arange(ids.shape[0], device=ids.device)[:, None] + salt + \
            torch.arange(ids.shape[1], device=ids.device)
        return self._replicas[ids, turn % self._replica_count[ids]]

    def set_placement(self, placement: torch.Tensor) -> None:
        """Hold `placement` [E + R] (CPU) from now on (the caller has put each slot's weights in place); the
        counts start again. The replica table: `_replicas` [E, most replicas] slot ids (padded with the last),
        `_replica_count` [E]."""
        self.placement = placement.cpu()
        count = torch.bincount(self.placement, minlength=self.num_experts)
        order = torch.sort(self.placement, stable=True).indices        # slots grouped by expert, in slot order
        start = torch.cumsum(count, 0) - count
        column = torch.arange(int(count.max()))
        self._replicas = order[start[:, None] + torch.minimum(column, count[:, None] - 1)]
        self._replica_count = count
        self._identity = bool((self.placement == torch.arange(self.placement.numel())).all())
        self.load = torch.zeros(self.num_experts, dtype=torch.int64)
        self.computed = 0


class MoE(nn.Module):
    """`block_sparse_moe.*`: router, routed experts (in a latent space when configured), shared experts."""

    def __init__(self, config: ModelConfig, par: Parallel = SINGLE):
        super().__init__()
        self.par = par
        self.gate = Router(config)
        self.latent = config.routed_expert_hidden_size is not None
        if self.latent:
            self.routed_expert_down_proj = Linear(config.hidden_size, config.expert_dim, bias=False)
            self.routed_expert_up_proj = Linear(config.expert_dim, config.hidden_size, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(config.expert_dim, config.rms_norm_eps)
        self.experts = RoutedExperts(config, config.expert_dim, par)
        if config.num_shared_experts:
            width = config.moe_intermediate_size * config.num_shared_experts
            self.shared_experts = GatedMLP(config, config.hidden_size, width, par, reduce=False)
            if self.latent:
                self.latent_and_shared = LinearGroup(self.routed_expert_down_proj, self.shared_experts.gate_proj,
                                                     self.shared_experts.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if self.par.layout.moe_a2a:
            return self._dispatched(x)
        ids, weights = self.gate(x)
        slots = self.experts.route(ids)
        if not self.latent:
            shared = self.shared_experts(x) if hasattr(self, "shared_experts") else None
            y = self.experts(x, slots, weights)
            return self.par.all_reduce(y if shared is None else y + shared)
        z, shared = self._latent_and_shared(x)
        y, shared = self._sum_over_ranks(self.experts(z, slots, weights), shared)
        return self._project_up(y, shared)

    def _dispatched(self, x: torch.Tensor) -> torch.Tensor:
        """The all-to-all MoE (kestrel.layers.expert_dispatch) on x [T, hidden], this rank's attention group's
        tokens: its own share is routed and dispatched, the group's shares gathered, the shared experts computed
        over the attention group."""
        (lo, hi), shares = own_rows(x.shape[0], self.par)
        ids, weights = self.gate(x[lo:hi])
        slots = self.experts.route(ids, salt=lo)
        if self.latent:
            z, shared = self._latent_and_shared(x)
            z = z[lo:hi]
        else:
            z, shared = x[lo:hi], self.shared_experts(x) if hasattr(self, "shared_experts") else None
        y = self.par.ffn.gather_rows(dispatch_and_combine(self.experts, z, slots, weights, self.par), shares)
        if shared is not None:
            shared = self.par.ffn.all_reduce(shared.contiguous())
        return (y if shared is None else y + shared) if not self.latent else self._project_up(y, shared)

    def _project_up(self, y: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """The latent routed sum y [T, latent] (whole) normed and projected up, plus the shared experts' output."""
        if hasattr(self, "routed_expert_norm"):
            y = self.routed_expert_norm(y)
        y = self.routed_expert_up_proj(y)
        return y if shared is None else y + shared

    def _latent_and_shared(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed experts' latent input [T, latent] and the shared experts' output [T, hidden] (None without
        shared experts): their three input projections one LinearGroup."""
        if not hasattr(self, "shared_experts"):
            return self.routed_expert_down_proj(x), None
        z, gate, up = self.latent_and_shared(x)
        return z, self.shared_experts.project_down(gate, up)

    def _sum_over_ranks(self, routed: torch.Tensor, shared: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                                           torch.Tensor | None]:
        """The ranks' partial latent routed sums [T, latent] and shared outputs [T, hidden], summed in one
        all-reduce (the latent sum must be whole before its norm)."""
        if self.par.group is None or shared is None:
            return self.par.all_reduce(routed), shared
        both = self.par.all_reduce(torch.cat([routed, shared], dim=-1))
        return both.split([routed.shape[-1], shared.shape[-1]], dim=-1)


def hold_dense_experts(model: nn.Module, dtype: torch.dtype | None) -> int:
    """RoutedExperts.hold_dense_copy(dtype) for every MXFP4 routed-expert module of model (None drops the copies);
    returns the bytes the copies now take."""
    held = 0
    for module in model.modules():
        if isinstance(module, RoutedExperts) and module.mxfp4:
            module.hold_dense_copy(dtype)
            if dtype is not None:
                held += module.w13_dense.nbytes + module.w2_dense.nbytes
    return held


def pack_onednn_experts(model: nn.Module) -> int:
    """RoutedExperts.pack_onednn for every routed-expert module of model whose products oneDNN's packed copies
    speed up (onednn_experts_pay: dense float32 experts, or a held float32 copy of MXFP4 ones); returns the bytes
    the copies add. Call it after hold_dense_experts."""
    added = 0
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            w2 = module.weights().w2
            if w2.dtype == torch.float32 and w2.device.type == "cpu" and onednn_experts_pay(w2[0].numel()):
                added += module.pack_onednn()
    return added
