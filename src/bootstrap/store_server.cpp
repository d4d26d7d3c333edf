// The rendezvous store's server (bootstrap/store.hpp; the wire protocol is in store_protocol.hpp).
//
// Server. One thread runs an epoll loop over the Gate that admits connections (net/gate.hpp: the
// listener and every handshake, one descriptor), an eventfd that asks it to stop, and every
// admitted client. Nothing in the loop blocks: sockets are non-blocking and each connection keeps
// its own input and output buffers. A GET, GET_MANY or WAIT for a key that does not
// exist yet is parked on the server and answered when a SET or ADD creates the key; the client
// bounds how long it is prepared to wait, and when it gives up and closes, its waiters go with it.
// A client that never gives up is answered with a timeout after StoreLimits::park_seconds; a
// GET_MANY is answered after its own wait (at most park_seconds) with the values that exist then.
// While a connection has a parked request or unsent output, the server reads nothing more from it,
// so its input buffer stays bounded by one request and a read's chunk. A client that shuts down
// its sending side (shutdown(SHUT_WR) after its last request) is still served what it sent, and
// then closed; a request of its that would wait is given up with the connection, as when a
// client closes.
//
// Bounds (StoreLimits): at most `unauthenticated` connections in the handshake (the Gate pushes out
// the oldest, so a flood of silent strangers holds a fixed number of rank 0's descriptors and a
// real client that answers at once still gets in; its warnings are throttled); SET and ADD that
// would take the store past its key or byte limit are refused with an error.
// Requests are consumed from the input by an offset, and the consumed prefix is dropped once per
// read, so a client that pipelines many small requests costs linear time, not quadratic. Keys are
// kept in order, so that an ERASE finds the keys under its prefix as one range: it costs what it
// erases (and a lookup), never a scan of every key.
#include "bootstrap/store.hpp"

#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>

#include "bootstrap/store_protocol.hpp"
#include "core/deadline.hpp"
#include "core/log.hpp"
#include "kolo/status.hpp"
#include "net/auth.hpp"
#include "net/gate.hpp"

namespace kolo {

using namespace store_protocol;

// ---- server ------------------------------------------------------------------------------------

struct StoreServer::Impl {
  enum class State { kReady, kParked };

  struct Connection {
    uint64_t id = 0;
    net::Socket socket;
    std::string peer;  // "host:port", and the rank once known, for log lines
    State state = State::kReady;
    bool closed = false;
    bool peer_shut_down = false;  // the client shut down its sending side (EPOLLRDHUP)
    bool input_ended = false;     // and everything it sent has been read
    uint32_t events = 0;  // what epoll is currently asked to report
    std::vector<uint8_t> input;
    size_t input_start = 0;  // input before this offset has been executed
    std::vector<uint8_t> output;
    size_t output_sent = 0;
    // A parked GET, GET_MANY or WAIT: what it waits for and how many of its keys are still
    // missing.
    Op parked_op = Op::kGet;
    std::string parked_key;
    std::vector<std::string> parked_keys;  // GET_MANY's keys, in the order of the reply
    std::vector<std::string> parked_missing;  // the keys this connection has waiters on
    size_t missing = 0;
    uint64_t park_generation = 0;
    Clock::time_point park_deadline{};
  };

  struct Waiter {
    uint64_t connection;
    uint64_t generation;
  };

  static constexpr uint64_t kGateId = 0;
  static constexpr uint64_t kWakeId = 1;
  // Replies pile up to this many unsent bytes before the server stops executing a client's
  // requests (one send for a batch of pipelined requests, not one each).
  static constexpr size_t kMaxPendingOutput = 64 * 1024;

  std::string secret;
  StoreLimits limits;
  std::unique_ptr<net::Gate> gate;
  net::Endpoint bound;
  net::Socket epoll;
  net::Socket wake;  // an eventfd; the destructor writes to it to stop the loop
  std::thread thread;

