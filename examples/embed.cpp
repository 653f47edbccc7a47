// The README's embedding example: one layer, one sequence, H2O at a budget
// of 4 tokens (2 heavy + 2 recent) over a bf16 BHSD cache the engine owns.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <vector>

int main() {
  using namespace kvevict;
  const int heads = 2, head_dim = 8;
  h2o_policy policy({/*seqs*/ 1, heads, /*q heads*/ heads, /*capacity*/ 5}, h2o_config{2, 2});
  auto cache = make_bhsd_cache<bfloat16>(1, heads, 5, head_dim);  // or a kv_view of your buffers

  // Attention weights per step: position 0 is a sink and position 3 a heavy hitter.
  const float weight[6] = {0.5f, 0.05f, 0.05f, 0.3f, 0.05f, 0.05f};
  std::vector<bfloat16> k(heads * head_dim), v(heads * head_dim);
  for (int step = 0; step < 6; ++step) {
    int slots[heads];
    for (int h = 0; h < heads; ++h) slots[h] = policy.next_slot(0, h);              // 1. where it goes
    scatter(cache.view(), 0, slots, make_tensor_view<const bfloat16>(k.data(), heads, head_dim),
            make_tensor_view<const bfloat16>(v.data(), heads, head_dim));           // 2. write K/V
    policy.append(0);
    std::vector<float> probs(heads * 5, 0.0f);                                      // 3. your attention
    for (int h = 0; h < heads; ++h)
      for (int s = 0; s < 5; ++s)
        if (int p = policy.slots().position(0, h, s); p >= 0) probs[h * 5 + s] = weight[p];
    policy.observe(0, decode_probs{make_tensor_view<const float>(probs.data(), heads, 5)});  // 4. scores
    policy.evict(0);                                                                // 5. free one slot
  }
  std::printf("kept positions:");
  for (int p = 0; p < 6; ++p)
    if (policy.slots().slot_of(0, 0, p) >= 0) std::printf(" %d", p);
  std::printf("\n");
}
