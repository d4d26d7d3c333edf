#include "transport/mesh.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <exception>
#include <string>
#include <thread>
#include <utility>

#include "bootstrap/store.hpp"
#include "core/log.hpp"
#include "kolo/status.hpp"
#include "net/auth.hpp"
#include "transport/transport.hpp"

namespace kolo {
namespace {

// Connection `stream` of a peer: 0 .. data_streams-1 carry data, data_streams is the control one.
void place(PeerSockets& peer, int stream, int data_streams, net::Socket socket) {
  if (stream == data_streams) {
    peer.control = std::move(socket);
  } else {
    peer.data[stream] = std::move(socket);
  }
}

// A connection whose handshake is under way: the nonce went out, the answer is coming in.
struct Handshake {
  net::Socket socket;
  std::string who;
  net::AuthNonce nonce;
  uint8_t answer[net::kAuthAnswerBytes] = {};
  size_t received = 0;
  Deadline deadline;
};

// Handshakes in progress at once; past this, new connections are refused until some finish.
constexpr size_t kMaxHandshakes = 256;
// How long one connection may take to prove the secret.
constexpr double kHandshakeSeconds = 5.0;

// Accepts the connections of every lower rank: `rank` of them per data stream and control. Every
// handshake runs at once in one poll() loop, each with its own few seconds, so that connections
// that never answer (strangers, port scanners) delay nobody: a peer's handshake completes while
// theirs wait out their time.
void accept_connections(const net::Socket& listener, const std::string& secret, uint64_t context,
                        const char* name, int rank, int data_streams, const Deadline& deadline,
                        const std::atomic<bool>& stop,
                        std::vector<std::pair<net::Hello, net::Socket>>& accepted) {
  const size_t per_peer = static_cast<size_t>(data_streams) + 1;
  const size_t expected = static_cast<size_t>(rank) * per_peer;
  std::vector<bool> seen(expected, false);
  std::vector<Handshake> pending;
  auto drop = [&](const std::string& who, const std::string& why) {
    log::warn("{}: dropped a connection from {}: {}", name, who, why);
  };
  while (accepted.size() < expected) {
    if (stop) return;
    if (deadline.expired()) {
      throw Error(Status::kTimeout,
                  fmt::format("rank {} timed out waiting for lower ranks to connect ({} of {} "
                              "connections arrived)",
                              rank, accepted.size(), expected));
    }
    std::vector<pollfd> polled = {{listener.fd(), POLLIN, 0}};
    for (const Handshake& handshake : pending) polled.push_back({handshake.socket.fd(), POLLIN, 0});
    ::poll(polled.data(), polled.size(), std::min(100, deadline.remaining_ms()));

    if (polled[0].revents != 0) {
      net::Socket socket(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (socket.valid()) {
        Handshake handshake{
            std::move(socket),          "an unknown address", net::make_auth_nonce(), {}, 0,
            Deadline(kHandshakeSeconds)};
        try {
          // A connection reset while it waited in the queue has no peer address any more.
          handshake.who = net::peer_endpoint(handshake.socket).to_string();
        } catch (const Error& error) {
          drop(handshake.who, error.what());
          continue;
        }
        if (pending.size() >= kMaxHandshakes) {
          drop(handshake.who, fmt::format("{} handshakes are already under way", kMaxHandshakes));
          continue;
        }
        ssize_t sent = ::send(handshake.socket.fd(), handshake.nonce.data(), handshake.nonce.size(),
                              MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent != static_cast<ssize_t>(handshake.nonce.size())) {
          drop(handshake.who, "it could not take the challenge");
          continue;
        }
        pending.push_back(std::move(handshake));
      }
    }

    // Answers that arrived; handshakes that are complete, failed or out of time leave `pending`.
    for (size_t i = 0; i < pending.size();) {
      Handshake& handshake = pending[i];
      bool done = false;
      ssize_t count = ::recv(handshake.socket.fd(), handshake.answer + handshake.received,
                             sizeof handshake.answer - handshake.received, MSG_DONTWAIT);
      if (count > 0) handshake.received += static_cast<size_t>(count);
      if (count == 0 || (count < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        drop(handshake.who, "it closed the connection before proving the job secret");
        done = true;
      } else if (handshake.received == sizeof handshake.answer) {
        done = true;
        try {
          net::Hello hello =
              net::check_auth_answer(secret, handshake.nonce, handshake.answer, handshake.who);
          bool control = hello.purpose == net::kPurposeControl;
          bool valid = hello.context == context && hello.rank >= 0 && hello.rank < rank &&
                       (control || (hello.purpose == net::kPurposeData &&
                                    hello.stream < static_cast<uint32_t>(data_streams)));
          size_t slot = valid ? static_cast<size_t>(hello.rank) * per_peer +
                                    (control ? data_streams : hello.stream)
                              : 0;
          if (!valid || seen[slot]) {
            drop(handshake.who, fmt::format("unexpected rank {} stream {} purpose {}", hello.rank,
                                            hello.stream, hello.purpose));
          } else if (const net::AuthProof proof =
                         net::acceptor_proof(secret, handshake.nonce, handshake.answer);
                     ::send(handshake.socket.fd(), proof.data(), proof.size(),
                            MSG_DONTWAIT | MSG_NOSIGNAL) != static_cast<ssize_t>(proof.size())) {
            drop(handshake.who, "it could not take this rank's proof of the secret");
          } else {
            seen[slot] = true;
            net::set_nonblocking(handshake.socket, false);
            accepted.emplace_back(hello, std::move(handshake.socket));
          }
        } catch (const Error& error) {
          drop(handshake.who, error.what());
        }
      } else if (handshake.deadline.expired()) {
        drop(handshake.who,
             fmt::format("it did not prove the job secret within {} s", kHandshakeSeconds));
        done = true;
      }
      if (done) {
        pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
}

// The address this rank listens on and publishes: the one its host sends from to reach rank 0's
// store. A rank that reaches the store over loopback shares rank 0's host, and a host name in
// KOLO_ADDR may resolve to loopback there (Debian maps its own name to 127.0.1.1) while other
// hosts reach it over the network: such a rank takes the interface that routes to the first rank
// that published a network address, so that no peer on another host is handed a loopback address.
std::string listen_address(const TransportSettings& settings, StoreClient& store, int rank,
                           int size, uint64_t context, const char* name) {
  std::string own =
      net::route_source_address(net::parse_endpoint(settings.addr, "KOLO_ADDR"), "KOLO_ADDR");
  std::string route_name = fmt::format("{}-route", name);
  store.set_string(store_key(context, route_name, rank), own);
  if (!net::is_loopback_address(own)) return own;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    std::string theirs = store.get_string(store_key(context, route_name, peer));
    if (!net::is_loopback_address(theirs)) {
      return net::route_source_address({theirs, 0}, fmt::format("the address of rank {}", peer));
    }
  }
  return own;
}

}  // namespace

std::string mesh_listen_host(const TransportSettings& settings, StoreClient& store, int rank,
                             int size, uint64_t context, const char* name) {
  return !settings.socket_ifname.empty()
             ? net::interface_address(settings.socket_ifname)
             : listen_address(settings, store, rank, size, context, name);
}

std::vector<PeerSockets> connect_mesh(const TransportSettings& settings, StoreClient& store,
                                      int rank, int size, uint64_t context, const char* name,
                                      int data_streams) {
  Deadline deadline(settings.timeout_s);
  std::string host = mesh_listen_host(settings, store, rank, size, context, name);
  net::Socket listener = net::listen_on({host, 0});
  net::Endpoint me = net::local_endpoint(listener);
  store.set_string(store_key(context, name, rank), me.to_string());
  if (data_streams > 0) {
    log::info("{}: rank {} listens on {} with {} data stream(s) per peer", name, rank,
              me.to_string(), data_streams);
  } else {
    log::info("{}: rank {} listens on {} for control connections", name, rank, me.to_string());
  }

  std::vector<PeerSockets> peers(size);
  for (auto& peer : peers) peer.data.resize(data_streams);

  // Lower ranks connect to us while we connect to higher ranks.
  std::atomic<bool> stop{false};
  std::exception_ptr accept_error;
  std::vector<std::pair<net::Hello, net::Socket>> accepted;
  std::thread acceptor([&] {
    try {
      accept_connections(listener, settings.secret, context, name, rank, data_streams, deadline,
                         stop, accepted);
    } catch (...) {
      accept_error = std::current_exception();
    }
  });
  std::exception_ptr connect_error;
  try {
    for (int peer = rank + 1; peer < size; ++peer) {
      net::Endpoint endpoint = net::parse_endpoint(store.get_string(store_key(context, name, peer)),
                                                   "the address published by a peer");
      for (int stream = 0; stream <= data_streams; ++stream) {
        bool control = stream == data_streams;
        net::Socket socket = net::connect_to(endpoint, deadline);
        net::Hello hello{control ? net::kPurposeControl : net::kPurposeData, rank,
                         static_cast<uint32_t>(stream), context};
        net::authenticate_as_client(socket, settings.secret, hello, deadline);
        place(peers[peer], stream, data_streams, std::move(socket));
      }
    }
  } catch (...) {
    connect_error = std::current_exception();
    stop = true;
  }
  acceptor.join();
  if (connect_error) std::rethrow_exception(connect_error);
  if (accept_error) std::rethrow_exception(accept_error);
  for (auto& [hello, socket] : accepted) {
    int stream =
        hello.purpose == net::kPurposeControl ? data_streams : static_cast<int>(hello.stream);
    place(peers[hello.rank], stream, data_streams, std::move(socket));
  }
  return peers;
}

}  // namespace kolo
