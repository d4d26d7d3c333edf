// One rank of a fusion-engine test (tests/test_fusion.cpp). Uses kolo only through the C ABI.
//
// Inputs are pseudo-random, derived from (scenario seed, rank, tensor, step), so that every rank
// can regenerate every other rank's inputs and compute reference results itself, in double (or
// exact integer) arithmetic, without any communication. Floating-point data is random in the last
// bit, so that the order of reduction shows: fused and unfused results are compared bit for bit.
//
//   kolo_fusion_worker orders      the same tensors submitted in a different random order per rank
//   kolo_fusion_worker many        hundreds of small tensors
//   kolo_fusion_worker mixed       dtypes, ops and factors submitted together (none fused together)
//   kolo_fusion_worker large       tensors larger than KOLO_FUSION_THRESHOLD beside small ones
//   kolo_fusion_worker bitwise     every dtype and op, fused vs unfused, bit for bit
//   kolo_fusion_worker one_ring    tensors too large to fuse share one ring allreduce
//   kolo_fusion_worker cache [N]   N steps of a changing set of tensors; reports the cache counters
//   kolo_fusion_worker group       grouped submissions run as one collective
//   kolo_fusion_worker broadcast   named broadcasts from every root
//   kolo_fusion_worker duplicate   a name submitted twice before completion
//   kolo_fusion_worker mismatch    the last rank submits two tensors differently
//   kolo_fusion_worker peerlost    the last rank dies with requests pending on the others
//   kolo_fusion_worker destroy     destroy with requests pending; callbacks and statuses after it
//   kolo_fusion_worker leave       rank 0 destroys its communicator first once all work is done
//   kolo_fusion_worker stall       the last rank submits one tensor late (or, "stall abort", never)
//   kolo_fusion_worker late        the last rank submits a tensor 1.5 s after the others
//   kolo_fusion_worker threads     ordered calls on one thread, named ones on another
//   kolo_fusion_worker idle        no cycles and no CPU while idle; woken by a submission
//   kolo_fusion_worker badargs     invalid arguments of every named call
//   kolo_fusion_worker allgather   named allgathers of per-rank counts (zero too), every dtype,
//                                  shuffled among named allreduces, counts changing every step
//   kolo_fusion_worker autotune [off]
//                                  steps of checked sums while KOLO_AUTOTUNE changes the settings,
//                                  until they settle, then steps that must change nothing; "off":
//                                  without KOLO_AUTOTUNE, the settings never change
//   kolo_fusion_worker allgather_errors
//                                  too small a receive capacity, disagreeing ranks, bad arguments
//                                  and misuse of kolo_request_counts
//
// Exit status 0 means every check passed ("<scenario> checks passed" is printed); a failing check
// prints what it expected and what it got.
#include <fmt/format.h>
#include <kolo.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

int g_rank = 0;
int g_size = 1;

[[noreturn]] void fail(const std::string& message) {
  fmt::print(stderr, "rank {}: FAILED: {}\n", g_rank, message);
  std::fflush(stderr);
  std::_Exit(1);
}

void check(kolo_comm_t comm, kolo_status_t status, const std::string& what) {
  if (status != KOLO_SUCCESS) {
    fail(fmt::format("{} returned {}: {}", what, kolo_status_string(status),
                     kolo_comm_last_error(comm)));
  }
}

kolo_fusion_stats_t stats_of(kolo_comm_t comm) {
  kolo_fusion_stats_t stats;
  std::memset(&stats, 0, sizeof(stats));
  stats.struct_size = sizeof(stats);
  check(comm, kolo_comm_fusion_stats(comm, &stats), "kolo_comm_fusion_stats");
  return stats;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

size_t element_size(kolo_dtype_t dtype) {
  return kolo_dtype_size(dtype);
}

const char* dtype_text(kolo_dtype_t dtype) {
  static const char* names[] = {"float32", "float64", "float16", "bfloat16", "int8",
                                "uint8",   "int32",   "int64",   "int16"};
  return names[dtype];
}
const char* op_text(kolo_op_t op) {
  static const char* names[] = {"sum", "avg", "min", "max", "prod"};
  return names[op];
}

// Random but valid (finite, normal) values: floats in [-1, 1) (near 1 for products, so that they
// neither overflow nor vanish), half types from random bits with a moderate exponent, integers of
// every bit.
void fill_random(kolo_dtype_t dtype, kolo_op_t op, void* buffer, uint64_t count, uint64_t seed) {
  std::mt19937_64 random(mix(seed));
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  std::uniform_real_distribution<double> near_one(0.9, 1.1);
  auto* bytes = static_cast<unsigned char*>(buffer);
  for (uint64_t i = 0; i < count; ++i) {
    switch (dtype) {
      case KOLO_FLOAT32: {
        float v = static_cast<float>(op == KOLO_PROD ? near_one(random) : uniform(random));
        std::memcpy(bytes + 4 * i, &v, 4);
        break;
      }
      case KOLO_FLOAT64: {
        double v = op == KOLO_PROD ? near_one(random) : uniform(random);
        std::memcpy(bytes + 8 * i, &v, 8);
        break;
      }
      case KOLO_FLOAT16:
      case KOLO_BFLOAT16: {
        uint64_t r = random();
        const int mantissa_bits = dtype == KOLO_FLOAT16 ? 10 : 7;
        const int bias = dtype == KOLO_FLOAT16 ? 15 : 127;
        // Exponents within a few binades of 1 (exactly 1.x for products).
        int exponent = op == KOLO_PROD ? bias : bias - 4 + static_cast<int>(r % 6);
        uint16_t v = static_cast<uint16_t>(((r >> 8) & 1) << 15) |
                     static_cast<uint16_t>(exponent << mantissa_bits) |
                     static_cast<uint16_t>((r >> 16) & ((1u << mantissa_bits) - 1));
        std::memcpy(bytes + 2 * i, &v, 2);
        break;
      }
      default: {
        uint64_t v = random();
        std::memcpy(bytes + element_size(dtype) * i, &v, element_size(dtype));
      }
    }
  }
}

// A named tensor of this rank, with its buffers allocated once.
struct Tensor {
  std::string name;
  kolo_dtype_t dtype = KOLO_FLOAT32;
  kolo_op_t op = KOLO_SUM;
  uint64_t count = 0;
  double prescale = 1.0, postscale = 1.0;
  uint64_t id = 0;  // seeds the inputs
  std::vector<unsigned char> send, recv;
  kolo_request_t request = nullptr;

  size_t bytes() const { return count * element_size(dtype); }
  uint64_t seed(int rank, uint64_t step) const {
    return mix(id * 1000003 + static_cast<uint64_t>(rank) * 7919 + step * 104729 + 17);
  }
  void prepare(uint64_t step) {
    send.resize(std::max<size_t>(bytes(), 1));
    recv.assign(std::max<size_t>(bytes(), 1), 0xAB);
    fill_random(dtype, op, send.data(), count, seed(g_rank, step));
  }
};

void submit(kolo_comm_t comm, Tensor& tensor, bool in_place = false) {
  kolo_async_options_t options = KOLO_ASYNC_OPTIONS_INITIALIZER;
  options.prescale = tensor.prescale;
  options.postscale = tensor.postscale;
  if (in_place) tensor.recv = tensor.send;
  check(comm,
        kolo_allreduce_async(comm, tensor.name.c_str(), tensor.send.data(),
                             in_place ? tensor.send.data() : tensor.recv.data(), tensor.count,
                             tensor.dtype, tensor.op, &options, &tensor.request),
        "kolo_allreduce_async " + tensor.name);
}

// Waits for every request, which must succeed; copies in-place results to recv.
void wait_all(std::vector<Tensor>& tensors, bool in_place = false) {
  for (Tensor& tensor : tensors) {
    if (!tensor.request) continue;
    kolo_status_t status = kolo_request_wait(tensor.request);
    if (status != KOLO_SUCCESS) {
      fail(fmt::format("request {} returned {}: {}", tensor.name, kolo_status_string(status),
                       kolo_request_last_error(tensor.request)));
    }
    kolo_request_free(tensor.request);
    tensor.request = nullptr;
    if (in_place) tensor.recv = tensor.send;
  }
}

// Submits in an order of this rank's own (a shuffle seeded by the rank and step).
void submit_shuffled(kolo_comm_t comm, std::vector<Tensor>& tensors, uint64_t step) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 random(mix(static_cast<uint64_t>(g_rank) * 31 + step * 1000 + 5));
  std::shuffle(order.begin(), order.end(), random);
  for (size_t i : order) submit(comm, tensors[i]);
}

// Checks a float32 or float64 sum/avg (with factors) against a double-precision reference
// computed from every rank's regenerated input; integer sums must be exact (they wrap).
void check_against_reference(const Tensor& tensor, uint64_t step) {
  std::vector<double> expected(tensor.count, 0.0);
  std::vector<uint64_t> exact(tensor.count, 0);
  std::vector<unsigned char> input(std::max<size_t>(tensor.bytes(), 1));
  const bool floating = tensor.dtype == KOLO_FLOAT32 || tensor.dtype == KOLO_FLOAT64;
  const bool integer =
      tensor.dtype == KOLO_INT16 || tensor.dtype == KOLO_INT32 || tensor.dtype == KOLO_INT64;
  if (!(floating && (tensor.op == KOLO_SUM || tensor.op == KOLO_AVG)) &&
      !(integer && tensor.op == KOLO_SUM && tensor.prescale == 1.0 && tensor.postscale == 1.0)) {
    return;  // only these have an independent reference here; the rest is compared bitwise
  }
  for (int rank = 0; rank < g_size; ++rank) {
    fill_random(tensor.dtype, tensor.op, input.data(), tensor.count, tensor.seed(rank, step));
    for (uint64_t i = 0; i < tensor.count; ++i) {
      if (tensor.dtype == KOLO_FLOAT32) {
        float v;
        std::memcpy(&v, input.data() + 4 * i, 4);
        expected[i] += v * tensor.prescale;
      } else if (tensor.dtype == KOLO_FLOAT64) {
        double v;
        std::memcpy(&v, input.data() + 8 * i, 8);
        expected[i] += v * tensor.prescale;
      } else {
        uint64_t v = 0;
        std::memcpy(&v, input.data() + element_size(tensor.dtype) * i, element_size(tensor.dtype));
        exact[i] += v;
      }
    }
  }
  for (uint64_t i = 0; i < tensor.count; ++i) {
    if (integer) {
      uint64_t got = 0, want = exact[i];
      std::memcpy(&got, tensor.recv.data() + element_size(tensor.dtype) * i,
                  element_size(tensor.dtype));
      if (tensor.dtype == KOLO_INT32) want &= 0xffffffffu;
      if (tensor.dtype == KOLO_INT16) want &= 0xffffu;
      if (got != want) {
        fail(fmt::format("{} element {}: expected {:#x}, got {:#x}", tensor.name, i, want, got));
      }
      continue;
    }
    double want = expected[i];
    if (tensor.op == KOLO_AVG) want /= g_size;
    want *= tensor.postscale;
    double got;
    if (tensor.dtype == KOLO_FLOAT32) {
      float v;
      std::memcpy(&v, tensor.recv.data() + 4 * i, 4);
      got = v;
    } else {
      std::memcpy(&got, tensor.recv.data() + 8 * i, 8);
    }
    double tolerance = (tensor.dtype == KOLO_FLOAT32 ? 1e-5 : 1e-12) * g_size *
                       std::max(1.0, std::fabs(tensor.prescale * tensor.postscale));
    if (!(std::fabs(got - want) <= tolerance)) {
      fail(fmt::format("{} element {} (step {}): expected {:.9g}, got {:.9g}", tensor.name, i, step,
                       want, got));
    }
  }
}

Tensor make_tensor(std::string name, kolo_dtype_t dtype, kolo_op_t op, uint64_t count,
                   uint64_t id) {
  Tensor tensor;
  tensor.name = std::move(name);
  tensor.dtype = dtype;
  tensor.op = op;
  tensor.count = count;
  tensor.id = id;
  return tensor;
}

// ---- scenarios ---------------------------------------------------------------------------------

