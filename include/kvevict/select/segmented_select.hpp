#pragma once
// Segmented selection on the host: the k highest or lowest (score, position)
// keys of every segment (the problem: select/segments.hpp).
//
// Per segment, a radix select finds the threshold of the k lowest 64-bit keys
// (top-k selects on complemented keys), then one pass in index order emits
// the selected indices, so among identical keys the lower index is taken
// first for free. The radix select reads digits MSB-first; after the first
// pass only the keys in the chosen bin are kept (compacted), so later passes
// touch a few percent of the segment, and it stops as soon as the whole bin
// is needed. That is O(n) with about three sequential passes over the
// segment, where std::nth_element does several passes of data-dependent
// branches. Explicit positions then need the k indices reordered by position:
// a stable LSD radix sort on the position alone keeps ties in index order.
//
// Like CUB, the caller provides the workspace (two-phase: ask for the bytes,
// then call); nothing is allocated except by the convenience overload.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "kvevict/error.hpp"
#include "kvevict/select/select_checks.hpp"
#include "kvevict/select/segments.hpp"

namespace kvevict {
namespace detail {

// 11-bit digits: six passes cover 64 bits and the 8 KiB histogram stays in L1.
constexpr int select_radix_bits = 11;
// The pivot sample: one key in select_sample_divisor, at most
// select_sample_max, and a band of select_sample_sigmas standard deviations
// around the expected rank of the k-th key.
constexpr std::int32_t select_sample_divisor = 64;
constexpr std::int32_t select_sample_max = 2048;
constexpr double select_sample_sigmas = 3.0;
constexpr std::size_t select_align = 64;
// Below this length, sampling costs more than the histogram pass it saves.
constexpr std::int32_t select_sample_min_length = 2048;
// Keys are made in blocks of this many, in a loop of their own that the
// compiler vectorises, then consumed by a scalar loop.
constexpr std::int32_t select_block = 256;

// The workspace: two arrays of n words (stored keys, candidate keys) and two
// of n indices (selected, candidates), plus slack to align them to a cache
// line wherever the caller's bytes start.
template <class Keys>
std::size_t select_workspace_bytes(const Keys& keys) {
  const std::size_t n = keys.max_length > 0 ? static_cast<std::size_t>(keys.max_length) : 0;
  return select_align - 1 + n * (2 * sizeof(std::uint64_t) + 2 * sizeof(std::int32_t));
}

// score_order_key without branches (scores of both signs mix unpredictably)
// and in another, cheaper encoding of the same order: sign-magnitude to
// offset binary, -0 and +0 alike; NaN lowest.
inline std::uint32_t score_order_key_branchless(float score) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &score, sizeof bits);
  const std::uint32_t neg = 0u - (bits >> 31), magnitude = bits & 0x7FFFFFFFu;
  const std::uint32_t key = ((magnitude ^ neg) - neg) + 0x80000000u;
  return key & (0u - static_cast<std::uint32_t>(magnitude <= 0x7F800000u));
}

// One segment's keys, as the selection reads them: key(j), the 64-bit key,
// and coarse(j), its top bits (key >> coarse_shift), cheap to make in bulk.
// Scores: the (score, position) keys of segment_set, made on the fly.
template <bool ExplicitPositions>
struct score_row {
  using coarse_type = std::uint32_t;
  static constexpr int coarse_shift = 32;
  const float* scores;
  const std::int32_t* positions;
  std::uint32_t flip;  // all ones for select_end::top: the key's complement
  coarse_type coarse(std::int32_t j) const noexcept { return score_order_key_branchless(scores[j]) ^ flip; }
  std::uint64_t key(std::int32_t j) const noexcept {
    const std::uint32_t pos = static_cast<std::uint32_t>(ExplicitPositions ? positions[j] : j);
    return (std::uint64_t{coarse(j)} << 32) | (pos ^ flip);
  }
};

// Any other key source: its keys made once, into the workspace.
struct stored_row {
  using coarse_type = std::uint64_t;
  static constexpr int coarse_shift = 0;
  const std::uint64_t* keys;
  coarse_type coarse(std::int32_t j) const noexcept { return keys[j]; }
  std::uint64_t key(std::int32_t j) const noexcept { return keys[j]; }
};

// Makes the coarse keys of block [j0, j0 + m) into buf and returns m, in a
// loop of its own that the compiler vectorises; callers consume them in a
// scalar loop whose counters stay in registers.
template <class Row>
std::int32_t coarse_block(const Row& row, std::int32_t j0, std::int32_t n, typename Row::coarse_type* buf) {
  const std::int32_t m = std::min(select_block, n - j0);
  if (m == select_block)  // a constant trip count vectorises even at -O2
    for (std::int32_t t = 0; t < select_block; ++t) buf[t] = row.coarse(j0 + t);
  else
    for (std::int32_t t = 0; t < m; ++t) buf[t] = row.coarse(j0 + t);
  return m;
}

