// TCP transport.
//
// Connections: a full mesh. Every pair of ranks shares KOLO_TCP_STREAMS data sockets and one
// control socket; the lower rank connects, the higher one accepts, and every socket proves the job
// secret (net/auth.hpp) before it is used. Listening addresses travel through the rendezvous store.
// The listener is closed once the mesh is complete.
//
// Data sockets carry frames of a fixed header (magic, payload length, the OpDescriptor of the
// collective) followed by the payload. Between two ranks the k-th message goes on stream
// k mod KOLO_TCP_STREAMS on both sides, so each stream is a FIFO and matching needs no tags. A
// receiver reads a payload straight into the buffer of the matching posted receive; when nothing
// is posted yet it leaves the bytes in the kernel, which pushes back on the sender. No memory is
// allocated per message and no byte is copied in user space.
//
// The control socket carries small frames only: ABORT (a rank failed; every peer stops waiting
// and reports that rank's status and message) and GOODBYE (a rank destroys its communicator
// normally). It is always read, so a peer whose control socket closes without a goodbye was lost
// (killed, crashed) and every rank learns of it within one epoll wake-up.
//
// Progress is edge-triggered epoll over every socket: an event marks a socket readable or
// writable, and the socket is served until the kernel says EAGAIN or nothing is posted.
#include "transport/tcp/tcp_transport.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bootstrap/store.hpp"
#include "core/config.hpp"
#include "core/log.hpp"
#include "net/auth.hpp"
#include "net/socket.hpp"

namespace kolo {
namespace {

constexpr uint32_t kDataMagic = 0x444c4f4b;     // "KOLD"
constexpr uint32_t kControlMagic = 0x434c4f4b;  // "KOLC"
constexpr uint32_t kControlAbort = 1;
constexpr uint32_t kControlGoodbye = 2;
constexpr size_t kMaxControlText = 4096;
constexpr int kSocketBufferBytes = 4 << 20;

struct DataHeader {
  uint32_t magic = kDataMagic;
  uint32_t reserved = 0;
  uint64_t bytes = 0;
  OpDescriptor descriptor;
};
static_assert(sizeof(DataHeader) == 56);

struct ControlHeader {
  uint32_t magic = kControlMagic;
  uint32_t kind = 0;
  int32_t status = 0;
  int32_t origin = -1;  // ABORT: the rank that failed first
  uint32_t length = 0;
};

// A FIFO of posted transfers, linked through Transfer::next.
class TransferQueue {
 public:
  bool empty() const { return head_ == nullptr; }
  Transfer* front() const { return head_; }
  void push(Transfer* transfer) {
    transfer->next = nullptr;
    if (tail_) {
      tail_->next = transfer;
    } else {
      head_ = transfer;
    }
    tail_ = transfer;
  }
  void pop() {
    head_ = head_->next;
    if (!head_) tail_ = nullptr;
  }
  void clear() { head_ = tail_ = nullptr; }

 private:
  Transfer* head_ = nullptr;
  Transfer* tail_ = nullptr;
};

struct Connection {
  net::Socket socket;
  int peer = -1;
  bool control = false;
  bool readable = true;  // until the kernel says EAGAIN
  bool writable = true;
  bool closed = false;   // the peer closed its side (EOF seen)

  TransferQueue sends;
  DataHeader send_header;
  size_t send_header_done = 0;
  bool send_started = false;

  TransferQueue recvs;
  DataHeader recv_header;
  size_t recv_header_done = 0;
  bool recv_header_checked = false;

