// One rank of a GPU test: buffers in device memory through kolo's C ABI, every result checked
// element by element against tests/reference.hpp (exact small-integer inputs, the expected result
// computed independently in double or 64-bit integer arithmetic).
//
//   kolo_gpu_worker allreduce blocking|stream   every dtype x op x size, in and out of place,
//   scaled kolo_gpu_worker broadcast blocking|stream   every root x dtype x size kolo_gpu_worker
//   loop SECONDS [KILL_AFTER]   device allreduce in a loop; with KILL_AFTER the
//                                               last rank SIGKILLs itself after that many
//                                               iterations; reports the status it ends with
//   kolo_gpu_worker expect STATUS_NAME          one device allreduce must fail with that status
//
// "blocking" uses kolo_allreduce_scaled / kolo_broadcast on device pointers, ordered after
// cudaMemcpy and cudaMemset on the legacy default stream; "stream" enqueues the copies, the
// collective and the copy back on a non-blocking stream of its own and waits with
// kolo_stream_synchronize.
//
// Environment: KOLO_TEST_DEVICE forces the CUDA device (default: local rank modulo the number of
// devices); KOLO_TEST_EXPECT_BACKEND, when set, is what kolo_comm_gpu_backend must report.
//
// Exit status 0: every check passed; 1: a check failed (it says what it expected and got); 77: no
// CUDA device (CUDA's reason is printed).
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <kolo.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../reference.hpp"
#include "../worker_common.hpp"

namespace {

using namespace kolo::test::reference;
using namespace kolo::test::worker;

void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    fail(fmt::format("{} failed: {} ({})", what, cudaGetErrorName(error),
                     cudaGetErrorString(error)));
  }
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    check_cuda(cudaMalloc(&data_, bytes == 0 ? 1 : bytes), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
};

// The GPU path, once the first GPU collective has chosen it; checked against the environment.
std::string gpu_backend(kolo_comm_t comm) {
  const char* name = nullptr;
  check_status(comm, kolo_comm_gpu_backend(comm, &name), "kolo_comm_gpu_backend");
  const char* expected = std::getenv("KOLO_TEST_EXPECT_BACKEND");
  if (expected != nullptr && std::string(name) != "none" && std::string(name) != expected) {
    fail(fmt::format("GPU backend is {}, expected {}", name, expected));
  }
  return name;
}

// ---- comparison -----------------------------------------------------------------------------

double decode_small_float(uint16_t bits, int mantissa_bits, int bias) {
  const int exponent_bits = 15 - mantissa_bits;
  const int exponent = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1);
  const int mantissa = bits & ((1 << mantissa_bits) - 1);
  double magnitude =
      exponent == 0 ? std::ldexp(mantissa, 1 - bias - mantissa_bits)
                    : std::ldexp(mantissa + (1 << mantissa_bits), exponent - bias - mantissa_bits);
  if (exponent == (1 << exponent_bits) - 1) magnitude = mantissa ? NAN : INFINITY;
  return (bits & 0x8000) ? -magnitude : magnitude;
}

double element_value(const TypeInfo& type, const void* buffer, size_t i) {
  const auto* p = static_cast<const unsigned char*>(buffer) + i * type.size;
  switch (type.dtype) {
    case KOLO_FLOAT32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case KOLO_FLOAT64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case KOLO_FLOAT16:
    case KOLO_BFLOAT16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return type.dtype == KOLO_FLOAT16 ? decode_small_float(v, 10, 15)
                                        : decode_small_float(v, 7, 127);
    }
    default:
      return NAN;
  }
}

// The first element of got that differs from expected: bitwise, or within a relative tolerance
// where NCCL's arithmetic legitimately differs from kolo's host arithmetic (ncclAvg of floating
// types multiplies each input by 1/N; float16 and bfloat16 then round at every step).
size_t first_wrong(const TypeInfo& type, const void* got, const void* expected, size_t count,
                   double tolerance) {
  if (tolerance == 0) return first_difference(got, expected, count, type.size);
  for (size_t i = 0; i < count; ++i) {
    const double a = element_value(type, got, i);
    const double b = element_value(type, expected, i);
    if (!(std::fabs(a - b) <= tolerance * std::max(1.0, std::fabs(b)))) return i;
  }
  return count;
}

double tolerance_for(const TypeInfo& type, kolo_op_t op, bool nccl) {
  if (!nccl || !type.is_float || op != KOLO_AVG || g_size == 1) return 0;
  if (type.dtype == KOLO_FLOAT16 || type.dtype == KOLO_BFLOAT16) return 2e-2;
  return type.dtype == KOLO_FLOAT32 ? 1e-6 : 1e-12;
}

