#include "proto/wire/bulk_fields.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/message.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/strings/str_cat.h"
#include "lossd/common/grpc_handover.h"
#include "lossd/common/status_macros.h"

namespace lossd::wire {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;
using google::protobuf::io::StringOutputStream;

constexpr WireFormatLite::WireType kLengthDelimited = WireFormatLite::WIRETYPE_LENGTH_DELIMITED;

uint32_t LengthDelimitedTag(int field) { return WireFormatLite::MakeTag(field, kLengthDelimited); }

// Calls visit(slice, begin, end) for the part [begin, end) of each of `slices` that bytes
// [offset, offset + count) of their concatenation cover, in order.
template <typename Visit>
void ForEachPart(const std::vector<grpc::Slice>& slices, int64_t offset, int64_t count,
                 Visit visit) {
  int64_t start = 0;
  for (const grpc::Slice& slice : slices) {
    const int64_t size = static_cast<int64_t>(slice.size());
    const int64_t from = std::max(offset, start);
    const int64_t to = std::min(offset + count, start + size);
    if (from < to) visit(slice, static_cast<size_t>(from - start), static_cast<size_t>(to - start));
    start += size;
    if (start >= offset + count) break;
  }
}

// Bytes [offset, offset + count) of the buffer whose slices are `slices`, as references.
std::vector<grpc::Slice> SliceRange(const std::vector<grpc::Slice>& slices, int64_t offset,
                                    int64_t count) {
  std::vector<grpc::Slice> range;
  ForEachPart(slices, offset, count, [&](const grpc::Slice& slice, size_t begin, size_t end) {
    range.push_back(begin == 0 && end == slice.size() ? slice : slice.sub(begin, end));
  });
  return range;
}

// protobuf's parser takes a tag or a length of at most 5 bytes (a 32-bit varint), where
// CodedInputStream reads up to 10 and keeps the low bits: read here as the parser reads them, so
// that nothing it refuses gets through re-encoded.
constexpr int64_t kMaxTagOrLengthBytes = 5;

// The next tag; 0 at the end of the input or of the current limit; nullopt for a tag protobuf
// refuses (too long, or of field 0).
std::optional<uint32_t> ReadTag(CodedInputStream& in) {
  const int64_t before = in.CurrentPosition();
  const uint32_t tag = in.ReadTag();
  if (in.CurrentPosition() - before > kMaxTagOrLengthBytes) return std::nullopt;
  if (tag == 0 && !in.ConsumedEntireMessage()) return std::nullopt;
  if (tag != 0 && WireFormatLite::GetTagFieldNumber(tag) == 0) return std::nullopt;
  return tag;
}

bool ReadLength(CodedInputStream& in, uint32_t* length) {
  const int64_t before = in.CurrentPosition();
  return in.ReadVarint32(length) && in.CurrentPosition() - before <= kMaxTagOrLengthBytes &&
         *length <= static_cast<uint32_t>(std::numeric_limits<int>::max());
}

// Copies the field that `tag` starts into `out`; false for one protobuf's parser refuses, and for
// a group (which proto3 never writes).
bool CopyField(CodedInputStream& in, uint32_t tag, CodedOutputStream& out) {
  switch (WireFormatLite::GetTagWireType(tag)) {
    case WireFormatLite::WIRETYPE_LENGTH_DELIMITED: {
      uint32_t length = 0;
      std::string value;
      if (!ReadLength(in, &length) || !in.ReadString(&value, static_cast<int>(length))) {
        return false;
      }
      out.WriteTag(tag);
      out.WriteVarint32(length);
      out.WriteString(value);
      return true;
    }
    case WireFormatLite::WIRETYPE_VARINT:
    case WireFormatLite::WIRETYPE_FIXED64:
    case WireFormatLite::WIRETYPE_FIXED32: return WireFormatLite::SkipField(&in, tag, &out);
    default: return false;
  }
}

absl::Status Malformed(const google::protobuf::MessageLite& outer, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("a malformed ", outer.GetTypeName(), ": ", what));
}

