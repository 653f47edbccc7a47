#pragma once
// What the host translation units (the bindings by topic, bindings.hpp,
// compiled by the C++ compiler, with nanobind) and the CUDA translation
// units (cuda_*.cu, compiled by nvcc, without nanobind) share: the policy
// spec, the enums the bindings expose, and the type-erased arrays and
// caches the bindings build from DLPack tensors. The
// bindings decide nothing; these types only carry pointers, extents and
// strides to kvevict's own calls.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kvevict/kvevict.hpp"

namespace kvevict_py {

using kvevict::batch_state_view;

/// Which kvevict policy a batched state belongs to.
enum class policy_kind : std::int32_t { h2o = 0, recent_window = 1, random = 2, exact_greedy = 3 };

/// A policy's shape and configuration, each field by its name: what every
/// call needs to carve the state out of its memory. The fields a policy
/// kind does not use stay at their defaults (h2o: heavy, recent, reduce,
/// decay, sinks; recent_window: sinks, window; random: budget, sinks,
/// recent, seed; exact_greedy: budget, recent, sinks; history: exact_greedy's
/// K/V history, or h2o's KeyDiff anchors with head_dim alone). Bound to
/// Python as kvevict._ext.PolicySpec; its int[] form for the torch.library
/// ops is the codec of spec_codec.hpp, the one place that orders the fields.
struct policy_spec {
  policy_kind kind = policy_kind::h2o;
  kvevict::policy_shape shape;
  std::int32_t heavy = 0;
  std::int32_t recent = 0;
  kvevict::group_reduce reduce = kvevict::group_reduce::sum;
  float decay = 1.0f;
  std::int32_t sinks = 0;
  std::int32_t window = 0;
  std::int32_t budget = 0;
  std::uint64_t seed = 0;
  kvevict::history_extent history;  ///< max_tokens, head_dim
};

/// Calls f(policy tag, config) with the kvevict policy type of `d`.
template <class Policy>
struct policy_tag {
  using type = Policy;
};

template <class F>
decltype(auto) with_policy(const policy_spec& d, F&& f) {
  switch (d.kind) {
    case policy_kind::h2o:
      return f(policy_tag<kvevict::h2o_policy>{}, kvevict::h2o_config{d.heavy, d.recent, d.reduce, d.decay, d.sinks});
    case policy_kind::recent_window:
      return f(policy_tag<kvevict::recent_window_policy>{}, kvevict::recent_window_config{d.sinks, d.window});
    case policy_kind::random:
      return f(policy_tag<kvevict::random_policy>{}, kvevict::random_config{d.budget, d.sinks, d.recent, d.seed});
    case policy_kind::exact_greedy:
      return f(policy_tag<kvevict::exact_greedy_policy>{}, kvevict::exact_greedy_config{d.budget, d.recent, d.sinks});
  }
  kvevict::detail::fail<kvevict::invalid_argument>(kvevict::detail::site{"python", "PolicySpec"}, "kind", "= ",
                                                   static_cast<int>(d.kind), " is not a policy kind (0..3)");
}

/// An enum member and its name: one table per enum gives both the names
/// in the library's messages and the members of its Python enum
/// (state.cpp, bind_enums), so no name is written twice.
template <class E>
struct enum_name {
  E value;
  const char* name;
};

template <class E, std::size_t N>
const char* name_in(const enum_name<E> (&table)[N], E value) noexcept {
  for (const enum_name<E>& entry : table)
    if (entry.value == value) return entry.name;
  return "?";
}

/// Element types of K/V, queries and new rows (fp8: K/V and new rows only).
enum class elem : std::int32_t { f32 = 0, f16 = 1, bf16 = 2, f8e4m3 = 3, f8e5m2 = 4 };

inline constexpr enum_name<elem> elem_names[] = {{elem::f32, "float32"},
                                                 {elem::f16, "float16"},
                                                 {elem::bf16, "bfloat16"},
                                                 {elem::f8e4m3, "float8_e4m3fn"},
                                                 {elem::f8e5m2, "float8_e5m2"}};

inline const char* elem_name(elem e) noexcept { return name_in(elem_names, e); }

inline bool is_fp8(elem e) noexcept { return e == elem::f8e4m3 || e == elem::f8e5m2; }

inline std::size_t elem_bytes(elem e) noexcept { return e == elem::f32 ? 4 : is_fp8(e) ? 1 : 2; }

template <class F>
decltype(auto) with_elem(elem e, F&& f) {
  switch (e) {
    case elem::f16: return f(kvevict::half{});
    case elem::bf16: return f(kvevict::bfloat16{});
    case elem::f8e4m3: return f(kvevict::fp8_e4m3{});
    case elem::f8e5m2: return f(kvevict::fp8_e5m2{});
    case elem::f32: break;
  }
  return f(float{});
}

/// The queries a cache of T takes besides float32: its own type, float32
/// again for fp8 (codes without a scale are not queries).
template <class T>
using own_query_t = std::conditional_t<kvevict::is_fp8_v<T>, float, T>;

/// A strided array of up to four dimensions (extents and strides in
/// elements), as DLPack gave it.
struct any_array {
  elem type = elem::f32;
  const void* data = nullptr;
  std::int32_t rank = 0;
  std::int32_t extents[4] = {};
  std::int64_t strides[4] = {};

