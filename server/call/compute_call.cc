#include "server/call/compute_call.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/loss_math.h"
#include "server/call/call_spec.h"
#include "server/call/proto_convert.h"
#include "server/call/result_writer.h"
#include "server/call/row_reader.h"
#include "server/shm/shared_memory.h"
#include "server/status/exception_status.h"

namespace lossd::server {
namespace {

double SecondsSince(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

// How long a call may wait for its results to leave before it counts as stalled on its client and
// gives its running slot back (as the streams' own writes do).
constexpr absl::Duration kResultStallGrace = absl::Milliseconds(20);

// Values a row of the one-value outputs (LOSSD_TOKEN_OUTPUTS), all four bytes wide.
#define LOSSD_COUNT_TOKEN_OUTPUT(type, name) +1
constexpr int64_t kOneValueOutputs = 0 LOSSD_TOKEN_OUTPUTS(LOSSD_COUNT_TOKEN_OUTPUT);
#undef LOSSD_COUNT_TOKEN_OUTPUT

// Per-row outputs of one engine chunk, in host memory: a buffer per output of LOSSD_TOKEN_OUTPUTS,
// whose name is also its OutputSelection and ComputeResult fields', and top-k's. (top_k, k values
// a row, and dL/dh, bytes in the caller's dtype, are bound and streamed on their own.)
struct ChunkOutputs {
// The engine's type is the wire's (an enum's repeated field holds ints).
#define LOSSD_TOKEN_BUFFER(type, name)                                                             \
  static_assert(std::is_same_v<std::remove_pointer_t<decltype(std::declval<v1::ComputeResult>()    \
                                                                  .mutable_##name())>::value_type, \
                               type>);                                                             \
  std::vector<type> name;
  LOSSD_TOKEN_OUTPUTS(LOSSD_TOKEN_BUFFER)
#undef LOSSD_TOKEN_BUFFER
  std::vector<float> top_k_logprob;
  std::vector<int32_t> top_k_token;

  // dL/dh, when wanted, goes to `grad_hidden` (shared memory, or the call's host buffer).
  TokenOutputs Bind(const v1::OutputSelection& want, int64_t rows, void* grad_hidden,
                    DType grad_dtype) {
    TokenOutputs out;
    auto bind = [rows](bool wanted, auto& buffer, int64_t per_row) {
      buffer.resize(wanted ? rows * per_row : 0);
      return wanted ? buffer.data() : nullptr;
    };
#define LOSSD_BIND_TOKEN_OUTPUT(type, name) out.name = bind(want.name(), name, 1);
    LOSSD_TOKEN_OUTPUTS(LOSSD_BIND_TOKEN_OUTPUT)
#undef LOSSD_BIND_TOKEN_OUTPUT
    out.top_k = want.top_k();
    out.top_k_logprob = bind(want.top_k() > 0, top_k_logprob, want.top_k());
    out.top_k_token = bind(want.top_k() > 0, top_k_token, want.top_k());
    out.grad_hidden = grad_hidden;
    out.grad_hidden_dtype = grad_dtype;
    return out;
  }
};

class ComputeCall {
 public:
  ComputeCall(const ComputeEnvironment& env, ComputeStream& stream) : env_(env), stream_(stream) {}

  absl::Status Run() {
    absl::Status status = CatchExceptions("Compute", [this] { return RunSteps(); });
    const std::optional<AdmissionRefusal> refusal = AdmissionRefusalOf(status);
    if (refusal.has_value() && env_.metrics != nullptr) {
      env_.metrics->CountAdmissionRejected(AdmissionRefusalName(*refusal));
    }
    // A reader still waiting on the client ends the stream with the call's own status at once.
    if (!status.ok() && reader_ != nullptr) reader_->Stop(status);
    if (!status.ok() && writer_ != nullptr) writer_->Stop(status);
    return status;
  }

 private:
  absl::Status RunSteps() {
    RETURN_IF_ERROR(ReadStart());
    if (spec_.shared_memory.has_value()) RETURN_IF_ERROR(MapSharedMemory());
    RETURN_IF_ERROR(Prepare());
    if (!spec_.shared_memory.has_value() || spec_.shared_memory->rows_follow()) {
      // The reader's buffers are host memory, taken before admission (and counted as pending);
      // the call queues for the device only once it has a chunk to compute or its stream ended,
      // so a client that is slow to send, or sends nothing, holds no running slot. Rows that
      // follow in shared memory need no buffers: the reader takes their announcements.
      const RowLayout layout = Layout();
      RETURN_IF_ERROR(pending_.Resize(pending_.bytes() + RowReader::BufferBytes(layout)));
      ASSIGN_OR_RETURN(reader_, RowReader::Start(stream_, env_.metrics, layout, *env_.host_buffers,
                                                 env_.limits.stream_idle,
                                                 PendingAccount{env_.pending, stream_.Peer()}));
      RETURN_IF_ERROR(reader_->AwaitFirstChunk());
    }

    const absl::Time queue_start = absl::Now();
    // A stream that fails while the call waits (a malformed message, rows read ahead that do not
    // fit the pending memory) ends the wait, and its error is the call's.
    const auto stream_failed = [this] {
      return stream_.IsCancelled() || (reader_ != nullptr && !reader_->Error().ok());
    };
    absl::StatusOr<Admission> admission =
        env_.scheduler->Admit(admitted_bytes_, stream_failed, env_.limits.max_admission_wait);
    if (!admission.ok()) {
      if (reader_ != nullptr) RETURN_IF_ERROR(reader_->Error());
      return AdmissionRefusalOf(admission.status()) == AdmissionRefusal::kOverBudget
                 ? OverBudget(admission.status())
                 : admission.status();
    }
    admission_ = *std::move(admission);
    pending_.Release();
    if (reader_ != nullptr) reader_->Admitted();
    queue_seconds_ = SecondsSince(queue_start);
    RETURN_IF_ERROR(CheckPinnedWeights(spec_));
    if (env_.metrics != nullptr) env_.metrics->ObserveQueueSeconds(queue_seconds_);
    RETURN_IF_ERROR(AllocateBuffers());

    RETURN_IF_ERROR(ReceiveAndCompute());
    RETURN_IF_ERROR(AwaitResultsWritten(writer_->queued()));
    if (staging_.held()) {
      // The first engine chunk stores its dL/dW; a call without rows has none to store.
      if (computed_rows_ == 0) RETURN_IF_ERROR(env_.backend->Zero(staging_.buffer()));
      // The last point at which a cancelled call can still leave the accumulator untouched.
      if (stream_.IsCancelled()) {
        return absl::CancelledError(
            "call cancelled before its dL/dW was committed; nothing was accumulated");
      }
      ASSIGN_OR_RETURN(commit_, CommitGradient());
    }
    accumulated_ = staging_.held();
    // The device is done with the call: its slot and buffers go back before the summary, which a
    // client that reads nothing would otherwise keep them waiting for.
    workspace_ = BufferLease();
    staging_ = BufferLease();
    admission_.Release();
    const absl::Status sent = SendSummary();
    // Once dL/dW is committed the call has taken effect: failing it now, because the client left
    // before its summary, would report as failed (so: nothing accumulated) a gradient that was.
    if (!sent.ok() && !accumulated_) return sent;
    Account();
    return absl::OkStatus();
  }

  // Reads and validates the start message. Its host memory counts as pending from the moment it
  // is read; the message itself (its repeated fields can be hundreds of MB) is freed once its
  // per-token values are copied out, leaving those copies charged.
  absl::Status ReadStart() {
    wire::ComputeRequestFrame frame;
    if (!stream_.Read(&frame)) {
      return stream_.IsCancelled()
                 ? absl::CancelledError("call cancelled before its start message")
                 : InvalidField("start", "a ComputeStart as the first message", "an empty stream");
    }
    v1::ComputeRequest& request = frame.message;
    if (!request.has_start()) {
      return InvalidField("start", "a ComputeStart as the first message", "a chunk");
    }
    const v1::ComputeStart& start = request.start();
    const int64_t copies_bound = StartCopiesBound(start, env_.limits.max_tokens_per_call);
    ASSIGN_OR_RETURN(pending_, env_.pending->Reserve(
                                   stream_.Peer(),
                                   static_cast<int64_t>(request.SpaceUsedLong()) + copies_bound));
    // Only a call that accumulates under an id is matched against its retries.
    const bool repeatable = !start.call_id().empty() && start.outputs().accumulate_grad_weight();
    const uint64_t fingerprint = repeatable ? StartFingerprint(*request.mutable_start()) : 0;
    ASSIGN_OR_RETURN(spec_, ParseStart(env_, start, fingerprint));
    return pending_.Resize(spec_.copied_bytes());
  }

  RowLayout Layout() const {
    RowLayout layout;
    layout.num_tokens = spec_.num_tokens;
    layout.hidden_size = spec_.hidden_size;
    layout.dtype = spec_.hidden_dtype;
    layout.chunk_rows = plan_.token_chunk;
    layout.chunk_ends = chunk_ends_;
    if (spec_.shared_memory.has_value()) layout.shared_rows = shared_memory_.hidden();
    if (spec_.teacher != nullptr) {
      layout.side.push_back(
          {SideField::kTeacherHidden,
           spec_.teacher_hidden_size * static_cast<int64_t>(DTypeSize(spec_.teacher_hidden_dtype)),
           absl::StrCat(spec_.teacher_hidden_size, " ", DTypeName(spec_.teacher_hidden_dtype),
                        " values")});
    } else if (spec_.teacher_top_k > 0) {
      const int64_t k = spec_.teacher_top_k;
      layout.side.push_back({SideField::kTeacherTopKTokens, k * 4, absl::StrCat(k, " int32 ids")});
      layout.side.push_back(
          {SideField::kTeacherTopKLogprobs, k * 4, absl::StrCat(k, " float32 values")});
    }
    return layout;
  }

  // The call alone needs more device memory than the compute budget: says how much, and what
  // would make it fit. A training call's V x H fp32 staging dL/dW is fixed by the head, so fewer
  // tokens help only when the workspace is what overflows.
  absl::Status OverBudget(const absl::Status& refused) const {
    const int64_t capacity = env_.scheduler->capacity_bytes();
    const Head& head = *spec_.head;
    std::string message =
        absl::StrCat("the call needs ", admitted_bytes_, " bytes of device memory (",
                     plan_.workspace_bytes, " of workspace");
    if (staging_bytes_ > 0) {
      absl::StrAppend(&message, " and ", staging_bytes_, " for the ", head.vocab_size(), " x ",
                      head.hidden_size(), " fp32 staging dL/dW of head '", head.name(), "'");
    }
    if (measure_ratios_first_) {
      absl::StrAppend(&message, " and ", spec_.num_tokens * spec_.hidden_row_bytes(),
                      " for the rows a gspo call keeps between its two passes");
    }
    absl::StrAppend(&message, "); the server's compute budget is ", capacity, " bytes");
    constexpr int64_t kMiB = int64_t{1} << 20;
    const int64_t needed_mib = (admitted_bytes_ + kMiB - 1) / kMiB;
    ProblemShape one_token = shape_;
    one_token.num_tokens = 1;
    const absl::StatusOr<ChunkPlan> smallest =
        env_.backend->Plan(one_token, env_.limits.workspace_budget_bytes);
    const int64_t smallest_workspace =
        smallest.ok() ? static_cast<int64_t>(smallest->workspace_bytes) : 0;
    const int64_t staging = static_cast<int64_t>(staging_bytes_);
    if (staging + smallest_workspace > capacity) {
      absl::StrAppend(&message, ". Fewer tokens cannot make it fit",
                      staging > 0 ? " (the staging dL/dW is fixed by the head)" : "",
                      ": start the server with --compute_memory_mib of at least ", needed_mib,
                      ", or 0 to size the budget to the heads it serves");
    } else {
      const int64_t workspace_room_mib = (capacity - staging) / kMiB;
      absl::StrAppend(&message, ". The workspace is what overflows: ");
      if (workspace_room_mib > 0 && workspace_room_mib * kMiB >= smallest_workspace) {
        absl::StrAppend(&message, "start the server with --workspace_budget_mib of at most ",
                        workspace_room_mib, " or ");
      } else {
        absl::StrAppend(&message, "start the server with ");
      }
      absl::StrAppend(&message, "--compute_memory_mib of at least ", needed_mib,
                      ", or send fewer tokens per call");
    }
    return WithAdmissionRefusal(absl::ResourceExhaustedError(message),
                                *AdmissionRefusalOf(refused));
  }

  absl::Status Prepare() {
    const Head& head = *spec_.head;
    ProblemShape& shape = shape_;
    shape.num_tokens = std::max<int64_t>(spec_.num_tokens, 1);
    shape.hidden_size = spec_.hidden_size;
    shape.vocab_size = head.vocab_size();
    shape.hidden_dtype = spec_.hidden_dtype;
    shape.weight_dtype = head.dtype();
    shape.grad_hidden = spec_.outputs.grad_hidden();
    shape.grad_weight = spec_.outputs.accumulate_grad_weight();
    shape.grad_hidden_dtype = spec_.grad_hidden_dtype;
    shape.top_k = spec_.outputs.top_k();
    shape.exact_gradients = spec_.options.exact_gradients;
    if (spec_.teacher != nullptr) {
      shape.teacher.kind = TeacherKind::kDense;
      shape.teacher.hidden_size = spec_.teacher_hidden_size;
      shape.teacher.hidden_dtype = spec_.teacher_hidden_dtype;
      shape.teacher.weight_dtype = spec_.teacher->dtype();
    } else if (spec_.teacher_top_k > 0) {
      shape.teacher.kind = TeacherKind::kSparse;
      shape.teacher.top_k = spec_.teacher_top_k;
    }
    shape.sequence_ratio = !spec_.ratio_sequences.empty();
    const int64_t* sequences = spec_.ratio_sequences.data();
    const int64_t num_sequences = static_cast<int64_t>(spec_.ratio_sequences.size());
    // Planned as a call of PlannedCallRows, so that calls of nearby lengths share buffer sizes.
    ProblemShape planned = shape;
    planned.num_tokens = PlannedCallRows(shape.num_tokens);
    ASSIGN_OR_RETURN(plan_, env_.backend->Plan(planned, env_.limits.workspace_budget_bytes));
    // Chunks longer than the overlap allows (a gspo call's longest sequence kept whole) are
    // planned again as a call of that many rows; where the budget cuts shorter ones, they stay.
    const int64_t chunk_limit = std::max(OverlappedChunkRowLimit(planned.num_tokens),
                                         LongestSequence(sequences, num_sequences));
    if (plan_.token_chunk > chunk_limit) {
      planned.num_tokens = chunk_limit;
      ASSIGN_OR_RETURN(plan_, env_.backend->Plan(planned, env_.limits.workspace_budget_bytes));
    }
    // gspo: where every sequence fits in an engine chunk, the engine measures each sequence's
    // ratio and finishes its rows in the chunk's one pass (chunks cut at sequence ends); a longer
    // sequence needs the two passes of MeasureRatiosThenCompute.
    measure_ratios_first_ =
        shape.sequence_ratio && LongestSequence(sequences, num_sequences) > plan_.token_chunk;
    spec_.options.policy.sequence_ratio = shape.sequence_ratio && !measure_ratios_first_;
    ratio_sequences_ = SequenceCursor(sequences);
    chunk_ends_ =
        spec_.options.policy.sequence_ratio
            ? TokenChunkEnds(spec_.num_tokens, plan_.token_chunk, sequences, num_sequences)
            : TokenChunkEnds(spec_.num_tokens, plan_.token_chunk);
    staging_bytes_ = shape.grad_weight ? head.vocab_size() * head.hidden_size() * sizeof(float) : 0;
    admitted_bytes_ = static_cast<int64_t>(plan_.workspace_bytes + staging_bytes_);
    // A gspo call in two passes keeps its rows between them: they count against the server's
    // budget like its workspace, so that a call of millions of rows is refused as over budget
    // instead of exhausting the host's memory.
    if (measure_ratios_first_) admitted_bytes_ += spec_.num_tokens * spec_.hidden_row_bytes();
    return absl::OkStatus();
  }

  // Before admission, so that a call that cannot use shared memory fails without waiting for, or
  // holding, a place on the device. Unless they follow (rows_follow), the rows are in the memfd, so
  // the start message is the whole call: nothing after it is read, and the call does not wait for
  // the client to half-close.
  absl::Status MapSharedMemory() {
    RETURN_IF_ERROR(
        CheckSharedMemoryOffered(env_.limits.allow_shared_memory, stream_.PeerIsLocal()));
    if (stream_.IsCancelled()) return absl::CancelledError("call cancelled before it was admitted");
    const uint64_t rows = static_cast<uint64_t>(spec_.num_tokens);
    const uint64_t grad_hidden_bytes =
        spec_.outputs.grad_hidden() ? rows * spec_.grad_row_bytes() : 0;
    ASSIGN_OR_RETURN(shared_memory_,
                     env_.shared_memory->Map(*spec_.shared_memory, rows * spec_.hidden_row_bytes(),
                                             grad_hidden_bytes));
    return absl::OkStatus();
  }

  absl::Status AllocateBuffers() {
    ASSIGN_OR_RETURN(workspace_,
                     env_.buffers->Acquire(plan_.workspace_bytes, MemoryPurpose::kWorkspace));
    if (staging_bytes_ > 0) {
      // Not zeroed: the first engine chunk stores into it (LossOptions::overwrite_grad_weight).
      ASSIGN_OR_RETURN(staging_, env_.buffers->Acquire(staging_bytes_, MemoryPurpose::kGradients));
    }
    writer_ = std::make_unique<ResultWriter>(stream_, env_.metrics);
    if (spec_.outputs.grad_hidden() && !spec_.shared_memory.has_value()) {
      // One chunk's dL/dh leaves from one buffer while the next chunk's is computed into the other.
      const int64_t rows = std::min(plan_.token_chunk, spec_.num_tokens);
      const size_t buffers = chunk_ends_.size() > 1 ? 2 : 1;
      for (size_t b = 0; b < buffers; ++b) {
        ASSIGN_OR_RETURN(
            message_grad_hidden_[b],
            env_.host_buffers->Acquire(static_cast<size_t>(rows * spec_.grad_row_bytes()),
                                       MemoryPurpose::kWorkspace));
      }
    }
    // The client may rewrite its memory while the call runs: unless the backend reads each row
    // once, every engine chunk that adds to dL/dW is computed from a private copy of its rows, so
    // that the finiteness check and dL/dW see the same values. A call without dL/dW writes only
    // into its own results, which a client racing its own rows can spoil for itself alone.
    // A gspo call in two passes keeps a copy of all its rows (MeasureRatiosThenCompute).
    if (spec_.shared_memory.has_value() && spec_.num_tokens > 0 && !measure_ratios_first_ &&
        spec_.outputs.accumulate_grad_weight() &&
        !env_.backend->ReadsRowsOnce(spec_.hidden_dtype)) {
      const int64_t rows = std::min(plan_.token_chunk, spec_.num_tokens);
      ASSIGN_OR_RETURN(shared_rows_copy_, env_.host_buffers->Acquire(
                                              static_cast<size_t>(rows * spec_.hidden_row_bytes()),
                                              MemoryPurpose::kWorkspace));
    }
    return absl::OkStatus();
  }

  // While the call waits for its client (its next rows not yet in, a result not yet taken) it
  // holds no running slot: the slot and the workspace go back to the scheduler, the staging dL/dW
  // stays admitted (it holds the call's sum so far), and the call queues again once its client
  // has caught up (ResumeIfPaused). Slots are for computing: a client that sends or reads slowly,
  // or not at all, delays its own call only.
  absl::Status PauseWhileWaiting() {
    if (!admission_.held() || admission_.paused()) return absl::OkStatus();
    workspace_ = BufferLease();
    admission_.Pause(static_cast<int64_t>(staging_bytes_));
    return absl::OkStatus();
  }

  absl::Status ResumeIfPaused() {
    if (!admission_.paused()) return absl::OkStatus();
    const auto stream_failed = [this] {
      return stream_.IsCancelled() || (reader_ != nullptr && !reader_->Error().ok());
    };
    const absl::Status resumed = admission_.Resume(stream_failed, env_.limits.max_admission_wait);
    if (!resumed.ok()) {
      // A stream that failed meanwhile: its error is the call's.
      if (reader_ != nullptr) RETURN_IF_ERROR(reader_->Error());
      return resumed;
    }
    ASSIGN_OR_RETURN(workspace_,
                     env_.buffers->Acquire(plan_.workspace_bytes, MemoryPurpose::kWorkspace));
    return absl::OkStatus();
  }

  // Engine chunk `chunk`'s dL/dh on its way into result messages: chunks take turns between two
  // buffers (one, for a call of one chunk).
  uint8_t* MessageGradHidden(int64_t chunk) {
    BufferLease& lease = message_grad_hidden_[message_grad_hidden_[1].held() ? chunk % 2 : 0];
    return static_cast<uint8_t*>(lease.buffer().data());
  }

  // Waits until the results up to message number `message` (ResultWriter::Queue) have left. A call
  // that waits on its client meanwhile gives its slot back, as a call waiting for rows does.
  absl::Status AwaitResultsWritten(int64_t message) {
    if (!writer_->AwaitWritten(message, kResultStallGrace, [this] { (void)PauseWhileWaiting(); })) {
      return absl::CancelledError(
          "client went away while results were sent; nothing was accumulated");
    }
    return ResumeIfPaused();
  }

  // Computes each engine chunk as soon as its rows are in, while the reader takes the next; rows
  // in shared memory are computed where they lie, or from a copy (AllocateBuffers).
  absl::Status ReceiveAndCompute() {
    if (measure_ratios_first_) return MeasureRatiosThenCompute();
    if (reader_ == nullptr) {  // every row in shared memory already
      for (int64_t first = 0; const int64_t end : chunk_ends_) {
        const uint8_t* rows = shared_memory_.hidden() + first * spec_.hidden_row_bytes();
        RETURN_IF_ERROR(ComputeChunk(PrivateRows({rows, first, end - first})));
        first = end;
      }
      return absl::OkStatus();
    }
    while (computed_rows_ < spec_.num_tokens) {
      if (!reader_->ChunkReady()) RETURN_IF_ERROR(PauseWhileWaiting());
      ASSIGN_OR_RETURN(const RowChunk chunk, reader_->Next());
      RETURN_IF_ERROR(ResumeIfPaused());
      RETURN_IF_ERROR(ComputeChunk(PrivateRows(chunk)));
      reader_->Release();
    }
    return reader_->Finish();
  }

  // The chunk, or where the rows lie in the client's shared memory and the call takes a private
  // copy of them (AllocateBuffers), the chunk read from that copy.
  RowChunk PrivateRows(RowChunk chunk) {
    if (!shared_rows_copy_.held()) return chunk;
    void* copy = shared_rows_copy_.buffer().data();
    std::memcpy(copy, chunk.rows, static_cast<size_t>(chunk.num_rows * spec_.hidden_row_bytes()));
    chunk.rows = copy;
    return chunk;
  }

  // OBJECTIVE_GSPO with a sequence longer than an engine chunk (shorter ones take the engine's
  // single pass, PolicyOptions::sequence_ratio). A first pass, forward only, takes each row's
  // logp_t as the rows arrive and keeps the rows; each sequence's log s_i, the mean over its
  // counted rows of logp_t - q_t, then makes the call ppo's against q'_t = logp_t - log s_i, whose
  // ratio on every token of the sequence is s_i with d r / d logp_t = r (GSPO-token's stop-gradient
  // form); the second pass computes that from the kept rows. Both passes read the same kept bytes,
  // so the ratios and the gradients see the same rows even where the client rewrites its shared
  // memory meanwhile.
  absl::Status MeasureRatiosThenCompute() {
    const int64_t n = spec_.num_tokens;
    const int64_t row_bytes = spec_.hidden_row_bytes();
    ASSIGN_OR_RETURN(BufferLease kept, env_.host_buffers->Acquire(
                                           static_cast<size_t>(std::max<int64_t>(n, 1) * row_bytes),
                                           MemoryPurpose::kWorkspace));
    uint8_t* kept_rows = static_cast<uint8_t*>(kept.buffer().data());
    std::vector<float> logprobs(static_cast<size_t>(n));
    const auto measure = [&](const RowChunk& chunk) {
      uint8_t* rows = kept_rows + chunk.first_row * row_bytes;
      std::memcpy(rows, chunk.rows, static_cast<size_t>(chunk.num_rows * row_bytes));
      return MeasureLogprobs({rows, chunk.first_row, chunk.num_rows},
                             logprobs.data() + chunk.first_row);
    };
    if (reader_ == nullptr) {
      for (int64_t first = 0; first < n; first += plan_.token_chunk) {
        const int64_t rows = std::min(plan_.token_chunk, n - first);
        RETURN_IF_ERROR(measure({shared_memory_.hidden() + first * row_bytes, first, rows}));
      }
    } else {
      int64_t measured = 0;
      while (measured < n) {
        if (!reader_->ChunkReady()) RETURN_IF_ERROR(PauseWhileWaiting());
        ASSIGN_OR_RETURN(const RowChunk chunk, reader_->Next());
        RETURN_IF_ERROR(ResumeIfPaused());
        RETURN_IF_ERROR(measure(chunk));
        measured += chunk.num_rows;
        reader_->Release();
      }
      RETURN_IF_ERROR(reader_->Finish());
    }
    ApplySequenceRatios(logprobs);
    for (int64_t first = 0; first < n; first += plan_.token_chunk) {
      const int64_t rows = std::min(plan_.token_chunk, n - first);
      RETURN_IF_ERROR(ComputeChunk({kept_rows + first * row_bytes, first, rows}));
    }
    return absl::OkStatus();
  }

  // logp of the chunk's rows under the call's transform, into `logprobs`; no gradients.
  absl::Status MeasureLogprobs(const RowChunk& chunk, float* logprobs) {
    LossOptions options;  // the call's head transform and ignored rows; nothing else applies
    options.ignore_index = spec_.options.ignore_index;
    options.logit_softcap = spec_.options.logit_softcap;
    options.temperature = spec_.options.temperature;
    options.allow_tf32 = spec_.options.allow_tf32;
    options.reduction = Reduction::kSum;
    TokenOutputs out;
    out.logprob = logprobs;
    return RunEngine(chunk, ChunkInputs(chunk), options, out, nullptr).status();
  }

  // The chunk's rows and labels as the engine takes them.
  BatchInputs ChunkInputs(const RowChunk& chunk) const {
    BatchInputs in;
    in.hidden = chunk.rows;
    in.hidden_dtype = spec_.hidden_dtype;
    in.num_tokens = chunk.num_rows;
    in.hidden_size = spec_.hidden_size;
    in.labels = spec_.has_labels ? spec_.labels.data() + chunk.first_row : nullptr;
    return in;
  }

  // One engine call on the call's heads and workspace, timed; a chunk whose values were not all
  // finite is explained as the call's error.
  absl::StatusOr<BatchSummary> RunEngine(const RowChunk& chunk, BatchInputs in,
                                         const LossOptions& options, const TokenOutputs& out,
                                         DeviceBuffer* grad_weight) {
    const absl::Time start = absl::Now();
    BatchSummary summary;
    RETURN_IF_ERROR(WithHeads([&](const WeightView& weight, const WeightView* teacher) {
      in.teacher.weight = teacher;
      ASSIGN_OR_RETURN(summary, env_.backend->Compute(in, weight, options, out, grad_weight,
                                                      workspace_.buffer()));
      return absl::OkStatus();
    }));
    const double seconds = SecondsSince(start);
    compute_seconds_ += seconds;
    if (env_.metrics != nullptr) env_.metrics->ObserveComputeSeconds(seconds);
    if (!summary.all_finite) {
      if (env_.metrics != nullptr) env_.metrics->CountNonFiniteCall();
      return ExplainNonFiniteChunk(chunk);
    }
    return summary;
  }

  // sampling_logprobs[t] <- logp_t - log s_i on the counted rows of each sequence i.
  void ApplySequenceRatios(const std::vector<float>& logprobs) {
    int64_t first = 0;
    for (const int64_t length : spec_.ratio_sequences) {
      double log_ratio_sum = 0.0;
      int64_t counted = 0;
      for (int64_t t = first; t < first + length; ++t) {
        if (!spec_.counted(t)) continue;
        log_ratio_sum += static_cast<double>(logprobs[t]) - spec_.sampling_logprobs[t];
        ++counted;
      }
      const double log_ratio = counted > 0 ? log_ratio_sum / static_cast<double>(counted) : 0.0;
      for (int64_t t = first; t < first + length; ++t) {
        if (spec_.counted(t)) {
          spec_.sampling_logprobs[t] = static_cast<float>(logprobs[t] - log_ratio);
        }
      }
      first += length;
    }
  }

  absl::Status ComputeChunk(const RowChunk& chunk) {
    const int64_t first = chunk.first_row;
    const int64_t rows = chunk.num_rows;
    // The chunk two before this one used the same dL/dh buffer: its results must have left. The
    // results in flight are so bounded to one chunk's, whatever the transport.
    RETURN_IF_ERROR(AwaitResultsWritten(last_message_of_chunk_[computed_chunks_ % 2]));
    BatchInputs in = ChunkInputs(chunk);
    in.token_weights = spec_.token_weights.empty() ? nullptr : spec_.token_weights.data() + first;
    const auto rows_of = [first](const auto& values) {
      return values.empty() ? nullptr : values.data() + first;
    };
    in.sampling_logprobs = rows_of(spec_.sampling_logprobs);
    in.advantages = rows_of(spec_.advantages);
    in.reference_logprobs = rows_of(spec_.reference_logprobs);
    in.logprob_grads = rows_of(spec_.logprob_grads);
    in.reduction_scales = rows_of(spec_.reduction_scales);
    if (spec_.options.policy.sequence_ratio) {  // the chunk holds whole sequences (chunk_ends_)
      const absl::Span<const int64_t> sequences = ratio_sequences_.Take(rows);
      in.ratio_sequence_lengths = sequences.data();
      in.num_ratio_sequences = static_cast<int64_t>(sequences.size());
    }
    if (spec_.teacher != nullptr) {
      in.teacher.hidden = chunk.side_rows[0];
      in.teacher.hidden_dtype = spec_.teacher_hidden_dtype;
      in.teacher.hidden_size = spec_.teacher_hidden_size;
    } else if (spec_.teacher_top_k > 0) {
      in.teacher.top_k = spec_.teacher_top_k;
      in.teacher.top_k_tokens = static_cast<const int32_t*>(chunk.side_rows[0]);
      in.teacher.top_k_logprobs = static_cast<const float*>(chunk.side_rows[1]);
      // Named by the call's rows; the engine would name them by the chunk's.
      const absl::Status valid = ValidateSparseTeacher(in.teacher, rows, spec_.head->vocab_size(),
                                                       spec_.options, in.labels, first);
      if (!valid.ok()) {
        return absl::Status(valid.code(), absl::StrCat("chunk.", valid.message()));
      }
    }
    uint8_t* grad_hidden = nullptr;
    if (spec_.outputs.grad_hidden()) {
      grad_hidden = spec_.shared_memory.has_value()
                        ? shared_memory_.grad_hidden() + first * spec_.grad_row_bytes()
                        : MessageGradHidden(computed_chunks_);
    }
    const TokenOutputs out =
        outputs_.Bind(spec_.outputs, rows, grad_hidden, spec_.grad_hidden_dtype);

    LossOptions options = spec_.options;
    options.overwrite_grad_weight = first == 0;
    ASSIGN_OR_RETURN(
        const BatchSummary summary,
        RunEngine(chunk, in, options, out, staging_.held() ? &staging_.buffer() : nullptr));
    loss_sum_ += summary.loss_sum;
    sequence_loss_ += summary.loss;
    kd_sum_ += summary.kd_sum;
    ce_sum_ += summary.ce_sum;
    clipped_tokens_ += summary.clipped_tokens;
    kl_sum_ += summary.kl_sum;
    correct_tokens_ += summary.correct_tokens;
    grad_weight_bound_ += summary.grad_weight_bound;
    peak_workspace_bytes_ = std::max(peak_workspace_bytes_, summary.workspace_bytes);
    QueueResults(first, rows);
    last_message_of_chunk_[computed_chunks_ % 2] = writer_->queued();
    ++computed_chunks_;
    computed_rows_ += rows;
    return absl::OkStatus();
  }

  // Runs fn with the student's W and a teacher head's (null without one), each under its shared
  // lock and at the version the call took. Two heads are locked in the order of their names, so
  // that calls with two heads in opposite roles cannot wait for each other behind a Step; a head
  // that is its own teacher is locked once.
  absl::Status WithHeads(absl::FunctionRef<absl::Status(const WeightView&, const WeightView*)> fn) {
    Head& student = *spec_.head;
    if (spec_.teacher == nullptr) {
      return student.WithWeights(spec_.version,
                                 [&](const WeightView& w) { return fn(w, nullptr); });
    }
    Head& teacher = *spec_.teacher;
    if (&teacher == &student) {
      if (spec_.teacher_version != spec_.version) {
        return absl::AbortedError(
            absl::StrCat("head '", student.name(), "' moved between its two reads of the call"));
      }
      return student.WithWeights(spec_.version, [&](const WeightView& w) { return fn(w, &w); });
    }
    const bool student_first = student.name() < teacher.name();
    Head& outer = student_first ? student : teacher;
    Head& inner = student_first ? teacher : student;
    return outer.WithWeights(
        student_first ? spec_.version : spec_.teacher_version, [&](const WeightView& a) {
          return inner.WithWeights(
              student_first ? spec_.teacher_version : spec_.version,
              [&](const WeightView& b) { return student_first ? fn(a, &b) : fn(b, &a); });
        });
  }

  // Runs only once a chunk's results were not finite, and says why: a NaN or Inf in its rows,
  // else what in the call overflowed fp32, else the logits themselves (W enters the server
  // finite, so only an optimizer step can have made it otherwise).
  absl::Status ExplainNonFiniteChunk(const RowChunk& chunk) {
    const int64_t first = chunk.first_row;
    const int64_t rows = chunk.num_rows;
    const int64_t columns = spec_.hidden_size;
    const std::string which = absl::StrCat("rows [", first, ", ", first + rows, ")");
    absl::Status finite =
        ValidateFiniteMatrix("chunk.hidden", chunk.rows, spec_.hidden_dtype, rows, columns, first);
    if (finite.ok() && spec_.teacher != nullptr) {
      finite =
          ValidateFiniteMatrix("chunk.teacher_hidden", chunk.side_rows[0],
                               spec_.teacher_hidden_dtype, rows, spec_.teacher_hidden_size, first);
    }
    if (!finite.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          finite.message(), " (", which, " give non-finite results); nothing was accumulated"));
    }
    const std::vector<std::string> suspects = OverflowSuspects(spec_, first, rows, false);
    if (!suspects.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(absl::StrJoin(suspects, ", "), ": ", which,
                       " of chunk.hidden are finite, but their results overflow fp32 under this; "
                       "nothing was accumulated"));
    }
    const auto largest_of = [rows](const void* data, DType dtype, int64_t columns) {
      std::pair<float, int64_t> largest{0.0f, 0};
      for (int64_t i = 0; i < rows * columns; ++i) {
        const float magnitude = std::fabs(LoadAsFloat(data, dtype, i));
        if (magnitude > largest.first) largest = {magnitude, i};
      }
      return largest;
    };
    const auto [largest, largest_at] = largest_of(chunk.rows, spec_.hidden_dtype, columns);
    if (spec_.teacher != nullptr) {
      // The teacher's logits overflow as the student's do: blame the larger rows.
      const int64_t teacher_columns = spec_.teacher_hidden_size;
      const auto [teacher_largest, teacher_at] =
          largest_of(chunk.side_rows[0], spec_.teacher_hidden_dtype, teacher_columns);
      if (teacher_largest > largest) {
        return absl::InvalidArgumentError(absl::StrCat(
            "chunk.teacher_hidden: ", which,
            " are finite, but the teacher's logits overflow fp32 "
            "(the largest |h| of the teacher's rows is ",
            teacher_largest, ", at chunk.teacher_hidden[", first + teacher_at / teacher_columns,
            ", ", teacher_at % teacher_columns, "]); nothing was accumulated"));
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("chunk.hidden: ", which,
                     " are finite, but their logits h W^T overflow fp32 (the largest "
                     "|h| is ",
                     largest, ", at chunk.hidden[", first + largest_at / columns, ", ",
                     largest_at % columns, "]); nothing was accumulated"));
  }

  // Finite logits do not make dL/dW finite: under a soft cap an infinite hidden value gives capped
  // logits but 0 * Inf = NaN in dL/dW, and a huge grad_scale overflows it, alone or added to the
  // accumulator. The head checks both, with the engine's bound sparing it the reading of V x H
  // floats where that bound proves them finite.
  absl::StatusOr<CommitOutcome> CommitGradient() {
    StagedGradient staged;
    staged.version = spec_.version;
    staged.buffer = &staging_.buffer();
    staged.tokens = spec_.counted_tokens;
    staged.rows = spec_.num_tokens;
    staged.bound = grad_weight_bound_;
    staged.call_id = spec_.call_id;
    staged.start_fingerprint = spec_.start_fingerprint;
    staged.loss_sum = loss_sum_;
    if (spec_.stage_grad_weight) {
      ASSIGN_OR_RETURN(const CommitOutcome outcome,
                       spec_.head->StageGradient(staged, staging_.buffer(), *env_.staging_room,
                                                 absl::Now() + env_.limits.staged_grad_ttl,
                                                 env_.limits.max_call_ids));
      // No room: commit as a call that does not stage; the client's backward corrects for its
      // upstream gradient, as the summary tells it.
      if (outcome != CommitOutcome::kNoRoom) return outcome;
    }
    absl::StatusOr<CommitOutcome> outcome =
        spec_.head->CommitGradient(staged, env_.limits.max_call_ids);
    // INVALID_ARGUMENT: this call's own dL/dW is not finite, which its options and weights explain
    // (FAILED_PRECONDITION: it would overflow the accumulator, which the head's message explains).
    if (!outcome.ok() && IsNonFiniteGradient(outcome.status()) &&
        outcome.status().code() == absl::StatusCode::kInvalidArgument) {
      outcome = ExplainNonFiniteGradient(outcome.status());
    }
    if (env_.metrics != nullptr) {
      if (!outcome.ok() && IsNonFiniteGradient(outcome.status())) {
        env_.metrics->CountNonFiniteCall();
      }
      if (outcome.ok() && *outcome == CommitOutcome::kReplayed) env_.metrics->CountReplayedCall();
    }
    return outcome;
  }

  // Why this call's own dL/dW is not finite, from what is left once its rows are gone: its options
  // and weights. Keeps the head's typed reason.
  absl::Status ExplainNonFiniteGradient(absl::Status status) const {
    std::vector<std::string> causes = OverflowSuspects(spec_, 0, spec_.num_tokens, true);
    if (spec_.options.logit_softcap > 0.0) {
      causes.push_back(absl::StrCat(
          "an Inf in chunk.hidden under options.logit_softcap = ", spec_.options.logit_softcap,
          " (the cap keeps its logits finite, not its dL/dW)"));
    }
    if (causes.empty()) {
      causes.push_back("hidden values in chunk.hidden large enough to overflow it");
    }
    return WithPayloadsOf(absl::InvalidArgumentError(absl::StrCat(
                              "this call's dL/dW has non-finite values in fp32, from ",
                              absl::StrJoin(causes, ", or "), "; nothing was accumulated")),
                          status);
  }

  // Queues the chunk's results, in messages of at most max_result_message_bytes (or less, where
  // the stream asks for less); its dL/dh is borrowed from MessageGradHidden until they have left.
  void QueueResults(int64_t first, int64_t rows) {
    const v1::OutputSelection& want = spec_.outputs;
    const int k = want.top_k();
    const bool grad_in_messages = want.grad_hidden() && !spec_.shared_memory.has_value();
    const int64_t grad_row_bytes = grad_in_messages ? spec_.grad_row_bytes() : 0;
    const int64_t row_bytes = grad_row_bytes + 4 * (kOneValueOutputs + 2 * k) + 16;
    const int64_t rows_per_message = std::max<int64_t>(
        1, stream_.ResultMessageBytes(env_.limits.max_result_message_bytes) / row_bytes);
    for (int64_t r0 = 0; r0 < rows; r0 += rows_per_message) {
      const int64_t n = std::min(rows_per_message, rows - r0);
      std::unique_ptr<v1::ComputeResponse> message = writer_->NewMessage();
      v1::ComputeResult& result = *message->mutable_result();
      result.set_row_offset(first + r0);
      result.set_num_rows(n);
      auto copy = [&](const auto& source, int64_t per_row, auto* target) {
        if (!source.empty()) {
          target->Add(source.begin() + r0 * per_row, source.begin() + (r0 + n) * per_row);
        }
      };
#define LOSSD_COPY_TOKEN_OUTPUT(type, name) copy(outputs_.name, 1, result.mutable_##name());
      LOSSD_TOKEN_OUTPUTS(LOSSD_COPY_TOKEN_OUTPUT)
#undef LOSSD_COPY_TOKEN_OUTPUT
      copy(outputs_.top_k_logprob, k, result.mutable_top_k_logprob());
      copy(outputs_.top_k_token, k, result.mutable_top_k_token());
      absl::string_view grad_hidden;
      if (grad_in_messages) {
        grad_hidden =
            absl::string_view(reinterpret_cast<const char*>(MessageGradHidden(computed_chunks_) +
                                                            r0 * grad_row_bytes),
                              static_cast<size_t>(n * grad_row_bytes));
        result.set_grad_hidden_dtype(ToProto(spec_.grad_hidden_dtype));
      }
      writer_->Queue(std::move(message), grad_hidden);
    }
  }

  absl::Status SendSummary() {
    v1::ComputeResponse response;
    v1::ComputeSummary& s = *response.mutable_summary();
    s.set_loss(IsSequenceReduction(spec_.options.reduction)
                   ? sequence_loss_
                   : ReducedLoss(spec_.options, loss_sum_, spec_.counted_tokens));
    s.set_loss_sum(loss_sum_);
    s.set_counted_tokens(spec_.counted_tokens);
    s.set_correct_tokens(correct_tokens_);
    s.set_head_version(spec_.version);
    const bool staged = commit_ == CommitOutcome::kStaged;
    s.set_grad_weight_accumulated(accumulated_ && !staged);
    s.set_grad_weight_staged(accumulated_ && staged);
    s.set_replayed(accumulated_ && commit_ == CommitOutcome::kReplayed);
    s.set_queue_seconds(queue_seconds_);
    s.set_compute_seconds(compute_seconds_);
    s.set_peak_workspace_bytes(peak_workspace_bytes_);
    s.set_backend(std::string(env_.backend->kind()));
    s.set_clipped_tokens(clipped_tokens_);
    const double counted = static_cast<double>(spec_.counted_tokens);
    s.set_clip_fraction(counted > 0 ? static_cast<double>(clipped_tokens_) / counted : 0.0);
    s.set_mean_kl(counted > 0 ? kl_sum_ / counted : 0.0);
    s.set_mean_kd(counted > 0 ? kd_sum_ / counted : 0.0);
    s.set_mean_ce(counted > 0 ? ce_sum_ / counted : 0.0);
    s.set_mean_rollout_is_weight(spec_.mean_rollout_is_weight);
    s.set_rollout_is_truncated_fraction(spec_.rollout_is_truncated_fraction);
    if (spec_.teacher != nullptr) s.set_teacher_head_version(spec_.teacher_version);
    return Send(response);
  }

  absl::Status Send(const v1::ComputeResponse& response,
                    const wire::BulkBytes& grad_hidden = wire::BulkBytes()) {
    const bool written =
        stream_.WriteOrStall(response, grad_hidden, [this] { (void)PauseWhileWaiting(); });
    RETURN_IF_ERROR(ResumeIfPaused());
    if (!written) {
      return absl::CancelledError(
          "client went away while results were sent; nothing was accumulated");
    }
    if (env_.metrics != nullptr)
      env_.metrics->AddBytesSent(static_cast<int64_t>(response.ByteSizeLong()) +
                                 grad_hidden.size());
    return absl::OkStatus();
  }

  void Account() {
    if (env_.metrics == nullptr) return;
    const bool training = spec_.outputs.grad_hidden() || spec_.outputs.accumulate_grad_weight();
    env_.metrics->AddTokens(training ? "train" : "score", spec_.num_tokens);
    // A dense teacher's logits are avoided as well.
    const int64_t heads = spec_.teacher != nullptr ? 2 : 1;
    env_.metrics->AddLogitsBytesAvoided(heads * spec_.num_tokens * spec_.head->vocab_size() *
                                        static_cast<int64_t>(sizeof(float)));
  }

  const ComputeEnvironment& env_;
  ComputeStream& stream_;
  CallSpec spec_;
  PendingCharge pending_;  // host memory held until admission
  ProblemShape shape_;
  ChunkPlan plan_;
  // The engine chunks' end rows: every plan_.token_chunk rows, or for a gspo call in one pass,
  // cut at sequence ends.
  std::vector<int64_t> chunk_ends_;
  bool measure_ratios_first_ = false;  // gspo in two passes: a sequence outgrows an engine chunk
  SequenceCursor ratio_sequences_;     // the sequences of the next chunk, in one pass
  size_t staging_bytes_ = 0;
  int64_t admitted_bytes_ = 0;
  Admission admission_;
  BufferLease workspace_;
  BufferLease staging_;
  std::array<BufferLease, 2> message_grad_hidden_;  // host memory (MessageGradHidden)
  BufferLease shared_rows_copy_;  // host memory: one engine chunk of rows out of shared memory
  ChunkOutputs outputs_;
  SharedCallMemory shared_memory_;
  std::unique_ptr<RowReader> reader_;  // rows from messages
  // After the buffers its messages borrow from, so that it stops first.
  std::unique_ptr<ResultWriter> writer_;
  // The number of the last result message of the last chunk computed into each dL/dh buffer.
  std::array<int64_t, 2> last_message_of_chunk_{};
  int64_t computed_chunks_ = 0;
  int64_t computed_rows_ = 0;
  double loss_sum_ = 0.0;
  double sequence_loss_ = 0.0;  // with a sequence reduction: the reduced loss, chunk by chunk
  int64_t clipped_tokens_ = 0;
  double kl_sum_ = 0.0;
  double kd_sum_ = 0.0;
  double ce_sum_ = 0.0;
  int64_t correct_tokens_ = 0;
  double grad_weight_bound_ = 0.0;  // on |this call's dL/dW|, summed over engine chunks
  CommitOutcome commit_ = CommitOutcome::kCommitted;  // of a call that accumulates
  bool accumulated_ = false;                          // dL/dW was committed (or replayed)
  int64_t peak_workspace_bytes_ = 0;
  double queue_seconds_ = 0.0;
  double compute_seconds_ = 0.0;
};

}  // namespace

absl::Status RunComputeCall(const ComputeEnvironment& env, ComputeStream& stream) {
  return ComputeCall(env, stream).Run();
}

}  // namespace lossd::server
