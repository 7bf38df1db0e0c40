"""Whether a bundle fits the Vulkan device it opens on, checked before anything runs.

A dispatch may bind a whole tensor: a parameter, a piece's logits or hidden states, a state tensor.
Each must fit one storage-buffer binding (compiler/device_limits.py says why that limit matters);
the parameters together must fit the device's memory. The MLA caches are one tensor (all MLA
layers stacked, exporter/export.py ``example_state``) that grows by a row per token, so the binding
limit also bounds the context: the session stops a sequence before its cache would outgrow it.
Tensors the program makes and frees inside a step are not counted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

from ..compiler.device_limits import DeviceLimits
from ..errors import K3Error

STATE_TENSOR = re.compile(r"\(([\d, ]+)\):(\w+)")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``bfloat16``, ``float8_e8m0fnu``, ``uint8``, ``bool``)."""
    bits = re.search(r"\d+", dtype)
    return int(bits.group()) // 8 if bits else 1


@dataclass
class Footprint:
    tensors: list[tuple[str, int]]      # what a dispatch may bind whole: name, bytes
    parameter_bytes: int
    cache_bytes_per_token: int          # of the stacked MLA caches; 0 without MLA layers or state text


def footprint(manifest) -> Footprint:
    """The bundle's tensors from its manifest: parameters as the module reads them, the prefill
    outputs at ``max_prompt`` tokens, the state tensors as the ``state`` signature lists them (the
    MLA caches, the one four-dimensional entry, listed one token long)."""
    cfg, batch, T = manifest.config, manifest.batch, manifest.max_prompt
    params = [(name, dtype_bytes(dtype) * prod(shape)) for name, (dtype, shape) in manifest.parameters.items()]
    tensors = params + [("the logits of a prompt piece", batch * T * cfg["vocab_size"] * 4)]
    if "hidden [" in manifest.entry_points.get("prefill", ""):
        tensors.append(("the hidden states of a prompt piece",
                        cfg["num_hidden_layers"] * batch * T * cfg["hidden_size"] * 4))
    per_token = 0
    for dims, dtype in STATE_TENSOR.findall(manifest.entry_points.get("state", "")):
        shape = [int(d) for d in dims.split(",") if d.strip()]
        if len(shape) == 4:
            per_token = dtype_bytes(dtype) * prod(shape)
        else:
            tensors.append((f"the state tensor {shape}", dtype_bytes(dtype) * prod(shape)))
    return Footprint(tensors, sum(b for _, b in params), per_token)


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def fit(manifest, limits: DeviceLimits, where: str) -> tuple[int, str]:
    """The longest context the device holds (the config's, or less when one binding cannot hold the
    MLA caches that long) and, when less, why. K3Error in one line when a tensor or the parameters
    cannot fit at all."""
    need = footprint(manifest)
    limit, limit_name = limits.binding_limit()
    name, size = max(need.tensors, key=lambda t: t[1])
    if size > limit:
        hint = " (compile with a smaller --max-prompt)" if "prompt piece" in name else ""
        raise K3Error(f"device: {where} binds {name} of {mib(size)}, over the {limit_name} of "
                      f"{limits.name!r} ({mib(limit)}){hint}")
    if need.parameter_bytes > limits.device_memory:
        raise K3Error(f"device: {where} reads {mib(need.parameter_bytes)} of parameters, more than the device-local "
                      f"memory of {limits.name!r} ({mib(limits.device_memory)})")
    context = manifest.config["max_position_embeddings"]
    if need.cache_bytes_per_token and need.cache_bytes_per_token * context > limit:
        tokens = limit // need.cache_bytes_per_token
        return tokens, (f"the MLA caches of more than {tokens:,} tokens would outgrow the {limit_name} of "
                        f"{limits.name!r} ({mib(limit)})")
    return context, ""
