"""Parameters, bytes, decode state, cache and FLOPs of a configuration, from module shapes (docs/model.md §6).

Nothing is allocated, and nothing is built per layer or per expert: decoder layers of one kind (KDA
or MLA attention, dense MLP or MoE) have the same shapes, so one layer of each kind is built on the
meta device, with a single routed expert, and each tensor counted once per layer of that kind and,
for the router and the experts, once per expert. A config with a million layers or experts costs
what k3-tiny does.

The figures count what a checkpoint stores: MXFP4 experts as their logical weights (out x in per
matrix: two per packed byte; the scales are not weights) and their bytes as stored, Kimi Linear's
``A_log`` as its H stored values (K3Model pads it to max(H, K)). Bytes follow the stored dtypes: from
the safetensors headers when a checkpoint is given (``account_checkpoint``), else from the published
layout of the config (docs/model.md §8; ``published_dtype``).
"""
from __future__ import annotations

import io
import re
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.filesize import decimal
from rich.table import Table

from ..errors import K3Error
from .checkpoint import FP32_SUFFIXES, TORCH_DTYPES, open_checkpoint
from .config import K3Config
from .shapes import component, layer_kinds, model_tensors, named_tensors

CACHE_BYTES = 2  # the MLA latent cache is kept in 16-bit (docs/model.md §6)
# float tensors a published layout stores in fp32 (docs/model.md §8); everything else float is bf16
PUBLISHED_FP32 = {"k3c": FP32_SUFFIXES, "k3_release": FP32_SUFFIXES, "kimi_linear": (".A_log", ".dt_bias")}
LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


def weights(name: str, numel: int) -> int:
    """Logical weights of a tensor: an MXFP4 ``weight_packed`` [out, in/2] (or gpt-oss ``_blocks``)
    holds two per byte; scales hold none."""
    if name.endswith(("weight_packed", "_blocks")):
        return 2 * numel
    return 0 if name.endswith(("weight_scale", "_scales")) else numel


def published_dtype(cfg: K3Config, name: str, t: torch.Tensor) -> torch.dtype:
    """The dtype the published layout of ``cfg`` stores a K3Model tensor in (docs/model.md §8)."""
    if t.dtype == torch.uint8:
        return torch.uint8
    return torch.float32 if name.endswith(PUBLISHED_FP32[cfg.layout]) else torch.bfloat16


def stored_numel(cfg: K3Config, name: str, t: torch.Tensor) -> int:
    """Numbers stored for a K3Model tensor: Kimi Linear stores A_log as [1, 1, H, 1] (kimi_linear.py)."""
    if cfg.layout == "kimi_linear" and name.endswith("A_log"):
        return cfg.kda_heads
    return t.numel()


def stored_counts(cfg: K3Config, checkpoint: Path | None) -> tuple[Counter, Counter]:
    """Parameters and bytes per component as stored: from the safetensors headers of ``checkpoint``,
    or from the published layout (module docstring)."""
    params, nbytes = Counter(), Counter()
    if checkpoint is None:
        for comp, name, t, n in model_tensors(cfg):
            numel = stored_numel(cfg, name, t)
            params[comp] += n * weights(name, numel)
            nbytes[comp] += n * numel * published_dtype(cfg, name, t).itemsize
        return params, nbytes
    ckpt = open_checkpoint(checkpoint, cfg)
    model_name = {}  # stored tensor -> the (first) K3Model tensor it holds, whose component it is
    for name, e in ckpt.entries.items():
        model_name.setdefault((e.file, e.key), name)
    kinds = cfg.layer_kinds
    for path, header in ckpt.stored.items():
        for key, (dtype, shape) in header.items():
            m = LAYER.fullmatch(model_name[path, key])
            comp = component(m[2], kinds[int(m[1])]) if m else component(model_name[path, key], None)
            if dtype not in TORCH_DTYPES:
                raise K3Error(f"{path}: tensor '{key}' has dtype {dtype}, which k3c does not read")
            numel = torch.Size(shape).numel()
            params[comp] += weights(key, numel)
            nbytes[comp] += numel * TORCH_DTYPES[dtype].itemsize
    return params, nbytes


