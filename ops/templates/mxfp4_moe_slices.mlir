{#- Shared by the mxfp4_moe loops: expert %e of each stacked weight, [E, ...] -> [1, ...], sliced in place,
    named %<weight>_e<suffix>. -#}
{% macro expert_slices(weights, e, suffix="") %}
{% for m in weights %}
        %{{ m.name }}_e{{ suffix }} = tensor.extract_slice %{{ m.name }}[{{ e }}{% for _ in m.type.shape[1:] %}, 0{% endfor %}] [{{ m.one.shape | join(", ") }}] [{% for _ in m.type.shape %}1{{ ", " if not loop.last }}{% endfor %}] : {{ m.type }} to {{ m.one }}
{% endfor %}
{% endmacro %}
