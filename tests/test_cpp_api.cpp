// kolo.hpp, the C++ layer over the C ABI: every wrapper against values computed here, and its
// errors (the status and kolo's message in kolo::Exception, the layer's own size checks). Ranks
// run as threads of this process, each with a communicator of its own configured through
// kolo_config_t; the example program (examples/cpp/) runs as real processes. Catch2's assertions
// are not thread-safe, so rank threads only record, and the test thread checks.
#include <catch2/catch.hpp>

#include <array>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "job.hpp"
#include "kolo.hpp"
#include "process.hpp"

// A half type of an application's own, given a dtype as docs/cpp.md shows.
struct ApplicationHalf {
  std::uint16_t bits;
};
template <>
struct kolo::dtype_traits<ApplicationHalf> {
  static constexpr kolo_dtype_t value = KOLO_FLOAT16;
};

// Defined in cpp_api_pedantic.cpp, compiled as C++17 with -Wall -Wextra -Wpedantic -Werror.
int pedantic_translation_unit_version();

namespace {

using kolo::test::kTestSecret;

// A job of `size` ranks as threads: body(comm) runs on each with its own kolo::Comm. The first
// exception of any rank is rethrown here, after every thread has ended.
void on_ranks(int size, const std::function<void(kolo::Comm&)>& body, double timeout_s = 30) {
  const std::string addr = "127.0.0.1:" + std::to_string(kolo::test::free_tcp_port());
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        kolo_config_t config = KOLO_CONFIG_INITIALIZER;
        config.rank = rank;
        config.size = size;
        config.addr = addr.c_str();
        config.secret = kTestSecret;
        config.timeout_s = timeout_s;
        kolo::Comm comm(config);
        body(comm);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

// What a call threw, for checks on the test thread.
struct Thrown {
  bool thrown = false;
  kolo_status_t status = KOLO_SUCCESS;
  std::string message;
  std::string what;
};

template <class Call>
Thrown thrown_by(Call&& call) {
  Thrown result;
  try {
    call();
  } catch (const kolo::Exception& error) {
    result = {true, error.status(), error.message(), error.what()};
  }
  return result;
}

// An int16 sum that wraps, where kolo.h has KOLO_INT16: rank r contributes 30000 + r at every
// element. Returns false (and does nothing) where it has not. A template, so that the call on
// int16 buffers is compiled only where it compiles.
template <class Int16 = std::int16_t>
bool int16_sum(kolo::Comm& comm, std::vector<Int16>* result) {
  if constexpr (kolo::detail::has_dtype<Int16>::value) {
    result->assign(5, static_cast<Int16>(30000 + comm.rank()));
    comm.allreduce(*result, KOLO_SUM);
    return true;
  } else {
    (void)comm;
    (void)result;
    return false;
  }
}

// The value rank r contributes at element i of the collectives below: distinct per rank and
// element, small enough to be exact in every dtype used.
double contribution(int rank, size_t i) { return rank * 100.0 + static_cast<double>(i % 50); }

}  // namespace

TEST_CASE("element types map to kolo dtypes at compile time", "[cpp_api]") {
  static_assert(kolo::dtype_of<float>() == KOLO_FLOAT32);
  static_assert(kolo::dtype_of<const double>() == KOLO_FLOAT64);
  static_assert(kolo::dtype_of<kolo::float16>() == KOLO_FLOAT16);
  static_assert(kolo::dtype_of<kolo::bfloat16>() == KOLO_BFLOAT16);
  static_assert(kolo::dtype_of<std::int8_t>() == KOLO_INT8);
  static_assert(kolo::dtype_of<signed char>() == KOLO_INT8);
  static_assert(kolo::dtype_of<std::uint8_t>() == KOLO_UINT8);
  static_assert(kolo::dtype_of<std::byte>() == KOLO_UINT8);
  static_assert(kolo::dtype_of<std::int32_t>() == KOLO_INT32);
  static_assert(kolo::dtype_of<std::int64_t>() == KOLO_INT64);
  static_assert(kolo::dtype_of<long long>() == KOLO_INT64);
  static_assert(kolo::dtype_of<ApplicationHalf>() == KOLO_FLOAT16);
  static_assert(!kolo::detail::has_dtype<unsigned>::value);
  static_assert(!kolo::detail::has_dtype<std::uint64_t>::value);
  // 16-bit integers where kolo.h has KOLO_INT16 (a later kolo.h), else refused.
  static_assert(kolo::detail::has_dtype<short>::value ==
                kolo::detail::int16_dtype<kolo_dtype_t>::value);
  static_assert(!kolo::detail::has_dtype<unsigned short>::value);
  static_assert(!kolo::detail::has_dtype<bool>::value);
  static_assert(!kolo::detail::has_dtype<wchar_t>::value);
  static_assert(!kolo::detail::has_dtype<long double>::value);
  // Every dtype's element has the size kolo gives it.
  CHECK(kolo_dtype_size(kolo::dtype_of<kolo::float16>()) == sizeof(kolo::float16));
  CHECK(kolo_dtype_size(kolo::dtype_of<kolo::bfloat16>()) == sizeof(kolo::bfloat16));
  CHECK(kolo_dtype_size(kolo::dtype_of<long>()) == sizeof(long));
  CHECK(kolo_dtype_size(kolo::dtype_of<int>()) == sizeof(int));
  CHECK(kolo::version() == KOLO_VERSION);
  CHECK(pedantic_translation_unit_version() == KOLO_VERSION);
}

TEST_CASE("kolo::Span views contiguous ranges and refuses a slice past its end", "[cpp_api]") {
  std::vector<int> values = {1, 2, 3, 4, 5};
  kolo::Span whole(values);
  static_assert(std::is_same_v<decltype(whole), kolo::Span<int>>);
  kolo::Span<const int> read_only = whole;
  CHECK(read_only.data() == values.data());
  CHECK(read_only.size() == 5);
  CHECK(whole.subspan(1, 3)[0] == 2);
  CHECK(whole.first(2).size() == 2);
  CHECK(whole.subspan(5, 0).empty());
  CHECK_THROWS_AS(whole.subspan(4, 2), std::out_of_range);
  CHECK_THROWS_AS(whole.first(6), std::out_of_range);
  const std::array<double, 3> fixed = {1, 2, 3};
  kolo::Span from_array(fixed);
  static_assert(std::is_same_v<decltype(from_array), kolo::Span<const double>>);
  int c_array[4] = {};
  CHECK(kolo::Span(c_array).size() == 4);
  CHECK(kolo::Span(values.data(), 2).size() == 2);
  CHECK(std::accumulate(whole.begin(), whole.end(), 0) == 15);
}

TEST_CASE("kolo::Comm and kolo::Request are move-only and own their handle", "[cpp_api]") {
  static_assert(!std::is_copy_constructible_v<kolo::Comm>);
  static_assert(!std::is_copy_assignable_v<kolo::Comm>);
  static_assert(std::is_nothrow_move_constructible_v<kolo::Comm>);
  static_assert(std::is_nothrow_move_assignable_v<kolo::Comm>);
  static_assert(!std::is_copy_constructible_v<kolo::Request>);
  static_assert(std::is_nothrow_move_constructible_v<kolo::Request>);

  std::vector<int> results(2, -1);
  std::vector<Thrown> moved_from(2);
  on_ranks(2, [&](kolo::Comm& comm) {
    kolo::Comm owner = std::move(comm);  // comm is now empty
    const int rank = owner.rank();
    moved_from[rank] = thrown_by([&] { comm.barrier(); });
    // get() lends the handle to C calls; released and adopted again, it is the same
    // communicator, still working.
    int c_size = 0;
    if (kolo_comm_size(owner.get(), &c_size) != KOLO_SUCCESS || c_size != 2) {
      throw std::runtime_error("kolo_comm_size(owner.get()) did not give 2");
    }
    kolo::Comm adopted(owner.release());
    std::vector<int> value = {rank + 1};
    adopted.allreduce(value, KOLO_SUM);
    results[rank] = value[0];
    kolo::Comm assigned(nullptr);
    assigned = std::move(adopted);  // destroys nothing (assigned was empty)
    assigned.barrier();
  });
  CHECK(results == std::vector<int>{3, 3});
  for (const Thrown& thrown : moved_from) {
    CHECK(thrown.thrown);
    CHECK(thrown.status == KOLO_ERR_INVALID_ARGUMENT);
    CHECK(thrown.message == "the communicator is NULL");
  }
  kolo::Comm empty(nullptr);
  CHECK_FALSE(empty);
  CHECK(empty.get() == nullptr);
  kolo::Request none;
  CHECK_FALSE(none);
  Thrown waited = thrown_by([&] { none.wait(); });
  CHECK(waited.status == KOLO_ERR_INVALID_ARGUMENT);
  CHECK(waited.message.find("empty") != std::string::npos);
}

TEST_CASE("a failed kolo_comm_init throws its status and kolo's message", "[cpp_api]") {
  kolo_config_t config = KOLO_CONFIG_INITIALIZER;
  config.rank = 0;
  config.size = 1;
  config.addr = "127.0.0.1:1";
  config.secret = "too short";
  Thrown thrown = thrown_by([&] { kolo::Comm comm(config); });
  REQUIRE(thrown.thrown);
  CHECK(thrown.status == KOLO_ERR_CONFIG);
  CHECK(thrown.message == kolo_comm_last_error(nullptr));  // the text of kolo's own failure
  CHECK(thrown.message.find("secret") != std::string::npos);
  CHECK(thrown.what == "KOLO_ERR_CONFIG: " + thrown.message);

  kolo_config_t unfilled;
  std::memset(&unfilled, 0, sizeof unfilled);
  thrown = thrown_by([&] { kolo::Comm comm(unfilled); });
  CHECK(thrown.status == KOLO_ERR_INVALID_ARGUMENT);
  CHECK(thrown.message.find("KOLO_CONFIG_INITIALIZER") != std::string::npos);
}

TEST_CASE("the blocking collectives of kolo.hpp give what the C calls define", "[cpp_api]") {
  const int size = 3;
  const size_t count = 7;  // per rank block, prime
  struct Outcome {
    int rank = -1, size = -1, local_rank = -1, local_size = -1;
    std::vector<float> allreduce_sum;
    std::vector<std::int32_t> allreduce_max_in_place;
    std::vector<double> scaled, scaled_in_place;
    std::vector<std::int64_t> broadcast;
    std::vector<double> allgather, allgather_in_place, allgatherv;
    std::vector<float> reduce_scatter, reduce_scatterv;
    std::vector<std::int32_t> alltoall, alltoallv;
    std::vector<double> reduce, reduce_in_place;
    std::vector<std::uint8_t> received;
    bool has_int16 = false;
    std::vector<std::int16_t> int16;
    std::vector<std::uint16_t> half_bits, bfloat_bits;
  };
  std::vector<Outcome> outcomes(size);
  const std::vector<std::uint64_t> v_counts = {2, 0, 5};

  on_ranks(size, [&](kolo::Comm& comm) {
    Outcome& out = outcomes[static_cast<size_t>(comm.rank())];
    out.rank = comm.rank();
    out.size = comm.size();
    out.local_rank = comm.local_rank();
    out.local_size = comm.local_size();
    const int rank = out.rank;
    auto mine = [&](size_t n, size_t offset = 0) {
      std::vector<double> values(n);
      for (size_t i = 0; i < n; ++i) values[i] = contribution(rank, offset + i);
      return values;
    };

    std::vector<double> base = mine(count);
    std::vector<float> send_float(base.begin(), base.end());
    out.allreduce_sum.resize(count);
    comm.allreduce(send_float, out.allreduce_sum, KOLO_SUM);

    out.allreduce_max_in_place.assign(base.begin(), base.end());
    comm.allreduce(out.allreduce_max_in_place, KOLO_MAX);

    out.scaled.resize(count);
    comm.allreduce_scaled(base, out.scaled, KOLO_SUM, 2.0, 0.5);
    out.scaled_in_place = base;
    comm.allreduce_scaled(out.scaled_in_place, KOLO_SUM, 1.0, 2.0);

    out.broadcast.assign(count, rank == 1 ? 42 : -1);
    comm.broadcast(out.broadcast, 1);

    comm.barrier();

    out.allgather.resize(size * count);
    comm.allgather(base, out.allgather);
    out.allgather_in_place.assign(size * count, -1.0);
    std::copy(base.begin(), base.end(), out.allgather_in_place.begin() + rank * count);
    kolo::Span gathered(out.allgather_in_place);
    comm.allgather(gathered.subspan(rank * count, count), gathered);

    out.allgatherv.resize(7);
    comm.allgatherv(mine(v_counts[rank]), out.allgatherv, v_counts);

    std::vector<double> whole = mine(size * count);
    std::vector<float> whole_float(whole.begin(), whole.end());
    out.reduce_scatter.resize(count);
    comm.reduce_scatter(whole_float, out.reduce_scatter, KOLO_SUM);
    std::vector<float> v_send(whole_float.begin(), whole_float.begin() + 7);
    out.reduce_scatterv.resize(v_counts[rank]);
    comm.reduce_scatterv(v_send, out.reduce_scatterv, v_counts, KOLO_SUM);

    std::vector<std::int32_t> to_all(size * 2);
    for (int peer = 0; peer < size; ++peer) {
      to_all[peer * 2] = rank * 10 + peer;
      to_all[peer * 2 + 1] = -(rank * 10 + peer);
    }
    out.alltoall.resize(size * 2);
    comm.alltoall(to_all, out.alltoall);

    // alltoallv: rank r sends r + 1 elements (each r * 10 + p) to every rank p.
    std::vector<std::uint64_t> send_counts(size, rank + 1), recv_counts(size);
    std::vector<std::int64_t> send_displs(size), recv_displs(size);
    std::vector<std::int32_t> v_out;
    std::int64_t offset = 0;
    for (int peer = 0; peer < size; ++peer) {
      send_displs[peer] = peer * (rank + 1);
      for (int k = 0; k <= rank; ++k) v_out.push_back(rank * 10 + peer);
      recv_counts[peer] = peer + 1;
      recv_displs[peer] = offset;
      offset += peer + 1;
    }
    out.alltoallv.resize(offset);
    comm.alltoallv(v_out, send_counts, send_displs, out.alltoallv, recv_counts, recv_displs);

    // reduce to rank 2; the others pass an empty recvbuf.
    out.reduce.resize(rank == 2 ? count : 0);
    comm.reduce(base, out.reduce, KOLO_MIN, 2);
    out.reduce_in_place = base;
    comm.reduce(out.reduce_in_place, KOLO_SUM, 0);

    // A message round the ring: rank 0 sends first, every other rank receives, then sends on.
    std::vector<std::uint8_t> message(5);
    const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
    if (rank == 0) {
      std::vector<std::uint8_t> first = {1, 2, 3, 4, 5};
      comm.send(first, next, 9);
      comm.recv(message, previous, 9);
    } else {
      comm.recv(message, previous, 9);
      for (auto& byte : message) byte = static_cast<std::uint8_t>(byte + 1);
      comm.send(message, next, 9);
    }
    out.received = message;
    out.has_int16 = int16_sum(comm, &out.int16);
    // Half types as bits: 1.0 on every rank sums to 3.0 (binary16 0x3c00 -> 0x4200, bfloat16
    // 0x3f80 -> 0x4040).
    std::vector<ApplicationHalf> halves(4, ApplicationHalf{0x3c00});
    comm.allreduce(halves, KOLO_SUM);
    std::array<kolo::bfloat16, 2> bfloats = {kolo::bfloat16{0x3f80}, kolo::bfloat16{0x3f80}};
    comm.allreduce(bfloats, KOLO_SUM);
    for (const auto& half : halves) out.half_bits.push_back(half.bits);
    for (const auto& bfloat : bfloats) out.bfloat_bits.push_back(bfloat.bits);
  });

  for (int rank = 0; rank < size; ++rank) {
    const Outcome& out = outcomes[rank];
    INFO("rank " << rank);
    CHECK(out.rank == rank);
    CHECK(out.size == size);
    CHECK(out.local_rank == rank);  // every thread is on this host
    CHECK(out.local_size == size);
    for (size_t i = 0; i < count; ++i) {
      double sum = 0, maximum = -1e300;
      for (int r = 0; r < size; ++r) {
        sum += contribution(r, i);
        maximum = std::max(maximum, contribution(r, i));
      }
      CHECK(out.allreduce_sum[i] == static_cast<float>(sum));
      CHECK(out.allreduce_max_in_place[i] == static_cast<std::int32_t>(maximum));
      CHECK(out.scaled[i] == sum);  // 2 * each input, summed, times 0.5
      CHECK(out.scaled_in_place[i] == 2 * sum);
      CHECK(out.broadcast[i] == 42);
      CHECK(out.reduce_scatter[i] == static_cast<float>(
                                         contribution(0, rank * count + i) +
                                         contribution(1, rank * count + i) +
                                         contribution(2, rank * count + i)));
      if (rank == 0) {
        CHECK(out.reduce_in_place[i] == sum);
      } else {  // the buffer of a rank other than the root is only read
        CHECK(out.reduce_in_place[i] == contribution(rank, i));
      }
      if (rank == 2) {
        CHECK(out.reduce[i] == contribution(0, i));
      }
    }
    for (int r = 0; r < size; ++r) {
      for (size_t i = 0; i < count; ++i) {
        CHECK(out.allgather[r * count + i] == contribution(r, i));
        CHECK(out.allgather_in_place[r * count + i] == contribution(r, i));
      }
    }
    std::vector<double> expected_v;
    for (int r = 0; r < size; ++r) {
      for (size_t i = 0; i < v_counts[r]; ++i) expected_v.push_back(contribution(r, i));
    }
    CHECK(out.allgatherv == expected_v);
    std::vector<float> expected_rsv;
    size_t start = std::accumulate(v_counts.begin(), v_counts.begin() + rank, size_t{0});
    for (size_t i = 0; i < v_counts[rank]; ++i) {
      double sum = 0;
      for (int r = 0; r < size; ++r) sum += contribution(r, start + i);
      expected_rsv.push_back(static_cast<float>(sum));
    }
    CHECK(out.reduce_scatterv == expected_rsv);
    std::vector<std::int32_t> expected_a2a, expected_a2av;
    for (int r = 0; r < size; ++r) {
      expected_a2a.push_back(r * 10 + rank);
      expected_a2a.push_back(-(r * 10 + rank));
      for (int k = 0; k <= r; ++k) expected_a2av.push_back(r * 10 + rank);
    }
    CHECK(out.alltoall == expected_a2a);
    CHECK(out.alltoallv == expected_a2av);
    // Round the ring, rank r > 0 kept the message after its own increment (r in all); rank 0
    // got it back incremented size - 1 times.
    const int increments = rank == 0 ? size - 1 : rank;
    std::vector<std::uint8_t> expected_message;
    for (std::uint8_t byte = 1; byte <= 5; ++byte) {
      expected_message.push_back(static_cast<std::uint8_t>(byte + increments));
    }
    CHECK(out.received == expected_message);
    CHECK(out.half_bits == std::vector<std::uint16_t>(4, 0x4200));
    CHECK(out.bfloat_bits == std::vector<std::uint16_t>(2, 0x4040));
    if (out.has_int16) {  // the sum modulo 2^16, as two's complement
      const std::uint32_t sum = 3 * 30000 + 0 + 1 + 2;
      CHECK(out.int16 == std::vector<std::int16_t>(5, static_cast<std::int16_t>(sum & 0xffff)));
    }
  }
}

TEST_CASE("kolo.hpp's size checks refuse before calling kolo, and kolo's refusals throw",
          "[cpp_api]") {
  const int size = 2;
  std::vector<std::vector<Thrown>> thrown(size);
  std::vector<std::string> last_error_after_checks(size);
  std::vector<std::vector<double>> after(size);
  on_ranks(size, [&](kolo::Comm& comm) {
    const int rank = comm.rank();
    std::vector<Thrown>& mine = thrown[rank];
    std::vector<double> four(4, 1.0), three(3, 1.0), six(6, 1.0);
    std::vector<std::uint64_t> counts_short = {4};
    std::vector<std::uint64_t> counts = {4, 4};
    std::vector<std::int64_t> displs = {0, 2};
    std::vector<std::uint64_t> block_counts = {2, 3};  // rank 1's block of 3 at 2 passes the end
    // The layer's own checks (indices 0-8).
    mine.push_back(thrown_by([&] { comm.allreduce(four, three, KOLO_SUM); }));
    mine.push_back(thrown_by([&] { comm.allgather(four, six); }));
    mine.push_back(thrown_by([&] { comm.reduce_scatter(six, four, KOLO_SUM); }));
    mine.push_back(thrown_by([&] { comm.alltoall(three, three); }));
    mine.push_back(thrown_by([&] { comm.allgatherv(four, six, counts_short); }));
    mine.push_back(thrown_by([&] { comm.allgatherv(four, six, counts); }));
    mine.push_back(thrown_by([&] { comm.reduce_scatterv(six, four, counts, KOLO_SUM); }));
    mine.push_back(thrown_by(
        [&] { comm.alltoallv(four, block_counts, displs, four, block_counts, displs); }));
    mine.push_back(thrown_by([&] { comm.reduce(four, three, KOLO_SUM, 0); }));
    last_error_after_checks[rank] = comm.last_error();  // "": kolo was not called
    // kolo's own refusals (indices 9-11): the message is the communicator's last error.
    mine.push_back(thrown_by([&] { comm.allreduce(four, static_cast<kolo_op_t>(99)); }));
    mine.back().what = comm.last_error();
    mine.push_back(thrown_by([&] { comm.broadcast(four, size); }));
    mine.back().what = comm.last_error();
    mine.push_back(thrown_by([&] { comm.send(four, rank, 0); }));
    mine.back().what = comm.last_error();
    // Argument errors leave the communicator working.
    comm.allreduce(four, KOLO_SUM);
    after[rank] = four;
  });
  const std::vector<std::string> expected = {
      "kolo::Comm::allreduce: recvbuf has 3 elements where sendbuf has 4 elements",
      "kolo::Comm::allgather: recvbuf has 6 elements, not 2 times sendbuf's 4 elements",
      "kolo::Comm::reduce_scatter: sendbuf has 6 elements, not 2 times recvbuf's 4 elements",
      "kolo::Comm::alltoall: sendbuf has 3 elements and recvbuf 3 elements: both must hold 2 "
      "blocks of one count",
      "kolo::Comm::allgatherv: counts has 1 entries, where the communicator has 2 ranks",
      "kolo::Comm::allgatherv: recvbuf has 6 elements where the counts add up to 8",
      "kolo::Comm::reduce_scatterv: sendbuf has 6 elements where the counts add up to 8",
      "kolo::Comm::alltoallv: sendbuf has 4 elements, and the block of rank 1 (3 elements at 2) "
      "does not fit in it",
      "kolo::Comm::reduce: recvbuf has 3 elements where sendbuf has 4 elements (an empty recvbuf "
      "is for ranks other than the root)",
  };
  for (int rank = 0; rank < size; ++rank) {
    INFO("rank " << rank);
    REQUIRE(thrown[rank].size() == 12);
    for (size_t i = 0; i < expected.size(); ++i) {
      CHECK(thrown[rank][i].thrown);
      CHECK(thrown[rank][i].status == KOLO_ERR_INVALID_ARGUMENT);
      CHECK(thrown[rank][i].message == expected[i]);
      CHECK(thrown[rank][i].what == "KOLO_ERR_INVALID_ARGUMENT: " + expected[i]);
    }
    CHECK(last_error_after_checks[rank].empty());
    for (size_t i = expected.size(); i < 12; ++i) {
      INFO("kolo's refusal " << i);
      CHECK(thrown[rank][i].status == KOLO_ERR_INVALID_ARGUMENT);
      CHECK_FALSE(thrown[rank][i].message.empty());
      CHECK(thrown[rank][i].message == thrown[rank][i].what);  // what held last_error()
    }
    CHECK(thrown[rank][10].message.find("root") != std::string::npos);
    CHECK(after[rank] == std::vector<double>(4, 2.0));
  }
}

TEST_CASE("ranks that disagree get KOLO_ERR_MISMATCH as an exception on every rank",
          "[cpp_api]") {
  const int size = 2;
  std::vector<Thrown> mismatch(size), later(size);
  on_ranks(size, [&](kolo::Comm& comm) {
    const int rank = comm.rank();
    std::vector<float> values(rank == 0 ? 100 : 101, 1.0f);
    mismatch[rank] = thrown_by([&] { comm.allreduce(values, KOLO_SUM); });
    later[rank] = thrown_by([&] { comm.barrier(); });  // broken: the same status again
  });
  for (int rank = 0; rank < size; ++rank) {
    INFO("rank " << rank << ": " << mismatch[rank].what);
    CHECK(mismatch[rank].status == KOLO_ERR_MISMATCH);
    CHECK(mismatch[rank].message.find("count 100") != std::string::npos);
    CHECK(mismatch[rank].message.find("count 101") != std::string::npos);
    CHECK(later[rank].status == KOLO_ERR_MISMATCH);
  }
}

TEST_CASE("split gives sub-communicators and an empty Comm for KOLO_COLOR_NONE", "[cpp_api]") {
  const int size = 3;
  std::vector<int> sub_size(size, -1), sub_rank(size, -1), sums(size, -1);
  std::vector<bool> empty(size);
  on_ranks(size, [&](kolo::Comm& comm) {
    const int rank = comm.rank();
    // Ranks 0 and 2 form one communicator, ranked in reverse by key; rank 1 joins none.
    kolo::Comm sub = comm.split(rank == 1 ? KOLO_COLOR_NONE : 0, -rank);
    empty[rank] = !sub;
    if (sub) {
      sub_size[rank] = sub.size();
      sub_rank[rank] = sub.rank();
      std::vector<int> value = {rank};
      sub.allreduce(value, KOLO_SUM);
      sums[rank] = value[0];
    }
    comm.barrier();  // the parent still works
  });
  CHECK(empty == std::vector<bool>{false, true, false});
  CHECK(sub_size == std::vector<int>{2, -1, 2});
  CHECK(sub_rank == std::vector<int>{1, -1, 0});
  CHECK(sums == std::vector<int>{2, -1, 2});
}

TEST_CASE("shrink gives a communicator of the ranks that are left", "[cpp_api]") {
  const int size = 3;
  std::vector<int> shrunk_size(size, -1), sums(size, -1);
  std::vector<Thrown> lost(size), old_after(size);
  on_ranks(size, [&](kolo::Comm& comm) {
    const int rank = comm.rank();
    if (rank == 2) {  // leaves the job: its communicator is destroyed
      comm = kolo::Comm(nullptr);
      return;
    }
    std::vector<int> value = {1};
    lost[rank] = thrown_by([&] { comm.allreduce(value, KOLO_SUM); });
    kolo::Comm shrunk = comm.shrink();
    shrunk_size[rank] = shrunk.size();
    value = {rank + 1};
    shrunk.allreduce(value, KOLO_SUM);
    sums[rank] = value[0];
    old_after[rank] = thrown_by([&] { comm.barrier(); });
  });
  for (int rank = 0; rank < 2; ++rank) {
    INFO("rank " << rank << ": " << lost[rank].what);
    CHECK(lost[rank].thrown);
    CHECK(lost[rank].status == KOLO_ERR_PEER_LOST);
    CHECK(lost[rank].message.find("rank 2") != std::string::npos);
    CHECK(shrunk_size[rank] == 2);
    CHECK(sums[rank] == 3);
    CHECK(old_after[rank].status == KOLO_ERR_PEER_LOST);
  }
}

TEST_CASE("named asynchronous operations return requests to wait on and test", "[cpp_api]") {
  const int size = 3;
  struct Outcome {
    std::vector<float> out_of_place, in_place, group_a, group_b, group_c, group_d, group_e;
    std::vector<std::int64_t> broadcast;
    std::vector<double> gathered;
    std::vector<std::uint64_t> gathered_counts;
    int last_joined = -2;
    bool tested_done = false;
    Thrown mismatch, bad_name, bad_threshold;
    std::string mismatch_last_error;
    kolo_fusion_stats_t stats{};
  };
  std::vector<Outcome> outcomes(size);
  on_ranks(size, [&](kolo::Comm& comm) {
    const int rank = comm.rank();
    Outcome& out = outcomes[rank];
    std::vector<float> send(5, static_cast<float>(rank + 1));
    out.out_of_place.resize(5);
    out.in_place.assign(3, static_cast<float>(rank));
    out.broadcast.assign(4, rank == 2 ? 7 : 0);
    kolo_async_options_t halve = KOLO_ASYNC_OPTIONS_INITIALIZER;
    halve.postscale = 0.5;
    kolo::Request a = comm.allreduce_async("grad.a", send, out.out_of_place, KOLO_SUM);
    kolo::Request b = comm.allreduce_async("grad.b", out.in_place, KOLO_SUM, &halve);
    // A request released to C and adopted back.
    kolo::Request c(comm.broadcast_async("weights", out.broadcast, 2).release());
    a.wait();
    b.wait();
    while (!c.test()) std::this_thread::yield();
    out.tested_done = c.test();

    // A group: two members out of place, one in place.
    out.group_a.resize(2);
    out.group_b.resize(3);
    out.group_c.assign(1, static_cast<float>(rank));
    std::vector<float> send_a(2, 1.0f), send_b(3, static_cast<float>(rank));
    kolo::Request group = comm.allreduce_group_async(
        {"group.a", "group.b", "group.c"},
        std::vector<kolo::Span<const float>>{send_a, send_b, out.group_c},
        std::vector<kolo::Span<float>>{out.group_a, out.group_b, out.group_c}, KOLO_MAX);
    group.wait();
    // A group in place.
    out.group_d.assign(2, static_cast<float>(rank));
    out.group_e.assign(4, 1.0f);
    comm.allreduce_group_async({"group.d", "group.e"},
                               std::vector<kolo::Span<float>>{out.group_d, out.group_e}, KOLO_SUM)
        .wait();

    // Horovod's allgather: rank r sends r + 1 elements.
    std::vector<double> mine(static_cast<size_t>(rank + 1), rank * 1.5);
    out.gathered.resize(10);
    kolo::Request gather = comm.allgather_async("gather", mine, out.gathered);
    gather.wait();
    out.gathered_counts = gather.counts(comm.size());

    // A tensor the ranks submit with different counts fails on every rank, naming it.
    std::vector<float> odd(rank == 0 ? 2 : 3, 1.0f);
    kolo::Request wrong = comm.allreduce_async("mismatched", odd, KOLO_SUM);
    out.mismatch = thrown_by([&] { wrong.wait(); });
    out.mismatch_last_error = wrong.last_error();
    out.bad_name = thrown_by([&] { comm.allreduce_async("", odd, KOLO_SUM); });
    out.bad_threshold = thrown_by([&] { comm.set_fusion_threshold(std::uint64_t{5} << 30); });
    comm.set_fusion_threshold(1 << 20);
    out.stats = comm.fusion_stats();
    out.last_joined = comm.join();
  });
  for (int rank = 0; rank < size; ++rank) {
    const Outcome& out = outcomes[rank];
    INFO("rank " << rank);
    CHECK(out.out_of_place == std::vector<float>(5, 6.0f));
    CHECK(out.in_place == std::vector<float>(3, 1.5f));  // (0 + 1 + 2) / 2
    CHECK(out.broadcast == std::vector<std::int64_t>(4, 7));
    CHECK(out.tested_done);
    CHECK(out.group_a == std::vector<float>(2, 1.0f));
    CHECK(out.group_b == std::vector<float>(3, 2.0f));
    CHECK(out.group_c == std::vector<float>(1, 2.0f));
    CHECK(out.group_d == std::vector<float>(2, 3.0f));
    CHECK(out.group_e == std::vector<float>(4, 3.0f));
    CHECK(out.gathered_counts == std::vector<std::uint64_t>{1, 2, 3});
    CHECK(out.gathered == std::vector<double>{0, 1.5, 1.5, 3, 3, 3, 0, 0, 0, 0});
    CHECK(out.mismatch.status == KOLO_ERR_MISMATCH);
    CHECK(out.mismatch.message.find("mismatched") != std::string::npos);
    CHECK(out.mismatch.message == out.mismatch_last_error);
    CHECK(out.bad_name.status == KOLO_ERR_INVALID_ARGUMENT);
    CHECK_FALSE(out.bad_name.message.empty());
    CHECK(out.bad_threshold.status == KOLO_ERR_INVALID_ARGUMENT);
    CHECK(out.stats.requests_completed == 6);
    CHECK(out.stats.requests_failed == 1);
    CHECK(out.last_joined >= 0);
    CHECK(out.last_joined == outcomes[0].last_joined);
  }
}

TEST_CASE("the GPU calls throw kolo's refusal of host buffers", "[cpp_api]") {
  std::vector<std::string> backend(1);
  std::vector<Thrown> on_stream(1), scaled(1), broadcast(1), synchronize(1);
  std::vector<std::string> last_error(1);
  on_ranks(1, [&](kolo::Comm& comm) {
    backend[0] = comm.gpu_backend();
    std::vector<float> host(4, 1.0f), result(4);
    on_stream[0] = thrown_by([&] { comm.allreduce_on_stream(host, result, KOLO_SUM, nullptr); });
    last_error[0] = comm.last_error();
    scaled[0] = thrown_by(
        [&] { comm.allreduce_scaled_on_stream(host, result, KOLO_SUM, 1.0, 2.0, nullptr); });
    broadcast[0] = thrown_by([&] { comm.broadcast_on_stream(host, 0, nullptr); });
    // With a GPU, synchronizing the default stream succeeds; without, it is refused.
    synchronize[0] = thrown_by([&] { comm.stream_synchronize(nullptr); });
  });
  CHECK(backend[0] == "none");
  // Without CUDA or a GPU: KOLO_ERR_UNSUPPORTED; with one, host memory is an invalid argument.
  for (const Thrown& thrown : {on_stream[0], scaled[0], broadcast[0]}) {
    CHECK(thrown.thrown);
    CHECK((thrown.status == KOLO_ERR_UNSUPPORTED || thrown.status == KOLO_ERR_INVALID_ARGUMENT));
    CHECK_FALSE(thrown.message.empty());
  }
  CHECK(on_stream[0].message == last_error[0]);
  if (synchronize[0].thrown) {
    CHECK(synchronize[0].status == KOLO_ERR_UNSUPPORTED);
    CHECK(on_stream[0].status == KOLO_ERR_UNSUPPORTED);
  }
}

TEST_CASE("the C++ example runs as a job of real processes", "[cpp_api]") {
  for (int size : {1, 2, 3}) {
    INFO("size " << size);
    kolo::test::Job job = kolo::test::start_job(size, {}, {}, "tests/kolo_cpp_example");
    auto results = job.wait(60);
    kolo::test::expect_all_pass(results, "of " + std::to_string(size) + ": ok");
  }
}
