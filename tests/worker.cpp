// One rank of a multi-process test. Uses kolo only through the C ABI, and computes every expected
// result itself, from every rank's input, in double or 64-bit integer arithmetic with its own
// rounding to the half types: nothing here shares code with the library's kernels.
//
//   kolo_test_worker allreduce [quick]   every dtype x op x size, in and out of place, scaled
//   kolo_test_worker broadcast           every root x dtype x size
//   kolo_test_worker barrier             nobody leaves before the last one entered
//   kolo_test_worker mismatch KIND       the last rank calls differently; expects MISMATCH
//   kolo_test_worker badargs             invalid arguments, then a working allreduce
//   kolo_test_worker identical           float allreduce of inexact values: the same bits on every
//                                        rank and in every repetition
//   kolo_test_worker loop SECONDS        allreduce in a loop; reports the status it ends with
//   kolo_test_worker stall SECONDS       the last rank sleeps before its allreduce; reports status
//
// Exit status 0 means every check passed; a failing check prints what it expected and got.
#include <fmt/format.h>
#include <kolo.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "reference.hpp"
#include "worker_common.hpp"

namespace {

using namespace kolo::test::reference;
using namespace kolo::test::worker;

// ---- scenarios ---------------------------------------------------------------------------------

struct Buffers {
  std::vector<unsigned char> send, recv, expected, input_copy;
  void reserve(size_t bytes) {
    // Allocated once, at the largest size; first touch of fresh memory is slow.
    if (send.size() < bytes) {
      send.resize(bytes);
      recv.resize(bytes);
      expected.resize(bytes);
      input_copy.resize(bytes);
    }
  }
};

int run_allreduce(kolo_comm_t comm, bool quick) {
  const uint64_t big_bytes = (quick ? 256u : 4096u) * 1024;
  Buffers buffers;
  buffers.reserve(big_bytes + 64);
  int checks = 0;
  struct Scale {
    double pre, post;
  };
  const Scale scales[] = {{1.0, 1.0}, {0.5, 2.0}};
  for (const TypeInfo& type : kTypes) {
    const uint64_t sizes[] = {0, 1, static_cast<uint64_t>(g_size - 1), 7919,
                              big_bytes / type.size + 3};
    for (kolo_op_t op : kOps) {
      for (uint64_t count : sizes) {
        for (const Scale& scale : scales) {
          // Scaled runs on the prime size only: enough to check the factors' placement.
          if ((scale.pre != 1.0) && count != 7919) continue;
          if (scale.pre != 1.0 && op == KOLO_PROD) continue;  // 0.5^N leaves the exact range
          for (int in_place = 0; in_place < 2; ++in_place) {
            fill_periodic(type, buffers.send.data(), count, [&](uint64_t i) {
              return static_cast<double>(input_value(type, op, g_rank, i));
            });
            if (in_place == 0) {  // the reference does not depend on the placement
              fill_periodic(type, buffers.expected.data(), count, [&](uint64_t i) {
                return expected_value(type, op, i, scale.pre, scale.post, g_size);
              });
            }
            std::memset(buffers.recv.data(), 0xAB, count * type.size);
            const void* send = buffers.send.data();
            void* recv = in_place ? buffers.send.data() : buffers.recv.data();
            std::memcpy(buffers.input_copy.data(), send, count * type.size);
            kolo_status_t status = kolo_allreduce_scaled(comm, send, recv, count, type.dtype, op,
                                                         scale.pre, scale.post);
            std::string what = fmt::format("allreduce {} {} count {} {}{}", type.name, op_name(op),
                                           count, in_place ? "in place" : "out of place",
                                           scale.pre != 1.0 ? " prescale 0.5 postscale 2" : "");
            check_status(comm, status, what);
            size_t bad = first_difference(recv, buffers.expected.data(), count, type.size);
            if (bad != count) {
              fail(fmt::format("{}: element {} expected {} got {}", what, bad,
                               element_text(type, buffers.expected.data(), bad),
                               element_text(type, recv, bad)));
            }
            if (!in_place && std::memcmp(buffers.input_copy.data(), send, count * type.size) != 0) {
              fail(what + ": the input buffer was modified");
            }
            ++checks;
          }
        }
      }
    }
  }
  fmt::print("rank {}: {} allreduce checks passed\n", g_rank, checks);
  return 0;
}

int run_broadcast(kolo_comm_t comm) {
  Buffers buffers;
  buffers.reserve(4u << 20);
  int checks = 0;
  for (int root = 0; root < g_size; ++root) {
    for (const TypeInfo& type : kTypes) {
      const uint64_t sizes[] = {0, 1, 7919, (3u << 20) / type.size + 5};
      for (uint64_t count : sizes) {
        auto value = [&](uint64_t i) {
          return static_cast<double>((i * 31 + root * 7) % 200) - 100;
        };
        fill_periodic(type, buffers.expected.data(), count, value);
        if (g_rank == root) {
          std::memcpy(buffers.recv.data(), buffers.expected.data(), count * type.size);
        } else {
          std::memset(buffers.recv.data(), 0xCD, count * type.size);
        }
        std::string what = fmt::format("broadcast {} count {} root {}", type.name, count, root);
        check_status(comm, kolo_broadcast(comm, buffers.recv.data(), count, type.dtype, root),
                     what.c_str());
        size_t bad =
            first_difference(buffers.recv.data(), buffers.expected.data(), count, type.size);
        if (bad != count) {
          fail(fmt::format("{}: element {} expected {} got {}", what, bad,
                           element_text(type, buffers.expected.data(), bad),
                           element_text(type, buffers.recv.data(), bad)));
        }
        ++checks;
      }
    }
  }
  fmt::print("rank {}: {} broadcast checks passed\n", g_rank, checks);
  return 0;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int run_barrier(kolo_comm_t comm) {
  for (int round = 0; round < 3; ++round) {
    // A different rank arrives last in each round.
    int late = round % g_size;
    if (g_rank == late) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    double entered = now_seconds();
    check_status(comm, kolo_barrier(comm), "barrier");
    double left = now_seconds();
    double last_entry = entered;
    double first_exit = left;
    check_status(comm, kolo_allreduce(comm, &last_entry, &last_entry, 1, KOLO_FLOAT64, KOLO_MAX),
                 "allreduce max");
    check_status(comm, kolo_allreduce(comm, &first_exit, &first_exit, 1, KOLO_FLOAT64, KOLO_MIN),
                 "allreduce min");
    if (first_exit < last_entry) {
      fail(
          fmt::format("round {}: a rank left the barrier at {:.6f}, before the last entered at "
                      "{:.6f}",
                      round, first_exit, last_entry));
    }
  }
  fmt::print("rank {}: barrier checks passed\n", g_rank);
  return 0;
}

int run_mismatch(kolo_comm_t comm, const std::string& kind) {
  std::vector<float> data(1000, 1.0f);
  bool odd = g_rank == g_size - 1;
  kolo_status_t status;
  if (kind == "count") {
    status =
        kolo_allreduce(comm, data.data(), data.data(), odd ? 999 : 1000, KOLO_FLOAT32, KOLO_SUM);
  } else if (kind == "dtype") {
    status = kolo_allreduce(comm, data.data(), data.data(), 500, odd ? KOLO_INT32 : KOLO_FLOAT32,
                            KOLO_SUM);
  } else if (kind == "op") {
    status = kolo_allreduce(comm, data.data(), data.data(), 1000, KOLO_FLOAT32,
                            odd ? KOLO_MAX : KOLO_SUM);
  } else if (kind == "collective") {
    status = odd ? kolo_broadcast(comm, data.data(), 1000, KOLO_FLOAT32, 0)
                 : kolo_allreduce(comm, data.data(), data.data(), 1000, KOLO_FLOAT32, KOLO_SUM);
  } else if (kind == "root") {
    status = kolo_broadcast(comm, data.data(), 1000, KOLO_FLOAT32, odd ? 1 % g_size : 0);
  } else if (kind == "scale") {
    status = kolo_allreduce_scaled(comm, data.data(), data.data(), 1000, KOLO_FLOAT32, KOLO_SUM,
                                   odd ? 0.5 : 1.0, 1.0);
  } else {
    fail("unknown mismatch kind " + kind);
  }
  fmt::print("rank {}: status {} message: {}\n", g_rank, kolo_status_string(status),
             kolo_comm_last_error(comm));
  if (status != KOLO_ERR_MISMATCH) fail("expected KOLO_ERR_MISMATCH");
  // The communicator is broken now, and says so again.
  kolo_status_t again = kolo_barrier(comm);
  if (again != KOLO_ERR_MISMATCH) {
    fail(fmt::format("a later call returned {} instead of the same KOLO_ERR_MISMATCH",
                     kolo_status_string(again)));
  }
  return 0;
}

int run_badargs(kolo_comm_t comm) {
  std::vector<float> data(100, 1.0f);
  struct Case {
    const char* what;
    kolo_status_t status;
    const char* must_mention;
  };
  const Case cases[] = {
      {"NULL sendbuf", kolo_allreduce(comm, nullptr, data.data(), 100, KOLO_FLOAT32, KOLO_SUM),
       "sendbuf"},
      {"NULL recvbuf", kolo_allreduce(comm, data.data(), nullptr, 100, KOLO_FLOAT32, KOLO_SUM),
       "recvbuf"},
      {"unknown dtype",
       kolo_allreduce(comm, data.data(), data.data(), 100, static_cast<kolo_dtype_t>(42), KOLO_SUM),
       "dtype"},
      {"unknown op",
       kolo_allreduce(comm, data.data(), data.data(), 100, KOLO_FLOAT32, static_cast<kolo_op_t>(9)),
       "op"},
      // 256 and 260 would read as float32 and min if narrowed to a byte.
      {"dtype 256",
       kolo_allreduce(comm, data.data(), data.data(), 100, static_cast<kolo_dtype_t>(256), KOLO_SUM),
       "dtype"},
      {"negative dtype",
       kolo_allreduce(comm, data.data(), data.data(), 100, static_cast<kolo_dtype_t>(-1), KOLO_SUM),
       "dtype"},
      {"op 258",
       kolo_allreduce(comm, data.data(), data.data(), 100, KOLO_FLOAT32, static_cast<kolo_op_t>(258)),
       "op"},
      {"overlap", kolo_allreduce(comm, data.data(), data.data() + 1, 50, KOLO_FLOAT32, KOLO_SUM),
       "overlap"},
      {"NaN scale",
       kolo_allreduce_scaled(comm, data.data(), data.data(), 100, KOLO_FLOAT32, KOLO_SUM, NAN, 1.0),
       "finite"},
      {"negative root", kolo_broadcast(comm, data.data(), 100, KOLO_FLOAT32, -1), "root"},
      {"root too large", kolo_broadcast(comm, data.data(), 100, KOLO_FLOAT32, g_size), "root"},
      {"NULL broadcast buffer", kolo_broadcast(comm, nullptr, 100, KOLO_FLOAT32, 0), "NULL"},
      {"NULL communicator",
       kolo_allreduce(nullptr, data.data(), data.data(), 100, KOLO_FLOAT32, KOLO_SUM), nullptr},
      {"NULL rank pointer", kolo_comm_rank(comm, nullptr), "NULL"},
  };
  for (const Case& c : cases) {
    if (c.status != KOLO_ERR_INVALID_ARGUMENT) {
      fail(fmt::format("{}: expected KOLO_ERR_INVALID_ARGUMENT, got {}", c.what,
                       kolo_status_string(c.status)));
    }
  }
  // The last error names the problem (checked for the last case with a communicator).
  if (!std::strstr(kolo_comm_last_error(comm), "NULL")) {
    fail(fmt::format("last error does not name the problem: '{}'", kolo_comm_last_error(comm)));
  }
  if (kolo_comm_destroy(nullptr) != KOLO_ERR_INVALID_ARGUMENT) fail("destroy(NULL) accepted");
  // NULL with count 0 is fine.
  check_status(comm, kolo_allreduce(comm, nullptr, nullptr, 0, KOLO_FLOAT32, KOLO_SUM),
               "allreduce of count 0 with NULL buffers");
  // And the communicator still works.
  check_status(comm, kolo_allreduce(comm, data.data(), data.data(), 100, KOLO_FLOAT32, KOLO_SUM),
               "allreduce after invalid arguments");
  for (float v : data) {
    if (v != static_cast<float>(g_size)) fail(fmt::format("allreduce after bad args gave {}", v));
  }
  fmt::print("rank {}: bad-argument checks passed\n", g_rank);
  return 0;
}

// kolo_comm_last_error from two threads: the message one thread holds stays intact while another
// thread records a new error on the same communicator.
int run_error_threads(kolo_comm_t comm) {
  std::vector<float> data(8, 1.0f);
  if (kolo_allreduce(comm, nullptr, data.data(), 8, KOLO_FLOAT32, KOLO_SUM) !=
      KOLO_ERR_INVALID_ARGUMENT) {
    fail("a NULL sendbuf was accepted");
  }
  const char* held = kolo_comm_last_error(comm);
  const std::string first = held;
  std::thread other([&] {
    if (kolo_broadcast(comm, data.data(), 8, KOLO_FLOAT32, g_size + 7) !=
        KOLO_ERR_INVALID_ARGUMENT) {
      fail("a root out of range was accepted");
    }
    const std::string seen = kolo_comm_last_error(comm);
    if (seen == first || seen.find("root") == std::string::npos) {
      fail(fmt::format("the other thread read '{}' after its own error", seen));
    }
  });
  other.join();
  if (first != held) {
    fail(fmt::format("the message this thread held changed from '{}' to '{}'", first, held));
  }
  const std::string now = kolo_comm_last_error(comm);
  if (now.find("root") == std::string::npos) {
    fail(fmt::format("the communicator's last error is '{}', not the broadcast's", now));
  }
  fmt::print("rank {}: error-thread checks passed\n", g_rank);
  return 0;
}

// Allreduces 4 MiB in a loop for `seconds` (or until a failure) and reports how it ended:
// "status <NAME> after <t> s since last success: <message>".
// Values whose sums round (unlike the exact integers of run_allreduce), so that results depend on
// the order of the reduction: every rank must still get the same bits, in every repetition.
// Checked by gathering every rank's result (kolo_allgather, as bytes) and comparing.
int run_identical(kolo_comm_t comm) {
  int checks = 0;
  for (kolo_dtype_t dtype : {KOLO_FLOAT32, KOLO_FLOAT64, KOLO_FLOAT16, KOLO_BFLOAT16}) {
    const TypeInfo& type = *std::find_if(std::begin(kTypes), std::end(kTypes),
                                         [&](const TypeInfo& t) { return t.dtype == dtype; });
    for (kolo_op_t op : {KOLO_SUM, KOLO_AVG}) {
      // 300007 elements: above recursive doubling's limit in every type up to N = 9.
      for (uint64_t count :
           {uint64_t{1}, uint64_t{7}, uint64_t{7919}, uint64_t{70001}, uint64_t{300007}}) {
        for (int in_place = 0; in_place < 2; ++in_place) {
          const size_t bytes = count * type.size;
          std::vector<unsigned char> send(bytes), recv(bytes), first(bytes);
          std::vector<unsigned char> everyone(bytes * static_cast<size_t>(g_size));
          const std::string what =
              fmt::format("allreduce {} {} count {} {} of inexact values", type.name, op_name(op),
                          count, in_place ? "in place" : "out of place");
          for (int repetition = 0; repetition < 2; ++repetition) {
            // 1/(3 + rank + i mod 97) and alike: thirds, sevenths, ... round in every type.
            fill_periodic(type, send.data(), count, [&](uint64_t i) {
              return 1.0 / static_cast<double>(3 + g_rank * 5 + i % 97) * (i % 2 ? -1.0 : 1.0);
            });
            void* out = in_place ? send.data() : recv.data();
            check_status(comm, kolo_allreduce(comm, send.data(), out, count, dtype, op),
                         what.c_str());
            check_status(comm, kolo_allgather(comm, out, everyone.data(), bytes, KOLO_UINT8),
                         (what + ": allgather of the results").c_str());
            for (int r = 0; r < g_size; ++r) {
              size_t bad = first_difference(everyone.data() + r * bytes, out, count, type.size);
              if (bad != count) {
                fail(fmt::format("{}: element {} is {} on rank {} but {} here", what, bad,
                                 element_text(type, everyone.data() + r * bytes, bad), r,
                                 element_text(type, out, bad)));
              }
            }
            if (repetition == 0) {
              std::memcpy(first.data(), out, bytes);
            } else if (std::memcmp(first.data(), out, bytes) != 0) {
              fail(fmt::format("{}: the same call gave other bits the second time", what));
            }
            ++checks;
          }
        }
      }
    }
  }
  fmt::print("rank {}: {} identical checks passed\n", g_rank, checks);
  return 0;
}

int run_loop(kolo_comm_t comm, double seconds) {
  std::vector<float> data(1u << 20, 1.0f);
  auto start = std::chrono::steady_clock::now();
  auto last_success = start;
  long iterations = 0;
  kolo_status_t status = KOLO_SUCCESS;
  fmt::print("rank {}: looping\n", g_rank);
  std::fflush(stdout);
  // Rank 0's clock decides when to stop, so that every rank runs the same number of iterations.
  int32_t keep_going = 1;
  while (keep_going) {
    status = kolo_allreduce(comm, data.data(), data.data(), data.size(), KOLO_FLOAT32, KOLO_AVG);
    if (status != KOLO_SUCCESS) break;
    keep_going = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
                 seconds;
    status = kolo_broadcast(comm, &keep_going, 1, KOLO_INT32, 0);
    if (status != KOLO_SUCCESS) break;
    last_success = std::chrono::steady_clock::now();
    ++iterations;
  }
  double since =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - last_success).count();
  fmt::print("rank {}: status {} after {:.3f} s since last success ({} iterations): {}\n", g_rank,
             kolo_status_string(status), since, iterations, kolo_comm_last_error(comm));
  return status == KOLO_SUCCESS ? 0 : 3;
}

// The last rank arrives `seconds` late; the others report the status their allreduce ended with.
int run_stall(kolo_comm_t comm, double seconds) {
  if (g_rank == g_size - 1) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
  std::vector<float> data(1000, 1.0f);
  auto start = std::chrono::steady_clock::now();
  kolo_status_t status =
      kolo_allreduce(comm, data.data(), data.data(), data.size(), KOLO_FLOAT32, KOLO_SUM);
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print("rank {}: status {} after {:.3f} s: {}\n", g_rank, kolo_status_string(status), waited,
             kolo_comm_last_error(comm));
  return status == KOLO_SUCCESS ? 0 : 3;
}

// Sums the ranks, destroys the communicator and makes the next one from the same configuration,
// twice, as Horovod's shutdown and init do; rank 0 destroys `delay` seconds after the others, so
// they reach the store's address while rank 0 still serves the old communicator's store.
int run_reinit(kolo_comm_t* comm, const kolo_config_t& config, double delay) {
  for (int round = 0;; ++round) {
    int32_t sum = g_rank;
    kolo_status_t status = kolo_allreduce(*comm, &sum, &sum, 1, KOLO_INT32, KOLO_SUM);
    if (status != KOLO_SUCCESS || sum != g_size * (g_size - 1) / 2) {
      fmt::print("rank {}: round {}: sum {} ({}: {})\n", g_rank, round, sum,
                 kolo_status_string(status), kolo_comm_last_error(*comm));
      return 3;
    }
    if (round == 2) break;
    if (g_rank == 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    if (kolo_comm_destroy(*comm) != KOLO_SUCCESS) fail("destroy failed");
    *comm = nullptr;
    status = kolo_comm_init(&config, comm);
    if (status != KOLO_SUCCESS) {
      fmt::print("rank {}: init {} failed: {}: {}\n", g_rank, round + 2,
                 kolo_status_string(status), kolo_comm_last_error(nullptr));
      return 4;
    }
  }
  fmt::print("rank {}: made 3 communicators one after the other\n", g_rank);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: kolo_test_worker SCENARIO [ARG]\n");
    return 2;
  }
  std::string scenario = argv[1];
  std::string argument = argc > 2 ? argv[2] : "";
  kolo_config_t config = KOLO_CONFIG_INITIALIZER;
  kolo_comm_t comm = nullptr;
  kolo_status_t status = kolo_comm_init(&config, &comm);
  if (status != KOLO_SUCCESS) {
    fmt::print(stderr, "init failed: {}: {}\n", kolo_status_string(status),
               kolo_comm_last_error(nullptr));
    return 4;
  }
  kolo_comm_rank(comm, &g_rank);
  kolo_comm_size(comm, &g_size);
  int result = 0;
  if (scenario == "allreduce")
    result = run_allreduce(comm, argument == "quick");
  else if (scenario == "broadcast")
    result = run_broadcast(comm);
  else if (scenario == "barrier")
    result = run_barrier(comm);
  else if (scenario == "mismatch")
    result = run_mismatch(comm, argument);
  else if (scenario == "badargs")
    result = run_badargs(comm);
  else if (scenario == "stall")
    result = run_stall(comm, std::atof(argument.c_str()));
  else if (scenario == "error_threads")
    result = run_error_threads(comm);
  else if (scenario == "identical")
    result = run_identical(comm);
  else if (scenario == "reinit")
    result = run_reinit(&comm, config, argument.empty() ? 0.5 : std::atof(argument.c_str()));
  else if (scenario == "loop")
    result = run_loop(comm, argument.empty() ? 5.0 : std::atof(argument.c_str()));
  else
    fail("unknown scenario " + scenario);
  if (comm != nullptr && kolo_comm_destroy(comm) != KOLO_SUCCESS) fail("destroy failed");
  return result;
}
