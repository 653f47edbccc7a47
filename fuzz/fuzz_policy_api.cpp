// libFuzzer harness of kvevict's policy API: the per-sequence policies
// (sequence_driver.hpp, built in policy_api_sequence.cpp) and the batched
// host API (batched_driver.hpp, policy_api_batched.cpp), for every policy x
// layout (BHSD, BSHD, paged NHD / HND) x dtype (float, half, bfloat16). The
// first bytes choose the API, the combination, the shape and the
// configuration; the rest drive up to 64 calls. docs/reliability.md,
// "Fuzzing", says what is checked and how to run it.
#include <cstddef>
#include <cstdint>

#include "policy_dispatch.hpp"
#include "support/fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvfuzz::fuzz_input in(data, size);
  if (in.one_in(2)) kvfuzz::run_batched_api(in);
  else kvfuzz::run_sequence_api(in);
  return 0;
}
