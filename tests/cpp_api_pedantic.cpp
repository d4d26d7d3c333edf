// kolo.hpp under the flags of a strict C++17 consumer (tests/meson.build: -std=c++17 -Wall -Wextra
// -Werror -pedantic): every wrapper is instantiated here, so that a warning or a later-standard
// feature anywhere in the header fails the build of test_cpp_api.
#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "kolo.hpp"

int pedantic_translation_unit_version();

namespace {

[[maybe_unused]] void instantiate_every_wrapper(kolo::Comm& comm) {
  std::vector<float> a(4), b(4);
  std::array<std::int32_t, 4> integers{};
  double plain[3] = {};
  std::vector<std::uint64_t> counts{1, 2};
  std::vector<std::int64_t> displs{0, 1};
  comm.allreduce(a, b, KOLO_SUM);
  comm.allreduce(a, KOLO_SUM);
  comm.allreduce(integers, KOLO_MAX);
  comm.allreduce(plain, KOLO_SUM);
  comm.allreduce(kolo::Span(a.data(), 2), kolo::Span(b).first(2), KOLO_SUM);
  comm.allreduce_scaled(a, b, KOLO_SUM, 1.0, 2.0);
  comm.allreduce_scaled(a, KOLO_SUM, 1.0, 2.0);
  comm.broadcast(a, 0);
  comm.barrier();
  comm.allgather(a, b);
  comm.allgatherv(a, b, counts);
  comm.reduce_scatter(a, b, KOLO_SUM);
  comm.reduce_scatterv(a, b, counts, KOLO_SUM);
  comm.alltoall(a, b);
  comm.alltoallv(a, counts, displs, b, counts, displs);
  comm.reduce(a, b, KOLO_SUM, 0);
  comm.reduce(a, KOLO_SUM, 0);
  comm.send(a, 1, 0);
  comm.recv(b, 1, 0);
  kolo::Comm sub = comm.split(0, 0);
  kolo::Comm shrunk = comm.shrink();
  kolo::Request request = comm.allreduce_async("a", a, b, KOLO_SUM);
  request = comm.allreduce_async("b", a, KOLO_SUM);
  request.wait();
  (void)request.test();
  (void)request.counts(2);
  (void)request.last_error();
  request = comm.broadcast_async("c", a, 0);
  request = comm.allgather_async("d", a, b);
  std::vector<kolo::Span<float>> buffers{kolo::Span(a), kolo::Span(b)};
  request = comm.allreduce_group_async({"e", "f"}, buffers, KOLO_SUM);
  (void)comm.join();
  (void)comm.fusion_stats();
  comm.set_fusion_threshold(1);
  comm.allreduce_on_stream(a, b, KOLO_SUM, nullptr);
  comm.allreduce_scaled_on_stream(a, b, KOLO_SUM, 1.0, 1.0, nullptr);
  comm.broadcast_on_stream(a, 0, nullptr);
  comm.stream_synchronize(nullptr);
  (void)comm.gpu_backend();
  std::vector<std::byte> bytes(3);
  comm.broadcast(bytes, 0);
  std::string text = "ab";
  comm.broadcast(text, 0);
  std::vector<long long> wide(2);
  comm.allreduce(wide, KOLO_SUM);
  std::vector<kolo::bfloat16> halves(2);
  comm.allreduce(halves, KOLO_SUM);
  (void)comm.rank();
  (void)comm.size();
  (void)comm.local_rank();
  (void)comm.local_size();
  (void)comm.last_error();
  kolo::Comm adopted(comm.release());
}

}  // namespace

int pedantic_translation_unit_version() { return kolo::version(); }
