// The C++ client of lossd: typed calls over lossd.v1.LossService.
//
//   auto client = lossd::client::Client::Connect({.address = "127.0.0.1:50051"});
//   lossd::client::ComputeRequest request;
//   request.head = "main";
//   request.hidden = {hidden.data(), lossd::client::DType::kBFloat16, num_tokens, hidden_size};
//   request.labels = labels;
//   request.outputs.grad_hidden = true;
//   auto result = client->Compute(request);   // result->summary.loss, result->grad_hidden
//
// Every call returns the server's gRPC status as an absl::Status with the same code and message.
// A Client is cheap to move and safe to use from several threads at once (its channels, shared).
//
// Replicas: the address is any gRPC target, and scoring spreads over every address it resolves to
// (round_robin), so `dns:///lossd-scoring:50051` (a headless Service) or
// `ipv4:10.0.0.1:50051,10.0.0.2:50051` scores on several servers of the same head, with failover.
// What lives in one process (a call that accumulates dL/dW, a step, the gradient, uploads,
// checkpoints, shared memory) goes to one server and is refused for a target that names several.
#ifndef LOSSD_CLIENT_CLIENT_H_
#define LOSSD_CLIENT_CLIENT_H_

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "lossd/client/tensor.h"
#include "lossd/v1/lossd.grpc.pb.h"

