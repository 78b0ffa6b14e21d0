#include "client/cpp/result_assembler.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"

namespace lossd::client {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

absl::Status ServerViolation(absl::string_view what) {
  return absl::InternalError(absl::StrCat("server sent ", what));
}

absl::Status RowCoverage::Mark(int64_t offset, int64_t count) {
  const int64_t rows = static_cast<int64_t>(seen_.size());
  if (offset < 0 || count < 0 || offset > rows || count > rows - offset) {
    return ServerViolation(
        absl::StrCat("rows [", offset, ", ", offset + count, ") of a ", rows, "-row result"));
  }
  for (int64_t row = offset; row < offset + count; ++row) {
    if (seen_[row]) return ServerViolation(absl::StrCat("row ", row, " twice"));
    seen_[row] = true;
  }
  covered_ += count;
  return absl::OkStatus();
}

namespace {

constexpr absl::string_view kTopKPrefix = "top_k_";

// The selection's singular field `name` of `type`, or null.
const FieldDescriptor* SelectionField(const Message& selection, absl::string_view name,
                                      FieldDescriptor::Type type) {
  const FieldDescriptor* field = selection.GetDescriptor()->FindFieldByName(std::string(name));
  return field != nullptr && !field->is_repeated() && field->type() == type ? field : nullptr;
}

// The int64 field `name` of a result message, which the contract gives every ComputeResult.
absl::StatusOr<const FieldDescriptor*> RowField(const Descriptor& type, absl::string_view name) {
  const FieldDescriptor* field = type.FindFieldByName(std::string(name));
  if (field == nullptr || field->is_repeated() || field->type() != FieldDescriptor::TYPE_INT64) {
    return absl::InternalError(absl::StrCat(type.full_name(), ": expected an int64 field ", name,
                                            " that places a message's rows"));
  }
  return field;
}

}  // namespace

absl::StatusOr<std::vector<PerTokenField>> PerTokenFields(const Message& selection,
                                                          const Descriptor& result_type) {
  std::vector<PerTokenField> fields;
  for (int i = 0; i < result_type.field_count(); ++i) {
    const FieldDescriptor* field = result_type.field(i);
    if (!field->is_repeated()) continue;
    const Reflection& reflection = *selection.GetReflection();
    int64_t values_per_row = 0;
    const bool matrix = absl::StartsWith(field->name(), kTopKPrefix);
    if (matrix) {
      const FieldDescriptor* top_k =
          SelectionField(selection, "top_k", FieldDescriptor::TYPE_INT32);
      if (top_k == nullptr) {
        return absl::InternalError(absl::StrCat(selection.GetDescriptor()->full_name(),
                                                ": expected an int32 top_k for ",
                                                result_type.full_name(), ".", field->name()));
      }
      values_per_row = reflection.GetInt32(selection, top_k);
      if (values_per_row < 0) {
        return InvalidField("outputs.top_k", "a count >= 0", absl::StrCat(values_per_row));
      }
    } else if (const FieldDescriptor* wanted =
                   SelectionField(selection, field->name(), FieldDescriptor::TYPE_BOOL)) {
      values_per_row = reflection.GetBool(selection, wanted) ? 1 : 0;
    } else {
      return absl::InternalError(
          absl::StrCat(result_type.full_name(), ".", field->name(),
                       ": no bool field of its name in ", selection.GetDescriptor()->full_name(),
                       " says when it is filled (the rule of ComputeResult in lossd.proto)"));
    }
    fields.push_back({field, values_per_row, matrix});
  }
  return fields;
}

absl::StatusOr<PerTokenAssembler> PerTokenAssembler::Create(const Message& selection, int64_t rows,
                                                            Message* per_token) {
  if (rows < 0) return InvalidField("rows", "a count >= 0", absl::StrCat(rows));
  ASSIGN_OR_RETURN(std::vector<PerTokenField> fields,
                   PerTokenFields(selection, *per_token->GetDescriptor()));
  PerTokenAssembler assembler(std::move(fields), rows, per_token);
  ASSIGN_OR_RETURN(assembler.row_offset_, RowField(*per_token->GetDescriptor(), "row_offset"));
  ASSIGN_OR_RETURN(assembler.num_rows_, RowField(*per_token->GetDescriptor(), "num_rows"));
  return assembler;
}

PerTokenAssembler::PerTokenAssembler(std::vector<PerTokenField> fields, int64_t rows,
                                     Message* per_token)
    : fields_(std::move(fields)), rows_(rows), per_token_(per_token), coverage_(rows) {
  per_token_->Clear();
  for (const PerTokenField& f : fields_) {
    if (f.values_per_row > 0) wanted_.push_back(f.field);
  }
}

absl::Status PerTokenAssembler::Add(Message& piece) {
  if (piece.GetDescriptor() != per_token_->GetDescriptor()) {
    return absl::InternalError(absl::StrCat("a ", piece.GetDescriptor()->full_name(),
                                            " among results of ",
                                            per_token_->GetDescriptor()->full_name()));
  }
  const Reflection& reflection = *piece.GetReflection();
  const int64_t offset = reflection.GetInt64(piece, row_offset_);
  const int64_t count = reflection.GetInt64(piece, num_rows_);
  RETURN_IF_ERROR(coverage_.Mark(offset, count));
  for (const PerTokenField& f : fields_) {
    const int64_t size = reflection.FieldSize(piece, f.field);
    if (size != count * f.values_per_row) {
      return ServerViolation(absl::StrCat(size, " values of ", f.field->name(), " for ", count,
                                          " rows, expected ", count * f.values_per_row));
    }
  }
  if (count == 0 || wanted_.empty()) return absl::OkStatus();
  // Only the per-token fields move; they leave the stream's message, which is read into again.
  std::unique_ptr<Message> values(piece.New());
  reflection.SwapFields(&piece, values.get(), wanted_);
  if (offset != next_row_) {
    waiting_.emplace(offset, std::make_pair(count, std::move(values)));
    return absl::OkStatus();
  }
  Append(*values, count);
  return absl::OkStatus();
}

void PerTokenAssembler::Append(const Message& values, int64_t count) {
  // Generated messages merge repeated fields by appending them whole.
  per_token_->MergeFrom(values);
  next_row_ += count;
  for (auto next = waiting_.find(next_row_); next != waiting_.end();
       next = waiting_.find(next_row_)) {
    per_token_->MergeFrom(*next->second.second);
    next_row_ += next->second.first;
    waiting_.erase(next);
  }
}

absl::Status PerTokenAssembler::Finish() {
  if (!coverage_.complete()) {
    return ServerViolation(
        absl::StrCat("results for ", coverage_.covered(), " of ", rows_, " rows"));
  }
  // Every row came exactly once, so nothing can still wait behind a gap.
  const Reflection& reflection = *per_token_->GetReflection();
  reflection.SetInt64(per_token_, row_offset_, 0);
  reflection.SetInt64(per_token_, num_rows_, rows_);
  return absl::OkStatus();
}

}  // namespace lossd::client
