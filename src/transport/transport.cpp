// Choosing a transport: make_transport() builds the one KOLO_TRANSPORT names (tcp, ucx), or for
// auto the faster of the two for this job.
#include "transport/transport.hpp"

#include <fmt/format.h>

#include "core/config.hpp"
#include "core/log.hpp"
#include "kolo_build_config.h"
#include "transport/tcp/tcp_transport.hpp"
#ifdef KOLO_HAVE_UCX
#include "transport/ucx/ucx_transport.hpp"
#endif

namespace kolo {

std::unique_ptr<Transport> make_transport(const Config& config, StoreClient& store, int rank,
                                          int size, uint64_t context) {
#ifdef KOLO_HAVE_UCX
  if (config.transport == "ucx") return make_ucx_transport(config, store, rank, size, context);
  if (config.transport == "auto") {
    std::string reason;
    bool ucx = ucx_is_faster(config, store, rank, size, context, reason);
    log::info("KOLO_TRANSPORT=auto chose {}: {}", ucx ? "ucx" : "tcp", reason);
    if (ucx) return make_ucx_transport(config, store, rank, size, context);
  }
#else
  if (config.transport == "ucx") {
    throw Error(Status::kUnsupported,
                "KOLO_TRANSPORT=ucx is not available: kolo was built without UCX (install "
                "libucx-dev and rebuild; available: tcp)");
  }
  if (config.transport == "auto") log::info("KOLO_TRANSPORT=auto chose tcp: built without UCX");
#endif
  if (config.transport == "tcp" || config.transport == "auto") {
    return make_tcp_transport(config, store, rank, size, context);
  }
  throw Error(Status::kUnsupported,
              fmt::format("KOLO_TRANSPORT={} is not a transport (tcp, ucx or auto)",
                          config.transport));
}

}  // namespace kolo
