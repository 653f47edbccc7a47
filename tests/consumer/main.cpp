// Runs one decode step through the installed headers and checks the result,
// so the package test fails if the headers are missing or broken.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <vector>

int main() {
  kvevict::policy_shape shape;
  shape.capacity = 3;
  kvevict::h2o_policy policy(shape, kvevict::h2o_config{1, 1});
  const std::vector<float> probs = {0.7f, 0.2f, 0.1f};
  for (int step = 0; step < 3; ++step) {
    policy.append(0);
    policy.observe(0, kvevict::decode_probs{kvevict::make_tensor_view(probs.data(), 1, 3)});
    policy.evict(0);
  }
  // Slot 0 (position 0) is the heavy hitter; slot 1 (position 1, score 0.2)
  // loses to the newest token, which the recent window protects.
  const bool ok = policy.slots().position(0, 0, 0) == 0 && policy.slots().position(0, 0, 1) == -1 &&
                  policy.slots().position(0, 0, 2) == 2 && KVEVICT_VERSION == 100;
  std::puts(ok ? "kvevict consumer: ok" : "kvevict consumer: WRONG");
  return ok ? 0 : 1;
}
