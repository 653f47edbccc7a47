#pragma once
// What the extension's translation units share (bindings split by topic:
// views.cpp the arrays and caches, state.cpp the spec, the state and its
// status, decode.cpp, prefill.cpp, multi_token.cpp, sequence.cpp the
// per-sequence classes, bench.cpp the benchmark hook, module.cpp the module
// and its exceptions).
//
// Thin by design: the bindings turn DLPack tensors (NumPy arrays, PyTorch
// CPU or CUDA tensors) into kvevict's views, zero-copy, check what only the
// Python side can get wrong (dtype, rank, device, strides a view cannot
// express), and call the C++ batched API: the host backend for host
// memory, the gpu:: launchers for CUDA memory on the caller's stream. Every
// decision comes from the C++ library; nothing here knows a policy's rule.
//
// A batched state lives in one uint8 array the caller owns (a NumPy array or
// a torch tensor, on the host or the GPU): its first 8 bytes hold the status
// word, the kvevict state is carved after `state_header_bytes`. So the state
// can be a tensor argument of a torch.library op, and moves with it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "common.hpp"
#ifdef KVEVICT_PY_CUDA
#include "cuda_backend.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace kvevict_py {

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
/// Set by module.cpp at import.
extern exception_types exceptions;

[[noreturn]] void fail_arg(const char* call, const char* arg, const std::string& what);

/// Throws the library's exception for a status word that is not clear, after
/// clearing it (host memory). The word's meaning and the exception it maps to
/// are kvevict's own (batch/status.hpp).
void raise_host_status(std::uint64_t* status, const char* call);

void clear_host_status(std::uint64_t* status);

// ---- arrays ----------------------------------------------------------------

using in_array = nb::ndarray<nb::ro>;  // read by the call
using out_array = nb::ndarray<>;       // written by the call

std::string dtype_name(const nb::dlpack::dtype& t);

bool is(const nb::dlpack::dtype& t, nb::dlpack::dtype_code code, int bits);

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

std::string device_name(const device& d);

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
  if (is(t, nb::dlpack::dtype_code::Float8_E4M3FN, 8)) return elem::f8e4m3;
  if (is(t, nb::dlpack::dtype_code::Float8_E5M2, 8)) return elem::f8e5m2;
  fail_arg(call, arg,
           concat("has dtype ", dtype_name(t), ", expected float32, float16, bfloat16, float8_e4m3fn or float8_e5m2"));
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
std::int32_t* int32_output(nb::handle obj, const device& dev, std::size_t count, const char* call, const char* arg);

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
      view_ = kvevict::detail::rebase_state(  // every pointer of the layout shifted by the same amount
          layout_, static_cast<std::ptrdiff_t>(reinterpret_cast<std::uintptr_t>(memory) + state_header_bytes - layout_base));
      carved_for_ = memory;
    }
    return view_;
  }

 private:
  /// A 256-byte aligned stand-in address for the layout.
  static constexpr std::uintptr_t layout_base = std::uintptr_t{1} << 16;

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

state_ref resolve_state(const Descriptor& desc, nb::handle memory, const char* call);

void* stream_of(std::uintptr_t stream);

/// The active set: None (every sequence), an int32 list of distinct
/// sequence indices, or one uint8/bool flag per sequence. The array must
/// stay alive for the call: it is an argument of it.
kvevict::active_set parse_active(nb::handle obj, const state_ref& st, const char* call, const char* arg = "active");

/// A cache layout, checked (nanobind passes members only; this keeps a
/// value cast from C++ honest).
cache_layout parse_layout(cache_layout layout, const char* call);

const char* layout_dims(cache_layout kind) noexcept;

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
any_cache parse_cache(cache_layout layout, nb::handle k_obj, nb::handle v_obj, nb::handle table_obj,
                      nb::handle scales_obj, const device& dev, std::int32_t state_capacity, const char* call);

/// The cache view of (layout, k, v, page_table, scales) for a batched state.
/// scales: an fp8 cache's float32 [2][1 or num_kv_heads] (K's, then V's),
/// None for any other cache.
any_cache parse_cache(cache_layout layout, nb::handle k_obj, nb::handle v_obj, nb::handle table_obj,
                      nb::handle scales_obj, const state_ref& st, const char* call);

/// The cache view of (layout, k, page_table) for a call that reads the keys
/// alone (key norms), K read-only. kvevict's kv_view has a V buffer, which
/// the key-norm path never reads but validates (non-null, disjoint from K):
/// it is given the address one past the last element of K, which lies
/// outside K's rows and is never dereferenced.
any_cache parse_keys(cache_layout layout, nb::handle k_obj, nb::handle table_obj, nb::handle scales_obj,
                     const device& dev, std::int32_t state_capacity, const char* call);

/// Rows of new K or V [num_seqs][num_kv_heads][head_dim] of the cache's type.
any_array parse_rows(nb::handle obj, const any_cache& cache, const state_ref& st, const char* call, const char* arg);

/// Queries of rank R on `dev`: float32 or the cache's type.
template <std::size_t R>
any_array parse_queries(nb::handle obj, const any_cache& cache, const device& dev, const char* call,
                        const char* dims) {
  const in_array a = as_array<in_array>(obj, call, "queries");
  require_device(a, dev, call, "queries");
  require_rank(a, R, call, "queries", dims);
  const elem t = elem_of(a, call, "queries");
  if (t != elem::f32 && (t != cache.type || is_fp8(t)))
    fail_arg(call, "queries",
             is_fp8(cache.type) ? concat("has dtype ", elem_name(t), ", expected float32 (an ", elem_name(cache.type),
                                         " cache's queries are numbers, not codes)")
                                : concat("has dtype ", elem_name(t), ", expected float32 or the cache's ",
                                         elem_name(cache.type)));
  return to_any(a, t);
}

template <std::size_t R>
any_array parse_queries(nb::handle obj, const any_cache& cache, const state_ref& st, const char* call,
                        const char* dims) {
  return parse_queries<R>(obj, cache, st.dev, call, dims);
}

kvevict::lse_base parse_base(kvevict::lse_base base, const char* call);

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

/// SnapKV's parameters for an input whose window rows are `rows`: the
/// window is that extent. The library validates them (require_snap_window,
/// with its own argument names).
kvevict::snap_window parse_snap(std::int32_t rows, std::int32_t pool_width, kvevict::snap_pooling pooling);

// ---- each topic's part of the module (module.cpp calls them) ----------------

void bind_views(nb::module_& m);
void bind_state(nb::module_& m);
void bind_decode(nb::module_& m);
void bind_multi_token(nb::module_& m);
void bind_prefill(nb::module_& m);
void bind_sequence(nb::module_& m);
void bind_bench(nb::module_& m);

}  // namespace kvevict_py
