// The GPU tests: the device kernels against the host kernels, device fusion of many small
// tensors, and device buffers across real processes (tests/gpu/gpu_worker.cpp) on the NCCL path,
// on the staged path with several ranks sharing one GPU, and with a peer killed.
//
// Without a usable GPU the program prints why (CUDA's error) and exits with 77, which Meson
// reports as SKIP: these tests never pass without running. One Meson test per Catch2 tag
// (tests/gpu/meson.build).
#define CATCH_CONFIG_RUNNER
#include <cuda_runtime_api.h>
#include <signal.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../job.hpp"
#include "../process.hpp"
#include "comm/communicator.hpp"
#include "core/config.hpp"
#include "core/reduce.hpp"
#include "gpu/kernels.hpp"
#include "kolo_build_config.h"

namespace {

using kolo::DataType;
using kolo::test::expect_all_pass;

int g_devices = 0;

void cuda(cudaError_t error, const char* what) {
  INFO(what << ": " << cudaGetErrorName(error) << " " << cudaGetErrorString(error));
  REQUIRE(error == cudaSuccess);
}

// Device memory for one test; freed at the end of the scope.
struct DeviceMemory {
  explicit DeviceMemory(size_t size) : bytes(size) { cuda(cudaMalloc(&data, size), "cudaMalloc"); }
  ~DeviceMemory() { cudaFree(data); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  std::byte* get() const { return static_cast<std::byte*>(data); }
  void* data = nullptr;
  size_t bytes;
};

void to_device(DeviceMemory& device, const std::vector<uint8_t>& host) {
  cuda(cudaMemcpy(device.data, host.data(), host.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
}
std::vector<uint8_t> to_host(const DeviceMemory& device, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  cuda(cudaMemcpy(host.data(), device.data, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return host;
}

const DataType kAllTypes[] = {DataType::kFloat32,  DataType::kFloat64, DataType::kFloat16,
                              DataType::kBFloat16, DataType::kInt8,    DataType::kUInt8,
                              DataType::kInt32,    DataType::kInt64};  // no int16: NCCL has none

// Random elements of dtype: finite floats (no NaN, whose payloads need not survive, and no -0,
// which a host sum 0 + -0 turns into +0), any bits for integers.
std::vector<uint8_t> random_elements(DataType dtype, size_t count, std::mt19937_64& rng) {
  const size_t size = kolo::dtype_size(dtype);
  std::vector<uint8_t> bytes(count * size);
  std::uniform_real_distribution<double> real(-1000.0, 1000.0);
  for (size_t i = 0; i < count; ++i) {
    uint8_t* p = bytes.data() + i * size;
    switch (dtype) {
      case DataType::kFloat32: {
        float v = static_cast<float>(real(rng));
        if (v == 0) v = 1;
        std::memcpy(p, &v, 4);
        break;
      }
      case DataType::kFloat64: {
        double v = real(rng);
        if (v == 0) v = 1;
        std::memcpy(p, &v, 8);
        break;
      }
      case DataType::kFloat16:
      case DataType::kBFloat16: {
        // Any finite value, subnormals included: exponent not all ones, not -0.
        const uint16_t exponent_mask = dtype == DataType::kFloat16 ? 0x7c00 : 0x7f80;
        uint16_t v;
        do {
          v = static_cast<uint16_t>(rng());
        } while ((v & exponent_mask) == exponent_mask || v == 0x8000);
        std::memcpy(p, &v, 2);
        break;
      }
      default: {
        const uint64_t v = rng();
        std::memcpy(p, &v, size);
      }
    }
  }
  return bytes;
}

size_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
                        size_t element) {
  for (size_t i = 0; i * element < a.size(); ++i) {
    if (std::memcmp(&a[i * element], &b[i * element], element) != 0) return i;
  }
  return a.size() / element;
}

std::string element_hex(const std::vector<uint8_t>& bytes, size_t i, size_t element) {
  uint64_t bits = 0;
  std::memcpy(&bits, &bytes[i * element], element);
  char text[32];
  std::snprintf(text, sizeof(text), "0x%0*llx", static_cast<int>(element * 2),
                static_cast<unsigned long long>(bits));
  return text;
}

// ---- Multi-process jobs of kolo_gpu_worker
// -------------------------------------------------------

kolo::test::Job start_gpu_job(int size, const std::vector<std::string>& worker_args,
                              const std::map<std::string, std::string>& extra_env) {
  kolo::test::Job job;
  job.port = kolo::test::free_tcp_port();
  for (int rank = 0; rank < size; ++rank) {
    std::map<std::string, std::string> env = {
        {"KOLO_RANK", std::to_string(rank)},
        {"KOLO_SIZE", std::to_string(size)},
        {"KOLO_ADDR", "127.0.0.1:" + std::to_string(job.port)},
        {"KOLO_SECRET", kolo::test::kTestSecret},
        {"KOLO_TIMEOUT", "60"},
    };
    for (const auto& [key, value] : extra_env) env[key] = value;
    std::vector<std::string> argv = {kolo::test::built_program("tests/gpu/kolo_gpu_worker")};
    argv.insert(argv.end(), worker_args.begin(), worker_args.end());
    job.ranks.emplace_back(argv, env);
  }
  return job;
}

// A communicator of one rank in this process, for the tests that call the C++ core directly.
std::unique_ptr<kolo::Communicator> single_rank_communicator() {
  kolo::ConfigOverrides overrides;
  overrides.rank = 0;
  overrides.size = 1;
  overrides.addr = "127.0.0.1:" + std::to_string(kolo::test::free_tcp_port());
  overrides.secret = kolo::test::kTestSecret;
  overrides.timeout_s = 60;
  return std::make_unique<kolo::Communicator>(overrides);
}

}  // namespace

// ---- Kernels ------------------------------------------------------------------------------------

TEST_CASE("device scaling is bitwise the host kernels' prescale, every dtype", "[kernels]") {
  std::mt19937_64 rng(42);
  const size_t count = 100003;
  for (DataType dtype : kAllTypes) {
    const size_t element = kolo::dtype_size(dtype);
    for (double factor : {0.5, 3.0, -1.25, 1.0 / 3.0, 1e10, -7e-3}) {
      DYNAMIC_SECTION(kolo::dtype_name(dtype) << " times " << factor) {
        const std::vector<uint8_t> input = random_elements(dtype, count, rng);
        std::vector<uint8_t> expected(input.size());
        kolo::ReduceSpec spec;
        spec.dtype = dtype;
        spec.op = kolo::ReduceOp::kSum;
        spec.prescale = factor;
        spec.ranks = 1;
        kolo::reduce_single(expected.data(), input.data(), count, spec);

        DeviceMemory source(input.size()), destination(input.size());
        to_device(source, input);
        kolo::gpu::scale(source.data, destination.data, count, dtype, factor, {});
        const std::vector<uint8_t> got = to_host(destination, input.size());
        const size_t bad = first_difference(got, expected, element);
        INFO("element " << bad << " of " << count << ": input " << element_hex(input, bad, element)
                        << " expected " << element_hex(expected, bad, element) << " got "
                        << (bad < count ? element_hex(got, bad, element) : "-"));
        CHECK(bad == count);
        // In place gives the same.
        kolo::gpu::scale(source.data, source.data, count, dtype, factor, {});
        CHECK(to_host(source, input.size()) == expected);
      }
    }
  }
}

TEST_CASE("device finish (AVG's division, then the postscale) is bitwise the host kernels'",
          "[kernels]") {
  std::mt19937_64 rng(43);
  const size_t count = 65537;
  for (DataType dtype : kAllTypes) {
    const size_t element = kolo::dtype_size(dtype);
    const DataType accumulator = kolo::accumulator_type(dtype);
    for (int ranks : {1, 3, 8}) {
      for (double postscale : {1.0, 0.25, 3.5}) {
        if (ranks == 1 && postscale == 1.0) continue;
        DYNAMIC_SECTION(kolo::dtype_name(dtype)
                        << " over " << ranks << " postscale " << postscale) {
          const std::vector<uint8_t> input = random_elements(dtype, count, rng);
          // The host's last step of an AVG: 0 + own, divided by ranks, times postscale.
          const std::vector<uint8_t> zeros(count * kolo::dtype_size(accumulator), 0);
          std::vector<uint8_t> expected(input.size());
          kolo::ReduceSpec spec;
          spec.dtype = dtype;
          spec.op = kolo::ReduceOp::kAvg;
          spec.postscale = postscale;
          spec.ranks = ranks;
          kolo::reduce_finish(expected.data(), zeros.data(), input.data(), count, spec);

          DeviceMemory data(input.size());
          to_device(data, input);
          kolo::gpu::finish_reduction(data.data, count, dtype, ranks, postscale, {});
          const std::vector<uint8_t> got = to_host(data, input.size());
          const size_t bad = first_difference(got, expected, element);
          INFO("element " << bad << ": input " << element_hex(input, bad, element) << " expected "
                          << element_hex(expected, bad, element) << " got "
                          << (bad < count ? element_hex(got, bad, element) : "-"));
          CHECK(bad == count);
        }
      }
    }
  }
}

TEST_CASE("batched copy: thousands of regions of every size and alignment", "[kernels]") {
  std::mt19937_64 rng(44);
  // 2500 regions (three launches), 0..70000 bytes each, at any byte offset, separated by gaps
  // that must stay untouched.
  const size_t regions_count = 2500;
  std::vector<kolo::gpu::CopyRegion> regions;
  std::vector<std::pair<size_t, size_t>> places;  // (source offset, destination offset)
  std::vector<size_t> sizes;
  size_t source_end = 0, destination_end = 0;
  for (size_t i = 0; i < regions_count; ++i) {
    const size_t bytes = i % 10 == 0 ? rng() % 70000 : rng() % 3000;
    const size_t source_offset = source_end + rng() % 17;
    const size_t destination_offset = destination_end + (i % 3 == 0 ? 0 : rng() % 33);
    places.emplace_back(source_offset, destination_offset);
    sizes.push_back(bytes);
    source_end = source_offset + bytes;
    destination_end = destination_offset + bytes;
  }
  std::vector<uint8_t> source_host(source_end + 64);
  for (auto& byte : source_host) byte = static_cast<uint8_t>(rng());
  std::vector<uint8_t> expected(destination_end + 64, 0x5a);
  DeviceMemory source(source_host.size()), destination(expected.size());
  to_device(source, source_host);
  to_device(destination, expected);
  for (size_t i = 0; i < regions_count; ++i) {
    regions.push_back(
        {source.get() + places[i].first, destination.get() + places[i].second, sizes[i]});
    std::memcpy(&expected[places[i].second], &source_host[places[i].first], sizes[i]);
  }
  kolo::gpu::batched_copy(regions, {});
  const std::vector<uint8_t> got = to_host(destination, expected.size());
  const size_t bad = first_difference(got, expected, 1);
  INFO("first wrong byte at " << bad << " of " << expected.size());
  CHECK(bad == expected.size());
}

TEST_CASE("batched copy rejects regions that are not whole elements", "[kernels]") {
  DeviceMemory memory(64);
  const kolo::gpu::CopyRegion region{memory.get(), memory.get() + 32, 6};
  try {
    kolo::gpu::batched_copy_scaled({&region, 1}, DataType::kFloat32, 2.0, {});
    FAIL("no error");
  } catch (const kolo::Error& error) {
    CHECK(error.status() == kolo::Status::kInvalidArgument);
  }
}

// ---- Device fusion
// --------------------------------------------------------------------------------

TEST_CASE("device fusion: thousands of small tensors packed in one launch, reduced, unpacked",
          "[fusion]") {
  // What the fusion engine does with GPU tensors: pack them into one buffer with batched copies,
  // run one collective on it, and unpack with the postscale applied on the way.
  std::mt19937_64 rng(45);
  auto communicator = single_rank_communicator();
  for (DataType dtype : {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16}) {
    for (bool aligned : {false, true}) {
      DYNAMIC_SECTION(kolo::dtype_name(dtype)
                      << (aligned ? " packed at 256-byte offsets" : " packed tightly")) {
        const size_t element = kolo::dtype_size(dtype);
        const size_t tensors = 3000;
        std::vector<size_t> counts, home, packed;  // elements; offsets in elements
        size_t home_end = 0, packed_end = 0;
        for (size_t i = 0; i < tensors; ++i) {
          const size_t count = 1 + (i % 50 == 0 ? rng() % 20000 : rng() % 700);
          counts.push_back(count);
          home.push_back(home_end + rng() % 5);  // tensors at odd places of one arena
          home_end = home.back() + count;
          if (aligned) packed_end = (packed_end * element + 255) / 256 * 256 / element;
          packed.push_back(packed_end);
          packed_end += count;
        }
        // Small integers: exact in every dtype, and through the scale factors below.
        std::vector<uint8_t> values(home_end * element);
        for (size_t i = 0; i < home_end; ++i) {
          const float v = static_cast<float>(static_cast<int>(rng() % 64) - 32);
          if (dtype == DataType::kFloat32) {
            std::memcpy(&values[i * 4], &v, 4);
          } else {
            const uint16_t h =
                dtype == DataType::kFloat16 ? kolo::float_to_half(v) : kolo::float_to_bfloat16(v);
            std::memcpy(&values[i * 2], &h, 2);
          }
        }
        DeviceMemory arena(values.size()), fused(packed_end * element), out(values.size());
        to_device(arena, values);
        cuda(cudaMemset(out.data, 0, out.bytes), "cudaMemset");

        std::vector<kolo::gpu::CopyRegion> pack, unpack;
        for (size_t i = 0; i < tensors; ++i) {
          pack.push_back({arena.get() + home[i] * element, fused.get() + packed[i] * element,
                          counts[i] * element});
          unpack.push_back({fused.get() + packed[i] * element, out.get() + home[i] * element,
                            counts[i] * element});
        }
        cudaStream_t stream = nullptr;
        cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        const kolo::gpu::Stream on{stream};
        // Pack, allreduce (one rank: x * 0.5 * 4 = 2x), unpack with x 0.5: the values again.
        kolo::gpu::batched_copy(pack, on);
        communicator->allreduce(fused.data, fused.data, packed_end, dtype, kolo::ReduceOp::kSum,
                                0.5, 4.0, &on);
        kolo::gpu::batched_copy_scaled(unpack, dtype, 0.5, on);
        communicator->synchronize_stream(on);
        cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");

        std::vector<uint8_t> expected(values.size(), 0);
        for (size_t i = 0; i < tensors; ++i) {
          std::memcpy(&expected[home[i] * element], &values[home[i] * element],
                      counts[i] * element);
        }
        const std::vector<uint8_t> got = to_host(out, values.size());
        const size_t bad = first_difference(got, expected, element);
        INFO("GPU path " << communicator->gpu_path() << "; element " << bad << " of " << home_end);
        CHECK(bad == home_end);
      }
    }
  }
}

// ---- Across processes
// -----------------------------------------------------------------------------

#ifdef KOLO_HAVE_NCCL
TEST_CASE("single-rank NCCL communicator: every dtype and op, blocking and on a stream", "[nccl]") {
  const std::map<std::string, std::string> env = {{"KOLO_GPU_BACKEND", "nccl"},
                                                  {"KOLO_TEST_EXPECT_BACKEND", "nccl"}};
  for (const char* mode : {"blocking", "stream"}) {
    DYNAMIC_SECTION("allreduce " << mode) {
      auto job = start_gpu_job(1, {"allreduce", mode}, env);
      expect_all_pass(job.wait(300), "GPU allreduce checks passed (nccl path)");
    }
    DYNAMIC_SECTION("broadcast " << mode) {
      auto job = start_gpu_job(1, {"broadcast", mode}, env);
      expect_all_pass(job.wait(300), "GPU broadcast checks passed (nccl path)");
    }
  }
}

TEST_CASE("KOLO_GPU_BACKEND=nccl with ranks sharing a GPU fails on every rank, without hanging",
          "[nccl_shared]") {
  auto job = start_gpu_job(2, {"expect", "KOLO_ERR_UNSUPPORTED"},
                           {{"KOLO_GPU_BACKEND", "nccl"}, {"KOLO_TEST_DEVICE", "0"}});
  const auto results = job.wait(120);
  expect_all_pass(results, "share the GPU");
}
#endif

TEST_CASE("ranks sharing one GPU reduce device buffers through the staged TCP path", "[staged]") {
  const std::map<std::string, std::string> env = {{"KOLO_GPU_BACKEND", "staged"},
                                                  {"KOLO_TEST_DEVICE", "0"},
                                                  {"KOLO_TEST_EXPECT_BACKEND", "staged"}};
  for (int n : {1, 2, 3}) {
    DYNAMIC_SECTION("allreduce blocking, N = " << n) {
      auto job = start_gpu_job(n, {"allreduce", "blocking"}, env);
      expect_all_pass(job.wait(600), "GPU allreduce checks passed (staged path)");
    }
  }
  SECTION("allreduce on a stream, N = 2") {
    auto job = start_gpu_job(2, {"allreduce", "stream"}, env);
    expect_all_pass(job.wait(600), "GPU allreduce checks passed (staged path)");
  }
  SECTION("allreduce with small segments and two TCP streams, N = 3") {
    auto small = env;
    small["KOLO_SEGMENT_BYTES"] = "256K";
    small["KOLO_TCP_STREAMS"] = "2";
    auto job = start_gpu_job(3, {"allreduce", "blocking"}, small);
    expect_all_pass(job.wait(600), "GPU allreduce checks passed (staged path)");
  }
  for (const char* mode : {"blocking", "stream"}) {
    DYNAMIC_SECTION("broadcast " << mode << ", N = 3") {
      auto job = start_gpu_job(3, {"broadcast", mode}, env);
      expect_all_pass(job.wait(600), "GPU broadcast checks passed (staged path)");
    }
  }
}

TEST_CASE("KOLO_GPU_BACKEND=auto: staged for ranks sharing a GPU, NCCL for a GPU each", "[auto]") {
  SECTION("two ranks on device 0") {
    auto job = start_gpu_job(2, {"loop", "0.5"}, {{"KOLO_TEST_DEVICE", "0"}});
    expect_all_pass(job.wait(120), "staged path");
  }
#ifdef KOLO_HAVE_NCCL
  if (g_devices >= 2) {
    SECTION("two ranks on two devices") {
      auto job = start_gpu_job(2, {"loop", "0.5"}, {});
      expect_all_pass(job.wait(120), "nccl path");
    }
  }
#endif
}

TEST_CASE("a peer killed during device allreduces: survivors fail fast instead of hanging",
          "[fault]") {
  SECTION("staged, three ranks sharing device 0") {
    auto job = start_gpu_job(3, {"loop", "60", "5"},
                             {{"KOLO_GPU_BACKEND", "staged"}, {"KOLO_TEST_DEVICE", "0"}});
    const auto results = job.wait(120);
    for (size_t rank = 0; rank < results.size(); ++rank) {
      INFO("rank " << rank << " output:\n" << results[rank].output);
      CHECK_FALSE(results[rank].timed_out);
      if (rank == results.size() - 1) {
        CHECK(results[rank].signal == SIGKILL);
      } else {
        CHECK(results[rank].exit_code == 3);
        CHECK(results[rank].output.find("status KOLO_ERR_PEER_LOST") != std::string::npos);
        CHECK(results[rank].output.find("rank 2") != std::string::npos);
      }
    }
  }
#ifdef KOLO_HAVE_NCCL
  if (g_devices >= 2) {
    SECTION("NCCL, two ranks on two devices") {
      auto job = start_gpu_job(2, {"loop", "60", "5"}, {{"KOLO_GPU_BACKEND", "nccl"}});
      const auto results = job.wait(120);
      INFO("rank 0 output:\n" << results[0].output);
      CHECK_FALSE(results[0].timed_out);
      CHECK(results[0].exit_code == 3);
      const bool reported =
          results[0].output.find("status KOLO_ERR_PEER_LOST") != std::string::npos ||
          results[0].output.find("status KOLO_ERR_SYSTEM") != std::string::npos;
      CHECK(reported);
      CHECK(results[1].signal == SIGKILL);
    }
  }
#endif
}

int main(int argc, char** argv) {
  const cudaError_t probe = cudaGetDeviceCount(&g_devices);
  if (probe != cudaSuccess || g_devices == 0) {
    std::printf("SKIPPED: no CUDA device: cudaGetDeviceCount returned %d (%s: %s)\n",
                static_cast<int>(probe), cudaGetErrorName(probe), cudaGetErrorString(probe));
    return 77;
  }
  std::printf("%d CUDA device(s)\n", g_devices);
  return Catch::Session().run(argc, argv);
}
