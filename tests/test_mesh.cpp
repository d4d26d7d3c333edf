// Transport set-up and control, without a job: the connection mesh (transport/mesh.hpp) between
// two ranks run as threads of this process, with a real rendezvous store (strangers that connect
// and never answer must not delay it), the control channel over a loopback pair, and how long a
// wait spins before it yields.
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/store.hpp"
#include "comm/connect.hpp"
#include "core/config.hpp"
#include "core/topology.hpp"
#include "kolo/status.hpp"
#include "net/socket.hpp"
#include "tools/free_port.hpp"
#include "transport/control_channel.hpp"
#include "transport/mesh.hpp"
#include "transport/shm/waiting.hpp"
#include "transport/transport.hpp"

using kolo::Deadline;
using kolo::PeerSockets;
using kolo::StoreClient;
using kolo::StoreServer;
namespace net = kolo::net;

namespace {

const char* kSecret = "mesh-test-secret";
constexpr uint64_t kContext = 0x5eed;

std::vector<PeerSockets> join(const net::Endpoint& store, int rank, int streams) {
  kolo::TransportSettings settings;
  settings.addr = store.to_string();
  settings.secret = kSecret;
  settings.timeout_s = 30;
  settings.socket_ifname = "=lo";
  StoreClient client(store, kSecret, rank, settings.timeout_s);
  return kolo::connect_mesh(settings, client, rank, 2, kContext, "tcp", streams);
}

}  // namespace

