"""What a Vulkan device lets one program bind and allocate, as its driver reports it.

A storage-buffer binding longer than ``VkPhysicalDeviceLimits.maxStorageBufferRange`` breaks the
Vulkan spec (VUID-VkWriteDescriptorSet-descriptorType-00333): llvmpipe happens to read past it, a
GPU driver may read garbage or lose the device (docs/pipeline.md §5 has the reproducer). IREE's
Python runtime does not expose the limits, so they are read here through the Vulkan loader
(``libvulkan.so.1``) with ctypes: an instance of its own, the three queries, the instance destroyed.
Only the fields read are laid out; their byte offsets follow the C structs of ``vulkan_core.h``.
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class DeviceLimits:
    name: str                   # VkPhysicalDeviceProperties.deviceName
    max_binding: int            # maxStorageBufferRange: bytes one storage-buffer binding may span
    max_allocation: int         # VkPhysicalDeviceMaintenance3Properties.maxMemoryAllocationSize
    device_memory: int          # the largest device-local memory heap

    def binding_limit(self) -> tuple[int, str]:
        """The bytes one tensor may take when a dispatch binds it whole, and the limit's name."""
        if self.max_allocation < self.max_binding:
            return self.max_allocation, "maxMemoryAllocationSize"
        return self.max_binding, "maxStorageBufferRange"


API_1_1 = (1 << 22) | (1 << 12)
STRUCTURE_TYPE_APPLICATION_INFO, STRUCTURE_TYPE_INSTANCE_CREATE_INFO = 0, 1
STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2 = 1000059001
STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES = 1000168000
MEMORY_HEAP_DEVICE_LOCAL_BIT = 1

# VkPhysicalDeviceProperties: deviceName char[256] at 20; VkPhysicalDeviceLimits (8-byte aligned) at
# 296, maxStorageBufferRange its eighth uint32 (+28). VkPhysicalDeviceProperties2: properties at 16.
DEVICE_NAME, LIMITS, MAX_STORAGE_BUFFER_RANGE = 20, 296, 28
PROPERTIES2_BODY = 16
# VkPhysicalDeviceMaintenance3Properties: maxMemoryAllocationSize (uint64) at 24.
MAX_MEMORY_ALLOCATION_SIZE = 24
# VkPhysicalDeviceMemoryProperties: memoryHeapCount at 260, memoryHeaps[16] at 264, 16 bytes each
# ({uint64 size, uint32 flags}).
HEAP_COUNT, HEAPS, HEAP_STRIDE = 260, 264, 16


class _AppInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("pApplicationName", ctypes.c_char_p),
                ("applicationVersion", ctypes.c_uint32), ("pEngineName", ctypes.c_char_p),
                ("engineVersion", ctypes.c_uint32), ("apiVersion", ctypes.c_uint32)]


class _InstanceInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.POINTER(_AppInfo)), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


@cache
def vulkan_limits() -> tuple[DeviceLimits, ...]:
    """The limits of every Vulkan device the loader finds, in its order; () without a loader or a device."""
    try:
        vk = ctypes.CDLL("libvulkan.so.1")
    except OSError:
        return ()
    app = _AppInfo(STRUCTURE_TYPE_APPLICATION_INFO, None, b"k3c", 0, b"k3c", 0, API_1_1)
    info = _InstanceInfo(STRUCTURE_TYPE_INSTANCE_CREATE_INFO, None, 0, ctypes.pointer(app), 0, None, 0, None)
    instance = ctypes.c_void_p()
    if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance)) != 0:
        return ()
    try:
        count = ctypes.c_uint32()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * count.value)()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles)
        return tuple(_read(vk, ctypes.c_void_p(h)) for h in handles[:count.value])
    finally:
        vk.vkDestroyInstance(instance, None)


def _read(vk, device) -> DeviceLimits:
    maintenance3 = ctypes.create_string_buffer(64)
    struct.pack_into("<i", maintenance3, 0, STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES)
    properties = ctypes.create_string_buffer(4096)
    struct.pack_into("<i", properties, 0, STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2)
    struct.pack_into("<Q", properties, 8, ctypes.addressof(maintenance3))     # pNext
    vk.vkGetPhysicalDeviceProperties2(device, properties)
    memory = ctypes.create_string_buffer(1024)
    vk.vkGetPhysicalDeviceMemoryProperties(device, memory)
    body = PROPERTIES2_BODY
    name = properties.raw[body + DEVICE_NAME:body + DEVICE_NAME + 256].split(b"\0")[0].decode(errors="replace")
    heaps = [struct.unpack_from("<QI", memory.raw, HEAPS + HEAP_STRIDE * i)
             for i in range(struct.unpack_from("<I", memory.raw, HEAP_COUNT)[0])]
    return DeviceLimits(
        name=name,
        max_binding=struct.unpack_from("<I", properties.raw, body + LIMITS + MAX_STORAGE_BUFFER_RANGE)[0],
        max_allocation=struct.unpack_from("<Q", maintenance3.raw, MAX_MEMORY_ALLOCATION_SIZE)[0],
        device_memory=max((size for size, flags in heaps if flags & MEMORY_HEAP_DEVICE_LOCAL_BIT), default=0))


def limits_of(device_name: str) -> DeviceLimits | None:
    """The limits of the Vulkan device IREE names ``device_name`` (IREE appends the driver's version
    to the Vulkan device name); None when the loader does not list it."""
    return next((d for d in vulkan_limits() if d.name and device_name.startswith(d.name)), None)
