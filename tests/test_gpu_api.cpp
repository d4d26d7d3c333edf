// The GPU interface where it must work without a GPU (src/gpu/gpu.hpp, gpu/kernels.hpp and the
// communicator's stream calls): host buffers are never taken for device memory, and a GPU call on
// a machine or build without one fails with KOLO_ERR_UNSUPPORTED and CUDA's reason, leaving the
// communicator usable. Built in every configuration; on a machine with a GPU the same calls with
// host buffers are argument errors instead. The GPU itself is tested by tests/gpu/.
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/config.hpp"
#include "gpu/gpu.hpp"
#include "gpu/kernels.hpp"
#include "job.hpp"
#include "process.hpp"

namespace {

using Catch::Matchers::Contains;

std::unique_ptr<kolo::Communicator> single_rank_communicator() {
  kolo::ConfigOverrides overrides;
  overrides.rank = 0;
  overrides.size = 1;
  overrides.addr = "127.0.0.1:" + std::to_string(kolo::test::free_tcp_port());
  overrides.secret = kolo::test::kTestSecret;
  overrides.timeout_s = 30;
  return std::make_unique<kolo::Communicator>(overrides);
}

}  // namespace

TEST_CASE("host memory is never device memory", "[gpu_api]") {
  int on_stack = 0;
  std::vector<float> on_heap(1000);
  CHECK_FALSE(kolo::gpu::locate(nullptr).device);
  CHECK_FALSE(kolo::gpu::locate(&on_stack).device);
  CHECK_FALSE(kolo::gpu::is_device_memory(on_heap.data()));
  // The reason is given exactly when there is no GPU.
  CHECK(kolo::gpu::devices_absent_reason().empty() == kolo::gpu::devices_present());
}

TEST_CASE("GPU calls with host buffers, or without a GPU, fail before anything is sent",
          "[gpu_api]") {
  auto communicator = single_rank_communicator();
  std::vector<float> data(1000, 2.0f);
  const kolo::gpu::Stream stream{};
  const bool gpu = kolo::gpu::devices_present();
  try {
    communicator->allreduce(data.data(), data.data(), data.size(), kolo::DataType::kFloat32,
                            kolo::ReduceOp::kSum, 1.0, 1.0, &stream);
    FAIL("allreduce on a stream with host buffers succeeded");
  } catch (const kolo::Error& error) {
    INFO(error.what());
    if (gpu) {
      CHECK(error.status() == kolo::Status::kInvalidArgument);
      CHECK_THAT(error.what(), Contains("host memory"));
    } else {
      CHECK(error.status() == kolo::Status::kUnsupported);
      CHECK_THAT(error.what(), Contains(kolo::gpu::devices_absent_reason()));
    }
  }
  try {
    communicator->broadcast(data.data(), data.size(), kolo::DataType::kFloat32, 0, &stream);
    FAIL("broadcast on a stream with host buffers succeeded");
  } catch (const kolo::Error& error) {
    CHECK(error.status() == (gpu ? kolo::Status::kInvalidArgument : kolo::Status::kUnsupported));
  }
  if (!gpu) {
    try {
      communicator->synchronize_stream(stream);
      FAIL("synchronize_stream without a GPU succeeded");
    } catch (const kolo::Error& error) {
      CHECK(error.status() == kolo::Status::kUnsupported);
    }
  }
  // Nothing broke: host buffers still take the host path.
  communicator->allreduce(data.data(), data.data(), data.size(), kolo::DataType::kFloat32,
                          kolo::ReduceOp::kSum);
  CHECK(data[999] == 2.0f);
  CHECK(std::string(communicator->gpu_path()) == "none");
}

TEST_CASE("device kernels without a GPU fail with KOLO_ERR_UNSUPPORTED", "[gpu_api]") {
  if (kolo::gpu::devices_present()) return;  // with a GPU: tests/gpu/ covers them
  std::vector<char> source(64, 1), destination(64, 0);
  const kolo::gpu::CopyRegion region{source.data(), destination.data(), 64};
  try {
    kolo::gpu::batched_copy({&region, 1}, {});
    FAIL("batched copy without a GPU succeeded");
  } catch (const kolo::Error& error) {
    INFO(error.what());
    CHECK(error.status() == kolo::Status::kUnsupported);
  }
  CHECK(destination[0] == 0);
}
