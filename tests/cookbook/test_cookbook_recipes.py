"""Recipes: SGLang's cells and overlays, vLLM's strategies, kestrel's own command, and every refusal's reason."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest
import torch

from kestrel.cookbook import sglang_recipe, vllm_recipe
from kestrel.cookbook.calculator import ratio_text
from kestrel.cookbook.flags import flag_value, has_flag, parse_flags, render_flags
from kestrel.cookbook.planner import plan
from kestrel.cookbook.recipe_request import RecipeRefused, RecipeRequest
from kestrel.cookbook.recipes import base_requests, make_recipe
from kestrel.cli import _parser
from kestrel.disagg.size import handoff_bytes
from kestrel.layers.cache import kv_bytes_per_token


def recipe(recipe_id: str, length: int | None = None):
    return make_recipe(RecipeRequest.from_id(recipe_id, length))


def sglang_flags(r) -> list:
    line = r.commands["sglang"].lines[0]
    return parse_flags(line[line.index("--"):])


def test_b300_balanced_is_the_pages_cell_with_the_ratio_pinned():
    r = recipe("k3/b300/unified/balanced")
    assert r.commands["sglang"].lines == [
        "sglang serve --trust-remote-code --model-path moonshotai/Kimi-K3 --reasoning-parser kimi_k3 "
        "--tool-call-parser kimi_k3 --host 0.0.0.0 --port 30000 --tp-size 8 --dcp-size 8 "
        "--mem-fraction-static 0.85 --mamba-full-memory-ratio 7.21"]
    assert r.sglang_status == "Verified" and r.lane == "balanced"
    assert "--tensor-parallel-size 8" in r.commands["vllm"].lines[0]
    assert r.commands["vllm"].strategy == "single_node_tp"
    assert "--tp-size 8 --dcp-size 8" in r.commands["kestrel"].lines[1]
    assert (r.nodes, r.per_node) == (1, 8)


def test_kestrel_commands_for_the_layouts_its_engine_runs():
    """TP (one node), TP x EP and TP x PP over two nodes; the pools its command pins come from kestrel's engine
    arithmetic."""
    tp8 = recipe("k3/b300/unified/low-latency").commands["kestrel"]
    assert tp8.lines == ["huggingface-cli download moonshotai/Kimi-K3 --local-dir models/Kimi-K3",
                         "kestrel serve --model models/Kimi-K3 --device cuda --tp-size 8 --mem-fraction-static 0.85 "
                         "--mamba-full-memory-ratio 0.18 --mamba-ssm-dtype float32 --kv-cache-dtype auto "
                         "--host 0.0.0.0 --port 30000"]
    h200 = recipe("k3/h200/unified/low-latency")
    line = h200.commands["kestrel"].lines[1]
    assert "--tp-size 16 --ep-size 16" in line
    assert line.endswith("--nnodes 2 --node-rank <rank> --dist-init-addr <head-node-ip>:5000")
    ours = plan(replace(h200.plan.request, engine="kestrel", compare_devices=False))
    assert f"--mamba-full-memory-ratio {ratio_text(ours.ratio)}" in line
    assert f"{ours.pools.state_slots:,} state slots, {ours.pools.kv_tokens:,} KV tokens" in h200.commands[
        "kestrel"].notes[0]
    staged = recipe("k3/b200/unified/low-latency").commands["kestrel"].lines[1]
    assert "--tp-size 8 --pp-size 2" in staged and "--nnodes 2" in staged


@pytest.mark.parametrize("recipe_id,reason", [
    ("k3/gb200/decode/high-throughput",
     "cannot run TP16 x DP2 x EP16 x DCP8: DP attention does not run with --dcp-size"),
    ("k3/b300/unified/low-latency,spec=mtp", "does not plan kestrel's draft memory yet"),
    ("k3/b300/unified/low-latency,quant=nvfp4", "not nvfp4"),
    ("k3/b300/unified/low-latency,hicache=host", "HiCache runs in one process for now"),
    ("k3/mi355x/unified/balanced", "mi355x is neither")])
def test_kestrel_refuses_what_its_engine_does_not_run(recipe_id, reason):
    assert reason in recipe(recipe_id).refusals["kestrel"]


@pytest.mark.parametrize("recipe_id,role,layout", [
    ("k3/b300/prefill/high-throughput", "--disaggregation-mode prefill --disaggregation-bootstrap-port 8998",
     "--pp-size 8"),
    ("k3/h200/decode/low-latency", "--disaggregation-mode decode", "--tp-size 16 --ep-size 16"),
    ("k3/b300/decode/balanced", "--disaggregation-mode decode", "--tp-size 8 --dcp-size 8")])
def test_pd_lanes_print_each_role_on_its_layout_and_the_router(recipe_id, role, layout):
    """A PD instance runs any layout (its ranks gather and split a handoff's state): the role's kestrel serve line,
    then the router in front of both halves."""
    command = recipe(recipe_id).commands["kestrel"]
    serve, router = command.lines[1], command.lines[2]
    assert role in serve and layout in serve
    assert router.startswith("kestrel router --pd-disaggregation --prefill http://<prefill-head-ip>:30000 8998")
    assert any("splits it over its own ranks" in note for note in command.notes)


def test_every_offered_sglang_command_pins_the_planners_ratio():
    for request in base_requests(models=("k3",), cpu=False):
        r = make_recipe(request)
        flags = sglang_flags(r)
        if has_flag(flags, "--max-mamba-cache-size"):          # the Atlas A3 cell sizes the pool by count
            assert not has_flag(flags, "--mamba-full-memory-ratio")
        else:
            assert flag_value(flags, "--mamba-full-memory-ratio") == r.ratio_text, request.id


def test_the_plan_reads_the_commands_own_flags():
    mi = recipe("k3/mi355x/unified/balanced").plan.request
    assert (mi.layout.tp, mi.layout.dcp, mi.cache.kv_dtype) == (8, 8, "fp8")
    h200 = recipe("k3/h200/unified/high-throughput").plan.request
    assert (h200.layout.tp, h200.layout.ep, h200.mem_fraction, h200.cache.radix_strategy, h200.nodes) == \
        (32, 32, 0.90, "extra_buffer_lazy", 4)
    gb200 = recipe("k3/gb200/decode/high-throughput").plan.request
    assert (gb200.layout.dp, gb200.layout.attention_tp, gb200.layout.dcp, gb200.cache.mode) == (2, 8, 8, "decode")
    a3 = recipe("k3/ascend-a3/unified/balanced,spec=mtp")
    assert a3.plan.nodes.devices == 32 and a3.plan.request.layout.tp == 64     # 64 dies on 32 NPUs


def test_dspark_collapses_b200_pipelines_and_adds_replay():
    flags = sglang_flags(recipe("k3/b200/unified/balanced,spec=mtp"))
    assert not has_flag(flags, "--pp-size")
    assert (flag_value(flags, "--tp-size"), flag_value(flags, "--dcp-size"), flag_value(flags, "--ep-size")) == \
        ("16", "16", "16")
    assert flag_value(flags, "--speculative-algorithm") == "DSPARK"
    assert has_flag(flags, "--enable-linear-replayssm-spec")
    prefill = sglang_flags(recipe("k3/b300/prefill/low-latency,spec=mtp"))
    assert not has_flag(prefill, "--enable-linear-replayssm-spec")


def test_hicache_storage_drops_dcp_and_needs_mooncake():
    r = recipe("k3/b300/unified/balanced,hicache=host+storage")
    flags = sglang_flags(r)
    assert not has_flag(flags, "--dcp-size")
    assert flag_value(flags, "--hicache-storage-backend") == "mooncake"
    assert r.commands["sglang"].lines[0].startswith("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH=<mooncake.json> ")
    assert "host or storage KV tier" in r.refusals["vllm"]
    host = sglang_flags(recipe("k3/b300/unified/balanced,hicache=host"))
    assert has_flag(host, "--dcp-size") and has_flag(host, "--enable-hierarchical-cache")


def test_nvfp4_swaps_the_checkpoint_and_the_moe_runner():
    r = recipe("k3/b200/unified/balanced,quant=nvfp4")
    flags = sglang_flags(r)
    assert flag_value(flags, "--moe-runner-backend") == "flashinfer_trtllm"
    assert "--model-path nvidia/Kimi-K3-NVFP4" in r.commands["sglang"].lines[0]
    assert r.commands["sglang"].image == "lmsysorg/sglang:dev-dev-kimi-k3-nvfp4"
    assert "RedHatAI/Kimi-K3-NVFP4" in r.commands["vllm"].lines[0]


def test_pd_recipes_add_the_router_and_the_roles_flags():
    r = recipe("k3/b300/decode/balanced")
    lines = r.commands["sglang"].lines
    assert "--disaggregation-mode decode" in lines[0] and "--port 30100" in lines[0]
    assert "--disaggregation-decode-extra-slots 16" in lines[0]
    assert lines[1].startswith("python3 -m sglang_router.launch_router --pd-disaggregation")
    assert r.plan.slots_per_request == 1


def test_k31_lanes_are_its_own_pages():
    """docs.sglang.io/cookbook/autoregressive/Moonshotai/Kimi-K3.1-Pro as serving-recipes.md section 5 records it:
    High-Concurrency (DCP8) on B300/GB300 Unified, prefill Low-Latency (TP8) and High-Throughput (PP4 x PCP2),
    decode Balanced (DCP8 x EP2, Verified with DFLASH on B300) and High-Throughput (DCP8), MI35x High-Throughput
    (DCP8) in both roles; served from the kimi-k31-pro branch (docker/k31.Dockerfile)."""
    hc = recipe("k3.1-pro/b300/unified/high-concurrency")
    assert "--model-path moonshotai/Kimi-K3.1-Pro" in hc.commands["sglang"].lines[0]
    assert (hc.plan.request.layout.tp, hc.plan.request.layout.dcp) == (8, 8)
    assert "kimi-k31-pro branch" in hc.commands["sglang"].image
    assert "no vLLM recipe for Kimi K3.1 Pro" in hc.refusals["vllm"]
    decode = recipe("k3.1-pro/b300/decode/balanced,spec=dflash")
    layout = decode.plan.request.layout
    assert (layout.tp, layout.dcp, layout.ep) == (8, 8, 2) and decode.sglang_status == "Verified (with DFLASH)"
    assert flag_value(sglang_flags(decode), "--speculative-draft-model-path") == "RadixArk/Kimi-K3.1-Dflash2-Preview"
    assert recipe("k3.1-pro/b300/decode/high-throughput").sglang_status == "Verified (without speculation)"
    prefill = recipe("k3.1-pro/b300/prefill/high-throughput").plan.request.layout
    assert (prefill.pp, prefill.tp) == (4, 2)
    assert "--attn-cp-size 2" in recipe("k3.1-pro/b300/prefill/high-throughput").commands["sglang"].lines[0]
    mi = recipe("k3.1-pro/mi355x/decode/high-throughput")
    assert mi.commands["sglang"].image is None and mi.plan.request.layout.dcp == 8


def test_k31_unknowns_are_not_filled_with_k3s_cells():
    for recipe_id in ("k3.1-pro/h200/unified/low-latency", "k3.1-pro/mi355x/unified/balanced",
                      "k3.1-pro/b300/unified/high-throughput"):
        with pytest.raises(RecipeRefused, match="kestrel does not borrow K3's cell"):
            recipe(recipe_id)
    for flag in ("--mem-fraction-static", "--disaggregation-transfer-backend", "--enable-linear-replayssm-spec"):
        assert not has_flag(sglang_flags(recipe("k3.1-pro/b300/decode/balanced,spec=dflash")), flag)


@pytest.mark.parametrize("recipe_id, reason", [
    ("k3/h200/unified/low-latency,quant=nvfp4", "NVFP4 checkpoint runs on Blackwell only"),
    ("k3/h200/unified/low-latency,spec=dflash", "K3 DFLASH has not been validated on this hardware"),
    ("k3/ascend-a3/unified/balanced,spec=mtp,hicache=host", "NPU HiCache does not support mamba cache"),
    ("k3/ascend-a3/unified/balanced", "NPU recipes run DSPARK only"),
    ("k3/ascend-950pr/unified/balanced,spec=dflash", "DFLASH is also off on NPU"),
    ("k3.1-pro/b300/unified/low-latency,hicache=host", "HiCache overlay was not retrievable"),
    ("k3.1-pro/b300/unified/low-latency,quant=nvfp4", "quantization overlay (runner, image) was not retrievable"),
    ("k3/b300/decode/balanced,quant=w4a8", "served on the Atlas A3 only"),
    ("k3/ascend-a3/unified/balanced,quant=mxfp4", "W4A8 modelslim checkpoint"),
    ("k3/ascend-a3/prefill/low-latency", "only Unified PD is supported on the NPU recipes"),
    ("k3/h200/prefill/low-latency", "no prefill low-latency cell for h200"),
    ("k3/b300/unified/high-concurrency", "no High-Concurrency lane"),
    ("k3.1-pro/b300/unified/balanced", "pick --strategy high-concurrency"),
    ("k3.1-pro/b300/unified/low-latency,spec=mtp", "no MTP or DSpark draft for K3.1 Pro"),
    ("k3/b300/prefill/high-throughput,spec=mtp", "DSPARK needs --pp-size 1"),
    ("k3/mi355x/unified/low-latency", "(its unified strategies there: balanced)"),
    ("k3/mac-studio-m3-ultra/unified/low-latency", "`kestrel plan --hardware mac-studio-m3-ultra`"),
    ("kimi-linear-48b/b300/unified/low-latency", "the anchors hold recipes for k3, k3.1-pro only"),
    ("k3.1-tiny/cpu/unified/balanced", "a CPU recipe is one device per instance"),
    ("k3.1-tiny/cpu/decode/high-throughput", "a CPU recipe is one device per instance"),
    ("k3/cpu/unified/low-latency", "k3 does not fit a CPU machine"),
])
def test_unsupported_combinations_are_refused_with_the_reason(recipe_id, reason):
    with pytest.raises(RecipeRefused) as refused:
        recipe(recipe_id)
    assert reason in str(refused.value)


@pytest.mark.parametrize("bad, message", [
    ("k3/b300/unified", "a recipe id looks like model/hardware/mode/strategy"),
    ("k3/b300/unified/balanced,colour=red", "unknown recipe option 'colour=red'"),
    ("k3/b300/sideways/balanced", "unknown mode 'sideways'"),
    ("k3/a100/unified/balanced", "unknown hardware 'a100'"),
    ("k3/b300/unified/balanced,quant=int2", "unknown quant 'int2'"),
])
def test_bad_recipe_ids(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        recipe(bad)


def test_ids_round_trip():
    request = RecipeRequest(model="k3", hardware="gb300", mode="decode", strategy="balanced", spec="mtp",
                            hicache="host+storage", quant="nvfp4")
    assert request.id == "k3/gb300/decode/balanced,spec=mtp,hicache=host+storage,quant=nvfp4"
    assert RecipeRequest.from_id(request.id) == request


def test_cpu_recipes_serve_the_bundled_model_or_a_random_preset():
    bundled = recipe("k3.1-tiny/cpu/unified/low-latency")
    lines = bundled.commands["kestrel"].lines
    assert len(lines) == 1 and lines[0].startswith("kestrel serve --model models/k3.1-tiny --device cpu ")
    assert f"--mamba-full-memory-ratio {bundled.ratio_text}" in lines[0]
    assert bundled.plan.model.config.hidden_size == 192          # the bundled model's own config, not the preset's
    assert bundled.plan.slots_per_request == 1 and set(bundled.refusals) == {"sglang", "vllm"}
    random = recipe("kimi-linear-tiny/cpu/unified/low-latency").commands["kestrel"].lines
    assert random[0] == "kestrel random-model kimi-linear-tiny --out models/kimi-linear-tiny-random"


def test_cpu_recipes_size_for_requests_within_the_models_context():
    """The bundled model's context is 2,048 tokens (the tiny presets' 4,096), so its recipes balance the pools for
    requests of that length, not the calculator's 11,264; K3 (a 1M context) keeps 11,264; no request is longer than
    the context, so a longer average is refused."""
    for mode in ("unified", "prefill"):
        bundled = recipe(f"k3.1-tiny/cpu/{mode}/low-latency")
        context = bundled.plan.model.config.max_position_embeddings
        assert context == 2048 and bundled.plan.request.avg_request_len == context
        assert bundled.plan.pools.holds(context)
    assert recipe("kimi-linear-tiny/cpu/unified/low-latency").plan.request.avg_request_len == 4096
    assert recipe("k3/b300/unified/low-latency").plan.request.avg_request_len == 11264
    assert recipe("k3.1-tiny/cpu/unified/low-latency", length=1000).plan.request.avg_request_len == 1000
    with pytest.raises(ValueError, match="--avg-request-len 11,264 exceeds the model's context of 2,048 tokens"):
        recipe("k3.1-tiny/cpu/unified/low-latency", length=11264)


def test_cpu_pd_recipes_are_two_instances_and_the_router_on_loopback():
    """Each role's line parses as `kestrel serve` in that role; the router's --prefill names the prefill instance's
    port and bootstrap port, its --decode the decode instance's port; both halves print the same router line."""
    parser = _parser()
    halves = {mode: recipe(f"k3.1-tiny/cpu/{mode}/low-latency") for mode in ("prefill", "decode")}
    served = {}
    for mode, r in halves.items():
        serve, router = r.commands["kestrel"].lines
        args = parser.parse_args(shlex.split(serve)[1:])
        assert (args.disaggregation_mode, args.disaggregation_transfer_backend, args.host) == (mode, "tcp",
                                                                                                "127.0.0.1")
        served[mode] = args
        assert r.plan.request.cache.mode == mode and r.lane == f"kestrel on CPU, {mode} instance"
        assert f"{mode} instance (k3.1-tiny/cpu/{mode}/low-latency)" in " ".join(r.notes)
    prefill, decode = served["prefill"], served["decode"]
    assert halves["prefill"].commands["kestrel"].lines[1] == halves["decode"].commands["kestrel"].lines[1] == (
        f"kestrel router --pd-disaggregation --prefill http://127.0.0.1:{prefill.port} "
        f"{prefill.disaggregation_bootstrap_port} --decode http://127.0.0.1:{decode.port} --port 8000")
    assert len({prefill.port, decode.port, prefill.disaggregation_bootstrap_port, 8000}) == 4


