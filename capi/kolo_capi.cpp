// The C ABI: converts C arguments to the C++ core and every exception back to a status.
// No exception crosses this file's functions.
#include "kolo.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/elastic.hpp"
#include "fusion/engine.hpp"
#include "kolo/dtype.hpp"
#include "kolo/status.hpp"

struct kolo_comm {
  std::unique_ptr<kolo::Communicator> communicator;
  std::mutex error_mutex;
  std::string last_error;
};

// A named operation's handle: shares the request with the fusion engine, so either may let go
// first (see fusion/request.hpp).
struct kolo_request {
  std::shared_ptr<kolo::fusion::Request> request;
  std::mutex error_mutex;
  std::string call_error;  // why kolo_request_counts refused, until the next call on the request
};

namespace {

thread_local std::string init_error;

static_assert(static_cast<int>(kolo::Status::kUnsupported) == KOLO_ERR_UNSUPPORTED);
static_assert(static_cast<int>(kolo::Status::kCancelled) == KOLO_ERR_CANCELLED);
static_assert(static_cast<int>(kolo::DataType::kInt64) == KOLO_INT64);
static_assert(static_cast<int>(kolo::DataType::kInt16) == KOLO_INT16);
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
    if (error.status() == kolo::Status::kSuccess) {  // a failure must never read as success
      return record(target, mutex, KOLO_ERR_INTERNAL,
                    std::string("an error carried status success: ") + error.what());
    }
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

// The C enums hold any int (int is their underlying type in C++) while the core's are one byte:
// a narrowing cast would read 256 as float32. A value outside the enum becomes 255, which the
// core refuses as an unknown dtype or op.
kolo::DataType core_dtype(kolo_dtype_t dtype) {
  const int value = dtype;
  return static_cast<kolo::DataType>(value >= 0 && value < kolo::kDataTypeCount ? value : 255);
}

kolo::ReduceOp core_op(kolo_op_t op) {
  const int value = op;
  return static_cast<kolo::ReduceOp>(value >= 0 && value < kolo::kReduceOpCount ? value : 255);
}

kolo::Communicator& communicator_of(kolo_comm_t comm) {
  if (!comm || !comm->communicator) {
    throw kolo::Error(kolo::Status::kInvalidArgument, "the communicator is NULL");
  }
  return *comm->communicator;
}

// A C array of one entry per rank; NULL stays NULL (the communicator refuses it by name).
template <typename T>
std::span<const T> per_rank(const T* values, const kolo::Communicator& communicator) {
  return values ? std::span<const T>(values, static_cast<size_t>(communicator.size()))
                : std::span<const T>();
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
  return kolo::dtype_size(core_dtype(dtype));
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

// Another thread may record a new error on the same communicator at any moment: the caller gets
// this thread's own copy, which only its own next call replaces.
const char* kolo_comm_last_error(kolo_comm_t comm) {
  if (!comm) return init_error.c_str();
  thread_local std::string copy;
  std::lock_guard<std::mutex> lock(comm->error_mutex);
  copy = comm->last_error;
  return copy.c_str();
}

kolo_status_t kolo_allreduce(kolo_comm_t comm, const void* sendbuf, void* recvbuf, uint64_t count,
                             kolo_dtype_t dtype, kolo_op_t op) {
  return kolo_allreduce_scaled(comm, sendbuf, recvbuf, count, dtype, op, 1.0, 1.0);
}

kolo_status_t kolo_allreduce_scaled(kolo_comm_t comm, const void* sendbuf, void* recvbuf,
                                    uint64_t count, kolo_dtype_t dtype, kolo_op_t op,
                                    double prescale, double postscale) {
  return guarded(comm, [&] {
    communicator_of(comm).allreduce(sendbuf, recvbuf, count, core_dtype(dtype),
                                    core_op(op), prescale, postscale);
  });
}

kolo_status_t kolo_broadcast(kolo_comm_t comm, void* buf, uint64_t count, kolo_dtype_t dtype,
                             int root) {
  return guarded(comm, [&] {
    communicator_of(comm).broadcast(buf, count, core_dtype(dtype), root);
  });
}

kolo_status_t kolo_barrier(kolo_comm_t comm) {
  return guarded(comm, [&] { communicator_of(comm).barrier(); });
}

kolo_status_t kolo_allgather(kolo_comm_t comm, const void* sendbuf, void* recvbuf, uint64_t count,
                             kolo_dtype_t dtype) {
  return guarded(comm, [&] {
    communicator_of(comm).allgather(sendbuf, recvbuf, count, core_dtype(dtype));
  });
}

kolo_status_t kolo_allgatherv(kolo_comm_t comm, const void* sendbuf, void* recvbuf,
                              const uint64_t* counts, kolo_dtype_t dtype) {
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    communicator.allgatherv(sendbuf, recvbuf, per_rank(counts, communicator),
                            core_dtype(dtype));
  });
}

