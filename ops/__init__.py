"""The k3 custom ops, one module each (docs/pipeline.md §6): the only parts of the graph that are not
plain aten. Importing this package registers ``torch.ops.k3.*``.

Each op module holds the op's ``torch.library`` definition (schema, eager reference, fake for
torch.export), the checks that say which operands its lowerings take, the lowerings (PyTorch bodies
traced to linalg, inside the ``scf.for`` wrappers of ``templates/``) and, in a ``CustomOp``, the
lowering each target takes. The model calls the ops; passes/ asks ``OPS`` for their lowerings.
Below them: ``numerics`` (upcast, the GLU activations) and ``mxfp4`` (the number format).
"""
from . import causal_attention, float_moe, kda, linear, mxfp4_moe
from .base import CustomOp, Lowering, TensorType

# in the order the pipeline lowers them
OPS: tuple[CustomOp, ...] = (kda.KDA_CHUNK, kda.KDA_STEP, mxfp4_moe.MXFP4_MOE, float_moe.FLOAT_MOE,
                             causal_attention.CAUSAL_ATTENTION, linear.LINEAR)

__all__ = ["OPS", "CustomOp", "Lowering", "TensorType"]
