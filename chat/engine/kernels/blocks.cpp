// Products over GGUF-style blocks of 32 weights with 8-bit activations, as llama.cpp computes them:
// each activation row is quantized per 32 values (a = round(x * 127 / max|x|)), a block's 32 products
// summed in integers (AVX2 `maddubs`, or `vpdpbusd` with AVX-512 VNNI), then scaled in float32:
//   sum_i (s q_i + z)(da a_i) = s da sum_i q_i a_i + z da sum_i a_i.
// The weights are read once per call whatever the number of rows: 4 to 6 bits a weight for 4- and 5-bit
// blocks (a quarter of bf16's bytes), which is what a decode step waits for.
//
// A row's result is computed the same way whatever else is in the batch (the same blocks in the same
// order, rows never mixed), so seeded answers stay batch-invariant.
#include "blocks.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace blocks {
namespace {

inline float bf(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  return static_cast<uint16_t>(f != f ? 0x7FC0 : rounded);
}

inline float half(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Activation rows quantized per 32 values: q (rows, cols) int8, d (rows, blocks) its scale, ds = d * sum(q), and
// dh (rows, blocks, 2) d * the sums of each half's 16 (for blocks with a scale per 16 weights and a centre: U6).
struct Acts {
  int64_t rows = 0, blocks = 0;
  std::vector<int8_t> q;
  std::vector<float> d, ds, dh;
};

Acts quantize(const at::Tensor& x) {
  Acts a;
  a.rows = x.size(0);
  const int64_t cols = x.size(1);
  a.blocks = cols / 32;
  a.q.resize(a.rows * cols);
  a.d.resize(a.rows * a.blocks);
  a.ds.resize(a.rows * a.blocks);
  a.dh.resize(a.rows * a.blocks * 2);
  const uint16_t* in = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t i = 0; i < a.rows * a.blocks; ++i) {
#if defined(__AVX2__)
    // the loop below, 8 lanes at a time: the same roundings (nearest, ties to even), so the same bytes
    __m256 v[4], top8 = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int k = 0; k < 4; ++k) {
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * 32 + 8 * k));
      v[k] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
      top8 = _mm256_max_ps(top8, _mm256_and_ps(v[k], magnitude));
    }
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
    const float d = top / 127.f, inverse = top > 0.f ? 127.f / top : 0.f;
    __m256i q[4];
    for (int k = 0; k < 4; ++k)
      q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(inverse)),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const auto total = [](__m256i sums) {
      __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
      sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
      return _mm_cvtsi128_si32(_mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1)));
    };
    const int first = total(_mm256_add_epi32(q[0], q[1])), second = total(_mm256_add_epi32(q[2], q[3]));
    // int32 -> int16 -> int8 (packs work within 128-bit halves: the permute puts the bytes back in order)
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + i * 32),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    a.d[i] = d;
    a.ds[i] = d * static_cast<float>(first + second);
    a.dh[2 * i] = d * static_cast<float>(first);
    a.dh[2 * i + 1] = d * static_cast<float>(second);
#else
    float v[32], top = 0.f;
    for (int j = 0; j < 32; ++j) v[j] = bf(in[i * 32 + j]);
    for (int j = 0; j < 32; ++j) top = std::max(top, std::fabs(v[j]));
    const float d = top / 127.f, inverse = top > 0.f ? 127.f / top : 0.f;
    int sums[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(v[j] * inverse));
      a.q[i * 32 + j] = static_cast<int8_t>(q);
      sums[j / 16] += q;
    }
    a.d[i] = d;
    a.ds[i] = d * static_cast<float>(sums[0] + sums[1]);
    a.dh[2 * i] = d * static_cast<float>(sums[0]);
    a.dh[2 * i + 1] = d * static_cast<float>(sums[1]);
#endif
  }
  return a;
}

