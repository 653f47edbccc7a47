#pragma once
// A brute-force model of h2o (docs/policies.md, docs/semantics.md): per
// (sequence, KV head) a map from cached position to its accumulated score,
// updated the obvious way (score = decay * score, rounded, plus the
// increment folded over the group in ascending query head) and evicting by
// sorting, the first `sinks` and the `recent` newest protected. The
// harness feeds it the same calls the library accepted and compares the
// cached positions and the score bits after each.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "finding.hpp"
#include "kvevict/order.hpp"
#include "kvevict/score_inputs.hpp"

namespace kvfuzz {

class h2o_shadow {
 public:
  h2o_shadow(std::int32_t seqs, std::int32_t heads, std::int32_t group, std::int32_t recent, std::int32_t budget,
             kvevict::group_reduce reduce, std::int32_t sinks, float decay)
      : heads_(heads), group_(group), recent_(recent), budget_(budget), sinks_(sinks), decay_(decay), reduce_(reduce),
        tokens_(std::size_t(seqs) * heads), lengths_(std::size_t(seqs), 0) {}

  /// Prompt row i of `length` as it enters a column total: weighed by
  /// decay^(length - 1 - i) (exact: the harness draws powers of two and 0).
  float weigh_row(float x, std::int32_t length, std::int32_t i) const {
    if (decay_ == 1.0f) return x;
    const float w = std::pow(decay_, float(length - 1 - i));
    return w * x;
  }

  std::int32_t group() const { return group_; }
  std::int32_t length(std::int32_t b) const { return lengths_[std::size_t(b)]; }
  std::size_t count(std::int32_t b, std::int32_t h) const { return head(b, h).size(); }

  /// The group fold of one slot: sum, mean or max over the g values in
  /// ascending query head (sum from 0 + x, max from 0, mean = sum / g).
  float fold(const float* values) const {
    float acc = 0.0f;
    for (std::int32_t j = 0; j < group_; ++j)
      acc = reduce_ == kvevict::group_reduce::max ? (values[j] > acc ? values[j] : acc) : acc + values[j];
    return reduce_ == kvevict::group_reduce::mean ? acc / float(group_) : acc;
  }

  void append(std::int32_t b, std::int32_t tokens) {
    const std::int32_t first = lengths_[std::size_t(b)];
    for (std::int32_t h = 0; h < heads_; ++h)
      for (std::int32_t j = 0; j < tokens; ++j) head(b, h)[first + j] = 0.0f;
    lengths_[std::size_t(b)] = first + tokens;
  }
  /// The batched append of one sequence is all heads or none: the same.
  void reset(std::int32_t b) {
    for (std::int32_t h = 0; h < heads_; ++h) head(b, h).clear();
    lengths_[std::size_t(b)] = 0;
  }

  /// fork: sequence `destination` becomes what sequence `source` of
  /// `before` (the shadow before the call) held.
  void copy_sequence(const h2o_shadow& before, std::int32_t source, std::int32_t destination) {
    for (std::int32_t h = 0; h < heads_; ++h) head(destination, h) = before.head(source, h);
    lengths_[std::size_t(destination)] = before.lengths_[std::size_t(source)];
  }

  /// Adds an increment to the score of `position`; a non-finite result is a
  /// finding (the library promises to refuse the update instead).
  void add(std::int32_t b, std::int32_t h, std::int32_t position, float increment, const char* call) {
    auto it = head(b, h).find(position);
    require(it != head(b, h).end(), std::string(call) + ": shadow has no position " + std::to_string(position));
    const float scaled = decay_ * it->second;  // rounded before the add, never fused
    const float next = scaled + increment;
    require(std::isfinite(next), std::string(call) + " accepted an update that makes the score of position " +
                                     std::to_string(position) + " non-finite");
    it->second = next;
  }

  /// evict: above the budget, the lowest (score, position) outside the
  /// first `sinks` and the `recent` newest goes. Returns false when there is no such token.
  bool evict_one(std::int32_t b, std::int32_t h) {
    auto& t = head(b, h);
    if (std::int32_t(t.size()) <= budget_) return true;
    const std::int32_t len = lengths_[std::size_t(b)];
    bool found = false;
    std::int32_t victim = 0;
    std::uint64_t best = 0;
    for (const auto& [p, score] : t) {
      if (p < sinks_ || p >= len - recent_) continue;
      const std::uint64_t key = kvevict::eviction_key(score, p);
      if (!found || key < best) found = true, best = key, victim = p;
    }
    if (found) t.erase(victim);
    return found;
  }