// The bin holding the need-th (1-based) key of the histogram; need becomes
// the rank within that bin.
inline std::uint32_t select_bin(const std::uint32_t* hist, std::uint32_t& need) noexcept {
  std::uint32_t b = 0;
  while (hist[b] < need) need -= hist[b++];
  return b;
}

// A window [lo, hi] of coarse keys around the k-th lowest key, from a
// systematic sample (in sample[0, S)), 3 sigma of a sample quantile wide on
// either side, so that it nearly always holds the k-th key.
template <class Row>
void sample_window(const Row& row, std::int32_t n, std::int32_t k, typename Row::coarse_type* sample,
                   typename Row::coarse_type& lo, typename Row::coarse_type& hi) {
  const std::int32_t size = std::clamp(n / select_sample_divisor, std::int32_t{32}, select_sample_max);
  for (std::int32_t t = 0; t < size; ++t)
    sample[t] = row.coarse(static_cast<std::int32_t>((2 * std::int64_t{t} + 1) * n / (2 * std::int64_t{size})));
  const double p = double(k) / n, mid = p * size, margin = select_sample_sigmas * std::sqrt(size * p * (1 - p)) + 2;
  const auto r_lo = static_cast<std::int32_t>(std::floor(mid - margin)) - 1;
  const auto r_hi = static_cast<std::int32_t>(std::ceil(mid + margin));
  lo = 0;
  hi = ~typename Row::coarse_type{0};
  std::int32_t end = size;
  if (r_hi < size) {
    std::nth_element(sample, sample + r_hi, sample + size);
    hi = sample[r_hi];
    end = r_hi;
  }
  if (r_lo >= 0) {
    std::nth_element(sample, sample + r_lo, sample + end);
    lo = sample[r_lo];
  }
}

// The window of the top digit's bin holding the k-th lowest key (0 < k < n);
// when that whole bin goes, an empty one just above it.
template <class Row>
void histogram_window(const Row& row, std::int32_t n, std::int32_t k, std::uint32_t* hist,
                      typename Row::coarse_type& lo, typename Row::coarse_type& hi) {
  using C = typename Row::coarse_type;
  constexpr int shift = 8 * sizeof(C) - select_radix_bits;
  std::fill_n(hist, std::size_t(1) << select_radix_bits, 0u);
  C buf[select_block];
  for (std::int32_t j0 = 0; j0 < n; j0 += select_block)
    for (std::int32_t t = 0, m = coarse_block(row, j0, n, buf); t < m; ++t) ++hist[buf[t] >> shift];
  std::uint32_t need = static_cast<std::uint32_t>(k);
  const C b = select_bin(hist, need);
  const bool whole = hist[b] == need;  // then b < 2^11 - 1, as some key lies above
  lo = static_cast<C>((b + whole) << shift);
  hi = whole ? lo : static_cast<C>(lo | (~C{0} >> select_radix_bits));
}

struct select_threshold {
  std::uint64_t key;    // every key below it goes,
  std::uint32_t equal;  // and the first `equal` keys equal to it, in index order
};

// The threshold of the `need` lowest of keys[0, m) (0 < need < m), which
// share the bits above `shift` (prefix), by radix select MSB-first: each pass
// takes the next digit and keeps only its chosen bin (compacted in place),
// so the passes shrink fast; it stops once the whole bin goes or the digits
// run out.
inline select_threshold radix_threshold(std::uint64_t* keys, std::int32_t m, std::uint32_t* hist, std::uint64_t prefix,
                                        int shift, std::uint32_t need) noexcept {
  while (shift > 0) {
    const int bits = std::min(select_radix_bits, shift);
    shift -= bits;
    const std::uint32_t digit_mask = (1u << bits) - 1u;
    std::fill_n(hist, std::size_t(1) << bits, 0u);
    for (std::int32_t t = 0; t < m; ++t) ++hist[static_cast<std::uint32_t>(keys[t] >> shift) & digit_mask];
    const std::uint32_t d = select_bin(hist, need);
    const auto in_bin = static_cast<std::int32_t>(hist[d]);
    prefix = (prefix << bits) | d;
    if (in_bin == static_cast<std::int32_t>(need)) break;  // the whole bin goes
    if (in_bin == m) continue;                             // one bin (tied digits): nothing to drop
    std::int32_t c = 0;
    for (std::int32_t t = 0; t < m; ++t) {
      const std::uint64_t x = keys[t];
      keys[c] = x;  // branch-free: always store, advance when it belongs
      c += static_cast<std::int32_t>((x >> shift) == prefix);
    }
    m = c;
  }
  // The bin's largest possible key; with shift 0 the bin is one key value.
  const std::uint64_t low = shift == 0 ? 0 : (~std::uint64_t{0} >> (64 - shift));
  return {(prefix << shift) | low, need};
}

