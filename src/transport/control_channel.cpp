#include "transport/control_channel.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/deadline.hpp"
#include "core/log.hpp"

namespace kolo {

ControlChannel::ControlChannel(int rank, int size) : rank_(rank), size_(size) {
  links_.reserve(static_cast<size_t>(size));
  for (int peer = 0; peer < size; ++peer) links_.emplace_back(size);
  epoll_ = net::Socket(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_.valid()) {
    throw Error(Status::kSystem, fmt::format("epoll_create1 failed: {}", std::strerror(errno)));
  }
}

void ControlChannel::attach(int peer, net::Socket socket) {
  net::set_nodelay(socket);
  net::tune_for_bulk(socket, 0);  // keepalive and TCP_USER_TIMEOUT: a vanished host shows
  net::set_nonblocking(socket, true);
  epoll_event event{};
  event.events = EPOLLIN | EPOLLRDHUP;
  event.data.u32 = static_cast<uint32_t>(peer);
  if (::epoll_ctl(epoll_.fd(), EPOLL_CTL_ADD, socket.fd(), &event) != 0) {
    throw Error(Status::kSystem, fmt::format("epoll_ctl failed: {}", std::strerror(errno)));
  }
  links_[peer].socket = std::move(socket);
}

void ControlChannel::serve() {
  for (Link& link : links_) {
    if (!link.unsent.empty()) flush(link, Deadline(0));
  }
  std::array<epoll_event, 64> events;
  for (;;) {
    int ready = ::epoll_wait(epoll_.fd(), events.data(), events.size(), 0);
    if (ready < 0) {
      if (errno == EINTR) continue;
      throw Error(Status::kSystem, fmt::format("epoll_wait failed: {}", std::strerror(errno)));
    }
    for (int i = 0; i < ready; ++i) serve_link(static_cast<int>(events[i].data.u32));
    if (ready < static_cast<int>(events.size())) return;
  }
}

void ControlChannel::serve_link(int peer) {
  Link& link = links_[peer];
  while (link.socket.valid() && !link.closed) {
    ssize_t received =
        ::recv(link.socket.fd(), link.reader.space(), link.reader.wanted(), MSG_DONTWAIT);
    if (received < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      int error = errno;
      close_link(peer);
      throw lost(peer, fmt::format("its connection failed: {}", std::strerror(error)));
    }
    if (received == 0) {
      close_link(peer);
      if (!link.said_goodbye) {
        throw lost(peer, "its connection closed without a goodbye (did it die?)");
      }
      return;
    }
    switch (link.reader.advance(static_cast<size_t>(received))) {
      case ControlFrameReader::Step::kMore:
        break;
      case ControlFrameReader::Step::kFrame:
        handle_frame(peer);
        break;
      case ControlFrameReader::Step::kMalformedHeader:
        log::warn("rank {} sent a malformed control frame; dropping the connection", peer);
        close_link(peer);
        throw lost(peer, "it sent a malformed control frame");
      case ControlFrameReader::Step::kMalformedFrame:
        throw lost(peer, "it sent a malformed control frame");
      case ControlFrameReader::Step::kUnknownKind:
        throw lost(peer, "it sent an unknown control frame");
    }
  }
}

void ControlChannel::handle_frame(int peer) {
  Link& link = links_[peer];
  const ControlFrameReader& frame = link.reader;
  switch (frame.kind()) {
    case ControlKind::kGoodbye:
      link.said_goodbye = true;
      return;
    case ControlKind::kWake:
      return;  // its whole purpose was to end a poll()
    case ControlKind::kAbort:
      remote_failure_ = true;
      remote_origin_ = frame.origin();
      remote_text_.assign(frame.text());
      throw Error(frame.status(),
                  fmt::format("{} (reported by rank {})", remote_text_, frame.origin()));
  }
}

void ControlChannel::close_link(int peer) {
  Link& link = links_[peer];
  if (link.closed) return;
  link.closed = true;
  ::epoll_ctl(epoll_.fd(), EPOLL_CTL_DEL, link.socket.fd(), nullptr);
}

void ControlChannel::look_for_abort(int peer) {
  if (const Link& link = links_[peer]; link.socket.valid() && !link.closed) {
    pollfd waiting{link.socket.fd(), POLLIN, 0};
    ::poll(&waiting, 1, 200);
  }
  for (int other = 0; other < size_; ++other) {
    try {
      serve_link(other);
    } catch (const Error&) {
      if (remote_failure_) throw;  // an abort: the first cause
    }
  }
}

Error ControlChannel::lost(int peer, const std::string& why) const {
  return Error(Status::kPeerLost, fmt::format("rank {} lost rank {}: {}", rank_, peer, why));
}

void ControlChannel::throw_lost(int peer, const std::string& why) const {
  Error error = lost(peer, why);
  if (said_goodbye(peer)) throw PeerLeft(error.status(), error.what());
  throw error;
}

void ControlChannel::send_frame(int peer, ControlKind kind, Status status, int origin,
                                const std::string& text) noexcept {
  Link& link = links_[peer];
  if (!link.socket.valid() || link.closed) return;
  ControlFrameHeader header;
  header.kind = static_cast<uint32_t>(kind);
  header.status = static_cast<int32_t>(status);
  header.origin = origin;
  header.length = static_cast<uint32_t>(std::min(text.size(), kControlMaxText));
  if (link.unsent.size() + sizeof(header) + header.length > kMaxUnsent) {
    log::warn("rank {} has read none of {} bytes of control frames; closing its control "
              "connection",
              peer, link.unsent.size());
    ::shutdown(link.socket.fd(), SHUT_RDWR);  // so that the peer, if it wakes, sees it too
    close_link(peer);
    return;
  }
  link.unsent.append(reinterpret_cast<const char*>(&header), sizeof(header));
  link.unsent.append(text, 0, header.length);
  // A peer that is stuck keeps what is unsent for later; one that is gone drops it.
  flush(link, Deadline(0.2));
}

void ControlChannel::flush(Link& link, const Deadline& deadline) noexcept {
  while (!link.unsent.empty() && link.socket.valid() && !link.closed) {
    ssize_t sent = ::send(link.socket.fd(), link.unsent.data(), link.unsent.size(),
                          MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent > 0) {
      link.unsent.erase(0, static_cast<size_t>(sent));
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd writable{link.socket.fd(), POLLOUT, 0};
      if (deadline.expired() || ::poll(&writable, 1, deadline.remaining_ms()) <= 0) return;
      continue;
    }
    link.unsent.clear();  // the connection failed: the peer is gone
    return;
  }
}

void ControlChannel::tell_peers(const Error& error) noexcept {
  if (told_peers_) return;
  told_peers_ = true;
  // A rank that learnt of the failure from another passes it on before it closes anything: a peer
  // that sees this rank's connections close then finds the first cause waiting.
  int origin = remote_failure_ ? remote_origin_ : rank_;
  const std::string text = remote_failure_ ? remote_text_ : std::string(error.what());
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != origin) send_frame(peer, ControlKind::kAbort, error.status(), origin, text);
  }
}

void ControlChannel::ring_doorbell(int peer) noexcept {
  send_frame(peer, ControlKind::kWake, Status::kSuccess, rank_, "");
}

void ControlChannel::say_goodbye() noexcept {
  for (int peer = 0; peer < size_; ++peer) {
    send_frame(peer, ControlKind::kGoodbye, Status::kSuccess, rank_, "");
  }
  for (auto& link : links_) {
    if (link.socket.valid()) ::shutdown(link.socket.fd(), SHUT_WR);
  }
}

void ControlChannel::wait_until_closed(const Deadline& deadline) noexcept {
  for (;;) {
    bool open = false;
    for (const auto& link : links_) open = open || (link.socket.valid() && !link.closed);
    if (!open || deadline.expired()) return;
    pollfd waiting{epoll_.fd(), POLLIN, 0};
    ::poll(&waiting, 1, std::max(1, deadline.remaining_ms()));
    for (int peer = 0; peer < size_; ++peer) {
      try {
        serve_link(peer);
      } catch (const Error&) {
        // Whatever a peer says now changes nothing: this rank is leaving.
      }
    }
  }
}

}  // namespace kolo
