#pragma once
// Matrix products of stored (quantised) weights with a batch of activations.
// Each weight row is decoded once per call and used for every sequence of the
// batch, so a decode step reads the weights once whatever the batch size.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "tinyllm/kernels.hpp"
#include "tinyllm/quant.hpp"
#include "tinyllm/quant_dot.hpp"

namespace tinyllm {

/// A [rows][cols] weight matrix in its stored format (ggml: cols contiguous).
struct weight_matrix {
  const std::uint8_t* data = nullptr;
  ggml_type type = ggml_type::f32;
  std::int64_t rows = 0, cols = 0;
  std::size_t row_stride = 0;  ///< bytes per row

  void dequantize(std::int64_t r, float* out) const { dequantize_row(type, data + std::size_t(r) * row_stride, out, cols); }
};

/// Threads pay off only above some work per call; tiny matrices (tests) would
/// spend their time in barriers.
inline bool worth_threads(const weight_matrix& w, std::int32_t batch) noexcept {
  return w.rows * w.cols * std::int64_t{batch} >= (std::int64_t{1} << 18);
}

/// y[b][r] = sum_c w[r][c] * x[b][c] for b < batch. x: [batch][cols], y: [batch][rows].
/// Rows are split across OpenMP threads; each row is dequantised once. A
/// sequence's result does not depend on the batch it is in (dot4 == dot).
inline void matmul(const weight_matrix& w, const float* x, std::int32_t batch, float* y) {
  std::exception_ptr failure;
#pragma omp parallel if (worth_threads(w, batch))
  {
    std::vector<float> row;
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < w.rows; ++r) {
      try {  // no exception may leave the parallel region
        row.resize(static_cast<std::size_t>(w.cols));
        w.dequantize(r, row.data());
      } catch (...) {
#pragma omp critical
        failure = std::current_exception();
        continue;
      }
      std::int32_t b = 0;
      for (float out[4]; b + 4 <= batch; b += 4) {
        dot4(row.data(), x + std::size_t(b) * w.cols, w.cols, out);
        for (int j = 0; j < 4; ++j) y[std::size_t(b + j) * w.rows + r] = out[j];
      }
      for (; b < batch; ++b) y[std::size_t(b) * w.rows + r] = dot(row.data(), x + std::size_t(b) * w.cols, w.cols);
    }
  }
  if (failure) std::rethrow_exception(failure);
}

/// y[b][r] = w[r] . x[b] with activations already quantised, x: [batch][cols / 32]
/// blocks (w must be Q4_0, Q4_1 or Q8_0; see quant_dot.hpp).
inline void matmul_q8(const weight_matrix& w, const q8_activations* x, std::int32_t batch, float* y) {
  // checked here, so that dot_q8 cannot throw inside the parallel region
  if (!rounds_activations(w.type)) throw format_error(std::string("matmul_q8: ") + type_name(w.type) + " weights");
  const std::int64_t blocks = w.cols / 32;
#pragma omp parallel for schedule(static) if (worth_threads(w, batch))
  for (std::int64_t r = 0; r < w.rows; ++r)
    for (std::int32_t b = 0; b < batch; ++b)
      y[std::size_t(b) * w.rows + r] = dot_q8(w.type, w.data + std::size_t(r) * w.row_stride, x + b * blocks, w.cols);
}

}  // namespace tinyllm
