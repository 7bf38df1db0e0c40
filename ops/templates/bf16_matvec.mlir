{#- The streamed bf16 matvec (ops/linear.py streamed): y [lead.., O] = W x for M rows x [lead.., IN]
    f32 (M the product of the static leading dims: one for a decode step, B for a step of B
    sequences) and W [O, IN] bf16, read where it lies, once for all M rows. W is seen as i32 words,
    each the bf16 pair of elements 2i (low half) and 2i + 1 (high half), [O, IN/32, 16]; x is split
    once into its even and odd elements xe, xo [M, IN/32, 16] in a small op of its own. One
    linalg.generic keeps 16 partial sums per row and output (vector lanes on the word position in a
    32-element block, a parallel dim; MV rows in one vector tile, so each word of W meets MV rows
    while it is in a register) and reduces over the blocks; a second sums the 16. Every row is
    summed in the same order whatever M is, so a row's result does not depend on the rows beside it.
    A bf16 widens to f32 exactly by its bits: the low half shifted left by 16, the high half with the
    low masked off. The two products per step keep the generic from being matched as a contraction
    (which IREE 3.13 lowers to scalar code here: 0.45x its default matvec). -#}
{% set xs = "tensor<%sxf32>" % "x".join(lead + [IN|string]) %}
{% set ys = "tensor<%sxf32>" % "x".join(lead + [O|string]) %}
{% set all = "[" + ", ".join(range(lead|length)|map("string")) + "], [" + (lead|length)|string + "]" %}
{% set half = "tensor<%dx%dx%dxf32>" % (M, B, LANES) %}
{% set words = "tensor<%dx%dx%dxi32>" % (O, B, LANES) %}
{% set part = "tensor<%dx%dx%dxf32>" % (M, O, LANES) %}
module {
  func.func @{{ name }}(%x: {{ xs }}, %W: tensor<{{ O }}x{{ IN }}xbf16>) -> {{ ys }} {
    %zero = arith.constant 0.0 : f32
    %x1 = tensor.collapse_shape %x [{{ all }}] : {{ xs }} into tensor<{{ M }}x{{ IN }}xf32>
    %x3 = tensor.expand_shape %x1 [[0], [1, 2, 3]] output_shape [{{ M }}, {{ B }}, {{ LANES }}, 2] : tensor<{{ M }}x{{ IN }}xf32> into tensor<{{ M }}x{{ B }}x{{ LANES }}x2xf32>
    %xe0 = tensor.empty() : tensor<2x{{ M }}x{{ B }}x{{ LANES }}xf32>
    %xt = linalg.generic {indexing_maps = [affine_map<(k, m, b, j) -> (m, b, j, k)>, affine_map<(k, m, b, j) -> (k, m, b, j)>],
                         iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
        ins(%x3 : tensor<{{ M }}x{{ B }}x{{ LANES }}x2xf32>) outs(%xe0 : tensor<2x{{ M }}x{{ B }}x{{ LANES }}xf32>) {
    ^bb0(%v: f32, %o: f32):
      linalg.yield %v : f32
    } -> tensor<2x{{ M }}x{{ B }}x{{ LANES }}xf32>
    %xe = tensor.extract_slice %xt[0, 0, 0, 0] [1, {{ M }}, {{ B }}, {{ LANES }}] [1, 1, 1, 1] : tensor<2x{{ M }}x{{ B }}x{{ LANES }}xf32> to {{ half }}
    %xo = tensor.extract_slice %xt[1, 0, 0, 0] [1, {{ M }}, {{ B }}, {{ LANES }}] [1, 1, 1, 1] : tensor<2x{{ M }}x{{ B }}x{{ LANES }}xf32> to {{ half }}
    %Wi = tensor.bitcast %W : tensor<{{ O }}x{{ IN }}xbf16> to tensor<{{ O }}x{{ IN }}xi16>
    %Wp = tensor.expand_shape %Wi [[0], [1, 2]] output_shape [{{ O }}, {{ IN // 2 }}, 2] : tensor<{{ O }}x{{ IN }}xi16> into tensor<{{ O }}x{{ IN // 2 }}x2xi16>
    %Ww = flow.tensor.bitcast %Wp : tensor<{{ O }}x{{ IN // 2 }}x2xi16> -> tensor<{{ O }}x{{ IN // 2 }}xi32>
    %W3 = tensor.expand_shape %Ww [[0], [1, 2]] output_shape [{{ O }}, {{ B }}, {{ LANES }}] : tensor<{{ O }}x{{ IN // 2 }}xi32> into {{ words }}
    %e = tensor.empty() : {{ part }}
    %f = linalg.fill ins(%zero : f32) outs(%e : {{ part }}) -> {{ part }}
    %part = linalg.generic {indexing_maps = [affine_map<(m, o, j, b) -> (o, b, j)>, affine_map<(m, o, j, b) -> (m, b, j)>,
                                            affine_map<(m, o, j, b) -> (m, b, j)>, affine_map<(m, o, j, b) -> (m, o, j)>],
                           iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
        ins(%W3, %xe, %xo : {{ words }}, {{ half }}, {{ half }}) outs(%f : {{ part }})
        {#- all M rows and 16 outputs per distributed tile, MV rows and the lanes of one output per vector tile, the block loop tiled by 1 #}
        attrs = {compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<distribution = [{{ M }}, 16, {{ LANES }}, 0], vector_common_parallel = [{{ MV }}, 1, {{ LANES }}, 0], vector_reduction = [0, 0, 0, 1]>, translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>} {
    ^bb0(%w: i32, %a: f32, %b: f32, %acc: f32):
      %c16 = arith.constant 16 : i32
      %high = arith.constant -65536 : i32
      %lo = arith.shli %w, %c16 : i32
      %hi = arith.andi %w, %high : i32
      %lf = arith.bitcast %lo : i32 to f32
      %hf = arith.bitcast %hi : i32 to f32
      %t0 = arith.mulf %lf, %a : f32
      %t1 = arith.mulf %hf, %b : f32
      %t2 = arith.addf %t0, %t1 : f32
      %r = arith.addf %acc, %t2 : f32
      linalg.yield %r : f32
    } -> {{ part }}
    %e2 = tensor.empty() : tensor<{{ M }}x{{ O }}xf32>
    %f2 = linalg.fill ins(%zero : f32) outs(%e2 : tensor<{{ M }}x{{ O }}xf32>) -> tensor<{{ M }}x{{ O }}xf32>
    %sum = linalg.generic {indexing_maps = [affine_map<(m, o, j) -> (m, o, j)>, affine_map<(m, o, j) -> (m, o)>],
                          iterator_types = ["parallel", "parallel", "reduction"]}
        ins(%part : {{ part }}) outs(%f2 : tensor<{{ M }}x{{ O }}xf32>) {
    ^bb0(%v: f32, %acc: f32):
      %r = arith.addf %acc, %v : f32
      linalg.yield %r : f32
    } -> tensor<{{ M }}x{{ O }}xf32>
    %y = tensor.expand_shape %sum [{{ all }}] output_shape [{{ (lead + [O|string])|join(", ") }}] : tensor<{{ M }}x{{ O }}xf32> into {{ ys }}
    return %y : {{ ys }}
  }
}
