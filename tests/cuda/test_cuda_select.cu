// CUDA segmented selection (kvevict/cuda/segmented_select.cuh) against the
// host's kvevict::segmented_select, which test_select holds to its
// definition: indices and mask bytes must be identical, including the bytes
// the call must not write. Segment lengths from 1 to 1M keys (the one-block
// and the multi-block paths), every count from 0 to n, both ends, random
// scores, all-equal scores, a few distinct values, NaN / +-0 / infinities /
// subnormals, implicit, shuffled and repeated positions, ragged lengths and
// per-segment counts. Also: bad per-segment counts and lengths (reported in
// the status word, that segment left unwritten), misaligned workspaces, a
// captured CUDA graph, a key source of its own through the generic core, and
// the argument checks that throw before any launch. A plain sort-based
// reference checks the host oracle itself on the smaller cases.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "cuda/device_mirror.cuh"
#include "kvevict/cuda/segmented_select.cuh"
#include "kvevict/select/segmented_select.hpp"

namespace {

using namespace kvevict;
using kvtest::device_buffer;

constexpr std::int32_t kIndexSentinel = -7;
constexpr std::uint8_t kMaskSentinel = 0xAB;

enum class scores_kind { random, equal, ties, special };
enum class positions_kind { implicit, shuffled, repeated };

const char* name(scores_kind s) {
  switch (s) {
    case scores_kind::random: return "random";
    case scores_kind::equal: return "equal";
    case scores_kind::ties: return "ties";
    case scores_kind::special: return "special";
  }
  return "?";
}
const char* name(positions_kind p) {
  switch (p) {
    case positions_kind::implicit: return "implicit";
    case positions_kind::shuffled: return "shuffled";
    case positions_kind::repeated: return "repeated";
  }
  return "?";
}

float bits_to_float(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float draw_score(scores_kind kind, std::mt19937& rng) {
  switch (kind) {
    case scores_kind::random: return std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng);
    case scores_kind::equal: return 0.25f;
    case scores_kind::ties: return static_cast<float>(rng() % 4) * 0.5f;
    case scores_kind::special: {
      const float special[] = {std::numeric_limits<float>::quiet_NaN(), bits_to_float(0xFFC00001u),  // NaNs
                               -0.0f, 0.0f, INFINITY, -INFINITY, bits_to_float(1u), bits_to_float(0x80000001u),
                               std::numeric_limits<float>::max(), 1.0f, -1.0f};
      const std::uint32_t r = rng() % 16;
      return r < 11 ? special[r] : std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
    }
  }
  return 0.0f;
}

/// A selection problem in host memory, laid out as the device copy will be.
struct problem {
  std::int32_t segments = 0, max_length = 0;
  std::int64_t stride = 0;
  std::vector<float> scores;            ///< [segments][stride]
  std::vector<std::int32_t> positions;  ///< [segments][stride], or empty: implicit
  std::vector<std::int32_t> lengths;    ///< [segments], or empty: max_length each
  std::vector<std::int32_t> ks;         ///< [segments], or empty: k each
  std::int32_t k = 0;
  bool want_indices = true, want_mask = true;
  std::int64_t fixed_index_stride = 0;  ///< > 0: the index stride, whatever the counts

  std::int32_t length(std::int32_t i) const { return lengths.empty() ? max_length : lengths[i]; }
  std::int32_t count(std::int32_t i) const { return ks.empty() ? k : ks[i]; }
  std::int64_t index_stride() const {
    if (fixed_index_stride > 0) return fixed_index_stride;
    std::int32_t largest = k;
    for (std::int32_t x : ks) largest = std::max(largest, x);
    return largest + 2;  // rows with a gap the call must not write
  }
  std::int64_t mask_stride() const { return max_length + 5; }

