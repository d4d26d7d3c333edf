// Memory for kolo's large working buffers (the ring's receive slots, partials and scratch, the
// fusion buffer), mapped from the kernel instead of taken from malloc.
//
// Why not new[]: glibc serves a large request with mmap only until the first such block is freed;
// it then raises its mmap threshold to that block's size, and every later request up to it comes
// from the arenas shared with the caller's own allocations. A buffer freed there (a communicator
// destroyed, a buffer grown) leaves a hole between live blocks that the allocator keeps mapped, so
// a job that splits and destroys communicators grew its resident memory by 10-25 MiB per rank in
// the soak although the bytes in use stayed flat (docs/contributing.md, "The soak"). Mapped
// buffers go back to the kernel whole when freed and never move the caller's threshold.
// Under AddressSanitizer they come from new[] after all, so that a write past the end of one is
// caught there rather than lost in the rest of its last page.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <new>
#include <utility>

#if defined(__SANITIZE_ADDRESS__)
#define KOLO_PAGE_BUFFER_FROM_NEW 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KOLO_PAGE_BUFFER_FROM_NEW 1
#endif
#endif

namespace kolo {

class PageBuffer {
 public:
  PageBuffer() = default;
  // Untouched pages cost nothing: the kernel backs them on first use, with zeros.
  explicit PageBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
#ifdef KOLO_PAGE_BUFFER_FROM_NEW
    data_ = new std::byte[bytes];
#else
    void* mapped =
        ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) throw std::bad_alloc();
    data_ = static_cast<std::byte*>(mapped);
#endif
  }
  ~PageBuffer() {
    release();
  }
  PageBuffer(PageBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  PageBuffer& operator=(PageBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;

  std::byte* data() const {
    return data_;
  }
  size_t size() const {
    return bytes_;
  }

  // Unmaps first, so that an old and a new buffer never need to coexist.
  void release() {
#ifdef KOLO_PAGE_BUFFER_FROM_NEW
    delete[] data_;
#else
    if (data_ != nullptr) ::munmap(data_, bytes_);
#endif
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace kolo
