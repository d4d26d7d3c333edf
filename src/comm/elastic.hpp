// Elastic jobs under a launcher (comm/elastic.cpp; capi/kolo.h's kolo_elastic_update states the
// contract): the ranks ask `kolorun --elastic`'s driver which ranks leave and how many join, and
// act on that plan together.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.hpp"

namespace kolo {

// The driver's store keys (src/tools/elastic_driver.cpp serves them). A rank 0 takes a request
// number with an ADD on kElasticRequestCounter, writes the members' slots under
// elastic_key("request", n), and reads the plan under elastic_key("plan", n); when the plan lets
// ranks join, the rank 0 of those that stay writes its invitation under
// elastic_key("invitation", n), and the driver then starts the newcomers with it.
inline constexpr const char* kElasticRequestCounter = "elastic/requests";
inline std::string elastic_key(const char* what, long long request) {
  return std::string("elastic/") + what + "/" + std::to_string(request);
}

// What one elastic_update did on this rank.
struct ElasticOutcome {
  bool changed = false;
  bool leaving = false;  // this rank's slot was removed: comm is all it holds, and it should exit
  int joined = 0;
  int left = 0;
  int old_size = 0;
  int new_size = 0;
  std::unique_ptr<Communicator> comm;  // the new communicator, on a rank that stays after a change
};

// Collective over comm. Without KOLO_ELASTIC_ADDR returns at once, unchanged. Throws kolo::Error.
ElasticOutcome elastic_update(Communicator& comm);

}  // namespace kolo
