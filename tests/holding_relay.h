// A TCP relay on loopback between clients and a server that can hold back what the server sends.
// With it a test loses a call's answer after the server has committed the call, as a slow or
// broken network does: the server computes, commits and answers, the client hears nothing until
// its deadline passes, and what it does next (retry, give up) can be checked against the server's
// state.
#ifndef LOSSD_TESTS_HOLDING_RELAY_H_
#define LOSSD_TESTS_HOLDING_RELAY_H_

#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace lossd::testing {

class HoldingRelay {
 public:
  // Listens on 127.0.0.1 (port() says where) and relays each connection to `server_port`; null
  // when it cannot listen.
  static std::unique_ptr<HoldingRelay> Start(int server_port);
  ~HoldingRelay();

  int port() const { return port_; }
  // From now on bytes from the server wait in the relay; bytes to it still flow.
  void Hold();
  // Delivers what waited, in order, and stops holding.
  void Release();
  // Breaks every connection made so far, dropping what waited: the client sees the connection
  // fail (UNAVAILABLE) without the answer. New connections are relayed as before, unheld. With
  // Hold, a test that waits for the server to commit before it drops loses the answer for sure,
  // however long the call takes, where a client deadline would race the call.
  void Drop();
  // How many connections clients have opened through the relay so far.
  int connections();

 private:
  HoldingRelay(int listen_fd, int port, int server_port);
  void AcceptConnections();
  // Copies bytes from `from` to `to` until either end closes; `from_server` waits while held.
  void Pump(int from, int to, bool from_server);

  const int listen_fd_;
  const int port_;
  const int server_port_;
  absl::Mutex mu_;
  bool holding_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int> sockets_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
  std::thread acceptor_;
};

}  // namespace lossd::testing

#endif  // LOSSD_TESTS_HOLDING_RELAY_H_
