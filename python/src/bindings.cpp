// kvevict._ext: the nanobind module under the Python package.
//
// Thin by design: it turns DLPack tensors (NumPy arrays, PyTorch CPU or
// CUDA tensors) into kvevict's views, zero-copy, checks what only the
// Python side can get wrong (dtype, rank, device, strides a view cannot
// express), and calls the C++ batched API: the host backend for host
// memory, the gpu:: launchers for CUDA memory on the caller's stream. Every
// decision comes from the C++ library; nothing here knows a policy's rule.
//
// A batched state lives in one uint8 array the caller owns (a NumPy array or
// a torch tensor, on the host or the GPU): its first 8 bytes hold the status
// word, the kvevict state is carved after `state_header_bytes`. So the state
// can be a tensor argument of a torch.library op, and moves with it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common.hpp"
#include "spec_codec.hpp"
#ifdef KVEVICT_PY_CUDA
#include "cuda_backend.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace kvevict_py {
namespace {

using kvevict::detail::concat;
using kvevict::detail::fail;
using kvevict::detail::site;

/// Bytes before the kvevict state in the memory array: the status word's
/// place. 256, so that on a 256-byte aligned array (every CUDA allocation)
/// the state's sub-arrays lie where make_batch_state would put them.
constexpr std::size_t state_header_bytes = 256;

// ---- errors ----------------------------------------------------------------

/// The Python exception types, created at import (see NB_MODULE).
struct exception_types {
  PyObject* error = nullptr;
  PyObject* invalid_argument = nullptr;
  PyObject* budget_error = nullptr;
  PyObject* out_of_range = nullptr;
  PyObject* non_finite_error = nullptr;
  PyObject* state_error = nullptr;
  PyObject* cuda_error = nullptr;
};
exception_types exceptions;

[[noreturn]] void fail_arg(const char* call, const char* arg, const std::string& what) {
  fail<kvevict::invalid_argument>(site{"python", call}, arg, what);
}

// ---- the status word: the one place the bindings read or clear it ----------

/// Throws the library's exception for a status word that is not clear, after
/// clearing it (host memory). The word's meaning and the exception it maps to
/// are kvevict's own (batch/status.hpp).
void raise_host_status(std::uint64_t* status, const char* call) {
  const std::uint64_t word = *status;
  if (word == kvevict::batch_status_clear) return;
  *status = kvevict::batch_status_clear;
  kvevict::throw_if_error(word, call);
}

void clear_host_status(std::uint64_t* status) { *status = kvevict::batch_status_clear; }

// ---- arrays ----------------------------------------------------------------

using in_array = nb::ndarray<nb::ro>;  // read by the call
using out_array = nb::ndarray<>;       // written by the call

std::string dtype_name(const nb::dlpack::dtype& t) {
  const char* kind = "?";
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: kind = "complex"; break;
    case nb::dlpack::dtype_code::Bool: kind = "bool"; break;
  }
  return concat(kind, int(t.bits), t.lanes != 1 ? concat("x", int(t.lanes)) : std::string());
}

bool is(const nb::dlpack::dtype& t, nb::dlpack::dtype_code code, int bits) {
  return t.code == static_cast<std::uint8_t>(code) && t.bits == bits && t.lanes == 1;
}

/// Where an array lives: (DLPack device type, id).
struct device {
  std::int32_t type = nb::device::cpu::value;
  std::int32_t id = 0;
  bool cuda() const noexcept { return type == nb::device::cuda::value; }
  bool operator==(const device& o) const noexcept {
    // Host memory of any kind (numpy, torch cpu, pinned) is one device.
    if (!cuda() && !o.cuda()) return true;
    return type == o.type && id == o.id;
  }
};

std::string device_name(const device& d) {
  if (d.type == nb::device::cpu::value) return "cpu";
  if (d.cuda()) return concat("cuda:", d.id);
  return concat("DLPack device type ", d.type, ":", d.id);
}

template <class A>
device device_of(const A& a) {
  return {a.device_type(), a.device_id()};
}

/// A DLPack-capable object as an array; `writable` for what the call writes.
template <class A>
A as_array(nb::handle obj, const char* call, const char* arg) {
  A a;
  if (!nb::try_cast(obj, a, false)) {
    const bool is_array = nb::hasattr(obj, "__dlpack__") || nb::hasattr(obj, "__array_interface__");
    fail_arg(call, arg,
             is_array && std::is_same_v<A, out_array>
                 ? std::string("is read-only, but the call writes it")
                 : concat("is a ", nb::inst_name(obj).c_str(),
                          ", not an array (a NumPy array or a torch tensor) of a supported dtype"));
  }
  return a;
}

template <class A>
void require_device(const A& a, const device& expected, const char* call, const char* arg) {
  const device d = device_of(a);
  if (!(d == expected))
    fail_arg(call, arg, concat("is on ", device_name(d), ", the state is on ", device_name(expected)));
}

template <class A>
void require_rank(const A& a, std::size_t rank, const char* call, const char* arg, const char* dims) {
  if (a.ndim() != rank)
    fail_arg(call, arg, concat("has ", a.ndim(), " dimensions, expected ", rank, " (", dims, ")"));
  for (std::size_t d = 0; d < rank; ++d) {
    if (a.shape(d) > 0x7FFFFFFF)
      fail_arg(call, arg, concat("has extent ", a.shape(d), " in dimension ", d, ", above int32"));
    if (a.stride(d) < 0)
      fail_arg(call, arg, concat("has a negative stride (", a.stride(d), " in dimension ", d,
                                 "); pass a copy (np.ascontiguousarray)"));
  }
}

template <class A>
void require_dtype(const A& a, nb::dlpack::dtype_code code, int bits, const char* call, const char* arg) {
  if (!is(a.dtype(), code, bits))
    fail_arg(call, arg,
             concat("has dtype ", dtype_name(a.dtype()), ", expected ", dtype_name({std::uint8_t(code), std::uint8_t(bits), 1})));
}