  // Only the loop thread touches what follows.
  std::map<std::string, std::vector<uint8_t>, std::less<>> data;  // in key order: see kErase
  std::unordered_map<std::string, std::vector<Waiter>> waiters;
  std::unordered_map<uint64_t, Connection> connections;
  // When each parked request times out (Connection::park_deadline), and its connection; an entry
  // leaves when its request is answered or its connection goes.
  std::set<std::pair<Clock::time_point, uint64_t>> park_deadlines;
  Clock::duration park_time{};  // StoreLimits::park_seconds
  std::vector<uint64_t> to_process;  // connections whose parked request was just answered
  std::vector<uint64_t> dead;        // closed connections to erase at the end of a round
  uint64_t next_id = 2;
  size_t stored_bytes = 0;     // keys and values in `data`
  size_t waiter_count = 0;     // entries in `waiters`

  // What stats() returns: a copy the loop publishes after every round.
  mutable std::mutex stats_mutex;
  StoreStats published;

  void publish_stats() {
    std::lock_guard<std::mutex> lock(stats_mutex);
    published.keys = data.size();
    published.bytes = stored_bytes;
    published.waiters = waiter_count;
    published.connections = connections.size();
    const net::GateStats gate_stats = gate->stats();
    published.connections += gate_stats.pending;
    published.unauthenticated = gate_stats.pending;
    published.strangers_dropped = gate_stats.dropped;
  }

  // -- epoll plumbing --

  void watch(int fd, uint64_t id, uint32_t events) {
    epoll_event event{};
    event.events = events;
    event.data.u64 = id;
    if (::epoll_ctl(epoll.fd(), EPOLL_CTL_ADD, fd, &event) != 0) {
      throw Error(Status::kSystem, fmt::format("epoll_ctl(ADD) in the rendezvous store: {}",
                                               std::generic_category().message(errno)));
    }
  }

  void set_events(int fd, uint64_t id, uint32_t events) {
    epoll_event event{};
    event.events = events;
    event.data.u64 = id;
    ::epoll_ctl(epoll.fd(), EPOLL_CTL_MOD, fd, &event);
  }

  // Reads while the connection may take a request and there is more to read, writes while output
  // is pending, and hears about a hang-up (also while a request is parked) until it has heard of
  // one: EPOLLRDHUP, like the end of the input, is reported for as long as it is asked for.
  void update_interest(Connection& connection) {
    if (connection.closed) return;
    uint32_t events = connection.peer_shut_down ? 0u : static_cast<uint32_t>(EPOLLRDHUP);
    if (connection.output_sent < connection.output.size()) {
      events |= EPOLLOUT;
    } else if (connection.state != State::kParked && !connection.input_ended) {
      events |= EPOLLIN;
    }
    if (events != connection.events) {
      set_events(connection.socket.fd(), connection.id, events);
      connection.events = events;
    }
  }

  void drop(Connection& connection) {
    if (connection.closed) return;
    ::epoll_ctl(epoll.fd(), EPOLL_CTL_DEL, connection.socket.fd(), nullptr);
    connection.socket.close();
    connection.closed = true;
    connection.input.clear();
    connection.input_start = 0;
    connection.output.clear();
    if (connection.state == State::kParked) forget_waiters(connection);
    dead.push_back(connection.id);
  }

  // Removes a parked connection's entries from `waiters` and its deadline, so that clients that
  // give up and close (after a timeout, say) leave nothing behind.
  void forget_waiters(Connection& connection) {
    park_deadlines.erase({connection.park_deadline, connection.id});
    for (const std::string& key : connection.parked_missing) {
      auto it = waiters.find(key);
      if (it == waiters.end()) continue;
      std::vector<Waiter>& list = it->second;
      size_t before = list.size();
      list.erase(std::remove_if(list.begin(), list.end(),
                                [&](const Waiter& w) { return w.connection == connection.id; }),
                 list.end());
      waiter_count -= before - list.size();
      if (list.empty()) waiters.erase(it);
    }
    connection.parked_missing.clear();
  }

  // -- the loop --

