// The large byte fields of Compute messages (hidden rows in, dL/dh out) without protobuf's copies.
//
// Parsing a message with protobuf copies each bytes field out of the buffers gRPC received it in,
// and serializing one copies it again into gRPC's buffers; for 134 MB of rows each way those copies
// cost as much CPU as the transport itself. Here a message that carries rows is one submessage of
// a oneof (ComputeRequest.chunk, ComputeResponse.result) whose bulk fields travel apart from the
// rest: received, they stay in gRPC's slices and are read once, into their final place; sent, they
// go from one copy the sender makes (or a buffer it hands over) straight to the wire. The bytes on
// the wire are protobuf's encoding of the whole message: a peer that uses protobuf as it is (the
// Python client, grpcurl) sees the message it would have seen otherwise.
#ifndef LOSSD_PROTO_WIRE_BULK_FIELDS_H_
#define LOSSD_PROTO_WIRE_BULK_FIELDS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/message_lite.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace lossd::wire {

// The bytes of one bulk field: pieces held by reference (gRPC's slices, counted), in order.
class BulkBytes {
 public:
  BulkBytes() = default;
  // A copy of `bytes`, in one slice gRPC can send without copying again.
  static BulkBytes Copy(absl::string_view bytes);
  // `bytes` where they lie, neither copied nor owned: only for a writer that is done with them
  // when its write returns (ComputeStream::WriteIsDoneOnReturn), while they stay put.
  static BulkBytes Borrow(absl::string_view bytes);
  // The slices as they are, holding a reference to each.
  static BulkBytes Of(std::vector<grpc::Slice> slices);

  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const std::vector<grpc::Slice>& slices() const { return slices_; }
  // Copies bytes [offset, offset + count) to `out`; the range must lie within size(). A piece
  // that already lies at its place in `out` (a reader put it there) is left as it is.
  void CopyTo(int64_t offset, int64_t count, void* out) const;
  std::string ToString() const;
  void Clear() {
    slices_.clear();
    size_ = 0;
  }

 private:
  std::vector<grpc::Slice> slices_;
  int64_t size_ = 0;
};

// Memory for the bytes of messages: bulk bytes copied in before they are sent, or a message read
// from a socket. Reused from message to message: a fresh allocation of megabytes for each would
// fault its pages in every time. A buffer goes back to the pool when gRPC (or whoever holds the
// slice) lets go of it, which may be after the pool's owner is gone (the slices share the pool).
// Thread-safe.
class MessageBufferPool : public std::enable_shared_from_this<MessageBufferPool> {
 public:
  static std::shared_ptr<MessageBufferPool> Create() {
    return std::shared_ptr<MessageBufferPool>(new MessageBufferPool());
  }
  ~MessageBufferPool();
  // A copy of `bytes` in one slice of pooled memory.
  BulkBytes Copy(absl::string_view bytes);
  // A slice of `bytes` bytes of pooled memory, not yet written: for bytes read from a socket.
  grpc::Slice Allocate(size_t bytes);
  // Buffers held now for reuse (tests).
  int64_t idle_buffers() const;

 private:
  struct Return;
  MessageBufferPool() = default;
  static void GiveBack(void* what);

  mutable absl::Mutex mu_;
  std::vector<std::pair<size_t, char*>> idle_ ABSL_GUARDED_BY(mu_);  // size, memory
};

// A message of the form `message Outer { oneof { Member member = N; ... } }` whose member carries
// bulk fields: the member's other fields as a protobuf message, and each bulk field's bytes.
struct BulkFieldSpec {
  int member_field;                   // N: the member's field number in the outer message
  absl::Span<const int> bulk_fields;  // the member's bytes fields that travel apart
};

// The outer message with `member` (whose bulk fields must be empty) set as its member and
// `bulk[i]` as the member's field spec.bulk_fields[i] (empty ones left out, as protobuf does).
// The bulk slices are referenced, not copied.
grpc::ByteBuffer EncodeWithBulk(const BulkFieldSpec& spec,
                                const google::protobuf::MessageLite& member,
                                absl::Span<const BulkBytes> bulk);

// The bytes EncodeWithBulk gives for the same arguments.
int64_t EncodedSizeWithBulk(const BulkFieldSpec& spec, const google::protobuf::MessageLite& member,
                            absl::Span<const BulkBytes> bulk);

// Where the bytes of the member's bulk field `bulk_field` lie in a message of `length` bytes of
// spec's form, told from its first bytes `head`, so that a reader can receive them straight where
// they go: for the field's first occurrence, when the member is the whole message, every field
// before it lies within `head`, and `head` ends within its bytes; nullopt for any other layout.
// Offsets are into the message.
struct BulkFieldAt {
  uint64_t member_offset = 0;  // the member's first field
  uint64_t key_offset = 0;     // the bulk field's key: the member's fields before it end here
  uint64_t value_offset = 0;   // the bulk field's bytes
  uint64_t value_size = 0;
};
std::optional<BulkFieldAt> FindBulkField(absl::Span<const uint8_t> head, uint64_t length,
                                         const BulkFieldSpec& spec, int bulk_field);

// Parses `buffer` into `outer` with the member's bulk fields left empty there and put in
// `bulk[i]` (spec.bulk_fields[i]) as references to the buffer's slices; the other fields as
// protobuf parses them (a repeated member merges, a repeated bulk field keeps its last value).
// INVALID_ARGUMENT, naming what is wrong, for bytes that are not such a message.
absl::Status DecodeWithBulk(const grpc::ByteBuffer& buffer, const BulkFieldSpec& spec,
                            google::protobuf::MessageLite& outer, absl::Span<BulkBytes> bulk);

}  // namespace lossd::wire

#endif  // LOSSD_PROTO_WIRE_BULK_FIELDS_H_
