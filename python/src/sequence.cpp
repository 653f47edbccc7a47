// The per-sequence policies (host), for engines that step one sequence at a time and as the
// reference the batched paths are checked against.
#include "bindings.hpp"

#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <initializer_list>
#include <vector>

namespace kvevict_py {

namespace {

// ---- per-sequence policies (host), for engines that step one sequence at a
// time and as the reference the batched paths are checked against ----------

template <class Policy>
class SequencePolicy {
 public:
  using config_type = typename kvevict::policy_traits<Policy>::config_type;
  explicit SequencePolicy(const policy_spec& spec) : p_(spec.shape, config_of(spec)) {}

  std::int32_t append(std::int32_t b) { return p_.append(b); }
  void observe_probs(std::int32_t b, nb::handle probs) {
    p_.observe(b, kvevict::decode_probs{input<2>(probs, "observe", "probs", "[num_q_heads][slots]")});
  }
  void observe_head_scores(std::int32_t b, nb::handle scores) {
    p_.observe(b, kvevict::head_scores{input<2>(scores, "observe", "scores", "[num_kv_heads][slots]")});
  }
  void observe_logits(std::int32_t b, nb::handle logits, nb::handle lse, float scale, kvevict::lse_base base) {
    p_.observe(b, kvevict::decode_logits{input<2>(logits, "observe", "logits", "[num_q_heads][slots]"),
                                         input<1>(lse, "observe", "lse", "[num_q_heads]"), scale,
                                         parse_base(base, "observe")});
  }
  /// Key norms of sequence b's cached keys (k_cache in `layout`, as the batched calls take it).
  void observe_key_norms(std::int32_t b, cache_layout layout, nb::handle k, nb::handle page_table, nb::handle scales) {
    const any_cache cache = parse_keys(layout, k, page_table, scales, device{}, p_.shape().capacity, "observe");
    visit_cache(cache, [&](auto view) {
      using V = decltype(view);
      p_.observe(b, kvevict::key_norms<typename V::element_type, typename V::layout_type>{view});
    });
  }
  /// KeyDiff: each occupied slot's score becomes -cos(k, the running anchor
  /// of b's cached keys). Only h2o_policy has it, as for the prefill.
  void observe_key_diff(std::int32_t b, cache_layout layout, nb::handle k, nb::handle page_table, nb::handle scales) {
    const any_cache cache = parse_keys(layout, k, page_table, scales, device{}, p_.shape().capacity, "observe");
    if constexpr (std::is_same_v<Policy, kvevict::h2o_policy>) {
      visit_cache(cache, [&](auto view) {
        using V = decltype(view);
        p_.observe(b, kvevict::key_diff<typename V::element_type, typename V::layout_type>{view});
      });
    } else {
      (void)b;
      fail_arg("observe", "in", concat("is key_diff, which the per-sequence ", kvevict::policy_traits<Policy>::name,
                                       " does not take (h2o_policy does)"));
    }
  }
  void skip_observe(std::int32_t b) { p_.skip_observe(b); }
  /// The freed slot of each KV head, -1 where nothing was evicted.
  std::vector<std::int32_t> evict(std::int32_t b) {
    std::vector<std::int32_t> victims(std::size_t(p_.shape().num_kv_heads), -1);
    p_.evict(b, victims.data());
    return victims;
  }
  std::int32_t prefill_column_sums(std::int32_t b, std::int32_t length, nb::handle sums) {
    return p_.prefill(b, length, kvevict::prefill_column_sums{input<2>(sums, "prefill", "column_sums",
                                                                       "[num_q_heads][length]")})
        .kept;
  }
  /// Key-norm prefill of sequence b's prompt in slots [0, length) of the
  /// cache (k, v in `layout`, as the batched calls take them): the kept
  /// rows move to slots [0, kept). Returns (kept, reclaimable_pages).
  std::pair<std::int32_t, std::int32_t> prefill_key_norms(std::int32_t b, std::int32_t length, cache_layout layout,
                                                          nb::handle k, nb::handle v, nb::handle page_table,
                                                          nb::handle scales) {
    const any_cache cache = parse_cache(layout, k, v, page_table, scales, device{}, p_.shape().capacity, "prefill");
    return visit_cache(cache, [&](auto view) {
      using V = decltype(view);
      const kvevict::prefill_result r =
          p_.prefill(b, length, kvevict::key_norms<typename V::element_type, typename V::layout_type>{view});
      return std::pair<std::int32_t, std::int32_t>{r.kept, r.reclaimable_pages};
    });
  }
  /// KeyDiff prefill of sequence b's prompt in slots [0, length) of the
  /// cache (k, v in `layout`, as the batched calls take them): the kept
  /// rows move to slots [0, kept). Returns (kept, reclaimable_pages). Only
  /// h2o_policy has it (the library's per-sequence recent_window and random
  /// policies take no KeyDiff input); the others are refused here, after
  /// the cache's checks.
  std::pair<std::int32_t, std::int32_t> prefill_key_diff(std::int32_t b, std::int32_t length, cache_layout layout,
                                                         nb::handle k, nb::handle v, nb::handle page_table,
                                                         nb::handle scales) {
    const char* call = "prefill";
    const any_cache cache = parse_cache(layout, k, v, page_table, scales, device{}, p_.shape().capacity, call);
    if constexpr (std::is_same_v<Policy, kvevict::h2o_policy>) {
      return visit_cache(cache, [&](auto view) {
        using V = decltype(view);
        const kvevict::prefill_result r =
            p_.prefill(b, length, kvevict::key_diff<typename V::element_type, typename V::layout_type>{view});
        return std::pair<std::int32_t, std::int32_t>{r.kept, r.reclaimable_pages};
      });
    } else {
      (void)b;
      (void)length;
      fail_arg(call, "in", concat("is key_diff, which the per-sequence ", kvevict::policy_traits<Policy>::name,
                                  " does not take (only h2o_policy does)"));
    }
  }
  /// SnapKV prefill of sequence b's prompt in slots [0, length) of the
  /// cache (k, v in `layout`): input window_probs [Hq][window][>= length],
  /// window_logits [Hq][window][>= length] with lse [Hq][window],
  /// window_queries [Hq][window][head_dim] with lse [Hq][window]; the window
  /// is the input's extent in dimension 1. The kept rows
  /// move to slots [0, kept). Returns (kept, reclaimable_pages). Only
  /// h2o_policy has it; the others are refused by the library's own check.
  std::pair<std::int32_t, std::int32_t> prefill_snapkv(std::int32_t b, std::int32_t length, prefill_input input,
                                                       nb::handle x_obj, nb::handle lse_obj, float scale,
                                                       kvevict::lse_base base_code, std::int32_t pool_width,
                                                       kvevict::snap_pooling pooling, cache_layout layout, nb::handle k,
                                                       nb::handle v, nb::handle page_table, nb::handle scales) {
    const char* call = "prefill";
    if (!is_window(input))
      fail_arg(call, "input",
               concat("= ", prefill_input_name(input), " is not window_probs, window_logits or window_queries"));
    const int which = input == prefill_input::window_probs ? 0 : input == prefill_input::window_logits ? 1 : 2;
    const any_cache cache = parse_cache(layout, k, v, page_table, scales, device{}, p_.shape().capacity, call);
    any_array x;
    kvevict::tensor_view<const float, 2> lse;
    if (which == 2) {
      x = parse_queries<3>(x_obj, cache, device{}, call, "[num_q_heads][window][head_dim]");
    } else {
      x = float_array<3>(x_obj, device{}, call, which == 0 ? "probs" : "logits", "[num_q_heads][window][>= length]");
    }
    if (which != 0) {
      if (lse_obj.is_none()) fail_arg(call, "lse", which == 1 ? "is required with logits" : "is required with queries");
      lse = float_input<2>(lse_obj, device{}, call, "lse", "[num_q_heads][window]");
    }
    const kvevict::lse_base base = parse_base(base_code, call);
    const kvevict::snap_window snap = parse_snap(x.extents[1], pool_width, pooling);
    if constexpr (std::is_same_v<Policy, kvevict::h2o_policy>) {
      return visit_cache(cache, [&](auto view) {
        using T = typename decltype(view)::element_type;
        kvevict::prefill_result r;
        if (which == 0) {
          r = p_.prefill(b, length, kvevict::window_probs{x.view<float, 3>(), snap}, view);
        } else if (which == 1) {
          r = p_.prefill(b, length, kvevict::window_logits{x.view<float, 3>(), lse, scale, base, snap}, view);
        } else if (x.type == elem::f32) {
          r = p_.prefill(b, length, kvevict::window_queries<float>{x.view<float, 3>(), lse, scale, base, snap}, view);
        } else {
          r = p_.prefill(b, length, kvevict::window_queries<own_query_t<T>>{x.view<own_query_t<T>, 3>(), lse, scale,
                                                                            base, snap}, view);
        }
        return std::pair<std::int32_t, std::int32_t>{r.kept, r.reclaimable_pages};
      });
    } else {
      (void)scale;
      (void)base;
      (void)b;
      (void)length;
      // The library's refusal of a policy that does not keep by score.
      kvevict::detail::require_snap_window(site{"python", call}, "in.snap", snap, p_.rule());
      fail_arg(call, "in.snap", "asks for SnapKV scores, which only h2o uses");
    }
  }
  void reset(std::int32_t b) { p_.reset(b); }
  std::int32_t length(std::int32_t b) const { return p_.length(b); }
  std::int32_t budget() const { return p_.budget(); }

