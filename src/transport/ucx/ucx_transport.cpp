// UCX transport.
//
// Data goes through one UCP worker per communicator with tagged messages; failures and shutdown go
// through the same control channel as the TCP transport (transport/control_channel.hpp).
//
// Why a TCP control channel beside UCX. UCX reports a dead peer only in its peer error-handling
// mode (UCP_ERR_HANDLING_MODE_PEER), and UCX 1.13 then refuses the transports that cannot detect
// failures itself: shared memory (posix, sysv) and CMA drop out and a job on one host falls back
// to UCX's TCP, 0.3 GB/s instead of several GB/s (measured: docs/architecture.md, "The UCX
// transport"). So the endpoints are created without error handling, which keeps every fast path,
// and one authenticated TCP socket per pair carries ABORT and GOODBYE frames and shows a death: the
// kernel closes a killed process's sockets, and a closed control socket without a goodbye means the
// peer was lost. It costs one socket per peer and one more fd in the poll that waits for UCX
// events; nothing per message. The price of running UCX without error handling is that UCX treats a
// CMA read from a process that just died as fatal; filter_peer_death() below turns exactly that
// into an error.
//
// Start-up, and the job secret before any data. 1. The control mesh is connected and every
// socket proves the job secret (net/auth.hpp). 2. Over each authenticated control socket the
// lower rank of the pair sends a random 64-bit key, which both ranks mix into every tag they
// exchange: a stranger who connects to this worker's UCX interfaces cannot produce a tag that
// matches a posted receive. 3. Worker addresses travel through the rendezvous store (itself
// authenticated) under kolo/<context>/ucx-worker/<rank>, and every rank creates an endpoint to
// every rank, itself included.
//
// Messages. The k-th message from rank s to rank r is two UCP tagged messages: its frame header
// (transport/framing.hpp) and, unless empty, the payload.
// Tags spell (header or payload, s, k) xor the pair's key, so the k-th receive posted for a peer
// takes exactly the k-th message that peer sent, as over TCP. A receive posts both at once: the
// payload straight into the caller's buffer (UCX's rendezvous protocol moves large payloads
// zero-copy: a CMA read within a host, RDMA with memory registrations that UCX's registration
// cache keeps for reused buffers), the header into a slot of this transport. The transfer
// completes only after the header was checked against the receiver's own descriptor and length,
// by check_frame(), as on every transport, so ranks that disagree get KOLO_ERR_MISMATCH. A
// payload longer than expected is cut short by UCX (truncated), never written past the buffer.
// A message that comes before its receive waits in UCX, where no check would see it if that
// receive is never posted; so when a collective starts and before a sleep, the next header from
// each peer is probed for, taken out of UCX and judged (judge_early_messages below).
//
// Peers on this host. Unless KOLO_SHM=0, every message to a peer on the same host goes
// through kolo's own rings in shared memory instead (transport/shm/: two memcpy()s through
// 256 KiB slots, faster here than UCX's per-message CMA read), set up over the authenticated
// control socket right after the keys; such a peer gets no UCX message at all, so ordering
// between the two paths never arises. progress() pumps the rings beside the worker, and before
// it sleeps asks the peers it waits on for a doorbell (a WAKE frame on the control channel).
//
// Progress. UCX calls back on completion from inside ucp_worker_progress; the callbacks only mark
// the operation and queue it, and the checks (which may throw) run after progress returns.
// Waiting spins on ucp_worker_progress for a few microseconds (latency), then arms the worker and
// sleeps in poll() on UCX's event fd and the control channel (no CPU burnt by waiting ranks).
//
// Shutdown. A normal end flushes the worker (a receiver's last rendezvous acknowledgement lets
// its sender finish), sends GOODBYE on every control socket and destroys the worker with its
// endpoints (closing them one by one would wait for peers that may have exited, which UCX reports
// as errors). After a failure, posted receives are cancelled and never written again, since the
// worker is not progressed any more; the worker outlives the failure until every peer has left
// (at most 2 s), so that peers still inside the failed collective do not touch vanished shared
// memory; sends that a dead peer never fetched cannot be cancelled in UCX without peer error
// handling, so the worker is destroyed with them outstanding and UCX's warning about them is
// silenced for that one call.
#include "transport/ucx/ucx_transport.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <ucs/debug/log_def.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include "bootstrap/store.hpp"
#include "core/log.hpp"
#include "net/socket.hpp"
#include "transport/control_channel.hpp"
#include "transport/framing.hpp"
#include "transport/mesh.hpp"
#include "transport/shm/shm_channel.hpp"
#include "transport/shm/waiting.hpp"