// The name of the outer message's field `field` ("chunk"), or with `member_field` of the member's
// (`chunk.hidden`), as the descriptors of full messages say; "field 2.1" where they cannot.
std::string FieldName(const google::protobuf::MessageLite& outer, int field, int member_field = 0) {
  const std::string numbers = member_field == 0 ? absl::StrCat("field ", field)
                                                : absl::StrCat("field ", member_field, ".", field);
  const auto* full = dynamic_cast<const google::protobuf::Message*>(&outer);
  if (full == nullptr) return numbers;
  const google::protobuf::Descriptor* type = full->GetDescriptor();
  if (member_field != 0) {
    const google::protobuf::FieldDescriptor* member = type->FindFieldByNumber(member_field);
    if (member == nullptr || member->message_type() == nullptr) return numbers;
    const google::protobuf::FieldDescriptor* inner =
        member->message_type()->FindFieldByNumber(field);
    return inner == nullptr ? numbers : absl::StrCat(member->name(), ".", inner->name());
  }
  const google::protobuf::FieldDescriptor* named = type->FindFieldByNumber(field);
  return named == nullptr ? numbers : named->name();
}

// Whether the member occurs at the top of the message, read without copying anything; false as
// well for bytes that cannot be read that far (protobuf's own parser then says what is wrong).
bool HasMember(const grpc::ByteBuffer& buffer, const BulkFieldSpec& spec) {
  grpc::ByteBuffer readable(buffer);
  grpc::ProtoBufferReader reader(&readable);
  CodedInputStream in(&reader);
  while (const uint32_t tag = in.ReadTag()) {
    if (tag == LengthDelimitedTag(spec.member_field)) return true;
    if (!WireFormatLite::SkipField(&in, tag)) return false;
  }
  return false;
}

}  // namespace

BulkBytes BulkBytes::Copy(absl::string_view bytes) {
  BulkBytes copy;
  if (!bytes.empty()) copy.slices_.emplace_back(bytes.data(), bytes.size());
  copy.size_ = static_cast<int64_t>(bytes.size());
  return copy;
}

BulkBytes BulkBytes::Borrow(absl::string_view bytes) {
  BulkBytes borrowed;
  if (!bytes.empty()) {
    borrowed.slices_.emplace_back(bytes.data(), bytes.size(), grpc::Slice::STATIC_SLICE);
  }
  borrowed.size_ = static_cast<int64_t>(bytes.size());
  return borrowed;
}

BulkBytes BulkBytes::Of(std::vector<grpc::Slice> slices) {
  BulkBytes bytes;
  for (const grpc::Slice& slice : slices) bytes.size_ += static_cast<int64_t>(slice.size());
  bytes.slices_ = std::move(slices);
  return bytes;
}

void BulkBytes::CopyTo(int64_t offset, int64_t count, void* out) const {
  uint8_t* next = static_cast<uint8_t*>(out);
  ForEachPart(slices_, offset, count, [&](const grpc::Slice& slice, size_t begin, size_t end) {
    // Bytes a reader received straight into `out` are where they go already.
    if (slice.begin() + begin != next) std::memcpy(next, slice.begin() + begin, end - begin);
    next += end - begin;
  });
}

std::string BulkBytes::ToString() const {
  std::string bytes(static_cast<size_t>(size_), '\0');
  CopyTo(0, size_, bytes.data());
  return bytes;
}

namespace {

// The member's encoded length: its own fields (whose sizes protobuf caches here) and the bulk ones.
size_t MemberLength(const BulkFieldSpec& spec, const google::protobuf::MessageLite& member,
                    absl::Span<const BulkBytes> bulk) {
  size_t length = member.ByteSizeLong();
  for (size_t i = 0; i < bulk.size(); ++i) {
    if (bulk[i].empty()) continue;
    length += CodedOutputStream::VarintSize32(LengthDelimitedTag(spec.bulk_fields[i])) +
              CodedOutputStream::VarintSize64(static_cast<uint64_t>(bulk[i].size())) +
              static_cast<size_t>(bulk[i].size());
  }
  return length;
}

}  // namespace