def test_pd_recipes_say_what_one_handoff_weighs():
    """kestrel.disagg.size.handoff_bytes for the plan's settings: K3's FP8 decode lane moves ~14 kB per token of
    latents and indexer keys (whole pages of 16) plus the 449 MB KDA state; Unified plans have no handoff."""
    r = recipe("k3/b300/decode/low-latency", length=1000)
    config, cache = r.plan.model.config, r.plan.request.cache
    expected = handoff_bytes(config, 1000, 16, torch.bfloat16, torch.float32,
                             torch.float8_e4m3fn if cache.kv_dtype == "fp8" else torch.bfloat16)
    assert r.plan.handoff_bytes == expected
    assert expected - r.plan.state_bytes_per_slot == 1008 * kv_bytes_per_token(
        config, torch.float8_e4m3fn if cache.kv_dtype == "fp8" else torch.bfloat16)
    assert f"{expected / 1e9:,.3f} GB" in r.notes[-1]
    assert recipe("k3/b300/unified/low-latency").plan.handoff_bytes is None


def test_overlay_flags_replace_their_negation():
    vllm = recipe("k3/b300/decode/balanced").commands["vllm"].lines[0]
    assert "--no-enable-prefix-caching" in vllm and "--enable-prefix-caching" not in vllm.replace("--no-enable", "")