namespace kolo {
namespace {

// Tag bits: 63 payload (1) or header (0); 40..62 the sending rank; 0..39 the message number
// between the pair (wrapping is harmless: only messages in flight at once must differ).
constexpr int kSequenceBits = 40;
constexpr int kMaxRanks = 1 << 23;
constexpr uint64_t kFullMask = ~uint64_t{0};

uint64_t message_tag(bool payload, int source, uint64_t sequence, uint64_t pair_key) {
  uint64_t plain = (uint64_t{payload} << 63) | (static_cast<uint64_t>(source) << kSequenceBits) |
                   (sequence & ((uint64_t{1} << kSequenceBits) - 1));
  return plain ^ pair_key;
}

// Waiting: spin on the worker and the rings as transport/shm/waiting.hpp says, then sleep in
// poll(). The sleep is bounded so that a peer's goodbye is re-examined, and shortened to a
// millisecond once a wake-up is found missing (missed_wake_up).
constexpr int kMaxSleepMs = 100;
constexpr auto kControlCheckInterval = std::chrono::milliseconds(1);
// A peer that said goodbye flushed everything it sent first; what it sent arrives within this.
constexpr auto kGoodbyeGrace = std::chrono::seconds(1);
// Normal shutdown: how long flushing may take before the worker is destroyed anyway.
constexpr double kShutdownSeconds = 10.0;
// After a failure: how long to wait for the peers to leave before destroying the worker.
constexpr double kFailedShutdownSeconds = 2.0;

[[noreturn]] void throw_ucx(const char* what, ucs_status_t status) {
  throw Error(Status::kSystem, fmt::format("ucx: {} failed: {}", what, ucs_status_string(status)));
}

// UCX without peer error handling treats a failed CMA copy as fatal and aborts the process: a
// receiver that fetches a rendezvous payload from a peer killed a moment ago (process_vm_readv
// fails with ESRCH, or EFAULT while the dying process's memory is torn down) would die with it.
// This handler, ahead of UCX's default one, turns exactly those reports into a log line; UCX then
// completes the receive with an error status, and the transport reports the lost peer as usual
// (its control socket has closed too). Everything else goes on to UCX's own handler.
ucs_log_func_rc_t filter_peer_death(const char* file, unsigned /*line*/, const char* /*function*/,
                                    ucs_log_level_t level,
                                    const ucs_log_component_config_t* /*component*/,
                                    const char* format, va_list arguments) {
  if (level != UCS_LOG_LEVEL_FATAL || std::strstr(file, "cma_ep.c") == nullptr) {
    return UCS_LOG_FUNC_RC_CONTINUE;
  }
  char text[1024];
  va_list copy;  // the next handler may need the arguments too
  va_copy(copy, arguments);
  std::vsnprintf(text, sizeof(text), format, copy);
  va_end(copy);
  const std::string message(text);
  auto ends_with = [&](const char* suffix) {
    std::string tail = fmt::format("returned -1: {}", suffix);
    return message.size() >= tail.size() &&
           message.compare(message.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (!ends_with(std::strerror(ESRCH)) && !ends_with(std::strerror(EFAULT))) {
    return UCS_LOG_FUNC_RC_CONTINUE;
  }
  log::info("ucx: a copy from a peer process failed, the peer is gone: {}", message);
  return UCS_LOG_FUNC_RC_STOP;
}

void install_peer_death_filter() {
  static std::once_flag once;
  std::call_once(once, [] { ucs_log_push_handler(&filter_peer_death); });
}

uint64_t random_key() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

class UcxTransport;

// One posted send or receive: its header and the two UCP requests (header, payload).
struct Operation {
  struct Part {
    Operation* operation = nullptr;
    void* request = nullptr;  // UCX's, while in flight
    bool done = false;
    ucs_status_t status = UCS_OK;
    size_t length = 0;  // receives: what arrived
  };

  UcxTransport* owner = nullptr;
  Transfer* transfer = nullptr;  // null while free
  bool receive = false;
  bool header_checked = false;
  bool queued = false;
  Operation* next = nullptr;  // in the free list or the completion queue
  FrameHeader header;
  Part parts[2];  // 0: header, 1: payload
};

class UcxTransport final : public Transport {
 public:
  UcxTransport(const TransportSettings& settings, StoreClient& store, int rank, int size,
               uint64_t context)
      : rank_(rank),
        size_(size),
        peers_(size),
        control_(rank, size),
        shm_(rank, size, control_, "ucx"),
        spinner_(settings) {
    timeout_s_ = settings.timeout_s;
    if (size > kMaxRanks) {
      throw Error(
          Status::kUnsupported,
          fmt::format("ucx: {} ranks are more than the {} that tags can name", size, kMaxRanks));
    }
    try {
      connect(settings, store, context);
    } catch (...) {
      destroy_ucx(false);
      throw;
    }
  }

  ~UcxTransport() override {
    // After a failure the peers were not told of (a PeerLeft) they go on, and what this rank sent
    // them must still leave the worker; unless a send of the caller's is unfinished: progress
    // would read its buffer, which the caller may have freed since the failure.
    if (!failure_ || (!control_.told_peers() && !caller_send_in_flight())) flush_worker();
    control_.say_goodbye();
    if (control_.told_peers()) {
      // Peers still inside the failed collective may yet send here before they read the ABORT;
      // this worker's shared memory must outlive those sends, or UCX reports errors on their
      // side. Each peer leaves (closes its control socket) once it has failed too.
      control_.wait_until_closed(Deadline(kFailedShutdownSeconds));
    }
    destroy_ucx(!failure_);
  }

  const char* name() const override { return "ucx"; }

  void post_send(Transfer& transfer) override {
    rethrow_failure();
    guarded([&] {
      enter(transfer.descriptor);
      if (shm_.connected(transfer.peer)) {
        if (shm_.post_send(transfer)) awake_.set();
        return;
      }
      Peer& peer = peers_[transfer.peer];
      const uint64_t sequence = peer.sent++;
      Operation& operation = acquire(transfer, false);
      operation.header = FrameHeader::for_transfer(transfer);
      start_send(operation, 0, &operation.header, sizeof(FrameHeader),
                 message_tag(false, rank_, sequence, peer.key));
      if (transfer.bytes > 0) {
        start_send(operation, 1, transfer.data, transfer.bytes,
                   message_tag(true, rank_, sequence, peer.key));
      } else {
        operation.parts[1].done = true;
      }
      queue(&operation);
      process_completions();
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
      const uint64_t sequence = peer.received++;
      Operation& operation = acquire(transfer, true);
      if (peer.early_header && peer.early_header->sequence == sequence) {
        use_early_header(operation, peer);
      } else {
        start_receive(operation, 0, &operation.header, sizeof(FrameHeader),
                      message_tag(false, transfer.peer, sequence, peer.key));
      }
      if (transfer.bytes > 0) {
        start_receive(operation, 1, transfer.data, transfer.bytes,
                      message_tag(true, transfer.peer, sequence, peer.key));
      } else {
        operation.parts[1].done = true;
      }
      queue(&operation);
      process_completions();
    });
  }

  void progress(const Deadline& deadline) override {
    rethrow_failure();
    guarded([&] {
      // Spin, then spin yielding the CPU (Spinner): most waits in a pipeline end within
      // microseconds. An expired deadline (a caller that sleeps on readiness_fd() itself) gets one
      // pass.
      spinner_.begin(!deadline.expired());
      shm_.end_sleep();
      bool moved = false;
      for (unsigned polls = 0;; ++polls) {
        // With no UCX operation posted (every peer on the rings), the worker has nothing this
        // wait needs soon, and its progress costs as much as a poll of the rings: every
        // kClockStride-th poll then.
        if (outstanding_ > 0 || polls % kClockStride == 0) ucp_worker_progress(worker_);
        bool completed = process_completions();
        bool copied = false;
        if (shm_.any() && shm_.pump(copied)) completed = true;
        if (completed) return awake_.set();
        if (!spinner_.next(copied)) break;
      }
      serve_control();
      judge_early_messages();

      // Sleep until UCX or the control channel has something, or the deadline.
      awake_.clear();
      for (;;) {
        ucs_status_t armed = ucp_worker_arm(worker_);
        if (armed == UCS_ERR_BUSY) {  // events arrived since the last progress: take them
          while (ucp_worker_progress(worker_) != 0) {
          }
          if (process_completions() || deadline.expired()) return awake_.set();
          if (Clock::now() >= next_control_check_) serve_control();
          judge_early_messages();
          continue;
        }
        if (armed != UCS_OK) throw_ucx("ucp_worker_arm", armed);
        if (shm_.any()) {
          // Ask the peers for a doorbell, then look once more: what they published before they
          // could see the request is found now (see transport/shm/shm_channel.hpp).
          shm_.prepare_sleep();
          moved = false;
          const bool completed = shm_.pump(moved);
          if (moved) {
            shm_.end_sleep();
            if (completed || deadline.expired()) return awake_.set();
            continue;
          }
        }
        // Armed, and peers on shared memory asked: the worker's event fd or a doorbell on the
        // control channel wakes a sleeping caller.
        if (deadline.expired()) return;
        pollfd waiting[2] = {{event_fd_, POLLIN, 0}, {control_.fd(), POLLIN, 0}};
        const bool bounded_by_us = deadline.remaining_ms() > max_sleep_ms_;
        int ready = ::poll(waiting, 2, std::min(deadline.remaining_ms(), max_sleep_ms_));
        if (ready < 0 && errno != EINTR) {
          throw Error(Status::kSystem, fmt::format("poll failed: {}", std::strerror(errno)));
        }
        serve_control();
        bool progressed = false;
        while (ucp_worker_progress(worker_) != 0) progressed = true;
        if (ready == 0 && bounded_by_us && progressed) missed_wake_up();
        process_completions();
        shm_.end_sleep();
        if (shm_.any()) shm_.pump(moved);
        return awake_.set();  // one wake-up (or the deadline): the caller looks at its transfers
      }
    });
  }

  // The sleep ran to its bound with no wake-up, yet UCX had work: the transports in use do not
  // signal the event fd here (seen with UCX's shared memory between network namespaces). Waits
  // then look every millisecond instead of sleeping up to kMaxSleepMs.
  void missed_wake_up() {
    if (max_sleep_ms_ == 1) return;
    max_sleep_ms_ = 1;
    log::warn(
        "ucx: rank {}: UCX's wake-ups do not arrive (it reaches its peers through {}); "
        "waits now look every millisecond. Between containers or network namespaces of one "
        "machine, leave UCX_TLS unset so that kolo keeps UCX off shared memory",
        rank_, describe_lanes());
  }

  // Readable while progress() has something to do: UCX's event fd (reliable only while the
  // worker is armed), the control channel, and `awake_` (transport/shm/waiting.hpp), which
  // progress() sets whenever it returns with the worker not armed: every return from progress()
  // leaves the worker armed or awake_ set.
  int readiness_fd() const override { return readiness_.fd(); }
  bool through_memory(int peer) const override { return shm_.connected(peer); }
  bool through_memory_everywhere() const override { return shm_.everywhere(); }

  void abort(const Error& error) noexcept override { fail(error, true); }

  const Error* failure() const override { return failure_ ? &*failure_ : nullptr; }

  // UCX's completion callbacks: mark the part done and queue its operation.
  static void on_sent(void* request, ucs_status_t status, void* user_data) {
    part_done(*static_cast<Operation::Part*>(user_data), request, status, 0);
  }
  static void on_received(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                          void* user_data) {
    part_done(*static_cast<Operation::Part*>(user_data), request, status,
              info != nullptr ? info->length : 0);
  }

 private:
  struct EarlyHeader {
    uint64_t sequence = 0;  // of the message between the pair
    FrameHeader header;
    size_t length = 0;  // what arrived
    ucs_status_t status = UCS_OK;
  };

  struct Peer {
    ucp_ep_h endpoint = nullptr;
    uint64_t key = 0;  // mixed into every tag between this pair
    uint64_t sent = 0;
    uint64_t received = 0;
    int outstanding = 0;  // posted operations not yet complete
    std::optional<Clock::time_point> goodbye_seen;
    // The header of message `received` from this peer, taken out of UCX before its receive was
    // posted (judge_early_messages); that receive takes it from here.
    std::optional<EarlyHeader> early_header;
  };

  // ---- set-up ---------------------------------------------------------------------------------

  void connect(const TransportSettings& settings, StoreClient& store, uint64_t context) {
    Deadline deadline(settings.timeout_s);
    const auto started = Clock::now();
    // 1. Authenticated control sockets; 2. a key per pair over them.
    std::vector<PeerSockets> sockets =
        connect_mesh(settings, store, rank_, size_, context, "ucx-control", 0);
    exchange_keys(sockets, deadline);
    // 2b. Rings in shared memory for the peers on this host (transport/shm/).
    shm_.connect(sockets, settings.host, settings.shm == "1",
                 ShmChannel::copy_mode(settings.shm_copy), deadline);
    const auto control_ready = Clock::now();

    // 3. The worker, its address in the store, an endpoint to every rank. A rank that cannot
    // start UCX publishes an empty address, so that the others fail at once instead of waiting
    // for KOLO_TIMEOUT.
    // Where the group exchanged the control mesh's addresses without the store (PMIx start-up,
    // TransportSettings::prepared), the worker addresses go over the control sockets as well.
    const bool over_sockets = settings.prepared != nullptr;
    std::vector<uint8_t> published;
    try {
      published = start_worker(settings);
    } catch (...) {
      try {
        if (over_sockets) {
          send_worker_address(sockets, {}, deadline);
        } else {
          store.set(store_key(context, "ucx-worker", rank_), {});
        }
      } catch (const Error&) {
        // The store or a peer is gone too; the peers learn from their own timeouts.
      }
      throw;
    }
    std::vector<std::vector<uint8_t>> others;
    if (over_sockets) {
      send_worker_address(sockets, published, deadline);
      others = receive_worker_addresses(sockets, deadline);
    } else {
      store.set(store_key(context, "ucx-worker", rank_), published);
    }
    log::info("ucx: rank {} worker address of {} bytes published", rank_, published.size());
    const auto worker_ready = Clock::now();

    if (!over_sockets) {
      // Every other rank's worker address, in one request.
      std::vector<std::string> keys;
      for (int peer = 0; peer < size_; ++peer) {
        if (peer != rank_) keys.push_back(store_key(context, "ucx-worker", peer));
      }
      others = store.get_all(keys);
    }
    for (int peer = 0; peer < size_; ++peer) {
      const std::vector<uint8_t>& remote =
          peer == rank_ ? published : others[static_cast<size_t>(peer < rank_ ? peer : peer - 1)];
      if (remote.empty()) {
        throw Error(Status::kPeerLost,
                    fmt::format("ucx: rank {} could not start UCX (its log says why)", peer));
      }
      ucp_ep_params_t endpoint_params{};
      // No error handling mode: UCX keeps shared memory and CMA (the control channel detects
      // failures instead; see the top of this file).
      endpoint_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
      endpoint_params.address = reinterpret_cast<const ucp_address_t*>(remote.data());
      ucs_status_t status = ucp_ep_create(worker_, &endpoint_params, &peers_[peer].endpoint);
      if (status != UCS_OK) {
        throw Error(Status::kPeerLost,
                    fmt::format("ucx: rank {} cannot reach rank {}: {} (check UCX_TLS and "
                                "UCX_NET_DEVICES)",
                                rank_, peer, ucs_status_string(status)));
      }
    }

    if (log::level() >= log::Level::kInfo) {
      log::info("ucx: rank {} reaches its peers through {}", rank_, describe_lanes());
    }

    // 4. Wait until every rank has its endpoints. Shared-memory endpoints attach to the peer's
    // segment when they are created, so no rank may go ahead (and, failing, destroy its worker)
    // while another is still connecting.
    synchronize(sockets, deadline);
    for (int peer = 0; peer < size_; ++peer) {
      if (peer != rank_) control_.attach(peer, std::move(sockets[peer].control));
    }
    make_readiness_set();
    auto ms = [](Clock::duration duration) {
      return std::chrono::duration<double, std::milli>(duration).count();
    };
    log::info(
        "ucx: rank {} set up in {:.1f} ms: control sockets {:.1f} ms, UCX worker {:.1f} ms, "
        "endpoints and start-up barrier {:.1f} ms",
        rank_, ms(Clock::now() - started), ms(control_ready - started),
        ms(worker_ready - control_ready), ms(Clock::now() - worker_ready));
  }

  // Which UCX transports: UCX_TLS where it names some. Otherwise all of them, except that peers
  // on another host (by kolo's reckoning, core/host.hpp) must be reached
  // over the network, though UCX may see them as reachable through shared memory or CMA
  // (containers or network namespaces on one kernel), whose wake-ups need not cross from one
  // namespace to the other. In a job that spans hosts, kolo's rings carry the traffic of this
  // host, so UCX's own shared-memory transports are left out. An empty UCX_TLS counts as unset,
  // as an empty KOLO_* variable does (UCX itself would start with no transport).
  void choose_transports(ucp_config_t* ucx_config) {
    const char* chosen = std::getenv("UCX_TLS");
    const bool other_hosts = shm_.any_other_host();
    if (chosen != nullptr && *chosen != '\0') {
      if (other_hosts) {
        log::info(
            "ucx: rank {}: UCX_TLS={} kept; peers on other hosts may then be reached "
            "through shared memory where UCX can",
            rank_, chosen);
      }
      return;
    }
    const char* transports = other_hosts ? "^sm" : "all";
    ucs_status_t status = ucp_config_modify(ucx_config, "TLS", transports);
    if (status != UCS_OK) {
      throw_ucx(fmt::format("choosing UCX's transports (TLS={})", transports).c_str(), status);
    }
    if (other_hosts) {
      log::info(
          "ucx: rank {}: peers on other hosts: UCX's shared-memory transports left out "
          "(UCX_TLS=^sm)",
          rank_);
    }
  }

  // UCX 1.13's TCP transport aborts the whole process (an assertion in tcp_ep.c, "PUT_TX_WAITING_
  // ACK") when a peer dies while one of its PUT Zcopy operations waits for the acknowledgement,
  // which turns a lost peer into a lost survivor. Without PUT Zcopy, UCX's rendezvous over TCP
  // moves large payloads as active messages instead, and a dead peer is an endpoint error as
  // everywhere else. UCX_TCP_PUT_ENABLE, where set, is kept.
  void avoid_tcp_put_zcopy(ucp_config_t* ucx_config) {
    if (std::getenv("UCX_TCP_PUT_ENABLE") != nullptr) return;
    ucs_status_t status = ucp_config_modify(ucx_config, "PUT_ENABLE", "n");
    if (status != UCS_OK) throw_ucx("turning off UCX's TCP PUT Zcopy (TCP_PUT_ENABLE=n)", status);
  }

  // Between hosts without RDMA, UCX's network is TCP, and its rendezvous protocol (a request, a
  // reply, then the payload) puts each handshake into the same byte stream as the bulk data going
  // the other way. Where a ring's two directions share one connection (two hosts, one rank each)
  // every handshake waits behind megabytes: measured on the simulated cluster with 1 Gbit/s links,
  // busbw fell to 0.67-0.73 of the link at 16-64 MiB, and rose to 0.95 with every message sent
  // eagerly (docs/architecture.md, "The UCX transport"). So, in a job across hosts without an
  // active RDMA port here, UCX_RNDV_THRESH=inf unless it is set. A payload that arrives before kolo
  // posts its receive waits in UCX's memory: at most what the sender posted ahead, one ring chunk
  // per peer.
  void eager_over_tcp(ucp_config_t* ucx_config) {
    if (!shm_.any_other_host() || std::getenv("UCX_RNDV_THRESH") != nullptr ||
        has_active_rdma_port()) {
      return;
    }
    ucs_status_t status = ucp_config_modify(ucx_config, "RNDV_THRESH", "inf");
    if (status != UCS_OK) throw_ucx("sending eagerly over TCP (RNDV_THRESH=inf)", status);
    log::info(
        "ucx: rank {}: peers on other hosts and no RDMA port: messages sent eagerly "
        "(UCX_RNDV_THRESH=inf)",
        rank_);
  }

  // The UCP context and worker (UCX_* variables apply); returns the worker's address.
  std::vector<uint8_t> start_worker(const TransportSettings& settings) {
    install_peer_death_filter();
    ucp_config_t* ucx_config = nullptr;
    ucs_status_t status = ucp_config_read(nullptr, nullptr, &ucx_config);  // reads UCX_* variables
    if (status != UCS_OK) throw_ucx("reading the UCX configuration (UCX_* variables)", status);
    choose_transports(ucx_config);
    avoid_tcp_put_zcopy(ucx_config);
    eager_over_tcp(ucx_config);
    ucp_params_t params{};
    params.field_mask =
        UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    params.estimated_num_eps = static_cast<size_t>(size_);
    params.name = "kolo";
    if (settings.local_size > 0) {
      params.field_mask |= UCP_PARAM_FIELD_ESTIMATED_NUM_PPN;
      params.estimated_num_ppn = static_cast<size_t>(settings.local_size);
    }
    status = ucp_init(&params, ucx_config, &context_);
    ucp_config_release(ucx_config);
    if (status != UCS_OK) {
      throw Error(Status::kConfig,
                  fmt::format("ucx: UCX could not start (ucp_init: {}); check UCX_TLS and "
                              "UCX_NET_DEVICES",
                              ucs_status_string(status)));
    }

    ucp_worker_params_t worker_params{};
    worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // the communicator serialises calls
    status = ucp_worker_create(context_, &worker_params, &worker_);
    if (status != UCS_OK) throw_ucx("ucp_worker_create", status);
    status = ucp_worker_get_efd(worker_, &event_fd_);
    if (status != UCS_OK) throw_ucx("ucp_worker_get_efd", status);

    ucp_address_t* address = nullptr;
    size_t address_length = 0;
    status = ucp_worker_get_address(worker_, &address, &address_length);
    if (status != UCS_OK) throw_ucx("ucp_worker_get_address", status);
    const auto* bytes = reinterpret_cast<const uint8_t*>(address);
    std::vector<uint8_t> published(bytes, bytes + address_length);
    ucp_worker_release_address(worker_, address);
    return published;
  }

  // The UCT transports UCX chose for the endpoints to other ranks ("sysv/memory cma/memory"), read
  // from UCX's own description of each endpoint (UCX 1.13 has no query for them).
  std::string describe_lanes() {
    std::set<std::string> lanes;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      char* text = nullptr;
      size_t length = 0;
      FILE* stream = ::open_memstream(&text, &length);
      if (!stream) continue;
      ucp_ep_print_info(peers_[peer].endpoint, stream);
      std::fclose(stream);
      // Lines such as "#  lane[0]:  3:sysv/memory.0 md[2]  -> ...".
      std::istringstream lines(std::string(text, length));
      std::free(text);
      std::string line;
      while (std::getline(lines, line)) {
        size_t at = line.find("lane[");
        if (at == std::string::npos) continue;
        std::istringstream words(line.substr(line.find(':', at) + 1));
        std::string lane;
        words >> lane;                           // "3:sysv/memory.0"
        lane = lane.substr(lane.find(':') + 1);  // "sysv/memory.0"
        lanes.insert(lane.substr(0, lane.rfind('.')));
      }
    }
    if (lanes.empty()) return "nothing (no peers)";
    std::string joined;
    for (const auto& lane : lanes) joined += (joined.empty() ? "" : " ") + lane;
    return joined;
  }

  // The lower rank of each pair sends the pair's key over their authenticated control socket.
  void exchange_keys(const std::vector<PeerSockets>& sockets, const Deadline& deadline) {
    peers_[rank_].key = random_key();
    for (int peer = rank_ + 1; peer < size_; ++peer) {
      peers_[peer].key = random_key();
      net::send_all(sockets[peer].control, &peers_[peer].key, sizeof(uint64_t), deadline);
    }
    for (int peer = 0; peer < rank_; ++peer) {
      net::recv_all(sockets[peer].control, &peers_[peer].key, sizeof(uint64_t), deadline);
    }
  }

  // This rank's worker address to every peer over its control socket: its length (4 bytes, host
  // order: the peers run this same build), then the bytes; empty when UCX did not start here.
  void send_worker_address(const std::vector<PeerSockets>& sockets,
                           const std::vector<uint8_t>& address, const Deadline& deadline) {
    const uint32_t length = static_cast<uint32_t>(address.size());
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      try {
        net::send_all(sockets[peer].control, &length, sizeof length, deadline);
        if (length > 0) net::send_all(sockets[peer].control, address.data(), length, deadline);
      } catch (const Error& error) {
        throw Error(error.status(),
                    fmt::format("ucx: rank {} could not send its worker address to rank {} (a "
                                "rank that cannot start UCX says why in its own log): {}",
                                rank_, peer, error.what()));
      }
    }
  }

  // Every other rank's worker address from its control socket, in rank order without this rank's
  // (as the store's get_all returns them); a length over kMaxWorkerAddress drops the peer.
  std::vector<std::vector<uint8_t>> receive_worker_addresses(
      const std::vector<PeerSockets>& sockets, const Deadline& deadline) {
    constexpr uint32_t kMaxWorkerAddress = 1 << 20;
    std::vector<std::vector<uint8_t>> addresses;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      uint32_t length = 0;
      try {
        net::recv_all(sockets[peer].control, &length, sizeof length, deadline);
        if (length > kMaxWorkerAddress) {
          throw control_.lost(peer, fmt::format("it sent a worker address of {} bytes", length));
        }
        addresses.emplace_back(length);
        if (length > 0)
          net::recv_all(sockets[peer].control, addresses.back().data(), length, deadline);
      } catch (const Error& error) {
        throw Error(error.status(), fmt::format("ucx: rank {} waited for rank {}'s worker "
                                                "address: {}",
                                                rank_, peer, error.what()));
      }
    }
    return addresses;
  }

