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
#include <map>
#include <mutex>
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

constexpr int TILE = 8;  // activation rows per pass over a weight row: one float lane each

// Activation rows quantized per 32 values: q (rows, cols) int8; for each tile of TILE rows and each block,
// the rows' scales d and d * sum(q) side by side (tiles, blocks, TILE), zero past the last row.
struct Acts {
  int64_t rows = 0, blocks = 0;
  std::vector<int8_t> q;
  std::vector<float> d, ds;
};

Acts quantize(const at::Tensor& x) {
  Acts a;
  a.rows = x.size(0);
  const int64_t cols = x.size(1);
  a.blocks = cols / 32;
  a.q.resize(a.rows * cols);
  const int64_t tiles = (a.rows + TILE - 1) / TILE;
  a.d.assign(tiles * a.blocks * TILE, 0.f);
  a.ds.assign(tiles * a.blocks * TILE, 0.f);
  const uint16_t* in = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t i = 0; i < a.rows * a.blocks; ++i) {
    float v[32], top = 0.f;
    for (int j = 0; j < 32; ++j) v[j] = bf(in[i * 32 + j]);
    for (int j = 0; j < 32; ++j) top = std::max(top, std::fabs(v[j]));
    const float d = top / 127.f, inverse = top > 0.f ? 127.f / top : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(v[j] * inverse));
      a.q[i * 32 + j] = static_cast<int8_t>(q);
      sum += q;
    }
    const int64_t row = i / a.blocks, b = i % a.blocks, at = ((row / TILE) * a.blocks + b) * TILE + row % TILE;
    a.d[at] = d;
    a.ds[at] = d * static_cast<float>(sum);
  }
  return a;
}

template <bool Wide>
inline float scale_at(const void* p, int64_t i) {
  if constexpr (Wide) return static_cast<const float*>(p)[i];
  return half(static_cast<const uint16_t*>(p)[i]);
}

#if defined(__AVX2__)

inline __m256i nibbles(const uint8_t* p) {  // 16 bytes -> 32 values: low nibbles, then high ones
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

inline __m256i fifth_bits(const uint8_t* p) {  // 4 bytes -> 0x10 in byte i where bit i is set
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

inline __m256i dot_unsigned(__m256i q, __m256i a) {  // 8 int32 sums of 4 products each (no saturation here)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1));
#endif
}

inline float sum8(__m256 v) {  // a fixed order
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// R activation rows (the first R of tile t) times weight row n -> out[0..R). Each row is a lane of the
// scale and min vectors and has its own accumulator: what it computes does not depend on R.
template <int64_t K, bool Wide, int R>
void rows_dot(const Matrix& w, int64_t n, const Acts& a, int64_t t, float* out) {
  const int64_t nb = w.blocks, stride = K == S8 ? 32 : 16;
  const uint8_t* qs = w.qs.data_ptr<uint8_t>() + n * nb * stride;
  const uint8_t* qh = K == U5 ? w.qh.data_ptr<uint8_t>() + n * nb * 4 : nullptr;
  const void* sc = static_cast<const char*>(w.scales.data_ptr()) + n * nb * w.sub * (Wide ? 4 : 2);
  const void* mn = w.mins.defined() ? static_cast<const char*>(w.mins.data_ptr()) + n * nb * (Wide ? 4 : 2) : nullptr;
  const int8_t* xq = a.q.data() + t * TILE * nb * 32;
  const float* ad = a.d.data() + t * nb * TILE;
  const float* ads = a.ds.data() + t * nb * TILE;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  __m256 mins = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i q;
    if constexpr (K == S8) {
      q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * 32));
    } else {
      q = nibbles(qs + b * 16);
      if constexpr (K == U5) q = _mm256_or_si256(q, fifth_bits(qh + b * 4));
    }
    __m256i magnitude = q;
    if constexpr (K == S8) magnitude = _mm256_sign_epi8(q, q);
    const __m256 da = _mm256_loadu_ps(ad + b * TILE);
    const float s0 = scale_at<Wide>(sc, w.sub * b);
    const __m256 scale0 = _mm256_mul_ps(_mm256_set1_ps(s0), da);  // row r's block scale in lane r
    __m256 scale1 = scale0;
    if (K == S8 && w.sub == 2) scale1 = _mm256_mul_ps(_mm256_set1_ps(scale_at<Wide>(sc, 2 * b + 1)), da);
    if constexpr (K != S8) {
      const float z = mn ? scale_at<Wide>(mn, b) : -w.centre * s0;
      mins = _mm256_fmadd_ps(_mm256_set1_ps(z), _mm256_loadu_ps(ads + b * TILE), mins);
    }
    for (int r = 0; r < R; ++r) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r * nb + b) * 32));
      if constexpr (K == S8) x = _mm256_sign_epi8(x, q);
      const __m256 products = _mm256_cvtepi32_ps(dot_unsigned(magnitude, x));
      const __m256i lane = _mm256_set1_epi32(r);
      __m256 scale = _mm256_permutevar8x32_ps(scale0, lane);
      if (K == S8 && w.sub == 2) scale = _mm256_blend_ps(scale, _mm256_permutevar8x32_ps(scale1, lane), 0xF0);
      acc[r] = _mm256_fmadd_ps(products, scale, acc[r]);
    }
  }
  float m[8];
  _mm256_storeu_ps(m, mins);
  for (int r = 0; r < R; ++r) out[r] = sum8(acc[r]) + m[r];
}