// Every rank submits the same tensors, each rank in its own order; results checked against the
// reference, and bitwise against an unfused run on the same inputs.
int run_orders(kolo_comm_t comm) {
  std::vector<Tensor> tensors;
  std::mt19937_64 sizes(42);  // the same on every rank
  for (uint64_t i = 0; i < 80; ++i) {
    uint64_t count = i % 7 == 0 ? sizes() % 5 : sizes() % 30000;
    tensors.push_back(make_tensor(fmt::format("layer{}.grad", i), KOLO_FLOAT32,
                                  i % 3 == 0 ? KOLO_AVG : KOLO_SUM, count, i));
  }
  // The engine's thread starts with the first named call: all it has timed lies after this.
  const auto engine_start = std::chrono::steady_clock::now();
  for (int round = 0; round < 2; ++round) {
    for (Tensor& tensor : tensors) tensor.prepare(round);
    submit_shuffled(comm, tensors, round);
    wait_all(tensors);
    for (const Tensor& tensor : tensors) check_against_reference(tensor, round);
  }
  kolo_fusion_stats_t stats = stats_of(comm);
  const auto elapsed_ns =
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now() - engine_start)
                                .count());
  fmt::print("rank {}: {} collectives, {} fused, {} tensors fused\n", g_rank, stats.collectives,
             stats.fused_collectives, stats.tensors_fused);
  if (g_size > 1 && stats.fused_collectives == 0) fail("nothing was fused");
  // The time breakdown: disjoint stretches of the engine's one thread, so together no more than
  // the time since it started; each non-zero exactly when there was something to time.
  const uint64_t timed = stats.collective_ns + stats.copy_ns + stats.negotiation_ns;
  if (stats.collective_ns == 0 || stats.negotiation_ns == 0 ||
      (stats.copy_ns == 0) != (stats.fused_collectives == 0) || timed > elapsed_ns) {
    fail(
        fmt::format("time breakdown: {} ns in collectives, {} ns copying, {} ns negotiating "
                    "({} collectives, {} fused) in {} ns since the first submission",
                    stats.collective_ns, stats.copy_ns, stats.negotiation_ns, stats.collectives,
                    stats.fused_collectives, elapsed_ns));
  }
  // A caller built before the breakdown passes the struct's older size: those bytes are filled
  // and nothing after them is written.
  kolo_fusion_stats_t older;
  std::memset(&older, 0xab, sizeof(older));
  older.struct_size = offsetof(kolo_fusion_stats_t, collective_ns);
  check(comm, kolo_comm_fusion_stats(comm, &older), "kolo_comm_fusion_stats (older size)");
  const auto* tail = reinterpret_cast<const unsigned char*>(&older) + older.struct_size;
  const bool untouched = std::all_of(tail, reinterpret_cast<const unsigned char*>(&older + 1),
                                     [](unsigned char byte) { return byte == 0xab; });
  if (!untouched || older.collectives != stats.collectives) {
    fail(
        fmt::format("kolo_comm_fusion_stats with the older struct_size {}: {} collectives "
                    "(expected {}), the bytes past it {}",
                    older.struct_size, older.collectives, stats.collectives,
                    untouched ? "untouched" : "overwritten"));
  }
  fmt::print("rank {}: orders checks passed\n", g_rank);
  return 0;
}

int run_many(kolo_comm_t comm) {
  std::vector<Tensor> tensors;
  for (uint64_t i = 0; i < 400; ++i) {
    tensors.push_back(
        make_tensor(fmt::format("small.{}", i), KOLO_FLOAT32, KOLO_SUM, 1 + (i * 37) % 97, i));
  }
  for (uint64_t step = 0; step < 3; ++step) {
    for (Tensor& tensor : tensors) tensor.prepare(step);
    submit_shuffled(comm, tensors, step);
    wait_all(tensors);
    for (const Tensor& tensor : tensors) check_against_reference(tensor, step);
  }
  kolo_fusion_stats_t stats = stats_of(comm);
  fmt::print("rank {}: {} tensors in {} collectives ({} fused)\n", g_rank, stats.tensors_submitted,
             stats.collectives, stats.fused_collectives);
  if (stats.collectives * 10 > stats.tensors_submitted) {
    fail(fmt::format("{} small tensors took {} collectives: fusion did not pack them",
                     stats.tensors_submitted, stats.collectives));
  }
  fmt::print("rank {}: many checks passed\n", g_rank);
  return 0;
}

// Tensor names carry their dtype and op, so that the timeline can be checked for collectives that
// mixed them (test_fusion.cpp does).
int run_mixed(kolo_comm_t comm) {
  struct Kind {
    kolo_dtype_t dtype;
    kolo_op_t op;
    double prescale;
  };
  const Kind kinds[] = {{KOLO_FLOAT32, KOLO_SUM, 1.0},
                        {KOLO_FLOAT32, KOLO_MAX, 1.0},
                        {KOLO_FLOAT64, KOLO_SUM, 1.0},
                        {KOLO_INT32, KOLO_SUM, 1.0},
                        {KOLO_FLOAT32, KOLO_SUM, 0.5}};
  std::vector<Tensor> tensors;
  for (int k = 0; k < 5; ++k) {
    for (int i = 0; i < 6; ++i) {
      // "float32-sum-x0.5/3": the part before '/' says what may be fused together.
      Tensor tensor = make_tensor(fmt::format("{}-{}-x{}/{}", dtype_text(kinds[k].dtype),
                                              op_text(kinds[k].op), kinds[k].prescale, i),
                                  kinds[k].dtype, kinds[k].op, 100 + 37 * i, k * 10 + i);
      tensor.prescale = kinds[k].prescale;
      tensors.push_back(std::move(tensor));
    }
  }
  for (uint64_t step = 0; step < 3; ++step) {
    for (Tensor& tensor : tensors) tensor.prepare(step);
    submit_shuffled(comm, tensors, step);
    wait_all(tensors);
    for (const Tensor& tensor : tensors) check_against_reference(tensor, step);
  }
  kolo_fusion_stats_t stats = stats_of(comm);
  if (stats.collectives < 3 * 5) {
    fail(fmt::format("{} collectives for 3 steps of 5 kinds that must not mix", stats.collectives));
  }
  fmt::print("rank {}: mixed checks passed\n", g_rank);
  return 0;
}

// One rank measures what fusing costs too: with nobody to talk to, a collective's latency is a
// fraction of a microsecond, so once three fused collectives have measured the copy cost a 512 KiB
// tensor runs alone. (A single rank used to skip the latency probe and, with no latency measured,
// fused every tensor below a megabyte.)
int run_measured(kolo_comm_t comm) {
  std::vector<Tensor> tensors;
  tensors.push_back(make_tensor("measured.large", KOLO_FLOAT32, KOLO_SUM, 128 * 1024, 0));
  for (uint64_t i = 1; i <= 8; ++i) {
    tensors.push_back(
        make_tensor(fmt::format("measured.small.{}", i), KOLO_FLOAT32, KOLO_SUM, 4096, i));
  }
  constexpr uint64_t kSteps = 12;
  kolo_fusion_stats_t before{};
  for (uint64_t step = 0; step < kSteps; ++step) {
    if (step == kSteps - 1) before = stats_of(comm);
    for (Tensor& tensor : tensors) tensor.prepare(step);
    submit_shuffled(comm, tensors, step);
    wait_all(tensors);
    for (const Tensor& tensor : tensors) check_against_reference(tensor, step);
  }
  const kolo_fusion_stats_t after = stats_of(comm);
  if (after.fused_collectives < 3) {
    fail(
        fmt::format("{} fused collectives in {} steps; the first steps fuse until the copy cost "
                    "is measured",
                    after.fused_collectives, kSteps));
  }
  const uint64_t fused = after.tensors_fused - before.tensors_fused;
  if (fused == tensors.size()) {
    fail(fmt::format("the last step still fused all {} tensors, the 512 KiB one included", fused));
  }
  fmt::print("rank {}: measured checks passed ({} of {} tensors fused in the last step)\n", g_rank,
             fused, tensors.size());
  return 0;
}

int run_large(kolo_comm_t comm) {
  // KOLO_FUSION_THRESHOLD=64K (set by the test): 100000 floats never fit.
  std::vector<Tensor> tensors;
  for (uint64_t i = 0; i < 12; ++i) {
    bool large = i % 4 == 0;
    tensors.push_back(make_tensor(fmt::format("{}.{}", large ? "large" : "small", i), KOLO_FLOAT32,
                                  KOLO_SUM, large ? 100000 + i : 1000 + i, i));
  }
  for (uint64_t step = 0; step < 2; ++step) {
    for (Tensor& tensor : tensors) tensor.prepare(step);
    submit_shuffled(comm, tensors, step);
    wait_all(tensors);
    for (const Tensor& tensor : tensors) check_against_reference(tensor, step);
  }
  kolo_fusion_stats_t stats = stats_of(comm);
  if (stats.tensors_fused > 2 * 9) fail("a tensor larger than the threshold was fused");
  if (g_size > 1 && stats.fused_collectives == 0) fail("the small tensors were not fused");
  if (stats.fusion_buffer_bytes > (64u << 10)) {
    fail(fmt::format("the fusion buffer grew to {} bytes, beyond the 64K threshold",
                     stats.fusion_buffer_bytes));
  }
  fmt::print("rank {}: large checks passed\n", g_rank);
  return 0;
}

// Tensors of a megabyte or more (never fused, whatever the engine measures) run on one ring per
// response and kind (ring_allreduce_pieces) where the ranks talk over the network: nothing copied,
// fewer collectives than tensors, the results correct and bitwise those of kolo_allreduce; with
// fusion off, and over kolo's shared-memory rings, one collective each.
int run_one_ring(kolo_comm_t comm) {
  // Where the job runs over the shared-memory rings (registry.cpp: KOLO_SHM=auto means on for
  // UCX, off for TCP; every rank of a test is on one host).
  auto variable = [](const char* name) {
    const char* value = std::getenv(name);
    return std::string(value ? value : "");
  };
  const std::string transport = variable("KOLO_TRANSPORT"), shm = variable("KOLO_SHM");
  const bool through_memory = transport == "tcp" ? shm == "1" : shm != "0";
  std::vector<Tensor> tensors;
  for (uint64_t i = 0; i < 11; ++i) {
    const bool sum = i < 7, single = i < 9;
    Tensor tensor =
        make_tensor(fmt::format("big.{}", i), single ? KOLO_FLOAT32 : KOLO_FLOAT64,
                    sum ? KOLO_SUM : KOLO_AVG, (single ? 262144 : 131072) + 1001 * i, i);
    if (!sum && single) tensor.postscale = 0.5;
    tensors.push_back(std::move(tensor));
  }
  const uint64_t steps = 4;
  for (int round = 0; round < 2; ++round) {
    const bool fusing = round == 0;
    check(comm, kolo_barrier(comm), "barrier");
    check(comm, kolo_comm_set_fusion_threshold(comm, fusing ? (64u << 20) : 0),
          "kolo_comm_set_fusion_threshold");
    kolo_fusion_stats_t before = stats_of(comm);
    for (uint64_t step = 0; step < steps; ++step) {
      for (Tensor& tensor : tensors) tensor.prepare(step);
      submit_shuffled(comm, tensors, step + 10 * round);
      wait_all(tensors);
      for (const Tensor& tensor : tensors) check_against_reference(tensor, step);
      // The same inputs by ordered calls: bit for bit what the engine gave.
      for (Tensor& tensor : tensors) {
        std::vector<unsigned char> ordered(tensor.recv.size(), 0xCD);
        check(comm,
              kolo_allreduce_scaled(comm, tensor.send.data(), ordered.data(), tensor.count,
                                    tensor.dtype, tensor.op, tensor.prescale, tensor.postscale),
              "kolo_allreduce_scaled " + tensor.name);
        if (ordered != tensor.recv) {
          fail(fmt::format("{} step {}: the engine's result differs from kolo_allreduce's",
                           tensor.name, step));
        }
      }
    }
    kolo_fusion_stats_t after = stats_of(comm);
    const uint64_t collectives = after.collectives - before.collectives;
    const uint64_t submitted = steps * tensors.size();
    if (after.tensors_fused != before.tensors_fused || after.bytes_copied != before.bytes_copied) {
      fail("a tensor of a megabyte or more went through the fusion buffer");
    }
    // Three kinds (float32 sums, float32 averages, float64 averages): at least three collectives
    // a step; fewer than one per tensor unless every submission came in a cycle of its own.
    if (fusing && g_size > 1 && !through_memory &&
        (collectives < 3 * steps || collectives >= submitted)) {
      fail(fmt::format("{} tensors in {} steps took {} collectives", tensors.size(), steps,
                       collectives));
    }
    if ((!fusing || through_memory) && collectives != submitted) {
      fail(fmt::format("{} {} tensors took {} collectives, not one each",
                       fusing ? "over shared memory" : "with fusion off", submitted, collectives));
    }
    fmt::print("rank {}: {} tensors, {} collectives ({}{})\n", g_rank, submitted, collectives,
               fusing ? "fusing" : "fusion off", through_memory ? ", shared memory" : "");
  }
  fmt::print("rank {}: one_ring checks passed\n", g_rank);
  return 0;
}

