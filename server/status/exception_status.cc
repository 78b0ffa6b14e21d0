#include "server/status/exception_status.h"

#include <exception>
#include <new>

#include "absl/strings/str_cat.h"

namespace lossd::server {

absl::Status CurrentExceptionStatus(absl::string_view where) {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(where, ": the server ran out of memory (an allocation failed)"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(where, ": unexpected error: ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(where, ": unexpected error"));
  }
}

}  // namespace lossd::server
