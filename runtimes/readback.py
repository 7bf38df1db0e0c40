"""Calling a compiled function on a device and reading its results back to the host, through
iree.runtime's public API: the VM context's ``invoke`` on ``VmVariantList``s of ``HalBufferView``s.

Results stay on the device as buffer views (the session passes the state back in as it is); only
what ``read_back`` copies comes to the host.
"""
from __future__ import annotations

import numpy as np
import iree.runtime as rt

from ..errors import K3Error


def to_device(device: rt.HalDevice, array: np.ndarray) -> rt.HalBufferView:
    """A device-local copy of ``array``."""
    array = np.ascontiguousarray(array)
    return device.allocator.allocate_buffer_copy(
        memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT, device=device,
        buffer=array, element_type=rt.array_interop.map_dtype_to_element_type(array.dtype))


class DeviceFunction:
    """Function ``name`` of module ``module`` in ``context``: called with numpy arrays (copied to
    the device) or buffer views already there; returns the results as buffer views. A failure on
    the device (a lost device, a runtime assertion of the program) is one K3Error naming the
    function."""

    def __init__(self, context: rt.SystemContext, module: str, name: str):
        self.name = name
        self.device = context.config.device
        self.function = context.modules[module].vm_module.lookup_function(name)
        self._vm_context = context.vm_context

    def __call__(self, *args, at: str = "") -> list[rt.HalBufferView]:
        """``at``: where in the sequence the call is (for the error line), e.g. "tokens 0-9"."""
        inputs = rt.VmVariantList(len(args))
        for a in args:
            inputs.push_ref(a if isinstance(a, rt.HalBufferView) else to_device(self.device, a))
        outputs = rt.VmVariantList(8)
        try:
            self._vm_context.invoke(self.function, inputs, outputs)
        except (RuntimeError, ValueError) as e:   # the runtime raises ValueError for INVALID_ARGUMENT
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            why = (lines[0] if lines else type(e).__name__).removeprefix("Error invoking function: ")
            where = f" at {at}" if at else ""
            raise K3Error(f"run: {self.name}{where} failed on the device: {why[:300]}") from None
        return [outputs.get_as_object(i, rt.HalBufferView) for i in range(len(outputs))]


def load(config: rt.Config, *modules: rt.VmModule) -> rt.SystemContext:
    """A context of ``modules`` (dependencies first) on ``config``'s device."""
    return rt.SystemContext(vm_modules=list(modules), config=config)


def read_back(device: rt.HalDevice, view: rt.HalBufferView, last: bool = False) -> np.ndarray:
    """A host copy of a result (with ``last``, of its last row along axis -2 only: a prompt's last
    logits). Mapped directly when the device made it host visible, and then only what is kept is
    copied; otherwise copied whole into a staging buffer the device allocates itself (Vulkan refuses
    to import numpy memory that is not page aligned, which importing it to copy into would need)."""
    dtype = rt.HalElementType.map_to_dtype(view.element_type)
    source = view.get_buffer()
    host_visible = int(rt.MemoryType.HOST_VISIBLE)
    mappable = int(rt.BufferUsage.MAPPING_SCOPED)
    if source.memory_type() & host_visible == host_visible and source.allowed_usage() & mappable == mappable:
        mapped = view.map().asarray(view.shape, dtype)
        return np.array(mapped[..., -1:, :] if last else mapped)
    whole = staged_copy(device, view)
    return np.ascontiguousarray(whole[..., -1:, :]) if last else whole


def staged_copy(device: rt.HalDevice, view: rt.HalBufferView) -> np.ndarray:
    """``view``'s contents copied by the device into a host-local staging buffer, then mapped."""
    source = view.get_buffer()
    staging = device.allocator.allocate_buffer(
        memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
        allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
        allocation_size=source.byte_length())
    done = device.create_semaphore(0)
    device.queue_copy(source, staging, wait_semaphores=rt.HalFence.create_at(done, 0),
                      signal_semaphores=rt.HalFence.create_at(done, 1))
    rt.HalFence.create_at(done, 1).wait()
    return np.array(staging.map().asarray(view.shape, rt.HalElementType.map_to_dtype(view.element_type)))
