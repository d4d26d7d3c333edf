// Slurm's hostlist expressions, the form in which a job step's nodes reach its tasks
// (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST):
//
//   hostlist := entry ("," entry)*
//   entry    := (text | "[" ranges "]")+        text: any characters but "[", "]" and ","
//   ranges   := range ("," range)*
//   range    := digits | digits "-" digits      low <= high
//
// "h[1-4]" is h1 h2 h3 h4; "a1,b[2,5-7]" is a1 b2 b5 b6 b7; "node[01-10]" keeps the low bound's
// width, node01 .. node10 (each range its own: "n[01-02,10]" is n01 n02 n10); "r[1-2]n[1-2]" is
// every combination, r1n1 r1n2 r2n1 r2n2. The order is the written one: Slurm writes a step's node
// list in its nodes' order, in which task 0 runs on the first node under block, cyclic and plane
// distributions.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace kolo {

// The most names expand_hostlist() produces; a longer list is refused rather than allocated.
inline constexpr size_t kMaxHostlistNames = size_t{1} << 20;

// The host names of `text` in order. Throws kolo::Error(kConfig) whose message says what is wrong
// and where ("unbalanced '[' at character 3 of 'h[1-4'"), for an empty list or entry, unbalanced
// or nested brackets, a range that is not digits, low > high, a number over 10^9, or more than
// max_names names.
std::vector<std::string> expand_hostlist(std::string_view text,
                                         size_t max_names = kMaxHostlistNames);

// The first host name of `text`, after checking the whole list's syntax as expand_hostlist() does
// (with the same messages); the list is not expanded, so no bound on its length applies.
std::string first_host_of_hostlist(std::string_view text);

}  // namespace kolo
