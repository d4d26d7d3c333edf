// Recursive-doubling allreduce, for small buffers: log2 N exchanges instead of the ring's 2(N-1)
// steps.
//
// Let P be the largest power of two <= N and E = N - P. Each rank turns its input into a partial
// (loaded in the accumulator type, prescaled), then:
//
//   fold      each rank r >= P sends its partial to r - P, which combines it into its own;
//   exchange  for d = 1, 2, 4, ..., P/2, ranks r < P swap partials with r XOR d and combine;
//   finish    ranks r < P finish their partial into recvbuf (AVG's division, the postscale and
//             the rounding of half types, once), and each rank r < E sends the finished result to
//             r + P.
//
// Every message holds the whole buffer: the time is (log2 P + 2·[E > 0])·a + the same times
// S/B, against the ring's 2(N-1)·a + 2(N-1)/N · S/B, so it wins while S is small (where is
// measured, src/ring/algorithms.hpp).
//
// Same result on every rank. At each exchange both partners compute lower OP upper, the partial
// of the lower rank first, so they compute the same expression and, from the same bits, get the
// same bits (IEEE +, *, min and max are deterministic given the operand order). After the last
// exchange every rank r < P holds bitwise the same partial, finishes it the same way, and the
// ranks r >= P receive it. Partials combine in the accumulator type (reduce_combine with the
// accumulator as dtype and no prescale); the finish combines the partial with the identity of the
// op (-0 for sums, 1 for products, +inf/-inf or the integer limits for min/max), which leaves every
// value, NaN included, unchanged, so that reduce_finish can do the rest.
//
// Agreement: every rank hears from its partner at every step (or from its fold partner), and a
// rank's contribution reaches the others only through ranks that checked the message it came in;
// a rank that disagrees is found out by the first rank it sends to, and nobody can finish without
// its contribution, so no rank returns success while another reports KOLO_ERR_MISMATCH.
//
// One shot. Where kolo's shared-memory rings link every pair (Transport::
// through_memory_everywhere(), agreed by every rank), N <= kOneShotMaxRanks and a rank would send
// at most kOneShotMaxBytes, every rank sends its partial to every other rank at once and computes
// the tree above by itself: the same combines of the same partials in the same order, so the same
// bits as the exchanges give, after one round of messages instead of log2 P (+ 2 with a fold).
// With more ranks than cores the exchanges wait for each partner in turn to be scheduled, which is
// most of a small allreduce's time; one round waits once. Over sockets N - 1 messages cost more
// than the rounds they save, and larger buffers multiply the bytes (see algorithms.hpp for the
// measurements). Agreement holds as before: every rank checks the message of every other rank,
// and the messages say Algorithm::kOneShot, so that a rank built with other limits, which
// exchanges instead, reports KOLO_ERR_MISMATCH rather than taking a partial for a sum of two.
#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "ring/algorithms.hpp"
#include "ring/reducing_call.hpp"
#include "ring/ring.hpp"

namespace kolo {
namespace {

template <typename T>
void fill(std::byte* buffer, uint64_t count, T value) {
  for (uint64_t i = 0; i < count; ++i) std::memcpy(buffer + i * sizeof(T), &value, sizeof(T));
}

template <typename T>
void fill_integer_identity(std::byte* buffer, uint64_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return fill(buffer, count, std::numeric_limits<T>::max());
    case ReduceOp::kMax:
      return fill(buffer, count, std::numeric_limits<T>::min());
    case ReduceOp::kProd:
      return fill(buffer, count, T{1});
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return fill(buffer, count, T{0});
  }
}

// The identity of op in float bits (see fill_identity in ring/ring.hpp).
template <typename T>
void fill_float_identity(std::byte* buffer, uint64_t count, ReduceOp op, T one, T infinity,
                         T negative_infinity, T negative_zero) {
  switch (op) {
    case ReduceOp::kMin:
      return fill(buffer, count, infinity);
    case ReduceOp::kMax:
      return fill(buffer, count, negative_infinity);
    case ReduceOp::kProd:
      return fill(buffer, count, one);
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return fill(buffer, count, negative_zero);
  }
}

}  // namespace

