// The engine's decode step in one call: every layer of a Llama-shaped decoder for one new
// column per row, with the norms, rotary positions, key/value writes, attention and SwiGLU as
// plain loops and the products on ATen's kernels (int4 or dense, as the Python side picks).
// Beyond Llama's block: q/k head norms, rotary positions over part of a head or none on some layers,
// Gemma's norms (float32 weights, after the attention and the MLP too), GELU, windowed layers with
// rotary angles of their own (their keys and values in a ring of the last columns, where the buffer gives one).
//
// Built by chat/engine/model/native.py with the C++ compiler it finds, loaded with
// torch.ops.load_library. Eager torch spends ~40 operator calls a layer on vectors of a few
// hundred numbers (3 µs each here, more than their arithmetic); this is the same step with four.
//
// Arithmetic follows the eager decoder (decoder.py): bf16 activations, float32 inside norms,
// attention in float32, the same roundings to bf16 between operations. Sums run in a fixed
// order over a row's own columns only, so a row's result does not depend on the other rows of
// the batch or on the padding before its tokens.
#include "blocks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf(float f) {  // round to nearest even, as c10::BFloat16 (branch-free: vectorizes)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  return static_cast<uint16_t>(f != f ? 0x7FC0 : rounded);
}

// e^x for x <= 0 in float32, within ~2 ulp (Cody-Waite reduction, a degree-6 polynomial), written so
// the compiler vectorizes it (the C library's expf is a call per element).
inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// silu(x) = x / (1 + e^-x), with e^-|x| only (exp_neg's range).
inline float silu(float x) {
  const float e = exp_neg(-std::fabs(x));
  return x >= 0.f ? x / (1.f + e) : x * e / (1.f + e);
}

// GELU's tanh form, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as torch's gelu(approximate="tanh");
// tanh(u) = sign(u) (1 - e^-2|u|) / (1 + e^-2|u|).
inline float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float e = exp_neg(-2.f * std::fabs(u));
  const float t = (1.f - e) / (1.f + e);
  return 0.5f * x * (1.f + (u >= 0.f ? t : -t));
}

constexpr int64_t LANES = 16;  // partial sums: a fixed summation order the compiler can vectorize

// sum of a[i] * b[i] over n (a multiple of LANES) floats, in LANES partial sums added in order
inline float dot(const float* a, const float* b, int64_t n) {
  float part[LANES] = {};
  for (int64_t i = 0; i < n; i += LANES)
    for (int64_t l = 0; l < LANES; ++l) part[l] += a[i + l] * b[i + l];
  float sum = 0.f;
  for (int64_t l = 0; l < LANES; ++l) sum += part[l];
  return sum;
}

inline void widen(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf(in[i]);
}

inline uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// A run of a product's outputs: blocks with 8-bit activations (blocks.cpp), int4 products summed (one for
// 4-bit weights, two for 5 to 8 bits), or a dense matrix (a type neither kernel takes).
struct Segment {
  std::vector<std::pair<at::Tensor, at::Tensor>> terms;  // (packed, scales and zeros)
  at::Tensor dense;
  std::shared_ptr<const blocks::Matrix> matrix;

  at::Tensor operator()(const at::Tensor& x) const {
    if (matrix) return blocks::multiply(*matrix, x);
    if (dense.defined()) return at::linear(x, dense);
    at::Tensor y = at::_weight_int4pack_mm_for_cpu(x, terms[0].first, 32, terms[0].second);
    for (size_t i = 1; i < terms.size(); ++i)
      y.add_(at::_weight_int4pack_mm_for_cpu(x, terms[i].first, 32, terms[i].second));
    return y;
  }
};

struct Product {  // one of the decoder's matrices: int4 segments side by side, a dense copy, or both
  std::vector<Segment> segments;
  at::Tensor dense, bias;
  int64_t crossover = 0;  // the segments up to this many rows, the dense copy above (when there are both)

  at::Tensor operator()(const at::Tensor& x) const {
    if (segments.empty() || (dense.defined() && x.size(0) > crossover))
      return bias.defined() ? at::linear(x, dense, bias) : at::linear(x, dense);
    at::Tensor y;
    if (segments.size() == 1) {
      y = segments[0](x);
    } else {
      std::vector<at::Tensor> outs;
      for (const Segment& s : segments) outs.push_back(s(x));
      y = at::cat(outs, 1);
    }
    if (bias.defined()) y.add_(bias);
    return y;
  }
};

// A layer's kind (``keep``'s kinds): bits of what it does beyond the Llama core.
constexpr int64_t NO_ROPE = 1;  // no rotary positions (SmolLM3's every fourth layer)
constexpr int64_t SLIDING = 2;  // attention over the model's window of latest columns, the local rotary angles

