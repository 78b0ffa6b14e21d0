// The C++ client of lossd: typed calls over lossd.v1.LossService.
//
//   auto client = lossd::client::Client::Connect({.address = "127.0.0.1:50051"});
//   lossd::client::ComputeRequest request;
//   request.head = "main";
//   request.hidden = {hidden.data(), lossd::client::DType::kBFloat16, num_tokens, hidden_size};
//   request.labels = labels;
//   request.outputs.set_grad_hidden(true);     // request.options, request.outputs: lossd.v1's own
//   auto result = client->Compute(request);   // result->summary.loss(), result->grad_hidden
//
// Every call returns the server's gRPC status as an absl::Status with the same code and message;
// ErrorInfoOf gives what it says to code (why it failed, which field).
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

namespace lossd::wire {
class MessageBufferPool;
}  // namespace lossd::wire

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
// The same retries, for the same reason, cover the other calls the server answers as the first
// when they are repeated: CommitGradWeight (a repeated commit of an id is a replay), and Step and
// GradWeightNorm of several ranks (ranks.world_size > 1: head_version names the step, and a
// repeat gets that step's outcome).
//
// Compute is retried here, not by gRPC: gRPC replays a stream only while everything sent fits its
// per-call retry buffer (256 KiB) and no response has come, so a call that failed after sending
// its rows, or while results were streaming back (a replica killed mid-call), would not be
// replayed. The read-only unary and fetch calls (ListHeads, GetHead, FetchWeight, FetchGradWeight,
// GetSharedMemorySocket) are retried on UNAVAILABLE by gRPC's own retryPolicy in the channels'
// service config, with these attempts (at most 5, gRPC's cap) and backoff: they send one small
// message and take effect nowhere. The other calls that change a head (a single process's Step,
// ZeroGradWeight, DiscardGradWeight, UploadHead, SaveCheckpoint) are made once, since a lost
// answer cannot tell whether they took effect.
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
  // Compute, CommitGradWeight and collective Step and GradWeightNorm (see RetryOptions); the
  // other calls are made once or retried by gRPC.
  RetryOptions compute_retry;
  // HTTP/2 keepalive pings on an idle connection. A server with gRPC's default policy answers
  // pings more frequent than every 5 minutes with GOAWAY, so the default stays at that.
  absl::Duration keepalive_time = absl::Minutes(5);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  // How many connections concurrent scoring Compute calls (those that accumulate no dL/dW) spread
  // over, each call on the one with the fewest calls in flight (the client's own first, so one
  // caller keeps to it): calls that share one HTTP/2 connection lose throughput to it. Training
  // calls keep to one connection, which reaches one server.
  int compute_connections = 4;
  // Whether Compute calls whose rows travel in messages send them over the server's Compute
  // socket (lossd_server --compute_socket_listen; ComputeSocket in lossd.proto: the same messages
  // on a plain TCP connection of their own, around gRPC's HTTP/2 transport) instead of gRPC.
  // Unset: where the server offers one, the channel has no TLS, and the address names one server
  // (TcpHost, resolving to one address); the client asks once. true: FAILED_PRECONDITION where
  // there is none; not with TLS. false: gRPC. ComputeRequest::compute_socket overrides it.
  std::optional<bool> compute_socket;
  // How many connections (1 to 8) one call over the Compute socket may spread its messages over
  // (ComputeSocketLanes in lossd.proto), for a network where one TCP flow cannot carry what the
  // link does (flows capped one by one, a long path with a small window); a call uses at most one
  // per message of rows. One connection fills a loopback or LAN link: the default is 1.
  int compute_socket_lanes = 1;
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
  // One address on this host (loopback or a Unix socket): a server there can take rows in
  // shared memory.
  bool local = false;
};
absl::StatusOr<Target> ParseTarget(absl::string_view address);
// The host of a target that names one TCP server (HOST:PORT, dns:, or a one-entry ipv4: or ipv6:
// list), as a socket connects to it, without brackets; none for anything else (a Unix socket,
// several addresses, another resolver). The Python client's _address.tcp_host follows the same
// rules.
std::optional<std::string> TcpHost(const Target& target);

// Which servers a channel's calls go to.
enum class Balancing {
  kRoundRobin,  // every address the target resolves to in turn, skipping those not SERVING
  kOneServer,   // gRPC's default pick_first: one server at a time
};

