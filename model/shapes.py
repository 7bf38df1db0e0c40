"""The model's tensors from shapes alone (docs/model.md §6): one decoder layer of each kind built on
the meta device with a single routed expert, each tensor counted once per layer of that kind and,
for the router and the experts, once per expert; and the memory check that refuses, before anything
is built, a model this machine cannot hold. accounting.py counts parameters, bytes and FLOPs from
these; checkpoint.py checks memory before it loads.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path

import torch
from rich.filesize import decimal

from ..errors import K3Error
from .config import K3Config
from .model import DecoderLayer, K3Model

LAYER_COMPONENTS = (  # (component, tensor name prefix inside a decoder layer); self_attn goes by kind
    ("routed_experts", "block_sparse_moe.experts."),
    ("shared_experts", "block_sparse_moe.shared_experts."),
    ("router", "block_sparse_moe.gate."),
    ("latent_projections", "block_sparse_moe.routed_expert_"),
    ("dense_mlp", "mlp."),
)
TOP_COMPONENTS = (("embedding", "model.embed_tokens."), ("lm_head", "lm_head."))
PER_EXPERT = ("block_sparse_moe.experts.", "block_sparse_moe.gate.")  # built for one expert, counted E times

def named_tensors(module: torch.nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


def component(name: str, kind: str | None) -> str:
    """Which part of the model a tensor belongs to; ``kind`` (the layer's attention) is None
    outside model.layers."""
    if kind is not None and name.startswith("self_attn."):
        return kind
    for comp, prefix in LAYER_COMPONENTS if kind is not None else TOP_COMPONENTS:
        if name.startswith(prefix):
            return comp
    return "norms_attnres"


def layer_kinds(cfg: K3Config) -> list[tuple[DecoderLayer, int]]:
    """One DecoderLayer per distinct (attention kind, MoE or dense), built with one routed expert,
    and the number of such layers."""
    first, count = {}, Counter()
    for i, kind in enumerate(cfg.layer_kinds):
        key = (kind, cfg.is_moe(i))
        first.setdefault(key, i)
        count[key] += 1
    one_expert = dataclasses.replace(cfg, num_experts=1, num_experts_per_token=1)
    return [(DecoderLayer(one_expert, i), count[key]) for key, i in first.items()]


def outer_tensors(cfg: K3Config) -> list[tuple[str, torch.Tensor]]:
    """The tensors outside model.layers (embedding, final norm, output AttnRes, lm_head), read off
    a one-layer K3Model of the same widths."""
    one_layer = dataclasses.replace(cfg, num_hidden_layers=1, first_k_dense_replace=1,
                                    linear_attn_config={**cfg.kda, "full_attn_layers": [1], "kda_layers": []})
    return [(n, t) for n, t in named_tensors(K3Model(one_layer)) if not n.startswith("model.layers.")]


def model_tensors(cfg: K3Config):
    """(component, K3Model tensor name (in its layer), meta tensor, how many of it the model holds)."""
    with torch.device("meta"):
        layers = layer_kinds(cfg)
        for name, t in outer_tensors(cfg):
            yield component(name, None), name, t, 1
        for layer, n in layers:
            for name, t in named_tensors(layer):
                yield component(name, layer.kind), name, t, n * (cfg.num_experts if name.startswith(PER_EXPERT) else 1)


MEMORY_LIMIT = "K3C_MEMORY_LIMIT"   # bytes: caps what k3c counts as available (tests lower it)


def model_memory(cfg: K3Config, dtype: torch.dtype) -> int:
    """Bytes of a K3Model of ``cfg`` in memory: float tensors at ``dtype``, MXFP4 experts as stored."""
    return sum(n * t.numel() * (1 if t.dtype == torch.uint8 else dtype.itemsize) for _, _, t, n in model_tensors(cfg))


def memory_shortfall(cfg: K3Config, dtype: torch.dtype) -> str | None:
    """None when a K3Model of ``cfg`` at ``dtype`` fits the memory available here, else why not
    (one clause: what it needs and what there is)."""
    need, have = model_memory(cfg, dtype), available_memory()
    if need <= have:
        return None
    return f"the model needs {decimal(need)} in {str(dtype).removeprefix('torch.')}, more than the " \
           f"{decimal(have)} of memory available here" + (f" ({MEMORY_LIMIT})" if MEMORY_LIMIT in os.environ else "")


def require_memory(cfg: K3Config, dtype: torch.dtype, what: str) -> None:
    """Refuse up front, in one line, to build a model whose float tensors at ``dtype`` (MXFP4 experts
    as stored) would not fit in the memory this machine has available."""
    if (why := memory_shortfall(cfg, dtype)) is not None:
        raise K3Error(f"{what}: {why}")


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (Linux), else physical memory; at most ``K3C_MEMORY_LIMIT``
    bytes when that is set."""
    have = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                have = int(line.split()[1]) * 1024
    except OSError:
        pass
    if have is None:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = os.environ.get(MEMORY_LIMIT)
    if limit is None:
        return have
    if not limit.strip().isdigit():
        raise K3Error(f"{MEMORY_LIMIT}={limit!r}: give a number of bytes")
    return min(have, int(limit))