// The model's style (``keep``'s style): bits.
constexpr int64_t GEMMA_NORMS = 1;  // each norm's weight applied in float32 before one rounding (Gemma's)
constexpr int64_t GELU = 2;         // a GELU (tanh) gated MLP instead of SwiGLU

struct Layer {
  at::Tensor attn_norm, mlp_norm;
  at::Tensor q_norm, k_norm;  // per-head RMSNorms of the queries and keys (qk_norm), or undefined
  at::Tensor post_attn_norm, post_mlp_norm;  // norms of the attention's and the MLP's outputs (Gemma's), or undefined
  Product qkv, o, gate_up, down;
  int64_t kind = 0;
};

struct Model {
  std::vector<Layer> layers;
  int64_t heads = 0, kv_heads = 0, dim = 0;
  int64_t window = 0;  // SLIDING layers' span in columns
  bool gemma_norms = false, gelu = false;
  double eps = 1e-6;
};

blocks::Kept<Model> models;

// weight * bf16(x * rsqrt(mean(x^2) + eps)) over n values, as decoder._norm rounds it; with ``gemma``,
// bf16(x * rsqrt(...) * weight) (one rounding, Gemma's).
inline void norm_into(const uint16_t* in, const uint16_t* w, double eps, int64_t n, float* row, uint16_t* out,
                      bool gemma) {
  widen(in, row, n);
  const float sum = dot(row, row, n);
  const float scale = 1.f / std::sqrt(sum / n + static_cast<float>(eps));
  if (gemma) {
    for (int64_t i = 0; i < n; ++i) out[i] = to_bf(row[i] * scale * bf(w[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = to_bf(bf(w[i]) * bf(to_bf(row[i] * scale)));
  }
}

// ``norm_into`` row by row.
at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty_like(x);
  std::vector<float> row(n);
  for (int64_t r = 0; r < rows; ++r) norm_into(bits(x) + r * n, bits(weight), eps, n, row.data(), bits(out) + r * n,
                                               gemma);
  return out;
}

// One head's n values normed as ``norm`` rounds a row, into ``out``.
void norm_head(const uint16_t* in, const at::Tensor& weight, double eps, int64_t n, uint16_t* out, bool gemma) {
  float row[512];
  norm_into(in, bits(weight), eps, n, row, out, gemma);
}

// h += y, rounded to bf16 (in place).
void add_into(at::Tensor& h, const at::Tensor& y) {
  uint16_t* a = bits(h);
  const uint16_t* b = bits(y);
  for (int64_t i = 0, n = h.numel(); i < n; ++i) a[i] = to_bf(bf(a[i]) + bf(b[i]));
}

// silu(gate) * up (``gelu``: gelu_tanh(gate) * up) for a (rows, 2F) gate/up product -> (rows, F), rounded as
// eager torch does.
at::Tensor swiglu(const at::Tensor& gu, bool gelu) {
  const int64_t rows = gu.size(0), f = gu.size(1) / 2;
  at::Tensor out = at::empty({rows, f}, gu.options());
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = bits(gu) + r * 2 * f;
    const uint16_t* u = g + f;
    uint16_t* o = bits(out) + r * f;
    if (gelu) {
      for (int64_t i = 0; i < f; ++i) o[i] = to_bf(bf(to_bf(gelu_tanh(bf(g[i])))) * bf(u[i]));
    } else {
      for (int64_t i = 0; i < f; ++i) o[i] = to_bf(bf(to_bf(silu(bf(g[i])))) * bf(u[i]));
    }
  }
  return out;
}

// Where each query of a step goes: its buffer row and the column it writes (a row's queries together, in
// order): ``cols`` columns per row from ``col``, or each row its own number (``counts``: drafts beyond one row).
struct Places {
  std::vector<int64_t> row, column;
  int64_t end = 0;  // one past the last column written

  Places(int64_t rows, int64_t col, const int64_t* counts, int64_t cols) {
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t n = counts ? counts[b] : cols;
      for (int64_t j = 0; j < n; ++j) row.push_back(b), column.push_back(col + j);
      end = std::max(end, col + n);
    }
  }
};

