{#- The activation of the native MXFP4 matvec (ops/mxfp4_gemv.py split, decode "native"): x [1, W]
    -> xt [W/128, 8, 16], xt[c, n, l] = x[128c + 8l + n] (the nibble n of dword l of a 64-byte
    chunk c; ops/kernels/mxfp4_rows.c); one small op of its own. -#}
{% set x3 = "tensor<%dx16x8xf32>" % (width // 128) %}
{% set xt = "tensor<%dx8x16xf32>" % (width // 128) %}
module {
  func.func @{{ name }}(%x: tensor<1x{{ width }}xf32>) -> {{ xt }} {
    %x1 = tensor.collapse_shape %x [[0, 1]] : tensor<1x{{ width }}xf32> into tensor<{{ width }}xf32>
    %x3 = tensor.expand_shape %x1 [[0, 1, 2]] output_shape [{{ width // 128 }}, 16, 8] : tensor<{{ width }}xf32> into {{ x3 }}
    %e = tensor.empty() : {{ xt }}
    %t = linalg.transpose ins(%x3 : {{ x3 }}) outs(%e : {{ xt }}) permutation = [0, 2, 1]
    return %t : {{ xt }}
  }
}
