// Multi-process tests of the collectives: N real processes over loopback, each checking every
// result element by element against its own independently computed reference (tests/worker.cpp).
#include <catch2/catch.hpp>

#include "job.hpp"

using kolo::test::expect_all_pass;
using kolo::test::start_job;

TEST_CASE("allreduce: every dtype, op and size, N = 1..5", "[collectives][allreduce]") {
  for (int n = 1; n <= 5; ++n) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start_job(n, {"allreduce"});
      expect_all_pass(job.wait(600), "allreduce checks passed");
    }
  }
}

TEST_CASE("allreduce: small segments and several streams exercise the pipeline",
          "[collectives][allreduce]") {
  for (int n : {2, 3, 4}) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start_job(n, {"allreduce", "quick"},
                           {{"KOLO_SEGMENT_BYTES", "4K"}, {"KOLO_TCP_STREAMS", "3"}});
      expect_all_pass(job.wait(600), "allreduce checks passed");
    }
  }
}

TEST_CASE("broadcast: from every root, N = 1..5", "[collectives][broadcast]") {
  for (int n = 1; n <= 5; ++n) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start_job(n, {"broadcast"}, {{"KOLO_SEGMENT_BYTES", "256K"}});
      expect_all_pass(job.wait(600), "broadcast checks passed");
    }
  }
}

TEST_CASE("barrier: nobody leaves before the last rank enters", "[collectives][barrier]") {
  for (int n : {1, 2, 3, 5}) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start_job(n, {"barrier"});
      expect_all_pass(job.wait(120), "barrier checks passed");
    }
  }
}
