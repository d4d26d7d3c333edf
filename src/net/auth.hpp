// Proof of the job secret on every new connection, before any other byte is accepted.
//
// Challenge and response, both ways: the accepting side sends a fresh random 32-byte nonce; the
// connecting side answers with a hello (protocol magic and version, its purpose and identity), an
// HMAC-SHA-512/256 under a key derived from the secret (auth_key) over both nonces and the hello,
// and a fresh nonce of its own. The acceptor checks the tag in constant time and drops the connection
// otherwise; if it is good, it proves the secret in turn with a tag over the same bytes under
// another role byte, which the connector checks before it sends anything else. So neither side
// talks to a process that does not know the secret: a stranger that took the store's port first
// (or a peer's address) cannot hand out forged addresses or receive a byte of data. The secret
// itself never crosses the wire, and a recorded exchange cannot be replayed against new nonces.
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
  uint32_t purpose = 0;  // kPurposeStore, kPurposeData, kPurposeControl, kPurposeLifeline
  int32_t rank = -1;     // the connecting rank
  uint32_t stream = 0;   // which of several parallel connections this is
  uint64_t context = 0;  // which communicator the connection belongs to
};
inline constexpr uint32_t kPurposeStore = 1;
inline constexpr uint32_t kPurposeData = 2;
inline constexpr uint32_t kPurposeControl = 3;
inline constexpr uint32_t kPurposeLifeline = 4;  // comm/lifeline.hpp

// The MAC key of a secret: Argon2id (libsodium's crypto_pwhash) of the secret under kolo's fixed
// salt, with a cost of about 12 ms and 16 MiB, so that whoever records one handshake must pay that
// for every secret guessed offline, where an unsalted hash would cost them next to nothing. The
// config refuses secrets shorter than 16 characters (core/config.hpp). Derived once per secret and
// process, then kept; thread-safe. Throws kolo::Error(kSystem) when the memory is not there.
using AuthKey = std::array<uint8_t, 32>;
const AuthKey& auth_key(const std::string& secret);

// Connecting side. Throws kolo::Error(kPeerLost) if the acceptor drops the connection (for
// example because the secret is wrong), kMismatch naming the acceptor when its own proof is wrong
// (it does not know the secret), kTimeout at the deadline.
void authenticate_as_client(const Socket& socket, const std::string& secret, const Hello& hello,
                            const Deadline& deadline);

// Accepting side. Returns the peer's hello when its proof is valid. Throws kolo::Error(kMismatch)
// with a message naming the peer address when the proof or the protocol magic is wrong (the
// caller logs it, closes the socket and carries on), kTimeout at the deadline.
Hello authenticate_as_server(const Socket& socket, const std::string& secret,
                             const Deadline& deadline);

// The same exchange cut into its messages, for an event loop that serves many connections and
// must not block on any one of them (the rendezvous store, the mesh). The acceptor sends the
// nonce, reads kAuthAnswerBytes, calls check_auth_answer, and on success sends the
// kAuthProofBytes of acceptor_proof; authenticate_as_server does exactly this.
inline constexpr size_t kAuthNonceBytes = 32;
// A 32-byte hello, a 32-byte tag, the connector's 32-byte nonce.
inline constexpr size_t kAuthAnswerBytes = 96;
inline constexpr size_t kAuthProofBytes = 32;
using AuthNonce = std::array<uint8_t, kAuthNonceBytes>;
using AuthProof = std::array<uint8_t, kAuthProofBytes>;

// A fresh random nonce.
AuthNonce make_auth_nonce();
// Checks an answer to nonce; returns the hello, or throws kolo::Error(kMismatch) naming peer.
Hello check_auth_answer(const std::string& secret, const AuthNonce& nonce,
                        const uint8_t (&answer)[kAuthAnswerBytes], const std::string& peer);
// The acceptor's proof of the secret, for an answer that check_auth_answer accepted.
AuthProof acceptor_proof(const std::string& secret, const AuthNonce& nonce,
                         const uint8_t (&answer)[kAuthAnswerBytes]);

}  // namespace kolo::net
