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
// Peers on this host. Unless KOLO_SHM says otherwise (its default: under KOLO_TRANSPORT=auto, not
// under an explicit tcp), every message to a peer on the same host goes through kolo's rings in
// shared memory (transport/shm/), set up over the pair's control socket; such a pair closes its
// data sockets, so no message can take the other path and overtake one in the ring. A job across
// hosts thus moves the bytes of each host through memory and the others over the network, in one
// communicator.
//
// Progress is edge-triggered epoll over every socket: an event marks a socket readable or
// writable, and the socket is served until the kernel says EAGAIN or nothing is posted.
// progress() first spins, polling the sockets (epoll_wait with no timeout) and any rings, for up to
// kSpin (transport/shm/waiting.hpp: plain polls, then polls with sched_yield() between them), and
// only then sleeps in epoll_wait: a small message's reply comes within microseconds, where a
// sleep costs a scheduler wake-up, about 24 us of the 28 an 8-byte allreduce took at N = 2 before
// the spin (docs/performance.md, "Small messages"). With rings, before sleeping it asks the peers
// on them for a doorbell (a WAKE frame on the control socket, which is in the epoll set); the
// readiness flag joins the epoll set.
#include "transport/tcp/tcp_transport.hpp"

#include <fmt/format.h>
#include <sched.h>
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
#include "transport/shm/shm_channel.hpp"
#include "transport/shm/waiting.hpp"

namespace kolo {
namespace {

constexpr int kSocketBufferBytes = 4 << 20;
// At most this much unsent data waits in a data socket (net::limit_unsent); the rest of its
// buffer is data in flight. Without a limit a socket's unsent data is whatever its send buffer
// holds beyond the window, and the kernel sends it when an acknowledgement or window update
// arrives, on the CPU that processes that packet, while this rank's own send() transmits on
// another. On loopback and veth a packet enters the backlog of the CPU that sends it, and two
// backlogs drain independently, so the receiver sees segments out of order, takes them for
// lost and halves the window: in `nstat`, 9,300 retransmitted segments and 13,900 out-of-order
// arrivals in 300 allreduces of 64 MiB at N = 2, and the busbw fell from 2.0 to 1.6 GB/s as the
// run went on (docs/performance.md, "Large buffers over TCP"). With at most 128 KiB unsent, little
// is left for the acknowledgement path to send: 5 retransmissions and 44 out-of-order arrivals in
// the same run, which kept 2.7 GB/s to its end.
constexpr int kUnsentBytes = 128 << 10;
// serve_sends() reads the same connection after writing this much (see there).
constexpr size_t kReadEveryBytes = 1 << 20;

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
      : rank_(rank),
        streams_(settings.tcp_streams),
        peers_(size),
        control_(rank, size),
        shm_(rank, size, control_, "tcp"),
        spinner_(settings) {
    epoll_ = net::Socket(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_.valid()) {
      throw Error(Status::kSystem, fmt::format("epoll_create1 failed: {}", std::strerror(errno)));
    }
    std::vector<PeerSockets> sockets =
        connect_mesh(settings, store, rank, size, context, "tcp", streams_);
    shm_.connect(sockets, settings.host, settings.shm == "1",
                 ShmChannel::copy_mode(settings.shm_copy), Deadline(settings.timeout_s));
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      if (!shm_.connected(peer)) {  // else its data sockets close here, unused
        peers_[peer].streams.resize(streams_);
        for (int stream = 0; stream < streams_; ++stream) {
          attach(peer, stream, std::move(sockets[peer].data[stream]), settings.tcp_congestion);
        }
      }
      control_.attach(peer, std::move(sockets[peer].control));
    }
    // The control channel and the readiness flag are more sources of events; their entries have
    // no connection.
    for (int fd : {control_.fd(), shm_.any() ? awake_.fd() : -1}) {
      if (fd < 0) continue;
      epoll_event event{};
      event.events = EPOLLIN;
      event.data.ptr = fd == control_.fd() ? nullptr : &awake_;
      if (::epoll_ctl(epoll_.fd(), EPOLL_CTL_ADD, fd, &event) != 0) {
        throw Error(Status::kSystem, fmt::format("epoll_ctl failed: {}", std::strerror(errno)));
      }
    }
  }

  ~TcpTransport() override { say_goodbye(); }