def test_flags_round_trip_with_quoting():
    text = "--tp-size 8 --cuda-graph-bs-decode 2 4 8 --model-loader-extra-config '{\"a\": true}' --enable-x"
    assert render_flags(parse_flags(text)) == text


def test_vllm_pd_commands_disaggregate_through_nixl():
    """vllm-project/recipes strategies/pd_cluster.yaml @2c22f3fe: NixlConnector producer on the prefill pool's port
    8001, consumer on the decode pool's 8002, and vllm-router in front; Kimi-K3.yaml's pd_cluster overrides."""
    prefill = recipe("k3/b300/prefill/low-latency").commands["vllm"].lines
    decode = recipe("k3/b300/decode/balanced").commands["vllm"].lines
    assert '"kv_connector":"NixlConnector","kv_role":"kv_producer"' in prefill[0] and "--port 8001" in prefill[0]
    assert '"kv_connector":"NixlConnector","kv_role":"kv_consumer"' in decode[0] and "--port 8002" in decode[0]
    assert "VLLM_SSM_CONV_STATE_LAYOUT=DS" in decode[0] and "--max-num-seqs 8" in decode[0]
    assert prefill[1] == decode[1] and decode[1].startswith("vllm-router --policy round_robin --vllm-pd-disaggregation")
    assert "--prefill http://<prefill-host>:8001 --decode http://<decode-host>:8002" in decode[1]
    assert "NCCL_MNNVL_ENABLE" not in prefill[0]                                   # NVL4-only, dropped on B300
    assert "NCCL_MNNVL_ENABLE=1" in recipe("k3/gb200/prefill/low-latency").commands["vllm"].lines[0]


