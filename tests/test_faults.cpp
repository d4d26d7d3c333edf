// Faults and bad input across real processes: a rank killed with SIGKILL, ranks that disagree,
// invalid arguments, a rank that never arrives, strangers without the job secret.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <regex>
#include <thread>

#include "faults.hpp"
#include "job.hpp"

using kolo::test::contains;
using kolo::test::seconds_to_failure;
using kolo::test::start_job;
using kolo::test::wait_until_looping;

namespace {

// Sends `bytes` to 127.0.0.1:port and closes; returns false if nobody listened.
bool poke(int port, const std::string& bytes) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bool connected = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  if (connected) {
    (void)!::write(fd, bytes.data(), bytes.size());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::close(fd);
  return connected;
}

}  // namespace

TEST_CASE("a rank killed with SIGKILL becomes KOLO_ERR_PEER_LOST on every survivor",
          "[faults][sigkill]") {
  struct Case {
    int size;
    int victim;
  };
  for (Case c : {Case{4, 2}, Case{3, 0}, Case{2, 1}}) {
    DYNAMIC_SECTION("N = " << c.size << ", rank " << c.victim << " killed") {
      auto job = start_job(c.size, {"loop", "120"});
      kolo::test::kill_and_expect_peer_lost(job, c.victim);
    }
  }
}

TEST_CASE("ranks that disagree get KOLO_ERR_MISMATCH on every rank", "[faults][mismatch]") {
  for (const char* kind : {"count", "dtype", "op", "collective", "root", "scale"}) {
    for (int n : {2, 3}) {
      DYNAMIC_SECTION(kind << " differs, N = " << n) {
        auto job = start_job(n, {"mismatch", kind});
        kolo::test::expect_every_rank_reports_mismatch(job.wait(60));
      }
    }
  }
}

TEST_CASE("invalid arguments are refused before anything is sent", "[faults][arguments]") {
  for (int n : {1, 2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start_job(n, {"badargs"});
      auto results = job.wait(60);
      for (size_t rank = 0; rank < results.size(); ++rank) {
        INFO("rank " << rank << " output:\n" << results[rank].output);
        CHECK(results[rank].exit_code == 0);
        CHECK(contains(results[rank].output, "bad-argument checks passed"));
      }
    }
  }
}

TEST_CASE("the last error a thread holds survives another thread's error", "[faults][arguments]") {
  auto job = start_job(1, {"error_threads"});
  auto results = job.wait(60);
  INFO("output:\n" << results[0].output);
  CHECK(results[0].exit_code == 0);
  CHECK(contains(results[0].output, "error-thread checks passed"));
}

TEST_CASE("a rank that never arrives gives KOLO_ERR_TIMEOUT within KOLO_TIMEOUT",
          "[faults][timeout]") {
  auto job = start_job(3, {"stall", "30"}, {{"KOLO_TIMEOUT", "2"}});
  auto started = std::chrono::steady_clock::now();
  for (int rank = 0; rank < 2; ++rank) {
    auto result = job.ranks[rank].wait(20);
    INFO("rank " << rank << " output:\n" << result.output);
    CHECK(result.exit_code == 3);
    CHECK(contains(result.output, "KOLO_ERR_TIMEOUT"));
    // Each rank that times out says where it stood (comm/report.hpp).
    CHECK(std::regex_search(result.output,
                            std::regex("WARN  at the timeout: rank " + std::to_string(rank) +
                                       " of 3 .*: in allreduce #[0-9]+ .* waiting for rank")));
  }
  double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  CHECK(elapsed < 15.0);
}

