// kolo.hpp — a header-only C++17 layer over kolo's C ABI (kolo.h).
//
// What it adds to kolo.h, and nothing more:
//   - ownership: kolo::Comm and kolo::Request are move-only and free their handle in the
//     destructor (kolo_comm_destroy, kolo_request_free);
//   - errors as exceptions: a call whose C function returns anything but KOLO_SUCCESS throws
//     kolo::Exception, which carries that status and kolo's message for it
//     (kolo_comm_last_error or kolo_request_last_error, read on the throwing thread);
//   - typed buffers: every buffer is a contiguous range (std::vector, std::array, a C array,
//     std::string, kolo::Span, anything that std::data and std::size accept), its dtype deduced
//     from the element type at compile time and its count from its size.
// Every member function is one call of the C function of the same name (the communicator queries
// that a count check needs aside), so kolo.h's documentation of that function is the
// documentation of the wrapper: what it does, whether it blocks, who owns each buffer, what each
// status means. The rules of kolo.h hold unchanged (collectives in the same order on every rank,
// buffers of named operations untouched until their request completes, every wait bounded by
// KOLO_TIMEOUT).
//
// Counts. A C call takes one count and trusts each buffer to hold what that count implies; a
// range knows its size, so the wrapper checks that the ranges fit together before calling (an
// out-of-place allreduce's recvbuf holds as many elements as its sendbuf, an allgather's N times
// as many, ...) and throws kolo::Exception with KOLO_ERR_INVALID_ARGUMENT and a message naming the
// call and both sizes otherwise, without calling kolo. Sizes must match exactly; pass
// Span::first or Span::subspan for part of a larger buffer. Device memory (the _on_stream calls,
// and the blocking collectives on GPU buffers) goes in as kolo::Span(pointer, count).
//
// Element types: float, double, the 8-bit integer types (char, signed char, unsigned char,
// std::byte), the 32- and 64-bit signed integer types (and the 16-bit ones where kolo.h has
// KOLO_INT16), and kolo::float16 / kolo::bfloat16 (bit containers: kolo reads and writes their
// bits, the arithmetic is kolo's). A type of your own (a half type of a framework, say) gets a
// dtype by a specialization of kolo::dtype_traits:
//   template <> struct kolo::dtype_traits<my_half> { static constexpr kolo_dtype_t value =
//   KOLO_FLOAT16; };
// Any other element type is refused at compile time.
#ifndef KOLO_HPP
#define KOLO_HPP

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kolo.h"

namespace kolo {

// ---- Errors ------------------------------------------------------------------------------------

// Thrown by every wrapper whose C call failed. status() is the C call's status; message() is
// kolo's text for it (the last error of the communicator or request), or, when kolo has none,
// kolo_status_string(status). what() is "<status name>: <message>", so that an exception that
// nobody catches still says both.
class Exception : public std::runtime_error {
 public:
  Exception(kolo_status_t status, const std::string& message)
      : std::runtime_error(describe(status, message)),
        status_(status),
        message_(message.empty() ? kolo_status_string(status) : message) {}

  kolo_status_t status() const noexcept { return status_; }
  const std::string& message() const noexcept { return message_; }

 private:
  // "KOLO_ERR_TIMEOUT" out of kolo_status_string's "KOLO_ERR_TIMEOUT: a wait ran past ...".
  static std::string describe(kolo_status_t status, const std::string& message) {
    const std::string full = kolo_status_string(status);
    if (message.empty()) return full;
    return full.substr(0, full.find(':')) + ": " + message;
  }

