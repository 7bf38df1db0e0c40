{#- torch.k3.mxfp4_moe, decode form (ops/mxfp4_moe.py by_slot): for each of the N tokens and its k
    (token, slot) pairs, w * FFN_e(z) of its picked expert e added to the token's row, the expert's
    matrices sliced in place from the stacked weights (``stacked``: the stacked weights, the
    flattened idx and the pair's place in it passed whole, the slot reading its expert itself on the
    device); @{{sym}}_slot is the FFN. The pairs are written out, not looped over: IREE 3.13 runs
    each trip of a loop holding dispatches as a submission of its own (about 75 us each on a CPU,
    more than a k3-small expert's FFN), where straight-line dispatches share one. ``ranged`` (one
    device's share of the experts): a pair whose expert is outside [0, E) is skipped. -#}
{% import "mxfp4_moe_slices.mlir" as slices %}
{% set flat = "tensor<%dxi64>" % (N * k) %}
{% set slot_types = ([row, row, wt, flat, "index"] + weights | map(attribute="type") | list if stacked else [row, row, wt] + one) | join(", ") %}
module {
  func.func private @{{ sym }}_slot({{ slot_types }}) -> {{ row }}
  func.func @{{ sym }}(%z: {{ z }}, %idx: {{ idx }}, %w: {{ w }}, {% for m in weights %}%{{ m.name }}: {{ m.type }}{{ ", " if not loop.last }}{% endfor %}) -> {{ out }} {
{% if ranged %}
    %cE = arith.constant {{ weights[0].type.shape[0] }} : index
{% endif %}
    %zero = arith.constant 0.0 : {{ out.element }}
    %empty = tensor.empty() : {{ out }}
    %y0 = linalg.fill ins(%zero : {{ out.element }}) outs(%empty : {{ out }}) -> {{ out }}
{% if stacked %}
    %flat = tensor.collapse_shape %idx [[0, 1]] : {{ idx }} into {{ flat }}
{% endif %}
{% for n in range(N) %}
    %z{{ n }} = tensor.extract_slice %z[{{ n }}, 0] [1, {{ L }}] [1, 1] : {{ z }} to {{ row }}
    %a{{ n }}_0 = tensor.extract_slice %y0[{{ n }}, 0] [1, {{ L }}] [1, 1] : {{ out }} to {{ row }}
{% for s in range(k) %}
{% set p = "%d_%d" % (n, s) %}
{% set a_in, a_out = "%%a%d_%d" % (n, s), "%%a%d_%d" % (n, s + 1) %}
    %ws{{ p }} = tensor.extract_slice %w[{{ n }}, {{ s }}] [1, 1] [1, 1] : {{ w }} to {{ wt }}
{% if ranged or not stacked %}
    %c{{ p }}n = arith.constant {{ n }} : index
    %c{{ p }}s = arith.constant {{ s }} : index
    %e{{ p }}64 = tensor.extract %idx[%c{{ p }}n, %c{{ p }}s] : {{ idx }}
    %e{{ p }} = arith.index_cast %e{{ p }}64 : {{ idx.element }} to index
{% endif %}
{% if ranged %}
    %inside{{ p }} = arith.cmpi ult, %e{{ p }}, %cE : index
    {{ a_out }} = scf.if %inside{{ p }} -> ({{ row }}) {
{% endif %}
{% if stacked %}
    %pair{{ p }} = arith.constant {{ n * k + s }} : index
    %r{{ p }} = func.call @{{ sym }}_slot({{ a_in }}, %z{{ n }}, %ws{{ p }}, %flat, %pair{{ p }}, {% for m in weights %}%{{ m.name }}{{ ", " if not loop.last }}{% endfor %}) : ({{ slot_types }}) -> {{ row }}
{% else %}
{{ slices.expert_slices(weights, "%%e%s" % p, p) -}}
    %r{{ p }} = func.call @{{ sym }}_slot({{ a_in }}, %z{{ n }}, %ws{{ p }}, {% for m in weights %}%{{ m.name }}_e{{ p }}{{ ", " if not loop.last }}{% endfor %}) : ({{ slot_types }}) -> {{ row }}
{% endif %}
{% if ranged %}
      scf.yield %r{{ p }} : {{ row }}
    } else {
      scf.yield {{ a_in }} : {{ row }}
    }
{% else %}
    {{ a_out }} = tensor.cast %r{{ p }} : {{ row }} to {{ row }}
{% endif %}
{% endfor %}
    %y{{ n + 1 }} = tensor.insert_slice %a{{ n }}_{{ k }} into %y{{ n }}[{{ n }}, 0] [1, {{ L }}] [1, 1] : {{ row }} into {{ out }}
{% endfor %}
    return %y{{ N }} : {{ out }}
  }
}