kolo_status_t kolo_reduce_scatter(kolo_comm_t comm, const void* sendbuf, void* recvbuf,
                                  uint64_t count, kolo_dtype_t dtype, kolo_op_t op) {
  return guarded(comm, [&] {
    communicator_of(comm).reduce_scatter(sendbuf, recvbuf, count,
                                         core_dtype(dtype),
                                         core_op(op));
  });
}

kolo_status_t kolo_reduce_scatterv(kolo_comm_t comm, const void* sendbuf, void* recvbuf,
                                   const uint64_t* counts, kolo_dtype_t dtype, kolo_op_t op) {
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    communicator.reduce_scatterv(sendbuf, recvbuf, per_rank(counts, communicator),
                                 core_dtype(dtype),
                                 core_op(op));
  });
}

kolo_status_t kolo_alltoall(kolo_comm_t comm, const void* sendbuf, void* recvbuf, uint64_t count,
                            kolo_dtype_t dtype) {
  return guarded(comm, [&] {
    communicator_of(comm).alltoall(sendbuf, recvbuf, count, core_dtype(dtype));
  });
}

kolo_status_t kolo_alltoallv(kolo_comm_t comm, const void* sendbuf, const uint64_t* sendcounts,
                             const int64_t* sdispls, void* recvbuf, const uint64_t* recvcounts,
                             const int64_t* rdispls, kolo_dtype_t dtype) {
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    communicator.alltoallv(sendbuf, per_rank(sendcounts, communicator),
                           per_rank(sdispls, communicator), recvbuf,
                           per_rank(recvcounts, communicator), per_rank(rdispls, communicator),
                           core_dtype(dtype));
  });
}

kolo_status_t kolo_reduce(kolo_comm_t comm, const void* sendbuf, void* recvbuf, uint64_t count,
                          kolo_dtype_t dtype, kolo_op_t op, int root) {
  return guarded(comm, [&] {
    communicator_of(comm).reduce(sendbuf, recvbuf, count, core_dtype(dtype),
                                 core_op(op), root);
  });
}

kolo_status_t kolo_send(kolo_comm_t comm, const void* buf, uint64_t count, kolo_dtype_t dtype,
                        int peer, int tag) {
  return guarded(comm, [&] {
    communicator_of(comm).send(buf, count, core_dtype(dtype), peer, tag);
  });
}

kolo_status_t kolo_recv(kolo_comm_t comm, void* buf, uint64_t count, kolo_dtype_t dtype, int peer,
                        int tag) {
  return guarded(comm, [&] {
    communicator_of(comm).recv(buf, count, core_dtype(dtype), peer, tag);
  });
}

kolo_status_t kolo_comm_split(kolo_comm_t comm, int color, int key, kolo_comm_t* newcomm) {
  if (newcomm) *newcomm = nullptr;
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    if (!newcomm) {
      throw kolo::Error(kolo::Status::kInvalidArgument, "kolo_comm_split: newcomm is NULL");
    }
    std::unique_ptr<kolo::Communicator> child = communicator.split(color, key);
    if (child) {
      auto handle = std::make_unique<kolo_comm>();
      handle->communicator = std::move(child);
      *newcomm = handle.release();
    }
  });
}

kolo_status_t kolo_comm_shrink(kolo_comm_t comm, kolo_comm_t* newcomm) {
  if (newcomm) *newcomm = nullptr;
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    if (!newcomm) {
      throw kolo::Error(kolo::Status::kInvalidArgument, "kolo_comm_shrink: newcomm is NULL");
    }
    auto handle = std::make_unique<kolo_comm>();
    handle->communicator = communicator.shrink();
    *newcomm = handle.release();
  });
}

kolo_status_t kolo_comm_invite(kolo_comm_t comm, char* buf, size_t len) {
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    if (!buf) throw kolo::Error(kolo::Status::kInvalidArgument, "kolo_comm_invite: buf is NULL");
    const std::string invitation = communicator.invite();
    if (invitation.size() + 1 > len) {
      throw kolo::Error(kolo::Status::kInvalidArgument,
                        fmt::format("kolo_comm_invite: the invitation needs {} bytes and buf has "
                                    "{} (KOLO_INVITATION_MAX is enough)",
                                    invitation.size() + 1, len));
    }
    std::memcpy(buf, invitation.c_str(), invitation.size() + 1);
  });
}

