#pragma once
// The exception hierarchy of kvevict's host API.
//
// Every public host entry point validates its arguments before it changes
// anything, so a thrown kvevict::error always leaves the cache and the policy
// exactly as they were (strong guarantee). Messages name the function, the
// argument and the offending value, e.g.
//   "kvevict::h2o_policy::observe: argument 'probs[3][17]' is NaN"
#include <sstream>
#include <stdexcept>
#include <string>

namespace kvevict {

/// Base of everything kvevict throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A shape, stride, pointer or configuration that cannot be used.
class invalid_argument : public error {
 public:
  using error::error;
};

/// A budget that does not fit the capacity, or whose parts do not add up.
class budget_error : public invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

/// An index (sequence, head, slot, page id, length) outside its range.
class out_of_range : public invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

/// NaN or infinity in probabilities, logits, LSE, queries or scores.
class non_finite_error : public invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

/// A call that is valid in itself but not in the current state
/// (e.g. prefill on a sequence that already holds tokens).
class state_error : public error {
 public:
  using error::error;
};

namespace detail {

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

/// Where an error happened: "class::function", streamed only when thrown.
struct site {
  const char* scope;
  const char* function;
  friend std::ostream& operator<<(std::ostream& out, const site& s) { return out << s.scope << "::" << s.function; }
};

/// Throws E with "kvevict::<where>: argument '<arg>' <what...>".
template <class E, class Where, class... What>
[[noreturn]] void fail(const Where& where, const std::string& arg, const What&... what) {
  throw E(concat("kvevict::", where, ": argument '", arg, "' ", what...));
}

/// Throws E with "kvevict::<where>: <what...>" for errors that are not about
/// one argument.
template <class E, class Where, class... What>
[[noreturn]] void fail_state(const Where& where, const What&... what) {
  throw E(concat("kvevict::", where, ": ", what...));
}

template <class Where>
void require_index(const Where& where, const char* arg, long long value, long long bound) {
  if (value < 0 || value >= bound)
    fail<out_of_range>(where, arg, "= ", value, " is outside [0, ", bound, ")");
}

template <class Where>
void require_not_null(const Where& where, const char* arg, const void* p) {
  if (p == nullptr) fail<invalid_argument>(where, arg, "is a null pointer");
}

template <class Where>
void require_positive(const Where& where, const char* arg, long long value) {
  if (value <= 0) fail<invalid_argument>(where, arg, "= ", value, " must be positive");
}

}  // namespace detail
}  // namespace kvevict