void fill_identity(std::byte* buffer, uint64_t count, DataType dtype, ReduceOp op) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr double kInfDouble = std::numeric_limits<double>::infinity();
  switch (dtype) {
    case DataType::kFloat32:
      return fill_float_identity(buffer, count, op, 1.0f, kInf, -kInf, -0.0f);
    case DataType::kFloat64:
      return fill_float_identity(buffer, count, op, 1.0, kInfDouble, -kInfDouble, -0.0);
    case DataType::kFloat16:  // IEEE binary16 bits
      return fill_float_identity<uint16_t>(buffer, count, op, 0x3c00, 0x7c00, 0xfc00, 0x8000);
    case DataType::kBFloat16:
      return fill_float_identity<uint16_t>(buffer, count, op, 0x3f80, 0x7f80, 0xff80, 0x8000);
    case DataType::kInt8:
      return fill_integer_identity<int8_t>(buffer, count, op);
    case DataType::kUInt8:
      return fill_integer_identity<uint8_t>(buffer, count, op);
    case DataType::kInt16:
      return fill_integer_identity<int16_t>(buffer, count, op);
    case DataType::kInt32:
      return fill_integer_identity<int32_t>(buffer, count, op);
    case DataType::kInt64:
      return fill_integer_identity<int64_t>(buffer, count, op);
  }
}

namespace {

// The one-shot form (see the top of the file): `all` holds room for every rank's partial, this
// rank's already in its place.
void one_shot(Ring& ring, const OpDescriptor& call_op, const ReducingCall& call, std::byte* all,
              size_t partial_bytes, int powers) {
  OpDescriptor op = call_op;
  op.algorithm = Algorithm::kOneShot;
  const int n = ring.size();
  const int r = ring.rank();
  const ReduceSpec partial_spec{accumulator_type(op.dtype), op.op, 1.0, 1.0, n};
  Transfer* transfers = ring.transfers(2 * static_cast<size_t>(n));  // [peer]: in, [n + peer]: out
  auto slot = [&](int rank) { return all + partial_bytes * static_cast<size_t>(rank); };
  // Sends first, each to the next rank up, so that no peer is every rank's first.
  for (int step = 1; step < n; ++step) {
    const int peer = (r + step) % n;
    transfers[n + peer].reset(peer, op, slot(r), partial_bytes);
    ring.transport().post_send(transfers[n + peer]);
  }
  for (int step = 1; step < n; ++step) {
    const int peer = (r - step + n) % n;
    transfers[peer].reset(peer, op, slot(peer), partial_bytes);
    ring.transport().post_recv(transfers[peer]);
  }
  for (int step = 1; step < n; ++step) {
    for (int peer : {(r - step + n) % n, (r + step) % n + n}) {
      while (!transfers[peer].complete) ring.wait(op, peer % n);
      ring.made_progress();
    }
  }
  // The tree of the exchanges: the fold, then each distance, the lower rank's partial first.
  for (int low = 0; low < n - powers; ++low) {
    reduce_combine(slot(low), slot(low), slot(low + powers), op.count, partial_spec);
  }
  for (int distance = 1; distance < powers; distance *= 2) {
    for (int low = 0; low < powers; low += 2 * distance) {
      reduce_combine(slot(low), slot(low), slot(low + distance), op.count, partial_spec);
    }
  }
  const size_t element = dtype_size(op.dtype);
  std::byte* identity = ring.buffer(Ring::kScratch, std::max<size_t>(1, op.count * element));
  fill_identity(identity, op.count, op.dtype, op.op);
  const ReduceSpec finish_spec{op.dtype, op.op, 1.0, op.postscale, n};
  reduce_finish(call.output, slot(0), identity, op.count, finish_spec);
}

}  // namespace

