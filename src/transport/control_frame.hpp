// The frames of the control channel (control_channel.hpp says what each one is for) and their
// reader.
//
// A frame is a ControlFrameHeader, sent as it lies in memory (every rank of a job runs the same
// build), then `length` bytes of text, at most kControlMaxText. The reader is a state machine over
// received bytes with no socket of its own: space() and wanted() say where the next bytes go and
// how many the current frame still needs (never more, so that one read never takes bytes of the
// next frame), advance() takes what arrived there, and a whole frame is checked before it is
// handed out. ControlChannel reads its sockets into one reader per peer;
// tests/fuzz/control_frame.cpp feeds one hostile bytes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kolo/status.hpp"

namespace kolo {

inline constexpr uint32_t kControlMagic = 0x434c4f4b;  // "KOLC"
inline constexpr size_t kControlMaxText = 4096;

enum class ControlKind : uint32_t {
  kAbort = 1,    // a rank failed: its status, the rank that failed first, that rank's message
  kGoodbye = 2,  // a rank destroys its communicator normally
  kWake = 3,     // a doorbell (shm_channel.hpp)
};

struct ControlFrameHeader {
  uint32_t magic = kControlMagic;
  uint32_t kind = 0;
  int32_t status = 0;
  int32_t origin = -1;  // ABORT: the rank that failed first
  uint32_t length = 0;  // of the text that follows
};

class ControlFrameReader {
 public:
  enum class Step {
    kMore,             // the frame is not complete yet
    kFrame,            // a whole, well-formed frame: kind(), and for an ABORT status(), origin(), text()
    kMalformedHeader,  // a header with the wrong magic or a text too long: the stream is lost
    kMalformedFrame,   // an ABORT whose status is no failure or whose origin is no rank
    kUnknownKind,      // a frame of a kind this build does not know
  };

  // `ranks`: the size of the communicator, which an ABORT's origin must lie within.
  explicit ControlFrameReader(int ranks) : ranks_(ranks) {}

  // Where the next received bytes go, and how many the current frame still needs (at least 1).
  char* space();
  size_t wanted() const;
  // Takes `received` bytes (1 to wanted()) written at space(). After anything but kMore the next
  // frame begins; what a kFrame describes stays readable until the next call.
  Step advance(size_t received);

  ControlKind kind() const { return static_cast<ControlKind>(header_.kind); }
  Status status() const { return status_; }
  int origin() const { return header_.origin; }
  std::string_view text() const { return {text_.data(), header_.length}; }

 private:
  Step finish();

  int ranks_;
  ControlFrameHeader header_;
  size_t header_done_ = 0;
  std::array<char, kControlMaxText> text_{};
  size_t text_done_ = 0;
  Status status_ = Status::kSuccess;
};

}  // namespace kolo
