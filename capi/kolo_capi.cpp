// The C ABI: converts C arguments to the C++ core and every exception back to a status.
// No exception crosses this file's functions.
#include "kolo.h"

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

#include "core/communicator.hpp"
#include "kolo/dtype.hpp"
#include "kolo/status.hpp"

struct kolo_comm {
  std::unique_ptr<kolo::Communicator> communicator;
  std::mutex error_mutex;
  std::string last_error;
};

namespace {

thread_local std::string init_error;

static_assert(static_cast<int>(kolo::Status::kUnsupported) == KOLO_ERR_UNSUPPORTED);
static_assert(static_cast<int>(kolo::DataType::kInt64) == KOLO_INT64);
static_assert(static_cast<int>(kolo::ReduceOp::kProd) == KOLO_PROD);

// The size of the version-1 kolo_config_t: older callers may pass a shorter struct one day, and a
// caller compiled against a newer header a longer one, of which we read what we know.
constexpr size_t kConfigV1Size = offsetof(kolo_config_t, segment_bytes) + sizeof(uint64_t);

kolo_status_t record(std::string* target, std::mutex* mutex, kolo_status_t status,
                     const std::string& message) {
  if (mutex) {
    std::lock_guard<std::mutex> lock(*mutex);
    *target = message;
  } else {
    *target = message;
  }
  return status;
}

// Runs body, turning exceptions into a status and the communicator's last error.
template <typename Body>
kolo_status_t guarded(kolo_comm_t comm, Body&& body) {
  std::string* target = comm ? &comm->last_error : &init_error;
  std::mutex* mutex = comm ? &comm->error_mutex : nullptr;
  try {
    body();
    return KOLO_SUCCESS;
  } catch (const kolo::Error& error) {
    return record(target, mutex, static_cast<kolo_status_t>(error.status()), error.what());
  } catch (const std::bad_alloc&) {
    return record(target, mutex, KOLO_ERR_SYSTEM, "out of memory");
  } catch (const std::exception& error) {
    return record(target, mutex, KOLO_ERR_INTERNAL, error.what());
  } catch (...) {
    return record(target, mutex, KOLO_ERR_INTERNAL, "unknown exception");
  }
}

kolo::ConfigOverrides overrides_from(const kolo_config_t* config) {
  kolo::ConfigOverrides overrides;
  if (!config) return overrides;
  if (config->struct_size < kConfigV1Size || config->magic != KOLO_CONFIG_MAGIC) {
    throw kolo::Error(kolo::Status::kInvalidArgument,
                      "kolo_comm_init: config was not filled by KOLO_CONFIG_INITIALIZER (wrong "
                      "struct_size or magic)");
  }
  if (config->api_version < 1) {
    throw kolo::Error(kolo::Status::kInvalidArgument,
                      "kolo_comm_init: config has an unknown api_version");
  }
  if (config->rank >= 0) overrides.rank = config->rank;
  if (config->size >= 0) overrides.size = config->size;
  if (config->local_rank >= 0) overrides.local_rank = config->local_rank;
  if (config->local_size >= 0) overrides.local_size = config->local_size;
  if (config->addr) overrides.addr = config->addr;
  if (config->secret) overrides.secret = config->secret;
  if (config->timeout_s > 0) overrides.timeout_s = config->timeout_s;
  if (config->tcp_streams > 0) overrides.tcp_streams = config->tcp_streams;
  if (config->socket_ifname) overrides.socket_ifname = config->socket_ifname;
  if (config->segment_bytes > 0) overrides.segment_bytes = config->segment_bytes;
  return overrides;
}

kolo::Communicator& communicator_of(kolo_comm_t comm) {
  if (!comm || !comm->communicator) {
    throw kolo::Error(kolo::Status::kInvalidArgument, "the communicator is NULL");
  }
  return *comm->communicator;
}

template <typename Getter>
kolo_status_t query(kolo_comm_t comm, int* out, const char* what, Getter&& getter) {
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    if (!out) {
      throw kolo::Error(kolo::Status::kInvalidArgument, std::string(what) + ": output is NULL");
    }
    *out = getter(communicator);
  });
}

}  // namespace

extern "C" {

int kolo_version(void) { return KOLO_VERSION; }

const char* kolo_status_string(kolo_status_t status) {
  return kolo::status_name(static_cast<kolo::Status>(status));
}

size_t kolo_dtype_size(kolo_dtype_t dtype) {
  return kolo::dtype_size(static_cast<kolo::DataType>(dtype));
}

kolo_status_t kolo_comm_init(const kolo_config_t* config, kolo_comm_t* comm) {
  init_error.clear();
  if (comm) *comm = nullptr;
  return guarded(nullptr, [&] {
    if (!comm) {
      throw kolo::Error(kolo::Status::kInvalidArgument, "kolo_comm_init: comm is NULL");
    }
    auto handle = std::make_unique<kolo_comm>();
    handle->communicator = std::make_unique<kolo::Communicator>(overrides_from(config));
    *comm = handle.release();
  });
}

kolo_status_t kolo_comm_destroy(kolo_comm_t comm) {
  if (!comm) return KOLO_ERR_INVALID_ARGUMENT;
  delete comm;
  return KOLO_SUCCESS;
}

kolo_status_t kolo_comm_rank(kolo_comm_t comm, int* rank) {
  return query(comm, rank, "kolo_comm_rank", [](auto& c) { return c.rank(); });
}
kolo_status_t kolo_comm_size(kolo_comm_t comm, int* size) {
  return query(comm, size, "kolo_comm_size", [](auto& c) { return c.size(); });
}
kolo_status_t kolo_comm_local_rank(kolo_comm_t comm, int* local_rank) {
  return query(comm, local_rank, "kolo_comm_local_rank", [](auto& c) { return c.local_rank(); });
}
kolo_status_t kolo_comm_local_size(kolo_comm_t comm, int* local_size) {
  return query(comm, local_size, "kolo_comm_local_size", [](auto& c) { return c.local_size(); });
}

const char* kolo_comm_last_error(kolo_comm_t comm) {
  if (!comm) return init_error.c_str();
  std::lock_guard<std::mutex> lock(comm->error_mutex);
  return comm->last_error.c_str();
}

kolo_status_t kolo_allreduce(kolo_comm_t comm, const void* sendbuf, void* recvbuf, uint64_t count,
                             kolo_dtype_t dtype, kolo_op_t op) {
  return kolo_allreduce_scaled(comm, sendbuf, recvbuf, count, dtype, op, 1.0, 1.0);
}

kolo_status_t kolo_allreduce_scaled(kolo_comm_t comm, const void* sendbuf, void* recvbuf,
                                    uint64_t count, kolo_dtype_t dtype, kolo_op_t op,
                                    double prescale, double postscale) {
  return guarded(comm, [&] {
    communicator_of(comm).allreduce(sendbuf, recvbuf, count, static_cast<kolo::DataType>(dtype),
                                    static_cast<kolo::ReduceOp>(op), prescale, postscale);
  });
}

kolo_status_t kolo_broadcast(kolo_comm_t comm, void* buf, uint64_t count, kolo_dtype_t dtype,
                             int root) {
  return guarded(comm, [&] {
    communicator_of(comm).broadcast(buf, count, static_cast<kolo::DataType>(dtype), root);
  });
}

kolo_status_t kolo_barrier(kolo_comm_t comm) {
  return guarded(comm, [&] { communicator_of(comm).barrier(); });
}

}  // extern "C"