// Rotary positions for the query and key heads of a (rows x cols, (heads + 2 kv_heads) * dim) q/k/v
// product (each head normed first where the layer has q/k norms; over the first cos.size(1) values of a
// head, the rest passed on; none on a NO_ROPE layer); queries go to ``q`` (float), keys and values into
// the layer's buffers: query i at its place (``Places``).
void rope_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const Model& m,
                    const Layer& layer, at::Tensor& q, at::Tensor& keys, at::Tensor& values, const Places& at) {
  const int64_t queries = qkv.size(0), d = m.dim, rot = cos.size(1), half = rot / 2, width = qkv.size(1);
  const bool rotate = !(layer.kind & NO_ROPE);
  const auto ks = keys.strides(), vs = values.strides();
  const int64_t slots = keys.size(2);  // column c at c mod slots: a windowed layer's ring (else c itself)
  for (int64_t r = 0; r < queries; ++r) {
    const int64_t b = at.row[r], at_col = at.column[r];  // its buffer row and column
    const uint16_t* row = bits(qkv) + r * width;
    const uint16_t* c = bits(cos) + r * rot;
    const uint16_t* s = bits(sin) + r * rot;
    for (int64_t h = 0; h < m.heads + m.kv_heads; ++h) {
      const uint16_t* x = row + h * d;
      uint16_t normed[512], rotated[512];
      const at::Tensor& head_norm = h < m.heads ? layer.q_norm : layer.k_norm;
      if (head_norm.defined()) {
        norm_head(x, head_norm, m.eps, d, normed, m.gemma_norms);
        x = normed;
      }
      const int64_t turns = rotate ? rot : 0;
      for (int64_t i = 0; i < turns; ++i) {
        // x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16
        const float turned = i < half ? -bf(x[i + half]) : bf(x[i - half]);
        rotated[i] = to_bf(bf(to_bf(bf(x[i]) * bf(c[i]))) + bf(to_bf(turned * bf(s[i]))));
      }
      for (int64_t i = turns; i < d; ++i) rotated[i] = x[i];
      if (h < m.heads) {
        float* out = q.data_ptr<float>() + (r * m.heads + h) * d;
        for (int64_t i = 0; i < d; ++i) out[i] = bf(rotated[i]);
      } else {
        uint16_t* out = bits(keys) + b * ks[0] + (h - m.heads) * ks[1] + (at_col % slots) * ks[2];
        std::memcpy(out, rotated, d * sizeof(uint16_t));
      }
    }
    for (int64_t h = 0; h < m.kv_heads; ++h) {
      const uint16_t* v = row + (m.heads + m.kv_heads + h) * d;
      std::memcpy(bits(values) + b * vs[0] + h * vs[1] + (at_col % slots) * vs[2], v, d * sizeof(uint16_t));
    }
  }
}

// Each query's heads attend over its buffer row's own columns [starts[b], its column] (query r: buffer
// row b = at.row[r], column at.column[r]), exactly as a step of that column alone would: the heads that
// share a key/value head go together. -> (queries, heads * dim) bf16.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int64_t* starts,
                  const Places& at, const Model& m, int64_t window) {
  // a windowed layer: query column c over columns [max(start, c - window + 1), c] (a row's columns are its
  // positions in order, so that is the keys within ``window`` positions)
  auto first_of = [&](int64_t r) {
    const int64_t start = starts[at.row[r]], at_col = at.column[r];
    return window > 0 ? std::max(start, at_col - window + 1) : start;
  };
  const int64_t queries = q.size(0), d = m.dim, group = m.heads / m.kv_heads;
  at::Tensor out = at::empty({queries, m.heads * d}, keys.options());
  const auto ks = keys.strides(), vs = values.strides();
  const int64_t slots = keys.size(2);  // column c at c mod slots (``rope_and_store``)
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  int64_t work = 0;
  for (int64_t r = 0; r < queries; ++r) work += (at.column[r] + 1 - first_of(r)) * group * d * 2;
  const int64_t tasks = queries * m.kv_heads;
  const int64_t grain = std::max<int64_t>(1, tasks * 65536 / std::max<int64_t>(work, 1));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, key(d), acc(group * d);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / m.kv_heads, g = t % m.kv_heads, b = at.row[r], first = first_of(r);
      const int64_t n = at.column[r] + 1 - first;
      const float* qs = q.data_ptr<float>() + (r * m.heads + g * group) * d;
      const uint16_t* kbase = bits(keys) + b * ks[0] + g * ks[1];
      const uint16_t* vbase = bits(values) + b * vs[0] + g * vs[1];
      scores.assign(group * n, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        widen(kbase + ((first + j) % slots) * ks[2], key.data(), d);
        for (int64_t h = 0; h < group; ++h) scores[h * n + j] = dot(key.data(), qs + h * d, d) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> total(group, 0.f);
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * n;
        float top = s[0];
        for (int64_t j = 1; j < n; ++j) top = std::max(top, s[j]);
        for (int64_t j = 0; j < n; ++j) s[j] = exp_neg(s[j] - top);
        for (int64_t j = 0; j < n; ++j) total[h] += s[j];
      }
      for (int64_t j = 0; j < n; ++j) {
        widen(vbase + ((first + j) % slots) * vs[2], key.data(), d);
        for (int64_t h = 0; h < group; ++h) {
          const float p = scores[h * n + j];
          float* a = acc.data() + h * d;
          for (int64_t i = 0; i < d; ++i) a[i] += p * key[i];
        }
      }
      uint16_t* o = bits(out) + r * m.heads * d + g * group * d;
      for (int64_t h = 0; h < group; ++h)
        for (int64_t i = 0; i < d; ++i) o[h * d + i] = to_bf(acc[h * d + i] / total[h]);
    }
  });
  return out;
}

