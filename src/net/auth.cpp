// Challenge-response proof of the job secret; see auth.hpp for the exchange.
//
// Bytes on the wire, all integers little-endian:
//   acceptor  -> connector  nonce A      32 random bytes
//   connector -> acceptor   hello        32 bytes: "KOLO", u32 version (3), u32 purpose,
//                                        i32 rank, u32 stream, u32 reserved (0), u64 context
//                           tag          32 bytes: HMAC-SHA-512/256(key, 'C' || A || hello || B)
//                                        where key = auth_key(secret) (auth.hpp: Argon2id)
//                           nonce B      32 random bytes
//   acceptor  -> connector  proof        32 bytes: HMAC-SHA-512/256(key, 'S' || A || hello || B);
//                                        on any failure the acceptor closes the connection
//                                        instead, and says why only in its own log (a stranger
//                                        learns nothing). The connector checks the proof before
//                                        it sends or believes anything else.
// The role byte keeps either tag from standing in for the other.
#include "net/auth.hpp"

#include <fmt/format.h>
#include <sodium.h>

#include <cstring>
#include <map>
#include <mutex>

#include "kolo/status.hpp"

namespace kolo::net {
namespace {

constexpr uint8_t kMagic[4] = {'K', 'O', 'L', 'O'};
constexpr uint32_t kProtocolVersion = 3;  // 3: the key from Argon2id instead of BLAKE2b
constexpr size_t kHelloBytes = 32;
constexpr size_t kTagBytes = crypto_auth_hmacsha512256_BYTES;
static_assert(kHelloBytes + kTagBytes + kAuthNonceBytes == kAuthAnswerBytes);
static_assert(kTagBytes == kAuthProofBytes);
static_assert(crypto_auth_hmacsha512256_KEYBYTES == 32);

void ensure_sodium() {
  // sodium_init is safe to call from several threads, but a static makes "once" explicit.
  static const int result = sodium_init();
  if (result < 0) throw Error(Status::kInternal, "libsodium failed to initialise (sodium_init)");
}

void put_u32(uint8_t* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}
void put_u64(uint8_t* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}
uint32_t get_u32(const uint8_t* in) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= static_cast<uint32_t>(in[i]) << (8 * i);
  return value;
}
uint64_t get_u64(const uint8_t* in) {
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value |= static_cast<uint64_t>(in[i]) << (8 * i);
  return value;
}

// Writes kHelloBytes at out.
void encode_hello(const Hello& hello, uint8_t* out) {
  std::memcpy(out, kMagic, 4);
  put_u32(out + 4, kProtocolVersion);
  put_u32(out + 8, hello.purpose);
  put_u32(out + 12, static_cast<uint32_t>(hello.rank));
  put_u32(out + 16, hello.stream);
  put_u32(out + 20, 0);
  put_u64(out + 24, hello.context);
}

// The key derivation's fixed salt: kolo's own, so that a table computed for another program's
// hashes is of no use; a per-job salt would have to reach every rank beside the secret.
constexpr uint8_t kKeySalt[crypto_pwhash_SALTBYTES] = {'k', 'o', 'l', 'o', ' ', 'a', 'u', 't',
                                                       'h', ' ', 'k', 'e', 'y', ' ', 'v', '3'};
// Argon2id's cost: 2 passes over 16 MiB, about 12 ms on one core of a loaded 2020s machine (five
// times the cost of 4 MiB, a quarter of 64 MiB). Paid once per secret and process.
constexpr unsigned long long kKeyPasses = 2;
constexpr size_t kKeyMemoryBytes = size_t{16} << 20;
static_assert(kKeyPasses >= crypto_pwhash_OPSLIMIT_MIN);
static_assert(kKeyMemoryBytes >= crypto_pwhash_MEMLIMIT_MIN);

constexpr uint8_t kConnectorRole = 'C';
constexpr uint8_t kAcceptorRole = 'S';

// HMAC over role || acceptor's nonce || hello || connector's nonce.
void compute_tag(const std::string& secret, uint8_t role, const AuthNonce& nonce,
                 const uint8_t* hello, const uint8_t* connector_nonce, uint8_t (&tag)[kTagBytes]) {
  const AuthKey& key = auth_key(secret);
  uint8_t message[1 + kAuthNonceBytes + kHelloBytes + kAuthNonceBytes];
  message[0] = role;
  std::memcpy(message + 1, nonce.data(), kAuthNonceBytes);
  std::memcpy(message + 1 + kAuthNonceBytes, hello, kHelloBytes);
  std::memcpy(message + 1 + kAuthNonceBytes + kHelloBytes, connector_nonce, kAuthNonceBytes);
  crypto_auth_hmacsha512256(tag, message, sizeof message, key.data());
}

// Re-throws e with the same status and context in front of its message.
[[noreturn]] void rethrow_with_context(const Error& error, const std::string& context) {
  throw Error(error.status(), fmt::format("{}: {}", context, error.what()));
}

std::string describe(const Socket& socket) {
  try {
    return peer_endpoint(socket).to_string();
  } catch (const Error&) {
    return fmt::format("a peer on fd {}", socket.fd());
  }
}

}  // namespace