  segment_set keys_at(const float* s, const std::int32_t* p, const std::int32_t* l) const {
    return segment_set{s, p, stride, l, max_length, segments};
  }
  selection_count count_at(const std::int32_t* k_of) const { return selection_count{k, k_of}; }
};

/// Scores and positions of `segments` segments of up to max_length keys.
problem make_problem(std::mt19937& rng, std::int32_t segments, std::int32_t max_length, scores_kind s,
                     positions_kind p) {
  problem pr;
  pr.segments = segments;
  pr.max_length = max_length;
  pr.stride = std::int64_t{max_length} + 3;
  pr.scores.assign(static_cast<std::size_t>(segments * pr.stride), 99.0f);
  if (p != positions_kind::implicit) pr.positions.assign(pr.scores.size(), -1);
  for (std::int32_t i = 0; i < segments; ++i) {
    float* row = pr.scores.data() + i * pr.stride;
    for (std::int32_t j = 0; j < max_length; ++j) row[j] = draw_score(s, rng);
    if (p == positions_kind::implicit) continue;
    std::int32_t* pos = pr.positions.data() + i * pr.stride;
    if (p == positions_kind::shuffled) {
      std::iota(pos, pos + max_length, 0);
      std::shuffle(pos, pos + max_length, rng);
    } else {  // repeated: identical keys exist when scores tie too
      for (std::int32_t j = 0; j < max_length; ++j) pos[j] = static_cast<std::int32_t>(rng() % (max_length / 4 + 1));
    }
  }
  return pr;
}

struct result {
  std::vector<std::int32_t> indices;
  std::vector<std::uint8_t> mask;
  std::uint64_t status = batch_status_clear;
};

result fresh_result(const problem& p) {
  result r;
  // At least one element each, so the outputs are never null.
  r.indices.assign(std::max<std::size_t>(1, static_cast<std::size_t>(p.segments * p.index_stride())), kIndexSentinel);
  r.mask.assign(std::max<std::size_t>(1, static_cast<std::size_t>(p.segments * p.mask_stride())), kMaskSentinel);
  return r;
}

selection_output output_at(const problem& p, std::int32_t* indices, std::uint8_t* mask) {
  return selection_output{p.want_indices ? indices : nullptr, p.index_stride(), p.want_mask ? mask : nullptr,
                          p.mask_stride()};
}

result run_host(const problem& p, select_end end) {
  result r = fresh_result(p);
  segmented_select(p.keys_at(p.scores.data(), p.positions.empty() ? nullptr : p.positions.data(),
                             p.lengths.empty() ? nullptr : p.lengths.data()),
                   end, p.count_at(p.ks.empty() ? nullptr : p.ks.data()),
                   output_at(p, r.indices.data(), r.mask.data()));
  return r;
}

/// The definition, the slow way: sort each segment by (key, index), take k,
/// sort those by (position, index).
result run_plain(const problem& p, select_end end) {
  result r = fresh_result(p);
  const segment_set keys = p.keys_at(p.scores.data(), p.positions.empty() ? nullptr : p.positions.data(),
                                     p.lengths.empty() ? nullptr : p.lengths.data());
  for (std::int32_t i = 0; i < p.segments; ++i) {
    const std::int32_t n = p.length(i), k = p.count(i);
    std::vector<std::pair<std::uint64_t, std::int32_t>> all;
    for (std::int32_t j = 0; j < n; ++j) all.emplace_back(keys.key(i, j, end), j);
    std::sort(all.begin(), all.end());
    std::vector<std::pair<std::int32_t, std::int32_t>> chosen;
    for (std::int32_t t = 0; t < k; ++t) chosen.emplace_back(keys.position(i, all[t].second), all[t].second);
    std::sort(chosen.begin(), chosen.end());
    if (p.want_indices)
      for (std::int32_t t = 0; t < k; ++t) r.indices[i * p.index_stride() + t] = chosen[t].second;
    if (p.want_mask) {
      for (std::int32_t j = 0; j < n; ++j) r.mask[i * p.mask_stride() + j] = 0;
      for (const auto& c : chosen) r.mask[i * p.mask_stride() + c.second] = 1;
    }
  }
  return r;
}

/// The problem's inputs in device memory.
struct device_problem {
  device_buffer<float> scores;
  device_buffer<std::int32_t> positions, lengths, ks;
  segment_set keys;
  selection_count count;

