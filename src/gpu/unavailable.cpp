// The GPU interfaces in a build without CUDA: no pointer is device memory, and asking for GPU work
// explicitly (a stream, a device kernel) is KOLO_ERR_UNSUPPORTED.
#include <string>

#include "gpu/backend.hpp"
#include "gpu/gpu.hpp"
#include "gpu/kernels.hpp"
#include "kolo/status.hpp"

namespace kolo::gpu {
namespace {

constexpr const char* kReason = "kolo was built without CUDA";

[[noreturn]] void unsupported(const std::string& what) {
  throw Error(Status::kUnsupported, what + ": " + kReason);
}

}  // namespace

bool devices_present() {
  return false;
}
std::string devices_absent_reason() {
  return kReason;
}
MemoryLocation locate(const void*) {
  return {};
}

const char* path_name(Path path) {
  return path == Path::kNccl ? "nccl" : "staged";
}

struct Backend::Impl {};

Backend::Backend(const BackendSetup&, int) {
  unsupported("GPU collectives");
}
Backend::~Backend() = default;
Path Backend::path() const {
  return Path::kStaged;
}
int Backend::device() const {
  return -1;
}
void Backend::allreduce(const OpDescriptor&, const void*, void*, const Stream*,
                        const HostAllreduce&) {
  unsupported("GPU allreduce");
}
void Backend::broadcast(const OpDescriptor&, void*, const Stream*, const HostBroadcast&) {
  unsupported("GPU broadcast");
}
void Backend::allgather(const OpDescriptor&, const void*, void*, const Stream*,
                        const HostCollective&) {
  unsupported("GPU allgather");
}
void Backend::reduce_scatter(const OpDescriptor&, const void*, void*, const Stream*,
                             const HostCollective&) {
  unsupported("GPU reduce-scatter");
}
void Backend::synchronize(Stream, const std::string& what) {
  unsupported(what);
}
void wait_for_stream(Stream, double, const std::string& what) {
  unsupported(what);
}

void batched_copy(std::span<const CopyRegion>, Stream) {
  unsupported("batched copy");
}
void batched_copy_scaled(std::span<const CopyRegion>, DataType, double, Stream) {
  unsupported("batched scaled copy");
}
void scale(const void*, void*, uint64_t, DataType, double, Stream) {
  unsupported("device scale");
}
void finish_reduction(void*, uint64_t, DataType, int, double, Stream) {
  unsupported("device finish");
}

}  // namespace kolo::gpu