void recursive_doubling_allreduce(Ring& ring, const OpDescriptor& op, const void* sendbuf,
                                  void* recvbuf) {
  const int n = ring.size();
  const int r = ring.rank();
  const ReducingCall call(ring, op, sendbuf, recvbuf, op.count);
  if (call.finished) return;
  // Two partials combine as accumulator-typed values, with nothing left to prescale.
  const ReduceSpec partial_spec{accumulator_type(op.dtype), op.op, 1.0, 1.0, n};
  const size_t element = dtype_size(op.dtype);
  const size_t accumulator = accumulator_size(op.dtype);
  const size_t partial_bytes = op.count * accumulator;
  int powers = 1;
  while (powers * 2 <= n) powers *= 2;
  const int extra = n - powers;

  std::byte* mine = ring.buffer(Ring::kPartials, std::max<size_t>(1, partial_bytes));
  std::byte* theirs = ring.buffer(Ring::kReceiveSlots, std::max<size_t>(1, partial_bytes));
  // Posts a send and/or a receive with one peer and waits for both. Buffers may be null when
  // empty (count 0), so what to post is said explicitly. The send goes first: posting a receive
  // already looks for the peer's message (a cache line fetched over shared memory), and the
  // peer waits for this rank's message meanwhile.
  enum Direction { kSend = 1, kReceive = 2, kBoth = 3 };
  auto exchange = [&](int peer, Direction direction, const void* send, size_t send_bytes,
                      void* receive, size_t receive_bytes) {
    Transfer* transfers = ring.transfers(2);
    if (direction & kSend) {
      transfers[1].reset(peer, op, const_cast<void*>(send), send_bytes);
      ring.transport().post_send(transfers[1]);
    }
    if (direction & kReceive) {
      transfers[0].reset(peer, op, receive, receive_bytes);
      ring.transport().post_recv(transfers[0]);
    }
    for (int i = 0; i < 2; ++i) {
      if (!(direction & (i == 0 ? kReceive : kSend))) continue;
      while (!transfers[i].complete) ring.wait(op, peer);
      ring.made_progress();
    }
  };
  ring.begin();

  if (n > 2 && n <= kOneShotMaxRanks &&
      partial_bytes * static_cast<uint64_t>(n - 1) <= kOneShotMaxBytes &&
      ring.transport().through_memory_everywhere()) {
    std::byte* all = ring.buffer(Ring::kReceiveSlots, std::max<size_t>(1, partial_bytes * n));
    std::byte* own = all + partial_bytes * static_cast<size_t>(r);
    // As the exchanges start: a rank r >= P hands over its input as it is when that already is a
    // partial.
    if (r >= powers && accumulator == element && op.prescale == 1.0) {
      if (partial_bytes > 0) std::memcpy(own, call.input, partial_bytes);
    } else {
      reduce_load(own, call.input, op.count, call.spec);
    }
    one_shot(ring, op, call, all, partial_bytes, powers);
    return;
  }

  if (r >= powers) {
    // Hand our contribution to r - P and wait for the result. The input goes as it is when it
    // already is a partial (no conversion, no prescale).
    const void* contribution = call.input;
    if (accumulator != element || op.prescale != 1.0) {
      reduce_load(mine, call.input, op.count, call.spec);
      contribution = mine;
    }
    exchange(r - powers, kSend, contribution, partial_bytes, nullptr, 0);
    exchange(r - powers, kReceive, nullptr, 0, call.output, op.count * element);
    return;
  }

  // Two ranks whose inputs already are partials (the element type is its own accumulator, no
  // prescale): each sends its input as it is and finishes lower OP upper straight into recvbuf,
  // combine and finish in one pass. The same bits as below, where the finish combines the partial
  // with the op's identity, which leaves every value unchanged.
  if (n == 2 && accumulator == element && op.prescale == 1.0) {
    const int partner = r ^ 1;
    exchange(partner, kBoth, call.input, partial_bytes, theirs, partial_bytes);
    const ReduceSpec finish_spec{op.dtype, op.op, 1.0, op.postscale, n};
    reduce_finish(call.output, r == 0 ? call.input : theirs, r == 0 ? theirs : call.input,
                  op.count, finish_spec);
    return;
  }

  reduce_load(mine, call.input, op.count, call.spec);
  if (r < extra) {
    exchange(r + powers, kReceive, nullptr, 0, theirs, partial_bytes);
    reduce_combine(mine, mine, theirs, op.count, partial_spec);
  }
  for (int distance = 1; distance < powers; distance *= 2) {
    const int partner = r ^ distance;
    exchange(partner, kBoth, mine, partial_bytes, theirs, partial_bytes);
    if (r < partner) {
      reduce_combine(mine, mine, theirs, op.count, partial_spec);
    } else {
      reduce_combine(theirs, theirs, mine, op.count, partial_spec);
      std::swap(mine, theirs);
    }
  }
  std::byte* identity = ring.buffer(Ring::kScratch, std::max<size_t>(1, op.count * element));
  fill_identity(identity, op.count, op.dtype, op.op);
  const ReduceSpec finish_spec{op.dtype, op.op, 1.0, op.postscale, n};
  reduce_finish(call.output, mine, identity, op.count, finish_spec);
  if (r < extra) exchange(r + powers, kSend, call.output, op.count * element, nullptr, 0);
}

}  // namespace kolo
