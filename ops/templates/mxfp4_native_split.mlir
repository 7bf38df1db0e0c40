{#- The activation of the native MXFP4 matvec (ops/mxfp4_gemv.py split, decode "native:<level>"):
    x [1, W] -> xt [W/128, 8, 16], each chunk of 128 activations permuted into the order in which
    the level's kernel variant multiplies them (ops/kernels/mxfp4_rows.c): x seen as `dims` (the
    chunk first), transposed by `perm` into `permuted`, regrouped by `groups` where it has more than 3 dims; one small op of its own. -#}
{% set xd = "tensor<%sxf32>" % (dims | join("x")) %}
{% set xp = "tensor<%sxf32>" % (permuted | join("x")) %}
{% set xt = "tensor<%dx8x16xf32>" % (width // 128) %}
module {
  func.func @{{ name }}(%x: tensor<1x{{ width }}xf32>) -> {{ xt }} {
    %x1 = tensor.collapse_shape %x [[0, 1]] : tensor<1x{{ width }}xf32> into tensor<{{ width }}xf32>
    %xd = tensor.expand_shape %x1 [[{{ range(dims | length) | join(", ") }}]] output_shape [{{ dims | join(", ") }}] : tensor<{{ width }}xf32> into {{ xd }}
    %e = tensor.empty() : {{ xp }}
    %t = linalg.transpose ins(%xd : {{ xd }}) outs(%e : {{ xp }}) permutation = [{{ perm | join(", ") }}]
{% if permuted | length > 3 %}
    %xt = tensor.collapse_shape %t {{ groups }} : {{ xp }} into {{ xt }}
    return %xt : {{ xt }}
{% else %}
    return %t : {{ xt }}
{% endif %}
  }
}
