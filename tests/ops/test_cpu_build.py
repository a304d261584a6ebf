"""kestrel.ops.cpu's build: where the C++ compiler is missing or fails, load() logs why and returns False, so that
callers take their torch paths (the kernels' results are tested with their ops: test_moe_experts,
test_kda_decode_step, test_linear_rows), and the cache holds no partial library; the ISA flags are inductor's,
picked or remembered; the sources split into about equal units, one per core; a build for AVX2 passes the kernel
tests too; prune, which a build runs, leaves the most recently used libraries only."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kestrel.ops.cpu as cpu


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"])
def test_a_failed_build_leaves_the_torch_paths(compiler: str, tmp_path, monkeypatch, caplog) -> None:
    flags = cpu._isa_flags()        # picked with the working compiler (inductor remembers the compiler it found)
    monkeypatch.setattr(cpu, "_isa_flags", lambda: flags)
    monkeypatch.setattr(cpu, "CACHE", tmp_path / "cpu-kernels")
    monkeypatch.setenv("CXX", str(tmp_path / compiler) if compiler.startswith("no-") else compiler)
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        assert cpu._load.__wrapped__() is False
    assert "kestrel's CPU kernels failed to build, using the torch paths" in caplog.text
    assert not any((tmp_path / "cpu-kernels").glob("*.so"))


def _inductors_flags() -> list[str]:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return [*isa.build_arch_flags().split(), *(f"-D{m}" for m in isa.build_macro())] if isa else []


def test_the_isa_flags_are_inductors_picked_or_remembered(tmp_path, monkeypatch) -> None:
    """The flags come from inductor's pick the first time, then from the memo it leaves (per CPU, compiler, torch
    and ATEN_CPU_CAPABILITY); a damaged memo is picked again and rewritten."""
    monkeypatch.setattr(cpu, "CACHE", tmp_path)
    assert cpu._isa_flags() == _inductors_flags()
    memo, = tmp_path.glob("isa-*.json")
    assert json.loads(memo.read_text()) == _inductors_flags()
    memo.write_text(json.dumps(["-mremembered"]))
    assert cpu._isa_flags() == ["-mremembered"]
    memo.write_text("[damaged")
    assert cpu._isa_flags() == _inductors_flags() == json.loads(memo.read_text())
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert cpu._isa_flags() == _inductors_flags() == []
    assert len(list(tmp_path.glob("isa-*.json"))) == 2


def test_an_isa_pick_that_finds_no_compiler_leaves_the_torch_paths(monkeypatch, caplog) -> None:
    def no_compiler() -> list[str]:
        raise RuntimeError("No working C++ compiler found")     # what inductor's pick raises (InvalidCxxCompiler)

    monkeypatch.setattr(cpu, "_isa_flags", no_compiler)
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        assert cpu._load.__wrapped__() is False
    assert "failed to build, using the torch paths: No working C++ compiler found" in caplog.text


AVX2_RUN = """
import sys
import pytest
from torch._inductor.cpu_vec_isa import pick_vec_isa
assert pick_vec_isa().build_macro() == ["CPU_CAPABILITY_AVX2"], pick_vec_isa()
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", *sys.argv[1:]]))
"""


def test_the_avx2_build_computes_the_same() -> None:
    """The kernels carry code for AVX-512 and for AVX2 (expert_matvec's MXFP4 decode, indexer_topk's transposes);
    on a CPU with AVX-512 the suite builds and tests the first, so the kernel tests, and the traced decode step that
    calls them, run again here in a process whose kernels and ATen kernels are built for AVX2
    (ATEN_CPU_CAPABILITY=avx2, which inductor's ISA choice follows). Elsewhere the suite itself tests this CPU's
    build."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if "CPU_CAPABILITY_AVX512" not in pick_vec_isa().build_macro():
        pytest.skip(f"this CPU's kernels are built for {pick_vec_isa() or 'no vector ISA'}, tested by the suite")
    tests = Path(__file__).parent
    result = subprocess.run([sys.executable, "-c", AVX2_RUN, str(tests / "test_moe_experts.py"), "-k",
                             "expert_matvec or expert_mlp or cpu_kernel", str(tests / "test_kda_decode_step.py"),
                             str(tests / "test_indexer_topk.py"), str(tests / "test_kda_chunk_terms.py"),
                             str(tests / "test_linear_rows.py"), str(tests / "test_linear_dots.py"),
                             str(tests / "test_attn_res_kernel.py"), str(tests / "test_paged_mla_kernel.py"),
                             str(tests / "test_norm_and_glu_kernels.py"),
                            f"{tests.parent}/engine/test_decode_graphs.py::test_the_traced_step_equals_the_eager_step",
                            f"{tests.parent}/engine/test_decode_graphs.py::"
                            "test_the_default_eager_step_runs_on_the_cpu_kernels_within_float32s_bound"],
                            cwd=tests.parent.parent, env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout


def test_the_sources_are_split_into_one_unit_per_core_of_about_equal_size(tmp_path) -> None:
    sizes = [900, 100, 500, 400, 300, 50]
    sources = [tmp_path / f"s{i}.cpp" for i in range(len(sizes))]
    for source, size in zip(sources, sizes):
        source.write_bytes(b"x" * size)
    for cores in (1, 2, 3, 16):
        units = cpu._units(sources, cores)
        assert len(units) == min(cores, len(sources)) and all(units)
        assert sorted(s for unit in units for s in unit) == sorted(sources)
        totals = [sum(s.stat().st_size for s in unit) for unit in units]
        assert max(totals) - min(totals) <= max(sizes)


def test_prune_keeps_the_most_recently_used_libraries_and_builds_under_way(tmp_path) -> None:
    libraries = [tmp_path / f"kestrel_cpu-{i:016x}.so" for i in range(5)]
    for age, library in enumerate(libraries):          # libraries[0] the most recently used
        library.write_bytes(b"")
        os.utime(library, (1e9 - age, 1e9 - age))
    building = tmp_path / "kestrel_cpu-ffffffffffffffff.so.123.tmp"
    building.write_bytes(b"")
    os.utime(building, (1.0, 1.0))
    cpu.prune(tmp_path, keep=3)
    assert sorted(tmp_path.iterdir()) == sorted([*libraries[:3], building])
