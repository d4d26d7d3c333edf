// How a connection gets in (net/gate.hpp), in one process: a Gate served by a thread of the test,
// strangers and real clients on loopback. And what the lifeline reads from a peer
// (comm/lifeline_wire.hpp).
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "capture_stderr.hpp"
#include "comm/lifeline_wire.hpp"
#include "kolo/status.hpp"
#include "net/gate.hpp"

using kolo::Deadline;
using kolo::Error;
using kolo::Status;
namespace net = kolo::net;

namespace {

const char* kSecret = "gate-test-secret-0123456789";

// A Gate served by a thread until destroyed; what it admits is kept.
class ServedGate {
 public:
  explicit ServedGate(net::Gate::Check check, net::GateLimits limits = {})
      : gate_(net::listen_on({"127.0.0.1", 0}), kSecret, "test gate", std::move(check), limits) {
    thread_ = std::thread([this] {
      while (!stop_) {
        pollfd entry{gate_.fd(), POLLIN, 0};
        const int timeout = gate_.timeout_ms();
        ::poll(&entry, 1, timeout < 0 ? 20 : std::min(timeout, 20));
        std::vector<net::Gate::Admitted> admitted = gate_.advance();
        std::lock_guard<std::mutex> lock(mutex_);
        stats_ = gate_.stats();
        for (auto& connection : admitted) admitted_.push_back(std::move(connection));
      }
    });
  }
  ~ServedGate() {
    stop_ = true;
    thread_.join();
  }
  net::Endpoint endpoint() const { return gate_.endpoint(); }
  net::GateStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }
  std::vector<net::Gate::Admitted> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(admitted_, {});
  }

 private:
  net::Gate gate_;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  net::GateStats stats_;
  std::vector<net::Gate::Admitted> admitted_;
  std::thread thread_;
};

std::string admit_all(const net::Hello&) { return {}; }

