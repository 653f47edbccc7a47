// Argument validation of the host API: every public host entry point rejects
// bad arguments before it changes anything.
//
// For every kind of bad input this file checks three things:
//   1. the call throws the documented kvevict::error subclass;
//   2. the message starts with "kvevict::", names the argument and shows the
//      offending value;
//   3. the call changed nothing (strong guarantee): every slot-table entry,
//      every count / next slot / length, every score (bit for bit), and the raw
//      bytes of K, V and the page table compare equal before and after.
// Policies are first driven into a non-trivial state (a compressed prefill,
// decode steps with evictions, a second sequence part-filled, a third one
// empty, the newest token appended and waiting for observe), so "unchanged"
// means something; each check ends with a valid call that does change it.
#include <doctest/doctest.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#define KVEVICT_TEST_HAVE_FORK 1
#else
#define KVEVICT_TEST_HAVE_FORK 0
#endif

#include "kvevict/compaction.hpp"
#include "kvevict/dtype/bfloat16.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_cache.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/layout.hpp"
#include "kvevict/policy/budget.hpp"
#include "kvevict/policy/exact_greedy.hpp"
#include "kvevict/policy/h2o.hpp"
#include "kvevict/policy/random.hpp"
#include "kvevict/policy/recent_window.hpp"
#include "kvevict/scatter.hpp"
#include "kvevict/score_inputs.hpp"
#include "kvevict/tensor_view.hpp"

namespace kv = kvevict;

