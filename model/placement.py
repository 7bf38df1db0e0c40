"""Bytes per device when the routed experts are split over N devices (README, "Past one device").

The plan the multi-device program follows: every MoE layer's routed experts in N contiguous ranges
(the first E mod N devices take one expert more), one range per device; everything else (embedding,
attention, router, shared experts, norms, lm_head), the KDA state and the MLA cache on device 0.
Figures come from ``accounting.account`` (shapes only).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import K3Error

# (name, memory in GB as sold) of the accelerators the report sizes for
ACCELERATORS = (("H200", 141), ("MI300X", 192), ("MI355X", 288))
HEADROOM = 0.10   # of each device's memory kept for activations, workspaces and the runtime


@dataclass
class DeviceBytes:
    device: int
    experts: int          # routed experts per MoE layer held here
    weights: int
    state: int            # KDA state and conv windows, MLA cache (device 0 only)

    @property
    def total(self) -> int:
        return self.weights + self.state


def expert_ranges(num_experts: int, devices: int) -> list[range]:
    """Contiguous expert ranges, one per device, sizes differing by at most one."""
    base, extra = divmod(num_experts, devices)
    starts = [d * base + min(d, extra) for d in range(devices + 1)]
    return [range(starts[d], starts[d + 1]) for d in range(devices)]


def split(figures: dict, num_experts: int, devices: int) -> list[DeviceBytes]:
    """Per-device bytes for ``figures`` (accounting.account) with the experts over ``devices``."""
    experts = figures["bytes_by_component"].get("routed_experts", 0)
    per_expert = experts // num_experts if num_experts else 0   # over all MoE layers
    trunk = figures["bytes_total"] - experts
    state = figures["kda_state_bytes"] + 2 * figures["kda_conv_state_numbers"] + figures["mla_cache_bytes"]
    rows = []
    for d, r in enumerate(expert_ranges(num_experts, devices)):
        rows.append(DeviceBytes(d, len(r), per_expert * len(r) + (trunk if d == 0 else 0), state if d == 0 else 0))
    return rows


def fits(rows: list[DeviceBytes], memory_bytes: int) -> bool:
    return max(r.total for r in rows) <= memory_bytes * (1 - HEADROOM)


def smallest_fit(figures: dict, num_experts: int, memory_bytes: int) -> int | None:
    """The fewest devices of ``memory_bytes`` that hold the model with HEADROOM kept free, or None
    when device 0's share alone (trunk, state, cache) does not fit."""
    for n in range(1, max(num_experts, 1) + 1):
        if fits(split(figures, num_experts, n), memory_bytes):
            return n
    return None


def placement_report(figures: dict, num_experts: int, devices: int, memory_gb: float | None) -> dict:
    """The --devices section of ``k3c inspect``: bytes per device, their sum (the one-device figure),
    whether it fits ``memory_gb`` per device, and the fewest devices of each ACCELERATORS entry.
    More devices than routed experts is refused before any per-device row is made."""
    if devices > max(num_experts, 1):
        raise K3Error(f"inspect: --devices {devices}: the model has {num_experts} routed experts per MoE layer "
                      f"to split; give at most that many devices")
    rows = split(figures, num_experts, devices)
    report = {"devices": devices, "headroom": HEADROOM, "context": figures["context"],
              "per_device": [{"device": r.device, "experts_per_layer": r.experts, "weights_bytes": r.weights,
                              "state_bytes": r.state, "total_bytes": r.total} for r in rows],
              "sum_bytes": sum(r.total for r in rows),
              "smallest_fit": {name: smallest_fit(figures, num_experts, int(gb * 1e9)) for name, gb in ACCELERATORS}}
    if memory_gb is not None:
        report["device_memory_bytes"] = int(memory_gb * 1e9)
        report["fits"] = fits(rows, int(memory_gb * 1e9))
    return report


def render_devices(report: dict) -> str:
    import io
    from rich.console import Console
    from rich.filesize import decimal
    from rich.table import Table
    table = Table(title=f"routed experts over {report['devices']} devices (context {report['context']:,} tokens)")
    for col in ("device", "experts / layer", "weights", "state + cache", "total"):
        table.add_column(col, justify="right")
    for r in report["per_device"]:
        table.add_row(str(r["device"]), str(r["experts_per_layer"]), decimal(r["weights_bytes"]),
                      decimal(r["state_bytes"]), decimal(r["total_bytes"]))
    lines = [f"sum over devices: {decimal(report['sum_bytes'])} (the one-device figure)"]
    if "fits" in report:
        lines.append(f"fits {decimal(report['device_memory_bytes'])} per device with {report['headroom']:.0%} "
                     f"headroom: {'yes' if report['fits'] else 'no'}")
    lines += [f"fewest {name} ({gb} GB) devices that hold it: {report['smallest_fit'][name] or 'none (device 0 alone does not fit)'}"
              for name, gb in ACCELERATORS]
    out = io.StringIO()
    Console(file=out, width=100).print(table)
    return out.getvalue() + "\n".join(lines)