  explicit device_problem(const problem& p)
      : scores(p.scores), positions(p.positions), lengths(p.lengths), ks(p.ks),
        keys(p.keys_at(scores.get(), positions.get(), lengths.get())), count(p.count_at(ks.get())) {}
};

/// Device outputs prefilled with the sentinels, and a clear status word.
struct device_result {
  device_buffer<std::int32_t> indices;
  device_buffer<std::uint8_t> mask;
  device_buffer<std::uint64_t> status;
  selection_output out;

  explicit device_result(const problem& p)
      : indices(fresh_result(p).indices), mask(fresh_result(p).mask), status(std::vector<std::uint64_t>{batch_status_clear}),
        out(output_at(p, indices.get(), mask.get())) {}
  result download() const {
    KVTEST_CUDA(cudaDeviceSynchronize());
    return result{indices.download(), mask.download(), status.download()[0]};
  }
};

std::size_t workspace_bytes(const device_problem& d, select_end end, const device_result& o) {
  std::size_t bytes = 0;
  KVTEST_CUDA(gpu::segmented_select(nullptr, bytes, d.keys, end, d.count, o.out, o.status.get(), nullptr));
  return bytes;
}

/// Runs the CUDA selection with the workspace `misalign` bytes past an
/// aligned allocation.
result run_device(const problem& p, select_end end, std::size_t misalign = 0) {
  const device_problem d(p);
  const device_result o(p);
  std::size_t bytes = workspace_bytes(d, end, o);
  device_buffer<unsigned char> workspace(bytes + misalign);
  KVTEST_CUDA(gpu::segmented_select(workspace.get() + misalign, bytes, d.keys, end, d.count, o.out, o.status.get(),
                                    nullptr));
  return o.download();
}

void check_same(const result& want, const result& got) {
  REQUIRE(got.indices.size() == want.indices.size());
  REQUIRE(got.mask.size() == want.mask.size());
  const auto bad_index = std::mismatch(want.indices.begin(), want.indices.end(), got.indices.begin());
  if (bad_index.first != want.indices.end()) {
    const auto at = bad_index.first - want.indices.begin();
    CAPTURE(at);
    CHECK(*bad_index.second == *bad_index.first);
  }
  const auto bad_mask = std::mismatch(want.mask.begin(), want.mask.end(), got.mask.begin());
  if (bad_mask.first != want.mask.end()) {
    const auto at = bad_mask.first - want.mask.begin();
    CAPTURE(at);
    CHECK(int(*bad_mask.second) == int(*bad_mask.first));
  }
  CHECK(got.status == want.status);
}

/// Device against host (and, when small, the host against the plain
/// definition).
void check_problem(const problem& p, select_end end, std::size_t misalign = 0) {
  const result host = run_host(p, end);
  if (std::int64_t{p.segments} * p.max_length <= 20000) check_same(run_plain(p, end), host);
  check_same(host, run_device(p, end, misalign));
}

constexpr select_end kEnds[] = {select_end::top, select_end::bottom};

TEST_CASE("cuda select: lengths 1 to 1M x every count x both ends x score and position kinds") {
  const std::int32_t sizes[] = {1, 2, 31, 32, 33, 1000, 4096, 4097, 32768, 131072, 1048576};
  const scores_kind score_kinds[] = {scores_kind::random, scores_kind::equal, scores_kind::ties, scores_kind::special};
  const positions_kind position_kinds[] = {positions_kind::implicit, positions_kind::shuffled, positions_kind::repeated};
  const int stride = kvtest::quick_stride(7);
  std::mt19937 rng(11);
  int combo = 0;
  for (const std::int32_t n : sizes)
    for (const scores_kind s : score_kinds)
      for (const positions_kind pk : position_kinds)
        for (const select_end end : kEnds) {
          if (combo++ % stride != 0) continue;
          if (n == 1048576 && pk == positions_kind::repeated && s != scores_kind::equal) continue;  // time
          // One segment per count, each with its own scores: ks covers
          // {0, 1, n/5, n/2, n-1, n}.
          std::vector<std::int32_t> ks = {0, 1, n / 5, n / 2, n - 1, n};
          std::sort(ks.begin(), ks.end());
          ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
          problem p = make_problem(rng, static_cast<std::int32_t>(ks.size()), n, s, pk);
          p.ks = ks;
          p.want_mask = combo % 2 == 0 || n <= 4096;
          p.want_indices = !p.want_mask || combo % 5 != 0 || n <= 33;
          CAPTURE(n);
          CAPTURE(name(s));
          CAPTURE(name(pk));
          CAPTURE(end == select_end::top);
          CAPTURE(p.want_mask);
          CAPTURE(p.want_indices);
          check_problem(p, end);
        }
}

TEST_CASE("cuda select: uniform k, ragged lengths and per-segment counts") {
  std::mt19937 rng(5);
  const int stride = kvtest::quick_stride(1);
  int combo = 0;
  for (const std::int32_t max_length : {1, 40, 4096, 4097, 20000}) {
    for (const positions_kind pk : {positions_kind::implicit, positions_kind::shuffled}) {
      for (const select_end end : kEnds) {
        if (combo++ % stride != 0) continue;
        CAPTURE(max_length);
        CAPTURE(name(pk));
        problem p = make_problem(rng, 13, max_length, scores_kind::ties, pk);
        // Uniform k over all-full segments.
        p.k = max_length / 3;
        check_problem(p, end);
        // Ragged lengths (shuffled positions stay a permutation of the
        // longest; a shorter segment sees part of it): uniform k below the
        // shortest, then per-segment counts.
        p.lengths.resize(13);
        for (std::int32_t& l : p.lengths) l = static_cast<std::int32_t>(rng() % (max_length + 1));
        p.lengths[0] = max_length;
        p.k = *std::min_element(p.lengths.begin(), p.lengths.end());
        check_problem(p, end);
        p.ks.resize(13);
        for (std::int32_t i = 0; i < 13; ++i) p.ks[i] = static_cast<std::int32_t>(rng() % (p.lengths[i] + 1));
        check_problem(p, end);
        p.want_indices = false;  // mask only
        check_problem(p, end);
        p.want_indices = true;
        p.want_mask = false;  // indices only
        check_problem(p, end);
      }
    }
  }
}

TEST_CASE("cuda select: 8 segments of 128K keys (several blocks per segment), keep sets and victims") {
  std::mt19937 rng(8);
  for (const positions_kind pk : {positions_kind::implicit, positions_kind::shuffled}) {
    for (const scores_kind s : {scores_kind::random, scores_kind::ties}) {
      problem p = make_problem(rng, 8, 131072, s, pk);
      p.ks.resize(8);
      for (std::int32_t& k : p.ks) k = static_cast<std::int32_t>(rng() % 131073);
      p.ks[0] = 26214;  // a 20% budget
      for (const select_end end : kEnds) {
        CAPTURE(name(pk));
        CAPTURE(name(s));
        check_problem(p, end);
      }
    }
  }
}

TEST_CASE("cuda select: no segments, empty segments, zero counts") {
  std::mt19937 rng(2);
  problem none = make_problem(rng, 0, 10, scores_kind::random, positions_kind::implicit);
  none.k = 3;
  check_problem(none, select_end::top);
  problem empty = make_problem(rng, 3, 0, scores_kind::random, positions_kind::shuffled);
  check_problem(empty, select_end::bottom);
  problem zero = make_problem(rng, 3, 5000, scores_kind::random, positions_kind::shuffled);
  check_problem(zero, select_end::bottom);  // k = 0: only mask zeros
}

/// Runs a problem with some bad counts or lengths: the device reports the
/// lowest bad segment and leaves every bad row as it was; the good rows
/// equal the host's for the same problem with the bad segments emptied.
void check_bad_segments(problem p, const std::vector<std::int32_t>& bad, select_end end) {
  const result got = run_device(p, end);
  CHECK(got.status == pack_status(bad.front(), 0, bad.front(), batch_code::bad_count));
  problem good = p;
  good.fixed_index_stride = p.index_stride();
  if (good.ks.empty()) good.ks.assign(p.segments, p.k);
  if (good.lengths.empty()) good.lengths.assign(p.segments, p.max_length);
  for (const std::int32_t i : bad) {
    good.ks[i] = 0;
    good.lengths[i] = 0;
  }
  const result want = run_host(good, end);
  for (std::int32_t i = 0; i < p.segments; ++i) {
    CAPTURE(i);
    const bool is_bad = std::find(bad.begin(), bad.end(), i) != bad.end();
    for (std::int64_t r = 0; r < p.index_stride(); ++r) {
      const std::int32_t x = got.indices[i * p.index_stride() + r];
      CHECK(x == (is_bad ? kIndexSentinel : want.indices[i * p.index_stride() + r]));
    }
    for (std::int64_t j = 0; j < p.mask_stride(); ++j) {
      const std::uint8_t x = got.mask[i * p.mask_stride() + j];
      CHECK(int(x) == int(is_bad ? kMaskSentinel : want.mask[i * p.mask_stride() + j]));
    }
  }
}

TEST_CASE("cuda select: a bad per-segment count or length is reported and leaves only its segment unwritten") {
  std::mt19937 rng(9);
  for (const std::int32_t max_length : {100, 9000}) {
    for (const positions_kind pk : {positions_kind::implicit, positions_kind::shuffled}) {
      CAPTURE(max_length);
      CAPTURE(name(pk));
      problem p = make_problem(rng, 6, max_length, scores_kind::random, pk);
      p.ks = {3, max_length + 1, 7, -1, max_length, 0};  // 1: above the length, 3: negative
      check_bad_segments(p, {1, 3}, select_end::top);
      // A length above max_length, and a count above a shorter length.
      p.ks = {3, 5, 7, 9, 2, 0};
      p.lengths = {max_length, max_length / 2, max_length + 1, 8, max_length, 0};
      check_bad_segments(p, {2, 3}, select_end::bottom);
      // A uniform count above one segment's length.
      p.ks.clear();
      p.k = 10;
      p.lengths = {max_length, 9, max_length, 50, 10, 11};
      check_bad_segments(p, {1}, select_end::top);
    }
  }
}

TEST_CASE("cuda select: a workspace at any alignment") {
  std::mt19937 rng(4);
  for (const std::int32_t max_length : {700, 12000}) {
    problem p = make_problem(rng, 3, max_length, scores_kind::random, positions_kind::shuffled);
    p.ks = {max_length / 2, 1, max_length - 3};
    for (std::size_t misalign = 1; misalign < 16; ++misalign) {
      CAPTURE(max_length);
      CAPTURE(misalign);
      check_problem(p, select_end::top, misalign);
    }
    check_problem(p, select_end::top, 255);
  }
}

TEST_CASE("cuda select: a captured CUDA graph replays to the eager result") {
  std::mt19937 rng(6);
  for (const std::int32_t max_length : {1000, 30000}) {
    CAPTURE(max_length);
    problem p = make_problem(rng, 4, max_length, scores_kind::ties, positions_kind::shuffled);
    p.ks = {max_length / 5, max_length / 2, 0, max_length};
    device_problem d(p);
    const device_result eager(p), graphed(p);
    std::size_t bytes = workspace_bytes(d, select_end::top, eager);
    device_buffer<unsigned char> workspace_eager(bytes), workspace_graph(bytes);
    cudaStream_t stream;
    KVTEST_CUDA(cudaStreamCreate(&stream));
    cudaGraph_t graph;
    KVTEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const cudaError_t captured = gpu::segmented_select(workspace_graph.get(), bytes, d.keys, select_end::top, d.count,
                                                       graphed.out, graphed.status.get(), stream);
    KVTEST_CUDA(cudaStreamEndCapture(stream, &graph));
    REQUIRE(captured == cudaSuccess);
    cudaGraphExec_t exec;
    KVTEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      CAPTURE(replay);
      // New scores each time: the graph reads them where they are.
      p = make_problem(rng, 4, max_length, scores_kind::ties, positions_kind::shuffled);
      p.ks = {max_length / 5, max_length / 2, 0, max_length};
      d.scores.upload(p.scores);
      d.positions.upload(p.positions);
      KVTEST_CUDA(cudaGraphLaunch(exec, stream));
      KVTEST_CUDA(gpu::segmented_select(workspace_eager.get(), bytes, d.keys, select_end::top, d.count, eager.out,
                                        eager.status.get(), stream));
      KVTEST_CUDA(cudaStreamSynchronize(stream));
      const result e = eager.download();
      check_same(e, graphed.download());
      check_same(run_host(p, select_end::top), e);
    }
    KVTEST_CUDA(cudaGraphExecDestroy(exec));
    KVTEST_CUDA(cudaGraphDestroy(graph));
    KVTEST_CUDA(cudaStreamDestroy(stream));
  }
}