/// Row-major contiguous (extents of 1 may have any stride).
template <class A>
void require_contiguous(const A& a, const char* call, const char* arg) {
  std::int64_t expected = 1;
  for (std::size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expected)
      fail_arg(call, arg, concat("is not contiguous (stride ", a.stride(d), " in dimension ", d, ", expected ",
                                 expected, "); pass a contiguous copy"));
    expected *= static_cast<std::int64_t>(a.shape(d));
  }
}

template <class A>
elem elem_of(const A& a, const char* call, const char* arg) {
  const nb::dlpack::dtype t = a.dtype();
  if (is(t, nb::dlpack::dtype_code::Float, 32)) return elem::f32;
  if (is(t, nb::dlpack::dtype_code::Float, 16)) return elem::f16;
  if (is(t, nb::dlpack::dtype_code::Bfloat, 16)) return elem::bf16;
  fail_arg(call, arg, concat("has dtype ", dtype_name(t), ", expected float32, float16 or bfloat16"));
}

template <class A>
any_array to_any(const A& a, elem type) {
  any_array r;
  r.type = type;
  r.data = a.data();
  r.rank = static_cast<std::int32_t>(a.ndim());
  for (std::size_t d = 0; d < a.ndim(); ++d) {
    r.extents[d] = static_cast<std::int32_t>(a.shape(d));
    r.strides[d] = a.stride(d);
  }
  return r;
}

/// A float32 input of the given rank (any non-negative strides).
template <int R>
any_array float_array(nb::handle obj, const device& dev, const char* call, const char* arg, const char* dims) {
  const in_array a = as_array<in_array>(obj, call, arg);
  require_device(a, dev, call, arg);
  require_rank(a, R, call, arg, dims);
  require_dtype(a, nb::dlpack::dtype_code::Float, 32, call, arg);
  return to_any(a, elem::f32);
}

template <int R>
kvevict::tensor_view<const float, R> float_input(nb::handle obj, const device& dev, const char* call,
                                                 const char* arg, const char* dims) {
  return float_array<R>(obj, dev, call, arg, dims).template view<float, R>();
}

/// A contiguous int32 output of `count` elements (victims, freed, pages).
std::int32_t* int32_output(nb::handle obj, const device& dev, std::size_t count, const char* call, const char* arg) {
  if (obj.is_none()) return nullptr;
  out_array a = as_array<out_array>(obj, call, arg);
  require_device(a, dev, call, arg);
  require_dtype(a, nb::dlpack::dtype_code::Int, 32, call, arg);
  require_contiguous(a, call, arg);
  if (a.size() != count) fail_arg(call, arg, concat("has ", a.size(), " elements, expected ", count));
  return static_cast<std::int32_t*>(a.data());
}

// ---- the policy descriptor and the state ------------------------------------

/// A policy's spec, validated once, with the carve of the last memory
/// it saw (the carve is a pure function of the memory's address).
class Descriptor {
 public:
  explicit Descriptor(const policy_spec& spec) : d_(spec) {
    // Validates everything (the C++ messages name the config fields).
    state_bytes_ = with_policy(d_, [&](auto tag, const auto& config) {
                     using P = typename decltype(tag)::type;
                     return kvevict::batch_state_bytes<P>(d_.shape, config, d_.history);
                   }) +
                   state_header_bytes;
    layout_ = with_policy(d_, [&](auto tag, const auto& config) {
      using P = typename decltype(tag)::type;
      // Only pointer arithmetic happens at the stand-in address; nothing is read or written there.
      return kvevict::make_batch_state<P>(reinterpret_cast<void*>(layout_base), state_bytes_ - state_header_bytes,
                                          d_.shape, config, d_.history);
    });
  }

  const policy_spec& spec() const noexcept { return d_; }
  std::size_t state_bytes() const noexcept { return state_bytes_; }
  std::int32_t budget() const {
    return with_policy(d_, [&](auto tag, const auto& config) {
      return kvevict::policy_traits<typename decltype(tag)::type>::rule(config).budget;
    });
  }

  /// The state view inside `memory` (already checked to be large enough).
  ///
  /// make_batch_state aligns its sub-arrays to absolute 256-byte boundaries,
  /// so its layout depends on where the memory lies. A state tensor must
  /// keep its meaning when torch copies it (clone, functionalization under
  /// torch.compile, opcheck's copies), wherever the copy lands: the layout
  /// is carved once at an aligned stand-in address and shifted onto
  /// `memory`, which makes it a function of the descriptor alone.
  const batch_state_view& carve(unsigned char* memory) const {
    if (memory != carved_for_) {
      view_ = rebase(layout_, layout_base, reinterpret_cast<std::uintptr_t>(memory) + state_header_bytes);
      carved_for_ = memory;
    }
    return view_;
  }

 private:
  /// A 256-byte aligned stand-in address for the layout.
  static constexpr std::uintptr_t layout_base = std::uintptr_t{1} << 16;

  /// The view `v` carved at `from`, moved to `to`: every pointer of the
  /// state shifted by the same amount.
  static batch_state_view rebase(batch_state_view v, std::uintptr_t from, std::uintptr_t to) {
    static_assert(sizeof(batch_state_view) == 264 && sizeof(kvevict::history_view) == 56 &&
                      sizeof(kvevict::device_workspace) == 48 && sizeof(kvevict::key_anchor_view) == 32,
                  "batch_state_view changed: shift its new pointers in rebase() too");
    auto shift = [&](auto*& p) {
      using T = std::remove_reference_t<decltype(*p)>;
      if (p) p = reinterpret_cast<T*>(reinterpret_cast<std::uintptr_t>(p) - from + to);
    };
    shift(v.slots.positions);
    shift(v.slots.counts);
    shift(v.slots.next_slots);
    shift(v.slots.lengths);
    shift(v.scores);
    shift(v.score_buffer);
    shift(v.appended);
    shift(v.streams);
    shift(v.victim_scratch);
    shift(v.history.keys);
    shift(v.history.values);
    shift(v.history.rows);
    shift(v.history.cached);
    shift(v.history.work);
    shift(v.anchors.sums);
    shift(v.anchors.units);
    shift(v.anchors.upto);
    shift(v.work.partials);
    shift(v.work.arrivals);
    shift(v.work.evict_plans);
    shift(v.work.evict_counts);
    shift(v.work.select);
    return v;
  }