kolo_status_t kolo_comm_grow(kolo_comm_t comm, int new_size, kolo_comm_t* newcomm) {
  if (newcomm) *newcomm = nullptr;
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    if (!newcomm) {
      throw kolo::Error(kolo::Status::kInvalidArgument, "kolo_comm_grow: newcomm is NULL");
    }
    auto handle = std::make_unique<kolo_comm>();
    handle->communicator = communicator.grow(new_size);
    *newcomm = handle.release();
  });
}

kolo_status_t kolo_elastic_update(kolo_comm_t comm, kolo_elastic_update_t* update,
                                  kolo_comm_t* newcomm) {
  if (newcomm) *newcomm = nullptr;
  if (update) *update = kolo_elastic_update_t{};
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    if (!update) {
      throw kolo::Error(kolo::Status::kInvalidArgument, "kolo_elastic_update: update is NULL");
    }
    if (!newcomm) {
      throw kolo::Error(kolo::Status::kInvalidArgument, "kolo_elastic_update: newcomm is NULL");
    }
    kolo::ElasticOutcome outcome = kolo::elastic_update(communicator);
    if (outcome.comm) {
      auto handle = std::make_unique<kolo_comm>();
      handle->communicator = std::move(outcome.comm);
      *newcomm = handle.release();
    }
    update->changed = outcome.changed;
    update->leaving = outcome.leaving;
    update->joined = outcome.joined;
    update->left = outcome.left;
    update->old_size = outcome.old_size;
    update->new_size = outcome.new_size;
  });
}

}  // extern "C"

// ---- Named asynchronous operations (src/fusion/) ---------------------------------------------

namespace {

// The version-1 kolo_async_options_t, and of kolo_fusion_stats_t the fields every caller has.
constexpr size_t kAsyncOptionsV1Size = offsetof(kolo_async_options_t, user_data) + sizeof(void*);
constexpr size_t kFusionStatsMinimumSize = offsetof(kolo_fusion_stats_t, idle_sleeps);

// Checks the C arguments common to every named call, submits, and hands out a request handle.
// `submit` calls the engine's narrow submit API with the chosen options: a template rather than
// a std::function, which would allocate on every submission (once per gradient in a step).
template <typename Submit>
kolo_status_t submit_named(kolo_comm_t comm, const char* call, bool named,
                           const kolo_async_options_t* options, kolo_request_t* request,
                           const Submit& submit) {
  if (request) *request = nullptr;
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    if (!request) {
      throw kolo::Error(kolo::Status::kInvalidArgument, std::string(call) + ": request is NULL");
    }
    if (!named) {
      throw kolo::Error(kolo::Status::kInvalidArgument, std::string(call) + ": name is NULL");
    }
    kolo_async_options_t defaults = KOLO_ASYNC_OPTIONS_INITIALIZER;
    if (options && options->struct_size < kAsyncOptionsV1Size) {
      throw kolo::Error(kolo::Status::kInvalidArgument,
                        std::string(call) +
                            ": options were not filled by KOLO_ASYNC_OPTIONS_INITIALIZER (wrong "
                            "struct_size)");
    }
    const kolo_async_options_t& chosen = options ? *options : defaults;
    kolo::fusion::SubmitOptions submit_options;
    submit_options.prescale = chosen.prescale;
    submit_options.postscale = chosen.postscale;
    if (chosen.callback) {
      submit_options.callback = [function = chosen.callback,
                                 user = chosen.user_data](kolo::Status status) {
        function(static_cast<kolo_status_t>(status), user);
      };
    }
    auto handle = std::make_unique<kolo_request>();
    handle->request = submit(communicator.fusion(), std::move(submit_options));
    *request = handle.release();
  });
}

void forget_call_error(kolo_request_t request) {
  std::lock_guard<std::mutex> lock(request->error_mutex);
  request->call_error.clear();
}

}  // namespace

