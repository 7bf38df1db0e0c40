"""The devices this host has, and the Vulkan profile that fits one.

Device names come from IREE's drivers (``query_available_devices``). A Vulkan module only runs right
on a device of the SPIR-V profile it was compiled for (llvmpipe's reductions go wrong under rdna3 or
valhall code), so a bundle's profile is checked against the device before it runs.
"""
from __future__ import annotations

from functools import cache

import iree.runtime as rt

from ..errors import K3Error
from . import cpu

# Vulkan profile of a device, by a word in its driver-reported name; first match wins.
VULKAN_PROFILE_OF_NAME = (("llvmpipe", "llvmpipe"), ("Mali", "valhall"), ("Radeon", "rdna3"), ("NVIDIA", "ampere"))


@cache
def devices(driver: str) -> tuple[str, ...]:
    """Names of the devices ``driver`` sees here; () when the driver or its library is missing."""
    try:
        found = rt.get_driver(driver).query_available_devices()
    except (RuntimeError, ValueError):
        return ()
    return tuple(d["name"] for d in found)


def open_devices(driver: str, n: int) -> list:
    """``n`` distinct devices of ``driver``, in program order (``@__device_0`` first): the driver's
    first ``n`` devices, or for a CPU driver ``n`` local devices (``create_default_device`` makes a
    new one each call; ``rt.get_device`` would return one cached device ``n`` times)."""
    d = rt.get_driver(driver)
    if driver.startswith("local"):
        return [d.create_default_device() for _ in range(n)]
    return [d.create_device(info["device_id"]) for info in d.query_available_devices()[:n]]


def vulkan_profile(name: str) -> str | None:
    """The ``--iree-vulkan-target`` profile for a Vulkan device name, or None if none is known."""
    return next((profile for word, profile in VULKAN_PROFILE_OF_NAME if word in name), None)


def detect_vulkan_profile() -> str:
    """The profile of the first Vulkan device here (what ``--target vulkan`` compiles for)."""
    found = devices("vulkan")
    if not found:
        raise K3Error("target: vulkan without a profile needs a Vulkan device here to detect it, and there is "
                      "none; name one, e.g. vulkan:llvmpipe")
    profile = vulkan_profile(found[0])
    if profile is None:
        raise K3Error(f"target: no known Vulkan profile for device {found[0]!r}; name one, e.g. vulkan:rdna3")
    return profile


def check_device(target) -> None:
    """Refuse, with K3Error, to run a module compiled for ``target`` (a compiler.targets.Target)
    where its driver has no device or fewer than the target's ``devices`` (a CPU driver makes any
    number of local devices), or where the Vulkan device a session opens (the driver's first) is not
    of the target's profile, or where this CPU lacks a feature the module's code uses (a CPU
    target's ``cpu_features``: running it would end in SIGILL)."""
    lacking = cpu.missing(target.cpu_features) if target.backend == "llvm-cpu" else []
    if lacking:
        raise K3Error(f"device: the bundle's code ({target.name}) needs CPU features this CPU lacks: "
                      f"{', '.join(lacking)}; compile it here with --target cpu, or for a level this CPU has "
                      f"(k3c targets)")
    found = devices(target.driver)
    if not found:
        raise K3Error(f"device: no {target.driver} device here to run a {target.name} bundle")
    if target.devices > len(found) and not target.driver.startswith("local"):
        raise K3Error(f"device: the bundle runs on {target.devices} {target.driver} devices and this host has "
                      f"{len(found)}; compile it with --devices {len(found)}")
    if target.driver == "vulkan":
        here = vulkan_profile(found[0])
        if target.name != f"vulkan:{here}":
            raise K3Error(f"device: bundle compiled for {target.name} but the Vulkan device here is "
                          f"{found[0]!r} (profile {here or 'unknown'}); recompile with --target vulkan")