  policy_spec d_;
  std::size_t state_bytes_ = 0;
  batch_state_view layout_;  ///< carved at layout_base
  mutable unsigned char* carved_for_ = nullptr;
  mutable batch_state_view view_;
};

/// A state array resolved for one call.
struct state_ref {
  batch_state_view view;
  std::uint64_t* status = nullptr;
  device dev;
};

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

/// The active set: None (every sequence), an int32 list of distinct
/// sequence indices, or one uint8/bool flag per sequence. The array must
/// stay alive for the call: it is an argument of it.
kvevict::active_set parse_active(nb::handle obj, const state_ref& st, const char* call) {
  if (obj.is_none()) return kvevict::active_set::all();
  const in_array a = as_array<in_array>(obj, call, "active");
  require_device(a, st.dev, call, "active");
  require_rank(a, 1, call, "active", "a list of sequence indices, or one flag per sequence");
  require_contiguous(a, call, "active");
  if (is(a.dtype(), nb::dlpack::dtype_code::Int, 32))
    return kvevict::active_set::of_list(static_cast<const std::int32_t*>(a.data()),
                                        static_cast<std::int32_t>(a.shape(0)));
  if (is(a.dtype(), nb::dlpack::dtype_code::UInt, 8) || is(a.dtype(), nb::dlpack::dtype_code::Bool, 8)) {
    if (a.shape(0) != std::size_t(st.view.num_seqs()))
      fail_arg(call, "active", concat("has ", a.shape(0), " flags, expected one per sequence (", st.view.num_seqs(), ")"));
    return kvevict::active_set::of_flags(static_cast<const std::uint8_t*>(a.data()));
  }
  fail_arg(call, "active",
           concat("has dtype ", dtype_name(a.dtype()), ", expected int32 (sequence indices) or uint8/bool (flags)"));
}

/// A cache layout, checked (nanobind passes members only; this keeps a
/// value cast from C++ honest).
cache_layout parse_layout(cache_layout layout, const char* call) {
  const auto code = static_cast<std::int32_t>(layout);
  if (code < 0 || code > 3)
    fail_arg(call, "layout", concat("= ", code, " is not a cache layout (0 bhsd, 1 bshd, 2 paged nhd, 3 paged hnd)"));
  return layout;
}

const char* layout_dims(cache_layout kind) noexcept {
  return kind == cache_layout::bhsd        ? "[num_seqs][num_kv_heads][capacity][head_dim]"
         : kind == cache_layout::bshd      ? "[num_seqs][capacity][num_kv_heads][head_dim]"
         : kind == cache_layout::paged_nhd ? "[num_pages][page_size][num_kv_heads][head_dim]"
                                           : "[num_pages][num_kv_heads][page_size][head_dim]";
}

/// The geometry of a cache from its K array (device, rank and dtype already
/// checked) and page table: every field of any_cache but `v`.
template <class A>
any_cache describe_cache(cache_layout kind, const A& k, elem type, nb::handle table_obj, const device& dev,
                         std::int32_t state_capacity, const char* call) {
  const bool paged = kind == cache_layout::paged_nhd || kind == cache_layout::paged_hnd;
  if (k.shape(3) > 1 && k.stride(3) != 1)
    fail_arg(call, "k_cache", concat("has stride ", k.stride(3), " in its last dimension; rows (head_dim) must be contiguous"));
  any_cache c;
  c.type = type;
  c.k = const_cast<void*>(static_cast<const void*>(k.data()));
  c.head_dim = static_cast<std::int32_t>(k.shape(3));
  c.paged = paged;
  if (!paged) {
    if (!table_obj.is_none()) fail_arg(call, "page_table", "is given for a strided (bhsd/bshd) cache");
    const bool bhsd = kind == cache_layout::bhsd;
    c.num_seqs = static_cast<std::int32_t>(k.shape(0));
    c.num_heads = static_cast<std::int32_t>(k.shape(bhsd ? 1 : 2));
    c.capacity = static_cast<std::int32_t>(k.shape(bhsd ? 2 : 1));
    c.strided.stride_seq = k.stride(0);
    c.strided.stride_head = k.stride(bhsd ? 1 : 2);
    c.strided.stride_slot = k.stride(bhsd ? 2 : 1);
    return c;
  }
  if (table_obj.is_none()) fail_arg(call, "page_table", "is required for a paged cache");
  const in_array t = as_array<in_array>(table_obj, call, "page_table");
  require_device(t, dev, call, "page_table");
  require_rank(t, 2, call, "page_table", "[num_seqs][max_pages_per_seq]");
  require_dtype(t, nb::dlpack::dtype_code::Int, 32, call, "page_table");
  if (t.shape(1) > 1 && t.stride(1) != 1) fail_arg(call, "page_table", "rows must be contiguous");
  const bool nhd = kind == cache_layout::paged_nhd;
  kvevict::paged_layout& l = c.pages;
  l.page_table = static_cast<const std::int32_t*>(t.data());
  l.page_table_stride = t.shape(0) > 1 ? t.stride(0) : static_cast<std::int64_t>(t.shape(1));
  l.max_pages_per_seq = static_cast<std::int32_t>(t.shape(1));
  l.num_pages = static_cast<std::int32_t>(k.shape(0));
  l.page_size = static_cast<std::int32_t>(k.shape(nhd ? 1 : 2));
  l.stride_page = k.stride(0);
  l.stride_head = k.stride(nhd ? 2 : 1);
  l.stride_slot = k.stride(nhd ? 1 : 2);
  c.num_seqs = static_cast<std::int32_t>(t.shape(0));
  c.num_heads = static_cast<std::int32_t>(k.shape(nhd ? 2 : 1));
  const std::int64_t capacity = std::int64_t{l.max_pages_per_seq} * l.page_size;
  c.capacity = capacity > state_capacity ? state_capacity : static_cast<std::int32_t>(capacity);
  if (capacity < state_capacity)
    fail_arg(call, "page_table", concat("has ", l.max_pages_per_seq, " pages of ", l.page_size,
                                        " slots per sequence, below the state's capacity ", state_capacity));
  return c;
}

