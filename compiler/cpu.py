"""CPU levels: what a ``cpu`` target's code may use, the one place that maps a target to its features.

A level is a named x86-64 instruction-set level (the psABI's micro-architecture levels, which LLVM
and GCC know by the same names):

    x86-64      the baseline every x86-64 runs (SSE2)
    x86-64-v3   AVX2, FMA, F16C, BMI1/2, MOVBE, LZCNT (Haswell, Zen 1 and later)
    x86-64-v4   v3 and AVX-512 F/BW/CD/DQ/VL (Skylake-SP, Zen 4 and later)

iree-compile is told the level (``--iree-llvmcpu-target-cpu=<level>``) and the native kernels are
built for it (``-march=<level>``), so a module of a level runs on every CPU that has the level's
features, whichever machine compiled it. ``cpu`` is this host: iree-compile is told ``host`` and
the module may use every feature this CPU has; its lowerings are those of the highest level the
host reaches. Lowerings ask ``lowering_level``; nothing reads the build host's CPU behind a
target's back.

Features are spelled as Linux's /proc/cpuinfo spells them (``abm`` is LZCNT).
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class Level:
    name: str                  # as LLVM and GCC spell it: x86-64, x86-64-v3, x86-64-v4
    features: tuple[str, ...]  # what its code needs, beyond the x86-64 baseline
    summary: str


LEVELS = {level.name: level for level in (
    Level("x86-64", (), "any x86-64 (SSE2)"),
    Level("x86-64-v3", V3, "AVX2, FMA, F16C (Haswell, Zen 1 and later)"),
    Level("x86-64-v4", V3 + V4, "AVX-512 F/BW/CD/DQ/VL (Skylake-SP, Zen 4 and later)"),
)}

# The instruction-set extensions a module compiled for ``host`` may use (cpuinfo names): what a
# bundle of the ``cpu`` target records and checks on open. Flags outside this list (hypervisor,
# power management, vulnerabilities) say nothing about which instructions run.
ISA = frozenset({
    "sse3", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "aes", "pclmulqdq", "sha_ni", "rdrand", "rdseed",
    "adx", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "xsave", "vaes", "vpclmulqdq", "gfni",
    "avx_vnni", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512ifma", "avx512vbmi",
    "avx512_vbmi2", "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8",
})


@functools.cache
def host_features() -> frozenset[str]:
    """This CPU's instruction-set extensions (ISA names from /proc/cpuinfo); empty off x86-64 Linux."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return frozenset(flags) & ISA


def is_x86_host() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def highest_level(features: frozenset[str]) -> Level | None:
    """The highest level whose features ``features`` holds (None off x86-64)."""
    if not is_x86_host():
        return None
    return max((lv for lv in LEVELS.values() if set(lv.features) <= features), key=lambda lv: len(lv.features))


def missing(needed: tuple[str, ...] | list[str]) -> list[str]:
    """The features of ``needed`` this CPU lacks."""
    return [f for f in needed if f not in host_features()]
