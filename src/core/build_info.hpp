// What this build of kolo is: its version and the commit it was built from, for the line a job
// logs at start-up and for bug reports.
#pragma once

#include <string_view>

namespace kolo {

// meson.build's version, "0.3.0".
std::string_view build_version();
// `git describe` of the commit built ("1a2b3c4d5e6f", "1a2b3c4d5e6f-dirty"); "unknown" where the
// sources were not a git checkout (meson.build, vcs_tag).
std::string_view build_commit();

}  // namespace kolo
