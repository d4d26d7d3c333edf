// Multi-process tests of the fusion engine: named asynchronous operations over real processes on
// loopback (tests/worker_fusion.cpp is one rank), and the timelines they write.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "flavour.hpp"
#include "job.hpp"

using kolo::test::expect_all_pass_on_transport;
using kolo::test::start_job;

namespace {

const char* kWorker = "tests/kolo_fusion_worker";

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Under a transport flavour the ranks log at INFO, for expect_all_pass_on_transport to check the
// path; a test that kills a rank runs as before, without it (`log_flavour` false).
std::vector<kolo::test::ProcessResult> run(int size, const std::vector<std::string>& args,
                                           const std::map<std::string, std::string>& env = {},
                                           double timeout_s = 120, bool log_flavour = true) {
  auto job = start_job(size, args, log_flavour ? kolo::test::with_flavour_logging(env) : env,
                       kWorker);
  return job.wait(timeout_s);
}

// A fresh directory for one test's timelines.
std::filesystem::path scratch_directory(const std::string& name) {
  auto path = std::filesystem::temp_directory_path() /
              ("kolo_fusion_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(path);
  std::filesystem::create_directories(path);
  return path;
}

nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream file(path);
  REQUIRE(file.good());
  return nlohmann::json::parse(file);  // throws, failing the test, when it is not valid JSON
}

uint64_t counter(const std::string& output, const std::string& name) {
  std::smatch match;
  REQUIRE(std::regex_search(output, match, std::regex(name + " ([0-9]+)")));
  return std::stoull(match[1]);
}

}  // namespace

TEST_CASE("ranks submit the same tensors in different orders", "[fusion][orders]") {
  for (int n : {1, 2, 3, 4}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"orders"}), "orders checks passed");
    }
  }
}

TEST_CASE("hundreds of small tensors are packed into a few collectives", "[fusion][many]") {
  for (int n : {2, 5}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"many"}), "many checks passed");
    }
  }
}

TEST_CASE("fused results are bitwise identical to unfused ones, every dtype and op",
          "[fusion][bitwise]") {
  for (int n : {2, 3, 4}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"bitwise"}, {}, 300), "bitwise checks passed");
    }
  }
  SECTION("small pipeline segments and several streams") {
    expect_all_pass_on_transport(
        run(3, {"bitwise"}, {{"KOLO_SEGMENT_BYTES", "4K"}, {"KOLO_TCP_STREAMS", "2"}}, 300),
        "bitwise checks passed");
  }
}

TEST_CASE("tensors larger than the fusion threshold run alone", "[fusion][large]") {
  expect_all_pass_on_transport(run(3, {"large"}, {{"KOLO_FUSION_THRESHOLD", "64K"}}),
                               "large checks passed");
}

TEST_CASE("tensors too large to fuse share one ring allreduce over the network, bitwise as alone",
          "[fusion][one_ring]") {
  for (int n : {2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"one_ring"}), "one_ring checks passed");
    }
  }
}

TEST_CASE("one rank measures what fusing costs too, and runs a 512 KiB tensor alone",
          "[fusion][measured]") {
  expect_all_pass_on_transport(run(1, {"measured"}), "measured checks passed");
}

