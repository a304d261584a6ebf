"""DFLASH with published DFlash and DSpark draft layouts (NVIDIA NeMo AutoModel's KimiK3DFlashDraftModel,
KimiK3DSparkModel and Qwen3DSparkModel, SpecForge's DFlashDraftModel), on the bundled model with a random draft of
each: the loader reads the layout's tensor names and refuses drafts that do not fit; every draft equals the draft's
argmax computed from scratch by the layout's own math (per-head keys and values over [context | block], RoPE and
grouped heads for the Qwen3 layers, YaRN's in transformers' frequencies for the Qwen3 DSpark draft; DSpark's own
embedding and lm_head, every slot drafting, its Markov head after the draft before; from
the target's layer outputs of one plain forward over the whole sequence, the embedding and the last layer's normed
output for DSpark's layers -1 and 5) after every engine step, through chunked prefill, prefix-cache hits,
preemption, rejected drafts, HiCache and PD handoffs; greedy output is plain greedy output. In float32, so that
near-ties are the only rounding question."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kestrel import LLM, SamplingParams
from kestrel.config import load_config
from kestrel.engine.args import BUNDLED_MODEL, EngineArgs
from kestrel.engine.handoff import Handoff
from kestrel.layers.activation import glu_activation
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.models.dflash_draft import default_target_layers, load_dflash_draft
from helpers import (BLOCK, DSPARK_LAYERS, MARKOV_RANK, MASK, QWEN, TARGET_LAYERS, YARN, assert_idle, check_drafts,
                     draft_tensors, hf_rope, write_draft)

PROMPTS = ["KING.\nWhat news from France?\n\nMESSENGER.\n", "ROMEO.\nBut soft,", "To be, or not to be"]
LAYOUTS = ["nemo", "specforge", "dspark", "dspark-qwen"]
MARKOV_KINDS = ["vanilla", "gated", "rnn"]
TEXT = json.loads((BUNDLED_MODEL / "config.json").read_text())["text_config"]


@pytest.fixture(scope="module", params=LAYOUTS)
def draft_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "draft"
    scaling = {"rope_scaling": YARN} if request.param == "dspark-qwen" else {}
    write_draft(folder, request.param, markov="rnn", **scaling)
    return folder


def dflash(draft_dir, **kw) -> LLM:
    return LLM(str(BUNDLED_MODEL), dtype="float32", speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(draft_dir), speculative_num_draft_tokens=3, page_size=4, **kw)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def nemo_attention(w: dict, p: str, config, h: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """KimiK3DFlashAttention: per-head keys and values expanded from the [context | block] latents, the shared key
    part appended, the output gated. h [B, D] normed block, context [S, D] -> [B, D]."""
    heads, eps = config.num_attention_heads, config.mla_norm_eps
    nope, rope, vd, rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
    q_latent = rms(h @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], eps)
    q = (q_latent @ w[p + "q_b_proj.weight"].T).view(BLOCK, heads, nope + rope)
    compressed = torch.cat([context, h]) @ w[p + "kv_a_proj_with_mqa.weight"].T                      # [S+B, 576]
    kv = rms(compressed[:, :rank], w[p + "kv_a_layernorm.weight"], eps) @ w[p + "kv_b_proj.weight"].T
    kv = kv.view(-1, heads, nope + vd)
    keys = torch.cat([kv[..., :nope], compressed[:, None, rank:].expand(-1, heads, rope)], dim=-1)
    scores = torch.einsum("bhd,shd->hbs", q, keys) * (nope + rope) ** -0.5
    o = torch.einsum("hbs,shv->bhv", scores.softmax(-1), kv[..., nope:]).reshape(BLOCK, heads * vd)
    return (o * torch.sigmoid(h @ w[p + "g_proj.weight"].T)) @ w[p + "o_proj.weight"].T


def rope(x: torch.Tensor, positions: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """HF's apply_rotary_pos_emb: x [P, heads, hd] at positions [P], rotate_half pairing (i with i + hd/2), of
    transformers' frequencies and cos/sin factor for the config's rope_scaling."""
    hd = x.shape[-1]
    inv_freq, factor = hf_rope(hd, QWEN["rope_theta"], scaling)
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return x * emb.cos() * factor + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1) * emb.sin() * factor


def specforge_attention(w: dict, p: str, h: torch.Tensor, context: torch.Tensor, scaling: dict | None
                        ) -> torch.Tensor:
    """Qwen3DFlashAttention: q from the block; k, v from [context | block], per-head q_norm and k_norm, RoPE over
    positions 0..S+B-1 (the queries the last B; YaRN's with rope_scaling), KV heads repeated (repeat_kv).
    h [B, D], context [S, D] -> [B, D]."""
    heads, kv_heads, hd, eps = (QWEN[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                   "rms_norm_eps"))
    both = torch.cat([context, h])
    positions = torch.arange(both.shape[0])
    q = rope(rms((h @ w[p + "q_proj.weight"].T).view(BLOCK, heads, hd), w[p + "q_norm.weight"], eps),
             positions[-BLOCK:], scaling)
    k = rope(rms((both @ w[p + "k_proj.weight"].T).view(-1, kv_heads, hd), w[p + "k_norm.weight"], eps), positions,
             scaling)
    v = (both @ w[p + "v_proj.weight"].T).view(-1, kv_heads, hd)
    k, v = (x[:, :, None].expand(-1, -1, heads // kv_heads, -1).reshape(-1, heads, hd) for x in (k, v))
    scores = torch.einsum("bhd,shd->hbs", q, k) * hd ** -0.5
    return torch.einsum("hbs,shd->bhd", scores.softmax(-1), v).reshape(BLOCK, heads * hd) @ w[p + "o_proj.weight"].T


def markov_logits(w: dict, logits: torch.Tensor, outputs: torch.Tensor, anchor: int, drafts: list[int]
                  ) -> torch.Tensor:
    """NeMo's Markov heads (markov_head.py: VanillaMarkov, GatedMarkovHead, RNNHead) over a block's slot logits
    [S, vocab] and normed outputs [S, D]: row k gains the bias from the token before slot k (the anchor, then
    drafts[k - 1]) -> [len(drafts), vocab]."""
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    state, rows = torch.zeros(MARKOV_RANK), []
    for k, previous in enumerate([anchor, *drafts][:len(drafts)]):
        e, h = w1[previous], outputs[k]
        if "markov_head.gate_proj.weight" in w:
            e = e * torch.sigmoid(w["markov_head.gate_proj.weight"] @ torch.cat([h, e])
                                  + w["markov_head.gate_proj.bias"])
        elif "markov_head.joint_proj.weight" in w:
            z = w["markov_head.joint_proj.weight"] @ torch.cat([state, e, h]) + w["markov_head.joint_proj.bias"]
            g, c, o = z.chunk(3)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            e = torch.tanh(o)
        rows.append(logits[k] + w2 @ e)
    return torch.stack(rows)


def scratch_block_logits(engine, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """The draft's forward from scratch: logits [drafts, vocab] of the drafts after tokens[-1] (the anchor), the
    context being the target's layer outputs over tokens[:-1] from one plain forward in a fresh cache (layer -1 the
    embedding, the last layer's output normed by the final norm: HuggingFace's output_hidden_states); a DSpark
    draft's through its own embedding and lm_head, from slot 0, and its Markov head after `drafts`."""
    model, draft = engine.model, engine.drafter.draft_model
    config, w = draft.config, draft.state_dict()
    eps, nemo, dspark = config.rms_norm_eps, "layers.0.self_attn.kv_b_proj.weight" in w, "lm_head.weight" in w
    layers, last = DSPARK_LAYERS if dspark else TARGET_LAYERS, model.config.num_hidden_layers - 1
    raw = json.loads((Path(engine.args.speculative_draft_model_path) / "config.json").read_text())
    length = len(tokens) - 1
    cache = HybridCache.allocate(model.config, 1, length, 1, torch.float32)
    features = {i: None for i in layers if i not in (-1, last)}
    ids = torch.tensor(tokens[:-1])
    with torch.inference_mode():
        hidden = model.model(ids, ForwardBatch.build([length], None, [0], torch.arange(length)[None], 1), cache,
                             features)
        features |= {-1: model.model.embed_tokens(ids),
                     last: rms(hidden, model.model.norm.weight, model.config.rms_norm_eps)}
        outputs = torch.cat([features[i] for i in layers], dim=-1)
        context = rms(outputs @ w["fc.weight"].T, w["hidden_norm.weight"], eps)                 # [S, D]
        table = w["embed_tokens.weight"] if dspark else model.model.embed_tokens.weight
        x = table[torch.tensor([tokens[-1]] + [MASK] * (BLOCK - 1))]                            # [B, D]
        act = glu_activation(config) if nemo else (lambda gate, up: F.silu(gate) * up)
        for n in range(config.num_hidden_layers):
            p = f"layers.{n}."
            h = rms(x, w[p + "input_layernorm.weight"], eps)
            x = x + (nemo_attention(w, p + "self_attn.", config, h, context) if nemo
                     else specforge_attention(w, p + "self_attn.", h, context, raw.get("rope_scaling")))
            h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
            x = x + act(h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T) @ w[
                p + "mlp.down_proj.weight"].T
        out = rms(x, w["norm.weight"], eps)
        if not dspark:
            return out[1:] @ model.lm_head.weight.T
        return markov_logits(w, out @ w["lm_head.weight"].T, out, tokens[-1], drafts)


