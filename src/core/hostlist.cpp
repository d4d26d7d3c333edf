// Parsing Slurm's hostlist expressions (core/hostlist.hpp). Each entry is parsed into pieces, a
// fixed text or a bracketed set of numbers, and expanded as the product of its pieces, the last
// piece varying fastest. Every error names the character where the text went wrong.
#include "core/hostlist.hpp"

#include <fmt/format.h>

#include <cctype>
#include <cstdint>

#include "kolo/status.hpp"

namespace kolo {
namespace {

// Numbers in brackets: at most nine digits, so that any range fits in 32 bits.
constexpr size_t kMaxDigits = 9;

struct Range {
  uint32_t low = 0, high = 0;
  size_t width = 0;  // the low bound's digits: "01-10" counts 01, 02, .. 10
};

// A fixed text when ranges is empty, else one of the numbers of the ranges.
struct Piece {
  std::string text;
  std::vector<Range> ranges;
};

bool host_name_character(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '-' || c == '.' || c == '_';
}

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  // Every entry of the list, each a sequence of pieces.
  std::vector<std::vector<Piece>> entries() {
    std::vector<std::vector<Piece>> result;
    if (text_.empty()) fail("the node list is empty");
    while (true) {
      result.push_back(entry());
      if (at_ == text_.size()) return result;
      ++at_;  // the comma entry() stopped at
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(Status::kConfig, fmt::format("{} at character {} of '{}'", what, at_ + 1, text_));
  }

  std::vector<Piece> entry() {
    std::vector<Piece> pieces;
    while (at_ < text_.size() && text_[at_] != ',') {
      char c = text_[at_];
      if (c == '[') {
        ++at_;
        pieces.push_back(Piece{"", ranges()});
      } else if (c == ']') {
        fail("unbalanced ']'");
      } else if (host_name_character(c)) {
        if (pieces.empty() || !pieces.back().ranges.empty()) pieces.emplace_back();
        pieces.back().text += c;
        ++at_;
      } else {
        fail(fmt::format("'{}' is not part of a host name", c));
      }
    }
    if (pieces.empty()) fail("empty entry");
    return pieces;
  }

  // From after "[" to after "]".
  std::vector<Range> ranges() {
    std::vector<Range> result;
    while (true) {
      Range range;
      auto [low, width] = number();
      range.low = range.high = low;
      range.width = width;
      if (at_ < text_.size() && text_[at_] == '-') {
        ++at_;
        range.high = number().first;
        if (range.high < range.low) {
          fail(fmt::format("range {}-{} runs backwards", range.low, range.high));
        }
      }
      result.push_back(range);
      if (at_ == text_.size()) fail("unbalanced '['");
      if (text_[at_] == ']') {
        ++at_;
        return result;
      }
      if (text_[at_] != ',') {
        fail(text_[at_] == '['
                 ? std::string("nested '['")
                 : fmt::format("'{}' in a range (expected a digit, '-', ',' or ']')", text_[at_]));
      }
      ++at_;
    }
  }

  // A number and its digit count.
  std::pair<uint32_t, size_t> number() {
    size_t start = at_;
    uint32_t value = 0;
    while (at_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[at_])) != 0) {
      if (at_ - start == kMaxDigits)
        fail(fmt::format("a number of more than {} digits", kMaxDigits));
      value = value * 10 + static_cast<uint32_t>(text_[at_] - '0');
      ++at_;
    }
    if (at_ == start) {
      if (at_ == text_.size()) fail("unbalanced '['");
      fail(fmt::format("'{}' where a number was expected", text_[at_]));
    }
    return {value, at_ - start};
  }

  std::string_view text_;
  size_t at_ = 0;
};

std::string_view trimmed(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front())) != 0) {
    text.remove_prefix(1);
  }
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())) != 0) {
    text.remove_suffix(1);
  }
  return text;
}

std::string number_text(uint32_t value, size_t width) {
  return fmt::format("{:0{}}", value, width);
}

// Appends the names of one entry, the last piece varying fastest.
void expand_entry(const std::vector<Piece>& pieces, size_t index, std::string& prefix,
                  std::vector<std::string>& out) {
  if (index == pieces.size()) {
    out.push_back(prefix);
    return;
  }
  const Piece& piece = pieces[index];
  size_t length = prefix.size();
  if (piece.ranges.empty()) {
    prefix += piece.text;
    expand_entry(pieces, index + 1, prefix, out);
  } else {
    for (const Range& range : piece.ranges) {
      for (uint64_t value = range.low; value <= range.high; ++value) {
        prefix += number_text(static_cast<uint32_t>(value), range.width);
        expand_entry(pieces, index + 1, prefix, out);
        prefix.resize(length);
      }
    }
  }
  prefix.resize(length);
}

// How many names an entry stands for, or max_names + 1 when that is more than max_names.
size_t entry_size(const std::vector<Piece>& pieces, size_t max_names) {
  uint64_t product = 1;
  for (const Piece& piece : pieces) {
    uint64_t count = 0;
    for (const Range& range : piece.ranges) count += uint64_t{range.high} - range.low + 1;
    if (piece.ranges.empty()) count = 1;
    // product <= max_names here, so the test cannot overflow.
    if (count > max_names || product > max_names / count) return max_names + 1;
    product *= count;
  }
  return static_cast<size_t>(product);
}

}  // namespace

std::vector<std::string> expand_hostlist(std::string_view text, size_t max_names) {
  std::string_view list = trimmed(text);
  auto entries = Parser(list).entries();
  size_t total = 0;
  for (const auto& pieces : entries) {
    total += entry_size(pieces, max_names);
    if (total > max_names) {
      throw Error(Status::kConfig, fmt::format("more than {} names in '{}'", max_names, list));
    }
  }
  std::vector<std::string> names;
  names.reserve(total);
  std::string prefix;
  for (const auto& pieces : entries) expand_entry(pieces, 0, prefix, names);
  return names;
}

std::string first_host_of_hostlist(std::string_view text) {
  auto entries = Parser(trimmed(text)).entries();
  std::string name;
  for (const Piece& piece : entries.front()) {
    name += piece.ranges.empty()
                ? piece.text
                : number_text(piece.ranges.front().low, piece.ranges.front().width);
  }
  return name;
}

}  // namespace kolo
