{#- torch.k3.kda_chunk as a loop over blocks of `block` tokens (ops/kda.py kda_chunk_blocks).
    @{{sym}}_chunk is the traced chunkwise form of one block; the loop carries one buffer
    [B, H, K + T, V]: the state's K rows, then the outputs, head-major. The last block is padded
    with zeros (tokens that change nothing). -#}
{% macro along_t(t, at, other) %}{% for d in t.shape %}{{ at if loop.index0 == 1 else (d if other is none else other) }}{{ ", " if not loop.last }}{% endfor %}{% endmacro %}
{% set state = "[0, 0, 0, 0] [%d, %d, %d, %d] [1, 1, 1, 1]" % (B, H, K, V) %}
module {
  func.func private @{{ sym }}_chunk({{ static | join(", ") }}) -> ({{ o_chunk }}, {{ S }})
  func.func @{{ sym }}(%q: {{ q }}, %k: {{ k }}, %v: {{ v }}, %g: {{ g }}, %beta: {{ beta }}, %S0: {{ S }}) -> ({{ o }}, {{ S }}) {
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %cC = arith.constant {{ block }} : index
    %cK = arith.constant {{ K }} : index
    %zero = arith.constant 0.0 : {{ element }}
    %T = tensor.dim %q, %c1 : {{ q }}
    %TK = arith.addi %T, %cK : index
    %empty = tensor.empty(%TK) : {{ buf }}
    %init = tensor.insert_slice %S0 into %empty{{ state }} : {{ S }} into {{ buf }}
    %r = scf.for %i = %c0 to %T step %cC iter_args(%b = %init) -> ({{ buf }}) {
      %rem = arith.subi %T, %i : index
      %n = arith.minsi %rem, %cC : index
      %npad = arith.subi %cC, %n : index
{% for x in tokens %}
      %{{ x.name }}_s = tensor.extract_slice %{{ x.name }}[{{ along_t(x.type, "%i", 0) }}] [{{ along_t(x.type, "%n", none) }}] [{{ along_t(x.type, 1, 1) }}] : {{ x.type }} to {{ x.type }}
      %{{ x.name }}_p = tensor.pad %{{ x.name }}_s low[{{ along_t(x.type, 0, 0) }}] high[{{ along_t(x.type, "%npad", 0) }}] {
      ^bb0({% for d in x.type.shape %}%a{{ loop.index0 }}: index{{ ", " if not loop.last }}{% endfor %}):
        tensor.yield %zero : {{ element }}
      } : {{ x.type }} to {{ x.type }}
      %{{ x.name }}_c = tensor.cast %{{ x.name }}_p : {{ x.type }} to {{ x.static }}
{% endfor %}
      %S = tensor.extract_slice %b{{ state }} : {{ buf }} to {{ S }}
      %co:2 = func.call @{{ sym }}_chunk({% for x in tokens %}%{{ x.name }}_c, {% endfor %}%S) : ({{ static | join(", ") }}) -> ({{ o_chunk }}, {{ S }})
      %os = tensor.extract_slice %co#0[0, 0, 0, 0] [{{ B }}, {{ H }}, %n, {{ V }}] [1, 1, 1, 1] : {{ o_chunk }} to {{ buf }}
      %at = arith.addi %i, %cK : index
      %b2 = tensor.insert_slice %os into %b[0, 0, %at, 0] [{{ B }}, {{ H }}, %n, {{ V }}] [1, 1, 1, 1] : {{ buf }} into {{ buf }}
      %b3 = tensor.insert_slice %co#1 into %b2{{ state }} : {{ S }} into {{ buf }}
      scf.yield %b3 : {{ buf }}
    }
    %oh = tensor.extract_slice %r[0, 0, {{ K }}, 0] [{{ B }}, {{ H }}, %T, {{ V }}] [1, 1, 1, 1] : {{ buf }} to {{ buf }}
    %o_e = tensor.empty(%T) : {{ o }}
    %o = linalg.transpose ins(%oh : {{ buf }}) outs(%o_e : {{ o }}) permutation = [0, 2, 1, 3]
    %Sr = tensor.extract_slice %r{{ state }} : {{ buf }} to {{ S }}
    %S_e = tensor.empty() : {{ S }}
    %S1 = linalg.copy ins(%Sr : {{ S }}) outs(%S_e : {{ S }}) -> {{ S }}
    return %o, %S1 : {{ o }}, {{ S }}
  }
}
