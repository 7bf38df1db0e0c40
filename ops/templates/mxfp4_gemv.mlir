{#- The streamed MXFP4 matvec (ops/mxfp4_gemv.py gemv): y [1, O] = W x with W expert e = idx[pair]'s packed
    codes P [E, O, IN/2] and E8M0 scales S [E, O, IN/32] (sliced in place), x split into its even and odd elements xe, xo
    [IN/32, 16]. One linalg.generic keeps 16 partial sums per row (lanes on the byte position j),
    reducing over the blocks b; a second sums the 16. The nibble decode is `decode` ("f16" or
    "int"); the kernel computes in f32 whatever calls it. -#}
{% macro f16_nibble(out, shift) %}
    %{{ out }}_a = arith.shli %w, %c{{ shift }} : i16
    %{{ out }}_b = arith.shrsi %{{ out }}_a, %c3 : i16
    %{{ out }}_c = arith.andi %{{ out }}_b, %mask : i16
    %{{ out }}_h = arith.bitcast %{{ out }}_c : i16 to f16
    %{{ out }} = arith.extf %{{ out }}_h : f16 to f32
{% endmacro %}
{% macro int_nibble(out, code) %}
    %{{ out }}_m = arith.andi %{{ code }}, %c7 : i16
    %{{ out }}_sg = arith.andi %{{ code }}, %c8 : i16
    %{{ out }}_sb = arith.shli %{{ out }}_sg, %c12 : i16
    %{{ out }}_bits = arith.shli %{{ out }}_m, %c6 : i16
    %{{ out }}_e = arith.addi %{{ out }}_bits, %half : i16
    %{{ out }}_big = arith.cmpi ugt, %{{ out }}_m, %c1 : i16
    %{{ out }}_bm = arith.extsi %{{ out }}_big : i1 to i16
    %{{ out }}_sm = arith.muli %{{ out }}_m, %half : i16
    %{{ out }}_mask = arith.ori %{{ out }}_bm, %{{ out }}_sm : i16
    %{{ out }}_abs = arith.andi %{{ out }}_e, %{{ out }}_mask : i16
    %{{ out }}_v = arith.ori %{{ out }}_abs, %{{ out }}_sb : i16
    %{{ out }}_wide = arith.extui %{{ out }}_v : i16 to i32
    %{{ out }}_f = arith.shli %{{ out }}_wide, %c16 : i32
    %{{ out }} = arith.bitcast %{{ out }}_f : i32 to f32
{% endmacro %}
{% set pk_all = "tensor<%dx%dx%dxi8>" % (E, O, IN // 2) %}
{% set sc_all = "tensor<%dx%dx%dxi8>" % (E, O, B) %}
{% set pk = "tensor<1x%dx%dxi8>" % (O, IN // 2) %}
{% set sc = "tensor<1x%dx%dxi8>" % (O, B) %}
{% set p3 = "tensor<%dx%dx%dxi8>" % (O, B, LANES) %}
{% set xt = "tensor<%dx%dxf32>" % (B, LANES) %}
{% set part = "tensor<%dx%dxf32>" % (O, LANES) %}
{% set y = "tensor<%dxf32>" % O %}
module {
  func.func @{{ name }}(%P_all: {{ pk_all }}, %S_all: {{ sc_all }}, %idx: tensor<{{ PAIRS }}xi64>, %pair: index, %xe: {{ xt }}, %xo: {{ xt }}) -> tensor<1x{{ O }}xf32> {
    %zero = arith.constant 0.0 : f32
    %e64 = tensor.extract %idx[%pair] : tensor<{{ PAIRS }}xi64>
    %expert = arith.index_cast %e64 : i64 to index
    %P = tensor.extract_slice %P_all[%expert, 0, 0] [1, {{ O }}, {{ IN // 2 }}] [1, 1, 1] : {{ pk_all }} to {{ pk }}
    %S = tensor.extract_slice %S_all[%expert, 0, 0] [1, {{ O }}, {{ B }}] [1, 1, 1] : {{ sc_all }} to {{ sc }}
    %P2 = tensor.collapse_shape %P [[0, 1], [2]] : {{ pk }} into tensor<{{ O }}x{{ IN // 2 }}xi8>
    %P3 = tensor.expand_shape %P2 [[0], [1, 2]] output_shape [{{ O }}, {{ B }}, {{ LANES }}] : tensor<{{ O }}x{{ IN // 2 }}xi8> into {{ p3 }}
    %S2 = tensor.collapse_shape %S [[0, 1], [2]] : {{ sc }} into tensor<{{ O }}x{{ B }}xi8>
    %e = tensor.empty() : {{ part }}
    %f = linalg.fill ins(%zero : f32) outs(%e : {{ part }}) -> {{ part }}
    %part = linalg.generic {indexing_maps = [affine_map<(o, j, b) -> (o, b, j)>, affine_map<(o, j, b) -> (o, b)>,
                                            affine_map<(o, j, b) -> (b, j)>, affine_map<(o, j, b) -> (b, j)>,
                                            affine_map<(o, j, b) -> (o, j)>],
                           iterator_types = ["parallel", "parallel", "reduction"]}
        ins(%P3, %S2, %xe, %xo : {{ p3 }}, tensor<{{ O }}x{{ B }}xi8>, {{ xt }}, {{ xt }})
        outs(%f : {{ part }})
        {#- lanes on the 16 byte positions, 16 rows per distributed tile, the block loop tiled by 1 #}
        attrs = {compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<distribution = [16, 16, 0], vector_common_parallel = [1, 16, 0], vector_reduction = [0, 0, 1]>, translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>} {
    ^bb0(%p: i8, %s: i8, %a: f32, %b: f32, %acc: f32):
{% if decode == "f16" %}
    {#- c moved to bits 15:12 of an i16, shifted right arithmetically by 3 and masked with 0x8E00:
        the f16 pattern of E2M1[c] * 2^-14 (the activation carries the 2^14) #}
    %c12 = arith.constant 12 : i16
    %c8 = arith.constant 8 : i16
    %c3 = arith.constant 3 : i16
    %mask = arith.constant -29184 : i16
    %w = arith.extui %p : i8 to i16
{{ f16_nibble("lo", 12) }}{{ f16_nibble("hi", 8) }}
{%- elif decode == "int" %}
    {#- i16 integer ops only: the bf16 pattern (m << 6) + 0x3F00 of m = c & 7 is E2M1[m] for m >= 2;
        m = 0 and 1 are masked to 0 and 0x3F00 (0.5); the sign or-ed in, widened to f32 by a shift #}
    %c1 = arith.constant 1 : i16
    %c4 = arith.constant 4 : i16
    %c6 = arith.constant 6 : i16
    %c7 = arith.constant 7 : i16
    %c8 = arith.constant 8 : i16
    %c12 = arith.constant 12 : i16
    %c15 = arith.constant 15 : i16
    %c16 = arith.constant 16 : i32
    %half = arith.constant 16128 : i16
    %w = arith.extui %p : i8 to i16
    %lo_c = arith.andi %w, %c15 : i16
    %hi_c = arith.shrui %w, %c4 : i16
{{ int_nibble("lo", "lo_c") }}{{ int_nibble("hi", "hi_c") }}
{%- endif %}
    {#- the f32 2^(S - 127) from its bits, no compare or select: S << 23, or-ed with 0x400000 (NaN)
        when S = 255, where (S + 1) >> 8 is 1; S = 0 gives +0 #}
    %c23 = arith.constant 23 : i32
    %c22 = arith.constant 22 : i32
    %c8_s = arith.constant 8 : i32
    %c1_s = arith.constant 1 : i32
    %s32 = arith.extui %s : i8 to i32
    %sb = arith.shli %s32, %c23 : i32
    %sp = arith.addi %s32, %c1_s : i32
    %st = arith.shrui %sp, %c8_s : i32
    %sq = arith.shli %st, %c22 : i32
    %sr = arith.ori %sb, %sq : i32
    %scale = arith.bitcast %sr : i32 to f32
      %t0 = arith.mulf %lo, %a : f32
      %t1 = arith.mulf %hi, %b : f32
      %t2 = arith.addf %t0, %t1 : f32
      %t3 = arith.mulf %t2, %scale : f32
      %r = arith.addf %acc, %t3 : f32
      linalg.yield %r : f32
    } -> {{ part }}
    %e2 = tensor.empty() : {{ y }}
    %f2 = linalg.fill ins(%zero : f32) outs(%e2 : {{ y }}) -> {{ y }}
    %sum = linalg.generic {indexing_maps = [affine_map<(o, j) -> (o, j)>, affine_map<(o, j) -> (o)>],
                          iterator_types = ["parallel", "reduction"]}
        ins(%part : {{ part }}) outs(%f2 : {{ y }}) {
    ^bb0(%v: f32, %acc: f32):
      %r = arith.addf %acc, %v : f32
      linalg.yield %r : f32
    } -> {{ y }}
    %y = tensor.expand_shape %sum [[0, 1]] output_shape [1, {{ O }}] : {{ y }} into tensor<1x{{ O }}xf32>
    return %y : tensor<1x{{ O }}xf32>
  }
}
