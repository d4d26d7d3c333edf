#include "fusion/timeline.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <iterator>

#include "kolo/status.hpp"

namespace kolo::fusion {
namespace {

constexpr size_t kWakeWriterAt = 8192;  // events queued before the writer is woken early
constexpr auto kWriteInterval = std::chrono::milliseconds(250);
constexpr size_t kFileBuffer = 1 << 20;

int64_t nanoseconds(Clock::time_point at) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(at.time_since_epoch()).count();
}

}  // namespace

std::string Timeline::path_for_rank(const std::string& path, int rank) {
  const std::string suffix = ".json";
  if (path.size() > suffix.size() &&
      path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return fmt::format("{}.rank{}.json", path.substr(0, path.size() - suffix.size()), rank);
  }
  return fmt::format("{}.rank{}.json", path, rank);
}

std::string Timeline::collective_args(uint64_t sequence, size_t tensors, uint64_t bytes,
                                      const UnitSpec& spec, bool fused) {
  if (spec.kind == Kind::kBroadcast) {
    return fmt::format("{{\"collective\":{},\"bytes\":{},\"dtype\":\"{}\",\"root\":{}}}", sequence,
                       bytes, dtype_name(spec.dtype), spec.root);
  }
  if (spec.kind == Kind::kAllgather) {
    return fmt::format("{{\"collective\":{},\"bytes\":{},\"dtype\":\"{}\"}}", sequence, bytes,
                       dtype_name(spec.dtype));
  }
  return fmt::format(
      "{{\"collective\":{},\"tensors\":{},\"bytes\":{},\"dtype\":\"{}\",\"op\":\"{}\",\"fused\":{}}"
      "}",
      sequence, tensors, bytes, dtype_name(spec.dtype), op_name(spec.op), fused);
}

std::string Timeline::cycle_args(uint64_t cycle, size_t announced, size_t collectives,
                                 size_t errors) {
  return fmt::format("{{\"cycle\":{},\"announced\":{},\"collectives\":{},\"errors\":{}}}",
                     cycle, announced, collectives, errors);
}

std::string Timeline::submitted_args(int rank) { return fmt::format("{{\"rank\":{}}}", rank); }

std::string Timeline::negotiate_args(uint64_t cycle, bool cached) {
  return fmt::format("{{\"cycle\":{},\"cached\":{}}}", cycle, cached);
}

std::string Timeline::error_args(Status status, const std::string& message) {
  return fmt::format("{{\"status\":\"{}\",\"message\":\"{}\"}}", escape(status_name(status)),
                     escape(message));
}

std::string Timeline::escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out += c;  // UTF-8 passes through; other bytes are the caller's names, kept as given
        }
    }
  }
  return out;
}

Timeline::Timeline(const std::string& path, int rank) : rank_(rank) {
  file_ = std::fopen(path.c_str(), "w");
  if (!file_) {
    throw Error(Status::kSystem, fmt::format("cannot write the timeline {} (KOLO_TIMELINE): {}",
                                             path, std::strerror(errno)));
  }
  std::setvbuf(file_, nullptr, _IOFBF, kFileBuffer);
  std::fputs("[\n", file_);
  push({'M', "process_name", 0, 0, 0, fmt::format("{{\"name\":\"rank {}\"}}", rank)});
  push({'M', "process_sort_index", 0, 0, 0, fmt::format("{{\"sort_index\":{}}}", rank)});
  writer_ = std::thread([this] { write_loop(); });
}

Timeline::~Timeline() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  writer_.join();
  std::fputs("\n]\n", file_);
  std::fclose(file_);
}

uint32_t Timeline::row(const std::string& name) {
  auto [it, created] = rows_.try_emplace(name, static_cast<uint32_t>(rows_.size()));
  if (created) {
    push({'M', "thread_name", it->second, 0, 0, fmt::format("{{\"name\":\"{}\"}}", escape(name))});
    push({'M', "thread_sort_index", it->second, 0, 0,
          fmt::format("{{\"sort_index\":{}}}", it->second)});
  }
  return it->second;
}

void Timeline::span(uint32_t row, const char* name, Clock::time_point begin, Clock::time_point end,
                    std::string args) {
  push({'X', name, row, nanoseconds(begin), nanoseconds(end), std::move(args)});
}

void Timeline::instant(uint32_t row, const char* name, Clock::time_point at, std::string args) {
  push({'i', name, row, nanoseconds(at), 0, std::move(args)});
}

void Timeline::push(Event event) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(event));
    wake = queue_.size() == kWakeWriterAt;
  }
  if (wake) wake_.notify_one();
}

void Timeline::format(const Event& event, std::string& out) const {
  auto to = std::back_inserter(out);
  if (!first_event_) out += ",\n";
  fmt::format_to(to, "{{\"name\":\"{}\",\"ph\":\"{}\",\"pid\":{},\"tid\":{}", event.name,
                 event.phase, rank_, event.row);
  if (event.phase != 'M') {
    fmt::format_to(to, ",\"ts\":{:.3f}", event.begin_ns / 1000.0);
  }
  if (event.phase == 'X') {
    fmt::format_to(to, ",\"dur\":{:.3f}", (event.end_ns - event.begin_ns) / 1000.0);
  } else if (event.phase == 'i') {
    out += ",\"s\":\"t\"";
  }
  if (!event.args.empty()) {
    out += ",\"args\":";
    out += event.args;
  }
  out += '}';
}

void Timeline::write_loop() {
  std::vector<Event> batch;
  std::string text;
  for (;;) {
    bool last;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait_for(lock, kWriteInterval,
                     [&] { return stopping_ || queue_.size() >= kWakeWriterAt; });
      batch.swap(queue_);
      last = stopping_;
    }
    text.clear();
    for (const Event& event : batch) {
      format(event, text);
      first_event_ = false;
    }
    if (!text.empty()) std::fwrite(text.data(), 1, text.size(), file_);
    batch.clear();
    if (last) return;
  }
}

}  // namespace kolo::fusion
