#pragma once
// A batched state in host memory that an object owns: what
// batched_policy<Policy, device::host> and the per-sequence policies keep.
// Copies are the same state in memory of their own; moves keep the memory
// (and so every pointer of the view).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvevict/batch/state.hpp"

namespace kvevict {
namespace detail {

class host_state {
 public:
  host_state() = default;
  /// The state of `parts` for shape and rule, carved and not initialised.
  host_state(const policy_shape& shape, const decode_rule& rule, const history_extent& history,
             const state_parts& parts, const site& w) {
    std::size_t bytes = 0;
    carve_state(nullptr, shape, rule, history, parts, w, &bytes);
    memory_.resize(bytes);
    view_ = carve_state(memory_.data(), shape, rule, history, parts, w, nullptr);
  }
  host_state(const host_state& o) : memory_(o.memory_.size()) { copy_from(o); }
  host_state& operator=(const host_state& o) {
    if (this != &o) {
      memory_.resize(o.memory_.size());
      copy_from(o);
    }
    return *this;
  }
  host_state(host_state&&) noexcept = default;
  host_state& operator=(host_state&&) noexcept = default;

  const batch_state_view& view() const noexcept { return view_; }
  std::size_t bytes() const noexcept { return memory_.size(); }

 private:
  std::uintptr_t base() const noexcept {
    return state_carver::align_up(reinterpret_cast<std::uintptr_t>(memory_.data()));
  }
  /// o's bytes from its aligned base to ours: the carve's offsets are the same.
  void copy_from(const host_state& o) {
    if (o.memory_.empty()) {
      view_ = o.view_;
      return;
    }
    const std::size_t used = o.memory_.size() - (state_carver::alignment - 1);
    std::memcpy(reinterpret_cast<void*>(base()), reinterpret_cast<const void*>(o.base()), used);
    view_ = rebase_state(o.view_, static_cast<std::ptrdiff_t>(base()) - static_cast<std::ptrdiff_t>(o.base()));
  }

  std::vector<unsigned char> memory_;
  batch_state_view view_;
};

}  // namespace detail
}  // namespace kvevict