  kolo_status_t status_;
  std::string message_;
};

namespace detail {

// Throws for a failed call on comm (a NULL comm reads the message kolo keeps for this thread).
inline void check(kolo_status_t status, kolo_comm_t comm) {
  if (status != KOLO_SUCCESS) throw Exception(status, kolo_comm_last_error(comm));
}

inline void check_request(kolo_status_t status, kolo_request_t request) {
  if (status == KOLO_SUCCESS) return;
  if (!request) throw Exception(status, "the kolo::Request is empty (moved from, or never submitted)");
  throw Exception(status, kolo_request_last_error(request));
}

// A wrapper's own argument check, made before any C call.
inline void require(bool ok, const char* call, const std::string& what) {
  if (!ok) throw Exception(KOLO_ERR_INVALID_ARGUMENT, std::string("kolo::Comm::") + call + ": " + what);
}

}  // namespace detail

// ---- Element types ---------------------------------------------------------------------------

// IEEE 754 binary16 and bfloat16, as bits: kolo reduces them (in float32, rounding once); this
// header converts nothing.
struct float16 {
  std::uint16_t bits;
};
struct bfloat16 {
  std::uint16_t bits;
};

// dtype_traits<T>::value is the kolo dtype of elements of type T; specialize it for types of
// your own with the layout of a kolo dtype.
template <class T, class Enable = void>
struct dtype_traits {};

template <>
struct dtype_traits<float> {
  static constexpr kolo_dtype_t value = KOLO_FLOAT32;
};
template <>
struct dtype_traits<double> {
  static constexpr kolo_dtype_t value = KOLO_FLOAT64;
};
template <>
struct dtype_traits<float16> {
  static constexpr kolo_dtype_t value = KOLO_FLOAT16;
};
template <>
struct dtype_traits<bfloat16> {
  static constexpr kolo_dtype_t value = KOLO_BFLOAT16;
};
template <>
struct dtype_traits<std::byte> {
  static constexpr kolo_dtype_t value = KOLO_UINT8;
};

namespace detail {

// KOLO_INT16, where the kolo.h beside this header has it (kolo.h of 0.2 does not): looked up
// through the enum type, so that its absence is a substitution failure and not an error.
template <class Dtype, class = void>
struct int16_dtype : std::false_type {};
template <class Dtype>
struct int16_dtype<Dtype, std::void_t<decltype(Dtype::KOLO_INT16)>> : std::true_type {
  static constexpr Dtype dtype = Dtype::KOLO_INT16;
};

// Integer types by width and signedness (int64_t is long here and long long elsewhere; both are
// 64-bit signed). bool and the wide character types are not numbers kolo reduces.
template <class T>
constexpr bool is_kolo_integer =
    std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, wchar_t> &&
    !std::is_same_v<T, char16_t> && !std::is_same_v<T, char32_t> &&
    (sizeof(T) == 1 ||
     (std::is_signed_v<T> && (sizeof(T) == 4 || sizeof(T) == 8 ||
                              (sizeof(T) == 2 && int16_dtype<kolo_dtype_t>::value))));

// Dtype is a parameter so that int16_dtype<Dtype>::dtype is looked up only where T needs it.
template <class T, class Dtype = kolo_dtype_t>
constexpr kolo_dtype_t integer_dtype() {
  if constexpr (sizeof(T) == 1) {
    return std::is_signed_v<T> ? KOLO_INT8 : KOLO_UINT8;
  } else if constexpr (sizeof(T) == 2) {
    return int16_dtype<Dtype>::dtype;
  } else if constexpr (sizeof(T) == 4) {
    return KOLO_INT32;
  } else {
    return KOLO_INT64;
  }
}

template <class T, class = void>
struct has_dtype : std::false_type {};
template <class T>
struct has_dtype<T, std::void_t<decltype(dtype_traits<T>::value)>> : std::true_type {};

}  // namespace detail

template <class T>
struct dtype_traits<T, std::enable_if_t<detail::is_kolo_integer<T>>> {
  static constexpr kolo_dtype_t value = detail::integer_dtype<T>();
};

// The kolo dtype of T (const ignored); a compile-time error names types kolo has no dtype for.
template <class T>
constexpr kolo_dtype_t dtype_of() {
  using Element = std::remove_cv_t<T>;
  static_assert(detail::has_dtype<Element>::value,
                "kolo: no kolo dtype for this element type (kolo has float32, float64, float16, "
                "bfloat16, int8, uint8, int32 and int64; specialize kolo::dtype_traits for a type "
                "of your own with one of these layouts)");
  return dtype_traits<Element>::value;
}

// ---- Span: a typed view of contiguous elements -------------------------------------------------

template <class T>
class Span;

namespace detail {

template <class T>
struct is_span : std::false_type {};
template <class T>
struct is_span<Span<T>> : std::true_type {};

// The element type of a contiguous range, const where the range gives const access.
template <class Range>
using element_t = std::remove_pointer_t<decltype(std::data(std::declval<Range&>()))>;

template <class Range, class = void>
struct is_range : std::false_type {};
template <class Range>
struct is_range<Range, std::void_t<decltype(std::data(std::declval<Range&>())),
                                   decltype(std::size(std::declval<Range&>()))>>
    : std::is_pointer<decltype(std::data(std::declval<Range&>()))> {};

template <class Range>
using if_range = std::enable_if_t<is_range<std::remove_reference_t<Range>>::value, int>;

}  // namespace detail

// A pointer and a count, as std::span of C++20 (which converts to it, being a contiguous range).
// It owns nothing; the elements must outlive every use of it.
template <class T>
class Span {
 public:
  using element_type = T;