  void run() {
    epoll_event events[64];
    for (;;) {
      int ready = ::epoll_wait(epoll.fd(), events, 64, next_timeout_ms());
      if (ready < 0 && errno != EINTR) {
        log::warn("rendezvous store: epoll_wait failed ({}); the store stops serving",
                  std::generic_category().message(errno));
        return;
      }
      for (int i = 0; i < ready; ++i) {
        uint64_t id = events[i].data.u64;
        if (id == kWakeId) return;
        if (id == kGateId) continue;  // admitted below, every round
        auto it = connections.find(id);
        if (it == connections.end() || it->second.closed) continue;
        guarded(it->second, [&](Connection& c) { handle_event(c, events[i].events); });
      }
      admit();
      expire_parks();
      while (!to_process.empty()) {
        std::vector<uint64_t> batch;
        batch.swap(to_process);
        for (uint64_t id : batch) {
          auto it = connections.find(id);
          if (it != connections.end())
            guarded(it->second, [&](Connection& c) { process_input(c); });
        }
      }
      for (uint64_t id : dead) connections.erase(id);
      dead.clear();
      publish_stats();
    }
  }

  // One misbehaving connection (or an allocation failure while serving it) must not end the
  // store for everyone else.
  template <typename Action>
  void guarded(Connection& connection, Action action) {
    try {
      action(connection);
    } catch (const std::exception& error) {
      log::warn("rendezvous store: dropping the connection from {}: {}", connection.peer,
                error.what());
      drop(connection);
    }
  }

  int next_timeout_ms() const {
    int timeout = gate->timeout_ms();
    if (park_deadlines.empty()) return timeout;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(park_deadlines.begin()->first -
                                                                   Clock::now())
                          .count();
    const int park_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
    return timeout < 0 ? park_ms : std::min(timeout, park_ms);
  }

  // Makes a client of every connection the gate admitted.
  void admit() {
    for (net::Gate::Admitted& admitted : gate->advance()) {
      const uint64_t id = next_id++;
      Connection& connection = connections[id];
      connection.id = id;
      connection.socket = std::move(admitted.socket);
      connection.peer = fmt::format("rank {} ({})", admitted.hello.rank, admitted.peer);
      log::info("rendezvous store: {} connected", connection.peer);
      guarded(connection, [&](Connection& c) {
        // A client's host may vanish without a FIN or RST (power loss, a cable): keepalive
        // probes find that out, so that its connection, and a request it parked, do not stay
        // for ever.
        net::enable_keepalive(c.socket);
        watch(c.socket.fd(), c.id, 0);
        c.events = 0;
        update_interest(c);
      });
    }
  }

  void handle_event(Connection& connection, uint32_t events) {
    // A ready client that shut down only its sending side is served what it sent first
    // (close_when_served); any other end of a connection drops it at once.
    const bool ready = connection.state == State::kReady;
    if ((events & (EPOLLERR | EPOLLHUP)) || ((events & EPOLLRDHUP) && !ready)) {
      if (connection.state == State::kParked) {
        log::info("rendezvous store: {} disconnected while waiting for key '{}'", connection.peer,
                  connection.parked_key);
      } else {
        log::info("rendezvous store: {} disconnected", connection.peer);
      }
      drop(connection);
      return;
    }
    if (events & EPOLLRDHUP) connection.peer_shut_down = true;
    if (events & EPOLLOUT) flush(connection);
    if (connection.closed) return;
    if (events & (EPOLLIN | EPOLLRDHUP)) read_input(connection);
    if (connection.closed) return;
    process_input(connection);
  }

  void read_input(Connection& connection) {
    size_t want = kReadChunk;
    size_t old_size = connection.input.size();
    connection.input.resize(old_size + want);
    ssize_t n = ::recv(connection.socket.fd(), connection.input.data() + old_size, want, 0);
    connection.input.resize(old_size + (n > 0 ? static_cast<size_t>(n) : 0));
    if (n == 0) {
      // What it sent is served before the connection closes (close_when_served).
      connection.peer_shut_down = true;
      connection.input_ended = true;
      return;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
      log::warn("rendezvous store: reading from {} failed ({}); dropped", connection.peer,
                std::generic_category().message(errno));
      drop(connection);
      return;
    }
  }

