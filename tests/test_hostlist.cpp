// Slurm's hostlist expressions (core/hostlist.hpp): each list is expanded by the parser and
// compared with the names written out by hand; each malformed list must be refused with a message
// that names what is wrong and where.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "core/hostlist.hpp"
#include "kolo/status.hpp"

using Catch::Matchers::Contains;
using kolo::expand_hostlist;
using kolo::first_host_of_hostlist;
using Names = std::vector<std::string>;

namespace {

// The message of the error that expanding `text` throws, or "" when it throws none.
std::string expand_refusal(const std::string& text, size_t max_names = kolo::kMaxHostlistNames) {
  try {
    expand_hostlist(text, max_names);
  } catch (const kolo::Error& error) {
    CHECK(error.status() == kolo::Status::kConfig);
    return error.what();
  }
  return "";
}

// The same for a list whose syntax is wrong, which first_host_of_hostlist must refuse alike.
std::string refusal(const std::string& text) {
  std::string message = expand_refusal(text);
  try {
    first_host_of_hostlist(text);
    FAIL("first_host_of_hostlist accepted '" << text << "'");
  } catch (const kolo::Error& error) {
    CHECK(error.status() == kolo::Status::kConfig);
    CHECK(std::string(error.what()) == message);
  }
  return message;
}

}  // namespace

TEST_CASE("hostlists expand in Slurm's order", "[hostlist]") {
  CHECK(expand_hostlist("h1") == Names{"h1"});
  CHECK(expand_hostlist("h[1-4]") == Names{"h1", "h2", "h3", "h4"});
  CHECK(expand_hostlist("a1,b[2,5-7]") == Names{"a1", "b2", "b5", "b6", "b7"});
  CHECK(expand_hostlist("node[01-03]") == Names{"node01", "node02", "node03"});
  CHECK(expand_hostlist("node[08-11]") == Names{"node08", "node09", "node10", "node11"});
  CHECK(expand_hostlist("n[8-11]") == Names{"n8", "n9", "n10", "n11"});
  // Each range keeps its own low bound's width, as Slurm does.
  CHECK(expand_hostlist("n[001-2,10]") == Names{"n001", "n002", "n10"});
  CHECK(expand_hostlist("[1-2]x") == Names{"1x", "2x"});
  CHECK(expand_hostlist("gpu[3-4].cluster-a") == Names{"gpu3.cluster-a", "gpu4.cluster-a"});
  CHECK(expand_hostlist("r[1-2]n[1-2]") == Names{"r1n1", "r1n2", "r2n1", "r2n2"});
  CHECK(expand_hostlist("kolo3,kolo1") == Names{"kolo3", "kolo1"});
  CHECK(expand_hostlist("  h[1-2]\n") == Names{"h1", "h2"});
  CHECK(expand_hostlist("h[5-5]") == Names{"h5"});
  CHECK(expand_hostlist("h[999999999]") == Names{"h999999999"});
}

TEST_CASE("the first host is found without expanding the list", "[hostlist]") {
  CHECK(first_host_of_hostlist("h[1-4]") == "h1");
  CHECK(first_host_of_hostlist("a1,b[2,5-7]") == "a1");
  CHECK(first_host_of_hostlist("node[01-10]") == "node01");
  CHECK(first_host_of_hostlist("r[7-9]n[03-04]") == "r7n03");
  CHECK(first_host_of_hostlist("z[5,1-2]") == "z5");
  // A thousand million names, of which only the first is made.
  CHECK(first_host_of_hostlist("n[0-999999999]") == "n0");
}

TEST_CASE("malformed hostlists are refused naming what is wrong and where", "[hostlist]") {
  CHECK_THAT(refusal(""), Contains("empty"));
  CHECK_THAT(refusal("   "), Contains("empty"));
  CHECK_THAT(refusal("h[1-4"), Contains("unbalanced '['") && Contains("of 'h[1-4'"));
  CHECK_THAT(refusal("h[1-4,"), Contains("unbalanced '['"));
  CHECK_THAT(refusal("h1-4]"), Contains("unbalanced ']'") && Contains("character 5"));
  CHECK_THAT(refusal("h[1-[2]]"), Contains("'[' where a number was expected"));
  CHECK_THAT(refusal("h[1[2]]"), Contains("nested '['") && Contains("character 4"));
  CHECK_THAT(refusal("h[4-1]"), Contains("range 4-1 runs backwards"));
  CHECK_THAT(refusal("h[a-b]"), Contains("'a' where a number was expected"));
  CHECK_THAT(refusal("h[1-2x]"), Contains("'x' in a range"));
  CHECK_THAT(refusal("h[]"), Contains("']' where a number was expected"));
  CHECK_THAT(refusal("h[1,]"), Contains("']' where a number was expected"));
  CHECK_THAT(refusal("h[-3]"), Contains("'-' where a number was expected"));
  CHECK_THAT(refusal("h1,,h2"), Contains("empty entry") && Contains("character 4"));
  CHECK_THAT(refusal("h1,"), Contains("empty entry"));
  CHECK_THAT(refusal(",h1"), Contains("empty entry") && Contains("character 1"));
  CHECK_THAT(refusal("h1 h2"), Contains("' ' is not part of a host name"));
  CHECK_THAT(refusal("h1;rm"), Contains("';' is not part of a host name"));
  CHECK_THAT(refusal("h[1234567890]"), Contains("more than 9 digits"));
}

TEST_CASE("a hostlist of more names than the bound is refused before it is expanded",
          "[hostlist]") {
  CHECK_THAT(expand_refusal("h[1-4]", 3), Contains("more than 3 names"));
  CHECK_THAT(expand_refusal("a[1-2],b[1-2]", 3), Contains("more than 3 names"));
  CHECK_THAT(expand_refusal("n[0-999999999]"), Contains("more than 1048576 names"));
  CHECK_THAT(expand_refusal("r[0-99999]n[0-99999]"), Contains("more than 1048576 names"));
  CHECK(expand_refusal("h[1-4]", 4).empty());
}