/// A key source of its own, as prefill's random policy builds: a hashed
/// draw per element, few distinct draws (ties), ragged lengths, positions
/// either the index or its reverse (then the output needs reordering).
struct draw_keys {
  std::int32_t num_segments = 0, max_length = 0;
  std::uint32_t seed = 0;
  bool reversed = false;

  KVEVICT_HOST_DEVICE std::int32_t length(std::int32_t i) const { return max_length - i % 3; }
  KVEVICT_HOST_DEVICE std::int32_t position(std::int32_t i, std::int32_t j) const {
    return reversed ? length(i) - 1 - j : j;
  }
  KVEVICT_HOST_DEVICE bool ordered_by_index() const { return !reversed; }
  KVEVICT_HOST_DEVICE std::uint64_t key(std::int32_t i, std::int32_t j, select_end end) const {
    std::uint32_t x = seed ^ (static_cast<std::uint32_t>(i) * 0x9E3779B9u) ^ (static_cast<std::uint32_t>(j) * 0x85EBCA6Bu);
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    const std::uint32_t draw = (i % 2) ? (x & 0xFFu) : x;  // odd segments: 256 distinct draws
    const std::uint64_t k = (std::uint64_t{draw} << 32) | static_cast<std::uint32_t>(position(i, j));
    return end == select_end::top ? ~k : k;
  }
};

