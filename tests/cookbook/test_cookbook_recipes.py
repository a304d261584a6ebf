"""Recipes: SGLang's cells and overlays, vLLM's strategies, kestrel's own command, and every refusal's reason."""

from __future__ import annotations

import pytest

from kestrel.cookbook.flags import flag_value, has_flag, parse_flags, render_flags
from kestrel.cookbook.recipes import RecipeRequest, base_requests, make_recipe
from kestrel.cookbook.sglang_recipe import RecipeRefused


def recipe(recipe_id: str, length: int = 11264):
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
    assert "8 devices" in r.refusals["kestrel"]
    assert (r.nodes, r.per_node) == (1, 8)


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
    a3 = recipe("k3/ascend-a3/unified/balanced")
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


def test_k31_uses_its_own_lane_names_and_drafts():
    hc = recipe("k3.1-pro/b300/unified/high-concurrency")
    assert "--model-path moonshotai/Kimi-K3.1-Pro" in hc.commands["sglang"].lines[0]
    assert has_flag(sglang_flags(hc), "--dcp-size")
    assert any("kimi-k31-pro branch" in n for n in hc.commands["sglang"].notes)
    assert "no vLLM recipe for Kimi K3.1 Pro" in hc.refusals["vllm"]
    dflash = sglang_flags(recipe("k3.1-pro/gb300/unified/high-concurrency,spec=dflash"))
    assert flag_value(dflash, "--speculative-draft-model-path") == "RadixArk/Kimi-K3.1-Dflash2-Preview"


@pytest.mark.parametrize("recipe_id, reason", [
    ("k3/h200/unified/low-latency,quant=nvfp4", "NVFP4 checkpoint runs on Blackwell only"),
    ("k3/h200/unified/low-latency,spec=dflash", "K3 DFLASH has not been validated on this hardware"),
    ("k3/ascend-a3/unified/balanced,hicache=host", "NPU HiCache does not support mamba cache"),
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
    ("k3.1-tiny/cpu/unified/balanced", "a CPU recipe is one device"),
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


def test_cpu_recipe_is_kestrels_own_command():
    r = recipe("k3.1-tiny/cpu/unified/low-latency")
    lines = r.commands["kestrel"].lines
    assert lines[0] == "kestrel random-model k3.1-tiny --out models/k3.1-tiny-random"
    assert f"--mamba-full-memory-ratio {r.ratio_text}" in lines[1]
    assert r.plan.slots_per_request == 1
    assert set(r.refusals) == {"sglang", "vllm"}


def test_overlay_flags_replace_their_negation():
    vllm = recipe("k3/b300/decode/balanced").commands["vllm"].lines[0]
    assert "--no-enable-prefix-caching" in vllm and "--enable-prefix-caching" not in vllm.replace("--no-enable", "")


def test_flags_round_trip_with_quoting():
    text = "--tp-size 8 --cuda-graph-bs-decode 2 4 8 --model-loader-extra-config '{\"a\": true}' --enable-x"
    assert render_flags(parse_flags(text)) == text