TEST_CASE("mixed dtypes, ops and factors are never fused together; the timeline shows it",
          "[fusion][mixed][timeline]") {
  const int n = 3;
  auto directory = scratch_directory("mixed");
  auto results = run(n, {"mixed"}, {{"KOLO_TIMELINE", (directory / "trace.json").string()}});
  expect_all_pass_on_transport(results, "mixed checks passed");

  for (int rank = 0; rank < n; ++rank) {
    auto path = directory / ("trace.rank" + std::to_string(rank) + ".json");
    INFO("timeline " << path);
    nlohmann::json trace = read_json(path);
    REQUIRE(trace.is_array());
    std::map<int, std::string> rows;  // tid -> tensor name
    std::multiset<std::string> names;
    for (const auto& event : trace) {
      CHECK(event.at("pid") == rank);
      names.insert(event.at("name").get<std::string>());
      if (event.at("name") == "thread_name") {
        rows[event.at("tid").get<int>()] = event.at("args").at("name").get<std::string>();
      }
      if (event.at("ph") == "X") {
        CHECK(event.at("dur").get<double>() >= 0);
        CHECK(event.contains("ts"));
      }
    }
    for (const char* expected :
         {"NEGOTIATE", "QUEUE", "COPY_IN", "ALLREDUCE", "COPY_OUT", "CYCLE", "process_name"}) {
      INFO("event " << expected);
      CHECK(names.count(expected) > 0);
    }
    if (rank == 0) CHECK(names.count("SUBMITTED") > 0);
    CHECK(rows.size() >= 30);  // a row per tensor, and the cycles row
    // Every collective holds tensors of one kind (the part of the name before '/').
    std::map<int64_t, std::set<std::string>> kinds_of_collective;
    std::map<int64_t, int> tensors_of_collective;
    for (const auto& event : trace) {
      if (event.at("name") != "ALLREDUCE") continue;
      const std::string& tensor = rows.at(event.at("tid").get<int>());
      int64_t collective = event.at("args").at("collective").get<int64_t>();
      kinds_of_collective[collective].insert(tensor.substr(0, tensor.find('/')));
      ++tensors_of_collective[collective];
      CHECK(event.at("args").at("fused").get<bool>() == (event.at("args").at("tensors") > 1));
    }
    int fused = 0;
    for (const auto& [collective, kinds] : kinds_of_collective) {
      INFO("collective " << collective);
      CHECK(kinds.size() == 1);
      if (tensors_of_collective[collective] > 1) ++fused;
    }
    CHECK(fused > 0);
  }
  std::filesystem::remove_all(directory);
}

TEST_CASE("the response cache carries a steady loop and survives a changing set",
          "[fusion][cache]") {
  SECTION("a cache large enough: almost every tensor is a hit") {
    auto results = run(3, {"cache", "40"});
    expect_all_pass_on_transport(results, "cache checks passed");
    for (const auto& result : results) {
      INFO(result.output);
      uint64_t hits = counter(result.output, "cache_hits");
      uint64_t negotiated = counter(result.output, "negotiated");
      CHECK(hits > 10 * negotiated);
      CHECK(negotiated >= 32);  // the first step, the extras, and the resized tensor twice
    }
  }
  SECTION("a cache of 8 entries: evictions every step, results still right") {
    auto results = run(3, {"cache", "12"}, {{"KOLO_CACHE_CAPACITY", "8"}});
    expect_all_pass_on_transport(results, "cache checks passed");
    for (const auto& result : results) CHECK(counter(result.output, "cache_hits") > 0);
  }
  SECTION("no cache") {
    auto results = run(2, {"cache", "6"}, {{"KOLO_CACHE_CAPACITY", "0"}});
    expect_all_pass_on_transport(results, "cache checks passed");
    for (const auto& result : results) CHECK(counter(result.output, "cache_hits") == 0);
  }
  SECTION("ranks with different cache capacities get KOLO_ERR_CONFIG") {
    // start_job gives every rank the same environment: this pair is started by hand.
    kolo::test::Job job;
    const int port = kolo::test::free_tcp_port();
    for (int rank = 0; rank < 2; ++rank) {
      job.ranks.emplace_back(
          std::vector<std::string>{kolo::test::built_program(kWorker), "cache", "2"},
          std::map<std::string, std::string>{{"KOLO_RANK", std::to_string(rank)},
                                             {"KOLO_SIZE", "2"},
                                             {"KOLO_ADDR", "127.0.0.1:" + std::to_string(port)},
                                             {"KOLO_SECRET", kolo::test::kTestSecret},
                                             {"KOLO_TIMEOUT", "30"},
                                             {"KOLO_CACHE_CAPACITY", rank == 0 ? "64" : "32"}});
    }
    for (auto& result : job.wait(60)) {
      INFO(result.output);
      CHECK_FALSE(result.timed_out);
      CHECK(result.exit_code == 1);
      CHECK(contains(result.output, "KOLO_CACHE_CAPACITY differs"));
    }
  }
}