// The one place channels are built: message size limits, keepalive and retry arguments set
// explicitly, the service config of `balancing` (load balancing, health checking, retryPolicy
// for the read-only calls), TLS when root certificates are given. Options must have passed
// ValidateChannelOptions.
// own_connection: the channel keeps its connections to itself (a local subchannel pool), where
// channels built alike would otherwise share one.
std::shared_ptr<grpc::Channel> MakeChannel(const ChannelOptions& options, Balancing balancing,
                                           bool own_connection = false);
absl::Status ValidateChannelOptions(const ChannelOptions& options);

// The wire's name for a dtype, as in OutputSelection.grad_hidden_dtype.
v1::DType ToProto(DType dtype);

// The same code (gRPC and absl share the canonical numbering) and the server's message, with the
// server's ErrorInfo (why, and the field it names) kept for ErrorInfoOf.
absl::Status FromGrpcStatus(const grpc::Status& status);
// The same from an RpcStatus, as the Compute socket's FRAME_STATUS carries it.
absl::Status FromRpcStatus(const v1::RpcStatus& status);
// The ErrorInfo a status from the server carried (its reason and field, to act on rather than the
// message); none for a status without one.
std::optional<v1::ErrorInfo> ErrorInfoOf(const absl::Status& status);

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
  // A 16-bit W that trains from fp32 master weights (FetchWeight with master reads them).
  bool master_weights = false;
  int64_t staged_gradients = 0;  // dL/dW staged by calls, waiting for CommitGradWeight
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

// A Compute call. Its options and the outputs it asks for are the wire contract's own messages,
// lossd.v1.LossOptions and lossd.v1.OutputSelection (lossd/v1/lossd.pb.h), with the wire's
// defaults (torch's): every option the server takes is set here as it travels, e.g.
//   request.options.set_objective(v1::OBJECTIVE_PPO);
//   request.options.mutable_policy()->set_dual_clip(3.0);
//   request.outputs.set_ratio(true);
// The tensors and per-token inputs are views of the caller's memory, which must stay valid for
// the call. Sizes are checked before anything is sent (INVALID_ARGUMENT naming the field).
struct ComputeRequest {
  std::string head;
  // Set: FAILED_PRECONDITION unless the head is there. Versions are per server: across replicas
  // pin weight_sha256 instead.
  std::optional<uint64_t> head_version;
  // Set (a HeadInfo::weight_sha256, say from a first GetHead): FAILED_PRECONDITION, naming both
  // hashes, from a server whose W is another, so that the calls of one scoring session over
  // replicas all use one W even while an update rolls out.
  std::string weight_sha256;
  v1::LossOptions options;
  v1::OutputSelection outputs;
  TensorView hidden;  // [num_tokens, hidden_size]
  // num_tokens token ids or ignore_index; empty only for OBJECTIVE_DISTILL with distill.alpha 0,
  // where every row then counts.
  absl::Span<const int64_t> labels;
  // Per-token inputs, each empty or num_tokens values (ComputeStart in lossd.proto says which
  // objective reads which).
  absl::Span<const float> token_weights;       // w_i
  absl::Span<const float> sampling_logprobs;   // q_i: importance sampling, ppo, cispo
  absl::Span<const float> advantages;          // A_i: importance sampling, ppo, cispo
  absl::Span<const float> reference_logprobs;  // with options.policy.kl_estimator
  absl::Span<const float> logprob_grads;       // g_i = dL/dlogp_i: OBJECTIVE_LOGPROB_GRADIENT
  absl::Span<const float> rollout_logprobs;    // the inference engine's: a rollout_correction
  // Next-token prediction: row i is scored against labels[i + 1] of its sequence, the last row of
  // each sequence is ignored (ComputeStart.shift_labels). sequence_lengths: the consecutive
  // sequences the rows make up (the sequence reductions need them); empty: one sequence.
  bool shift_labels = false;
  absl::Span<const int64_t> sequence_lengths;
  // The teacher of OBJECTIVE_DISTILL, one of:
  // - a head served by the same server, with its hidden rows for the same positions
  //   ([num_tokens, teacher hidden size], any dtype), sent beside each chunk of `hidden`;
  //   teacher_head_version pins it;
  // - a sparse teacher: per row its teacher_top_k most likely tokens and their log-probabilities,
  //   [num_tokens, teacher_top_k] each, row-major.
  std::string teacher_head;
  std::optional<uint64_t> teacher_head_version;
  TensorView teacher_hidden;
  int teacher_top_k = 0;
  absl::Span<const int32_t> teacher_top_k_tokens;
  absl::Span<const float> teacher_top_k_logprobs;
  // With outputs.accumulate_grad_weight: keep this call's dL/dW on the server under call_id until
  // Client::CommitGradWeight adds it times a scale, or DiscardGradWeight drops it
  // (ComputeStart.stage_grad_weight; the summary's grad_weight_staged says whether it was).
  bool stage_grad_weight = false;
  // Hidden rows per chunk message; 0 picks as many as fit in min(4 MiB, max_message_bytes), small
  // enough that the server computes early chunks while later ones are still on the wire.
  int64_t rows_per_message = 0;
  // Rows and dL/dh through a memfd shared with a server on this host instead of messages (see
  // SharedMemory in lossd.proto): the client hands its memfd over on the server's handover socket,
  // once per memfd, and the server computes on the rows there. For a server on loopback or a Unix
  // socket in the client's network namespace, whichever user either runs as. Not with a teacher,
  // whose rows travel in messages only. Unset: shared memory when the target is one server on
  // this host, the call has no teacher and the server offers it (the client asks once, for at most
  // 10 s, and keeps to messages if it does not); true or false: as said.
  std::optional<bool> shared_memory;
  // Over the Compute socket rather than gRPC, when the rows travel in messages (see
  // ChannelOptions::compute_socket); unset: the client's choice.
  std::optional<bool> compute_socket;
  // Rows that shared memory takes by copy (not in a SharedRegion) go into it after the call's
  // start, this many rows at a time, each piece announced once in place (SharedMemory.rows_follow),
  // so that the server computes while the rest are copied. 0: in pieces of about 32 MiB where the
  // server says that pays (SharedMemorySocket.rows_follow_pays: its engine computes on a GPU, not
  // the host's cores), else every row copied before the start.
  int64_t shared_rows_per_piece = 0;
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
  // With no grad_hidden_out: dL/dh is lent as result.grad_hidden_shared (result.grad_hidden then
  // has no bytes) from a buffer of the client's, which serves no other call until the last copy
  // of that pointer is dropped. With shared memory it is left where the server wrote it, which
  // saves copying it out; with messages it is received straight into a buffer that earlier calls
  // have used, which saves copying it and faulting in fresh pages. With a few lent out already,
  // dL/dh fills result.grad_hidden as usual.
  bool lend_grad_hidden = false;
};

