#pragma once
// The full cache's attention of one sequence, recorded in a teacher-forced
// pass, for the look-ahead oracle (docs/fidelity.md, "Oracles"): it evicts
// the cached token that the next T queries of the full cache attend to
// least. The oracle lives in the evaluation, not in the library: no engine
// knows its future queries.
//
// Stored as running column sums in double, cum(u, p) = sum over rows
// u' <= u of a(u', p), where a(u', p) is the probability query u' put on key
// p summed over the KV head's query group; the mass over rows (t, t + T] is
// then one difference, exact enough in double, instead of T reads.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace tinyllm {

class attention_record {
 public:
  attention_record(std::int32_t layers, std::int32_t kv_heads, std::int32_t length)
      : layers_(layers), heads_(kv_heads), length_(length),
        data_(std::size_t(layers) * std::size_t(kv_heads) * triangle(length), 0.0) {}

  std::int32_t length() const noexcept { return length_; }
  /// Rows written so far (the highest recorded query position + 1).
  std::int32_t rows() const noexcept { return rows_; }

  /// Records query position u of (layer, KV head): a[p] for p in [0, u].
  /// Rows of one (layer, head) must come in order u = 0, 1, ...
  void write_row(std::int32_t layer, std::int32_t head, std::int32_t u, const float* a) {
    if (u < 0 || u >= length_)
      throw std::out_of_range("attention_record: row " + std::to_string(u) + " outside [0, " +
                              std::to_string(length_) + ")");
    double* row = at(layer, head, u);
    const double* prev = u > 0 ? at(layer, head, u - 1) : nullptr;
    for (std::int32_t p = 0; p < u; ++p) row[p] = prev[p] + double(a[p]);
    row[u] = double(a[u]);
    rows_ = std::max(rows_, u + 1);
  }

  /// Attention mass on position p over query rows (t, t + horizon] that were
  /// recorded (every later recorded row when horizon is 0); p <= t.
  float future_mass(std::int32_t layer, std::int32_t head, std::int32_t p, std::int32_t t,
                    std::int32_t horizon) const {
    const std::int32_t last = horizon > 0 ? std::min(t + horizon, rows_ - 1) : rows_ - 1;
    if (last <= t || p > t) return 0.0f;
    return static_cast<float>(at(layer, head, last)[p] - at(layer, head, t)[p]);
  }

 private:
  static std::size_t triangle(std::int32_t n) noexcept { return std::size_t(n) * std::size_t(n + 1) / 2; }
  double* at(std::int32_t layer, std::int32_t head, std::int32_t u) {
    return data_.data() + (std::size_t(layer) * std::size_t(heads_) + std::size_t(head)) * triangle(length_) +
           triangle(u);
  }
  const double* at(std::int32_t layer, std::int32_t head, std::int32_t u) const {
    return data_.data() + (std::size_t(layer) * std::size_t(heads_) + std::size_t(head)) * triangle(length_) +
           triangle(u);
  }

  std::int32_t layers_, heads_, length_, rows_ = 0;
  std::vector<double> data_;  // [layer][head][triangle: row u holds u + 1 values]
};

}  // namespace tinyllm