  constexpr Span() noexcept = default;
  constexpr Span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  // Any contiguous range whose elements convert to T without losing const (a std::vector<float>
  // to Span<float> or Span<const float>, a Span<float> to Span<const float>).
  template <class Range, class Element = detail::element_t<std::remove_reference_t<Range>>,
            std::enable_if_t<detail::is_range<std::remove_reference_t<Range>>::value &&
                                 !detail::is_span<std::remove_cv_t<std::remove_reference_t<Range>>>::value &&
                                 std::is_convertible_v<Element (*)[], T (*)[]>,
                             int> = 0>
  constexpr Span(Range&& range) noexcept(noexcept(std::data(range)) && noexcept(std::size(range)))
      : data_(std::data(range)), size_(std::size(range)) {}
  template <class U, std::enable_if_t<std::is_convertible_v<U (*)[], T (*)[]>, int> = 0>
  constexpr Span(const Span<U>& other) noexcept : data_(other.data()), size_(other.size()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr bool empty() const noexcept { return size_ == 0; }
  constexpr T* begin() const noexcept { return data_; }
  constexpr T* end() const noexcept { return data_ + size_; }
  constexpr T& operator[](std::size_t index) const noexcept { return data_[index]; }

  // Elements [offset, offset + count); out_of_range past the end.
  Span subspan(std::size_t offset, std::size_t count) const {
    if (offset > size_ || count > size_ - offset) {
      throw std::out_of_range("kolo::Span::subspan: [" + std::to_string(offset) + ", +" +
                              std::to_string(count) + ") is outside a span of " +
                              std::to_string(size_) + " elements");
    }
    return Span(data_ + offset, count);
  }
  Span first(std::size_t count) const { return subspan(0, count); }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

template <class T>
Span(T*, std::size_t) -> Span<T>;
template <class Range, detail::if_range<Range> = 0>
Span(Range&&) -> Span<detail::element_t<std::remove_reference_t<Range>>>;

namespace detail {

// A read-only view of a range passed as a send buffer.
template <class Range>
Span<const element_t<const Range>> in(const Range& range) {
  return {std::data(range), static_cast<std::size_t>(std::size(range))};
}

// A writable view of a range passed as a receive buffer.
template <class Range>
Span<element_t<std::remove_reference_t<Range>>> out(Range&& range) {
  using Element = element_t<std::remove_reference_t<Range>>;
  static_assert(!std::is_const_v<Element>,
                "kolo: this buffer is written by the call: pass a range with non-const elements");
  return {std::data(range), static_cast<std::size_t>(std::size(range))};
}

template <class Send, class Recv>
constexpr void same_type() {
  static_assert(std::is_same_v<std::remove_cv_t<Send>, std::remove_cv_t<Recv>>,
                "kolo: the send and receive buffers of one call have the same element type");
}

template <class T>
constexpr kolo_dtype_t dtype_in(Span<T>) {
  return dtype_of<T>();
}

inline std::string elements(std::size_t count) { return std::to_string(count) + " elements"; }

// The sum of counts, or false where it does not fit in 64 bits.
inline bool sum_of(Span<const std::uint64_t> counts, std::uint64_t* sum) {
  *sum = 0;
  for (std::uint64_t count : counts) {
    if (count > UINT64_MAX - *sum) return false;
    *sum += count;
  }
  return true;
}

}  // namespace detail

// ---- Requests of named operations --------------------------------------------------------------

// A submitted named operation (kolo_request_t), freed by the destructor; a request still pending
// then completes in the background, its buffers in use until it has (kolo_request_free).
class Request {
 public:
  Request() noexcept = default;
  // Takes ownership of handle (may be NULL: an empty request).
  explicit Request(kolo_request_t handle) noexcept : handle_(handle) {}
  Request(Request&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  Request& operator=(Request&& other) noexcept {
    if (this != &other) {
      if (handle_) kolo_request_free(handle_);
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() {
    if (handle_) kolo_request_free(handle_);
  }

  // kolo_request_test: false while pending, true once completed successfully; throws the
  // request's error once it has failed. Never blocks.
  bool test() {
    int done = 0;
    detail::check_request(kolo_request_test(handle_, &done), handle_);
    return done != 0;
  }

  // kolo_request_wait: returns once the request has completed successfully; throws its error,
  // or KOLO_ERR_TIMEOUT (the request still pending: wait again) past the communicator's timeout.
  void wait() { detail::check_request(kolo_request_wait(handle_), handle_); }

  // kolo_request_counts of a completed allgather: element r is what rank r sent; size is the
  // communicator's size (Comm::size()).
  std::vector<std::uint64_t> counts(int size) {
    std::vector<std::uint64_t> counts(size > 0 ? static_cast<std::size_t>(size) : 0);
    detail::check_request(kolo_request_counts(handle_, counts.data(), size), handle_);
    return counts;
  }

  // kolo_request_last_error: "" on success or while pending.
  std::string last_error() const { return kolo_request_last_error(handle_); }

  kolo_request_t get() const noexcept { return handle_; }
  // Gives the handle up: the caller frees it with kolo_request_free.
  kolo_request_t release() noexcept { return std::exchange(handle_, nullptr); }
  explicit operator bool() const noexcept { return handle_ != nullptr; }

 private:
  kolo_request_t handle_ = nullptr;
};

// ---- Communicators -----------------------------------------------------------------------------

// A communicator (kolo_comm_t), destroyed by the destructor (kolo_comm_destroy). Move-only; a
// moved-from Comm is empty, and every call on an empty one throws KOLO_ERR_INVALID_ARGUMENT.
// The thread rules of kolo.h hold: a Comm may be used from several threads, and must not be
// destroyed while another thread is inside a call on it.
class Comm {
 public:
  // kolo_comm_init from the environment (KOLO_RANK, a launcher's variables, ...).
  Comm() { detail::check(kolo_comm_init(nullptr, &handle_), nullptr); }
  // kolo_comm_init with config (start from KOLO_CONFIG_INITIALIZER; see kolo.h).
  explicit Comm(const kolo_config_t& config) {
    detail::check(kolo_comm_init(&config, &handle_), nullptr);
  }
  // Takes ownership of handle, a communicator from kolo.h's calls (NULL: an empty Comm).
  explicit Comm(kolo_comm_t handle) noexcept : handle_(handle) {}

  Comm(Comm&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  Comm& operator=(Comm&& other) noexcept {
    if (this != &other) {
      if (handle_) kolo_comm_destroy(handle_);
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  ~Comm() {
    if (handle_) kolo_comm_destroy(handle_);
  }

  kolo_comm_t get() const noexcept { return handle_; }
  // Gives the handle up: the caller destroys it with kolo_comm_destroy.
  kolo_comm_t release() noexcept { return std::exchange(handle_, nullptr); }
  explicit operator bool() const noexcept { return handle_ != nullptr; }

  int rank() const { return query(kolo_comm_rank); }
  int size() const { return query(kolo_comm_size); }
  int local_rank() const { return query(kolo_comm_local_rank); }
  int local_size() const { return query(kolo_comm_local_size); }
  // kolo_comm_last_error: the message of the last failure on this communicator, "" if none.
  std::string last_error() const { return kolo_comm_last_error(handle_); }

  // ---- Collectives (blocking; kolo.h documents each) ----

  template <class Send, class Recv, detail::if_range<Recv> = 0>
  void allreduce(const Send& send, Recv&& recv, kolo_op_t op) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    same_size("allreduce", in.size(), out.size());
    call_typed(in, out, [&](auto element) {
      return kolo_allreduce(handle_, in.data(), out.data(), in.size(), element, op);
    });
  }
  // In place.
  template <class Buffer, detail::if_range<Buffer> = 0>
  void allreduce(Buffer&& buffer, kolo_op_t op) {
    auto both = detail::out(buffer);
    detail::check(
        kolo_allreduce(handle_, both.data(), both.data(), both.size(), detail::dtype_in(both), op),
        handle_);
  }

  template <class Send, class Recv, detail::if_range<Recv> = 0>
  void allreduce_scaled(const Send& send, Recv&& recv, kolo_op_t op, double prescale,
                        double postscale) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    same_size("allreduce_scaled", in.size(), out.size());
    call_typed(in, out, [&](auto element) {
      return kolo_allreduce_scaled(handle_, in.data(), out.data(), in.size(), element, op,
                                   prescale, postscale);
    });
  }
  template <class Buffer, detail::if_range<Buffer> = 0>
  void allreduce_scaled(Buffer&& buffer, kolo_op_t op, double prescale, double postscale) {
    auto both = detail::out(buffer);
    detail::check(kolo_allreduce_scaled(handle_, both.data(), both.data(), both.size(),
                                        detail::dtype_in(both), op, prescale, postscale),
                  handle_);
  }

  template <class Buffer, detail::if_range<Buffer> = 0>
  void broadcast(Buffer&& buffer, int root) {
    auto both = detail::out(buffer);
    detail::check(kolo_broadcast(handle_, both.data(), both.size(), detail::dtype_in(both),
                                 root),
                  handle_);
  }

  void barrier() { detail::check(kolo_barrier(handle_), handle_); }

  // recv holds size() times send's elements. In place: send is this rank's block of recv
  // (Span(recv).subspan(rank() * count, count)).
  template <class Send, class Recv, detail::if_range<Recv> = 0>
  void allgather(const Send& send, Recv&& recv) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    const std::size_t ranks = static_cast<std::size_t>(size());
    detail::require(out.size() % ranks == 0 && out.size() / ranks == in.size(), "allgather",
                    "recvbuf has " + detail::elements(out.size()) + ", not " +
                        std::to_string(ranks) + " times sendbuf's " + detail::elements(in.size()));
    call_typed(in, out, [&](auto element) {
      return kolo_allgather(handle_, in.data(), out.data(), in.size(), element);
    });
  }

  // counts has size() entries; send holds counts[rank()] elements and recv their sum.
  template <class Send, class Recv, class Counts, detail::if_range<Recv> = 0>
  void allgatherv(const Send& send, Recv&& recv, const Counts& counts) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    const Span<const std::uint64_t> per_rank = detail::in(counts);
    const std::uint64_t total = check_counts("allgatherv", per_rank);
    detail::require(in.size() == per_rank[static_cast<std::size_t>(rank())], "allgatherv",
                    "sendbuf has " + detail::elements(in.size()) + " where counts[rank] is " +
                        std::to_string(per_rank[static_cast<std::size_t>(rank())]));
    detail::require(out.size() == total, "allgatherv",
                    "recvbuf has " + detail::elements(out.size()) + " where the counts add up to " +
                        std::to_string(total));
    call_typed(in, out, [&](auto element) {
      return kolo_allgatherv(handle_, in.data(), out.data(), per_rank.data(), element);
    });
  }

  // send holds size() times recv's elements. In place: recv is this rank's block of send.
  template <class Send, class Recv, detail::if_range<Recv> = 0>
  void reduce_scatter(const Send& send, Recv&& recv, kolo_op_t op) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    const std::size_t ranks = static_cast<std::size_t>(size());
    detail::require(in.size() % ranks == 0 && in.size() / ranks == out.size(), "reduce_scatter",
                    "sendbuf has " + detail::elements(in.size()) + ", not " +
                        std::to_string(ranks) + " times recvbuf's " + detail::elements(out.size()));
    call_typed(in, out, [&](auto element) {
      return kolo_reduce_scatter(handle_, in.data(), out.data(), out.size(), element, op);
    });
  }

  // counts has size() entries; send holds their sum and recv counts[rank()] elements.
  template <class Send, class Recv, class Counts, detail::if_range<Recv> = 0>
  void reduce_scatterv(const Send& send, Recv&& recv, const Counts& counts, kolo_op_t op) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    const Span<const std::uint64_t> per_rank = detail::in(counts);
    const std::uint64_t total = check_counts("reduce_scatterv", per_rank);
    detail::require(in.size() == total, "reduce_scatterv",
                    "sendbuf has " + detail::elements(in.size()) + " where the counts add up to " +
                        std::to_string(total));
    detail::require(out.size() == per_rank[static_cast<std::size_t>(rank())], "reduce_scatterv",
                    "recvbuf has " + detail::elements(out.size()) + " where counts[rank] is " +
                        std::to_string(per_rank[static_cast<std::size_t>(rank())]));
    call_typed(in, out, [&](auto element) {
      return kolo_reduce_scatterv(handle_, in.data(), out.data(), per_rank.data(), element, op);
    });
  }

  // send and recv each hold size() blocks of the same count.
  template <class Send, class Recv, detail::if_range<Recv> = 0>
  void alltoall(const Send& send, Recv&& recv) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    const std::size_t ranks = static_cast<std::size_t>(size());
    detail::require(in.size() == out.size() && in.size() % ranks == 0, "alltoall",
                    "sendbuf has " + detail::elements(in.size()) + " and recvbuf " +
                        detail::elements(out.size()) + ": both must hold " +
                        std::to_string(ranks) + " blocks of one count");
    call_typed(in, out, [&](auto element) {
      return kolo_alltoall(handle_, in.data(), out.data(), in.size() / ranks, element);
    });
  }

  // The arrays have size() entries; every block [displacement, displacement + count) of a
  // non-zero count lies inside its buffer (negative displacements are left to kolo, which
  // refuses them).
  template <class Send, class SendCounts, class SendDispls, class Recv, class RecvCounts,
            class RecvDispls, detail::if_range<Recv> = 0>
  void alltoallv(const Send& send, const SendCounts& send_counts, const SendDispls& send_displs,
                 Recv&& recv, const RecvCounts& recv_counts, const RecvDispls& recv_displs) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    const Span<const std::uint64_t> scounts = detail::in(send_counts);
    const Span<const std::int64_t> sdispls = detail::in(send_displs);
    const Span<const std::uint64_t> rcounts = detail::in(recv_counts);
    const Span<const std::int64_t> rdispls = detail::in(recv_displs);
    const std::size_t ranks = static_cast<std::size_t>(size());
    detail::require(scounts.size() == ranks && sdispls.size() == ranks && rcounts.size() == ranks &&
                        rdispls.size() == ranks,
                    "alltoallv",
                    "the count and displacement arrays have " + std::to_string(scounts.size()) +
                        ", " + std::to_string(sdispls.size()) + ", " +
                        std::to_string(rcounts.size()) + " and " + std::to_string(rdispls.size()) +
                        " entries, where the communicator has " + std::to_string(ranks) + " ranks");
    blocks_inside("alltoallv", "sendbuf", scounts, sdispls, in.size());
    blocks_inside("alltoallv", "recvbuf", rcounts, rdispls, out.size());
    call_typed(in, out, [&](auto element) {
      return kolo_alltoallv(handle_, in.data(), scounts.data(), sdispls.data(), out.data(),
                            rcounts.data(), rdispls.data(), element);
    });
  }