def check(engine) -> tuple[int, dict[str, list[int]]]:
    return check_drafts(engine, scratch_block_logits, serial=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loads_the_layouts_tensor_names(tmp_path, layout):
    write_draft(tmp_path, layout)
    draft = load_dflash_draft(tmp_path, load_config(BUNDLED_MODEL))
    state = draft.state_dict()
    written = {name: t for name, t in draft_tensors(layout, TEXT, 2).items()
               if not name.startswith("confidence_head.")}         # DSpark's: it only schedules verification
    assert set(state) == set(written)
    assert all(torch.equal(state[name], t) for name, t in written.items())
    layers, first = (DSPARK_LAYERS, 0) if layout.startswith("dspark") else (TARGET_LAYERS, 1)
    spec = draft.spec
    assert (spec.block_size, spec.mask_token_id, spec.target_layer_ids, spec.first_slot) == (BLOCK, MASK,
                                                                                            tuple(layers), first)


@pytest.mark.parametrize("layout, changes, message", [
    ("nemo", {"hidden_size": 256}, "made for another target: its hidden_size is 256"),
    ("nemo", {"kv_lora_rank": 64}, "made for another target: its kv_lora_rank is 64"),
    ("nemo", {"dflash_config": {"target_layer_ids": TARGET_LAYERS}}, "mask_token_id must be a token id"),
    ("nemo", {"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 9]}},
     "target_layer_ids must list layers"),
    ("nemo", {"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [-2, 1]}},
     "target_layer_ids must list layers"),
    ("nemo", {"block_size": 1}, "block_size must be an integer of at least 2"),
    ("dspark", {"block_size": 0}, "block_size must be an integer of at least 1"),
    ("dspark", {"mask_token_id": 4096}, "mask_token_id must be a token id below 4096"),
    ("dspark", {"markov_head_type": "lstm"}, "markov_head_type one of vanilla, gated, rnn"),
    ("dspark", {"markov_rank": 8}, "markov_head.markov_w1.weight of shape"),
    ("dspark", {"markov_rank": 0}, "unexpected \\['markov_head"),
    ("dspark", {"architectures": ["Gemma4DSparkModel"]}, "is a Gemma4DSparkModel; kestrel runs DSpark drafts of"),
    ("nemo", {"num_hidden_layers": 3}, "does not hold the tensors its config.json describes: missing"),
    ("specforge", {"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    ("specforge", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "RoPE scaling 'longrope' is not"),
    ("specforge", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "its RoPE does not load: "
                                                                          "'original_max_position_embeddings'"),
    ("specforge", {"layer_types": ["full_attention", "sliding_attention"]}, "no sliding windows or other"),
    ("specforge", {"head_dim": 48}, "self_attn.q_proj.weight of shape"),
])
def test_refuses_a_draft_that_does_not_fit(tmp_path, layout, changes, message):
    write_draft(tmp_path, layout, **changes)
    with pytest.raises(ValueError, match=message):
        load_dflash_draft(tmp_path, load_config(BUNDLED_MODEL))


def test_refuses_a_dflash2_draft(tmp_path):
    """DFlash 2 (NeMo's draft_qwen3_dflash2.py) adds in-block convolutions and a path selector to every layer."""
    tensors = write_draft(tmp_path)
    save_file(tensors | {"candidate_selector.successor_codebook": torch.zeros(4096, 8),
                         "layers.0.attention_conv.base_kernel": torch.zeros(2, 12)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="is a DFlash 2 draft .* which kestrel does not run yet"):
        load_dflash_draft(tmp_path, load_config(BUNDLED_MODEL))


@pytest.mark.parametrize("kind", MARKOV_KINDS)
def test_markov_heads_draft_as_nemos_do(tmp_path, kind):
    """Each Markov head, on random slot logits and outputs: every draft is the argmax of its slot's logits plus the
    bias NeMo's head computes from the draft before it (the anchor for the first)."""
    write_draft(tmp_path, "dspark", markov=kind)
    draft = load_dflash_draft(tmp_path, load_config(BUNDLED_MODEL))
    gen = torch.Generator().manual_seed(1)
    logits, outputs = torch.randn(3, BLOCK, 4096, generator=gen), torch.randn(3, BLOCK, TEXT["hidden_size"],
                                                                             generator=gen)
    anchors = torch.tensor([5, 77, 4000])
    with torch.inference_mode():
        drafts = draft.markov_head.drafts(logits, outputs, anchors).tolist()
    w = draft.state_dict()
    for row, anchor in enumerate(anchors.tolist()):
        expected = markov_logits(w, logits[row], outputs[row], anchor, drafts[row])
        assert expected.argmax(-1).tolist() == drafts[row]
    base = logits.argmax(-1).tolist()
    assert drafts != base                               # the bias changes drafts, so the check above can fail


def test_a_dspark_draft_refuses_a_token_map_and_a_confidence_cut(tmp_path):
    write_draft(tmp_path, "dspark")
    for changes, message in (({"speculative_token_map": str(BUNDLED_MODEL / "token_map.pt")},
                              "this DSpark draft drafts through its own lm_head and Markov head"),
                             ({"speculative_draft_min_confidence": 0.2}, "a published DFlash or DSpark draft")):
        with pytest.raises(ValueError, match=message):
            LLM(str(BUNDLED_MODEL), dtype="float32", speculative_algorithm="DFLASH",
                speculative_draft_model_path=str(tmp_path), **changes)


def test_dspark_is_sglangs_name_for_dflash_with_a_dspark_draft(tmp_path):
    write_draft(tmp_path / "dspark", "dspark")
    write_draft(tmp_path / "dflash", "nemo")
    args = EngineArgs(model=str(BUNDLED_MODEL), speculative_algorithm="DSPARK",
                      speculative_draft_model_path=str(tmp_path / "dspark"))
    assert args.speculative_algorithm == "DFLASH"
    for folder in (tmp_path / "dflash", None):
        with pytest.raises(ValueError, match="DSPARK drafts with a DSpark draft"):
            EngineArgs(model=str(BUNDLED_MODEL), speculative_algorithm="DSPARK", speculative_draft_model_path=folder)


def test_default_target_layers_follow_dflash():
    """DFlash's rule, as NeMo's build_target_layer_ids computes it (numbers worked by hand)."""
    assert default_target_layers(61, 1) == [30]
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layers(93, 3) == [1, 46, 90]


def test_greedy_output_is_plain_and_drafts_are_the_drafts_from_scratch(draft_dir):
    """Through chunked prefill, prefix-cache hits, preemption and rejected drafts, and a one-token prompt."""
    engine = dflash(draft_dir, chunked_prefill_size=8, max_total_tokens=96, mamba_scheduler_strategy="extra_buffer",
                    mamba_track_interval=4).engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(BUNDLED_MODEL), dtype="float32").generate(PROMPTS, params)]
    checked = 0
    for turn in range(2):                                   # the second turn starts from the prefix cache
        for i, prompt in enumerate(PROMPTS + ["A"]):
            engine.add_request(f"{turn}.{i}", prompt, params)
        turn_checked, finished = check(engine)
        checked += turn_checked
        assert [finished[f"{turn}.{i}"] for i in range(len(PROMPTS))] == expected
    assert checked >= 60
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_cache.stats.hits > 0
    assert engine.spec_stats.verifications > 0
    assert_idle(engine.scheduler)


def test_hicache_brings_the_context_back_with_the_pages(draft_dir):
    """Pages evicted to host memory and loaded back on a prefix hit hold the draft's context latents too: the drafts
    after the hit are the drafts from scratch."""
    engine = dflash(draft_dir, enable_hierarchical_cache=True, max_total_tokens=64, max_mamba_cache_size=4).engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = list(range(100, 122))
    for i, ids in enumerate([first, *(list(range(200 + 30 * k, 220 + 30 * k)) for k in range(3))]):
        engine.add_request(f"r{i}", ids, params)
        check(engine)
    stats = engine.scheduler.prefix_cache.stats
    assert stats.pages_evicted > 0 and stats.pages_loaded == 0
    engine.add_request("again", first, params)
    checked, _ = check(engine)
    assert stats.pages_loaded > 0 and checked >= 5
    assert_idle(engine.scheduler)


def test_pd_handoffs_carry_the_context_between_dflash_instances_or_the_decoder_computes_it(draft_dir):
    """A prefill instance holding the draft writes its context latents into the pages it hands over, so the decode
    instance's drafts are the drafts from scratch and its output plain greedy output; a plain prefill instance's
    handoff lacks them, so the decode instance computes the prompt itself, with the same output."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    decoder = dflash(draft_dir).engine
    expected = [o.outputs[0].token_ids for o in LLM(str(BUNDLED_MODEL), dtype="float32").generate(PROMPTS, params)]
    for name, prefiller in (("dflash", dflash(draft_dir).engine),
                            ("plain", LLM(str(BUNDLED_MODEL), dtype="float32", page_size=4).engine)):
        handed: list[Handoff] = []
        for i, prompt in enumerate(PROMPTS):
            prefiller.add_request(f"p{i}", prompt, params, handoff=handed.append)
        while prefiller.has_unfinished_requests():
            prefiller.step()
        for i, handoff in enumerate(handed):
            decoder.add_prefilled_request(f"{name}{i}", handoff, params)
        checked, finished = check(decoder)
        assert [finished[f"{name}{i}"] for i in range(len(PROMPTS))] == expected and checked >= 20
    assert_idle(decoder.scheduler)


def test_the_context_rows_and_weights_are_in_the_memory_plan(draft_dir):
    """Per draft layer and token: NeMo's, an MLA latent (kv_lora_rank + qk_rope_head_dim); SpecForge's, a key and a
    value per KV head. The weights: the draft's, and the packed copies of those oneDNN multiplies (a DSpark draft's
    own LM head, on CPUs that take oneDNN)."""
    plain = LLM(str(BUNDLED_MODEL), dtype="float32").engine
    engine = dflash(draft_dir).engine
    raw = json.loads((draft_dir / "config.json").read_text())
    width = (raw["kv_lora_rank"] + raw["qk_rope_head_dim"] if "kv_lora_rank" in raw
             else 2 * raw["num_key_value_heads"] * raw["head_dim"])
    model = engine.drafter.draft_model
    draft = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    draft += sum(m.packed.numel() * 4 for m in model.modules() if getattr(m, "packed", None) is not None)  # oneDNN's
    assert engine.plan.weight_bytes == plain.plan.weight_bytes + draft
    assert engine.plan.kv_bytes_per_token == plain.plan.kv_bytes_per_token + 2 * width * 4
    assert len(engine.cache.mla) == len(plain.cache.mla) + 2
    assert all(pool.latent.values.shape[1] == width for pool in engine.cache.mla[-2:])
    assert f"DFlash draft: {2 * width * 4:,} B of each token" in engine.plan.describe()


def test_refuses_pipeline_stages_decode_context_parallelism_and_dp_attention(draft_dir):
    for parallel in ({"pp_size": 2}, {"dcp_size": 2, "tp_size": 2},
                     {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}):
        with pytest.raises(ValueError, match="runs without pipeline stages, decode context parallelism and DP"):
            EngineArgs(model=str(BUNDLED_MODEL), speculative_algorithm="DFLASH",
                       speculative_draft_model_path=str(draft_dir), **parallel)


@pytest.mark.slow
def test_compiled_decode_steps_write_the_context_too(draft_dir):
    """With --enable-torch-compile the decode steps and verifications run as compiled graphs, which must write the
    draft's context rows as the eager forward does: step by step, the same drafts and tokens as an eager engine
    (minutes of compiling: outside `make test`)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for compiled in (False, True):
        llm = dflash(draft_dir, max_running_requests=2, enable_torch_compile=compiled)
        recorded, draft = [], llm.engine.runner.drafter.draft
        llm.engine.runner.drafter.draft = lambda inputs, kept: recorded.append(draft(inputs, kept)) or recorded[-1]
        runs.append(([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)], recorded))
    assert runs[0] == runs[1] and sum(len(d) for step in runs[0][1] for d in step) >= 10