def test_vllm_rocm_environment_is_the_recipes():
    """Kimi-K3.yaml @2c22f3fe hardware_overrides.amd: VLLM_ROCM_USE_AITER=1 and VLLM_USE_BREAKABLE_CUDAGRAPH=0
    ("REQUIRED on ROCm: the build auto-enables =1")."""
    line = recipe("k3/mi355x/unified/balanced").commands["vllm"].lines[0]
    assert line.startswith("VLLM_ROCM_USE_AITER=1 ")
    assert " VLLM_USE_BREAKABLE_CUDAGRAPH=0 vllm serve " in line
    compilation = '{"cudagraph_mode":"FULL_DECODE_ONLY","custom_ops":["+fused_rms_norm_gated"]}'
    assert f"--compilation-config '{compilation}'" in line


def test_npu_recipes_follow_the_page():
    """SGLang's NPU cells (kestrel issue 18's review of the newest kimi-k3.jsx): DSPARK only, no tool-call parser, and
    the A5 cell names its tokenizer, attention backend, device and dtype."""
    a5 = recipe("k3/ascend-950pr/unified/balanced,spec=mtp")
    flags = sglang_flags(a5)
    assert not has_flag(flags, "--tool-call-parser") and flag_value(flags, "--reasoning-parser") == "kimi_k3"
    assert (flag_value(flags, "--tokenizer-path"), flag_value(flags, "--attention-backend"),
            flag_value(flags, "--device"), flag_value(flags, "--dtype")) == ("moonshotai/Kimi-K3", "ascend", "npu",
                                                                            "bfloat16")
    assert flag_value(flags, "--speculative-algorithm") == "DSPARK"
    assert not has_flag(sglang_flags(recipe("k3/ascend-a3/unified/balanced,spec=mtp")), "--tool-call-parser")


