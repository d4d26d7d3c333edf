#include "ring/ring.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>

namespace kolo {

// The transport as a subset of its ranks sees it: peer i of the subset is ranks[i] of the whole.
// Posting rewrites the peer; everything else is the whole transport's, failures included.
class SubsetTransport final : public Transport {
 public:
  SubsetTransport(Transport& whole, std::vector<int> ranks)
      : whole_(whole), ranks_(std::move(ranks)) {}

  const char* name() const override { return whole_.name(); }
  void post_send(Transfer& transfer) override {
    transfer.peer = ranks_[transfer.peer];
    whole_.post_send(transfer);
  }
  void post_recv(Transfer& transfer) override {
    transfer.peer = ranks_[transfer.peer];
    whole_.post_recv(transfer);
  }
  void progress(const Deadline& deadline) override { whole_.progress(deadline); }
  void abort(const Error& error) noexcept override { whole_.abort(error); }
  const Error* failure() const override { return whole_.failure(); }
  int readiness_fd() const override { return whole_.readiness_fd(); }
  bool through_memory(int peer) const override { return whole_.through_memory(ranks_[peer]); }
  bool through_memory_everywhere() const override { return whole_.through_memory_everywhere(); }

 private:
  Transport& whole_;
  std::vector<int> ranks_;
};

HostMap::HostMap(const std::vector<int>& host_of) {
  std::map<int, int> number;  // the caller's host number -> ours
  for (size_t rank = 0; rank < host_of.size(); ++rank) {
    auto [entry, added] = number.emplace(host_of[rank], static_cast<int>(leaders_.size()));
    if (added) {
      leaders_.push_back(static_cast<int>(rank));
      ranks_on_.emplace_back();
    }
    host_of_.push_back(entry->second);
    local_index_.push_back(static_cast<int>(ranks_on_[entry->second].size()));
    ranks_on_[entry->second].push_back(static_cast<int>(rank));
  }
  shape_.hosts = std::max<int>(1, static_cast<int>(leaders_.size()));
  if (!ranks_on_.empty()) {
    const auto [fewest, most] =
        std::minmax_element(ranks_on_.begin(), ranks_on_.end(),
                            [](const auto& a, const auto& b) { return a.size() < b.size(); });
    shape_.smallest_host = static_cast<int>(fewest->size());
    shape_.largest_host = static_cast<int>(most->size());
  }
  // Recursive doubling's steps (ring/allreduce_recursive_doubling.cpp), and which of them cross
  // between hosts, over all ranks and over the leaders.
  auto network_steps = [](int n, const std::function<bool(int, int)>& apart) {
    int powers = 1;
    while (powers * 2 <= n) powers *= 2;
    int steps = 0;
    bool fold_crosses = false;  // the fold, r + P -> r, and the final r -> r + P
    for (int r = powers; r < n; ++r) fold_crosses = fold_crosses || apart(r, r - powers);
    steps += fold_crosses ? 2 : 0;
    for (int distance = 1; distance < powers; distance *= 2) {
      bool crosses = false;
      for (int r = 0; r < powers; ++r) crosses = crosses || apart(r, r ^ distance);
      steps += crosses ? 1 : 0;
    }
    return steps;
  };
  const int ranks = static_cast<int>(host_of_.size());
  shape_.flat_network_steps =
      network_steps(ranks, [&](int a, int b) { return host_of_[a] != host_of_[b]; });
  shape_.hierarchical_network_steps = network_steps(shape_.hosts, [](int, int) { return true; });
}

std::vector<int> HostMap::at_local_index(int local_index) const {
  std::vector<int> ranks;
  for (const std::vector<int>& host : ranks_on_) {
    if (local_index < static_cast<int>(host.size())) ranks.push_back(host[local_index]);
  }
  return ranks;
}

Ring::Ring(Transport& transport, int rank, int size, size_t segment_bytes, double timeout_s)
    : Ring(transport, rank, size, segment_bytes, timeout_s, {}) {}

Ring::Ring(Transport& transport, int rank, int size, size_t segment_bytes, double timeout_s,
           std::vector<int> ranks)
    : transport_(transport),
      rank_(rank),
      size_(size),
      segment_bytes_(segment_bytes),
      timeout_s_(timeout_s),
      deadline_(timeout_s),
      ranks_(std::move(ranks)),
      hosts_(std::vector<int>(static_cast<size_t>(size), 0)) {}

Ring::~Ring() = default;
Ring::Subring::~Subring() = default;

void Ring::Subring::reset() {
  ring.reset();
  transport.reset();
}

void Ring::set_allreduce_placement(AllreduceMode mode, HostMap hosts) {
  allreduce_mode_ = mode;
  hosts_ = std::move(hosts);
  for (Subring* subring : {&leaders_, &local_, &cross_}) subring->reset();
}

Ring& Ring::subring(Subring& subring, const std::vector<int>& ranks, int position) {
  if (!subring.ring) {
    std::vector<int> names;
    for (int rank : ranks) names.push_back(rank_name(rank));
    subring.transport = std::make_unique<SubsetTransport>(transport_, ranks);
    subring.ring.reset(new Ring(*subring.transport, position, static_cast<int>(ranks.size()),
                                segment_bytes_, timeout_s_, std::move(names)));
    subring.ring->waiting_for_ = waiting_for_;
  }
  return *subring.ring;
}

Ring& Ring::leaders() {
  return subring(leaders_, hosts_.leaders(), hosts_.host_of(rank_));
}

Ring& Ring::local() {
  return subring(local_, hosts_.ranks_on(hosts_.host_of(rank_)), hosts_.local_index(rank_));
}

Ring& Ring::cross() {
  const std::vector<int> ranks = hosts_.at_local_index(hosts_.local_index(rank_));
  const auto position = std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin();
  return subring(cross_, ranks, static_cast<int>(position));
}

std::byte* Ring::buffer(Buffer which, size_t bytes) {
  if (bytes > buffers_[which].size()) {
    buffers_[which].release();  // first: the old and new buffer need not coexist
    buffers_[which] = PageBuffer(bytes);
  }
  return buffers_[which].data();
}

void IncomingReduction::attach(Transfer& transfer) {
  transfer.sink = [](void* context, size_t offset, const void* piece, size_t length) {
    static_cast<const IncomingReduction*>(context)->apply(offset, piece, length);
  };
  transfer.sink_context = this;
  transfer.sink_grain = accumulator_size(spec->dtype);
}

void IncomingReduction::apply(size_t offset, const void* incoming, size_t bytes) const {
  const size_t accumulator = accumulator_size(spec->dtype);
  const size_t element = dtype_size(spec->dtype);
  const size_t first = offset / accumulator;
  const size_t count = bytes / accumulator;
  if (finish) {
    reduce_finish(result + first * element, incoming, own + first * element, count, *spec);
  } else {
    reduce_combine(result + first * accumulator, incoming, own + first * element, count, *spec);
  }
}

Transfer* Ring::transfers(size_t count) {
  if (transfers_.size() < count) transfers_.resize(count);
  for (size_t i = 0; i < count; ++i) transfers_[i] = Transfer{};
  return transfers_.data();
}

void Ring::wait(const OpDescriptor& op, int waiting_for) {
  waiting_for_->store(rank_name(waiting_for), std::memory_order_relaxed);
  if (restart_clock_) {
    deadline_ = Deadline(timeout_s_);
    restart_clock_ = false;
  } else if (deadline_.expired()) {
    Error error(Status::kTimeout,
                fmt::format("{} timed out on rank {}: nothing arrived from or went to rank {} for "
                            "{} s (KOLO_TIMEOUT)",
                            describe(op), rank_name(rank_), rank_name(waiting_for), timeout_s_));
    transport_.abort(error);
    throw error;
  }
  transport_.progress(deadline_);
}

}  // namespace kolo
