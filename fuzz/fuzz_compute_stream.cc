// Compute calls driven by untrusted streams, against a real CPU backend and a tiny head, without
// gRPC. Whatever the client sends, and however the stream ends, a call must return a status and:
// - leave the head's gradient accumulator exactly as it was unless the status is OK (the
//   all-or-nothing contract of OutputSelection.accumulate_grad_weight);
// - give back its workspace, staging gradient and scheduler slot;
// - when OK, have streamed results for rows 0..num_tokens-1 in order, then one summary, and leave a
//   finite accumulator.
//
// Input layout (kScriptHeaderBytes, then records):
//   [0] Read index from which the client has cancelled (Read fails, IsCancelled is true); 255:
//   never [1] Read index just before which the head is replaced by an upload (Head::Retire); 255:
//   never [2] Write index from which writes fail, as when the client has gone away; 255: never [3]
//   workspace budget in units of kBudgetUnitBytes, plus one [4] result message limit in units of
//   kResultUnitBytes, plus one [5] dtype of the head's W: 0 float32, 1 bfloat16, 2 float16 (modulo
//   3) records: a little-endian uint16 length, then that many bytes of a serialized ComputeRequest
//   (the last record may be cut short). Records that do not parse are dropped, as gRPC never
//   delivers them.
//
// Run it with OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 (scripts/fuzz.sh does): one input at a time
// gains nothing from thread pools, and their scheduling would make coverage less repeatable.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/time/time.h"
#include "lossd/kernels/backend.h"
#include "lossd/v1/lossd.pb.h"
#include "proto/wire/compute_frames.h"
#include "server/call/compute_call.h"
#include "server/heads/head_store.h"
#include "server/memory/memory_ledger.h"
#include "server/memory/scheduler.h"

namespace lossd::server {
namespace {

constexpr char kHeadName[] = "h";
constexpr int64_t kVocabSize = 64;
constexpr int64_t kHiddenSize = 8;
// Small enough that most inputs are refused or cheap, large enough for several engine chunks.
constexpr int64_t kMaxTokensPerCall = 64;
constexpr size_t kScriptHeaderBytes = 6;
constexpr size_t kBudgetUnitBytes = 128;
constexpr int64_t kResultUnitBytes = 16;
constexpr uint8_t kNeverByte = 255;

void Require(bool holds, const char* contract) {
  if (holds) return;
  std::fprintf(stderr, "fuzz_compute_stream: violated: %s\n", contract);
  std::abort();
}

// An index of the script header, where kNeverByte means no index at all.
int IndexOrNever(uint8_t byte) {
  return byte == kNeverByte ? std::numeric_limits<int>::max() : byte;
}

struct Script {
  int cancel_from_read = 0;
  int retire_before_read = 0;
  int fail_from_write = 0;
  size_t workspace_budget_bytes = 0;
  int64_t result_message_bytes = 0;
  DType head_dtype = DType::kFloat32;
  std::vector<wire::ComputeRequestFrame> requests;
};

// The message as the server's stream decodes it (wire::ComputeRequestFrame), which must accept
// only what protobuf parses and find the rows protobuf finds.
bool DecodeLikeProtobuf(const uint8_t* data, size_t length, wire::ComputeRequestFrame* frame) {
  grpc::Slice slice(data, length);
  const bool decoded = frame->Decode(grpc::ByteBuffer(&slice, 1)).ok();
  v1::ComputeRequest parsed;
  const bool protobuf_parses = parsed.ParseFromArray(data, static_cast<int>(length));
  if (!decoded) return false;
  Require(protobuf_parses, "the wire decoder accepts only what protobuf parses");
  const v1::ComputeChunk& chunk = parsed.chunk();
  Require(
      frame->rows[wire::kHiddenRows].ToString() == chunk.hidden() &&
          frame->rows[wire::kTeacherHiddenRows].ToString() == chunk.teacher_hidden() &&
          frame->rows[wire::kTeacherTopKTokenRows].ToString() == chunk.teacher_top_k_tokens() &&
          frame->rows[wire::kTeacherTopKLogprobRows].ToString() == chunk.teacher_top_k_logprobs(),
      "the wire decoder finds the rows protobuf finds");
  return true;
}

bool ParseScript(const uint8_t* data, size_t size, Script* script) {
  if (size < kScriptHeaderBytes) return false;
  script->cancel_from_read = IndexOrNever(data[0]);
  script->retire_before_read = IndexOrNever(data[1]);
  script->fail_from_write = IndexOrNever(data[2]);
  script->workspace_budget_bytes = (data[3] + size_t{1}) * kBudgetUnitBytes;
  script->result_message_bytes = (data[4] + int64_t{1}) * kResultUnitBytes;
  constexpr DType kHeadDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  script->head_dtype = kHeadDTypes[data[5] % 3];
  size_t cursor = kScriptHeaderBytes;
  while (cursor + 2 <= size) {
    const size_t length =
        std::min<size_t>(data[cursor] | (data[cursor + 1] << 8), size - cursor - 2);
    cursor += 2;
    wire::ComputeRequestFrame request;
    if (DecodeLikeProtobuf(data + cursor, length, &request)) {
      script->requests.push_back(std::move(request));
    }
    cursor += length;
  }
  return true;
}

// The client side of one call, as the script says.
class ScriptedStream : public ComputeStream {
 public:
  ScriptedStream(const Script& script, Head& head) : script_(script), head_(head) {}

