// grpc_echo_bench: the ceiling gRPC itself reaches on this machine for the traffic of a Compute
// call.
//
// A bidirectional stream echoes --bytes each way in messages of --message_bytes (about 4 MiB, what
// the lossd client sends), split over --streams concurrent calls on one connection (or spread over
// --connections), as `lossctl bench --calls=S --streams=S` splits its tokens; the server sends back
// every message it reads and does nothing else. Server and client are two processes talking over
// loopback TCP, like lossd_server and lossctl: the program forks before any gRPC call (gRPC's
// threads do not survive a fork), the child serves on 127.0.0.1 and reports its port over a socket
// pair, the parent is the client.
//
// --copies=protobuf sends Blob messages through protobuf on both ends (each message's bytes copied
// by serializing and by parsing, on each side); --copies=one moves raw bytes as lossd's Compute
// does (proto/wire): a sender copies its bytes once into pooled memory that gRPC sends as it is, a
// receiver copies them once out of the slices gRPC received them in.
//
// One untimed round (connection, buffers), then --reps timed rounds; prints the median round's
// seconds and the serialized message bytes each way (what lossctl bench counts), as a sentence or,
// with --json, as one JSON object.
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc_echo.grpc.pb.h"
#include "proto/wire/bulk_fields.h"

ABSL_FLAG(int64_t, bytes, int64_t{128} << 20, "payload bytes each way per round, over all streams");
ABSL_FLAG(int64_t, message_bytes, int64_t{4} << 20,
          "payload bytes per message (the last of a call may be shorter)");
ABSL_FLAG(int64_t, streams, 1, "concurrent calls, each carrying an equal share of --bytes");
ABSL_FLAG(int64_t, connections, 1,
          "TCP connections the calls are spread over, in turn (at most --streams): whether one "
          "large transfer gains from several connections where one cannot fill the link");
ABSL_FLAG(int, reps, 3, "timed rounds after one untimed warm-up; the median is reported");
ABSL_FLAG(bool, json, false, "print one JSON object instead of a sentence");
ABSL_FLAG(std::string, channel_args, "",
          "integer gRPC channel arguments for both ends, NAME=VALUE,... (tuning experiments: "
          "grpc.http2.max_frame_size, grpc.experimental.tcp_max_read_chunk_size, ...)");
ABSL_FLAG(
    std::string, copies, "protobuf",
    "protobuf (Blob messages, protobuf's copies) or one (raw bytes, one copy each way on each "
    "side, as lossd's Compute)");

namespace lossd::bench {
namespace {

// Room above the payload for the protobuf field tag and length in the message size limits.
constexpr int64_t kFramingBytes = 64;
// A wedged server fails the run rather than hanging it (a round is well under a second).
constexpr absl::Duration kCallDeadline = absl::Minutes(5);
constexpr absl::Duration kConnectDeadline = absl::Seconds(30);
// Calls still open when the client is done are cancelled after this.
constexpr absl::Duration kShutdownGrace = absl::Seconds(1);

class EchoService final : public Echo::Service {
  grpc::Status Stream(grpc::ServerContext* /*context*/,
                      grpc::ServerReaderWriter<Blob, Blob>* stream) override {
    Blob blob;  // Reused, so that its buffer is allocated once per call rather than per message.
    while (stream->Read(&blob)) {
      if (!stream->Write(blob))
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the client went away");
    }
    return grpc::Status::OK;
  }
};

// The raw echo of one call: each message copied out of gRPC's slices into a buffer of its own (as
// lossd's row reader copies rows) and sent back from one pooled copy (as lossd sends dL/dh). One
// read and one write in flight at a time; what is read while a write is out waits in a queue.
class OneCopyEchoReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  OneCopyEchoReactor() { StartRead(&received_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      absl::MutexLock lock(&mu_);
      reads_over_ = true;
      FinishIfDone();
      return;
    }
    std::vector<grpc::Slice> slices;
    (void)received_.Dump(&slices);
    landing_.clear();
    for (const grpc::Slice& slice : slices) landing_.append(slice.begin(), slice.end());
    const lossd::wire::BulkBytes echo = pool_->Copy(landing_);
    {
      absl::MutexLock lock(&mu_);
      queue_.emplace_back(echo.slices().data(), echo.slices().size());
      if (!writing_) WriteNext();
    }
    StartRead(&received_);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    queue_.pop_front();
    if (!ok) {
      queue_.clear();
      reads_over_ = true;
    }
    if (!queue_.empty()) {
      WriteNext();
    } else {
      FinishIfDone();
    }
  }

