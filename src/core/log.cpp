#include "core/log.hpp"

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <string>

namespace kolo::log {
namespace {

std::atomic<int> g_rank{-1};

// Padded to one width so that messages line up: "WARN  ", "INFO  ", "TRACE ".
const char* level_label(Level level) {
  switch (level) {
    case Level::kWarn:
      return "WARN ";
    case Level::kInfo:
      return "INFO ";
    case Level::kTrace:
      return "TRACE";
  }
  return "?????";
}

// The short host name ("node17", not "node17.cluster.example.org"), read once.
const std::string& short_host_name() {
  static const std::string name = [] {
    char buffer[256] = {};
    if (gethostname(buffer, sizeof(buffer) - 1) != 0) return std::string("unknown-host");
    std::string host(buffer);
    if (auto dot = host.find('.'); dot != std::string::npos) host.resize(dot);
    return host.empty() ? std::string("unknown-host") : host;
  }();
  return name;
}

// Writes one line without looking at the level; used by write() and by level() itself (which
// must not call write(), because write() calls level()).
void emit(Level level, std::string_view message) {
  int rank = g_rank.load(std::memory_order_relaxed);
  std::string line =
      fmt::format("kolo {}:{} {} ", short_host_name(),
                  rank >= 0 ? std::to_string(rank) : std::string("?"), level_label(level));
  while (!message.empty() && message.back() == '\n') message.remove_suffix(1);
  line.append(message);
  line.push_back('\n');

  // One write() per line keeps lines of different processes apart on a shared pipe (up to
  // PIPE_BUF); the mutex keeps lines of this process's threads apart even when a write is partial.
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  const char* data = line.data();
  size_t left = line.size();
  while (left > 0) {
    ssize_t written = ::write(STDERR_FILENO, data, left);
    if (written < 0) {
      if (errno == EINTR) continue;
      return;  // nowhere left to report that stderr is broken
    }
    data += written;
    left -= static_cast<size_t>(written);
  }
}

std::string to_upper(std::string text) {
  for (char& c : text) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return text;
}

}  // namespace

Level level() {
  static const Level cached = [] {
    const char* value = std::getenv("KOLO_DEBUG");
    if (value == nullptr || *value == '\0') return Level::kWarn;
    std::string upper = to_upper(value);
    if (upper == "WARN") return Level::kWarn;
    if (upper == "INFO") return Level::kInfo;
    if (upper == "TRACE") return Level::kTrace;
    emit(Level::kWarn,
         fmt::format("KOLO_DEBUG={} is not a log level: use WARN, INFO or TRACE; using WARN",
                     value));
    return Level::kWarn;
  }();
  return cached;
}

void set_rank(int rank) {
  g_rank.store(rank, std::memory_order_relaxed);
}

void write(Level message_level, std::string_view message) {
  // Asked even for warnings (always shown) so that a bad KOLO_DEBUG is reported before them.
  if (message_level > level()) return;
  emit(message_level, message);
}

}  // namespace kolo::log
