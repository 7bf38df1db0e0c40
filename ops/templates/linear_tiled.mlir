{#- The tiled product of many rows (ops/linear.py tiled): y [.., O] = x [.., IN] W^T for f32 x whose
    leading dims hold one dynamic row count, W [O, IN] f32 or bf16, as one linalg.mmt4d on M0 x N0 x 1
    tiles (IREE's CPU tiled matmul; the tile is the CPU level's, docs/pipeline.md §4) without the
    data-tiling flag. W is widened and laid out once per call into the mmt4d's right-hand tiles
    [O/N0, IN, N0, 1] by one elementwise op; the rows are packed (zero padded to a multiple of M0)
    and the M0 x N0 result tiles unpacked. `lead` are the leading dims of x and y ("?" for the
    dynamic one, at position `dyn`). -#}
{% set xs = "tensor<%sxf32>" % "x".join(lead + [IN|string]) %}
{% set ys = "tensor<%sxf32>" % "x".join(lead + [O|string]) %}
{% set rows = "tensor<?x%dxf32>" % IN %}
{% set out = "tensor<?x%dxf32>" % O %}
{% set collapse = "[[" + ", ".join(range(lead|length)|map("string")) + "], [" + (lead|length)|string + "]]" %}
{% set shape = ", ".join(lead[:dyn] + ["%n"] + lead[dyn + 1:] + [O|string]) %}
{% set rhs = "tensor<%dx%dx%dx1xf32>" % (O // N0, IN, N0) %}
{% set lhs = "tensor<?x%dx%dx1xf32>" % (IN, M0) %}
{% set acc = "tensor<?x%dx%dx%dxf32>" % (O // N0, M0, N0) %}
{% set w3 = "tensor<%dx%dx%dx%s>" % (O // N0, N0, IN, wtype) %}
module {
  func.func @{{ name }}(%x: {{ xs }}, %W: tensor<{{ O }}x{{ IN }}x{{ wtype }}>) -> {{ ys }} {
    %c0 = arith.constant 0 : index
    %cm = arith.constant {{ M0 - 1 }} : index
    %cM0 = arith.constant {{ M0 }} : index
    %zero = arith.constant 0.0 : f32
{% if lead|length > 1 %}
    %x2 = tensor.collapse_shape %x {{ collapse }} : {{ xs }} into {{ rows }}
{% else %}
    %x2 = tensor.cast %x : {{ xs }} to {{ rows }}
{% endif %}
    %n = tensor.dim %x2, %c0 : {{ rows }}
    %W3 = tensor.expand_shape %W [[0, 1], [2]] output_shape [{{ O // N0 }}, {{ N0 }}, {{ IN }}] : tensor<{{ O }}x{{ IN }}x{{ wtype }}> into {{ w3 }}
    %we = tensor.empty() : {{ rhs }}
    %Wt = linalg.generic {indexing_maps = [affine_map<(n1, k, n0, z) -> (n1, n0, k)>, affine_map<(n1, k, n0, z) -> (n1, k, n0, z)>],
                         iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
        ins(%W3 : {{ w3 }}) outs(%we : {{ rhs }}) {
    ^bb0(%w: {{ wtype }}, %o: f32):
{% if wtype == "f32" %}
      linalg.yield %w : f32
{% else %}
      %f = arith.extf %w : {{ wtype }} to f32
      linalg.yield %f : f32
{% endif %}
    } -> {{ rhs }}
    {#- arith, not affine.apply: an affine op keeps the function from being inlined #}
    %nm = arith.addi %n, %cm : index
    %n1 = arith.divui %nm, %cM0 : index
    %xe = tensor.empty(%n1) : {{ lhs }}
    %xp = linalg.pack %x2 padding_value(%zero : f32) inner_dims_pos = [0, 1] inner_tiles = [{{ M0 }}, 1] into %xe : {{ rows }} -> {{ lhs }}
    %ae = tensor.empty(%n1) : {{ acc }}
    %af = linalg.fill ins(%zero : f32) outs(%ae : {{ acc }}) -> {{ acc }}
    %y4 = linalg.mmt4d ins(%xp, %Wt : {{ lhs }}, {{ rhs }}) outs(%af : {{ acc }}) -> {{ acc }}
    %ye = tensor.empty(%n) : {{ out }}
    %y2 = linalg.unpack %y4 inner_dims_pos = [0, 1] inner_tiles = [{{ M0 }}, {{ N0 }}] into %ye : {{ acc }} -> {{ out }}
{% if lead|length > 1 %}
    %y = tensor.expand_shape %y2 {{ collapse }} output_shape [{{ shape }}] : {{ out }} into {{ ys }}
{% else %}
    %y = tensor.cast %y2 : {{ out }} to {{ ys }}
{% endif %}
    return %y : {{ ys }}
  }
}
