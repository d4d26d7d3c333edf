// Elastic jobs under a launcher: kolo_elastic_update (capi/kolo.h states the contract).
//
// `kolorun --elastic --host-discovery-script S` serves a store of its own, the driver, at
// KOLO_ELASTIC_ADDR (authenticated with the job secret), and tells every rank its slot
// (KOLO_ELASTIC_SLOT). One call, collective over comm:
//   1. Rank 0 gathers every member's slot (one allgather of fixed-size records), takes a request
//      number from the driver (an ADD), writes the slots in rank order under it and waits for the
//      plan, bounded by KOLO_TIMEOUT: "join <n> leave <rank> <rank> ...", the ranks of comm whose
//      slots the driver removes and how many newcomers it will start.
//   2. Rank 0 broadcasts the plan, or the error it met, over comm, so that every rank acts on the
//      same one. No change, or an error here: comm is untouched and usable.
//   3. Ranks leave through a split: the leaving ones pass no colour and are done (leaving = 1).
//      When rank 0 leaves, whose process serves the split's store, those that stay shrink the
//      split at once, which gives them a store of their own (its coordinator's).
//   4. Newcomers join through a growth of what is left: its rank 0 makes the invitation and writes
//      it under the request number, the driver starts the newcomers with KOLO_INVITATION set, and
//      every member calls grow. The members keep their order; the newcomers follow.
// A failed growth (a newcomer that died while joining, none that came in time) fails on every
// member as kolo_comm_grow does; the communicator the call was made on is then broken, and
// kolo_comm_shrink on it gives the members that stayed a working one again.
#include "comm/elastic.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <vector>

#include "bootstrap/store.hpp"
#include "core/log.hpp"
#include "kolo/dtype.hpp"
#include "kolo/status.hpp"
#include "net/socket.hpp"