// The k lowest keys of a segment (0 < k < n) into idx[0, k) in index order
// (idx and cand hold n entries), and mask (if given). One pass splits the
// keys by a window of coarse keys that holds the k-th (from a sample, or if
// that misses, from a histogram): below it they are selected; inside it they
// are candidates, listed in index order in idx too, flagged (bit 31). A radix
// select among the candidates then finds which go, and a pass over idx drops
// the flagged ones that do not. idx thus never needs a merge.
template <class Row>
void select_row(const Row& row, std::int32_t n, std::int32_t k, std::uint64_t* cand_keys, std::int32_t* idx,
                std::int32_t* cand, std::uint32_t* hist, std::uint8_t* mask) {
  using C = typename Row::coarse_type;
  constexpr int cs = Row::coarse_shift;
  C lo, hi;
  std::int32_t c = 0, m = 0;
  for (int attempt = n >= select_sample_min_length ? 0 : 1;; ++attempt) {
    if (attempt == 0)
      sample_window(row, n, k, reinterpret_cast<C*>(cand_keys), lo, hi);
    else
      histogram_window(row, n, k, hist, lo, hi);  // always holds it
    const C width = hi - lo;
    C buf[select_block];
    c = m = 0;
    for (std::int32_t j0 = 0; j0 < n; j0 += select_block) {
      for (std::int32_t t = 0, size = coarse_block(row, j0, n, buf); t < size; ++t) {
        const std::uint32_t below = buf[t] < lo, inside = buf[t] - lo <= width;  // below lo, x - lo wraps
        idx[c] = static_cast<std::int32_t>(static_cast<std::uint32_t>(j0 + t) | inside << 31);  // branch-free:
        c += static_cast<std::int32_t>(below | inside);  // always store, advance when it belongs
        cand[m] = j0 + t;
        m += static_cast<std::int32_t>(inside);
        if (mask) mask[j0 + t] = static_cast<std::uint8_t>(below);
      }
    }
    if (c - m <= k && k <= c) break;
  }
  if (m == 0) return;
  // Which candidates go: the need lowest, by a radix select on their keys.
  const auto need = static_cast<std::uint32_t>(k - (c - m));
  select_threshold t{std::uint64_t{lo} << cs, 0};  // need == 0: none
  if (need == std::uint32_t(m)) {
    t = {(std::uint64_t{hi} << cs) | (cs ? ~std::uint64_t{0} >> (64 - cs) : 0), need};  // all
  } else if (need > 0) {
    for (std::int32_t u = 0; u < m; ++u) cand_keys[u] = row.key(cand[u]);
    const std::uint64_t span = (std::uint64_t{lo} ^ std::uint64_t{hi}) << cs | (cs ? ~std::uint64_t{0} >> (64 - cs) : 0);
    int shift = 0;  // the candidates share the bits above the highest one where lo and hi differ
    while (shift < 64 && (span >> shift) != 0) ++shift;
    t = radix_threshold(cand_keys, m, hist, shift == 64 ? 0 : (std::uint64_t{lo} << cs) >> shift, shift, need);
  }
  std::uint32_t equal_left = t.equal;
  for (std::int32_t u = 0; u < m; ++u) {  // in index order, so equal keys go lowest index first
    const std::uint64_t key = row.key(cand[u]);
    const std::uint32_t eq = key == t.key;
    const std::uint32_t take = static_cast<std::uint32_t>(key < t.key) | (eq & static_cast<std::uint32_t>(equal_left > 0));
    equal_left -= eq & take;
    if (mask) mask[cand[u]] = static_cast<std::uint8_t>(take);
    cand[u] = static_cast<std::int32_t>(static_cast<std::uint32_t>(cand[u]) | take << 31);
  }
  if (m < n) cand[m] = static_cast<std::int32_t>(0x80000000u);  // read, never used, after the last candidate
  std::int32_t o = 0;
  for (std::int32_t u = 0, next = 0; u < c; ++u) {
    const auto e = static_cast<std::uint32_t>(idx[u]);
    const std::uint32_t flagged = e >> 31;
    const std::uint32_t keep = (~flagged | (static_cast<std::uint32_t>(cand[next]) >> 31)) & 1u;
    next += static_cast<std::int32_t>(flagged);
    idx[o] = static_cast<std::int32_t>(e & 0x7FFFFFFFu);
    o += static_cast<std::int32_t>(keep);
  }
}