struct ComputeResult {
  // As the server sent it: the loss (reduced as asked; the sum for REDUCTION_NONE), counts, the
  // policy and distillation statistics (clip_fraction, mean_kl, mean_kd, mean_ce), whether dL/dW
  // was accumulated, staged or replayed, the server's timings.
  v1::ComputeSummary summary;
  // Every per-token output asked for, over all rows in row order (row_offset 0, num_rows
  // num_tokens), put together from the result messages by the rule of lossd.proto's
  // ComputeResult: a repeated field is filled when the OutputSelection field of its name is set,
  // with one value per row (per_token.logprob(i) is row i's), and the top_k_* fields with top_k
  // values per row ([num_tokens, top_k], best first). Outputs not asked for are empty.
  v1::ComputeResult per_token;
  Tensor grad_hidden;  // [num_tokens, hidden_size] when asked for (see grad_hidden_out)
  // grad_hidden's bytes where the server wrote them, when lent (ComputeRequest::lend_grad_hidden);
  // null otherwise.
  std::shared_ptr<const uint8_t> grad_hidden_shared;
  std::string call_id;  // the one sent, empty for none
  int attempts = 0;     // 1 unless retried
  // Seen by the client: the whole call (of the last attempt), and the serialized message bytes
  // each way.
  double wall_seconds = 0.0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t messages_sent = 0;
  int64_t messages_received = 0;
  // How the rows and dL/dh travelled.
  enum class Transport { kGrpc, kComputeSocket, kSharedMemory };
  Transport transport = Transport::kGrpc;
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

// The ranks of a data-parallel job that step one head together (lossd.v1.RankGroup): each calls
// Step (and GradWeightNorm) with the same request but its own rank, the server acts once when all
// world_size ranks have called and answers every rank alike. world_size 1: this call alone.
struct RankGroup {
  int world_size = 1;
  int rank = 0;  // [0, world_size)
};

struct StepOptions {
  std::string head;
  std::variant<SgdOptions, AdamWOptions> optimizer;
  double max_grad_norm = 0.0;  // > 0: clip by global norm first (after grad_multiplier)
  bool keep_grad = false;      // false: the server zeroes the accumulator after the step
  // Set: FAILED_PRECONDITION unless the head is there. Required with ranks.world_size > 1, where
  // it names the step (the version the ranks trained on).
  std::optional<uint64_t> head_version;
  RankGroup ranks;
  // Multiplies the accumulated gradient before anything else (a clip multiplier taken over the
  // whole model, 1 / a loss scale); unset: 1.
  std::optional<double> grad_multiplier;
  // A gradient whose norm (after grad_multiplier) leaves float32's range skips the step, as
  // torch.amp.GradScaler does, instead of failing it: StepResult::skipped.
  bool skip_nonfinite = false;
};

struct StepResult {
  uint64_t head_version = 0;
  double grad_norm = 0.0;  // after grad_multiplier, before clipping
  double clip_multiplier = 1.0;
  int64_t accumulated_tokens = 0;
  bool skipped = false;  // skip_nonfinite met a non-finite gradient: W did not move
};

// GradWeightNorm: the norm of a head's accumulated gradient, once every rank has sent its part.
struct GradNormOptions {
  std::string head;
  std::optional<uint64_t> head_version;  // required with ranks.world_size > 1, as for Step
  RankGroup ranks;
  std::optional<double> grad_multiplier;  // the norm is of the multiplied gradient
};

struct GradNormResult {
  uint64_t head_version = 0;
  double grad_norm = 0.0;  // +inf or NaN when an entry is not finite
  int64_t accumulated_tokens = 0;
  int64_t accumulated_calls = 0;
};

struct CommitResult {
  uint64_t head_version = 0;
  int64_t accumulated_tokens = 0;
  bool replayed = false;  // the id was committed before: nothing added again
};

class ComputeConnections;
class ComputeSocketPool;
struct ComputeSocketChoice;
class Handover;
class SharedBuffer;
class SharedBufferPool;

// Memory a Client can share with a server on its host (Client::NewSharedRegion: a memfd, handed
// over at the first call that uses it; zero-filled at first). A Compute of that Client whose rows
// (ComputeRequest::hidden) lie in one, starting a multiple of 64 bytes from data(), hands them
// over where they are instead of copying them into shared memory first; dL/dh still comes back as
// asked. With messages (a server elsewhere) it is ordinary memory. Copies share the memory, which
// is freed with the last copy or call that holds it.
class SharedRegion {
 public:
  uint8_t* data() const;
  uint64_t size() const;

