/* The native MXFP4 matvec of the CPU levels x86-64-v4 and x86-64-v3 (ops/native.py builds it for
   the level with -march=<level>, ops/mxfp4_gemv.py calls it; docs/model.md §5): rows [o0, o1) of
   y = W x for one workgroup, W expert e's matrix in the checkpoint's MXFP4 layout.

     y[o] = sum_blocks 2^(S[o, block] - 127) * sum_(i in block) E2M1[code i of row o] * x[i]

   P [rows, in/2] u8 is `weight_packed` (element 2j in the low nibble of byte j), read as chunks of
   64 bytes = 128 weights = 4 blocks of 32; S [rows, in/32] u8 holds the E8M0 block scales. Each
   lane of a vector sums the products of 8 weights of one block, then the lane's block scale
   multiplies that sum (a block's products are summed before its scale multiplies them). xt
   [in/128, 8, 16] f32 is the activation permuted once per call (templates/mxfp4_native_split.mlir)
   so that the 8 activations a vector multiplies are contiguous; the permutation is the variant's:

     AVX-512F  dword l of a chunk holds weights 8l + n, n = 0..7, in its nibbles from the lowest;
               each nibble position n is shifted to the bottom of its dword and decoded by one
               vpermps from the 16 E2M1 values held in a 512-bit register (4 index bits), the 16
               lanes of a chunk at once. xt[c, 16n + l] = x[128c + 8l + n].
     AVX2      (no 16-lane permute) a half chunk of 32 bytes: its low and high nibbles decoded by
               vpshufb into the upper two bytes of each weight's f32 (half_chunk below).
               xt[c, 64h + 32r0 + 16q + 8r1 + 4b + d] = x[128c + 64h + 32b + 16q + 4d + 2r1 + r0].

   The scale 2^(s - 127) is the f32 with bits s << 23 (+inf for s = 255): AVX-512 or-s 0x400000 into
   it where (s + 1) >> 8 is 1, AVX2 adds x - x (by integer ops resp. on the FP add pipes), both
   giving NaN for s = 255; s = 0 gives +0 (IREE's CPU workers flush the subnormal 2^-127 anyway).
   Both variants compute every product exactly (an E2M1 value times an f32, rounded once) and sum
   a lane's 8 products in two chains of 4. Freestanding: no libc, no globals beyond read-only
   constants. */
#include <stddef.h>
#include <stdint.h>
#include <immintrin.h>

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "mxfp4_rows.c needs AVX-512F or AVX2 and FMA"
#endif

/* Bytes ahead of the chunk in hand that each step asks the cache for (docs/pipeline.md §3). */
#define PREFETCH_AHEAD 4096

/* A 1-D array as IREE passes a memref: allocated and aligned pointers, offset, size, stride
   (in elements); the data starts at aligned + offset. */
#define MEMREF(T, name) T* name##_allocated, T* name##_aligned, size_t name##_offset, size_t name##_size, size_t name##_stride

#if defined(__AVX512F__)
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

/* y[o] for one row: its packed codes p, scales s, over `chunks` chunks of 128 weights. */
static inline float row(const uint8_t* p, const uint8_t* s, const float* xt, size_t chunks) {
  const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                      -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  const __m512i block_of_lane = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i four = _mm512_set1_epi32(4);
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
  return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
}
#else  /* AVX2 and FMA */

/* The 8 lanes' sums over one half chunk (bytes 32h..32h+31, 64 weights, blocks 2h and 2h + 1; xc =
   xt + 128c + 64h). The low and high nibbles of the 32 bytes are split into two vectors of codes
   and decoded by vpshufb into the two upper bytes of each code's f32 (every E2M1 value is a bf16:
   its low 16 bits are zero); vpunpck{l,h}bw pairs them into 16-bit words, each dword then gives two
   f32, its high word masked and its low word shifted up. vpshufb and vpunpck stay within 128-bit
   lanes, so lanes 0-3 hold block 2h and lanes 4-7 block 2h + 1, the lane of weight
   64h + 32b + 16q + 4d + 2r1 + r0 being 4b + d; its activation is xc[32r0 + 16q + 8r1 + 4b + d]. */
static inline __m256 half_chunk(const uint8_t* p, const float* xc, __m256i high_byte, __m256i low_byte) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i high_word = _mm256_set1_epi32((int)0xFFFF0000u);
  __m256i w = _mm256_loadu_si256((const __m256i*)p);
  __m256i even = _mm256_and_si256(w, nibble), odd = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
  __m256i he = _mm256_shuffle_epi8(high_byte, even), le = _mm256_shuffle_epi8(low_byte, even);
  __m256i ho = _mm256_shuffle_epi8(high_byte, odd), lo = _mm256_shuffle_epi8(low_byte, odd);
  /* words: r0 = 0 (q = 0, 1), then r0 = 1 (q = 0, 1); in each, r1 = 0 from the low word of a dword
     (shifted up), r1 = 1 from the high word (masked). Straight-line code: a loop over an array of the
     4 words stays a loop at gcc -O2, the array on the stack (docs/pipeline.md §6). */
  __m256i w0 = _mm256_unpacklo_epi8(le, he), w1 = _mm256_unpackhi_epi8(le, he);
  __m256i w2 = _mm256_unpacklo_epi8(lo, ho), w3 = _mm256_unpackhi_epi8(lo, ho);
