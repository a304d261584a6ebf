"""The accelerator catalog: sourced facts per device, read from `data/hardware.json`.

Every number carries its source and a flag ("vendor claim", "measured", "third-party report"); a missing number is
"unknown" (no public source) or "none" (the device lacks the capability). Nothing here estimates: the planner asks
a Fact whether it is known and says which of its answers an unknown blocks.

Memory has one basis for every device: the vendor's datasheet figure per device, in the unit the vendor wrote. A
measured figure (B300: 275,040 MiB seen by nvidia-smi) stays an alternative (`Device.measured_memory_bytes`), used
where a check compares with a measurement taken on that device.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ..engine.cache.planner import device_memory

CATALOG_FILE = Path(__file__).parent / "data" / "hardware.json"
CPU = "cpu"
"""The id of the machine kestrel runs on when it has no accelerator (not in the catalog: measured at run time)."""

_BYTES = {"GB": 10**9, "GiB": 2**30, "MiB": 2**20}
_BYTES_PER_S = {"TB/s": 10**12, "GB/s": 10**9}


@dataclass(frozen=True)
class Fact:
    """One sourced number (or flag) about a device."""

    value: float | bool | None
    unit: str
    flag: str                       # vendor claim | measured | third-party report | unknown | none
    source: str
    tag: str | None = None          # hardware.md's own flag: VD, VC, 3P-M, 3P-R
    note: str | None = None
    alternatives: tuple[Fact, ...] = ()

    @property
    def known(self) -> bool:
        return self.value is not None

    def describe(self) -> str:
        """'288 GB (vendor claim: N12 ...)', or 'unknown (...)'."""
        if self.value is None:
            return f"{self.flag} ({self.source})"
        return f"{self.value:g} {self.unit} ({self.flag}: {self.source})"

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"value": self.value, "unit": self.unit, "flag": self.flag, "source": self.source}
        if self.tag:
            d["tag"] = self.tag
        if self.note:
            d["note"] = self.note
        if self.alternatives:
            d["alternatives"] = [a.as_dict() for a in self.alternatives]
        return d


@dataclass(frozen=True)
class Device:
    """One accelerator (or machine) with its facts, keyed as in hardware.json."""

    id: str
    name: str
    vendor: str
    section: str                    # hardware.md section
    cuda_names: tuple[str, ...]     # substrings of torch.cuda.get_device_name that identify it
    facts: dict[str, Fact] = field(hash=False)

    def fact(self, name: str) -> Fact:
        return self.facts[name]

    @property
    def memory_bytes(self) -> int | None:
        """Memory per device in bytes, or None when unknown."""
        memory = self.facts["memory"]
        return None if memory.value is None else int(memory.value * _BYTES[memory.unit])

    @property
    def measured_memory_bytes(self) -> int | None:
        """Memory per device as a third-party measurement saw it (the value or an alternative), or None."""
        memory = self.facts["memory"]
        for fact in (memory, *memory.alternatives):
            if fact.flag == "measured" and fact.value is not None:
                return int(fact.value * _BYTES[fact.unit])
        return None

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """Memory bandwidth per device in bytes/s, or None when unknown."""
        bandwidth = self.facts["memory_bandwidth"]
        return None if bandwidth.value is None else bandwidth.value * _BYTES_PER_S[bandwidth.unit]

    @property
    def flop_rate(self) -> float | None:
        """Dense multiply rate per device in flops/s, or None when unknown: a measured CPU's float32 rate, a catalog
        device's bf16 dense figure."""
        rate = self.facts.get("fp32_dense") or self.facts["bf16_dense"]
        return None if rate.value is None else rate.value * 1e12

    @property
    def ranks_per_device(self) -> int:
        """Engine ranks per device: 2 for an Ascend 910C (two dies), else 1."""
        ranks = self.facts.get("ranks_per_device")
        return int(ranks.value) if ranks is not None and ranks.value else 1

    @property
    def devices_per_node(self) -> int | None:
        per_node = self.facts["devices_per_node"]
        return None if per_node.value is None else int(per_node.value)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "vendor": self.vendor, "section": self.section,
                "facts": {k: f.as_dict() for k, f in self.facts.items()}}


def _fact(raw: dict[str, Any]) -> Fact:
    return Fact(value=raw.get("value"), unit=raw.get("unit", ""), flag=raw["flag"], source=raw["source"],
                tag=raw.get("tag"), note=raw.get("note"),
                alternatives=tuple(_fact(a) for a in raw.get("alternatives", ())))