  // Executes complete requests for as long as the connection can take them, sending the replies
  // of each batch together and dropping the executed prefix of the input once a batch.
  void process_input(Connection& connection) {
    for (;;) {
      const bool batch_full = execute_requests(connection);
      if (connection.closed) return;
      if (connection.input_start == connection.input.size()) {
        connection.input.clear();
      } else if (connection.input_start > 0) {
        connection.input.erase(connection.input.begin(),
                               connection.input.begin() +
                                   static_cast<ptrdiff_t>(connection.input_start));
      }
      connection.input_start = 0;
      flush(connection);
      // A full batch went out at once: requests that arrived with it are still in the input, and
      // no event will announce them (they have all been read), so the next batch runs now.
      if (connection.closed || !batch_full || connection.output_sent < connection.output.size()) {
        close_when_served(connection);
        return;
      }
    }
  }

  // Closes the connection of a client that shut down its sending side once everything it sent
  // has been read and answered; what is left of its input then is part of a request that can
  // never be completed. A request that parks is given up at once: a client that has stopped
  // sending looks the same as one that has closed, whose waiters must not stay behind.
  void close_when_served(Connection& connection) {
    if (connection.closed || !connection.peer_shut_down) return;
    if (connection.state == State::kParked) {
      log::info("rendezvous store: {} disconnected while waiting for key '{}'", connection.peer,
                connection.parked_key);
      drop(connection);
      return;
    }
    if (!connection.input_ended || connection.output_sent < connection.output.size()) return;
    log::info("rendezvous store: {} disconnected", connection.peer);
    drop(connection);
  }

  // Executes complete requests until the input holds none, the connection parks, or a batch of
  // replies reaches kMaxPendingOutput; returns true in the last case.
  bool execute_requests(Connection& connection) {
    while (!connection.closed && connection.state == State::kReady &&
           connection.input_start < connection.input.size()) {
      if (connection.output.size() - connection.output_sent >= kMaxPendingOutput) return true;
      const uint8_t* next = connection.input.data() + connection.input_start;
      size_t available = connection.input.size() - connection.input_start;
      RequestParser check(next, available, nullptr);
      Parse result = check.parse();
      if (result == Parse::kIncomplete) break;
      if (result == Parse::kMalformed) {
        log::warn("rendezvous store: {} sent {}; dropped", connection.peer, check.reason());
        drop(connection);
        return false;
      }
      Request request;
      RequestParser decode(next, available, &request);
      decode.parse();
      connection.input_start += check.consumed();
      execute(connection, std::move(request));
    }
    return false;
  }