#define LOW_WORD(w) _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))
#define HIGH_WORD(w) _mm256_castsi256_ps(_mm256_and_si256(w, high_word))
  __m256 a = _mm256_mul_ps(LOW_WORD(w0), _mm256_loadu_ps(xc));
  __m256 b = _mm256_mul_ps(HIGH_WORD(w0), _mm256_loadu_ps(xc + 8));
  a = _mm256_fmadd_ps(LOW_WORD(w1), _mm256_loadu_ps(xc + 16), a);
  b = _mm256_fmadd_ps(HIGH_WORD(w1), _mm256_loadu_ps(xc + 24), b);
  a = _mm256_fmadd_ps(LOW_WORD(w2), _mm256_loadu_ps(xc + 32), a);
  b = _mm256_fmadd_ps(HIGH_WORD(w2), _mm256_loadu_ps(xc + 40), b);
  a = _mm256_fmadd_ps(LOW_WORD(w3), _mm256_loadu_ps(xc + 48), a);
  b = _mm256_fmadd_ps(HIGH_WORD(w3), _mm256_loadu_ps(xc + 56), b);
#undef LOW_WORD
#undef HIGH_WORD
  return _mm256_add_ps(a, b);
}

/* 2^(s - 127) for 8 scale bytes widened to i32 lanes: s << 23 is that f32 for s < 255 and +inf for
   s = 255, which x + (x - x) turns into NaN (it leaves every finite x as it is). */
static inline __m256 scales8(__m256i s) {
  __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(s, 23));
  return _mm256_add_ps(x, _mm256_sub_ps(x, x));
}

/* The scales of two chunks (8 blocks), and of one (4 blocks, lanes 4-7 unused). */
static inline __m256 two_chunk_scales(const uint8_t* s) {
  uint64_t s8;
  __builtin_memcpy(&s8, s, 8);
  return scales8(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s8)));
}

static inline __m256 one_chunk_scales(const uint8_t* s) {
  uint32_t s4;
  __builtin_memcpy(&s4, s, 4);
  return scales8(_mm256_cvtepu8_epi32(_mm_cvtsi32_si128((int)s4)));
}

/* y[o] for one row: its packed codes p, scales s, over `chunks` chunks of 128 weights. */
static inline float row(const uint8_t* p, const uint8_t* s, const float* xt, size_t chunks) {
  /* bytes 3 and 2 of the f32 of each E2M1 code 0..15 (0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives),
     once per 128-bit lane */
#define HIGH_BYTES 0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, \
    (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0
#define LOW_BYTES 0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0, \
    0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0
  const __m256i high_byte = _mm256_setr_epi8(HIGH_BYTES, HIGH_BYTES);
  const __m256i low_byte = _mm256_setr_epi8(LOW_BYTES, LOW_BYTES);
#undef HIGH_BYTES
#undef LOW_BYTES
  /* lanes of half chunk j (of two chunks) take the scales of blocks 2j and 2j + 1 */
  const __m256i pair0 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), pair1 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  const __m256i pair2 = _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), pair3 = _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7);
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  size_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    __m256 sc = two_chunk_scales(s + 4 * c);
    _mm_prefetch((const char*)(p + 64 * c) + PREFETCH_AHEAD, _MM_HINT_T0);
    _mm_prefetch((const char*)(p + 64 * c) + PREFETCH_AHEAD + 64, _MM_HINT_T0);
    even = _mm256_fmadd_ps(half_chunk(p + 64 * c, xt + 128 * c, high_byte, low_byte),
                           _mm256_permutevar8x32_ps(sc, pair0), even);
    odd = _mm256_fmadd_ps(half_chunk(p + 64 * c + 32, xt + 128 * c + 64, high_byte, low_byte),
                          _mm256_permutevar8x32_ps(sc, pair1), odd);
    even = _mm256_fmadd_ps(half_chunk(p + 64 * c + 64, xt + 128 * c + 128, high_byte, low_byte),
                           _mm256_permutevar8x32_ps(sc, pair2), even);
    odd = _mm256_fmadd_ps(half_chunk(p + 64 * c + 96, xt + 128 * c + 192, high_byte, low_byte),
                          _mm256_permutevar8x32_ps(sc, pair3), odd);
  }
  if (c < chunks) {
    __m256 sc = one_chunk_scales(s + 4 * c);
    _mm_prefetch((const char*)(p + 64 * c) + PREFETCH_AHEAD, _MM_HINT_T0);
    even = _mm256_fmadd_ps(half_chunk(p + 64 * c, xt + 128 * c, high_byte, low_byte),
                           _mm256_permutevar8x32_ps(sc, pair0), even);
    odd = _mm256_fmadd_ps(half_chunk(p + 64 * c + 32, xt + 128 * c + 64, high_byte, low_byte),
                          _mm256_permutevar8x32_ps(sc, pair1), odd);
  }
  __m256 t = _mm256_add_ps(even, odd);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

#endif

/* Rows [group * rows_per_group, ...) of expert e's matrix (`rows` rows, `in` a multiple of 128). */
void k3c_mxfp4_rows(MEMREF(const uint8_t, packed), MEMREF(const uint8_t, scale), MEMREF(const float, act),
                    MEMREF(float, out), size_t e, size_t rows, size_t in, size_t rows_per_group, size_t group) {
  const uint8_t* P = packed_aligned + packed_offset + e * rows * (in / 2);
  const uint8_t* S = scale_aligned + scale_offset + e * rows * (in / 32);
  const float* xt = act_aligned + act_offset;
  float* y = out_aligned + out_offset;
  size_t o0 = group * rows_per_group, o1 = o0 + rows_per_group;
  if (o1 > rows) o1 = rows;
  for (size_t o = o0; o < o1; ++o) y[o] = row(P + o * (in / 2), S + o * (in / 32), xt, in / 128);
}
