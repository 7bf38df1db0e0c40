{#- The native MXFP4 matvec (ops/mxfp4_gemv.py gemv, decode "native"): y [1, O] = W x with W expert
    e's packed codes P [E, O, IN/2] and E8M0 scales S [E, O, IN/32] as stored, read in place (the
    dispatch gets the stacked weights whole: a slice before it would be a copy), e = idx[pair] read
    by the dispatch itself (an expert index read back to the host to pass it would wait for the
    device at every call), x permuted into xt [IN/128, 8, 16] (templates/mxfp4_native_split.mlir).
    One dispatch of GROUPS workgroups, each calling k3c_mxfp4_rows (ops/kernels/mxfp4_rows.c, built
    by ops/native.py, linked from `object`) on ROWS rows. Each binding goes to it as a 1-D memref
    descriptor (allocated and aligned pointers, offset, size, stride): IREE places a binding's byte
    offset in the descriptor, so the kernel reads each array at aligned + offset. -#}
{% set pk = "tensor<%dx%dx%dxi8>" % (E, O, IN // 2) %}
{% set sc = "tensor<%dx%dx%dxi8>" % (E, O, IN // 32) %}
{% set xt = "tensor<%dx8x16xf32>" % (IN // 128) %}
{% set y = "tensor<1x%dxf32>" % O %}
{% set ix = "tensor<%dxi64>" % PAIRS %}
{% set args = "memref<?xi8>, memref<?xi8>, memref<?xf32>, memref<?xf32>, index, index, index, index, index" %}
module {
  stream.executable private @{{ name }}_native attributes {
    hal.executable.objects = #hal.executable.objects<{
      #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [#hal.executable.object<{path = "{{ object }}"}>]
    }>
  } {
    stream.executable.export public @{{ name }}_rows workgroups() -> (index, index, index) {
      %groups = arith.constant {{ GROUPS }} : index
      %c1 = arith.constant 1 : index
      stream.return %groups, %c1, %c1 : index, index, index
    }
    builtin.module {
      func.func private @k3c_mxfp4_rows({{ args }}) attributes {hal.import.static}
      func.func @{{ name }}_rows(%bp: !stream.binding, %bs: !stream.binding, %bi: !stream.binding, %pair: index, %bx: !stream.binding, %by: !stream.binding) {
        %c0 = arith.constant 0 : index
        %npairs = arith.constant {{ PAIRS }} : index
        %i = stream.binding.subspan %bi[%c0] : !stream.binding -> memref<?xi64>{ %npairs }
        %e64 = memref.load %i[%pair] : memref<?xi64>
        %e = arith.index_cast %e64 : i64 to index
        %np = arith.constant {{ E * O * IN // 2 }} : index
        %ns = arith.constant {{ E * O * IN // 32 }} : index
        %nx = arith.constant {{ IN }} : index
        %rows = arith.constant {{ O }} : index
        %per_group = arith.constant {{ ROWS }} : index
        %group = stream.dispatch.workgroup.id[0] : index
        %p = stream.binding.subspan %bp[%c0] : !stream.binding -> memref<?xi8>{ %np }
        %s = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?xi8>{ %ns }
        %x = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<?xf32>{ %nx }
        %y = stream.binding.subspan %by[%c0] : !stream.binding -> memref<?xf32>{ %rows }
        func.call @k3c_mxfp4_rows(%p, %s, %x, %y, %e, %rows, %nx, %per_group, %group) : ({{ args }}) -> ()
        return
      }
    }
  }
  func.func @{{ name }}(%P: {{ pk }}, %S: {{ sc }}, %idx: {{ ix }}, %pair: index, %xt: {{ xt }}) -> {{ y }} {
    %y = flow.dispatch @{{ name }}_native::@{{ name }}_rows(%P, %S, %idx, %pair, %xt) : ({{ pk }}, {{ sc }}, {{ ix }}, index, {{ xt }}) -> {{ y }}
    return %y : {{ y }}
  }
}