TEST_CASE("a group runs as one collective, beside single tensors", "[fusion][group]") {
  for (int n : {1, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"group"}), "group checks passed");
    }
  }
}

TEST_CASE("named broadcasts from every root", "[fusion][broadcast]") {
  for (int n : {2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"broadcast"}), "broadcast checks passed");
    }
  }
}

TEST_CASE("kolo_join: ranks with fewer steps join, the others go on with zeros for them",
          "[fusion][join]") {
  for (int n : {1, 2, 4}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"join"}), "join checks passed");
    }
  }
}

TEST_CASE("a name submitted twice before completion is refused at once",
          "[fusion][errors][duplicate]") {
  expect_all_pass_on_transport(run(2, {"duplicate"}), "duplicate checks passed");
}

TEST_CASE("ranks that disagree about a tensor fail it on every rank, naming it",
          "[fusion][errors][mismatch]") {
  for (int n : {2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"mismatch"}), "mismatch checks passed");
    }
  }
}

TEST_CASE("invalid arguments of named calls are refused", "[fusion][errors][badargs]") {
  for (int n : {1, 2}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"badargs"}), "badargs checks passed");
    }
  }
}

TEST_CASE("named allgathers: a count per rank, zero too, every dtype, beside named allreduces",
          "[fusion][allgather]") {
  for (int n : {1, 2, 3, 4}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"allgather"}), "allgather checks passed");
    }
  }
  SECTION("the timeline shows each allgather as a collective of its own") {
    const int n = 3;
    auto directory = scratch_directory("allgather");
    auto results = run(n, {"allgather"}, {{"KOLO_TIMELINE", (directory / "trace.json").string()}});
    expect_all_pass_on_transport(results, "allgather checks passed");
    for (int rank = 0; rank < n; ++rank) {
      auto path = directory / ("trace.rank" + std::to_string(rank) + ".json");
      INFO("timeline " << path);
      nlohmann::json trace = read_json(path);
      std::map<int, std::string> rows;  // tid -> tensor name
      for (const auto& event : trace) {
        if (event.at("name") == "thread_name") {
          rows[event.at("tid").get<int>()] = event.at("args").at("name").get<std::string>();
        }
      }
      std::set<int64_t> collectives;
      int allgathers = 0;
      for (const auto& event : trace) {
        if (event.at("name") != "ALLGATHER") continue;
        ++allgathers;
        CHECK(rows.at(event.at("tid").get<int>()).rfind("gather.", 0) == 0);
        collectives.insert(event.at("args").at("collective").get<int64_t>());
      }
      CHECK(allgathers == 4 * 12);          // 12 allgathers a step, 4 steps
      CHECK(collectives.size() == 4 * 12);  // never two in one collective
    }
    std::filesystem::remove_all(directory);
  }
}

TEST_CASE("named allgathers: too small a capacity, disagreeing ranks, bad arguments",
          "[fusion][errors][allgather_errors]") {
  for (int n : {1, 2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"allgather_errors"}), "allgather_errors checks passed");
    }
  }
}

TEST_CASE("a lost rank fails every pending request, naming it", "[fusion][errors][peerlost]") {
  for (int n : {2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      auto results = run(n, {"peerlost"}, {}, 60, false);
      for (int rank = 0; rank < n; ++rank) {
        INFO("rank " << rank << " output:\n" << results[rank].output);
        CHECK_FALSE(results[rank].timed_out);
        if (rank == n - 1) {
          CHECK(results[rank].signal == SIGKILL);
        } else {
          CHECK(results[rank].exit_code == 0);
          CHECK(contains(results[rank].output, "peerlost checks passed"));
        }
      }
    }
  }
}