namespace {

// ---- the batch every policy-level check runs on ----

constexpr std::int32_t kSeqs = 3;  // 0: prefilled then decoded, 1: part-filled, 2: empty
constexpr std::int32_t kKvHeads = 2;
constexpr std::int32_t kQHeads = 4;  // GQA: query heads 2 and 3 belong to KV head 1
constexpr std::int32_t kDim = 4;
constexpr std::int32_t kCap = 8;
constexpr std::int32_t kBudget = 5;
constexpr std::int32_t kPrompt = 7;  // > kBudget: the setup prefill compresses
constexpr std::int32_t kPage = 3;
constexpr std::int32_t kPagesPerSeq = 3;  // pages_for(kCap, kPage)
constexpr std::int32_t kNumPages = kSeqs * kPagesPerSeq;

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

template <class... P>
std::string cat(const P&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// ---- snapshots of everything a rejected call must leave alone ----

struct entry {
  const char* what;
  std::int32_t b, h, s;
  std::uint64_t value;
};

struct snapshot {
  std::vector<entry> entries;
  std::vector<unsigned char> k, v;
  std::vector<std::int32_t> page_table;
};

std::uint64_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
std::uint64_t bits_of(std::int32_t x) { return static_cast<std::uint32_t>(x); }

template <class T>
std::vector<unsigned char> bytes_of(const std::vector<T>& v) {
  std::vector<unsigned char> out(v.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::string describe(const entry& e) {
  std::string out = e.what;
  for (std::int32_t i : {e.b, e.h, e.s})
    if (i >= 0) out += cat("[", i, "]");
  return out;
}

/// "" when equal, else the first difference in words.
std::string first_difference(const snapshot& a, const snapshot& b) {
  if (a.entries.size() != b.entries.size())
    return cat("the number of state entries (", a.entries.size(), " -> ", b.entries.size(), ")");
  for (std::size_t i = 0; i < a.entries.size(); ++i)
    if (a.entries[i].value != b.entries[i].value || std::strcmp(a.entries[i].what, b.entries[i].what) != 0)
      return cat(describe(a.entries[i]), " (bits ", a.entries[i].value, " -> ", b.entries[i].value, ")");
  const auto differ = [](const char* name, const auto& x, const auto& y) -> std::string {
    if (x.size() != y.size()) return cat(name, " size (", x.size(), " -> ", y.size(), ")");
    for (std::size_t i = 0; i < x.size(); ++i)
      if (x[i] != y[i]) return cat(name, "[", i, "] (", +x[i], " -> ", +y[i], ")");
    return "";
  };
  std::string d = differ("K storage byte", a.k, b.k);
  if (d.empty()) d = differ("V storage byte", a.v, b.v);
  if (d.empty()) d = differ("page table entry", a.page_table, b.page_table);
  return d;
}

template <class Policy>
void add_policy_state(snapshot& st, const Policy& p) {
  const kv::policy_shape& sh = p.shape();
  for (std::int32_t b = 0; b < sh.num_seqs; ++b) {
    st.entries.push_back({"length", b, -1, -1, bits_of(p.length(b))});
    st.entries.push_back({"awaiting_observe", b, -1, -1, std::uint64_t{p.awaiting_observe(b)}});
    for (std::int32_t h = 0; h < sh.num_kv_heads; ++h) {
      st.entries.push_back({"count", b, h, -1, bits_of(p.slots().count(b, h))});
      st.entries.push_back({"next_slot", b, h, -1, bits_of(p.next_slot(b, h))});
      for (std::int32_t s = 0; s < sh.capacity; ++s) {
        st.entries.push_back({"position", b, h, s, bits_of(p.slots().position(b, h, s))});
        st.entries.push_back({"score", b, h, s, bits_of(p.score(b, h, s))});
        if (p.scores_of(b, h)[s] != p.score(b, h, s)) st.entries.push_back({"scores_of mismatch", b, h, s, 1});
      }
      if constexpr (std::is_same_v<Policy, kv::random_policy>) {
        if (h == 0) st.entries.push_back({"stream", b, -1, -1, static_cast<std::uint64_t>(p.stream(b))});
      }
      if constexpr (std::is_same_v<Policy, kv::exact_greedy_policy>) {
        const std::int32_t rows = p.history_length(b, h);
        st.entries.push_back({"history_length", b, h, -1, bits_of(rows)});
        for (std::int32_t i = 0; i < rows * kDim; ++i) {
          st.entries.push_back({"history_keys", b, h, i, bits_of(p.history_keys(b, h)[i])});
          st.entries.push_back({"history_values", b, h, i, bits_of(p.history_values(b, h)[i])});
        }
      }
    }
  }
}

template <class T, class Layout>
void add_cache_state(snapshot& st, kv::kv_cache<T, Layout>& c) {
  st.k = bytes_of(c.k_storage());
  st.v = bytes_of(c.v_storage());
  st.page_table = c.page_table();
}

// ---- checking one rejected call ----

template <class F>
std::string message_of(const F& call) {
  try {
    call();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}

template <class E, class F>
void expect_rejected(const F& call, std::initializer_list<std::string> parts) {
  CHECK_THROWS_AS(call(), E);
  const std::string msg = message_of(call);
  CHECK_MESSAGE(msg.rfind("kvevict::", 0) == 0, "message \"" << msg << "\" does not start with \"kvevict::\"");
  for (const std::string& part : parts)
    CHECK_MESSAGE(msg.find(part) != std::string::npos,
                  "message \"" << msg << "\" does not contain \"" << part << "\"");
}

/// What a call that a library bug could crash (an unchecked null pointer,
/// signed overflow under UBSan) did: "rejected: <what>", "wrong exception:
/// <what>", "accepted", or "crashed ...". Where fork exists it runs in a child
/// process, so such a bug fails one CHECK instead of ending the whole run.
template <class E, class F>
std::string isolated_outcome(const F& call) {
  const auto outcome = [&]() -> std::string {
    try {
      call();
    } catch (const E& e) {
      return std::string("rejected: ") + e.what();
    } catch (const std::exception& e) {
      return std::string("wrong exception: ") + e.what();
    }
    return "accepted";
  };
#if KVEVICT_TEST_HAVE_FORK
  int fds[2];
  if (pipe(fds) != 0) return outcome();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return outcome();
  }
  if (pid == 0) {
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, SIG_DFL);
    close(fds[0]);
    const std::string r = outcome();
    const ssize_t written = write(fds[1], r.data(), r.size());
    _exit(written == static_cast<ssize_t>(r.size()) ? 0 : 3);
  }
  close(fds[1]);
  std::string r;
  char buf[256];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) r.append(buf, static_cast<std::size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return cat("crashed (signal ", WTERMSIG(status), ")");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return cat("crashed (exit status ", WEXITSTATUS(status), ")");
  return r;
#else
  return outcome();
#endif
}

template <class E, class F>
void expect_rejected_isolated(const F& call, std::initializer_list<std::string> parts) {
  const std::string r = isolated_outcome<E>(call);
  CHECK_MESSAGE(r.rfind("rejected: kvevict::", 0) == 0, "expected a kvevict error of the right type, got: " << r);
  for (const std::string& part : parts)
    CHECK_MESSAGE(r.find(part) != std::string::npos, "outcome \"" << r << "\" does not contain \"" << part << "\"");
}

#define KV_PARTS(...) \
  { __VA_ARGS__ }

/// CHECK_THROWS_NAMING(E, ("part", ...), call): call() throws E whose message
/// contains every part.
#define CHECK_THROWS_NAMING(E, parts, ...)                                             \
  do {                                                                                 \
    INFO("call at line " << __LINE__);                                                 \
    expect_rejected<E>(__VA_ARGS__, std::initializer_list<std::string> KV_PARTS parts); \
  } while (0)

/// As CHECK_THROWS_NAMING, and snap() (the whole observable state) compares
/// equal before and after the rejected call.
#define CHECK_REJECTED(snap, E, parts, ...)                                              \
  do {                                                                                   \
    INFO("rejected call at line " << __LINE__);                                          \
    const snapshot before_ = (snap)();                                                   \
    expect_rejected<E>(__VA_ARGS__, std::initializer_list<std::string> KV_PARTS parts);   \
    const std::string changed_ = first_difference(before_, (snap)());                    \
    CHECK_MESSAGE(changed_.empty(), "the rejected call changed " << changed_);           \
  } while (0)

#define CHECK_REJECTED_ISOLATED(E, parts, ...)                                                   \
  do {                                                                                           \
    INFO("call at line " << __LINE__);                                                           \
    expect_rejected_isolated<E>(__VA_ARGS__, std::initializer_list<std::string> KV_PARTS parts); \
  } while (0)

// ---- data ----

template <class T>
void fill_random(std::vector<T>& v, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  for (T& x : v) x = kv::from_float<T>(u(rng));
}

std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float lo, float hi) {
  std::vector<float> v(n);
  fill_random(v, rng, lo, hi);
  return v;
}

/// [kQHeads][len][len]: causal softmax rows; entries above the diagonal are `above`.
std::vector<float> causal_probs(std::int32_t len, std::mt19937& rng, float above = 0.0f) {
  std::vector<float> p(std::size_t(kQHeads) * len * len, above);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (std::int32_t q = 0; q < kQHeads; ++q)
    for (std::int32_t i = 0; i < len; ++i) {
      float* row = p.data() + (std::size_t(q) * len + i) * len;
      float sum = 0.0f;
      for (std::int32_t j = 0; j <= i; ++j) sum += row[j] = u(rng);
      for (std::int32_t j = 0; j <= i; ++j) row[j] /= sum;
    }
  return p;
}

template <class E>
kv::tensor_view<const E, 2> view2(const std::vector<E>& buf, std::int32_t rows, std::int32_t cols,
                                  std::int64_t row_stride, std::int64_t col_stride = 1) {
  return kv::make_strided_view<const E, 2>(buf.data(), {rows, cols}, {row_stride, col_stride});
}

/// One decode step's queries and LSE for the fused-attention path.
template <class Q>
struct query_data {
  std::vector<Q> q;
  std::vector<float> lse;
  float scale = 0.5f;

  explicit query_data(std::mt19937& rng) : q(std::size_t(kQHeads) * kDim), lse(std::size_t(kQHeads), 2.0f) {
    fill_random(q, rng);
  }
  kv::decode_queries<Q> input() const {
    kv::decode_queries<Q> in;
    in.q = kv::make_tensor_view<const Q>(q.data(), kQHeads, kDim);
    in.lse = kv::make_tensor_view<const float>(lse.data(), kQHeads);
    in.scale = scale;
    return in;
  }
};

// ---- policies and caches ----

kv::policy_shape shape_of(std::int32_t capacity = kCap) {
  kv::policy_shape s;
  s.num_seqs = kSeqs;
  s.num_kv_heads = kKvHeads;
  s.num_q_heads = kQHeads;
  s.capacity = capacity;
  return s;
}

kv::h2o_config h2o_cfg(std::int32_t heavy, std::int32_t recent) {
  kv::h2o_config c;
  c.heavy = heavy;
  c.recent = recent;
  return c;
}
kv::recent_window_config window_cfg(std::int32_t sinks, std::int32_t window) {
  kv::recent_window_config c;
  c.sinks = sinks;
  c.window = window;
  return c;
}
kv::random_config random_cfg(std::int32_t budget, std::int32_t sinks, std::int32_t recent) {
  kv::random_config c;
  c.budget = budget;
  c.sinks = sinks;
  c.recent = recent;
  c.seed = 99;
  return c;
}
kv::exact_greedy_config greedy_cfg(std::int32_t budget, std::int32_t recent, std::int32_t sinks = 0) {
  kv::exact_greedy_config c;
  c.budget = budget;
  c.recent = recent;
  c.sinks = sinks;
  return c;
}

kv::h2o_policy make_h2o(std::int32_t capacity = kCap) { return {shape_of(capacity), h2o_cfg(3, 2)}; }
kv::recent_window_policy make_window(std::int32_t capacity = kCap) { return {shape_of(capacity), window_cfg(1, 4)}; }
kv::random_policy make_random(std::int32_t capacity = kCap) { return {shape_of(capacity), random_cfg(kBudget, 1, 1)}; }
kv::exact_greedy_policy make_greedy(std::int32_t capacity = kCap) {
  return {shape_of(capacity), greedy_cfg(kBudget, 1)};
}

template <class T>
kv::kv_cache<T, kv::strided_layout> bhsd() {
  return kv::make_bhsd_cache<T>(kSeqs, kKvHeads, kCap, kDim);
}
template <class T>
kv::kv_cache<T, kv::strided_layout> bshd() {
  return kv::make_bshd_cache<T>(kSeqs, kKvHeads, kCap, kDim);
}
template <class T>
kv::kv_cache<T, kv::paged_layout> paged(kv::page_order order) {
  return kv::make_paged_cache<T>(kSeqs, kKvHeads, kCap, kDim, kPage, order);
}

template <class T>
std::int32_t& page_entry(kv::kv_cache<T, kv::paged_layout>& c, std::int32_t b, std::int32_t i) {
  return c.page_table()[std::size_t(b) * kPagesPerSeq + i];
}

/// A policy and its cache in a non-trivial state.
template <class Policy, class T, class Layout>
struct fixture {
  using element = T;
  using layout = Layout;
  static constexpr bool greedy = std::is_same_v<Policy, kv::exact_greedy_policy>;

  Policy policy;
  kv::kv_cache<T, Layout> cache;
  std::mt19937 rng{20240607u};

  fixture(Policy p, kv::kv_cache<T, Layout> c) : policy(std::move(p)), cache(std::move(c)) {
    fill_random(cache.k_storage(), rng);
    fill_random(cache.v_storage(), rng);
    prefill_valid(0, kPrompt);
    for (int step = 0; step < 4; ++step) decode_step(0);
    for (int step = 0; step < 3; ++step) decode_step(1);
    REQUIRE(policy.length(0) == kPrompt + 4);
    REQUIRE(policy.slots().count(0, 0) == kBudget);
    REQUIRE(policy.length(1) == 3);
    REQUIRE(policy.length(2) == 0);
  }

  kv::kv_view<T, Layout> view() noexcept { return cache.view(); }

  snapshot capture() {
    snapshot st;
    add_policy_state(st, policy);
    add_cache_state(st, cache);
    return st;
  }
  auto snap() {
    return [this] { return capture(); };
  }

  void prefill_valid(std::int32_t b, std::int32_t len) {
    if constexpr (greedy) {
      const query_data<T> qd(rng);
      policy.prefill(b, len, qd.input(), view());
    } else {
      const std::vector<float> probs = causal_probs(len, rng);
      policy.prefill(b, len, kv::prefill_probs{kv::make_tensor_view<const float>(probs.data(), kQHeads, len, len)},
                     view());
    }
  }

  /// Decode steps 1-2: take next_slot, append, write the new K/V rows there.
  void write_token(std::int32_t b) {
    std::int32_t slots[kKvHeads];
    for (std::int32_t h = 0; h < kKvHeads; ++h) slots[h] = policy.next_slot(b, h);
    policy.append(b);
    std::vector<T> k_new(std::size_t(kKvHeads) * kDim), v_new(k_new.size());
    fill_random(k_new, rng);
    fill_random(v_new, rng);
    kv::scatter(view(), b, slots, kv::make_tensor_view<const T>(k_new.data(), kKvHeads, kDim),
                kv::make_tensor_view<const T>(v_new.data(), kKvHeads, kDim));
  }

  void observe_valid(std::int32_t b) {
    if constexpr (greedy) {
      const query_data<T> qd(rng);
      policy.observe(b, qd.input(), view());
    } else {
      const std::vector<float> probs = random_floats(std::size_t(kQHeads) * kCap, rng, 0.05f, 1.0f);
      policy.observe(b, kv::decode_probs{kv::make_tensor_view<const float>(probs.data(), kQHeads, kCap)});
    }
  }

  void decode_step(std::int32_t b) {
    write_token(b);
    observe_valid(b);
    policy.evict(b);
  }

  /// The highest occupied slot of (b, h).
  std::int32_t occupied_slot(std::int32_t b, std::int32_t h) const {
    for (std::int32_t s = kCap - 1; s >= 0; --s)
      if (policy.slots().position(b, h, s) >= 0) return s;
    return -1;
  }
  std::int32_t occupied_width(std::int32_t b) const {
    std::int32_t w = 0;
    for (std::int32_t h = 0; h < kKvHeads; ++h) w = std::max(w, occupied_slot(b, h) + 1);
    return w;
  }
};

/// A cache alone (scatter, compact), filled with random rows.
template <class T, class Layout>
struct cache_fixture {
  using element = T;
  using layout = Layout;

  kv::kv_cache<T, Layout> cache;
  std::mt19937 rng{7u};

  explicit cache_fixture(kv::kv_cache<T, Layout> c) : cache(std::move(c)) {
    fill_random(cache.k_storage(), rng);
    fill_random(cache.v_storage(), rng);
  }
  snapshot capture() {
    snapshot st;
    add_cache_state(st, cache);
    return st;
  }
  auto snap() {
    return [this] { return capture(); };
  }
};

/// Runs check(fixture) for h2o on four dtype/layout combinations and for the
/// recent window and random policies on two, one SUBCASE each.
template <class Check>
void for_each_policy_and_cache(const Check& check) {
  SUBCASE("h2o, float, bhsd") {
    fixture fx(make_h2o(), bhsd<float>());
    check(fx);
  }
  SUBCASE("h2o, bfloat16, paged nhd") {
    fixture fx(make_h2o(), paged<kv::bfloat16>(kv::page_order::nhd));
    check(fx);
  }
  SUBCASE("h2o, float, paged hnd") {
    fixture fx(make_h2o(), paged<float>(kv::page_order::hnd));
    check(fx);
  }
  SUBCASE("h2o, bfloat16, bshd") {
    fixture fx(make_h2o(), bshd<kv::bfloat16>());
    check(fx);
  }
  SUBCASE("recent_window, float, bhsd") {
    fixture fx(make_window(), bhsd<float>());
    check(fx);
  }
  SUBCASE("recent_window, bfloat16, paged nhd") {
    fixture fx(make_window(), paged<kv::bfloat16>(kv::page_order::nhd));
    check(fx);
  }
  SUBCASE("random, float, bhsd") {
    fixture fx(make_random(), bhsd<float>());
    check(fx);
  }
  SUBCASE("random, bfloat16, paged hnd") {
    fixture fx(make_random(), paged<kv::bfloat16>(kv::page_order::hnd));
    check(fx);
  }
}

/// The view checks every entry point that takes a kv_view shares.
template <class Snap, class View, class Call>
void check_bad_views(const Snap& snap, const View& good, const Call& call) {
  const auto edited = [&](auto edit) {
    View v = good;
    edit(v);
    return v;
  };
  CHECK_REJECTED(snap, kv::invalid_argument, ("'view.k'", "null"),
                 [&] { call(edited([](View& v) { v.k = nullptr; })); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'view.v'", "null"),
                 [&] { call(edited([](View& v) { v.v = nullptr; })); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'view.v'", "overlaps view.k"),
                 [&] { call(edited([](View& v) { v.v = v.k; })); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'view.head_dim'", "= 0"),
                 [&] { call(edited([](View& v) { v.head_dim = 0; })); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'view.num_heads'", "= -1"),
                 [&] { call(edited([](View& v) { v.num_heads = -1; })); });
  // Rows of consecutive slots overlap when stride_slot < head_dim.
  CHECK_REJECTED(snap, kv::invalid_argument, ("'layout.stride_slot'", "= 3", "overlap"),
                 [&] { call(edited([](View& v) { v.layout.stride_slot = kDim - 1; })); });
  if constexpr (std::is_same_v<typename View::layout_type, kv::paged_layout>) {
    CHECK_REJECTED(snap, kv::invalid_argument, ("'layout.stride_page'", "= 1", "overlap"),
                   [&] { call(edited([](View& v) { v.layout.stride_page = 1; })); });
    CHECK_REJECTED(snap, kv::invalid_argument, ("'layout.page_table'", "null"),
                   [&] { call(edited([](View& v) { v.layout.page_table = nullptr; })); });
    CHECK_REJECTED(snap, kv::invalid_argument, ("'layout.page_size'", "= 0"),
                   [&] { call(edited([](View& v) { v.layout.page_size = 0; })); });
  } else {
    CHECK_REJECTED(snap, kv::invalid_argument, ("'layout.stride_seq'", "= 1", "overlap"),
                   [&] { call(edited([](View& v) { v.layout.stride_seq = 1; })); });
  }
}

/// The view checks of policy entry points: the generic ones plus the match
/// with the policy's shape.
template <class Snap, class View, class Call>
void check_bad_policy_views(const Snap& snap, const View& good, const Call& call) {
  check_bad_views(snap, good, call);
  const auto edited = [&](auto edit) {
    View v = good;
    edit(v);
    return v;
  };
  CHECK_REJECTED(snap, kv::invalid_argument, ("'view.num_heads'", "= 1"),
                 [&] { call(edited([](View& v) { v.num_heads = 1; })); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'view.num_seqs'", "= 2"),
                 [&] { call(edited([](View& v) { v.num_seqs = 2; })); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'view.capacity'", "= 7"),
                 [&] { call(edited([](View& v) { v.capacity = kCap - 1; })); });
}

// ---- observe ----

template <class Fx>
void check_observe_probs(Fx& fx) {
  auto& policy = fx.policy;
  const auto snap = fx.snap();
  fx.write_token(0);  // attention ran over budget + 1 tokens; the policy waits for observe
  const snapshot before = fx.capture();
  const std::int32_t width = fx.occupied_width(0);
  REQUIRE(width < kCap);
  const std::int32_t s0 = fx.occupied_slot(0, 0), s1 = fx.occupied_slot(0, 1);
  const std::vector<float> probs = random_floats(std::size_t(kQHeads) * kCap, fx.rng, 0.05f, 1.0f);
  const auto input = [&](const std::vector<float>& p, std::int32_t rows, std::int32_t cols) {
    return kv::decode_probs{view2(p, rows, cols, kCap)};
  };
  const auto with = [&](std::int32_t q, std::int32_t s, float x) {
    std::vector<float> p = probs;
    p[std::size_t(q) * kCap + s] = x;
    return p;
  };

  CHECK_REJECTED(snap, kv::invalid_argument, ("'probs.extents[0]'", "= 3", "expected 4"),
                 [&] { policy.observe(0, input(probs, kQHeads - 1, kCap)); });
  CHECK_REJECTED(snap, kv::invalid_argument,
                 ("'probs.extents[1]'", cat("= ", width - 1), cat("at least ", width)),
                 [&] { policy.observe(0, input(probs, kQHeads, width - 1)); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'probs'", "null"), [&] { policy.observe(0, kv::decode_probs{}); });
  {
    const std::vector<float> bad = with(3, s1, kNaN);
    CHECK_REJECTED(snap, kv::non_finite_error, (cat("'probs[3][", s1, "]'"), "NaN"),
                   [&] { policy.observe(0, input(bad, kQHeads, kCap)); });
  }
  {
    const std::vector<float> bad = with(2, s1, kInf);
    CHECK_REJECTED(snap, kv::non_finite_error, (cat("'probs[2][", s1, "]'"), "inf"),
                   [&] { policy.observe(0, input(bad, kQHeads, kCap)); });
  }
  {
    const std::vector<float> bad = with(1, s0, -0.25f);
    CHECK_REJECTED(snap, kv::invalid_argument, (cat("'probs[1][", s0, "]'"), "-0.25", "negative"),
                   [&] { policy.observe(0, input(bad, kQHeads, kCap)); });
  }
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"),
                 [&] { policy.observe(kSeqs, input(probs, kQHeads, kCap)); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= -1"),
                 [&] { policy.observe(-1, input(probs, kQHeads, kCap)); });
  CHECK_REJECTED(snap, kv::state_error, ("sequence 2", "append"),
                 [&] { policy.observe(2, input(probs, kQHeads, kCap)); });

  // head_scores: per-KV-head increments.
  {
    std::vector<float> scores = random_floats(std::size_t(kKvHeads) * kCap, fx.rng, 0.05f, 1.0f);
    scores[std::size_t(1) * kCap + s1] = kNaN;
    CHECK_REJECTED(snap, kv::non_finite_error, (cat("'scores[1][", s1, "]'"), "NaN"),
                   [&] { policy.observe(0, kv::head_scores{view2(scores, kKvHeads, kCap, kCap)}); });
    scores[std::size_t(1) * kCap + s1] = -kInf;
    CHECK_REJECTED(snap, kv::non_finite_error, (cat("'scores[1][", s1, "]'"), "-inf"),
                   [&] { policy.observe(0, kv::head_scores{view2(scores, kKvHeads, kCap, kCap)}); });
    scores[std::size_t(1) * kCap + s1] = 0.5f;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'scores.extents[0]'", "= 1"),
                   [&] { policy.observe(0, kv::head_scores{view2(scores, 1, kCap, kCap)}); });
    CHECK_REJECTED(snap, kv::invalid_argument, ("'scores'", "null"), [&] { policy.observe(0, kv::head_scores{}); });
  }

  // Columns of free slots are ignored, NaN or not; the valid call changes the scores.
  std::vector<float> free_nan = probs;
  for (std::int32_t q = 0; q < kQHeads; ++q)
    for (std::int32_t s = width; s < kCap; ++s) free_nan[std::size_t(q) * kCap + s] = kNaN;
  CHECK_NOTHROW(policy.observe(0, input(free_nan, kQHeads, kCap)));
  CHECK_FALSE(first_difference(before, fx.capture()).empty());
  for (std::int32_t h = 0; h < kKvHeads; ++h)
    for (std::int32_t s = width; s < kCap; ++s) CHECK(policy.score(0, h, s) == 0.0f);
  CHECK(policy.evict(0) == kKvHeads);
}

template <class Fx>
void check_observe_queries(Fx& fx) {
  using T = typename Fx::element;
  constexpr bool is_paged = std::is_same_v<typename Fx::layout, kv::paged_layout>;
  auto& policy = fx.policy;
  const auto snap = fx.snap();
  fx.write_token(0);
  const snapshot before = fx.capture();
  REQUIRE(fx.occupied_width(0) <= 2 * kPage);  // slots 6 and 7 (page 2) are free
  const query_data<T> good(fx.rng);
  const auto observe = [&](const kv::decode_queries<T>& in) { policy.observe(0, in, fx.view()); };

  {
    query_data<T> qd = good;
    qd.q[std::size_t(1) * kDim + 2] = kv::from_float<T>(kNaN);
    CHECK_REJECTED(snap, kv::non_finite_error, ("'q[1][2]'", "NaN"), [&] { observe(qd.input()); });
    qd.q[std::size_t(1) * kDim + 2] = kv::from_float<T>(kInf);
    CHECK_REJECTED(snap, kv::non_finite_error, ("'q[1][2]'", "inf"), [&] { observe(qd.input()); });
  }
  // The LSE is an input like q: non-finite values must be rejected and named.
  {
    query_data<T> qd = good;
    qd.lse[2] = kInf;
    CHECK_REJECTED(snap, kv::non_finite_error, ("'lse[2]'", "inf"), [&] { observe(qd.input()); });
  }
  {
    query_data<T> qd = good;
    qd.lse[0] = kNaN;
    CHECK_REJECTED(snap, kv::non_finite_error, ("'lse[0]'", "NaN"), [&] { observe(qd.input()); });
  }
  {
    query_data<T> qd = good;
    qd.lse[1] = -kInf;
    CHECK_REJECTED(snap, kv::non_finite_error, ("'lse[1]'", "-inf"), [&] { observe(qd.input()); });
  }
  {
    kv::decode_queries<T> in = good.input();
    in.lse.extents[0] = kQHeads - 1;  // the buffer still has kQHeads entries: no out-of-bounds read
    CHECK_REJECTED(snap, kv::invalid_argument, ("'lse.extents[0]'", "= 3"), [&] { observe(in); });
  }
  for (const float scale : {0.0f, -1.0f, kNaN, kInf}) {
    kv::decode_queries<T> in = good.input();
    in.scale = scale;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'scale'", cat("= ", scale)), [&] { observe(in); });
  }
  {
    kv::decode_queries<T> in = good.input();
    in.q.extents[0] = kQHeads - 1;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'q.extents[0]'", "= 3"), [&] { observe(in); });
    in = good.input();
    in.q.extents[1] = kDim - 1;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'q.extents[1]'", "= 3"), [&] { observe(in); });
    in = good.input();
    in.q.data = nullptr;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'q'", "null"), [&] { observe(in); });
  }
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"),
                 [&] { policy.observe(kSeqs, good.input(), fx.view()); });
  CHECK_REJECTED(snap, kv::state_error, ("sequence 2", "append"), [&] { policy.observe(2, good.input(), fx.view()); });
  check_bad_policy_views(snap, fx.view(), [&](const auto& v) { policy.observe(0, good.input(), v); });

  if constexpr (is_paged) {
    // Page 0 holds slots 0-2 and page 1 slots 3-5, all occupied.
    for (const std::int32_t bad : {-1, kNumPages}) {
      for (const std::int32_t page : {0, 1}) {
        const std::int32_t saved = page_entry(fx.cache, 0, page);
        page_entry(fx.cache, 0, page) = bad;
        CHECK_REJECTED(snap, kv::out_of_range, (cat("'page_table[0][", page, "]'"), cat("= ", bad)),
                       [&] { observe(good.input()); });
        page_entry(fx.cache, 0, page) = saved;
      }
    }
    // Page 2 holds only free slots: its entry is never read, so it may be unset.
    const std::int32_t saved = page_entry(fx.cache, 0, 2);
    page_entry(fx.cache, 0, 2) = -1;
    CHECK_NOTHROW(observe(good.input()));
    page_entry(fx.cache, 0, 2) = saved;
  } else {
    CHECK_NOTHROW(observe(good.input()));
  }
  CHECK_FALSE(first_difference(before, fx.capture()).empty());
  CHECK(policy.evict(0) == kKvHeads);
}

// ---- prefill ----

template <class Fx>
void check_prefill(Fx& fx) {
  using T = typename Fx::element;
  using Policy = std::remove_reference_t<decltype(fx.policy)>;
  constexpr bool is_paged = std::is_same_v<typename Fx::layout, kv::paged_layout>;
  constexpr std::int32_t len = 6;  // > budget: compresses; fits pages 0 and 1
  auto& policy = fx.policy;
  const auto snap = fx.snap();
  const snapshot before = fx.capture();
  const std::vector<float> probs = causal_probs(len, fx.rng);
  const auto at = [](std::int32_t q, std::int32_t i, std::int32_t p) {
    return (std::size_t(q) * len + i) * len + std::size_t(p);
  };
  const auto probs_in = [&](const std::vector<float>& p) {
    return kv::prefill_probs{kv::make_tensor_view<const float>(p.data(), kQHeads, len, len)};
  };
  const auto prefill = [&](std::int32_t b, std::int32_t n, const std::vector<float>& p) {
    policy.prefill(b, n, probs_in(p), fx.view());
  };

  CHECK_REJECTED(snap, kv::out_of_range, ("'length'", "= 0"), [&] { prefill(2, 0, probs); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'length'", "= -1"), [&] { prefill(2, -1, probs); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'length'", "= 9"), [&] { prefill(2, kCap + 1, probs); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"), [&] { prefill(kSeqs, len, probs); });
  CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "already holds"), [&] { prefill(0, len, probs); });
  CHECK_REJECTED(snap, kv::state_error, ("sequence 1", "already holds"), [&] { prefill(1, len, probs); });
  {
    std::vector<float> bad = probs;
    bad[at(1, 5, 2)] = kNaN;
    CHECK_REJECTED(snap, kv::non_finite_error, ("'probs[1][5][2]'", "NaN"), [&] { prefill(2, len, bad); });
  }
  {
    std::vector<float> bad = probs;
    bad[at(3, 4, 0)] = kInf;
    CHECK_REJECTED(snap, kv::non_finite_error, ("'probs[3][4][0]'", "inf"), [&] { prefill(2, len, bad); });
  }
  {
    std::vector<float> bad = probs;
    bad[at(0, 3, 3)] = -0.5f;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'probs[0][3][3]'", "-0.5", "negative"),
                   [&] { prefill(2, len, bad); });
  }
  {
    kv::prefill_probs in = probs_in(probs);
    in.probs.extents[1] = len - 1;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'probs.extents[1]'", "= 5"),
                   [&] { policy.prefill(2, len, in, fx.view()); });
    in = probs_in(probs);
    in.probs.extents[0] = kQHeads - 1;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'probs.extents[0]'", "= 3"),
                   [&] { policy.prefill(2, len, in, fx.view()); });
    CHECK_REJECTED(snap, kv::invalid_argument, ("'probs'", "null"),
                   [&] { policy.prefill(2, len, kv::prefill_probs{}, fx.view()); });
  }

  // Column sums, with and without a view.
  {
    std::vector<float> sums = random_floats(std::size_t(kQHeads) * len, fx.rng, 0.1f, 2.0f);
    const auto sums_in = [&] { return kv::prefill_column_sums{view2(sums, kQHeads, len, len)}; };
    sums[std::size_t(3) * len + 4] = kInf;
    CHECK_REJECTED(snap, kv::non_finite_error, ("'sums[3][4]'", "inf"),
                   [&] { policy.prefill(2, len, sums_in(), fx.view()); });
    CHECK_REJECTED(snap, kv::non_finite_error, ("'sums[3][4]'", "inf"), [&] { policy.prefill(2, len, sums_in()); });
    sums[std::size_t(3) * len + 4] = 1.0f;
    sums[0] = kNaN;
    CHECK_REJECTED(snap, kv::non_finite_error, ("'sums[0][0]'", "NaN"), [&] { policy.prefill(2, len, sums_in()); });
    sums[0] = 1.0f;
    sums[std::size_t(2) * len + 1] = -1.0f;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'sums[2][1]'", "-1", "negative"),
                   [&] { policy.prefill(2, len, sums_in()); });
    sums[std::size_t(2) * len + 1] = 1.0f;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'sums.extents[1]'", "= 5"),
                   [&] { policy.prefill(2, len, kv::prefill_column_sums{view2(sums, kQHeads, len - 1, len)}); });
    CHECK_REJECTED(snap, kv::out_of_range, ("'length'", "= 9"), [&] { policy.prefill(2, kCap + 1, sums_in()); });
    CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "already holds"), [&] { policy.prefill(0, len, sums_in()); });
  }

  // Fused attention: every prompt row's query and LSE.
  {
    std::vector<T> q(std::size_t(kQHeads) * len * kDim);
    fill_random(q, fx.rng);
    std::vector<float> lse(std::size_t(kQHeads) * len, 3.0f);
    float scale = 0.5f;
    const auto queries_in = [&] {
      kv::prefill_queries<T> in;
      in.q = kv::make_tensor_view<const T>(q.data(), kQHeads, len, kDim);
      in.lse = kv::make_tensor_view<const float>(lse.data(), kQHeads, len);
      in.scale = scale;
      return in;
    };
    const auto prefill_q = [&] { policy.prefill(2, len, queries_in(), fx.view()); };
    lse[std::size_t(2) * len + 3] = kNaN;
    CHECK_REJECTED(snap, kv::non_finite_error, ("'lse[2][3]'", "NaN"), prefill_q);
    lse[std::size_t(2) * len + 3] = kInf;
    CHECK_REJECTED(snap, kv::non_finite_error, ("'lse[2][3]'", "inf"), prefill_q);
    lse[std::size_t(2) * len + 3] = 3.0f;
    q[(std::size_t(1) * len + 4) * kDim + 2] = kv::from_float<T>(kInf);
    CHECK_REJECTED(snap, kv::non_finite_error, ("'q[1][4][2]'", "inf"), prefill_q);
    q[(std::size_t(1) * len + 4) * kDim + 2] = kv::from_float<T>(kNaN);
    CHECK_REJECTED(snap, kv::non_finite_error, ("'q[1][4][2]'", "NaN"), prefill_q);
    q[(std::size_t(1) * len + 4) * kDim + 2] = kv::from_float<T>(0.25f);
    scale = 0.0f;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'scale'", "= 0"), prefill_q);
    scale = kNaN;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'scale'", "= nan"), prefill_q);
    scale = 0.5f;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'lse.extents[1]'", "= 5"), [&] {
      kv::prefill_queries<T> in = queries_in();
      in.lse.extents[1] = len - 1;
      policy.prefill(2, len, in, fx.view());
    });
    CHECK_REJECTED(snap, kv::invalid_argument, ("'lse'", "null"), [&] {
      kv::prefill_queries<T> in = queries_in();
      in.lse.data = nullptr;
      policy.prefill(2, len, in, fx.view());
    });
    CHECK_REJECTED(snap, kv::invalid_argument, ("'q.extents[2]'", "= 3"), [&] {
      kv::prefill_queries<T> in = queries_in();
      in.q.extents[2] = kDim - 1;
      policy.prefill(2, len, in, fx.view());
    });
    CHECK_REJECTED(snap, kv::invalid_argument, ("'q'", "null"), [&] {
      kv::prefill_queries<T> in = queries_in();
      in.q.data = nullptr;
      policy.prefill(2, len, in, fx.view());
    });
  }

  check_bad_policy_views(snap, fx.view(), [&](const auto& v) { policy.prefill(2, len, probs_in(probs), v); });

  // Policies that need no scores.
  if constexpr (!std::is_same_v<Policy, kv::h2o_policy>) {
    CHECK_REJECTED(snap, kv::out_of_range, ("'length'", "= 0"), [&] { policy.prefill(2, 0, fx.view()); });
    CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "already holds"), [&] { policy.prefill(0, len, fx.view()); });
    check_bad_policy_views(snap, fx.view(), [&](const auto& v) { policy.prefill(2, len, v); });
  }

  if constexpr (is_paged) {
    // Prompt rows 3-5 live in page 1 of sequence 2.
    for (const std::int32_t bad : {-1, kNumPages}) {
      const std::int32_t saved = page_entry(fx.cache, 2, 1);
      page_entry(fx.cache, 2, 1) = bad;
      CHECK_REJECTED(snap, kv::out_of_range, ("'page_table[2][1]'", cat("= ", bad)), [&] { prefill(2, len, probs); });
      page_entry(fx.cache, 2, 1) = saved;
    }
  }

  // Entries above the diagonal are never read: NaN there is fine. For a paged
  // cache, the page past the prompt may be unset too.
  CHECK(first_difference(before, fx.capture()).empty());
  const std::vector<float> upper_nan = causal_probs(len, fx.rng, kNaN);
  std::int32_t saved_page = 0;
  if constexpr (is_paged) {
    saved_page = page_entry(fx.cache, 2, 2);
    page_entry(fx.cache, 2, 2) = -1;
  }
  kv::prefill_result result;
  CHECK_NOTHROW(result = policy.prefill(2, len, probs_in(upper_nan), fx.view()));
  if constexpr (is_paged) page_entry(fx.cache, 2, 2) = saved_page;
  CHECK(result.kept == kBudget);
  CHECK(policy.length(2) == len);
  CHECK(policy.slots().count(2, 1) == kBudget);
}