  ControlHeader control_header;
  size_t control_header_done = 0;
  std::array<char, kMaxControlText> control_text{};
  size_t control_text_done = 0;
};

struct Peer {
  std::vector<std::unique_ptr<Connection>> streams;
  std::unique_ptr<Connection> control;
  uint64_t messages_sent = 0;
  uint64_t messages_received = 0;
  bool said_goodbye = false;
};

// The local address this machine uses to reach `remote`: a connected UDP socket sends nothing but
// is given a source address by the kernel's routing table.
std::string route_source_address(const net::Endpoint& remote) {
  net::Socket probe(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(remote.port == 0 ? 9 : remote.port);
  if (!probe.valid() || ::inet_pton(AF_INET, remote.host.c_str(), &address.sin_addr) != 1 ||
      ::connect(probe.fd(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return "0.0.0.0";
  }
  sockaddr_in local{};
  socklen_t length = sizeof(local);
  if (::getsockname(probe.fd(), reinterpret_cast<sockaddr*>(&local), &length) != 0) {
    return "0.0.0.0";
  }
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
  return text;
}

class TcpTransport final : public Transport {
 public:
  TcpTransport(const Config& config, StoreClient& store, int rank, int size, uint64_t context)
      : rank_(rank), size_(size), streams_(config.tcp_streams), peers_(size) {
    epoll_ = net::Socket(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_.valid()) {
      throw Error(Status::kSystem, fmt::format("epoll_create1 failed: {}", std::strerror(errno)));
    }
    connect_mesh(config, store, context);
  }

  ~TcpTransport() override { say_goodbye(); }

  const char* name() const override { return "tcp"; }

  void post_send(Transfer& transfer) override {
    rethrow_failure();
    Peer& peer = peers_[transfer.peer];
    Connection& connection = *peer.streams[peer.messages_sent++ % streams_];
    connection.sends.push(&transfer);
    guarded([&] { serve_sends(connection); });
  }

  void post_recv(Transfer& transfer) override {
    rethrow_failure();
    Peer& peer = peers_[transfer.peer];
    Connection& connection = *peer.streams[peer.messages_received++ % streams_];
    connection.recvs.push(&transfer);
    guarded([&] { serve_recvs(connection); });
  }

  void progress(const Deadline& deadline) override {
    rethrow_failure();
    std::array<epoll_event, 64> events;
    int ready = ::epoll_wait(epoll_.fd(), events.data(), events.size(), deadline.remaining_ms());
    if (ready < 0) {
      if (errno == EINTR) return;
      fail(Error(Status::kSystem, fmt::format("epoll_wait failed: {}", std::strerror(errno))), true);
    }
    guarded([&] {
      for (int i = 0; i < ready; ++i) {
        auto* connection = static_cast<Connection*>(events[i].data.ptr);
        uint32_t flags = events[i].events;
        if (flags & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) connection->readable = true;
        if (flags & (EPOLLOUT | EPOLLHUP | EPOLLERR)) connection->writable = true;
        if (connection->control) {
          serve_control(*connection);
        } else {
          serve_sends(*connection);
          serve_recvs(*connection);
        }
      }
    });
  }

  void abort(const Error& error) noexcept override { fail(error, true); }

  const Error* failure() const override { return failure_ ? &*failure_ : nullptr; }

 private:
  // ---- set-up ---------------------------------------------------------------------------------

  void connect_mesh(const Config& config, StoreClient& store, uint64_t context) {
    Deadline deadline(config.timeout_s);
    std::string host = !config.socket_ifname.empty()
                           ? net::interface_address(config.socket_ifname)
                           : route_source_address(net::parse_endpoint(config.addr, "KOLO_ADDR"));
    net::Socket listener = net::listen_on({host, 0});
    net::Endpoint me = net::local_endpoint(listener);
    if (me.host == "0.0.0.0") me.host = "127.0.0.1";
    store.set_string(key(context, rank_), me.to_string());
    log::info("tcp: rank {} listens on {} with {} data stream(s) per peer", rank_, me.to_string(),
              streams_);

    for (auto& peer : peers_) {
      peer.streams.resize(streams_);
    }

    // Lower ranks connect to us while we connect to higher ranks.
    size_t expected = static_cast<size_t>(rank_) * (streams_ + 1);
    std::atomic<bool> stop{false};
    std::exception_ptr accept_error;
    std::vector<std::pair<net::Hello, net::Socket>> accepted;
    std::thread acceptor([&] {
      try {
        accept_connections(listener, config.secret, context, expected, deadline, stop, accepted);
      } catch (...) {
        accept_error = std::current_exception();
      }
    });
    std::exception_ptr connect_error;
    try {
      for (int peer = rank_ + 1; peer < size_; ++peer) {
        net::Endpoint endpoint = net::parse_endpoint(store.get_string(key(context, peer)),
                                                     "the address published by a peer");
        for (int stream = 0; stream <= streams_; ++stream) {
          bool control = stream == streams_;
          net::Socket socket = net::connect_to(endpoint, deadline);
          net::Hello hello{control ? net::kPurposeControl : net::kPurposeData, rank_,
                           static_cast<uint32_t>(stream), context};
          net::authenticate_as_client(socket, config.secret, hello, deadline);
          attach(peer, stream, control, std::move(socket));
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
      attach(hello.rank, static_cast<int>(hello.stream), hello.purpose == net::kPurposeControl,
             std::move(socket));
    }
  }

  static std::string key(uint64_t context, int rank) {
    return fmt::format("kolo/{:x}/tcp/{}", context, rank);
  }

  void accept_connections(const net::Socket& listener, const std::string& secret,
                          uint64_t context, size_t expected, const Deadline& deadline,
                          const std::atomic<bool>& stop,
                          std::vector<std::pair<net::Hello, net::Socket>>& accepted) {
    std::vector<bool> seen(static_cast<size_t>(rank_) * (streams_ + 1), false);
    while (accepted.size() < expected) {
      if (stop) return;
      if (deadline.expired()) {
        throw Error(Status::kTimeout,
                    fmt::format("rank {} timed out waiting for lower ranks to connect ({} of {} "
                                "connections arrived)",
                                rank_, accepted.size(), expected));
      }
      net::Socket socket;
      try {
        socket = net::accept_from(listener, Deadline(std::min(0.1, deadline.remaining_s())));
      } catch (const Error& error) {
        if (error.status() == Status::kTimeout) continue;
        throw;
      }
      std::string who = net::peer_endpoint(socket).to_string();
      try {
        // A stranger that never answers may delay the mesh by a few seconds, not stall it.
        net::Hello hello = net::authenticate_as_server(
            socket, secret, Deadline(std::min(5.0, std::max(0.0, deadline.remaining_s()))));
        bool control = hello.purpose == net::kPurposeControl;
        size_t slot = static_cast<size_t>(hello.rank) * (streams_ + 1) +
                      (control ? streams_ : hello.stream);
        bool valid = hello.context == context && hello.rank >= 0 && hello.rank < rank_ &&
                     (control || (hello.purpose == net::kPurposeData &&
                                  hello.stream < static_cast<uint32_t>(streams_)));
        if (!valid || seen[slot]) {
          log::warn("tcp: dropped a connection from {}: unexpected rank {} stream {} purpose {}",
                    who, hello.rank, hello.stream, hello.purpose);
          continue;
        }
        seen[slot] = true;
        accepted.emplace_back(hello, std::move(socket));
      } catch (const Error& error) {
        log::warn("tcp: dropped a connection from {}: {}", who, error.what());
      }
    }
  }

  void attach(int peer, int stream, bool control, net::Socket socket) {
    net::set_nodelay(socket);
    net::tune_for_bulk(socket, kSocketBufferBytes);
    net::set_nonblocking(socket, true);
    auto connection = std::make_unique<Connection>();
    connection->socket = std::move(socket);
    connection->peer = peer;
    connection->control = control;
    epoll_event event{};
    event.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    event.data.ptr = connection.get();
    if (::epoll_ctl(epoll_.fd(), EPOLL_CTL_ADD, connection->socket.fd(), &event) != 0) {
      throw Error(Status::kSystem, fmt::format("epoll_ctl failed: {}", std::strerror(errno)));
    }
    if (control) {
      peers_[peer].control = std::move(connection);
    } else {
      peers_[peer].streams[stream] = std::move(connection);
    }
  }

  // ---- data -----------------------------------------------------------------------------------

  void serve_sends(Connection& connection) {
    while (connection.writable && !connection.sends.empty()) {
      Transfer& transfer = *connection.sends.front();
      if (!connection.send_started) {
        connection.send_header.bytes = transfer.bytes;
        connection.send_header.descriptor = transfer.descriptor;
        connection.send_header_done = 0;
        connection.send_started = true;
      }
      iovec parts[2];
      int count = 0;
      if (connection.send_header_done < sizeof(DataHeader)) {
        parts[count++] = {reinterpret_cast<char*>(&connection.send_header) +
                              connection.send_header_done,
                          sizeof(DataHeader) - connection.send_header_done};
      }
      if (transfer.done < transfer.bytes) {
        parts[count++] = {static_cast<char*>(transfer.data) + transfer.done,
                          transfer.bytes - transfer.done};
      }
      msghdr message{};
      message.msg_iov = parts;
      message.msg_iovlen = count;
      ssize_t sent = count ? ::sendmsg(connection.socket.fd(), &message,
                                       MSG_NOSIGNAL | MSG_DONTWAIT)
                           : 0;
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          connection.writable = false;
          break;
        }
        data_lost(connection.peer, fmt::format("sending to it failed: {}", std::strerror(errno)));
      }
      size_t header_part = std::min<size_t>(sent, sizeof(DataHeader) - connection.send_header_done);
      connection.send_header_done += header_part;
      transfer.done += sent - header_part;
      if (connection.send_header_done == sizeof(DataHeader) && transfer.done == transfer.bytes) {
        connection.sends.pop();
        connection.send_started = false;
        transfer.complete = true;
      }
    }
  }

  void serve_recvs(Connection& connection) {
    if (connection.closed && !connection.recvs.empty()) {
      data_lost(connection.peer,
                 peers_[connection.peer].said_goodbye
                     ? "it destroyed its communicator while this rank still expected data"
                     : "its connection closed");
    }
    while (connection.readable && !connection.closed) {
      Transfer* transfer = connection.recvs.front();
      bool header_pending = connection.recv_header_done < sizeof(DataHeader);
      if (!header_pending && !transfer) break;  // the next message waits for its receive
      iovec parts[2];
      int count = 0;
      if (header_pending) {
        parts[count++] = {reinterpret_cast<char*>(&connection.recv_header) +
                              connection.recv_header_done,
                          sizeof(DataHeader) - connection.recv_header_done};
      }
      if (transfer && transfer->done < transfer->bytes) {
        parts[count++] = {static_cast<char*>(transfer->data) + transfer->done,
                          transfer->bytes - transfer->done};
      }
      ssize_t received = 0;
      if (count > 0) {
        received = ::readv(connection.socket.fd(), parts, count);
        if (received < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) {
            connection.readable = false;
            break;
          }
          data_lost(connection.peer, fmt::format("receiving failed: {}", std::strerror(errno)));
        }
        if (received == 0) {
          connection.closed = true;
          connection.readable = false;
          // Not an error yet: a peer that finished may close. It is one if we wait on it.
          if (transfer || connection.recv_header_done > 0) {
            data_lost(connection.peer,
                       peers_[connection.peer].said_goodbye
                           ? "it destroyed its communicator while this rank still expected data"
                           : "its connection closed in the middle of a message");
          }
          break;
        }
      }
      size_t header_part =
          header_pending ? std::min<size_t>(received, sizeof(DataHeader) - connection.recv_header_done)
                         : 0;
      connection.recv_header_done += header_part;
      if (transfer) transfer->done += received - header_part;
      if (connection.recv_header_done < sizeof(DataHeader) || !transfer) continue;
      if (!connection.recv_header_checked) {
        check_header(connection, *transfer);
        connection.recv_header_checked = true;
      }
      if (transfer->done == transfer->bytes) {
        connection.recvs.pop();
        connection.recv_header_done = 0;
        connection.recv_header_checked = false;
        transfer->complete = true;
      }
    }
  }

  void check_header(const Connection& connection, const Transfer& transfer) {
    const DataHeader& header = connection.recv_header;
    if (header.magic != kDataMagic) {
      log::warn("tcp: rank {} sent a malformed frame (magic {:#x}); dropping it", connection.peer,
                header.magic);
      throw Error(Status::kPeerLost,
                  fmt::format("rank {} sent a malformed frame (magic {:#x}) to rank {}; the "
                              "connection was dropped",
                              connection.peer, header.magic, rank_));
    }
    if (!(header.descriptor == transfer.descriptor)) {
      throw Error(Status::kMismatch,
                  fmt::format("ranks disagree: rank {} called {} but rank {} called {}", rank_,
                              describe(transfer.descriptor), connection.peer,
                              describe(header.descriptor)));
    }
    if (header.bytes != transfer.bytes) {
      throw Error(Status::kMismatch,
                  fmt::format("ranks disagree in {}: rank {} sent a message of {} bytes where rank "
                              "{} expected {} (is KOLO_SEGMENT_BYTES the same on every rank?)",
                              describe(transfer.descriptor), connection.peer, header.bytes, rank_,
                              transfer.bytes));
    }
  }

  // ---- control --------------------------------------------------------------------------------

  void serve_control(Connection& connection) {
    while (connection.readable && !connection.closed) {
      char* target;
      size_t wanted;
      if (connection.control_header_done < sizeof(ControlHeader)) {
        target = reinterpret_cast<char*>(&connection.control_header) +
                 connection.control_header_done;
        wanted = sizeof(ControlHeader) - connection.control_header_done;
      } else {
        target = connection.control_text.data() + connection.control_text_done;
        wanted = connection.control_header.length - connection.control_text_done;
      }
      ssize_t received = wanted ? ::recv(connection.socket.fd(), target, wanted, 0) : 0;
      if (received < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          connection.readable = false;
          break;
        }
        throw lost(connection.peer, fmt::format("its connection failed: {}", std::strerror(errno)));
      }
      if (wanted && received == 0) {
        connection.closed = true;
        if (!peers_[connection.peer].said_goodbye) {
          throw lost(connection.peer, "its connection closed without a goodbye (did it die?)");
        }
        return;
      }
      if (connection.control_header_done < sizeof(ControlHeader)) {
        connection.control_header_done += received;
        if (connection.control_header_done < sizeof(ControlHeader)) continue;
        const ControlHeader& header = connection.control_header;
        if (header.magic != kControlMagic || header.length > kMaxControlText) {
          log::warn("tcp: rank {} sent a malformed control frame; dropping the connection",
                    connection.peer);
          throw lost(connection.peer, "it sent a malformed control frame");
        }
      } else {
        connection.control_text_done += received;
      }
      if (connection.control_text_done < connection.control_header.length) continue;
      handle_control(connection);
      connection.control_header_done = 0;
      connection.control_text_done = 0;
    }
  }

  void handle_control(Connection& connection) {
    const ControlHeader& header = connection.control_header;
    if (header.kind == kControlGoodbye) {
      peers_[connection.peer].said_goodbye = true;
      return;
    }
    std::string text(connection.control_text.data(), header.length);
    Status status = static_cast<Status>(header.status);
    if (header.kind != kControlAbort || status == Status::kSuccess) {
      throw lost(connection.peer, "it sent an unknown control frame");
    }
    if (header.origin < 0 || header.origin >= size_) {
      throw lost(connection.peer, "it sent a malformed control frame");
    }
    remote_failure_ = true;
    remote_origin_ = header.origin;
    remote_text_ = text;
    throw Error(status, fmt::format("{} (reported by rank {})", text, header.origin));
  }

  // Writes one control frame, waiting at most a short while: used on failure and shutdown only.
  void send_control(Connection& connection, uint32_t kind, Status status, int origin,
                    const std::string& text) noexcept {
    if (connection.closed) return;
    ControlHeader header;
    header.kind = kind;
    header.status = static_cast<int32_t>(status);
    header.origin = origin;
    header.length = static_cast<uint32_t>(std::min(text.size(), kMaxControlText));
    std::string frame(reinterpret_cast<const char*>(&header), sizeof(header));
    frame.append(text, 0, header.length);
    try {
      net::send_all(connection.socket, frame.data(), frame.size(), Deadline(0.2));
    } catch (const Error&) {
      // The peer is gone or stuck; it will learn of the failure through its own timeout.
    }
  }

  void say_goodbye() noexcept {
    for (auto& peer : peers_) {
      if (peer.control) send_control(*peer.control, kControlGoodbye, Status::kSuccess, rank_, "");
    }
    for (auto& peer : peers_) {
      for (auto& stream : peer.streams) {
        if (stream) ::shutdown(stream->socket.fd(), SHUT_WR);
      }
      if (peer.control) ::shutdown(peer.control->socket.fd(), SHUT_WR);
    }
  }

  // ---- failures -------------------------------------------------------------------------------

  // A data connection failed. If a rank failed first and said why, its ABORT is on a control
  // connection, possibly still in flight, and the connection we lost may only be a consequence
  // (the peer gave up because of that abort): report the abort rather than the loss.
  [[noreturn]] void data_lost(int peer, const std::string& why) {
    if (Connection* control = peers_[peer].control.get(); control && !control->closed) {
      pollfd waiting{control->socket.fd(), POLLIN, 0};
      ::poll(&waiting, 1, 200);
    }
    for (auto& other : peers_) {
      if (!other.control || other.control->closed) continue;
      other.control->readable = true;
      try {
        serve_control(*other.control);
      } catch (const Error&) {
        if (remote_failure_) throw;  // an abort: the first cause
      }
    }
    throw lost(peer, why);
  }

  Error lost(int peer, const std::string& why) const {
    return Error(Status::kPeerLost, fmt::format("rank {} lost rank {}: {}", rank_, peer, why));
  }

  template <typename Function>
  void guarded(Function&& function) {
    try {
      function();
    } catch (const Error& error) {
      fail(error, true);
      throw;
    }
  }

  void fail(const Error& error, bool tell_peers) noexcept {
    if (failure_) return;
    failure_.emplace(error);
    for (auto& peer : peers_) {
      for (auto& stream : peer.streams) {
        if (!stream) continue;
        stream->sends.clear();
        stream->recvs.clear();
      }
    }
    if (!tell_peers) return;
    // A rank that learnt of the failure from another passes it on before it can close anything:
    // a peer that sees this rank's connections close then finds the first cause waiting.
    int origin = remote_failure_ ? remote_origin_ : rank_;
    const std::string& text = remote_failure_ ? remote_text_ : std::string(error.what());
    for (size_t peer = 0; peer < peers_.size(); ++peer) {
      if (peers_[peer].control && static_cast<int>(peer) != origin) {
        send_control(*peers_[peer].control, kControlAbort, error.status(), origin, text);
      }
    }
  }

  void rethrow_failure() const {
    if (failure_) throw *failure_;
  }

  int rank_;
  int size_;
  int streams_;
  net::Socket epoll_;
  std::vector<Peer> peers_;
  std::optional<Error> failure_;
  bool remote_failure_ = false;  // the failure came in an ABORT from remote_origin_
  int remote_origin_ = -1;
  std::string remote_text_;
};

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(const Config& config, StoreClient& store, int rank,
                                              int size, uint64_t context) {
  return std::make_unique<TcpTransport>(config, store, rank, size, context);
}

}  // namespace kolo
