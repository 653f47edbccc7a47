#pragma once
// A brute-force model of multi-token steps (docs/semantics.md, "Decode
// cycle", "Scores" and "Multi-token steps"; docs/policies.md, "The
// policies", "random", "exact_greedy"), written in the tests from those
// definitions so the batched host backend is checked against it rather than
// against the per-sequence policies (a facade over that backend).
//
// Per (sequence, KV head) the model keeps its own slot table (the position
// in each slot, the count, the next slot), scores and, per sequence, the
// length, and runs:
//   - append of n tokens: token j to the next slot for j = 0 when there is
//     one, else to count + j; score 0; the next slot is the new count while
//     count <= budget, else none (-1);
//   - observe: h2o, recent_window and random add the step's per-head
//     increment to every occupied slot (decay 1: S + inc in float);
//     exact_greedy's score of each cached token v is its leave-one-out
//     error E(v) (below); then, above the budget, one victim: the lowest
//     (score, position) (h2o, exact_greedy), the oldest (recent_window), the
//     lowest (Philox priority of the step, position) (random, from
//     support/random_reference.hpp) among the unprotected (the first
//     `sinks`, the `recent` newest); its slot becomes the next slot;
//   - evict_to(target): the count - target lowest of that order freed at
//     once (exact_greedy: greedily, one victim a round, every error
//     recomputed with the tokens freed so far evicted, the scores left being
//     the last round's), then the refill: span = kept + 1 (kept <= budget)
//     or kept; the i-th lowest free slot below the span takes the token
//     (position, score, K/V rows) of the i-th lowest occupied slot at or
//     beyond it; the first free slot of the span left over is the next slot
//     (-1 when none).
//
// exact_greedy's error is computed here in long double from the
// definition, E(v) = sum over the group's query heads of
// ||out(G \ {v}) - out(H)||^2, written with the identity docs/policies.md
// states, w^2 ||out(G \ {v}) - out(R)||^2 with R = H \ (G \ {v}) and
// w = Z(R) / Z(H) (so that tiny errors are not lost to cancellation); the
// library computes it in double with float keys: the test compares within a
// relative tolerance (1e-6), and a victim within it of the lowest error (a near
// tie) may be either, the model then following the library's choice
// (counted). Evicting the only cached token leaves nothing to attend to:
// its error is +inf (the library's convention, policy/leave_one_out.hpp).
//
// Nothing here calls the library except kvevict::philox4x32_10 (inside
// random_reference.hpp), pinned by Random123's known answers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <set>
#include <vector>

#include "support/random_reference.hpp"

namespace kvtest {

enum class model_rule { lowest_score, oldest, random_priority, greedy };

struct model_config {
  model_rule rule = model_rule::lowest_score;
  std::int32_t budget = 0, sinks = 0, recent = 0;
  std::uint64_t seed = 0;
};

/// One (sequence, KV head) of the model.
struct model_head {
  std::vector<std::int32_t> pos;   // [capacity], -1 free
  std::vector<float> score;        // [capacity]
  std::vector<long double> error;  // exact_greedy: E of the token in each slot, from the last scoring
  std::int32_t count = 0, next = 0;
};

/// A row move of the refill: the token of slot `from` goes to slot `to`.
struct model_move {
  std::int32_t from = -1, to = -1;
};

/// exact_greedy's inputs of one step: the K/V row of (position, head) as
/// the cache holds it, in float, and the step's query of (sequence, query
/// head).
struct greedy_inputs {
  std::int32_t group = 1, head_dim = 1;
  long double scale = 0.5L;
  std::function<float(std::int32_t position, std::int32_t h, std::int32_t d)> key, value;
  std::function<float(std::int32_t b, std::int32_t q, std::int32_t d)> query;
};

class multi_token_model {
 public:
  multi_token_model(std::int32_t seqs, std::int32_t heads, std::int32_t capacity, const model_config& c)
      : heads_(heads), cap_(capacity), c_(c), length_(std::size_t(seqs), 0) {
    model_head empty;
    empty.pos.assign(std::size_t(capacity), -1);
    empty.score.assign(std::size_t(capacity), 0.0f);
    empty.error.assign(std::size_t(capacity), 0.0L);
    heads_of_.assign(std::size_t(seqs) * std::size_t(heads), empty);
  }

