#include "server/heads/weight_digest.h"

#include <openssl/err.h>
#include <openssl/evp.h>

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace lossd::server {
namespace {

constexpr size_t kDigestHexDigits = 64;

// Only an allocation fails here; the queued OpenSSL error is dropped so that it cannot be taken
// for the cause of a later, unrelated failure on this thread.
absl::Status OpenSslFailure(absl::string_view call) {
  ERR_clear_error();
  return absl::InternalError(absl::StrCat("SHA-256 of W: ", call, " failed"));
}

}  // namespace

struct WeightHasher::Context {
  struct Free {
    void operator()(EVP_MD_CTX* context) const { EVP_MD_CTX_free(context); }
  };
  std::unique_ptr<EVP_MD_CTX, Free> digest;
};

WeightHasher::WeightHasher(std::unique_ptr<Context> context) : context_(std::move(context)) {}
WeightHasher::WeightHasher(WeightHasher&&) noexcept = default;
WeightHasher& WeightHasher::operator=(WeightHasher&&) noexcept = default;
WeightHasher::~WeightHasher() = default;

absl::StatusOr<WeightHasher> WeightHasher::Start(DType dtype, int64_t vocab_size,
                                                 int64_t hidden_size) {
  auto context = std::make_unique<Context>();
  context->digest.reset(EVP_MD_CTX_new());
  if (context->digest == nullptr) return OpenSslFailure("EVP_MD_CTX_new");
  if (EVP_DigestInit_ex(context->digest.get(), EVP_sha256(), nullptr) != 1) {
    return OpenSslFailure("EVP_DigestInit_ex");
  }
  WeightHasher hasher(std::move(context));
  const std::string header =
      absl::StrCat("lossd-head-v1 ", DTypeName(dtype), " ", vocab_size, " ", hidden_size, "\n");
  if (absl::Status added = hasher.Add(header.data(), header.size()); !added.ok()) return added;
  return hasher;
}

absl::Status WeightHasher::Add(const void* bytes, size_t size) {
  if (EVP_DigestUpdate(context_->digest.get(), bytes, size) != 1) {
    return OpenSslFailure("EVP_DigestUpdate");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> WeightHasher::Finish() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(context_->digest.get(), digest, &length) != 1) {
    return OpenSslFailure("EVP_DigestFinal_ex");
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), length));
}

absl::StatusOr<std::string> WeightSha256(DType dtype, int64_t vocab_size, int64_t hidden_size,
                                         const void* bytes, size_t size) {
  absl::StatusOr<WeightHasher> hasher = WeightHasher::Start(dtype, vocab_size, hidden_size);
  if (!hasher.ok()) return hasher.status();
  if (absl::Status added = hasher->Add(bytes, size); !added.ok()) return added;
  return hasher->Finish();
}

bool IsWeightDigest(absl::string_view text) {
  if (text.size() != kDigestHexDigits) return false;
  for (const char c : text) {
    if (!absl::ascii_isdigit(c) && !(c >= 'a' && c <= 'f')) return false;
  }
  return true;
}

}  // namespace lossd::server