at::Tensor opt(const at::Tensor& t) { return t.numel() ? t : at::Tensor(); }

int64_t keep(at::TensorList norms, at::TensorList tensors, at::IntArrayRef layout, at::TensorList biases,
             at::IntArrayRef crossovers, at::IntArrayRef kinds, int64_t heads, int64_t kv_heads, int64_t dim,
             double eps, int64_t window, int64_t style) {
  // Per layer: norms [attn, mlp, q heads, k heads, after attention, after MLP] (the last four empty: none), its
  // kind (NO_ROPE, SLIDING bits); then for each of its products [qkv, o, gate_up, down] a bias (empty:
  // none), a crossover, and in ``layout``: [has a dense copy, segments, then each segment's int4 terms
  // (0: a dense segment; -1: a block matrix, whose id follows)], whose tensors come in that order from
  // ``tensors``: the dense copy, then per segment its dense matrix or its terms' (packed, scales) pairs.
  // ``window``: SLIDING layers' span; ``style``: GEMMA_NORMS, GELU bits.
  Model m;
  m.heads = heads, m.kv_heads = kv_heads, m.dim = dim, m.eps = eps, m.window = window;
  m.gemma_norms = style & GEMMA_NORMS, m.gelu = style & GELU;
  const int64_t n = norms.size() / 6;
  TORCH_CHECK(n > 0 && norms[0].numel() % LANES == 0, "hidden size not a multiple of ", LANES);
  TORCH_CHECK(dim <= 512 && dim % LANES == 0 && heads % kv_heads == 0, "unsupported head shape");
  TORCH_CHECK(biases.size() == static_cast<size_t>(n * 4) && crossovers.size() == static_cast<size_t>(n * 4) &&
                  kinds.size() == static_cast<size_t>(n) && norms.size() == static_cast<size_t>(n * 6),
              "weights of ", n, " layers expected");
  size_t at = 0, t = 0;
  auto next_int = [&]() {
    TORCH_CHECK(at < layout.size(), "layout too short");
    return layout[at++];
  };
  auto next_tensor = [&]() {
    TORCH_CHECK(t < tensors.size(), "too few weight tensors for the layout");
    return tensors[t++];
  };
  for (int64_t l = 0; l < n; ++l) {
    Layer layer;
    layer.attn_norm = norms[6 * l].contiguous();
    layer.mlp_norm = norms[6 * l + 1].contiguous();
    layer.q_norm = opt(norms[6 * l + 2].contiguous());
    layer.k_norm = opt(norms[6 * l + 3].contiguous());
    layer.post_attn_norm = opt(norms[6 * l + 4].contiguous());
    layer.post_mlp_norm = opt(norms[6 * l + 5].contiguous());
    layer.kind = kinds[l];
    TORCH_CHECK(!(layer.kind & SLIDING) || window > 0, "a windowed layer without a window");
    for (const at::Tensor* post : {&layer.post_attn_norm, &layer.post_mlp_norm})
      TORCH_CHECK(!post->defined() || (post->scalar_type() == at::kBFloat16 && post->numel() == norms[0].numel()),
                  "bf16 norms of the hidden size expected after the attention and the MLP");
    TORCH_CHECK(layer.q_norm.defined() == layer.k_norm.defined() &&
                    (!layer.q_norm.defined() || (layer.q_norm.numel() == dim && layer.k_norm.numel() == dim &&
                                                 layer.q_norm.scalar_type() == at::kBFloat16 &&
                                                 layer.k_norm.scalar_type() == at::kBFloat16)),
                "bf16 q and k head norms of the head size expected, both or neither");
    TORCH_CHECK(layer.attn_norm.scalar_type() == at::kBFloat16 && layer.mlp_norm.scalar_type() == at::kBFloat16,
                "bf16 norm weights expected");
    Product* parts[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int p = 0; p < 4; ++p) {
      Product& product = *parts[p];
      if (next_int()) product.dense = next_tensor();
      const int64_t segments = next_int();
      TORCH_CHECK(segments > 0 || product.dense.defined(), "a product without weights");
      for (int64_t i = 0; i < segments; ++i) {
        Segment segment;
        const int64_t terms = next_int();
        if (terms < 0) {
          const int64_t matrix = next_int();
          segment.matrix = blocks::find(matrix);
          TORCH_CHECK(segment.matrix, "no block matrix ", matrix);
        }
        if (terms == 0) segment.dense = next_tensor();
        for (int64_t j = 0; j < terms; ++j) {
          at::Tensor packed = next_tensor();
          segment.terms.emplace_back(packed, next_tensor());
        }
        product.segments.push_back(std::move(segment));
      }
      product.bias = opt(biases[l * 4 + p]);
      product.crossover = crossovers[l * 4 + p];
    }
    m.layers.push_back(std::move(layer));
  }
  TORCH_CHECK(at == layout.size() && t == tensors.size(), "more weights than the layout describes");
  return models.add(std::make_shared<const Model>(std::move(m)));
}

