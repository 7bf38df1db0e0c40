"""A bundle against the Vulkan device's limits (compiler/device_limits.py, runtimes/device_fit.py):
the figures by hand from a manifest, llvmpipe's limits as Mesa sets them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import needs_vulkan_run  # tests/ is on sys.path
from k3c.compiler.device_limits import DeviceLimits, limits_of, vulkan_limits
from k3c.compiler.devices import devices
from k3c.errors import K3Error
from k3c.runtimes.device_fit import dtype_bytes, fit, footprint

# k3-tiny's state signature text as export writes it (2 KDA layers' conv windows and S matrices, the
# 2 MLA layers' caches one token long)
STATE = "(2, 1, 3, 256, 3):bfloat16, (2, 1, 4, 64, 64):float32, (2, 1, 1, 40):bfloat16"


def manifest(max_prompt: int = 32, **parameters):
    return SimpleNamespace(
        config={"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "max_position_embeddings": 4096},
        batch=1, max_prompt=max_prompt, parameters=parameters,
        entry_points={"prefill": "(tokens [1, T<= 32] int64) -> (logits [1, T, 512] f32, hidden [4, 1, T, 64], "
                                 "state...)", "state": STATE})


def limits(binding: int, allocation: int = 2**31, memory: int = 2**31) -> DeviceLimits:
    return DeviceLimits("a device", binding, allocation, memory)


def test_dtype_bytes():
    assert [dtype_bytes(d) for d in ("float32", "bfloat16", "float8_e8m0fnu", "uint8", "int64", "bool")] == \
        [4, 2, 1, 1, 8, 1]


def test_footprint_by_hand():
    f = footprint(manifest(embed=["bfloat16", [512, 64]], packed=["uint8", [3, 8, 16]]))
    assert f.tensors == [
        ("embed", 512 * 64 * 2), ("packed", 3 * 8 * 16),
        ("the logits of a prompt piece", 32 * 512 * 4),
        ("the hidden states of a prompt piece", 4 * 32 * 64 * 4),
        ("the state tensor [2, 1, 3, 256, 3]", 2 * 3 * 256 * 3 * 2),
        ("the state tensor [2, 1, 4, 64, 64]", 2 * 4 * 64 * 64 * 4)]
    assert f.parameter_bytes == 512 * 64 * 2 + 3 * 8 * 16
    assert f.cache_bytes_per_token == 2 * 40 * 2


def test_a_tensor_over_the_binding_limit_is_refused_naming_the_limit():
    with pytest.raises(K3Error, match=r"^device: b binds the state tensor \[2, 1, 4, 64, 64\] of 0\.1 MiB, over "
                                      r"the maxStorageBufferRange of 'a device' \(0\.1 MiB\)$"):
        fit(manifest(embed=["bfloat16", [512, 64]]), limits(2**17 - 1), "b")
    with pytest.raises(K3Error, match=r"binds the logits of a prompt piece of 0\.2 MiB, .* smaller --max-prompt"):
        fit(manifest(128, embed=["bfloat16", [512, 64]]), limits(2**18 - 1), "b")
    with pytest.raises(K3Error, match="binds embed .* over the maxMemoryAllocationSize"):
        fit(manifest(embed=["float32", [512, 1024]]), limits(2**30, allocation=2**20), "b")


def test_parameters_over_the_device_memory_are_refused():
    with pytest.raises(K3Error, match="reads 4.0 MiB of parameters, more than the device-local memory"):
        fit(manifest(a=["float32", [2**19]], b=["float32", [2**19]]), limits(2**30, memory=3 * 2**20), "b")


def test_the_context_is_what_one_binding_holds_of_the_mla_caches():
    m = manifest(embed=["bfloat16", [512, 64]])
    assert fit(m, limits(2**30), "b") == (4096, "")
    tokens, why = fit(m, limits(2**17), "b")     # the largest fixed tensor: the S matrices, 128 KiB
    assert tokens == 2**17 // 160 and f"more than {tokens:,} tokens" in why and "maxStorageBufferRange" in why


@needs_vulkan_run
def test_limits_of_llvmpipe_as_mesa_sets_them():
    """Mesa 22.3's lavapipe: maxStorageBufferRange 1 << 27, maxMemoryAllocationSize 1 << 31."""
    found = limits_of(devices("vulkan")[0])
    assert found is not None and found in vulkan_limits()
    if not found.name.startswith("llvmpipe"):
        pytest.skip(f"the Vulkan device here is {found.name!r}, not llvmpipe")
    assert (found.max_binding, found.max_allocation) == (1 << 27, 1 << 31)
    assert found.device_memory > 0