 private:
  friend class Client;
  explicit SharedRegion(std::shared_ptr<SharedBuffer> buffer);

  std::shared_ptr<SharedBuffer> buffer_;
};

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
  // `master`: a head's fp32 master weights (HeadInfo::master_weights) instead of the 16-bit W that
  // calls read; W for a head without them.
  absl::StatusOr<Tensor> FetchWeight(const std::string& head, DType dtype = DType::kFloat32,
                                     bool master = false) const;
  absl::StatusOr<Tensor> FetchGradWeight(const std::string& head,
                                         DType dtype = DType::kFloat32) const;
  // Returns the head's version.
  absl::StatusOr<uint64_t> ZeroGrad(const std::string& head) const;
  absl::StatusOr<StepResult> Step(const StepOptions& options) const;
  // Changes nothing; collective like Step with ranks.world_size > 1.
  absl::StatusOr<GradNormResult> GradWeightNorm(const GradNormOptions& options) const;
  // Adds the dL/dW that the call `call_id` staged (ComputeRequest::stage_grad_weight) to the
  // accumulator times `scale` (the upstream gradient of its loss). NOT_FOUND when nothing is
  // staged under the id any more (the head stepped, the gradient expired or was discarded).
  absl::StatusOr<CommitResult> CommitGradWeight(const std::string& head, const std::string& call_id,
                                                double scale = 1.0) const;
  // Drops staged gradients whose backward will not run; returns how many were still staged.
  absl::StatusOr<int> DiscardGradWeight(const std::string& head,
                                        absl::Span<const std::string> call_ids) const;
  // An empty `head` saves every head; returns the checkpoint paths on the server.
  absl::StatusOr<std::vector<std::string>> SaveCheckpoint(const std::string& head = "") const;

