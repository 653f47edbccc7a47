#pragma once
// h2o configurations for the seeded tests: H2O itself, TOVA (decay 0) and
// decays between, with and without attention sinks.
#include <cstdint>

#include "kvevict/policy/h2o.hpp"

namespace kvtest {

/// pick(lo, hi) draws an int in [lo, hi].
template <class Pick>
kvevict::h2o_config draw_h2o_config(Pick pick, int max_heavy, int max_recent) {
  kvevict::h2o_config c{pick(0, max_heavy), pick(1, max_recent), static_cast<kvevict::group_reduce>(pick(0, 2))};
  const float decays[] = {1.0f, 1.0f, 0.0f, 0.5f, 0.9f};
  c.decay = decays[pick(0, 4)];
  c.sinks = pick(0, 3) == 0 ? pick(1, 2) : 0;
  return c;
}

}  // namespace kvtest