  void execute(Connection& connection, Request request) {
    switch (request.op) {
      case Op::kSet: {
        const std::string& key = request.keys.front();
        log::trace("rendezvous store: {} sets '{}' ({} bytes)", connection.peer, key,
                   request.value.size());
        std::string refusal = over_limit(key, request.value.size());
        if (!refusal.empty()) return refuse(connection, refusal);
        store(key, std::move(request.value));
        uint8_t ok = kReplyOk;
        queue(connection, &ok, 1);
        return;
      }
      case Op::kGet:
      case Op::kWait:
      case Op::kGetMany: {
        std::vector<std::string> missing;
        for (const auto& key : request.keys) {
          if (data.count(key) == 0) missing.push_back(key);
        }
        std::sort(missing.begin(), missing.end());
        missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
        connection.parked_op = request.op;
        connection.parked_key = request.keys.empty() ? std::string() : request.keys.front();
        Clock::duration park_for = park_time;
        if (request.op == Op::kGetMany) {
          connection.parked_keys = std::move(request.keys);
          park_for =
              std::min<Clock::duration>(park_for, std::chrono::milliseconds(request.wait_ms));
        }
        if (missing.empty() ||
            (request.op == Op::kGetMany && park_for <= Clock::duration::zero())) {
          answer_parked(connection);
          return;
        }
        log::trace("rendezvous store: {} waits for {}", connection.peer, quote_keys(missing));
        connection.state = State::kParked;
        connection.missing = missing.size();
        ++connection.park_generation;
        for (const auto& key : missing) {
          waiters[key].push_back(Waiter{connection.id, connection.park_generation});
        }
        waiter_count += missing.size();
        connection.parked_missing = std::move(missing);
        connection.park_deadline = Clock::now() + park_for;
        park_deadlines.emplace(connection.park_deadline, connection.id);
        return;
      }
      case Op::kAdd: {
        const std::string& key = request.keys.front();
        int64_t current = 0;
        auto it = data.find(key);
        if (it != data.end()) {
          if (it->second.size() != 8) {
            return refuse(connection,
                          fmt::format("key '{}' holds a {}-byte value, not a counter made by add",
                                      key, it->second.size()));
          }
          current = static_cast<int64_t>(decode_u64(it->second.data()));
        }
        int64_t sum = 0;
        if (__builtin_add_overflow(current, request.delta, &sum)) {
          return refuse(connection, fmt::format("adding {} to key '{}' (now {}) overflows int64",
                                                request.delta, key, current));
        }
        std::string refusal = over_limit(key, 8);
        if (!refusal.empty()) return refuse(connection, refusal);
        std::vector<uint8_t> encoded;
        append_u64(encoded, static_cast<uint64_t>(sum));
        store(key, encoded);
        std::vector<uint8_t> reply{kReplyOk};
        append_u64(reply, static_cast<uint64_t>(sum));
        queue(connection, reply.data(), reply.size());
        return;
      }
      case Op::kErase: {
        // The keys that start with prefix are one range of the ordered keys, from the first
        // that is not less than the prefix.
        const std::string& prefix = request.keys.front();
        uint64_t erased = 0;
        auto it = data.lower_bound(prefix);
        while (it != data.end() && it->first.starts_with(prefix)) {
          stored_bytes -= it->first.size() + it->second.size();
          it = data.erase(it);
          ++erased;
        }
        log::trace("rendezvous store: {} erased {} key(s) starting with '{}'", connection.peer,
                   erased, prefix);
        return answer_erased(connection, erased);
      }
      case Op::kDelete: {
        uint64_t erased = 0;
        for (const std::string& key : request.keys) {
          auto it = data.find(key);
          if (it == data.end()) continue;
          stored_bytes -= it->first.size() + it->second.size();
          data.erase(it);
          ++erased;
        }
        log::trace("rendezvous store: {} erased {} of {} key(s) named", connection.peer, erased,
                   request.keys.size());
        return answer_erased(connection, erased);
      }
    }
  }

  void answer_erased(Connection& connection, uint64_t erased) {
    std::vector<uint8_t> reply{kReplyOk};
    append_u64(reply, erased);
    queue(connection, reply.data(), reply.size());
  }

  void refuse(Connection& connection, const std::string& message) {
    reply_error(connection, kReplyError, message);
  }

  void reply_error(Connection& connection, uint8_t code, const std::string& message) {
    std::vector<uint8_t> reply{code};
    size_t bytes = std::min(message.size(), kMaxErrorBytes);
    append_u32(reply, static_cast<uint32_t>(bytes));
    append_bytes(reply, message.data(), bytes);
    queue(connection, reply.data(), reply.size());
  }

  // Why storing a value of value_bytes under key would take the store past a limit; empty when
  // it fits.
  std::string over_limit(const std::string& key, size_t value_bytes) const {
    auto it = data.find(key);
    if (it == data.end() && data.size() >= limits.keys) {
      return fmt::format("the store holds {} keys, its limit; key '{}' was not stored",
                         data.size(), key);
    }
    size_t old_bytes = it == data.end() ? 0 : key.size() + it->second.size();
    size_t total = stored_bytes - old_bytes + key.size() + value_bytes;
    if (total > limits.bytes) {
      return fmt::format(
          "storing key '{}' ({} bytes of value) would take the store to {} bytes of keys and "
          "values, over its limit of {}; not stored",
          key, value_bytes, total, limits.bytes);
    }
    return {};
  }