  template <class T, int R>
  kvevict::tensor_view<const T, R> view() const noexcept {
    kvevict::tensor_view<const T, R> v;
    v.data = static_cast<const T*>(data);
    for (int d = 0; d < R; ++d) {
      v.extents[d] = extents[d];
      v.strides[d] = strides[d];
    }
    return v;
  }
};

/// The cache layouts the Python API accepts (CacheView in cache.py).
enum class cache_layout : std::int32_t { bhsd = 0, bshd = 1, paged_nhd = 2, paged_hnd = 3 };

/// One layer's K and V buffers: a kv_view of any element type and layout.
struct any_cache {
  elem type = elem::f32;
  bool paged = false;
  void* k = nullptr;
  void* v = nullptr;
  kvevict::strided_layout strided;
  kvevict::paged_layout pages;
  std::int32_t num_seqs = 0, num_heads = 0, capacity = 0, head_dim = 0;
  kvevict::kv_scales scales;  ///< fp8 only: the scales array's rows (parse_scales)

  template <class T, class Layout>
  kvevict::kv_view<T, Layout> view(const Layout& layout) const noexcept {
    return {static_cast<T*>(k), static_cast<T*>(v), layout, num_seqs, num_heads, capacity, head_dim, scales};
  }
};

/// Calls f(kv_view<T, Layout>) for the cache's element type and layout.
template <class F>
decltype(auto) visit_cache(const any_cache& c, F&& f) {
  return with_elem(c.type, [&](auto t) -> decltype(auto) {
    using T = decltype(t);
    if (c.paged) return f(c.view<T>(c.pages));
    return f(c.view<T>(c.strided));
  });
}

/// Calls f(Q{}, kv_view<T, Layout>) for queries `q` over cache `c`. Queries
/// are float32 or the cache's own type (what attention kernels produce;
/// float32 only for fp8); the bindings refuse other pairs before this is
/// reached, which keeps the number of CUDA kernel instantiations down.
template <class F>
decltype(auto) visit_queries(const any_array& q, const any_cache& c, F&& f) {
  return visit_cache(c, [&](auto cache) -> decltype(auto) {
    using T = typename decltype(cache)::element_type;
    if (q.type == elem::f32) return f(float{}, cache);
    return f(own_query_t<T>{}, cache);
  });
}

/// The inputs of a decode step (observe_evict): probs [B][Hq][W],
/// head_scores [B][Hkv][W], logits [B][Hq][W] with lse; queries with lse
/// and the cache; the cached keys alone (key norms, KeyDiff).
enum class decode_input : std::int32_t {
  probs = 0,
  head_scores = 1,
  logits = 2,
  queries = 3,
  key_norms = 4,
  key_diff = 5,
};

inline constexpr enum_name<decode_input> decode_input_names[] = {
    {decode_input::probs, "probs"},         {decode_input::head_scores, "head_scores"},
    {decode_input::logits, "logits"},       {decode_input::queries, "queries"},
    {decode_input::key_norms, "key_norms"}, {decode_input::key_diff, "key_diff"}};

inline const char* decode_input_name(decode_input kind) noexcept { return name_in(decode_input_names, kind); }

/// The inputs of a batched prefill (key_norms, key_diff: the cached keys
/// themselves, kvevict/policy/key_diff.hpp for KeyDiff; window_*: SnapKV's
/// observation window, kvevict/policy/snapkv.hpp).
enum class prefill_input : std::int32_t {
  probs = 0,
  sums = 1,
  queries = 2,
  none = 3,
  key_norms = 4,
  window_probs = 5,
  window_logits = 6,
  window_queries = 7,
  key_diff = 8,
};

inline constexpr enum_name<prefill_input> prefill_input_names[] = {
    {prefill_input::probs, "probs"},
    {prefill_input::sums, "sums"},
    {prefill_input::queries, "queries"},
    {prefill_input::none, "none"},
    {prefill_input::key_norms, "key_norms"},
    {prefill_input::window_probs, "window_probs"},
    {prefill_input::window_logits, "window_logits"},
    {prefill_input::window_queries, "window_queries"},
    {prefill_input::key_diff, "key_diff"}};

inline const char* prefill_input_name(prefill_input kind) noexcept { return name_in(prefill_input_names, kind); }

inline bool is_window(prefill_input kind) noexcept {
  return kind == prefill_input::window_probs || kind == prefill_input::window_logits ||
         kind == prefill_input::window_queries;
}

/// Raised by the CUDA translation units for a failed CUDA runtime call
/// (kvevict::gpu::cuda_error needs the CUDA headers to name).
class cuda_failure : public kvevict::error {
 public:
  using kvevict::error::error;
};

}  // namespace kvevict_py