// ---- scenarios ------------------------------------------------------------------------------

struct HostBuffers {
  std::vector<unsigned char> send, expected, got, input_after;
  explicit HostBuffers(size_t bytes)
      : send(bytes), expected(bytes), got(bytes), input_after(bytes) {}
};

// NCCL has no 16-bit integer type, so the GPU path refuses int16 before anything is sent, with a
// message that names it, and the communicator stays usable (the next dtype's calls run on it).
void expect_int16_refused(kolo_comm_t comm, kolo_status_t status, const std::string& what) {
  const std::string error = kolo_comm_last_error(comm);
  if (status != KOLO_ERR_UNSUPPORTED || error.find("int16") == std::string::npos) {
    fail(fmt::format("{}: expected KOLO_ERR_UNSUPPORTED naming int16, got {}: {}", what,
                     kolo_status_string(status), error));
  }
}

int run_allreduce(kolo_comm_t comm, bool on_stream) {
  // More than one staging piece (8 MiB each), so that the staged path pipelines.
  const uint64_t big_bytes = (9u << 20) + 4096;
  HostBuffers host(big_bytes + 64);
  DeviceBuffer device_send(big_bytes + 64);
  DeviceBuffer device_recv(big_bytes + 64);
  cudaStream_t stream = nullptr;
  if (on_stream) check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  struct Scale {
    double pre, post;
  };
  const Scale scales[] = {{1.0, 1.0}, {0.5, 2.0}};
  int checks = 0;
  std::string backend = "none";
  for (const TypeInfo& type : kTypes) {
    if (type.dtype == KOLO_INT16) {
      const kolo_status_t refused =
          on_stream ? kolo_allreduce_scaled_on_stream(comm, device_send.get(), device_recv.get(),
                                                      7919, KOLO_INT16, KOLO_SUM, 1.0, 1.0, stream)
                    : kolo_allreduce(comm, device_send.get(), device_recv.get(), 7919, KOLO_INT16,
                                     KOLO_SUM);
      expect_int16_refused(comm, refused, "device allreduce of int16");
      ++checks;
      continue;
    }
    const uint64_t sizes[] = {1, static_cast<uint64_t>(g_size + 1), 7919,
                              big_bytes / type.size + 3};
    for (kolo_op_t op : kOps) {
      for (uint64_t count : sizes) {
        for (const Scale& scale : scales) {
          if (scale.pre != 1.0 && count != 7919) continue;    // placement of the factors only
          if (scale.pre != 1.0 && op == KOLO_PROD) continue;  // 0.5^N leaves the exact range
          fill_periodic(type, host.expected.data(), count, [&](uint64_t i) {
            return expected_value(type, op, i, scale.pre, scale.post, g_size);
          });
          fill_periodic(type, host.send.data(), count, [&](uint64_t i) {
            return static_cast<double>(input_value(type, op, g_rank, i));
          });
          const size_t bytes = count * type.size;
          for (int in_place = 0; in_place < 2; ++in_place) {
            void* send = device_send.get();
            void* recv = in_place ? device_send.get() : device_recv.get();
            const std::string what =
                fmt::format("{} allreduce {} {} count {} {}{}", on_stream ? "stream" : "blocking",
                            type.name, op_name(op), count, in_place ? "in place" : "out of place",
                            scale.pre != 1.0 ? " prescale 0.5 postscale 2" : "");
            if (on_stream) {
              check_cuda(
                  cudaMemcpyAsync(send, host.send.data(), bytes, cudaMemcpyHostToDevice, stream),
                  "cudaMemcpyAsync");
              if (!in_place) check_cuda(cudaMemsetAsync(recv, 0xAB, bytes, stream), "memset");
              check_status(comm,
                           kolo_allreduce_scaled_on_stream(comm, send, recv, count, type.dtype, op,
                                                           scale.pre, scale.post, stream),
                           what);
              check_cuda(
                  cudaMemcpyAsync(host.got.data(), recv, bytes, cudaMemcpyDeviceToHost, stream),
                  "cudaMemcpyAsync");
              check_cuda(cudaMemcpyAsync(host.input_after.data(), send, bytes,
                                         cudaMemcpyDeviceToHost, stream),
                         "cudaMemcpyAsync");
              check_status(comm, kolo_stream_synchronize(comm, stream), what + " (synchronize)");
            } else {
              check_cuda(cudaMemcpy(send, host.send.data(), bytes, cudaMemcpyHostToDevice),
                         "cudaMemcpy");
              if (!in_place) check_cuda(cudaMemset(recv, 0xAB, bytes), "cudaMemset");
              check_status(comm,
                           kolo_allreduce_scaled(comm, send, recv, count, type.dtype, op, scale.pre,
                                                 scale.post),
                           what);
              check_cuda(cudaMemcpy(host.got.data(), recv, bytes, cudaMemcpyDeviceToHost),
                         "cudaMemcpy");
              check_cuda(cudaMemcpy(host.input_after.data(), send, bytes, cudaMemcpyDeviceToHost),
                         "cudaMemcpy");
            }
            if (backend == "none") backend = gpu_backend(comm);
            const double tolerance = tolerance_for(type, op, backend == "nccl");
            const size_t bad =
                first_wrong(type, host.got.data(), host.expected.data(), count, tolerance);
            if (bad != count) {
              fail(fmt::format("{} ({} path): element {} expected {} got {}", what, backend, bad,
                               element_text(type, host.expected.data(), bad),
                               element_text(type, host.got.data(), bad)));
            }
            if (!in_place && std::memcmp(host.input_after.data(), host.send.data(), bytes) != 0) {
              fail(what + ": the input buffer was modified");
            }
            ++checks;
          }
        }
      }
    }
  }
  if (stream != nullptr) cudaStreamDestroy(stream);
  fmt::print("rank {}: {} GPU allreduce checks passed ({} path)\n", g_rank, checks, backend);
  return 0;
}