// The weights are stored in groups of 8 rows (GROUP), each block of a group as chunks of 32 bytes: 4 bytes
// of each row side by side, so one integer dot product instruction multiplies 4 weights of all 8 rows by the
// same 4 activations (broadcast), and each float lane holds one weight row's sum.
//   U4: 4 chunks a block; chunk c holds weights 4c..4c+3 of each row in its low nibbles and 16+4c..
//       in its high ones. U5: the same, and 32 bytes of fifth bits a block, laid over the chunks' bytes:
//       byte i's bit 2c holds the fifth bit of chunk c's low nibble in byte i, bit 2c+1 its high one's,
//       so a shift and a mask give a chunk's 0x10s. S8: 8 chunks a block, chunk c: weights 4c..4c+3, signed.
//       U6: as U4, and two 32-byte planes of the high 2 bits a block: plane p's byte i, bits 2 (2c' + h) and up,
//       hold those of chunk 2p + c''s byte i, its low nibble's (h 0) or its high one's (h 1).
// Scales (and mins) per block: the group's 8 side by side (two sets for Q6_K: weights 0-15, 16-31).
constexpr int64_t GROUP = 8;

inline int64_t chunk_bytes(int64_t kind) { return kind == S8 || kind == U8 ? 8 * 32 : 4 * 32; }
inline int64_t high_bytes(int64_t kind) { return kind == U6 ? 64 : kind == U5 ? 32 : 0; }  // a block's high bits

// Group g's blocks, fifth bits (U5), scales and mins (null where there are none), and with SUPER scales its
// super-blocks' d and dmin: what a kernel reads of one group.
struct Group {
  const uint8_t* qs;
  const uint8_t* qh;
  const void* sc;
  const void* mn;
  const uint16_t* d;
  const uint16_t* dmin;
  int64_t per_super;
};

template <int64_t K, int S>
Group group_at(const Matrix& w, int64_t g) {
  const int64_t nb = w.blocks, size = S == F32 ? 4 : S == F16 ? 2 : 1;
  Group at{w.qs.data_ptr<uint8_t>() + g * nb * chunk_bytes(K),
           high_bytes(K) ? w.qh.data_ptr<uint8_t>() + g * nb * high_bytes(K) : nullptr,
           static_cast<const char*>(w.scales.data_ptr()) + g * nb * w.sub * GROUP * size,
           w.mins.defined() ? static_cast<const char*>(w.mins.data_ptr()) + g * nb * GROUP * size : nullptr,
           nullptr, nullptr, w.per_super};
  if constexpr (S == SUPER) {
    const int64_t supers = nb / w.per_super;
    at.d = reinterpret_cast<const uint16_t*>(w.dsuper.data_ptr()) + g * supers * GROUP;
    at.dmin = w.msuper.defined() ? reinterpret_cast<const uint16_t*>(w.msuper.data_ptr()) + g * supers * GROUP : nullptr;
  }
  return at;
}

// Row j's scale number i (block b's: i = b * sub + half) and block b's min, as float32: s = d * sc and
// z = -(dmin * mn) for SUPER scales (the products gguf-py computes, so the same floats).
template <int64_t K, int S>
inline float scale_at(const Group& at, int64_t i, int64_t b, int64_t j) {
  if constexpr (S == F32) return static_cast<const float*>(at.sc)[i * GROUP + j];
  if constexpr (S == F16) return half(static_cast<const uint16_t*>(at.sc)[i * GROUP + j]);
  const float q = K == S8 || K == U8 || K == U6 ? static_cast<float>(static_cast<const int8_t*>(at.sc)[i * GROUP + j])
                                     : static_cast<float>(static_cast<const uint8_t*>(at.sc)[i * GROUP + j]);
  return half(at.d[(b / at.per_super) * GROUP + j]) * q;
}

template <int S>
inline float min_at(const Group& at, int64_t b, int64_t j) {
  if constexpr (S == F32) return static_cast<const float*>(at.mn)[b * GROUP + j];
  if constexpr (S == F16) return half(static_cast<const uint16_t*>(at.mn)[b * GROUP + j]);
  return -(half(at.dmin[(b / at.per_super) * GROUP + j]) * static_cast<float>(static_cast<const uint8_t*>(at.mn)[b * GROUP + j]));
}

#if defined(__AVX2__)

// The 8 rows' scale number i (block b's), and block b's mins: ``scale_at``, ``min_at`` 8 lanes at a time.
template <int64_t K, int S>
inline __m256 scales8(const Group& at, int64_t i, int64_t b) {
  if constexpr (S == F32) return _mm256_loadu_ps(static_cast<const float*>(at.sc) + i * GROUP);
  if constexpr (S == F16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(at.sc) + i * GROUP)));
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(at.sc) + i * GROUP));
  const __m256 q = _mm256_cvtepi32_ps(K == S8 || K == U8 || K == U6 ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at.d + (b / at.per_super) * GROUP)));
  return _mm256_mul_ps(d, q);
}

