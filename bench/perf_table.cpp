// The output: nccl-tests' table, printed on rank 0 in nccl-tests' layout so that kolo's figures can
// be read next to NCCL's: the parameters, the ranks, the column headers, a row per dtype, op and
// size, and the summary.
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <string>
#include <vector>

#include "perf_internal.hpp"

namespace kolo::bench::detail {
namespace {

// nccl-tests' time column: fewer decimals as the time grows, always 7 characters wide.
std::string format_time(double microseconds) {
  if (microseconds >= 10000.0) return fmt::format("{:7.0f}", microseconds);
  if (microseconds >= 100.0) return fmt::format("{:7.1f}", microseconds);
  return fmt::format("{:7.2f}", microseconds);
}

}  // namespace

void print_parameters(Printer& out, const Options& options) {
  const bool by_factor = options.step_factor > 1;
  out.line(
      "# nThread 1 nGpus 1 minBytes {} maxBytes {} step: {}({}) warmup iters: {} iters: {} "
      "agg iters: {} validation: {} graph: {}",
      options.min_bytes, options.max_bytes,
      by_factor ? static_cast<uint64_t>(options.step_factor) : options.step_bytes,
      by_factor ? "factor" : "bytes", options.warmup_iterations, options.iterations,
      options.agg_iterations, options.check_iterations, options.cuda_graph_launches);
  if (options.later_warmup_iterations >= 0) {
    out.line("# later cycles: warmup iters: {}", options.later_warmup_iterations);
  }
  out.line("#");
}

// Lists every rank with its pid and host, gathered with two allgathers.
void print_ranks(Printer& out, kolo_comm_t comm, int ranks, bool gpu) {
  constexpr size_t kHostBytes = 64;
  int local_rank = 0;
  check(comm, kolo_comm_local_rank(comm, &local_rank));
  const int64_t mine[2] = {static_cast<int64_t>(getpid()), local_rank};
  std::vector<int64_t> numbers(2 * static_cast<size_t>(ranks));
  check(comm, kolo_allgather(comm, mine, numbers.data(), 2, KOLO_INT64));
  char host[kHostBytes] = {};
  gethostname(host, kHostBytes - 1);
  std::vector<uint8_t> hosts(kHostBytes * static_cast<size_t>(ranks));
  check(comm, kolo_allgather(comm, host, hosts.data(), kHostBytes, KOLO_UINT8));

  out.line("# Using devices");
  for (int r = 0; r < ranks; ++r) {
    const std::string host_name(reinterpret_cast<const char*>(&hosts[kHostBytes * r]));
    out.line("#  Rank {:2} Group  0 Pid {:6} on {:>10} device {:2} {}", r, numbers[2 * r],
             host_name, numbers[2 * r + 1], gpu ? "[gpu] GPU memory" : "[host] CPU memory");
  }
  out.line("#");
}

void print_memory(Printer& out, kolo_comm_t comm, int ranks, uint64_t bytes, bool gpu) {
  const int64_t mine = static_cast<int64_t>(bytes);
  std::vector<int64_t> all(static_cast<size_t>(ranks));
  check(comm, kolo_allgather(comm, &mine, all.data(), 1, KOLO_INT64));
  for (int r = 0; r < ranks; ++r) {
    out.line("# {:<20} : rank {} {:.2f} MB of buffers in {} memory", "Memory usage", r,
             static_cast<double>(all[r]) / (1024.0 * 1024.0), gpu ? "GPU" : "host");
  }
  out.line("#");
}

void print_column_headers(Printer& out, const Options& options) {
  const char* time = options.report_cputime ? "cputime" : "time";
  const char* stamp_label = options.report_timestamps ? "  timestamp" : "";
  const char* stamp_format = options.report_timestamps ? "  (YYYY-mm-dd HH:MM:SS)" : "";
  out.line(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       "
      "in-place          ",
      "", "", "", "", "");
  out.line(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6} {:>6}  {:>7}  {:>6}  {:>6} "
      "{:>6}{}",
      "size", "count", "type", "redop", "root", time, "algbw", "busbw", "#wrong", time, "algbw",
      "busbw", "#wrong", stamp_label);
  out.line(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}  {:>7}  {:>6}  {:>6}  "
      "{:>5}{}",
      "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
      "", stamp_format);
}

void print_row(Printer& out, const Row& row, const Options& options) {
  std::string line =
      fmt::format("{:12}  {:12}  {:>8}  {:>6}  {:6}", row.bytes, row.count, dtype_name(row.dtype),
                  row.op ? op_name(*row.op) : "none", row.root);
  for (const Placement& placement : row.placements) {
    line += fmt::format("  {}  {:6.2f}  {:6.2f}  {:>5}", format_time(placement.seconds * 1e6),
                        placement.algbw, placement.busbw,
                        row.checked ? std::to_string(placement.wrong) : std::string("N/A"));
  }
  if (options.report_timestamps) {
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char stamp[32] = {};
    std::strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M:%S", &local);
    line += fmt::format("  {}", stamp);
  }
  out.line("{}", line);
}

void print_first_calls(Printer& out, uint64_t bytes, const std::vector<double>& seconds,
                       double steady_seconds) {
  std::string line = fmt::format("# first calls {:>10} B (us, x timed):", bytes);
  // Buckets 1, 2-10, 11-100, ...: a cliff that lasts some hundred calls shows in one of them.
  size_t begin = 0, end = 1;
  while (begin < seconds.size()) {
    end = std::min(end, seconds.size());
    std::vector<double> bucket(seconds.begin() + begin, seconds.begin() + end);
    std::nth_element(bucket.begin(), bucket.begin() + bucket.size() / 2, bucket.end());
    const double median = bucket[bucket.size() / 2];
    const std::string calls =
        end - begin == 1 ? fmt::format("#{}", end) : fmt::format("#{}-{}", begin + 1, end);
    line += fmt::format("  {} {:.2f} ({:.1f}x)", calls, median * 1e6,
                        steady_seconds > 0 ? median / steady_seconds : 0.0);
    begin = end;
    end = end == 1 ? 10 : end * 10;
  }
  out.line("{}", line);
}

void print_summary(Printer& out, uint64_t total_wrong, double average_busbw,
                   const std::string& program) {
  out.line("# {:<20} : {} {}", "Out of bounds values", total_wrong,
           total_wrong == 0 ? "OK" : "FAILED");
  out.line("# {:<20} : {:g} ", "Avg bus bandwidth", average_busbw);
  out.line("#");
  out.line("# Collective test concluded: {}", program);
}

}  // namespace kolo::bench::detail
