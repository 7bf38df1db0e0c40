{#- torch.k3.mxfp4_moe, decode form (ops/mxfp4_moe.py by_slot): a loop over the N tokens and their
    k (token, slot) pairs, each adding w * FFN_e(z) of its picked expert e to the token's row, the
    expert's matrices sliced in place from the stacked weights (``stacked``: the stacked weights and
    e passed whole, the slot slices or offsets them itself); @{{sym}}_slot is the FFN. ``ranged``
    (one device's share of the experts): a pair whose expert is outside [0, E) is skipped. -#}
{% import "mxfp4_moe_slices.mlir" as slices %}
{% set slot_types = ([row, row, wt, "index"] + weights | map(attribute="type") | list if stacked else [row, row, wt] + one) | join(", ") %}
module {
  func.func private @{{ sym }}_slot({{ slot_types }}) -> {{ row }}
  func.func @{{ sym }}(%z: {{ z }}, %idx: {{ idx }}, %w: {{ w }}, {% for m in weights %}%{{ m.name }}: {{ m.type }}{{ ", " if not loop.last }}{% endfor %}) -> {{ out }} {
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %cN = arith.constant {{ N }} : index
    %ck = arith.constant {{ k }} : index
{% if ranged %}
    %cE = arith.constant {{ weights[0].type.shape[0] }} : index
{% endif %}
    %zero = arith.constant 0.0 : {{ out.element }}
    %empty = tensor.empty() : {{ out }}
    %init = linalg.fill ins(%zero : {{ out.element }}) outs(%empty : {{ out }}) -> {{ out }}
    %y = scf.for %n = %c0 to %cN step %c1 iter_args(%all = %init) -> ({{ out }}) {
      %zn = tensor.extract_slice %z[%n, 0] [1, {{ L }}] [1, 1] : {{ z }} to {{ row }}
      %yn0 = tensor.extract_slice %all[%n, 0] [1, {{ L }}] [1, 1] : {{ out }} to {{ row }}
      %yn = scf.for %s = %c0 to %ck step %c1 iter_args(%a = %yn0) -> ({{ row }}) {
        %e64 = tensor.extract %idx[%n, %s] : {{ idx }}
        %e = arith.index_cast %e64 : {{ idx.element }} to index
{% if ranged %}
        %inside = arith.cmpi ult, %e, %cE : index
        %a2 = scf.if %inside -> ({{ row }}) {
{% endif %}
        %ws = tensor.extract_slice %w[%n, %s] [1, 1] [1, 1] : {{ w }} to {{ wt }}
{% if stacked %}
        %a{{ 1 if ranged else 2 }} = func.call @{{ sym }}_slot(%a, %zn, %ws, %e, {% for m in weights %}%{{ m.name }}{{ ", " if not loop.last }}{% endfor %}) : ({{ slot_types }}) -> {{ row }}
{% else %}
{{ slices.expert_slices(weights, "%e") -}}
        %a{{ 1 if ranged else 2 }} = func.call @{{ sym }}_slot(%a, %zn, %ws, {% for m in weights %}%{{ m.name }}_e{{ ", " if not loop.last }}{% endfor %}) : ({{ slot_types }}) -> {{ row }}
{% endif %}
{% if ranged %}
          scf.yield %a1 : {{ row }}
        } else {
          scf.yield %a : {{ row }}
        }
{% endif %}
        scf.yield %a2 : {{ row }}
      }
      %put = tensor.insert_slice %yn into %all[%n, 0] [1, {{ L }}] [1, 1] : {{ row }} into {{ out }}
      scf.yield %put : {{ out }}
    }
    return %y : {{ out }}
  }
}
