// The rendezvous store's client (bootstrap/store.hpp; the wire protocol is in store_protocol.hpp):
// one authenticated connection, a request and its reply at a time, every wait bounded.
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
#include <deque>
#include <exception>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "bootstrap/store_protocol.hpp"
#include "core/deadline.hpp"
#include "core/log.hpp"
#include "kolo/status.hpp"
#include "net/auth.hpp"
#include "net/gate.hpp"

namespace kolo {

using namespace store_protocol;

// ---- client ------------------------------------------------------------------------------------

struct StoreClient::Impl {
  net::Endpoint endpoint;
  std::string where;  // "the rendezvous store at host:port"
  std::string secret;
  int rank = -1;
  double timeout_s = 0;
  uint64_t generation = 0;
  net::Socket socket;
  uint64_t requests = 0;  // requests sent (StoreClient::requests)
  std::function<void()> before_first_request;  // a deferred client's (StoreClient::Deferred)
  // After the server went away or spoke nonsense, every later call fails at once with this
  // instead of waiting out its timeout against a store that is not coming back.
  std::string broken;
  // remember_written_keys(): the keys set or added since, each once.
  bool remembering = false;
  std::vector<std::string> written;
  std::unordered_set<std::string> written_set;

  void wrote(const std::string& key) {
    if (remembering && written_set.insert(key).second) written.push_back(key);
  }

  void connect(const Deadline& deadline) {
    net::Hello hello;
    hello.purpose = net::kPurposeStore;
    hello.rank = rank;
    hello.context = generation;
    socket = net::connect_authenticated(endpoint, secret, hello, deadline);
    net::enable_keepalive(socket);  // a parked request to a vanished rank 0 fails, not hangs
  }

  // Sends one request and reads the reply's status byte within the call's timeout, then lets
  // read_payload read the rest. An error reply throws kInvalidArgument, a timeout reply (the
  // server's park limit) kTimeout; the connection stays usable after either. Any failure leaves the connection in an unknown state, so it is
  // closed: after a timeout the next call reconnects (the server drops the parked request when
  // it sees the old connection go); after anything else the client stays broken.
  template <typename ReadPayload>
  auto transact(const std::string& what, const std::vector<uint8_t>& request,
                ReadPayload read_payload) {
    if (!broken.empty()) {
      throw Error(Status::kPeerLost, fmt::format("cannot go on {}: {}", what, broken));
    }
    Deadline deadline(timeout_s);
    std::string refusal;
    uint8_t code = 0;
    try {
      if (before_first_request) std::exchange(before_first_request, nullptr)();
      if (!socket.valid()) connect(deadline);
      ++requests;
      net::send_all(socket, request.data(), request.size(), deadline);
      net::recv_all(socket, &code, 1, deadline);
      if (code == kReplyOk) return read_payload(deadline);
      if (code != kReplyError && code != kReplyTimeout) {
        throw Error(Status::kMismatch,
                    fmt::format("{} answered with an unknown reply code {}", where, code));
      }
      uint8_t length_bytes[4];
      net::recv_all(socket, length_bytes, 4, deadline);
      uint32_t length = decode_u32(length_bytes);
      if (length > kMaxErrorBytes) {
        throw Error(Status::kMismatch,
                    fmt::format("{} sent an error message of {} bytes", where, length));
      }
      refusal.resize(length);
      net::recv_all(socket, refusal.data(), length, deadline);
    } catch (const Error& error) {
      socket.close();
      std::string message;
      switch (error.status()) {
        case Status::kTimeout:
          throw Error(Status::kTimeout,
                      fmt::format("timed out after {:g} s {} in {}", timeout_s, what, where));
        case Status::kPeerLost:
          message = fmt::format("{} (served by rank 0) closed the connection while {} [{}]", where,
                                what, error.what());
          break;
        default:
          message = fmt::format("{} in {}: {}", what, where, error.what());
          break;
      }
      broken = message;
      throw Error(error.status(), message);
    }
    if (code == kReplyTimeout) {
      throw Error(Status::kTimeout, fmt::format("{} in {}: {}", what, where, refusal));
    }
    throw Error(Status::kInvalidArgument, fmt::format("{} refused {}: {}", where, what, refusal));
  }

