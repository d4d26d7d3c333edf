// kolorun's elastic driver: elastic_driver.hpp says what it does; comm/elastic.cpp is the ranks'
// side of the plans it answers.
#include "tools/elastic_driver.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "bootstrap/store.hpp"
#include "comm/elastic.hpp"
#include "kolo/status.hpp"
#include "net/socket.hpp"

namespace kolorun {
namespace {

Clock::time_point after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  const char* name = sigabbrev_np(WTERMSIG(status));
  return name ? fmt::format("was killed by signal SIG{}", name)
              : fmt::format("was killed by signal {}", WTERMSIG(status));
}

std::string host_of(const std::string& slot) {
  return slot.substr(0, slot.rfind(':'));
}
int index_of(const std::string& slot) {
  return std::atoi(slot.c_str() + slot.rfind(':') + 1);
}

bool valid_host(std::string_view name) {
  return !name.empty() && name[0] != '-' && name.size() <= 255 &&
         name.find_first_of(" \t'\"\\;&|$`*?<>()[]{}!#,:=/") == name.npos;
}

// One line of the script's output: "host" or "host:slots"; false when it is neither.
bool parse_line(std::string_view line, int default_slots, std::string* host, int* slots) {
  size_t colon = line.rfind(':');
  *host = std::string(line.substr(0, colon));
  *slots = default_slots;
  if (colon != line.npos) {
    std::string_view count = line.substr(colon + 1);
    if (count.empty() || count.size() > 6 || count.find_first_not_of("0123456789") != count.npos) {
      return false;
    }
    *slots = std::atoi(std::string(count).c_str());
    if (*slots < 1 || *slots > 100000) return false;
  }
  return valid_host(*host);
}

}  // namespace

ElasticDriver::ElasticDriver(ElasticOptions options, Starter start, Say say, bool verbose)
    : options_(std::move(options)),
      start_(std::move(start)),
      say_(std::move(say)),
      verbose_(verbose),
      next_discovery_(Clock::now()),
      start_by_(after(options_.start_timeout_s)) {}

ElasticDriver::~ElasticDriver() {
  if (script_fd_ >= 0) ::close(script_fd_);
  client_.reset();
  server_.reset();
}

std::string ElasticDriver::serve() {
  try {
    // Every interface: a host named later by the script reaches it at this machine's name.
    server_ =
        std::make_unique<kolo::StoreServer>(kolo::net::Endpoint{"0.0.0.0", 0}, options_.secret);
    client_ = std::make_unique<kolo::StoreClient>(
        kolo::net::Endpoint{"127.0.0.1", static_cast<uint16_t>(port())}, options_.secret, 0,
        options_.rank_timeout_s);
  } catch (const kolo::Error& error) {
    return fmt::format("cannot serve the elastic driver's store: {}", error.what());
  }
  ::setenv("KOLO_ELASTIC_ADDR", fmt::format("127.0.0.1:{}", port()).c_str(), 1);
  return {};
}

int ElasticDriver::port() const {
  return server_ ? static_cast<int>(server_->endpoint().port) : 0;
}

void ElasticDriver::report(const std::string& message) {
  if (message == last_report_) return;
  last_report_ = message;
  say_(message);
}

void ElasticDriver::fail_job(const std::string& message) {
  if (fatal_) return;
  fatal_ = message;
  stop();
}

void ElasticDriver::stop() {
  stopping_ = true;
  if (script_pid_ > 0) ::kill(-script_pid_, SIGKILL);
}

int ElasticDriver::wait_ms() const {
  // Plans are answered within this; ranks wait for them in kolo_elastic_update.
  return 20;
}

int ElasticDriver::exit_code() const {
  if (fatal_) return 1;
  if (!last_exit_) return 0;
  return WIFEXITED(*last_exit_) ? WEXITSTATUS(*last_exit_) : 128 + WTERMSIG(*last_exit_);
}

int ElasticDriver::running_ranks() const {
  int running = 0;
  for (const auto& [name, slot] : slots_) running += slot.pid > 0 && !slot.leaving;
  return running;
}

bool ElasticDriver::usable(const std::string& slot) const {
  if (!hosts_) return false;
  const std::string host = host_of(slot);
  if (blacklist_.count(host)) return false;
  for (const auto& [name, count] : *hosts_) {
    if (name == host) return index_of(slot) < count;
  }
  return false;
}

