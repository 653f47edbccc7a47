#pragma once
// The canonical order of a prefill column sum (docs/semantics.md, "Scores":
// prefill). The prefill score of column p of query head q is
//
//   sum over rows i in [p, L) of P[q][i][p]
//
// and a float sum's bits depend on the order of its additions. So that a GPU
// can split the rows of a column across threads and still give the host's
// bits, the order is fixed here, once, for every backend:
//
//   - rows go in chunks of 64 aligned at multiples of 64: chunk c is rows
//     [64c, 64c + 64) intersected with [p, L);
//   - each chunk is summed left to right in float, starting from its first
//     row (the chunk partial);
//   - the partials are added left to right in ascending c, starting from the
//     first non-empty chunk's partial (chunk p / 64).
//
// Under a score decay (h2o's decay, TOVA) the summed value of row i is
// decayed_row(decay, L, i, P[q][i][p]): the weighting changes the values,
// never the order.
//
// For L <= 64 this is the plain left-to-right sum. (Starting from the first
// row rather than from +0 differs only in the sign of an all-zero sum; the
// GQA fold that follows, fold_group, starts from +0 and erases it.)
//
// Every addition is detail::add (never fused into an FMA), and the functions
// are KVEVICT_HOST_DEVICE, so the host loops and the CUDA kernels run the
// same code. They sum what value(i) returns and validate nothing: callers
// check each element as they always did (finite, a non-negative probability),
// inside value() or around it.
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/reproducible_math.hpp"

namespace kvevict {

/// Rows per chunk of the canonical column-sum order.
inline constexpr std::int32_t prefill_chunk_rows = 64;

/// The first chunk holding a row of column p (rows i >= p).
KVEVICT_HOST_DEVICE constexpr std::int32_t prefill_first_chunk(std::int32_t p) noexcept {
  return p / prefill_chunk_rows;
}

/// Chunks of a prompt of `length` rows: chunk indices run below this.
KVEVICT_HOST_DEVICE constexpr std::int32_t prefill_chunks(std::int32_t length) noexcept {
  return (length + prefill_chunk_rows - 1) / prefill_chunk_rows;
}

/// Rows [begin, end) of chunk `chunk` for column p of a prompt of `length`
/// rows; empty (begin >= end) when the chunk holds no row of the column.
struct prefill_chunk_range {
  std::int32_t begin = 0;
  std::int32_t end = 0;

  KVEVICT_HOST_DEVICE prefill_chunk_range(std::int32_t p, std::int32_t chunk, std::int32_t length) noexcept {
    const std::int32_t first = chunk * prefill_chunk_rows;
    begin = first > p ? first : p;
    end = first + prefill_chunk_rows < length ? first + prefill_chunk_rows : length;
  }
  KVEVICT_HOST_DEVICE bool empty() const noexcept { return begin >= end; }
};

/// decay^n for n >= 0 by binary exponentiation (square the base, multiply
/// the result at each set bit of n, low bits first), every product rounded
/// to float: the same bits on every backend. 1 for n = 0 (0^0 included).
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline float decay_power(float decay, std::int32_t n) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  float result = 1.0f, base = decay;
  for (; n > 0; n >>= 1) {
    if (n & 1) result = detail::mul(result, base);
    if (n > 1) base = detail::mul(base, base);
  }
  return result;
}

/// Row i's weighting, its power computed once (for a loop over the row's
/// columns): weight = decay_power(decay, length - 1 - i); decay 1 leaves x.
struct row_decay {
  float weight = 1.0f;
  bool weighted = false;
  KVEVICT_HOST_DEVICE row_decay(float decay, std::int32_t length, std::int32_t i) noexcept
      : weight(decay == 1.0f ? 1.0f : decay_power(decay, length - 1 - i)), weighted(decay != 1.0f) {}
  KVEVICT_HOST_DEVICE float operator()(float x) const noexcept { return weighted ? detail::mul(weight, x) : x; }
};

/// Prompt row i's value x as it enters its column sum under a score decay
/// (updated_score): weighted by decay^(length - 1 - i), so that the newest
/// row counts fully and an older one as many decays as decode steps would
/// have applied. decay = 1 (H2O) returns x itself; decay = 0 (TOVA) keeps
/// the last row alone (every other row becomes a zero).
KVEVICT_HOST_DEVICE inline float decayed_row(float decay, std::int32_t length, std::int32_t i, float x) noexcept {
  return row_decay(decay, length, i)(x);
}

/// A running sum in the canonical order: the first value starts it, every
/// later one is added. Kernels that stage the rows of a chunk in pieces
/// feed one of these row by row, in ascending rows; prefill_chunk_partial
/// below is the same accumulator over one loop.
struct prefill_accumulator {
  float sum = 0.0f;
  bool started = false;

  KVEVICT_HOST_DEVICE void add(float x) noexcept {
    sum = started ? detail::add(sum, x) : x;
    started = true;
  }
};

/// The partial of chunk `chunk` for column p: value(i) over the chunk's rows
/// of the column (prefill_chunk_range), left to right. The range must not be
/// empty.
KVEVICT_EXEC_CHECK_DISABLE
template <class Value>
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline float prefill_chunk_partial(std::int32_t p, std::int32_t chunk,
                                                                            std::int32_t length, Value value) {
  KVEVICT_FP_CONTRACT_OFF
  const prefill_chunk_range rows(p, chunk, length);
  prefill_accumulator acc;
  for (std::int32_t i = rows.begin; i < rows.end; ++i) acc.add(value(i));
  return acc.sum;
}

/// The column total from its chunk partials: partial(c) for c from
/// prefill_first_chunk(p) to prefill_chunks(length) - 1, added in ascending
/// c. Requires 0 <= p < length.
KVEVICT_EXEC_CHECK_DISABLE
template <class Partial>
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline float prefill_combine_chunks(std::int32_t p, std::int32_t length,
                                                                             Partial partial) {
  KVEVICT_FP_CONTRACT_OFF
  const std::int32_t last = prefill_chunks(length);
  prefill_accumulator acc;
  for (std::int32_t c = prefill_first_chunk(p); c < last; ++c) acc.add(partial(c));
  return acc.sum;
}

/// Column p's sum over rows [p, length) of value(i) in the canonical order:
/// what a per-sequence prefill computes for one (query head, column). It
/// calls value(i) once per row in ascending i, so validation inside value()
/// meets the elements in the order a plain loop would. Requires
/// 0 <= p < length.
KVEVICT_EXEC_CHECK_DISABLE
template <class Value>
KVEVICT_HOST_DEVICE inline float prefill_column_sum(std::int32_t p, std::int32_t length, Value value) {
  return prefill_combine_chunks(p, length,
                                [&](std::int32_t chunk) { return prefill_chunk_partial(p, chunk, length, value); });
}

}  // namespace kvevict