// ---- append, evict, accessors ----

/// On a policy whose capacity is exactly budget + 1.
template <class Policy>
void check_append_when_full(Policy policy) {
  constexpr std::int32_t cap = kBudget + 1;
  const auto snap = [&] {
    snapshot st;
    add_policy_state(st, policy);
    return st;
  };
  std::mt19937 rng(5u);
  const std::vector<float> inc = random_floats(std::size_t(kKvHeads) * cap, rng, 0.1f, 1.0f);
  const kv::head_scores scores{view2(inc, kKvHeads, cap, cap)};
  for (std::int32_t i = 0; i < 2; ++i) {
    policy.append(1);
    policy.observe(1, scores);
  }
  for (std::int32_t i = 0; i < cap; ++i) {
    policy.append(0);
    policy.observe(0, scores);
  }
  REQUIRE(policy.slots().count(0, 0) == cap);
  REQUIRE(policy.next_slot(0, 1) == -1);
  REQUIRE(policy.score(0, 1, 0) > 0.0f);

  CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "no free slot"), [&] { policy.append(0); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"), [&] { policy.append(kSeqs); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= -1"), [&] { policy.append(-1); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"), [&] { policy.evict(kSeqs); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= -1"), [&] { policy.evict(-1); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"), [&] { policy.reset(kSeqs); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= -2"), [&] { policy.reset(-2); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"), [&] { (void)policy.next_slot(kSeqs, 0); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'head'", "= 2"), [&] { (void)policy.next_slot(0, kKvHeads); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'head'", "= -1"), [&] { (void)policy.next_slot(0, -1); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= -1"), [&] { (void)policy.length(-1); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'slot'", "= 6"), [&] { (void)policy.score(0, 0, cap); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'slot'", "= -1"), [&] { (void)policy.score(0, 0, -1); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'head'", "= 2"), [&] { (void)policy.score(0, kKvHeads, 0); });

  // Evicting makes room again.
  std::int32_t victims[kKvHeads] = {-1, -1};
  CHECK(policy.evict(0, victims) == kKvHeads);
  CHECK(policy.next_slot(0, 0) == victims[0]);
  CHECK_NOTHROW(policy.append(0));
}