template <int S>
inline __m256 mins8(const Group& at, int64_t b) {
  if constexpr (S == F32) return _mm256_loadu_ps(static_cast<const float*>(at.mn) + b * GROUP);
  if constexpr (S == F16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(at.mn) + b * GROUP)));
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(at.mn) + b * GROUP));
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at.dmin + (b / at.per_super) * GROUP)));
  const __m256 z = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
  return _mm256_xor_ps(z, _mm256_set1_ps(-0.f));  // -(dmin * mn)
}

inline void to_bf8(const float* in, uint16_t* out) {  // to_bf on 8 floats
  const __m256 f = _mm256_loadu_ps(in);
  const __m256i u = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
}

template <int Bit>
inline __m256i fifth(__m256i plane) {  // 0x10 in each byte whose bit ``Bit`` is set (16-bit shifts: no
  // bit crosses into bit 4 of the neighbouring byte for shifts of at most 4)
  const __m256i at4 = Bit <= 4 ? _mm256_slli_epi16(plane, 4 - Bit) : _mm256_srli_epi16(plane, Bit - 4);
  return _mm256_and_si256(at4, _mm256_set1_epi8(0x10));
}

template <int Pos>
inline __m256i sixth(__m256i plane) {  // the 2 bits at ``Pos`` of each byte, as its 0x30s (as ``fifth``)
  const __m256i at4 = Pos <= 4 ? _mm256_slli_epi16(plane, 4 - Pos) : _mm256_srli_epi16(plane, Pos - 4);
  return _mm256_and_si256(at4, _mm256_set1_epi8(0x30));
}

inline __m256i broadcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

// Sums of unsigned weight bytes times signed activation bytes, 4 a lane: into acc (int32), or without VNNI
// into 16-bit pairs (acc16) that ``flush`` widens; the bounds of each kind keep the pairs from saturating.
struct Dot {
  __m256i acc = _mm256_setzero_si256(), acc16 = _mm256_setzero_si256();
  inline void add(__m256i w, __m256i x) {
    if constexpr (VNNI) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      acc = _mm256_dpbusd_epi32(acc, w, x);
#endif
    } else {
      acc16 = _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, x));
    }
  }
  inline void flush() {
    if constexpr (!VNNI) {
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)));
      acc16 = _mm256_setzero_si256();
    }
  }
  // sum + the products of u (unsigned) and s (signed) 4 a lane, in int32 at once: for pairs that could
  // saturate 16 bits if two were added (|q| up to 128 of 8-bit weights)
  static inline __m256i now(__m256i sum, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(sum, u, s);
#else
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
  }
  inline __m256 take() {
    flush();
    const __m256 f = _mm256_cvtepi32_ps(acc);
    acc = _mm256_setzero_si256();
    return f;
  }
};

