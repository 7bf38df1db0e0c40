{#- One expert slot of the streamed MXFP4 decode (ops/mxfp4_gemv.py expert_slot):
    a + ws * W2 act(W1 z, W3 z) of expert e = idx[pair], each matrix read in place from the stacked weights
    [E, out, ...] and multiplied packed by @{{name}}_up / @{{name}}_down (templates/mxfp4_gemv.mlir or
    mxfp4_native_gemv.mlir) on the activations split for them (xl: z's types, xi: the hidden
    row's; templates/mxfp4_split.mlir or mxfp4_native_split.mlir); @{{act}} and @{{axpy}} are
    traced from PyTorch. -#}
{% set row = "tensor<1x%dxf32>" % L %}
{% set hid = "tensor<1x%dxf32>" % I %}
{% set wt = "tensor<1x1xf32>" %}
{% set w13 = ["tensor<%dx%dx%dxi8>" % (E, I, L // 2), "tensor<%dx%dx%dxi8>" % (E, I, L // 32)] %}
{% set w2 = ["tensor<%dx%dx%dxi8>" % (E, L, I // 2), "tensor<%dx%dx%dxi8>" % (E, L, I // 32)] %}
{% set xls = xl | join(", ") %}
{% set xis = xi | join(", ") %}
{% macro parts(v, types) %}{% for t in types %}%{{ v }}#{{ loop.index0 }}{{ ", " if not loop.last }}{% endfor %}{% endmacro %}
{% set ix = "tensor<%dxi64>" % PAIRS %}
{% set a13 = "%s, %s, %s, index, %s" % (w13[0], w13[1], ix, xls) %}
{% set a2 = "%s, %s, %s, index, %s" % (w2[0], w2[1], ix, xis) %}
module {
  func.func private @{{ name }}_split_in({{ row }}) -> ({{ xls }})
  func.func private @{{ name }}_split_hid({{ hid }}) -> ({{ xis }})
  func.func private @{{ name }}_up({{ a13 }}) -> {{ hid }}
  func.func private @{{ name }}_down({{ a2 }}) -> {{ row }}
  func.func private @{{ act }}({{ hid }}, {{ hid }}) -> {{ hid }}
  func.func private @{{ axpy }}({{ row }}, {{ wt }}, {{ row }}) -> {{ row }}
  func.func @{{ name }}(%a: {{ row }}, %z: {{ row }}, %ws: {{ wt }}, %idx: {{ ix }}, %pair: index, %w1p: {{ w13[0] }}, %w1s: {{ w13[1] }}, %w3p: {{ w13[0] }}, %w3s: {{ w13[1] }},
                    %w2p: {{ w2[0] }}, %w2s: {{ w2[1] }}) -> {{ row }} {
    %x:{{ xl | length }} = func.call @{{ name }}_split_in(%z) : ({{ row }}) -> ({{ xls }})
    %g = func.call @{{ name }}_up(%w1p, %w1s, %idx, %pair, {{ parts("x", xl) }}) : ({{ a13 }}) -> {{ hid }}
    %u = func.call @{{ name }}_up(%w3p, %w3s, %idx, %pair, {{ parts("x", xl) }}) : ({{ a13 }}) -> {{ hid }}
    %h = func.call @{{ act }}(%g, %u) : ({{ hid }}, {{ hid }}) -> {{ hid }}
    %hx:{{ xi | length }} = func.call @{{ name }}_split_hid(%h) : ({{ hid }}) -> ({{ xis }})
    %y = func.call @{{ name }}_down(%w2p, %w2s, %idx, %pair, {{ parts("hx", xi) }}) : ({{ a2 }}) -> {{ row }}
    %r = func.call @{{ axpy }}(%a, %ws, %y) : ({{ row }}, {{ wt }}, {{ row }}) -> {{ row }}
    return %r : {{ row }}
  }
}