// The usable slots, in the script's order, that are neither taken nor used up by failures.
std::vector<std::string> ElasticDriver::free_slots(const std::set<std::string>& taken) {
  std::vector<std::string> free;
  if (!hosts_) return free;
  for (const auto& [host, count] : *hosts_) {
    if (blacklist_.count(host)) continue;
    for (int i = 0; i < count; ++i) {
      std::string name = fmt::format("{}:{}", host, i);
      auto found = slots_.find(name);
      if (taken.count(name)) continue;
      if (found != slots_.end()) {
        const Slot& slot = found->second;
        if (slot.pid > 0 || slot.reserved) continue;
        if (options_.reset_limit >= 0 && slot.failures > options_.reset_limit) continue;
      }
      free.push_back(name);
    }
  }
  return free;
}

void ElasticDriver::run_discovery() {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    report(fmt::format("--host-discovery-script {}: cannot make a pipe: {}", options_.script,
                       std::strerror(errno)));
    return;
  }
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    report(fmt::format("--host-discovery-script {}: cannot fork: {}", options_.script,
                       std::strerror(errno)));
    return;
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);
    ::dup2(::open("/dev/null", O_RDONLY), STDIN_FILENO);
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    const char* argv[] = {"/bin/sh", "-c", options_.script.c_str(), nullptr};
    ::execv("/bin/sh", const_cast<char**>(argv));
    _exit(127);
  }
  ::setpgid(pid, pid);
  ::close(pipe_fds[1]);
  ::fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
  script_pid_ = pid;
  script_fd_ = pipe_fds[0];
  script_output_.clear();
  script_timed_out_ = false;
  script_deadline_ = after(kScriptTimeoutSeconds);
}

// The script has exited with status: its output becomes the host set, or it is reported.
void ElasticDriver::finish_discovery(int status) {
  if (script_fd_ >= 0) {
    char buffer[4096];
    for (ssize_t count; (count = ::read(script_fd_, buffer, sizeof buffer)) > 0;) {
      if (script_output_.size() < (1u << 20)) script_output_.append(buffer, size_t(count));
    }
    ::close(script_fd_);
    script_fd_ = -1;
  }
  script_pid_ = -1;
  script_deadline_ = Clock::time_point::max();
  next_discovery_ = after(kDiscoveryIntervalSeconds);
  if (stopping_) return;
  std::string problem;
  std::vector<std::pair<std::string, int>> hosts;
  if (script_timed_out_) {
    problem = fmt::format("did not finish within {} s and was killed", kScriptTimeoutSeconds);
  } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    problem = describe_status(status);
  } else {
    std::istringstream lines(script_output_);
    int number = 0;
    for (std::string line; std::getline(lines, line);) {
      ++number;
      std::string_view text(line);
      while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) {
        text.remove_suffix(1);
      }
      while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) {
        text.remove_prefix(1);
      }
      if (text.empty()) continue;
      std::string host;
      int slots = 0;
      if (!parse_line(text, options_.slots_per_host, &host, &slots)) {
        problem = fmt::format("printed line {}, '{}', which is not 'host' or 'host:slots'", number,
                              std::string(text.substr(0, 80)));
        break;
      }
      auto same = std::find_if(hosts.begin(), hosts.end(),
                               [&](const auto& entry) { return entry.first == host; });
      if (same != hosts.end()) {
        same->second += slots;
      } else {
        hosts.emplace_back(host, slots);
      }
    }
  }
  if (!problem.empty()) {
    ++script_failures_;
    std::string kept = hosts_ ? "the last good host set is kept" : "no hosts known yet";
    report(fmt::format("--host-discovery-script {} {}; {}", options_.script, problem, kept));
    if (script_failures_ >= kMaxScriptFailures) {
      fail_job(
          fmt::format("--host-discovery-script {} failed {} times in a row (last: {}); "
                      "stopping the job",
                      options_.script, script_failures_, problem));
    }
    return;
  }
  if (script_failures_ > 0 && !last_report_.empty()) {
    say_(fmt::format("--host-discovery-script {} works again", options_.script));
  }
  script_failures_ = 0;
  last_report_.clear();
  if (verbose_ && (!hosts_ || *hosts_ != hosts)) {
    std::string text;
    for (const auto& [host, slots] : hosts) text += fmt::format(" {}:{}", host, slots);
    say_(fmt::format("--elastic: the discovery script names{}", text.empty() ? " no host" : text));
  }
  hosts_ = std::move(hosts);
}