bool eventually(const std::function<bool()>& condition, double seconds) {
  const Deadline deadline(seconds);
  while (!condition()) {
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

const net::Hello kHello{net::kPurposeData, 3, 1, 42};

}  // namespace

TEST_CASE("gate: a client gets in past a crowd of silent strangers", "[gate]") {
  ServedGate gate(admit_all, net::GateLimits{16, 5.0});
  // Far more silent connections than handshakes may be under way, and than a listen backlog holds.
  std::vector<net::Socket> strangers;
  for (int i = 0; i < 300; ++i) strangers.push_back(net::connect_to(gate.endpoint(), Deadline(5)));
  REQUIRE(eventually([&] { return gate.stats().dropped >= 300 - 16; }, 10));
  CHECK(gate.stats().pending <= 16);

  const auto started = std::chrono::steady_clock::now();
  net::Socket client =
      net::connect_authenticated(gate.endpoint(), kSecret, kHello, Deadline(5));
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  CHECK(took < 2.0);
  REQUIRE(eventually([&] { return gate.stats().admitted == 1; }, 5));
  std::vector<net::Gate::Admitted> admitted = gate.take();
  REQUIRE(admitted.size() == 1);
  CHECK(admitted[0].hello.rank == 3);
  CHECK(admitted[0].hello.context == 42);

  // Nothing past the answer was read: what the client says next is the owner's to read.
  const char word[] = "after the handshake";
  net::send_all(client, word, sizeof word, Deadline(5));
  net::set_nonblocking(admitted[0].socket, false);
  char got[sizeof word] = {};
  net::recv_all(admitted[0].socket, got, sizeof got, Deadline(5));
  CHECK(std::string(got) == word);
}

TEST_CASE("gate: a hello the owner does not want gets no proof of the secret", "[gate]") {
  ServedGate gate([](const net::Hello& hello) {
    return hello.rank == 3 ? std::string("rank 3 is not expected") : std::string();
  });
  net::Socket socket = net::connect_to(gate.endpoint(), Deadline(5));
  // The acceptor closes the connection instead of proving the secret: the client sees it closed
  // (kPeerLost), not a proof (which would let it go on) nor a wrong one (kMismatch).
  try {
    net::authenticate_as_client(socket, kSecret, kHello, Deadline(5));
    FAIL("the connection was admitted");
  } catch (const Error& error) {
    CHECK(error.status() == Status::kPeerLost);
  }
  CHECK(gate.stats().admitted == 0);
  // connect_authenticated tries again until its deadline, then gives the reason.
  try {
    net::connect_authenticated(gate.endpoint(), kSecret, kHello, Deadline(0.5));
    FAIL("the connection was admitted");
  } catch (const Error& error) {
    CHECK(error.status() == Status::kPeerLost);
  }
  // Another rank gets in.
  net::Hello other = kHello;
  other.rank = 2;
  CHECK(net::connect_authenticated(gate.endpoint(), kSecret, other, Deadline(5)).valid());
}

TEST_CASE("gate: warnings about strangers are throttled", "[gate]") {
  const std::string log = capture_stderr([] {
    ServedGate gate(admit_all);
    std::vector<net::Socket> strangers;
    for (int i = 0; i < 40; ++i) {
      net::Socket stranger = net::connect_to(gate.endpoint(), Deadline(5));
      uint8_t nonce[net::kAuthNonceBytes];
      net::recv_all(stranger, nonce, sizeof nonce, Deadline(5));
      std::vector<uint8_t> garbage(net::kAuthAnswerBytes, 0x17);
      net::send_all(stranger, garbage.data(), garbage.size(), Deadline(5));
      strangers.push_back(std::move(stranger));
    }
    REQUIRE(eventually([&] { return gate.stats().dropped == 40; }, 10));
  });  // the gate's end reports what it held back
  size_t warnings = 0;
  for (size_t at = log.find("is not a kolo peer"); at != std::string::npos;
       at = log.find("is not a kolo peer", at + 1)) {
    ++warnings;
  }
  INFO(log);
  CHECK(warnings == 5);
  CHECK(log.find("35 more warnings") != std::string::npos);
}

TEST_CASE("gate: reaching a listener says whether anybody is there", "[gate]") {
  std::string why;
  net::Socket socket;
  net::Endpoint nobody;
  {
    ServedGate gate(admit_all);
    nobody = gate.endpoint();
    CHECK(net::reach_authenticated(gate.endpoint(), kSecret, kHello, Deadline(5), &socket, &why) ==
          net::Reach::kAdmitted);
    CHECK(socket.valid());
  }
  // The listener closed with its gate: refused, which is evidence that nobody listens.
  socket.close();
  CHECK(net::reach_authenticated(nobody, kSecret, kHello, Deadline(5), &socket, &why) ==
        net::Reach::kGone);
  CHECK_FALSE(socket.valid());
  // A listener that takes connections but never admits this one (nobody accepts: its backlog
  // holds the connection): no evidence either way.
  net::Socket deaf = net::listen_on({"127.0.0.1", 0});
  CHECK(net::reach_authenticated(net::local_endpoint(deaf), kSecret, kHello, Deadline(2),
                                 &socket, &why) == net::Reach::kSilent);
  // It was asked again meanwhile, and took the fresh connections too: a process listens there.
  CHECK_THAT(why, Catch::Matchers::Contains("fresh connection(s) were taken meanwhile: a process "
                                            "listens there and does not answer"));
}

TEST_CASE("gate: a connection nobody answers, from a listener that closed since, is no answer",
          "[gate]") {
  // The listener takes the connection and closes, but the connection stays open and silent: what
  // a process that dies while a connection is being made to it can leave behind. A fresh
  // connection is refused, which says that nobody listens there any more.
  net::Socket listener = net::listen_on({"127.0.0.1", 0});
  const net::Endpoint endpoint = net::local_endpoint(listener);
  net::Socket left_open;
  std::thread closer([&] {
    left_open = net::accept_from(listener, Deadline(5));
    listener.close();
  });
  std::string why;
  net::Socket socket;
  const net::Reach reach =
      net::reach_authenticated(endpoint, kSecret, kHello, Deadline(10), &socket, &why);
  closer.join();
  INFO(why);
  CHECK(reach == net::Reach::kGone);
  CHECK_FALSE(socket.valid());
  CHECK_THAT(why, Catch::Matchers::Contains("took a connection and never answered it, and a "
                                            "fresh connection found nobody listening"));
}

TEST_CASE("lifeline: an abort is always a failure, and a decision is checked",
          "[gate][lifeline]") {
  using namespace kolo::lifeline_wire;
  Message abort{kAbort, 0, text_bytes("done")};
  // An abort that says "success" must not become a shrink that succeeds without a communicator.
  CHECK(abort_error(abort, 1).status() == Status::kMismatch);
  abort.value = 999;
  CHECK(abort_error(abort, 1).status() == Status::kMismatch);
  abort.value = static_cast<int32_t>(Status::kPeerLost);
  CHECK(abort_error(abort, 1).status() == Status::kPeerLost);
  CHECK(std::string(abort_error(abort, 1).what()) == "done");

  CHECK(built_result(Message{kBuilt, 0, {}}, 2).status() == Status::kSuccess);
  CHECK(built_result(Message{kBuilt, static_cast<int32_t>(Status::kTimeout), {}}, 2).status() ==
        Status::kTimeout);
  CHECK(built_result(Message{kBuilt, -5, {}}, 2).status() == Status::kMismatch);

  const kolo::ShrinkDecision decision{{0, 2, 3}, 77, "127.0.0.1:5"};
  const kolo::ShrinkDecision back = decode(encode(decision), 4, 0);
  CHECK(back.members == decision.members);
  CHECK(back.context == 77);
  CHECK(back.store == "127.0.0.1:5");
  CHECK_THROWS_AS(decode(encode(decision), 3, 0), Error);  // rank 3 is outside 3 ranks
  CHECK_THROWS_AS(decode(encode({{2, 1}, 1, ""}), 4, 0), Error);  // not increasing

  Header header;
  header.word = kBuilt + 1;
  CHECK_THROWS_AS(check_header(header, 1), Error);
  header.word = kAbort;
  header.bytes = kMaxPayloadBytes + 1;
  CHECK_THROWS_AS(check_header(header, 1), Error);
}
