{#- One streamed MXFP4 matvec as the expert FFN runs it, split then gemv, as a public @main
    (ops/mxfp4_gemv.py matvec_module: for tests and the bench); `xt` the activation's types. -#}
{% set x = "tensor<1x%dxf32>" % IN %}
{% set y = "tensor<1x%dxf32>" % O %}
{% set pk = "tensor<1x%dx%dxi8>" % (O, IN // 2) %}
{% set sc = "tensor<1x%dx%dxi8>" % (O, IN // 32) %}
{% set acts = xt | join(", ") %}
module {
  func.func private @split({{ x }}) -> ({{ acts }})
  func.func private @gemv({{ pk }}, {{ sc }}, tensor<1xi64>, index, {{ acts }}) -> {{ y }}
  func.func @main(%P: {{ pk }}, %S: {{ sc }}, %x: {{ x }}) -> {{ y }} {
    %h:{{ xt | length }} = func.call @split(%x) : ({{ x }}) -> ({{ acts }})
    %c0 = arith.constant 0 : index
    %first = arith.constant dense<0> : tensor<1xi64>
    %y = func.call @gemv(%P, %S, %first, %c0, {% for t in xt %}%h#{{ loop.index0 }}{{ ", " if not loop.last }}{% endfor %}) : ({{ pk }}, {{ sc }}, tensor<1xi64>, index, {{ acts }}) -> {{ y }}
    return %y : {{ y }}
  }
}