  // Stores a value and answers every parked request that was waiting only for this key.
  void store(const std::string& key, std::vector<uint8_t> value) {
    auto existing = data.find(key);
    if (existing != data.end()) stored_bytes -= key.size() + existing->second.size();
    stored_bytes += key.size() + value.size();
    auto [it, created] = data.insert_or_assign(key, std::move(value));
    (void)it;
    if (!created) return;
    auto waiting = waiters.find(key);
    if (waiting == waiters.end()) return;
    std::vector<Waiter> list = std::move(waiting->second);
    waiters.erase(waiting);
    waiter_count -= list.size();
    for (const Waiter& waiter : list) {
      auto found = connections.find(waiter.connection);
      if (found == connections.end()) continue;
      Connection& other = found->second;
      if (other.closed || other.state != State::kParked ||
          other.park_generation != waiter.generation) {
        continue;
      }
      if (--other.missing == 0) {
        other.state = State::kReady;
        other.parked_missing.clear();
        park_deadlines.erase({other.park_deadline, other.id});
        answer_parked(other);
        to_process.push_back(other.id);  // it may have more input; handled after this round
      }
    }
  }

  // Answers every parked request that has waited park_seconds with a timeout that names the
  // keys still missing; the connection then goes on with its next request.
  void expire_parks() {
    const auto now = Clock::now();
    while (!park_deadlines.empty() && park_deadlines.begin()->first <= now) {
      auto it = connections.find(park_deadlines.begin()->second);
      if (it == connections.end() || it->second.state != State::kParked) {
        park_deadlines.erase(park_deadlines.begin());  // cannot happen: answers erase theirs
        continue;
      }
      Connection& connection = it->second;
      if (connection.parked_op == Op::kGetMany) {
        // Its own wait is over: it learns what exists now, and asks again for the rest.
        forget_waiters(connection);
        connection.state = State::kReady;
        answer_get_many(connection);
        to_process.push_back(connection.id);
        continue;
      }
      std::vector<std::string> missing;
      for (const std::string& key : connection.parked_missing) {
        if (data.count(key) == 0) missing.push_back(key);
      }
      forget_waiters(connection);  // erases the deadline too
      connection.state = State::kReady;
      connection.parked_keys.clear();
      const std::string message = fmt::format(
          "{} {} {} appear within {:g} s (the store's limit for a waiting request)",
          missing.size() == 1 ? "key" : "keys", quote_keys(missing),
          missing.size() == 1 ? "did not" : "did not all",
          std::chrono::duration<double>(park_time).count());
      log::info("rendezvous store: {}: {}", connection.peer, message);
      reply_error(connection, kReplyTimeout, message);
      to_process.push_back(connection.id);  // sends the reply, then serves what came next
    }
  }

  void answer_parked(Connection& connection) {
    if (connection.parked_op == Op::kWait) {
      uint8_t ok = kReplyOk;
      queue(connection, &ok, 1);
      return;
    }
    if (connection.parked_op == Op::kGetMany) return answer_get_many(connection);
    const std::vector<uint8_t>& value = data.at(connection.parked_key);
    std::vector<uint8_t> reply{kReplyOk};
    reply.reserve(5 + value.size());
    append_u32(reply, static_cast<uint32_t>(value.size()));
    append_bytes(reply, value.data(), value.size());
    queue(connection, reply.data(), reply.size());
  }

  // The value of every key GET_MANY named that exists, in its order, or an error when together
  // they would exceed kMaxGetManyReplyBytes (checked before anything is copied).
  void answer_get_many(Connection& connection) {
    const std::vector<std::string> keys = std::move(connection.parked_keys);
    connection.parked_keys.clear();
    std::vector<const std::vector<uint8_t>*> values;
    values.reserve(keys.size());
    size_t value_bytes = 0;
    for (const std::string& key : keys) {
      auto it = data.find(key);
      values.push_back(it == data.end() ? nullptr : &it->second);
      if (it != data.end()) value_bytes += it->second.size();
    }
    if (value_bytes > kMaxGetManyReplyBytes) {
      return refuse(connection,
                    fmt::format("the values of the {} keys {} take {} bytes, over the limit of {} "
                                "for one GET_MANY",
                                keys.size(), quote_keys(keys), value_bytes, kMaxGetManyReplyBytes));
    }
    std::vector<uint8_t> reply{kReplyOk};
    reply.reserve(5 + 5 * keys.size() + value_bytes);
    append_u32(reply, static_cast<uint32_t>(keys.size()));
    for (const std::vector<uint8_t>* value : values) {
      reply.push_back(value != nullptr ? 1 : 0);
      if (value == nullptr) continue;
      append_u32(reply, static_cast<uint32_t>(value->size()));
      append_bytes(reply, value->data(), value->size());
    }
    queue(connection, reply.data(), reply.size());
  }

