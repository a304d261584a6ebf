"""Test helpers: tiny random models of each family member (and model folders with a byte-level BPE tokenizer), the
plain greedy computation the engine must reproduce, random published-layout DFlash drafts for the bundled model,
float32's rounding bounds, and the ops a computation dispatches or a traced graph calls."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path

import tokenizers
import torch
from filelock import FileLock
from safetensors.torch import save_file
from tokenizers import decoders, models, pre_tokenizers, trainers
from torch.utils._python_dispatch import TorchDispatchMode

from kestrel.config import parse_config
from kestrel.engine.args import BUNDLED_MODEL
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.models.checkpoint import build_model, save_model
from kestrel.models.init import init_weights
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.presets import tiny_config

FAMILY = ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"]


def tiny_model(preset: str, dtype: torch.dtype = torch.float32, seed: int = 0, std: float = 0.1, **overrides):
    """A random model of `preset`, its text-config keys replaced by `overrides` (eval mode)."""
    raw = tiny_config(preset)
    text = raw.get("text_config", raw)
    text.update(overrides)
    model = init_weights(build_model(parse_config(raw), dtype), seed=seed, std=std)
    for name, p in model.named_parameters():   # spread the router bias so it really steers selection
        if name.endswith("e_score_correction_bias"):
            p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return model.eval(), raw


def assert_idle(scheduler) -> None:
    """Nothing queued or running, and every page and state slot either free or held by the prefix cache alone,
    with the cache's own accounting consistent (no locks left, its pages and slots exactly those not free)."""
    assert not scheduler.running and not scheduler.waiting
    state, kv, cache = scheduler.state_pool, scheduler.kv_pool, scheduler.prefix_cache
    nodes, snapshots = (list(cache.nodes()), cache.snapshots) if cache is not None else ([], [])
    assert state.num_free + len(snapshots) == state.num_slots
    assert {s.slot for s in snapshots}.isdisjoint(state._free)
    held = {n.page for n in nodes} | {s.tail_page for s in snapshots if s.tail_page is not None}
    assert kv.num_used == 0 and len(held) == kv.num_pages - kv.num_free == kv.num_cached_only
    assert all(n.locks == 0 for n in nodes) and all(s.locks == 0 for s in snapshots)
    if cache is not None:
        assert cache.num_pages == len(nodes)


@torch.inference_mode()
def greedy_generate(model: KimiForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                    page_size: int = 16, stop_token_id: int | None = None) -> list[list[int]]:
    """Greedy continuations (up to max_new_tokens ids each, ending early at stop_token_id) of token-id prompts:
    one prefill, then one token per sequence per step, each sequence owning one slot and its pages up front."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token.")
    device = model.lm_head.weight.device
    n = len(prompts)
    pages_per_seq = -(-(max(map(len, prompts)) + max_new_tokens) // page_size)
    cache = HybridCache.allocate(model.config, num_slots=n, num_pages=n * pages_per_seq, page_size=page_size,
                                 dtype=model.lm_head.weight.dtype, device=device)
    page_table = torch.arange(n * pages_per_seq, device=device).view(n, pages_per_seq)
    slots = list(range(n))

    lens = [len(p) for p in prompts]
    batch = ForwardBatch.build(lens, None, slots, page_table, page_size, device)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    last = batch.cu_seqlens[1:] - 1
    next_ids = model.compute_logits(model(ids, batch, cache)[last]).argmax(-1)

    outputs: list[list[int]] = [[] for _ in prompts]
    running = list(range(n))
    for _ in range(max_new_tokens):
        for i, token in zip(running, next_ids.tolist()):
            outputs[i].append(token)
        running = [i for i in running if outputs[i][-1] != stop_token_id and len(outputs[i]) < max_new_tokens]
        if not running:
            break
        batch = ForwardBatch.build([1] * len(running), [lens[i] + len(outputs[i]) - 1 for i in running],
                                   [slots[i] for i in running], page_table[running], page_size, device)
        ids = torch.tensor([outputs[i][-1] for i in running], device=device)
        next_ids = model.compute_logits(model(ids, batch, cache)).argmax(-1)
    return outputs


def check_drafts(engine, draft_logits: Callable[..., torch.Tensor], serial: bool = False
                 ) -> tuple[int, dict[str, list[int]]]:
    """Step engine to the end, checking after every step that each running sequence's drafts are the argmax of
    draft_logits(engine, its tokens) [drafts, vocab], the oracle's, where no near-tie lets rounding decide: (how
    many drafts were checked, each finished request's tokens). serial: drafts that depend on the drafts before them
    (DSpark's Markov head), the oracle called as draft_logits(engine, tokens, drafts) to give each draft's logits
    after the drafts before it."""
    checked, finished = 0, {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        for seq in engine.scheduler.running:
            if not seq.draft:
                continue
            tokens = seq.tokens(0, seq.num_tokens)
            logits = (draft_logits(engine, tokens, list(seq.draft)) if serial
                      else draft_logits(engine, tokens))[:len(seq.draft)]
            top2 = logits.topk(2).values
            clear = (top2[:, 0] - top2[:, 1] > 1e-3).tolist()
            expected = logits.argmax(-1).tolist()
            assert all(g == e for g, e, c in zip(seq.draft, expected, clear) if c)
            checked += sum(clear)
    return checked, finished


TARGET_LAYERS = [1, 4]
"""The random DFlash drafts' target layers, block size and mask token (the bundled model's vocabulary); DSpark's
read the embedding and the last layer too (HuggingFace's output_hidden_states convention)."""
DSPARK_LAYERS = [-1, 2, 5]
BLOCK = 5
MASK = 4090
MARKOV_RANK = 16
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
"""A YaRN scaling whose ramp spans several of QWEN's frequencies (dims 0-7 of 18)."""
QWEN = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 36, "intermediate_size": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1000.0, "hidden_act": "silu"}
"""A SpecForge-layout draft's shape (GQA, head_dim unlike hidden / heads) for the bundled model's hidden size."""