  /// Copies of the slot table: positions [B][H][capacity], counts [B][H],
  /// scores [B][H][capacity] (0 for free slots).
  nb::ndarray<nb::numpy, std::int32_t> positions() const {
    const auto& s = p_.shape();
    auto* out = new std::int32_t[std::size_t(s.num_seqs) * s.num_kv_heads * s.capacity];
    std::size_t i = 0;
    for (std::int32_t b = 0; b < s.num_seqs; ++b)
      for (std::int32_t h = 0; h < s.num_kv_heads; ++h)
        for (std::int32_t x = 0; x < s.capacity; ++x) out[i++] = p_.slots().position(b, h, x);
    return owned(out, {std::size_t(s.num_seqs), std::size_t(s.num_kv_heads), std::size_t(s.capacity)});
  }
  nb::ndarray<nb::numpy, std::int32_t> counts() const {
    const auto& s = p_.shape();
    auto* out = new std::int32_t[std::size_t(s.num_seqs) * s.num_kv_heads];
    std::size_t i = 0;
    for (std::int32_t b = 0; b < s.num_seqs; ++b)
      for (std::int32_t h = 0; h < s.num_kv_heads; ++h) out[i++] = p_.slots().count(b, h);
    return owned(out, {std::size_t(s.num_seqs), std::size_t(s.num_kv_heads)});
  }
  nb::ndarray<nb::numpy, float> scores() const {
    const auto& s = p_.shape();
    auto* out = new float[std::size_t(s.num_seqs) * s.num_kv_heads * s.capacity];
    std::size_t i = 0;
    for (std::int32_t b = 0; b < s.num_seqs; ++b)
      for (std::int32_t h = 0; h < s.num_kv_heads; ++h)
        for (std::int32_t x = 0; x < s.capacity; ++x)
          out[i++] = p_.slots().position(b, h, x) >= 0 ? p_.score(b, h, x) : 0.0f;
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    return nb::ndarray<nb::numpy, float>(out, {std::size_t(s.num_seqs), std::size_t(s.num_kv_heads),
                                               std::size_t(s.capacity)},
                                         owner);
  }