int64_t EncodedSizeWithBulk(const BulkFieldSpec& spec, const google::protobuf::MessageLite& member,
                            absl::Span<const BulkBytes> bulk) {
  const size_t length = MemberLength(spec, member, bulk);
  return static_cast<int64_t>(
      CodedOutputStream::VarintSize32(LengthDelimitedTag(spec.member_field)) +
      CodedOutputStream::VarintSize64(length) + length);
}

// What a pooled slice's destroy callback needs: the pool (kept alive by it) and the memory.
struct MessageBufferPool::Return {
  std::shared_ptr<MessageBufferPool> pool;
  char* memory;
  size_t size;
};

MessageBufferPool::~MessageBufferPool() {
  for (const auto& [size, memory] : idle_) delete[] memory;
}

BulkBytes MessageBufferPool::Copy(absl::string_view bytes) {
  if (bytes.empty()) return BulkBytes();
  grpc::Slice slice = Allocate(bytes.size());
  std::memcpy(const_cast<uint8_t*>(slice.begin()), bytes.data(), bytes.size());
  std::vector<grpc::Slice> slices;
  slices.push_back(std::move(slice));
  return BulkBytes::Of(std::move(slices));
}

grpc::Slice MessageBufferPool::Allocate(size_t bytes) {
  char* memory = nullptr;
  std::vector<std::pair<size_t, char*>> unfit;
  {
    absl::MutexLock lock(&mu_);
    // A message's rows are mostly the size of the one before: a buffer that size is reused; when
    // none is idle, the idle ones of other sizes are freed rather than kept for sizes that may not
    // come again.
    const auto same = std::find_if(idle_.begin(), idle_.end(),
                                   [&](const auto& idle) { return idle.first == bytes; });
    if (same != idle_.end()) {
      memory = same->second;
      idle_.erase(same);
    } else {
      unfit.swap(idle_);
    }
  }
  for (const auto& [size, idle] : unfit) delete[] idle;
  if (memory == nullptr) memory = new char[std::max<size_t>(bytes, 1)];
  auto* back = new Return{shared_from_this(), memory, bytes};
  // The caller writes the bytes before anyone else sees the slice; GiveBack may run on any of
  // gRPC's threads.
  HandOverToGrpc(back);
  return grpc::Slice(memory, bytes, &MessageBufferPool::GiveBack, back);
}

void MessageBufferPool::GiveBack(void* what) {
  TakeOverFromGrpc(what);
  std::unique_ptr<Return> back(static_cast<Return*>(what));
  MessageBufferPool& pool = *back->pool;
  // Kept: as many buffers as were in flight at once, which bounds the pool.
  absl::MutexLock lock(&pool.mu_);
  pool.idle_.emplace_back(back->size, back->memory);
}

int64_t MessageBufferPool::idle_buffers() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(idle_.size());
}

std::optional<BulkFieldAt> FindBulkField(absl::Span<const uint8_t> head, uint64_t length,
                                         const BulkFieldSpec& spec, int bulk_field) {
  CodedInputStream in(head.data(), static_cast<int>(head.size()));
  const auto position = [&in] { return static_cast<uint64_t>(in.CurrentPosition()); };
  BulkFieldAt at;
  uint64_t member_length = 0;
  if (in.ReadTag() != LengthDelimitedTag(spec.member_field) || !in.ReadVarint64(&member_length) ||
      member_length != length - position()) {
    return std::nullopt;
  }
  at.member_offset = position();
  while (true) {
    at.key_offset = position();
    const uint32_t tag = in.ReadTag();  // 0 at the end of `head`
    if (tag == 0) return std::nullopt;
    if (tag != LengthDelimitedTag(bulk_field)) {
      if (!WireFormatLite::SkipField(&in, tag)) return std::nullopt;
      continue;
    }
    if (!in.ReadVarint64(&at.value_size)) return std::nullopt;
    at.value_offset = position();
    if (at.value_size > length - at.value_offset || at.value_offset + at.value_size < head.size()) {
      return std::nullopt;
    }
    return at;
  }
}

