#pragma once
// What kvevict's prompt compression reads of llama.cpp's prompt pass: its
// attention probabilities, layer by layer and ubatch by ubatch, folded as
// the pass goes (the [L][L] matrices are never kept):
//   column sums  c(q, s) <- decay * c(q, s) + p(q, row, s), row by row (h2o,
//                the decayed rules; decay 0 is TOVA's last row)
//   window rows  p(q, row, s) of the last `window` rows (SnapKV)
// llama.cpp hands each layer's softmax output, [cells][ubatch rows][query
// heads], to the evaluation callback (cb_eval) as it computes it.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ggml.h>

namespace kvevict_llama {

/// The layer of a tensor llama.cpp names "kq_soft_max-<layer>" (its non-flash
/// attention's softmax output), or -1 for any other tensor.
inline std::int32_t softmax_layer(const ggml_tensor* t) {
  static constexpr char prefix[] = "kq_soft_max-";
  if (std::strncmp(t->name, prefix, sizeof(prefix) - 1) != 0) return -1;
  return std::atoi(t->name + sizeof(prefix) - 1);
}

class prompt_attention {
 public:
  enum class fold { column_sums, window_rows };

  /// layers x q_heads over a prompt of `length` tokens; `window` rows for SnapKV.
  prompt_attention(fold what, std::int32_t layers, std::int32_t q_heads, std::int32_t length, float decay,
                   std::int32_t window)
      : what_(what), layers_(layers), q_heads_(q_heads), length_(length), decay_(decay), window_(window),
        rows_(std::size_t(layers), 0),
        data_(std::size_t(layers) * q_heads * (what == fold::window_rows ? window : 1) * length, 0.0f) {}

  /// cb_eval: asks for every layer's softmax, folds what it gets. Returns
  /// false (which stops the pass) for a tensor it cannot read.
  static bool on_tensor(ggml_tensor* t, bool ask, void* user) {
    const std::int32_t il = softmax_layer(t);
    if (il < 0) return !ask;
    if (ask) return true;
    auto* self = static_cast<prompt_attention*>(user);
    if (il >= self->layers_ || t->type != GGML_TYPE_F32 || t->ne[2] != self->q_heads_) return false;
    self->fold_ubatch(il, t);
    return true;
  }

  /// Whether every layer saw every prompt row.
  bool complete() const {
    return std::all_of(rows_.begin(), rows_.end(), [&](std::int32_t r) { return r == length_; });
  }
  /// Layer il's column sums [q_heads][length] or window rows [q_heads][window][length].
  const float* layer(std::int32_t il) const {
    return data_.data() + std::size_t(il) * q_heads_ * (what_ == fold::window_rows ? window_ : 1) * length_;
  }

 private:
  void fold_ubatch(std::int32_t il, const ggml_tensor* t) {
    const std::int32_t columns = static_cast<std::int32_t>(std::min<std::int64_t>(t->ne[0], length_));
    const std::int32_t first = rows_[std::size_t(il)];
    for (std::int64_t r = 0; r < t->ne[1] && first + r < length_; ++r) {
      const std::int32_t row = first + static_cast<std::int32_t>(r);
      for (std::int32_t q = 0; q < q_heads_; ++q) {
        const auto* p = reinterpret_cast<const float*>(static_cast<const char*>(t->data) + r * t->nb[1] + q * t->nb[2]);
        if (what_ == fold::column_sums) {
          float* c = data_.data() + (std::size_t(il) * q_heads_ + q) * length_;
          for (std::int32_t s = 0; s <= row && s < columns; ++s) c[s] = decay_ * c[s] + p[s];  // decay 1: exactly c + p
        } else if (row >= length_ - window_) {
          float* w = data_.data() + ((std::size_t(il) * q_heads_ + q) * window_ + (row - (length_ - window_))) * length_;
          std::copy_n(p, std::min(row + 1, columns), w);
        }
      }
    }
    rows_[std::size_t(il)] = first + static_cast<std::int32_t>(std::min<std::int64_t>(t->ne[1], length_ - first));
  }

  fold what_;
  std::int32_t layers_, q_heads_, length_;
  float decay_;
  std::int32_t window_;
  std::vector<std::int32_t> rows_;  // [layers]: prompt rows folded so far
  std::vector<float> data_;
};

}  // namespace kvevict_llama
