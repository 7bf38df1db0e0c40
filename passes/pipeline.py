"""The pass pipeline: the list of rewrites applied between the exporter and iree-compile.

Which implementation replaces each custom op is the op's business (ops/: each ``CustomOp`` names its
lowering per target); the pipeline asks each op in ``ops.OPS`` for the lowering of a target and
applies them in that order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from iree.compiler import ir

from ..errors import K3Error
from ..ops import OPS, CustomOp, Lowering
from ..ops.base import Generator
from .devices import place_on_devices
from .layer_calls import call_layer_bodies, inline_loop_bodies, loop_layer_runs
from .rewrite import custom_ops, lower_custom_op


@dataclass
class Rewrite:
    op: str               # the torch.operator name it replaces
    generator: Generator  # (sym, operand types, constants) -> MLIR texts
    doc: str

    @classmethod
    def of(cls, op: CustomOp, lowering: Lowering) -> "Rewrite":
        return cls(op.mlir_name, lowering.generate, lowering.doc)


def rewrites_for(target=None) -> list[Rewrite]:
    """Each op's lowering for ``target`` (a compiler.targets.Target; None: the defaults)."""
    return [Rewrite.of(op, op.lowering(target)) for op in OPS]


@dataclass
class Pipeline:
    """Rewrites in order; after them no ``torch.k3.*`` operator may remain. A program over several
    ``devices`` is placed first (passes/devices.py)."""
    rewrites: list[Rewrite] = field(default_factory=rewrites_for)
    devices: int = 1

    @classmethod
    def for_target(cls, target) -> "Pipeline":
        """The lowerings ``target`` (a compiler.targets.Target) takes."""
        return cls(rewrites_for(target), getattr(target, "devices", 1))

    def describe(self) -> str:
        return "\n".join(f"{r.op:24s} -> {r.doc}" for r in self.rewrites)

    def run(self, module: ir.Module, log=print) -> dict[str, int]:
        counts = {}
        if self.devices > 1:
            t0 = time.perf_counter()
            counts = place_on_devices(module)
            log(f"devices: {self.devices}; {counts['transfers']} transfers, {counts['pinned parameters']} "
                f"parameters pinned in {time.perf_counter() - t0:.1f}s")
        t0 = time.perf_counter()
        counts |= {"layer loops": loop_layer_runs(module), "layer calls": call_layer_bodies(module)}
        log(f"layer placeholders: {counts['layer loops']} loops over layer runs, {counts['layer calls']} calls "
            f"of the layer bodies in {time.perf_counter() - t0:.1f}s")
        for r in self.rewrites:
            t0 = time.perf_counter()
            counts[r.op] = lower_custom_op(module, r.op, r.generator)
            log(f"{r.op}: {counts[r.op]} replaced in {time.perf_counter() - t0:.1f}s")
        t0 = time.perf_counter()
        counts["inlined into layer loops"] = inline_loop_bodies(module)
        log(f"layer loops: {counts['inlined into layer loops']} calls inlined in {time.perf_counter() - t0:.1f}s")
        left = sorted({name for prefix in ("torch.k3.", "torch.k3x.", "torch.k3dev.") for name, _ in custom_ops(module, prefix)})
        if left:
            raise K3Error(f"passes: no lowering for custom op(s) {', '.join(left)}")
        module.operation.verify()
        return counts