#else  // no AVX2: the same sums in plain loops

template <int64_t K, bool Wide, int R>
void rows_dot(const Matrix& w, int64_t n, const Acts& a, int64_t t, float* out) {
  const int64_t nb = w.blocks, stride = K == S8 ? 32 : 16;
  const uint8_t* qs = w.qs.data_ptr<uint8_t>() + n * nb * stride;
  const uint8_t* qh = K == U5 ? w.qh.data_ptr<uint8_t>() + n * nb * 4 : nullptr;
  const void* sc = static_cast<const char*>(w.scales.data_ptr()) + n * nb * w.sub * (Wide ? 4 : 2);
  const void* mn = w.mins.defined() ? static_cast<const char*>(w.mins.data_ptr()) + n * nb * (Wide ? 4 : 2) : nullptr;
  for (int r = 0; r < R; ++r) {
    float acc = 0.f, mins = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* x = a.q.data() + ((t * TILE + r) * nb + b) * 32;
      const float da = a.d[(t * nb + b) * TILE + r];
      int32_t sums[2] = {0, 0};
      for (int j = 0; j < 32; ++j) {
        int q;
        if (K == S8) {
          q = static_cast<int8_t>(qs[b * 32 + j]);
        } else {
          q = j < 16 ? qs[b * 16 + j] & 15 : qs[b * 16 + j - 16] >> 4;
          if (K == U5) q |= ((qh[b * 4 + j / 8] >> (j % 8)) & 1) << 4;
        }
        sums[j / 16] += q * x[j];
      }
      const float s = scale_at<Wide>(sc, w.sub * b);
      if (K == S8 && w.sub == 2) {
        acc += sums[0] * (s * da) + sums[1] * (scale_at<Wide>(sc, 2 * b + 1) * da);
      } else {
        acc += (sums[0] + sums[1]) * (s * da);
        if (K != S8) mins += (mn ? scale_at<Wide>(mn, b) : -w.centre * s) * a.ds[(t * nb + b) * TILE + r];
      }
    }
    out[r] = acc + mins;
  }
}

#endif

template <int64_t K, bool Wide>
void run(const Matrix& w, const Acts& a, uint16_t* y) {
  const int64_t m = a.rows, n = w.rows, tiles = (m + TILE - 1) / TILE;
  // enough weight rows per task to cover a thread's start-up (~64 KiB of blocks)
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, w.blocks * 20 * std::min<int64_t>(m, 8)));
  using Kernel = void (*)(const Matrix&, int64_t, const Acts&, int64_t, float*);
  static constexpr Kernel kernels[TILE] = {rows_dot<K, Wide, 1>, rows_dot<K, Wide, 2>, rows_dot<K, Wide, 3>,
                                           rows_dot<K, Wide, 4>, rows_dot<K, Wide, 5>, rows_dot<K, Wide, 6>,
                                           rows_dot<K, Wide, 7>, rows_dot<K, Wide, 8>};
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float out[TILE];
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = std::min<int64_t>(TILE, m - t * TILE);
        kernels[rows - 1](w, j, a, t, out);
        for (int64_t i = 0; i < rows; ++i) y[(t * TILE + i) * n + j] = to_bf(out[i]);
      }
    }
  });
}