void forget(int64_t id) { models.forget(id); }

// Every layer for ``cols`` new columns per row (one in a decode step; more to verify drafted tokens):
// ``h`` (rows x cols, hidden) bf16 embeddings, a row's columns together -> hidden states before the
// final norm. Row r's keys and values are written at columns [col, col + cols) of each layer's
// buffer; its column c attends over columns [starts[r], c], so each column's result is bit for bit
// what a step of that column alone would give.
at::Tensor step(int64_t id, const at::Tensor& embedded, at::TensorList keys, at::TensorList values,
                const at::Tensor& starts, int64_t col, const at::Tensor& counts, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& local_cos, const at::Tensor& local_sin) {
  const std::shared_ptr<const Model> found = models.find(id);
  TORCH_CHECK(found, "no decoder ", id);
  const Model& m = *found;
  TORCH_CHECK(embedded.scalar_type() == at::kBFloat16 && embedded.dim() == 2 &&
                  embedded.size(1) == m.layers[0].attn_norm.numel(),
              "bf16 (rows, hidden) expected");
  TORCH_CHECK(keys.size() == m.layers.size() && values.size() == m.layers.size(), "a buffer per layer expected");
  const int64_t queries = embedded.size(0), rows = starts.numel();
  at::Tensor per_row = counts.numel() ? counts.to(at::kLong).contiguous() : at::Tensor();
  TORCH_CHECK(rows > 0 && (per_row.defined() ? per_row.numel() == rows && per_row.min().item<int64_t>() >= 1 &&
                                                   per_row.sum().item<int64_t>() == queries
                                             : queries % rows == 0),
              "the same number of columns per row expected, or a count per row (at least one) adding up to them");
  const Places at(rows, col, per_row.defined() ? per_row.data_ptr<int64_t>() : nullptr, queries / rows);
  at::Tensor h = embedded.contiguous().clone();
  at::Tensor c = cos.contiguous(), s = sin.contiguous(), first = starts.to(at::kLong).contiguous();
  at::Tensor lc = local_cos.numel() ? local_cos.contiguous() : c, ls = local_sin.numel() ? local_sin.contiguous() : s;
  TORCH_CHECK(c.size(0) == queries && c.size(1) <= m.dim && c.size(1) % 2 == 0 && s.sizes() == c.sizes() &&
                  lc.sizes() == c.sizes() && ls.sizes() == c.sizes() && c.scalar_type() == at::kBFloat16 &&
                  s.scalar_type() == at::kBFloat16 && lc.scalar_type() == at::kBFloat16 &&
                  ls.scalar_type() == at::kBFloat16,
              "a start column per row and bf16 rotary angles per column expected");
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(first.data_ptr<int64_t>()[r] >= 0 && first.data_ptr<int64_t>()[r] <= col, "row ", r,
                " starts after the column it writes");
  at::Tensor q = at::empty({queries, m.heads * m.dim}, embedded.options().dtype(at::kFloat));
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const Layer& layer = m.layers[l];
    at::Tensor k = keys[l], v = values[l];
    TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.scalar_type() == at::kBFloat16 &&
                    v.scalar_type() == at::kBFloat16 && k.stride(3) == 1 && v.stride(3) == 1 && k.size(0) >= rows &&
                    k.size(1) == m.kv_heads && k.size(3) == m.dim,
                "key/value buffers of the wrong shape");
    const bool sliding = layer.kind & SLIDING;
    // a buffer column per column, or (a windowed layer) a ring that holds the window of every new column at once
    TORCH_CHECK(at.end <= k.size(2) || (sliding && m.window - 1 + at.end - col <= k.size(2)),
                "key/value buffers of the wrong shape");
    at::Tensor qkv = layer.qkv(norm(h, layer.attn_norm, m.eps, m.gemma_norms)).contiguous();
    rope_and_store(qkv, sliding ? lc : c, sliding ? ls : s, m, layer, q, k, v, at);
    at::Tensor out = layer.o(attend(q, k, v, first.data_ptr<int64_t>(), at, m, sliding ? m.window : 0))
                         .contiguous();
    add_into(h, layer.post_attn_norm.defined() ? norm(out, layer.post_attn_norm, m.eps, m.gemma_norms) : out);
    out = layer.down(swiglu(layer.gate_up(norm(h, layer.mlp_norm, m.eps, m.gemma_norms)).contiguous(), m.gelu))
              .contiguous();
    add_into(h, layer.post_mlp_norm.defined() ? norm(out, layer.post_mlp_norm, m.eps, m.gemma_norms) : out);
  }
  return h;
}

