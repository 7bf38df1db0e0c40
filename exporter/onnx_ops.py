"""The k3 custom ops as ONNX operators of the domain ``k3`` (version 1), kept whole, not decomposed.

    k3.KdaChunk(q, k, v, g, beta, S) -> (o, S_out)           torch.ops.k3.kda_chunk (prefill)
    k3.KdaStep(q, k, v, g, beta, S) -> (o, S_out)            torch.ops.k3.kda_step (decode)
    k3.Mxfp4ExpertFfn(z, idx, w, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
        attributes act (string), beta1, beta2 (float) -> y   torch.ops.k3.mxfp4_moe
    k3.FloatExpertFfn(z, idx, w, w1, w3, w2)
        attributes act (string), beta1, beta2 (float) -> y   torch.ops.k3.float_moe

Shapes and meaning are the torch ops' (ops/). Importing this module registers the schemas
with ``onnx.defs``, so the checker, shape inference and the exporter know the ops; ``KERNELS`` run
them in onnx's ReferenceEvaluator by calling the same eager ops.
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import defs
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from .. import ops  # noqa: F401  (registers torch.ops.k3.*)

DOMAIN = "k3"
DOMAIN_VERSION = 1
# ONNX op type in domain k3 -> torch.ops.k3.<name>
ONNX_TO_K3 = {"KdaChunk": "kda_chunk", "KdaStep": "kda_step", "Mxfp4ExpertFfn": "mxfp4_moe",
              "FloatExpertFfn": "float_moe"}
OPSET = 20  # the ai.onnx opset torch.onnx.export (torch 2.13) writes by default
FLOAT = ["tensor(float)", "tensor(double)"]

_In = defs.OpSchema.FormalParameter
_Attr = defs.OpSchema.Attribute


def _kda_schema(name: str, doc: str) -> defs.OpSchema:
    schema = defs.OpSchema(
        name, DOMAIN, DOMAIN_VERSION, doc=doc,
        inputs=[_In(n, "T", d) for n, d in (("q", "[B, T, H, K], L2-normalised and scaled"),
                                            ("k", "[B, T, H, K], L2-normalised"), ("v", "[B, T, H, V]"),
                                            ("g", "[B, T, H, K] log-decay"), ("beta", "[B, T, H]"),
                                            ("S", "[B, H, K, V] state"))],
        outputs=[_In("o", "T", "[B, T, H, V]"), _In("S_out", "T", "[B, H, K, V] state after the T tokens")],
        type_constraints=[("T", FLOAT, "float tensors")])

    def infer(ctx):
        ctx.set_output_type(0, ctx.get_input_type(2))
        ctx.set_output_type(1, ctx.get_input_type(5))
    return schema.set_type_and_shape_inference_function(infer)


_MOE_DOC = "y = sum_i w_i W2_e act(W1_e z, W3_e z), e = idx_i"
_MOE_ATTRIBUTES = [_Attr("act", defs.OpSchema.AttrType.STRING, "situ or silu"),
                   _Attr("beta1", defs.OpSchema.AttrType.FLOAT, "SiTU gate beta"),
                   _Attr("beta2", defs.OpSchema.AttrType.FLOAT, "SiTU linear beta")]


def _moe_schema(name: str, doc: str, experts: list, down: int, weight_types: list) -> defs.OpSchema:
    """An expert FFN op: z, idx, w and the experts in; y [N, L] out, L the size of input ``down``'s dim 1."""
    schema = defs.OpSchema(
        name, DOMAIN, DOMAIN_VERSION, doc=f"{_MOE_DOC}; {doc}",
        inputs=[_In("z", "T", "[N, L]"), _In("idx", "tensor(int64)", "[N, k] expert ids"),
                _In("w", "T", "[N, k] routing weights"), *experts],
        outputs=[_In("y", "T", "[N, L]")],
        type_constraints=[("T", FLOAT, "float tensors"), *weight_types],
        attributes=_MOE_ATTRIBUTES)

    def infer(ctx):
        y = onnx.TypeProto()
        y.CopyFrom(ctx.get_input_type(0))
        y.tensor_type.shape.dim[1].CopyFrom(ctx.get_input_type(down).tensor_type.shape.dim[1])
        ctx.set_output_type(0, y)
    return schema.set_type_and_shape_inference_function(infer)


_MXFP4_EXPERTS = [_In(f"{w}_{part}", "tensor(uint8)", f"[E, out, in/{2 if part == 'packed' else 32}]")
                  for w in ("w1", "w3", "w2") for part in ("packed", "scale")]
_FLOAT_EXPERTS = [_In(w, "W", shape) for w, shape in (("w1", "[E, I, L]"), ("w3", "[E, I, L]"), ("w2", "[E, L, I]"))]


SCHEMAS = [_kda_schema("KdaChunk", "chunkwise KDA over T tokens (prefill), spec section 1"),
           _kda_schema("KdaStep", "recurrent KDA, token by token (decode), spec section 1"),
           _moe_schema("Mxfp4ExpertFfn", "MXFP4 experts (spec section 5) stay packed", _MXFP4_EXPERTS, 7, []),
           _moe_schema("FloatExpertFfn", "float experts in their stored dtype", _FLOAT_EXPERTS, 5,
                       [("W", [*FLOAT, "tensor(float16)", "tensor(bfloat16)"], "the experts' dtype")])]
for _schema in SCHEMAS:
    if not defs.has(_schema.name, DOMAIN):
        defs.register_schema(_schema)


def _torch_kernel(op_type: str) -> type[OpRun]:
    """A ReferenceEvaluator kernel running ``torch.ops.k3.<op>`` on the node's inputs and attributes."""
    op = getattr(torch.ops.k3, ONNX_TO_K3[op_type])
    attributes = [a.name for a in op.default._schema.arguments if not isinstance(a.type, torch.TensorType)]

    def _run(self, *inputs, **values):
        out = op(*(torch.tensor(x) for x in inputs), *(values[a] for a in attributes))
        return tuple(t.numpy() for t in out) if isinstance(out, tuple) else (out.numpy(),)

    return type(op_type, (OpRun,), {"op_domain": DOMAIN, "_run": _run})


class GatherElements(OpRun):
    """onnx 1.23's reference GatherElements rejects axis -1 (fixed upstream in onnx/onnx#8444)."""
    op_domain = ""

    def _run(self, data, indices, axis=None):
        return (np.take_along_axis(data, indices, axis=axis),)


KERNELS = [*(_torch_kernel(op_type) for op_type in ONNX_TO_K3), GatherElements]


def reference_evaluator(model: str | onnx.ModelProto) -> ReferenceEvaluator:
    """onnx's ReferenceEvaluator for an exported entry point, with the k3 ops run by their eager references (ops/)."""
    return ReferenceEvaluator(model, new_ops=KERNELS)