// ---- exact greedy ----

template <class T, class Layout>
void check_exact_greedy(fixture<kv::exact_greedy_policy, T, Layout>& fx) {
  constexpr bool is_paged = std::is_same_v<Layout, kv::paged_layout>;
  auto& policy = fx.policy;
  const auto snap = fx.snap();
  fx.write_token(0);  // appended and written, not observed yet
  const snapshot before = fx.capture();
  const query_data<T> good(fx.rng);
  const auto observe = [&](const kv::decode_queries<T>& in) { policy.observe(0, in, fx.view()); };

  CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "not observed"), [&] { policy.evict(0); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"), [&] { policy.evict(kSeqs); });
  // Regression (fuzz/regressions/fuzz_policy_api/greedy_evict_to_bad_sequence):
  // evict_to read the sequence's kept queries before checking the index.
  std::vector<kv::slot_move> moves(std::size_t(kKvHeads) * kCap);
  std::vector<std::int32_t> move_counts(static_cast<std::size_t>(kKvHeads));
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"),
                 [&] { policy.evict_to(kSeqs, kBudget, moves.data(), move_counts.data()); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= -1"), [&] { policy.evict_to(-1, kBudget, fx.view()); });
  CHECK_REJECTED(snap, kv::state_error, ("sequence 2", "append"), [&] { policy.observe(2, good.input(), fx.view()); });
  {
    query_data<T> qd = good;
    qd.q[std::size_t(2) * kDim + 1] = kv::from_float<T>(kNaN);
    CHECK_REJECTED(snap, kv::non_finite_error, ("'q[2][1]'", "NaN"), [&] { observe(qd.input()); });
  }
  {
    kv::decode_queries<T> in = good.input();
    in.scale = 0.0f;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'scale'", "= 0"), [&] { observe(in); });
  }
  {
    // A view whose head_dim differs from the history's.
    auto other = kv::make_bhsd_cache<T>(kSeqs, kKvHeads, kCap, 2);
    CHECK_REJECTED(snap, kv::invalid_argument, ("'view.head_dim'", "= 2"),
                   [&] { policy.observe(0, good.input(), other.view()); });
  }
  check_bad_policy_views(snap, fx.view(), [&](const auto& v) { policy.observe(0, good.input(), v); });
  if constexpr (is_paged) {
    // The newest token's row is read into the history: its page must be valid.
    const std::int32_t slot = policy.slots().slot_of(0, 0, policy.length(0) - 1);
    const std::int32_t page = slot / kPage;
    const std::int32_t saved = page_entry(fx.cache, 0, page);
    page_entry(fx.cache, 0, page) = kNumPages;
    CHECK_REJECTED(snap, kv::out_of_range, (cat("'page_table[0][", page, "]'"), "= 9"), [&] { observe(good.input()); });
    page_entry(fx.cache, 0, page) = saved;
  }

  // Prefill of the empty sequence 2, judged with the last prompt row.
  {
    CHECK_REJECTED(snap, kv::out_of_range, ("'length'", "= 0"), [&] { policy.prefill(2, 0, good.input(), fx.view()); });
    CHECK_REJECTED(snap, kv::state_error, ("sequence 1", "already holds"),
                   [&] { policy.prefill(1, 4, good.input(), fx.view()); });
    query_data<T> qd = good;
    qd.q[3] = kv::from_float<T>(-kInf);
    CHECK_REJECTED(snap, kv::non_finite_error, ("'q[0][3]'", "-inf"),
                   [&] { policy.prefill(2, 6, qd.input(), fx.view()); });
    kv::decode_queries<T> in = good.input();
    in.scale = kNaN;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'scale'", "= nan"), [&] { policy.prefill(2, 6, in, fx.view()); });
    if constexpr (is_paged) {
      // Regression: a page table that repeats a page id was rejected only
      // after the prompt rows had gone into the history.
      const std::int32_t saved = page_entry(fx.cache, 2, 1);
      page_entry(fx.cache, 2, 1) = page_entry(fx.cache, 2, 0);
      CHECK_REJECTED(snap, kv::invalid_argument, ("'page_table[2]'", "twice"),
                     [&] { policy.prefill(2, 6, good.input(), fx.view()); });
      CHECK(policy.history_length(2, 0) == 0);
      page_entry(fx.cache, 2, 1) = saved;
    }
  }

  CHECK_NOTHROW(observe(good.input()));
  CHECK_FALSE(first_difference(before, fx.capture()).empty());
  CHECK(policy.evict(0) == kKvHeads);

  // Once the sequence holds budget + 1 tokens, a second append must wait for evict.
  fx.write_token(0);
  CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "no free slot"), [&] { fx.write_token(0); });
  CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "not observed"), [&] { policy.evict(0); });
  // Two appends and one observe while filling (as a two-token append): both
  // tokens join the history, as in the batched API. (This was refused.)
  fx.write_token(2);
  fx.write_token(2);
  CHECK_NOTHROW(policy.observe(2, good.input(), fx.view()));
  for (std::int32_t h = 0; h < kKvHeads; ++h) CHECK(policy.history_length(2, h) == 2);
  CHECK(policy.evict(2) == 0);
}

