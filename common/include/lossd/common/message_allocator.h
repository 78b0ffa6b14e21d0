// Allocator settings for processes that stream large gRPC messages.
#ifndef LOSSD_COMMON_MESSAGE_ALLOCATOR_H_
#define LOSSD_COMMON_MESSAGE_ALLOCATOR_H_

#include <malloc.h>

namespace lossd {

// A Compute call allocates and frees message buffers of a few MiB for every message each way.
// By default glibc maps blocks that large afresh each time (and hands freed heap tops back to the
// kernel), so every message paid for page faults on new memory: about a third of a call's time
// on the transport benchmark. Blocks up to 32 MiB (glibc's largest threshold) now come from the
// heap, which keeps up to 256 MiB of freed memory for the next message. Buffers larger than that
// are still mapped. lossctl uses it; the server does not: with it, a 512-token training call at
// V = 128256, H = 2048 spent 8% more time in the engine (5.79 s against 5.35 s), more than the
// messages save on the CPU backend.
inline void KeepMessageBuffersInHeap() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

}  // namespace lossd

#endif  // LOSSD_COMMON_MESSAGE_ALLOCATOR_H_