@pytest.mark.parametrize("recipe_id, flags", [
    ("k3/b200/prefill/low-latency", ["--disable-flashinfer-autotune", "--weight-loader-prefetch-checkpoints",
                                     "--watchdog-timeout", "--model-loader-extra-config"]),
    ("k3/gb200/prefill/high-throughput", ["--disable-flashinfer-autotune", "--weight-loader-prefetch-checkpoints"]),
    ("k3/b200/decode/balanced", ["--disable-flashinfer-autotune", "--watchdog-timeout", "--model-loader-extra-config"]),
])
def test_cells_carry_the_pages_loader_flags(recipe_id, flags):
    """Issue 18's review of SGLang's kimi-k3.jsx: deep-PP prefill cells carry the autotune and prefetch flags (as
    B300's and GB300's Long-Context cells do, serving-recipes.md section 1.2), every B200 cell the B200 extras."""
    got = sglang_flags(recipe(recipe_id))
    assert all(has_flag(got, flag) for flag in flags)
    assert [name for name, _ in got].count("--disable-flashinfer-autotune") == 1


@pytest.mark.parametrize("recipe_id", ["k3/gb300/decode/low-latency", "k3/gb200/decode/low-latency",
                                       "k3/gb200/decode/balanced"])
def test_gb_decode_cells_pin_the_pages_memory_fraction(recipe_id):
    assert flag_value(sglang_flags(recipe(recipe_id)), "--mem-fraction-static") == "0.85"