  // Streams the batch in chunk messages from a writer thread while this thread reads the results,
  // so results arrive while rows are still being sent and neither side blocks the other. Retries
  // as options().compute_retry says.
  absl::StatusOr<ComputeResult> Compute(const ComputeRequest& request) const;
  // `bytes` of memory for rows that calls hand over without copying (see SharedRegion). Linux
  // only (memfd_create).
  absl::StatusOr<SharedRegion> NewSharedRegion(uint64_t bytes) const;

  const ChannelOptions& options() const { return options_; }
  const Target& target() const { return target_; }

 private:
  Client(ChannelOptions options, Target target);
  // FAILED_PRECONDITION naming `what` when the target lists several addresses: a head's
  // gradient, optimizer state, versions and shared memory live in one process.
  absl::Status RequireOneServer(absl::string_view what) const;
  // Adds the bearer token and the deadline to a call's context.
  void PrepareContext(grpc::ClientContext& context) const;
  absl::StatusOr<Tensor> FetchTensor(const std::string& head, DType dtype, bool gradient,
                                     bool master) const;
  // One unary call to the one server.
  template <typename Request, typename Response>
  absl::StatusOr<Response> CallOneServer(grpc::Status (v1::LossService::Stub::*method)(
                                             grpc::ClientContext*, const Request&, Response*),
                                         const Request& request) const;
  // CallOneServer, retried as options().compute_retry says where `repeatable`: the server
  // answers a repeat of the request as the first.
  template <typename Request, typename Response>
  absl::StatusOr<Response> CallOneServerRetried(
      grpc::Status (v1::LossService::Stub::*method)(grpc::ClientContext*, const Request&,
                                                    Response*),
      const Request& request, bool repeatable) const;
  // The part of Compute that depends on how the rows travel.
  absl::Status RunCompute(const ComputeRequest& request, v1::ComputeRequest& start_message,
                          ComputeResult& result) const;
  absl::Status RunComputeShared(const ComputeRequest& request, v1::ComputeRequest& start_message,
                                ComputeResult& result) const;
  absl::Status RunComputeOverSocket(const ComputeRequest& request,
                                    v1::ComputeRequest& start_message, ComputeResult& result,
                                    ComputeSocketPool& socket) const;
  // The Compute socket `request` goes over, or null for gRPC (ComputeRequest::compute_socket);
  // FAILED_PRECONDITION when it asked for one that is not there.
  absl::StatusOr<ComputeSocketPool*> ComputeSocketFor(const ComputeRequest& request) const;
  // Asks the server for its Compute socket: the pool, or null where there is none to use (for
  // good); an error where the server could not be asked, or (required) there is none.
  absl::StatusOr<std::unique_ptr<ComputeSocketPool>> FindComputeSocket(bool required) const;

  // Where the server takes memfds (GetSharedMemorySocket), asked within `deadline` at most.
  absl::StatusOr<v1::SharedMemorySocket> SharedMemorySocket(
      absl::Duration deadline = absl::InfiniteDuration()) const;
  // Whether `request`'s rows travel in shared memory (ComputeRequest.shared_memory).
  bool UsesSharedMemory(const ComputeRequest& request) const;

  ChannelOptions options_;
  Target target_;
  // Scoring and reads, over every address (Balancing::kRoundRobin).
  std::shared_ptr<grpc::Channel> balanced_channel_;
  std::unique_ptr<v1::LossService::Stub> balanced_stub_;
  // What belongs to one server (Balancing::kOneServer): training calls, steps, the gradient,
  // uploads, checkpoints, shared memory.
  std::shared_ptr<grpc::Channel> one_server_channel_;
  std::unique_ptr<v1::LossService::Stub> one_server_stub_;
  // Scoring Compute calls' connections (ChannelOptions::compute_connections).
  std::shared_ptr<ComputeConnections> scoring_connections_;
  // The connection that shared-memory calls' memfds are registered on.
  std::shared_ptr<Handover> handover_;
  std::shared_ptr<SharedBufferPool> shared_buffers_;  // memfds kept between shared-memory calls
  // Memory that rows are copied into to be sent, kept for the next message and call.
  std::shared_ptr<wire::MessageBufferPool> send_buffers_;
  // The server's Compute socket, once asked for (ChannelOptions::compute_socket).
  std::shared_ptr<ComputeSocketChoice> compute_socket_;
};

}  // namespace lossd::client

#endif  // LOSSD_CLIENT_CLIENT_H_
