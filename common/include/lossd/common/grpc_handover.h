// gRPC hands what it is given (a reactor, the memory behind a slice) from the thread that gives
// it to the threads that use it or let go of it through libgrpc's queues, which ThreadSanitizer
// cannot see into (Debian's libgrpc is not instrumented): it would take the first touch on gRPC's
// side for a race with what the giving thread wrote before. These two tell it of that hand-over,
// keyed by the object's address; in other builds they are nothing.
#ifndef LOSSD_COMMON_GRPC_HANDOVER_H_
#define LOSSD_COMMON_GRPC_HANDOVER_H_

#include "absl/base/config.h"

#ifdef ABSL_HAVE_THREAD_SANITIZER
#include <sanitizer/tsan_interface.h>
#endif

namespace lossd {

// On the giving thread, after its last write before gRPC has the object.
inline void HandOverToGrpc([[maybe_unused]] const void* object) {
#ifdef ABSL_HAVE_THREAD_SANITIZER
  __tsan_release(const_cast<void*>(object));
#endif
}

// On gRPC's thread, before its first touch of the object.
inline void TakeOverFromGrpc([[maybe_unused]] const void* object) {
#ifdef ABSL_HAVE_THREAD_SANITIZER
  __tsan_acquire(const_cast<void*>(object));
#endif
}

}  // namespace lossd

#endif  // LOSSD_COMMON_GRPC_HANDOVER_H_
