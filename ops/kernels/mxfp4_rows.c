/* The native MXFP4 matvec of the cpu target (ops/native.py builds it, ops/mxfp4_gemv.py calls it;
   docs/model.md §5): rows [o0, o1) of y = W x for one workgroup, W expert e's matrix in the
   checkpoint's MXFP4 layout.

     y[o] = sum_c sum_l 2^(S[o, 4c + l/4] - 127) * sum_n E2M1[nibble n of dword l of chunk c of row o] * xt[c, n, l]

   P [rows, in/2] u8 is `weight_packed` (element 2j in the low nibble of byte j), read as chunks of
   64 bytes = 16 dwords = 128 weights: dword l of chunk c holds weights 128c + 8l + n, n = 0..7, in
   its nibbles from the lowest. S [rows, in/32] u8 holds the E8M0 block scales; a block (32 weights)
   is 4 dwords. xt [in/128, 8, 16] f32 is the activation permuted once per call:
   xt[c, n, l] = x[128c + 8l + n].

   Per chunk: each nibble position n is shifted to the bottom of its dword and decoded by one
   vpermps from the 16 E2M1 values held in a register (vpermps reads the low 4 bits of each index);
   the 8 products of a lane are summed, then multiplied by the lane's block scale. The scales of 4
   chunks (16 blocks) are built at once: 2^(s - 127) is the f32 with bits s << 23, or-ed with
   0x400000 (a NaN) where s = 255, where (s + 1) >> 8 is 1; s = 0 gives +0 (IREE's CPU workers
   flush the subnormal 2^-127 anyway). A block's products are summed before its scale multiplies
   them. Needs AVX-512F (ops/native.py compiles it with -march=native; where it does not build the
   linalg kernel runs). Freestanding: no libc, no globals beyond read-only constants. */
#include <stddef.h>
#include <stdint.h>
#include <immintrin.h>

#ifndef __AVX512F__
#error "mxfp4_rows.c needs AVX-512F"
#endif

/* Bytes ahead of the chunk in hand that each step asks the cache for: one thread's stream from
   memory ran at 5.8-10.1 GB/s without and 10.4-11.7 GB/s with 4 KiB (64-byte prefetches, AMD EPYC
   Zen 4, ninth session's machine; 2 and 8 KiB in between). */
#define PREFETCH_AHEAD 4096

/* The 16 lanes' sums over one chunk: lane l adds the 8 products of its dword's nibbles, nibble n
   decoded from bits 4n..4n+3 (two chains of 4). */
static inline __m512 chunk(const uint8_t* p, const float* xc, __m512 table) {
  __m512i w = _mm512_loadu_si512((const void*)p);
  __m512 a = _mm512_mul_ps(_mm512_permutexvar_ps(w, table), _mm512_loadu_ps(xc));
  __m512 b = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), table), _mm512_loadu_ps(xc + 16));
  a = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 8), table), _mm512_loadu_ps(xc + 32), a);
  b = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 12), table), _mm512_loadu_ps(xc + 48), b);
  a = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 16), table), _mm512_loadu_ps(xc + 64), a);
  b = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 20), table), _mm512_loadu_ps(xc + 80), b);
  a = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 24), table), _mm512_loadu_ps(xc + 96), a);
  b = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 28), table), _mm512_loadu_ps(xc + 112), b);
  return _mm512_add_ps(a, b);
}

/* 2^(s - 127) for 16 scale bytes widened to i32 lanes (NaN where s = 255) */
static inline __m512 scales(__m512i s) {
  __m512i nan = _mm512_slli_epi32(_mm512_srli_epi32(_mm512_add_epi32(s, _mm512_set1_epi32(1)), 8), 22);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(s, 23), nan));
}

/* A 1-D array as IREE passes a memref: allocated and aligned pointers, offset, size, stride
   (in elements); the data starts at aligned + offset. */
#define MEMREF(T, name) T* name##_allocated, T* name##_aligned, size_t name##_offset, size_t name##_size, size_t name##_stride

/* Rows [group * rows_per_group, ...) of expert e's matrix (`rows` rows, `in` a multiple of 128). */
void k3c_mxfp4_rows(MEMREF(const uint8_t, packed), MEMREF(const uint8_t, scale), MEMREF(const float, act),
                    MEMREF(float, out), size_t e, size_t rows, size_t in, size_t rows_per_group, size_t group) {
  const uint8_t* P = packed_aligned + packed_offset + e * rows * (in / 2);
  const uint8_t* S = scale_aligned + scale_offset + e * rows * (in / 32);
  const float* xt = act_aligned + act_offset;
  float* y = out_aligned + out_offset;
  const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                      -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  const __m512i block_of_lane = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i four = _mm512_set1_epi32(4);
  size_t chunks = in / 128, o0 = group * rows_per_group, o1 = o0 + rows_per_group;
  if (o1 > rows) o1 = rows;
  for (size_t o = o0; o < o1; ++o) {
    const uint8_t* p = P + o * (in / 2);
    const uint8_t* s = S + o * (in / 32);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    size_t c = 0;
    for (; c + 4 <= chunks; c += 4) {  /* 4 chunks: their 16 scales in one vector */
      __m512 sc = scales(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(s + 4 * c))));
      __m512i block = block_of_lane;
      for (int i = 0; i < 4; ++i, block = _mm512_add_epi32(block, four)) {
        _mm_prefetch((const char*)(p + 64 * (c + i)) + PREFETCH_AHEAD, _MM_HINT_T0);
        __m512 sum = chunk(p + 64 * (c + i), xt + 128 * (c + i), table);
        if (i & 1) odd = _mm512_fmadd_ps(sum, _mm512_permutexvar_ps(block, sc), odd);
        else even = _mm512_fmadd_ps(sum, _mm512_permutexvar_ps(block, sc), even);
      }
    }
    for (; c < chunks; ++c) {  /* the last 1-3 chunks: 4 scale bytes each */
      uint32_t s4;
      __builtin_memcpy(&s4, s + 4 * c, 4);
      __m512 sc = scales(_mm512_cvtepu8_epi32(_mm_cvtsi32_si128((int)s4)));
      _mm_prefetch((const char*)(p + 64 * c) + PREFETCH_AHEAD, _MM_HINT_T0);
      even = _mm512_fmadd_ps(chunk(p + 64 * c, xt + 128 * c, table), _mm512_permutexvar_ps(block_of_lane, sc), even);
    }
    y[o] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
  }
}