namespace lossd::client {

// The port lossd_server listens on unless its --listen names another.
inline constexpr int kDefaultServerPort = 50051;

// How Compute retries a call that failed with UNAVAILABLE (no connection, a server shutting down)
// or DEADLINE_EXCEEDED: the client cannot know whether the server committed such a call, so it
// sends the same call again, rows and all, under the same call id (ComputeRequest::call_id),
// and the server answers a repeat of a committed call as a replay without adding its dL/dW
// again. A scoring call changes nothing on the server and is simply sent again; over replicas the
// retry goes to the next server in the rotation. Other codes are the server's answer and are
// returned as they are.
//
// Compute is retried here, not by gRPC: gRPC replays a stream only while everything sent fits its
// per-call retry buffer (256 KiB) and no response has come, so a call that failed after sending
// its rows, or while results were streaming back (a replica killed mid-call), would not be
// replayed. The read-only unary and fetch calls (ListHeads, GetHead, FetchWeight, FetchGradWeight,
// GetSharedMemorySocket) are retried on UNAVAILABLE by gRPC's own retryPolicy in the channels'
// service config, with these attempts (at most 5, gRPC's cap) and backoff: they send one small
// message and take effect nowhere. Calls that change a head (Step, ZeroGradWeight, UploadHead,
// SaveCheckpoint) are made once, since a lost answer cannot tell whether they took effect.
struct RetryOptions {
  int max_attempts = 4;  // attempts in all; 1 turns retrying off
  // The wait before the n-th retry is initial_backoff * multiplier^(n - 1), at most max_backoff,
  // times a random factor in [0.5, 1] so that clients that failed together do not retry together.
  absl::Duration initial_backoff = absl::Milliseconds(200);
  absl::Duration max_backoff = absl::Seconds(5);
  double backoff_multiplier = 2.0;
  // Called before each retry with the failure, the attempt that failed (1-based) and the wait,
  // say to log it; may be empty.
  std::function<void(const absl::Status& failure, int attempt, absl::Duration wait)> on_retry;
};

struct ChannelOptions {
  // HOST:PORT, or a gRPC target URI such as dns:///HOST:PORT, ipv4:ADDR:PORT,ADDR:PORT or
  // unix:PATH (see CheckServerAddress and ParseTarget), passed to gRPC as written.
  std::string address = "127.0.0.1:50051";
  std::string bearer_token;       // sent as "authorization: Bearer <token>" on every call
  std::string tls_root_cert_pem;  // empty: plaintext; else TLS, trusting these roots
  // Largest message sent or received, set on the channel explicitly because gRPC's default receive
  // limit (4 MiB) is smaller than one batch. Compute and UploadHead split what they send to fit it,
  // and fetches ask for chunks of at most half of it. Compute results come in messages the server
  // sizes, at most min(half its own limit, 8 MiB): a limit below that can refuse them.
  int64_t max_message_bytes = int64_t{256} << 20;
  absl::Duration deadline = absl::InfiniteDuration();  // per call, and per attempt of Compute
  RetryOptions compute_retry;  // Compute only: the other calls are made once
  // HTTP/2 keepalive pings on an idle connection. A server with gRPC's default policy answers
  // pings more frequent than every 5 minutes with GOAWAY, so the default stays at that.
  absl::Duration keepalive_time = absl::Minutes(5);
  absl::Duration keepalive_timeout = absl::Seconds(20);
};

// An address a channel can be built for: HOST:PORT ([IPV6]:PORT), or a gRPC target URI (dns:,
// ipv4:, ipv6:, unix:, unix-abstract:, vsock:, xds:), which is left to gRPC. Refused, naming
// `field`, are a HOST without a port (gRPC would dial port 443, where no lossd listens) and URLs
// such as http://HOST:PORT (gRPC cannot resolve them), each with the address to give instead.
absl::Status CheckServerAddress(absl::string_view address, absl::string_view field);

// A channel target as the client reads it: an address CheckServerAddress takes, kept as written,
// with the servers it lists.
struct Target {
  std::string uri;  // what the channels are built on
  // Addresses the target lists: several for an ipv4:/ipv6: list, else one. A DNS name counts as
  // one though it may resolve to several (a headless Service): calls that belong to one server
  // then stay on the first that answers (pick_first), so name one server, or a Service with one
  // virtual IP, for training.
  int listed_addresses = 1;
};
absl::StatusOr<Target> ParseTarget(absl::string_view address);

// Which servers a channel's calls go to.
enum class Balancing {
  kRoundRobin,  // every address the target resolves to in turn, skipping those not SERVING
  kOneServer,   // gRPC's default pick_first: one server at a time
};

// The one place channels are built: message size limits, keepalive and retry arguments set
// explicitly, the service config of `balancing` (load balancing, health checking, retryPolicy
// for the read-only calls), TLS when root certificates are given. Options must have passed
// ValidateChannelOptions.
std::shared_ptr<grpc::Channel> MakeChannel(const ChannelOptions& options, Balancing balancing);
absl::Status ValidateChannelOptions(const ChannelOptions& options);

// The same code (gRPC and absl share the canonical numbering) and the server's message.
absl::Status FromGrpcStatus(const grpc::Status& status);

enum class Optimizer { kNone, kSgd, kAdamW };

struct HeadInfo {
  std::string name;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  DType dtype = DType::kFloat32;  // storage dtype of W on the server
  uint64_t version = 0;
  std::string source;
  int64_t accumulated_tokens = 0;  // in the gradient accumulator since it was last zeroed
  int64_t accumulated_calls = 0;
  Optimizer optimizer = Optimizer::kNone;  // kind of optimizer state held
  int64_t steps = 0;
  bool tied_embeddings = false;  // W is also the model's input embedding
  double logit_softcap = 0.0;    // the cap calls get unless they set their own; 0: none
  // SHA-256 of W at `version` (HeadInfo.weight_sha256): equal on replicas that serve the same W.
  // Always set by GetHead; ListHeads leaves it empty where the server has not hashed W since it
  // last changed.
  std::string weight_sha256;
};

// What a head's model does with W besides the output projection (UploadHeadStart's fields).
struct ModelTraits {
  bool tied_embeddings = false;  // W is also the input embedding
  double logit_softcap = 0.0;    // the final logit soft cap; 0: none
};

struct HeadList {
  std::vector<HeadInfo> heads;
  std::string backend;  // the server's compute backend, described by the server
};

enum class Reduction { kMean, kSum, kNone };

// Mirrors lossd.v1.LossOptions; defaults follow torch.nn.functional.cross_entropy.
struct LossOptions {
  Reduction reduction = Reduction::kMean;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;  // [0, 1]
  double z_loss_scale = 0.0;     // >= 0: adds scale * lse^2 per token
  // logits <- cap * tanh(logits / cap). Unset: the head's cap (HeadInfo::logit_softcap); 0: off.
  std::optional<double> logit_softcap;
  double temperature = 1.0;      // > 0, applied after the soft cap
  double grad_scale = 1.0;       // multiplies dL/dh and dL/dW
  // The mean's denominator when this batch is one slice of a larger one; 0 counts this batch's
  // non-ignored tokens.
  double mean_denominator = 0.0;
  bool allow_tf32 = false;       // GPU only
};

// Which per-token results to stream back; the summary always comes.
struct OutputSelection {
  bool token_loss = false;
  bool logprob = false;
  bool lse = false;
  bool entropy = false;
  bool argmax = false;
  int top_k = 0;  // 0..64
  bool grad_hidden = false;
  std::optional<DType> grad_hidden_dtype;  // unset: the dtype of the hidden states
  // Adds this batch's dL/dW to the head's accumulator on the server, all or nothing.
  bool accumulate_grad_weight = false;
};

struct ComputeRequest {
  std::string head;
  // Set: FAILED_PRECONDITION unless the head is there. Versions are per server: across replicas
  // pin weight_sha256 instead.
  std::optional<uint64_t> head_version;
  // Set (a HeadInfo::weight_sha256, say from a first GetHead): FAILED_PRECONDITION, naming both
  // hashes, from a server whose W is another, so that the calls of one scoring session over
  // replicas all use one W even while an update rolls out.
  std::string weight_sha256;
  LossOptions options;
  OutputSelection outputs;
  TensorView hidden;                     // [num_tokens, hidden_size]
  absl::Span<const int64_t> labels;      // num_tokens token ids or ignore_index
  absl::Span<const float> token_weights; // empty, or num_tokens weights
  // Next-token prediction: row i is scored against labels[i + 1] of its sequence, the last row of
  // each sequence is ignored (ComputeStart.shift_labels). sequence_lengths: the consecutive
  // sequences the rows make up; empty: one sequence.
  bool shift_labels = false;
  absl::Span<const int64_t> sequence_lengths;
  // Hidden rows per chunk message; 0 picks as many as fit in min(4 MiB, max_message_bytes), small
  // enough that the server computes early chunks while later ones are still on the wire.
  int64_t rows_per_message = 0;
  // Rows and dL/dh through a memfd shared with a server on this host instead of messages (see
  // SharedMemory in lossd.proto): the client hands its memfd over on the server's handover socket,
  // once per memfd, and the server computes on the rows there. For a server on loopback or a Unix
  // socket in the client's network namespace, whichever user either runs as.
  bool shared_memory = false;
  // The call's name on the server, so that a retry cannot add its dL/dW twice (see RetryOptions
  // and ComputeStart.call_id in lossd.proto). Empty: a call that accumulates dL/dW gets a fresh
  // random id (32 hex digits). Set one to repeat a call across processes; at most 64 characters
  // of printable ASCII without spaces.
  std::string call_id;
  // Called on the calling thread as results arrive, with the rows whose results have come in this
  // attempt (a retry starts again from 0) and num_tokens: for showing progress. Empty: not called.
  std::function<void(int64_t rows_done, int64_t rows_total)> on_progress;
  // Where dL/dh goes when asked for: null fills result.grad_hidden; set, num_tokens * hidden_size
  // values of the grad dtype in the caller's buffer, written only once the call has succeeded
  // (result.grad_hidden then has no bytes). A buffer reused across calls saves allocating and
  // faulting in a fresh one per call.
  void* grad_hidden_out = nullptr;
};

struct ComputeSummary {
  double loss = 0.0;  // reduced as asked (the sum for Reduction::kNone)
  double loss_sum = 0.0;
  int64_t counted_tokens = 0;  // tokens whose label is not ignore_index
  int64_t correct_tokens = 0;  // counted tokens whose argmax is the label
  uint64_t head_version = 0;
  bool grad_weight_accumulated = false;
  // A repeat of a call_id the server had already accumulated (a retry after a commit whose answer
  // was lost): results computed again, dL/dW not added again.
  bool replayed = false;
  double queue_seconds = 0.0;  // server: waiting for admission
  double compute_seconds = 0.0;  // server: inside the engine
  int64_t peak_workspace_bytes = 0;
  std::string backend;
};

// Per-token vectors are in row order and empty unless asked for.
struct ComputeResult {
  ComputeSummary summary;
  std::vector<float> token_loss;
  std::vector<float> logprob;
  std::vector<float> lse;
  std::vector<float> entropy;
  std::vector<int32_t> argmax;
  int top_k = 0;
  std::vector<float> top_k_logprob;  // [num_tokens, top_k], best first
  std::vector<int32_t> top_k_token;  // [num_tokens, top_k]
  Tensor grad_hidden;                // [num_tokens, hidden_size] when asked for (see grad_hidden_out)
  std::string call_id;               // the one sent, empty for none
  int attempts = 0;                  // 1 unless retried
  // Seen by the client: the whole call (of the last attempt), and the serialized message bytes
  // each way.
  double wall_seconds = 0.0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t messages_sent = 0;
  int64_t messages_received = 0;
};

// Optimizer settings; torch.optim semantics and defaults, as the wire contract has them.
struct SgdOptions {
  std::optional<double> learning_rate;  // unset: the server's default, torch's 1e-3
  double momentum = 0.0;
  double weight_decay = 0.0;  // L2 penalty added to the gradient
};
struct AdamWOptions {
  double learning_rate = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double epsilon = 1e-8;
  double weight_decay = 0.01;  // decoupled
};

struct StepOptions {
  std::string head;
  std::variant<SgdOptions, AdamWOptions> optimizer;
  double max_grad_norm = 0.0;  // > 0: clip by global norm first
  bool keep_grad = false;      // false: the server zeroes the accumulator after the step
  std::optional<uint64_t> head_version;  // set: FAILED_PRECONDITION unless the head is there
};

struct StepResult {
  uint64_t head_version = 0;
  double grad_norm = 0.0;  // before clipping
  double clip_multiplier = 1.0;
  int64_t accumulated_tokens = 0;
};

class Handover;
class SharedBufferPool;

class Client {
 public:
  // Validates the options and builds the channel; it connects on the first call.
  static absl::StatusOr<Client> Connect(ChannelOptions options);

  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;
  ~Client();