// Every dtype x op, with and without factors, below and above the size where the engine switches
// from recursive doubling to the ring: fused results equal unfused ones and kolo_allreduce's
// (one host: the flat schedules) bit for bit.
int run_bitwise(kolo_comm_t comm) {
  const kolo_dtype_t dtypes[] = {KOLO_FLOAT32, KOLO_FLOAT64, KOLO_FLOAT16, KOLO_BFLOAT16, KOLO_INT8,
                                 KOLO_UINT8,   KOLO_INT16,   KOLO_INT32,   KOLO_INT64};
  const kolo_op_t ops[] = {KOLO_SUM, KOLO_AVG, KOLO_MIN, KOLO_MAX, KOLO_PROD};
  std::vector<Tensor> tensors;
  std::mt19937_64 sizes(7);
  uint64_t id = 0;
  for (kolo_dtype_t dtype : dtypes) {
    for (kolo_op_t op : ops) {
      for (int i = 0; i < 4; ++i) {
        // The fourth is above 32 KiB x N for every dtype at N <= 4: reduced by the ring.
        const uint64_t count = i == 3 ? 140000 + sizes() % 5000 : 1 + sizes() % 5000;
        Tensor tensor = make_tensor(fmt::format("{}.{}.{}", dtype_text(dtype), op_text(op), i),
                                    dtype, op, count, id++);
        if (i == 2 && op != KOLO_PROD) {
          tensor.prescale = 0.75;
          tensor.postscale = 1.5;
        }
        tensors.push_back(std::move(tensor));
      }
    }
  }
  std::vector<std::vector<unsigned char>> fused(tensors.size());
  for (int round = 0; round < 3; ++round) {
    const bool fusing = round == 0, ordered = round == 2;
    check(comm, kolo_barrier(comm), "barrier");
    check(comm, kolo_comm_set_fusion_threshold(comm, fusing ? (64u << 20) : 0),
          "kolo_comm_set_fusion_threshold");
    kolo_fusion_stats_t before = stats_of(comm);
    for (Tensor& tensor : tensors) tensor.prepare(0);  // the same inputs in every round
    if (ordered) {
      for (Tensor& tensor : tensors) {
        check(comm,
              kolo_allreduce_scaled(comm, tensor.send.data(), tensor.recv.data(), tensor.count,
                                    tensor.dtype, tensor.op, tensor.prescale, tensor.postscale),
              "kolo_allreduce_scaled " + tensor.name);
      }
    } else {
      submit_shuffled(comm, tensors, round);
      wait_all(tensors);
    }
    kolo_fusion_stats_t after = stats_of(comm);
    uint64_t fused_now = after.fused_collectives - before.fused_collectives;
    if (fusing && g_size > 1 && fused_now == 0) fail("the fused round fused nothing");
    if (!fusing && fused_now != 0) fail("the unfused round fused something");
    for (size_t t = 0; t < tensors.size(); ++t) {
      const Tensor& tensor = tensors[t];
      if (fusing) {
        check_against_reference(tensor, 0);
        fused[t].assign(tensor.recv.begin(), tensor.recv.begin() + tensor.bytes());
        continue;
      }
      for (uint64_t i = 0; i < tensor.count; ++i) {
        const size_t size = element_size(tensor.dtype);
        if (std::memcmp(fused[t].data() + i * size, tensor.recv.data() + i * size, size) != 0) {
          uint64_t a = 0, b = 0;
          std::memcpy(&a, fused[t].data() + i * size, size);
          std::memcpy(&b, tensor.recv.data() + i * size, size);
          fail(fmt::format("{} element {}: fused {:#x} but {} {:#x}", tensor.name, i, a,
                           ordered ? "kolo_allreduce" : "unfused", b));
        }
      }
    }
    fmt::print("rank {}: round {} ({}): {} collectives, {} fused\n", g_rank, round,
               fusing    ? "fused"
               : ordered ? "ordered"
                         : "unfused",
               after.collectives - before.collectives, fused_now);
  }
  fmt::print("rank {}: bitwise checks passed ({} tensors, every dtype and op)\n", g_rank,
             tensors.size());
  return 0;
}

// A training loop whose set of tensors changes: 30 every step, an extra one every other step, one
// whose count changes at step 20; with a small cache (set by the test) slots are evicted.
int run_cache(kolo_comm_t comm, int steps) {
  std::vector<Tensor> base;
  for (uint64_t i = 0; i < 30; ++i) {
    base.push_back(make_tensor(fmt::format("w{}", i), KOLO_FLOAT32, KOLO_SUM, 50 + i * 13, i));
  }
  for (int step = 0; step < steps; ++step) {
    std::vector<Tensor> tensors = base;
    if (step % 2 == 0) {
      tensors.push_back(make_tensor(fmt::format("extra{}", step % 6), KOLO_FLOAT32, KOLO_SUM, 77,
                                    100 + step % 6));
    }
    tensors.push_back(
        make_tensor("resized", KOLO_FLOAT32, KOLO_SUM, step < steps / 2 ? 64 : 128, 200));
    for (Tensor& tensor : tensors) tensor.prepare(step);
    submit_shuffled(comm, tensors, step);
    wait_all(tensors);
    for (const Tensor& tensor : tensors) check_against_reference(tensor, step);
  }
  kolo_fusion_stats_t stats = stats_of(comm);
  fmt::print("rank {}: cache_hits {} negotiated {} cycles {} collectives {}\n", g_rank,
             stats.cache_hits, stats.negotiated, stats.cycles, stats.collectives);
  fmt::print("rank {}: cache checks passed\n", g_rank);
  return 0;
}

int run_group(kolo_comm_t comm) {
  for (uint64_t threshold : {uint64_t{64} << 20, uint64_t{0}}) {
    check(comm, kolo_barrier(comm), "barrier");
    check(comm, kolo_comm_set_fusion_threshold(comm, threshold), "set threshold");
    std::vector<Tensor> members;
    for (uint64_t i = 0; i < 5; ++i) {
      members.push_back(
          make_tensor(fmt::format("group.{}", i), KOLO_FLOAT32, KOLO_AVG, 100 + 1000 * i, 300 + i));
    }
    for (Tensor& tensor : members) tensor.prepare(threshold);
    std::vector<const char*> names;
    std::vector<const void*> sends;
    std::vector<void*> recvs;
    std::vector<uint64_t> counts;
    for (Tensor& tensor : members) {
      names.push_back(tensor.name.c_str());
      sends.push_back(tensor.send.data());
      recvs.push_back(tensor.recv.data());
      counts.push_back(tensor.count);
    }
    kolo_fusion_stats_t before = stats_of(comm);
    std::atomic<int> calls{0};
    kolo_async_options_t options = KOLO_ASYNC_OPTIONS_INITIALIZER;
    options.callback = [](kolo_status_t status, void* user) {
      if (status == KOLO_SUCCESS) ++*static_cast<std::atomic<int>*>(user);
    };
    options.user_data = &calls;
    kolo_request_t request;
    check(comm,
          kolo_allreduce_group_async(comm, 5, names.data(), sends.data(), recvs.data(),
                                     counts.data(), KOLO_FLOAT32, KOLO_AVG, &options, &request),
          "kolo_allreduce_group_async");
    if (kolo_request_wait(request) != KOLO_SUCCESS) {
      fail(fmt::format("group: {}", kolo_request_last_error(request)));
    }
    kolo_request_free(request);
    if (calls != 1) fail(fmt::format("the callback ran {} times", calls.load()));
    for (const Tensor& tensor : members) check_against_reference(tensor, threshold);
    kolo_fusion_stats_t after = stats_of(comm);
    uint64_t collectives = after.collectives - before.collectives;
    uint64_t fused = after.fused_collectives - before.fused_collectives;
    if (threshold > 0 && (collectives != 1 || fused != 1)) {
      fail(fmt::format("a group of 5 took {} collectives ({} fused) instead of one fused",
                       collectives, fused));
    }
    if (threshold == 0 && (collectives != 5 || fused != 0)) {
      fail(fmt::format("with fusion off a group of 5 took {} collectives ({} fused)", collectives,
                       fused));
    }
  }
  // Groups and single tensors, in different orders.
  check(comm, kolo_comm_set_fusion_threshold(comm, 64u << 20), "set threshold");
  std::vector<Tensor> singles;
  for (uint64_t i = 0; i < 6; ++i) {
    singles.push_back(
        make_tensor(fmt::format("single.{}", i), KOLO_FLOAT32, KOLO_SUM, 999, 400 + i));
    singles.back().prepare(9);
  }
  std::vector<Tensor> members;
  for (uint64_t i = 0; i < 3; ++i) {
    members.push_back(make_tensor(fmt::format("g2.{}", i), KOLO_FLOAT32, KOLO_SUM, 500, 500 + i));
    members.back().prepare(9);
  }
  const char* names[] = {members[0].name.c_str(), members[1].name.c_str(), members[2].name.c_str()};
  const void* sends[] = {members[0].send.data(), members[1].send.data(), members[2].send.data()};
  void* recvs[] = {members[0].recv.data(), members[1].recv.data(), members[2].recv.data()};
  const uint64_t counts[] = {500, 500, 500};
  kolo_request_t group = nullptr;
  if (g_rank % 2 == 0) submit_shuffled(comm, singles, 9);
  check(comm,
        kolo_allreduce_group_async(comm, 3, names, sends, recvs, counts, KOLO_FLOAT32, KOLO_SUM,
                                   nullptr, &group),
        "group");
  if (g_rank % 2 == 1) submit_shuffled(comm, singles, 9);
  wait_all(singles);
  if (kolo_request_wait(group) != KOLO_SUCCESS) fail(kolo_request_last_error(group));
  kolo_request_free(group);
  for (const Tensor& tensor : singles) check_against_reference(tensor, 9);
  for (const Tensor& tensor : members) check_against_reference(tensor, 9);
  fmt::print("rank {}: group checks passed\n", g_rank);
  return 0;
}