// Every bounded wait counts on Deadline, which reads the kernel's coarse clock (a tick of 1-10 ms)
// to keep clock reads off each collective's path: it must still end each wait on time, and a
// caller that polls until it expires must sleep through the last tick, not spin through it.
TEST_CASE("a deadline ends a wait on time, sleeping to the end", "[deadline]") {
  CHECK(Deadline(0).expired());
  CHECK(Deadline(0).remaining_ms() == 0);
  CHECK(Deadline(-1).remaining_ms() == 0);
  // Until it expires, a deadline never says 0 ms are left: watched without a pause through its
  // last tick, where less than a millisecond is left (not a whole number of milliseconds).
  const Deadline short_one(0.0505);
  long looks = 0;
  while (!short_one.expired()) {
    // 0 only when the clock has passed the end since expired() looked
    if (short_one.remaining_ms() == 0) REQUIRE(short_one.expired());
    ++looks;
  }
  CHECK(looks > 0);
  // A caller that sleeps for what is left ends on time, in a few sleeps.
  const auto start = std::chrono::steady_clock::now();
  const Deadline deadline(0.2005);
  CHECK_FALSE(deadline.expired());
  CHECK(deadline.remaining_ms() > 150);
  CHECK(deadline.remaining_ms() <= 201);
  int polls = 0;
  while (!deadline.expired()) {
    ::poll(nullptr, 0, deadline.remaining_ms());
    ++polls;
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(took >= 0.2 - 0.011);  // at most one tick early (the clock lags by less than a tick)
  CHECK(took < 1.0);
  CHECK(polls < 30);  // one sleep, and a few of a millisecond in the last tick
}

// The address `rank` published for its mesh, once it has.
net::Endpoint published_address(const net::Endpoint& store, int rank) {
  StoreClient observer(store, kSecret, 0, 30);
  return net::parse_endpoint(observer.get_string(kolo::store_key(kContext, "tcp", rank)),
                             "a rank's address");
}

TEST_CASE("silent strangers at a rank's listener do not delay the mesh", "[mesh]") {
  StoreServer server({"127.0.0.1", 0}, kSecret);
  net::Endpoint store = server.endpoint();
  const int streams = 2;
  // Rank 1 accepts rank 0's connections; it publishes its address first.
  auto rank1 = std::async(std::launch::async, [&] { return join(store, 1, streams); });
  net::Endpoint listener = published_address(store, 1);

  // Strangers connect before rank 0 does, and never say a word.
  std::vector<net::Socket> strangers;
  for (int i = 0; i < 20; ++i) strangers.push_back(net::connect_to(listener, Deadline(5)));

  auto start = std::chrono::steady_clock::now();
  std::vector<PeerSockets> rank0 = join(store, 0, streams);
  std::vector<PeerSockets> peers1 = rank1.get();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO("the mesh took " << seconds << " s with 20 silent strangers connected first");
  CHECK(seconds < 3.0);  // one at a time, each stranger would cost 5 s
  REQUIRE(peers1[0].data.size() == streams);
  for (const auto& socket : peers1[0].data) CHECK(socket.valid());
  CHECK(peers1[0].control.valid());
  CHECK(rank0[1].control.valid());

  // The sockets work: a byte from rank 0's control connection arrives on rank 1's.
  uint8_t sent = 0x5a, received = 0;
  net::send_all(rank0[1].control, &sent, 1, Deadline(5));
  net::recv_all(peers1[0].control, &received, 1, Deadline(5));
  CHECK(received == sent);
}

TEST_CASE("a connection reset before it is accepted is dropped, not fatal", "[mesh]") {
  StoreServer server({"127.0.0.1", 0}, kSecret);
  net::Endpoint store = server.endpoint();
  auto rank1 = std::async(std::launch::async, [&] { return join(store, 1, 1); });
  StoreClient observer(store, kSecret, 0, 30);
  net::Endpoint listener = net::parse_endpoint(
      observer.get_string(kolo::store_key(kContext, "tcp", 1)), "rank 1's address");
  for (int i = 0; i < 5; ++i) {
    net::Socket reset = net::connect_to(listener, Deadline(5));
    linger abort_on_close{1, 0};  // close() sends RST
    ::setsockopt(reset.fd(), SOL_SOCKET, SO_LINGER, &abort_on_close, sizeof abort_on_close);
  }
  std::vector<PeerSockets> rank0 = join(store, 0, 1);
  std::vector<PeerSockets> peers1 = rank1.get();
  CHECK(peers1[0].control.valid());
  CHECK(rank0[1].control.valid());
}

TEST_CASE("control frames cut short by a full socket arrive whole and in order", "[control]") {
  net::Socket listener = net::listen_on({"127.0.0.1", 0});
  net::Socket connecting = net::connect_to(net::local_endpoint(listener), Deadline(5));
  net::Socket accepted = net::accept_from(listener, Deadline(5));
  int small = 4096;
  ::setsockopt(connecting.fd(), SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
  ::setsockopt(accepted.fd(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  kolo::ControlChannel sender(0, 2), receiver(1, 2);
  sender.attach(1, std::move(connecting));
  receiver.attach(0, std::move(accepted));

  // Doorbells until the sockets are full: one then waits out its 0.2 s and is cut short.
  for (int rung = 0; rung < 100000; ++rung) {
    auto start = std::chrono::steady_clock::now();
    sender.ring_doorbell(1);
    if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(150)) break;
  }
  const std::string cause = "rank 0 failed: " + std::string(1000, 'x');
  sender.tell_peers(kolo::Error(kolo::Status::kMismatch, cause));

  // The receiver drains, the sender finishes what it still has: the ABORT must come out intact.
  std::string seen;
  for (int round = 0; round < 2000 && seen.empty(); ++round) {
    try {
      receiver.serve();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // window updates
      sender.serve();
    } catch (const kolo::Error& error) {
      CHECK(error.status() == kolo::Status::kMismatch);
      seen = error.what();
    }
  }
  CHECK(seen.find(cause) != std::string::npos);
  CHECK(seen.find("malformed") == std::string::npos);
}

namespace {

// Progresses until the transfer completes; the transport's error, if one comes first.
std::string finish(kolo::Transport& transport, const kolo::Transfer& transfer) {
  const Deadline deadline(10);
  try {
    while (!transfer.complete && !deadline.expired()) transport.progress(Deadline(0.1));
  } catch (const kolo::Error& error) {
    return error.what();
  }
  return transfer.complete ? "" : "not complete within 10 s";
}

}  // namespace

// Two ranks that leave at the same moment each find the other gone: that is their failure alone,
// and a third rank still finishing a collective must not be aborted by it. A caller that then
// abandons a collective (abort) still tells every peer.
TEST_CASE("a transfer to a rank that said goodbye fails this rank only, until it aborts",
          "[control]") {
  // Which of the two ends each run takes: "leaves" (rank 0 is destroyed) or "aborts".
  for (const std::string end : {"leaves", "aborts"}) {
    std::vector<std::string> names;
    for (const auto& entry : kolo::transport_registry()) {
      if (entry.connect && std::string(entry.name) != "auto") names.push_back(entry.name);
    }
    REQUIRE(std::find(names.begin(), names.end(), "tcp") != names.end());
    for (const std::string& name : names) {
      DYNAMIC_SECTION(name << ", then rank 0 " << end) {
        StoreServer server({"127.0.0.1", 0}, kSecret);
        kolo::TransportSettings settings;
        settings.transport = name;
        settings.addr = server.endpoint().to_string();
        settings.secret = kSecret;
        settings.timeout_s = 30;
        settings.socket_ifname = "=lo";
        settings.shm = std::string("0");  // the network path; the rings follow the same rule
        const int size = 3;
        std::vector<std::unique_ptr<kolo::Transport>> transports(size);
        {
          std::vector<std::thread> threads;
          for (int rank = 0; rank < size; ++rank) {
            threads.emplace_back([&, rank] {
              StoreClient client(server.endpoint(), kSecret, rank, settings.timeout_s);
              transports[rank] = kolo::make_transport(settings, client, rank, size, kContext);
            });
          }
          for (auto& thread : threads) thread.join();
        }
        for (const auto& transport : transports) REQUIRE(transport);
        kolo::OpDescriptor op;
        op.collective = kolo::Collective::kSendRecv;
        op.root = 1;
        op.count = 64;

        // Ranks 0 and 1 send rank 2 a message each; rank 1 leaves (a GOODBYE).
        std::vector<int> sent(64), received(64, -1), early(64), early_received(64, -1);
        for (size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<int>(i * 7 + 1);
        for (size_t i = 0; i < early.size(); ++i) early[i] = static_cast<int>(i * 5 + 3);
        kolo::Transfer to_two, early_to_two, from_one, from_gone, from_zero, early_from_zero;
        early_to_two.reset(2, op, early.data(), early.size() * sizeof(int));
        transports[0]->post_send(early_to_two);
        REQUIRE(finish(*transports[0], early_to_two).empty());
        to_two.reset(2, op, sent.data(), sent.size() * sizeof(int));
        transports[1]->post_send(to_two);
        REQUIRE(finish(*transports[1], to_two).empty());
        transports[1].reset();

        // Rank 0 still expects a message from rank 1: its own failure, naming rank 1.
        std::vector<int> lost(64);
        from_gone.reset(1, op, lost.data(), lost.size() * sizeof(int));
        std::string zero_error;
        try {
          transports[0]->post_recv(from_gone);
          zero_error = finish(*transports[0], from_gone);
        } catch (const kolo::Error& error) {
          zero_error = error.what();
        }
        INFO(zero_error);
        CHECK(zero_error.find("rank 0 lost rank 1") != std::string::npos);
        REQUIRE(transports[0]->failure() != nullptr);

        // Rank 2 is not told: it reads its control connections for a while (an ABORT from rank 0
        // went out before rank 0's failure returned) and the message rank 1 sent arrives whole.
        std::string two_quiet;
        try {
          const Deadline quiet(0.3);
          while (!quiet.expired()) transports[2]->progress(quiet);
        } catch (const kolo::Error& error) {
          two_quiet = error.what();
        }
        CHECK(two_quiet.empty());
        from_one.reset(1, op, received.data(), received.size() * sizeof(int));
        transports[2]->post_recv(from_one);
        CHECK(finish(*transports[2], from_one).empty());
        CHECK(received == sent);
        CHECK(transports[2]->failure() == nullptr);

        if (end == "leaves") {
          // Nobody was told, so what rank 0 sent must reach rank 2 (flushed), and rank 0 leaves
          // at once: it does not wait for every peer to close (2 s at most), as a rank whose
          // peers were told does.
          const auto start = std::chrono::steady_clock::now();
          transports[0].reset();
          CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(1500));
          early_from_zero.reset(0, op, early_received.data(), early_received.size() * sizeof(int));
          transports[2]->post_recv(early_from_zero);
          CHECK(finish(*transports[2], early_from_zero).empty());
          CHECK(early_received == early);
          continue;
        }

        // Rank 0 abandons a collective: now rank 2 hears of it, with rank 0's first error (after
        // the message rank 0 sent before it failed).
        transports[0]->abort(kolo::Error(kolo::Status::kPeerLost, "a later consequence"));
        early_from_zero.reset(0, op, early_received.data(), early_received.size() * sizeof(int));
        transports[2]->post_recv(early_from_zero);
        CHECK(finish(*transports[2], early_from_zero).empty());
        CHECK(early_received == early);
        std::vector<int> never(64);
        from_zero.reset(0, op, never.data(), never.size() * sizeof(int));
        transports[2]->post_recv(from_zero);
        const std::string two_error = finish(*transports[2], from_zero);
        INFO(two_error);
        CHECK(two_error.find("rank 0 lost rank 1") != std::string::npos);
        CHECK(two_error.find("(reported by rank 0)") != std::string::npos);
        CHECK(two_error.find("a later consequence") == std::string::npos);
      }
    }
  }
}

// The store's port for kolorun and the tests' jobs: free, and below the ephemeral range, where
// neither an outgoing connection nor a listener bound to port 0 can take it first.
TEST_CASE("a job's store port is picked below the ephemeral range", "[mesh]") {
  int ephemeral_low = 0;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  REQUIRE(ephemeral_low > 11000);
  std::set<int> seen;
  for (int pick = 0; pick < 20; ++pick) {
    int port = kolo::tools::pick_free_local_port();
    CHECK(port >= 10000);
    CHECK(port < ephemeral_low);
    CHECK(kolo::tools::bind_local_port(port) == port);  // still free
    seen.insert(port);
  }
  CHECK(seen.size() > 10);  // at random, not the same port for jobs started together
}

// How long a wait spins before it yields (transport/shm/waiting.hpp): never while the host runs
// more ranks than this process may use CPUs, unless kolo bound each rank to a core of its own;
// never on the fusion engine's connections, whose thread shares its CPU with the application's.
TEST_CASE("a wait spins only on a CPU that no other thread of the job needs", "[spin]") {
  cpu_set_t cpus;
  REQUIRE(::sched_getaffinity(0, sizeof(cpus), &cpus) == 0);
  const int usable = CPU_COUNT(&cpus);
  const auto none = std::chrono::steady_clock::duration::zero();
  kolo::TransportSettings settings;
  settings.local_size = 1;
  CHECK(kolo::pure_spin_for(settings) == kolo::kPureSpin);
  settings.local_size = usable + 1;  // more ranks than this process's CPUs
  CHECK(kolo::pure_spin_for(settings) == none);
  settings.own_core = true;  // bound one to a core, as KOLO_BIND=core does
  CHECK(kolo::pure_spin_for(settings) == kolo::kPureSpin);
  settings.local_size = 1;
  settings.yield_at_once = true;  // the fusion engine's connections
  CHECK(kolo::pure_spin_for(settings) == none);

  // Whether a rank has a core of its own follows from KOLO_BIND and the ranks on this host.
  kolo::Config config;
  config.local_size = 1;
  CHECK_FALSE(kolo::transport_settings(config).own_core);  // KOLO_BIND=none
  config.bind = "numa";
  CHECK_FALSE(kolo::transport_settings(config).own_core);
  config.bind = "core";
  CHECK(kolo::transport_settings(config).own_core);
  config.local_size = kolo::local_topology().cores + 1;  // some ranks share a core
  CHECK_FALSE(kolo::transport_settings(config).own_core);
  CHECK_FALSE(kolo::transport_settings(config).yield_at_once);  // set by connect_links alone
}

// A wait whose yield ran another task (the peer it waits for, started on the same CPU, or any
// other program) polls without yielding no more: the next waits yield from the start, until a
// wait's yields all come straight back (transport/shm/waiting.hpp, Spinner).
TEST_CASE("a wait that finds its CPU shared yields at once until the CPU is its own again",
          "[spin]") {
  using std::chrono::microseconds;
  const auto none = std::chrono::steady_clock::duration::zero();
  kolo::TransportSettings settings;
  settings.local_size = 1;
  kolo::Spinner spinner(settings);
  spinner.begin();
  CHECK(spinner.pure_spin() == kolo::kPureSpin);
  spinner.begin();  // a wait that ended without yielding changes nothing
  CHECK(spinner.pure_spin() == kolo::kPureSpin);
  spinner.yielded(microseconds(1));
  spinner.yielded(microseconds(1));
  spinner.begin();  // every yield came straight back: nobody else wants this CPU
  CHECK(spinner.pure_spin() == kolo::kPureSpin);
  spinner.yielded(microseconds(1));
  spinner.yielded(microseconds(40));  // one ran another task first
  spinner.begin();
  CHECK(spinner.pure_spin() == none);
  spinner.begin();  // a wait that needed no yield says nothing about the CPU
  CHECK(spinner.pure_spin() == none);
  spinner.yielded(microseconds(1));
  spinner.begin();
  CHECK(spinner.pure_spin() == kolo::kPureSpin);

  // The settings' ceiling stays: the fusion engine's waits never spin without yielding.
  settings.yield_at_once = true;
  kolo::Spinner engine(settings);
  engine.yielded(microseconds(1));
  engine.begin();
  CHECK(engine.pure_spin() == none);

  // A real yield with another thread runnable on the same CPU runs it, and is seen to.
  cpu_set_t saved, one;
  REQUIRE(::sched_getaffinity(0, sizeof(saved), &saved) == 0);
  CPU_ZERO(&one);
  CPU_SET(::sched_getcpu(), &one);
  REQUIRE(::sched_setaffinity(0, sizeof(one), &one) == 0);  // this thread only
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    ::sched_setaffinity(0, sizeof(one), &one);
    while (!stop.load()) {
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // running, and on this CPU
  kolo::Spinner shared(kolo::TransportSettings{});
  shared.begin();
  for (int i = 0; i < 20; ++i) shared.yield();
  shared.begin();
  stop = true;
  busy.join();
  REQUIRE(::sched_setaffinity(0, sizeof(saved), &saved) == 0);
  CHECK(shared.pure_spin() == none);
}

// Spinner::next: a wait's spin lasts kSpin from its first empty poll, a poll that copied starts
// it again, and an expired deadline's wait (begin(false)) polls once.
TEST_CASE("a spin lasts kSpin from its last copy, and one poll for a caller that sleeps itself",
          "[spin]") {
  using Clock = std::chrono::steady_clock;
  kolo::TransportSettings settings;
  settings.local_size = 1;
  kolo::Spinner spinner(settings);
  // Polls until the spin ends, copying until `copy_for` has passed: how long it spun, how many
  // polls, and when the last copy was.
  auto spin_for = [&](Clock::duration copy_for) {
    spinner.begin();
    const auto start = Clock::now();
    long polls = 0;
    Clock::duration last_copy{};
    for (;;) {
      const auto now = Clock::now() - start;
      const bool copied = now < copy_for;
      if (copied) last_copy = now;
      if (!spinner.next(copied)) break;
      ++polls;
    }
    return std::tuple{Clock::now() - start, polls, last_copy};
  };
  const auto [plain, polls, no_copy] = spin_for(Clock::duration::zero());
  CHECK(plain >= kolo::kSpin);
  CHECK(plain < kolo::kSpin + std::chrono::milliseconds(20));  // ends (generous: a busy machine)
  CHECK(polls > 1);
  const auto [copied, copied_polls, last_copy] = spin_for(kolo::kSpin / 2);
  CHECK(last_copy > kolo::kSpin / 4);
  CHECK(copied >= last_copy + kolo::kSpin);  // the last copy started it again
  spinner.begin(false);
  CHECK_FALSE(spinner.next(false));  // one poll, no spin
  spinner.begin(false);
  CHECK_FALSE(spinner.next(true));
}

TEST_CASE("a crowd of strangers at a rank's listener refuses no peer", "[mesh]") {
  StoreServer server({"127.0.0.1", 0}, kSecret);
  net::Endpoint store = server.endpoint();
  const int streams = 2;
  // Rank 1 accepts rank 0's connections; it publishes its address first.
  auto rank1 = std::async(std::launch::async, [&] { return join(store, 1, streams); });
  net::Endpoint listener = published_address(store, 1);

  // More silent connections than handshakes may be under way and than the listen backlog holds,
  // and some that answer the challenge with garbage: a peer's connections must still get in.
  std::vector<net::Socket> strangers;
  for (int i = 0; i < 320; ++i) {
    strangers.push_back(net::connect_to(listener, Deadline(5)));
    if (i % 16 == 0) {
      uint8_t nonce[32];
      net::recv_all(strangers.back(), nonce, sizeof nonce, Deadline(5));
      std::vector<uint8_t> garbage(96, 0x5a);
      net::send_all(strangers.back(), garbage.data(), garbage.size(), Deadline(5));
    }
  }
  std::vector<PeerSockets> rank0 = join(store, 0, streams);
  std::vector<PeerSockets> peers1 = rank1.get();
  CHECK(peers1[0].control.valid());
  REQUIRE(rank0[1].control.valid());
  uint8_t sent = 0x3c, received = 0;
  net::send_all(rank0[1].control, &sent, 1, Deadline(5));
  net::recv_all(peers1[0].control, &received, 1, Deadline(5));
  CHECK(received == sent);
}