const AuthKey& auth_key(const std::string& secret) {
  ensure_sodium();
  // Keys are kept for the life of the process (a process meets one secret, or a few in tests),
  // in a map whose entries never move, so that a reference stays valid.
  static std::mutex mutex;
  static std::map<std::string, AuthKey> keys;
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, inserted] = keys.try_emplace(secret);
  if (inserted &&
      crypto_pwhash(it->second.data(), it->second.size(), secret.data(), secret.size(), kKeySalt,
                    kKeyPasses, kKeyMemoryBytes, crypto_pwhash_ALG_ARGON2ID13) != 0) {
    keys.erase(it);
    throw Error(Status::kSystem,
                fmt::format("deriving the authentication key from the job secret needs {} MiB, "
                            "which could not be allocated",
                            kKeyMemoryBytes >> 20));
  }
  return it->second;
}

AuthNonce make_auth_nonce() {
  ensure_sodium();
  AuthNonce nonce;
  randombytes_buf(nonce.data(), nonce.size());
  return nonce;
}

Hello check_auth_answer(const std::string& secret, const AuthNonce& nonce,
                        const uint8_t (&answer)[kAuthAnswerBytes], const std::string& peer) {
  ensure_sodium();
  const uint8_t* hello = answer;
  const uint8_t* tag = answer + kHelloBytes;
  const uint8_t* connector_nonce = answer + kHelloBytes + kTagBytes;
  if (std::memcmp(hello, kMagic, sizeof kMagic) != 0) {
    throw Error(Status::kMismatch,
                fmt::format("connection from {} is not a kolo peer (it does not begin its "
                            "answer with the protocol magic 'KOLO'); dropped",
                            peer));
  }
  uint32_t version = get_u32(hello + 4);
  if (version != kProtocolVersion) {
    throw Error(Status::kMismatch,
                fmt::format("connection from {} speaks kolo protocol version {}, this process "
                            "speaks version {}; are all ranks running the same kolo build?",
                            peer, version, kProtocolVersion));
  }
  uint8_t expected[kTagBytes];
  compute_tag(secret, kConnectorRole, nonce, hello, connector_nonce, expected);
  if (sodium_memcmp(expected, tag, kTagBytes) != 0) {
    throw Error(Status::kMismatch,
                fmt::format("connection from {} failed authentication: its proof of the job "
                            "secret is wrong (is KOLO_SECRET the same on every rank?); dropped",
                            peer));
  }
  Hello result;
  result.purpose = get_u32(hello + 8);
  result.rank = static_cast<int32_t>(get_u32(hello + 12));
  result.stream = get_u32(hello + 16);
  result.context = get_u64(hello + 24);
  return result;
}

void authenticate_as_client(const Socket& socket, const std::string& secret, const Hello& hello,
                            const Deadline& deadline) {
  ensure_sodium();
  const std::string peer = describe(socket);
  AuthNonce nonce;
  try {
    recv_all(socket, nonce.data(), nonce.size(), deadline);
  } catch (const Error& error) {
    rethrow_with_context(error,
                         fmt::format("authenticating to {} (waiting for its challenge)", peer));
  }

  uint8_t answer[kAuthAnswerBytes];
  encode_hello(hello, answer);
  uint8_t* connector_nonce = answer + kHelloBytes + kTagBytes;
  randombytes_buf(connector_nonce, kAuthNonceBytes);
  uint8_t tag[kTagBytes];
  compute_tag(secret, kConnectorRole, nonce, answer, connector_nonce, tag);
  std::memcpy(answer + kHelloBytes, tag, kTagBytes);

  AuthProof proof{};
  try {
    send_all(socket, answer, sizeof answer, deadline);
    recv_all(socket, proof.data(), proof.size(), deadline);
  } catch (const Error& error) {
    if (error.status() != Status::kPeerLost) {
      rethrow_with_context(error, fmt::format("authenticating to {}", peer));
    }
    throw Error(Status::kPeerLost,
                fmt::format("{} dropped the connection during authentication: it did not accept "
                            "this process's proof of the job secret (is KOLO_SECRET the same on "
                            "every rank, and is every rank running the same kolo build?) [{}]",
                            peer, error.what()));
  }
  const AuthProof expected = acceptor_proof(secret, nonce, answer);
  if (sodium_memcmp(expected.data(), proof.data(), proof.size()) != 0) {
    throw Error(Status::kMismatch,
                fmt::format("{} does not know the job secret: its proof in return is wrong, so "
                            "it is not this job's (another job, or a process that took the port "
                            "first); nothing was sent to it",
                            peer));
  }
}

AuthProof acceptor_proof(const std::string& secret, const AuthNonce& nonce,
                         const uint8_t (&answer)[kAuthAnswerBytes]) {
  ensure_sodium();
  AuthProof proof{};
  uint8_t tag[kTagBytes];
  compute_tag(secret, kAcceptorRole, nonce, answer, answer + kHelloBytes + kTagBytes, tag);
  std::memcpy(proof.data(), tag, kTagBytes);
  sodium_memzero(tag, sizeof tag);
  return proof;
}

Hello authenticate_as_server(const Socket& socket, const std::string& secret,
                             const Deadline& deadline) {
  const std::string peer = describe(socket);
  AuthNonce nonce = make_auth_nonce();
  uint8_t answer[kAuthAnswerBytes];
  try {
    send_all(socket, nonce.data(), nonce.size(), deadline);
    recv_all(socket, answer, sizeof answer, deadline);
  } catch (const Error& error) {
    rethrow_with_context(error, fmt::format("authenticating the connection from {}", peer));
  }
  Hello hello = check_auth_answer(secret, nonce, answer, peer);
  const AuthProof proof = acceptor_proof(secret, nonce, answer);
  try {
    send_all(socket, proof.data(), proof.size(), deadline);
  } catch (const Error& error) {
    rethrow_with_context(error, fmt::format("accepting the connection from {}", peer));
  }
  return hello;
}

}  // namespace kolo::net