int run_broadcast(kolo_comm_t comm) {
  std::vector<std::vector<unsigned char>> buffers;
  std::vector<kolo_request_t> requests;
  struct Sent {
    int root;
    kolo_dtype_t dtype;
    uint64_t count;
  };
  std::vector<Sent> sent;
  for (int root = 0; root < g_size; ++root) {
    for (kolo_dtype_t dtype : {KOLO_FLOAT32, KOLO_INT8, KOLO_FLOAT64}) {
      uint64_t count = 1 + 977 * (root + 1) + dtype;
      std::vector<unsigned char> buffer(count * element_size(dtype) + 1);
      if (g_rank == root) {
        fill_random(dtype, KOLO_SUM, buffer.data(), count, 11 + root * 8 + dtype);
      } else {
        std::fill(buffer.begin(), buffer.end(), 0xCD);
      }
      buffers.push_back(std::move(buffer));
      sent.push_back({root, dtype, count});
    }
  }
  requests.resize(sent.size());
  std::vector<size_t> order(sent.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 random(g_rank + 1);
  std::shuffle(order.begin(), order.end(), random);
  for (size_t i : order) {
    check(comm,
          kolo_broadcast_async(comm, fmt::format("bcast.{}", i).c_str(), buffers[i].data(),
                               sent[i].count, sent[i].dtype, sent[i].root, nullptr, &requests[i]),
          "kolo_broadcast_async");
  }
  for (size_t i = 0; i < sent.size(); ++i) {
    if (kolo_request_wait(requests[i]) != KOLO_SUCCESS) fail(kolo_request_last_error(requests[i]));
    kolo_request_free(requests[i]);
    std::vector<unsigned char> expected(sent[i].count * element_size(sent[i].dtype));
    fill_random(sent[i].dtype, KOLO_SUM, expected.data(), sent[i].count,
                11 + sent[i].root * 8 + sent[i].dtype);
    if (std::memcmp(expected.data(), buffers[i].data(), expected.size()) != 0) {
      fail(fmt::format("broadcast {} from root {} delivered other bytes", i, sent[i].root));
    }
  }
  fmt::print("rank {}: broadcast checks passed\n", g_rank);
  return 0;
}

// kolo_join with uneven data: rank r has 2 + r steps, then joins. Each step submits 20 small
// float32 sums (fused), a 2 MiB float32 average (alone) and an int32 allgather of r + 1 elements;
// ranks that have joined count as zeros (and send no allgather elements). The last rank, alone at
// the end, also submits a broadcast from rank 0, which has joined: refused on it. Every rank's
// join returns the last rank; then one more allreduce of every rank runs as before.
int run_join(kolo_comm_t comm) {
  const int steps = 2 + g_rank;
  constexpr int kSmall = 20;
  constexpr uint64_t kSmallCount = 333;
  constexpr uint64_t kLargeCount = (2u << 20) / 4;
  auto active = [](int rank, int step) { return 2 + rank > step; };
  auto value = [](int rank, uint64_t k) { return static_cast<float>((rank + 1) * (k % 7 + 1)); };
  uint64_t capacity = 0;
  for (int q = 0; q < g_size; ++q) capacity += static_cast<uint64_t>(q + 1);
  for (int step = 0; step < steps; ++step) {
    std::vector<std::vector<float>> small(kSmall, std::vector<float>(kSmallCount));
    std::vector<float> large(kLargeCount);
    std::vector<int32_t> mine(static_cast<size_t>(g_rank + 1)), gathered(capacity, -1);
    for (auto& tensor : small) {
      for (uint64_t k = 0; k < kSmallCount; ++k) tensor[k] = value(g_rank, k);
    }
    for (uint64_t k = 0; k < kLargeCount; ++k) large[k] = value(g_rank, k);
    for (size_t j = 0; j < mine.size(); ++j) mine[j] = g_rank * 100 + static_cast<int32_t>(j);
    std::vector<kolo_request_t> requests(kSmall + 2);
    for (int i = 0; i < kSmall; ++i) {
      check(comm,
            kolo_allreduce_async(comm, fmt::format("join.{}.{}", step, i).c_str(), small[i].data(),
                                 small[i].data(), kSmallCount, KOLO_FLOAT32, KOLO_SUM, nullptr,
                                 &requests[i]),
            "kolo_allreduce_async");
    }
    check(comm,
          kolo_allreduce_async(comm, fmt::format("join.{}.large", step).c_str(), large.data(),
                               large.data(), kLargeCount, KOLO_FLOAT32, KOLO_AVG, nullptr,
                               &requests[kSmall]),
          "kolo_allreduce_async");
    check(comm,
          kolo_allgather_async(comm, fmt::format("join.{}.gather", step).c_str(), mine.data(),
                               mine.size(), gathered.data(), capacity, KOLO_INT32, nullptr,
                               &requests[kSmall + 1]),
          "kolo_allgather_async");
    for (kolo_request_t request : requests) {
      if (kolo_request_wait(request) != KOLO_SUCCESS) fail(kolo_request_last_error(request));
    }
    // The references: the ranks still active at this step, in rank order.
    for (uint64_t k = 0; k < kLargeCount; ++k) {
      float sum = 0;
      for (int q = 0; q < g_size; ++q) sum += active(q, step) ? value(q, k) : 0.0f;
      if (k < kSmallCount) {
        for (int i = 0; i < kSmall; ++i) {
          if (small[i][k] != sum) {
            fail(fmt::format("step {} tensor {} element {}: {} where the active ranks sum to {}",
                             step, i, k, small[i][k], sum));
          }
        }
      }
      if (large[k] != sum / static_cast<float>(g_size)) {
        fail(fmt::format("step {} large element {}: {} where the average over {} ranks is {}", step,
                         k, large[k], g_size, sum / static_cast<float>(g_size)));
      }
    }
    std::vector<uint64_t> counts(g_size);
    check(comm, kolo_request_counts(requests[kSmall + 1], counts.data(), g_size),
          "kolo_request_counts");
    size_t at = 0;
    for (int q = 0; q < g_size; ++q) {
      const uint64_t expected = active(q, step) ? static_cast<uint64_t>(q + 1) : 0;
      if (counts[q] != expected) {
        fail(fmt::format("step {}: rank {} gathered {} elements, expected {}", step, q, counts[q],
                         expected));
      }
      for (uint64_t j = 0; j < expected; ++j, ++at) {
        if (gathered[at] != q * 100 + static_cast<int32_t>(j)) {
          fail(fmt::format("step {}: gathered element {} is {}", step, at, gathered[at]));
        }
      }
    }
    for (kolo_request_t request : requests) kolo_request_free(request);
  }
  if (g_rank == g_size - 1 && g_size > 1) {  // everyone else has joined by now
    std::vector<float> buffer(10, 1.0f);
    kolo_request_t request = nullptr;
    check(comm,
          kolo_broadcast_async(comm, "join.from_joined_root", buffer.data(), buffer.size(),
                               KOLO_FLOAT32, 0, nullptr, &request),
          "kolo_broadcast_async");
    if (kolo_request_wait(request) != KOLO_ERR_INVALID_ARGUMENT ||
        !contains(kolo_request_last_error(request), "kolo_join")) {
      fail(fmt::format("a broadcast from a rank that has joined: {}",
                       kolo_request_last_error(request)));
    }
    kolo_request_free(request);
  }
  int last = -1;
  check(comm, kolo_join(comm, &last), "kolo_join");
  if (last != g_size - 1) fail(fmt::format("kolo_join returned {}, not {}", last, g_size - 1));
  // Joining is over: a named allreduce needs every rank again.
  std::vector<float> after(1000, static_cast<float>(g_rank + 1));
  kolo_request_t request = nullptr;
  check(comm,
        kolo_allreduce_async(comm, "join.after", after.data(), after.data(), after.size(),
                             KOLO_FLOAT32, KOLO_SUM, nullptr, &request),
        "kolo_allreduce_async");
  if (kolo_request_wait(request) != KOLO_SUCCESS) fail(kolo_request_last_error(request));
  kolo_request_free(request);
  const float all = static_cast<float>(g_size * (g_size + 1) / 2);
  for (float x : after) {
    if (x != all) fail(fmt::format("after the join: {} where every rank sums to {}", x, all));
  }
  fmt::print("rank {}: join checks passed\n", g_rank);
  return 0;
}

int run_duplicate(kolo_comm_t comm) {
  Tensor first = make_tensor("dup", KOLO_FLOAT32, KOLO_SUM, 1000, 1);
  first.prepare(0);
  submit(comm, first);
  Tensor second = make_tensor("dup", KOLO_FLOAT32, KOLO_SUM, 1000, 1);
  second.prepare(0);
  kolo_request_t request = reinterpret_cast<kolo_request_t>(1);
  kolo_status_t status = kolo_allreduce_async(comm, "dup", second.send.data(), second.recv.data(),
                                              1000, KOLO_FLOAT32, KOLO_SUM, nullptr, &request);
  std::string message = kolo_comm_last_error(comm);
  fmt::print("rank {}: second submission: {}: {}\n", g_rank, kolo_status_string(status), message);
  if (status != KOLO_ERR_INVALID_ARGUMENT) fail("a duplicate name was accepted");
  if (request != nullptr) fail("a refused submission left *request set");
  if (!contains(message, "'dup'") || !contains(message, "already pending")) {
    fail("the message does not name the tensor and the problem: " + message);
  }
  // A group that reuses a pending name is refused too.
  const char* names[] = {"other", "dup"};
  const void* sends[] = {second.send.data(), second.send.data() + 400};
  void* recvs[] = {second.recv.data(), second.recv.data() + 400};
  const uint64_t counts[] = {100, 100};
  status = kolo_allreduce_group_async(comm, 2, names, sends, recvs, counts, KOLO_FLOAT32, KOLO_SUM,
                                      nullptr, &request);
  if (status != KOLO_ERR_INVALID_ARGUMENT) fail("a group reusing a pending name was accepted");
  std::vector<Tensor> tensors;
  tensors.push_back(std::move(first));
  wait_all(tensors);
  check_against_reference(tensors[0], 0);
  // Completed: the name can be used again.
  second.prepare(0);
  submit(comm, second);
  std::vector<Tensor> again;
  again.push_back(std::move(second));
  wait_all(again);
  check_against_reference(again[0], 0);
  fmt::print("rank {}: duplicate checks passed\n", g_rank);
  return 0;
}

int run_mismatch(kolo_comm_t comm) {
  const bool odd = g_rank == g_size - 1;
  std::vector<Tensor> tensors;
  tensors.push_back(make_tensor("good.before", KOLO_FLOAT32, KOLO_SUM, 500, 1));
  tensors.push_back(make_tensor("bad.count", KOLO_FLOAT32, KOLO_SUM, odd ? 999 : 1000, 2));
  tensors.push_back(make_tensor("bad.dtype", odd ? KOLO_INT32 : KOLO_FLOAT32, KOLO_SUM, 300, 3));
  tensors.push_back(make_tensor("good.after", KOLO_FLOAT32, KOLO_SUM, 700, 4));
  for (Tensor& tensor : tensors) tensor.prepare(0);
  submit_shuffled(comm, tensors, 0);
  for (Tensor& tensor : tensors) {
    kolo_status_t status = kolo_request_wait(tensor.request);
    std::string message = kolo_request_last_error(tensor.request);
    kolo_request_free(tensor.request);
    tensor.request = nullptr;
    const bool bad = tensor.name.rfind("bad", 0) == 0;
    fmt::print("rank {}: {}: {} {}\n", g_rank, tensor.name, kolo_status_string(status), message);
    if (!bad) {
      if (status != KOLO_SUCCESS) fail(tensor.name + " failed: " + message);
      check_against_reference(tensor, 0);
      continue;
    }
    if (status != KOLO_ERR_MISMATCH) fail(tensor.name + " did not fail with KOLO_ERR_MISMATCH");
    std::string last = fmt::format("rank {}", g_size - 1);
    std::vector<std::string> wanted = {"'" + tensor.name + "'", "disagree", last};
    if (tensor.name == "bad.count") {
      wanted.push_back("count 999");
      wanted.push_back("count 1000");
    } else {
      wanted.push_back("int32");
      wanted.push_back("float32");
    }
    for (const std::string& part : wanted) {
      if (!contains(message, part)) fail(fmt::format("'{}' missing from: {}", part, message));
    }
  }
  // The engine goes on.
  std::vector<Tensor> later;
  later.push_back(make_tensor("after.mismatch", KOLO_FLOAT32, KOLO_SUM, 321, 5));
  later[0].prepare(0);
  submit(comm, later[0]);
  wait_all(later);
  check_against_reference(later[0], 0);
  fmt::print("rank {}: mismatch checks passed\n", g_rank);
  return 0;
}

// The last rank dies while the others have requests pending that it never submits.
int run_peerlost(kolo_comm_t comm) {
  const int victim = g_size - 1;
  std::vector<Tensor> ready;
  ready.push_back(make_tensor("ready", KOLO_FLOAT32, KOLO_SUM, 10, 1));
  ready[0].prepare(0);
  submit(comm, ready[0]);
  wait_all(ready);
  if (g_rank == victim) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ::raise(SIGKILL);
  }
  std::vector<Tensor> tensors;
  for (uint64_t i = 0; i < 8; ++i) {
    tensors.push_back(make_tensor(fmt::format("pending.{}", i), KOLO_FLOAT32, KOLO_SUM, 100, i));
    tensors.back().prepare(0);
    submit(comm, tensors.back());
  }
  auto start = std::chrono::steady_clock::now();
  for (Tensor& tensor : tensors) {
    kolo_status_t status = kolo_request_wait(tensor.request);
    std::string message = kolo_request_last_error(tensor.request);
    kolo_request_free(tensor.request);
    if (status != KOLO_ERR_PEER_LOST || !contains(message, fmt::format("rank {}", victim))) {
      fail(fmt::format("{}: expected KOLO_ERR_PEER_LOST naming rank {}, got {}: {}", tensor.name,
                       victim, kolo_status_string(status), message));
    }
  }
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Later submissions fail at once.
  Tensor late = make_tensor("late", KOLO_FLOAT32, KOLO_SUM, 10, 9);
  late.prepare(0);
  kolo_request_t request;
  kolo_status_t status = kolo_allreduce_async(comm, "late", late.send.data(), late.recv.data(), 10,
                                              KOLO_FLOAT32, KOLO_SUM, nullptr, &request);
  if (status != KOLO_ERR_PEER_LOST) {
    fail(fmt::format("a submission after the loss returned {}", kolo_status_string(status)));
  }
  fmt::print("rank {}: all pending requests failed with KOLO_ERR_PEER_LOST within {:.2f} s: {}\n",
             g_rank, waited, kolo_comm_last_error(comm));
  fmt::print("rank {}: peerlost checks passed\n", g_rank);
  return 0;
}

