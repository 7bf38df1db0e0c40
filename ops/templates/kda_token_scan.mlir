{#- torch.k3.kda_chunk token by token (ops/kda.py kda_token_scan, the bench's baseline):
    @{{sym}}_token is the traced one-token recurrence, called in a loop over T carrying the state. -#}
{% macro along_t(t, at, other) %}{% for d in t.shape %}{{ at if loop.index0 == 1 else (d if other is none else other) }}{{ ", " if not loop.last }}{% endfor %}{% endmacro %}
module {
  func.func private @{{ sym }}_token({{ one | join(", ") }}) -> ({{ o1 }}, {{ S }})
  func.func @{{ sym }}(%q: {{ q }}, %k: {{ k }}, %v: {{ v }}, %g: {{ g }}, %beta: {{ beta }}, %S0: {{ S }}) -> ({{ v }}, {{ S }}) {
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %T = tensor.dim %q, %c1 : {{ q }}
    %init = tensor.empty(%T) : {{ v }}
    %r:2 = scf.for %i = %c0 to %T step %c1 iter_args(%out = %init, %S = %S0) -> ({{ v }}, {{ S }}) {
{% for x in tokens %}
      %{{ x.name }}_t = tensor.extract_slice %{{ x.name }}[{{ along_t(x.type, "%i", 0) }}] [{{ x.one.shape | join(", ") }}] [{{ along_t(x.type, 1, 1) }}] : {{ x.type }} to {{ x.one }}
{% endfor %}
      %o:2 = func.call @{{ sym }}_token({% for x in tokens %}%{{ x.name }}_t, {% endfor %}%S) : ({{ one | join(", ") }}) -> ({{ o1 }}, {{ S }})
      %o2 = tensor.insert_slice %o#0 into %out[0, %i, 0, 0] [{{ o1.shape | join(", ") }}] [1, 1, 1, 1] : {{ o1 }} into {{ v }}
      scf.yield %o2, %o#1 : {{ v }}, {{ S }}
    }
    return %r#0, %r#1 : {{ v }}, {{ S }}
  }
}
