"""Targets: what ``--target`` accepts, the iree-compile flags for each, and what this host can run.

    cpu                 llvm-cpu for this host's CPU (driver local-task); the lowerings of the
                        highest CPU level it reaches (compiler/cpu.py)
    cpu:<level>         llvm-cpu for every CPU of a level: x86-64 (any x86-64), x86-64-v3 (AVX2,
                        FMA, F16C), x86-64-v4 (AVX-512); compiles on any machine, runs where
                        the CPU has the level's features
    cuda[:sm_XX]        NVIDIA (driver cuda); default sm_80. IREE 3.13 has no sm_90 target:
                        cuda:sm_90 compiles for sm_80, whose code Hopper runs, with a warning
    rocm[:gfxXXX]       AMD (driver hip); default gfx942
    vulkan[:profile]    SPIR-V (driver vulkan); no profile = the profile of the device present
                        (compiler/devices.py); a module runs right only on a device of its profile
"""
from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import cache

from ..errors import K3Error
from . import cpu, devices

ROCM_CHIPS = ("gfx90a", "gfx942", "gfx1100")
CUDA_CHIPS = ("sm_80", "sm_86", "sm_89")
VULKAN_PROFILES = ("llvmpipe", "rdna3", "ampere", "valhall")


@dataclass(frozen=True)
class Target:
    name: str        # canonical spelling, e.g. "cuda:sm_80"
    backend: str     # IREE HAL target backend
    driver: str      # IREE runtime driver
    flags: tuple[str, ...]
    note: str = ""   # a warning worth printing when this target is chosen
    devices: int = 1  # devices of the driver one program runs on (routed experts split over them)
    level: str = ""   # llvm-cpu: the CPU level whose lowerings the ops take ("" for none: the baseline's)
    cpu_features: tuple[str, ...] = ()   # llvm-cpu: the CPU features its code may use (compiler/cpu.py)

    def to_dict(self) -> dict:
        """The target as the manifest and the cache keys hold it (``devices`` only when above one,
        the CPU fields only on CPU targets)."""
        d = {**asdict(self), "flags": list(self.flags), "cpu_features": list(self.cpu_features)}
        if self.devices == 1:
            del d["devices"]
        if self.backend != "llvm-cpu":
            del d["level"], d["cpu_features"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Target":
        """The target a manifest holds (``to_dict``'s inverse)."""
        return cls(**{**d, "flags": tuple(d["flags"]), "cpu_features": tuple(d.get("cpu_features", ()))})

    @property
    def lowering_keys(self) -> tuple[str, ...]:
        """The keys of an op's lowering table this target reads, first match wins (ops/base.py):
        its name, its CPU level's target name, its backend."""
        return (self.name, *((f"cpu:{self.level}",) if self.level else ()), self.backend)


def _local(cpu: str) -> tuple[str, ...]:
    return ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
            f"--iree-llvmcpu-target-cpu={cpu}")


# extra iree-compile flags of a program over several devices: const-expr hoisting would evaluate
# expressions of the pinned parameters at load time without their placement (IREE 3.13)
MULTI_DEVICE_FLAGS = ("--iree-opt-const-expr-hoisting=false",)
MAX_DEVICES = 1024   # devices one program may span: far above any host, checked before a flag is made


def on_devices(target: Target, n: int) -> Target:
    """``target`` over ``n`` devices of its driver: one ``--iree-hal-target-device=<kind>[i]`` per
    device (``@__device_i`` in the program), README "Past one device"."""
    if not 1 <= n <= MAX_DEVICES:
        raise K3Error(f"target: --devices must be from 1 to {MAX_DEVICES}, got {n}")
    if n == 1:
        return target
    if target.driver == "vulkan":
        raise K3Error("target: --devices takes cpu, cuda or rocm targets; vulkan runs on one device")
    device = next(f for f in target.flags if f.startswith("--iree-hal-target-device="))
    kind = device.split("=", 1)[1]
    flags = [f for f in target.flags if f != device]
    return replace(target, devices=n, flags=(*(f"--iree-hal-target-device={kind}[{i}]" for i in range(n)),
                                            *flags, *MULTI_DEVICE_FLAGS))


def cpu_target(arch: str) -> Target:
    """``cpu`` ("" or "host": this CPU, every feature it has) or ``cpu:<level>``."""
    if arch in ("", "host"):
        here = cpu.highest_level(cpu.host_features())
        return Target("cpu", "llvm-cpu", "local-task", _local("host"), level=here.name if here else "",
                      cpu_features=tuple(sorted(cpu.host_features())))
    if arch not in cpu.LEVELS:
        raise K3Error(f"target: unknown CPU level {arch!r} in 'cpu:{arch}' (use cpu, or cpu: with one of "
                      f"{', '.join(cpu.LEVELS)})")
    level = cpu.LEVELS[arch]
    return Target(f"cpu:{arch}", "llvm-cpu", "local-task", _local(arch), level=arch, cpu_features=level.features)