// The k selected indices idx (ascending) into dst by position; equal
// positions stay in index order. x and y hold k words each.
template <class Keys>
void order_by_position(const Keys& keys, std::int32_t i, const std::int32_t* idx, std::int32_t k, std::int32_t* dst,
                       std::uint64_t* x, std::uint64_t* y, std::uint32_t* hist) {
  // (position with its sign bit flipped, so signed order is unsigned order) << 32 | index
  std::uint32_t lo = ~0u, hi = 0;
  for (std::int32_t t = 0; t < k; ++t) {
    const std::uint32_t p = static_cast<std::uint32_t>(keys.position(i, idx[t])) ^ 0x80000000u;
    lo = std::min(lo, p);
    hi = std::max(hi, p);
    x[t] = (std::uint64_t{p} << 32) | static_cast<std::uint32_t>(idx[t]);
  }
  if (k < 64) {
    std::sort(x, x + k);  // few: a comparison sort wins (the words are distinct)
  } else {
    // LSD radix sort of (position - lo) over only the bits its range needs;
    // stable, so equal positions keep index order.
    int bits = 0;
    while (bits < 32 && ((hi - lo) >> bits) != 0) ++bits;
    const int passes = (bits + select_radix_bits - 1) / select_radix_bits;
    const int digit = passes ? (bits + passes - 1) / passes : 0;
    const std::uint32_t digit_mask = (1u << digit) - 1u;
    for (int pass = 0; pass < passes; ++pass) {
      const int shift = pass * digit;
      const auto bin = [&](std::uint64_t v) { return ((static_cast<std::uint32_t>(v >> 32) - lo) >> shift) & digit_mask; };
      std::fill_n(hist, std::size_t(1) << digit, 0u);
      for (std::int32_t t = 0; t < k; ++t) ++hist[bin(x[t])];
      std::uint32_t sum = 0;
      for (std::uint32_t b = 0; b <= digit_mask; ++b) sum += std::exchange(hist[b], sum);
      for (std::int32_t t = 0; t < k; ++t) y[hist[bin(x[t])]++] = x[t];
      std::swap(x, y);
    }
  }
  for (std::int32_t t = 0; t < k; ++t) dst[t] = static_cast<std::int32_t>(static_cast<std::uint32_t>(x[t]));
}

// One segment, 0 < k < n: the selected indices into idx (n entries).
template <class Keys>
void select_in_segment(const Keys& keys, std::int32_t i, select_end end, std::int32_t n, std::int32_t k,
                       std::uint64_t* stored, std::uint64_t* cand_keys, std::int32_t* idx, std::int32_t* cand,
                       std::uint32_t* hist, std::uint8_t* mask) {
  const Keys local = keys;  // a copy, so that stores to the workspace cannot alias its fields
  for (std::int32_t j = 0; j < n; ++j) stored[j] = local.key(i, j, end);
  select_row(stored_row{stored}, n, k, cand_keys, idx, cand, hist, mask);
}

inline void select_in_segment(const segment_set& keys, std::int32_t i, select_end end, std::int32_t n, std::int32_t k,
                              std::uint64_t*, std::uint64_t* cand_keys, std::int32_t* idx, std::int32_t* cand,
                              std::uint32_t* hist, std::uint8_t* mask) {
  const float* s = keys.scores + i * keys.stride;
  const std::uint32_t flip = end == select_end::top ? ~0u : 0u;
  if (keys.positions)
    select_row(score_row<true>{s, keys.positions + i * keys.stride, flip}, n, k, cand_keys, idx, cand, hist, mask);
  else
    select_row(score_row<false>{s, nullptr, flip}, n, k, cand_keys, idx, cand, hist, mask);
}