  void check_key(const std::string& key, const char* operation) const {
    if (key.empty() || key.size() > kStoreMaxKeyBytes) {
      throw Error(Status::kInvalidArgument,
                  fmt::format("store {}: key of {} bytes; keys are 1 to {} bytes", operation,
                              key.size(), kStoreMaxKeyBytes));
    }
  }
};

StoreClient::StoreClient(const net::Endpoint& endpoint, const std::string& secret, int rank,
                         double timeout_s, uint64_t generation)
    : StoreClient(endpoint, secret, rank, timeout_s, generation, Deferred{}) {
  try {
    impl_->connect(Deadline(timeout_s));
  } catch (const Error& error) {
    throw Error(error.status(),
                fmt::format("rank {} could not connect to {} (served by rank 0; is KOLO_ADDR "
                            "right and is rank 0 running?): {}",
                            rank, impl_->where, error.what()));
  }
}

StoreClient::StoreClient(const net::Endpoint& endpoint, const std::string& secret, int rank,
                         double timeout_s, uint64_t generation, Deferred deferred)
    : impl_(std::make_unique<Impl>()) {
  impl_->generation = generation;
  impl_->endpoint = endpoint;
  impl_->where = fmt::format("the rendezvous store at {}", endpoint.to_string());
  impl_->secret = secret;
  impl_->rank = rank;
  impl_->timeout_s = timeout_s;
  impl_->before_first_request = std::move(deferred.before_first_request);
}

StoreClient::~StoreClient() = default;

void StoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  impl_->check_key(key, "set");
  if (value.size() > kStoreMaxValueBytes) {
    throw Error(Status::kInvalidArgument,
                fmt::format("store set: the value for key '{}' has {} bytes; the limit is {}", key,
                            value.size(), kStoreMaxValueBytes));
  }
  std::vector<uint8_t> request{static_cast<uint8_t>(Op::kSet)};
  request.reserve(9 + key.size() + value.size());
  append_key(request, key);
  append_u32(request, static_cast<uint32_t>(value.size()));
  append_bytes(request, value.data(), value.size());
  impl_->transact(fmt::format("setting key '{}'", key), request, [](const Deadline&) {});
  impl_->wrote(key);
}

std::vector<uint8_t> StoreClient::get(const std::string& key) {
  impl_->check_key(key, "get");
  std::vector<uint8_t> request{static_cast<uint8_t>(Op::kGet)};
  append_key(request, key);
  Impl& impl = *impl_;
  return impl.transact(
      fmt::format("waiting for key '{}'", key), request, [&](const Deadline& deadline) {
        uint8_t length_bytes[4];
        net::recv_all(impl.socket, length_bytes, 4, deadline);
        uint32_t length = decode_u32(length_bytes);
        if (length > kStoreMaxValueBytes) {
          throw Error(Status::kMismatch, fmt::format("{} sent a value of {} bytes for key '{}'",
                                                     impl.where, length, key));
        }
        std::vector<uint8_t> value(length);
        net::recv_all(impl.socket, value.data(), length, deadline);
        return value;
      });
}