TEST_CASE("strangers without the job secret are dropped and the job goes on", "[faults][secret]") {
  auto job = start_job(2, {"loop", "4"});
  wait_until_looping(job);
  // Garbage, an oversized length and an empty connection to the rendezvous store.
  CHECK(poke(job.port, "GET / HTTP/1.0\r\n\r\n"));
  CHECK(poke(job.port, std::string(64, '\xff')));
  CHECK(poke(job.port, ""));
  // A process with the wrong secret tries to join as rank 1.
  kolo::test::Process intruder({kolo::test::built_program("tests/kolo_test_worker"), "loop", "1"},
                               {{"KOLO_RANK", "1"},
                                {"KOLO_SIZE", "2"},
                                {"KOLO_ADDR", "127.0.0.1:" + std::to_string(job.port)},
                                {"KOLO_SECRET", "not-the-job-secret"},
                                {"KOLO_TIMEOUT", "5"}});
  auto intruder_result = intruder.wait(30);
  INFO("intruder output:\n" << intruder_result.output);
  CHECK(intruder_result.exit_code == 4);
  CHECK(contains(intruder_result.output, "init failed"));
  auto results = job.wait(60);
  for (size_t rank = 0; rank < results.size(); ++rank) {
    INFO("rank " << rank << " output:\n" << results[rank].output);
    CHECK(results[rank].exit_code == 0);
    CHECK(contains(results[rank].output, "status KOLO_SUCCESS"));
  }
}

TEST_CASE("a job secret from KOLO_SECRET_FILE, and a warning once per job without one",
          "[faults][secret]") {
  SECTION("every rank reads the secret from the file; a stranger without it is dropped") {
    char path[] = "/tmp/kolo-job-secret-XXXXXX";
    int fd = ::mkstemp(path);  // mode 600
    REQUIRE(fd >= 0);
    REQUIRE(::write(fd, "file-secret-0123\n", 17) == 17);
    ::close(fd);
    auto job = start_job(2, {"loop", "3"}, {{"KOLO_SECRET", ""}, {"KOLO_SECRET_FILE", path}});
    wait_until_looping(job);
    kolo::test::Process intruder({kolo::test::built_program("tests/kolo_test_worker"), "loop", "1"},
                                 {{"KOLO_RANK", "1"},
                                  {"KOLO_SIZE", "2"},
                                  {"KOLO_ADDR", "127.0.0.1:" + std::to_string(job.port)},
                                  {"KOLO_SECRET", kolo::test::kTestSecret},
                                  {"KOLO_TIMEOUT", "5"}});
    CHECK(intruder.wait(30).exit_code == 4);
    auto results = job.wait(60);
    ::unlink(path);
    for (size_t rank = 0; rank < results.size(); ++rank) {
      INFO("rank " << rank << " output:\n" << results[rank].output);
      CHECK(results[rank].exit_code == 0);
      CHECK(contains(results[rank].output, "status KOLO_SUCCESS"));
      CHECK_FALSE(contains(results[rank].output, "no job secret"));
    }
  }
  SECTION("without a secret, rank 0 alone warns, at the default log level") {
    auto job = start_job(3, {"barrier"}, {{"KOLO_SECRET", ""}});
    auto results = job.wait(60);
    for (size_t rank = 0; rank < results.size(); ++rank) {
      INFO("rank " << rank << " output:\n" << results[rank].output);
      CHECK(results[rank].exit_code == 0);
      CHECK(contains(results[rank].output, "WARN  no job secret") == (rank == 0));
    }
  }
}

TEST_CASE("a missing rendezvous configuration says what to set", "[faults][config]") {
  kolo::test::Process lonely({kolo::test::built_program("tests/kolo_test_worker"), "barrier"},
                             {{"KOLO_RANK", "0"}, {"KOLO_SIZE", "2"}});
  auto result = lonely.wait(30);
  INFO(result.output);
  CHECK(result.exit_code == 4);
  CHECK(contains(result.output, "KOLO_ERR_CONFIG"));
  CHECK(contains(result.output, "KOLO_ADDR"));
}

TEST_CASE("a congestion control the kernel refuses fails the job on every rank, naming it",
          "[faults][config]") {
  auto job = start_job(2, {"barrier"},
                       {{"KOLO_TRANSPORT", "tcp"}, {"KOLO_TCP_CONGESTION", "kolo-no-such"}});
  auto results = job.wait(60);
  for (size_t rank = 0; rank < results.size(); ++rank) {
    INFO("rank " << rank << " output:\n" << results[rank].output);
    CHECK_FALSE(results[rank].timed_out);
    CHECK(results[rank].exit_code == 4);
    CHECK(contains(results[rank].output, "KOLO_ERR_CONFIG"));
    CHECK(contains(results[rank].output, "KOLO_TCP_CONGESTION=kolo-no-such"));
    CHECK(contains(results[rank].output, "it allows: "));
  }
}
