// The checks of a Compute call's inputs, each naming the field at fault, and the reductions'
// per-row factors: what the server runs on a request before any backend sees it, and every
// backend again on the call. Host code only. What backends alone share (planning, carving the
// workspace, finishing rows) is kernels/backend_impl.h.
#ifndef LOSSD_KERNELS_BACKEND_COMMON_H_
#define LOSSD_KERNELS_BACKEND_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/distill_math.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/kernels/types.h"

namespace lossd {

// Checks every field of a Compute call and names the first bad one with what was expected.
// Labels are checked too: any label outside [0, V) that is not ignore_index is rejected.
absl::Status ValidateCall(const BatchInputs& inputs, const WeightView& weight,
                          const LossOptions& options, const TokenOutputs& outputs,
                          const DeviceBuffer* grad_weight);
absl::Status ValidateOptions(const LossOptions& options);
// Labels in [0, vocab_size) or ignore_index; weights finite. `first_index` offsets the reported
// position for callers that check a slice of a larger batch.
absl::Status ValidateLabels(const int64_t* labels, int64_t count, int64_t vocab_size,
                            int64_t ignore_index, int64_t first_index = 0);
absl::Status ValidateTokenWeights(const float* weights, int64_t count, int64_t first_index = 0);
// OK when every element of the row-major [rows, cols] matrix `data`, stored in `dtype`, is finite;
// else INVALID_ARGUMENT naming the first Inf or NaN as `field`[first_row + r, c]. Reads the raw
// bits (an exponent of all ones), so it costs one pass over memory even at V x H of a large head.
// A logit soft cap: 0 (off) or a positive normal fp32 number (a cap of 1e-300 would round to 0
// in fp32 and turn capping off, one of 1e39 to Inf). Wherever a head's cap comes from
// (config.json, an upload, a checkpoint), a call that leaves its own unset is capped with it.
absl::Status ValidateSoftcap(absl::string_view field, double value);

absl::Status ValidateFiniteMatrix(absl::string_view field, const void* data, DType dtype,
                                  int64_t rows, int64_t cols, int64_t first_row = 0);

// The per-token inputs the call's objective and terms read (types.h, BatchInputs): present, and
// finite on rows that are not ignored; with a sequence reduction, its per-row factors.
absl::Status ValidateObjectiveInputs(const BatchInputs& inputs, const LossOptions& options,
                                     int64_t first_index = 0);

// The distill options a sparse teacher allows: no teacher soft cap or temperature (its
// log-probabilities are final), no reverse KL against a renormalized top-k, temperature 1 with a
// tail bucket. Fields are named with `prefix` ("distill.", "options.distill.").
absl::Status ValidateSparseTeacherOptions(const DistillOptions& options, absl::string_view prefix);

// A sparse teacher's rows [0, count) (TeacherInputs): token ids in [0, vocab_size), distinct within
// a row, finite log-probabilities <= 0 whose probabilities sum to at most 1 + 1e-3 (rounding in
// the cached values), on every row, ignored or not; with the spread mass or a tail bucket and the
// reverse KL, some mass left outside the top-k on every counted row. Named as
// "<field>[first_index + r, j]".
absl::Status ValidateSparseTeacher(const TeacherInputs& teacher, int64_t count, int64_t vocab_size,
                                   const LossOptions& options, const int64_t* labels,
                                   int64_t first_index = 0);

// OK when sequence_lengths[0 .. num_sequences) are each >= 1 and sum to num_tokens (no lengths:
// OK, whatever num_tokens). INVALID_ARGUMENT names the first length at fault.
absl::Status ValidateSequenceLengths(const int64_t* sequence_lengths, int64_t num_sequences,
                                     int64_t num_tokens,
                                     absl::string_view field = "sequence_lengths");

// The end rows of a batch's token chunks of at most chunk_rows rows each, in order, the last one
// num_tokens: every chunk_rows rows, or given the batch's sequences (valid lengths), as many whole
// sequences as fit in each chunk, so that no sequence is split (what a chunk that finishes a
// sequence's rows together needs: PolicyOptions::sequence_ratio). A sequence longer than
// chunk_rows is a chunk of its own; the caller checks with LongestSequence first.
std::vector<int64_t> TokenChunkEnds(int64_t num_tokens, int64_t chunk_rows,
                                    const int64_t* sequence_lengths = nullptr,
                                    int64_t num_sequences = 0);
// The longest of the lengths (0 when there are none).
int64_t LongestSequence(const int64_t* sequence_lengths, int64_t num_sequences);

// A batch's sequences taken chunk by chunk, in order, where each chunk holds whole sequences
// (TokenChunkEnds with the sequences): Take(rows) gives the lengths of those that make up the next
// `rows` rows.
class SequenceCursor {
 public:
  explicit SequenceCursor(const int64_t* sequence_lengths = nullptr) : lengths_(sequence_lengths) {}
  absl::Span<const int64_t> Take(int64_t rows) {
    const size_t first = next_;
    for (int64_t covered = 0; covered < rows;) covered += lengths_[next_++];
    return absl::Span<const int64_t>(lengths_ + first, next_ - first);
  }

 private:
  const int64_t* lengths_;
  size_t next_ = 0;
};

// Next-token labels, as a causal LM's loss takes them: within each sequence (valid lengths; none:
// all rows are one) labels[i] <- labels[i + 1], and the last row of each gets ignore_index.
void ShiftLabelsWithinSequences(int64_t* labels, int64_t num_tokens,
                                const int64_t* sequence_lengths, int64_t num_sequences,
                                int64_t ignore_index);

// Each row's factor in a sequence reduction (verl's agg_loss "seq-mean-token-sum" and
// "seq-mean-token-mean") of a batch made of sequences of the given lengths, one after another:
// 1 / S or 1 / (S L_s), with L_s the non-ignored rows of the row's sequence and S the sequences
// with at least one (fully ignored sequences are left out), or options.mean_denominator when > 0
// (the whole batch's S, for a batch that is one slice of it). Ignored rows get 0. The lengths must
// be >= 1 and sum to num_tokens.
absl::StatusOr<std::vector<double>> SequenceReductionScales(const LossOptions& options,
                                                            const int64_t* labels,
                                                            int64_t num_tokens,
                                                            const int64_t* sequence_lengths,
                                                            int64_t num_sequences);

// Rows whose label is not ignore_index; every row without labels (null).
int64_t CountCountedRows(const int64_t* labels, int64_t num_tokens, int64_t ignore_index);

}  // namespace lossd

#endif  // LOSSD_KERNELS_BACKEND_COMMON_H_