std::mutex lock;
std::map<int64_t, std::shared_ptr<const Matrix>> kept;

int64_t keep(int64_t kind, int64_t sub, double centre, const at::Tensor& qs, const at::Tensor& qh,
             const at::Tensor& scales, const at::Tensor& mins) {
  auto w = std::make_shared<Matrix>();
  TORCH_CHECK(kind == U4 || kind == U5 || kind == S8, "unknown block kind ", kind);
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.is_contiguous(), "(rows, blocks, bytes) u8 expected");
  w->kind = kind, w->rows = qs.size(0), w->blocks = qs.size(1), w->cols = 32 * qs.size(1);
  w->sub = sub, w->centre = static_cast<float>(centre);
  TORCH_CHECK(qs.size(2) == (kind == S8 ? 32 : 16), "block bytes");
  TORCH_CHECK(sub == 1 || (sub == 2 && kind == S8), "two scales a block for S8 only");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf, "f16 or f32 scales");
  w->wide = scales.scalar_type() == at::kFloat;
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == w->rows * w->blocks * sub, "a scale per block");
  if (kind == U5)
    TORCH_CHECK(qh.is_contiguous() && qh.scalar_type() == at::kByte && qh.numel() == w->rows * w->blocks * 4,
                "fifth bits");
  if (mins.numel()) {
    TORCH_CHECK(kind != S8 && mins.is_contiguous() && mins.scalar_type() == scales.scalar_type() &&
                    mins.numel() == w->rows * w->blocks,
                "a min per block, of the scales' type");
    w->mins = mins;
  }
  w->qs = qs, w->qh = kind == U5 ? qh : at::Tensor(), w->scales = scales;
  std::lock_guard<std::mutex> guard(lock);
  const int64_t id = kept.empty() ? 1 : kept.rbegin()->first + 1;
  kept.emplace(id, std::move(w));
  return id;
}

void forget(int64_t id) {
  std::lock_guard<std::mutex> guard(lock);
  kept.erase(id);
}

at::Tensor mm(int64_t id, const at::Tensor& x) {
  auto w = find(id);
  TORCH_CHECK(w, "no block matrix ", id);
  return multiply(*w, x);
}

}  // namespace

std::shared_ptr<const Matrix> find(int64_t id) {
  std::lock_guard<std::mutex> guard(lock);
  auto it = kept.find(id);
  return it == kept.end() ? nullptr : it->second;
}

at::Tensor multiply(const Matrix& w, const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.cols && x_in.scalar_type() == at::kBFloat16,
              "bf16 (rows, ", w.cols, ") expected");
  const at::Tensor x = x_in.contiguous();
  const Acts a = quantize(x);
  at::Tensor y = at::empty({x.size(0), w.rows}, x.options());
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (w.kind == U4) w.wide ? run<U4, true>(w, a, out) : run<U4, false>(w, a, out);
  else if (w.kind == U5) w.wide ? run<U5, true>(w, a, out) : run<U5, false>(w, a, out);
  else w.wide ? run<S8, true>(w, a, out) : run<S8, false>(w, a, out);
  return y;
}

}  // namespace blocks

TORCH_LIBRARY_FRAGMENT(chat_native, lib) {
  lib.def("blocks_keep(int kind, int sub, float centre, Tensor qs, Tensor qh, Tensor scales, Tensor mins) -> int",
          &blocks::keep);
  lib.def("blocks_forget(int id) -> ()", &blocks::forget);
  lib.def("blocks_mm(int id, Tensor x) -> Tensor", &blocks::mm);
}