struct CallbackRecord {
  std::atomic<int> calls{0};
  std::atomic<int> status{-1};
};

// Requests that can never complete (each rank's own name) when the communicator is destroyed.
// Rank 0 destroys first; the others a second later.
int run_destroy(kolo_comm_t comm) {
  std::vector<Tensor> common;
  common.push_back(make_tensor("common", KOLO_FLOAT32, KOLO_SUM, 100, 1));
  common[0].prepare(0);
  submit(comm, common[0]);
  wait_all(common);
  std::vector<unsigned char> buffer(4000);
  CallbackRecord record;
  kolo_async_options_t options = KOLO_ASYNC_OPTIONS_INITIALIZER;
  options.callback = [](kolo_status_t status, void* user) {
    auto* r = static_cast<CallbackRecord*>(user);
    r->status = status;
    ++r->calls;
  };
  options.user_data = &record;
  kolo_request_t request;
  std::string name = fmt::format("only.on.rank{}", g_rank);
  check(comm,
        kolo_allreduce_async(comm, name.c_str(), buffer.data(), buffer.data(), 1000, KOLO_FLOAT32,
                             KOLO_SUM, &options, &request),
        "submit");
  kolo_request_t unwaited;  // freed before the destroy: must not crash or leak a callback
  check(comm,
        kolo_allreduce_async(comm, (name + ".freed").c_str(), buffer.data() + 2000,
                             buffer.data() + 2000, 10, KOLO_FLOAT32, KOLO_SUM, nullptr, &unwaited),
        "submit");
  kolo_request_free(unwaited);
  std::this_thread::sleep_for(std::chrono::milliseconds(g_rank == 0 ? 300 : 1300));
  auto start = std::chrono::steady_clock::now();
  if (kolo_comm_destroy(comm) != KOLO_SUCCESS) fail("destroy failed");
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int done = 0;
  kolo_status_t tested = kolo_request_test(request, &done);
  kolo_status_t waited = kolo_request_wait(request);
  std::string message = kolo_request_last_error(request);
  kolo_request_free(request);
  fmt::print(
      "rank {}: destroy took {:.3f} s; request {} ({}): {}; callback ran {} time(s) with {}\n",
      g_rank, took, kolo_status_string(waited), done, message, record.calls.load(),
      kolo_status_string(static_cast<kolo_status_t>(record.status.load())));
  if (took > 5.0) fail("destroy took too long");
  if (!done || tested != waited) fail("the request was not complete after destroy");
  const kolo_status_t expected = g_rank == 0 ? KOLO_ERR_CANCELLED : waited;
  if (waited != expected || (waited != KOLO_ERR_CANCELLED && waited != KOLO_ERR_PEER_LOST)) {
    fail(
        fmt::format("expected KOLO_ERR_CANCELLED (or, after rank 0 left, KOLO_ERR_PEER_LOST), "
                    "got {}",
                    kolo_status_string(waited)));
  }
  if (!contains(message, name)) fail("the message does not name the tensor: " + message);
  if (record.calls != 1 || record.status != waited) fail("the callback did not run exactly once");
  fmt::print("rank {}: destroy checks passed\n", g_rank);
  return -1;  // destroyed already
}

// The end of a program: every rank's work is done, rank 0 destroys its communicator at once, the
// others a second later. Nobody's request may fail; afterwards a named call reports the departure.
int run_leave(kolo_comm_t comm) {
  for (uint64_t step = 0; step < 3; ++step) {
    std::vector<Tensor> tensors;
    for (uint64_t i = 0; i < 20; ++i) {
      tensors.push_back(
          make_tensor(fmt::format("last.{}", i), KOLO_FLOAT32, KOLO_SUM, 10 + 5000 * (i % 4), i));
      tensors.back().prepare(step);
    }
    submit_shuffled(comm, tensors, step);
    wait_all(tensors);
    for (const Tensor& tensor : tensors) check_against_reference(tensor, step);
  }
  if (g_rank == 0) {
    if (kolo_comm_destroy(comm) != KOLO_SUCCESS) fail("destroy failed");
    fmt::print("rank 0: leave checks passed\n");
    return -1;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  std::vector<float> data(10, 1.0f);
  kolo_request_t request = nullptr;
  kolo_status_t status = kolo_allreduce_async(comm, "after.leaving", data.data(), data.data(), 10,
                                              KOLO_FLOAT32, KOLO_SUM, nullptr, &request);
  std::string message = kolo_comm_last_error(comm);
  fmt::print("rank {}: a named call after rank 0 left: {}: {}\n", g_rank,
             kolo_status_string(status), message);
  if (status != KOLO_ERR_PEER_LOST || !contains(message, "rank 0 destroyed its communicator")) {
    fail("expected KOLO_ERR_PEER_LOST saying that rank 0 destroyed its communicator");
  }
  fmt::print("rank {}: leave checks passed\n", g_rank);
  return 0;
}

int run_stall(kolo_comm_t comm, bool abort) {
  const bool late = g_rank == g_size - 1;
  std::vector<Tensor> tensors;
  tensors.push_back(make_tensor("early", KOLO_FLOAT32, KOLO_SUM, 100, 1));
  tensors.push_back(
      make_tensor(abort ? "never.tensor" : "late.tensor", KOLO_FLOAT32, KOLO_SUM, 100, 2));
  for (Tensor& tensor : tensors) tensor.prepare(0);
  submit(comm, tensors[0]);
  if (!late) submit(comm, tensors[1]);
  if (late && !abort) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    submit(comm, tensors[1]);
  }
  if (late && abort) tensors.pop_back();  // never submitted here
  if (!abort || late) {
    wait_all(tensors);
  } else {
    Tensor never = std::move(tensors.back());
    tensors.pop_back();
    wait_all(tensors);
    kolo_status_t status = kolo_request_wait(never.request);
    std::string message = kolo_request_last_error(never.request);
    kolo_request_free(never.request);
    fmt::print("rank {}: never.tensor: {}: {}\n", g_rank, kolo_status_string(status), message);
    if (status != KOLO_ERR_TIMEOUT || !contains(message, "'never.tensor'") ||
        !contains(message, fmt::format("not by rank {}", g_size - 1))) {
      fail("expected KOLO_ERR_TIMEOUT naming the tensor and the missing rank");
    }
  }
  // The engine goes on.
  check(comm, kolo_barrier(comm), "barrier");
  std::vector<Tensor> after;
  after.push_back(make_tensor("after.stall", KOLO_FLOAT32, KOLO_SUM, 100, 3));
  after[0].prepare(0);
  submit(comm, after[0]);
  wait_all(after);
  check_against_reference(after[0], 0);
  fmt::print("rank {}: stall checks passed\n", g_rank);
  return 0;
}

// The last rank submits a tensor 1.5 s after the others, the test having set KOLO_CYCLE_TIME_MS to
// 1000: the others ask for it again after 0.25 ms, 0.5, 1, ... up to a second (the last ask before
// it comes at about 1.02 s, the next at about 2.02 s). Its submission must start the next cycle
// itself (engine.cpp, loop()), not wait half a second for the others' next ask.
int run_late(kolo_comm_t comm) {
  const bool late = g_rank == g_size - 1;
  std::vector<Tensor> before;  // every engine connected, then idle
  before.push_back(make_tensor("before.late", KOLO_FLOAT32, KOLO_SUM, 100, 1));
  before[0].prepare(0);
  submit(comm, before[0]);
  wait_all(before);
  check_against_reference(before[0], 0);
  check(comm, kolo_barrier(comm), "barrier");
  std::vector<Tensor> tensors;
  tensors.push_back(make_tensor("late.tensor", KOLO_FLOAT32, KOLO_SUM, 100, 2));
  tensors[0].prepare(0);
  if (late) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const auto submitted = std::chrono::steady_clock::now();
  submit(comm, tensors[0]);
  wait_all(tensors);
  const double waited_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - submitted)
          .count();
  check_against_reference(tensors[0], 0);
  fmt::print("rank {}: late.tensor completed {:.1f} ms after this rank submitted it\n", g_rank,
             waited_ms);
  if (!late && waited_ms < 1400) fail("expected to wait for the late rank's 1.5 s");
  if (late && waited_ms > 250) {
    fail(
        fmt::format("expected the late rank's submission to start the next cycle at once; it "
                    "waited {:.1f} ms, as if for the others' next ask",
                    waited_ms));
  }
  fmt::print("rank {}: late checks passed\n", g_rank);
  return 0;
}

// Ordered collectives on the main thread while another thread runs named ones.
int run_threads(kolo_comm_t comm) {
  std::atomic<bool> failed{false};
  std::string failure;
  std::thread named([&] {
    for (uint64_t step = 0; step < 40 && !failed; ++step) {
      std::vector<Tensor> tensors;
      for (uint64_t i = 0; i < 8; ++i) {
        tensors.push_back(make_tensor(fmt::format("named.{}", i), KOLO_FLOAT32, KOLO_SUM,
                                      200 + 3000 * (i % 3), i));
        tensors.back().prepare(step);
      }
      submit_shuffled(comm, tensors, step);
      wait_all(tensors);
      for (const Tensor& tensor : tensors) check_against_reference(tensor, step);
    }
  });
  std::vector<int32_t> data(5000);
  for (int iteration = 0; iteration < 150; ++iteration) {
    for (size_t i = 0; i < data.size(); ++i) data[i] = g_rank + static_cast<int32_t>(i) + iteration;
    check(comm, kolo_allreduce(comm, data.data(), data.data(), data.size(), KOLO_INT32, KOLO_SUM),
          "ordered allreduce");
    for (size_t i = 0; i < data.size(); ++i) {
      int32_t want = g_size * (static_cast<int32_t>(i) + iteration) + g_size * (g_size - 1) / 2;
      if (data[i] != want) {
        fail(fmt::format("ordered allreduce {} element {}: {} instead of {}", iteration, i, data[i],
                         want));
      }
    }
  }
  named.join();
  fmt::print("rank {}: threads checks passed\n", g_rank);
  return 0;
}

double cpu_seconds() {
  timespec now;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return now.tv_sec + now.tv_nsec * 1e-9;
}

int run_idle(kolo_comm_t comm) {
  for (int round = 0; round < 3; ++round) {
    std::vector<Tensor> tensors;
    for (uint64_t i = 0; i < 5; ++i) {
      tensors.push_back(make_tensor(fmt::format("idle.{}", i), KOLO_FLOAT32, KOLO_SUM, 100, i));
      tensors.back().prepare(round);
    }
    submit_shuffled(comm, tensors, round);
    wait_all(tensors);
    for (const Tensor& tensor : tensors) check_against_reference(tensor, round);
    // Let the engines see that nobody has work, then stay idle for a while.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kolo_fusion_stats_t before = stats_of(comm);
    double cpu_before = cpu_seconds();
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    kolo_fusion_stats_t after = stats_of(comm);
    double cpu = cpu_seconds() - cpu_before;
    fmt::print("rank {}: round {}: idle for 1.5 s: {} cycles, {:.1f} ms of CPU, {} idle sleeps\n",
               g_rank, round, after.cycles - before.cycles, cpu * 1e3, after.idle_sleeps);
    if (after.cycles != before.cycles) fail("the engine cycled while every rank was idle");
    if (cpu > 0.05) fail("the idle process used CPU time");
    if (after.idle_sleeps == 0) fail("the engine never went idle");
    check(comm, kolo_barrier(comm), "barrier");
  }
  fmt::print("rank {}: idle checks passed\n", g_rank);
  return 0;
}