// R activation rows (from r0) times the 8 weight rows of group g -> out[r * 8 + lane]. Each activation row
// has its own accumulators and the same operations whatever R is: its result does not depend on the batch.
template <int64_t K, int S, int R>
void group_dot(const Matrix& w, int64_t g, const Acts& a, int64_t r0, float* out) {
  const int64_t nb = w.blocks, sub = w.sub;
  const Group at = group_at<K, S>(w, g);
  const uint8_t *qs = at.qs, *qh = at.qh;
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    Dot dot[R];
    const uint8_t* chunks = qs + b * chunk_bytes(K);
    if constexpr (K == U8) {  // VNNI only: unsigned bytes times signed ones, 4 a lane, in int32
      for (int c = 0; c < 8; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + c * 32));
        for (int r = 0; r < R; ++r) dot[r].add(q, broadcast4(a.q.data() + ((r0 + r) * nb + b) * 32 + 4 * c));
      }
    } else if constexpr (K == S8) {
      // |q| (the unsigned operand) times x with q's sign, summed straight into int32 (``Dot::now``)
      __m256i sums[R];
      for (int half = 0; half < 2; ++half) {  // Q6_K: weights 16-31 have their own scale
        if (half == 0 || sub == 2)
          for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
        for (int c = 4 * half; c < 4 * half + 4; ++c) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + c * 32));
          const __m256i magnitude = _mm256_sign_epi8(q, q);
          for (int r = 0; r < R; ++r) {
            const __m256i x = _mm256_sign_epi8(broadcast4(a.q.data() + ((r0 + r) * nb + b) * 32 + 4 * c), q);
            sums[r] = Dot::now(sums[r], magnitude, x);
          }
        }
        if (half == 1 || sub == 2) {
          const __m256 s = scales8<K, S>(at, b * sub + (sub == 2 ? half : 0), b);
          for (int r = 0; r < R; ++r)
            total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]),
                                       _mm256_mul_ps(s, _mm256_set1_ps(a.d[(r0 + r) * nb + b])), total[r]);
        }
      }
      continue;  // no min
    } else if constexpr (K == U6) {
      // the low nibbles are weights 0-15 (one scale), the high ones 16-31 (the other): a sum for each
      Dot second[R];
      const __m256i planes[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + b * 64)),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + b * 64 + 32))};
      const auto chunk = [&](auto at) {
        constexpr int c = decltype(at)::value;
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + c * 32));
        const __m256i low = _mm256_or_si256(_mm256_and_si256(packed, _mm256_set1_epi8(0x0F)),
                                            sixth<4 * (c % 2)>(planes[c / 2]));
        const __m256i high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F)),
                                             sixth<4 * (c % 2) + 2>(planes[c / 2]));
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.q.data() + ((r0 + r) * nb + b) * 32 + 4 * c;
          dot[r].add(low, broadcast4(x));
          second[r].add(high, broadcast4(x + 16));
          if (c % 2 == 1) {  // pairs of up to 2 * 63 * 127: two adds at most
            dot[r].flush();
            second[r].flush();
          }
        }
      };
      chunk(std::integral_constant<int, 0>{});
      chunk(std::integral_constant<int, 1>{});
      chunk(std::integral_constant<int, 2>{});
      chunk(std::integral_constant<int, 3>{});
      const __m256 s0 = scales8<K, S>(at, b * 2, b), s1 = scales8<K, S>(at, b * 2 + 1, b);
      const __m256 z0 = _mm256_mul_ps(_mm256_set1_ps(-w.centre), s0), z1 = _mm256_mul_ps(_mm256_set1_ps(-w.centre), s1);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        const __m256 d = _mm256_set1_ps(a.d[i]);
        total[r] = _mm256_fmadd_ps(dot[r].take(), _mm256_mul_ps(s0, d), total[r]);
        total[r] = _mm256_fmadd_ps(second[r].take(), _mm256_mul_ps(s1, d), total[r]);
        total[r] = _mm256_fmadd_ps(z0, _mm256_set1_ps(a.dh[2 * i]), total[r]);
        total[r] = _mm256_fmadd_ps(z1, _mm256_set1_ps(a.dh[2 * i + 1]), total[r]);
      }
      continue;
    } else {
      __m256i plane = _mm256_setzero_si256();
      if constexpr (K == U5) plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + b * 32));
      const auto chunk = [&](auto at) {
        constexpr int c = decltype(at)::value;
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + c * 32));
        __m256i low = _mm256_and_si256(packed, _mm256_set1_epi8(0x0F));
        __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F));
        if constexpr (K == U5) {
          low = _mm256_or_si256(low, fifth<2 * c>(plane));
          high = _mm256_or_si256(high, fifth<2 * c + 1>(plane));
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.q.data() + ((r0 + r) * nb + b) * 32 + 4 * c;
          dot[r].add(low, broadcast4(x));
          dot[r].add(high, broadcast4(x + 16));
          if (K == U5 && c % 2 == 1) dot[r].flush();  // pairs of up to 2 * 31 * 127: four adds at most
        }
      };
      chunk(std::integral_constant<int, 0>{});
      chunk(std::integral_constant<int, 1>{});
      chunk(std::integral_constant<int, 2>{});
      chunk(std::integral_constant<int, 3>{});
    }
    const __m256 s0 = scales8<K, S>(at, b * sub, b);
    const __m256 z = at.mn ? mins8<S>(at, b) : _mm256_mul_ps(_mm256_set1_ps(-w.centre), s0);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      total[r] = _mm256_fmadd_ps(dot[r].take(), _mm256_mul_ps(s0, _mm256_set1_ps(a.d[i])), total[r]);
      total[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(a.ds[i]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * GROUP, total[r]);
}