@cache
def catalog() -> dict[str, Device]:
    """Every device of the catalog, by id, in the order of hardware.json."""
    raw = json.loads(CATALOG_FILE.read_text())
    devices = {}
    for entry in raw["devices"]:
        facts = {k: _fact(v) for k, v in entry.items() if isinstance(v, dict)}
        devices[entry["id"]] = Device(id=entry["id"], name=entry["name"], vendor=entry["vendor"],
                                      section=entry["section"], cuda_names=tuple(entry["cuda_names"]), facts=facts)
    return devices


@dataclass(frozen=True)
class CpuSpeed:
    """What one measurement saw this machine do on `threads` torch threads."""

    bandwidth: float                # bytes/s: a copy of COPY_BYTES, its reads plus its writes
    flop_rate: float                # flops/s: float32 matmuls of MATMUL_SIZE^3 (multiply-adds count 2)
    threads: int


COPY_BYTES = 256 * 2**20
MATMUL_SIZE = 1024


def measure_cpu(threads: int | None = None, repeats: int = 5) -> CpuSpeed:
    """This machine's memory bandwidth and float32 multiply-add rate on `threads` torch threads (default: torch's
    current count), each the best of `repeats` runs; about a second."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        src, dst = torch.ones(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
        a, b = torch.rand(MATMUL_SIZE, MATMUL_SIZE), torch.rand(MATMUL_SIZE, MATMUL_SIZE)
        copy = _best(lambda: dst.copy_(src), repeats)
        matmul = _best(lambda: torch.mm(a, b), repeats)
        return CpuSpeed(2 * COPY_BYTES / copy, 2 * MATMUL_SIZE ** 3 / matmul, torch.get_num_threads())
    finally:
        torch.set_num_threads(previous)


def _best(run, repeats: int) -> float:
    """The fastest of `repeats` timed calls of run, in seconds (after one untimed call)."""
    run()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return min(times)


def local_cpu(ranks: int = 1, speed: CpuSpeed | None = None) -> Device:
    """This machine's CPU as a device for `ranks` engine ranks (kestrel runs them all here, sharing its memory, as
    kestrel.distributed.launch.ranks_on_node counts them): its RAM (measured now); its bandwidth and float32 rate
    from `speed` (measure_cpu), unknown without it."""
    ram = device_memory(torch.device("cpu"))
    unknown = "not measured: `kestrel plan --measure` measures it"
    seen = None if speed is None else f"measured now on {speed.threads} torch thread(s) (kestrel plan --measure)"
    facts = {
        "memory": Fact(ram / 2**20, "MiB", "measured", "this machine (os.sysconf)"),
        "memory_bandwidth": (Fact(None, "TB/s", "unknown", unknown) if speed is None
                             else Fact(speed.bandwidth / 1e12, "TB/s", "measured", f"a copy, {seen}")),
        "fp32_dense": (Fact(None, "TFLOPS", "unknown", unknown) if speed is None
                       else Fact(speed.flop_rate / 1e12, "TFLOPS", "measured", f"float32 matmuls, {seen}")),
        "bf16_dense": Fact(None, "TFLOPS", "unknown", unknown),
        "fp8_dense": Fact(None, "TFLOPS", "unknown", unknown),
        "fp4_dense": Fact(None, "TFLOPS", "unknown", unknown),
        "scale_up_bandwidth": Fact(None, "GB/s", "none", "one machine"),
        "devices_per_node": Fact(1, "per machine", "measured", "this machine"),
        "scale_up_domain": Fact(1, "per machine", "measured", "this machine"),
        "native_fp4": Fact(None, "", "unknown", unknown),
        "ranks_per_device": Fact(ranks, "ranks", "measured", "kestrel's ranks of one CPU instance share the machine"),
    }
    return Device(id=CPU, name="this machine's CPU", vendor="", section="", cuda_names=(), facts=facts)


def get_device(device_id: str) -> Device:
    """The catalog device `device_id` (or `cpu`: this machine); a ValueError lists the choices otherwise."""
    if device_id == CPU:
        return local_cpu()
    devices = catalog()
    if device_id not in devices:
        raise ValueError(f"unknown hardware {device_id!r}; choose one of: {', '.join([*devices, CPU])}.")
    return devices[device_id]


def device_for_cuda_name(name: str) -> Device | None:
    """The catalog device whose name torch reports as `name` (longest match wins: GB300 before B300)."""
    matches = [(len(n), d) for d in catalog().values() for n in d.cuda_names if n.lower() in name.lower()]
    return max(matches, key=lambda m: m[0])[1] if matches else None