  const char* name() const override { return "tcp"; }

  void post_send(Transfer& transfer) override {
    rethrow_failure();
    guarded([&] {
      enter(transfer.descriptor);
      if (shm_.connected(transfer.peer)) {
        if (shm_.post_send(transfer)) awake_.set();
        return;
      }
      Peer& peer = peers_[transfer.peer];
      Connection& connection = *peer.streams[peer.messages_sent++ % streams_];
      connection.sends.push(&transfer);
      serve_sends(connection);
    });
  }

  void post_recv(Transfer& transfer) override {
    rethrow_failure();
    guarded([&] {
      enter(transfer.descriptor);
      if (shm_.connected(transfer.peer)) {
        if (shm_.post_recv(transfer)) awake_.set();
        return;
      }
      Peer& peer = peers_[transfer.peer];
      Connection& connection = *peer.streams[peer.messages_received++ % streams_];
      connection.recvs.push(&transfer);
      serve_recvs(connection);
    });
  }

  void progress(const Deadline& deadline) override {
    rethrow_failure();
    if (!shm_.any()) {
      if (!spin(deadline)) serve_events(deadline.remaining_ms());
      return;
    }
    guarded([&] {
      if (spin(deadline)) return awake_.set();
      check_departed_ring_peers();
      shm_.check_unexpected(current_);
      // Nothing moved: ask the peers on the rings for a doorbell, then look once more, since
      // what they published before they could see the request rings no bell (shm_channel.hpp).
      awake_.clear();
      shm_.prepare_sleep();
      bool moved = false;
      shm_.pump(moved);
      if (moved) {
        shm_.end_sleep();
        return awake_.set();
      }
      // A caller that sleeps on readiness_fd() itself (an expired deadline) leaves asleep: the
      // doorbells, the sockets and the control channel wake it.
      if (deadline.expired()) return;
      serve_events(deadline.remaining_ms());
      shm_.end_sleep();
      shm_.pump(moved);
      awake_.set();  // one wake-up (or the deadline): the caller looks at its transfers
    });
  }

  void abort(const Error& error) noexcept override { fail(error, true); }

  const Error* failure() const override { return failure_ ? &*failure_ : nullptr; }

  // The epoll set: readable while some socket (data or control) has an event to collect, or, with
  // rings, while the readiness flag is set (progress() returned without asking for doorbells).
  int readiness_fd() const override { return epoll_.fd(); }
  bool through_memory(int peer) const override { return shm_.connected(peer); }
  bool through_memory_everywhere() const override { return shm_.everywhere(); }

 private:
  // ---- waiting --------------------------------------------------------------------------------

