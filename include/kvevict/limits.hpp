#pragma once
// The largest allocation kvevict makes on its own: what a policy's state or
// a kv_cache may need. A shape beyond it is a unit mistake (a token count
// passed as a byte count, a product that overflowed in the caller), not a
// workload, so it is refused with the library's error before anything is
// allocated, instead of ending in std::bad_alloc or in an overcommitted
// allocation that the OOM killer ends later.
#include <cstdint>

#include "kvevict/error.hpp"

namespace kvevict {

/// 1 TiB: far above any one layer's cache or state (a 128K-token context of
/// 256 sequences x 32 KV heads x head_dim 128 in bfloat16 is 64 GiB of K and V
/// per layer), far below what 64-bit sizes and offsets can address.
inline constexpr std::uint64_t max_allocation_bytes = std::uint64_t{1} << 40;

namespace detail {

/// Throws invalid_argument naming `arg` when `bytes` (an exact product in
/// long double, so it cannot overflow) exceeds max_allocation_bytes.
template <class Where>
void require_allocation(const Where& where, const char* arg, long double bytes) {
  if (bytes > static_cast<long double>(max_allocation_bytes))
    fail<invalid_argument>(where, arg, "needs ", bytes / (1024.0L * 1024.0L * 1024.0L),
                           " GiB, above kvevict::max_allocation_bytes (1 TiB)");
}

}  // namespace detail
}  // namespace kvevict
