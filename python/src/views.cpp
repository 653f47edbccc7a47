// Arrays, caches and the small inputs: DLPack objects checked and turned into kvevict views.
#include "bindings.hpp"

#include <vector>

namespace kvevict_py {

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

std::string dtype_name(const nb::dlpack::dtype& t) {
  const char* kind = "?";
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: kind = "complex"; break;
    case nb::dlpack::dtype_code::Bool: kind = "bool"; break;
    case nb::dlpack::dtype_code::Float8_E4M3FN: return "float8_e4m3fn";
    case nb::dlpack::dtype_code::Float8_E5M2: return "float8_e5m2";
    default: break;
  }
  return concat(kind, int(t.bits), t.lanes != 1 ? concat("x", int(t.lanes)) : std::string());
}

bool is(const nb::dlpack::dtype& t, nb::dlpack::dtype_code code, int bits) {
  return t.code == static_cast<std::uint8_t>(code) && t.bits == bits && t.lanes == 1;
}

std::string device_name(const device& d) {
  if (d.type == nb::device::cpu::value) return "cpu";
  if (d.cuda()) return concat("cuda:", d.id);
  return concat("DLPack device type ", d.type, ":", d.id);
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

/// The active set: None (every sequence), an int32 list of distinct
/// sequence indices, or one uint8/bool flag per sequence. The array must
/// stay alive for the call: it is an argument of it.
kvevict::active_set parse_active(nb::handle obj, const state_ref& st, const char* call, const char* arg) {
  if (obj.is_none()) return kvevict::active_set::all();
  const in_array a = as_array<in_array>(obj, call, arg);
  require_device(a, st.dev, call, arg);
  require_rank(a, 1, call, arg, "a list of sequence indices, or one flag per sequence");
  require_contiguous(a, call, arg);
  if (is(a.dtype(), nb::dlpack::dtype_code::Int, 32))
    return kvevict::active_set::of_list(static_cast<const std::int32_t*>(a.data()),
                                        static_cast<std::int32_t>(a.shape(0)));
  if (is(a.dtype(), nb::dlpack::dtype_code::UInt, 8) || is(a.dtype(), nb::dlpack::dtype_code::Bool, 8)) {
    if (a.shape(0) != std::size_t(st.view.num_seqs()))
      fail_arg(call, arg, concat("has ", a.shape(0), " flags, expected one per sequence (", st.view.num_seqs(), ")"));
    return kvevict::active_set::of_flags(static_cast<const std::uint8_t*>(a.data()));
  }
  fail_arg(call, arg,
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

/// The cache view of (layout, k, v, page_table) on `dev`, for a policy of
/// `state_capacity` slots per head.
/// The scales of an fp8 cache: float32 [2][1] (one K and one V scale per
/// layer) or [2][num_kv_heads] (per KV head), contiguous, on the cache's
/// device; required for an fp8 cache, refused for any other (its values
/// are its elements). Their values are checked by the calls that read keys.
void parse_scales(any_cache& c, nb::handle obj, const device& dev, const char* call) {
  if (!is_fp8(c.type)) {
    if (!obj.is_none())
      fail_arg(call, "scales", concat("are given for a ", elem_name(c.type), " cache: scales belong to fp8 caches"));
    return;
  }
  if (obj.is_none())
    fail_arg(call, "scales", concat("are required for an ", elem_name(c.type),
                                    " cache (a code's value is code x scale): CacheView(..., k_scale=, v_scale=)"));
  const in_array a = as_array<in_array>(obj, call, "scales");
  require_device(a, dev, call, "scales");
  require_rank(a, 2, call, "scales", "[2][1 or num_kv_heads] (K's row, then V's)");
  require_dtype(a, nb::dlpack::dtype_code::Float, 32, call, "scales");
  require_contiguous(a, call, "scales");
  const std::size_t n = a.shape(1);
  if (a.shape(0) != 2 || (n != 1 && n != std::size_t(c.num_heads)))
    fail_arg(call, "scales", concat("has shape [", a.shape(0), "][", n, "], expected [2][1] or [2][", c.num_heads,
                                    "] (num_kv_heads)"));
  const float* k = static_cast<const float*>(a.data());
  c.scales = kvevict::kv_scales{k, k + n, n > 1 ? 1 : 0};
}

any_cache parse_cache(cache_layout layout, nb::handle k_obj, nb::handle v_obj, nb::handle table_obj,
                      nb::handle scales_obj, const device& dev, std::int32_t state_capacity, const char* call) {
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
  parse_scales(c, scales_obj, dev, call);
  return c;
}

/// The cache view of (layout, k, v, page_table, scales) for a batched state.
any_cache parse_cache(cache_layout layout, nb::handle k_obj, nb::handle v_obj, nb::handle table_obj,
                      nb::handle scales_obj, const state_ref& st, const char* call) {
  return parse_cache(layout, k_obj, v_obj, table_obj, scales_obj, st.dev, st.view.capacity(), call);
}

/// The cache view of (layout, k, page_table) for a call that reads the keys
/// alone (key norms), K read-only. kvevict's kv_view has a V buffer, which
/// the key-norm path never reads but validates (non-null, disjoint from K):
/// it is given the address one past the last element of K, which lies
/// outside K's rows and is never dereferenced.
any_cache parse_keys(cache_layout layout, nb::handle k_obj, nb::handle table_obj, nb::handle scales_obj,
                     const device& dev, std::int32_t state_capacity, const char* call) {
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
  const std::size_t bytes = static_cast<std::size_t>(span) * elem_bytes(type);
  c.v = c.k ? static_cast<void*>(static_cast<unsigned char*>(c.k) + bytes) : nullptr;
  parse_scales(c, scales_obj, dev, call);
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

kvevict::lse_base parse_base(kvevict::lse_base base, const char* call) {
  if (base != kvevict::lse_base::natural && base != kvevict::lse_base::base2)
    fail_arg(call, "base", concat("= ", static_cast<int>(base), " is not natural or base2"));
  return base;
}

/// SnapKV's parameters for an input whose window rows are `rows`: the
/// window is that extent. The library validates them (require_snap_window,
/// with its own argument names).
kvevict::snap_window parse_snap(std::int32_t rows, std::int32_t pool_width, kvevict::snap_pooling pooling) {
  return {rows, pool_width, pooling};
}

namespace {

/// ml_dtypes' bfloat16 and float8 NumPy arrays have no DLPack dtype NumPy
/// can export; this views their bits (a uint16 or uint8 array) as `type`,
/// zero-copy, writable when the array is.
template <class A>
nb::object typed_view(const A& a, nb::handle owner, nb::dlpack::dtype type) {
  std::vector<std::size_t> shape(a.ndim());
  std::vector<std::int64_t> strides(a.ndim());
  for (std::size_t d = 0; d < a.ndim(); ++d) {
    shape[d] = a.shape(d);
    strides[d] = a.stride(d);
  }
  // array_api: a nanobind array object with __dlpack__ and the buffer protocol.
  using R = std::conditional_t<std::is_same_v<A, out_array>, nb::ndarray<nb::array_api>,
                               nb::ndarray<nb::array_api, nb::ro>>;
  return nb::cast(R(const_cast<void*>(static_cast<const void*>(a.data())), a.ndim(), shape.data(), owner,
                    strides.data(), type, a.device_type(), a.device_id()));
}

/// The bits array `obj` (uint of type's width) viewed as `type`.
nb::object as_typed(nb::handle obj, nb::dlpack::dtype type, const char* call) {
  out_array w;
  if (nb::try_cast(obj, w, false)) {
    require_dtype(w, nb::dlpack::dtype_code::UInt, type.bits, call, "array");
    return typed_view(w, obj, type);
  }
  const in_array r = as_array<in_array>(obj, call, "array");
  require_dtype(r, nb::dlpack::dtype_code::UInt, type.bits, call, "array");
  return typed_view(r, obj, type);
}

nb::object as_bfloat16(nb::handle obj) {
  return as_typed(obj, {std::uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1}, "as_bfloat16");
}

/// e5m2: float8_e5m2, else float8_e4m3fn.
nb::object as_float8(nb::handle obj, bool e5m2) {
  const auto code = e5m2 ? nb::dlpack::dtype_code::Float8_E5M2 : nb::dlpack::dtype_code::Float8_E4M3FN;
  return as_typed(obj, {std::uint8_t(code), 8, 1}, "as_float8");
}

}  // namespace

void bind_views(nb::module_& m) {
  m.def("as_bfloat16", &as_bfloat16, "array"_a);
  m.def("as_float8", &as_float8, "array"_a, "e5m2"_a);
}

}  // namespace kvevict_py
