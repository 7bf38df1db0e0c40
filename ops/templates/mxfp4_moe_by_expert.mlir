{#- torch.k3.mxfp4_moe, prefill form (ops/mxfp4_moe.py by_expert): @{{sym}}_group orders the
    (token, slot) pairs by expert, @{{sym}}_expert (the FFN) runs on each expert's rows with its
    matrices sliced in place, @{{sym}}_combine adds each token's k results. The experts are written
    out {{ unroll }} at a time: straight-line code where that is all E of them, else in an scf.for
    over groups of {{ unroll }}. IREE 3.13 copies a tensor carried by a loop whole on every trip
    (a same-device transfer of the iteration argument that is never elided), so the [N k, L] rows
    of every expert's results would be copied once per expert; in straight-line code each expert
    writes its rows in place. ``ranged`` (one device's share of the experts): the pairs whose
    expert is outside [0, E) are grouped last and never run, their rows left zero. -#}
{% import "mxfp4_moe_slices.mlir" as slices %}
{% set one_types = weights | map(attribute="one") | join(", ") %}
module {
  func.func private @{{ sym }}_group({{ z }}, {{ idx }}) -> ({{ zs3 }}, {{ idx }}, {{ vec }}, {{ vec }})
  func.func private @{{ sym }}_expert({{ rows }}, {{ one_types }}) -> {{ rows }}
  func.func private @{{ sym }}_combine({{ zs3 }}, {{ idx }}, {{ w }}) -> {{ rows }}
  func.func @{{ sym }}(%z: {{ z }}, %idx: {{ idx }}, %w: {{ w }}, {% for m in weights %}%{{ m.name }}: {{ m.type }}{{ ", " if not loop.last }}{% endfor %}) -> {{ rows }} {
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %ck = arith.constant {{ k }} : index
    %cE = arith.constant {{ E }} : index
    %g:4 = func.call @{{ sym }}_group(%z, %idx) : ({{ z }}, {{ idx }}) -> ({{ zs3 }}, {{ idx }}, {{ vec }}, {{ vec }})
    %N = tensor.dim %z, %c0 : {{ z }}
    %Nk = arith.muli %N, %ck : index
    %zs = tensor.collapse_shape %g#0 [[0, 1], [2]] : {{ zs3 }} into {{ rows }}
{% if ranged %}
    %zero = arith.constant 0.0 : {{ rows.element }}
    %empty = tensor.empty(%Nk) : {{ rows }}
    %init = linalg.fill ins(%zero : {{ rows.element }}) outs(%empty : {{ rows }}) -> {{ rows }}
{% else %}
    %init = tensor.empty(%Nk) : {{ rows }}
{% endif %}
{% macro expert_step(j, e, acc) %}
      %n64_{{ j }} = tensor.extract %g#2[{{ e }}] : {{ vec }}
      %s64_{{ j }} = tensor.extract %g#3[{{ e }}] : {{ vec }}
      %n_{{ j }} = arith.index_cast %n64_{{ j }} : {{ vec.element }} to index
      %s_{{ j }} = arith.index_cast %s64_{{ j }} : {{ vec.element }} to index
      %rows_{{ j }} = tensor.extract_slice %zs[%s_{{ j }}, 0] [%n_{{ j }}, {{ L }}] [1, 1] : {{ rows }} to {{ rows }}
{{ slices.expert_slices(weights, e, "_" ~ j) }}
      %ye_{{ j }} = func.call @{{ sym }}_expert(%rows_{{ j }}, {% for m in weights %}%{{ m.name }}_e_{{ j }}{{ ", " if not loop.last }}{% endfor %})
          : ({{ rows }}, {{ one_types }}) -> {{ rows }}
      %acc_{{ j + 1 }} = tensor.insert_slice %ye_{{ j }} into {{ acc }}[%s_{{ j }}, 0] [%n_{{ j }}, {{ L }}] [1, 1] : {{ rows }} into {{ rows }}
{% endmacro %}
{% if unroll == E %}
{% for j in range(E) %}
    %e_{{ j }} = arith.constant {{ j }} : index
{{ expert_step(j, "%e_" ~ j, "%init" if j == 0 else "%acc_" ~ j) }}
{% endfor %}
    %out = tensor.cast %acc_{{ E }} : {{ rows }} to {{ rows }}
{% else %}
    %cU = arith.constant {{ unroll }} : index
    %out = scf.for %first = %c0 to %cE step %cU iter_args(%acc_0 = %init) -> ({{ rows }}) {
{% for j in range(unroll) %}
      %j_{{ j }} = arith.constant {{ j }} : index
      %e_{{ j }} = arith.addi %first, %j_{{ j }} : index
{{ expert_step(j, "%e_" ~ j, "%acc_" ~ j) }}
{% endfor %}
      scf.yield %acc_{{ unroll }} : {{ rows }}
    }
{% endif %}
    %out3 = tensor.expand_shape %out [[0, 1], [2]] output_shape [%N, {{ k }}, {{ L }}] : {{ rows }} into {{ zs3 }}
    %y = func.call @{{ sym }}_combine(%out3, %g#1, %w) : ({{ zs3 }}, {{ idx }}, {{ w }}) -> {{ rows }}
    return %y : {{ rows }}
  }
}