  const model_head& head(std::int32_t b, std::int32_t h) const { return heads_of_[index(b, h)]; }
  std::int32_t length(std::int32_t b) const { return length_[std::size_t(b)]; }
  std::int64_t near_ties() const { return near_ties_; }
  std::int64_t greedy_rounds() const { return greedy_rounds_; }
  /// The slot each head freed in the last observe + evict, or -1.
  const std::vector<std::int32_t>& last_victims() const { return last_victims_; }

  /// Appends `tokens` tokens to sequence b; fills slots[h * tokens + j] with
  /// the slot of token j of head h. Returns the first new position.
  std::int32_t append(std::int32_t b, std::int32_t tokens, std::vector<std::int32_t>& slots) {
    const std::int32_t first = length_[std::size_t(b)];
    slots.assign(std::size_t(heads_) * std::size_t(tokens), -1);
    for (std::int32_t h = 0; h < heads_; ++h) {
      model_head& m = heads_of_[index(b, h)];
      for (std::int32_t j = 0; j < tokens; ++j) {
        const std::int32_t s = j == 0 && m.next >= 0 ? m.next : m.count + j;
        m.pos[std::size_t(s)] = first + j;
        m.score[std::size_t(s)] = 0.0f;
        m.error[std::size_t(s)] = 0.0L;
        slots[std::size_t(h * tokens + j)] = s;
      }
      m.count += tokens;
      m.next = m.count <= c_.budget ? m.count : -1;
    }
    length_[std::size_t(b)] = first + tokens;
    return first;
  }

  /// observe + evict of sequence b with per-head increments inc(h, slot).
  template <class Increment>
  void observe_evict(std::int32_t b, Increment inc) {
    observe(b, inc);
    last_victims_.assign(std::size_t(heads_), -1);
    for (std::int32_t h = 0; h < heads_; ++h) {
      model_head& m = heads_of_[index(b, h)];
      if (m.count > c_.budget) {
        last_victims_[std::size_t(h)] = lowest(b, h, 1).front();
        free_slot(m, last_victims_[std::size_t(h)]);
      }
    }
  }

  /// observe alone (the per-sequence call): the increments added, no victim.
  template <class Increment>
  void observe(std::int32_t b, Increment inc) {
    for (std::int32_t h = 0; h < heads_; ++h) {
      model_head& m = heads_of_[index(b, h)];
      for (std::int32_t s = 0; s < cap_; ++s)
        if (m.pos[std::size_t(s)] >= 0) {
          const float sum = m.score[std::size_t(s)] + inc(h, s);
          m.score[std::size_t(s)] = sum;
        }
    }
  }

  /// exact_greedy's observe alone: every cached token scored, no victim.
  void greedy_observe(std::int32_t b, const greedy_inputs& in) {
    for (std::int32_t h = 0; h < heads_; ++h) score_greedy(b, h, in, heads_of_[index(b, h)]);
  }

  /// exact_greedy's observe + evict of sequence b; `chosen(h)` is the slot
  /// the library freed for head h (or -1), taken when it is within a near
  /// tie of the model's victim.
  template <class Chosen>
  bool greedy_observe_evict(std::int32_t b, const greedy_inputs& in, Chosen chosen) {
    bool ok = true;
    last_victims_.assign(std::size_t(heads_), -1);
    for (std::int32_t h = 0; h < heads_; ++h) {
      model_head& m = heads_of_[index(b, h)];
      score_greedy(b, h, in, m);
      if (m.count <= c_.budget) continue;
      const std::vector<std::int32_t> ties = greedy_candidates(b, m);
      const std::int32_t lib = chosen(h);
      if (std::find(ties.begin(), ties.end(), lib) == ties.end()) {
        ok = false;
        last_victims_[std::size_t(h)] = ties.front();
      } else {
        near_ties_ += ties.size() > 1;
        last_victims_[std::size_t(h)] = lib;
      }
      free_slot(m, last_victims_[std::size_t(h)]);
    }
    return ok;
  }