void ElasticDriver::start_first_ranks() {
  std::vector<std::string> free = free_slots({});
  if (static_cast<int>(free.size()) < options_.min_np) {
    if (Clock::now() >= start_by_) {
      fail_job(
          fmt::format("--elastic: {} names {} usable slots, fewer than --min-np {}, after "
                      "--start-timeout {} s; stopping",
                      options_.script, free.size(), options_.min_np, options_.start_timeout_s));
    }
    return;
  }
  int size = std::min({options_.np, options_.max_np, static_cast<int>(free.size())});
  started_ = true;
  if (verbose_) say_(fmt::format("--elastic: starting {} ranks", size));
  bool spans_hosts = false;
  for (const auto& [host, count] : *hosts_) spans_hosts |= !options_.is_this_machine(host);
  for (int rank = 0; rank < size; ++rank) {
    RankLaunch launch{free[static_cast<size_t>(rank)], rank, size, {}, spans_hosts};
    pid_t pid = start_(launch);
    if (pid <= 0) {
      fail_job(fmt::format("--elastic: cannot start rank {} in slot {}", rank, launch.slot));
      return;
    }
    slots_[launch.slot].pid = pid;
    slot_of_pid_[pid] = launch.slot;
  }
}

std::string ElasticDriver::plan_for(long long request, const std::vector<std::string>& members) {
  std::string leave;
  int stay = 0;
  std::set<std::string> taken;
  for (size_t rank = 0; rank < members.size(); ++rank) {
    const std::string& name = members[rank];
    taken.insert(name);
    if (usable(name)) {
      ++stay;
      continue;
    }
    leave += fmt::format(" {}", rank);
    auto found = slots_.find(name);
    if (found != slots_.end() && found->second.pid > 0) {
      found->second.leaving = true;
      found->second.leave_by = after(kLeaveGraceSeconds);
    }
    if (verbose_) say_(fmt::format("--elastic: rank {} in slot {} leaves", rank, name));
  }
  std::vector<std::string> free = free_slots(taken);
  int room = std::max(0, options_.max_np - stay);
  if (static_cast<int>(free.size()) > room) {
    if (!said_max_np_) {
      say_(
          fmt::format("--elastic: {} free slots, but --max-np {} allows {} more ranks: the "
                      "others stay unused",
                      free.size(), options_.max_np, room));
      said_max_np_ = true;
    }
    free.resize(static_cast<size_t>(room));
  } else {
    said_max_np_ = false;
  }
  if (!free.empty()) {
    for (const std::string& name : free) slots_[name].reserved = true;
    growths_[request] = {free, after(options_.rank_timeout_s)};
    if (verbose_) {
      say_(fmt::format("--elastic: {} newcomers join ({})", free.size(), fmt::join(free, " ")));
    }
  }
  return fmt::format("join {} leave{}", free.size(), leave);
}

void ElasticDriver::answer_requests() {
  // The next request and a few after it: a rank 0 that died between taking a number and writing
  // its request leaves a gap, skipped once a later request has been answered for a while.
  constexpr int kWindow = 4;
  std::vector<std::string> keys;
  for (int i = 0; i < kWindow; ++i) keys.push_back(kolo::elastic_key("request", next_request_ + i));
  std::vector<long long> growth_ids;
  for (const auto& [id, growth] : growths_) {
    keys.push_back(kolo::elastic_key("invitation", id));
    growth_ids.push_back(id);
  }
  std::vector<std::optional<std::vector<uint8_t>>> values;
  try {
    values = client_->get_many(keys, 0);
  } catch (const kolo::Error& error) {
    report(fmt::format("--elastic: the driver's store failed: {}", error.what()));
    return;
  }
  for (int i = 0; i < kWindow; ++i) {
    const auto& value = values[static_cast<size_t>(i)];
    if (!value) continue;
    long long id = next_request_ + i;
    std::istringstream words(std::string(value->begin(), value->end()));
    std::vector<std::string> members;
    for (std::string slot; words >> slot;) members.push_back(slot);
    std::string plan = plan_for(id, members);
    try {
      client_->set_string(kolo::elastic_key("plan", id), plan);
      client_->erase({kolo::elastic_key("request", id)});
    } catch (const kolo::Error& error) {
      report(fmt::format("--elastic: the driver's store failed: {}", error.what()));
    }
    if (i == 0) {
      ++next_request_;
      request_gap_since_ = Clock::time_point::max();
    } else if (request_gap_since_ == Clock::time_point::max()) {
      request_gap_since_ = Clock::now();
    }
  }
  if (request_gap_since_ != Clock::time_point::max() &&
      Clock::now() - request_gap_since_ > std::chrono::seconds(5)) {
    ++next_request_;  // a number taken and never used
    request_gap_since_ = Clock::time_point::max();
  }
  for (size_t i = 0; i < growth_ids.size(); ++i) {
    const auto& value = values[kWindow + i];
    Growth& growth = growths_[growth_ids[i]];
    if (value) {
      std::string invitation(value->begin(), value->end());
      for (const std::string& name : growth.slots) {
        Slot& slot = slots_[name];
        slot.reserved = false;
        if (stopping_) continue;
        pid_t pid = start_(RankLaunch{name, -1, 0, invitation});
        if (pid <= 0) {
          say_(fmt::format("--elastic: cannot start a newcomer in slot {}", name));
          continue;
        }
        slot.pid = pid;
        slot.leaving = false;
        slot_of_pid_[pid] = name;
      }
      growths_.erase(growth_ids[i]);
    } else if (Clock::now() >= growth.give_up) {
      say_(
          fmt::format("--elastic: no invitation came for the plan of request {} within {} s; "
                      "its slots are free again",
                      growth_ids[i], options_.rank_timeout_s));
      for (const std::string& name : growth.slots) slots_[name].reserved = false;
      growths_.erase(growth_ids[i]);
    }
  }
}

