{#- One expert of the MXFP4 prefill on the CPU levels (ops/mxfp4_moe.py tiled_expert): rows [R, L] ->
    W2 act(W1 rows, W3 rows), as three linalg.mmt4d on T x T x 1 tiles (IREE's CPU tiled matmul; T
    is the CPU level's, docs/pipeline.md §4) without the data-tiling flag. Each matrix [1, out, in]
    is dequantised once by @{{name}}_rhs_up / _down straight into the mmt4d's right-hand layout
    [out/T, in, T, 1] by integer ops (no table); the rows are packed (zero padded to a multiple of
    T), the activation @{{act}} (traced from PyTorch) takes the T x T output tiles and transposes
    them into the left-hand layout of the last product, whose tiles are unpacked to [R, L]. -#}
{% set rows = "tensor<?x%dxf32>" % L %}
{% macro rhs_type(o, i) %}tensor<{{ o // T }}x{{ i }}x{{ T }}x1xf32>{% endmacro %}
{% macro lhs_type(i) %}tensor<?x{{ i }}x{{ T }}x1xf32>{% endmacro %}
{% macro acc_type(o) %}tensor<?x{{ o // T }}x{{ T }}x{{ T }}xf32>{% endmacro %}
module {
{% for (part, o, i) in [("up", I, L), ("down", L, I)] %}
  func.func @{{ name }}_rhs_{{ part }}(%P: tensor<1x{{ o }}x{{ i // 2 }}xi8>, %S: tensor<1x{{ o }}x{{ i // 32 }}xi8>) -> {{ rhs_type(o, i) }} {
    %P4 = tensor.expand_shape %P [[0], [1, 2], [3, 4]] output_shape [1, {{ o // T }}, {{ T }}, {{ i // 32 }}, 16] : tensor<1x{{ o }}x{{ i // 2 }}xi8> into tensor<1x{{ o // T }}x{{ T }}x{{ i // 32 }}x16xi8>
    %S3 = tensor.expand_shape %S [[0], [1, 2], [3]] output_shape [1, {{ o // T }}, {{ T }}, {{ i // 32 }}] : tensor<1x{{ o }}x{{ i // 32 }}xi8> into tensor<1x{{ o // T }}x{{ T }}x{{ i // 32 }}xi8>
    %e = tensor.empty() : tensor<{{ o // T }}x{{ i // 32 }}x16x2x{{ T }}xf32>
    {#- output dims (n1, b, j, t, n0): element 32b + 2j + t of row T n1 + n0, nibble t of byte j #}
    %W = linalg.generic {indexing_maps = [affine_map<(n1, b, j, t, n0) -> (0, n1, n0, b, j)>, affine_map<(n1, b, j, t, n0) -> (0, n1, n0, b)>,
                                         affine_map<(n1, b, j, t, n0) -> (n1, b, j, t, n0)>],
                        iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}
        ins(%P4, %S3 : tensor<1x{{ o // T }}x{{ T }}x{{ i // 32 }}x16xi8>, tensor<1x{{ o // T }}x{{ T }}x{{ i // 32 }}xi8>)
        outs(%e : tensor<{{ o // T }}x{{ i // 32 }}x16x2x{{ T }}xf32>) {
    ^bb0(%p: i8, %s: i8, %out: f32):
      %c1 = arith.constant 1 : i32
      %c2 = arith.constant 2 : i32
      %c4 = arith.constant 4 : i32
      %c7 = arith.constant 7 : i32
      %c8 = arith.constant 8 : i32
      %c15 = arith.constant 15 : i32
      %c22 = arith.constant 22 : i32
      %c23 = arith.constant 23 : i32
      %c28 = arith.constant 28 : i32
      %c126 = arith.constant 126 : i32
      %zero = arith.constant 0 : i32
      %t = linalg.index 3 : index
      %t32 = arith.index_cast %t : index to i32
      %sh = arith.muli %t32, %c4 : i32
      %p32 = arith.extui %p : i8 to i32
      %ps = arith.shrui %p32, %sh : i32
      %c = arith.andi %ps, %c15 : i32
      {#- E2M1 from its bits: magnitude m = c & 7; m >= 2 is 2^((m >> 1) - 1) (1 + (m & 1) / 2), the f32
          ((m >> 1) + 126) << 23 | (m & 1) << 22; m = 1 is 0.5 (126 << 23), m = 0 is 0; sign bit c & 8 #}
      %m = arith.andi %c, %c7 : i32
      %ex = arith.shrui %m, %c1 : i32
      %eb = arith.addi %ex, %c126 : i32
      %ebits = arith.shli %eb, %c23 : i32
      %mb = arith.andi %m, %c1 : i32
      %mbits = arith.shli %mb, %c22 : i32
      %normal = arith.ori %ebits, %mbits : i32
      %big = arith.cmpi uge, %m, %c2 : i32
      %one = arith.cmpi eq, %m, %c1 : i32
      %half = arith.shli %c126, %c23 : i32
      %small = arith.select %one, %half, %zero : i32
      %mag = arith.select %big, %normal, %small : i32
      %sg = arith.andi %c, %c8 : i32
      %sbits = arith.shli %sg, %c28 : i32
      %bits = arith.ori %mag, %sbits : i32
      %v = arith.bitcast %bits : i32 to f32
      {#- the block scale 2^(S - 127) from its bits, as templates/mxfp4_gemv.mlir: S << 23, NaN for
          S = 255, +0 for S = 0 (IREE's CPU code flushes the subnormal 2^-127) #}
      %c8s = arith.constant 8 : i32
      %c1s = arith.constant 1 : i32
      %s32 = arith.extui %s : i8 to i32
      %sb = arith.shli %s32, %c23 : i32
      %sp = arith.addi %s32, %c1s : i32
      %st = arith.shrui %sp, %c8s : i32
      %sq = arith.shli %st, %c22 : i32
      %sr = arith.ori %sb, %sq : i32
      %scale = arith.bitcast %sr : i32 to f32
      %r = arith.mulf %v, %scale : f32
      linalg.yield %r : f32
    } -> tensor<{{ o // T }}x{{ i // 32 }}x16x2x{{ T }}xf32>
    %W3 = tensor.collapse_shape %W [[0], [1, 2, 3], [4]] : tensor<{{ o // T }}x{{ i // 32 }}x16x2x{{ T }}xf32> into tensor<{{ o // T }}x{{ i }}x{{ T }}xf32>
    %W4 = tensor.expand_shape %W3 [[0], [1], [2, 3]] output_shape [{{ o // T }}, {{ i }}, {{ T }}, 1] : tensor<{{ o // T }}x{{ i }}x{{ T }}xf32> into {{ rhs_type(o, i) }}
    return %W4 : {{ rhs_type(o, i) }}
  }
{% endfor %}
  func.func private @{{ act }}({{ acc_type(I) }}, {{ acc_type(I) }}) -> tensor<?x{{ I // T }}x{{ T }}x{{ T }}xf32>
  func.func @{{ name }}(%rows: {{ rows }}, %w1p: tensor<1x{{ I }}x{{ L // 2 }}xi8>, %w1s: tensor<1x{{ I }}x{{ L // 32 }}xi8>,
                    %w3p: tensor<1x{{ I }}x{{ L // 2 }}xi8>, %w3s: tensor<1x{{ I }}x{{ L // 32 }}xi8>,
                    %w2p: tensor<1x{{ L }}x{{ I // 2 }}xi8>, %w2s: tensor<1x{{ L }}x{{ I // 32 }}xi8>) -> {{ rows }} {
    %c0 = arith.constant 0 : index
    %zero = arith.constant 0.0 : f32
    %W1 = func.call @{{ name }}_rhs_up(%w1p, %w1s) : (tensor<1x{{ I }}x{{ L // 2 }}xi8>, tensor<1x{{ I }}x{{ L // 32 }}xi8>) -> {{ rhs_type(I, L) }}
    %W3 = func.call @{{ name }}_rhs_up(%w3p, %w3s) : (tensor<1x{{ I }}x{{ L // 2 }}xi8>, tensor<1x{{ I }}x{{ L // 32 }}xi8>) -> {{ rhs_type(I, L) }}
    %W2 = func.call @{{ name }}_rhs_down(%w2p, %w2s) : (tensor<1x{{ L }}x{{ I // 2 }}xi8>, tensor<1x{{ L }}x{{ I // 32 }}xi8>) -> {{ rhs_type(L, I) }}
    %n = tensor.dim %rows, %c0 : {{ rows }}
    {#- arith, not affine.apply: an affine op keeps the function from being inlined into the loop #}
    %cm = arith.constant {{ T - 1 }} : index
    %cT = arith.constant {{ T }} : index
    %nm = arith.addi %n, %cm : index
    %n1 = arith.divui %nm, %cT : index
    %xe = tensor.empty(%n1) : {{ lhs_type(L) }}
    %x = linalg.pack %rows padding_value(%zero : f32) inner_dims_pos = [0, 1] inner_tiles = [{{ T }}, 1] into %xe : {{ rows }} -> {{ lhs_type(L) }}
    %ge = tensor.empty(%n1) : {{ acc_type(I) }}
    %gf = linalg.fill ins(%zero : f32) outs(%ge : {{ acc_type(I) }}) -> {{ acc_type(I) }}
    %g = linalg.mmt4d ins(%x, %W1 : {{ lhs_type(L) }}, {{ rhs_type(I, L) }}) outs(%gf : {{ acc_type(I) }}) -> {{ acc_type(I) }}
    %u = linalg.mmt4d ins(%x, %W3 : {{ lhs_type(L) }}, {{ rhs_type(I, L) }}) outs(%gf : {{ acc_type(I) }}) -> {{ acc_type(I) }}
    %h = func.call @{{ act }}(%g, %u) : ({{ acc_type(I) }}, {{ acc_type(I) }}) -> tensor<?x{{ I // T }}x{{ T }}x{{ T }}xf32>
    %h4 = tensor.expand_shape %h [[0], [1], [2], [3, 4]] output_shape [%n1, {{ I // T }}, {{ T }}, {{ T }}, 1] : tensor<?x{{ I // T }}x{{ T }}x{{ T }}xf32> into tensor<?x{{ I // T }}x{{ T }}x{{ T }}x1xf32>
    %hp = tensor.collapse_shape %h4 [[0], [1, 2], [3], [4]] : tensor<?x{{ I // T }}x{{ T }}x{{ T }}x1xf32> into {{ lhs_type(I) }}
    %ye = tensor.empty(%n1) : {{ acc_type(L) }}
    %yf = linalg.fill ins(%zero : f32) outs(%ye : {{ acc_type(L) }}) -> {{ acc_type(L) }}
    %y4 = linalg.mmt4d ins(%hp, %W2 : {{ lhs_type(I) }}, {{ rhs_type(L, I) }}) outs(%yf : {{ acc_type(L) }}) -> {{ acc_type(L) }}
    %out = tensor.empty(%n) : {{ rows }}
    %y = linalg.unpack %y4 inner_dims_pos = [0, 1] inner_tiles = [{{ T }}, {{ T }}] into %out : {{ acc_type(L) }} -> {{ rows }}
    return %y : {{ rows }}
  }
}
