// Proof of the job secret on every new connection, before any other byte is accepted.
//
// Challenge and response: the accepting side sends a fresh random 32-byte nonce; the connecting
// side answers with a hello (protocol magic and version, its purpose and identity) followed by
// HMAC-SHA-512/256(key = hash of the secret, nonce || hello). The acceptor checks the tag in
// constant time and drops the connection otherwise. The secret itself never crosses the wire, and
// a recorded answer cannot be replayed against a new nonce.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/deadline.hpp"
#include "net/socket.hpp"

namespace kolo::net {

// What a connecting side says about itself; carried inside the authenticated hello.
struct Hello {
  uint32_t purpose = 0;  // kPurposeStore, kPurposeData, kPurposeControl
  int32_t rank = -1;     // the connecting rank
  uint32_t stream = 0;   // which of several parallel connections this is
  uint64_t context = 0;  // which communicator the connection belongs to
};
inline constexpr uint32_t kPurposeStore = 1;
inline constexpr uint32_t kPurposeData = 2;
inline constexpr uint32_t kPurposeControl = 3;

// Connecting side. Throws kolo::Error(kPeerLost) if the acceptor drops the connection
// (for example because the secret is wrong), kTimeout at the deadline.
void authenticate_as_client(const Socket& socket, const std::string& secret, const Hello& hello,
                            const Deadline& deadline);

// Accepting side. Returns the peer's hello when its proof is valid. Throws kolo::Error(kMismatch)
// with a message naming the peer address when the proof or the protocol magic is wrong (the
// caller logs it, closes the socket and carries on), kTimeout at the deadline.
Hello authenticate_as_server(const Socket& socket, const std::string& secret,
                             const Deadline& deadline);

// The same exchange cut into its messages, for an event loop that serves many connections and
// must not block on any one of them (the rendezvous store). The acceptor sends the nonce, reads
// kAuthAnswerBytes, calls check_auth_answer, and on success sends the one byte kAuthAccepted;
// authenticate_as_server does exactly this.
inline constexpr size_t kAuthNonceBytes = 32;
inline constexpr size_t kAuthAnswerBytes = 64;  // a 32-byte hello, then a 32-byte tag
inline constexpr uint8_t kAuthAccepted = 0x4b;
using AuthNonce = std::array<uint8_t, kAuthNonceBytes>;

// A fresh random nonce.
AuthNonce make_auth_nonce();
// Checks an answer to nonce; returns the hello, or throws kolo::Error(kMismatch) naming peer.
Hello check_auth_answer(const std::string& secret, const AuthNonce& nonce,
                        const uint8_t (&answer)[kAuthAnswerBytes], const std::string& peer);

}  // namespace kolo::net
