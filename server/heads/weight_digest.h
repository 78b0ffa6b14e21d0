// The content hash of a head's W (HeadInfo.weight_sha256): SHA-256 over a header naming the
// storage dtype and shape, then W's stored bytes, so that replicas can tell whether they serve the
// same W and anyone can recompute it from the bytes with sha256sum.
#ifndef LOSSD_SERVER_HEADS_WEIGHT_DIGEST_H_
#define LOSSD_SERVER_HEADS_WEIGHT_DIGEST_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lossd/kernels/types.h"

namespace lossd::server {

// Feeds W to SHA-256 in any number of pieces, in row order:
//   SHA-256("lossd-head-v1 <dtype> <vocab_size> <hidden_size>\n" || W's stored bytes).
class WeightHasher {
 public:
  // Starts the digest with the header of a [vocab_size, hidden_size] W stored as `dtype`.
  static absl::StatusOr<WeightHasher> Start(DType dtype, int64_t vocab_size, int64_t hidden_size);
  WeightHasher(WeightHasher&&) noexcept;
  WeightHasher& operator=(WeightHasher&&) noexcept;
  ~WeightHasher();

  absl::Status Add(const void* bytes, size_t size);
  // The digest as 64 lowercase hex digits; the hasher is spent.
  absl::StatusOr<std::string> Finish();

 private:
  struct Context;
  explicit WeightHasher(std::unique_ptr<Context> context);
  std::unique_ptr<Context> context_;
};

// The digest of a whole W held in host memory, `bytes` stored as `dtype`.
absl::StatusOr<std::string> WeightSha256(DType dtype, int64_t vocab_size, int64_t hidden_size,
                                         const void* bytes, size_t size);

// Whether `text` has the form of a digest: 64 lowercase hex digits.
bool IsWeightDigest(absl::string_view text);

}  // namespace lossd::server

#endif  // LOSSD_SERVER_HEADS_WEIGHT_DIGEST_H_
