#pragma once
// Inputs of the batched calls: the per-sequence score inputs of
// score_inputs.hpp with a leading sequence dimension, new K/V rows for the
// fused append + scatter, and the set of sequences that step.
//
// All are trivially copyable views; on CUDA they point to device memory.
// Slot dimensions may be wider than needed: a batched call reads slots
// [0, count(b, h)) only, and count never exceeds budget + 1 during decode.
// After a multi-token append it can: a head whose count exceeds the input's
// slot dimension is refused (narrow_input) rather than read past its end.
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/score_inputs.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {

/// Decode probabilities of every sequence: probs(b, q, s), [B][Hq][>= budget + 1].
struct batch_probs {
  tensor_view<const float, 3> probs;
};

/// Per-KV-head increments the engine reduced itself: scores(b, h, s),
/// [B][Hkv][>= budget + 1].
struct batch_head_scores {
  tensor_view<const float, 3> scores;
};

/// Logits and LSE from a fused decode kernel: probability
/// exp(logits(b, q, s) * scale - lse(b, q)) with no K re-read.
/// logits [B][Hq][>= budget + 1], lse [B][Hq] (natural log, or base 2 for
/// FlashInfer).
struct batch_logits {
  tensor_view<const float, 3> logits;
  tensor_view<const float, 2> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
};

/// Queries and LSE from a fused decode kernel; the logits are recomputed
/// from the cached keys. q [B][Hq][head_dim], lse [B][Hq].
template <class Q>
struct batch_queries {
  tensor_view<const Q, 3> q;
  tensor_view<const float, 2> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
};

/// One new K or V row per (sequence, KV head): rows(b, h, d), [B][Hkv][head_dim],
/// for append with scatter. The last stride must be 1.
template <class T>
struct batch_rows {
  tensor_view<const T, 3> rows;
};

/// Which sequences a batched call steps: a list of distinct indices, or one
/// flag per sequence, or (the default) all of them. On CUDA the list and the
/// flags live in device memory; the list's length is known on the host.
struct active_set {
  enum class kind : std::uint8_t { all, list, flags };
  kind mode = kind::all;
  const std::int32_t* list = nullptr;   ///< `count` distinct sequence indices (mode list)
  std::int32_t count = 0;               ///< entries of `list`; 0 steps nothing
  const std::uint8_t* flags = nullptr;  ///< [num_seqs], non-zero steps (mode flags)

  static active_set all() noexcept { return {}; }
  static active_set of_list(const std::int32_t* list, std::int32_t count) noexcept {
    return {kind::list, list, count, nullptr};
  }
  static active_set of_flags(const std::uint8_t* flags) noexcept { return {kind::flags, nullptr, 0, flags}; }

  /// How many entries a call walks: the list's length, or every sequence.
  KVEVICT_HOST_DEVICE std::int32_t entries(std::int32_t num_seqs) const noexcept {
    return mode == kind::list ? count : num_seqs;
  }
  /// The sequence of entry i, or -1 when entry i is inactive; -2 when the
  /// list names an index outside [0, num_seqs).
  KVEVICT_HOST_DEVICE std::int32_t sequence(std::int32_t i, std::int32_t num_seqs) const noexcept {
    if (mode == kind::list) {
      const std::int32_t b = list[i];
      return b >= 0 && b < num_seqs ? b : -2;
    }
    return mode == kind::flags && flags[i] == 0 ? -1 : i;
  }
};

static_assert(std::is_trivially_copyable_v<batch_logits>, "inputs go to kernels by value");
static_assert(std::is_trivially_copyable_v<batch_queries<float>>, "inputs go to kernels by value");
static_assert(std::is_trivially_copyable_v<active_set>, "inputs go to kernels by value");

}  // namespace kvevict