#else  // no AVX2: the same sums in plain loops

template <int64_t K, int S, int R>
void group_dot(const Matrix& w, int64_t g, const Acts& a, int64_t r0, float* out) {
  const int64_t nb = w.blocks, sub = w.sub;
  const Group at = group_at<K, S>(w, g);
  const uint8_t *qs = at.qs, *qh = at.qh;
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < GROUP; ++j) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = (r0 + r) * nb + b;
        const int8_t* x = a.q.data() + i * 32;
        const uint8_t* chunks = qs + b * chunk_bytes(K);
        int32_t sums[2] = {0, 0};
        for (int k = 0; k < 32; ++k) {
          int q;
          if (K == S8) {
            q = static_cast<int8_t>(chunks[(k / 4) * 32 + j * 4 + k % 4]);
          } else if (K == U8) {
            q = chunks[(k / 4) * 32 + j * 4 + k % 4];
          } else {
            const int c = (k % 16) / 4;
            const uint8_t byte = chunks[c * 32 + j * 4 + k % 4];
            q = k < 16 ? byte & 15 : byte >> 4;
            if (K == U5) q |= ((qh[b * 32 + j * 4 + k % 4] >> (2 * c + (k < 16 ? 0 : 1))) & 1) << 4;
            if (K == U6) q |= ((qh[b * 64 + (c / 2) * 32 + j * 4 + k % 4] >> (2 * (2 * (c % 2) + (k < 16 ? 0 : 1)))) & 3) << 4;
          }
          sums[sub == 2 && k >= 16] += q * x[k];
        }
        const float s0 = scale_at<K, S>(at, b * sub, b, j);
        total += static_cast<float>(sums[0]) * (s0 * a.d[i]);
        if (sub == 2) total += static_cast<float>(sums[1]) * (scale_at<K, S>(at, b * 2 + 1, b, j) * a.d[i]);
        if (K == U6) {
          total += -w.centre * s0 * a.dh[2 * i];
          total += -w.centre * scale_at<K, S>(at, b * 2 + 1, b, j) * a.dh[2 * i + 1];
        } else if (K != S8) {
          total += (at.mn ? min_at<S>(at, b, j) : -w.centre * s0) * a.ds[i];
        }
      }
      out[r * GROUP + j] = total;
    }
  }
}

#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int ROWS = 8;  // activation rows per pass over a group's blocks: 32 vector registers hold 8 rows' sums
#else
constexpr int ROWS = 4;  // 16 vector registers: 4 rows' sums, and the weights, without spilling
#endif

template <int64_t K, int S>
void run(const Matrix& w, const Acts& a, uint16_t* y) {
  const int64_t m = a.rows, n = w.rows, groups = (n + GROUP - 1) / GROUP;
  // enough groups per task to cover a thread's start-up (~64 KiB of blocks)
  const int64_t grain =
      std::max<int64_t>(1, 65536 / std::max<int64_t>(1, w.blocks * chunk_bytes(K) * std::min<int64_t>(m, ROWS)));
  using Kernel = void (*)(const Matrix&, int64_t, const Acts&, int64_t, float*);
  static constexpr Kernel kernels[8] = {group_dot<K, S, 1>, group_dot<K, S, 2>, group_dot<K, S, 3>,
                                        group_dot<K, S, 4>, group_dot<K, S, 5>, group_dot<K, S, 6>,
                                        group_dot<K, S, 7>, group_dot<K, S, 8>};
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    float out[ROWS * GROUP];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t width = std::min<int64_t>(GROUP, n - g * GROUP);
      for (int64_t r = 0; r < m; r += ROWS) {
        const int64_t rows = std::min<int64_t>(ROWS, m - r);
        kernels[rows - 1](w, g, a, r, out);
        for (int64_t i = 0; i < rows; ++i) {
#if defined(__AVX2__)
          if (width == GROUP) {
            to_bf8(out + i * GROUP, y + (r + i) * n + g * GROUP);
            continue;
          }
#endif
          for (int64_t j = 0; j < width; ++j) y[(r + i) * n + g * GROUP + j] = to_bf(out[i * GROUP + j]);
        }
      }
    }
  });
}