// A decode step: ``cols`` new columns for every row (one; more to verify one row's drafted tokens).
at::Tensor decode(int64_t id, const at::Tensor& embedded, at::TensorList keys, at::TensorList values,
                  const at::Tensor& starts, int64_t col, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& local_cos, const at::Tensor& local_sin) {
  return step(id, embedded, keys, values, starts, col, at::Tensor(), cos, sin, local_cos, local_sin);
}

// A step of each row's own number of columns, ``counts`` (drafts beyond one row: its last token and its drafts, or
// the last token alone): row r's columns at [col, col + counts[r]), each still bit for bit a step of it alone.
at::Tensor decode_ragged(int64_t id, const at::Tensor& embedded, at::TensorList keys, at::TensorList values,
                         const at::Tensor& starts, int64_t col, const at::Tensor& counts, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& local_cos, const at::Tensor& local_sin) {
  TORCH_CHECK(counts.numel() == starts.numel(), "a count per row expected");
  return step(id, embedded, keys, values, starts, col, counts, cos, sin, local_cos, local_sin);
}

// Move row rows[i]'s columns [firsts[i], lasts[i]) right by by[i] in every layer's keys and values (after a ragged
// step, the rows that kept fewer columns: every row's tokens end at the buffer's last column again). A layer whose
// ``rings`` entry is not 0 holds column c at slot c mod that (a windowed layer's ring): there only the columns the
// ring still holds after the move are moved, slot to slot, the last first (a destination slot is never a source
// slot still to be read: that would be a column a whole ring before the ones kept).
void shift(at::TensorList keys, at::TensorList values, at::IntArrayRef rings, at::IntArrayRef rows,
           at::IntArrayRef firsts, at::IntArrayRef lasts, at::IntArrayRef by) {
  TORCH_CHECK(rows.size() == firsts.size() && rows.size() == lasts.size() && rows.size() == by.size(),
              "a first column, a last and a shift per row expected");
  TORCH_CHECK(rings.size() == keys.size() && values.size() == keys.size(), "a ring size per layer expected");
  for (const at::TensorList& store : {keys, values}) {
    for (size_t l = 0; l < store.size(); ++l) {
      const at::Tensor& t = store[l];
      TORCH_CHECK(t.dim() == 4 && t.scalar_type() == at::kBFloat16 && t.stride(3) == 1 && t.stride(2) == t.size(3),
                  "bf16 (rows, heads, columns, dim) buffers expected");
      const int64_t ring = rings[l];
      TORCH_CHECK(ring == 0 || ring == t.size(2), "a ring of its buffer's columns expected");
      const auto st = t.strides();
      for (size_t i = 0; i < rows.size(); ++i) {
        TORCH_CHECK(rows[i] >= 0 && rows[i] < t.size(0) && 0 <= firsts[i] && firsts[i] <= lasts[i] && by[i] >= 0 &&
                        (ring || lasts[i] + by[i] <= t.size(2)),
                    "a shift out of the buffer");
        for (int64_t h = 0; h < t.size(1); ++h) {
          uint16_t* base = bits(t) + rows[i] * st[0] + h * st[1];
          if (!ring) {
            std::memmove(base + (firsts[i] + by[i]) * st[2], base + firsts[i] * st[2],
                         (lasts[i] - firsts[i]) * st[2] * sizeof(uint16_t));
            continue;
          }
          if (by[i] == 0) continue;
          for (int64_t c = lasts[i] - 1; c >= std::max(firsts[i], lasts[i] + by[i] - ring); --c)
            std::memcpy(base + ((c + by[i]) % ring) * st[2], base + (c % ring) * st[2], st[2] * sizeof(uint16_t));
        }
      }
    }
  }
}

// The first index of the largest of n floats.
inline int64_t argmax(const float* x, int64_t n) noexcept {
  float part[LANES];
  std::fill(part, part + LANES, -INFINITY);
  const int64_t body = n - n % LANES;
  for (int64_t i = 0; i < body; i += LANES)
    for (int64_t l = 0; l < LANES; ++l) part[l] = x[i + l] > part[l] ? x[i + l] : part[l];
  float top = -INFINITY;
  for (int64_t l = 0; l < LANES; ++l) top = std::max(top, part[l]);
  for (int64_t i = body; i < n; ++i) top = std::max(top, x[i]);
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == top) return i;
  return 0;  // all NaN
}

