// The decode step: append (with or without the K/V scatter) and observe + evict from every input kind.
#include "bindings.hpp"

namespace kvevict_py {

namespace {

void append(const Descriptor& desc, nb::handle memory, nb::handle active_obj, std::uintptr_t stream) {
  const char* call = "append";
  const state_ref st = resolve_state(desc, memory, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  KVEVICT_PY_ON_DEVICE(st, run_host(st, call, [&] { kvevict::batched_append(st.view, active, st.status); }),
                       cuda::append(st.view, active, st.status, stream_of(stream)));
}

void append_kv(const Descriptor& desc, nb::handle memory, cache_layout layout, nb::handle k, nb::handle v,
               nb::handle page_table, nb::handle scales, nb::handle k_new_obj, nb::handle v_new_obj,
               nb::handle active_obj, std::uintptr_t stream) {
  const char* call = "append";
  const state_ref st = resolve_state(desc, memory, call);
  const any_cache cache = parse_cache(layout, k, v, page_table, scales, st, call);
  const any_array k_new = parse_rows(k_new_obj, cache, st, call, "k_new");
  const any_array v_new = parse_rows(v_new_obj, cache, st, call, "v_new");
  const kvevict::active_set active = parse_active(active_obj, st, call);
  KVEVICT_PY_ON_DEVICE(st, run_host(st, call,
                                    [&] {
                                      visit_cache(cache, [&](auto view) {
                                        using T = typename decltype(view)::element_type;
                                        kvevict::batched_append(st.view, active, view,
                                                                kvevict::batch_rows<T>{k_new.view<T, 3>()},
                                                                kvevict::batch_rows<T>{v_new.view<T, 3>()}, st.status);
                                      });
                                    }),
                       cuda::append_kv(st.view, active, cache, k_new, v_new, st.status, stream_of(stream)));
}

/// input: probs [B][Hq][W], head_scores (per-KV-head increments) [B][Hkv][W],
/// logits [B][Hq][W] with lse [B][Hq]. Queries, key norms and KeyDiff read
/// the cache and have their own calls. `one_launch`: the step, append +
/// observe + evict in one call (batched_step), the K/V rows already in the
/// next slots.
void observe_evict(bool one_launch, const Descriptor& desc, nb::handle memory, decode_input input, nb::handle x_obj,
                   nb::handle lse_obj, float scale, kvevict::lse_base base_code, nb::handle victims_obj,
                   nb::handle active_obj, std::uintptr_t stream) {
  const char* call = one_launch ? "step" : "observe_evict";
  const state_ref st = resolve_state(desc, memory, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  std::int32_t* victims =
      int32_output(victims_obj, st.dev, std::size_t(st.view.num_seqs()) * st.view.num_heads(), call, "victims");
  auto step = [&](const auto& in) {
    if (one_launch) {
      KVEVICT_PY_ON_DEVICE(st, run_host(st, call, [&] { kvevict::batched_step(st.view, active, in, victims, st.status); }),
                           cuda::step(st.view, active, in, victims, st.status, stream_of(stream)));
      return;
    }
    KVEVICT_PY_ON_DEVICE(st, run_host(st, call, [&] { kvevict::batched_observe_evict(st.view, active, in, victims, st.status); }),
                         cuda::observe_evict(st.view, active, in, victims, st.status, stream_of(stream)));
  };
  switch (input) {
    case decode_input::probs:
      return step(kvevict::batch_probs{float_input<3>(x_obj, st.dev, call, "probs", "[num_seqs][num_q_heads][slots]")});
    case decode_input::head_scores:
      return step(kvevict::batch_head_scores{
          float_input<3>(x_obj, st.dev, call, "head_scores", "[num_seqs][num_kv_heads][slots]")});
    case decode_input::logits: {
      const auto logits = float_input<3>(x_obj, st.dev, call, "logits", "[num_seqs][num_q_heads][slots]");
      if (lse_obj.is_none()) fail_arg(call, "lse", "is required with logits");
      const auto lse = float_input<2>(lse_obj, st.dev, call, "lse", "[num_seqs][num_q_heads]");
      return step(kvevict::batch_logits{logits, lse, scale, parse_base(base_code, call)});
    }
    case decode_input::queries:
    case decode_input::key_norms:
    case decode_input::key_diff: break;
  }
  fail_arg(call, "input", concat("= ", decode_input_name(input),
                                 " is not probs, head_scores or logits (it reads the cache: its own call)"));
}

void observe_evict_queries(const Descriptor& desc, nb::handle memory, nb::handle q_obj, nb::handle lse_obj,
                           float scale, kvevict::lse_base base_code, cache_layout layout, nb::handle k, nb::handle v,
                           nb::handle page_table, nb::handle scales, nb::handle victims_obj, nb::handle active_obj,
                           std::uintptr_t stream) {
  const char* call = "observe_evict";
  const state_ref st = resolve_state(desc, memory, call);
  const any_cache cache = parse_cache(layout, k, v, page_table, scales, st, call);
  const any_array q = parse_queries<3>(q_obj, cache, st, call, "[num_seqs][num_q_heads][head_dim]");
  const auto lse = float_input<2>(lse_obj, st.dev, call, "lse", "[num_seqs][num_q_heads]");
  const kvevict::lse_base base = parse_base(base_code, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  std::int32_t* victims =
      int32_output(victims_obj, st.dev, std::size_t(st.view.num_seqs()) * st.view.num_heads(), call, "victims");
  KVEVICT_PY_ON_DEVICE(
      st, run_host(st, call,
                   [&] {
                     visit_queries(q, cache, [&](auto qt, auto view) {
                       using Q = decltype(qt);
                       const kvevict::batch_queries<Q> in{q.view<Q, 3>(), lse, scale, base};
                       kvevict::batched_observe_evict(st.view, active, in, view, victims, st.status);
                     });
                   }),
      cuda::observe_evict_queries(st.view, active, q, lse, scale, base, cache, victims, st.status, stream_of(stream)));
}

/// Observe + evict from the cached keys alone: key norms (each occupied
/// slot's score becomes -||k||; h2o takes it with decay 0) or, with
/// `diff`, KeyDiff (-cos(k, the running anchor of the cached keys); an h2o
/// state made with head_dim).
void observe_evict_keys(bool diff, const Descriptor& desc, nb::handle memory, cache_layout layout, nb::handle k,
                        nb::handle page_table, nb::handle scales, nb::handle victims_obj, nb::handle active_obj,
                        std::uintptr_t stream) {
  const char* call = "observe_evict";
  const state_ref st = resolve_state(desc, memory, call);
  const any_cache cache = parse_keys(layout, k, page_table, scales, st.dev, st.view.capacity(), call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  std::int32_t* victims =
      int32_output(victims_obj, st.dev, std::size_t(st.view.num_seqs()) * st.view.num_heads(), call, "victims");
  KVEVICT_PY_ON_DEVICE(
      st, run_host(st, call,
                   [&] {
                     visit_cache(cache, [&](auto view) {
                       using V = decltype(view);
                       using E = typename V::element_type;
                       using L = typename V::layout_type;
                       if (diff) kvevict::batched_observe_evict(st.view, active, kvevict::key_diff<E, L>{view}, victims, st.status);
                       else kvevict::batched_observe_evict(st.view, active, kvevict::key_norms<E, L>{view}, victims, st.status);
                     });
                   }),
      cuda::observe_evict_keys(st.view, active, diff, cache, victims, st.status, stream_of(stream)));
}

}  // namespace

void bind_decode(nb::module_& m) {
  const auto none = nb::none();
  m.def("append", &append, "desc"_a, "state"_a, "active"_a = none, "stream"_a = 0);
  m.def("append_kv", &append_kv, "desc"_a, "state"_a, "layout"_a, "k_cache"_a, "v_cache"_a, "page_table"_a.none(),
        "scales"_a.none(), "k_new"_a, "v_new"_a, "active"_a = none, "stream"_a = 0);
  for (const bool one_launch : {false, true})
    m.def(one_launch ? "step" : "observe_evict",
          [one_launch](const Descriptor& desc, nb::handle memory, decode_input input, nb::handle x, nb::handle lse,
                       float scale, kvevict::lse_base base, nb::handle victims, nb::handle active,
                       std::uintptr_t stream) {
            observe_evict(one_launch, desc, memory, input, x, lse, scale, base, victims, active, stream);
          },
          "desc"_a, "state"_a, "input"_a, "x"_a, "lse"_a.none(), "scale"_a, "base"_a, "victims"_a.none(),
          "active"_a = none, "stream"_a = 0);
  m.def("observe_evict_queries", &observe_evict_queries, "desc"_a, "state"_a, "queries"_a, "lse"_a, "scale"_a,
        "base"_a, "layout"_a, "k_cache"_a, "v_cache"_a, "page_table"_a.none(), "scales"_a.none(), "victims"_a.none(),
        "active"_a = none, "stream"_a = 0);
  for (const bool diff : {false, true})
    m.def(diff ? "observe_evict_key_diff" : "observe_evict_key_norms",
          [diff](const Descriptor& desc, nb::handle memory, cache_layout layout, nb::handle k, nb::handle page_table,
                 nb::handle scales, nb::handle victims, nb::handle active, std::uintptr_t stream) {
            observe_evict_keys(diff, desc, memory, layout, k, page_table, scales, victims, active, stream);
          },
          "desc"_a, "state"_a, "layout"_a, "k_cache"_a, "page_table"_a.none(), "scales"_a.none(), "victims"_a.none(),
          "active"_a = none, "stream"_a = 0);
}

}  // namespace kvevict_py
