// TCP transport.
//
// Connections: a full mesh (transport/mesh.hpp). Every pair of ranks shares KOLO_TCP_STREAMS data
// sockets and one control socket; the lower rank connects, the higher one accepts, and every
// socket proves the job secret (net/auth.hpp) before it is used. Listening addresses travel
// through the rendezvous store. The listener is closed once the mesh is complete.
//
// Data sockets carry frames (transport/framing.hpp: a 64-byte header with the payload length and
// the OpDescriptor of the collective, then the payload). Between two ranks the k-th message goes on
// stream k mod KOLO_TCP_STREAMS on both sides, so each stream is a FIFO and matching needs no tags.
// A receiver reads a payload straight into the buffer of the matching posted receive; when nothing
// is posted yet it leaves the bytes in the kernel, which pushes back on the sender. No memory is
// allocated per message and no byte is copied in user space.
//
// The control socket carries small frames only (transport/control_channel.hpp, shared with the UCX
// transport): ABORT (a rank failed; every peer stops waiting and reports that rank's status and
// message) and GOODBYE (a rank destroys its communicator normally). It is always read, so a peer
// whose control socket closes without a goodbye was lost (killed, crashed) and every rank learns
// of it within one epoll wake-up.
//
// Progress is edge-triggered epoll over every socket: an event marks a socket readable or
// writable, and the socket is served until the kernel says EAGAIN or nothing is posted.
#include "transport/tcp/tcp_transport.hpp"

#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <vector>

#include "core/log.hpp"
#include "net/socket.hpp"
#include "transport/control_channel.hpp"
#include "transport/framing.hpp"
#include "transport/mesh.hpp"

namespace kolo {
namespace {

constexpr int kSocketBufferBytes = 4 << 20;

struct Connection {
  net::Socket socket;
  int peer = -1;
  bool readable = true;  // until the kernel says EAGAIN
  bool writable = true;
  bool closed = false;  // the peer closed its side (EOF seen)

  IntrusiveFifo<Transfer> sends;
  FrameHeader send_header;
  size_t send_header_done = 0;
  bool send_started = false;

  IntrusiveFifo<Transfer> recvs;
  FrameHeader recv_header;
  size_t recv_header_done = 0;
  bool recv_header_checked = false;
};

struct Peer {
  std::vector<std::unique_ptr<Connection>> streams;
  uint64_t messages_sent = 0;
  uint64_t messages_received = 0;
};

class TcpTransport final : public Transport {
 public:
  TcpTransport(const TransportSettings& settings, StoreClient& store, int rank, int size,
               uint64_t context)
      : rank_(rank), streams_(settings.tcp_streams), peers_(size), control_(rank, size) {
    epoll_ = net::Socket(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_.valid()) {
      throw Error(Status::kSystem, fmt::format("epoll_create1 failed: {}", std::strerror(errno)));
    }
    std::vector<PeerSockets> sockets =
        connect_mesh(settings, store, rank, size, context, "tcp", streams_);
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      peers_[peer].streams.resize(streams_);
      for (int stream = 0; stream < streams_; ++stream) {
        attach(peer, stream, std::move(sockets[peer].data[stream]));
      }
      control_.attach(peer, std::move(sockets[peer].control));
    }
    // The control channel is one more source of events; its entry has no connection.
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.ptr = nullptr;
    if (::epoll_ctl(epoll_.fd(), EPOLL_CTL_ADD, control_.fd(), &event) != 0) {
      throw Error(Status::kSystem, fmt::format("epoll_ctl failed: {}", std::strerror(errno)));
    }
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
      fail(Error(Status::kSystem, fmt::format("epoll_wait failed: {}", std::strerror(errno))),
           true);
    }
    guarded([&] {
      for (int i = 0; i < ready; ++i) {
        auto* connection = static_cast<Connection*>(events[i].data.ptr);
        if (!connection) {
          control_.serve();
          continue;
        }
        uint32_t flags = events[i].events;
        if (flags & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) connection->readable = true;
        if (flags & (EPOLLOUT | EPOLLHUP | EPOLLERR)) connection->writable = true;
        serve_sends(*connection);
        serve_recvs(*connection);
      }
    });
  }

  void abort(const Error& error) noexcept override { fail(error, true); }

  const Error* failure() const override { return failure_ ? &*failure_ : nullptr; }

  // The epoll set: readable while some socket (data or control) has an event to collect.
  int readiness_fd() const override { return epoll_.fd(); }

 private:
  // ---- set-up ---------------------------------------------------------------------------------

  void attach(int peer, int stream, net::Socket socket) {
    net::set_nodelay(socket);
    net::tune_for_bulk(socket, kSocketBufferBytes);
    net::set_nonblocking(socket, true);
    auto connection = std::make_unique<Connection>();
    connection->socket = std::move(socket);
    connection->peer = peer;
    epoll_event event{};
    event.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    event.data.ptr = connection.get();
    if (::epoll_ctl(epoll_.fd(), EPOLL_CTL_ADD, connection->socket.fd(), &event) != 0) {
      throw Error(Status::kSystem, fmt::format("epoll_ctl failed: {}", std::strerror(errno)));
    }
    peers_[peer].streams[stream] = std::move(connection);
  }