template <int64_t K>
void by_scaling(const Matrix& w, const Acts& a, uint16_t* y) {
  if (w.scaling == SUPER) run<K, SUPER>(w, a, y);
  else if (w.scaling == F32) run<K, F32>(w, a, y);
  else run<K, F16>(w, a, y);
}

Kept<Matrix> kept;

bool vnni() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return true;
#else
  return false;
#endif
}

int64_t keep(int64_t kind, int64_t rows, int64_t sub, double centre, const at::Tensor& qs, const at::Tensor& qh,
             const at::Tensor& scales, const at::Tensor& mins, int64_t per_super, const at::Tensor& dsuper,
             const at::Tensor& msuper) {
  auto w = std::make_shared<Matrix>();
  TORCH_CHECK(kind == U4 || kind == U5 || kind == S8 || kind == U8 || kind == U6, "unknown block kind ", kind);
  TORCH_CHECK(kind != U6 || (sub == 2 && centre == 32.0 && per_super > 0), "6-bit blocks: Q6_K's form");
  TORCH_CHECK(kind != U8 || vnni(), "unsigned 8-bit blocks need VNNI (AVX2's maddubs would saturate)");
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "(groups of 8 rows, blocks, bytes) u8 expected");
  TORCH_CHECK(rows > 0 && (rows + GROUP - 1) / GROUP == qs.size(0), "rows in groups of ", GROUP);
  w->kind = kind, w->rows = rows, w->blocks = qs.size(1), w->cols = 32 * qs.size(1);
  w->sub = sub, w->centre = static_cast<float>(centre);
  const int64_t groups = qs.size(0), padded = groups * GROUP;
  TORCH_CHECK(qs.size(2) == chunk_bytes(kind), "block bytes");
  TORCH_CHECK(sub == 1 || (sub == 2 && (kind == S8 || kind == U6)), "two scales a block for S8 and U6 only");
  TORCH_CHECK(kind != U8 || centre == 128.0, "unsigned 8-bit blocks hold q + 128");
  const bool eight = kind == S8 || kind == U8 || kind == U6;  // signed byte scales, no mins
  if (per_super > 0) {
    w->scaling = SUPER, w->per_super = per_super;
    TORCH_CHECK(w->blocks % per_super == 0, "whole super-blocks");
    TORCH_CHECK(scales.scalar_type() == (eight ? at::kChar : at::kByte), "byte scales with super-blocks");
    const int64_t supers = padded * (w->blocks / per_super);
    TORCH_CHECK(dsuper.is_contiguous() && dsuper.scalar_type() == at::kHalf && dsuper.numel() == supers,
                "an f16 d per super-block");
    if (!eight) {
      TORCH_CHECK(msuper.is_contiguous() && msuper.scalar_type() == at::kHalf && msuper.numel() == supers &&
                      mins.scalar_type() == at::kByte && mins.numel() == padded * w->blocks,
                  "a byte min per block and an f16 dmin per super-block");
      w->msuper = msuper;
    }
    w->dsuper = dsuper;
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf, "f16 or f32 scales");
    w->scaling = scales.scalar_type() == at::kFloat ? F32 : F16;
  }
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == padded * w->blocks * sub, "a scale per block");
  if (high_bytes(kind))
    TORCH_CHECK(qh.is_contiguous() && qh.scalar_type() == at::kByte && qh.numel() == padded / GROUP * w->blocks * high_bytes(kind),
                "high bits");
  if (mins.numel()) {
    TORCH_CHECK(!eight && mins.is_contiguous() && mins.numel() == padded * w->blocks, "a min per block");
    TORCH_CHECK(per_super > 0 || mins.scalar_type() == scales.scalar_type(), "mins of the scales' type");
    w->mins = mins;
  } else {
    TORCH_CHECK(per_super == 0 || eight, "K-quant blocks need their mins");
  }
  w->qs = qs, w->qh = high_bytes(kind) ? qh : at::Tensor(), w->scales = scales;
  return kept.add(std::move(w));
}