// ---- the decode protocol: append -> observe once -> evict ----

template <class P, class = void>
struct has_skip_observe : std::false_type {};
template <class P>
struct has_skip_observe<P, std::void_t<decltype(std::declval<P&>().skip_observe(0))>> : std::true_type {};
static_assert(has_skip_observe<kv::h2o_policy>::value && has_skip_observe<kv::recent_window_policy>::value &&
                  has_skip_observe<kv::random_policy>::value,
              "the score-keeping policies offer the skip_observe opt-out");
static_assert(!has_skip_observe<kv::exact_greedy_policy>::value, "exact_greedy needs every step observed");

/// The moves form's buffers of evict_to.
struct slot_moves {
  std::vector<kv::slot_move> moves = std::vector<kv::slot_move>(std::size_t(kKvHeads) * kCap);
  std::vector<std::int32_t> counts = std::vector<std::int32_t>(kKvHeads);
};

/// Regressions: h2o and random took an evict after an append without an
/// observe (the victim came from the last step's scores), and an observe
/// twice in one step counted the step twice. Both are refused with the state
/// unchanged, for every policy; evict_to likewise.
template <class Fx>
void check_protocol(Fx& fx) {
  auto& policy = fx.policy;
  const auto snap = fx.snap();
  slot_moves moves;
  // Sequence 0 holds the budget: this append makes an eviction due.
  fx.write_token(0);
  CHECK(policy.awaiting_observe(0));
  CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "not observed"), [&] { policy.evict(0); });
  CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "not observed"), [&] { policy.evict_to(0, 4, fx.view()); });
  CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "not observed"),
                 [&] { policy.evict_to(0, kBudget, moves.moves.data(), moves.counts.data()); });
  fx.observe_valid(0);
  CHECK_FALSE(policy.awaiting_observe(0));
  CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "already observed", "once per step"),
                 [&] { fx.observe_valid(0); });
  CHECK(policy.evict(0) == kKvHeads);
  CHECK(policy.evict(0) == 0);  // a second evict has nothing left to do
  CHECK_REJECTED(snap, kv::state_error, ("sequence 0", "already observed"), [&] { fx.observe_valid(0); });
  // A freshly prefilled sequence has its scores: observing it again would count the prompt twice.
  fx.prefill_valid(2, kPrompt);
  CHECK_FALSE(policy.awaiting_observe(2));
  CHECK_REJECTED(snap, kv::state_error, ("sequence 2", "already observed"), [&] { fx.observe_valid(2); });
  // A multi-token append is one step: one observe, then evict_to.
  policy.append(1, 3, nullptr);
  CHECK_REJECTED(snap, kv::state_error, ("sequence 1", "not observed"), [&] { policy.evict_to(1, kBudget, fx.view()); });
  fx.observe_valid(1);
  CHECK(policy.evict_to(1, kBudget, fx.view()) == 1);
  // reset ends a pending step.
  fx.write_token(1);
  policy.reset(1);
  CHECK_FALSE(policy.awaiting_observe(1));
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"), [&] { (void)policy.awaiting_observe(kSeqs); });

  if constexpr (has_skip_observe<decltype(fx.policy)>::value) {
    CHECK_REJECTED(snap, kv::state_error, ("skip_observe", "sequence 0", "already observed"),
                   [&] { policy.skip_observe(0); });
    CHECK_REJECTED(snap, kv::state_error, ("skip_observe", "sequence 1", "holds no token"),
                   [&] { policy.skip_observe(1); });
    CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= -1"), [&] { policy.skip_observe(-1); });
    // The opt-out: the step adds nothing and the victim comes from the scores as they are.
    fx.write_token(0);
    std::vector<float> scores_before(std::size_t(kKvHeads) * kCap);
    for (std::int32_t h = 0; h < kKvHeads; ++h)
      for (std::int32_t s = 0; s < kCap; ++s) scores_before[std::size_t(h) * kCap + s] = policy.score(0, h, s);
    policy.skip_observe(0);
    for (std::int32_t h = 0; h < kKvHeads; ++h)
      for (std::int32_t s = 0; s < kCap; ++s) CHECK(policy.score(0, h, s) == scores_before[std::size_t(h) * kCap + s]);
    std::int32_t victims[kKvHeads];
    CHECK(policy.evict(0, victims) == kKvHeads);
    for (std::int32_t h = 0; h < kKvHeads; ++h) CHECK(victims[h] >= 0);
  }
}