  // ---- data -----------------------------------------------------------------------------------

  void serve_sends(Connection& connection) {
    while (connection.writable && !connection.sends.empty()) {
      Transfer& transfer = *connection.sends.front();
      if (!connection.send_started) {
        connection.send_header = FrameHeader::for_transfer(transfer);
        connection.send_header_done = 0;
        connection.send_started = true;
      }
      iovec parts[2];
      int count = 0;
      if (connection.send_header_done < sizeof(FrameHeader)) {
        parts[count++] = {
            reinterpret_cast<char*>(&connection.send_header) + connection.send_header_done,
            sizeof(FrameHeader) - connection.send_header_done};
      }
      if (transfer.done < transfer.bytes) {
        parts[count++] = {static_cast<char*>(transfer.data) + transfer.done,
                          transfer.bytes - transfer.done};
      }
      msghdr message{};
      message.msg_iov = parts;
      message.msg_iovlen = count;
      ssize_t sent =
          count ? ::sendmsg(connection.socket.fd(), &message, MSG_NOSIGNAL | MSG_DONTWAIT) : 0;
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          connection.writable = false;
          break;
        }
        data_lost(connection.peer, fmt::format("sending to it failed: {}", std::strerror(errno)));
      }
      size_t header_part =
          std::min<size_t>(sent, sizeof(FrameHeader) - connection.send_header_done);
      connection.send_header_done += header_part;
      transfer.done += sent - header_part;
      if (connection.send_header_done == sizeof(FrameHeader) && transfer.done == transfer.bytes) {
        connection.sends.pop();
        connection.send_started = false;
        transfer.complete = true;
      }
    }
  }

  void serve_recvs(Connection& connection) {
    if (connection.closed && !connection.recvs.empty()) {
      data_lost(connection.peer,
                control_.said_goodbye(connection.peer)
                    ? "it destroyed its communicator while this rank still expected data"
                    : "its connection closed");
    }
    while (connection.readable && !connection.closed) {
      Transfer* transfer = connection.recvs.front();
      bool header_pending = connection.recv_header_done < sizeof(FrameHeader);
      if (!header_pending && !transfer) break;  // the next message waits for its receive
      iovec parts[2];
      int count = 0;
      if (header_pending) {
        parts[count++] = {
            reinterpret_cast<char*>(&connection.recv_header) + connection.recv_header_done,
            sizeof(FrameHeader) - connection.recv_header_done};
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
                      control_.said_goodbye(connection.peer)
                          ? "it destroyed its communicator while this rank still expected data"
                          : "its connection closed in the middle of a message");
          }
          break;
        }
      }
      size_t header_part =
          header_pending
              ? std::min<size_t>(received, sizeof(FrameHeader) - connection.recv_header_done)
              : 0;
      connection.recv_header_done += header_part;
      if (transfer) transfer->done += received - header_part;
      if (connection.recv_header_done < sizeof(FrameHeader) || !transfer) continue;
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
    const FrameHeader& header = connection.recv_header;
    if (!header.well_formed()) {
      log::warn("tcp: rank {} sent a malformed frame (magic {:#x}); dropping it", connection.peer,
                header.magic);
      throw Error(Status::kPeerLost,
                  fmt::format("rank {} sent a malformed frame (magic {:#x}) to rank {}; the "
                              "connection was dropped",
                              connection.peer, header.magic, rank_));
    }
    check_frame(rank_, transfer, header);
  }

  // ---- shutdown -------------------------------------------------------------------------------

  void say_goodbye() noexcept {
    control_.say_goodbye();
    for (auto& peer : peers_) {
      for (auto& stream : peer.streams) {
        if (stream) ::shutdown(stream->socket.fd(), SHUT_WR);
      }
    }
  }

  // ---- failures -------------------------------------------------------------------------------

  // A data connection failed. If a rank failed first and said why, its ABORT is on a control
  // connection, possibly still in flight, and the connection we lost may only be a consequence
  // (the peer gave up because of that abort): report the abort rather than the loss.
  [[noreturn]] void data_lost(int peer, const std::string& why) {
    control_.look_for_abort(peer);
    throw control_.lost(peer, why);
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
    if (tell_peers) control_.tell_peers(error);
  }

  void rethrow_failure() const {
    if (failure_) throw *failure_;
  }

  int rank_;
  int streams_;
  net::Socket epoll_;
  std::vector<Peer> peers_;
  ControlChannel control_;
  std::optional<Error> failure_;
};

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(const TransportSettings& settings, StoreClient& store,
                                              int rank, int size, uint64_t context) {
  return std::make_unique<TcpTransport>(settings, store, rank, size, context);
}

}  // namespace kolo
