#pragma once
// Runs one library call under the harness's rules: a kvevict::error must
// leave the state byte for byte as it was (compared with a snapshot taken
// just before); any other exception is a finding. Returns whether the call
// succeeded.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "finding.hpp"
#include "kvevict/error.hpp"
#include "state_snapshot.hpp"

namespace kvfuzz {

/// KVEVICT_FUZZ_TRACE=1 prints every call and its outcome: how a saved
/// input is turned into a written-out repro.
inline bool tracing() {
  static const bool on = [] {
    const char* v = std::getenv("KVEVICT_FUZZ_TRACE");
    return v != nullptr && v[0] != '\0' && std::string(v) != "0";
  }();
  return on;
}

template <class Take, class Call>
bool guarded(const std::string& what, Take take, Call call) {
  const snapshot before = take();
  try {
    call();
    if (tracing()) std::fprintf(stderr, "call %s: ok\n", what.c_str());
    return true;
  } catch (const kvevict::error& e) {
    if (tracing()) std::fprintf(stderr, "call %s: refused: %s\n", what.c_str(), e.what());
    const std::string changed = before.first_difference(take());
    if (!changed.empty()) finding(what + " threw \"" + e.what() + "\" but changed " + changed);
    return false;
  } catch (const std::exception& e) {
    finding(what + " threw an exception outside kvevict::error: " + e.what());
  } catch (...) {
    finding(what + " threw something that is not a std::exception");
  }
}

/// For calls that only construct (no state to compare): kvevict::error is
/// a refusal, anything else a finding.
template <class Call>
bool guarded_construct(const std::string& what, Call call) {
  try {
    call();
    return true;
  } catch (const kvevict::error&) {
    return false;
  } catch (const std::exception& e) {
    finding(what + " threw an exception outside kvevict::error: " + e.what());
  } catch (...) {
    finding(what + " threw something that is not a std::exception");
  }
}

}  // namespace kvfuzz
