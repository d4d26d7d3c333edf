// Ranks as threads of one test process, each with its own transport and ring, for tests of the
// ring schedules over real transports (test_ring_pieces, test_recursive_doubling).
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/store.hpp"
#include "core/op_descriptor.hpp"
#include "ring/ring.hpp"
#include "transport/transport.hpp"

namespace ring_threads {

// Random elements that are finite in every dtype used here (no NaN, whose bits may vary).
inline std::vector<std::byte> random_elements(kolo::DataType dtype, uint64_t count, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<std::byte> bytes(count * kolo::dtype_size(dtype));
  for (uint64_t i = 0; i < count; ++i) {
    const double value = static_cast<double>(random() % 2001) / 250.0 - 4.0;
    if (dtype == kolo::DataType::kFloat32) {
      const float f = static_cast<float>(value);
      std::memcpy(bytes.data() + i * 4, &f, 4);
    } else if (dtype == kolo::DataType::kFloat64) {
      std::memcpy(bytes.data() + i * 8, &value, 8);
    } else {  // float16: sign, an exponent of 2^-6..2^4, any mantissa
      const uint16_t half = static_cast<uint16_t>(((random() & 1) << 15) |
                                                  ((9 + random() % 11) << 10) | (random() & 0x3ff));
      std::memcpy(bytes.data() + i * 2, &half, 2);
    }
  }
  return bytes;
}

// Whether this build has `transport` (UCX is optional).
inline bool built_with(const std::string& transport) {
  for (const auto& entry : kolo::transport_registry()) {
    if (transport == entry.name) return true;
  }
  return false;
}

// Runs `body(rank, ring)` on each of `ranks` ranks, each on its own thread with its own transport
// (of `settings`, given its transport and shm; the rest is filled here) and ring, and checks that
// no rank threw.
template <typename Body>
void on_every_rank(int ranks, kolo::TransportSettings settings, size_t segment_bytes, Body body) {
  const char* secret = "ring-threads-secret";
  const uint64_t context = 0x91ece5;
  kolo::StoreServer server({"127.0.0.1", 0}, secret);
  settings.addr = server.endpoint().to_string();
  settings.secret = secret;
  settings.timeout_s = 30;
  settings.socket_ifname = "=lo";
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        kolo::StoreClient client(server.endpoint(), secret, rank, settings.timeout_s);
        std::unique_ptr<kolo::Transport> links =
            kolo::make_transport(settings, client, rank, ranks, context);
        kolo::Ring ring(*links, rank, ranks, segment_bytes, settings.timeout_s);
        body(rank, ring);
      } catch (const std::exception& error) {
        errors[rank] = error.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int rank = 0; rank < ranks; ++rank) {
    INFO("rank " << rank);
    CHECK(errors[rank] == "");
  }
}

}  // namespace ring_threads