// w[i] = e^((x[i] - top) * inv) for n floats, 0 where x[i] is -inf (a grammar's mask: never drawn) or NaN; their sum
// (in LANES partial sums).
float weights(const float* __restrict x, float* __restrict w, int64_t n, float top, float inv) noexcept {
  for (int64_t i = 0; i < n; ++i) w[i] = exp_neg((x[i] - top) * inv);
  for (int64_t i = 0; i < n; ++i) w[i] = x[i] > -INFINITY && w[i] == w[i] ? w[i] : 0.f;  // -inf (masked), NaN: 0
  float part[LANES] = {};
  const int64_t body = n - n % LANES;
  for (int64_t i = 0; i < body; i += LANES)
    for (int64_t l = 0; l < LANES; ++l) part[l] += w[i + l];
  float total = 0.f;
  for (int64_t l = 0; l < LANES; ++l) total += part[l];
  for (int64_t i = body; i < n; ++i) total += w[i];
  return total;
}

// A weight's bin: its float's bits (monotonic for weights in [0, 1]) without the low BIN_SHIFT bits, so a bin
// spans 1/64 of an octave (1.1 %); weight 1 (the most likely token) falls in bin 0x3F800000 >> 17 = 8128, weight
// 0 (a masked token) alone in bin 0 (the least weight exp_neg gives, e^-87, is a normal float: bin 64 or above).
constexpr int BIN_SHIFT = 17;
constexpr int64_t BINS = (0x3F800000 >> BIN_SHIFT) + 1;

inline uint32_t bin_of(float w) noexcept {
  return std::min<uint32_t>(std::bit_cast<uint32_t>(w) >> BIN_SHIFT, BINS - 1);
}

// One row's kept tokens as a selection over a histogram of its weights, never a sort of the vocabulary: the
// bins, most likely first, give each filter's cut up to one bin; only the tokens of a bin that holds a cut (or
// the draw) are sorted (by weight, then token id). Every position below is in that order: the most likely
// token first.
struct Row {
  const float* w = nullptr;
  int64_t vocab = 0;
  std::vector<int32_t> count;
  std::vector<double> mass;
  std::vector<uint16_t> bins;  // each token's
  std::vector<std::pair<float, int64_t>> members;  // the sorted tokens of bin ``sorted_bin``
  int64_t sorted_bin = -1;

  Row() : count(BINS), mass(BINS) {}

  void histogram(const float* weights, int64_t n) {
    w = weights, vocab = n, sorted_bin = -1;
    std::fill(count.begin(), count.end(), 0);
    std::fill(mass.begin(), mass.end(), 0.0);
    // no branch: a zero weight (a masked token) lands in bin 0, never read; the bins computed ahead (vectorized)
    bins.resize(n);
    for (int64_t i = 0; i < n; ++i) bins[i] = static_cast<uint16_t>(bin_of(w[i]));
    for (int64_t i = 0; i < n; ++i) {
      ++count[bins[i]];
      mass[bins[i]] += w[i];
    }
  }

  const std::vector<std::pair<float, int64_t>>& sorted(int64_t b) {
    if (b != sorted_bin) {
      members.clear();
      for (int64_t i = 0; i < vocab; ++i)
        if (bins[i] == b) members.emplace_back(w[i], i);
      std::sort(members.begin(), members.end(), [](const auto& a, const auto& c) {
        return a.first > c.first || (a.first == c.first && a.second < c.second);
      });
      sorted_bin = b;
    }
    return members;
  }

  // The mass of the first ``n`` tokens.
  double mass_of_first(int64_t n) {
    double before = 0.0;
    int64_t seen = 0;
    for (int64_t b = BINS - 1; b > 0 && seen < n; --b) {
      if (!count[b]) continue;
      if (seen + count[b] <= n) {
        seen += count[b], before += mass[b];
        continue;
      }
      for (const auto& [value, token] : sorted(b)) {
        if (seen == n) break;
        before += value, ++seen;
      }
    }
    return before;
  }

  // How many tokens, most likely first, have less than ``limit`` of mass before them (at most ``most``).
  int64_t below_mass(double limit, int64_t most) {
    double before = 0.0;
    int64_t seen = 0;
    for (int64_t b = BINS - 1; b > 0 && seen < most; --b) {
      if (!count[b]) continue;
      if (before >= limit) break;
      if (before + mass[b] < limit) {  // all of the bin, and the token after it too (it starts below limit)
        seen += count[b], before += mass[b];
        continue;
      }
      for (const auto& [value, token] : sorted(b)) {
        if (before >= limit || seen == most) break;
        before += value, ++seen;
      }
    }
    return std::min(seen, most);
  }

  // The token at mass ``target`` among the first ``n``: the first whose running sum exceeds it.
  int64_t at_mass(double target, int64_t n) {
    double cdf = 0.0;
    int64_t seen = 0, last = -1;
    for (int64_t b = BINS - 1; b > 0 && seen < n; --b) {
      if (!count[b]) continue;
      if (seen + count[b] <= n && cdf + mass[b] <= target) {
        seen += count[b], cdf += mass[b];
        continue;
      }
      for (const auto& [value, token] : sorted(b)) {
        if (seen == n) break;
        cdf += value, ++seen, last = token;
        if (cdf > target) return token;
      }
    }
    return last;  // the draw past the sum's rounding: the last kept token
  }
};