void forget(int64_t id) { kept.forget(id); }

// A K-quant tensor's blocks as stored in the file, (rows, super-blocks, bytes) u8 (GGML type ``type``: 12 Q4_K,
// 13 Q5_K, 14 Q6_K), in the products' layout (U4, U5, U6) with SUPER scales, moved byte by byte (nothing decoded
// to floats): [qs (groups, blocks, 128), qh (groups, blocks, 32 | 64) or empty, sc (groups, blocks * sub, 8) u8
// (i8 for Q6_K), mn (groups, blocks, 8) u8 or empty, d, dmin (groups, super-blocks, 8) f16 (dmin empty for
// Q6_K)]. Rows padded to whole groups are zeros. What ``quant.Blocks.from_k`` builds from ``gguf.k_parts``, a
// tenth of the time and without its temporaries.
std::vector<at::Tensor> repack_k(int64_t type, const at::Tensor& raw) {
  constexpr int64_t Q4_K = 12, Q5_K = 13, Q6_K = 14;
  TORCH_CHECK(type == Q4_K || type == Q5_K || type == Q6_K, "not a K-quant type: ", type);
  const int64_t size = type == Q4_K ? 144 : type == Q5_K ? 176 : 210;
  TORCH_CHECK(raw.dim() == 3 && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.size(2) == size,
              "(rows, super-blocks, ", size, ") u8 expected");
  const int64_t rows = raw.size(0), supers = raw.size(1), nb = supers * 8, groups = (rows + GROUP - 1) / GROUP;
  const bool six = type == Q6_K, fifth = type == Q5_K;
  const int64_t sub = six ? 2 : 1;
  const auto u8 = raw.options();
  at::Tensor qs = at::zeros({groups, nb, 128}, u8);
  at::Tensor qh = fifth || six ? at::zeros({groups, nb, six ? 64 : 32}, u8) : at::empty({0}, u8);
  at::Tensor sc = at::zeros({groups, nb * sub, GROUP}, six ? u8.dtype(at::kChar) : u8);
  at::Tensor mn = six ? at::empty({0}, u8) : at::zeros({groups, nb, GROUP}, u8);
  at::Tensor d = at::zeros({groups, supers, GROUP}, u8.dtype(at::kHalf));
  at::Tensor dmin = six ? at::empty({0}, u8.dtype(at::kHalf)) : at::zeros({groups, supers, GROUP}, u8.dtype(at::kHalf));
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t *out = qs.data_ptr<uint8_t>(), *highs = fifth || six ? qh.data_ptr<uint8_t>() : nullptr;
  uint8_t* scales = static_cast<uint8_t*>(sc.data_ptr());
  uint8_t* mins = six ? nullptr : mn.data_ptr<uint8_t>();
  uint16_t* ds = reinterpret_cast<uint16_t*>(d.data_ptr());
  uint16_t* dms = six ? nullptr : reinterpret_cast<uint16_t*>(dmin.data_ptr());
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    uint8_t q[256];
    for (int64_t row = begin; row < end; ++row) {
      const int64_t g = row / GROUP, j = row % GROUP;
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* x = in + (row * supers + s) * size;
        uint16_t dd, dm = 0;
        if (six) {
          std::memcpy(&dd, x + 208, 2);
          for (int w = 0; w < 256; ++w) {  // as gguf-py: low 4 bits from ql, high 2 from qh (w = s * (q - 32))
            const int h = w / 128, low = (x[h * 64 + w % 64] >> (4 * ((w % 128) / 64))) & 0x0F;
            const int high = (x[128 + h * 32 + w % 32] >> (2 * ((w % 128) / 32))) & 0x03;
            q[w] = static_cast<uint8_t>(low | (high << 4));
          }
          for (int k = 0; k < 16; ++k) scales[((g * nb * 2) + s * 16 + k) * GROUP + j] = x[192 + k];
        } else {
          std::memcpy(&dd, x, 2);
          std::memcpy(&dm, x + 2, 2);
          const uint8_t* k6 = x + 4;  // 6-bit scales and mins of the 8 sub-blocks
          for (int b = 0; b < 8; ++b) {
            const uint8_t scale = b < 4 ? k6[b] & 63 : (k6[b + 4] & 0x0F) | ((k6[b - 4] >> 6) << 4);
            const uint8_t min = b < 4 ? k6[b + 4] & 63 : (k6[b + 4] >> 4) | ((k6[b] >> 6) << 4);
            scales[(g * nb + s * 8 + b) * GROUP + j] = scale;
            mins[(g * nb + s * 8 + b) * GROUP + j] = min;
          }
          const uint8_t* nibbles = x + (fifth ? 48 : 16);
          for (int w = 0; w < 256; ++w) {
            const int b = w / 32, i = w % 32;
            q[w] = (nibbles[(b / 2) * 32 + i] >> (4 * (b % 2))) & 0x0F;
            if (fifth) q[w] |= ((x[16 + i] >> b) & 1) << 4;
          }
        }
        ds[(g * supers + s) * GROUP + j] = dd;
        if (!six) dms[(g * supers + s) * GROUP + j] = dm;
        for (int b = 0; b < 8; ++b) {  // the 8 blocks of 32 in the group's layout (``chunk_bytes``, above)
          const uint8_t* v = q + b * 32;
          uint8_t* blk = out + (g * nb + s * 8 + b) * 128;
          for (int c = 0; c < 4; ++c)
            for (int k = 0; k < 4; ++k) blk[c * 32 + j * 4 + k] = (v[4 * c + k] & 15) | ((v[16 + 4 * c + k] & 15) << 4);
          if (six) {  // plane p, byte 4 j + k, bits 2 (2 c' + h): chunk 2 p + c''s weight 4 c + k (+ 16 for h 1)
            uint8_t* f = highs + (g * nb + s * 8 + b) * 64 + j * 4;
            for (int p = 0; p < 2; ++p)
              for (int k = 0; k < 4; ++k) {
                uint8_t bits = 0;
                for (int c2 = 0; c2 < 2; ++c2)
                  for (int h = 0; h < 2; ++h) bits |= (v[16 * h + 4 * (2 * p + c2) + k] >> 4) << (2 * (2 * c2 + h));
                f[p * 32 + k] = bits;
              }
          }
          if (fifth) {
            uint8_t* f = highs + (g * nb + s * 8 + b) * 32 + j * 4;
            for (int k = 0; k < 4; ++k) {
              uint8_t bits = 0;
              for (int c = 0; c < 4; ++c)
                bits |= ((v[4 * c + k] >> 4) << (2 * c)) | ((v[16 + 4 * c + k] >> 4) << (2 * c + 1));
              f[k] = bits;
            }
          }
        }
      }
    }
  });
  return {qs, qh, sc, mn, d, dmin};
}