  // Appends a reply; the caller flushes (process_input does, once for a batch of replies).
  void queue(Connection& connection, const void* bytes, size_t size) {
    append_bytes(connection.output, bytes, size);
  }

  void flush(Connection& connection) {
    while (!connection.closed && connection.output_sent < connection.output.size()) {
      ssize_t n =
          ::send(connection.socket.fd(), connection.output.data() + connection.output_sent,
                 connection.output.size() - connection.output_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        connection.output_sent += static_cast<size_t>(n);
        continue;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      log::info("rendezvous store: sending to {} failed ({}); dropped", connection.peer,
                std::generic_category().message(errno));
      drop(connection);
      return;
    }
    if (connection.output_sent == connection.output.size()) {
      connection.output.clear();
      connection.output_sent = 0;
    }
    update_interest(connection);
  }
};

namespace {

net::Socket listen_for_store(const net::Endpoint& endpoint) {
  try {
    return net::listen_on(endpoint);
  } catch (const Error& error) {
    throw Error(error.status(), fmt::format("cannot serve the rendezvous store: {}", error.what()));
  }
}

}  // namespace

StoreServer::StoreServer(const net::Endpoint& endpoint, std::string secret, StoreLimits limits)
    : StoreServer(listen_for_store(endpoint), std::move(secret), limits) {}

StoreServer::StoreServer(net::Socket listener, std::string secret, StoreLimits limits)
    : impl_(std::make_unique<Impl>()) {
  impl_->secret = std::move(secret);
  impl_->limits = limits;
  // At most about 30 years, so that a deadline stays within the clock's range.
  const double park_seconds = limits.park_seconds > 0 ? std::min(limits.park_seconds, 1e9) : 0.0;
  impl_->park_time = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(park_seconds));
  try {
    impl_->gate = std::make_unique<net::Gate>(
        std::move(listener), impl_->secret, "rendezvous store",
        [generation = limits.generation](const net::Hello& hello) {
          if (hello.purpose != net::kPurposeStore) {
            return fmt::format("opened it for purpose {}, not for the store", hello.purpose);
          }
          if (hello.context != 0 && hello.context != generation) {
            return fmt::format("came for communicator {} made at this address, and this store "
                               "serves communicator {} (it retries until that one is served)",
                               hello.context, generation);
          }
          return std::string();
        },
        net::GateLimits{limits.unauthenticated,
                        std::chrono::duration<double>(kHandshakeTime).count()});
    impl_->bound = impl_->gate->endpoint();
  } catch (const Error& error) {
    throw Error(error.status(), fmt::format("cannot serve the rendezvous store: {}", error.what()));
  }
  impl_->epoll = net::Socket(::epoll_create1(EPOLL_CLOEXEC));
  impl_->wake = net::Socket(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!impl_->epoll.valid() || !impl_->wake.valid()) {
    throw Error(Status::kSystem,
                fmt::format("cannot serve the rendezvous store at {}: epoll/eventfd: {}",
                            impl_->bound.to_string(), std::generic_category().message(errno)));
  }
  impl_->watch(impl_->gate->fd(), Impl::kGateId, EPOLLIN);
  impl_->watch(impl_->wake.fd(), Impl::kWakeId, EPOLLIN);
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
}

StoreServer::~StoreServer() {
  uint64_t one = 1;
  // An eventfd write of 1 cannot fail short of a counter overflow, which one write cannot cause.
  (void)!::write(impl_->wake.fd(), &one, sizeof one);
  impl_->thread.join();
}

net::Endpoint StoreServer::endpoint() const {
  return impl_->bound;
}

StoreStats StoreServer::stats() const {
  std::lock_guard<std::mutex> lock(impl_->stats_mutex);
  return impl_->published;
}

}  // namespace kolo
