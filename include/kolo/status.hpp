// Errors inside the C++ core: one exception type carrying a status code and a message that names
// the operation and the ranks involved. The C ABI turns it back into a kolo_status_t.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace kolo {

// Mirrors kolo_status_t in capi/kolo.h value for value.
enum class Status : int {
  kSuccess = 0,
  kInvalidArgument = 1,
  kTimeout = 2,
  kPeerLost = 3,
  kMismatch = 4,
  kInternal = 5,
  kSystem = 6,
  kConfig = 7,
  kUnsupported = 8,
  kCancelled = 9,
};

const char* status_name(Status status);

// The status that a number read from the wire (a peer's abort, a fused response's error, a
// split's outcome) stands for; false when it stands for none, so that a broken or hostile peer
// cannot hand a caller a value outside kolo_status_t.
bool status_from_wire(int64_t value, Status& status);

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  Status status() const { return status_; }

 private:
  Status status_;
};

}  // namespace kolo