  // recv: the result on the root, where it holds send's count; elsewhere ignored (may be empty).
  template <class Send, class Recv, detail::if_range<Recv> = 0>
  void reduce(const Send& send, Recv&& recv, kolo_op_t op, int root) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    detail::require(out.empty() || out.size() == in.size(), "reduce",
                    "recvbuf has " + detail::elements(out.size()) + " where sendbuf has " +
                        detail::elements(in.size()) + " (an empty recvbuf is for ranks other than "
                        "the root)");
    call_typed(in, out, [&](auto element) {
      return kolo_reduce(handle_, in.data(), out.empty() ? nullptr : out.data(), in.size(),
                         element, op, root);
    });
  }
  // In place on the root; the other ranks' buffers are only read.
  template <class Buffer, detail::if_range<Buffer> = 0>
  void reduce(Buffer&& buffer, kolo_op_t op, int root) {
    auto both = detail::out(buffer);
    detail::check(kolo_reduce(handle_, both.data(), both.data(), both.size(),
                              detail::dtype_in(both), op, root),
                  handle_);
  }

  // ---- Point to point ----

  template <class Buffer>
  void send(const Buffer& buffer, int peer, int tag) {
    auto in = detail::in(buffer);
    detail::check(kolo_send(handle_, in.data(), in.size(), detail::dtype_in(in), peer, tag),
                  handle_);
  }
  template <class Buffer, detail::if_range<Buffer> = 0>
  void recv(Buffer&& buffer, int peer, int tag) {
    auto out = detail::out(buffer);
    detail::check(kolo_recv(handle_, out.data(), out.size(), detail::dtype_in(out), peer,
                            tag),
                  handle_);
  }

