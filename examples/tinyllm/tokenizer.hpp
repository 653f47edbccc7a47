#pragma once
// Byte-level BPE tokenizer (GPT-2 style) for GGUF vocabularies with
// tokenizer.ggml.model == "gpt2". Ground truth is llama.cpp (llama-vocab.cpp,
// unicode.cpp); token ids match llama_tokenize(add_special=false,
// parse_special=false) for SmolLM2 (verified on a 274 kB book and a Unicode
// stress set). Pipeline:
//
//   1. UTF-8 -> code points, leniently as llama.cpp: an invalid byte becomes
//      U+FFFD, overlong forms are accepted and re-encoded shortest.
//   2. Pre-tokenize: the GPT-2 regex
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (contractions are lower-case only; a whitespace run followed by a
//      non-space leaves its last code point to the next piece). `smollm` first
//      isolates every \p{N} code point and runs the regex on each piece, so
//      digits never group and " 1" is two pieces.
//   3. Each piece's bytes -> one symbol per byte; merge the adjacent pair of
//      lowest merge rank (leftmost on ties) until none applies.
//   4. Symbols -> token ids; a merged symbol that is no token falls back to
//      the tokens of its bytes. A byte whose symbol is no token is dropped, as
//      in llama.cpp (SmolLM2 lacks 21 of them, e.g. 0x04 and the lead bytes
//      0xF1/0xF2, so such text does not round-trip there).
//
// Deliberate differences from llama.cpp, none of which arises with SmolLM2's
// vocabulary (every merge result is a token, no duplicates) or valid UTF-8:
//   - Byte fallback (4) emits each byte's byte-level token. llama.cpp looks up
//     the single raw bytes of the byte-level *encoded* text, so it only finds
//     printable ASCII and drops every other byte.
//   - A 4-byte sequence above U+10FFFF is invalid here (U+FFFD per byte);
//     llama.cpp throws from deep inside tokenization (the process aborts).
//   - The constructor rejects duplicate tokens and merges that are malformed
//     or name non-tokens (llama.cpp: last duplicate wins, such merges are
//     silently unusable). Empty tokens become "[EMPTY_<id>]" as in llama.cpp.
//   - Special/control tokens are never parsed from text (parse_special=false)
//     and decode() renders them as their text.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tinyllm/error.hpp"
#include "tinyllm/unicode_classes.hpp"

namespace tinyllm {

enum class pretokenizer {
  gpt2,   // the GPT-2 regex alone
  smollm  // isolate every \p{N} code point, then the GPT-2 regex on each piece
};

/// Pre-tokenizer for a GGUF tokenizer.ggml.pre value: the names llama.cpp
/// maps to exactly these two regex lists. "default" (and a missing key) is a
/// different four-regex cascade in llama.cpp and is not supported.
inline pretokenizer pretokenizer_from_name(const std::string& gguf_pre) {
  static const char* const smollm_names[] = {"smollm", "codeshell", "exaone", "minerva-7b", "mellum2"};
  static const char* const gpt2_names[] = {
      "gpt2",   "gpt-2",       "phi-2",   "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",     "a.x-4.0",
      "mellum", "modern-bert", "exaone4", "mpt",     "olmo",    "jais",     "trillion",   "granite-docling"};
  for (const char* n : smollm_names)
    if (gguf_pre == n) return pretokenizer::smollm;
  for (const char* n : gpt2_names)
    if (gguf_pre == n) return pretokenizer::gpt2;
  throw format_error("tokenizer: unsupported pre-tokenizer '" + gguf_pre + "' (tokenizer.ggml.pre)");
}

namespace tokenizer_detail {

// Decodes one code point at text[off], advancing off. Mirrors llama.cpp's
// unicode_cpt_from_utf8 + its U+FFFD substitution (lead byte checked by its
// high bits, continuation bytes checked, overlongs and surrogates accepted),
// except that results above U+10FFFF are rejected too.
inline std::uint32_t next_code_point(std::string_view text, std::size_t& off) noexcept {
  constexpr std::uint32_t replacement = 0xFFFD;
  const auto byte = [&](std::size_t i) { return static_cast<std::uint32_t>(static_cast<unsigned char>(text[i])); };
  const std::uint32_t b0 = byte(off);
  std::size_t len = 0;
  std::uint32_t cp = 0;
  if (b0 < 0x80) {
    ++off;
    return b0;
  } else if ((b0 & 0x40) == 0) {
    len = 0;  // stray continuation byte
  } else if ((b0 & 0x20) == 0) {
    len = 2;
    cp = b0 & 0x1F;
  } else if ((b0 & 0x10) == 0) {
    len = 3;
    cp = b0 & 0x0F;
  } else if ((b0 & 0x08) == 0) {
    len = 4;
    cp = b0 & 0x07;
  }  // else 0xF8..0xFF: len stays 0
  if (len == 0 || off + len > text.size()) {
    ++off;
    return replacement;
  }
  for (std::size_t i = 1; i < len; ++i) {
    const std::uint32_t b = byte(off + i);
    if ((b & 0xC0) != 0x80) {
      ++off;
      return replacement;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp > 0x10FFFF) {
    ++off;
    return replacement;
  }
  off += len;
  return cp;
}

inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
// other 68 bytes map to U+0100.. in byte order, so every token is printable.
struct byte_level_map {
  std::array<std::uint32_t, 256> cp_of_byte{};
  std::array<std::int16_t, 0x144> byte_of_cp{};  // -1: not a byte symbol

  byte_level_map() noexcept {
    byte_of_cp.fill(-1);
    std::uint32_t next = 0x100;
    for (std::uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      cp_of_byte[b] = printable ? b : next++;
      byte_of_cp[cp_of_byte[b]] = static_cast<std::int16_t>(b);
    }
  }
};

inline const byte_level_map& byte_level() {
  static const byte_level_map map;
  return map;
}

// Text after step 1: normalized UTF-8 plus, per code point, its class and
// byte offset (offsets has one extra entry, the total size).
struct decoded_text {
  std::string utf8;
  std::vector<std::uint32_t> cps;
  std::vector<unicode::cp_class> classes;
  std::vector<std::size_t> offsets;
};

inline void decode_text(std::string_view text, decoded_text& d) {
  d.utf8.clear(), d.cps.clear(), d.classes.clear(), d.offsets.clear();
  d.utf8.reserve(text.size());
  for (std::size_t off = 0; off < text.size();) {
    const std::uint32_t cp = next_code_point(text, off);
    d.offsets.push_back(d.utf8.size());
    d.cps.push_back(cp);
    d.classes.push_back(unicode::classify(cp));
    append_utf8(d.utf8, cp);
  }
  d.offsets.push_back(d.utf8.size());
}

// The GPT-2 regex on code points [begin, end), calling emit(first, last) for
// each piece. Positions outside the range have no class, as in llama.cpp's
// hand-written matcher, so a piece never extends past `end`.
template <class Emit>
void split_gpt2(const decoded_text& d, std::size_t begin, std::size_t end, Emit&& emit) {
  using unicode::cp_class;
  enum class k { none, letter, number, whitespace, other };
  const auto kind = [&](std::size_t i) {
    if (i >= end) return k::none;
    switch (d.classes[i]) {
      case cp_class::letter: return k::letter;
      case cp_class::number: return k::number;
      case cp_class::whitespace: return k::whitespace;
      default: return k::other;
    }
  };
  const auto cp_at = [&](std::size_t i) { return i < end ? d.cps[i] : 0xFFFFFFFFu; };

  std::size_t pos = begin;
  while (pos < end) {
    const std::uint32_t cp = d.cps[pos];
    const std::size_t start = pos;
    if (cp == '\'') {  // 's 't 're 've 'm 'll 'd, lower case only
      const std::uint32_t c1 = cp_at(pos + 1), c2 = cp_at(pos + 2);
      std::size_t n = 0;
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
        n = 2;
      else if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
        n = 3;
      if (n != 0) {
        emit(start, pos + n);
        pos += n;
        continue;
      }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional leading space
    // joins the run that follows it.
    const k run = cp == ' ' ? kind(pos + 1) : kind(pos);
    if (run == k::letter || run == k::number || run == k::other) {
      pos += (cp == ' ') ? 1 : 0;
      while (kind(pos) == run) ++pos;
      emit(start, pos);
      continue;
    }
    std::size_t n_ws = 0;
    while (kind(pos + n_ws) == k::whitespace) ++n_ws;
    if (n_ws > 1 && pos + n_ws < end) {
      pos += n_ws - 1;  // `\s+(?!\S)`: the last space goes with the next piece
    } else if (n_ws > 0) {
      pos += n_ws;  // `\s+` at the end of the range (or a single space)
    } else {
      ++pos;  // unreachable: every code point has a class
    }
    emit(start, pos);
  }
}

template <class Emit>
void split_pieces(const decoded_text& d, pretokenizer pre, Emit&& emit) {
  const std::size_t n = d.cps.size();
  if (pre == pretokenizer::gpt2) {
    split_gpt2(d, 0, n, emit);
    return;
  }
  // smollm: every \p{N} code point alone, the runs between them as pieces.
  std::size_t run_start = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (d.classes[i] != unicode::cp_class::number) continue;
    if (run_start < i) split_gpt2(d, run_start, i, emit);
    emit(i, i + 1);
    run_start = i + 1;
  }
  if (run_start < n) split_gpt2(d, run_start, n, emit);
}

}  // namespace tokenizer_detail

/// Pre-tokenizer pieces of `utf8` (normalized UTF-8, not byte-level encoded);
/// for tests and debugging.
inline std::vector<std::string> pre_tokenize(std::string_view utf8, pretokenizer pre) {
  tokenizer_detail::decoded_text d;
  tokenizer_detail::decode_text(utf8, d);
  std::vector<std::string> pieces;
  tokenizer_detail::split_pieces(d, pre, [&](std::size_t first, std::size_t last) {
    pieces.emplace_back(d.utf8, d.offsets[first], d.offsets[last] - d.offsets[first]);
  });
  return pieces;
}

class bpe_tokenizer {
 public:
  /// tokens/merges as in GGUF tokenizer.ggml.tokens / tokenizer.ggml.merges:
  /// byte-level encoded strings, merges as "left right" in rank order.
  bpe_tokenizer(std::vector<std::string> tokens, const std::vector<std::string>& merges, pretokenizer pre)
      : tokens_(std::move(tokens)), pre_(pre) {
    if (tokens_.empty()) throw format_error("tokenizer: empty vocabulary");
    if (tokens_.size() > std::size_t(std::numeric_limits<std::int32_t>::max()) ||
        merges.size() > std::size_t(std::numeric_limits<std::int32_t>::max()))
      throw format_error("tokenizer: vocabulary or merge list too large");
    ids_.reserve(tokens_.size());
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      if (tokens_[i].empty()) tokens_[i] = "[EMPTY_" + std::to_string(i) + "]";  // as llama.cpp
      const auto [it, inserted] = ids_.emplace(tokens_[i], static_cast<std::int32_t>(i));
      if (!inserted)
        throw format_error("tokenizer: duplicate token '" + tokens_[i] + "' (ids " + std::to_string(it->second) +
                           " and " + std::to_string(i) + ")");
    }

    const auto& bl = tokenizer_detail::byte_level();
    for (std::size_t b = 0; b < 256; ++b) {
      std::string s;
      tokenizer_detail::append_utf8(s, bl.cp_of_byte[b]);
      byte_token_[b] = find(s);
    }

    merges_.reserve(merges.size());
    for (std::size_t r = 0; r < merges.size(); ++r) {
      const std::string& m = merges[r];
      const std::size_t sep = m.find(' ', 1);  // from 1: as llama.cpp
      if (sep == std::string::npos || sep + 1 == m.size())
        throw format_error("tokenizer: merge " + std::to_string(r) + " '" + m + "' is not \"left right\"");
      const std::string left = m.substr(0, sep), right = m.substr(sep + 1);
      const std::int32_t l = find(left), rt = find(right);
      if (l < 0 || rt < 0)
        throw format_error("tokenizer: merge " + std::to_string(r) + " '" + m + "' names '" + (l < 0 ? left : right) +
                           "', which is not a token");
      // A repeated pair keeps its first (lowest) rank, as llama.cpp.
      merges_.emplace(pair_key(l, rt), merge_info{static_cast<std::int32_t>(r), find(left + right)});
    }
  }

  /// Token ids of `utf8`: no BOS/EOS, special tokens are plain text.
  std::vector<std::int32_t> encode(std::string_view utf8) const {
    std::vector<std::int32_t> out;
    tokenizer_detail::decoded_text d;
    tokenizer_detail::decode_text(utf8, d);
    out.reserve(d.utf8.size() / 3 + 1);
    work w;
    tokenizer_detail::split_pieces(d, pre_, [&](std::size_t first, std::size_t last) {
      encode_piece(std::string_view(d.utf8).substr(d.offsets[first], d.offsets[last] - d.offsets[first]), w, out);
    });
    return out;
  }

  /// The bytes the tokens stand for. Characters outside the byte-level
  /// alphabet (e.g. in added tokens) are copied as UTF-8.
  std::string decode(const std::vector<std::int32_t>& ids) const {
    const auto& bl = tokenizer_detail::byte_level();
    std::string out;
    for (std::int32_t id : ids) {
      const std::string_view t = token_text(id);
      for (std::size_t off = 0; off < t.size();) {
        const std::uint32_t cp = tokenizer_detail::next_code_point(t, off);
        const int b = cp < bl.byte_of_cp.size() ? bl.byte_of_cp[cp] : -1;
        if (b >= 0)
          out.push_back(static_cast<char>(b));
        else
          tokenizer_detail::append_utf8(out, cp);
      }
    }
    return out;
  }

  std::string_view token_text(std::int32_t id) const {
    if (id < 0 || id >= vocab_size())
      throw std::out_of_range("tokenizer: token id " + std::to_string(id) + " out of range");
    return tokens_[static_cast<std::size_t>(id)];
  }

  std::int32_t vocab_size() const noexcept { return static_cast<std::int32_t>(tokens_.size()); }

  /// Id of the token with exactly this (byte-level encoded) text, -1 if none.
  std::int32_t find(std::string_view token_text) const {
    const auto it = ids_.find(std::string(token_text));
    return it == ids_.end() ? -1 : it->second;
  }

  pretokenizer pre() const noexcept { return pre_; }

 private:
  struct merge_info {
    std::int32_t rank;
    std::int32_t result;  // token id of left+right, -1 if not a token
  };

  struct symbol {
    std::int32_t id;           // -1: not a token (cannot merge further, falls back to bytes)
    std::uint32_t begin, end;  // bytes of the piece
    std::int32_t prev, next;   // alive neighbours, -1 at the ends
  };

  struct candidate {
    std::int32_t rank;
    std::int32_t left, right;
    std::int32_t result;      // id of the merged symbol
    std::uint32_t right_end;  // right's extent when queued: detects a stale pair
    // heap order: lowest rank first, then leftmost
    bool operator<(const candidate& o) const noexcept { return rank != o.rank ? rank > o.rank : left > o.left; }
  };

  struct work {  // buffers reused across pieces
    std::vector<symbol> syms;
    std::vector<candidate> heap;
  };

  static std::uint64_t pair_key(std::int32_t l, std::int32_t r) noexcept {
    return (std::uint64_t(std::uint32_t(l)) << 32) | std::uint32_t(r);
  }

  void push_candidate(work& w, std::int32_t l, std::int32_t r) const {
    if (l < 0 || r < 0) return;
    const symbol& a = w.syms[std::size_t(l)];
    const symbol& b = w.syms[std::size_t(r)];
    if (a.id < 0 || b.id < 0) return;  // merges only name tokens
    const auto it = merges_.find(pair_key(a.id, b.id));
    if (it == merges_.end()) return;
    w.heap.push_back(candidate{it->second.rank, l, r, it->second.result, b.end});
    std::push_heap(w.heap.begin(), w.heap.end());
  }

  void emit_symbol(std::string_view piece, const symbol& s, std::vector<std::int32_t>& out) const {
    if (s.id >= 0) {
      out.push_back(s.id);
      return;
    }
    for (std::uint32_t i = s.begin; i < s.end; ++i) {
      const std::int32_t t = byte_token_[static_cast<unsigned char>(piece[i])];
      if (t >= 0) out.push_back(t);  // a byte with no token is dropped, as llama.cpp
    }
  }

  void encode_piece(std::string_view piece, work& w, std::vector<std::int32_t>& out) const {
    const auto n = static_cast<std::int32_t>(piece.size());
    w.syms.clear();
    w.heap.clear();
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int32_t id = byte_token_[static_cast<unsigned char>(piece[std::size_t(i)])];
      w.syms.push_back(symbol{id, std::uint32_t(i), std::uint32_t(i + 1), i - 1, i + 1 < n ? i + 1 : -1});
    }
    for (std::int32_t i = 0; i + 1 < n; ++i) push_candidate(w, i, i + 1);

    while (!w.heap.empty()) {
      std::pop_heap(w.heap.begin(), w.heap.end());
      const candidate c = w.heap.back();
      w.heap.pop_back();
      symbol& a = w.syms[std::size_t(c.left)];
      symbol& b = w.syms[std::size_t(c.right)];
      // Symbols only grow; a merged-away one has begin == end. The pair is
      // current iff both live, still adjacent, and right has not grown.
      if (a.begin == a.end || b.begin == b.end || a.next != c.right || b.end != c.right_end) continue;
      a.id = c.result;
      a.end = b.end;
      a.next = b.next;
      if (b.next >= 0) w.syms[std::size_t(b.next)].prev = c.left;
      b.begin = b.end;
      push_candidate(w, a.prev, c.left);
      push_candidate(w, c.left, a.next);
    }
    // symbol 0 is never merged away (merges keep the left one)
    for (std::int32_t i = n > 0 ? 0 : -1; i >= 0; i = w.syms[std::size_t(i)].next)
      emit_symbol(piece, w.syms[std::size_t(i)], out);
  }

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, std::int32_t> ids_;
  std::unordered_map<std::uint64_t, merge_info> merges_;
  std::array<std::int32_t, 256> byte_token_{};
  pretokenizer pre_;
};

}  // namespace tinyllm