int run_broadcast(kolo_comm_t comm, bool on_stream) {
  const uint64_t big_bytes = (9u << 20) + 4096;
  HostBuffers host(big_bytes + 64);
  DeviceBuffer device(big_bytes + 64);
  cudaStream_t stream = nullptr;
  if (on_stream) check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  int checks = 0;
  std::string backend = "none";
  for (int root = 0; root < g_size; ++root) {
    for (const TypeInfo& type : kTypes) {
      if (type.dtype == KOLO_INT16) {
        const kolo_status_t refused =
            on_stream ? kolo_broadcast_on_stream(comm, device.get(), 7919, KOLO_INT16, root, stream)
                      : kolo_broadcast(comm, device.get(), 7919, KOLO_INT16, root);
        expect_int16_refused(comm, refused, "device broadcast of int16");
        ++checks;
        continue;
      }
      const uint64_t sizes[] = {1, 7919, big_bytes / type.size + 5};
      for (uint64_t count : sizes) {
        const size_t bytes = count * type.size;
        fill_periodic(type, host.expected.data(), count, [&](uint64_t i) {
          return static_cast<double>((i * 31 + root * 7) % 200) - 100;
        });
        if (g_rank == root) {
          std::memcpy(host.send.data(), host.expected.data(), bytes);
        } else {
          std::memset(host.send.data(), 0xCD, bytes);
        }
        const std::string what =
            fmt::format("{} broadcast {} count {} root {}", on_stream ? "stream" : "blocking",
                        type.name, count, root);
        if (on_stream) {
          check_cuda(cudaMemcpyAsync(device.get(), host.send.data(), bytes, cudaMemcpyHostToDevice,
                                     stream),
                     "cudaMemcpyAsync");
          check_status(
              comm, kolo_broadcast_on_stream(comm, device.get(), count, type.dtype, root, stream),
              what);
          check_cuda(
              cudaMemcpyAsync(host.got.data(), device.get(), bytes, cudaMemcpyDeviceToHost, stream),
              "cudaMemcpyAsync");
          check_status(comm, kolo_stream_synchronize(comm, stream), what + " (synchronize)");
        } else {
          check_cuda(cudaMemcpy(device.get(), host.send.data(), bytes, cudaMemcpyHostToDevice),
                     "cudaMemcpy");
          check_status(comm, kolo_broadcast(comm, device.get(), count, type.dtype, root), what);
          check_cuda(cudaMemcpy(host.got.data(), device.get(), bytes, cudaMemcpyDeviceToHost),
                     "cudaMemcpy");
        }
        if (backend == "none") backend = gpu_backend(comm);
        const size_t bad =
            first_difference(host.got.data(), host.expected.data(), count, type.size);
        if (bad != count) {
          fail(fmt::format("{} ({} path): element {} expected {} got {}", what, backend, bad,
                           element_text(type, host.expected.data(), bad),
                           element_text(type, host.got.data(), bad)));
        }
        ++checks;
      }
    }
  }
  if (stream != nullptr) cudaStreamDestroy(stream);
  fmt::print("rank {}: {} GPU broadcast checks passed ({} path)\n", g_rank, checks, backend);
  return 0;
}