/// The core, unchecked: any copyable key source with num_segments,
/// max_length, length(i), key(i, j, end) -> uint64, position(i, j) and
/// ordered_by_index(). workspace must hold select_workspace_bytes(keys) bytes.
template <class Keys>
void select_segments(void* workspace, std::size_t /*bytes*/, const Keys& keys, select_end end,
                     const selection_count& count, const selection_output& out) {
  const std::size_t cap = static_cast<std::size_t>(std::max(keys.max_length, std::int32_t{0}));
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(workspace);
  std::uint64_t* const stored = reinterpret_cast<std::uint64_t*>((base + select_align - 1) & ~(select_align - 1));
  std::uint64_t* const cand_keys = stored + cap;
  std::int32_t* const idx = reinterpret_cast<std::int32_t*>(cand_keys + cap);
  std::int32_t* const cand = idx + cap;
  std::uint32_t hist[std::size_t(1) << select_radix_bits];
  for (std::int32_t i = 0; i < keys.num_segments; ++i) {
    const std::int32_t n = keys.length(i), k = count.of(i);
    std::int32_t* const row = out.indices ? out.indices + i * out.index_stride : nullptr;
    std::uint8_t* const mask = out.mask ? out.mask + i * out.mask_stride : nullptr;
    if (k == 0 || k == n) {  // nothing or everything: no keys needed
      for (std::int32_t j = 0; j < k; ++j) idx[j] = j;
      if (mask) std::fill_n(mask, n, static_cast<std::uint8_t>(k == n));
    } else {
      select_in_segment(keys, i, end, n, k, stored, cand_keys, idx, cand, hist, mask);
    }
    if (!row) continue;
    if (keys.ordered_by_index())
      std::copy_n(idx, k, row);
    else
      order_by_position(keys, i, idx, k, row, stored, cand_keys, hist);
  }
}

template <class Where>
void validate_select(const Where& where, const segment_set& keys, select_end end, const selection_count& count,
                     const selection_output& out) {
  require_select_end(where, end);
  if (keys.num_segments < 0) fail<invalid_argument>(where, "keys.num_segments", "= ", keys.num_segments, " is negative");
  if (keys.max_length < 0) fail<invalid_argument>(where, "keys.max_length", "= ", keys.max_length, " is negative");
  if (keys.num_segments > 0 && keys.max_length > 0) require_not_null(where, "keys.scores", keys.scores);
  if (keys.stride < keys.max_length)
    fail<invalid_argument>(where, "keys.stride", "= ", keys.stride, " is below keys.max_length = ", keys.max_length);
  std::int32_t largest_k = 0;
  for (std::int32_t i = 0; i < keys.num_segments; ++i) {
    const std::int32_t n = keys.length(i), k = count.of(i);
    if (n < 0 || n > keys.max_length)
      fail<out_of_range>(where, concat("keys.lengths[", i, "]"), "= ", n, " is outside [0, ", keys.max_length, "]");
    if (k < 0 || k > n)
      fail<out_of_range>(where, count.ks ? concat("count.ks[", i, "]") : std::string("count.k"), "= ", k,
                         " is outside [0, ", n, "]");
    largest_k = std::max(largest_k, k);
  }
  if (!out.indices && !out.mask) fail<invalid_argument>(where, "out", "has neither indices nor mask");
  if (out.indices && out.index_stride < largest_k)
    fail<invalid_argument>(where, "out.index_stride", "= ", out.index_stride, " is below the largest k = ", largest_k);
  if (out.mask && out.mask_stride < keys.max_length)
    fail<invalid_argument>(where, "out.mask_stride", "= ", out.mask_stride, " is below keys.max_length = ",
                           keys.max_length);
  require_select_strides(where, keys, largest_k, out);
}

}  // namespace detail

/// Bytes of workspace segmented_select needs for these keys (any alignment).
inline std::size_t segmented_select_workspace_bytes(const segment_set& keys) {
  return detail::select_workspace_bytes(keys);
}

/// Selects count.of(i) elements of every segment i: the highest keys
/// (select_end::top) or the lowest (select_end::bottom); see
/// select/segments.hpp. Validates everything before writing anything.
inline void segmented_select(void* workspace, std::size_t workspace_bytes, const segment_set& keys, select_end end,
                             const selection_count& count, const selection_output& out) {
  constexpr const char* where = "segmented_select";
  detail::validate_select(where, keys, end, count, out);
  detail::require_not_null(where, "workspace", workspace);
  const std::size_t needed = detail::select_workspace_bytes(keys);
  if (workspace_bytes < needed)
    detail::fail<invalid_argument>(where, "workspace_bytes", "= ", workspace_bytes, " is below the ", needed,
                                   " needed (segmented_select_workspace_bytes)");
  detail::select_segments(workspace, workspace_bytes, keys, end, count, out);
}

/// As above, with a workspace of its own.
inline void segmented_select(const segment_set& keys, select_end end, const selection_count& count,
                             const selection_output& out) {
  detail::validate_select("segmented_select", keys, end, count, out);
  const std::size_t bytes = detail::select_workspace_bytes(keys);
  const std::unique_ptr<unsigned char[]> workspace(new unsigned char[bytes]);  // uninitialised: all written first
  detail::select_segments(workspace.get(), bytes, keys, end, count, out);
}

}  // namespace kvevict