TEST_CASE("destroying a communicator with pending requests cancels them cleanly",
          "[fusion][errors][destroy]") {
  for (int n : {2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      auto results = run(n, {"destroy"}, {}, 60);
      expect_all_pass_on_transport(results, "destroy checks passed");
      CHECK(contains(results[0].output, "KOLO_ERR_CANCELLED"));
    }
  }
}

TEST_CASE("ranks that leave once all work is done leave quietly", "[fusion][errors][leave]") {
  for (int n : {2, 3, 4}) {
    DYNAMIC_SECTION("N = " << n) {
      auto results = run(n, {"leave"}, {}, 60);
      expect_all_pass_on_transport(results, "leave checks passed");
      for (const auto& result : results) {
        INFO(result.output);
        CHECK_FALSE(contains(result.output, "WARN"));
      }
    }
  }
}

TEST_CASE("stalled tensors: a warning names them and the missing ranks; optionally they fail",
          "[fusion][stall]") {
  SECTION("warning") {
    auto results = run(3, {"stall"}, {{"KOLO_STALL_WARNING_S", "1"}});
    expect_all_pass_on_transport(results, "stall checks passed");
    INFO(results[0].output);
    CHECK(contains(results[0].output, "'late.tensor' missing rank 2"));
    CHECK(contains(results[0].output, "KOLO_STALL_WARNING_S"));
    CHECK_FALSE(contains(results[1].output, "missing rank"));  // only rank 0 reports
  }
  SECTION("abort") {
    auto results = run(3, {"stall", "abort"},
                       {{"KOLO_STALL_WARNING_S", "0.5"}, {"KOLO_STALL_ABORT_S", "1.5"}});
    expect_all_pass_on_transport(results, "stall checks passed");
    CHECK(contains(results[0].output, "'never.tensor' missing rank 2"));
  }
}

TEST_CASE("a late rank's submission starts the next cycle at once", "[fusion][late]") {
  // A cycle time of a second: the others' asks come far apart, and one of them would be late.
  auto results = run(3, {"late"}, {{"KOLO_CYCLE_TIME_MS", "1000"}});
  expect_all_pass_on_transport(results, "late checks passed");
}

TEST_CASE("ordered and named calls from two threads of one program do not race",
          "[fusion][threads]") {
  for (int n : {2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      expect_all_pass_on_transport(run(n, {"threads"}), "threads checks passed");
    }
  }
}

TEST_CASE("an idle communicator runs no cycles and uses no CPU", "[fusion][idle]") {
  expect_all_pass_on_transport(run(3, {"idle"}), "idle checks passed");
}

namespace {

// The lines of `output` that match `pattern`, each as its first group.
std::vector<std::string> matches(const std::string& output, const std::string& pattern) {
  std::vector<std::string> found;
  std::regex expression(pattern);
  for (auto it = std::sregex_iterator(output.begin(), output.end(), expression);
       it != std::sregex_iterator(); ++it) {
    found.push_back((*it)[1]);
  }
  return found;
}

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> fields;
  std::stringstream stream(line);
  for (std::string field; std::getline(stream, field, ',');) fields.push_back(field);
  return fields;
}

}  // namespace