grpc::ByteBuffer EncodeWithBulk(const BulkFieldSpec& spec,
                                const google::protobuf::MessageLite& member,
                                absl::Span<const BulkBytes> bulk) {
  const size_t member_length = MemberLength(spec, member, bulk);
  // The small pieces (tags, lengths, the member's other fields) gather in `head` until a bulk
  // field's bytes follow them.
  std::vector<grpc::Slice> slices;
  std::string head;
  {
    StringOutputStream stream(&head);
    CodedOutputStream out(&stream);
    out.WriteTag(LengthDelimitedTag(spec.member_field));
    out.WriteVarint64(member_length);
    member.SerializeWithCachedSizes(&out);
  }
  for (size_t i = 0; i < bulk.size(); ++i) {
    if (bulk[i].empty()) continue;
    {
      StringOutputStream stream(&head);
      CodedOutputStream out(&stream);
      out.WriteTag(LengthDelimitedTag(spec.bulk_fields[i]));
      out.WriteVarint64(static_cast<uint64_t>(bulk[i].size()));
    }
    slices.emplace_back(head);
    head.clear();
    slices.insert(slices.end(), bulk[i].slices().begin(), bulk[i].slices().end());
  }
  if (!head.empty()) slices.emplace_back(head);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

namespace {

// Whether `tag` sets another field of the oneof the member belongs to, which protobuf's parser
// takes as clearing the member read before it (full messages only: lite ones carry no oneofs'
// descriptors, and their members are read as if alone).
bool SetsAnotherOneofField(const google::protobuf::MessageLite& outer, int member_field,
                           uint32_t tag) {
  const auto* full = dynamic_cast<const google::protobuf::Message*>(&outer);
  if (full == nullptr) return false;
  const google::protobuf::Descriptor* type = full->GetDescriptor();
  const google::protobuf::FieldDescriptor* member = type->FindFieldByNumber(member_field);
  const google::protobuf::FieldDescriptor* other =
      type->FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag));
  if (member == nullptr || other == nullptr || other == member ||
      member->containing_oneof() == nullptr ||
      other->containing_oneof() != member->containing_oneof()) {
    return false;
  }
  // With another wire type than its own, protobuf keeps the field as unknown instead.
  return WireFormatLite::GetTagWireType(tag) ==
         WireFormatLite::WireTypeForFieldType(
             static_cast<WireFormatLite::FieldType>(other->type()));
}

