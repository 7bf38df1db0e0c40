"""Reading a function result back from any device to the host."""
from __future__ import annotations

import numpy as np
import iree.runtime as rt


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