TEST_CASE("cuda select: the generic core with a key source of its own") {
  for (const std::int32_t max_length : {300, 5000, 70000}) {
    for (const bool reversed : {false, true}) {
      for (const select_end end : kEnds) {
        CAPTURE(max_length);
        CAPTURE(reversed);
        const draw_keys keys{5, max_length, 1234u + static_cast<std::uint32_t>(max_length), reversed};
        problem shape;  // for the output strides only
        shape.segments = keys.num_segments;
        shape.max_length = max_length;
        shape.ks = {max_length / 5, 1, max_length - 2, 0, max_length / 2};
        const selection_count host_count{0, shape.ks.data()};

        result want = fresh_result(shape);
        const std::size_t host_bytes = kvevict::detail::select_workspace_bytes(keys);
        std::vector<unsigned char> host_workspace(host_bytes);
        kvevict::detail::select_segments(host_workspace.data(), host_bytes, keys, end, host_count,
                                         output_at(shape, want.indices.data(), want.mask.data()));

        const device_buffer<std::int32_t> ks(shape.ks);
        const selection_count count{0, ks.get()};
        const device_result o(shape);
        std::size_t bytes = 0;
        KVTEST_CUDA(gpu::detail::select_segments(nullptr, bytes, keys, end, count, o.out, o.status.get(), nullptr));
        device_buffer<unsigned char> workspace(bytes);
        KVTEST_CUDA(gpu::detail::select_segments(workspace.get(), bytes, keys, end, count, o.out, o.status.get(),
                                                 nullptr));
        check_same(want, o.download());
      }
    }
  }
}