  absl::StatusOr<HeadList> ListHeads() const;
  absl::StatusOr<HeadInfo> GetHead(const std::string& head) const;
  // Creates the head (or, with `replace`, overwrites it) from `weight`, [vocab_size, hidden_size],
  // with what `model` says of the model it comes from.
  absl::StatusOr<HeadInfo> UploadHead(const std::string& head, const TensorView& weight,
                                      DType storage_dtype = DType::kFloat32, bool replace = false,
                                      const ModelTraits& model = {}) const;
  absl::StatusOr<Tensor> FetchWeight(const std::string& head, DType dtype = DType::kFloat32) const;
  absl::StatusOr<Tensor> FetchGradWeight(const std::string& head, DType dtype = DType::kFloat32) const;
  // Returns the head's version.
  absl::StatusOr<uint64_t> ZeroGrad(const std::string& head) const;
  absl::StatusOr<StepResult> Step(const StepOptions& options) const;
  // An empty `head` saves every head; returns the checkpoint paths on the server.
  absl::StatusOr<std::vector<std::string>> SaveCheckpoint(const std::string& head = "") const;

  // Streams the batch in chunk messages from a writer thread while this thread reads the results,
  // so results arrive while rows are still being sent and neither side blocks the other. Retries
  // as options().compute_retry says.
  absl::StatusOr<ComputeResult> Compute(const ComputeRequest& request) const;

