#pragma once
// The demo's synthetic decode stream, built to have the structure the H2O
// paper measured in real models:
//   - attention sinks: the first few tokens' keys align with a direction every
//     query shares, so they draw attention all along;
//   - heavy hitters: a pool of "popular" keys, each introduced at some point
//     of the stream, and later queries align with one of them drawn from a
//     Zipf distribution, so a few tokens receive most of the attention;
//   - topics persist: a query keeps its predecessor's popular key with
//     probability `persistence`, as text stays on a subject for a while;
//   - locality: each query also leans towards the previous token's key.
// Everything is a pure function of (seed, sequence, head, position), so every
// policy sees the same stream.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace demo {

struct workload_config {
  std::int32_t head_dim = 128;
  std::int32_t sinks = 4;            // sink tokens at positions [0, sinks)
  std::int32_t popular = 64;         // popular keys per (sequence, head)
  double zipf_exponent = 1.1;        // popularity of the k-th popular key ~ 1 / k^s
  double popular_fraction = 0.05;    // share of positions that carry a popular key
  double persistence = 0.9;          // chance a query keeps the previous query's popular key
  // Directions have norm head_dim^(1/4), so with the usual 1/sqrt(head_dim)
  // softmax scale a key strength a and a query strength b add a*b to a logit.
  float sink_key = 2.0f;       // sinks along the shared direction
  float sink_query = 2.5f;     // every query along the shared direction
  float popular_key = 2.5f;    // a popular key along its own direction
  float popular_query = 3.2f;  // a query along the popular key it picked
  float locality = 2.0f;       // query along the previous token's key
  float noise = 0.5f;          // per-coordinate Gaussian noise of keys and queries
  std::uint64_t seed = 1;
};

/// One (sequence, KV head) stream of keys, values and queries.
class head_stream {
 public:
  head_stream(const workload_config& c, std::int32_t sequence, std::int32_t head, std::int32_t length)
      : c_(c), rng_(static_cast<std::uint32_t>(c.seed * 1000003u + std::uint64_t(sequence) * 9176u + head)) {
    const std::int32_t d = c.head_dim;
    sink_dir_ = unit(d);
    for (std::int32_t j = 0; j < c.popular; ++j) popular_dir_.push_back(unit(d));
    // Popular key j sits at a random position, so heavy hitters appear all
    // along the stream; queries only use those already seen.
    std::uniform_int_distribution<std::int32_t> pos(c.sinks, std::max(c.sinks, length - 1));
    popular_at_.assign(std::size_t(length), -1);
    const std::int32_t count = std::min<std::int32_t>(
        c.popular, std::max<std::int32_t>(1, static_cast<std::int32_t>(c.popular_fraction * length)));
    for (std::int32_t j = 0; j < count; ++j) popular_at_[std::size_t(pos(rng_))] = j;
    double total = 0.0;
    for (std::int32_t j = 0; j < c.popular; ++j) total += 1.0 / std::pow(j + 1.0, c.zipf_exponent);
    double acc = 0.0;
    for (std::int32_t j = 0; j < c.popular; ++j) {
      acc += 1.0 / std::pow(j + 1.0, c.zipf_exponent) / total;
      zipf_cdf_.push_back(acc);
    }
  }

  /// Key and value of the token at `position` (positions come in order).
  void token(std::int32_t position, float* key, float* value) {
    const std::int32_t d = c_.head_dim;
    std::normal_distribution<float> n(0.0f, c_.noise);
    const std::int32_t j = popular_at_[std::size_t(position)];
    for (std::int32_t i = 0; i < d; ++i) {
      float k = n(rng_);
      if (position < c_.sinks) k += c_.sink_key * sink_dir_[std::size_t(i)];
      if (j >= 0) k += c_.popular_key * popular_dir_[std::size_t(j)][std::size_t(i)];
      key[i] = k;
      value[i] = std::normal_distribution<float>(0.0f, 1.0f)(rng_);
    }
    if (j >= 0) seen_.push_back(j);
    last_key_.assign(key, key + d);
  }

  /// A query of the token just produced: the sink direction, a Zipf-chosen
  /// popular key already seen, and the previous key.
  void query(float* q) {
    const std::int32_t d = c_.head_dim;
    std::normal_distribution<float> n(0.0f, c_.noise);
    std::int32_t j = -1;
    if (topic_ >= 0 && std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < c_.persistence) j = topic_;
    if (j < 0 && !seen_.empty()) {
      // Draw Zipf ranks until one that has appeared (ranks are popularity).
      std::uniform_real_distribution<double> u(0.0, 1.0);
      for (int tries = 0; tries < 8 && j < 0; ++tries) {
        const double x = u(rng_);
        std::int32_t r = 0;
        while (r + 1 < c_.popular && zipf_cdf_[std::size_t(r)] < x) ++r;
        for (std::int32_t s : seen_)
          if (s == r) j = r;
      }
    }
    topic_ = j;
    float norm_last = 0.0f;
    for (float x : last_key_) norm_last += x * x;
    const float toward_last = c_.locality * std::pow(static_cast<float>(d), 0.25f) / (std::sqrt(norm_last) + 1e-6f);
    for (std::int32_t i = 0; i < d; ++i) {
      float x = n(rng_) + c_.sink_query * sink_dir_[std::size_t(i)];
      if (j >= 0) x += c_.popular_query * popular_dir_[std::size_t(j)][std::size_t(i)];
      x += toward_last * last_key_[std::size_t(i)];
      q[i] = x;
    }
  }

 private:
  std::vector<float> unit(std::int32_t d) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> v(static_cast<std::size_t>(d));
    float norm = 0.0f;
    for (float& x : v) {
      x = n(rng_);
      norm += x * x;
    }
    norm = std::sqrt(norm);
    for (float& x : v) x = x / norm * std::pow(static_cast<float>(d), 0.25f);
    return v;
  }

  workload_config c_;
  std::mt19937 rng_;
  std::vector<float> sink_dir_;
  std::vector<std::vector<float>> popular_dir_;
  std::vector<std::int32_t> popular_at_, seen_;
  std::vector<double> zipf_cdf_;
  std::vector<float> last_key_;
  std::int32_t topic_ = -1;
};

}  // namespace demo