def test_hopper_decode_cells_carry_the_pages_environment():
    h200 = recipe("k3/h200/decode/low-latency").commands["sglang"].lines[0]
    assert h200.startswith("NCCL_MNNVL_ENABLE=1 NCCL_CUMEM_ENABLE=1 SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 sglang")
    h100 = recipe("k3/h100/decode/balanced").commands["sglang"].lines[0]
    assert h100.startswith("NCCL_CUMEM_ENABLE=1 SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 PYTORCH_CUDA_ALLOC_CONF=")


# Issue 59: a second review against SGLang's and vLLM's sources (rows 1-10 of its table; row 6 is in
# test_cookbook_cli.py, row 10 in test_cookbook_planner.py).


def test_k31_prefill_context_parallelism_uses_sglangs_flags():
    """Row 1. SGLang has no --pcp-size (0.5.23's parser: unrecognized arguments); prefill context parallelism is
    --attn-cp-size with --enable-prefill-cp, which needs --cp-strategy (server_args._handle_context_parallelism
    raises without it; interleave is what SGLang maps DSA prefill CP to). PP4 x PCP2 on 8 GPUs: TP2 x PP4, CP2
    inside the TP group."""
    for hardware in ("b300", "gb300"):
        r = recipe(f"k3.1-pro/{hardware}/prefill/high-throughput")
        flags = sglang_flags(r)
        assert not has_flag(flags, "--pcp-size")
        assert [flag_value(flags, f) for f in ("--tp-size", "--pp-size", "--attn-cp-size", "--cp-strategy")] == \
            ["2", "4", "2", "interleave"]
        assert has_flag(flags, "--enable-prefill-cp")
        assert r.plan.request.layout.world == 8