  bool Read(wire::ComputeRequestFrame* request) override {
    const int index = reads_++;
    if (index == script_.retire_before_read) head_.Retire();
    if (index >= script_.cancel_from_read) cancelled_ = true;
    if (cancelled_ || next_request_ == script_.requests.size()) return false;
    *request = script_.requests[next_request_++];
    return true;
  }

  bool Write(const v1::ComputeResponse& response, const wire::BulkBytes& grad_hidden) override {
    if (writes_++ >= script_.fail_from_write) {
      client_left_ = true;
      cancelled_ = true;  // a client that went away has also cancelled the call
      return false;
    }
    responses_.push_back(response);
    if (!grad_hidden.empty())
      responses_.back().mutable_result()->set_grad_hidden(grad_hidden.ToString());
    return true;
  }

  bool IsCancelled() const override { return cancelled_; }
  // The call ended its stream: the scripted client gets nothing more through.
  void End(const absl::Status&) override { cancelled_ = true; }
  // Shared memory names another process's descriptors; its checks are exercised end to end.
  bool PeerIsLocal() const override { return false; }

  const std::vector<v1::ComputeResponse>& responses() const { return responses_; }
  bool client_left() const { return client_left_; }

 private:
  const Script& script_;
  Head& head_;
  int reads_ = 0;
  int writes_ = 0;
  size_t next_request_ = 0;
  std::atomic<bool> cancelled_ = false;  // set by reads and writes, on different threads
  bool client_left_ = false;
  std::vector<v1::ComputeResponse> responses_;
};

// Checks what an OK call streamed back against what its start message asked for. A client that
// left at the summary got every result but not the summary.
void CheckSuccessfulResponses(const v1::ComputeStart& start,
                              const std::vector<v1::ComputeResponse>& responses, bool client_left) {
  if (client_left) {
    Require(start.outputs().accumulate_grad_weight(),
            "a call succeeds without its summary delivered only once its dL/dW is committed");
  } else {
    Require(!responses.empty() && responses.back().has_summary(),
            "an OK call ends with its summary");
  }
  const size_t result_count = client_left ? responses.size() : responses.size() - 1;
  const v1::OutputSelection& want = start.outputs();
  const v1::DType grad_dtype = want.grad_hidden_dtype() == v1::DTYPE_UNSPECIFIED
                                   ? start.hidden_dtype()
                                   : want.grad_hidden_dtype();
  const int64_t grad_row_bytes =
      want.grad_hidden() ? kHiddenSize * (grad_dtype == v1::DTYPE_FLOAT32 ? 4 : 2) : 0;
  int64_t next_row = 0;
  for (size_t i = 0; i < result_count; ++i) {
    Require(responses[i].has_result(), "only the last message is a summary");
    const v1::ComputeResult& result = responses[i].result();
    const int64_t rows = result.num_rows();
    Require(result.row_offset() == next_row && rows > 0, "results cover the rows in order, once");
    next_row += rows;
    auto expect = [rows](bool wanted, int size, int64_t per_row, const char* contract) {
      Require(size == (wanted ? rows * per_row : 0), contract);
    };
    expect(want.token_loss(), result.token_loss_size(), 1,
           "token_loss: one per row when asked for");
    expect(want.logprob(), result.logprob_size(), 1, "logprob: one per row when asked for");
    expect(want.lse(), result.lse_size(), 1, "lse: one per row when asked for");
    expect(want.entropy(), result.entropy_size(), 1, "entropy: one per row when asked for");
    expect(want.argmax(), result.argmax_size(), 1, "argmax: one per row when asked for");
    expect(want.top_k() > 0, result.top_k_token_size(), want.top_k(), "top_k_token: k per row");
    expect(want.top_k() > 0, result.top_k_logprob_size(), want.top_k(), "top_k_logprob: k per row");
    Require(static_cast<int64_t>(result.grad_hidden().size()) == rows * grad_row_bytes,
            "grad_hidden: one row of the asked dtype per row");
    for (const int32_t token : result.argmax()) {
      Require(token >= 0 && token < kVocabSize, "argmax is a token of the vocabulary");
    }
    for (const int32_t token : result.top_k_token()) {
      Require(token >= 0 && token < kVocabSize, "top-k tokens are tokens of the vocabulary");
    }
  }
  Require(next_row == start.num_tokens(), "results cover every row");
  if (!client_left) {
    Require(responses.back().summary().grad_weight_accumulated() == want.accumulate_grad_weight(),
            "the summary tells whether dL/dW was accumulated, as asked");
  }
}

// One backend for the whole run: creating it queries OpenBLAS and the OpenMP runtime.
Backend& CpuBackend() {
  static Backend* const backend = [] {
    auto created = CreateBackend("cpu");
    Require(created.ok(), "the CPU backend starts");
    return created->release();
  }();
  return *backend;
}

void RunOne(const Script& script) {
  Backend& backend = CpuBackend();
  // Fresh server state per input, so that every finding reproduces from its input alone.
  MemoryLedger ledger;
  auto created = Head::Create(
      backend, ledger,
      MakeDemoHead(kHeadName, kVocabSize, kHiddenSize, script.head_dtype, /*seed=*/1), "fuzz");
  Require(created.ok(), "the head is created");
  std::shared_ptr<Head> head = *created;
  // Before the heads, which give their staged dL/dW's room back to it as they go.
  StagingRoom staging_room(/*capacity_bytes=*/int64_t{1} << 30);
  HeadStore heads;
  Require(heads.Put(head, /*replace=*/false).ok(), "the head is stored");
  Scheduler scheduler(/*capacity_bytes=*/int64_t{1} << 30, /*max_running=*/1, /*max_queued=*/0);
  PendingMemory pending(/*capacity_bytes=*/int64_t{1} << 30,
                        /*per_connection_bytes=*/int64_t{1} << 30);

  ComputeLimits limits;
  limits.workspace_budget_bytes = script.workspace_budget_bytes;
  limits.max_tokens_per_call = kMaxTokensPerCall;
  limits.max_result_message_bytes = script.result_message_bytes;
  limits.max_admission_wait = absl::ZeroDuration();
  BufferCache buffers(backend, ledger, scheduler.capacity_bytes());
  HostAllocator host;
  MemoryLedger host_ledger;
  BufferCache host_buffers(host, host_ledger, /*capacity_bytes=*/0);
  static SharedMemoryMaps shared_memory_maps;  // never reached: the scripted peer is not local
  const ComputeEnvironment env{&backend, &heads,        &scheduler,    /*metrics=*/nullptr,
                               &ledger,  &buffers,      &host_buffers, &shared_memory_maps,
                               &pending, &staging_room, limits};

  const auto grad_before = head->ReadGradient(DType::kFloat32);
  Require(grad_before.ok(), "the gradient reads before the call");
  const HeadSummary before = head->Summary();
  const int64_t gradient_bytes_before = ledger.current(MemoryPurpose::kGradients);

  ScriptedStream stream(script, *head);
  const absl::Status status = RunComputeCall(env, stream);

  const HeadSummary after = head->Summary();
  Require(ledger.current(MemoryPurpose::kWorkspace) == 0, "the call's workspace is released");
  // The head is fresh, so a call that accumulates keeps its staging buffer as the accumulator.
  const bool accumulated = after.accumulated_calls > before.accumulated_calls;
  const int64_t accumulator_bytes = kVocabSize * kHiddenSize * static_cast<int64_t>(sizeof(float));
  Require(ledger.current(MemoryPurpose::kGradients) ==
              gradient_bytes_before + (accumulated ? accumulator_bytes : 0),
          "the call's staging gradient is released or kept as the accumulator");
  Require(scheduler.running() == 0 && scheduler.queued() == 0 && scheduler.admitted_bytes() == 0,
          "the call leaves the scheduler");
  Require(pending.held_bytes() == 0, "the call holds no pending host memory once it ended");
  Require(ledger.current(MemoryPurpose::kCache) == buffers.idle_bytes(),
          "the call's buffers are back in the cache, charged to it");

  const auto grad_after = head->ReadGradient(DType::kFloat32);
  Require(grad_after.ok(), "the gradient reads after the call");
  if (!status.ok()) {
    Require(grad_after->data == grad_before->data, "a failed call leaves the gradient bit for bit");
    Require(after.accumulated_tokens == before.accumulated_tokens &&
                after.accumulated_calls == before.accumulated_calls,
            "a failed call leaves the accumulated counts");
    return;
  }
  const v1::ComputeStart& start = script.requests.front().message.start();
  CheckSuccessfulResponses(start, stream.responses(), stream.client_left());
  Require(after.accumulated_calls ==
              before.accumulated_calls + (start.outputs().accumulate_grad_weight() ? 1 : 0),
          "an OK call accumulates exactly when asked");
  const std::vector<uint8_t>& grad = grad_after->data;
  for (size_t i = 0; i < grad.size(); i += sizeof(float)) {
    float value;
    std::memcpy(&value, grad.data() + i, sizeof value);
    Require(std::isfinite(value), "an OK call leaves a finite accumulator");
  }
}

}  // namespace
}  // namespace lossd::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lossd::server::Script script;
  if (lossd::server::ParseScript(data, size, &script)) lossd::server::RunOne(script);
  return 0;
}