std::vector<std::optional<std::vector<uint8_t>>> StoreClient::get_many(
    const std::vector<std::string>& keys, double wait_s) {
  if (keys.empty()) return {};
  if (keys.size() > kMaxWaitKeys) {
    throw Error(Status::kInvalidArgument,
                fmt::format("store get_many: {} keys; the limit is {}", keys.size(), kMaxWaitKeys));
  }
  // The server answers within wait_s; the transaction's own deadline (the client's timeout)
  // must not end first.
  const double wait = std::clamp(wait_s, 0.0, impl_->timeout_s * 0.9);
  std::vector<uint8_t> request{static_cast<uint8_t>(Op::kGetMany)};
  append_u32(request, static_cast<uint32_t>(std::min(wait * 1e3, 4e9)));
  append_u32(request, static_cast<uint32_t>(keys.size()));
  for (const auto& key : keys) {
    impl_->check_key(key, "get_many");
    append_key(request, key);
  }
  if (request.size() > kMaxRequestBytes) {
    throw Error(Status::kInvalidArgument,
                fmt::format("store get_many: the keys take {} bytes; the limit is {}",
                            request.size(), kMaxRequestBytes));
  }
  std::string what = keys.size() == 1 ? fmt::format("waiting for key '{}'", keys.front())
                                      : fmt::format("waiting for keys {}", quote_keys(keys));
  Impl& impl = *impl_;
  return impl.transact(what, request, [&](const Deadline& deadline) {
    uint8_t header[4];
    net::recv_all(impl.socket, header, 4, deadline);
    const uint32_t count = decode_u32(header);
    if (count != keys.size()) {
      throw Error(Status::kMismatch, fmt::format("{} sent {} values for the {} keys {}",
                                                 impl.where, count, keys.size(), quote_keys(keys)));
    }
    std::vector<std::optional<std::vector<uint8_t>>> values(count);
    size_t total = 0;
    for (uint32_t i = 0; i < count; ++i) {
      uint8_t present = 0;
      net::recv_all(impl.socket, &present, 1, deadline);
      if (present > 1) {
        throw Error(Status::kMismatch, fmt::format("{} sent a presence byte of {} for key '{}'",
                                                   impl.where, present, keys[i]));
      }
      if (present == 0) continue;
      net::recv_all(impl.socket, header, 4, deadline);
      const uint32_t length = decode_u32(header);
      total += length;
      if (length > kStoreMaxValueBytes || total > kMaxGetManyReplyBytes) {
        throw Error(Status::kMismatch,
                    fmt::format("{} sent a value of {} bytes for key '{}' ({} bytes so far; the "
                                "limits are {} for a value, {} for all)",
                                impl.where, length, keys[i], total, kStoreMaxValueBytes,
                                kMaxGetManyReplyBytes));
      }
      values[i].emplace(length);
      net::recv_all(impl.socket, values[i]->data(), length, deadline);
    }
    return values;
  });
}

std::vector<std::vector<uint8_t>> StoreClient::get_all(const std::vector<std::string>& keys,
                                                       std::vector<size_t>* missing) {
  // Rounds of 1, 2, 4, 8, then 10 s: one request when every rank is there within a second, few
  // when some are late, and a recent view of who is missing if the store goes away meanwhile.
  constexpr double kFirstRound = 1.0;
  constexpr double kLongestRound = 10.0;
  std::vector<std::vector<uint8_t>> values(keys.size());
  std::vector<size_t> waiting(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) waiting[i] = i;
  if (missing != nullptr) *missing = waiting;
  const Deadline deadline(impl_->timeout_s);
  double round = kFirstRound;
  while (!waiting.empty()) {
    std::vector<std::string> asked;
    asked.reserve(waiting.size());
    for (size_t i : waiting) asked.push_back(keys[i]);
    const double left = std::max(0.0, deadline.remaining_s());
    auto answers = get_many(asked, std::min(round, left));
    std::vector<size_t> still;
    for (size_t j = 0; j < answers.size(); ++j) {
      if (answers[j]) {
        values[waiting[j]] = std::move(*answers[j]);
      } else {
        still.push_back(waiting[j]);
      }
    }
    waiting = std::move(still);
    if (missing != nullptr) *missing = waiting;
    if (waiting.empty()) break;
    if (deadline.expired() || left <= 0) {
      std::vector<std::string> names;
      for (size_t i : waiting) names.push_back(keys[i]);
      throw Error(Status::kTimeout,
                  fmt::format("timed out after {:g} s waiting for {} {} in {}", impl_->timeout_s,
                              names.size() == 1 ? "key" : "keys", quote_keys(names),
                              impl_->where));
    }
    round = std::min(2 * round, kLongestRound);
  }
  return values;
}

std::vector<std::string> StoreClient::get_all_strings(const std::vector<std::string>& keys,
                                                      std::vector<size_t>* missing) {
  std::vector<std::string> strings;
  strings.reserve(keys.size());
  for (const std::vector<uint8_t>& value : get_all(keys, missing)) {
    strings.emplace_back(value.begin(), value.end());
  }
  return strings;
}