  const ChannelOptions& options() const { return options_; }
  const Target& target() const { return target_; }

 private:
  Client(ChannelOptions options, Target target);
  // FAILED_PRECONDITION naming `what` when the target lists several addresses: a head's
  // gradient, optimizer state, versions and shared memory live in one process.
  absl::Status RequireOneServer(absl::string_view what) const;
  // Adds the bearer token and the deadline to a call's context.
  void PrepareContext(grpc::ClientContext& context) const;
  absl::StatusOr<Tensor> FetchTensor(const std::string& head, DType dtype, bool gradient) const;
  // The part of Compute that depends on how the rows travel.
  absl::Status RunCompute(const ComputeRequest& request, v1::ComputeRequest& start_message,
                          ComputeResult& result) const;
  absl::Status RunComputeShared(const ComputeRequest& request, v1::ComputeRequest& start_message,
                                ComputeResult& result) const;

  // Where the server takes memfds (GetSharedMemorySocket).
  absl::StatusOr<std::string> SharedMemorySocketName() const;

  ChannelOptions options_;
  Target target_;
  // Scoring and reads, over every address (Balancing::kRoundRobin).
  std::unique_ptr<v1::LossService::Stub> balanced_stub_;
  // What belongs to one server (Balancing::kOneServer): training calls, steps, the gradient,
  // uploads, checkpoints, shared memory.
  std::unique_ptr<v1::LossService::Stub> one_server_stub_;
  // The connection that shared-memory calls' memfds are registered on.
  std::shared_ptr<Handover> handover_;
  std::shared_ptr<SharedBufferPool> shared_buffers_;  // memfds kept between shared-memory calls
};

}  // namespace lossd::client

#endif  // LOSSD_CLIENT_CLIENT_H_