int run_badargs(kolo_comm_t comm) {
  std::vector<float> data(100, 1.0f);
  kolo_request_t request = nullptr;
  std::string long_name(2000, 'x');
  kolo_async_options_t bad_options = KOLO_ASYNC_OPTIONS_INITIALIZER;
  bad_options.struct_size = 3;
  kolo_async_options_t nan_options = KOLO_ASYNC_OPTIONS_INITIALIZER;
  nan_options.prescale = NAN;
  const char* group_names[] = {"g.a", "g.a"};
  const void* group_sends[] = {data.data(), data.data() + 50};
  void* group_recvs[] = {data.data(), data.data() + 50};
  void* overlapping_recvs[] = {data.data(), data.data() + 10};
  const char* distinct_names[] = {"g.b", "g.c"};
  const uint64_t group_counts[] = {50, 50};
  struct Case {
    const char* what;
    kolo_status_t status;
  };
  const Case cases[] = {
      {"NULL name", kolo_allreduce_async(comm, nullptr, data.data(), data.data(), 100, KOLO_FLOAT32,
                                         KOLO_SUM, nullptr, &request)},
      {"empty name", kolo_allreduce_async(comm, "", data.data(), data.data(), 100, KOLO_FLOAT32,
                                          KOLO_SUM, nullptr, &request)},
      {"long name", kolo_allreduce_async(comm, long_name.c_str(), data.data(), data.data(), 100,
                                         KOLO_FLOAT32, KOLO_SUM, nullptr, &request)},
      {"NULL request", kolo_allreduce_async(comm, "a", data.data(), data.data(), 100, KOLO_FLOAT32,
                                            KOLO_SUM, nullptr, nullptr)},
      {"NULL sendbuf", kolo_allreduce_async(comm, "a", nullptr, data.data(), 100, KOLO_FLOAT32,
                                            KOLO_SUM, nullptr, &request)},
      {"unknown dtype",
       kolo_allreduce_async(comm, "a", data.data(), data.data(), 100, static_cast<kolo_dtype_t>(42),
                            KOLO_SUM, nullptr, &request)},
      {"unknown op", kolo_allreduce_async(comm, "a", data.data(), data.data(), 100, KOLO_FLOAT32,
                                          static_cast<kolo_op_t>(9), nullptr, &request)},
      {"overlap", kolo_allreduce_async(comm, "a", data.data(), data.data() + 1, 50, KOLO_FLOAT32,
                                       KOLO_SUM, nullptr, &request)},
      {"NaN prescale", kolo_allreduce_async(comm, "a", data.data(), data.data(), 100, KOLO_FLOAT32,
                                            KOLO_SUM, &nan_options, &request)},
      {"options size", kolo_allreduce_async(comm, "a", data.data(), data.data(), 100, KOLO_FLOAT32,
                                            KOLO_SUM, &bad_options, &request)},
      {"root -1",
       kolo_broadcast_async(comm, "b", data.data(), 100, KOLO_FLOAT32, -1, nullptr, &request)},
      {"root = size",
       kolo_broadcast_async(comm, "b", data.data(), 100, KOLO_FLOAT32, g_size, nullptr, &request)},
      {"group of 0",
       kolo_allreduce_group_async(comm, 0, group_names, group_sends, group_recvs, group_counts,
                                  KOLO_FLOAT32, KOLO_SUM, nullptr, &request)},
      {"group NULL arrays",
       kolo_allreduce_group_async(comm, 2, nullptr, group_sends, group_recvs, group_counts,
                                  KOLO_FLOAT32, KOLO_SUM, nullptr, &request)},
      {"group repeated name",
       kolo_allreduce_group_async(comm, 2, group_names, group_sends, group_recvs, group_counts,
                                  KOLO_FLOAT32, KOLO_SUM, nullptr, &request)},
      {"group overlapping outputs",
       kolo_allreduce_group_async(comm, 2, distinct_names, group_sends, overlapping_recvs,
                                  group_counts, KOLO_FLOAT32, KOLO_SUM, nullptr, &request)},
      {"NULL communicator", kolo_allreduce_async(nullptr, "a", data.data(), data.data(), 100,
                                                 KOLO_FLOAT32, KOLO_SUM, nullptr, &request)},
  };
  for (const Case& c : cases) {
    if (c.status != KOLO_ERR_INVALID_ARGUMENT) {
      fail(fmt::format("{}: expected KOLO_ERR_INVALID_ARGUMENT, got {}", c.what,
                       kolo_status_string(c.status)));
    }
    if (request != nullptr) fail(fmt::format("{}: *request was set", c.what));
  }
  // Each message names its problem: checked again one by one.
  auto expect_message = [&](kolo_status_t status, const char* part, const char* what) {
    std::string message = kolo_comm_last_error(comm);
    if (status != KOLO_ERR_INVALID_ARGUMENT || !contains(message, part)) {
      fail(fmt::format("{}: {} '{}' does not mention '{}'", what, kolo_status_string(status),
                       message, part));
    }
  };
  expect_message(kolo_allreduce_async(comm, "", data.data(), data.data(), 100, KOLO_FLOAT32,
                                      KOLO_SUM, nullptr, &request),
                 "empty", "empty name");
  expect_message(kolo_allreduce_async(comm, long_name.c_str(), data.data(), data.data(), 100,
                                      KOLO_FLOAT32, KOLO_SUM, nullptr, &request),
                 "1024", "long name");
  expect_message(
      kolo_broadcast_async(comm, "b", data.data(), 100, KOLO_FLOAT32, g_size, nullptr, &request),
      "root", "root");
  expect_message(
      kolo_allreduce_group_async(comm, 2, group_names, group_sends, group_recvs, group_counts,
                                 KOLO_FLOAT32, KOLO_SUM, nullptr, &request),
      "twice", "repeated name");
  expect_message(
      kolo_allreduce_group_async(comm, 2, distinct_names, group_sends, overlapping_recvs,
                                 group_counts, KOLO_FLOAT32, KOLO_SUM, nullptr, &request),
      "overlap", "overlapping outputs");
  expect_message(kolo_allreduce_async(comm, "a", data.data(), data.data(), 100, KOLO_FLOAT32,
                                      KOLO_SUM, &bad_options, &request),
                 "struct_size", "options");
  // Request and stats functions.
  int done;
  if (kolo_request_test(nullptr, &done) != KOLO_ERR_INVALID_ARGUMENT) fail("test(NULL)");
  if (kolo_request_wait(nullptr) != KOLO_ERR_INVALID_ARGUMENT) fail("wait(NULL)");
  if (kolo_request_free(nullptr) != KOLO_ERR_INVALID_ARGUMENT) fail("free(NULL)");
  if (std::string(kolo_request_last_error(nullptr)) != "") fail("last_error(NULL)");
  if (kolo_comm_fusion_stats(comm, nullptr) != KOLO_ERR_INVALID_ARGUMENT) fail("stats(NULL)");
  if (kolo_comm_set_fusion_threshold(comm, uint64_t{5} << 30) != KOLO_ERR_INVALID_ARGUMENT) {
    fail("a threshold of 5 GiB was accepted");
  }
  kolo_fusion_stats_t stats = stats_of(comm);
  if (stats.tensors_submitted != 0) fail("refused submissions were counted");
  // NULL buffers with count 0 are fine, and the engine works after all this.
  std::vector<Tensor> tensors;
  tensors.push_back(make_tensor("valid", KOLO_FLOAT32, KOLO_SUM, 100, 1));
  tensors[0].prepare(0);
  submit(comm, tensors[0]);
  kolo_request_t empty;
  check(comm,
        kolo_allreduce_async(comm, "empty", nullptr, nullptr, 0, KOLO_FLOAT32, KOLO_SUM, nullptr,
                             &empty),
        "count 0 with NULL buffers");
  wait_all(tensors);
  check_against_reference(tensors[0], 0);
  if (kolo_request_wait(empty) != KOLO_SUCCESS) fail("count 0 failed");
  kolo_request_free(empty);
  fmt::print("rank {}: badargs checks passed\n", g_rank);
  return 0;
}

// ---- named allgathers ---------------------------------------------------------------------------

// A named allgather of this rank: every rank's count for the current step, this rank's input and
// its receive buffer (recv_capacity elements, filled with 0xAB so that writes past the gathered
// total show).
struct Gather {
  std::string name;
  kolo_dtype_t dtype = KOLO_FLOAT32;
  uint64_t id = 0;
  std::vector<uint64_t> counts;  // [rank]
  uint64_t capacity = 0;
  std::vector<unsigned char> send, recv;
  kolo_request_t request = nullptr;

  size_t element() const { return element_size(dtype); }
  uint64_t total() const { return std::accumulate(counts.begin(), counts.end(), uint64_t{0}); }
  uint64_t seed(int rank, uint64_t step) const {
    return mix(id * 1000003 + static_cast<uint64_t>(rank) * 7919 + step * 104729 + 99991);
  }
  void prepare(uint64_t step, std::vector<uint64_t> every_count, uint64_t recv_capacity) {
    counts = std::move(every_count);
    capacity = recv_capacity;
    send.assign(std::max<size_t>(counts[g_rank] * element(), 1), 0);
    fill_random(dtype, KOLO_SUM, send.data(), counts[g_rank], seed(g_rank, step));
    recv.assign(std::max<size_t>(capacity * element(), 1), 0xAB);
  }
  // Empty buffers go in as NULL on odd ranks: allowed with a zero count or capacity.
  kolo_status_t submit(kolo_comm_t comm) {
    const bool nulls = g_rank % 2 == 1;
    const void* sendbuf = nulls && counts[g_rank] == 0 ? nullptr : send.data();
    void* recvbuf = nulls && capacity == 0 ? nullptr : recv.data();
    return kolo_allgather_async(comm, name.c_str(), sendbuf, counts[g_rank], recvbuf, capacity,
                                dtype, nullptr, &request);
  }
  // Element by element against every rank's regenerated input, in rank order; nothing written
  // past the total; kolo_request_counts reports every rank's count.
  void check(uint64_t step) const {
    std::vector<uint64_t> reported(counts.size() + 2, 777);
    kolo_status_t status =
        kolo_request_counts(request, reported.data(), static_cast<int>(reported.size()));
    if (status != KOLO_SUCCESS) {
      fail(fmt::format("kolo_request_counts of {}: {}: {}", name, kolo_status_string(status),
                       kolo_request_last_error(request)));
    }
    for (size_t r = 0; r < reported.size(); ++r) {
      uint64_t want = r < counts.size() ? counts[r] : 777;  // entries past size are not written
      if (reported[r] != want) {
        fail(fmt::format("{} step {}: kolo_request_counts entry {} is {}, expected {}", name, step,
                         r, reported[r], want));
      }
    }
    const size_t size = element();
    uint64_t at = 0;
    std::vector<unsigned char> input;
    for (int rank = 0; rank < g_size; ++rank) {
      input.assign(std::max<size_t>(counts[rank] * size, 1), 0);
      fill_random(dtype, KOLO_SUM, input.data(), counts[rank], seed(rank, step));
      for (uint64_t i = 0; i < counts[rank]; ++i, ++at) {
        if (std::memcmp(recv.data() + at * size, input.data() + i * size, size) != 0) {
          uint64_t got = 0, want = 0;
          std::memcpy(&got, recv.data() + at * size, size);
          std::memcpy(&want, input.data() + i * size, size);
          fail(
              fmt::format("{} ({}) step {}: element {} (rank {}'s element {}) is {:#x}, expected "
                          "{:#x}",
                          name, dtype_text(dtype), step, at, rank, i, got, want));
        }
      }
    }
    for (size_t byte = at * size; byte < capacity * size; ++byte) {
      if (recv[byte] != 0xAB) {
        fail(fmt::format("{} step {}: byte {} past the gathered {} elements was written", name,
                         step, byte, at));
      }
    }
  }
};

