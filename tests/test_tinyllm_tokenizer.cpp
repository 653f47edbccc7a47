// tinyllm's byte-level BPE tokenizer on hand-built vocabularies (no model
// file): merge order, pre-token boundaries (GPT-2 regex, SmolLM digit split),
// byte fallback, non-ASCII text, round trips, invalid UTF-8, errors, and the
// generated Unicode class table. Expected ids are derived by hand; agreement
// with llama.cpp on the real SmolLM2 vocabulary was checked separately.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tinyllm/tokenizer.hpp"

namespace {

using tinyllm::bpe_tokenizer;
using tinyllm::pretokenizer;

std::string utf8(std::uint32_t cp) {
  std::string s;
  tinyllm::tokenizer_detail::append_utf8(s, cp);
  return s;
}

// GPT-2 byte-level symbol of a byte, written independently of the header:
// printable Latin-1 stands for itself, the rest map to U+0100.. in order.
std::string sym(unsigned char byte) {
  std::uint32_t next = 0x100;
  for (std::uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const std::uint32_t cp = printable ? b : next++;
    if (b == byte) return utf8(cp);
  }
  return {};
}

std::string sym(const std::string& bytes) {
  std::string s;
  for (char c : bytes) s += sym(static_cast<unsigned char>(c));
  return s;
}

// Vocabulary: ids 0..255 are the byte symbols in byte order (so a byte's id
// is its value), then `extra` tokens from 256 on.
std::vector<std::string> byte_vocab(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> v;
  for (int b = 0; b < 256; ++b) v.push_back(sym(static_cast<unsigned char>(b)));
  v.insert(v.end(), extra.begin(), extra.end());
  return v;
}

std::string join(const std::vector<std::int32_t>& ids) {
  std::string s;
  for (std::int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}

std::string enc(const bpe_tokenizer& tok, const std::string& text) { return join(tok.encode(text)); }

std::string pieces(const std::string& text, pretokenizer pre) {
  std::string s;
  for (const std::string& p : tinyllm::pre_tokenize(text, pre)) s += "[" + p + "]";
  return s;
}

}  // namespace

TEST_CASE("byte-level alphabet") {
  CHECK(sym(' ') == "\xC4\xA0");   // Ġ U+0120
  CHECK(sym('\n') == "\xC4\x8A");  // Ċ U+010A
  CHECK(sym('a') == "a");
  CHECK(sym(0xE9) == "\xC3\xA9");  // é stands for itself
  const bpe_tokenizer tok(byte_vocab(), {}, pretokenizer::gpt2);
  CHECK(tok.vocab_size() == 256);
  CHECK(tok.find("\xC4\xA0") == 32);
  CHECK(tok.find("zz") == -1);
  CHECK(tok.token_text(10) == "\xC4\x8A");
  CHECK(enc(tok, " a\n") == "32 97 10");
  CHECK(tok.decode({32, 97, 10}) == " a\n");
  CHECK(enc(tok, "").empty());
  CHECK(tok.decode({}).empty());
}

TEST_CASE("merges apply by rank, leftmost first on equal rank") {
  SUBCASE("a lower rank wins even later in the word") {
    const bpe_tokenizer bc_first(byte_vocab({"ab", "bc"}), {"b c", "a b"}, pretokenizer::gpt2);
    CHECK(enc(bc_first, "abc") == "97 257");
    const bpe_tokenizer ab_first(byte_vocab({"ab", "bc"}), {"a b", "b c"}, pretokenizer::gpt2);
    CHECK(enc(ab_first, "abc") == "256 99");
  }
  SUBCASE("equal rank: leftmost pair") {
    const bpe_tokenizer tok(byte_vocab({"aa"}), {"a a"}, pretokenizer::gpt2);
    CHECK(enc(tok, "aaa") == "256 97");
    CHECK(enc(tok, "aaaa") == "256 256");
    CHECK(enc(tok, "aaaaa") == "256 256 97");
  }
  SUBCASE("a pair formed by a merge competes with older pairs by rank") {
    // abcd: "a b" (0) -> [ab c d]; then "c d" (1) beats "ab c" (2) -> [ab cd]
    const bpe_tokenizer tok(byte_vocab({"ab", "cd", "abc"}), {"a b", "c d", "ab c"}, pretokenizer::gpt2);
    CHECK(enc(tok, "abcd") == "256 257");
    CHECK(enc(tok, "abc") == "258");
  }
  SUBCASE("the first of two identical merges sets the rank") {
    const bpe_tokenizer tok(byte_vocab({"ab", "bc"}), {"a b", "b c", "a b"}, pretokenizer::gpt2);
    CHECK(enc(tok, "abc") == "256 99");
  }
}

TEST_CASE("pre-tokenizer: words, digits, contractions, whitespace, punctuation") {
  const auto gpt2 = pretokenizer::gpt2;
  const auto smol = pretokenizer::smollm;
  CHECK(pieces("Hello world", gpt2) == "[Hello][ world]");
  CHECK(pieces("Hello world", smol) == "[Hello][ world]");

  // digits: grouped with an optional space (gpt2) vs one piece each (smollm)
  CHECK(pieces("abc 12345 x2y", gpt2) == "[abc][ 12345][ x][2][y]");
  CHECK(pieces("abc 12345 x2y", smol) == "[abc][ ][1][2][3][4][5][ x][2][y]");
  CHECK(pieces("3.14", gpt2) == "[3][.][14]");
  CHECK(pieces("3.14", smol) == "[3][.][1][4]");
  CHECK(pieces("\xD9\xA3\xD9\xA4", gpt2) == "[\xD9\xA3\xD9\xA4]");  // ٣٤ Arabic-indic digits
  CHECK(pieces("\xD9\xA3\xD9\xA4", smol) == "[\xD9\xA3][\xD9\xA4]");
  CHECK(pieces("x\xE2\x85\xAB\xC2\xB2", smol) == "[x][\xE2\x85\xAB][\xC2\xB2]");  // xⅫ²

  // contractions: lower case only
  CHECK(pieces("it's", gpt2) == "[it]['s]");
  CHECK(pieces("IT'S", gpt2) == "[IT]['][S]");
  CHECK(pieces("we'll", gpt2) == "[we]['ll]");
  CHECK(pieces("I'd've", gpt2) == "[I]['d]['ve]");
  CHECK(pieces("'''", gpt2) == "[''']");
  CHECK(pieces("x 's", gpt2) == "[x][ '][s]");

  // whitespace: \s+(?!\S) leaves the last space of a run to the next piece
  CHECK(pieces("a  b", gpt2) == "[a][ ][ b]");
  CHECK(pieces("a \n\n b", gpt2) == "[a][ \n\n][ b]");
  CHECK(pieces("  \t\nx", gpt2) == "[  \t][\n][x]");
  CHECK(pieces("trailing   ", gpt2) == "[trailing][   ]");
  CHECK(pieces("a\tb", gpt2) == "[a][\t][b]");
  CHECK(pieces("\n\n\n", gpt2) == "[\n\n\n]");
  CHECK(pieces("x 1", smol) == "[x][ ][1]");  // the space is cut off from the digit

  // punctuation runs take one leading space
  CHECK(pieces("Hi!!! (ok)...", gpt2) == "[Hi][!!!][ (][ok][)...]");
  CHECK(pieces("a...b", gpt2) == "[a][...][b]");
}

TEST_CASE("pre-tokenizer: non-ASCII letters, marks, Unicode spaces, emoji") {
  const auto gpt2 = pretokenizer::gpt2;
  // café Ωμέγα Жук 中文
  const std::string cafe = "caf\xC3\xA9", omega = "\xCE\xA9\xCE\xBC\xCE\xAD\xCE\xB3\xCE\xB1",
                    zhuk = "\xD0\x96\xD1\x83\xD0\xBA", zhongwen = "\xE4\xB8\xAD\xE6\x96\x87";
  CHECK(pieces(cafe + " " + omega + " " + zhuk + " " + zhongwen, gpt2) ==
        "[" + cafe + "][ " + omega + "][ " + zhuk + "][ " + zhongwen + "]");
  CHECK(pieces("e\xCC\x81", gpt2) == "[e][\xCC\x81]");         // combining acute is not \p{L}
  CHECK(pieces("x\xC2\xA0y", gpt2) == "[x][\xC2\xA0][y]");     // NBSP is whitespace
  CHECK(pieces("a \xC2\xA0 b", gpt2) == "[a][ \xC2\xA0][ b]");
  CHECK(pieces("x\xE3\x80\x80y", gpt2) == "[x][\xE3\x80\x80][y]");  // ideographic space
  CHECK(pieces("x\xE2\x80\x8By", gpt2) == "[x][\xE2\x80\x8B][y]");  // ZWSP is not whitespace
  CHECK(pieces("hi \xF0\x9F\x98\x80!", gpt2) == "[hi][ \xF0\x9F\x98\x80!]");
}

TEST_CASE("encode respects piece boundaries") {
  const std::string G = sym(' ');
  SUBCASE("no merge across pieces; digits depend on the pre-tokenizer") {
    const std::vector<std::string> merges = {"a 1", "1 2"};
    const bpe_tokenizer gpt2(byte_vocab({"a1", "12"}), merges, pretokenizer::gpt2);
    const bpe_tokenizer smol(byte_vocab({"a1", "12"}), merges, pretokenizer::smollm);
    CHECK(enc(gpt2, "a1") == "97 49");
    CHECK(enc(gpt2, "12") == "257");
    CHECK(enc(smol, "12") == "49 50");
  }
  SUBCASE("leading space joins the word; whitespace runs") {
    // 256 Ġb, 257 ĠĠ, 258 ab, 259 Ġa, 260 Ġab
    const bpe_tokenizer tok(byte_vocab({G + "b", G + G, "ab", G + "a", G + "ab"}),
                            {"a b", G + " b", G + " " + G, G + " a", G + "a b"}, pretokenizer::gpt2);
    CHECK(enc(tok, "a b") == "97 256");
    CHECK(enc(tok, "a  b") == "97 32 256");
    CHECK(enc(tok, "a   b") == "97 257 256");
    CHECK(enc(tok, "a  ") == "97 257");
    // " ab": "a b" (rank 0) beats "Ġ a" (rank 3), and "Ġ ab" is no merge
    CHECK(enc(tok, " ab") == "32 258");
    CHECK(enc(tok, "ab ab") == "258 32 258");
  }
  SUBCASE("contractions and punctuation") {
    const bpe_tokenizer tok(byte_vocab({"'s", "it"}), {"' s", "i t"}, pretokenizer::gpt2);
    CHECK(enc(tok, "it's") == "257 256");
    CHECK(enc(tok, "IT'S") == "73 84 39 83");
    CHECK(enc(tok, "it!'s") == "257 33 39 115");  // "!'" is one punctuation piece
  }
}

TEST_CASE("byte fallback for symbols that are not tokens") {
  SUBCASE("a merge result missing from the vocabulary falls back to its bytes") {
    const bpe_tokenizer tok(byte_vocab(), {"a b"}, pretokenizer::gpt2);
    CHECK(enc(tok, "ab") == "97 98");
    CHECK(enc(tok, "xaby") == "120 97 98 121");
  }
  SUBCASE("...and cannot merge further") {
    // "a b" (0) makes the non-token "ab", so "b c" (1) never applies
    const bpe_tokenizer tok(byte_vocab({"bc"}), {"a b", "b c"}, pretokenizer::gpt2);
    CHECK(enc(tok, "abc") == "97 98 99");
    CHECK(enc(tok, "bc") == "256");
  }
  SUBCASE("non-ASCII bytes fall back to their byte tokens") {
    // (llama.cpp would drop the Ġ here; see tokenizer.hpp)
    const bpe_tokenizer tok(byte_vocab(), {sym(' ') + " a"}, pretokenizer::gpt2);
    CHECK(enc(tok, " a") == "32 97");
  }
  SUBCASE("a byte with no token is dropped, as llama.cpp") {
    std::vector<std::string> v = byte_vocab();
    v.erase(v.begin() + 4);  // no token for byte 0x04; ids above 4 shift by one
    const bpe_tokenizer tok(std::move(v), {}, pretokenizer::gpt2);
    CHECK(enc(tok, std::string("x\x04y", 3)) == "119 120");
  }
}

TEST_CASE("non-ASCII letters") {
  // é = C3 A9 -> symbols "Ã" "©"; Ω = CE A9 has no merge
  const std::string e_acute = sym(std::string("\xC3\xA9"));
  const bpe_tokenizer tok(byte_vocab({e_acute, "caf" + e_acute, "ca", "caf"}),
                          {sym(std::string("\xC3")) + " " + sym(std::string("\xA9")), "c a", "ca f", "caf " + e_acute},
                          pretokenizer::gpt2);
  CHECK(e_acute == "\xC3\x83\xC2\xA9");
  CHECK(enc(tok, "\xC3\xA9") == "256");
  CHECK(enc(tok, "caf\xC3\xA9") == "257");
  CHECK(enc(tok, "\xCE\xA9") == "206 169");
  CHECK(enc(tok, " caf\xC3\xA9") == "32 257");
  CHECK(tok.decode({257, 32, 206, 169}) == "caf\xC3\xA9 \xCE\xA9");
}

TEST_CASE("round trip on random valid UTF-8") {
  std::vector<std::string> merges = {sym(' ') + " t", "t h", "h e", "e r", "1 2"};
  const std::vector<std::string> extra = {sym(' ') + "t", "th", "he", "er", "12"};
  std::mt19937 rng(1234);
  const auto draw = [&](std::uint32_t n) { return static_cast<std::uint32_t>(rng() % n); };
  const std::uint32_t pool[] = {' ', ' ', '\n', '\t', '\'', 's', 't', 'h',
                                'e', '1', '2',  '.',  0xA0, 0x3000, 0x2009, 0x301};
  for (pretokenizer pre : {pretokenizer::gpt2, pretokenizer::smollm}) {
    const bpe_tokenizer tok(byte_vocab(extra), merges, pre);
    for (int n = 0; n < 300; ++n) {
      std::string text;
      const std::uint32_t len = draw(24);
      for (std::uint32_t i = 0; i < len; ++i) {
        std::uint32_t cp = 0;
        switch (draw(4)) {
          case 0: cp = pool[draw(sizeof pool / sizeof pool[0])]; break;
          case 1: cp = 0x20 + draw(0x5F); break;    // ASCII
          case 2: cp = 0x80 + draw(0x2F80); break;  // 2- and 3-byte scripts
          default: cp = draw(0x110000); break;      // anything
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';  // surrogates are not valid UTF-8
        text += utf8(cp);
      }
      CAPTURE(text);
      CHECK(tok.decode(tok.encode(text)) == text);
      std::string joined;
      for (const std::string& p : tinyllm::pre_tokenize(text, pre)) joined += p;
      CHECK(joined == text);  // pieces partition the text
    }
  }
}

TEST_CASE("invalid UTF-8 becomes U+FFFD, as llama.cpp") {
  const bpe_tokenizer tok(byte_vocab(), {}, pretokenizer::gpt2);
  CHECK(enc(tok, "\xFF") == "239 191 189");  // EF BF BD
  CHECK(enc(tok, "x\x80y") == "120 239 191 189 121");
  CHECK(enc(tok, "\xE4\xB8") == "239 191 189 239 191 189");  // truncated: one per byte
  CHECK(enc(tok, std::string("\xC0\x80", 2)) == "0");        // overlong NUL is accepted
  CHECK(enc(tok, "\xF4\x90\x80\x80") == "239 191 189 239 191 189 239 191 189 239 191 189");  // > U+10FFFF
  CHECK(tok.decode(tok.encode("a\x80")) == "a\xEF\xBF\xBD");
}

TEST_CASE("construction errors") {
  CHECK_THROWS_AS(bpe_tokenizer({}, {}, pretokenizer::gpt2), tinyllm::format_error);
  CHECK_THROWS_WITH_AS(bpe_tokenizer(byte_vocab({"ab", "ab"}), {}, pretokenizer::gpt2),
                       doctest::Contains("duplicate token 'ab'"), tinyllm::format_error);
  CHECK_THROWS_WITH_AS(bpe_tokenizer(byte_vocab(), {"a zz"}, pretokenizer::gpt2), doctest::Contains("'zz'"),
                       tinyllm::format_error);
  CHECK_THROWS_WITH_AS(bpe_tokenizer(byte_vocab(), {"ab"}, pretokenizer::gpt2), doctest::Contains("merge 0"),
                       tinyllm::format_error);
  CHECK_THROWS_AS(bpe_tokenizer(byte_vocab(), {"a "}, pretokenizer::gpt2), tinyllm::format_error);
  // an empty token is renamed as llama.cpp does, keeping the ids
  const bpe_tokenizer tok(byte_vocab({""}), {}, pretokenizer::gpt2);
  CHECK(tok.token_text(256) == "[EMPTY_256]");
  CHECK_THROWS_AS(tok.token_text(257), std::out_of_range);
  CHECK_THROWS_AS(tok.token_text(-1), std::out_of_range);
  CHECK_THROWS_AS(tok.decode({300}), std::out_of_range);
}

TEST_CASE("pre-tokenizer names") {
  CHECK(tinyllm::pretokenizer_from_name("smollm") == pretokenizer::smollm);
  CHECK(tinyllm::pretokenizer_from_name("gpt-2") == pretokenizer::gpt2);
  CHECK(tinyllm::pretokenizer_from_name("gpt2") == pretokenizer::gpt2);
  CHECK_THROWS_WITH_AS(tinyllm::pretokenizer_from_name("llama3"), doctest::Contains("'llama3'"), tinyllm::format_error);
  CHECK_THROWS_WITH_AS(tinyllm::pretokenizer_from_name("default"), doctest::Contains("'default'"),
                       tinyllm::format_error);
}

TEST_CASE("unicode classes") {
  using tinyllm::unicode::classify;
  using C = tinyllm::unicode::cp_class;
  CHECK(classify('A') == C::letter);
  CHECK(classify(0xE9) == C::letter);     // é
  CHECK(classify(0xDF) == C::letter);     // ß
  CHECK(classify(0x3A9) == C::letter);    // Ω
  CHECK(classify(0x416) == C::letter);    // Ж
  CHECK(classify(0x4E2D) == C::letter);   // 中
  CHECK(classify(0x2EBF0) == C::letter);  // CJK Extension I (Unicode 15.1)
  CHECK(classify('7') == C::number);
  CHECK(classify(0x663) == C::number);    // ٣ Arabic-indic digit three
  CHECK(classify(0x216B) == C::number);   // Ⅻ roman numeral (Nl)
  CHECK(classify(0xB2) == C::number);     // ² (No)
  CHECK(classify(' ') == C::whitespace);
  CHECK(classify('\n') == C::whitespace);
  CHECK(classify(0xA0) == C::whitespace);
  CHECK(classify(0x3000) == C::whitespace);
  CHECK(classify(0x85) == C::whitespace);
  CHECK(classify(0x200B) == C::other);    // zero-width space: Cf, not White_Space
  CHECK(classify(0x1C) == C::other);      // isspace() in Python, but not White_Space
  CHECK(classify(0x1F600) == C::other);   // 😀
  CHECK(classify(0x301) == C::other);     // combining acute
  CHECK(classify('\'') == C::other);
  CHECK(classify(0x378) == C::other);     // unassigned
  CHECK(classify(0x110000) == C::other);
  CHECK(tinyllm::unicode::is_letter('z'));
  CHECK(tinyllm::unicode::is_number('0'));
  CHECK(tinyllm::unicode::is_whitespace('\t'));
}