// One occurrence of the member, after its tag: its fields other than the bulk ones into `out` as
// one occurrence of the member, the bulk ones into `bulk` as references to `slices`.
absl::Status ReadMember(CodedInputStream& in, const std::vector<grpc::Slice>& slices, int64_t total,
                        const BulkFieldSpec& spec, const google::protobuf::MessageLite& outer,
                        CodedOutputStream& out, absl::Span<BulkBytes> bulk) {
  uint32_t member_length = 0;
  if (!ReadLength(in, &member_length) ||
      static_cast<int64_t>(member_length) > total - in.CurrentPosition()) {
    return Malformed(outer, absl::StrCat(FieldName(outer, spec.member_field), " is cut short"));
  }
  const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(member_length));
  std::string member;
  StringOutputStream member_stream(&member);
  CodedOutputStream member_out(&member_stream);
  while (true) {
    const std::optional<uint32_t> read = ReadTag(in);
    if (!read.has_value()) {
      return Malformed(outer,
                       absl::StrCat(FieldName(outer, spec.member_field), " is badly encoded"));
    }
    const uint32_t tag = *read;
    if (tag == 0) break;
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    const auto bulk_field = std::find(spec.bulk_fields.begin(), spec.bulk_fields.end(), field);
    if (bulk_field == spec.bulk_fields.end()) {
      if (!CopyField(in, tag, member_out)) {
        return Malformed(outer, absl::StrCat(FieldName(outer, field, spec.member_field),
                                             " is cut short or badly encoded"));
      }
      continue;
    }
    uint32_t length = 0;
    if (WireFormatLite::GetTagWireType(tag) != kLengthDelimited || !ReadLength(in, &length)) {
      return Malformed(outer,
                       absl::StrCat(FieldName(outer, field, spec.member_field), " is not bytes"));
    }
    const int64_t offset = in.CurrentPosition();
    if (static_cast<int64_t>(length) > in.BytesUntilLimit() || !in.Skip(static_cast<int>(length))) {
      return Malformed(outer,
                       absl::StrCat(FieldName(outer, field, spec.member_field), " is cut short"));
    }
    bulk[bulk_field - spec.bulk_fields.begin()] = BulkBytes::Of(SliceRange(slices, offset, length));
  }
  if (in.BytesUntilLimit() != 0) {
    return Malformed(outer, absl::StrCat(FieldName(outer, spec.member_field), " is badly encoded"));
  }
  in.PopLimit(limit);
  member_out.Trim();
  out.WriteTag(LengthDelimitedTag(spec.member_field));
  out.WriteVarint64(static_cast<uint64_t>(member_out.ByteCount()));
  out.WriteRaw(member.data(), static_cast<int>(member_out.ByteCount()));
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeWithBulk(const grpc::ByteBuffer& buffer, const BulkFieldSpec& spec,
                            google::protobuf::MessageLite& outer, absl::Span<BulkBytes> bulk) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return Malformed(outer, "its buffer could not be read");
  int64_t total = 0;
  for (const grpc::Slice& slice : slices) total += static_cast<int64_t>(slice.size());
  for (BulkBytes& bytes : bulk) bytes.Clear();

  grpc::ByteBuffer readable(buffer);  // the reader takes a mutable buffer; this shares its slices
  grpc::ProtoBufferReader reader(&readable);
  // A message without the member (a start, a summary, whose repeated fields may be large) goes
  // to protobuf's parser as it is: rewriting it field by field would only copy it twice more.
  if (!HasMember(buffer, spec)) {
    if (!outer.ParseFromZeroCopyStream(&reader)) {
      return Malformed(outer, "protobuf cannot parse it");
    }
    return absl::OkStatus();
  }
  CodedInputStream in(&reader);
  // The message without the bulk fields, each field where it was: protobuf's parser then merges
  // the member's occurrences and keeps the oneof's last member as it would have.
  std::string rest;
  {
    StringOutputStream outer_stream(&rest);
    CodedOutputStream outer_out(&outer_stream);
    while (true) {
      const std::optional<uint32_t> read = ReadTag(in);
      if (!read.has_value()) return Malformed(outer, "a field tag is badly encoded");
      const uint32_t tag = *read;
      if (tag == 0) break;
      if (tag == LengthDelimitedTag(spec.member_field)) {
        RETURN_IF_ERROR(ReadMember(in, slices, total, spec, outer, outer_out, bulk));
        continue;
      }
      if (!CopyField(in, tag, outer_out)) {
        return Malformed(outer,
                         absl::StrCat(FieldName(outer, WireFormatLite::GetTagFieldNumber(tag)),
                                      " is cut short or badly encoded"));
      }
      // The parser clears the member here, its bulk fields with it.
      if (SetsAnotherOneofField(outer, spec.member_field, tag)) {
        for (BulkBytes& bytes : bulk) bytes.Clear();
      }
    }
    if (in.CurrentPosition() != total) return Malformed(outer, "a field tag is badly encoded");
  }
  if (!outer.ParseFromString(rest)) return Malformed(outer, "a field's value is not valid");
  return absl::OkStatus();
}

}  // namespace lossd::wire