extern "C" {

kolo_status_t kolo_allreduce_async(kolo_comm_t comm, const char* name, const void* sendbuf,
                                   void* recvbuf, uint64_t count, kolo_dtype_t dtype, kolo_op_t op,
                                   const kolo_async_options_t* options, kolo_request_t* request) {
  return submit_named(
      comm, "kolo_allreduce_async", name != nullptr, options, request,
      [&](kolo::fusion::FusionEngine& engine, kolo::fusion::SubmitOptions chosen) {
        kolo::fusion::NamedTensor tensor{name, sendbuf, recvbuf, count};
        return engine.allreduce({&tensor, 1}, core_dtype(dtype), core_op(op), std::move(chosen));
      });
}

kolo_status_t kolo_broadcast_async(kolo_comm_t comm, const char* name, void* buf, uint64_t count,
                                   kolo_dtype_t dtype, int root,
                                   const kolo_async_options_t* options, kolo_request_t* request) {
  return submit_named(comm, "kolo_broadcast_async", name != nullptr, options, request,
                      [&](kolo::fusion::FusionEngine& engine, kolo::fusion::SubmitOptions chosen) {
                        return engine.broadcast({name, buf, buf, count}, core_dtype(dtype), root,
                                                std::move(chosen));
                      });
}

kolo_status_t kolo_allreduce_group_async(kolo_comm_t comm, int n, const char* const* names,
                                         const void* const* sendbufs, void* const* recvbufs,
                                         const uint64_t* counts, kolo_dtype_t dtype, kolo_op_t op,
                                         const kolo_async_options_t* options,
                                         kolo_request_t* request) {
  const char* call = "kolo_allreduce_group_async";
  std::vector<kolo::fusion::NamedTensor> tensors;
  kolo_status_t status = guarded(comm, [&] {
    communicator_of(comm);
    if (std::string problem = kolo::fusion::group_size_problem(n); !problem.empty()) {
      throw kolo::Error(kolo::Status::kInvalidArgument, fmt::format("{}: {}", call, problem));
    }
    if (!names || !sendbufs || !recvbufs || !counts) {
      throw kolo::Error(kolo::Status::kInvalidArgument,
                        fmt::format("{}: names, sendbufs, recvbufs and counts must not be NULL",
                                    call));
    }
    tensors.reserve(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      if (!names[i]) {
        throw kolo::Error(kolo::Status::kInvalidArgument,
                          fmt::format("{}: names[{}] is NULL", call, i));
      }
      tensors.push_back({names[i], sendbufs[i], recvbufs[i], counts[i]});
    }
  });
  if (status != KOLO_SUCCESS) {
    if (request) *request = nullptr;
    return status;
  }
  return submit_named(comm, call, true, options, request,
                      [&](kolo::fusion::FusionEngine& engine, kolo::fusion::SubmitOptions chosen) {
                        return engine.allreduce(tensors, core_dtype(dtype), core_op(op),
                                                std::move(chosen));
                      });
}

kolo_status_t kolo_allgather_async(kolo_comm_t comm, const char* name, const void* sendbuf,
                                   uint64_t count, void* recvbuf, uint64_t recv_capacity,
                                   kolo_dtype_t dtype, const kolo_async_options_t* options,
                                   kolo_request_t* request) {
  return submit_named(
      comm, "kolo_allgather_async", name != nullptr, options, request,
      [&](kolo::fusion::FusionEngine& engine, kolo::fusion::SubmitOptions chosen) {
        return engine.allgather({name, sendbuf, recvbuf, count}, recv_capacity,
                                core_dtype(dtype), std::move(chosen));
      });
}

kolo_status_t kolo_request_test(kolo_request_t request, int* done) {
  if (!request || !done) return KOLO_ERR_INVALID_ARGUMENT;
  forget_call_error(request);
  kolo::Status status = kolo::Status::kSuccess;
  *done = request->request->test(&status) ? 1 : 0;
  return static_cast<kolo_status_t>(status);
}

kolo_status_t kolo_request_wait(kolo_request_t request) {
  if (!request) return KOLO_ERR_INVALID_ARGUMENT;
  forget_call_error(request);
  return static_cast<kolo_status_t>(request->request->wait());
}

kolo_status_t kolo_request_counts(kolo_request_t request, uint64_t* counts, int n) {
  if (!request) return KOLO_ERR_INVALID_ARGUMENT;
  forget_call_error(request);
  std::string refusal;
  kolo::Status status = request->request->copy_gathered_counts(counts, n, &refusal);
  if (!refusal.empty()) {
    std::lock_guard<std::mutex> lock(request->error_mutex);
    request->call_error = "kolo_request_counts: " + refusal;
  }
  return static_cast<kolo_status_t>(status);
}

const char* kolo_request_last_error(kolo_request_t request) {
  if (!request) return "";
  thread_local std::string copy;  // as in kolo_comm_last_error
  std::lock_guard<std::mutex> lock(request->error_mutex);
  copy = request->call_error.empty() ? request->request->message() : request->call_error;
  return copy.c_str();
}

kolo_status_t kolo_request_free(kolo_request_t request) {
  if (!request) return KOLO_ERR_INVALID_ARGUMENT;
  delete request;
  return KOLO_SUCCESS;
}

kolo_status_t kolo_comm_fusion_stats(kolo_comm_t comm, kolo_fusion_stats_t* stats) {
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    if (!stats || stats->struct_size < kFusionStatsMinimumSize) {
      throw kolo::Error(kolo::Status::kInvalidArgument,
                        "kolo_comm_fusion_stats: stats is NULL or its struct_size is too small");
    }
    const kolo::fusion::FusionStats counters = communicator.fusion().stats();
    kolo_fusion_stats_t filled;
    filled.struct_size = stats->struct_size;
    filled.cycles = counters.cycles;
    filled.idle_sleeps = counters.idle_sleeps;
    filled.tensors_submitted = counters.tensors_submitted;
    filled.requests_completed = counters.requests_completed;
    filled.requests_failed = counters.requests_failed;
    filled.negotiated = counters.negotiated;
    filled.cache_hits = counters.cache_hits;
    filled.collectives = counters.collectives;
    filled.fused_collectives = counters.fused_collectives;
    filled.tensors_fused = counters.tensors_fused;
    filled.bytes_copied = counters.bytes_copied;
    filled.fusion_buffer_bytes = counters.fusion_buffer_bytes;
    filled.autotune_updates = counters.autotune_updates;
    filled.autotune_settled = counters.autotune_settled ? 1 : 0;
    filled.fusion_threshold = counters.fusion_threshold;
    filled.cycle_time_ms = counters.cycle_time_ms;
    filled.segment_bytes = counters.segment_bytes;
    filled.collective_ns = counters.collective_ns;
    filled.copy_ns = counters.copy_ns;
    filled.negotiation_ns = counters.negotiation_ns;
    const size_t known = std::min(stats->struct_size, sizeof(filled));
    std::memcpy(stats, &filled, known);
    if (stats->struct_size > known) {
      std::memset(reinterpret_cast<char*>(stats) + known, 0, stats->struct_size - known);
    }
  });
}

