#pragma once
// The codec of a policy_spec as a list of integers: the `desc` argument of
// the torch.library ops, whose schema cannot carry a class. The one table
// below names every field and fixes its place; PolicySpec.encode() and
// PolicySpec.decode() are its only readers, so no other code (Python
// included) knows a position. A new field is one line of the table.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

#include "common.hpp"

namespace kvevict_py {

/// One field of policy_spec as an int64: its name, the integers it accepts
/// (decode and the PolicySpec constructor check them), how to read and write it.
struct spec_field {
  const char* name;
  std::int64_t lo, hi;
  std::int64_t (*get)(const policy_spec&);
  void (*set)(policy_spec&, std::int64_t);
};

namespace spec_codec_detail {
constexpr std::int64_t i32_lo = std::numeric_limits<std::int32_t>::min();
constexpr std::int64_t i32_hi = std::numeric_limits<std::int32_t>::max();
inline std::int64_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float bits_float(std::int64_t v) {
  const auto u = static_cast<std::uint32_t>(v);
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
}  // namespace spec_codec_detail

#define KVEVICT_PY_SPEC_I32(field, member)                                                         \
  spec_field {                                                                                     \
    #field, spec_codec_detail::i32_lo, spec_codec_detail::i32_hi,                                  \
        [](const policy_spec& s) -> std::int64_t { return s.member; },                             \
        [](policy_spec& s, std::int64_t v) { s.member = static_cast<std::int32_t>(v); }           \
  }

/// The fields in encoding order.
inline const spec_field spec_fields[] = {
    {"kind", 0, 3, [](const policy_spec& s) -> std::int64_t { return static_cast<std::int64_t>(s.kind); },
     [](policy_spec& s, std::int64_t v) { s.kind = static_cast<policy_kind>(v); }},
    KVEVICT_PY_SPEC_I32(num_seqs, shape.num_seqs),
    KVEVICT_PY_SPEC_I32(num_kv_heads, shape.num_kv_heads),
    KVEVICT_PY_SPEC_I32(num_q_heads, shape.num_q_heads),
    KVEVICT_PY_SPEC_I32(capacity, shape.capacity),
    KVEVICT_PY_SPEC_I32(first_kv_head, shape.first_kv_head),
    KVEVICT_PY_SPEC_I32(heavy, heavy),
    KVEVICT_PY_SPEC_I32(recent, recent),
    {"reduce", 0, 2, [](const policy_spec& s) -> std::int64_t { return static_cast<std::int64_t>(s.reduce); },
     [](policy_spec& s, std::int64_t v) { s.reduce = static_cast<kvevict::group_reduce>(v); }},
    // float32 bits: the library validates the value (NaN, outside [0, 1]).
    {"decay", 0, 0xFFFFFFFFll, [](const policy_spec& s) { return spec_codec_detail::float_bits(s.decay); },
     [](policy_spec& s, std::int64_t v) { s.decay = spec_codec_detail::bits_float(v); }},
    KVEVICT_PY_SPEC_I32(sinks, sinks),
    KVEVICT_PY_SPEC_I32(window, window),
    KVEVICT_PY_SPEC_I32(budget, budget),
    // uint64 as the int64 of the same bits (torch's int is int64).
    {"seed", std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max(),
     [](const policy_spec& s) { return static_cast<std::int64_t>(s.seed); },
     [](policy_spec& s, std::int64_t v) { s.seed = static_cast<std::uint64_t>(v); }},
    KVEVICT_PY_SPEC_I32(max_tokens, history.max_tokens),
    KVEVICT_PY_SPEC_I32(head_dim, history.head_dim),
};

#undef KVEVICT_PY_SPEC_I32

constexpr std::size_t spec_field_count = sizeof(spec_fields) / sizeof(spec_fields[0]);

/// The field named `name`, or nullptr.
inline const spec_field* find_spec_field(std::string_view name) noexcept {
  for (const spec_field& f : spec_fields)
    if (name == f.name) return &f;
  return nullptr;
}

/// Sets field `f` of `s` to `v` after checking it fits (out_of_range naming
/// the field otherwise).
inline void set_spec_field(policy_spec& s, const spec_field& f, std::int64_t v, const char* arg_prefix = "") {
  if (v < f.lo || v > f.hi)
    kvevict::detail::fail<kvevict::out_of_range>(kvevict::detail::site{"python", "PolicySpec"},
                                                 kvevict::detail::concat(arg_prefix, f.name), "= ", v,
                                                 " is outside [", f.lo, ", ", f.hi, "]");
  f.set(s, v);
}

inline std::vector<std::int64_t> encode_spec(const policy_spec& s) {
  std::vector<std::int64_t> v;
  v.reserve(spec_field_count);
  for (const spec_field& f : spec_fields) v.push_back(f.get(s));
  return v;
}

inline policy_spec decode_spec(const std::vector<std::int64_t>& v) {
  if (v.size() != spec_field_count) {
    std::string names;
    for (const spec_field& f : spec_fields) names += (names.empty() ? "" : ", ") + std::string(f.name);
    kvevict::detail::fail<kvevict::invalid_argument>(kvevict::detail::site{"python", "PolicySpec.decode"}, "values",
                                                     "has ", v.size(), " entries, expected ", spec_field_count, " (",
                                                     names, ")");
  }
  policy_spec s;
  for (std::size_t i = 0; i < spec_field_count; ++i) set_spec_field(s, spec_fields[i], v[i], "values.");
  return s;
}

}  // namespace kvevict_py