namespace kolo {
namespace {

constexpr size_t kSlotBytes = 128;     // a slot's name in the members' allgather, NUL included
constexpr size_t kMessageBytes = 512;  // rank 0's error, broadcast to the others
constexpr int kMaxJoin = 1 << 20;

// The process keeps one connection to the driver (authenticating costs a key derivation), made
// by whichever of its communicators needs it first.
std::mutex driver_mutex;
std::unique_ptr<StoreClient> driver_client;
std::string driver_address;

StoreClient& driver(const Communicator& comm, const std::string& address) {
  if (!driver_client || driver_address != address) {
    driver_client.reset();
    driver_client =
        std::make_unique<StoreClient>(net::parse_endpoint(address, "KOLO_ELASTIC_ADDR"),
                                      comm.config().secret, comm.rank(), comm.config().timeout_s);
    driver_address = address;
  }
  return *driver_client;
}

struct Plan {
  long long request = 0;
  int join = 0;
  std::vector<int> leave_flags;  // one per rank of comm
};

// "join 2 leave 0 3" for a comm of `size` ranks; what is wrong with it otherwise.
Plan parse_plan(const std::string& text, int size) {
  Plan plan;
  plan.leave_flags.assign(static_cast<size_t>(size), 0);
  std::istringstream words(text);
  std::string word;
  long long join = -1;
  if (!(words >> word) || word != "join" || !(words >> join) || join < 0 || join > kMaxJoin ||
      !(words >> word) || word != "leave") {
    throw Error(Status::kInternal,
                fmt::format("the driver's plan '{}' is not 'join <n> leave <ranks>'", text));
  }
  plan.join = static_cast<int>(join);
  for (long long rank; words >> rank;) {
    if (rank < 0 || rank >= size) {
      throw Error(Status::kInternal,
                  fmt::format("the driver's plan '{}' names rank {} of a communicator of {}", text,
                              rank, size));
    }
    plan.leave_flags[static_cast<size_t>(rank)] = 1;
  }
  if (!words.eof()) {
    throw Error(Status::kInternal, fmt::format("the driver's plan '{}' has a word that is not a "
                                               "rank",
                                               text));
  }
  return plan;
}

// Rank 0: asks the driver for the plan for these members.
Plan ask_driver(const Communicator& comm, const std::string& address,
                const std::vector<std::string>& slots) {
  std::lock_guard lock(driver_mutex);
  StoreClient& client = driver(comm, address);
  Plan plan;
  plan.request = client.add(kElasticRequestCounter, 1);
  std::string members;
  for (const std::string& slot : slots) members += (members.empty() ? "" : " ") + slot;
  client.set_string(elastic_key("request", plan.request), members);
  std::string text = client.get_string(elastic_key("plan", plan.request));
  Plan parsed = parse_plan(text, comm.size());
  parsed.request = plan.request;
  return parsed;
}

}  // namespace

ElasticOutcome elastic_update(Communicator& comm) {
  ElasticOutcome outcome;
  outcome.old_size = outcome.new_size = comm.size();
  const char* address = std::getenv("KOLO_ELASTIC_ADDR");
  if (address == nullptr || *address == '\0') return outcome;
  // A missing or malformed slot travels as "-": rank 0 then fails every rank, naming this one.
  const char* slot_variable = std::getenv("KOLO_ELASTIC_SLOT");
  const std::string_view given = slot_variable ? slot_variable : "";
  const bool valid = !given.empty() && given.size() < kSlotBytes &&
                     given.find_first_of(" \t\n") == std::string_view::npos;
  const std::string slot(valid ? given : std::string_view("-"));

  // 1. Every member's slot, to rank 0.
  std::vector<char> mine(kSlotBytes, '\0');
  std::memcpy(mine.data(), slot.data(), slot.size());
  std::vector<char> all(kSlotBytes * static_cast<size_t>(comm.size()), '\0');
  comm.allgather(mine.data(), all.data(), kSlotBytes, DataType::kUInt8);

  // 2. Rank 0 asks, everyone learns: [status, join, leave flags...] and rank 0's message.
  std::vector<int32_t> header(2 + static_cast<size_t>(comm.size()), 0);
  std::vector<char> message(kMessageBytes, '\0');
  Plan plan;
  if (comm.rank() == 0) {
    std::vector<std::string> slots;
    std::string unnamed;
    for (int rank = 0; rank < comm.size(); ++rank) {
      slots.emplace_back(all.data() + kSlotBytes * static_cast<size_t>(rank));
      if (slots.back() == "-" && unnamed.empty()) unnamed = std::to_string(rank);
    }
    try {
      if (!unnamed.empty()) {
        throw Error(Status::kConfig,
                    fmt::format("rank {} has no valid KOLO_ELASTIC_SLOT (set by kolorun --elastic "
                                "beside KOLO_ELASTIC_ADDR)",
                                unnamed));
      }
      plan = ask_driver(comm, address, slots);
      header[1] = plan.join;
      for (size_t i = 0; i < plan.leave_flags.size(); ++i) header[2 + i] = plan.leave_flags[i];
    } catch (const Error& error) {
      header[0] = static_cast<int32_t>(error.status());
      std::string text = fmt::format(
          "kolo_elastic_update: rank 0 got no plan from the driver at "
          "KOLO_ELASTIC_ADDR={}: {}",
          address, error.what());
      std::strncpy(message.data(), text.c_str(), kMessageBytes - 1);
    }
  }
  comm.broadcast(header.data(), header.size(), DataType::kInt32, 0);
  if (header[0] != 0) {
    comm.broadcast(message.data(), kMessageBytes, DataType::kUInt8, 0);
    throw Error(static_cast<Status>(header[0]), std::string(message.data()));
  }
  const int join = header[1];
  int leaving = 0;
  for (int rank = 0; rank < comm.size(); ++rank) leaving += header[2 + static_cast<size_t>(rank)];
  if (join == 0 && leaving == 0) return outcome;
  // Rank 0's request number, for the invitation's key: every rank needs it only if it becomes the
  // rank 0 of those that stay, so it travels with the plan.
  long long request = plan.request;
  comm.broadcast(&request, 1, DataType::kInt64, 0);

  outcome.changed = true;
  outcome.left = leaving;
  outcome.joined = join;
  const bool this_leaves = header[2 + static_cast<size_t>(comm.rank())] != 0;

  // 3. Leaving: a split without the leaving ranks.
  std::unique_ptr<Communicator> staying;
  if (leaving > 0) {
    staying = comm.split(this_leaves ? -1 : 0, comm.rank());
    if (this_leaves) {
      outcome.leaving = true;
      outcome.new_size = 0;
      outcome.joined = join;
      log::info("kolo_elastic_update: this rank's slot {} was removed; it leaves", slot);
      return outcome;
    }
  }
  // A split's store is served by the process of its parent's rank 0: when that rank leaves, a
  // shrink of the split (all alive, all calling) gives those that stay a store of their own.
  if (staying && header[2] != 0) staying = staying->shrink();
  Communicator& members = staying ? *staying : comm;

  // 4. Joining: an invitation for the driver, then the growth.
  if (join > 0) {
    if (members.rank() == 0) {
      std::string invitation = members.invite();
      std::lock_guard lock(driver_mutex);
      driver(members, address).set_string(elastic_key("invitation", request), invitation);
    }
    outcome.comm = members.grow(members.size() + join);
  } else {
    outcome.comm = std::move(staying);
  }
  outcome.new_size = outcome.comm->size();
  return outcome;
}

}  // namespace kolo
