// The Compute socket's framing (ComputeSocket in lossd.proto), for the server and the C++ client
// alike: the frame header, its checks, and a connection whose every wait is bounded by a deadline
// or a wake descriptor.
#ifndef LOSSD_PROTO_WIRE_COMPUTE_SOCKET_IO_H_
#define LOSSD_PROTO_WIRE_COMPUTE_SOCKET_IO_H_

#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "lossd/common/unique_fd.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd::wire {

inline constexpr uint32_t kComputeSocketMagic = 0x3153434c;  // "LCS1" in little-endian order
inline constexpr int64_t kComputeSocketMaxHelloBytes = 4096;
// A FRAME_STATUS is a code, a message and an ErrorInfo: far below this.
inline constexpr int64_t kComputeSocketMaxStatusBytes = 1 << 20;
// A call's lanes (ComputeSocketLanes): at most this many connections, lane 0 counted, meet under
// a key of this many random bytes.
inline constexpr int kComputeSocketMaxLanes = 8;
inline constexpr int kComputeSocketMinCallKeyBytes = 16;
inline constexpr int kComputeSocketMaxCallKeyBytes = 64;

struct FrameHeader {
  uint32_t magic = kComputeSocketMagic;
  uint32_t kind = 0;
  uint64_t length = 0;
};
static_assert(sizeof(FrameHeader) == 16);

// "FRAME_MESSAGE", or the number of a kind lossd.proto does not name.
std::string FrameKindName(uint32_t kind);
// OK for a header with lossd's magic and at most `max_length` bytes after it; else an error
// naming the part at fault as its field ("frame.magic", "frame.length").
absl::Status CheckFrameHeader(const FrameHeader& header, uint64_t max_length);

// How one blocking step on a connection ended.
enum class SocketIo {
  kDone,
  kPeerClosed,  // the peer closed or reset the connection
  kTimedOut,
  kStopped,  // a descriptor of the connection's own wake set: its owner stops
  kEnded,    // a descriptor of the wait's extra wake set: the call it serves has ended
};

// A connected, non-blocking TCP socket with the waits the Compute socket needs: each reads or
// writes until done, the deadline, the peer's end, or a wake descriptor (an eventfd made readable)
// fires, polling.
class SocketConnection {
 public:
  SocketConnection(UniqueFd fd, std::vector<int> wake_fds);
  int fd() const { return fd_.get(); }
  SocketIo ReadExact(void* out, size_t bytes, absl::Time deadline,
                     const std::vector<int>& extra_wake = {});
  // Sends every byte of `parts`; `on_slow`, if given, runs once when the peer has not taken
  // them within `slow_after`. `sent` (if given) says how many bytes left.
  SocketIo WriteAll(
      std::vector<iovec> parts, absl::Time deadline, const std::vector<int>& extra_wake = {},
      absl::Duration slow_after = {}, absl::FunctionRef<void()> on_slow = [] {},
      int64_t* sent = nullptr);
  // Waits until the socket has bytes to read (or the peer's end: kDone then too).
  SocketIo WaitReadable(absl::Time deadline, const std::vector<int>& extra_wake = {});
  // Whether the peer has closed its end (or the connection broke).
  bool PeerGone() const;
  // Whether bytes wait to be read now.
  bool Readable() const;

 private:
  SocketIo Wait(short events, absl::Time deadline, const std::vector<int>& extra_wake);

  UniqueFd fd_;
  const std::vector<int> wake_fds_;
};

// The header and `message`'s slices as the parts of one frame of `kind`; `slices` and `header`
// hold what the parts point to.
std::vector<iovec> FrameParts(uint32_t kind, const grpc::ByteBuffer& message,
                              std::vector<grpc::Slice>& slices, FrameHeader& header);

// Sends a FRAME_STATUS of `status` within `deadline`; whether it left whole.
bool SendStatusFrame(SocketConnection& connection, const v1::RpcStatus& status,
                     absl::Time deadline);

// Makes `event_fd` readable for good: every wait that watches it returns.
void SignalEventFd(int event_fd);
// A fresh non-blocking eventfd, or an invalid one when the process is out of descriptors.
UniqueFd NewEventFd();

}  // namespace lossd::wire

#endif  // LOSSD_PROTO_WIRE_COMPUTE_SOCKET_IO_H_