// ---- scatter and compact ----

template <class Fx>
void check_scatter(Fx& fx) {
  using T = typename Fx::element;
  constexpr bool is_paged = std::is_same_v<typename Fx::layout, kv::paged_layout>;
  auto& cache = fx.cache;
  const auto snap = fx.snap();
  std::vector<T> rows(std::size_t(2) * (kKvHeads + 1) * kDim);  // room for the bad shapes below
  fill_random(rows, fx.rng);
  const auto rows_view = [&](std::int32_t n, std::int32_t d, std::int64_t s0, std::int64_t s1) {
    return view2(rows, n, d, s0, s1);
  };
  const kv::tensor_view<const T, 2> good = rows_view(kKvHeads, kDim, kDim, 1);
  const std::int32_t slots[kKvHeads] = {1, 5};
  const auto scatter_to = [&](std::int32_t b, const std::int32_t* s) { kv::scatter(cache.view(), b, s, good, good); };

  CHECK_REJECTED(snap, kv::invalid_argument, ("'slots'", "null"), [&] { scatter_to(0, nullptr); });
  {
    const std::int32_t bad[kKvHeads] = {1, kCap};
    CHECK_REJECTED(snap, kv::out_of_range, ("'slots[1]'", "= 8"), [&] { scatter_to(0, bad); });
    const std::int32_t negative[kKvHeads] = {-1, 0};
    CHECK_REJECTED(snap, kv::out_of_range, ("'slots[0]'", "= -1"), [&] { scatter_to(0, negative); });
  }
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"), [&] { scatter_to(kSeqs, slots); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= -1"), [&] { scatter_to(-1, slots); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'k_new'", "[2][3]", "expected [2][4]"),
                 [&] { kv::scatter(cache.view(), 0, slots, rows_view(kKvHeads, kDim - 1, kDim, 1), good); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'v_new'", "[3][4]", "expected [2][4]"),
                 [&] { kv::scatter(cache.view(), 0, slots, good, rows_view(kKvHeads + 1, kDim, kDim, 1)); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'k_new.strides[1]'", "= 2", "contiguous"),
                 [&] { kv::scatter(cache.view(), 0, slots, rows_view(kKvHeads, kDim, 2 * kDim, 2), good); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'v_new.strides[1]'", "= 0"),
                 [&] { kv::scatter(cache.view(), 0, slots, good, rows_view(kKvHeads, kDim, kDim, 0)); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'k_new'", "null"),
                 [&] { kv::scatter(cache.view(), 0, slots, kv::tensor_view<const T, 2>{}, good); });
  check_bad_views(snap, cache.view(), [&](const auto& v) { kv::scatter(v, 0, slots, good, good); });
  if constexpr (is_paged) {
    const std::int32_t moved[kKvHeads] = {4, 0};  // head 0 writes into page 1
    for (const std::int32_t bad : {-1, kNumPages}) {
      const std::int32_t saved = page_entry(cache, 0, 1);
      page_entry(cache, 0, 1) = bad;
      CHECK_REJECTED(snap, kv::out_of_range, ("'page_table[0][1]'", cat("= ", bad)), [&] { scatter_to(0, moved); });
      page_entry(cache, 0, 1) = saved;
    }
  }

  // K and V rows must not overlap each other either (not only k == v).
  {
    auto v = cache.view();
    v.v = v.k + 1;
    CHECK_REJECTED(snap, kv::invalid_argument, ("'view.v'"), [&] { kv::scatter(v, 0, slots, good, good); });
  }

  // The valid call writes exactly the two rows.
  CHECK_NOTHROW(scatter_to(0, slots));
  const auto v = cache.view();
  for (std::int32_t h = 0; h < kKvHeads; ++h)
    for (std::int32_t d = 0; d < kDim; ++d) {
      CHECK(kv::to_float(v.k_row(0, h, slots[h])[d]) == kv::to_float(good(h, d)));
      CHECK(kv::to_float(v.v_row(0, h, slots[h])[d]) == kv::to_float(good(h, d)));
    }
}

template <class Fx>
void check_compact(Fx& fx) {
  using T = typename Fx::element;
  constexpr bool is_paged = std::is_same_v<typename Fx::layout, kv::paged_layout>;
  auto& cache = fx.cache;
  const auto snap = fx.snap();
  const auto compact = [&](std::int32_t b, std::int32_t h, std::initializer_list<std::int32_t> src,
                           T* workspace = nullptr) {
    const std::vector<std::int32_t> s(src);
    kv::compact(cache.view(), b, h, s.data(), static_cast<std::int32_t>(s.size()), workspace);
  };
  const std::vector<std::int32_t> all = {0, 1, 2, 3, 4, 5, 6, 7, 7};

  CHECK_REJECTED(snap, kv::out_of_range, ("'n'", "= 9"),
                 [&] { kv::compact(cache.view(), 0, 0, all.data(), kCap + 1); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'n'", "= -1"), [&] { kv::compact(cache.view(), 0, 0, all.data(), -1); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'src'", "null"),
                 [&] { kv::compact(cache.view(), 0, 0, static_cast<const std::int32_t*>(nullptr), 2); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'src[2]'", "= 2", "repeated"), [&] { compact(0, 1, {0, 2, 2}); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'workspace'", "null"), [&] { compact(1, 0, {3, 1}); });
  CHECK_REJECTED(snap, kv::invalid_argument, ("'workspace'", "null"), [&] { compact(1, 0, {2, 5, 4}); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'src[1]'", "= 8"), [&] { compact(0, 0, {0, kCap}); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'src[0]'", "= -1"), [&] { compact(0, 0, {-1}); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'head'", "= 2"), [&] { compact(0, kKvHeads, {1, 2}); });
  CHECK_REJECTED(snap, kv::out_of_range, ("'sequence'", "= 3"), [&] { compact(kSeqs, 0, {1, 2}); });
  check_bad_views(snap, cache.view(), [&](const auto& v) {
    const std::int32_t src[2] = {2, 5};
    kv::compact(v, 0, 0, src, 2);
  });
  if constexpr (is_paged) {
    // A source in page 2 of sequence 1, and a destination in its page 0.
    for (const std::int32_t bad : {-1, kNumPages}) {
      std::int32_t saved = page_entry(cache, 1, 2);
      page_entry(cache, 1, 2) = bad;
      CHECK_REJECTED(snap, kv::out_of_range, ("'page_table[1][2]'", cat("= ", bad)), [&] { compact(1, 1, {0, 7}); });
      page_entry(cache, 1, 2) = saved;
      saved = page_entry(cache, 1, 0);
      page_entry(cache, 1, 0) = bad;
      CHECK_REJECTED(snap, kv::out_of_range, ("'page_table[1][0]'", cat("= ", bad)), [&] { compact(1, 1, {4, 5}); });
      page_entry(cache, 1, 0) = saved;
    }
  }

  // Non-increasing sources go through the workspace.
  const auto view = cache.view();
  std::vector<float> row3(kDim), row1(kDim);
  for (std::int32_t d = 0; d < kDim; ++d) {
    row3[std::size_t(d)] = kv::to_float(view.k_row(1, 0, 3)[d]);
    row1[std::size_t(d)] = kv::to_float(view.k_row(1, 0, 1)[d]);
  }
  std::vector<T> workspace(kv::compaction_workspace_elements(2, kDim));
  CHECK_NOTHROW(compact(1, 0, {3, 1}, workspace.data()));
  for (std::int32_t d = 0; d < kDim; ++d) {
    CHECK(kv::to_float(view.k_row(1, 0, 0)[d]) == row3[std::size_t(d)]);
    CHECK(kv::to_float(view.k_row(1, 0, 1)[d]) == row1[std::size_t(d)]);
  }
}

}  // namespace

// =====================================================================

static_assert(std::is_base_of_v<kv::error, kv::invalid_argument>);
static_assert(std::is_base_of_v<kv::invalid_argument, kv::budget_error>);
static_assert(std::is_base_of_v<kv::invalid_argument, kv::out_of_range>);
static_assert(std::is_base_of_v<kv::invalid_argument, kv::non_finite_error>);
static_assert(std::is_base_of_v<kv::error, kv::state_error>);
static_assert(!std::is_base_of_v<kv::invalid_argument, kv::state_error>);
static_assert(std::is_base_of_v<std::runtime_error, kv::error>);

TEST_CASE("errors: policy constructors reject bad budgets and shapes") {
  const kv::policy_shape good = shape_of(kCap);
  const auto with = [&](std::int32_t seqs, std::int32_t kv_heads, std::int32_t q_heads, std::int32_t capacity) {
    kv::policy_shape s = good;
    s.num_seqs = seqs;
    s.num_kv_heads = kv_heads;
    s.num_q_heads = q_heads;
    s.capacity = capacity;
    return s;
  };

  SUBCASE("empty budgets") {
    CHECK_THROWS_NAMING(kv::budget_error, ("'budget'", "= 0"), [&] { kv::h2o_policy p(good, h2o_cfg(0, 0)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'budget'", "= 0"),
                        [&] { kv::recent_window_policy p(good, window_cfg(0, 0)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("budget = 0"), [&] { kv::random_policy p(good, random_cfg(0, 0, 0)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("budget = 0"),
                        [&] { kv::exact_greedy_policy p(good, greedy_cfg(0, 0)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("budget = -3"),
                        [&] { kv::exact_greedy_policy p(good, greedy_cfg(-3, 0)); });
  }

  SUBCASE("capacity below budget + 1") {
    const kv::policy_shape small = with(kSeqs, kKvHeads, kQHeads, kBudget);
    CHECK_THROWS_NAMING(kv::budget_error, ("'shape.capacity'", "= 5", "needs 6"),
                        [&] { kv::h2o_policy p(small, h2o_cfg(3, 2)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'shape.capacity'", "= 5"),
                        [&] { kv::recent_window_policy p(small, window_cfg(1, 4)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'shape.capacity'", "= 5"),
                        [&] { kv::random_policy p(small, random_cfg(kBudget, 1, 1)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'shape.capacity'", "= 5"),
                        [&] { kv::exact_greedy_policy p(small, greedy_cfg(kBudget, 1)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'shape.capacity'", "= 0"),
                        [&] { kv::h2o_policy p(with(kSeqs, kKvHeads, kQHeads, 0), h2o_cfg(3, 2)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'shape.capacity'", "= -4"),
                        [&] { kv::h2o_policy p(with(kSeqs, kKvHeads, kQHeads, -4), h2o_cfg(3, 2)); });
  }

  SUBCASE("negative parts") {
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.heavy'", "= -1"), [&] { kv::h2o_policy p(good, h2o_cfg(-1, 4)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.recent'", "= -2"), [&] { kv::h2o_policy p(good, h2o_cfg(4, -2)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.sinks'", "= -1"),
                        [&] { kv::recent_window_policy p(good, window_cfg(-1, 4)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.window'", "= -3"),
                        [&] { kv::recent_window_policy p(good, window_cfg(2, -3)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.sinks'", "= -1"),
                        [&] { kv::random_policy p(good, random_cfg(kBudget, -1, 0)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.recent'", "= -1"),
                        [&] { kv::random_policy p(good, random_cfg(kBudget, 0, -1)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.recent'", "= -1"),
                        [&] { kv::exact_greedy_policy p(good, greedy_cfg(kBudget, -1)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.sinks'", "= -1"),
                        [&] { kv::exact_greedy_policy p(good, greedy_cfg(kBudget, 0, -1)); });
  }

  SUBCASE("protected tokens that leave nothing to evict") {
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.sinks + config.recent'", "= 5", "budget = 5"),
                        [&] { kv::random_policy p(good, random_cfg(kBudget, 3, 2)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.sinks + config.recent'", "= 7"),
                        [&] { kv::random_policy p(good, random_cfg(kBudget, 7, 0)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.sinks + config.recent'", "= 5", "budget = 5"),
                        [&] { kv::exact_greedy_policy p(good, greedy_cfg(kBudget, kBudget)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.sinks + config.recent'", "= 6"),
                        [&] { kv::exact_greedy_policy p(good, greedy_cfg(kBudget, 6)); });
    CHECK_THROWS_NAMING(kv::budget_error, ("'config.sinks + config.recent'", "= 5", "budget = 5"),
                        [&] { kv::exact_greedy_policy p(good, greedy_cfg(kBudget, 2, 3)); });
  }

  SUBCASE("shapes") {
    CHECK_THROWS_NAMING(kv::invalid_argument, ("'shape.num_q_heads'", "= 3", "multiple", "= 2"),
                        [&] { kv::h2o_policy p(with(kSeqs, 2, 3, kCap), h2o_cfg(3, 2)); });
    CHECK_THROWS_NAMING(kv::invalid_argument, ("'shape.num_q_heads'", "= 6", "= 4"),
                        [&] { kv::random_policy p(with(kSeqs, 4, 6, kCap), random_cfg(kBudget, 1, 1)); });
    CHECK_THROWS_NAMING(kv::invalid_argument, ("'shape.num_seqs'", "= 0"),
                        [&] { kv::h2o_policy p(with(0, kKvHeads, kQHeads, kCap), h2o_cfg(3, 2)); });
    CHECK_THROWS_NAMING(kv::invalid_argument, ("'shape.num_seqs'", "= -1"),
                        [&] { kv::recent_window_policy p(with(-1, kKvHeads, kQHeads, kCap), window_cfg(1, 4)); });
    CHECK_THROWS_NAMING(kv::invalid_argument, ("'shape.num_kv_heads'", "= 0"),
                        [&] { kv::h2o_policy p(with(kSeqs, 0, kQHeads, kCap), h2o_cfg(3, 2)); });
    CHECK_THROWS_NAMING(kv::invalid_argument, ("'shape.num_kv_heads'", "= -2"),
                        [&] { kv::exact_greedy_policy p(with(kSeqs, -2, kQHeads, kCap), greedy_cfg(kBudget, 1)); });
    CHECK_THROWS_NAMING(kv::invalid_argument, ("'shape.num_q_heads'", "= 0"),
                        [&] { kv::h2o_policy p(with(kSeqs, kKvHeads, 0, kCap), h2o_cfg(3, 2)); });
    CHECK_THROWS_NAMING(kv::invalid_argument, ("'shape.num_q_heads'", "= -4"),
                        [&] { kv::random_policy p(with(kSeqs, kKvHeads, -4, kCap), random_cfg(kBudget, 1, 1)); });
  }

  SUBCASE("budgets near INT32_MAX do not overflow into acceptance") {
    // budget + 1 (the spare slot) and heavy + recent must not wrap around.
    constexpr std::int32_t big = std::numeric_limits<std::int32_t>::max();
    CHECK_REJECTED_ISOLATED(kv::budget_error, ("budget", "2147483647"),
                            [&] { kv::random_policy p(good, random_cfg(big, 0, 0)); });
    CHECK_REJECTED_ISOLATED(kv::budget_error, ("budget", "2147483647"),
                            [&] { kv::exact_greedy_policy p(good, greedy_cfg(big, 0)); });
    CHECK_REJECTED_ISOLATED(kv::budget_error, ("config.heavy"), [&] { kv::h2o_policy p(good, h2o_cfg(big, 1)); });
    CHECK_REJECTED_ISOLATED(kv::budget_error, ("config.sinks"),
                            [&] { kv::recent_window_policy p(good, window_cfg(big, 1)); });
  }
}

TEST_CASE("errors: ratio helpers") {
  CHECK_THROWS_NAMING(kv::budget_error, ("'ratio'", "= -0.1", "[0, 1]"), [] { (void)kv::tokens_for_ratio(100, -0.1); });
  CHECK_THROWS_NAMING(kv::budget_error, ("'ratio'", "= 1.5"), [] { (void)kv::tokens_for_ratio(100, 1.5); });
  CHECK_THROWS_NAMING(kv::budget_error, ("'ratio'", "= nan"),
                      [] { (void)kv::tokens_for_ratio(100, std::numeric_limits<double>::quiet_NaN()); });
  CHECK_THROWS_NAMING(kv::budget_error, ("'ratio'", "= inf"),
                      [] { (void)kv::tokens_for_ratio(100, std::numeric_limits<double>::infinity()); });
  CHECK_THROWS_NAMING(kv::invalid_argument, ("'length'", "= -1"), [] { (void)kv::tokens_for_ratio(-1, 0.5); });
  CHECK(kv::tokens_for_ratio(100, 0.0) == 0);
  CHECK(kv::tokens_for_ratio(100, 1.0) == 100);

  CHECK_THROWS_NAMING(kv::budget_error, ("'heavy_ratio + recent_ratio'", "empty budget", "length 10"),
                      [] { (void)kv::h2o_from_ratios(10, 0.05, 0.05); });
  CHECK_THROWS_NAMING(kv::budget_error, ("'heavy_ratio + recent_ratio'", "length 0"),
                      [] { (void)kv::h2o_from_ratios(0, 0.5, 0.5); });
  // A bad ratio passed to h2o_from_ratios is named as that function's argument.
  CHECK_THROWS_NAMING(kv::budget_error, ("'recent_ratio'", "= 1.5"),
                      [] { (void)kv::h2o_from_ratios(100, 0.1, 1.5); });
  CHECK_THROWS_NAMING(kv::budget_error, ("'sinks'", "= 5", "budget 5"),
                      [] { (void)kv::recent_window_from_ratio(10, 0.5, 5); });
  CHECK_THROWS_NAMING(kv::budget_error, ("'sinks'", "= -1"), [] { (void)kv::recent_window_from_ratio(10, 0.5, -1); });
  CHECK(kv::h2o_from_ratios(100, 0.1, 0.1).budget() == 20);
}

TEST_CASE("errors: observe with probabilities or head scores") {
  for_each_policy_and_cache([](auto& fx) { check_observe_probs(fx); });
}

TEST_CASE("errors: observe with queries and LSE (fused attention)") {
  for_each_policy_and_cache([](auto& fx) { check_observe_queries(fx); });
}

TEST_CASE("errors: a null LSE pointer is rejected, not dereferenced") {
  fixture fx(make_h2o(), bhsd<float>());
  fx.write_token(0);
  const query_data<float> good(fx.rng);
  kv::decode_queries<float> in = good.input();
  in.lse.data = nullptr;
  CHECK_REJECTED_ISOLATED(kv::invalid_argument, ("'lse'", "null"), [&] { fx.policy.observe(0, in, fx.view()); });
}

TEST_CASE("errors: prefill") {
  for_each_policy_and_cache([](auto& fx) { check_prefill(fx); });
}

TEST_CASE("errors: append on a full sequence, evict and accessors out of range") {
  SUBCASE("h2o") { check_append_when_full(make_h2o(kBudget + 1)); }
  SUBCASE("recent_window") { check_append_when_full(make_window(kBudget + 1)); }
  SUBCASE("random") { check_append_when_full(make_random(kBudget + 1)); }
}

TEST_CASE("errors: exact greedy") {
  SUBCASE("float, bhsd") {
    fixture fx(make_greedy(), bhsd<float>());
    check_exact_greedy(fx);
  }
  SUBCASE("bfloat16, paged nhd") {
    fixture fx(make_greedy(), paged<kv::bfloat16>(kv::page_order::nhd));
    check_exact_greedy(fx);
  }
}

TEST_CASE("errors: the decode protocol (append, observe once, evict)") {
  for_each_policy_and_cache([](auto& fx) { check_protocol(fx); });
  SUBCASE("exact_greedy, float, bhsd") {
    fixture fx(make_greedy(), bhsd<float>());
    check_protocol(fx);
  }
  SUBCASE("exact_greedy, bfloat16, paged hnd") {
    fixture fx(make_greedy(), paged<kv::bfloat16>(kv::page_order::hnd));
    check_protocol(fx);
  }
}

TEST_CASE("errors: scores cannot become NaN or inf from finite inputs") {
  // One GQA group of two query heads, one KV head; h2o with no recent
  // window, so every token's score decides.
  kv::policy_shape shape;
  shape.num_seqs = 1;
  shape.num_kv_heads = 1;
  shape.num_q_heads = 2;
  shape.capacity = 4;
  kv::h2o_policy policy(shape, h2o_cfg(2, 0));
  const auto snap = [&] {
    snapshot st;
    add_policy_state(st, policy);
    return st;
  };
  std::vector<float> minus(4, -3e38f), huge(2 * 4, 3e38f);
  const kv::head_scores negative{view2(minus, 1, 4, 4)};
  const kv::decode_probs big{view2(huge, 2, 4, 4)};

  // Negative per-head increments are allowed (docs/semantics.md, "Scores").
  policy.append(0);
  policy.observe(0, negative);
  CHECK(policy.score(0, 0, 0) == -3e38f);
  policy.append(0);
  // Regression: two -3e38 increments reached -inf, then +inf increments NaN.
  CHECK_REJECTED(snap, kv::non_finite_error, ("sequence 0 head 0 slot 0", "overflows"),
                 [&] { policy.observe(0, negative); });
  // The group reduction itself overflows: 3e38 + 3e38 is inf before any score is touched.
  CHECK_REJECTED(snap, kv::non_finite_error, ("'probs[0..1][0]'", "overflows to inf", "KV head 0"),
                 [&] { policy.observe(0, big); });
  // mean and max of the same group stay finite; with sum the rejection above stands.
  kv::h2o_config by_max = h2o_cfg(2, 0);
  by_max.reduce = kv::group_reduce::max;
  kv::h2o_policy max_policy(shape, by_max);
  max_policy.append(0);
  max_policy.observe(0, big);
  CHECK(max_policy.score(0, 0, 0) == 3e38f);
  // A valid observe still goes through after the rejections.
  std::vector<float> one(2 * 4, 0.25f);
  CHECK_NOTHROW(policy.observe(0, kv::decode_probs{view2(one, 2, 4, 4)}));
  CHECK(policy.score(0, 0, 0) == -3e38f + 0.5f);
  CHECK(policy.score(0, 0, 1) == 0.5f);
  // The lowest score is the victim, however negative.
  policy.append(0);
  policy.observe(0, kv::decode_probs{view2(one, 2, 4, 4)});
  std::int32_t victim = -1;
  CHECK(policy.evict(0, &victim) == 1);
  CHECK(victim == 0);
}

TEST_CASE("errors: out-of-range enum values are rejected, not read as defaults") {
  kv::h2o_config bad = h2o_cfg(3, 2);
  bad.reduce = static_cast<kv::group_reduce>(9);
  CHECK_THROWS_NAMING(kv::invalid_argument, ("'config.reduce'", "= 9"), [&] { kv::h2o_policy p(shape_of(), bad); });

  fixture fx(make_h2o(), bhsd<float>());
  const auto snap = fx.snap();
  fx.write_token(0);
  std::mt19937 rng(3u);
  const std::vector<float> logits = random_floats(std::size_t(kQHeads) * kCap, rng, -1.0f, 1.0f);
  const std::vector<float> lse(kQHeads, 1.0f);
  kv::decode_logits in{view2(logits, kQHeads, kCap, kCap), kv::make_tensor_view<const float>(lse.data(), kQHeads)};
  in.base = static_cast<kv::lse_base>(5);
  CHECK_REJECTED(snap, kv::invalid_argument, ("'base'", "= 5", "lse_base"), [&] { fx.policy.observe(0, in); });
  query_data<float> qd(rng);
  kv::decode_queries<float> q = qd.input();
  q.base = static_cast<kv::lse_base>(5);
  CHECK_REJECTED(snap, kv::invalid_argument, ("'base'", "= 5"), [&] { fx.policy.observe(0, q, fx.view()); });
}

TEST_CASE("errors: shapes too large to allocate are refused before allocating") {
  // 2^20 x 2^20 x 2^30 would end in std::bad_alloc (or an overcommitted
  // allocation); anything above kvevict::max_allocation_bytes is refused.
  kv::policy_shape huge;
  huge.num_seqs = 1 << 20;
  huge.num_kv_heads = 1 << 20;
  huge.num_q_heads = 1 << 20;
  huge.capacity = 1 << 30;
  const char* arg = "'shape.num_seqs * shape.num_kv_heads * shape.capacity'";
  CHECK_REJECTED_ISOLATED(kv::invalid_argument, (arg, "max_allocation_bytes"),
                          [&] { kv::h2o_policy p(huge, h2o_cfg(3, 2)); });
  CHECK_REJECTED_ISOLATED(kv::invalid_argument, (arg), [&] { kv::recent_window_policy p(huge, window_cfg(1, 4)); });
  CHECK_REJECTED_ISOLATED(kv::invalid_argument, (arg), [&] { kv::random_policy p(huge, random_cfg(kBudget, 1, 1)); });
  CHECK_REJECTED_ISOLATED(kv::invalid_argument, (arg),
                          [&] { kv::exact_greedy_policy p(huge, greedy_cfg(kBudget, 1)); });
  // Just above the limit: 2^17 sequences x 2^8 heads x 2^12 slots x 8 bytes = 2^40, plus scratch.
  kv::policy_shape edge = huge;
  edge.num_seqs = 1 << 17;
  edge.num_kv_heads = 1 << 8;
  edge.num_q_heads = 1 << 8;
  edge.capacity = 1 << 12;
  CHECK_REJECTED_ISOLATED(kv::invalid_argument, (arg), [&] { kv::h2o_policy p(edge, h2o_cfg(3, 2)); });
  CHECK_REJECTED_ISOLATED(kv::invalid_argument, ("make_bhsd_cache", "'num_seqs * num_heads * capacity * head_dim'"),
                          [] { (void)kv::make_bhsd_cache<float>(1 << 20, 1 << 10, 1 << 10, 128); });
  CHECK_REJECTED_ISOLATED(kv::invalid_argument, ("make_bshd_cache", "max_allocation_bytes"),
                          [] { (void)kv::make_bshd_cache<kv::bfloat16>(1 << 10, 1 << 10, 1 << 10, 512); });
  // A page far larger than the capacity: the pool, not the shape, is what is allocated.
  CHECK_REJECTED_ISOLATED(kv::invalid_argument, ("make_paged_cache", "'the page pool'"),
                          [] { (void)kv::make_paged_cache<float>(1, 64, 1, 128, 1 << 30, kv::page_order::nhd); });
}

TEST_CASE("errors: scatter") {
  SUBCASE("float, bhsd") {
    cache_fixture fx(bhsd<float>());
    check_scatter(fx);
  }
  SUBCASE("bfloat16, bshd") {
    cache_fixture fx(bshd<kv::bfloat16>());
    check_scatter(fx);
  }
  SUBCASE("bfloat16, paged nhd") {
    cache_fixture fx(paged<kv::bfloat16>(kv::page_order::nhd));
    check_scatter(fx);
  }
  SUBCASE("float, paged hnd") {
    cache_fixture fx(paged<float>(kv::page_order::hnd));
    check_scatter(fx);
  }
}

TEST_CASE("errors: compact") {
  SUBCASE("float, bhsd") {
    cache_fixture fx(bhsd<float>());
    check_compact(fx);
  }
  SUBCASE("bfloat16, bshd") {
    cache_fixture fx(bshd<kv::bfloat16>());
    check_compact(fx);
  }
  SUBCASE("bfloat16, paged nhd") {
    cache_fixture fx(paged<kv::bfloat16>(kv::page_order::nhd));
    check_compact(fx);
  }
  SUBCASE("float, paged hnd") {
    cache_fixture fx(paged<float>(kv::page_order::hnd));
    check_compact(fx);
  }
}

TEST_CASE("errors: cache factories reject non-positive sizes") {
  CHECK_THROWS_NAMING(kv::invalid_argument, ("make_bhsd_cache", "'num_seqs'", "= 0"),
                      [] { (void)kv::make_bhsd_cache<float>(0, 2, 8, 4); });
  CHECK_THROWS_NAMING(kv::invalid_argument, ("make_bhsd_cache", "'num_heads'", "= -2"),
                      [] { (void)kv::make_bhsd_cache<float>(1, -2, 8, 4); });
  CHECK_THROWS_NAMING(kv::invalid_argument, ("make_bhsd_cache", "'capacity'", "= 0"),
                      [] { (void)kv::make_bhsd_cache<kv::bfloat16>(1, 2, 0, 4); });
  CHECK_THROWS_NAMING(kv::invalid_argument, ("make_bhsd_cache", "'head_dim'", "= -1"),
                      [] { (void)kv::make_bhsd_cache<kv::bfloat16>(1, 2, 8, -1); });
  CHECK_THROWS_NAMING(kv::invalid_argument, ("make_bshd_cache", "'capacity'", "= -8"),
                      [] { (void)kv::make_bshd_cache<float>(1, 2, -8, 4); });
  CHECK_THROWS_NAMING(kv::invalid_argument, ("make_paged_cache", "'num_seqs'", "= -1"),
                      [] { (void)kv::make_paged_cache<float>(-1, 2, 8, 4, 3, kv::page_order::nhd); });
  CHECK_THROWS_NAMING(kv::invalid_argument, ("make_paged_cache", "'head_dim'", "= 0"),
                      [] { (void)kv::make_paged_cache<kv::bfloat16>(1, 2, 8, 0, 3, kv::page_order::hnd); });
  CHECK_THROWS_NAMING(kv::invalid_argument, ("make_paged_cache", "'page_size'", "= 0"),
                      [] { (void)kv::make_paged_cache<float>(1, 2, 8, 4, 0, kv::page_order::nhd); });
  CHECK_THROWS_NAMING(kv::invalid_argument, ("make_paged_cache", "'page_size'", "= -3"),
                      [] { (void)kv::make_paged_cache<kv::bfloat16>(1, 2, 8, 4, -3, kv::page_order::hnd); });
}
