// What the fuzz targets share: an input read from the front as fixed-size values and byte runs
// (zeros once it is used up, so that every input means something and nothing reads past it), and
// the check of an invariant, which libFuzzer reports as a crash and saves the input of.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define FUZZ_REQUIRE(condition)                                                                    \
  do {                                                                                             \
    if (!(condition)) {                                                                            \
      std::fprintf(stderr, "fuzz invariant broken: %s (%s:%d)\n", #condition, __FILE__, __LINE__); \
      std::abort();                                                                                \
    }                                                                                              \
  } while (0)

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  template <typename T>
  T take() {
    T value{};
    const size_t bytes = std::min(sizeof(T), left());
    std::memcpy(&value, data_ + at_, bytes);
    at_ += bytes;
    return value;
  }
  // Up to `bytes` bytes: fewer once the input runs out.
  std::vector<uint8_t> take_bytes(size_t bytes) {
    bytes = std::min(bytes, left());
    std::vector<uint8_t> run(data_ + at_, data_ + at_ + bytes);
    at_ += bytes;
    return run;
  }
  size_t left() const { return size_ - at_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};