  // Waits in epoll_wait at most timeout_ms for the sockets and the control channel, and serves
  // what they report. Returns how many of them reported (the readiness flag does not count).
  int serve_events(int timeout_ms) {
    std::array<epoll_event, 64> events;
    int ready = ::epoll_wait(epoll_.fd(), events.data(), events.size(), timeout_ms);
    if (ready < 0) {
      if (errno == EINTR) return 0;
      fail(Error(Status::kSystem, fmt::format("epoll_wait failed: {}", std::strerror(errno))),
           true);
      rethrow_failure();
    }
    int served = 0;
    guarded([&] {
      for (int i = 0; i < ready; ++i) {
        if (events[i].data.ptr == &awake_) continue;
        ++served;
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
    return served;
  }

  // Polls the sockets and the rings (if any) for kSpin (waiting.hpp; one pass for an expired
  // deadline, so that a caller sleeping on readiness_fd() does not spin), each copy through a ring
  // starting the spin again. True when a ring transfer completed or a socket reported something.
  bool spin(const Deadline& deadline) {
    shm_.end_sleep();
    spinner_.begin(!deadline.expired());
    for (;;) {
      bool copied = false;
      if (shm_.pump(copied) || serve_events(0) > 0) return true;
      if (!spinner_.next(copied)) return false;
    }
  }

  // A peer on a ring that said goodbye put everything it ever sent into the ring first (a send
  // through a ring completes once copied in): what is still pending with it never completes.
  void check_departed_ring_peers() {
    for (int peer = 0; peer < static_cast<int>(peers_.size()); ++peer) {
      if (!shm_.connected(peer) || !control_.said_goodbye(peer) || shm_.pending(peer) == 0) {
        continue;
      }
      bool moved = false;
      shm_.pump(moved);
      if (shm_.pending(peer) > 0) {
        data_lost(peer, "it destroyed its communicator while this rank still expected data");
      }
    }
  }

  // ---- messages that come before their receive -----------------------------------------------

  // A transfer of `descriptor` is posted: when that starts another collective, the messages that
  // arrived with no receive posted are judged against it (check_unexpected_frame), as those that
  // arrive later are when their header is read (serve_recvs) or before a sleep (the rings).
  void enter(const OpDescriptor& descriptor) {
    if (!enters_another_collective(current_, descriptor)) return;
    current_ = descriptor;
    for (auto& peer : peers_) {
      for (auto& stream : peer.streams) {
        if (stream->recvs.empty() && stream->recv_header_done == sizeof(FrameHeader)) {
          check_unexpected(*stream);
        }
      }
    }
    shm_.check_unexpected(current_);
  }

  void check_unexpected(const Connection& connection) const {
    if (connection.recv_header.well_formed()) {
      check_unexpected_frame(rank_, connection.peer, current_, connection.recv_header);
    }
  }

  // ---- set-up ---------------------------------------------------------------------------------

  void attach(int peer, int stream, net::Socket socket, const std::string& congestion) {
    net::set_nodelay(socket);
    net::tune_for_bulk(socket, kSocketBufferBytes);
    net::limit_unsent(socket, kUnsentBytes);
    const std::string algorithm = net::set_congestion_control(socket, congestion);
    if (stream == 0) {
      log::info("tcp: rank {} -> rank {}: congestion control {} (KOLO_TCP_CONGESTION={}, {})",
                rank_, peer, algorithm, congestion,
                net::connects_this_host(socket) ? "this host" : "another host");
    }
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
    size_t written = 0;
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
      // Where this connection also carries the bytes coming back (two ranks), reading what has
      // arrived every kReadEveryBytes written keeps both directions moving: writing until EAGAIN
      // (megabytes: the peer's window plus kUnsentBytes; 8 MiB before that limit) and only then
      // reading left the peer's data waiting, and ran a 16 MiB exchange at half of what the
      // loopback carries (docs/performance.md, "Large buffers over TCP").
      written += sent;
      if (written >= kReadEveryBytes && !connection.recvs.empty() && !connection.closed) {
        written = 0;
        connection.readable = true;  // a spurious read costs one EAGAIN
        serve_recvs(connection);
      }
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
      if (!transfer && header_part > 0 && connection.recv_header_done == sizeof(FrameHeader)) {
        check_unexpected(connection);  // a message before its receive: of another call?
      }
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
  // (the peer gave up because of that abort): report the abort rather than the loss. A peer that
  // said goodbye makes it a PeerLeft.
  [[noreturn]] void data_lost(int peer, const std::string& why) {
    control_.look_for_abort(peer);
    control_.throw_lost(peer, why);
  }

  template <typename Function>
  void guarded(Function&& function) {
    try {
      function();
    } catch (const PeerLeft& error) {
      fail(error, false);
      throw;
    } catch (const Error& error) {
      fail(error, true);
      throw;
    }
  }

  // Marks the transport failed (the first error stays) and forgets every posted transfer; tells
  // the peers when asked, once, with the first error.
  void fail(const Error& error, bool tell_peers) noexcept {
    if (!failure_) {
      failure_.emplace(error);
      for (auto& peer : peers_) {
        for (auto& stream : peer.streams) {
          if (!stream) continue;
          stream->sends.clear();
          stream->recvs.clear();
        }
      }
      shm_.forget();
    }
    if (tell_peers) control_.tell_peers(*failure_);
  }

  void rethrow_failure() const {
    if (failure_) throw *failure_;
  }

  int rank_;
  int streams_;
  net::Socket epoll_;
  std::vector<Peer> peers_;
  ControlChannel control_;
  ShmChannel shm_;  // after control_, which it rings doorbells through
  AwakeFlag awake_;
  Spinner spinner_;
  OpDescriptor current_;  // of the latest posted transfer of a numbered collective (enter)
  std::optional<Error> failure_;
};

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(const TransportSettings& settings, StoreClient& store,
                                              int rank, int size, uint64_t context) {
  return std::make_unique<TcpTransport>(settings, store, rank, size, context);
}

}  // namespace kolo