void ElasticDriver::tick() {
  if (stopping_) return;
  const Clock::time_point now = Clock::now();
  if (script_pid_ < 0 && now >= next_discovery_) run_discovery();
  if (script_fd_ >= 0) {
    char buffer[4096];
    for (ssize_t count; (count = ::read(script_fd_, buffer, sizeof buffer)) > 0;) {
      if (script_output_.size() < (1u << 20)) script_output_.append(buffer, size_t(count));
    }
  }
  if (script_pid_ > 0 && now >= script_deadline_ && !script_timed_out_) {
    script_timed_out_ = true;
    ::kill(-script_pid_, SIGKILL);  // reaped() then reports it
  }
  if (!started_) {
    if (hosts_)
      start_first_ranks();
    else if (now >= start_by_) {
      fail_job(fmt::format("--elastic: {} gave no host set within --start-timeout {} s",
                           options_.script, options_.start_timeout_s));
    }
    return;
  }
  answer_requests();
  for (auto& [name, slot] : slots_) {
    if (slot.pid > 0 && slot.leaving && now >= slot.leave_by) {
      say_(
          fmt::format("--elastic: the rank in slot {} (pid {}) did not leave within {} s; "
                      "killing it",
                      name, slot.pid, kLeaveGraceSeconds));
      if (kill_) {
        kill_(slot.pid);
      } else {
        ::kill(-slot.pid, SIGKILL);
      }
      slot.leave_by = Clock::time_point::max();
    }
  }
  int running = running_ranks();
  if (running > 0 && running < options_.min_np && growths_.empty()) {
    std::set<std::string> none;
    if (free_slots(none).empty()) {
      fail_job(
          fmt::format("--elastic: {} ranks run, fewer than --min-np {}, and {} names no free "
                      "slot to start one; stopping the job",
                      running, options_.min_np, options_.script));
    }
  }
}

bool ElasticDriver::reaped(pid_t pid, int status) {
  if (pid == script_pid_) {
    finish_discovery(status);
    return true;
  }
  auto found = slot_of_pid_.find(pid);
  if (found == slot_of_pid_.end()) return false;
  const std::string name = found->second;
  slot_of_pid_.erase(found);
  Slot& slot = slots_[name];
  slot.pid = -1;
  const bool was_leaving = slot.leaving;
  slot.leaving = false;
  last_exit_ = status;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    if (verbose_)
      say_(fmt::format("--elastic: the rank in slot {} (pid {}) exited 0{}", name, pid,
                       was_leaving ? ": it left" : ""));
    return true;
  }
  if (stopping_) return true;
  ++slot.failures;
  const std::string host = host_of(name);
  int host_failures = ++host_failures_[host];
  std::string next;
  if (host_failures >= kBlacklistFailures && blacklist_.insert(host).second) {
    next = fmt::format(
        "; {} ranks have failed on {}: it is blacklisted, its ranks leave at the "
        "next update and none start there again",
        host_failures, host);
  } else if (options_.reset_limit >= 0 && slot.failures > options_.reset_limit) {
    next = fmt::format(
        "; the slot has failed {} times, more than --reset-limit {}: it is not "
        "restarted",
        slot.failures, options_.reset_limit);
  } else {
    next = "; the others go on, and the slot is restarted at the next update";
  }
  say_(fmt::format("--elastic: the rank in slot {} (pid {}) {}{}", name, pid,
                   describe_status(status), next));
  return true;
}

}  // namespace kolorun