def test_every_gb200_gb300_cell_skips_sglangs_tp_memory_imbalance_check():
    """Row 2. Every gb200/gb300 cell of SGLang's newest stored kimi-k3.jsx sets
    SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 (unified, prefill and decode)."""
    lanes = [r for r in base_requests(models=("k3",), cpu=False) if r.hardware in ("gb200", "gb300")]
    assert len(lanes) == 16
    for request in lanes:
        line = make_recipe(request).commands["sglang"].lines[0]
        assert line.startswith("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 sglang serve"), request.id


def test_vllm_h200_high_throughput_is_multi_node_tp_dp_and_refused_when_a_replica_does_not_fit():
    """Row 3. vllm-project/recipes Kimi-K3.yaml @8959cf64: strategy_hardware multi_node_dep: h200: unsupported, and
    multi_node_tp_dp (one TP replica per node, DP across nodes) granted on h200. kestrel models tp_dp as the command
    builder emits it, and refuses H200's: a TP8 replica of K3 needs about 205 GB per rank of a 141 GB H200."""
    r = recipe("k3/h200/unified/high-throughput")
    assert "vllm" not in r.commands
    reason = r.refusals["vllm"]
    assert "multi_node_dep unsupported on h200" in reason and "multi_node_tp_dp" in reason and "141 GB" in reason
    assert recipe("k3/gb200/unified/high-throughput").commands["vllm"].strategy == "multi_node_dep"
    # the tp_dp shape itself, on H200's 2 x 8 cell: TP8 x DP2, one replica per node (command-synthesis.js tp_dp)
    h200 = sglang_recipe.compose(RecipeRequest.from_id("k3/h200/unified/low-latency"))
    flags, notes = vllm_recipe._parallel_flags("tp_dp", h200, None)
    assert flags.startswith("--tensor-parallel-size 8 --data-parallel-size 2 --data-parallel-size-local 1 ")
    assert "--data-parallel-start-rank <node-index>" in flags and notes


def test_vllm_pd_prefill_runs_without_enforce_eager():
    """Row 4. vllm-project/recipes 6f19519 "Remove enforce eager in prefill of PD" (#828): strategies/pd_cluster.yaml
    and Kimi-K3.yaml's pd_cluster.prefill no longer pass --enforce-eager."""
    prefills = [r for r in base_requests(models=("k3",), cpu=False) if r.mode == "prefill"]
    commands = [make_recipe(r).commands.get("vllm") for r in prefills]
    assert len([c for c in commands if c]) == 8
    for command in filter(None, commands):
        assert "--enforce-eager" not in command.lines[0] and "kv_producer" in command.lines[0]


