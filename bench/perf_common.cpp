// The runner: run_benchmark() joins the job, allocates the buffers once and measures every row
// (perf_internal.hpp lists the harness's other files: the flags, the reference, the table). See
// perf_common.hpp for what a benchmark provides and what the harness does with it.
//
// One row is measured like this, on every rank:
//   first calls      with --first K: barrier, K calls out of place, each timed on its own
//   warm up          -w calls out of place (--later_warmup_iters in the cycles after the first)
//   out of place     barrier, -n x -m calls, time / (n x m);  then -c calls, each on fresh input,
//                    compared
//   in place         the same, in one buffer
// The per-rank times are then combined across ranks (-a: the average by default, as nccl-tests),
// and the #wrong counts summed. Inputs are written before each timed batch so that floating-point
// timing never runs on denormal leftovers; the repeated in-place calls change the values (sums
// grow to infinity, which costs nothing extra), which is why each check starts from fresh input.
#include "perf_common.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpu_memory.hpp"
#include "perf_internal.hpp"

#ifdef KOLO_BENCH_JSON
#include <fstream>
#include <nlohmann/json.hpp>
#endif

namespace kolo::bench {
namespace detail {
namespace {

// ---- Buffers ------------------------------------------------------------------------------------

struct FreeDeleter {
  void operator()(void* pointer) const { std::free(pointer); }
};
using Buffer = std::unique_ptr<std::byte, FreeDeleter>;

// Page-aligned, and touched once here so that no timed call pays for first-touch page faults.
Buffer allocate_touched(uint64_t bytes) {
  constexpr uint64_t kPage = 4096;
  const uint64_t rounded = std::max<uint64_t>((bytes + kPage - 1) / kPage * kPage, kPage);
  auto* memory = static_cast<std::byte*>(std::aligned_alloc(kPage, rounded));
  if (memory == nullptr) {
    fmt::print(stderr, "cannot allocate {} bytes of benchmark buffers\n", rounded);
    std::exit(1);
  }
  std::memset(memory, 0, rounded);
  return Buffer(memory);
}

struct DeviceDeleter {
  void operator()(std::byte* pointer) const { gpu::release(pointer); }
};
using DeviceBuffer = std::unique_ptr<std::byte, DeviceDeleter>;

struct Buffers {
  Buffer send;      // out of place: sendbuf
  Buffer recv;      // out of place: recvbuf; in place: the one buffer
  Buffer expected;  // the reference result
  // With -g, what the collective sees instead of send and recv; inputs are written to the host
  // buffers and copied over, results copied back, at the same offsets.
  DeviceBuffer device_send;
  DeviceBuffer device_recv;
  uint64_t bytes = 0;  // what the buffers above take in all (-M)
};

Buffers allocate_buffers(const Options& options, const Collective& collective, int rank,
                         int ranks) {
  uint64_t send_bytes = 0, recv_bytes = 0, expected_bytes = 0;
  const std::vector<uint64_t> sizes = row_sizes(options);
  for (kolo_dtype_t dtype : options.dtypes) {
    const size_t element = kolo_dtype_size(dtype);
    for (uint64_t bytes : sizes) {
      const Shape shape = collective.shape(bytes, element, rank, ranks);
      const uint64_t in_place = std::max(shape.in_place_send_offset + shape.send_count,
                                         shape.in_place_recv_offset + shape.recv_count);
      send_bytes = std::max(send_bytes, shape.send_count * element);
      recv_bytes = std::max(recv_bytes, std::max(shape.recv_count, in_place) * element);
      expected_bytes = std::max(expected_bytes, shape.recv_count * element);
    }
  }
  Buffers buffers;
  buffers.send = allocate_touched(send_bytes);
  buffers.recv = allocate_touched(recv_bytes);
  if (options.check) buffers.expected = allocate_touched(expected_bytes);
  buffers.bytes = send_bytes + recv_bytes + (options.check ? expected_bytes : 0);
  if (options.gpu) {
    buffers.device_send.reset(static_cast<std::byte*>(gpu::allocate(send_bytes)));
    buffers.device_recv.reset(static_cast<std::byte*>(gpu::allocate(recv_bytes)));
    buffers.bytes = send_bytes + recv_bytes;  // -M reports the device buffers only
  }
  return buffers;
}

// ---- Measuring ----------------------------------------------------------------------------------

// Seconds per call of this rank, over a batch that every rank starts together.
double time_calls(const Collective& collective, const Operation& operation, const void* sendbuf,
                  void* recvbuf, int calls, bool blocking) {
  // With -g the calls are enqueued on a stream: the batch starts on an idle stream and ends when
  // the stream has run it, as nccl-tests times it.
  if (operation.stream) {
    check(operation.comm, kolo_stream_synchronize(operation.comm, operation.stream));
  }
  check(operation.comm, kolo_barrier(operation.comm));
  const auto start = std::chrono::steady_clock::now();
  for (int call = 0; call < calls; ++call) {
    check(operation.comm, collective.run(operation, sendbuf, recvbuf));
    // -z 1: each call waits for the one before it to finish on the GPU too.
    if (operation.stream && blocking) {
      check(operation.comm, kolo_stream_synchronize(operation.comm, operation.stream));
    }
  }
  if (operation.stream) {
    check(operation.comm, kolo_stream_synchronize(operation.comm, operation.stream));
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / calls;
}

// --first: each call timed on its own, after a barrier that starts them together on every rank.
std::vector<double> time_each_call(const Collective& collective, const Operation& operation,
                                   const void* sendbuf, void* recvbuf, int calls) {
  std::vector<double> seconds(static_cast<size_t>(calls));
  check(operation.comm, kolo_barrier(operation.comm));
  for (double& taken : seconds) {
    const auto start = std::chrono::steady_clock::now();
    check(operation.comm, collective.run(operation, sendbuf, recvbuf));
    if (operation.stream) {
      check(operation.comm, kolo_stream_synchronize(operation.comm, operation.stream));
    }
    taken = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return seconds;
}

// Combines per-rank values as -a asks: rank 0's, or their average, minimum or maximum.
void combine_across_ranks(kolo_comm_t comm, Combine combine, double* values, uint64_t count) {
  switch (combine) {
    case Combine::kRankZero:
      check(comm, kolo_broadcast(comm, values, count, KOLO_FLOAT64, 0));
      return;
    case Combine::kAverage:
      check(comm, kolo_allreduce(comm, values, values, count, KOLO_FLOAT64, KOLO_AVG));
      return;
    case Combine::kMinimum:
      check(comm, kolo_allreduce(comm, values, values, count, KOLO_FLOAT64, KOLO_MIN));
      return;
    case Combine::kMaximum:
      check(comm, kolo_allreduce(comm, values, values, count, KOLO_FLOAT64, KOLO_MAX));
      return;
  }
}

// -J: the table as JSON, on rank 0: the rows with the table's columns, the summary's two figures.
void write_json(const std::string& path, const std::string& program, const std::vector<Row>& rows,
                uint64_t total_wrong, double average_busbw) {
#ifdef KOLO_BENCH_JSON
  nlohmann::json results = nlohmann::json::array();
  for (const Row& row : rows) {
    nlohmann::json entry = {{"size", row.bytes},
                            {"count", row.count},
                            {"type", dtype_name(row.dtype)},
                            {"redop", row.op ? op_name(*row.op) : "none"},
                            {"root", row.root}};
    const char* names[2] = {"out_of_place", "in_place"};
    for (int placement = 0; placement < 2; ++placement) {
      const Placement& measured = row.placements[placement];
      entry[names[placement]] = {
          {"time_us", measured.seconds * 1e6},
          {"algbw_gbps", measured.algbw},
          {"busbw_gbps", measured.busbw},
          {"wrong", row.checked ? nlohmann::json(measured.wrong) : nlohmann::json(nullptr)}};
    }
    results.push_back(entry);
  }
  const nlohmann::json document = {
      {"program", program},
      {"results", results},
      {"out_of_bounds", {{"count", total_wrong}, {"okay", total_wrong == 0}}},
      {"average_bus_bandwidth", {{"bandwidth", average_busbw}}}};
  std::ofstream file(path);
  file << document.dump(2) << '\n';
  if (!file) {
    fmt::print(stderr, "-J {}: cannot write the file\n", path);
    std::exit(1);
  }
#else
  (void)path, (void)program, (void)rows, (void)total_wrong, (void)average_busbw;
#endif
}

class Runner {
 public:
  Runner(const Collective& collective, const Options& options, kolo_comm_t comm, int rank,
         int ranks, void* stream)
      : collective_(collective),
        options_(options),
        comm_(comm),
        rank_(rank),
        ranks_(ranks),
        out_(rank == 0),
        buffers_(allocate_buffers(options, collective, rank, ranks)),
        stream_(stream) {}

  int run(const std::string& program, const std::string& gpu_note) {
    print_parameters(out_, options_);
    if (!gpu_note.empty()) out_.line("# {}\n#", gpu_note);
    print_ranks(out_, comm_, ranks_, options_.gpu);
    if (options_.memory_report) print_memory(out_, comm_, ranks_, buffers_.bytes, options_.gpu);
    print_column_headers(out_, options_);
    const std::vector<uint64_t> sizes = row_sizes(options_);
    // -N: the rows again and again, as many times as asked (0: until the job is interrupted).
    for (int cycle = 0; options_.run_cycles == 0 || cycle < options_.run_cycles; ++cycle) {
      for (kolo_dtype_t dtype : options_.dtypes) {
        for (kolo_op_t op : options_.ops) {
          for (uint64_t bytes : sizes) run_row(dtype, op, bytes, warmup_calls(cycle));
        }
      }
    }
    const double average_busbw = placements_ == 0 ? 0.0 : busbw_sum_ / placements_;
    print_summary(out_, total_wrong_, average_busbw, program);
    if (rank_ == 0 && !options_.json_path.empty()) {
      write_json(options_.json_path, program, rows_, total_wrong_, average_busbw);
    }
    return total_wrong_ == 0 ? 0 : 1;
  }

 private:
  int warmup_calls(int cycle) const {
    const bool later = cycle > 0 && options_.later_warmup_iterations >= 0;
    return later ? options_.later_warmup_iterations : options_.warmup_iterations;
  }

  void run_row(kolo_dtype_t dtype, kolo_op_t op, uint64_t bytes, int warmup) {
    const size_t element = kolo_dtype_size(dtype);
    Operation operation{comm_,
                        rank_,
                        ranks_,
                        dtype,
                        op,
                        options_.root,
                        collective_.shape(bytes, element, rank_, ranks_)};
    if (collective_.output_on_root_only && rank_ != options_.root) operation.shape.recv_count = 0;
    operation.stream = stream_;
    const Shape& shape = operation.shape;
    const uint64_t send_bytes = shape.send_count * element;
    const uint64_t recv_bytes = shape.recv_count * element;
    std::byte* send = buffers_.send.get();
    std::byte* recv = buffers_.recv.get();
    std::byte* in_place_send = recv + shape.in_place_send_offset * element;
    std::byte* in_place_recv = recv + shape.in_place_recv_offset * element;
    // What the collective sees: the host buffers, or with -g their device twins.
    std::byte* run_send = stream_ ? buffers_.device_send.get() : send;
    std::byte* run_recv = stream_ ? buffers_.device_recv.get() : recv;
    std::byte* run_in_place_send = run_recv + shape.in_place_send_offset * element;
    std::byte* run_in_place_recv = run_recv + shape.in_place_recv_offset * element;
    if (options_.check) collective_.expected_output(operation, buffers_.expected.get());

    collective_.init_input(operation, send);
    upload(run_send, send, send_bytes);
    std::vector<double> first;
    if (options_.first_calls > 0) {
      first = time_each_call(collective_, operation, run_send, run_recv, options_.first_calls);
    }
    for (int call = 0; call < warmup; ++call) {
      check(comm_, collective_.run(operation, run_send, run_recv));
    }

    double seconds[2] = {0, 0};
    int64_t wrong[2] = {0, 0};
    const int calls = options_.iterations * options_.agg_iterations;
    seconds[0] = time_calls(collective_, operation, run_send, run_recv, calls, options_.blocking);
    for (int checked = 0; checked < options_.check_iterations; ++checked) {
      collective_.init_input(operation, send);
      upload(run_send, send, send_bytes);
      // Unwritten elements show as wrong.
      std::memset(recv, 0xa5, recv_bytes);
      if (stream_) gpu::fill(run_recv, 0xa5, recv_bytes, stream_);
      check(comm_, collective_.run(operation, run_send, run_recv));
      download(recv, run_recv, recv_bytes);
      wrong[0] +=
          static_cast<int64_t>(count_wrong(dtype, recv, buffers_.expected.get(), shape.recv_count));
    }

    collective_.init_input(operation, in_place_send);
    upload(run_in_place_send, in_place_send, send_bytes);
    seconds[1] = time_calls(collective_, operation, run_in_place_send, run_in_place_recv, calls,
                            options_.blocking);
    for (int checked = 0; checked < options_.check_iterations; ++checked) {
      collective_.init_input(operation, in_place_send);
      upload(run_in_place_send, in_place_send, send_bytes);
      check(comm_, collective_.run(operation, run_in_place_send, run_in_place_recv));
      download(in_place_recv, run_in_place_recv, recv_bytes);
      wrong[1] += static_cast<int64_t>(
          count_wrong(dtype, in_place_recv, buffers_.expected.get(), shape.recv_count));
    }

    combine_across_ranks(comm_, options_.combine, seconds, 2);
    if (!first.empty()) combine_across_ranks(comm_, options_.combine, first.data(), first.size());
    check(comm_, kolo_allreduce(comm_, wrong, wrong, 2, KOLO_INT64, KOLO_SUM));

    Row row;
    row.bytes = std::max(shape.send_count, shape.recv_count) * element;
    row.count = shape.count;
    row.dtype = dtype;
    if (collective_.reduces) row.op = op;
    row.root = operation.root;
    row.checked = options_.check;
    for (int placement = 0; placement < 2; ++placement) {
      const double algbw = seconds[placement] > 0 ? row.bytes / seconds[placement] / 1e9 : 0.0;
      const double busbw = algbw * collective_.busbw_factor(ranks_);
      const auto placement_wrong = static_cast<uint64_t>(wrong[placement]);
      row.placements[placement] = Placement{seconds[placement], algbw, busbw, placement_wrong};
      busbw_sum_ += busbw;
      ++placements_;
      total_wrong_ += placement_wrong;
    }
    print_row(out_, row, options_);
    if (!first.empty()) print_first_calls(out_, row.bytes, first, seconds[0]);
    if (!options_.json_path.empty()) rows_.push_back(row);
  }

  // With -g: host to device before a call (on the stream the calls use, so in order with them),
  // and device to host once the stream has run the call. Nothing to do with host buffers.
  void upload(std::byte* device, const std::byte* host, uint64_t bytes) {
    if (stream_) gpu::copy_to_device(device, host, bytes, stream_);
  }
  void download(std::byte* host, const std::byte* device, uint64_t bytes) {
    if (!stream_) return;
    check(comm_, kolo_stream_synchronize(comm_, stream_));
    gpu::copy_to_host(host, device, bytes, stream_);
  }

  const Collective& collective_;
  const Options& options_;
  kolo_comm_t comm_;
  int rank_;
  int ranks_;
  Printer out_;
  Buffers buffers_;
  void* stream_;           // with -g; nullptr otherwise
  std::vector<Row> rows_;  // with -J
  double busbw_sum_ = 0;
  uint64_t placements_ = 0;
  uint64_t total_wrong_ = 0;
};

}  // namespace
}  // namespace detail

// ---- Public -------------------------------------------------------------------------------------

void check(kolo_comm_t comm, kolo_status_t status) {
  if (status == KOLO_SUCCESS) return;
  std::fprintf(stderr, "kolo error: %s: %s\n", kolo_status_string(status),
               kolo_comm_last_error(comm));
  std::exit(1);
}

Shape same_count_shape(uint64_t bytes, size_t element_size) {
  const uint64_t count = bytes / element_size;
  return Shape{count, count, count, 0, 0};
}

int run_benchmark(int argc, char** argv, const Collective& collective) {
  detail::Options options;
  if (const std::optional<int> exit_code = detail::parse_options(argc, argv, collective, options)) {
    return *exit_code;
  }
  const std::string program = std::string(collective.name) + "_perf";
#ifndef KOLO_BENCH_JSON
  if (!options.json_path.empty()) {
    fmt::print(stderr, "{}: -J: this build has no JSON writer (nlohmann-json3-dev was not found)\n",
               program);
    return detail::kUsageExitCode;
  }
#endif
  // Where the buffers go, decided before joining the job so that every rank refuses alike.
  std::string reason = "no -g 1 on the command line";
  bool gpu_usable = false;
  if (options.gpu_requested) {
    gpu_usable = collective.gpu && gpu::available(&reason);
    if (!collective.gpu) reason = program + " has no GPU mode";
  }
  if (const std::string problem = detail::gpu_flag_problem(options, gpu_usable, reason);
      !problem.empty()) {
    if (detail::probably_rank_zero()) fmt::print(stderr, "{}: {}\n", program, problem);
    return detail::kUsageExitCode;
  }
  options.gpu = gpu_usable;
  std::string gpu_note;
  if (options.gpu_requested && !gpu_usable) {
    gpu_note = fmt::format("-g 1: the buffers are in host memory: {}", reason);
  }

  kolo_config_t config = KOLO_CONFIG_INITIALIZER;
  config.timeout_s = options.timeout_s;  // <= 0: KOLO_TIMEOUT
  kolo_comm_t comm = nullptr;
  check(nullptr, kolo_comm_init(&config, &comm));
  int rank = 0, ranks = 1;
  check(comm, kolo_comm_rank(comm, &rank));
  check(comm, kolo_comm_size(comm, &ranks));
  if (collective.rooted && options.root >= ranks) {
    if (rank == 0) {
      fmt::print(stderr, "{}: -r {} is not a rank: there are {} ranks\n", program, options.root,
                 ranks);
    }
    kolo_comm_destroy(comm);
    return detail::kUsageExitCode;
  }
  void* stream = nullptr;
  if (options.gpu) {
    int local_rank = 0;
    check(comm, kolo_comm_local_rank(comm, &local_rank));
    const std::string device = gpu::select_device(local_rank);
    if (rank == 0) fmt::print("# GPU buffers: rank 0 on {}\n", device);
    stream = options.null_stream ? gpu::default_stream() : gpu::create_stream();
  }
  int exit_code = 0;
  {
    detail::Runner runner(collective, options, comm, rank, ranks, stream);
    exit_code = runner.run(program, gpu_note);
  }
  if (stream) gpu::destroy_stream(stream);
  if (const kolo_status_t status = kolo_comm_destroy(comm); status != KOLO_SUCCESS) {
    std::fprintf(stderr, "kolo error: %s: kolo_comm_destroy failed\n", kolo_status_string(status));
    return 1;
  }
  return exit_code;
}

}  // namespace kolo::bench
