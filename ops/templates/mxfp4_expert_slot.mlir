{#- One expert slot of the streamed MXFP4 decode (ops/mxfp4_gemv.py expert_slot):
    a + ws * W2 act(W1 z, W3 z), each matrix [1, out, ...] sliced from the stacked weights and
    multiplied packed by @{{name}}_up / @{{name}}_down (templates/mxfp4_gemv.mlir) on the split
    activations (templates/mxfp4_split.mlir); @{{act}} and @{{axpy}} are traced from PyTorch. -#}
{% set row = "tensor<1x%dxf32>" % L %}
{% set hid = "tensor<1x%dxf32>" % I %}
{% set wt = "tensor<1x1xf32>" %}
{% set w13 = ["tensor<1x%dx%dxi8>" % (I, L // 2), "tensor<1x%dx%dxi8>" % (I, L // 32)] %}
{% set w2 = ["tensor<1x%dx%dxi8>" % (L, I // 2), "tensor<1x%dx%dxi8>" % (L, I // 32)] %}
{% set xl = "tensor<%dx%dxf32>" % (L // 32, LANES) %}
{% set xi = "tensor<%dx%dxf32>" % (I // 32, LANES) %}
{% set a13 = "%s, %s, %s, %s" % (w13[0], w13[1], xl, xl) %}
{% set a2 = "%s, %s, %s, %s" % (w2[0], w2[1], xi, xi) %}
module {
  func.func private @{{ name }}_split_in({{ row }}) -> ({{ xl }}, {{ xl }})
  func.func private @{{ name }}_split_hid({{ hid }}) -> ({{ xi }}, {{ xi }})
  func.func private @{{ name }}_up({{ a13 }}) -> {{ hid }}
  func.func private @{{ name }}_down({{ a2 }}) -> {{ row }}
  func.func private @{{ act }}({{ hid }}, {{ hid }}) -> {{ hid }}
  func.func private @{{ axpy }}({{ row }}, {{ wt }}, {{ row }}) -> {{ row }}
  func.func @{{ name }}(%a: {{ row }}, %z: {{ row }}, %ws: {{ wt }}, %w1p: {{ w13[0] }}, %w1s: {{ w13[1] }}, %w3p: {{ w13[0] }}, %w3s: {{ w13[1] }},
                    %w2p: {{ w2[0] }}, %w2s: {{ w2[1] }}) -> {{ row }} {
    %x:2 = func.call @{{ name }}_split_in(%z) : ({{ row }}) -> ({{ xl }}, {{ xl }})
    %g = func.call @{{ name }}_up(%w1p, %w1s, %x#0, %x#1) : ({{ a13 }}) -> {{ hid }}
    %u = func.call @{{ name }}_up(%w3p, %w3s, %x#0, %x#1) : ({{ a13 }}) -> {{ hid }}
    %h = func.call @{{ act }}(%g, %u) : ({{ hid }}, {{ hid }}) -> {{ hid }}
    %hx:2 = func.call @{{ name }}_split_hid(%h) : ({{ hid }}) -> ({{ xi }}, {{ xi }})
    %y = func.call @{{ name }}_down(%w2p, %w2s, %hx#0, %hx#1) : ({{ a2 }}) -> {{ row }}
    %r = func.call @{{ axpy }}(%a, %ws, %y) : ({{ row }}, {{ wt }}, {{ row }}) -> {{ row }}
    return %r : {{ row }}
  }
}