void StoreClient::wait(const std::vector<std::string>& keys) {
  if (keys.empty()) return;
  if (keys.size() > kMaxWaitKeys) {
    throw Error(Status::kInvalidArgument,
                fmt::format("store wait: {} keys; the limit is {}", keys.size(), kMaxWaitKeys));
  }
  std::vector<uint8_t> request{static_cast<uint8_t>(Op::kWait)};
  append_u32(request, static_cast<uint32_t>(keys.size()));
  for (const auto& key : keys) {
    impl_->check_key(key, "wait");
    append_key(request, key);
  }
  if (request.size() > kMaxRequestBytes) {
    throw Error(Status::kInvalidArgument,
                fmt::format("store wait: the keys take {} bytes; the limit is {}", request.size(),
                            kMaxRequestBytes));
  }
  std::string what = keys.size() == 1 ? fmt::format("waiting for key '{}'", keys.front())
                                      : fmt::format("waiting for keys {}", quote_keys(keys));
  impl_->transact(what, request, [](const Deadline&) {});
}

int64_t StoreClient::add(const std::string& key, int64_t delta) {
  impl_->check_key(key, "add");
  std::vector<uint8_t> request{static_cast<uint8_t>(Op::kAdd)};
  append_key(request, key);
  append_u64(request, static_cast<uint64_t>(delta));
  Impl& impl = *impl_;
  const int64_t sum = impl.transact(fmt::format("adding {} to key '{}'", delta, key), request,
                                    [&](const Deadline& deadline) {
                                      uint8_t sum[8];
                                      net::recv_all(impl.socket, sum, 8, deadline);
                                      return static_cast<int64_t>(decode_u64(sum));
                                    });
  impl.wrote(key);
  return sum;
}

void StoreClient::set_string(const std::string& key, const std::string& value) {
  set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string StoreClient::get_string(const std::string& key) {
  std::vector<uint8_t> value = get(key);
  return std::string(value.begin(), value.end());
}

uint64_t StoreClient::erase_prefix(const std::string& prefix) {
  impl_->check_key(prefix, "erase");
  std::vector<uint8_t> request{static_cast<uint8_t>(Op::kErase)};
  append_key(request, prefix);
  Impl& impl = *impl_;
  return impl.transact(fmt::format("erasing the keys that start with '{}'", prefix), request,
                       [&](const Deadline& deadline) {
                         uint8_t count[8];
                         net::recv_all(impl.socket, count, 8, deadline);
                         return decode_u64(count);
                       });
}

uint64_t StoreClient::erase(const std::vector<std::string>& keys) {
  if (keys.empty()) return 0;
  if (keys.size() > kMaxWaitKeys) {
    throw Error(Status::kInvalidArgument,
                fmt::format("store erase: {} keys; the limit is {}", keys.size(), kMaxWaitKeys));
  }
  std::vector<uint8_t> request{static_cast<uint8_t>(Op::kDelete)};
  append_u32(request, static_cast<uint32_t>(keys.size()));
  for (const auto& key : keys) {
    impl_->check_key(key, "erase");
    append_key(request, key);
  }
  if (request.size() > kMaxRequestBytes) {
    throw Error(Status::kInvalidArgument,
                fmt::format("store erase: the keys take {} bytes; the limit is {}", request.size(),
                            kMaxRequestBytes));
  }
  Impl& impl = *impl_;
  return impl.transact(fmt::format("erasing keys {}", quote_keys(keys)), request,
                       [&](const Deadline& deadline) {
                         uint8_t count[8];
                         net::recv_all(impl.socket, count, 8, deadline);
                         return decode_u64(count);
                       });
}

void StoreClient::remember_written_keys() {
  impl_->remembering = true;
}

std::vector<std::string> StoreClient::take_written_keys() {
  impl_->remembering = false;
  impl_->written_set.clear();
  return std::exchange(impl_->written, {});
}

uint64_t StoreClient::requests() const {
  return impl_->requests;
}

std::string store_key(uint64_t context, std::string_view what) {
  return fmt::format("kolo/{:x}/{}", context, what);
}

std::string store_key(uint64_t context, std::string_view what, int rank) {
  return fmt::format("kolo/{:x}/{}/{}", context, what, rank);
}

}  // namespace kolo
