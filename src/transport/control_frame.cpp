#include "transport/control_frame.hpp"

namespace kolo {

char* ControlFrameReader::space() {
  if (header_done_ < sizeof(header_)) return reinterpret_cast<char*>(&header_) + header_done_;
  return text_.data() + text_done_;
}

size_t ControlFrameReader::wanted() const {
  if (header_done_ < sizeof(header_)) return sizeof(header_) - header_done_;
  return header_.length - text_done_;
}

ControlFrameReader::Step ControlFrameReader::advance(size_t received) {
  if (header_done_ < sizeof(header_)) {
    header_done_ += received;
    if (header_done_ < sizeof(header_)) return Step::kMore;
    if (header_.magic != kControlMagic || header_.length > kControlMaxText) {
      header_done_ = 0;
      return Step::kMalformedHeader;
    }
  } else {
    text_done_ += received;
  }
  if (text_done_ < header_.length) return Step::kMore;
  header_done_ = 0;
  text_done_ = 0;
  return finish();
}

ControlFrameReader::Step ControlFrameReader::finish() {
  switch (kind()) {
    case ControlKind::kGoodbye:
    case ControlKind::kWake:
      return Step::kFrame;
    case ControlKind::kAbort:
      if (!status_from_wire(header_.status, status_) || status_ == Status::kSuccess ||
          header_.origin < 0 || header_.origin >= ranks_) {
        return Step::kMalformedFrame;
      }
      return Step::kFrame;
  }
  return Step::kUnknownKind;
}

}  // namespace kolo