  /// evict_to: keep the protected tokens and the highest (score, position)
  /// of the rest, `target` in all.
  void evict_to(std::int32_t b, std::int32_t h, std::int32_t target) {
    auto& t = head(b, h);
    if (std::int32_t(t.size()) <= target) return;
    const std::int32_t len = lengths_[std::size_t(b)];
    std::vector<std::pair<std::uint64_t, std::int32_t>> rest;
    std::int32_t protected_count = 0;
    for (const auto& [p, score] : t) {
      if (p < sinks_ || p >= len - recent_) ++protected_count;
      else rest.push_back({kvevict::eviction_key(score, p), p});
    }
    std::sort(rest.begin(), rest.end());  // ascending: victims first
    const std::size_t victims = t.size() - std::size_t(target);
    require(victims <= rest.size(), "shadow evict_to: fewer unprotected tokens than victims");
    for (std::size_t i = 0; i < victims; ++i) t.erase(rest[i].second);
    (void)protected_count;
  }

  /// Prefill of a prompt of `length` with per-head scores[h][p]: the first
  /// `sinks`, the last `recent` and the top of the rest by (score, position).
  void prefill(std::int32_t b, std::int32_t length, const std::vector<std::vector<float>>& scores) {
    lengths_[std::size_t(b)] = length;
    for (std::int32_t h = 0; h < heads_; ++h) {
      auto& t = head(b, h);
      t.clear();
      for (std::int32_t p = 0; p < length; ++p) t[p] = scores[std::size_t(h)][std::size_t(p)];
      if (length <= budget_) continue;
      std::vector<std::pair<std::uint64_t, std::int32_t>> rest;
      for (std::int32_t p = sinks_; p < length - recent_; ++p)
        rest.push_back({kvevict::eviction_key(t[p], p), p});
      std::sort(rest.begin(), rest.end());
      const std::size_t victims = std::size_t(length - budget_);
      for (std::size_t i = 0; i < victims; ++i) t.erase(rest[i].second);
    }
  }

  /// Compares (b, h) with the library's slot table and scores: the same
  /// cached positions, each with the same score bits.
  void compare(const char* api, std::int32_t b, std::int32_t h, const std::int32_t* positions, const float* scores,
               std::int32_t capacity, std::int32_t length) const {
    const std::string at = std::string(api) + " h2o sequence " + std::to_string(b) + " head " + std::to_string(h);
    require(length == lengths_[std::size_t(b)], at + ": length " + std::to_string(length) + ", shadow " +
                                                     std::to_string(lengths_[std::size_t(b)]));
    const auto& t = head(b, h);
    std::size_t cached = 0;
    for (std::int32_t s = 0; s < capacity; ++s) {
      const std::int32_t p = positions[s];
      if (p < 0) continue;
      ++cached;
      const auto it = t.find(p);
      require(it != t.end(), at + ": position " + std::to_string(p) + " is cached, the brute force evicted it");
      std::uint32_t a, e;
      std::memcpy(&a, &scores[s], 4);
      std::memcpy(&e, &it->second, 4);
      require(a == e, at + ": position " + std::to_string(p) + " has score " + std::to_string(scores[s]) +
                          ", the brute force " + std::to_string(it->second));
    }
    require(cached == t.size(), at + ": " + std::to_string(cached) + " cached positions, the brute force keeps " +
                                    std::to_string(t.size()));
  }

 private:
  std::map<std::int32_t, float>& head(std::int32_t b, std::int32_t h) {
    return tokens_[std::size_t(b) * heads_ + h];
  }
  const std::map<std::int32_t, float>& head(std::int32_t b, std::int32_t h) const {
    return tokens_[std::size_t(b) * heads_ + h];
  }

  std::int32_t heads_, group_, recent_, budget_, sinks_;
  float decay_;
  kvevict::group_reduce reduce_;
  std::vector<std::map<std::int32_t, float>> tokens_;  // [B][H]: position -> score
  std::vector<std::int32_t> lengths_;
};

}  // namespace kvfuzz