  void OnDone() override { delete this; }

 private:
  void WriteNext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    StartWrite(&queue_.front());
  }
  void FinishIfDone() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reads_over_ && !writing_ && queue_.empty() && !finished_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  grpc::ByteBuffer received_;
  std::string landing_;
  const std::shared_ptr<lossd::wire::MessageBufferPool> pool_ =
      lossd::wire::MessageBufferPool::Create();
  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_over_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

class OneCopyEchoService final : public Echo::WithRawCallbackMethod_Stream<Echo::Service> {
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* /*context*/) override {
    return new OneCopyEchoReactor();
  }
};

// --channel_args as names and values; a malformed item is left out with a word on stderr.
std::vector<std::pair<std::string, int>> ChannelArgs() {
  std::vector<std::pair<std::string, int>> args;
  for (const absl::string_view item :
       absl::StrSplit(absl::GetFlag(FLAGS_channel_args), ',', absl::SkipEmpty())) {
    const std::pair<absl::string_view, absl::string_view> parts = absl::StrSplit(item, '=');
    int value = 0;
    if (parts.first.empty() || !absl::SimpleAtoi(parts.second, &value)) {
      absl::FPrintF(stderr, "grpc_echo_bench: --channel_args: '%s' is not NAME=INTEGER\n", item);
      continue;
    }
    args.emplace_back(std::string(parts.first), value);
  }
  return args;
}

bool WriteAll(int fd, const void* data, size_t size) {
  const char* next = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = write(fd, next, size);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return false;
    next += written;
    size -= static_cast<size_t>(written);
  }
  return true;
}

// False on end of file (the other process closed its end or died) or an error.
bool ReadAll(int fd, void* data, size_t size) {
  char* next = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got = read(fd, next, size);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    next += got;
    size -= static_cast<size_t>(got);
  }
  return true;
}

// The child: serves until the parent closes its end of `control_fd`, then exits.
int RunServer(int control_fd, pid_t parent, int message_limit, bool one_copy) {
  // The server must never outlive the client, even one killed by SIGKILL; the getppid check covers
  // a parent that died before the prctl.
  if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != parent) {
    absl::FPrintF(stderr,
                  "grpc_echo_bench: the echo server could not tie its life to the client's\n");
    return 1;
  }
  EchoService protobuf_service;
  OneCopyEchoService one_copy_service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  if (one_copy) {
    builder.RegisterService(&one_copy_service);
  } else {
    builder.RegisterService(&protobuf_service);
  }
  for (const auto& [name, value] : ChannelArgs()) builder.AddChannelArgument(name, value);
  builder.SetMaxReceiveMessageSize(message_limit);
  builder.SetMaxSendMessageSize(message_limit);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    absl::FPrintF(stderr, "grpc_echo_bench: the echo server could not listen on 127.0.0.1\n");
    return 1;
  }
  if (!WriteAll(control_fd, &port, sizeof port)) return 1;
  // The read returns only when the parent closes its end: it is done, or it died.
  std::thread stopper([&] {
    char unused;
    ReadAll(control_fd, &unused, 1);
    server->Shutdown(absl::ToChronoTime(absl::Now() + kShutdownGrace));
  });
  server->Wait();
  stopper.join();
  return 0;
}

struct Traffic {
  int64_t bytes_sent = 0;  // Serialized message bytes, as lossctl bench counts them.
  int64_t bytes_received = 0;
};

