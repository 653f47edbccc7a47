#pragma once
// Switches that steer the policy harness around call patterns of defects
// that are already reported and being fixed, so a long run can keep looking
// for new ones. All are OFF by default (CI runs with none set); each is an
// environment variable read once at start-up, set to 1 to skip:
//
//   KVEVICT_FUZZ_SKIP_BATCHED_OBSERVE_WIDE_HEADS
//     batched_observe_evict when an active head holds more slots than the
//     input's slot extent (after batched_append_tokens went past budget + 1):
//     observe read past its input.
//   KVEVICT_FUZZ_SKIP_BATCHED_SCORELESS_PREFILL
//     batched_prefill without scores (recent_window, random): it formed an
//     offset from a null input pointer (UBSan).
//   KVEVICT_FUZZ_SKIP_REPEATED_EVICT
//     a second per-sequence evict after one observe while the sequence is
//     still above its budget (after a multi-token append): it left two holes.
#include <cstdlib>
#include <cstring>

namespace kvfuzz {

struct known_defect_skips {
  bool batched_observe_wide_heads = false;
  bool batched_scoreless_prefill = false;
  bool repeated_evict = false;
};

inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") != 0 && v[0] != '\0';
}

inline const known_defect_skips& skips() {
  static const known_defect_skips s{env_flag("KVEVICT_FUZZ_SKIP_BATCHED_OBSERVE_WIDE_HEADS"),
                                    env_flag("KVEVICT_FUZZ_SKIP_BATCHED_SCORELESS_PREFILL"),
                                    env_flag("KVEVICT_FUZZ_SKIP_REPEATED_EVICT")};
  return s;
}

}  // namespace kvfuzz
