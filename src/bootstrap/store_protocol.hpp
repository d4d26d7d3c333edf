// The rendezvous store's wire protocol, shared by its server (store_server.cpp) and its client
// (store_client.cpp): request and reply encoding, limits, and the parser of requests. Internal to
// src/bootstrap/; bootstrap/store.hpp is the store's interface.
//
// Requests (client to server), integers little-endian:
//   SET   u8 1, u32 key_bytes, key, u32 value_bytes, value
//   GET   u8 2, u32 key_bytes, key
//   WAIT  u8 3, u32 key_count, key_count x (u32 key_bytes, key)
//   ADD   u8 4, u32 key_bytes, key, i64 delta
//   ERASE u8 5, u32 prefix_bytes, prefix  (every key that starts with prefix)
//   DELETE u8 6, u32 key_count, key_count x (u32 key_bytes, key)  (exactly these keys)
//   GET_MANY u8 7, u32 wait_ms, u32 key_count, key_count x (u32 key_bytes, key)  (waits until
//          every key exists or wait_ms passes, at most the server's park_seconds)
// Replies (server to client):
//   ok     u8 0, then for GET u32 value_bytes and the value, for GET_MANY u32 key_count and per
//          key in the request's order u8 1, u32 value_bytes, value, or u8 0 for a key that does
//          not exist (yet), for ADD the i64 sum, for ERASE and DELETE the u64 number of keys
//          erased, else nothing
//   error  u8 1, u32 message_bytes, message  (ADD on a value that is not a counter, or overflow;
//          a GET_MANY whose values together exceed kMaxGetManyReplyBytes)
//   timeout u8 2, u32 message_bytes, message  (a GET or WAIT whose keys did not all appear within
//          the server's StoreLimits::park_seconds)
// Keys are 1..kStoreMaxKeyBytes bytes, values at most kStoreMaxValueBytes; each length is checked
// as soon as it has arrived, before its bytes are awaited or anything is allocated for them.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bootstrap/store.hpp"

namespace kolo::store_protocol {

enum class Op : uint8_t {
  kSet = 1,
  kGet = 2,
  kWait = 3,
  kAdd = 4,
  kErase = 5,
  kDelete = 6,
  kGetMany = 7,
};
inline constexpr uint8_t kReplyOk = 0;
inline constexpr uint8_t kReplyError = 1;
inline constexpr uint8_t kReplyTimeout = 2;

// The most keys one WAIT, DELETE or GET_MANY names.
inline constexpr size_t kMaxWaitKeys = 1u << 16;
// The most bytes of values one GET_MANY reply carries (the lengths and headers aside): a
// start-up's records are a few hundred bytes per rank, so this serves well over 10^5 ranks,
// and it bounds what one request makes the server copy and a client allocate.
inline constexpr size_t kMaxGetManyReplyBytes = 64u << 20;
// The largest legal request: a SET of the longest key and value, plus its headers. The keys of a
// WAIT or DELETE together must fit in it too.
inline constexpr size_t kMaxRequestBytes = 1 + 4 + kStoreMaxKeyBytes + 4 + kStoreMaxValueBytes;
inline constexpr size_t kMaxErrorBytes = 4096;
inline constexpr auto kHandshakeTime = std::chrono::seconds(5);
inline constexpr size_t kReadChunk = 64 * 1024;

// ---- encoding ----------------------------------------------------------------------------------

inline void append_u32(std::vector<uint8_t>& out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}
inline void append_u64(std::vector<uint8_t>& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}
inline void append_bytes(std::vector<uint8_t>& out, const void* data, size_t bytes) {
  const auto* begin = static_cast<const uint8_t*>(data);
  out.insert(out.end(), begin, begin + bytes);
}
inline void append_key(std::vector<uint8_t>& out, const std::string& key) {
  append_u32(out, static_cast<uint32_t>(key.size()));
  append_bytes(out, key.data(), key.size());
}
inline uint32_t decode_u32(const uint8_t* in) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= static_cast<uint32_t>(in[i]) << (8 * i);
  return value;
}
inline uint64_t decode_u64(const uint8_t* in) {
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value |= static_cast<uint64_t>(in[i]) << (8 * i);
  return value;
}

inline std::string quote_keys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 4;
  std::string text;
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) {
    text += fmt::format("{}'{}'", i == 0 ? "" : ", ", keys[i]);
  }
  if (keys.size() > kShown) text += fmt::format(" and {} more", keys.size() - kShown);
  return text;
}

// ---- request parsing (server) ------------------------------------------------------------------