def parse_target(spec: str) -> Target:
    """``cpu``, ``cpu:<level>``, ``cuda[:sm_XX]``, ``rocm[:gfxXXX]``, ``vulkan[:profile]`` -> Target.
    ``vulkan`` alone takes the profile of the Vulkan device here (K3Error when there is none)."""
    kind, _, arch = spec.partition(":")
    if kind == "cpu":
        return cpu_target(arch)
    if kind == "cuda":
        arch = arch or "sm_80"
        note = ""
        if arch == "sm_90":
            arch, note = "sm_80", "IREE 3.13 has no sm_90 target; compiling for sm_80, which Hopper runs"
        if arch not in CUDA_CHIPS:
            raise K3Error(f"target: unsupported CUDA arch {arch!r} (known: {', '.join(CUDA_CHIPS)}, sm_90)")
        return Target(f"cuda:{arch}", "cuda", "cuda",
                      ("--iree-hal-target-device=cuda", f"--iree-cuda-target={arch}"), note)
    if kind == "rocm":
        arch = arch or "gfx942"
        if arch not in ROCM_CHIPS:
            raise K3Error(f"target: unsupported ROCm chip {arch!r} (known: {', '.join(ROCM_CHIPS)})")
        return Target(f"rocm:{arch}", "rocm", "hip", ("--iree-hal-target-device=hip", f"--iree-rocm-target={arch}"))
    if kind == "vulkan":
        arch = arch or devices.detect_vulkan_profile()
        if arch not in VULKAN_PROFILES:
            raise K3Error(f"target: unknown Vulkan profile {arch!r} (known: {', '.join(VULKAN_PROFILES)})")
        return Target(f"vulkan:{arch}", "vulkan-spirv", "vulkan",
                      ("--iree-hal-target-device=vulkan", f"--iree-vulkan-target={arch}"))
    raise K3Error(f"target: unknown target {spec!r} (use cpu, cpu:x86-64[-v3|-v4], cuda[:sm_XX], rocm[:gfxXXX], "
                  "vulkan[:profile])")


def _die_with(parent: int) -> None:
    """In the iree-compile child, before exec: ask Linux to SIGKILL it when k3c (``parent``) dies,
    however k3c dies (prctl(2) PR_SET_PDEATHSIG); if k3c is already gone, stop."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def compile_mlir(mlir: str, target: Target, log=print) -> bytes:
    """iree-compile a torch-dialect module (custom ops already lowered) for ``target``: the command
    line iree.compiler.compile_str would run, run as a child that dies with k3c (SIGKILL included;
    on SIGTERM or Ctrl-C subprocess.run kills it as the exception passes)."""
    # deferred heavy import (~0.3 s): a session on the run path needs the targets, not the compiler
    from iree.compiler.tools.core import CompilerOptions, build_compile_command_line
    from iree.compiler.tools.debugging import TempFileSaver

    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with TempFileSaver.implicit() as tfs:
        command = build_compile_command_line("-", tfs, CompilerOptions(input_type="torch",
                                                                         extra_args=list(target.flags)))
    done = subprocess.run(command, input=mlir.encode(), capture_output=True,
                          preexec_fn=functools.partial(_die_with, os.getpid()))
    if done.returncode != 0:
        text = done.stderr.decode(errors="replace")
        lines = text.splitlines() or [f"exit status {done.returncode}"]
        first = next((line for line in lines if "error:" in line), lines[0])
        raise K3Error(f"compile: iree-compile failed for {target.name}: {first.strip()[:300]}")
    vmfb = done.stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    log(f"iree-compile for {target.name}: {len(vmfb) / 1e6:.2f} MB in {time.perf_counter() - t0:.1f}s "
        f"({cpu:.1f}s CPU, peak RSS of compiler children so far {after.ru_maxrss / 1024:.0f} MiB)")
    return vmfb


# every target --target names, one per chip or profile (cuda:sm_90 is cuda:sm_80)
KNOWN_TARGETS = ("cpu", *(f"cpu:{level}" for level in cpu.LEVELS), *(f"cuda:{c}" for c in CUDA_CHIPS), *(f"rocm:{c}" for c in ROCM_CHIPS),
                 *(f"vulkan:{p}" for p in VULKAN_PROFILES))

PROBE = """func.func @probe(%x: tensor<4x8xf32>) -> tensor<4xf32> {
  %zero = arith.constant dense<0.0> : tensor<4xf32>
  %sum = linalg.reduce ins(%x : tensor<4x8xf32>) outs(%zero : tensor<4xf32>) dimensions = [1]
    (%a: f32, %b: f32) { %s = arith.addf %a, %b : f32  linalg.yield %s : f32 }
  return %sum : tensor<4xf32>
}"""


@cache
def compiles_here(target: Target) -> bool:
    """Whether this iree-compile builds a small reduction for ``target`` (probed once per process)."""
    try:
        compile_mlir(PROBE, target, log=lambda _: None)
    except (K3Error, ImportError):   # ImportError: iree-base-compiler is not installed here
        return False
    return True


def runs_here(target: Target) -> bool:
    """Whether ``target``'s driver has a device here that its modules run on."""
    try:
        devices.check_device(target)
    except K3Error:
        return False
    return True


@dataclass
class TargetStatus:
    """One row of ``k3c targets``; the last three are filled by ``--validate`` (runtimes/validate.py)."""
    target: Target
    compiles: bool            # the probe compile
    runs: bool                # a device of the driver (and profile) is here
    device: str               # the driver's first device, or "-"
    validated: str = "not run: no matching device"   # or "PASS" / "FAIL"
    max_abs: float | None = None            # worst step's max abs logit error
    tolerance: float | None = None


def target_statuses() -> list[TargetStatus]:
    """Every known target probed here. The probes compile in parallel (each an iree-compile process)."""
    from rich.console import Console  # deferred: only `k3c targets` draws progress
    from rich.progress import track

    targets = [parse_target(spec) for spec in KNOWN_TARGETS]
    with ThreadPoolExecutor() as pool:
        compiles = list(track(pool.map(compiles_here, targets), total=len(targets),
                              description="probing iree-compile", transient=True,
                              console=Console(stderr=True)))
    rows = []
    for t, ok in zip(targets, compiles):
        found = devices.devices(t.driver)
        rows.append(TargetStatus(t, ok, runs_here(t), found[0] if found else "-"))
    return rows