TEST_CASE("cuda select: argument errors throw before any launch") {
  std::mt19937 rng(1);
  // Shuffled positions: the indices are reordered by position, so the call
  // needs a workspace and one smaller by 256 bytes is too small at any
  // alignment (implicit positions need none: the size query is the slack).
  problem p = make_problem(rng, 2, 50, scores_kind::random, positions_kind::shuffled);
  p.k = 5;
  const device_problem d(p);
  const device_result o(p);
  std::size_t bytes = workspace_bytes(d, select_end::top, o);
  REQUIRE(bytes > 256);
  device_buffer<unsigned char> workspace(bytes);
  const auto call = [&](const segment_set& keys, const selection_count& count, const selection_output& out,
                        std::size_t size) {
    std::size_t b = size;
    return gpu::segmented_select(workspace.get(), b, keys, select_end::top, count, out, o.status.get(), nullptr);
  };
  segment_set keys = d.keys;
  selection_output out = o.out;
  CHECK_THROWS_AS(call(keys, d.count, out, bytes - 256), invalid_argument);  // too small at any alignment
  keys.scores = nullptr;
  CHECK_THROWS_AS(call(keys, d.count, out, bytes), invalid_argument);
  keys = d.keys;
  keys.stride = 49;
  CHECK_THROWS_AS(call(keys, d.count, out, bytes), invalid_argument);
  keys = d.keys;
  keys.num_segments = -1;
  CHECK_THROWS_AS(call(keys, d.count, out, bytes), invalid_argument);
  keys = d.keys;
  CHECK_THROWS_AS(call(keys, selection_count{51, nullptr}, out, bytes), out_of_range);
  CHECK_THROWS_AS(call(keys, selection_count{-1, nullptr}, out, bytes), out_of_range);
  out.index_stride = 4;
  CHECK_THROWS_AS(call(keys, d.count, out, bytes), invalid_argument);
  out = o.out;
  out.mask_stride = 49;
  CHECK_THROWS_AS(call(keys, d.count, out, bytes), invalid_argument);
  out = selection_output{};
  CHECK_THROWS_AS(call(keys, d.count, out, bytes), invalid_argument);
  out = o.out;
  keys.stride = std::int64_t{1} << 62;  // segment 1's offset would wrap to segment 0's keys
  CHECK_THROWS_WITH_AS(call(keys, d.count, out, bytes), doctest::Contains("'keys.stride'"), invalid_argument);
  keys = d.keys;
  std::size_t b5 = bytes;
  CHECK_THROWS_WITH_AS(gpu::segmented_select(workspace.get(), b5, keys, static_cast<select_end>(5), d.count, out,
                                             o.status.get(), nullptr),
                       doctest::Contains("'end'"), invalid_argument);  // read as "bottom" before
  out = selection_output{};
  // The size query checks the same arguments.
  std::size_t query = 0;
  CHECK_THROWS_AS(gpu::segmented_select(nullptr, query, keys, select_end::top, d.count, out, nullptr, nullptr),
                  invalid_argument);
  // Nothing was launched: the outputs still hold their sentinels.
  const result r = o.download();
  CHECK(std::all_of(r.indices.begin(), r.indices.end(), [](std::int32_t x) { return x == kIndexSentinel; }));
  CHECK(std::all_of(r.mask.begin(), r.mask.end(), [](std::uint8_t x) { return x == kMaskSentinel; }));
  CHECK(r.status == batch_status_clear);
}

}  // namespace
