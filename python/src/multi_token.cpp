// Multi-token steps: append_tokens, and evict_to (rows moved in the cache, or the moves reported).
#include "bindings.hpp"

namespace kvevict_py {

namespace {

void append_tokens(const Descriptor& desc, nb::handle memory, std::int32_t tokens, nb::handle active_obj,
                   std::uintptr_t stream) {
  const char* call = "append_tokens";
  const state_ref st = resolve_state(desc, memory, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  KVEVICT_PY_ON_DEVICE(st, run_host(st, call, [&] { kvevict::batched_append_tokens(st.view, active, tokens, st.status); }),
                       cuda::append_tokens(st.view, active, tokens, st.status, stream_of(stream)));
}

/// evict_to with the rows moved in the cache; exact_greedy passes the step's
/// queries and LSE (q_obj not None).
void evict_to(const Descriptor& desc, nb::handle memory, std::int32_t target, cache_layout layout, nb::handle k,
              nb::handle v, nb::handle page_table, nb::handle scales, nb::handle q_obj, nb::handle lse_obj, float scale,
              kvevict::lse_base base_code, nb::handle freed_obj, nb::handle active_obj, std::uintptr_t stream) {
  const char* call = "evict_to";
  const state_ref st = resolve_state(desc, memory, call);
  const any_cache cache = parse_cache(layout, k, v, page_table, scales, st, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  std::int32_t* freed =
      int32_output(freed_obj, st.dev, std::size_t(st.view.num_seqs()) * st.view.num_heads(), call, "freed");
  if (q_obj.is_none()) {
    KVEVICT_PY_ON_DEVICE(st, run_host(st, call,
                                      [&] {
                                        visit_cache(cache, [&](auto view) {
                                          kvevict::batched_evict_to(st.view, active, target, view, freed, st.status);
                                        });
                                      }),
                         cuda::evict_to(st.view, active, target, cache, freed, st.status, stream_of(stream)));
    return;
  }
  const any_array q = parse_queries<3>(q_obj, cache, st, call, "[num_seqs][num_q_heads][head_dim]");
  const auto lse = float_input<2>(lse_obj, st.dev, call, "lse", "[num_seqs][num_q_heads]");
  const kvevict::lse_base base = parse_base(base_code, call);
  KVEVICT_PY_ON_DEVICE(
      st, run_host(st, call,
                   [&] {
                     visit_queries(q, cache, [&](auto qt, auto view) {
                       using Q = decltype(qt);
                       const kvevict::batch_queries<Q> in{q.view<Q, 3>(), lse, scale, base};
                       kvevict::batched_evict_to(st.view, active, target, in, view, freed, st.status);
                     });
                   }),
      cuda::evict_to_greedy(st.view, active, target, q, lse, scale, base, cache, freed, st.status, stream_of(stream)));
}

/// evict_to for engines that move rows themselves: moves [B][H][capacity][2]
/// (from, to) int32 and move_counts [B][H].
void evict_to_moves(const Descriptor& desc, nb::handle memory, std::int32_t target, nb::handle moves_obj,
                    nb::handle counts_obj, nb::handle active_obj, std::uintptr_t stream) {
  const char* call = "evict_to";
  const state_ref st = resolve_state(desc, memory, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  const std::size_t heads = std::size_t(st.view.num_seqs()) * st.view.num_heads();
  static_assert(sizeof(kvevict::slot_move) == 2 * sizeof(std::int32_t), "slot_move is two int32");
  auto* moves = reinterpret_cast<kvevict::slot_move*>(
      int32_output(moves_obj, st.dev, heads * st.view.capacity() * 2, call, "moves"));
  std::int32_t* counts = int32_output(counts_obj, st.dev, heads, call, "move_counts");
  if (!moves) fail_arg(call, "moves", "is required");
  if (!counts) fail_arg(call, "move_counts", "is required");
  KVEVICT_PY_ON_DEVICE(st, run_host(st, call, [&] { kvevict::batched_evict_to(st.view, active, target, moves, counts, st.status); }),
                       cuda::evict_to_moves(st.view, active, target, moves, counts, st.status, stream_of(stream)));
}

}  // namespace

void bind_multi_token(nb::module_& m) {
  const auto none = nb::none();
  m.def("append_tokens", &append_tokens, "desc"_a, "state"_a, "tokens"_a, "active"_a = none, "stream"_a = 0);
  m.def("evict_to", &evict_to, "desc"_a, "state"_a, "target"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
        "page_table"_a.none(), "scales"_a.none(), "queries"_a.none(), "lse"_a.none(), "scale"_a, "base"_a,
        "freed"_a.none(), "active"_a = none, "stream"_a = 0);
  m.def("evict_to_moves", &evict_to_moves, "desc"_a, "state"_a, "target"_a, "moves"_a, "move_counts"_a,
        "active"_a = none, "stream"_a = 0);
}

}  // namespace kvevict_py
