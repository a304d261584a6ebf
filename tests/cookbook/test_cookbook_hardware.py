"""The hardware catalog: every device the issue names, every number with a source and a flag, unknowns kept."""

from __future__ import annotations

import pytest

from kestrel.cookbook.hardware import catalog, device_for_cuda_name, get_device

REQUIRED = ["vera-rubin", "b300", "gb300", "b200", "gb200", "h200", "h100", "mi355x", "mi350x", "mi300x", "tpu7x",
            "trainium2", "trainium3", "zhenwu-m890", "zhenwu-810e", "zhenwu-v900", "ascend-a3", "ascend-950pr",
            "ascend-950dt", "mac-mini-m4-pro", "mac-studio-m3-ultra"]
FACTS = ["memory", "memory_bandwidth", "bf16_dense", "fp8_dense", "fp4_dense", "scale_up_bandwidth",
         "devices_per_node", "scale_up_domain", "native_fp4"]
NUMBER_FLAGS = {"vendor claim", "measured", "third-party report"}


def test_the_catalog_covers_the_day_0_list_and_more():
    assert set(REQUIRED) <= set(catalog())


@pytest.mark.parametrize("device_id", REQUIRED)
def test_every_number_has_a_source_and_a_flag(device_id):
    device = get_device(device_id)
    for name in FACTS:
        fact = device.fact(name)
        assert fact.source.strip(), (device_id, name)
        if fact.value is None:
            assert fact.flag in ("unknown", "none"), (device_id, name)
        else:
            assert fact.flag in NUMBER_FLAGS, (device_id, name)
        for alternative in fact.alternatives:
            assert alternative.value is not None and alternative.flag in NUMBER_FLAGS and alternative.source


def test_vendor_claims_and_unknowns_are_carried_over():
    v900 = get_device("zhenwu-v900")
    assert (v900.fact("memory").value, v900.fact("memory").flag) == (216, "vendor claim")
    assert (v900.fact("scale_up_bandwidth").value, v900.fact("scale_up_bandwidth").flag) == (1200, "vendor claim")
    assert v900.bandwidth_bytes_per_s is None and v900.fact("memory_bandwidth").flag == "unknown"
    assert get_device("mac-mini-m4-pro").fact("bf16_dense").flag == "unknown"
    assert get_device("h200").fact("fp4_dense").flag == "none"


def test_units_and_ranks():
    assert get_device("b300").memory_bytes == 270 * 10**9              # the datasheet, like every other device
    assert get_device("b300").measured_memory_bytes == 275_040 * 2**20  # nvidia-smi, hardware.md R3
    assert get_device("gb300").measured_memory_bytes is None
    assert get_device("tpu7x").memory_bytes == 192 * 2**30             # GiB as Google writes it
    assert get_device("gb300").bandwidth_bytes_per_s == 8e12
    assert get_device("ascend-a3").ranks_per_device == 2               # two dies per 910C
    assert get_device("b300").ranks_per_device == 1


def test_b300_conflicts_are_kept():
    memory = get_device("b300").fact("memory")
    assert (memory.value, memory.unit, memory.flag) == (270, "GB", "vendor claim")
    assert {(a.value, a.unit, a.flag) for a in memory.alternatives} == {(275040, "MiB", "measured"),
                                                                        (288, "GB", "vendor claim")}


def test_memory_has_one_basis_for_every_device():
    """The planner reads the vendor's per-device figure everywhere; measurements stay alternatives."""
    for device in catalog().values():
        assert device.fact("memory").flag != "measured", device.id


def test_mi300x_carries_hardware_md_section_5():
    """../shared/reference/hardware.md section 5, MI300X column (A1 MI300X page via R1; A1/A2 via R9; N18 MLPerf)."""
    mi300x = get_device("mi300x")
    assert mi300x.memory_bytes == 192 * 10**9
    assert mi300x.bandwidth_bytes_per_s == 5.3e12
    assert (mi300x.fact("bf16_dense").value, mi300x.fact("fp8_dense").value) == (1307.4, 2614.9)
    assert mi300x.fact("fp4_dense").flag == "none" and mi300x.fact("native_fp4").value is False
    assert mi300x.fact("scale_up_bandwidth").value == 7 * 128
    assert mi300x.devices_per_node == 8
    assert device_for_cuda_name("AMD Instinct MI300X").id == "mi300x"


def test_cuda_names_map_to_catalog_ids():
    assert device_for_cuda_name("NVIDIA GB300").id == "gb300"
    assert device_for_cuda_name("NVIDIA B300 SXM6 AC").id == "b300"
    assert device_for_cuda_name("NVIDIA H200").id == "h200"
    assert device_for_cuda_name("NVIDIA A100-SXM4-80GB") is None


def test_unknown_hardware_lists_the_choices():
    with pytest.raises(ValueError, match="unknown hardware 'a100'; choose one of: vera-rubin, b300, gb300"):
        get_device("a100")
    assert get_device("cpu").memory_bytes > 0