  // ---- Sub-communicators, shrinking and growing ----

  // kolo_comm_split: the new communicator; an empty Comm for a negative colour (KOLO_COLOR_NONE).
  Comm split(int color, int key) {
    kolo_comm_t child = nullptr;
    detail::check(kolo_comm_split(handle_, color, key, &child), handle_);
    return Comm(child);
  }

  // kolo_comm_shrink: a new communicator of the ranks still alive; this one is broken after it.
  Comm shrink() {
    kolo_comm_t child = nullptr;
    detail::check(kolo_comm_shrink(handle_, &child), handle_);
    return Comm(child);
  }

  // kolo_comm_invite, on rank 0: the invitation newcomers pass in KOLO_INVITATION.
  std::string invite() {
    char text[KOLO_INVITATION_MAX];
    detail::check(kolo_comm_invite(handle_, text, sizeof text), handle_);
    return text;
  }

  // kolo_comm_grow: with the invited newcomers, a communicator of new_size ranks; this one is
  // broken after it.
  Comm grow(int new_size) {
    kolo_comm_t child = nullptr;
    detail::check(kolo_comm_grow(handle_, new_size, &child), handle_);
    return Comm(child);
  }

  // kolo_elastic_update: the launcher's plan, applied. update says what changed; the returned
  // Comm is the new communicator (empty when nothing changed or this rank leaves).
  Comm elastic_update(kolo_elastic_update_t& update) {
    kolo_comm_t child = nullptr;
    detail::check(kolo_elastic_update(handle_, &update, &child), handle_);
    return Comm(child);
  }

