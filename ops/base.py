"""What a k3 custom op is made of (docs/pipeline.md §6), and the operand types its lowerings read.

Each op module (kda.py, mxfp4_moe.py, causal_attention.py) defines its op with ``torch.library``
(schema from the signature, the eager reference as the body, a fake for torch.export), the checks
that say which operands its lowerings handle, the lowerings themselves and, in a ``CustomOp``, which
lowering each target takes. passes/ only drives: it asks each ``CustomOp`` for its lowering for a
target and calls it on every instance of the op.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

try:
    from iree.compiler import ir, passmanager
    from iree.compiler.dialects import func as func_d
except ImportError:  # iree-base-runtime alone runs a bundle; only lowering needs the compiler
    ir = passmanager = func_d = None

from ..errors import K3Error

_FLOATS = {torch.float64: "F64Type", torch.float32: "F32Type", torch.float16: "F16Type", torch.bfloat16: "BF16Type"}
# integer dtype -> (bits, signedness in a !torch.vtensor: True si, False ui, None signless), as
# torch-mlir's FX importer spells them (a builtin tensor holds every integer signless)
_INTEGERS = {torch.int64: (64, True), torch.int32: (32, True), torch.int16: (16, True), torch.int8: (8, True),
             torch.uint8: (8, False), torch.bool: (1, None)}


def _builtin_element(dtype: torch.dtype) -> ir.Type:
    """The element type of ``dtype`` in a builtin tensor (integers signless, as torch-mlir converts them)."""
    if dtype in _FLOATS:
        return getattr(ir, _FLOATS[dtype]).get()
    return ir.IntegerType.get_signless(_INTEGERS[dtype][0])


def _torch_element(dtype: torch.dtype) -> ir.Type:
    """The element type of ``dtype`` in a ``!torch.vtensor`` (si64, ui8, i1, f32...)."""
    if dtype in _FLOATS:
        return getattr(ir, _FLOATS[dtype]).get()
    bits, signed = _INTEGERS[dtype]
    if signed is None:
        return ir.IntegerType.get_signless(bits)
    return ir.IntegerType.get_signed(bits) if signed else ir.IntegerType.get_unsigned(bits)


def _to_builtin(types: list[ir.Type]) -> list[ir.RankedTensorType]:
    """The builtin tensor types of ``!torch.vtensor`` types, converted by torch-mlir's own type
    converter (the pass iree-compile's torch input runs), on a scratch declaration."""
    scratch = ir.Module.create()
    with ir.InsertionPoint(scratch.body):
        decl = func_d.FuncOp("types", (types, []), visibility="private")
    passmanager.PassManager.parse("builtin.module(torch-func-backend-type-conversion)").run(scratch.operation)
    return [ir.RankedTensorType(t) for t in ir.FunctionType(ir.TypeAttr(decl.attributes["function_type"]).value).inputs]


def _torch_dtype(vtensor: ir.Type, builtin: ir.RankedTensorType) -> torch.dtype:
    """The torch dtype whose ``!torch.vtensor`` of ``builtin``'s shape is ``vtensor`` (this tells ui8
    from si8, which the builtin type does not)."""
    shape = tuple(None if builtin.is_dynamic_dim(i) else d for i, d in enumerate(builtin.shape))
    for dtype in (*_FLOATS, *_INTEGERS):
        if _builtin_element(dtype) == builtin.element_type and TensorType(shape, dtype).vtensor == vtensor:
            return dtype
    raise K3Error(f"passes: no torch dtype k3c handles has the type {vtensor}")


@dataclass(frozen=True)
class TensorType:
    """A tensor operand as a lowering sees it: its shape and its torch dtype. In ``shape`` an int is
    a static size, None a dynamic one (as read from the IR) and a str a dynamic one with a name:
    sizes with one name are one size (what ``trace.trace_to_linalg`` tells torch.export)."""
    shape: tuple[int | str | None, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, types: list[ir.Type]) -> list["TensorType"]:
        """The TensorTypes of ``!torch.vtensor`` IR types (in the current context)."""
        return [cls(tuple(None if b.is_dynamic_dim(i) else d for i, d in enumerate(b.shape)), _torch_dtype(t, b))
                for t, b in zip(types, _to_builtin(types))]

    @property
    def builtin(self) -> ir.RankedTensorType:
        """The builtin tensor type the implementation takes (in the current context)."""
        dims = [d if isinstance(d, int) else ir.ShapedType.get_dynamic_size() for d in self.shape]
        return ir.RankedTensorType.get(dims, _builtin_element(self.dtype), loc=ir.Location.unknown())

    @property
    def element(self) -> ir.Type:
        return self.builtin.element_type

    @property
    def vtensor(self) -> ir.Type:
        """The ``!torch.vtensor`` type (built as torch-mlir's FX importer builds it: from text)."""
        dims = ",".join(str(d) if isinstance(d, int) else "?" for d in self.shape)
        return ir.Type.parse(f"!torch.vtensor<[{dims}],{_torch_element(self.dtype)}>")

    def __str__(self) -> str:
        return str(self.builtin)

    def with_dim(self, index: int, size: int | str | None) -> "TensorType":
        shape = list(self.shape)
        shape[index] = size
        return TensorType(tuple(shape), self.dtype)

    def describe(self) -> str:
        """[1, ?, 4, 16] float32: the shape and dtype in a message."""
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"[{dims}] {str(self.dtype).removeprefix('torch.')}"


# (function name, operand types, constant arguments) -> MLIR texts defining ``func @<name>``
Generator = Callable[[str, list[TensorType], list], list[str]]


@dataclass(frozen=True)
class Lowering:
    """One implementation of an op: ``generate`` checks the operands and writes the MLIR; ``doc``
    says what it is (``k3c export`` and the pipeline's description print it)."""
    generate: Generator
    doc: str


NAMESPACE = "k3"   # torch.library namespace of the ops: torch.ops.k3.<name>, ``torch.k3.<name>`` in MLIR


@dataclass(frozen=True)
class CustomOp:
    """A k3 custom op (``name``, defined with ``torch.library.custom_op`` in its module) and its
    lowerings, keyed by "default", by a HAL backend ("llvm-cpu") or by a target name ("cpu:x86-64-v4"):
    the target's name wins, then its CPU level's target name (``cpu`` takes the lowerings of the
    level this host reaches: compiler/cpu.py), then its backend, then the default."""
    name: str
    lowerings: dict[str, Lowering]
    # lowerings for a program over several devices (same keys), where they differ (README "Past one device")
    sharded: dict[str, Lowering] = field(default_factory=dict)

    @property
    def mlir_name(self) -> str:
        """The operator's name in the imported module, ``torch.k3.<name>``."""
        return f"torch.{NAMESPACE}.{self.name}"

    def lowering(self, target=None) -> Lowering:
        """The lowering for ``target`` (a compiler.targets.Target; None: the default); on a target
        of several devices, from ``sharded`` first."""
        keys = target.lowering_keys if target is not None else ()
        tables = (self.sharded, self.lowerings) if getattr(target, "devices", 1) > 1 else (self.lowerings,)
        for table in tables:
            for key in (*keys, "default"):
                if key in table:
                    return table[key]
        return self.lowerings["default"]


def require(ok: bool, op: str, message: str) -> None:
    """An op's check: K3Error "passes: <op>: <message>" unless ``ok``."""
    if not ok:
        raise K3Error(f"passes: {op}: {message}")


def check_one_float(op: str, names: list[str], ins: list[TensorType], dtypes=(torch.float32, torch.float64)) -> None:
    """Every operand of ``ins`` has one dtype, among ``dtypes``."""
    got = ", ".join(f"{n} {t.describe()}" for n, t in zip(names, ins))
    allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    require(len({t.dtype for t in ins}) == 1 and ins[0].dtype in dtypes, op,
            f"takes operands of one dtype, {allowed}; got {got}")
