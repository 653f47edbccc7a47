// The policy spec, the state array (init, reset, offsets) and its status word.
#include "bindings.hpp"

#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <functional>
#include <string_view>
#include <vector>

#include "spec_codec.hpp"

namespace kvevict_py {

state_ref resolve_state(const Descriptor& desc, nb::handle memory, const char* call) {
  out_array m = as_array<out_array>(memory, call, "state");
  if (!is(m.dtype(), nb::dlpack::dtype_code::UInt, 8) || m.ndim() != 1 || (m.shape(0) > 1 && m.stride(0) != 1))
    fail_arg(call, "state", concat("must be a contiguous 1-D uint8 array (has dtype ", dtype_name(m.dtype()), ", ",
                                   m.ndim(), " dimensions)"));
  if (m.shape(0) < desc.state_bytes())
    fail_arg(call, "state", concat("has ", m.shape(0), " bytes, the policy needs ", desc.state_bytes()));
  auto* base = static_cast<unsigned char*>(m.data());
  if (reinterpret_cast<std::uintptr_t>(base) % alignof(std::uint64_t) != 0)
    fail_arg(call, "state", "is not 8-byte aligned (allocate it with numpy.empty or torch.empty)");
  state_ref r;
  r.view = desc.carve(base);
  r.status = reinterpret_cast<std::uint64_t*>(base);
  r.dev = device_of(m);
  if (r.dev.type != nb::device::cpu::value && !r.dev.cuda())
    fail_arg(call, "state", concat("is on ", device_name(r.dev), "; kvevict runs on the CPU and CUDA"));
#ifndef KVEVICT_PY_CUDA
  if (r.dev.cuda())
    fail_arg(call, "state",
             "is on a CUDA device, but this kvevict was built without CUDA (nvcc was not found when it was "
             "installed; reinstall with the CUDA toolkit on PATH)");
#endif
  return r;
}

void* stream_of(std::uintptr_t stream) { return reinterpret_cast<void*>(stream); }

namespace {

void init(const Descriptor& desc, nb::handle memory, std::uintptr_t stream) {
  const state_ref st = resolve_state(desc, memory, "init");
  KVEVICT_PY_ON_DEVICE(st,
                       {
                         kvevict::init_batch_state(st.view);
                         clear_host_status(st.status);
                       },
                       cuda::init(st.view, st.status, stream_of(stream)));
}

/// A 1-D array with one element per entry of `active` (`per`: what an
/// entry is called in the message), on the state's device, contiguous.
in_array per_entry_array(nb::handle obj, const state_ref& st, const kvevict::active_set& active, const char* call,
                         const char* arg, const char* meaning, const char* per) {
  const in_array a = as_array<in_array>(obj, call, arg);
  require_device(a, st.dev, call, arg);
  require_rank(a, 1, call, arg, meaning);
  require_contiguous(a, call, arg);
  const std::int32_t entries = active.entries(st.view.num_seqs());
  if (a.shape(0) != std::size_t(entries))
    fail_arg(call, arg, concat("has ", a.shape(0), " entries, expected one per ", per, " (", entries, ")"));
  return a;
}

/// Random's request streams: one uint64 (or int64) per entry of `active`,
/// or null. int64 streams are read as uint64: a negative one reads above
/// max_random_stream and is refused by the library.
const std::uint64_t* parse_streams(nb::handle obj, const state_ref& st, const kvevict::active_set& active,
                                   const char* call) {
  if (obj.is_none()) return nullptr;
  const in_array s =
      per_entry_array(obj, st, active, call, "streams", "one request stream per active entry", "active entry");
  if (!is(s.dtype(), nb::dlpack::dtype_code::UInt, 64) && !is(s.dtype(), nb::dlpack::dtype_code::Int, 64))
    fail_arg(call, "streams", concat("has dtype ", dtype_name(s.dtype()), ", expected uint64 or int64"));
  return static_cast<const std::uint64_t*>(s.data());
}

void reset(const Descriptor& desc, nb::handle memory, nb::handle active_obj, nb::handle streams_obj,
           std::uintptr_t stream) {
  const char* call = "reset";
  const state_ref st = resolve_state(desc, memory, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  const std::uint64_t* streams = parse_streams(streams_obj, st, active, call);
  KVEVICT_PY_ON_DEVICE(st, run_host(st, call, [&] { kvevict::reset_batch_sequences(st.view, active, streams); }),
                       cuda::reset(st.view, active, streams, st.status, stream_of(stream)));
}

/// Forks (kvevict/batch/fork.hpp) from state `from` into state `to` (the
/// same one, or one of another batch size): destinations (None: every
/// sequence of `to`) become copies of sources[i]. On CUDA a call without a
/// workspace returns the bytes it needs and does nothing else.
std::size_t run_fork(const char* call, const state_ref& from, const state_ref& to, nb::handle sources_obj,
                     nb::handle destinations_obj, nb::handle streams_obj, nb::handle workspace_obj,
                     std::uintptr_t stream) {
  if (!(from.dev == to.dev)) fail_arg(call, "source", "is a state on another device than the destination's");
  const kvevict::active_set destinations = parse_active(destinations_obj, to, call, "destinations");
  const in_array s = per_entry_array(sources_obj, to, destinations, call, "sources",
                                     "the sequence each destination copies", "destination entry");
  if (!is(s.dtype(), nb::dlpack::dtype_code::Int, 32))
    fail_arg(call, "sources", concat("has dtype ", dtype_name(s.dtype()), ", expected int32"));
  const auto* sources = static_cast<const std::int32_t*>(s.data());
  const std::uint64_t* streams = parse_streams(streams_obj, to, destinations, call);
#ifdef KVEVICT_PY_CUDA
  if (to.dev.cuda()) {
    if (workspace_obj.is_none())
      return cuda::fork(nullptr, 0, from.view, to.view, destinations, sources, streams, to.status, stream_of(stream));
    out_array ws = as_array<out_array>(workspace_obj, call, "workspace");
    require_device(ws, to.dev, call, "workspace");
    return cuda::fork(ws.data(), ws.nbytes(), from.view, to.view, destinations, sources, streams, to.status,
                      stream_of(stream));
  }
#endif
  (void)workspace_obj;
  (void)stream;
  run_host(to, call, [&] { kvevict::batched_fork(from.view, to.view, destinations, sources, streams); });
  return 0;
}

std::size_t fork(const Descriptor& desc, nb::handle memory, nb::handle sources_obj, nb::handle destinations_obj,
                 nb::handle streams_obj, nb::handle workspace_obj, std::uintptr_t stream) {
  const state_ref st = resolve_state(desc, memory, "fork");
  return run_fork("fork", st, st, sources_obj, destinations_obj, streams_obj, workspace_obj, stream);
}

std::size_t fork_from(const Descriptor& desc, nb::handle memory, const Descriptor& source_desc, nb::handle source,
                      nb::handle sources_obj, nb::handle destinations_obj, nb::handle streams_obj,
                      nb::handle workspace_obj, std::uintptr_t stream) {
  const state_ref to = resolve_state(desc, memory, "fork");
  const state_ref from = resolve_state(source_desc, source, "fork");
  return run_fork("fork", from, to, sources_obj, destinations_obj, streams_obj, workspace_obj, stream);
}

std::uint64_t status_word(const Descriptor& desc, nb::handle memory, std::uintptr_t stream) {
  const state_ref st = resolve_state(desc, memory, "status_word");
#ifdef KVEVICT_PY_CUDA
  if (st.dev.cuda()) return cuda::read_status(st.status, stream_of(stream));
#endif
  (void)stream;
  return *st.status;
}

/// Raises the status word's exception (CUDA: after waiting for `stream`) and
/// clears it. `call`: the call the refusal came from, when the caller knows
/// (the message names it, and a prefill's refusal leaves the whole sequence).
void check(const Descriptor& desc, nb::handle memory, std::uintptr_t stream, const std::string& call) {
  const state_ref st = resolve_state(desc, memory, "check");
#ifdef KVEVICT_PY_CUDA
  if (st.dev.cuda()) {
    const std::uint64_t word = cuda::read_status(st.status, stream_of(stream));
    if (word == kvevict::batch_status_clear) return;
    cuda::clear_status(st.status, stream_of(stream));
    kvevict::throw_if_error(word, call.c_str());
  }
#endif
  (void)stream;
  raise_host_status(st.status, call.c_str());
}

/// Byte offsets of the state's arrays from the start of `memory`, so that
/// Python can view them in place (zero-copy, on either device).
nb::dict state_offsets(const Descriptor& desc, nb::handle memory) {
  const state_ref st = resolve_state(desc, memory, "state_offsets");
  const auto* base = static_cast<const unsigned char*>(static_cast<const void*>(st.status));
  auto off = [&](const void* p) -> nb::object {
    if (!p) return nb::none();
    return nb::int_(static_cast<const unsigned char*>(p) - base);
  };
  nb::dict d;
  d["status"] = nb::int_(0);
  d["positions"] = off(st.view.slots.positions);
  d["counts"] = off(st.view.slots.counts);
  d["next_slots"] = off(st.view.slots.next_slots);
  d["lengths"] = off(st.view.slots.lengths);
  d["scores"] = off(st.view.scores);
  d["score_buffer"] = off(st.view.scores ? st.view.score_buffer : nullptr);
  d["appended"] = off(st.view.appended);
  d["streams"] = off(st.view.streams);
  d["history_rows"] = off(st.view.history.rows);
  return d;
}

std::uint64_t clear_status_value() { return kvevict::batch_status_clear; }

/// A Python enum whose members come from the name table that the
/// library's messages use (common.hpp).
template <class E, std::size_t N>
void bind_named_enum(nb::module_& m, const char* name, const char* doc, const enum_name<E> (&table)[N]) {
  nb::enum_<E> e(m, name, doc, nb::is_arithmetic());
  for (const enum_name<E>& entry : table) e.value(entry.name, entry.value);
}

/// The integer codes of the C++ side as Python enums: what the calls take
/// (a member, or its value where a torch.library op carries an int).
void bind_enums(nb::module_& m) {
  nb::enum_<policy_kind>(m, "PolicyKind", "Which kvevict policy a state belongs to.", nb::is_arithmetic())
      .value("h2o", policy_kind::h2o)
      .value("recent_window", policy_kind::recent_window)
      .value("random", policy_kind::random)
      .value("exact_greedy", policy_kind::exact_greedy);
  nb::enum_<kvevict::group_reduce>(m, "GroupReduce", "How h2o folds a GQA group's query heads into a KV head's score.", nb::is_arithmetic())
      .value("sum", kvevict::group_reduce::sum)
      .value("mean", kvevict::group_reduce::mean)
      .value("max", kvevict::group_reduce::max);
  bind_named_enum(m, "DecodeInput", "The input of a decode step (observe_evict).", decode_input_names);
  bind_named_enum(m, "PrefillInput", "The input of a batched prefill.", prefill_input_names);
  bind_named_enum(m, "Elem", "Element types of K/V, queries and new rows.", elem_names);
  nb::enum_<cache_layout>(m, "CacheLayout", "K/V layouts (kvevict.CacheView).", nb::is_arithmetic())
      .value("bhsd", cache_layout::bhsd)
      .value("bshd", cache_layout::bshd)
      .value("paged_nhd", cache_layout::paged_nhd)
      .value("paged_hnd", cache_layout::paged_hnd);
  nb::enum_<kvevict::lse_base>(m, "LseBase", "Base of a log-sum-exp: natural (FlashAttention) or base2 (FlashInfer).", nb::is_arithmetic())
      .value("natural", kvevict::lse_base::natural)
      .value("base2", kvevict::lse_base::base2);
  nb::enum_<kvevict::snap_pooling>(m, "SnapPooling", "SnapKV's pooling of the window scores.", nb::is_arithmetic())
      .value("max", kvevict::snap_pooling::max)
      .value("mean", kvevict::snap_pooling::mean);
}

/// PolicySpec: policy_spec with its fields by name (read-only), built by
/// the Python configs (kvevict.config.policy_spec); encode()/decode() are
/// its int[] form for the torch.library ops (spec_codec.hpp's table).
void bind_policy_spec(nb::module_& m) {
  using S = policy_spec;
  auto set = [](S& s, const char* name, std::int64_t v) { set_spec_field(s, *find_spec_field(name), v); };
  nb::class_<S>(m, "PolicySpec", "A batched policy's kind, shape and configuration, each field by name.")
      .def("__init__",
           [set](S* self, policy_kind kind, std::int64_t num_seqs, std::int64_t num_kv_heads,
                 std::int64_t num_q_heads, std::int64_t capacity, std::int64_t heavy, std::int64_t recent,
                 kvevict::group_reduce reduce, float decay, std::int64_t sinks, std::int64_t window,
                 std::int64_t budget, std::uint64_t seed, std::int64_t max_tokens, std::int64_t head_dim,
                 std::int64_t first_kv_head) {
             S s;
             s.kind = kind;
             set(s, "num_seqs", num_seqs);
             set(s, "num_kv_heads", num_kv_heads);
             set(s, "num_q_heads", num_q_heads);
             set(s, "capacity", capacity);
             set(s, "heavy", heavy);
             set(s, "recent", recent);
             s.reduce = reduce;
             s.decay = decay;
             set(s, "sinks", sinks);
             set(s, "window", window);
             set(s, "budget", budget);
             s.seed = seed;
             set(s, "max_tokens", max_tokens);
             set(s, "head_dim", head_dim);
             set(s, "first_kv_head", first_kv_head);
             new (self) S(s);
           },
           "kind"_a, "num_seqs"_a, "num_kv_heads"_a, "num_q_heads"_a, "capacity"_a, nb::kw_only(), "heavy"_a = 0,
           "recent"_a = 0, "reduce"_a = kvevict::group_reduce::sum, "decay"_a = 1.0f, "sinks"_a = 0, "window"_a = 0,
           "budget"_a = 0, "seed"_a = 0, "max_tokens"_a = 0, "head_dim"_a = 0, "first_kv_head"_a = 0)
      .def_prop_ro("kind", [](const S& s) { return s.kind; })
      .def_prop_ro("num_seqs", [](const S& s) { return s.shape.num_seqs; })
      .def_prop_ro("num_kv_heads", [](const S& s) { return s.shape.num_kv_heads; })
      .def_prop_ro("num_q_heads", [](const S& s) { return s.shape.num_q_heads; })
      .def_prop_ro("capacity", [](const S& s) { return s.shape.capacity; })
      .def_prop_ro("first_kv_head", [](const S& s) { return s.shape.first_kv_head; })
      .def_prop_ro("heavy", [](const S& s) { return s.heavy; })
      .def_prop_ro("recent", [](const S& s) { return s.recent; })
      .def_prop_ro("reduce", [](const S& s) { return s.reduce; })
      .def_prop_ro("decay", [](const S& s) { return s.decay; })
      .def_prop_ro("sinks", [](const S& s) { return s.sinks; })
      .def_prop_ro("window", [](const S& s) { return s.window; })
      .def_prop_ro("budget", [](const S& s) { return s.budget; })
      .def_prop_ro("seed", [](const S& s) { return s.seed; })
      .def_prop_ro("max_tokens", [](const S& s) { return s.history.max_tokens; })
      .def_prop_ro("head_dim", [](const S& s) { return s.history.head_dim; })
      .def("encode", &encode_spec, "The spec as integers (the `desc` argument of the torch.library ops).")
      .def_static("decode", &decode_spec, "values"_a, "The spec encode() gave these integers (checked).")
      .def_prop_ro_static("fields",
                          [](nb::handle) {
                            std::vector<std::string> names;
                            for (const spec_field& f : spec_fields) names.emplace_back(f.name);
                            return names;
                          },
                          "The fields in encode()'s order.")
      .def("__eq__", [](const S& a, const S& b) { return encode_spec(a) == encode_spec(b); })
      .def("__hash__", [](const S& s) {
        std::size_t h = 0;
        for (std::int64_t v : encode_spec(s)) h = h * 1000003u ^ std::hash<std::int64_t>{}(v);
        return h;
      })
      .def("__repr__", [](const S& s) {
        std::string r = "PolicySpec(";
        for (std::size_t i = 0; i < spec_field_count; ++i) {
          const spec_field& f = spec_fields[i];
          r += concat(i ? ", " : "", f.name, "=");
          if (std::string_view(f.name) == "decay") r += concat(s.decay);
          else if (std::string_view(f.name) == "seed") r += concat(s.seed);
          else r += concat(f.get(s));
        }
        return r + ")";
      });
}

}  // namespace

void bind_state(nb::module_& m) {
  bind_enums(m);
  bind_policy_spec(m);
  nb::class_<Descriptor>(m, "Descriptor",
                         "A batched policy's spec, validated by the C++ library, with the layout of its state.")
      .def(nb::init<const policy_spec&>(), "spec"_a)
      .def_prop_ro("spec", &Descriptor::spec)
      .def_prop_ro("state_bytes", &Descriptor::state_bytes, "Bytes of the state array, status word included.")
      .def_prop_ro("budget", &Descriptor::budget);

  const auto none = nb::none();
  m.def("init", &init, "desc"_a, "state"_a, "stream"_a = 0);
  m.def("reset", &reset, "desc"_a, "state"_a, "active"_a = none, "streams"_a = none, "stream"_a = 0);
  m.def("fork", &fork, "desc"_a, "state"_a, "sources"_a, "destinations"_a = none, "streams"_a = none,
        "workspace"_a = none, "stream"_a = 0);
  m.def("fork_from", &fork_from, "desc"_a, "state"_a, "source_desc"_a, "source"_a, "sources"_a,
        "destinations"_a = none, "streams"_a = none, "workspace"_a = none, "stream"_a = 0);
  m.def("status_word", &status_word, "desc"_a, "state"_a, "stream"_a = 0);
  m.def("check", &check, "desc"_a, "state"_a, "stream"_a = 0, "call"_a = "check");
  m.def("state_offsets", &state_offsets, "desc"_a, "state"_a);
  m.def("h2o_from_ratios", [](std::int32_t length, double heavy_ratio, double recent_ratio) {
    const kvevict::h2o_config c = kvevict::h2o_from_ratios(length, heavy_ratio, recent_ratio);
    return std::make_pair(c.heavy, c.recent);
  }, "length"_a, "heavy_ratio"_a, "recent_ratio"_a);
  m.def("recent_window_from_ratio", [](std::int32_t length, double ratio, std::int32_t sinks) {
    const kvevict::recent_window_config c = kvevict::recent_window_from_ratio(length, ratio, sinks);
    return std::make_pair(c.sinks, c.window);
  }, "length"_a, "ratio"_a, "sinks"_a);
  m.attr("STATUS_CLEAR") = nb::int_(clear_status_value());
  m.attr("STATE_HEADER_BYTES") = nb::int_(state_header_bytes);
}

}  // namespace kvevict_py