def hf_rope(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """transformers' RoPE initialisation (the reference drafts are trained with): inverse frequencies [head_dim / 2]
    and the cos/sin factor of a config's scaling dict (none: plain RoPE)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim), 1.0
    params = {"rope_theta": theta, **{k: v for k, v in scaling.items() if k != "type"}, "rope_type": kind}
    config = Qwen3Config(hidden_size=192, num_attention_heads=4, head_dim=head_dim, rope_parameters=params,
                         max_position_embeddings=int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")


def draft_tensors(layout: str, text: dict, layers: int, seed: int = 0, markov: str = "vanilla"
                  ) -> dict[str, torch.Tensor]:
    """Random weights under the layout's names and shapes ("nemo": NeMo's KimiK3DFlashDraftModel for the K3 text
    config `text`; "specforge": SpecForge's DFlashDraftModel of shape QWEN; "dspark" and "dspark-qwen": NeMo's
    KimiK3DSparkModel and Qwen3DSparkModel (of shape QWEN), with a Markov head of kind `markov` and rank
    MARKOV_RANK and a confidence head) for a draft of `layers` layers."""
    d, vocab, r = text["hidden_size"], text["vocab_size"], MARKOV_RANK
    dspark = layout.startswith("dspark")
    shapes = {"fc.weight": (d, len(DSPARK_LAYERS if dspark else TARGET_LAYERS) * d), "hidden_norm.weight": (d,),
              "norm.weight": (d,)}
    if dspark:
        shapes |= {"embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d), "markov_head.markov_w1.weight":
                   (vocab, r), "markov_head.markov_w2.weight": (vocab, r), "confidence_head.proj.weight": (1, d + r),
                   "confidence_head.proj.bias": (1,)}
        shapes |= {"gated": {"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)},
                   "rnn": {"markov_head.joint_proj.weight": (3 * r, 2 * r + d),
                           "markov_head.joint_proj.bias": (3 * r,)}}.get(markov, {})
    for n in range(layers):
        p = f"layers.{n}."
        if layout in ("nemo", "dspark"):                    # K3 MLA layers
            heads, inter = text["num_attention_heads"], text["intermediate_size"]
            nope, rope, v, q_rank, kv_rank = (text[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim",
                                                                "v_head_dim", "q_lora_rank", "kv_lora_rank"))
            shapes |= {p + "self_attn.q_a_proj.weight": (q_rank, d), p + "self_attn.q_a_layernorm.weight": (q_rank,),
                       p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
                       p + "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, d),
                       p + "self_attn.kv_a_layernorm.weight": (kv_rank,),
                       p + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_rank),
                       p + "self_attn.g_proj.weight": (heads * v, d), p + "self_attn.o_proj.weight": (d, heads * v)}
        else:
            heads, kv_heads, hd, inter = (QWEN[k] for k in ("num_attention_heads", "num_key_value_heads",
                                                             "head_dim", "intermediate_size"))
            shapes |= {p + "self_attn.q_proj.weight": (heads * hd, d), p + "self_attn.o_proj.weight": (d, heads * hd),
                       p + "self_attn.k_proj.weight": (kv_heads * hd, d),
                       p + "self_attn.v_proj.weight": (kv_heads * hd, d),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                   p + "mlp.down_proj.weight": (d, inter)}
    gen = torch.Generator().manual_seed(seed)
    return {name: (1 + 0.1 * torch.randn(shape, generator=gen) if len(shape) == 1
                   else torch.randn(shape, generator=gen) * shape[1] ** -0.5) for name, shape in shapes.items()}


def write_draft(folder: Path, layout: str = "nemo", layers: int = 2, markov: str = "vanilla", **changes
                ) -> dict[str, torch.Tensor]:
    """A draft folder of the layout for the bundled model, config.json as NeMo's build_kimi_k3_dflash_draft_config
    or build_kimi_k3_draft_config (DSpark; the target's text config, adapted) or SpecForge (a Qwen3 config of
    shape QWEN) writes it, its keys replaced by changes; returns its tensors."""
    text = json.loads((BUNDLED_MODEL / "config.json").read_text())["text_config"]
    dflash = {"block_size": BLOCK, "num_hidden_layers": layers, "num_target_layers": 6,
              "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TARGET_LAYERS}}
    nemo = copy.deepcopy(text) | {
        "num_hidden_layers": layers, "num_target_layers": 6, "num_experts": None, "num_shared_experts": 0,
        "num_nextn_predict_layers": 0, "attn_res_block_size": None, "tie_word_embeddings": False,
        "linear_attn_config": {"kda_layers": [], "full_attn_layers": list(range(1, layers + 1))}}
    if layout == "nemo":
        config = nemo | dflash | {"architectures": ["KimiK3DFlashDraftModel"]}
    else:
        qwen = {"model_type": "qwen3", "hidden_size": text["hidden_size"], "vocab_size": text["vocab_size"],
                "attention_bias": False, "num_hidden_layers": layers, **QWEN}
        dspark = {"block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": DSPARK_LAYERS, "num_anchors": 512,
                  "markov_rank": MARKOV_RANK, "markov_head_type": markov, "enable_confidence_head": True,
                  "confidence_head_with_markov": True}
        config = {"dspark": nemo | dspark | {"architectures": ["KimiK3DSparkModel"]},
                  "dspark-qwen": qwen | dspark | {"architectures": ["Qwen3DSparkModel"]}}.get(
                      layout, qwen | dflash | {"architectures": ["DFlashDraftModel"]})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config | changes))
    tensors = draft_tensors(layout, text, layers, markov=markov)
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def selected_mask(selected: torch.Tensor, context_len: int) -> torch.Tensor:
    """[T, context_len] bool, True at the positions listed in selected [T, k] (entries < 0 list nothing): the mask
    form of a sparse selection, which masked attention took before it read listed positions."""
    spill = torch.where(selected >= 0, selected, context_len)                 # unlisted entries land past the end
    mask = torch.zeros(selected.shape[0], context_len + 1, dtype=torch.bool, device=selected.device)
    return mask.scatter_(1, spill, True)[:, :context_len]


VOCAB = 320
SPECIALS = ["[PAD]", "[BOS]", "[EOS]"]          # ids 0, 1, 2
CORPUS = ["the quick brown fox jumps over the lazy dog", "to be or not to be, that is the question",
          "all the world's a stage, and all the men and women merely players", "héllo wörld, ça va? 你好世界 🙂"] * 20


def write_tokenizer(folder) -> None:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "add_bos_token": True}))


def write_model(folder, preset: str = "k3.1-tiny", seed: int = 0, **overrides) -> None:
    """A random model of `preset` (text-config keys replaced by overrides) and the test tokenizer in folder."""
    raw = tiny_config(preset)
    text = raw.get("text_config", raw)
    text.update(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, **overrides)
    model = init_weights(build_model(parse_config(raw), torch.float32), seed=seed, std=0.1)
    save_model(model, folder, config_json=raw)
    write_tokenizer(folder)


def computed_once(tmp_path_factory, name: str, compute: Callable[[], dict]) -> dict:
    """compute()'s result (tensors, numbers, strings), computed once per test run: under pytest-xdist the first
    worker to ask computes and saves it in the run's shared temporary folder and the others load it (a module
    fixture would otherwise be built once per worker); without xdist, computed in place."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return compute()
    shared = tmp_path_factory.getbasetemp().parent / f"{name}.pt"         # this run's, shared by its workers
    with FileLock(f"{shared}.lock"):
        if not shared.is_file():
            torch.save(compute(), shared)
        return torch.load(shared)


U = 2.0 ** -24
"""float32's unit roundoff."""


def gamma(n: int) -> float:
    """Higham's gamma_n in float32: the relative error bound of n roundings, n u / (1 - n u)."""
    return n * U / (1 - n * U)


class OpCalls(TorchDispatchMode):
    """The ops dispatched under it, in order, by name ("aten.mul", "kestrel_cpu.glu")."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def traced_targets(fn: Callable, *args, **kwargs) -> tuple[object, list[str]]:
    """fn(*args, **kwargs) traced by torch.compile into one graph (run as traced), and the ops that graph calls."""
    targets = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=capture, fullgraph=True)(*args, **kwargs), targets
