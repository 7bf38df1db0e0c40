"""The custom ops' machinery (ops/, docs/pipeline.md §6): operand types read from the IR, the checks
that refuse operands a lowering does not handle, a generated text that does not parse, and element
types that follow the operands."""
from __future__ import annotations

import pytest
import torch
from iree.compiler import ir
from iree.compiler.extras.fx_importer import FxImporter
from torch.export import Dim, export

from k3c.errors import K3Error
from k3c.ops import OPS, causal_attention, kda, mxfp4, mxfp4_moe
from k3c.ops.base import TensorType
from k3c.ops.mlir import parse
from k3c.passes.pipeline import Pipeline, Rewrite


def imported(fn, example: tuple, dynamic_shapes=None) -> ir.Module:
    """``fn`` (calling one k3 op) exported and imported to torch-dialect MLIR, as the model is."""
    class Op(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    program = export(Op(), example, dynamic_shapes=dynamic_shapes)
    context = ir.Context()
    importer = FxImporter(context=context)
    with context:
        importer.import_program(program, func_name="main")
    return importer.module


def test_operand_types_come_from_the_ir():
    """The signedness the builtin tensor type drops (ui8, si8 are both i8 there) is kept; dynamic
    sizes are None; the builtin type is torch-mlir's conversion."""
    with ir.Context(), ir.Location.unknown():
        types = [ir.Type.parse(t) for t in ("!torch.vtensor<[2,?,16],ui8>", "!torch.vtensor<[4],si8>",
                                            "!torch.vtensor<[?,3],f32>", "!torch.vtensor<[1,2],si64>")]
        got = TensorType.of(types)
        assert got == [TensorType((2, None, 16), torch.uint8), TensorType((4,), torch.int8),
                       TensorType((None, 3), torch.float32), TensorType((1, 2), torch.int64)]
        assert [str(t) for t in got] == ["tensor<2x?x16xi8>", "tensor<4xi8>", "tensor<?x3xf32>", "tensor<1x2xi64>"]
        assert [t.vtensor for t in got] == types


def test_each_op_names_its_lowering_per_target():
    import dataclasses

    from k3c.compiler.targets import parse_target
    from k3c.ops.mxfp4_moe import MXFP4_MOE

    names = ("cpu", "cpu:x86-64", "cpu:x86-64-v3", "cpu:x86-64-v4", "vulkan:llvmpipe", "cuda")
    docs = {op.name: {t: op.lowering(parse_target(t)).doc for t in names} for op in OPS}
    here = parse_target("cpu").level
    for op in ("mxfp4_moe", "linear"):
        assert docs[op]["cpu"] == docs[op][f"cpu:{here}"]
        assert len({docs[op][t] for t in names[1:4]}) == 3, docs[op]   # each level its own
    assert "8x8" in docs["linear"]["cpu:x86-64-v3"] and "16x16" in docs["linear"]["cpu:x86-64-v4"]
    assert "x86-64-v3" in docs["mxfp4_moe"]["cpu:x86-64-v3"] and "x86-64-v4" in docs["mxfp4_moe"]["cpu:x86-64-v4"]
    # one device prefills the experts dequantised; several devices on the level's tiles (ops/mxfp4_moe.py)
    assert all("prefill dequantises" in docs["mxfp4_moe"][t] for t in names[2:4])
    two = {t: MXFP4_MOE.lowering(dataclasses.replace(parse_target(t), devices=2)).doc for t in names[2:4]}
    assert "8x8 mmt4d" in two["cpu:x86-64-v3"] and "16x16 mmt4d" in two["cpu:x86-64-v4"]
    assert docs["mxfp4_moe"]["cpu:x86-64"] != docs["mxfp4_moe"]["cuda"]
    assert docs["kda_chunk"]["cpu"] == docs["kda_chunk"]["cpu:x86-64"] != docs["kda_chunk"]["vulkan:llvmpipe"]
    assert docs["kda_step"]["vulkan:llvmpipe"] != docs["kda_step"]["cuda"]
    assert [op.mlir_name for op in OPS] == [r.op for r in Pipeline().rewrites]


def test_generated_text_that_does_not_parse_is_one_line_and_printed_numbered(capsys):
    module = imported(causal_attention.causal_attention, (torch.randn(1, 4, 2, 8),) * 3 + (0.5,))
    broken = "module {\n  func.func @x(%a: tensor<4xf32>) -> tensor<4xf32> {\n    return %b : tensor<4xf32>\n  }\n}"
    pipeline = Pipeline([Rewrite("torch.k3.causal_attention", lambda sym, ins, consts: [broken], "broken on purpose")])
    with pytest.raises(K3Error) as e:
        pipeline.run(module, log=lambda _: None)
    message = str(e.value)
    assert "\n" not in message and message.startswith("passes: torch.k3.causal_attention (k3_causal_attention_")
    assert message.endswith("generated MLIR does not parse: line 3, column 12 (return %b : tensor<4xf32>): "
                            "use of undeclared SSA value name (text printed above, numbered)")
    err = capsys.readouterr().err
    assert "1 | module {" in err and "3 |     return %b : tensor<4xf32>" in err


def test_parse_error_of_a_text_without_a_diagnostic_location_still_names_it(capsys):
    with ir.Context(), pytest.raises(K3Error, match=r"^passes: a test: generated MLIR does not parse"):
        parse("module {", "a test")
    assert "1 | module {" in capsys.readouterr().err


def moe_operands(packed_dtype=torch.uint8, z_dtype=torch.float32, N: int = 2):
    E, L, I = 4, 64, 32
    gen = torch.Generator().manual_seed(0)
    weights = []
    for shape in ((E, I, L), (E, I, L), (E, L, I)):
        p, s = mxfp4.quantize(torch.randn(shape, generator=gen))
        weights += [p.to(packed_dtype), s]
    idx = torch.tensor([[0, 1]] * N)
    return (torch.randn(N, L, dtype=z_dtype), idx, torch.rand(N, 2), *weights, "situ", 4.0, 25.0)


@pytest.mark.parametrize("case, operands, words", [
    ("int8 packed weights", moe_operands(packed_dtype=torch.int8),
     "takes z, w float32, idx int64 and the experts uint8; got z [2, 64] float32, idx [2, 2] int64, "
     "w [2, 2] float32, w1_packed [4, 32, 32] int8"),
    ("float64 activations", moe_operands(z_dtype=torch.float64), "z [2, 64] float64"),
])
def test_mxfp4_moe_refuses_operands_it_does_not_handle(case, operands, words):
    module = imported(mxfp4_moe.mxfp4_moe, operands)
    with pytest.raises(K3Error) as e:
        Pipeline().run(module, log=lambda _: None)
    assert str(e.value).startswith("passes: mxfp4_moe: ") and words in str(e.value) and "\n" not in str(e.value)


def test_kda_chunk_refuses_mixed_dtypes_and_causal_attention_mismatched_keys():
    q = torch.randn(1, 8, 2, 16)
    kda_args = (q, q, torch.randn(1, 8, 2, 16).bfloat16(), -torch.rand(1, 8, 2, 16), torch.rand(1, 8, 2),
                torch.zeros(1, 2, 16, 16))
    with pytest.raises(K3Error, match=r"^passes: kda_chunk: takes operands of one dtype, float32 or float64; "
                                      r"got q \[1, 8, 2, 16\] float32, .*v \[1, 8, 2, 16\] bfloat16"):
        Pipeline().run(imported(kda.kda_chunk, kda_args), log=lambda _: None)
    attention = imported(causal_attention.causal_attention, (q, torch.randn(1, 8, 2, 12), torch.randn(1, 8, 2, 4), 0.25))
    with pytest.raises(K3Error, match=r"^passes: causal_attention: wants q \[B, T, H, Dq\], k \[B, L, H, Dq\] .*k \[1, 8, 2, 12\] float32"):
        Pipeline().run(attention, log=lambda _: None)
    heads = imported(causal_attention.causal_attention, (q, torch.randn(1, 9, 3, 16), torch.randn(1, 9, 3, 4), 0.25))
    with pytest.raises(K3Error, match=r"^passes: causal_attention: wants .*k \[1, 9, 3, 16\] float32"):
        Pipeline().run(heads, log=lambda _: None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lowerings_take_their_element_type_from_the_operands(dtype):
    """The loops' pads, buffers and casts are of the operands' element type (no f32 literal): the
    lowered kda_chunk and causal_attention verify for float32 and float64 alike. (Only the lowering:
    iree-compile demotes float64 to float32 by default.)"""
    T = Dim("T", min=2, max=512)
    x = torch.randn(1, 8, 2, 16, dtype=dtype)
    kda_args = (x, x, x, -x.abs(), torch.rand(1, 8, 2, dtype=dtype), torch.zeros(1, 2, 16, 16, dtype=dtype))
    element = "f64" if dtype == torch.float64 else "f32"
    for fn, args, dims, buffer in ((kda.kda_chunk, kda_args, ({1: T},) * 5 + (None,), f"tensor<1x2x?x16x{element}>"),
                                   (causal_attention.causal_attention, (x, x, x, 0.25), ({1: T},) * 3 + (None,),
                                    f"tensor<2x?x16x{element}>")):
        module = imported(fn, args, (dims,))
        Pipeline().run(module, log=lambda _: None)   # verifies the module
        assert "tensor.pad" in str(module) and buffer in str(module)
        assert element == "f64" or "f64" not in str(module)
