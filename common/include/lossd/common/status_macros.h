// Status plumbing shared by every layer of lossd, header-only so the client can use it too.
#ifndef LOSSD_COMMON_STATUS_MACROS_H_
#define LOSSD_COMMON_STATUS_MACROS_H_

#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define LOSSD_CONCAT_INNER_(a, b) a##b
#define LOSSD_CONCAT_(a, b) LOSSD_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                      \
  do {                                             \
    ::absl::Status lossd_status_ = (expr);         \
    if (!lossd_status_.ok()) return lossd_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` unwraps an absl::StatusOr or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  LOSSD_ASSIGN_OR_RETURN_IMPL_(LOSSD_CONCAT_(lossd_statusor_, __LINE__), lhs, expr)
#define LOSSD_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()

namespace lossd {

// `status` with the request field it is about attached, for clients to act on (ErrorInfo.field)
// without parsing the message.
inline absl::Status WithField(absl::Status status, absl::string_view field) {
  status.SetPayload("type.lossd/lossd.Field", absl::Cord(field));
  return status;
}
// The field WithField attached; empty when none.
inline std::string FieldOf(const absl::Status& status) {
  const auto field = status.GetPayload("type.lossd/lossd.Field");
  return field.has_value() ? std::string(*field) : std::string();
}

// `status` carrying every payload of `source` too (the typed reasons code acts on), for an error
// that explains or re-words another.
inline absl::Status WithPayloadsOf(absl::Status status, const absl::Status& source) {
  source.ForEachPayload([&status](absl::string_view type_url, const absl::Cord& payload) {
    status.SetPayload(type_url, payload);
  });
  return status;
}

// The one shape of lossd's bad-input errors: "<field>: expected <what>, got <what came>".
inline absl::Status InvalidField(absl::string_view field, absl::string_view expected,
                                 absl::string_view got) {
  return WithField(
      absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, ", got ", got)),
      field);
}

// A failed system call as a Status: "<what>: <strerror>", with the code errno maps to.
inline absl::Status ErrnoError(absl::string_view what, int error_number) {
  return absl::Status(absl::ErrnoToStatusCode(error_number),
                      absl::StrCat(what, ": ", std::strerror(error_number)));
}

}  // namespace lossd

#endif  // LOSSD_COMMON_STATUS_MACROS_H_