  // ---- Named asynchronous operations (the fusion engine) ----
  // The buffers must stay valid and untouched until the request has completed (kolo.h).

  template <class Send, class Recv, detail::if_range<Recv> = 0>
  Request allreduce_async(const std::string& name, const Send& send, Recv&& recv, kolo_op_t op,
                          const kolo_async_options_t* options = nullptr) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    same_size("allreduce_async", in.size(), out.size());
    return submit([&](auto element, kolo_request_t* request) {
      return kolo_allreduce_async(handle_, name.c_str(), in.data(), out.data(), in.size(), element,
                                  op, options, request);
    }, in, out);
  }
  // In place.
  template <class Buffer, detail::if_range<Buffer> = 0>
  Request allreduce_async(const std::string& name, Buffer&& buffer, kolo_op_t op,
                          const kolo_async_options_t* options = nullptr) {
    auto both = detail::out(buffer);
    return submit([&](auto element, kolo_request_t* request) {
      return kolo_allreduce_async(handle_, name.c_str(), both.data(), both.data(), both.size(),
                                  element, op, options, request);
    }, both, both);
  }

  template <class Buffer, detail::if_range<Buffer> = 0>
  Request broadcast_async(const std::string& name, Buffer&& buffer, int root,
                          const kolo_async_options_t* options = nullptr) {
    auto both = detail::out(buffer);
    return submit([&](auto element, kolo_request_t* request) {
      return kolo_broadcast_async(handle_, name.c_str(), both.data(), both.size(), element, root,
                                  options, request);
    }, both, both);
  }

  // One request for a group of allreduces: member i reduces sends[i] into recvs[i] (the same
  // span reduces in place) under names[i].
  template <class T>
  Request allreduce_group_async(const std::vector<std::string>& names,
                                const std::vector<Span<const T>>& sends,
                                const std::vector<Span<T>>& recvs, kolo_op_t op,
                                const kolo_async_options_t* options = nullptr) {
    detail::require(names.size() == sends.size() && names.size() == recvs.size(),
                    "allreduce_group_async",
                    std::to_string(names.size()) + " names, " + std::to_string(sends.size()) +
                        " send buffers and " + std::to_string(recvs.size()) +
                        " receive buffers: one of each per member");
    std::vector<const char*> name_pointers;
    std::vector<const void*> send_pointers;
    std::vector<void*> recv_pointers;
    std::vector<std::uint64_t> counts;
    for (std::size_t i = 0; i < names.size(); ++i) {
      same_size("allreduce_group_async", sends[i].size(), recvs[i].size());
      name_pointers.push_back(names[i].c_str());
      send_pointers.push_back(sends[i].data());
      recv_pointers.push_back(recvs[i].data());
      counts.push_back(sends[i].size());
    }
    kolo_request_t request = nullptr;
    detail::check(kolo_allreduce_group_async(
                      handle_, static_cast<int>(std::min<std::size_t>(names.size(), INT32_MAX)),
                      name_pointers.data(), send_pointers.data(), recv_pointers.data(),
                      counts.data(), dtype_of<T>(), op, options, &request),
                  handle_);
    return Request(request);
  }
  // In place.
  template <class T>
  Request allreduce_group_async(const std::vector<std::string>& names,
                                const std::vector<Span<T>>& buffers, kolo_op_t op,
                                const kolo_async_options_t* options = nullptr) {
    return allreduce_group_async(names, std::vector<Span<const T>>(buffers.begin(), buffers.end()),
                                 buffers, op, options);
  }

  // Horovod's allgather: send's elements (a count per rank) gathered into recv, whose size is
  // the capacity; Request::counts(size()) tells what each rank sent once it has completed.
  template <class Send, class Recv, detail::if_range<Recv> = 0>
  Request allgather_async(const std::string& name, const Send& send, Recv&& recv,
                          const kolo_async_options_t* options = nullptr) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    return submit([&](auto element, kolo_request_t* request) {
      return kolo_allgather_async(handle_, name.c_str(), in.data(), in.size(), out.data(),
                                  out.size(), element, options, request);
    }, in, out);
  }

  // kolo_join: blocks until every rank has joined; returns the rank that joined last.
  int join() {
    int last_rank = -1;
    detail::check(kolo_join(handle_, &last_rank), handle_);
    return last_rank;
  }

  kolo_fusion_stats_t fusion_stats() const {
    kolo_fusion_stats_t stats{};
    stats.struct_size = sizeof stats;
    detail::check(kolo_comm_fusion_stats(handle_, &stats), handle_);
    return stats;
  }

  void set_fusion_threshold(std::uint64_t bytes) {
    detail::check(kolo_comm_set_fusion_threshold(handle_, bytes), handle_);
  }

  // ---- GPU buffers: device memory as Span(pointer, count); stream is a cudaStream_t ----

  template <class Send, class Recv, detail::if_range<Recv> = 0>
  void allreduce_on_stream(const Send& send, Recv&& recv, kolo_op_t op, void* stream) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    same_size("allreduce_on_stream", in.size(), out.size());
    call_typed(in, out, [&](auto element) {
      return kolo_allreduce_on_stream(handle_, in.data(), out.data(), in.size(), element, op,
                                      stream);
    });
  }
  template <class Send, class Recv, detail::if_range<Recv> = 0>
  void allreduce_scaled_on_stream(const Send& send, Recv&& recv, kolo_op_t op, double prescale,
                                  double postscale, void* stream) {
    auto in = detail::in(send);
    auto out = detail::out(recv);
    same_size("allreduce_scaled_on_stream", in.size(), out.size());
    call_typed(in, out, [&](auto element) {
      return kolo_allreduce_scaled_on_stream(handle_, in.data(), out.data(), in.size(), element,
                                             op, prescale, postscale, stream);
    });
  }
  template <class Buffer, detail::if_range<Buffer> = 0>
  void broadcast_on_stream(Buffer&& buffer, int root, void* stream) {
    auto both = detail::out(buffer);
    detail::check(kolo_broadcast_on_stream(handle_, both.data(), both.size(),
                                           detail::dtype_in(both), root, stream),
                  handle_);
  }
  void stream_synchronize(void* stream) {
    detail::check(kolo_stream_synchronize(handle_, stream), handle_);
  }
  // "nccl", "staged", or "none" before the first GPU collective.
  std::string gpu_backend() const {
    const char* name = nullptr;
    detail::check(kolo_comm_gpu_backend(handle_, &name), handle_);
    return name;
  }

 private:
  int query(kolo_status_t (*getter)(kolo_comm_t, int*)) const {
    int value = 0;
    detail::check(getter(handle_, &value), handle_);
    return value;
  }

  static void same_size(const char* call, std::size_t send, std::size_t recv) {
    detail::require(send == recv, call,
                    "recvbuf has " + detail::elements(recv) + " where sendbuf has " +
                        detail::elements(send));
  }

  // A per-rank counts array has one entry per rank; returns their sum.
  std::uint64_t check_counts(const char* call, Span<const std::uint64_t> counts) const {
    const std::size_t ranks = static_cast<std::size_t>(size());
    detail::require(counts.size() == ranks, call,
                    "counts has " + std::to_string(counts.size()) +
                        " entries, where the communicator has " + std::to_string(ranks) + " ranks");
    std::uint64_t total = 0;
    detail::require(detail::sum_of(counts, &total), call, "the counts add up to more than 2^64 - 1");
    return total;
  }

  static void blocks_inside(const char* call, const char* buffer, Span<const std::uint64_t> counts,
                            Span<const std::int64_t> displs, std::size_t size) {
    for (std::size_t peer = 0; peer < counts.size(); ++peer) {
      if (counts[peer] == 0 || displs[peer] < 0) continue;
      const auto start = static_cast<std::uint64_t>(displs[peer]);
      detail::require(counts[peer] <= size && start <= size - counts[peer], call,
                      std::string(buffer) + " has " + detail::elements(size) + ", and the block of rank " +
                          std::to_string(peer) + " (" + std::to_string(counts[peer]) +
                          " elements at " + std::to_string(start) + ") does not fit in it");
    }
  }

  // Calls c_call(dtype) for buffers of one element type and throws its failure.
  template <class In, class Out, class Call>
  void call_typed(const In&, const Out&, Call&& c_call) {
    using Element = typename Out::element_type;
    detail::same_type<typename In::element_type, Element>();
    detail::check(c_call(dtype_of<Element>()), handle_);
  }

  template <class Call, class In, class Out>
  Request submit(Call&& c_call, const In&, const Out&) {
    using Element = typename Out::element_type;
    detail::same_type<typename In::element_type, Element>();
    kolo_request_t request = nullptr;
    detail::check(c_call(dtype_of<Element>(), &request), handle_);
    return Request(request);
  }

  kolo_comm_t handle_ = nullptr;
};

// kolo_version: the version of the library loaded, as KOLO_VERSION (major * 10000 + minor * 100
// + patch).
inline int version() noexcept { return kolo_version(); }

}  // namespace kolo

#endif  // KOLO_HPP