 private:
  template <int R>
  kvevict::tensor_view<const float, R> input(nb::handle obj, const char* call, const char* arg, const char* dims) {
    return float_input<R>(obj, device{}, call, arg, dims);
  }
  static nb::ndarray<nb::numpy, std::int32_t> owned(std::int32_t* data, std::initializer_list<std::size_t> shape) {
    nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<std::int32_t*>(p); });
    return nb::ndarray<nb::numpy, std::int32_t>(data, shape, owner);
  }

  static config_type config_of(const policy_spec& spec) {
    return with_policy(spec, [&](auto tag, const auto& config) -> config_type {
      using P = typename decltype(tag)::type;
      if constexpr (std::is_same_v<P, Policy>) {
        return config;
      } else {
        fail_arg("SequencePolicy", "spec.kind",
                 concat("is ", kvevict::policy_traits<P>::name, ", this class is ", kvevict::policy_traits<Policy>::name));
      }
    });
  }

  Policy p_;
};

template <class Policy>
void bind_sequence_policy(nb::module_& m, const char* name, const char* doc) {
  using S = SequencePolicy<Policy>;
  nb::class_<S>(m, name, doc)
      .def(nb::init<const policy_spec&>(), "spec"_a, "A policy of this class's kind: its shape and config from `spec`.")
      .def("append", &S::append, "b"_a, "Records sequence b's next token in every head's next slot; returns its position.")
      .def("observe_probs", &S::observe_probs, "b"_a, "probs"_a, "Adds the step's probabilities [Hq][slots] to the scores.")
      .def("observe_head_scores", &S::observe_head_scores, "b"_a, "scores"_a)
      .def("observe_logits", &S::observe_logits, "b"_a, "logits"_a, "lse"_a, "scale"_a = 1.0f,
           "base"_a = kvevict::lse_base::natural)
      .def("observe_key_norms", &S::observe_key_norms, "b"_a, "layout"_a, "k_cache"_a,
           "page_table"_a.none() = nb::none(), "scales"_a.none() = nb::none(),
           "Sets each occupied slot's score to -||k|| of its cached key (k_cache in `layout`).")
      .def("observe_key_diff", &S::observe_key_diff, "b"_a, "layout"_a, "k_cache"_a,
           "page_table"_a.none() = nb::none(), "scales"_a.none() = nb::none(),
           "KeyDiff (h2o): sets each occupied slot's score to -cos(k, the running anchor of the cached keys).")
      .def("skip_observe", &S::skip_observe, "b"_a)
      .def("evict", &S::evict, "b"_a, "Frees one victim slot per KV head above the budget; returns the freed slots (-1: none).")
      .def("prefill_key_norms", &S::prefill_key_norms, "b"_a, "length"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
           "page_table"_a.none() = nb::none(), "scales"_a.none() = nb::none(),
           "Compresses the prompt in slots [0, length) by its key norms, moving the kept K/V rows to slots [0, kept); "
           "returns (kept, reclaimable_pages).")
      .def("prefill_key_diff", &S::prefill_key_diff, "b"_a, "length"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
           "page_table"_a.none() = nb::none(), "scales"_a.none() = nb::none(),
           "KeyDiff prefill (h2o): the prompt in slots [0, length) scored by -cos(k_p, the sum of its head's unit "
           "keys); the kept K/V rows move to slots [0, kept). Returns (kept, reclaimable_pages).")
      .def("prefill_snapkv", &S::prefill_snapkv, "b"_a, "length"_a, "input"_a, "x"_a, "lse"_a.none(), "scale"_a,
           "base"_a, "pool_width"_a, "pooling"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
           "page_table"_a.none() = nb::none(), "scales"_a.none() = nb::none(),
           "SnapKV prefill (h2o): the prompt in slots [0, length) scored by its last `window` rows' attention "
           "(input window_probs, window_logits + lse, window_queries + lse), pooled; the kept K/V rows move to slots [0, kept). "
           "Returns (kept, reclaimable_pages).")
      .def("prefill_column_sums", &S::prefill_column_sums, "b"_a, "length"_a, "column_sums"_a,
           "Prefill compression of the slot table only (no K/V moved); returns the tokens kept per head.")
      .def("reset", &S::reset, "b"_a)
      .def("length", &S::length, "b"_a)
      .def_prop_ro("budget", &S::budget)
      .def("positions", &S::positions, "A copy of the positions [B][H][capacity] (-1: free).")
      .def("counts", &S::counts)
      .def("scores", &S::scores);
}

}  // namespace

void bind_sequence(nb::module_& m) {
  bind_sequence_policy<kvevict::h2o_policy>(m, "SequenceH2O", "Per-sequence h2o_policy (host; slot table only).");
  bind_sequence_policy<kvevict::recent_window_policy>(m, "SequenceRecentWindow",
                                                      "Per-sequence recent_window_policy (host; slot table only).");
  bind_sequence_policy<kvevict::random_policy>(m, "SequenceRandom", "Per-sequence random_policy (host; slot table only).");
}

}  // namespace kvevict_py
