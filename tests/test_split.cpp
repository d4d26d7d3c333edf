// Communicator::split and the rendezvous store (comm/split.cpp): a job of two ranks run as threads
// of this process, and a client of its store that looks at the keys a split leaves behind.
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/store.hpp"
#include "comm/communicator.hpp"
#include "core/config.hpp"
#include "job.hpp"
#include "kolo/status.hpp"
#include "net/socket.hpp"
#include "process.hpp"

namespace {

using Communicators = std::vector<std::unique_ptr<kolo::Communicator>>;

// Runs body(rank) on one thread per rank and waits for all; the first exception is rethrown.
template <typename Body>
void on_every_rank(int size, Body body) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

Communicators start_world(int size, const std::string& addr) {
  Communicators world(static_cast<size_t>(size));
  on_every_rank(size, [&](int rank) {
    kolo::ConfigOverrides overrides;
    overrides.rank = rank;
    overrides.size = size;
    overrides.addr = addr;
    overrides.secret = kolo::test::kTestSecret;
    overrides.timeout_s = 30;
    world[rank] = std::make_unique<kolo::Communicator>(overrides);
  });
  return world;
}

Communicators split_all(const Communicators& parents, int color) {
  Communicators children(parents.size());
  on_every_rank(static_cast<int>(parents.size()),
                [&](int rank) { children[rank] = parents[rank]->split(color, rank); });
  return children;
}

std::string local_address() {
  return "127.0.0.1:" + std::to_string(kolo::test::free_tcp_port());
}

}  // namespace

TEST_CASE("a split erases the store keys it wrote and no others under its prefix", "[split]") {
  // A split's context follows from its parent's and the call's place among the parent's calls:
  // the same split in a job that did the same before it gets the same context. The first job
  // shows which one; in the second, a key under that context's prefix exists before the split,
  // as the GPU set-up's keys of a communicator do when its rank 0 erases the split's own.
  uint64_t context = 0;
  {
    Communicators world = start_world(2, local_address());
    Communicators copy = split_all(world, 0);
    context = copy[0]->context();
    REQUIRE(copy[1]->context() == context);
  }
  const std::string addr = local_address();
  Communicators world = start_world(2, addr);
  kolo::StoreClient observer(kolo::net::parse_endpoint(addr, "KOLO_ADDR"), kolo::test::kTestSecret, 0,
                       5.0);
  const std::string prefix = kolo::store_key(context, "");
  const std::string other = prefix + "gpu/device/1";
  observer.set_string(other, "written before the split's erase");
  Communicators copy = split_all(world, 0);
  REQUIRE(copy[0]->context() == context);
  INFO("the split must leave '" << other << "' alone: it did not write it");
  CHECK(observer.get_string(other) == "written before the split's erase");
  // Everything the split's members wrote is gone: the other key is the only one left.
  CHECK(observer.erase_prefix(prefix) == 1);
  // The new communicator works (Catch2's checks are made on this thread alone).
  std::vector<int> values = {1, 2};
  on_every_rank(2, [&](int rank) {
    copy[rank]->allreduce(&values[rank], &values[rank], 1, kolo::DataType::kInt32,
                          kolo::ReduceOp::kSum);
  });
  CHECK(values == std::vector<int>{3, 3});
}
