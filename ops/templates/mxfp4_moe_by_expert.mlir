{#- torch.k3.mxfp4_moe, prefill form (ops/mxfp4_moe.py by_expert): @{{sym}}_group orders the
    (token, slot) pairs by expert, the loop over the E experts runs @{{sym}}_expert (the FFN) on each
    expert's rows with its matrices sliced in place, @{{sym}}_combine adds each token's k results. ``ranged`` (one device's
    share of the experts): the pairs whose expert is outside [0, E) are grouped last and never
    run, their rows left zero. -#}
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
    %out = scf.for %e = %c0 to %cE step %c1 iter_args(%acc = %init) -> ({{ rows }}) {
      %n64 = tensor.extract %g#2[%e] : {{ vec }}
      %s64 = tensor.extract %g#3[%e] : {{ vec }}
      %n = arith.index_cast %n64 : {{ vec.element }} to index
      %s = arith.index_cast %s64 : {{ vec.element }} to index
      %rows = tensor.extract_slice %zs[%s, 0] [%n, {{ L }}] [1, 1] : {{ rows }} to {{ rows }}
{{ slices.expert_slices(weights, "%e") }}
      %ye = func.call @{{ sym }}_expert(%rows, {% for m in weights %}%{{ m.name }}_e{{ ", " if not loop.last }}{% endfor %})
          : ({{ rows }}, {{ one_types }}) -> {{ rows }}
      %put = tensor.insert_slice %ye into %acc[%s, 0] [%n, {{ L }}] [1, 1] : {{ rows }} into {{ rows }}
      scf.yield %put : {{ rows }}
    }
    %out3 = tensor.expand_shape %out [[0, 1], [2]] output_shape [%N, {{ k }}, {{ L }}] : {{ rows }} into {{ zs3 }}
    %y = func.call @{{ sym }}_combine(%out3, %g#1, %w) : ({{ zs3 }}, {{ idx }}, {{ w }}) -> {{ rows }}
    return %y : {{ rows }}
  }
}
