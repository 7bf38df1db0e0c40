"""The pass pipeline: the list of rewrites applied between the exporter and iree-compile."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

from iree.compiler import ir

from ..errors import K3Error
from . import causal_attention, expert_loops, lowerings
from .layer_calls import call_layer_bodies
from .rewrite import custom_ops, lower_custom_op


@dataclass
class Rewrite:
    op: str            # the torch.operator name it replaces
    generator: object  # (sym, operand types, constants) -> MLIR texts
    doc: str


# per target backend, then per target name (which wins), the rewrites that replace a default one
VARIANTS = {
    "llvm-cpu": [Rewrite("torch.k3.kda_chunk", partial(lowerings.kda_chunk, block=256, chunk=16),
                         "chunkwise KDA, 256 tokens per loop iteration in 16-token chunks (k3c bench)"),
                 Rewrite("torch.k3.mxfp4_moe", expert_loops.mxfp4_moe_streamed("int"),
                         "MXFP4 decode streams the packed weights, 16 lanes per row, i16 nibble decode (no F16C)")],
    "cpu": [Rewrite("torch.k3.mxfp4_moe", expert_loops.mxfp4_moe_streamed("f16"),
                    "MXFP4 decode streams the packed weights, f16 nibble decode, 16 lanes per row")],
    "vulkan-spirv": [Rewrite("torch.k3.kda_step", lowerings.kda_step_v_major,
                             "recurrent KDA step on the V-major state (SPIR-V: reductions innermost)")],
}


@dataclass
class Pipeline:
    """Rewrites in order; after them no ``torch.k3.*`` operator may remain."""
    rewrites: list[Rewrite] = field(default_factory=lambda: [
        Rewrite("torch.k3.kda_chunk", lowerings.kda_chunk, "chunkwise KDA: traced 64-token chunk in an scf.for"),
        Rewrite("torch.k3.kda_step", lowerings.kda_step, "recurrent KDA step for decode"),
        Rewrite("torch.k3.mxfp4_moe", lowerings.mxfp4_moe,
                "MXFP4 experts one at a time, sliced in place: loop over picked slots / over experts"),
        Rewrite("torch.k3.causal_attention", causal_attention.causal_attention,
                f"MLA prefill attention: a loop over {causal_attention.BLOCK}-row query blocks, keys up to the block"),
    ])

    @classmethod
    def for_target(cls, target) -> "Pipeline":
        """The default rewrites with ``target``'s variants (a compiler.targets.Target) in their place."""
        variants = {r.op: r for key in (target.backend, target.name) for r in VARIANTS.get(key, [])}
        return cls([variants.get(r.op, r) for r in cls().rewrites])

    def describe(self) -> str:
        return "\n".join(f"{r.op:24s} -> {r.doc}" for r in self.rewrites)

    def run(self, module: ir.Module, log=print) -> dict[str, int]:
        t0 = time.perf_counter()
        counts = {"layer calls": call_layer_bodies(module)}
        log(f"layer placeholders: {counts['layer calls']} calls of the layer bodies in {time.perf_counter() - t0:.1f}s")
        for r in self.rewrites:
            t0 = time.perf_counter()
            counts[r.op] = lower_custom_op(module, r.op, r.generator)
            log(f"{r.op}: {counts[r.op]} replaced in {time.perf_counter() - t0:.1f}s")
        left = sorted({name for prefix in ("torch.k3.", "torch.k3x.") for name, _ in custom_ops(module, prefix)})
        if left:
            raise K3Error(f"passes: no lowering for custom op(s) {', '.join(left)}")
        module.operation.verify()
        return counts
