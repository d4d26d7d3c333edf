#include "kolo/status.hpp"

namespace kolo {

// The C ABI's kolo_status_string() returns these strings, so they are static and each begins with
// the C enumerator's name. The switch has no default case so that -Wswitch points here when a
// status is added.
const char* status_name(Status status) {
  switch (status) {
    case Status::kSuccess:
      return "KOLO_SUCCESS: no error";
    case Status::kInvalidArgument:
      return "KOLO_ERR_INVALID_ARGUMENT: an argument was invalid (NULL pointer, unknown dtype or "
             "op, bad root or bad config)";
    case Status::kTimeout:
      return "KOLO_ERR_TIMEOUT: a wait ran past the communicator's timeout";
    case Status::kPeerLost:
      return "KOLO_ERR_PEER_LOST: a peer rank was lost";
    case Status::kMismatch:
      return "KOLO_ERR_MISMATCH: ranks called different collectives, counts, dtypes or ops";
    case Status::kInternal:
      return "KOLO_ERR_INTERNAL: an internal error in kolo (please report the message)";
    case Status::kSystem:
      return "KOLO_ERR_SYSTEM: an operating-system call failed";
    case Status::kConfig:
      return "KOLO_ERR_CONFIG: the environment or config does not describe a usable job";
    case Status::kUnsupported:
      return "KOLO_ERR_UNSUPPORTED: not available in this build or on this machine";
    case Status::kCancelled:
      return "KOLO_ERR_CANCELLED: the communicator was destroyed before the request completed";
  }
  return "unknown kolo status";
}

bool status_from_wire(int64_t value, Status& status) {
  if (value < static_cast<int64_t>(Status::kSuccess) ||
      value > static_cast<int64_t>(Status::kCancelled)) {
    return false;
  }
  status = static_cast<Status>(value);
  return true;
}

}  // namespace kolo
