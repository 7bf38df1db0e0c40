{#- torch.k3.causal_attention as a loop over static query blocks of `block` rows (ops/causal_attention.py):
    q [B, T, H, D] and k, v [B, L, H, D] padded by the same %pad rows (T + %pad = Tp = ceil(T / block)
    block) and transposed once to [B H, Tp | Lp, D], kept out of the loop by util.optimization_barrier
    (the padded lengths re-tied to the result by flow.tensor.tie_shape); @{{sym}}_block attends a
    block's queries to the keys up to its end, L - T + off + block. -#}
{% macro to_heads(x, t, D, n) %}
    %{{ x }}p = tensor.pad %{{ x }} low[0, 0, 0, 0] high[0, %pad, 0, 0] {
    ^bb0(%{{ x }}0: index, %{{ x }}1: index, %{{ x }}2: index, %{{ x }}3: index):
      tensor.yield %zero : {{ element }}
    } : {{ t }} to {{ t }}
    %{{ x }}e = tensor.empty(%{{ n }}) : tensor<{{ B }}x{{ H }}x?x{{ D }}x{{ element }}>
    %{{ x }}t = linalg.transpose ins(%{{ x }}p : {{ t }}) outs(%{{ x }}e : tensor<{{ B }}x{{ H }}x?x{{ D }}x{{ element }}>) permutation = [0, 2, 1, 3]
    %{{ x }}h0 = tensor.collapse_shape %{{ x }}t [[0, 1], [2], [3]] : tensor<{{ B }}x{{ H }}x?x{{ D }}x{{ element }}> into tensor<{{ N }}x?x{{ D }}x{{ element }}>
{% endmacro %}
{% set heads_o = "tensor<%dx%dx?x%dx%s>" % (B, H, Dv, element) %}
module {
  func.func private @{{ sym }}_block({{ qb }}, {{ kd }}, {{ vd }}) -> {{ ob }}
  func.func @{{ sym }}(%q_in: {{ q_in }}, %k_in: {{ k_in }}, %v_in: {{ v_in }}) -> {{ out_in }} {
    %q = tensor.cast %q_in : {{ q_in }} to {{ q }}
    %k = tensor.cast %k_in : {{ k_in }} to {{ k }}
    %v = tensor.cast %v_in : {{ v_in }} to {{ v }}
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %cB = arith.constant {{ block }} : index
    %cB1 = arith.constant {{ block - 1 }} : index
    %zero = arith.constant 0.0 : {{ element }}
    %T = tensor.dim %q, %c1 : {{ q }}
    %Lk = tensor.dim %k, %c1 : {{ k }}
    %before = arith.subi %Lk, %T : index
    %T1 = arith.addi %T, %cB1 : index
    %nb = arith.divui %T1, %cB : index
    %Tp = arith.muli %nb, %cB : index
    %pad = arith.subi %Tp, %T : index
    %Lp = arith.addi %Lk, %pad : index
{{ to_heads("q", q, Dq, "Tp") }}{{ to_heads("k", k, Dq, "Lp") }}{{ to_heads("v", v, Dv, "Lp") }}
    %qb0, %kb0, %vb0 = util.optimization_barrier %qh0, %kh0, %vh0 : {{ kd }}, {{ kd }}, {{ vd }}
    %qh = flow.tensor.tie_shape %qb0 : {{ kd }}{{ "{%Tp}" }}
    %kh = flow.tensor.tie_shape %kb0 : {{ kd }}{{ "{%Lp}" }}
    %vh = flow.tensor.tie_shape %vb0 : {{ vd }}{{ "{%Lp}" }}
    %init = tensor.empty(%Tp) : {{ od }}
    %res = scf.for %off = %c0 to %Tp step %cB iter_args(%acc = %init) -> ({{ od }}) {
      %end = arith.addi %off, %cB : index
      %L = arith.addi %before, %end : index
      %qs = tensor.extract_slice %qh[0, %off, 0] [{{ N }}, {{ block }}, {{ Dq }}] [1, 1, 1] : {{ kd }} to {{ qb }}
      %ks = tensor.extract_slice %kh[0, 0, 0] [{{ N }}, %L, {{ Dq }}] [1, 1, 1] : {{ kd }} to {{ kd }}
      %vs = tensor.extract_slice %vh[0, 0, 0] [{{ N }}, %L, {{ Dv }}] [1, 1, 1] : {{ vd }} to {{ vd }}
      %ob = func.call @{{ sym }}_block(%qs, %ks, %vs) : ({{ qb }}, {{ kd }}, {{ vd }}) -> {{ ob }}
      %acc2 = tensor.insert_slice %ob into %acc[0, %off, 0] [{{ N }}, {{ block }}, {{ Dv }}] [1, 1, 1] : {{ ob }} into {{ od }}
      scf.yield %acc2 : {{ od }}
    }
    %rs = tensor.extract_slice %res[0, 0, 0] [{{ N }}, %T, {{ Dv }}] [1, 1, 1] : {{ od }} to {{ od }}
    %re = tensor.expand_shape %rs [[0, 1], [2], [3]] output_shape [{{ B }}, {{ H }}, %T, {{ Dv }}] : {{ od }} into {{ heads_o }}
    %oe = tensor.empty(%T) : {{ out }}
    %o = linalg.transpose ins(%re : {{ heads_o }}) outs(%oe : {{ out }}) permutation = [0, 2, 1, 3]
    %o_out = tensor.cast %o : {{ out }} to {{ out_in }}
    return %o_out : {{ out_in }}
  }
}