// Every rank's count of allgather tensor `id` at `step`, the same on every rank. Patterns:
// 0 varied, zero on one rank; 1 zero everywhere; 2 large (past Bruck's switch point, so the ring
// runs at four ranks too); 3 tiny, zero often; 4 only one rank sends.
std::vector<uint64_t> gather_counts(int pattern, uint64_t id, uint64_t step) {
  std::vector<uint64_t> counts(g_size);
  for (int rank = 0; rank < g_size; ++rank) {
    uint64_t random = mix(id * 31 + static_cast<uint64_t>(rank) * 1009 + step * 7 + 3);
    const bool chosen = static_cast<uint64_t>(rank) == (id + step) % g_size;
    switch (pattern) {
      case 0:
        counts[rank] = chosen ? 0 : 1 + random % 3000;
        break;
      case 1:
        counts[rank] = 0;
        break;
      case 2:
        counts[rank] = 30000 + random % 10000;
        break;
      case 3:
        counts[rank] = random % 4;
        break;
      default:
        counts[rank] = chosen ? 1 + random % 500 : 0;
    }
  }
  return counts;
}

int run_allgather(kolo_comm_t comm) {
  const kolo_dtype_t dtypes[] = {KOLO_FLOAT32, KOLO_FLOAT64, KOLO_FLOAT16, KOLO_BFLOAT16,
                                 KOLO_INT8,    KOLO_UINT8,   KOLO_INT32,   KOLO_INT64};
  struct Planned {
    int pattern;
    kolo_dtype_t dtype;
  };
  std::vector<Planned> plan;
  for (kolo_dtype_t dtype : dtypes) plan.push_back({0, dtype});
  plan.push_back({1, KOLO_FLOAT32});
  plan.push_back({2, KOLO_FLOAT32});
  plan.push_back({3, KOLO_INT64});
  plan.push_back({4, KOLO_UINT8});
  std::vector<Gather> gathers(plan.size());
  for (size_t g = 0; g < plan.size(); ++g) {
    gathers[g].name = fmt::format("gather.{}.{}", g, dtype_text(plan[g].dtype));
    gathers[g].dtype = plan[g].dtype;
    gathers[g].id = g;
  }
  std::vector<Tensor> reduced;
  for (uint64_t i = 0; i < 8; ++i) {
    reduced.push_back(
        make_tensor(fmt::format("reduce.{}", i), KOLO_FLOAT32, KOLO_SUM, 100 + 37 * i, 600 + i));
  }
  const uint64_t steps = 4;
  for (uint64_t step = 0; step < steps; ++step) {
    for (size_t g = 0; g < gathers.size(); ++g) {
      std::vector<uint64_t> counts = gather_counts(plan[g].pattern, g, step);
      uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
      const uint64_t slack[] = {0, 5, 1000};  // exactly the total, or more
      gathers[g].prepare(step, std::move(counts), total + slack[(g + step) % 3]);
    }
    for (Tensor& tensor : reduced) tensor.prepare(step);
    // Allgathers and allreduces in one order of this rank's own.
    std::vector<size_t> order(gathers.size() + reduced.size());
    std::iota(order.begin(), order.end(), 0);
    std::mt19937_64 random(mix(static_cast<uint64_t>(g_rank) * 131 + step * 17 + 1));
    std::shuffle(order.begin(), order.end(), random);
    for (size_t i : order) {
      if (i < gathers.size()) {
        check(comm, gathers[i].submit(comm), "kolo_allgather_async " + gathers[i].name);
      } else {
        submit(comm, reduced[i - gathers.size()]);
      }
    }
    for (Gather& gather : gathers) {
      kolo_status_t status = kolo_request_wait(gather.request);
      if (status != KOLO_SUCCESS) {
        fail(fmt::format("{} step {}: {}: {}", gather.name, step, kolo_status_string(status),
                         kolo_request_last_error(gather.request)));
      }
    }
    wait_all(reduced);
    for (Gather& gather : gathers) {
      gather.check(step);
      kolo_request_free(gather.request);
      gather.request = nullptr;
    }
    for (const Tensor& tensor : reduced) check_against_reference(tensor, step);
  }
  kolo_fusion_stats_t stats = stats_of(comm);
  fmt::print("rank {}: {} collectives ({} fused), negotiated {}, cache hits {}\n", g_rank,
             stats.collectives, stats.fused_collectives, stats.negotiated, stats.cache_hits);
  // Allgathers are never cached: each was negotiated in full every step (gather.9, whose counts
  // never change, too), while the allreduces hit the cache from the second step on.
  const uint64_t negotiated = steps * gathers.size() + reduced.size();
  const uint64_t hits = (steps - 1) * reduced.size();
  if (stats.negotiated != negotiated || stats.cache_hits != hits) {
    fail(fmt::format("negotiated {} and cache hits {}, expected {} and {}", stats.negotiated,
                     stats.cache_hits, negotiated, hits));
  }
  if (stats.collectives < steps * gathers.size()) {
    fail(fmt::format("{} collectives for {} allgathers, which each run alone", stats.collectives,
                     steps * gathers.size()));
  }
  fmt::print("rank {}: allgather checks passed\n", g_rank);
  return 0;
}

int run_allgather_errors(kolo_comm_t comm) {
  const int last = g_size - 1;
  auto expect_parts = [](const std::string& what, kolo_status_t status, kolo_status_t wanted,
                         const std::string& message, const std::vector<std::string>& parts) {
    fmt::print("rank {}: {}: {}: {}\n", g_rank, what, kolo_status_string(status), message);
    if (status != wanted) {
      fail(fmt::format("{}: expected {}, got {}: {}", what, kolo_status_string(wanted),
                       kolo_status_string(status), message));
    }
    for (const std::string& part : parts) {
      if (!contains(message, part))
        fail(fmt::format("{}: '{}' missing from: {}", what, part, message));
    }
  };

  // A request that stays pending while rank 0 looks at it: the others submit only after the
  // barrier. Rank 0 may not submit the name again, as an allgather or as anything else, nor read
  // counts that are not there yet.
  Gather pending;
  pending.name = "ag.pending";
  pending.id = 1;
  std::vector<uint64_t> pending_counts(g_size);
  for (int rank = 0; rank < g_size; ++rank) pending_counts[rank] = 3 * rank + 1;
  pending.prepare(0, pending_counts,
                  std::accumulate(pending_counts.begin(), pending_counts.end(), uint64_t{0}));
  if (g_size > 1) {
    if (g_rank == 0) {
      check(comm, pending.submit(comm), "kolo_allgather_async ag.pending");
      std::vector<uint64_t> counts(g_size);
      kolo_status_t status = kolo_request_counts(pending.request, counts.data(), g_size);
      expect_parts("counts of a pending request", status, KOLO_ERR_INVALID_ARGUMENT,
                   kolo_request_last_error(pending.request), {"'ag.pending'", "pending"});
      kolo_request_t again = reinterpret_cast<kolo_request_t>(1);
      status = kolo_allgather_async(comm, "ag.pending", pending.send.data(), 1, pending.recv.data(),
                                    pending.capacity, KOLO_FLOAT32, nullptr, &again);
      expect_parts("the same name again", status, KOLO_ERR_INVALID_ARGUMENT,
                   kolo_comm_last_error(comm), {"'ag.pending'", "already pending"});
      if (again != nullptr) fail("a refused submission left *request set");
      std::vector<float> data(10);
      status = kolo_allreduce_async(comm, "ag.pending", data.data(), data.data(), 10, KOLO_FLOAT32,
                                    KOLO_SUM, nullptr, &again);
      expect_parts("the same name as an allreduce", status, KOLO_ERR_INVALID_ARGUMENT,
                   kolo_comm_last_error(comm), {"'ag.pending'", "already pending"});
    }
    check(comm, kolo_barrier(comm), "barrier");
    if (g_rank != 0) check(comm, pending.submit(comm), "kolo_allgather_async ag.pending");
  } else {
    check(comm, pending.submit(comm), "kolo_allgather_async ag.pending");
  }
  if (kolo_request_wait(pending.request) != KOLO_SUCCESS) {
    fail(fmt::format("ag.pending: {}", kolo_request_last_error(pending.request)));
  }
  pending.check(0);

  // Misuse of kolo_request_counts.
  {
    std::vector<uint64_t> counts(g_size + 1, 0);
    if (kolo_request_counts(nullptr, counts.data(), g_size) != KOLO_ERR_INVALID_ARGUMENT) {
      fail("kolo_request_counts(NULL request) was accepted");
    }
    // (Each status is taken before the message: arguments are evaluated in no set order.)
    kolo_status_t status = kolo_request_counts(pending.request, nullptr, g_size);
    expect_parts("counts into NULL", status, KOLO_ERR_INVALID_ARGUMENT,
                 kolo_request_last_error(pending.request), {"counts is NULL"});
    status = kolo_request_counts(pending.request, counts.data(), g_size - 1);
    expect_parts("counts with too little room", status, KOLO_ERR_INVALID_ARGUMENT,
                 kolo_request_last_error(pending.request),
                 {"room for", fmt::format("{} ranks", g_size)});
    if (counts != std::vector<uint64_t>(g_size + 1, 0)) fail("a refused call wrote counts");
    // A later call starts afresh: its message is the request's own again (none: it succeeded).
    int done = 0;
    if (kolo_request_test(pending.request, &done) != KOLO_SUCCESS || !done) fail("test");
    if (std::string(kolo_request_last_error(pending.request)) != "") {
      fail("the refusal's message outlived the next call on the request");
    }
    std::vector<Tensor> reduced;
    reduced.push_back(make_tensor("ag.reduced", KOLO_FLOAT32, KOLO_SUM, 10, 7));
    reduced[0].prepare(0);
    submit(comm, reduced[0]);
    if (kolo_request_wait(reduced[0].request) != KOLO_SUCCESS) fail("ag.reduced failed");
    status = kolo_request_counts(reduced[0].request, counts.data(), g_size);
    expect_parts("counts of an allreduce", status, KOLO_ERR_INVALID_ARGUMENT,
                 kolo_request_last_error(reduced[0].request), {"'ag.reduced'", "not an allgather"});
    wait_all(reduced);
  }
  kolo_request_free(pending.request);
  pending.request = nullptr;

  // Refused at submission, before anything is sent: each status, *request and message checked.
  {
    std::vector<float> data(100, 1.0f);
    std::vector<float> out(1000, 0.0f);
    kolo_async_options_t bad_options = KOLO_ASYNC_OPTIONS_INITIALIZER;
    bad_options.struct_size = 3;
    kolo_request_t request = nullptr;
    struct Case {
      const char* what;
      std::function<kolo_status_t()> call;
      std::vector<std::string> parts;  // of the message
    };
    auto submitted = [&](const char* name, const void* sendbuf, uint64_t count, void* recvbuf,
                         uint64_t capacity, kolo_dtype_t dtype = KOLO_FLOAT32,
                         const kolo_async_options_t* options = nullptr, bool with_request = true) {
      return [=, &request] {
        return kolo_allgather_async(comm, name, sendbuf, count, recvbuf, capacity, dtype, options,
                                    with_request ? &request : nullptr);
      };
    };
    const Case cases[] = {
        {"NULL recvbuf",
         submitted("bad", data.data(), 100, nullptr, 1000),
         {"kolo_allgather_async", "'bad'", "receive buffer", "NULL", "recv_capacity is 1000"}},
        {"NULL sendbuf",
         submitted("bad", nullptr, 100, out.data(), 1000),
         {"'bad'", "send buffer", "NULL but count is 100"}},
        {"overlap",
         submitted("bad", out.data() + 10, 100, out.data(), 1000),
         {"'bad'", "overlap", "in place"}},
        {"unknown dtype",
         submitted("bad", data.data(), 100, out.data(), 1000, static_cast<kolo_dtype_t>(42)),
         {"dtype 255"}},
        {"huge capacity",
         submitted("bad", data.data(), 100, out.data(), ~uint64_t{0} / 2),
         {"recv_capacity", "too large"}},
        {"NULL name", submitted(nullptr, data.data(), 100, out.data(), 1000), {"name is NULL"}},
        {"empty name", submitted("", data.data(), 100, out.data(), 1000), {"empty"}},
        {"options size",
         submitted("bad", data.data(), 100, out.data(), 1000, KOLO_FLOAT32, &bad_options),
         {"struct_size"}},
        {"NULL request",
         submitted("bad", data.data(), 100, out.data(), 1000, KOLO_FLOAT32, nullptr, false),
         {"request is NULL"}},
    };
    for (const Case& c : cases) {
      kolo_status_t status = c.call();
      expect_parts(c.what, status, KOLO_ERR_INVALID_ARGUMENT, kolo_comm_last_error(comm), c.parts);
      if (request != nullptr) fail(fmt::format("{}: *request was set", c.what));
    }
    // ag.pending and ag.reduced on every rank; nothing refused was counted.
    if (stats_of(comm).tensors_submitted != 2) {
      fail(fmt::format("refused submissions were counted: {} tensors submitted",
                       stats_of(comm).tensors_submitted));
    }
  }

  // Failures on every rank, beside tensors that succeed: a receive capacity one element short on
  // the last rank; with two ranks or more, a dtype that differs and a name that is an allreduce
  // on the last rank.
  std::vector<uint64_t> small_counts(g_size);
  for (int rank = 0; rank < g_size; ++rank) small_counts[rank] = 10 * (rank + 1);
  const uint64_t small_total =
      std::accumulate(small_counts.begin(), small_counts.end(), uint64_t{0});
  Gather small;
  small.name = "ag.small";
  small.id = 2;
  small.prepare(0, small_counts, g_rank == last ? small_total - 1 : small_total);
  Gather good;
  good.name = "ag.good";
  good.dtype = KOLO_INT32;
  good.id = 3;
  good.prepare(0, gather_counts(0, 3, 0), 4000 * static_cast<uint64_t>(g_size));
  Gather typed;
  typed.name = "ag.dtype";
  typed.dtype = g_size > 1 && g_rank == last ? KOLO_INT32 : KOLO_FLOAT32;
  typed.id = 4;
  typed.prepare(0, std::vector<uint64_t>(g_size, 5), 5 * static_cast<uint64_t>(g_size));
  Gather kind;
  kind.name = "ag.kind";
  kind.id = 5;
  kind.prepare(0, std::vector<uint64_t>(g_size, 8), 8 * static_cast<uint64_t>(g_size));
  std::vector<unsigned char> kind_reduced(64, 0);
  kolo_request_t kind_request = nullptr;
  const bool disagreeing = g_size > 1;
  check(comm, small.submit(comm), "ag.small");
  check(comm, good.submit(comm), "ag.good");
  if (disagreeing) {
    check(comm, typed.submit(comm), "ag.dtype");
    if (g_rank == last) {
      check(comm,
            kolo_allreduce_async(comm, "ag.kind", kind_reduced.data(), kind_reduced.data(), 8,
                                 KOLO_FLOAT32, KOLO_SUM, nullptr, &kind_request),
            "ag.kind as an allreduce");
    } else {
      check(comm, kind.submit(comm), "ag.kind");
      kind_request = kind.request;
    }
  }
  {
    kolo_status_t status = kolo_request_wait(small.request);
    expect_parts("a capacity one element short on the last rank", status, KOLO_ERR_INVALID_ARGUMENT,
                 kolo_request_last_error(small.request),
                 {"'ag.small'", "recv_capacity", fmt::format("needs {} elements", small_total),
                  fmt::format("{} on rank {}", small_total - 1, last),
                  fmt::format("rank {}: {}", last, small_counts[last])});
    std::vector<uint64_t> counts(g_size, 0);
    if (kolo_request_counts(small.request, counts.data(), g_size) != KOLO_ERR_INVALID_ARGUMENT) {
      fail("kolo_request_counts of the failed ag.small did not return its status");
    }
    for (unsigned char byte : small.recv) {
      if (byte != 0xAB) fail("ag.small wrote its receive buffer although it failed");
    }
    kolo_request_free(small.request);
  }
  if (kolo_request_wait(good.request) != KOLO_SUCCESS) {
    fail(fmt::format("ag.good: {}", kolo_request_last_error(good.request)));
  }
  good.check(0);
  kolo_request_free(good.request);
  if (disagreeing) {
    kolo_status_t status = kolo_request_wait(typed.request);
    expect_parts("dtypes that differ", status, KOLO_ERR_MISMATCH,
                 kolo_request_last_error(typed.request),
                 {"'ag.dtype'", "disagree", fmt::format("rank {}", last),
                  "allgather 'ag.dtype' (int32)", "allgather 'ag.dtype' (float32)"});
    kolo_request_free(typed.request);
    status = kolo_request_wait(kind_request);
    expect_parts("an allgather and an allreduce of one name", status, KOLO_ERR_MISMATCH,
                 kolo_request_last_error(kind_request),
                 {"'ag.kind'", "disagree", fmt::format("rank {}", last), "allgather 'ag.kind'",
                  "allreduce 'ag.kind'"});
    kolo_request_free(kind_request);
  }

  // Nothing at all to gather, with NULL buffers everywhere; and the engine goes on.
  kolo_request_t nothing = nullptr;
  check(comm,
        kolo_allgather_async(comm, "ag.nothing", nullptr, 0, nullptr, 0, KOLO_INT8, nullptr,
                             &nothing),
        "ag.nothing");
  if (kolo_request_wait(nothing) != KOLO_SUCCESS) fail(kolo_request_last_error(nothing));
  std::vector<uint64_t> counts(g_size, 9);
  check(comm, kolo_request_counts(nothing, counts.data(), g_size), "counts of ag.nothing");
  if (counts != std::vector<uint64_t>(g_size, 0)) fail("ag.nothing reported counts other than 0");
  kolo_request_free(nothing);
  Gather after;
  after.name = "ag.small";  // the failed name may be used again
  after.id = 6;
  after.prepare(1, small_counts, small_total);
  check(comm, after.submit(comm), "ag.small again");
  if (kolo_request_wait(after.request) != KOLO_SUCCESS)
    fail(kolo_request_last_error(after.request));
  after.check(1);
  kolo_request_free(after.request);
  fmt::print("rank {}: allgather_errors checks passed\n", g_rank);
  return 0;
}