inline const char* op_name(Op op) {
  switch (op) {
    case Op::kSet: return "SET";
    case Op::kGet: return "GET";
    case Op::kWait: return "WAIT";
    case Op::kAdd: return "ADD";
    case Op::kErase: return "ERASE";
    case Op::kDelete: return "DELETE";
    case Op::kGetMany: return "GET_MANY";
  }
  return "unknown request";
}

struct Request {
  Op op = Op::kSet;
  std::vector<std::string> keys;  // one key, WAIT's, DELETE's or GET_MANY's keys, or ERASE's prefix
  std::vector<uint8_t> value;     // SET
  int64_t delta = 0;              // ADD
  uint32_t wait_ms = 0;           // GET_MANY
};

enum class Parse { kIncomplete, kComplete, kMalformed };

// Reads one request from the front of bytes that may hold only part of it. Called with
// request == nullptr it only checks and measures, so a request still arriving is never copied;
// once complete it is called again to decode.
class RequestParser {
 public:
  RequestParser(const uint8_t* data, size_t size, Request* request)
      : data_(data), size_(size), request_(request) {}

  Parse parse() {
    if (!has(1)) return Parse::kIncomplete;
    uint8_t op = data_[offset_++];
    if (request_ != nullptr) request_->op = static_cast<Op>(op);
    switch (static_cast<Op>(op)) {
      case Op::kSet: {
        Parse key = parse_key();
        if (key != Parse::kComplete) return key;
        if (!has(4)) return Parse::kIncomplete;
        uint32_t length = decode_u32(data_ + offset_);
        offset_ += 4;
        if (length > kStoreMaxValueBytes) {
          return malformed(fmt::format("a SET value of {} bytes (the limit is {})", length,
                                       kStoreMaxValueBytes));
        }
        if (!has(length)) return Parse::kIncomplete;
        if (request_ != nullptr) request_->value.assign(data_ + offset_, data_ + offset_ + length);
        offset_ += length;
        return Parse::kComplete;
      }
      case Op::kGet:
      case Op::kErase:
        return parse_key();
      case Op::kWait:
      case Op::kDelete:
      case Op::kGetMany: {
        if (static_cast<Op>(op) == Op::kGetMany) {
          if (!has(4)) return Parse::kIncomplete;
          if (request_ != nullptr) request_->wait_ms = decode_u32(data_ + offset_);
          offset_ += 4;
        }
        if (!has(4)) return Parse::kIncomplete;
        uint32_t count = decode_u32(data_ + offset_);
        offset_ += 4;
        if (count > kMaxWaitKeys) {
          return malformed(fmt::format("a {} of {} keys (the limit is {})",
                                       op_name(static_cast<Op>(op)), count, kMaxWaitKeys));
        }
        for (uint32_t i = 0; i < count; ++i) {
          Parse key = parse_key();
          if (key != Parse::kComplete) return key;
        }
        return Parse::kComplete;
      }
      case Op::kAdd: {
        Parse key = parse_key();
        if (key != Parse::kComplete) return key;
        if (!has(8)) return Parse::kIncomplete;
        if (request_ != nullptr)
          request_->delta = static_cast<int64_t>(decode_u64(data_ + offset_));
        offset_ += 8;
        return Parse::kComplete;
      }
    }
    return malformed(fmt::format("an unknown request code {}", op));
  }

  size_t consumed() const { return offset_; }
  const std::string& reason() const { return reason_; }

 private:
  bool has(size_t bytes) const { return size_ - offset_ >= bytes; }

  Parse parse_key() {
    if (!has(4)) return Parse::kIncomplete;
    uint32_t length = decode_u32(data_ + offset_);
    offset_ += 4;
    if (length == 0 || length > kStoreMaxKeyBytes) {
      return malformed(
          fmt::format("a key of {} bytes (keys are 1 to {} bytes)", length, kStoreMaxKeyBytes));
    }
    if (offset_ + length > kMaxRequestBytes) {
      return malformed(fmt::format("a request of more than {} bytes", kMaxRequestBytes));
    }
    if (!has(length)) return Parse::kIncomplete;
    if (request_ != nullptr) {
      request_->keys.emplace_back(reinterpret_cast<const char*>(data_ + offset_), length);
    }
    offset_ += length;
    return Parse::kComplete;
  }

  Parse malformed(std::string reason) {
    reason_ = std::move(reason);
    return Parse::kMalformed;
  }

  const uint8_t* data_;
  size_t size_;
  size_t offset_ = 0;
  Request* request_;
  std::string reason_;
};

}  // namespace kolo::store_protocol