// One row's draw: temperature <= 0 is argmax; else weights over the whole vocabulary at that temperature,
// then top-k, top-p over what top-k kept, min-p against the most likely, and the token where ``want`` falls in
// the kept weights (most likely first; with none of the three filters, in vocabulary order). Each filter keeps
// a prefix of the tokens by weight, so what is kept is the shortest of the three prefixes (at least one token).
int64_t draw(const float* x, int64_t vocab, float temp, int64_t kk, float p_cut, float m_cut, float want,
             std::vector<float>& w, Row& row) {
  const int64_t best = argmax(x, vocab);
  if (!(temp > 0.f) || x[best] == -INFINITY) return best;
  const float total = weights(x, w.data(), vocab, x[best], 1.f / temp);
  if (kk <= 0 && p_cut >= 1.f && m_cut <= 0.f) {  // no filter: the whole vocabulary, in its order
    const float target = want * total;
    float cdf = 0.f;
    int64_t last = best;
    for (int64_t i = 0; i < vocab; ++i) {
      if (w[i] <= 0.f) continue;
      cdf += w[i], last = i;
      if (cdf > target) return i;
    }
    return last;
  }
  row.histogram(w.data(), vocab);
  int64_t positive = 0;
  for (int64_t b = 1; b < BINS; ++b) positive += row.count[b];
  int64_t kept = kk > 0 ? std::min(kk, positive) : positive;
  const double base = kk > 0 && kk < positive ? row.mass_of_first(kept) : static_cast<double>(total);
  if (p_cut < 1.f) kept = std::min(kept, row.below_mass(static_cast<double>(p_cut) * base, kept));
  if (m_cut > 0.f) {
    int64_t above = 0;  // the most likely token weighs 1: min-p keeps the weights of at least min_p
    for (int64_t i = 0; i < vocab; ++i) above += w[i] >= m_cut;
    kept = std::min(kept, above);
  }
  kept = std::max<int64_t>(kept, 1);
  const double mass = kept < positive ? row.mass_of_first(kept) : static_cast<double>(total);
  const int64_t chosen = row.at_mass(static_cast<double>(want) * mass, kept);
  return chosen < 0 ? best : chosen;
}

// Next token of each row of ``logits`` (rows, vocab), as chat/engine/model/sampling.py draws it (``draw``), given
// each row's uniform number ``u``; a row's token does not depend on the others. Rows one after the other: on a
// busy 2-core box a team of threads waits for a descheduled member (8 rows took 6 ms in parallel, 2.6 alone).
at::Tensor sample(const at::Tensor& logits_in, const at::Tensor& temperature, const at::Tensor& top_k,
                  const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u) {
  const at::Tensor logits = logits_in.to(at::kFloat).contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const at::Tensor t = temperature.to(at::kFloat).contiguous(), k = top_k.to(at::kLong).contiguous(),
                   tp = top_p.to(at::kFloat).contiguous(), mp = min_p.to(at::kFloat).contiguous(),
                   draws = u.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows}, at::kLong);
  int64_t* chosen = out.data_ptr<int64_t>();
  std::vector<float> w(vocab);
  Row row;
  for (int64_t r = 0; r < rows; ++r)
    chosen[r] = draw(logits.data_ptr<float>() + r * vocab, vocab, t.data_ptr<float>()[r], k.data_ptr<int64_t>()[r],
                     tp.data_ptr<float>()[r], mp.data_ptr<float>()[r], draws.data_ptr<float>()[r], w, row);
  return out;
}

}  // namespace

TORCH_LIBRARY(chat_native, lib) {
  lib.def("keep(Tensor[] norms, Tensor[] tensors, int[] layout, Tensor[] biases, int[] crossovers, int[] kinds, "
          "int heads, int kv_heads, int dim, float eps, int window, int style) -> int", &keep);
  lib.def("forget(int id) -> ()", &forget);
  lib.def("decode(int id, Tensor embedded, Tensor[] keys, Tensor[] values, Tensor starts, int col, Tensor cos, "
          "Tensor sin, Tensor local_cos, Tensor local_sin) -> Tensor", &decode);
  lib.def("decode_ragged(int id, Tensor embedded, Tensor[] keys, Tensor[] values, Tensor starts, int col, "
          "Tensor counts, Tensor cos, Tensor sin, Tensor local_cos, Tensor local_sin) -> Tensor", &decode_ragged);
  lib.def("shift(Tensor[] keys, Tensor[] values, int[] rings, int[] rows, int[] firsts, int[] lasts, int[] by) -> ()",
          &shift);
  lib.def("sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor u) -> Tensor",
          &sample);
}
