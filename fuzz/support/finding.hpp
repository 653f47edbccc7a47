#pragma once
// How a harness reports a finding: print what was violated and abort, so
// libFuzzer saves the input as a crash. Every check in the harnesses goes
// through here; nothing is ever "expected" and skipped silently.
#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvfuzz {

[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "\n==== kvevict fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void require(bool ok, const std::string& what) {
  if (!ok) finding(what);
}

}  // namespace kvfuzz