def account(cfg: K3Config, context: int = 1_048_576, checkpoint: Path | None = None) -> dict:
    """Every figure of docs/model.md §6 for ``cfg``; cache sizes and attention FLOPs at ``context`` tokens;
    parameters and bytes as ``checkpoint`` stores them when given."""
    params, nbytes = stored_counts(cfg, checkpoint)
    with torch.device("meta"):
        layers = layer_kinds(cfg)
    moe = [(layer.block_sparse_moe, n) for layer, n in layers if hasattr(layer, "block_sparse_moe")]
    expert = [(name, t[0]) for name, t in named_tensors(moe[0][0].experts)] if moe else []  # stacked [E, ...]
    per_expert = sum(weights(name, t.numel()) for name, t in expert)
    per_expert_bytes = sum(t.numel() * published_dtype(cfg, name, t).itemsize for name, t in expert)
    active_experts = sum(n * cfg.num_experts_per_token for _, n in moe)
    total = sum(params.values())
    trunk = total - params["embedding"] - params["routed_experts"]
    active = trunk + active_experts * per_expert

    # Decode state (docs/model.md §1): S [H, K, V] fp32 per KDA layer (V = K), and the conv state of q, k, v.
    kda = [(layer.self_attn, n) for layer, n in layers if layer.kind == "kda"]
    kda_state = sum(n * a.H * a.K * a.K for a, n in kda)
    conv_state = sum(n * 3 * a.q_conv1d.weight.shape[0] * (a.q_conv1d.weight.shape[-1] - 1) for a, n in kda)
    # MLA cache (docs/model.md §2): one kv_a_proj_with_mqa output [c_n | k_pe] per token per layer.
    mla = [(layer.self_attn, n) for layer, n in layers if layer.kind == "mla"]
    mla_per_token = sum(n * a.kv_a_proj_with_mqa.out_features for a, n in mla)
    # Absorbed decode of one token over `context` cached tokens, per head: scores over the
    # rank + rope wide key, then the mix of rank wide values.
    mla_flops = sum(n * 2 * a.H * context * (2 * a.rank + a.rope) for a, n in mla)
    # Prediction S^T k, rank-1 update and readout S^T q: a multiply-add per state number each.
    kda_flops = 2 * 3 * kda_state
    mxfp4 = cfg.experts_mxfp4 and bool(moe)
    return {
        "context": context,
        "params_total": total,
        "params_by_component": dict(params),
        "routed_experts": sum(cfg.num_experts * n for _, n in moe),
        "params_per_routed_expert": per_expert,
        "params_trunk": trunk,
        "params_active_per_token": active,
        "bytes_total": sum(nbytes.values()),
        "bytes_by_component": dict(nbytes),
        "mxfp4_bytes_per_expert": per_expert_bytes if mxfp4 else None,
        "mxfp4_bytes_per_token": active_experts * per_expert_bytes if mxfp4 else None,
        "kda_state_numbers": kda_state,
        "kda_state_bytes": 4 * kda_state,
        "kda_conv_state_numbers": conv_state,
        "mla_cache_numbers_per_token": mla_per_token,
        "mla_cache_bytes": CACHE_BYTES * mla_per_token * context,
        "crossover_tokens": kda_state // mla_per_token + 1 if mla_per_token else None,
        "mla_cache_over_kda_state": round(mla_per_token * context / kda_state, 2) if kda_state else None,
        "flops_per_token": {"weights": 2 * active, "mla_attention": mla_flops, "kda_state": kda_flops,
                            "total": 2 * active + mla_flops + kda_flops},
    }


def render(f: dict) -> str:
    """The figures as two rich tables, rendered to plain text."""
    parts = Table(title="Parameters and stored bytes")
    for col in ("component", "parameters", "bytes"):
        parts.add_column(col, justify="left" if col == "component" else "right")
    for comp, n in sorted(f["params_by_component"].items(), key=lambda kv: -kv[1]):
        parts.add_row(comp, f"{n:,}", decimal(f["bytes_by_component"][comp]))
    parts.add_row("total", f"{f['params_total']:,}", decimal(f["bytes_total"]), style="bold")

    def size(v):
        return "-" if v is None else decimal(v)

    def gflop(v):
        return f"{v / 1e9:,.1f} GFLOP" if v >= 1e9 else f"{v / 1e6:,.1f} MFLOP" if v >= 1e6 else f"{v:,} FLOP"

    flops = f["flops_per_token"]
    rows = [
        ("routed experts (MXFP4 as logical weights)",
         f"{f['routed_experts']:,} x {f['params_per_routed_expert']:,} params"),
        ("active params per token (no embedding)", f"{f['params_active_per_token']:,}"),
        ("MXFP4 bytes per expert / per token", f"{size(f['mxfp4_bytes_per_expert'])} / "
                                               f"{size(f['mxfp4_bytes_per_token'])}"),
        ("KDA state per sequence (fp32)", f"{f['kda_state_numbers']:,} numbers, {decimal(f['kda_state_bytes'])}"),
        ("KDA conv state per sequence", f"{f['kda_conv_state_numbers']:,} numbers"),
        ("MLA cache per token", f"{f['mla_cache_numbers_per_token']:,} numbers"),
        (f"MLA cache at {f['context']:,} tokens (16-bit)", decimal(f["mla_cache_bytes"])),
        ("MLA cache passes KDA state at", "-" if f["crossover_tokens"] is None
         else f"{f['crossover_tokens']:,} tokens"),
        (f"MLA cache / KDA state at {f['context']:,} tokens", "-" if f["mla_cache_over_kda_state"] is None
         else f"{f['mla_cache_over_kda_state']:,}x"),
        ("FLOPs per token: weights (2 x active)", gflop(flops["weights"])),
        (f"FLOPs per token: MLA attention at {f['context']:,}", gflop(flops["mla_attention"])),
        ("FLOPs per token: KDA state", gflop(flops["kda_state"])),
    ]
    other = Table(title="State, cache and compute")
    other.add_column("figure")
    other.add_column("value", justify="right")
    for row in rows:
        other.add_row(*row)
    console = Console(file=io.StringIO(), width=110)
    console.print(parts, other)
    return console.file.getvalue()