  /// evict_to(target) of sequence b for h2o, recent_window and random.
  /// Returns the refill moves per head.
  std::vector<std::vector<model_move>> evict_to(std::int32_t b, std::int32_t target) {
    std::vector<std::vector<model_move>> moves(static_cast<std::size_t>(heads_));
    for (std::int32_t h = 0; h < heads_; ++h) {
      model_head& m = heads_of_[index(b, h)];
      if (m.count <= target) continue;
      for (std::int32_t s : lowest(b, h, m.count - target)) free_slot(m, s);
      moves[std::size_t(h)] = refill(m);
    }
    return moves;
  }

  /// exact_greedy's evict_to(target) of sequence b: greedy rounds; where a
  /// round has a near tie, every branch is followed and the one that keeps
  /// `library_keeps(h)` (the positions the library kept) is taken. Returns
  /// false when no branch keeps them.
  template <class Keeps>
  bool greedy_evict_to(std::int32_t b, std::int32_t target, const greedy_inputs& in, Keeps library_keeps,
                       std::vector<std::vector<model_move>>& moves) {
    moves.assign(std::size_t(heads_), {});
    bool ok = true;
    for (std::int32_t h = 0; h < heads_; ++h) {
      model_head& m = heads_of_[index(b, h)];
      if (m.count <= target) continue;
      const std::set<std::int32_t> want = library_keeps(h);
      model_head found;
      if (!greedy_search(b, h, in, m, target, want, found)) {
        ok = false;
        greedy_search_first(b, h, in, target);
      } else {
        m = found;
      }
      moves[std::size_t(h)] = refill(m);
    }
    return ok;
  }

 private:
  std::size_t index(std::int32_t b, std::int32_t h) const { return std::size_t(b) * std::size_t(heads_) + std::size_t(h); }

  bool protected_position(std::int32_t p, std::int32_t length) const {
    return p < c_.sinks || p >= length - c_.recent;
  }

  /// The k lowest unprotected slots of (b, h) by the rule's order.
  std::vector<std::int32_t> lowest(std::int32_t b, std::int32_t h, std::int32_t k) const {
    const model_head& m = heads_of_[index(b, h)];
    const std::int32_t length = length_[std::size_t(b)];
    std::vector<std::int32_t> candidates;  // slots
    for (std::int32_t s = 0; s < cap_; ++s)
      if (m.pos[std::size_t(s)] >= 0 && !protected_position(m.pos[std::size_t(s)], length)) candidates.push_back(s);
    if (c_.rule == model_rule::random_priority) {
      std::vector<std::int32_t> positions;
      for (std::int32_t s : candidates) positions.push_back(m.pos[std::size_t(s)]);
      std::vector<std::int32_t> out;
      for (std::int32_t p : random_victims(c_.seed, std::uint64_t(b), h, length - 1, positions, std::size_t(k)))
        for (std::int32_t s : candidates)
          if (m.pos[std::size_t(s)] == p) out.push_back(s);
      return out;
    }
    std::sort(candidates.begin(), candidates.end(), [&](std::int32_t x, std::int32_t y) {
      const std::int32_t px = m.pos[std::size_t(x)], py = m.pos[std::size_t(y)];
      if (c_.rule == model_rule::oldest) return px < py;
      const float sx = m.score[std::size_t(x)], sy = m.score[std::size_t(y)];
      return sx != sy ? sx < sy : px < py;
    });
    candidates.resize(std::min(candidates.size(), std::size_t(k)));
    return candidates;
  }

