// How a Compute call's per-token results are put together from the result messages that carry
// them, derived from the wire contract's descriptors rather than written out field by field: by
// the rule in lossd.proto (ComputeResult), a repeated field of ComputeResult is filled when
// OutputSelection's field of the same name is set, with one value per row, and the fields named
// top_k_* with OutputSelection.top_k values per row. A per-token output added to the contract is
// then assembled and checked by the client as it is, with no code of its own.
#ifndef LOSSD_CLIENT_CPP_RESULT_ASSEMBLER_H_
#define LOSSD_CLIENT_CPP_RESULT_ASSEMBLER_H_

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lossd::client {

// The server broke the wire contract; the call's data cannot be trusted (INTERNAL).
absl::Status ServerViolation(absl::string_view what);

// Which rows of a result have arrived, so that results streamed in any order are each placed once
// and a missing or repeated row is an error rather than silently zero.
class RowCoverage {
 public:
  explicit RowCoverage(int64_t rows) : seen_(static_cast<size_t>(rows), false) {}

  // Marks rows [offset, offset + count); a range outside the result, or a row marked before, is a
  // ServerViolation.
  absl::Status Mark(int64_t offset, int64_t count);

  bool complete() const { return covered_ == static_cast<int64_t>(seen_.size()); }
  int64_t covered() const { return covered_; }

 private:
  std::vector<bool> seen_;
  int64_t covered_ = 0;
};

// A repeated field of the result message and how many values each row brings in it: 0 for an
// output not asked for, which every message must leave empty.
struct PerTokenField {
  const google::protobuf::FieldDescriptor* field = nullptr;
  int64_t values_per_row = 0;
  // A top_k_* field: its values make a [rows, top_k] matrix, whatever top_k is.
  bool matrix = false;
};

// Every repeated field of `result_type` (lossd.v1.ComputeResult), with its values per row under
// `selection` (a lossd.v1.OutputSelection) by the rule above. INTERNAL for a repeated field that
// the rule does not cover (no OutputSelection field says when it is filled), INVALID_ARGUMENT
// naming outputs.top_k for a negative top_k.
absl::StatusOr<std::vector<PerTokenField>> PerTokenFields(
    const google::protobuf::Message& selection, const google::protobuf::Descriptor& result_type);

// Puts the per-token outputs of one call's result messages together into one message of their
// type, in row order: each message's row_offset and num_rows place its rows, every row exactly
// once, and each repeated field carries num_rows times its values per row (none when not asked
// for). Messages may come in any order; those ahead of a gap wait, moved out of the stream's
// message, until the gap is filled.
class PerTokenAssembler {
 public:
  // `per_token` (a message of the results' type, emptied here) receives the rows and must outlive
  // the assembler.
  static absl::StatusOr<PerTokenAssembler> Create(const google::protobuf::Message& selection,
                                                  int64_t rows,
                                                  google::protobuf::Message* per_token);

  // Checks one result message and takes its per-token values out of it (its singular fields, such
  // as grad_hidden, are left for the caller).
  absl::Status Add(google::protobuf::Message& piece);
  // After the last message: every row has come. per_token then spans rows [0, rows).
  absl::Status Finish();

  int64_t covered() const { return coverage_.covered(); }
  const std::vector<PerTokenField>& fields() const { return fields_; }

 private:
  PerTokenAssembler(std::vector<PerTokenField> fields, int64_t rows,
                    google::protobuf::Message* per_token);
  // Appends `values` (this call's rows from next_row_ on) and whatever waited right behind them.
  void Append(const google::protobuf::Message& values, int64_t count);

  std::vector<PerTokenField> fields_;
  std::vector<const google::protobuf::FieldDescriptor*> wanted_;  // values_per_row > 0
  const google::protobuf::FieldDescriptor* row_offset_ = nullptr;
  const google::protobuf::FieldDescriptor* num_rows_ = nullptr;
  int64_t rows_ = 0;
  google::protobuf::Message* per_token_ = nullptr;
  RowCoverage coverage_;
  int64_t next_row_ = 0;  // rows before it are in per_token_
  // Rows that came ahead of next_row_, by their first row.
  std::map<int64_t, std::pair<int64_t, std::unique_ptr<google::protobuf::Message>>> waiting_;
};

}  // namespace lossd::client

#endif  // LOSSD_CLIENT_CPP_RESULT_ASSEMBLER_H_
