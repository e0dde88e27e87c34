// Matrices kept as GGUF-style blocks of 32 weights, multiplied with 8-bit activations (blocks.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace blocks {

// How a block's 32 weights are stored (each with a scale s, and for the unsigned kinds a min z: w = s * q + z).
enum Kind : int64_t {
  U4 = 0,  // 16 bytes: byte i holds weight i (low nibble) and weight i + 16 (high nibble), q in 0..15
  U5 = 1,  // as U4, plus 4 bytes of fifth bits (bit i: weight i's), q in 0..31
  S8 = 2,  // 32 signed bytes, w = s * q (no min)
  U8 = 3,  // 32 bytes q + 128, w = s * (q - 128): the signed bytes without their sign trick (VNNI builds only)
  U6 = 4,  // as U4, plus 8 bytes of the weights' high 2 bits, q in 0..63, w = s * (q - 32) per 16 (Q6_K)
};

// How the block scales (and mins) are stored: a float per block (f16 where the file's are, else float32), or as
// K-quants store them, a byte per block (signed for the 8-bit kinds) times an f16 per super-block of
// ``per_super`` blocks: s = d * sc, z = -(dmin * mn) (the file's numbers unchanged: no wider than the file).
enum Scaling : int64_t { F16 = 0, F32 = 1, SUPER = 2 };

struct Matrix {
  int64_t kind = U4, rows = 0, cols = 0, blocks = 0;
  int64_t sub = 1;      // scales per 32 weights: 1, or 2 (S8 with 16-weight sub-blocks, Q6_K)
  int64_t scaling = F16;
  int64_t per_super = 0;  // SUPER: blocks a super-block
  float centre = 0.f;   // U4/U5 without stored mins: z = -centre * s
  at::Tensor qs, qh, scales, mins;  // (rows, blocks, 16 | 32) u8; (rows, blocks, 4 | 8) u8; (rows, blocks * sub); (rows, blocks)
  at::Tensor dsuper, msuper;        // SUPER: (rows, blocks / per_super) f16 d and dmin (none for S8/U8)
};

// y = x W^T for bf16 x (rows, cols) -> bf16 (rows, W.rows). Each row of x is quantized to 8 bits per 32
// values (scale max|x| / 127); a row's result does not depend on the other rows.
at::Tensor multiply(const Matrix& w, const at::Tensor& x);

std::shared_ptr<const Matrix> find(int64_t id);

// What the Python side holds by an id (torch ops take integers): kept until forgotten, and shared with whoever
// uses it meanwhile (a forget during a product or a step frees nothing that is in use).
template <typename T>
class Kept {
 public:
  int64_t add(std::shared_ptr<const T> value) {
    std::lock_guard<std::mutex> guard(lock_);
    const int64_t id = items_.empty() ? 1 : items_.rbegin()->first + 1;
    items_.emplace(id, std::move(value));
    return id;
  }
  void forget(int64_t id) {
    std::lock_guard<std::mutex> guard(lock_);
    items_.erase(id);
  }
  std::shared_ptr<const T> find(int64_t id) const {
    std::lock_guard<std::mutex> guard(lock_);
    auto it = items_.find(id);
    return it == items_.end() ? nullptr : it->second;
  }

 private:
  mutable std::mutex lock_;
  std::map<int64_t, std::shared_ptr<const T>> items_;
};

}  // namespace blocks
