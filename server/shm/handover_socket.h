// The server's end of shared memory's handover socket (HandoverRequest in lossd.proto): a Unix
// SOCK_SEQPACKET socket in the abstract namespace where clients on this host pass their memfds
// with SCM_RIGHTS and get handles back. The kernel passes the descriptor itself, so the server
// maps only memory a client held and handed over, whichever user either runs as.
//
// One thread serves every connection with poll(); nothing a peer sends or fails to send can make
// it wait: sockets are non-blocking, every descriptor that arrives is closed unless registered,
// a peer that does not read its replies is disconnected. A connection's handles are revoked when
// it closes, so nothing is kept for a client that has exited.
#ifndef LOSSD_SERVER_SHM_HANDOVER_SOCKET_H_
#define LOSSD_SERVER_SHM_HANDOVER_SOCKET_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "lossd/common/unique_fd.h"
#include "server/shm/shared_memory.h"

namespace lossd::server {

class HandoverSocket {
 public:
  static constexpr size_t kMaxRequestBytes = 4096;
  // Descriptors one message may carry before the kernel truncates the rest (and closes them).
  static constexpr int kMaxDescriptorsPerMessage = 8;

  struct Limits {
    size_t max_connections = 32;
    // So that one local user cannot take every connection and lock the others out.
    size_t max_connections_per_user = 16;
  };

  // Binds a fresh random abstract name and starts serving it, registering into `maps`, which must
  // outlive the socket.
  static absl::StatusOr<std::unique_ptr<HandoverSocket>> Open(SharedMemoryMaps& maps,
                                                              Limits limits);
  static absl::StatusOr<std::unique_ptr<HandoverSocket>> Open(SharedMemoryMaps& maps) {
    return Open(maps, Limits());
  }
  HandoverSocket(const HandoverSocket&) = delete;
  HandoverSocket& operator=(const HandoverSocket&) = delete;
  // Stops serving, closes the socket (an abstract name goes with its last descriptor) and every
  // connection, revoking their handles.
  ~HandoverSocket();

  // The name without its leading NUL byte (SharedMemorySocket.abstract_name).
  const std::string& abstract_name() const { return abstract_name_; }

 private:
  HandoverSocket(SharedMemoryMaps& maps, Limits limits, UniqueFd listener, UniqueFd wake,
                 std::string abstract_name);
  void Serve();

  SharedMemoryMaps& maps_;
  const Limits limits_;
  const UniqueFd listener_;
  const UniqueFd wake_;  // an eventfd: written once to stop the thread
  const std::string abstract_name_;
  std::thread thread_;  // last: started once everything above is set up
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_SHM_HANDOVER_SOCKET_H_