/// The cache view of (layout, k, v, page_table) on `dev`, for a policy of
/// `state_capacity` slots per head.
any_cache parse_cache(cache_layout layout, nb::handle k_obj, nb::handle v_obj, nb::handle table_obj, const device& dev,
                      std::int32_t state_capacity, const char* call) {
  const cache_layout kind = parse_layout(layout, call);
  const char* dims = layout_dims(kind);
  out_array k = as_array<out_array>(k_obj, call, "k_cache");
  out_array v = as_array<out_array>(v_obj, call, "v_cache");
  require_device(k, dev, call, "k_cache");
  require_device(v, dev, call, "v_cache");
  require_rank(k, 4, call, "k_cache", dims);
  require_rank(v, 4, call, "v_cache", dims);
  const elem type = elem_of(k, call, "k_cache");
  if (elem_of(v, call, "v_cache") != type)
    fail_arg(call, "v_cache", concat("has dtype ", dtype_name(v.dtype()), ", k_cache has ", dtype_name(k.dtype())));
  for (std::size_t d = 0; d < 4; ++d) {
    if (v.shape(d) != k.shape(d))
      fail_arg(call, "v_cache", concat("has extent ", v.shape(d), " in dimension ", d, ", k_cache has ", k.shape(d)));
    if (v.stride(d) != k.stride(d) && k.shape(d) > 1)
      fail_arg(call, "v_cache", concat("has stride ", v.stride(d), " in dimension ", d, ", k_cache has ", k.stride(d),
                                       " (one layout serves both)"));
  }
  any_cache c = describe_cache(kind, k, type, table_obj, dev, state_capacity, call);
  c.v = v.data();
  return c;
}

/// The cache view of (layout, k, v, page_table) for a batched state.
any_cache parse_cache(cache_layout layout, nb::handle k_obj, nb::handle v_obj, nb::handle table_obj,
                      const state_ref& st, const char* call) {
  return parse_cache(layout, k_obj, v_obj, table_obj, st.dev, st.view.capacity(), call);
}

/// The cache view of (layout, k, page_table) for a call that reads the keys
/// alone (key norms), K read-only. kvevict's kv_view has a V buffer, which
/// the key-norm path never reads but validates (non-null, disjoint from K):
/// it is given the address one past the last element of K, which lies
/// outside K's rows and is never dereferenced.
any_cache parse_keys(cache_layout layout, nb::handle k_obj, nb::handle table_obj, const device& dev,
                     std::int32_t state_capacity, const char* call) {
  const cache_layout kind = parse_layout(layout, call);
  const in_array k = as_array<in_array>(k_obj, call, "k_cache");
  require_device(k, dev, call, "k_cache");
  require_rank(k, 4, call, "k_cache", layout_dims(kind));
  const elem type = elem_of(k, call, "k_cache");
  any_cache c = describe_cache(kind, k, type, table_obj, dev, state_capacity, call);
  std::int64_t span = 1;  // elements from K's first to one past its last
  for (std::size_t d = 0; d < 4; ++d) {
    if (k.shape(d) == 0) span = 0;
    if (span) span += (static_cast<std::int64_t>(k.shape(d)) - 1) * k.stride(d);
  }
  const std::size_t bytes = static_cast<std::size_t>(span) * (type == elem::f32 ? 4 : 2);
  c.v = c.k ? static_cast<void*>(static_cast<unsigned char*>(c.k) + bytes) : nullptr;
  return c;
}

/// Rows of new K or V [num_seqs][num_kv_heads][head_dim] of the cache's type.
any_array parse_rows(nb::handle obj, const any_cache& cache, const state_ref& st, const char* call, const char* arg) {
  const in_array a = as_array<in_array>(obj, call, arg);
  require_device(a, st.dev, call, arg);
  require_rank(a, 3, call, arg, "[num_seqs][num_kv_heads][head_dim]");
  const elem t = elem_of(a, call, arg);
  if (t != cache.type)
    fail_arg(call, arg, concat("has dtype ", elem_name(t), ", the cache holds ", elem_name(cache.type)));
  return to_any(a, t);
}

/// Queries of rank R on `dev`: float32 or the cache's type.
template <std::size_t R>
any_array parse_queries(nb::handle obj, const any_cache& cache, const device& dev, const char* call,
                        const char* dims) {
  const in_array a = as_array<in_array>(obj, call, "queries");
  require_device(a, dev, call, "queries");
  require_rank(a, R, call, "queries", dims);
  const elem t = elem_of(a, call, "queries");
  if (t != elem::f32 && t != cache.type)
    fail_arg(call, "queries", concat("has dtype ", elem_name(t), ", expected float32 or the cache's ",
                                     elem_name(cache.type)));
  return to_any(a, t);
}

template <std::size_t R>
any_array parse_queries(nb::handle obj, const any_cache& cache, const state_ref& st, const char* call,
                        const char* dims) {
  return parse_queries<R>(obj, cache, st.dev, call, dims);
}

kvevict::lse_base parse_base(kvevict::lse_base base, const char* call) {
  if (base != kvevict::lse_base::natural && base != kvevict::lse_base::base2)
    fail_arg(call, "base", concat("= ", static_cast<int>(base), " is not natural or base2"));
  return base;
}

/// Runs a host call without the GIL, then raises its status.
template <class F>
void run_host(const state_ref& st, const char* call, F&& f) {
  {
    nb::gil_scoped_release release;
    f();
  }
  raise_host_status(st.status, call);
}

#ifdef KVEVICT_PY_CUDA
#define KVEVICT_PY_ON_DEVICE(st, host_call, cuda_call) \
  do {                                                 \
    if ((st).dev.cuda()) {                             \
      cuda_call;                                       \
    } else {                                           \
      host_call;                                       \
    }                                                  \
  } while (0)
#else
#define KVEVICT_PY_ON_DEVICE(st, host_call, cuda_call) \
  do {                                                 \
    host_call;                                         \
  } while (0)
#endif

// ---- the calls ----------------------------------------------------------------

void init(const Descriptor& desc, nb::handle memory, std::uintptr_t stream) {
  const state_ref st = resolve_state(desc, memory, "init");
  KVEVICT_PY_ON_DEVICE(st,
                       {
                         kvevict::init_batch_state(st.view);
                         clear_host_status(st.status);
                       },
                       cuda::init(st.view, st.status, stream_of(stream)));
}