at::Tensor mm(int64_t id, const at::Tensor& x) {
  auto w = find(id);
  TORCH_CHECK(w, "no block matrix ", id);
  return multiply(*w, x);
}

}  // namespace

std::shared_ptr<const Matrix> find(int64_t id) { return kept.find(id); }

at::Tensor multiply(const Matrix& w, const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.cols && x_in.scalar_type() == at::kBFloat16,
              "bf16 (rows, ", w.cols, ") expected");
  const at::Tensor x = x_in.contiguous();
  const Acts a = quantize(x);
  at::Tensor y = at::empty({x.size(0), w.rows}, x.options());
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (w.kind == U4) by_scaling<U4>(w, a, out);
  else if (w.kind == U5) by_scaling<U5>(w, a, out);
  else if (w.kind == U6) by_scaling<U6>(w, a, out);
  else if (w.kind == U8) by_scaling<U8>(w, a, out);
  else by_scaling<S8>(w, a, out);
  return y;
}

}  // namespace blocks

TORCH_LIBRARY_FRAGMENT(chat_native, lib) {
  lib.def("blocks_keep(int kind, int rows, int sub, float centre, Tensor qs, Tensor qh, Tensor scales, Tensor mins, "
          "int per_super, Tensor dsuper, Tensor msuper) -> int",
          &blocks::keep);
  lib.def("blocks_forget(int id) -> ()", &blocks::forget);
  lib.def("blocks_repack_k(int type, Tensor raw) -> Tensor[]", &blocks::repack_k);
  lib.def("blocks_vnni() -> bool", &blocks::vnni);
  lib.def("blocks_mm(int id, Tensor x) -> Tensor", &blocks::mm);
}
