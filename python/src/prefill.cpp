// Batched prefill (prompt compression) from every input kind.
#include "bindings.hpp"

namespace kvevict_py {

namespace {

/// The prompt lengths: int32 [num_seqs] on the state's device (the array
/// must stay alive for the call: it is an argument of it).
kvevict::prompt_lengths parse_prompts(nb::handle lengths_obj, std::int32_t max_length, const state_ref& st,
                                      const char* call) {
  const in_array lengths = as_array<in_array>(lengths_obj, call, "lengths");
  require_device(lengths, st.dev, call, "lengths");
  require_rank(lengths, 1, call, "lengths", "one prompt length per sequence");
  require_dtype(lengths, nb::dlpack::dtype_code::Int, 32, call, "lengths");
  require_contiguous(lengths, call, "lengths");
  if (lengths.shape(0) != std::size_t(st.view.num_seqs()))
    fail_arg(call, "lengths", concat("has ", lengths.shape(0), " entries, expected num_seqs = ", st.view.num_seqs()));
  return {static_cast<const std::int32_t*>(lengths.data()), max_length};
}

/// Batched prefill of any input kind (see prefill, prefill_snapkv and
/// prefill_key_diff); `pool_width` and `pooling` are read by the window_*
/// kinds only.
std::size_t run_prefill(const Descriptor& desc, nb::handle memory, nb::handle lengths_obj, std::int32_t max_length,
                        prefill_input kind, nb::handle x_obj, nb::handle lse_obj, float scale,
                        kvevict::lse_base base_code, std::int32_t pool_width, kvevict::snap_pooling pooling, cache_layout layout,
                        nb::handle k, nb::handle v, nb::handle page_table, nb::handle scales,
                        nb::handle reclaimable_obj, nb::handle active_obj, nb::handle workspace_obj,
                        std::uintptr_t stream) {
  const char* call = "prefill";
  const state_ref st = resolve_state(desc, memory, call);
  const any_cache cache = parse_cache(layout, k, v, page_table, scales, st, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  const kvevict::prompt_lengths prompts = parse_prompts(lengths_obj, max_length, st, call);
  std::int32_t* reclaimable = int32_output(reclaimable_obj, st.dev, std::size_t(st.view.num_seqs()), call,
                                           "reclaimable_pages");
  any_array x;
  kvevict::tensor_view<const float, 3> lse;
  auto require_lse = [&](const char* with) {
    if (lse_obj.is_none()) fail_arg(call, "lse", concat("is required with ", with));
  };
  switch (kind) {
    case prefill_input::probs:
      x = float_array<4>(x_obj, st.dev, call, "probs", "[num_seqs][num_q_heads][max_length][max_length]");
      break;
    case prefill_input::sums:
      x = float_array<3>(x_obj, st.dev, call, "column_sums", "[num_seqs][num_q_heads][max_length]");
      break;
    case prefill_input::queries:
      x = parse_queries<4>(x_obj, cache, st.dev, call, "[num_seqs][num_q_heads][max_length][head_dim]");
      lse = float_input<3>(lse_obj, st.dev, call, "lse", "[num_seqs][num_q_heads][max_length]");
      break;
    case prefill_input::none:
    case prefill_input::key_norms:
    case prefill_input::key_diff: break;
    case prefill_input::window_probs:
      x = float_array<4>(x_obj, st.dev, call, "probs", "[num_seqs][num_q_heads][window][>= max_length]");
      break;
    case prefill_input::window_logits:
      x = float_array<4>(x_obj, st.dev, call, "logits", "[num_seqs][num_q_heads][window][>= max_length]");
      require_lse("logits");
      lse = float_input<3>(lse_obj, st.dev, call, "lse", "[num_seqs][num_q_heads][window]");
      break;
    case prefill_input::window_queries:
      x = parse_queries<4>(x_obj, cache, st.dev, call, "[num_seqs][num_q_heads][window][head_dim]");
      require_lse("queries");
      lse = float_input<3>(lse_obj, st.dev, call, "lse", "[num_seqs][num_q_heads][window]");
      break;
  }
  const kvevict::lse_base base = parse_base(base_code, call);
  const kvevict::snap_window snap =
      is_window(kind) ? parse_snap(x.extents[2], pool_width, pooling) : kvevict::snap_window{};
#ifdef KVEVICT_PY_CUDA
  if (st.dev.cuda()) {
    if (workspace_obj.is_none())
      return cuda::prefill(nullptr, 0, st.view, active, prompts, kind, x, lse, scale, base, snap, cache, reclaimable,
                           st.status, stream_of(stream));
    out_array ws = as_array<out_array>(workspace_obj, call, "workspace");
    require_device(ws, st.dev, call, "workspace");
    return cuda::prefill(ws.data(), ws.nbytes(), st.view, active, prompts, kind, x, lse, scale, base, snap, cache,
                         reclaimable, st.status, stream_of(stream));
  }
#endif
  (void)workspace_obj;
  (void)stream;
  run_host(st, call, [&] {
    visit_cache(cache, [&](auto view) {
      using T = typename decltype(view)::element_type;
      switch (kind) {
        case prefill_input::probs:
          return kvevict::batched_prefill(st.view, active, prompts, kvevict::batch_prefill_probs{x.view<float, 4>()},
                                          view, reclaimable, st.status);
        case prefill_input::sums:
          return kvevict::batched_prefill(st.view, active, prompts, kvevict::batch_prefill_sums{x.view<float, 3>()},
                                          view, reclaimable, st.status);
        case prefill_input::none:
          return kvevict::batched_prefill(st.view, active, prompts, view, reclaimable, st.status);
        case prefill_input::key_norms: {
          using V = decltype(view);
          const kvevict::key_norms<typename V::element_type, typename V::layout_type> in{view};
          return kvevict::batched_prefill(st.view, active, prompts, in, reclaimable, st.status);
        }
        case prefill_input::key_diff: {
          using V = decltype(view);
          const kvevict::key_diff<typename V::element_type, typename V::layout_type> in{view};
          return kvevict::batched_prefill(st.view, active, prompts, in, reclaimable, st.status);
        }
        case prefill_input::queries: {
          if (x.type == elem::f32)
            return kvevict::batched_prefill(st.view, active, prompts,
                                            kvevict::batch_prefill_queries<float>{x.view<float, 4>(), lse, scale, base},
                                            view, reclaimable, st.status);
          return kvevict::batched_prefill(st.view, active, prompts,
                                          kvevict::batch_prefill_queries<own_query_t<T>>{x.view<own_query_t<T>, 4>(),
                                                                                         lse, scale, base}, view,
                                          reclaimable, st.status);
        }
        case prefill_input::window_probs:
          return kvevict::batched_prefill(st.view, active, prompts,
                                          kvevict::batch_window_probs{x.view<float, 4>(), snap}, view, reclaimable,
                                          st.status);
        case prefill_input::window_logits:
          return kvevict::batched_prefill(st.view, active, prompts,
                                          kvevict::batch_window_logits{x.view<float, 4>(), lse, scale, base, snap},
                                          view, reclaimable, st.status);
        case prefill_input::window_queries: {
          if (x.type == elem::f32)
            return kvevict::batched_prefill(
                st.view, active, prompts,
                kvevict::batch_window_queries<float>{x.view<float, 4>(), lse, scale, base, snap}, view, reclaimable,
                st.status);
          return kvevict::batched_prefill(st.view, active, prompts,
                                          kvevict::batch_window_queries<own_query_t<T>>{x.view<own_query_t<T>, 4>(),
                                                                                        lse, scale, base, snap},
                                          view, reclaimable, st.status);
        }
      }
    });
  });
  return 0;
}

/// Batched prefill. input: probs [B][Hq][M][M], sums (column sums)
/// [B][Hq][M], queries [B][Hq][M][D] with lse [B][Hq][M], none, key_norms
/// (the norms of the cached keys, x None; kvevict::key_norms over the
/// cache). On CUDA with workspace None it only returns the workspace bytes;
/// otherwise 0.
std::size_t prefill(const Descriptor& desc, nb::handle memory, nb::handle lengths_obj, std::int32_t max_length,
                    prefill_input input, nb::handle x_obj, nb::handle lse_obj, float scale, kvevict::lse_base base_code,
                    cache_layout layout, nb::handle k, nb::handle v, nb::handle page_table, nb::handle scales,
                    nb::handle reclaimable_obj, nb::handle active_obj, nb::handle workspace_obj,
                    std::uintptr_t stream) {
  if (is_window(input) || input == prefill_input::key_diff)
    fail_arg("prefill", "input",
             concat("= ", prefill_input_name(input),
                    " is not probs, sums, queries, none or key_norms (SnapKV and KeyDiff have their own calls)"));
  return run_prefill(desc, memory, lengths_obj, max_length, input, x_obj, lse_obj, scale, base_code, 0,
                     kvevict::snap_pooling::max, layout, k, v, page_table, scales, reclaimable_obj, active_obj,
                     workspace_obj, stream);
}

/// SnapKV prefill (kvevict/batch/prefill_window.hpp): the prompts scored by
/// the attention of their last `window` rows. input: window_probs
/// [B][Hq][window][>= M], window_logits [B][Hq][window][>= M] with lse
/// [B][Hq][window], window_queries [B][Hq][window][D] with lse
/// [B][Hq][window]; the window is the input's extent in dimension 2.
/// Workspace and return value as prefill.
std::size_t prefill_snapkv(const Descriptor& desc, nb::handle memory, nb::handle lengths_obj,
                           std::int32_t max_length, prefill_input input, nb::handle x_obj, nb::handle lse_obj,
                           float scale, kvevict::lse_base base_code, std::int32_t pool_width, kvevict::snap_pooling pooling,
                           cache_layout layout, nb::handle k, nb::handle v, nb::handle page_table, nb::handle scales,
                           nb::handle reclaimable_obj, nb::handle active_obj, nb::handle workspace_obj,
                           std::uintptr_t stream) {
  if (!is_window(input))
    fail_arg("prefill", "input",
             concat("= ", prefill_input_name(input), " is not window_probs, window_logits or window_queries"));
  return run_prefill(desc, memory, lengths_obj, max_length, input, x_obj, lse_obj, scale, base_code, pool_width,
                     pooling, layout, k, v, page_table, scales, reclaimable_obj, active_obj, workspace_obj, stream);
}

/// KeyDiff prefill (kvevict/batch/prefill_key_diff.hpp): the prompts scored
/// by their cached keys alone, position p by -cos(k_p, the sum of its
/// head's unit prompt keys). Its own entry point rather than an input of
/// prefill: it takes no x, lse, scale or base. Workspace and return value
/// as prefill.
std::size_t prefill_key_diff(const Descriptor& desc, nb::handle memory, nb::handle lengths_obj,
                             std::int32_t max_length, cache_layout layout, nb::handle k, nb::handle v,
                             nb::handle page_table, nb::handle scales, nb::handle reclaimable_obj,
                             nb::handle active_obj, nb::handle workspace_obj, std::uintptr_t stream) {
  return run_prefill(desc, memory, lengths_obj, max_length, prefill_input::key_diff, nb::none(), nb::none(), 1.0f,
                     kvevict::lse_base::natural, 0, kvevict::snap_pooling::max, layout, k, v, page_table, scales,
                     reclaimable_obj, active_obj, workspace_obj, stream);
}

/// exact_greedy's batched prefill (kvevict/batch/prefill_exact_greedy.hpp,
/// host only): the prompts join the history and are reduced greedily to
/// the budget, judged with the queries of each prompt's last row
/// [B][Hq][head_dim] (float32 or the cache's type; lse [B][Hq] optional:
/// the library does not read it); the kept rows move to slots [0, kept).
/// The library refuses a state without a history (not exact_greedy's).
void prefill_exact_greedy(const Descriptor& desc, nb::handle memory, nb::handle lengths_obj, std::int32_t max_length,
                          nb::handle q_obj, nb::handle lse_obj, float scale, kvevict::lse_base base_code,
                          cache_layout layout, nb::handle k, nb::handle v, nb::handle page_table, nb::handle scales,
                          nb::handle reclaimable_obj, nb::handle active_obj, std::uintptr_t stream) {
  (void)stream;
  const char* call = "prefill";
  const state_ref st = resolve_state(desc, memory, call);
  if (st.dev.cuda())
    fail_arg(call, "state", "is on a CUDA device: exact_greedy's prefill runs on the host (the CUDA backend has none)");
  const any_cache cache = parse_cache(layout, k, v, page_table, scales, st, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  const kvevict::prompt_lengths prompts = parse_prompts(lengths_obj, max_length, st, call);
  std::int32_t* reclaimable = int32_output(reclaimable_obj, st.dev, std::size_t(st.view.num_seqs()), call,
                                           "reclaimable_pages");
  const any_array q = parse_queries<3>(q_obj, cache, st.dev, call, "[num_seqs][num_q_heads][head_dim]");
  kvevict::tensor_view<const float, 2> lse;
  if (!lse_obj.is_none()) lse = float_input<2>(lse_obj, st.dev, call, "lse", "[num_seqs][num_q_heads]");
  const kvevict::lse_base base = parse_base(base_code, call);
  run_host(st, call, [&] {
    visit_queries(q, cache, [&](auto qt, auto view) {
      using Q = decltype(qt);
      const kvevict::batch_queries<Q> in{q.view<Q, 3>(), lse, scale, base};
      kvevict::batched_prefill(st.view, active, prompts, in, view, reclaimable, st.status);
    });
  });
}

}  // namespace

void bind_prefill(nb::module_& m) {
  const auto none = nb::none();
  m.def("prefill", &prefill, "desc"_a, "state"_a, "lengths"_a, "max_length"_a, "input"_a, "x"_a.none(),
        "lse"_a.none(), "scale"_a, "base"_a, "layout"_a, "k_cache"_a, "v_cache"_a, "page_table"_a.none(),
        "scales"_a.none(), "reclaimable_pages"_a.none(), "active"_a = none, "workspace"_a = none, "stream"_a = 0);
  m.def("prefill_snapkv", &prefill_snapkv, "desc"_a, "state"_a, "lengths"_a, "max_length"_a, "input"_a, "x"_a,
        "lse"_a.none(), "scale"_a, "base"_a, "pool_width"_a, "pooling"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
        "page_table"_a.none(), "scales"_a.none(), "reclaimable_pages"_a.none(), "active"_a = none, "workspace"_a = none,
        "stream"_a = 0);
  m.def("prefill_key_diff", &prefill_key_diff, "desc"_a, "state"_a, "lengths"_a, "max_length"_a, "layout"_a,
        "k_cache"_a, "v_cache"_a, "page_table"_a.none(), "scales"_a.none(), "reclaimable_pages"_a.none(),
        "active"_a = none, "workspace"_a = none, "stream"_a = 0);
  m.def("prefill_exact_greedy", &prefill_exact_greedy, "desc"_a, "state"_a, "lengths"_a, "max_length"_a,
        "queries"_a, "lse"_a.none(), "scale"_a, "base"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
        "page_table"_a.none(), "scales"_a.none(), "reclaimable_pages"_a.none(), "active"_a = none, "stream"_a = 0);
}

}  // namespace kvevict_py