// A finished echo call's traffic, or why it failed: its status, a writer cut off, bytes lost.
absl::StatusOr<Traffic> EchoOutcome(const grpc::Status& status, bool all_written,
                                    const Traffic& traffic) {
  if (!status.ok()) {
    // gRPC and absl share the canonical code numbering.
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("echo call failed: ", status.error_message()));
  }
  if (!all_written)
    return absl::UnavailableError("echo call ended before all its messages were sent");
  if (traffic.bytes_received != traffic.bytes_sent) {
    return absl::DataLossError(absl::StrFormat("echo call sent %d bytes but received %d",
                                               traffic.bytes_sent, traffic.bytes_received));
  }
  return traffic;
}

// One call: a writer thread sends `payload_bytes` in messages of at most `message_bytes` and then
// half-closes, while this thread reads the echoes.
absl::StatusOr<Traffic> EchoCall(Echo::Stub& stub, int64_t payload_bytes, int64_t message_bytes) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
  std::unique_ptr<grpc::ClientReaderWriter<Blob, Blob>> stream = stub.Stream(&context);
  Traffic traffic;
  bool all_written = true;
  std::thread writer([&] {
    Blob request;  // Reused: one buffer for every message of the call.
    request.mutable_data()->assign(static_cast<size_t>(std::min(payload_bytes, message_bytes)),
                                   '\x5a');
    for (int64_t left = payload_bytes; left > 0; left -= message_bytes) {
      if (left < message_bytes) request.mutable_data()->resize(static_cast<size_t>(left));
      if (!stream->Write(request)) {  // The call is over; Finish says why.
        all_written = false;
        return;
      }
      traffic.bytes_sent += static_cast<int64_t>(request.ByteSizeLong());
    }
    stream->WritesDone();
  });
  Blob echo;
  while (stream->Read(&echo)) traffic.bytes_received += static_cast<int64_t>(echo.ByteSizeLong());
  writer.join();
  return EchoOutcome(stream->Finish(), all_written, traffic);
}

// The same call as raw bytes, as the C++ client moves a Compute call's rows and dL/dh: each
// message sent from one pooled copy of `payload`, each echo copied once into `landing` (the
// caller's buffer, as large as the call's bytes).
absl::StatusOr<Traffic> OneCopyEchoCall(grpc::Channel& channel, int64_t payload_bytes,
                                        int64_t message_bytes, const std::string& payload,
                                        uint8_t* landing) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
  using RawStream = grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;
  const std::unique_ptr<RawStream> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          &channel,
          grpc::internal::RpcMethod("/lossd.bench.Echo/Stream",
                                    grpc::internal::RpcMethod::BIDI_STREAMING),
          &context));
  const std::shared_ptr<lossd::wire::MessageBufferPool> pool =
      lossd::wire::MessageBufferPool::Create();
  Traffic traffic;
  bool all_written = true;
  std::thread writer([&] {
    for (int64_t left = payload_bytes; left > 0; left -= message_bytes) {
      const lossd::wire::BulkBytes bytes = pool->Copy(
          absl::string_view(payload.data(), static_cast<size_t>(std::min(left, message_bytes))));
      grpc::ByteBuffer message(bytes.slices().data(), bytes.slices().size());
      if (!stream->Write(message)) {
        all_written = false;
        return;
      }
      traffic.bytes_sent += bytes.size();
    }
    stream->WritesDone();
  });
  grpc::ByteBuffer echo;
  std::vector<grpc::Slice> slices;
  while (stream->Read(&echo)) {
    slices.clear();
    (void)echo.Dump(&slices);
    for (const grpc::Slice& slice : slices) {
      const int64_t room = payload_bytes - traffic.bytes_received;
      const int64_t size = std::min(static_cast<int64_t>(slice.size()), std::max<int64_t>(room, 0));
      std::memcpy(landing + traffic.bytes_received, slice.begin(), static_cast<size_t>(size));
      traffic.bytes_received += static_cast<int64_t>(slice.size());
    }
  }
  writer.join();
  return EchoOutcome(stream->Finish(), all_written, traffic);
}