  void free_slot(model_head& m, std::int32_t s) {
    m.pos[std::size_t(s)] = -1;
    m.score[std::size_t(s)] = 0.0f;
    m.error[std::size_t(s)] = 0.0L;
    --m.count;
    m.next = s;
  }

  /// The refill after evict_to freed its victims, `count` tokens kept.
  std::vector<model_move> refill(model_head& m) const {
    const std::int32_t span = m.count <= c_.budget ? m.count + 1 : m.count;
    std::vector<std::int32_t> holes, sources;
    for (std::int32_t s = 0; s < cap_; ++s) {
      if (s < span && m.pos[std::size_t(s)] < 0) holes.push_back(s);
      if (s >= span && m.pos[std::size_t(s)] >= 0) sources.push_back(s);
    }
    std::vector<model_move> moves;
    for (std::size_t i = 0; i < sources.size() && i < holes.size(); ++i) {
      const std::size_t from = std::size_t(sources[i]), to = std::size_t(holes[i]);
      m.pos[to] = m.pos[from];
      m.score[to] = m.score[from];
      m.error[to] = m.error[from];
      m.pos[from] = -1;
      m.score[from] = 0.0f;
      m.error[from] = 0.0L;
      moves.push_back({sources[i], holes[i]});
    }
    m.next = sources.size() < holes.size() ? holes[sources.size()] : -1;
    return moves;
  }

  /// exact_greedy: every cached token's E(v) against the whole history
  /// [0, length(b)), into error (long double) and score (rounded to float).
  void score_greedy(std::int32_t b, std::int32_t h, const greedy_inputs& in, model_head& m) const {
    const std::int32_t n = length_[std::size_t(b)], D = in.head_dim;
    std::vector<char> cached(std::size_t(n), 0);
    for (std::int32_t s = 0; s < cap_; ++s)
      if (m.pos[std::size_t(s)] >= 0) cached[std::size_t(m.pos[std::size_t(s)])] = 1;
    std::vector<long double> total(std::size_t(cap_), 0.0L);
    const std::size_t rows = static_cast<std::size_t>(n), dims = static_cast<std::size_t>(D);
    std::vector<long double> weight(rows), out_g(dims), out_x(dims), a(dims), r(dims);
    for (std::int32_t j = 0; j < in.group; ++j) {
      const std::int32_t q = h * in.group + j;
      long double top = -INFINITY;
      std::vector<long double> logit(rows);
      for (std::int32_t p = 0; p < n; ++p) {
        long double dot = 0.0L;
        for (std::int32_t d = 0; d < D; ++d) dot += (long double)in.query(b, q, d) * (long double)in.key(p, h, d);
        logit[std::size_t(p)] = in.scale * dot;
        top = std::max(top, logit[std::size_t(p)]);
      }
      // Unnormalised sums over the cached set G and the evicted set X.
      long double zg = 0.0L, zx = 0.0L;
      std::fill(out_g.begin(), out_g.end(), 0.0L);
      std::fill(out_x.begin(), out_x.end(), 0.0L);
      for (std::int32_t p = 0; p < n; ++p) {
        weight[std::size_t(p)] = std::exp(logit[std::size_t(p)] - top);
        long double& z = cached[std::size_t(p)] ? zg : zx;
        std::vector<long double>& o = cached[std::size_t(p)] ? out_g : out_x;
        z += weight[std::size_t(p)];
        for (std::int32_t d = 0; d < D; ++d) o[std::size_t(d)] += weight[std::size_t(p)] * in.value(p, h, d);
      }
      const long double zh = zg + zx;
      for (std::int32_t s = 0; s < cap_; ++s) {
        const std::int32_t v = m.pos[std::size_t(s)];
        if (v < 0) continue;
        const long double wv = weight[std::size_t(v)];
        // A = G \ {v}, R = X u {v}.
        const long double za = zg - wv, zr = zx + wv;
        if (m.count == 1) {  // G = {v}: nothing would be left to attend to (leave_one_out.hpp: +inf)
          total[std::size_t(s)] = INFINITY;
          continue;
        }
        long double e = 0.0L;
        for (std::int32_t d = 0; d < D; ++d) {
          const long double vv = wv * in.value(v, h, d);
          a[std::size_t(d)] = (out_g[std::size_t(d)] - vv) / za;
          r[std::size_t(d)] = (out_x[std::size_t(d)] + vv) / zr;
          const long double diff = a[std::size_t(d)] - r[std::size_t(d)];
          e += diff * diff;
        }
        const long double w = zr / zh;
        total[std::size_t(s)] += w * w * e;
      }
    }
    for (std::int32_t s = 0; s < cap_; ++s) {
      m.error[std::size_t(s)] = m.pos[std::size_t(s)] >= 0 ? total[std::size_t(s)] : 0.0L;
      m.score[std::size_t(s)] = static_cast<float>(m.error[std::size_t(s)]);
    }
  }

