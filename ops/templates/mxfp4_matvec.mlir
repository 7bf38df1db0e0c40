{#- One streamed MXFP4 matvec as the expert FFN runs it, split then gemv, as a public @main
    (ops/mxfp4_gemv.py matvec_module: for tests and the bench). -#}
{% set x = "tensor<1x%dxf32>" % IN %}
{% set y = "tensor<1x%dxf32>" % O %}
{% set xt = "tensor<%dx%dxf32>" % (IN // 32, LANES) %}
{% set pk = "tensor<1x%dx%dxi8>" % (O, IN // 2) %}
{% set sc = "tensor<1x%dx%dxi8>" % (O, IN // 32) %}
module {
  func.func private @split({{ x }}) -> ({{ xt }}, {{ xt }})
  func.func private @gemv({{ pk }}, {{ sc }}, {{ xt }}, {{ xt }}) -> {{ y }}
  func.func @main(%P: {{ pk }}, %S: {{ sc }}, %x: {{ x }}) -> {{ y }} {
    %h:2 = func.call @split(%x) : ({{ x }}) -> ({{ xt }}, {{ xt }})
    %y = func.call @gemv(%P, %S, %h#0, %h#1) : ({{ pk }}, {{ sc }}, {{ xt }}, {{ xt }}) -> {{ y }}
    return %y : {{ y }}
  }
}