struct Round {
  double seconds = 0.0;
  Traffic traffic;
};

// All calls at once, each on a thread of its own, as lossctl bench runs --streams calls in flight.
absl::StatusOr<Round> RunRound(const std::function<absl::StatusOr<Traffic>(size_t)>& call,
                               size_t calls) {
  std::vector<absl::StatusOr<Traffic>> results(calls, absl::UnknownError("not run"));
  std::vector<std::thread> callers;
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < calls; ++i) {
    callers.emplace_back([&, i] { results[i] = call(i); });
  }
  for (std::thread& caller : callers) caller.join();
  Round round;
  round.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  for (const absl::StatusOr<Traffic>& result : results) {
    if (!result.ok()) return result.status();
    round.traffic.bytes_sent += result->bytes_sent;
    round.traffic.bytes_received += result->bytes_received;
  }
  return round;
}

// Each call's share of `total`: equal, the remainder spread one byte each over the first calls.
std::vector<int64_t> SplitBytes(int64_t total, int64_t calls) {
  std::vector<int64_t> shares(static_cast<size_t>(calls), total / calls);
  for (int64_t i = 0; i < total % calls; ++i) ++shares[static_cast<size_t>(i)];
  return shares;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2.0;
}

struct Options {
  int64_t bytes;
  int64_t message_bytes;
  int64_t streams;
  int64_t connections;
  int reps;
  bool json;
  bool one_copy;  // --copies=one
};

absl::Status RunClient(int port, const Options& options, int message_limit) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(message_limit);
  for (const auto& [name, value] : ChannelArgs()) args.SetInt(name, value);
  args.SetMaxReceiveMessageSize(message_limit);
  // Channels share one connection to the same address unless each keeps its own subchannels.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<Echo::Stub>> stubs;
  for (int64_t c = 0; c < options.connections; ++c) {
    channels.push_back(grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                                 grpc::InsecureChannelCredentials(), args));
    if (!channels.back()->WaitForConnected(absl::ToChronoTime(absl::Now() + kConnectDeadline))) {
      return absl::UnavailableError(
          absl::StrCat("could not connect to the echo server on port ", port));
    }
    stubs.push_back(Echo::NewStub(channels.back()));
  }
  const std::vector<int64_t> call_bytes = SplitBytes(options.bytes, options.streams);
  // For --copies=one: the bytes each message is copied from, and each call's landing place,
  // touched by the warm-up round before any timed one.
  const std::string payload(
      options.one_copy ? static_cast<size_t>(std::min(options.bytes, options.message_bytes)) : 0,
      '\x5a');
  std::vector<std::vector<uint8_t>> landings(options.one_copy ? call_bytes.size() : 0);
  for (size_t i = 0; i < landings.size(); ++i) landings[i].resize(call_bytes[i]);
  const auto call = [&](size_t i) {
    const size_t c = i % channels.size();
    return options.one_copy ? OneCopyEchoCall(*channels[c], call_bytes[i], options.message_bytes,
                                              payload, landings[i].data())
                            : EchoCall(*stubs[c], call_bytes[i], options.message_bytes);
  };

  absl::StatusOr<Round> warm_up = RunRound(call, call_bytes.size());
  if (!warm_up.ok()) return warm_up.status();
  std::vector<double> seconds;
  Traffic traffic;  // The same in every round.
  for (int rep = 0; rep < options.reps; ++rep) {
    absl::StatusOr<Round> round = RunRound(call, call_bytes.size());
    if (!round.ok()) return round.status();
    seconds.push_back(round->seconds);
    traffic = round->traffic;
  }
  const double median = Median(seconds);
  if (options.json) {
    absl::PrintF(
        "{\"seconds\": %.6f, \"bytes_sent\": %d, \"bytes_received\": %d, \"streams\": %d, "
        "\"connections\": %d, \"message_bytes\": %d, \"reps\": %d, \"copies\": \"%s\"}\n",
        median, traffic.bytes_sent, traffic.bytes_received, options.streams, options.connections,
        options.message_bytes, options.reps, options.one_copy ? "one" : "protobuf");
  } else {
    absl::PrintF(
        "%d bytes each way in %d-byte messages over %d stream%s: %.4f s (median of %d), "
        "%.3f GB/s sent, %.3f GB/s received\n",
        options.bytes, options.message_bytes, options.streams, options.streams == 1 ? "" : "s",
        median, options.reps, traffic.bytes_sent / median / 1e9,
        traffic.bytes_received / median / 1e9);
  }
  return absl::OkStatus();
}