kolo_status_t kolo_join(kolo_comm_t comm, int* last_rank) {
  return guarded(comm, [&] {
    const int last = communicator_of(comm).fusion().join();
    if (last_rank) *last_rank = last;
  });
}

kolo_status_t kolo_comm_set_fusion_threshold(kolo_comm_t comm, uint64_t bytes) {
  return guarded(comm, [&] {
    communicator_of(comm).fusion().set_fusion_threshold(bytes);
  });
}

// ---- GPU buffers (comm/communicator_gpu.cpp, src/gpu/) -----------------------------------------

kolo_status_t kolo_allreduce_scaled_on_stream(kolo_comm_t comm, const void* sendbuf, void* recvbuf,
                                              uint64_t count, kolo_dtype_t dtype, kolo_op_t op,
                                              double prescale, double postscale, void* stream) {
  return guarded(comm, [&] {
    const kolo::gpu::Stream on{stream};
    communicator_of(comm).allreduce(sendbuf, recvbuf, count, core_dtype(dtype),
                                    core_op(op), prescale, postscale, &on);
  });
}

kolo_status_t kolo_allreduce_on_stream(kolo_comm_t comm, const void* sendbuf, void* recvbuf,
                                       uint64_t count, kolo_dtype_t dtype, kolo_op_t op,
                                       void* stream) {
  return kolo_allreduce_scaled_on_stream(comm, sendbuf, recvbuf, count, dtype, op, 1.0, 1.0,
                                         stream);
}

kolo_status_t kolo_broadcast_on_stream(kolo_comm_t comm, void* buf, uint64_t count,
                                       kolo_dtype_t dtype, int root, void* stream) {
  return guarded(comm, [&] {
    const kolo::gpu::Stream on{stream};
    communicator_of(comm).broadcast(buf, count, core_dtype(dtype), root, &on);
  });
}

kolo_status_t kolo_stream_synchronize(kolo_comm_t comm, void* stream) {
  return guarded(comm,
                 [&] { communicator_of(comm).synchronize_stream(kolo::gpu::Stream{stream}); });
}

kolo_status_t kolo_comm_gpu_backend(kolo_comm_t comm, const char** name) {
  return guarded(comm, [&] {
    kolo::Communicator& communicator = communicator_of(comm);
    if (name == nullptr) {
      throw kolo::Error(kolo::Status::kInvalidArgument, "kolo_comm_gpu_backend: name is NULL");
    }
    *name = communicator.gpu_path();
  });
}

}  // extern "C"