void reset(const Descriptor& desc, nb::handle memory, nb::handle active_obj, nb::handle streams_obj,
           std::uintptr_t stream) {
  const char* call = "reset";
  const state_ref st = resolve_state(desc, memory, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  const std::uint64_t* streams = nullptr;
  if (!streams_obj.is_none()) {
    const in_array s = as_array<in_array>(streams_obj, call, "streams");
    require_device(s, st.dev, call, "streams");
    require_rank(s, 1, call, "streams", "one request stream per active entry");
    require_contiguous(s, call, "streams");
    if (!is(s.dtype(), nb::dlpack::dtype_code::UInt, 64) && !is(s.dtype(), nb::dlpack::dtype_code::Int, 64))
      fail_arg(call, "streams", concat("has dtype ", dtype_name(s.dtype()), ", expected uint64 or int64"));
    if (s.shape(0) != std::size_t(active.entries(st.view.num_seqs())))
      fail_arg(call, "streams", concat("has ", s.shape(0), " entries, expected one per active entry (",
                                       active.entries(st.view.num_seqs()), ")"));
    // int64 streams are read as uint64: a negative one reads above
    // max_random_stream and is refused by reset itself.
    streams = static_cast<const std::uint64_t*>(s.data());
  }
  KVEVICT_PY_ON_DEVICE(st, run_host(st, call, [&] { kvevict::reset_batch_sequences(st.view, active, streams); }),
                       cuda::reset(st.view, active, streams, st.status, stream_of(stream)));
}

void append(const Descriptor& desc, nb::handle memory, nb::handle active_obj, std::uintptr_t stream) {
  const char* call = "append";
  const state_ref st = resolve_state(desc, memory, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  KVEVICT_PY_ON_DEVICE(st, run_host(st, call, [&] { kvevict::batched_append(st.view, active, st.status); }),
                       cuda::append(st.view, active, st.status, stream_of(stream)));
}

void append_kv(const Descriptor& desc, nb::handle memory, cache_layout layout, nb::handle k, nb::handle v,
               nb::handle page_table, nb::handle k_new_obj, nb::handle v_new_obj, nb::handle active_obj,
               std::uintptr_t stream) {
  const char* call = "append";
  const state_ref st = resolve_state(desc, memory, call);
  const any_cache cache = parse_cache(layout, k, v, page_table, st, call);
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
/// the cache and have their own calls.
void observe_evict(const Descriptor& desc, nb::handle memory, decode_input input, nb::handle x_obj,
                   nb::handle lse_obj, float scale, kvevict::lse_base base_code, nb::handle victims_obj,
                   nb::handle active_obj, std::uintptr_t stream) {
  const char* call = "observe_evict";
  const state_ref st = resolve_state(desc, memory, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  std::int32_t* victims =
      int32_output(victims_obj, st.dev, std::size_t(st.view.num_seqs()) * st.view.num_heads(), call, "victims");
  auto step = [&](const auto& in) {
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
                           nb::handle page_table, nb::handle victims_obj, nb::handle active_obj,
                           std::uintptr_t stream) {
  const char* call = "observe_evict";
  const state_ref st = resolve_state(desc, memory, call);
  const any_cache cache = parse_cache(layout, k, v, page_table, st, call);
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
                        nb::handle page_table, nb::handle victims_obj, nb::handle active_obj, std::uintptr_t stream) {
  const char* call = "observe_evict";
  const state_ref st = resolve_state(desc, memory, call);
  const any_cache cache = parse_keys(layout, k, page_table, st.dev, st.view.capacity(), call);
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
              nb::handle v, nb::handle page_table, nb::handle q_obj, nb::handle lse_obj, float scale,
              kvevict::lse_base base_code, nb::handle freed_obj, nb::handle active_obj, std::uintptr_t stream) {
  const char* call = "evict_to";
  const state_ref st = resolve_state(desc, memory, call);
  const any_cache cache = parse_cache(layout, k, v, page_table, st, call);
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

/// SnapKV's parameters for an input whose window rows are `rows`: the
/// window is that extent. The library validates them (require_snap_window,
/// with its own argument names).
kvevict::snap_window parse_snap(std::int32_t rows, std::int32_t pool_width, kvevict::snap_pooling pooling) {
  return {rows, pool_width, pooling};
}

/// Batched prefill of any input kind (see prefill, prefill_snapkv and
/// prefill_key_diff); `pool_width` and `pooling` are read by the window_*
/// kinds only.
std::size_t run_prefill(const Descriptor& desc, nb::handle memory, nb::handle lengths_obj, std::int32_t max_length,
                        prefill_input kind, nb::handle x_obj, nb::handle lse_obj, float scale,
                        kvevict::lse_base base_code, std::int32_t pool_width, kvevict::snap_pooling pooling, cache_layout layout,
                        nb::handle k, nb::handle v, nb::handle page_table, nb::handle reclaimable_obj,
                        nb::handle active_obj, nb::handle workspace_obj, std::uintptr_t stream) {
  const char* call = "prefill";
  const state_ref st = resolve_state(desc, memory, call);
  const any_cache cache = parse_cache(layout, k, v, page_table, st, call);
  const kvevict::active_set active = parse_active(active_obj, st, call);
  const in_array lengths = as_array<in_array>(lengths_obj, call, "lengths");
  require_device(lengths, st.dev, call, "lengths");
  require_rank(lengths, 1, call, "lengths", "one prompt length per sequence");
  require_dtype(lengths, nb::dlpack::dtype_code::Int, 32, call, "lengths");
  require_contiguous(lengths, call, "lengths");
  if (lengths.shape(0) != std::size_t(st.view.num_seqs()))
    fail_arg(call, "lengths", concat("has ", lengths.shape(0), " entries, expected num_seqs = ", st.view.num_seqs()));
  const kvevict::prompt_lengths prompts{static_cast<const std::int32_t*>(lengths.data()), max_length};
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
                                          kvevict::batch_prefill_queries<T>{x.view<T, 4>(), lse, scale, base}, view,
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
                                          kvevict::batch_window_queries<T>{x.view<T, 4>(), lse, scale, base, snap},
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
                    cache_layout layout, nb::handle k, nb::handle v, nb::handle page_table,
                    nb::handle reclaimable_obj, nb::handle active_obj, nb::handle workspace_obj,
                    std::uintptr_t stream) {
  if (is_window(input) || input == prefill_input::key_diff)
    fail_arg("prefill", "input",
             concat("= ", prefill_input_name(input),
                    " is not probs, sums, queries, none or key_norms (SnapKV and KeyDiff have their own calls)"));
  return run_prefill(desc, memory, lengths_obj, max_length, input, x_obj, lse_obj, scale, base_code, 0,
                     kvevict::snap_pooling::max, layout, k, v, page_table, reclaimable_obj, active_obj, workspace_obj, stream);
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
                           cache_layout layout, nb::handle k, nb::handle v, nb::handle page_table,
                           nb::handle reclaimable_obj, nb::handle active_obj, nb::handle workspace_obj,
                           std::uintptr_t stream) {
  if (!is_window(input))
    fail_arg("prefill", "input",
             concat("= ", prefill_input_name(input), " is not window_probs, window_logits or window_queries"));
  return run_prefill(desc, memory, lengths_obj, max_length, input, x_obj, lse_obj, scale, base_code, pool_width,
                     pooling, layout, k, v, page_table, reclaimable_obj, active_obj, workspace_obj, stream);
}

/// KeyDiff prefill (kvevict/batch/prefill_key_diff.hpp): the prompts scored
/// by their cached keys alone, position p by -cos(k_p, the sum of its
/// head's unit prompt keys). Its own entry point rather than an input of
/// prefill: it takes no x, lse, scale or base. Workspace and return value
/// as prefill.
std::size_t prefill_key_diff(const Descriptor& desc, nb::handle memory, nb::handle lengths_obj,
                             std::int32_t max_length, cache_layout layout, nb::handle k, nb::handle v,
                             nb::handle page_table, nb::handle reclaimable_obj, nb::handle active_obj,
                             nb::handle workspace_obj, std::uintptr_t stream) {
  return run_prefill(desc, memory, lengths_obj, max_length, prefill_input::key_diff, nb::none(), nb::none(), 1.0f,
                     kvevict::lse_base::natural, 0, kvevict::snap_pooling::max, layout, k, v, page_table, reclaimable_obj, active_obj, workspace_obj, stream);
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

/// Benchmark hook (benchmarks/python/bench_python.py): the time per decode
/// step of `steps` steps of batched_append + batched_observe_evict from
/// `probs` on a host state, in C++ with no Python in between: the baseline
/// the Python calls' overhead is measured against. Returns nanoseconds per
/// step; raises like the calls it times.
double bench_decode_steps(const Descriptor& desc, nb::handle memory, nb::handle probs_obj, nb::handle victims_obj,
                          std::int64_t steps) {
  const char* call = "bench_decode_steps";
  const state_ref st = resolve_state(desc, memory, call);
  if (st.dev.cuda()) fail_arg(call, "state", "must be in host memory");
  const kvevict::batch_probs in{float_input<3>(probs_obj, st.dev, call, "probs", "[num_seqs][num_q_heads][slots]")};
  std::int32_t* victims =
      int32_output(victims_obj, st.dev, std::size_t(st.view.num_seqs()) * st.view.num_heads(), call, "victims");
  const kvevict::active_set all = kvevict::active_set::all();
  std::chrono::steady_clock::duration elapsed{};
  {
    nb::gil_scoped_release release;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < steps; ++i) {
      kvevict::batched_append(st.view, all, st.status);
      kvevict::batched_observe_evict(st.view, all, in, victims, st.status);
    }
    elapsed = std::chrono::steady_clock::now() - t0;
  }
  raise_host_status(st.status, call);
  return std::chrono::duration<double, std::nano>(elapsed).count() / double(steps > 0 ? steps : 1);
}

/// ml_dtypes' bfloat16 NumPy arrays have no DLPack dtype NumPy can export;
/// this views their bits (a uint16 array) as bfloat16, zero-copy, writable
/// when the array is.
template <class A>
nb::object bfloat16_view(const A& a, nb::handle owner) {
  std::vector<std::size_t> shape(a.ndim());
  std::vector<std::int64_t> strides(a.ndim());
  for (std::size_t d = 0; d < a.ndim(); ++d) {
    shape[d] = a.shape(d);
    strides[d] = a.stride(d);
  }
  const nb::dlpack::dtype bf16{std::uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
  // array_api: a nanobind array object with __dlpack__ and the buffer protocol.
  using R = std::conditional_t<std::is_same_v<A, out_array>, nb::ndarray<nb::array_api>,
                               nb::ndarray<nb::array_api, nb::ro>>;
  return nb::cast(R(const_cast<void*>(static_cast<const void*>(a.data())), a.ndim(), shape.data(), owner,
                    strides.data(), bf16, a.device_type(), a.device_id()));
}

nb::object as_bfloat16(nb::handle obj) {
  const char* call = "as_bfloat16";
  out_array w;
  if (nb::try_cast(obj, w, false)) {
    require_dtype(w, nb::dlpack::dtype_code::UInt, 16, call, "array");
    return bfloat16_view(w, obj);
  }
  const in_array r = as_array<in_array>(obj, call, "array");
  require_dtype(r, nb::dlpack::dtype_code::UInt, 16, call, "array");
  return bfloat16_view(r, obj);
}

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
  void observe_key_norms(std::int32_t b, cache_layout layout, nb::handle k, nb::handle page_table) {
    const any_cache cache = parse_keys(layout, k, page_table, device{}, p_.shape().capacity, "observe");
    visit_cache(cache, [&](auto view) {
      using V = decltype(view);
      p_.observe(b, kvevict::key_norms<typename V::element_type, typename V::layout_type>{view});
    });
  }
  /// KeyDiff: each occupied slot's score becomes -cos(k, the running anchor
  /// of b's cached keys). Only h2o_policy has it, as for the prefill.
  void observe_key_diff(std::int32_t b, cache_layout layout, nb::handle k, nb::handle page_table) {
    const any_cache cache = parse_keys(layout, k, page_table, device{}, p_.shape().capacity, "observe");
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
                                                          nb::handle k, nb::handle v, nb::handle page_table) {
    const any_cache cache = parse_cache(layout, k, v, page_table, device{}, p_.shape().capacity, "prefill");
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
                                                         nb::handle k, nb::handle v, nb::handle page_table) {
    const char* call = "prefill";
    const any_cache cache = parse_cache(layout, k, v, page_table, device{}, p_.shape().capacity, call);
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
                                                       nb::handle v, nb::handle page_table) {
    const char* call = "prefill";
    if (!is_window(input))
      fail_arg(call, "input",
               concat("= ", prefill_input_name(input), " is not window_probs, window_logits or window_queries"));
    const int which = input == prefill_input::window_probs ? 0 : input == prefill_input::window_logits ? 1 : 2;
    const any_cache cache = parse_cache(layout, k, v, page_table, device{}, p_.shape().capacity, call);
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
          r = p_.prefill(b, length, kvevict::window_queries<T>{x.view<T, 3>(), lse, scale, base, snap}, view);
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
      .def("observe_key_norms", &S::observe_key_norms, "b"_a, "layout"_a, "k_cache"_a, "page_table"_a.none() = nb::none(),
           "Sets each occupied slot's score to -||k|| of its cached key (k_cache in `layout`).")
      .def("observe_key_diff", &S::observe_key_diff, "b"_a, "layout"_a, "k_cache"_a, "page_table"_a.none() = nb::none(),
           "KeyDiff (h2o): sets each occupied slot's score to -cos(k, the running anchor of the cached keys).")
      .def("skip_observe", &S::skip_observe, "b"_a)
      .def("evict", &S::evict, "b"_a, "Frees one victim slot per KV head above the budget; returns the freed slots (-1: none).")
      .def("prefill_key_norms", &S::prefill_key_norms, "b"_a, "length"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
           "page_table"_a.none() = nb::none(),
           "Compresses the prompt in slots [0, length) by its key norms, moving the kept K/V rows to slots [0, kept); "
           "returns (kept, reclaimable_pages).")
      .def("prefill_key_diff", &S::prefill_key_diff, "b"_a, "length"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
           "page_table"_a.none() = nb::none(),
           "KeyDiff prefill (h2o): the prompt in slots [0, length) scored by -cos(k_p, the sum of its head's unit "
           "keys); the kept K/V rows move to slots [0, kept). Returns (kept, reclaimable_pages).")
      .def("prefill_snapkv", &S::prefill_snapkv, "b"_a, "length"_a, "input"_a, "x"_a, "lse"_a.none(), "scale"_a,
           "base"_a, "pool_width"_a, "pooling"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
           "page_table"_a.none() = nb::none(),
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
  nb::enum_<decode_input>(m, "DecodeInput", "The input of a decode step (observe_evict).", nb::is_arithmetic())
      .value("probs", decode_input::probs)
      .value("head_scores", decode_input::head_scores)
      .value("logits", decode_input::logits)
      .value("queries", decode_input::queries)
      .value("key_norms", decode_input::key_norms)
      .value("key_diff", decode_input::key_diff);
  nb::enum_<prefill_input>(m, "PrefillInput", "The input of a batched prefill.", nb::is_arithmetic())
      .value("probs", prefill_input::probs)
      .value("sums", prefill_input::sums)
      .value("queries", prefill_input::queries)
      .value("none", prefill_input::none)
      .value("key_norms", prefill_input::key_norms)
      .value("window_probs", prefill_input::window_probs)
      .value("window_logits", prefill_input::window_logits)
      .value("window_queries", prefill_input::window_queries)
      .value("key_diff", prefill_input::key_diff);
  nb::enum_<elem>(m, "Elem", "Element types of K/V, queries and new rows.", nb::is_arithmetic())
      .value("float32", elem::f32)
      .value("float16", elem::f16)
      .value("bfloat16", elem::bf16);
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
                 std::int64_t budget, std::uint64_t seed, std::int64_t max_tokens, std::int64_t head_dim) {
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
             new (self) S(s);
           },
           "kind"_a, "num_seqs"_a, "num_kv_heads"_a, "num_q_heads"_a, "capacity"_a, nb::kw_only(), "heavy"_a = 0,
           "recent"_a = 0, "reduce"_a = kvevict::group_reduce::sum, "decay"_a = 1.0f, "sinks"_a = 0, "window"_a = 0,
           "budget"_a = 0, "seed"_a = 0, "max_tokens"_a = 0, "head_dim"_a = 0)
      .def_prop_ro("kind", [](const S& s) { return s.kind; })
      .def_prop_ro("num_seqs", [](const S& s) { return s.shape.num_seqs; })
      .def_prop_ro("num_kv_heads", [](const S& s) { return s.shape.num_kv_heads; })
      .def_prop_ro("num_q_heads", [](const S& s) { return s.shape.num_q_heads; })
      .def_prop_ro("capacity", [](const S& s) { return s.shape.capacity; })
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

PyObject* new_exception(nb::module_& m, const char* name, PyObject* base1, PyObject* base2, const char* doc) {
  nb::object bases = base2 ? nb::make_tuple(nb::handle(base1), nb::handle(base2)) : nb::make_tuple(nb::handle(base1));
  const std::string qualified = concat("kvevict.", name);
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (!type) throw nb::python_error();
  m.attr(name) = nb::handle(type);
  return type;
}

}  // namespace
}  // namespace kvevict_py

NB_MODULE(_ext, m) {
  using namespace kvevict_py;
  m.doc() = "kvevict's C++ batched API over DLPack arrays (internal: use the kvevict package).";
  // Descriptors live in caches of the Python package (kvevict.ops) and in
  // torch's op registry until the interpreter exits: not leaks.
  nb::set_leak_warnings(false);

  exceptions.error = new_exception(m, "Error", PyExc_Exception, nullptr, "Base of every error kvevict raises.");
  exceptions.invalid_argument = new_exception(m, "InvalidArgument", exceptions.error, PyExc_ValueError,
                                              "A shape, dtype, stride, device, pointer or configuration that cannot be used.");
  exceptions.budget_error = new_exception(m, "BudgetError", exceptions.invalid_argument, nullptr,
                                          "A budget that does not fit the capacity, or whose parts do not add up.");
  exceptions.out_of_range = new_exception(m, "OutOfRange", exceptions.invalid_argument, PyExc_IndexError,
                                          "An index (sequence, head, slot, page id, length) outside its range.");
  exceptions.non_finite_error = new_exception(m, "NonFiniteError", exceptions.invalid_argument, nullptr,
                                              "NaN or infinity in an input, or a score that would overflow.");
  exceptions.state_error = new_exception(m, "StateError", exceptions.error, PyExc_RuntimeError,
                                         "A call that is valid in itself but not in the current state.");
  exceptions.cuda_error = new_exception(m, "CudaError", exceptions.error, PyExc_RuntimeError,
                                        "A CUDA runtime call or kernel launch failed.");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const kvevict::budget_error& e) {
      PyErr_SetString(exceptions.budget_error, e.what());
    } catch (const kvevict::out_of_range& e) {
      PyErr_SetString(exceptions.out_of_range, e.what());
    } catch (const kvevict::non_finite_error& e) {
      PyErr_SetString(exceptions.non_finite_error, e.what());
    } catch (const kvevict::invalid_argument& e) {
      PyErr_SetString(exceptions.invalid_argument, e.what());
    } catch (const kvevict::state_error& e) {
      PyErr_SetString(exceptions.state_error, e.what());
    } catch (const cuda_failure& e) {
      PyErr_SetString(exceptions.cuda_error, e.what());
    } catch (const kvevict::error& e) {
      PyErr_SetString(exceptions.error, e.what());
    }
  });

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
  m.def("append", &append, "desc"_a, "state"_a, "active"_a = none, "stream"_a = 0);
  m.def("append_kv", &append_kv, "desc"_a, "state"_a, "layout"_a, "k_cache"_a, "v_cache"_a, "page_table"_a.none(),
        "k_new"_a, "v_new"_a, "active"_a = none, "stream"_a = 0);
  m.def("observe_evict", &observe_evict, "desc"_a, "state"_a, "input"_a, "x"_a, "lse"_a.none(), "scale"_a, "base"_a,
        "victims"_a.none(), "active"_a = none, "stream"_a = 0);
  m.def("observe_evict_queries", &observe_evict_queries, "desc"_a, "state"_a, "queries"_a, "lse"_a, "scale"_a,
        "base"_a, "layout"_a, "k_cache"_a, "v_cache"_a, "page_table"_a.none(), "victims"_a.none(), "active"_a = none,
        "stream"_a = 0);
  for (const bool diff : {false, true})
    m.def(diff ? "observe_evict_key_diff" : "observe_evict_key_norms",
          [diff](const Descriptor& desc, nb::handle memory, cache_layout layout, nb::handle k, nb::handle page_table,
                 nb::handle victims, nb::handle active, std::uintptr_t stream) {
            observe_evict_keys(diff, desc, memory, layout, k, page_table, victims, active, stream);
          },
          "desc"_a, "state"_a, "layout"_a, "k_cache"_a, "page_table"_a.none(), "victims"_a.none(), "active"_a = none,
          "stream"_a = 0);
  m.def("append_tokens", &append_tokens, "desc"_a, "state"_a, "tokens"_a, "active"_a = none, "stream"_a = 0);
  m.def("evict_to", &evict_to, "desc"_a, "state"_a, "target"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
        "page_table"_a.none(), "queries"_a.none(), "lse"_a.none(), "scale"_a, "base"_a, "freed"_a.none(),
        "active"_a = none, "stream"_a = 0);
  m.def("evict_to_moves", &evict_to_moves, "desc"_a, "state"_a, "target"_a, "moves"_a, "move_counts"_a,
        "active"_a = none, "stream"_a = 0);
  m.def("prefill", &prefill, "desc"_a, "state"_a, "lengths"_a, "max_length"_a, "input"_a, "x"_a.none(),
        "lse"_a.none(), "scale"_a, "base"_a, "layout"_a, "k_cache"_a, "v_cache"_a, "page_table"_a.none(),
        "reclaimable_pages"_a.none(), "active"_a = none, "workspace"_a = none, "stream"_a = 0);
  m.def("prefill_snapkv", &prefill_snapkv, "desc"_a, "state"_a, "lengths"_a, "max_length"_a, "input"_a, "x"_a,
        "lse"_a.none(), "scale"_a, "base"_a, "pool_width"_a, "pooling"_a, "layout"_a, "k_cache"_a, "v_cache"_a,
        "page_table"_a.none(), "reclaimable_pages"_a.none(), "active"_a = none, "workspace"_a = none,
        "stream"_a = 0);
  m.def("prefill_key_diff", &prefill_key_diff, "desc"_a, "state"_a, "lengths"_a, "max_length"_a, "layout"_a,
        "k_cache"_a, "v_cache"_a, "page_table"_a.none(), "reclaimable_pages"_a.none(), "active"_a = none,
        "workspace"_a = none, "stream"_a = 0);
  m.def("status_word", &status_word, "desc"_a, "state"_a, "stream"_a = 0);
  m.def("check", &check, "desc"_a, "state"_a, "stream"_a = 0, "call"_a = "check");
  m.def("state_offsets", &state_offsets, "desc"_a, "state"_a);
  m.def("as_bfloat16", &as_bfloat16, "array"_a);
  m.def("_bench_decode_steps", &bench_decode_steps, "desc"_a, "state"_a, "probs"_a, "victims"_a, "steps"_a);
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
#ifdef KVEVICT_PY_CUDA
  m.attr("CUDA") = true;
#else
  m.attr("CUDA") = false;
#endif

  bind_sequence_policy<kvevict::h2o_policy>(m, "SequenceH2O", "Per-sequence h2o_policy (host; slot table only).");
  bind_sequence_policy<kvevict::recent_window_policy>(m, "SequenceRecentWindow",
                                                      "Per-sequence recent_window_policy (host; slot table only).");
  bind_sequence_policy<kvevict::random_policy>(m, "SequenceRandom", "Per-sequence random_policy (host; slot table only).");
}
