// The output: nccl-tests' table, printed on rank 0 in nccl-tests' layout so that kolo's figures can
// be read next to NCCL's: the parameters, the ranks, the column headers, a row per dtype, op and
// size, and the summary.
#include <fmt/core.h>
#include <unistd.h>

#include <cstdint>
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
      "agg iters: 1 validation: {} graph: 0",
      options.min_bytes, options.max_bytes,
      by_factor ? static_cast<uint64_t>(options.step_factor) : options.step_bytes,
      by_factor ? "factor" : "bytes", options.warmup_iterations, options.iterations,
      options.check ? 1 : 0);
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

void print_column_headers(Printer& out) {
  out.line(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       "
      "in-place          ",
      "", "", "", "", "");
  out.line(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6} {:>6}  {:>7}  {:>6}  {:>6} {:>6}",
      "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
      "busbw", "#wrong");
  out.line(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}  {:>7}  {:>6}  {:>6}  "
      "{:>5}",
      "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
      "");
}

void print_row(Printer& out, const Row& row) {
  std::string line =
      fmt::format("{:12}  {:12}  {:>8}  {:>6}  {:6}", row.bytes, row.count, dtype_name(row.dtype),
                  row.op ? op_name(*row.op) : "none", row.root);
  for (const Placement& placement : row.placements) {
    line += fmt::format("  {}  {:6.2f}  {:6.2f}  {:>5}", format_time(placement.seconds * 1e6),
                        placement.algbw, placement.busbw,
                        row.checked ? std::to_string(placement.wrong) : std::string("N/A"));
  }
  out.line("{}", line);
}

void print_summary(Printer& out, uint64_t total_wrong, double average_busbw) {
  out.line("# Out of bounds values : {} {}", total_wrong, total_wrong == 0 ? "OK" : "FAILED");
  out.line("# Avg bus bandwidth    : {:g} ", average_busbw);
  out.line("#");
}

}  // namespace kolo::bench::detail