int Fail(const std::string& message) {
  absl::FPrintF(stderr, "grpc_echo_bench: %s\n", message);
  return 1;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "grpc_echo_bench: gRPC's own bidirectional echo over loopback, the ceiling of a Compute "
      "call's wire throughput.\n  grpc_echo_bench --bytes=134217728 --streams=4 --json");
  absl::ParseCommandLine(argc, argv);
  const Options options{absl::GetFlag(FLAGS_bytes),          absl::GetFlag(FLAGS_message_bytes),
                        absl::GetFlag(FLAGS_streams),        absl::GetFlag(FLAGS_connections),
                        absl::GetFlag(FLAGS_reps),           absl::GetFlag(FLAGS_json),
                        absl::GetFlag(FLAGS_copies) == "one"};
  if (absl::GetFlag(FLAGS_copies) != "one" && absl::GetFlag(FLAGS_copies) != "protobuf") {
    absl::FPrintF(stderr, "grpc_echo_bench: --copies must be protobuf or one, not '%s'\n",
                  absl::GetFlag(FLAGS_copies));
    return 2;
  }
  if (options.message_bytes < 1 || options.message_bytes > INT_MAX - kFramingBytes) {
    absl::FPrintF(stderr, "grpc_echo_bench: --message_bytes must be in [1, %d]\n",
                  INT_MAX - kFramingBytes);
    return 2;
  }
  if (options.streams < 1 || options.bytes < options.streams || options.reps < 1 ||
      options.connections < 1 || options.connections > options.streams) {
    absl::FPrintF(stderr,
                  "grpc_echo_bench: --streams and --reps must be >= 1, --bytes >= --streams, "
                  "--connections in [1, --streams]\n");
    return 2;
  }
  const int message_limit = static_cast<int>(options.message_bytes + kFramingBytes);

  // A socket pair rather than two pipes: the child sends its port on it, and the parent closing
  // its end (or dying) is the child's signal to stop.
  int control[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, control) != 0) {
    return Fail(absl::StrCat("socketpair failed: ", std::strerror(errno)));
  }
  const pid_t parent = getpid();
  std::fflush(nullptr);  // Nothing buffered may be written twice.
  const pid_t child = fork();
  if (child < 0) return Fail(absl::StrCat("fork failed: ", std::strerror(errno)));
  if (child == 0) {
    close(control[0]);
    return RunServer(control[1], parent, message_limit, options.one_copy);
  }
  close(control[1]);

  int port = 0;
  absl::Status status = ReadAll(control[0], &port, sizeof port)
                            ? RunClient(port, options, message_limit)
                            : absl::UnavailableError("the echo server did not start");
  close(control[0]);  // Tells the server to stop.
  int child_status = 0;
  while (waitpid(child, &child_status, 0) < 0 && errno == EINTR) {
  }
  if (!status.ok()) return Fail(status.ToString());
  if (!WIFEXITED(child_status) || WEXITSTATUS(child_status) != 0) {
    return Fail(absl::StrCat("the echo server ended abnormally (wait status ", child_status, ")"));
  }
  return 0;
}

}  // namespace
}  // namespace lossd::bench

int main(int argc, char** argv) { return lossd::bench::Main(argc, argv); }