// Steps of small tensors and a large one (8 MiB: its pipeline segments follow the tuner's
// segment), every element checked against the reference, while rank 0 tunes. The ranks leave the
// loop together, once every rank's engine has the final settings (an ordered allreduce decides),
// run more steps, and print the settings, which the test compares between ranks and with the log.
int run_autotune(kolo_comm_t comm, bool tuning) {
  std::vector<Tensor> tensors;
  for (uint64_t i = 0; i < 40; ++i) {
    tensors.push_back(make_tensor(fmt::format("tune.small.{}", i), KOLO_FLOAT32,
                                  i % 2 ? KOLO_SUM : KOLO_AVG, 1 + (i * 997) % 20000, i));
  }
  tensors.push_back(make_tensor("tune.large", KOLO_FLOAT32, KOLO_SUM, 2 << 20, 99));
  auto run_step = [&](uint64_t step) {
    for (Tensor& tensor : tensors) tensor.prepare(step);
    submit_shuffled(comm, tensors, step);
    wait_all(tensors);
    for (const Tensor& tensor : tensors) check_against_reference(tensor, step);
  };
  const uint64_t kMaxSteps = tuning ? 400 : 5;
  uint64_t step = 0;
  bool settled = false;
  while (step < kMaxSteps && !settled) {
    run_step(step++);
    int64_t mine = stats_of(comm).autotune_settled ? 1 : 0, everyone = 0;
    check(comm, kolo_allreduce(comm, &mine, &everyone, 1, KOLO_INT64, KOLO_MIN), "kolo_allreduce");
    settled = everyone == 1;
  }
  if (settled != tuning) {
    fail(fmt::format("after {} steps the engine {} settled (KOLO_AUTOTUNE {})", step,
                     settled ? "has" : "has not", tuning ? "on" : "off"));
  }
  const kolo_fusion_stats_t at_end = stats_of(comm);
  for (int extra = 0; extra < 5; ++extra) run_step(step++);
  const kolo_fusion_stats_t after = stats_of(comm);
  if (after.autotune_updates != at_end.autotune_updates ||
      after.fusion_threshold != at_end.fusion_threshold ||
      after.cycle_time_ms != at_end.cycle_time_ms || after.segment_bytes != at_end.segment_bytes) {
    fail(fmt::format("the settings changed after settling: {} updates, threshold {}, cycle {} ms, "
                     "segment {}, then {} updates, threshold {}, cycle {} ms, segment {}",
                     at_end.autotune_updates, at_end.fusion_threshold, at_end.cycle_time_ms,
                     at_end.segment_bytes, after.autotune_updates, after.fusion_threshold,
                     after.cycle_time_ms, after.segment_bytes));
  }
  if (!tuning && after.autotune_updates != 0) {
    fail(fmt::format("{} settings updates without KOLO_AUTOTUNE", after.autotune_updates));
  }
  fmt::print("rank {}: autotune settings: updates {}, threshold {}, cycle {} ms, segment {}\n",
             g_rank, after.autotune_updates, after.fusion_threshold, after.cycle_time_ms,
             after.segment_bytes);
  fmt::print("rank {}: {} steps\n", g_rank, step);
  fmt::print("rank {}: autotune checks passed\n", g_rank);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: kolo_fusion_worker SCENARIO [ARG]\n");
    return 2;
  }
  std::string scenario = argv[1];
  std::string argument = argc > 2 ? argv[2] : "";
  kolo_comm_t comm = nullptr;
  kolo_status_t status = kolo_comm_init(nullptr, &comm);
  if (status != KOLO_SUCCESS) {
    fmt::print(stderr, "init failed: {}: {}\n", kolo_status_string(status),
               kolo_comm_last_error(nullptr));
    return 4;
  }
  kolo_comm_rank(comm, &g_rank);
  kolo_comm_size(comm, &g_size);
  int result;
  if (scenario == "orders") {
    result = run_orders(comm);
  } else if (scenario == "many") {
    result = run_many(comm);
  } else if (scenario == "mixed") {
    result = run_mixed(comm);
  } else if (scenario == "large") {
    result = run_large(comm);
  } else if (scenario == "measured") {
    result = run_measured(comm);
  } else if (scenario == "one_ring") {
    result = run_one_ring(comm);
  } else if (scenario == "bitwise") {
    result = run_bitwise(comm);
  } else if (scenario == "cache") {
    result = run_cache(comm, argument.empty() ? 40 : std::atoi(argument.c_str()));
  } else if (scenario == "group") {
    result = run_group(comm);
  } else if (scenario == "broadcast") {
    result = run_broadcast(comm);
  } else if (scenario == "join") {
    result = run_join(comm);
  } else if (scenario == "duplicate") {
    result = run_duplicate(comm);
  } else if (scenario == "mismatch") {
    result = run_mismatch(comm);
  } else if (scenario == "peerlost") {
    result = run_peerlost(comm);
  } else if (scenario == "destroy") {
    result = run_destroy(comm);
  } else if (scenario == "leave") {
    result = run_leave(comm);
  } else if (scenario == "stall") {
    result = run_stall(comm, argument == "abort");
  } else if (scenario == "late") {
    result = run_late(comm);
  } else if (scenario == "threads") {
    result = run_threads(comm);
  } else if (scenario == "idle") {
    result = run_idle(comm);
  } else if (scenario == "badargs") {
    result = run_badargs(comm);
  } else if (scenario == "allgather") {
    result = run_allgather(comm);
  } else if (scenario == "autotune") {
    result = run_autotune(comm, argument != "off");
  } else if (scenario == "allgather_errors") {
    result = run_allgather_errors(comm);
  } else {
    fail("unknown scenario " + scenario);
  }
  if (result < 0) return 0;  // the scenario destroyed the communicator itself
  if (kolo_comm_destroy(comm) != KOLO_SUCCESS) fail("destroy failed");
  return result;
}