TEST_CASE("autotuning changes the settings mid-run alike on every rank, logs and settles",
          "[fusion][autotune]") {
  for (int n : {2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      auto directory = scratch_directory("autotune");
      const auto log = directory / "autotune.csv";
      auto results = run(n, {"autotune"},
                         {{"KOLO_AUTOTUNE", "1"},
                          {"KOLO_AUTOTUNE_WINDOW_MS", "30"},
                          {"KOLO_AUTOTUNE_LOG", log.string()},
                          {"KOLO_DEBUG", "INFO"}},
                         600);
      expect_all_pass_on_transport(results, "autotune checks passed");

      // Every rank applied the same settings from the same cycles, and settled on the same.
      const auto applied = matches(results[0].output, R"(rank 0 applies ([^\n]*))");
      const auto settled = matches(results[0].output, R"(rank 0: autotune settings: ([^\n]*))");
      REQUIRE(settled.size() == 1);
      for (int rank = 1; rank < n; ++rank) {
        INFO("rank " << rank);
        const std::string prefix = "rank " + std::to_string(rank);
        CHECK(matches(results[rank].output, prefix + R"( applies ([^\n]*))") == applied);
        CHECK(matches(results[rank].output, prefix + R"(: autotune settings: ([^\n]*))") ==
              settled);
      }

      // The log: a header, the warm-up, 14 trials of the search (the start, 64M / 5 ms / 1M, is
      // on every list: 1 + 5 cycle times + 5 thresholds + 3 segments), each a setting of its own,
      // the 3 best of them again, and the final row.
      std::ifstream file(log);
      REQUIRE(file.good());
      std::vector<std::vector<std::string>> rows;
      std::string header;
      std::getline(file, header);
      CHECK(header ==
            "trial,fusion_threshold_bytes,cycle_time_ms,segment_bytes,bytes,busy_s,"
            "score_bytes_per_s,outcome");
      for (std::string line; std::getline(file, line);) rows.push_back(split_csv(line));
      REQUIRE(rows.size() == 1 + 14 + 3 + 1);
      for (const auto& row : rows) REQUIRE(row.size() == 8);
      CHECK(rows.front()[0] == "0");
      CHECK(rows.front()[7] == "warmup");
      auto settings_of = [](const std::vector<std::string>& row) {
        return row[1] + "," + row[2] + "," + row[3];
      };
      std::map<std::string, double> searched;  // settings -> score
      std::vector<double> ranked;
      double best = -1;
      for (size_t i = 1; i <= 14; ++i) {
        const auto& row = rows[i];
        INFO("row " << i);
        CHECK(row[0] == std::to_string(i));
        CHECK((row[7] == "kept" || row[7] == "dropped"));
        CHECK(std::stoull(row[4]) > 0);
        const double score = std::stod(row[6]);
        CHECK(searched.emplace(settings_of(row), score).second);
        CHECK((row[7] == "kept") == (score > best));
        best = std::max(best, score);
        ranked.push_back(score);
      }
      CHECK(settings_of(rows[1]) == "67108864,5,1048576");
      std::sort(ranked.rbegin(), ranked.rend());
      // The finalists: the three best of the search, again, and the final one the best mean.
      std::string chosen;
      double chosen_mean = -1;
      for (size_t i = 15; i <= 17; ++i) {
        const auto& row = rows[i];
        INFO("row " << i);
        CHECK(row[0] == std::to_string(i));
        CHECK(row[7] == "confirm");
        REQUIRE(searched.count(settings_of(row)));
        CHECK(searched[settings_of(row)] >= ranked[2]);
        const double mean = (searched[settings_of(row)] + std::stod(row[6])) / 2;
        if (mean > chosen_mean) chosen_mean = mean, chosen = settings_of(row);
      }
      const auto& final = rows.back();
      CHECK(final[7] == "final");
      CHECK(settings_of(final) == chosen);
      const int trials = 17;
      // The settings every rank reports are the final row's; one update per trial.
      CHECK(settled[0] == "updates " + std::to_string(trials) + ", threshold " + final[1] +
                              ", cycle " + final[2] + " ms, segment " + final[3]);
      CHECK(applied.size() == static_cast<size_t>(trials));
      std::filesystem::remove_all(directory);
    }
  }
  SECTION("without KOLO_AUTOTUNE nothing changes") {
    auto results = run(2, {"autotune", "off"});
    expect_all_pass_on_transport(results, "autotune checks passed");
    for (const auto& result : results) {
      CHECK(contains(result.output, "autotune settings: updates 0, threshold 67108864, cycle 5 "
                                    "ms, segment 1048576"));
    }
  }
}