  /// The unprotected slots whose error is within a near tie (relative 1e-6)
  /// of the lowest (score, position); the model's own victim first.
  std::vector<std::int32_t> greedy_candidates(std::int32_t b, const model_head& m) const {
    const std::int32_t length = length_[std::size_t(b)];
    std::int32_t best = -1;
    for (std::int32_t s = 0; s < cap_; ++s) {
      const std::int32_t p = m.pos[std::size_t(s)];
      if (p < 0 || protected_position(p, length)) continue;
      if (best < 0 || m.error[std::size_t(s)] < m.error[std::size_t(best)] ||
          (m.error[std::size_t(s)] == m.error[std::size_t(best)] && p < m.pos[std::size_t(best)]))
        best = s;
    }
    std::vector<std::int32_t> out{best};
    const long double limit = m.error[std::size_t(best)] * (1.0L + 1e-6L) + 1e-37L;
    for (std::int32_t s = 0; s < cap_; ++s) {
      const std::int32_t p = m.pos[std::size_t(s)];
      if (s == best || p < 0 || protected_position(p, length)) continue;
      if (m.error[std::size_t(s)] <= limit) out.push_back(s);
    }
    return out;
  }

  bool greedy_search(std::int32_t b, std::int32_t h, const greedy_inputs& in, const model_head& start,
                     std::int32_t target, const std::set<std::int32_t>& want, model_head& found) {
    model_head m = start;
    score_greedy(b, h, in, m);
    ++greedy_rounds_;
    const std::vector<std::int32_t> ties = greedy_candidates(b, m);
    for (std::int32_t victim : ties) {
      model_head next = m;
      free_slot(next, victim);
      bool hit = false;
      if (next.count > target) {
        hit = greedy_search(b, h, in, next, target, want, found);
      } else {
        std::set<std::int32_t> kept;
        for (std::int32_t p : next.pos)
          if (p >= 0) kept.insert(p);
        hit = kept == want;
        if (hit) found = next;
      }
      if (hit) {
        near_ties_ += ties.size() > 1;
        return true;
      }
    }
    return false;
  }

  void greedy_search_first(std::int32_t b, std::int32_t h, const greedy_inputs& in, std::int32_t target) {
    model_head& m = heads_of_[index(b, h)];
    while (m.count > target) {
      score_greedy(b, h, in, m);
      free_slot(m, greedy_candidates(b, m).front());
    }
  }

  std::int32_t heads_, cap_;
  model_config c_;
  std::vector<std::int32_t> length_;
  std::vector<model_head> heads_of_;
  std::vector<std::int32_t> last_victims_;
  std::int64_t near_ties_ = 0, greedy_rounds_ = 0;
};

}  // namespace kvtest
