// The control connection to every peer: how failures reach every rank, and how a dead peer shows.
//
// Each pair of ranks keeps one authenticated TCP socket (set up by connect_mesh) that carries small
// frames only, a fixed header and at most 4 KiB of text (control_frame.hpp: their layout and
// reader):
//   ABORT    a rank failed: its status, the rank that failed first and that rank's message. Every
//            peer stops waiting and reports that first cause, not a consequence of it.
//   GOODBYE  a rank destroys its communicator normally.
//   WAKE     a doorbell, no more: a peer moved data for this rank through shared memory while this
//            rank slept in poll() (see transport/shm/shm_channel.hpp). serve() just consumes it.
// Frames go out whole and in order: what a full socket leaves unsent is sent before the next frame
// (and whenever serve() runs), never dropped halfway.
// The socket is always read, so a peer whose control socket closes without a goodbye was lost
// (killed, crashed): the kernel closes a dead process's sockets, and every rank learns of it within
// one wake-up. A host that vanishes is caught by TCP keepalive and TCP_USER_TIMEOUT within ~10 s.
//
// Transports poll fd() beside their own events (the TCP transport's epoll set, the UCX worker's
// event fd) and call serve() when it is readable.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/deadline.hpp"
#include "kolo/status.hpp"
#include "net/socket.hpp"
#include "transport/control_frame.hpp"

namespace kolo {

// A transfer to or from a peer that has said GOODBYE failed: the peer destroyed its communicator
// normally, and the failure is this rank's alone. A transport fails on it without telling the
// other ranks, who may still be finishing a collective that needs nothing more from this one (two
// ranks leaving at the same moment each find the other gone). A caller that abandons a collective
// still tells them, through Transport::abort.
class PeerLeft : public Error {
 public:
  using Error::Error;
};

class ControlChannel {
 public:
  ControlChannel(int rank, int size);
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  // Takes the connected, authenticated control socket of a peer and starts watching it.
  void attach(int peer, net::Socket socket);

  // Readable (level-triggered) while some control socket has a frame or an end of file to read.
  int fd() const { return epoll_.fd(); }

  // Reads what every peer has sent, without blocking. Throws kolo::Error: the announced status
  // (and text, "reported by rank R") for an ABORT, kPeerLost naming the peer when a control
  // connection closes without a goodbye, fails or carries a malformed frame.
  void serve();

  bool said_goodbye(int peer) const { return links_[peer].said_goodbye; }
  // The peer's control connection reached its end (after a goodbye, or an error was thrown).
  bool closed(int peer) const { return links_[peer].closed; }

  // Called when another path to `peer` failed (a data connection closed): a rank that failed first
  // sent an ABORT that may still be in flight, and the loss is probably a consequence of it. Waits
  // up to 200 ms for the peer's control socket, reads every peer's, and throws the ABORT if one
  // arrived; returns otherwise.
  void look_for_abort(int peer);

  // "rank R lost rank P: why".
  Error lost(int peer, const std::string& why) const;
  // Throws lost(peer, why) as a PeerLeft when the peer has said goodbye, else as an Error.
  [[noreturn]] void throw_lost(int peer, const std::string& why) const;

  // Tells every peer about a failure with an ABORT frame, best effort and briefly (0.2 s a peer at
  // most), once: later calls do nothing. A failure that arrived in an ABORT is passed on with its
  // origin, so that every rank reports the first cause; the origin itself is not told.
  void tell_peers(const Error& error) noexcept;
  bool told_peers() const { return told_peers_; }

  // Sends WAKE to `peer`, best effort (a peer that is gone needs no waking).
  void ring_doorbell(int peer) noexcept;

  // Sends GOODBYE to every peer and shuts down the writing side of every control socket.
  void say_goodbye() noexcept;

  // After say_goodbye: reads (and ignores) what peers send until every control socket has reached
  // its end, that is until every peer has said goodbye too or is gone, or until the deadline.
  void wait_until_closed(const Deadline& deadline) noexcept;

 private:
  struct Link {
    explicit Link(int ranks) : reader(ranks) {}
    net::Socket socket;
    bool closed = false;
    bool said_goodbye = false;
    ControlFrameReader reader;
    // Bytes of frames not sent yet: a frame that a full socket cut short is finished before any
    // later frame starts, so that the peer never reads half a frame followed by another.
    std::string unsent;
  };
  // More unsent bytes than this mean the peer has read nothing for thousands of frames: it is
  // stuck or gone, and its control connection is closed.
  static constexpr size_t kMaxUnsent = 64 << 10;

  void serve_link(int peer);
  void handle_frame(int peer);
  void close_link(int peer);
  void send_frame(int peer, ControlKind kind, Status status, int origin,
                  const std::string& text) noexcept;
  // Sends what the link has unsent until it is all out or the deadline passes; a failed socket
  // drops it (the peer is gone).
  static void flush(Link& link, const Deadline& deadline) noexcept;

  int rank_;
  int size_;
  net::Socket epoll_;
  std::vector<Link> links_;
  bool told_peers_ = false;
  bool remote_failure_ = false;  // an ABORT arrived from remote_origin_
  int remote_origin_ = -1;
  std::string remote_text_;
};

}  // namespace kolo