  // A byte to every peer over its control socket, then one from every peer.
  void synchronize(const std::vector<PeerSockets>& sockets, const Deadline& deadline) {
    const uint8_t ready = 1;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer != rank_) net::send_all(sockets[peer].control, &ready, 1, deadline);
    }
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      uint8_t answer = 0;
      try {
        net::recv_all(sockets[peer].control, &answer, 1, deadline);
      } catch (const Error& error) {
        throw Error(error.status(), fmt::format("ucx: rank {} waited for rank {} to connect: {}",
                                                rank_, peer, error.what()));
      }
      if (answer != ready) {
        throw control_.lost(peer, "it sent a malformed start-up message");
      }
    }
  }

  // ---- operations -----------------------------------------------------------------------------

  Operation& acquire(Transfer& transfer, bool receive) {
    Operation* operation = free_;
    if (operation) {
      free_ = operation->next;
    } else {
      operations_.push_back(std::make_unique<Operation>());
      operation = operations_.back().get();
      operation->owner = this;
      for (auto& part : operation->parts) part.operation = operation;
    }
    operation->transfer = &transfer;
    operation->receive = receive;
    operation->header_checked = false;
    operation->queued = false;
    operation->next = nullptr;
    for (auto& part : operation->parts) {
      part.request = nullptr;
      part.done = false;
      part.status = UCS_OK;
      part.length = 0;
    }
    ++peers_[transfer.peer].outstanding;
    ++outstanding_;
    return *operation;
  }

  void release(Operation& operation) {
    --peers_[operation.transfer->peer].outstanding;
    --outstanding_;
    operation.transfer = nullptr;
    operation.next = free_;
    free_ = &operation;
  }

  void start_send(Operation& operation, int index, const void* buffer, size_t length,
                  uint64_t tag) {
    Operation::Part& part = operation.parts[index];
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxTransport::on_sent;
    param.user_data = &part;
    ucs_status_ptr_t request =
        ucp_tag_send_nbx(peers_[operation.transfer->peer].endpoint, buffer, length, tag, &param);
    settle(part, request, "sending to", operation.transfer->peer);
  }

  void start_receive(Operation& operation, int index, void* buffer, size_t length, uint64_t tag) {
    Operation::Part& part = operation.parts[index];
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv = &UcxTransport::on_received;
    param.user_data = &part;
    ucs_status_ptr_t request = ucp_tag_recv_nbx(worker_, buffer, length, tag, kFullMask, &param);
    if (request == nullptr) part.length = length;
    settle(part, request, "receiving from", operation.transfer->peer);
  }

  // What a UCP call returned: done at once, failed, or a request whose callback comes later.
  void settle(Operation::Part& part, ucs_status_ptr_t request, const char* what, int peer) {
    if (request == nullptr) {
      part.done = true;
    } else if (UCS_PTR_IS_ERR(request)) {
      peer_failed(peer, fmt::format("ucx: {} it failed: {}", what,
                                    ucs_status_string(UCS_PTR_STATUS(request))));
    } else {
      part.request = request;
    }
  }

  static void part_done(Operation::Part& part, void* request, ucs_status_t status, size_t length) {
    part.done = true;
    part.status = status;
    part.length = length;
    part.request = nullptr;
    ucp_request_free(request);
    part.operation->owner->queue(part.operation);
  }

  void queue(Operation* operation) {
    if (operation->queued) return;
    operation->queued = true;
    completed_.push(operation);
  }

  // Checks and completes what the callbacks queued; true when a transfer completed.
  bool process_completions() {
    bool completed = false;
    while (!completed_.empty()) {
      Operation& operation = *completed_.pop();
      operation.queued = false;
      if (operation.transfer == nullptr) continue;
      if (advance(operation)) completed = true;
    }
    return completed;
  }

  bool advance(Operation& operation) {
    Transfer& transfer = *operation.transfer;
    const Operation::Part& header = operation.parts[0];
    const Operation::Part& payload = operation.parts[1];
    if (!operation.receive) {
      if (!header.done || !payload.done) return false;
      for (const auto& part : operation.parts) {
        if (part.status != UCS_OK) {
          peer_failed(transfer.peer,
                      fmt::format("ucx: sending to it failed: {}", ucs_status_string(part.status)));
        }
      }
    } else {
      if (header.done && !operation.header_checked) {
        check_header(operation);
        operation.header_checked = true;
      }
      if (!operation.header_checked || !payload.done) return false;
      if (payload.status != UCS_OK || (transfer.bytes > 0 && payload.length != transfer.bytes)) {
        peer_failed(
            transfer.peer,
            fmt::format("ucx: its message of {} to rank {} did not arrive whole ({} of {} bytes: "
                        "{})",
                        describe(transfer.descriptor), rank_, payload.length, transfer.bytes,
                        ucs_status_string(payload.status)));
      }
    }
    transfer.done = transfer.bytes;
    transfer.complete = true;
    release(operation);
    return true;
  }

  void check_header(const Operation& operation) {
    const Transfer& transfer = *operation.transfer;
    const Operation::Part& part = operation.parts[0];
    const FrameHeader& header = operation.header;
    if (part.status != UCS_OK || part.length != sizeof(FrameHeader) || !header.well_formed()) {
      log::warn("ucx: rank {} sent a malformed message header (magic {:#x}, {} bytes: {})",
                transfer.peer, header.magic, part.length, ucs_status_string(part.status));
      throw Error(Status::kPeerLost,
                  fmt::format("rank {} sent a malformed message (magic {:#x}) to rank {}",
                              transfer.peer, header.magic, rank_));
    }
    check_frame(rank_, transfer, header);
  }

  // ---- messages that come before their receive -----------------------------------------------

  // A transfer of `descriptor` is posted: when that starts another collective, the messages that
  // came before their receive are judged against it, as they are again before each sleep.
  void enter(const OpDescriptor& descriptor) {
    if (!enters_another_collective(current_, descriptor)) return;
    current_ = descriptor;
    judge_early_messages();
  }

  // UCX keeps a message that comes before its receive to itself until a receive matches its tag,
  // and a rank whose schedule differs from its peer's may never post one (a broadcast where the
  // others run the hierarchical allreduce). So for every peer reached through UCX, the header of
  // the next message that no receive was posted for yet (tag of message `received`) is taken out
  // of UCX when it is there and judged against the collective this rank is in
  // (check_unexpected_frame; the rings judge theirs themselves). A header that passes is kept for
  // the receive that will be posted for it (post_recv), and judged again when the rank enters
  // another collective; its payload stays in UCX under its own tag for that receive.
  void judge_early_messages() {
    if (current_.sequence == 0) return;  // no collective yet: nothing to judge against
    for (int peer = 0; peer < size_; ++peer) {
      if (shm_.connected(peer)) continue;
      Peer& state = peers_[peer];
      if (!state.early_header) take_early_header(peer, state);
      const std::optional<EarlyHeader>& early = state.early_header;
      if (early && early->status == UCS_OK && early->length == sizeof(FrameHeader) &&
          early->header.well_formed()) {
        check_unexpected_frame(rank_, peer, current_, early->header);
      }
    }
  }

  // Takes the header of message `received` out of UCX if it has arrived. A header is small
  // enough for UCX's eager protocol, where receiving a probed message completes at once; a larger
  // UCX_RNDV_THRESH aside, the wait below costs nothing.
  void take_early_header(int peer, Peer& state) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h message = ucp_tag_probe_nb(
        worker_, message_tag(false, peer, state.received, state.key), kFullMask, 1, &info);
    if (message == nullptr) return;
    EarlyHeader& early = state.early_header.emplace();
    early.sequence = state.received;
    early.length = info.length;
    ucp_request_param_t param{};  // no callback: waited for here
    early.status = wait_request(
        ucp_tag_msg_recv_nbx(worker_, &early.header, sizeof(FrameHeader), message, &param),
        Deadline(timeout_s_));
    if (early.status == UCS_INPROGRESS) {
      peer_failed(peer, fmt::format("ucx: a message header from it did not arrive within {} s",
                                    timeout_s_));
    }
  }

  // The header part of a receive whose header came early: done as UCX would have done it, and
  // checked with the payload by advance() as every header is.
  void use_early_header(Operation& operation, Peer& peer) {
    Operation::Part& part = operation.parts[0];
    operation.header = peer.early_header->header;
    part.done = true;
    part.status = peer.early_header->status;
    part.length = peer.early_header->length;
    peer.early_header.reset();
  }

  // ---- control --------------------------------------------------------------------------------

  // Reads the control channel (throws for an ABORT or a lost peer), and fails a wait on a peer
  // that said goodbye and had time enough to deliver what it sent before.
  void serve_control() {
    const auto now = Clock::now();
    next_control_check_ = now + kControlCheckInterval;
    control_.serve();
    for (int peer = 0; peer < size_; ++peer) {
      Peer& state = peers_[peer];
      if (peer == rank_ || !control_.said_goodbye(peer) ||
          (state.outstanding == 0 && shm_.pending(peer) == 0)) {
        continue;
      }
      if (!state.goodbye_seen) state.goodbye_seen = now;
      if (now - *state.goodbye_seen > kGoodbyeGrace) {
        control_.throw_lost(peer,
                            "it destroyed its communicator while this rank still expected "
                            "data");
      }
    }
  }

  // ---- readiness ------------------------------------------------------------------------------

  void make_readiness_set() {
    readiness_ = net::Socket(::epoll_create1(EPOLL_CLOEXEC));
    if (!readiness_.valid()) {
      throw Error(Status::kSystem,
                  fmt::format("ucx: epoll_create1 failed: {}", std::strerror(errno)));
    }
    for (int fd : {event_fd_, control_.fd(), awake_.fd()}) {
      epoll_event event{};
      event.events = EPOLLIN;
      event.data.fd = fd;
      if (::epoll_ctl(readiness_.fd(), EPOLL_CTL_ADD, fd, &event) != 0) {
        throw Error(Status::kSystem, fmt::format("epoll_ctl failed: {}", std::strerror(errno)));
      }
    }
    awake_.set();  // the worker is not armed yet
  }

  // ---- failures and shutdown ------------------------------------------------------------------

  // UCX failed on a message to or from `peer`. That is usually a consequence: the peer failed
  // first (its ABORT may still be in flight) or died (its control socket shows it); report the
  // first cause when there is one.
  [[noreturn]] void peer_failed(int peer, const std::string& why) {
    control_.look_for_abort(peer);
    if (control_.closed(peer) && !control_.said_goodbye(peer)) {
      throw control_.lost(peer, "its connection closed without a goodbye (did it die?)");
    }
    control_.throw_lost(peer, why);  // a PeerLeft when the peer said goodbye
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
      // Forget posted transfers. Receives are cancelled (UCX calls back at once); the worker is not
      // progressed again, so nothing more is written into the caller's buffers.
      for (auto& operation : operations_) {
        if (operation->transfer == nullptr) continue;
        for (auto& part : operation->parts) {
          if (operation->receive && part.request != nullptr) {
            ucp_request_cancel(worker_, part.request);
          }
        }
      }
      for (auto& operation : operations_) operation->transfer = nullptr;
      shm_.forget();
    }
    if (tell_peers) control_.tell_peers(*failure_);
  }

  void rethrow_failure() const {
    if (failure_) throw *failure_;
  }

  bool caller_send_in_flight() const {
    for (const auto& operation : operations_) {
      if (!operation->receive && operation->parts[1].request != nullptr) return true;
    }
    return false;
  }

  // Waits (bounded) until every operation this worker started has left it, including UCX's own
  // protocol messages, such as the acknowledgement that lets a rendezvous sender complete.
  void flush_worker() noexcept {
    if (!worker_) return;
    ucp_request_param_t param{};
    ucs_status_ptr_t request = ucp_worker_flush_nbx(worker_, &param);
    if (wait_request(request, Deadline(kShutdownSeconds)) != UCS_OK) {
      log::warn("ucx: rank {} could not flush its messages within {} s", rank_, kShutdownSeconds);
    }
  }

  // Progresses until request completes or the deadline; its status, UCS_INPROGRESS when the
  // deadline came first (UCX then frees the request when it completes).
  ucs_status_t wait_request(ucs_status_ptr_t request, const Deadline& deadline) noexcept {
    if (request == nullptr) return UCS_OK;
    if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
    ucs_status_t status;
    while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS && !deadline.expired()) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(request);
    return status;
  }

  void destroy_ucx(bool clean) noexcept {
    if (worker_) {
      if (clean) {
        // The endpoints go with the worker. Closing them one by one in flush mode would wait for
        // peers that may have exited already, and UCX reports that as an error.
        ucp_worker_destroy(worker_);
      } else {
        // Requests to a peer that is gone cannot be finished or cancelled (see the top of this
        // file): UCX's warning that they were never returned says nothing the user can act on.
        ucs_log_level_t level = ucs_global_opts.log_component.log_level;
        ucs_global_opts.log_component.log_level = std::min(level, UCS_LOG_LEVEL_ERROR);
        ucp_worker_destroy(worker_);
        ucs_global_opts.log_component.log_level = level;
      }
      worker_ = nullptr;
    }
    if (context_) {
      ucp_cleanup(context_);
      context_ = nullptr;
    }
  }

  int rank_;
  int size_;
  std::vector<Peer> peers_;
  ControlChannel control_;
  ShmChannel shm_;  // after control_, which it rings doorbells through
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  AwakeFlag awake_;
  net::Socket readiness_;
  Spinner spinner_;
  int outstanding_ = 0;  // UCX operations posted and not yet complete, over every peer
  double timeout_s_;                // KOLO_TIMEOUT
  int max_sleep_ms_ = kMaxSleepMs;  // 1 once a wake-up was found missing (missed_wake_up)
  std::vector<std::unique_ptr<Operation>> operations_;
  Operation* free_ = nullptr;
  IntrusiveFifo<Operation> completed_;
  Clock::time_point next_control_check_{};
  OpDescriptor current_;  // of the latest posted transfer of a numbered collective (enter)
  std::optional<Error> failure_;
};

}  // namespace

std::unique_ptr<Transport> make_ucx_transport(const TransportSettings& settings, StoreClient& store,
                                              int rank, int size, uint64_t context) {
  return std::make_unique<UcxTransport>(settings, store, rank, size, context);
}

}  // namespace kolo
