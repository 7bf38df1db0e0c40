"""The devices this host has, the Vulkan profile that fits one, and reading results back from any of them.

Device names come from IREE's drivers (``query_available_devices``). A Vulkan module only runs right
on a device of the SPIR-V profile it was compiled for (llvmpipe's reductions go wrong under rdna3 or
valhall code), so a bundle's profile is checked against the device before it runs.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import iree.runtime as rt

from ..errors import K3Error

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
    """Refuse, with K3Error, to run a module compiled for ``target`` (a runtimes.targets.Target)
    where its driver has no device, or where the Vulkan device a session opens (the driver's first)
    is not of the target's profile."""
    found = devices(target.driver)
    if not found:
        raise K3Error(f"device: no {target.driver} device here to run a {target.name} bundle")
    if target.driver == "vulkan":
        here = vulkan_profile(found[0])
        if target.name != f"vulkan:{here}":
            raise K3Error(f"device: bundle compiled for {target.name} but the Vulkan device here is "
                          f"{found[0]!r} (profile {here or 'unknown'}); recompile with --target vulkan")


def read_back(array: rt.DeviceArray) -> np.ndarray:
    """A host copy of a function result. ``DeviceArray.to_host`` imports numpy memory into the
    device, which Vulkan refuses unless it is page aligned; this copies through a staging buffer
    the device allocates itself (or maps directly when the result is host visible already)."""
    device, view = array._device, array._buffer_view  # DeviceArray keeps both private
    dtype = rt.HalElementType.map_to_dtype(view.element_type)
    source = view.get_buffer()
    host_visible = int(rt.MemoryType.HOST_VISIBLE)
    mappable = int(rt.BufferUsage.MAPPING_SCOPED)
    if source.memory_type() & host_visible == host_visible and source.allowed_usage() & mappable == mappable:
        return np.array(view.map().asarray(view.shape, dtype))
    staging = device.allocator.allocate_buffer(
        memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
        allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
        allocation_size=source.byte_length())
    done = device.create_semaphore(0)
    device.queue_copy(source, staging, wait_semaphores=rt.HalFence.create_at(done, 0),
                      signal_semaphores=rt.HalFence.create_at(done, 1))
    rt.HalFence.create_at(done, 1).wait()
    return np.array(staging.map().asarray(view.shape, dtype))