// Allreduces 4 MiB of device memory in a loop for `seconds` (rank 0's clock decides, through a
// host broadcast, so every rank runs the same number of iterations). With kill_after > 0 the last
// rank kills itself with SIGKILL after that many iterations. Reports
// "status <NAME> after <t> s since last success (<n> iterations): <message>".
int run_loop(kolo_comm_t comm, double seconds, long kill_after) {
  const uint64_t count = 1u << 20;
  DeviceBuffer data(count * sizeof(float));
  check_cuda(cudaMemset(data.get(), 0, count * sizeof(float)), "cudaMemset");
  const auto start = std::chrono::steady_clock::now();
  auto last_success = start;
  long iterations = 0;
  kolo_status_t status = KOLO_SUCCESS;
  fmt::print("rank {}: looping\n", g_rank);
  std::fflush(stdout);
  int32_t keep_going = 1;
  while (keep_going) {
    status = kolo_allreduce(comm, data.get(), data.get(), count, KOLO_FLOAT32, KOLO_AVG);
    if (status != KOLO_SUCCESS) break;
    ++iterations;
    if (kill_after > 0 && iterations == kill_after && g_rank == g_size - 1) {
      fmt::print("rank {}: killing myself after {} iterations\n", g_rank, iterations);
      std::fflush(stdout);
      raise(SIGKILL);
    }
    keep_going =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds;
    status = kolo_broadcast(comm, &keep_going, 1, KOLO_INT32, 0);
    if (status != KOLO_SUCCESS) break;
    last_success = std::chrono::steady_clock::now();
  }
  const double since =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - last_success).count();
  fmt::print("rank {}: status {} after {:.3f} s since last success ({} iterations, {} path): {}\n",
             g_rank, kolo_status_string(status), since, iterations, gpu_backend(comm),
             kolo_comm_last_error(comm));
  return status == KOLO_SUCCESS ? 0 : 3;
}

// One device allreduce that must fail with `expected` (a status name such as
// KOLO_ERR_UNSUPPORTED) on this rank.
int run_expect(kolo_comm_t comm, const std::string& expected) {
  DeviceBuffer data(1024 * sizeof(float));
  const kolo_status_t status =
      kolo_allreduce(comm, data.get(), data.get(), 1024, KOLO_FLOAT32, KOLO_SUM);
  const std::string name = kolo_status_string(status);
  fmt::print("rank {}: status {}: {}\n", g_rank, name, kolo_comm_last_error(comm));
  if (name.rfind(expected, 0) != 0) fail(fmt::format("expected {}", expected));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: kolo_gpu_worker SCENARIO [ARG...]\n");
    return 2;
  }
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    fmt::print("SKIPPED: no CUDA device: cudaGetDeviceCount returned {} ({}: {})\n",
               static_cast<int>(probe), cudaGetErrorName(probe), cudaGetErrorString(probe));
    return 77;
  }
  const std::string scenario = argv[1];
  const std::string argument = argc > 2 ? argv[2] : "";
  kolo_config_t config = KOLO_CONFIG_INITIALIZER;
  kolo_comm_t comm = nullptr;
  const kolo_status_t status = kolo_comm_init(&config, &comm);
  if (status != KOLO_SUCCESS) {
    fmt::print(stderr, "init failed: {}: {}\n", kolo_status_string(status),
               kolo_comm_last_error(nullptr));
    return 4;
  }
  kolo_comm_rank(comm, &g_rank);
  kolo_comm_size(comm, &g_size);
  int local_rank = 0;
  kolo_comm_local_rank(comm, &local_rank);
  const char* forced = std::getenv("KOLO_TEST_DEVICE");
  const int device = forced ? std::atoi(forced) : local_rank % devices;
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  fmt::print("rank {}: CUDA device {} of {}\n", g_rank, device, devices);

  int result = 0;
  if (scenario == "allreduce") {
    result = run_allreduce(comm, argument == "stream");
  } else if (scenario == "broadcast") {
    result = run_broadcast(comm, argument == "stream");
  } else if (scenario == "loop") {
    result = run_loop(comm, argument.empty() ? 5.0 : std::atof(argument.c_str()),
                      argc > 3 ? std::atol(argv[3]) : 0);
  } else if (scenario == "expect") {
    result = run_expect(comm, argument);
  } else {
    fail("unknown scenario " + scenario);
  }
  if (kolo_comm_destroy(comm) != KOLO_SUCCESS) fail("destroy failed");
  return result;
}