def test_k31_dflash2_draft_kv_comes_from_its_mla_config():
    """Row 5. RadixArk/Kimi-K3.1-Dflash2-Preview is a 5-layer MLA draft in BF16: 5 x (512 + 64) x 2 = 5,760 B per
    token (SGLang's 10,240 B help figure is an MHA draft's); the B300 decode Balanced ratio is then 4.67, not 3.18."""
    r = recipe("k3.1-pro/b300/decode/balanced,spec=dflash")
    plan_ = r.plan
    assert plan_.request.cache.draft_kv_bytes is None
    kv_rank = plan_.kv_bytes_per_token / 8 + 5 * (512 + 64) * 2
    assert plan_.kv_bytes_per_token_per_rank == kv_rank
    assert r.ratio_text == "4.67" and flag_value(sglang_flags(r), "--mamba-full-memory-ratio") == "4.67"


def test_k31_mi35x_lanes_carry_no_k3_mla_decode_tune():
    """Row 7. SGLANG_MLA_DECODE_TUNE=1 is the Non-Spec overlay of K3's page on MI35x (an MLA decode tune); K3.1 Pro's
    attention is DSA and its page's overlays were not retrievable, so its MI35x lanes carry none; K3's keep it."""
    for mode in ("prefill", "decode"):
        line = recipe(f"k3.1-pro/mi355x/{mode}/high-throughput").commands["sglang"].lines[0]
        assert "SGLANG_MLA_DECODE_TUNE" not in line
    assert "SGLANG_MLA_DECODE_TUNE=1" in recipe("k3/mi355x/unified/balanced").commands["sglang"].lines[0]


def test_ascend_cells_carry_the_pages_environment_and_multithread_load():
    """Row 8. SGLang's newest stored kimi-k3.jsx: both NPU cells pass --model-loader-extra-config
    '{"enable_multithread_load": true}'; the A3 cell sets 23 environment variables, the A5 cell 19."""
    for recipe_id, count, sample in (
            ("k3/ascend-a3/unified/balanced,spec=mtp,quant=w4a8", 23, "DEEPEP_HCCL_BUFFSIZE=1800"),
            ("k3/ascend-950pr/unified/balanced,spec=mtp", 19, "SGLANG_NPU_USE_FIAS_V2_BSND=True")):
        line = recipe(recipe_id).commands["sglang"].lines[0]
        env = line[:line.index(" sglang serve")].split()
        assert len(env) == count and sample in env and "SGLANG_RAGGED_VERIFY_MODE=static" in env
        assert flag_value(parse_flags(line[line.index("--"):]), "--model-loader-extra-config") == \
            '{"enable_multithread_load": true}'


def test_pd_decode_hicache_says_the_flag_is_inert():
    """Row 9. SGLang's scheduler: enable_decode_hicache = disaggregation_decode_enable_radix_cache and
    enable_hierarchical_cache. The page's HiCache overlay adds only --enable-hierarchical-cache on a decode role: the
    command stays as the page prints it and the note says it is inert there."""
    r = recipe("k3/b300/decode/low-latency,hicache=host")
    flags = sglang_flags(r)
    assert has_flag(flags, "--enable-hierarchical-cache")
    assert not has_flag(flags, "--disaggregation-decode-enable-radix-cache")
    assert any("inert" in n and "--disaggregation-decode-enable-radix-cache" in n for n in r.commands["sglang"].notes)
    assert not any("inert" in n for n in recipe("k3/b300/unified/low-latency,hicache=host").commands["sglang"].notes)


def test_each_cell_table_names_its_upstream_file_and_commit():
    """Issue 59's build list: per cell table, the upstream file and commit it was read from, and where the newest
    stored upstream differs (gb300 prefill Default lost --enable-symm-mem)."""
    from kestrel.cookbook.anchors import anchors
    provenance = anchors()["provenance"]
    for table in ("cells (K3, SGLang)", "cells (K3.1 Pro, SGLang)", "vllm", "sglang_calculator"):
        assert {"file", "commit", "newest_stored_differs"} <= set(provenance[table]), table
    assert provenance["vllm"]["commit"].startswith("8959cf64")
    assert any("--enable-symm-mem" in d for d in provenance["cells (K3, SGLang)"]["newest_stored_differs"])
    notes = recipe("k3/gb300/prefill/low-latency").commands["sglang"].notes
    assert any("drops --enable-symm-mem" in n for n in notes)
