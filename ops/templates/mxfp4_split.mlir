{#- The activation of the streamed MXFP4 matvec (ops/mxfp4_gemv.py split): x [1, W] -> the even
    and odd elements of each 32-element block, xe, xo [W/32, 16], times `fold` (the decode's
    offset, 2^14 for "f16"); one small op of its own. -#}
{% set x3 = "tensor<%dx%dx2xf32>" % (B, LANES) %}
{% set xt = "tensor<2x%dx%dxf32>" % (B, LANES) %}
{% set half = "tensor<%dx%dxf32>" % (B, LANES) %}
module {
  func.func @{{ name }}(%x: tensor<1x{{ width }}xf32>) -> ({{ half }}, {{ half }}) {
    %fold = arith.constant {{ "%e" % fold }} : f32
    %x1 = tensor.collapse_shape %x [[0, 1]] : tensor<1x{{ width }}xf32> into tensor<{{ width }}xf32>
    %x3 = tensor.expand_shape %x1 [[0, 1, 2]] output_shape [{{ B }}, {{ LANES }}, 2] : tensor<{{ width }}xf32> into {{ x3 }}
    %e = tensor.empty() : {{ xt }}
    %t = linalg.generic {indexing_maps = [affine_map<(k, b, j) -> (b, j, k)>, affine_map<(k, b, j) -> (k, b, j)>],
                        iterator_types = ["parallel", "parallel", "parallel"]}
        ins(%x3 : {{ x3 }}) outs(%e : {{ xt }}) {
    ^bb0(%v: f32, %o: f32):
      %r = arith.mulf %v, %fold : f32
      linalg.yield %r : f32
    } -> {{ xt }}
    %xe = tensor.extract_slice %t[0, 0, 0] [1, {{ B }}, {{ LANES }}] [1, 1, 1] : {{ xt }} to {{ half }}
    %xo = tensor.extract_slice %t[1, 0, 0] [1, {{ B }}, {{ LANES }}] [1, 1, 1] : {{ xt }} to {{ half }}
    return %xe, %xo : {{ half }}, {{ half }}
  }
}
