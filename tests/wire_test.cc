// Compute messages with their row bytes apart (proto/wire): what is encoded is protobuf's own
// encoding of the whole message, what is decoded is what protobuf would parse, whatever slices the
// bytes arrive in, and bytes that are not such a message are refused by name without a crash.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "lossd/v1/lossd.pb.h"
#include "proto/wire/bulk_fields.h"
#include "proto/wire/compute_frames.h"

namespace lossd::wire {
namespace {

using google::protobuf::util::MessageDifferencer;

std::string RandomBytes(size_t size, std::mt19937& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::string bytes(size, '\0');
  for (char& c : bytes) c = static_cast<char>(byte(rng));
  return bytes;
}

// `bytes` as a buffer of slices cut at random places (gRPC hands a message over in the pieces it
// read it in).
grpc::ByteBuffer InRandomSlices(const std::string& bytes, int cuts, std::mt19937& rng) {
  std::vector<size_t> ends;
  std::uniform_int_distribution<size_t> place(0, bytes.size());
  for (int i = 0; i < cuts; ++i) ends.push_back(place(rng));
  ends.push_back(bytes.size());
  std::sort(ends.begin(), ends.end());
  std::vector<grpc::Slice> slices;
  size_t start = 0;
  for (const size_t end : ends) {
    if (end > start) slices.emplace_back(bytes.data() + start, end - start);
    start = end;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& slice : slices) bytes.append(slice.begin(), slice.end());
  return bytes;
}

struct ChunkCase {
  const char* name;
  size_t hidden_bytes;
  size_t teacher_bytes;
  size_t top_k_bytes;
  int64_t shared_rows;
  int cuts;  // slices the received bytes come in
};

class ChunkFrameTest : public testing::TestWithParam<ChunkCase> {};

TEST_P(ChunkFrameTest, EncodesProtobufsBytesAndDecodesWhatProtobufParses) {
  const ChunkCase& c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(c.hidden_bytes * 7 + c.cuts));
  v1::ComputeRequest whole;
  v1::ComputeChunk& chunk = *whole.mutable_chunk();
  chunk.set_hidden(RandomBytes(c.hidden_bytes, rng));
  chunk.set_teacher_hidden(RandomBytes(c.teacher_bytes, rng));
  chunk.set_teacher_top_k_tokens(RandomBytes(c.top_k_bytes, rng));
  chunk.set_teacher_top_k_logprobs(RandomBytes(c.top_k_bytes, rng));
  chunk.set_shared_rows(c.shared_rows);

  const ComputeRequestFrame sent = ComputeRequestFrame::FromMessage(whole);
  const grpc::ByteBuffer encoded = sent.Encode();
  EXPECT_EQ(static_cast<int64_t>(encoded.Length()), sent.ByteSize());
  // A peer that parses with protobuf sees the whole message.
  v1::ComputeRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(encoded)));
  EXPECT_TRUE(MessageDifferencer::Equals(parsed, whole));

  // Protobuf's own bytes of the message, received in pieces, decode to the same rows.
  ComputeRequestFrame received;
  ASSERT_TRUE(received.Decode(InRandomSlices(whole.SerializeAsString(), c.cuts, rng)).ok());
  EXPECT_EQ(received.rows[kHiddenRows].ToString(), chunk.hidden());
  EXPECT_EQ(received.rows[kTeacherHiddenRows].ToString(), chunk.teacher_hidden());
  EXPECT_EQ(received.rows[kTeacherTopKTokenRows].ToString(), chunk.teacher_top_k_tokens());
  EXPECT_EQ(received.rows[kTeacherTopKLogprobRows].ToString(), chunk.teacher_top_k_logprobs());
  ASSERT_TRUE(received.message.has_chunk());
  EXPECT_TRUE(received.message.chunk().hidden().empty());
  EXPECT_EQ(received.message.chunk().shared_rows(), c.shared_rows);
  EXPECT_EQ(received.ByteSize(), static_cast<int64_t>(whole.ByteSizeLong()));

  // A piece from the middle of the rows, across slices.
  const BulkBytes& hidden = received.rows[kHiddenRows];
  if (hidden.size() >= 3) {
    const int64_t offset = hidden.size() / 3;
    const int64_t count = hidden.size() - 2 * offset;
    std::string piece(static_cast<size_t>(count), '\0');
    hidden.CopyTo(offset, count, piece.data());
    EXPECT_EQ(piece,
              chunk.hidden().substr(static_cast<size_t>(offset), static_cast<size_t>(count)));
  }
}

INSTANTIATE_TEST_SUITE_P(Table, ChunkFrameTest,
                         testing::Values(
                             // Rows in one slice, as a sender's copy is.
                             ChunkCase{"one_slice", 4096, 0, 0, 0, 0},
                             // Rows cut at many places, including inside the tags and lengths.
                             ChunkCase{"many_slices", 100'003, 0, 0, 0, 40},
                             // A distill chunk: four bulk fields in one member.
                             ChunkCase{"teacher_fields", 9'000, 5'000, 640, 0, 25},
                             // A length that takes three varint bytes next to one that takes one.
                             ChunkCase{"short_and_long", 3'000'001, 0, 7, 0, 12},
                             // An announcement: no rows at all, only shared_rows.
                             ChunkCase{"announcement", 0, 0, 0, 1234, 3},
                             // One byte of rows: shorter than gRPC's inlined slices.
                             ChunkCase{"one_byte", 1, 0, 0, 0, 1}),
                         [](const testing::TestParamInfo<ChunkCase>& info) {
                           return info.param.name;
                         });

TEST(ComputeFrameTest, AStartTravelsWhole) {
  v1::ComputeRequest whole;
  whole.mutable_start()->set_head("main");
  whole.mutable_start()->add_labels(7);
  ComputeRequestFrame frame;
  frame.message = whole;
  v1::ComputeRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(frame.Encode())));
  EXPECT_TRUE(MessageDifferencer::Equals(parsed, whole));
  ComputeRequestFrame received;
  ASSERT_TRUE(received.Decode(frame.Encode()).ok());
  EXPECT_TRUE(MessageDifferencer::Equals(received.message, whole));
}

TEST(ComputeFrameTest, AResultsDLdhTravelsApartAndASummaryWhole) {
  std::mt19937 rng(5);
  v1::ComputeResponse result;
  result.mutable_result()->set_row_offset(64);
  result.mutable_result()->set_num_rows(2);
  result.mutable_result()->add_token_loss(1.5f);
  result.mutable_result()->set_grad_hidden_dtype(v1::DTYPE_BFLOAT16);
  const std::string grad = RandomBytes(70'000, rng);
  const grpc::ByteBuffer encoded = EncodeComputeResponse(result, BulkBytes::Copy(grad));
  v1::ComputeResponse whole = result;
  whole.mutable_result()->set_grad_hidden(grad);
  v1::ComputeResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(encoded)));
  EXPECT_TRUE(MessageDifferencer::Equals(parsed, whole));

  ComputeResponseFrame received;
  ASSERT_TRUE(received.Decode(InRandomSlices(whole.SerializeAsString(), 9, rng)).ok());
  EXPECT_EQ(received.grad_hidden.ToString(), grad);
  EXPECT_TRUE(MessageDifferencer::Equals(received.message, result));

  v1::ComputeResponse summary;
  summary.mutable_summary()->set_loss(2.25);
  ASSERT_TRUE(received.Decode(EncodeComputeResponse(summary, BulkBytes())).ok());
  EXPECT_TRUE(received.grad_hidden.empty());
  EXPECT_TRUE(MessageDifferencer::Equals(received.message, summary));
}

// Protobuf merges a repeated submessage and keeps the last value of a repeated bytes field; the
// decoder does the same.
TEST(ComputeFrameTest, RepeatedMembersMergeAsProtobufMergesThem) {
  v1::ComputeRequest first;
  first.mutable_chunk()->set_hidden("first rows");
  first.mutable_chunk()->set_shared_rows(3);
  v1::ComputeRequest second;
  second.mutable_chunk()->set_hidden("second rows");
  const std::string bytes = first.SerializeAsString() + second.SerializeAsString();
  v1::ComputeRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  std::mt19937 rng(11);
  ComputeRequestFrame received;
  ASSERT_TRUE(received.Decode(InRandomSlices(bytes, 6, rng)).ok());
  EXPECT_EQ(received.rows[kHiddenRows].ToString(), parsed.chunk().hidden());
  EXPECT_EQ(received.message.chunk().shared_rows(), parsed.chunk().shared_rows());
}

// The oneof's last member set wins, as in protobuf: a start after a chunk clears the chunk and
// its rows, a chunk after a start is the message.
TEST(ComputeFrameTest, TheLastOneofMemberWinsAsInProtobuf) {
  v1::ComputeRequest chunk;
  chunk.mutable_chunk()->set_hidden("rows");
  v1::ComputeRequest start;
  start.mutable_start()->set_head("main");
  for (const bool chunk_last : {false, true}) {
    const std::string bytes = chunk_last ? start.SerializeAsString() + chunk.SerializeAsString()
                                         : chunk.SerializeAsString() + start.SerializeAsString();
    v1::ComputeRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes));
    std::mt19937 rng(29);
    ComputeRequestFrame received;
    ASSERT_TRUE(received.Decode(InRandomSlices(bytes, 3, rng)).ok());
    EXPECT_EQ(received.message.has_chunk(), parsed.has_chunk());
    EXPECT_EQ(received.message.has_start(), parsed.has_start());
    EXPECT_EQ(received.rows[kHiddenRows].ToString(), parsed.chunk().hidden());
  }
}

struct MalformedCase {
  const char* name;
  std::string bytes;
  const char* says;  // in the error
};

class MalformedFrameTest : public testing::TestWithParam<MalformedCase> {};

TEST_P(MalformedFrameTest, IsRefusedByName) {
  const MalformedCase& c = GetParam();
  std::mt19937 rng(3);
  ComputeRequestFrame received;
  const absl::Status status = received.Decode(InRandomSlices(c.bytes, 2, rng));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("lossd.v1.ComputeRequest"), std::string::npos) << status;
  EXPECT_NE(status.message().find(c.says), std::string::npos) << status;
}

// A chunk member (field 2) holding `inner`, with its length as written.
std::string Chunk(const std::string& inner) {
  return absl::StrCat("\x12", std::string(1, static_cast<char>(inner.size())), inner);
}

INSTANTIATE_TEST_SUITE_P(
    Table, MalformedFrameTest,
    testing::Values(
        // hidden (field 1) says 10 bytes, 4 follow.
        MalformedCase{"rows_cut_short",
                      Chunk(std::string("\x0a\x0a"
                                        "abcd",
                                        6)),
                      "chunk.hidden is cut short"},
        // hidden sent as a varint: not bytes.
        MalformedCase{"rows_not_bytes", Chunk(std::string("\x08\x05", 2)),
                      "chunk.hidden is not bytes"},
        // The member says 20 bytes, 2 follow.
        MalformedCase{"member_cut_short", std::string("\x12\x14\x28\x01", 4), "chunk is cut short"},
        // After a chunk, a tag of field 0, which protobuf never writes.
        MalformedCase{"field_zero", Chunk(std::string("\x28\x01", 2)) + std::string("\x00\x01", 2),
                      "a field tag is badly encoded"},
        // The same as the message's last byte, where the end of input could hide it.
        MalformedCase{"lone_zero_tag", Chunk(std::string("\x28\x01", 2)) + std::string(1, '\0'),
                      "a field tag is badly encoded"},
        // ... and as the member's last byte.
        MalformedCase{"zero_tag_in_member", Chunk(std::string("\x28\x01\x00", 3)), "badly encoded"},
        // A field 0 in a chunk that the start after it clears: protobuf refuses it all the same.
        MalformedCase{"field_zero_in_cleared_member",
                      Chunk(std::string("\x02\x00", 2)) + std::string("\x0a\x00", 2),
                      "chunk is badly encoded"},
        // shared_rows (field 5) as a varint that never ends.
        MalformedCase{"endless_varint", Chunk(std::string("\x28\xff\xff", 3)),
                      "chunk.shared_rows is cut short"},
        // After a chunk, a tag in six bytes: CodedInputStream would keep its low 32 bits, protobuf
        // refuses it.
        MalformedCase{
            "six_byte_tag",
            Chunk(std::string("\x28\x01", 2)) + std::string("\xd0\xfe\xcf\xf7\xff\x7a\x3c", 7),
            "a field tag is badly encoded"},
        // The member's length in six bytes (zero, padded), which protobuf refuses likewise.
        MalformedCase{"six_byte_length", std::string("\x12\x80\x80\x80\x80\x80\x00", 7),
                      "chunk is cut short"},
        // After a chunk, a group, which proto3 never writes.
        MalformedCase{"group", Chunk(std::string("\x28\x01", 2)) + std::string("\x0b\x0c", 2),
                      "start is cut short or badly encoded"},
        // After a chunk, a start cut short.
        MalformedCase{"outer_cut_short",
                      Chunk(std::string("\x28\x01", 2)) + std::string("\x0a\x09\x01", 3),
                      "start is cut short or badly encoded"},
        // A start cut short and no chunk: protobuf's own parser reads it, and refuses it.
        MalformedCase{"start_cut_short", std::string("\x0a\x09\x01", 3),
                      "protobuf cannot parse it"}),
    [](const testing::TestParamInfo<MalformedCase>& info) { return info.param.name; });

// Every prefix of a valid message either decodes (where it ends between fields) or is refused:
// never a crash, never rows past the bytes received.
TEST(ComputeFrameTest, EveryPrefixDecodesOrIsRefused) {
  std::mt19937 rng(17);
  v1::ComputeRequest whole;
  whole.mutable_chunk()->set_hidden(RandomBytes(300, rng));
  whole.mutable_chunk()->set_teacher_top_k_tokens(RandomBytes(40, rng));
  whole.mutable_chunk()->set_shared_rows(99);
  const std::string bytes = whole.SerializeAsString();
  for (size_t end = 0; end < bytes.size(); ++end) {
    ComputeRequestFrame received;
    const absl::Status status = received.Decode(InRandomSlices(bytes.substr(0, end), 3, rng));
    if (status.ok()) {
      for (const BulkBytes& field : received.rows)
        EXPECT_LE(field.size(), static_cast<int64_t>(end));
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    }
  }
}

// What the decoder accepts, protobuf parses, with the same rows: random changes to valid messages,
// as the fuzz target checks at length.
TEST(ComputeFrameTest, AcceptsOnlyWhatProtobufParses) {
  std::mt19937 rng(23);
  v1::ComputeRequest chunk;
  chunk.mutable_chunk()->set_hidden(RandomBytes(40, rng));
  chunk.mutable_chunk()->set_teacher_top_k_tokens(RandomBytes(12, rng));
  chunk.mutable_chunk()->set_shared_rows(5);
  v1::ComputeRequest start;
  start.mutable_start()->set_head("main");
  start.mutable_start()->add_labels(3);
  const std::string seeds[] = {chunk.SerializeAsString(), start.SerializeAsString(),
                               chunk.SerializeAsString() + start.SerializeAsString(),
                               start.SerializeAsString() + chunk.SerializeAsString()};
  std::uniform_int_distribution<int> byte(0, 255);
  // protobuf logs every string it refuses as invalid UTF-8; the refusals are what is tested.
  const google::protobuf::LogSilencer quiet;
  int accepted = 0;
  int refused = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::string bytes = seeds[trial % 4];
    const int changes = 1 + trial % 3;
    for (int c = 0; c < changes; ++c) {
      std::uniform_int_distribution<size_t> place(0, bytes.size());
      const size_t at = place(rng);
      switch (byte(rng) % 3) {
        case 0:
          if (at < bytes.size()) bytes[at] = static_cast<char>(byte(rng));
          break;
        case 1: bytes.insert(at, 1, static_cast<char>(byte(rng))); break;
        default: bytes.resize(at); break;
      }
    }
    ComputeRequestFrame received;
    if (!received.Decode(InRandomSlices(bytes, 2, rng)).ok()) {
      ++refused;
      continue;
    }
    ++accepted;
    v1::ComputeRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes)) << "accepted what protobuf refuses, trial " << trial;
    ASSERT_EQ(received.rows[kHiddenRows].ToString(), parsed.chunk().hidden()) << trial;
    ASSERT_EQ(received.rows[kTeacherTopKTokenRows].ToString(),
              parsed.chunk().teacher_top_k_tokens())
        << trial;
    ASSERT_EQ(received.message.has_chunk(), parsed.has_chunk()) << trial;
  }
  // Both outcomes were reached often enough for the check to mean something.
  EXPECT_GT(accepted, 1000);
  EXPECT_GT(refused, 1000);
}

// Field `field` of wire type 2 holding `value`, as protobuf encodes it.
std::string LengthDelimited(int field, const std::string& value) {
  std::string bytes(1, static_cast<char>(field << 3 | 2));
  for (uint64_t length = value.size();; length >>= 7) {
    bytes += static_cast<char>((length & 0x7f) | (length >= 0x80 ? 0x80 : 0));
    if (length < 0x80) break;
  }
  return bytes + value;
}

// A chunk's bytes as a client writes it (its other fields first, then its rows).
std::string ChunkBytes(const std::string& hidden, const std::string& teacher,
                       int64_t shared_rows = 0) {
  ComputeRequestFrame frame;
  frame.message.mutable_chunk()->set_shared_rows(shared_rows);
  frame.rows[kHiddenRows] = BulkBytes::Copy(hidden);
  frame.rows[kTeacherHiddenRows] = BulkBytes::Copy(teacher);
  return Flatten(frame.Encode());
}

struct FindFieldCase {
  const char* name;
  std::string message;
  size_t head;    // bytes of the message the reader has
  bool response;  // a ComputeResponse's dL/dh, else a ComputeRequest's hidden rows
  bool found;
};

class FindBulkFieldTest : public testing::TestWithParam<FindFieldCase> {};

TEST_P(FindBulkFieldTest, FindsTheFieldOnlyWhereItsFirstBytesAreInTheHead) {
  const FindFieldCase& c = GetParam();
  const std::string& bytes = c.message;
  const std::optional<BulkFieldAt> at = FindBulkField(
      {reinterpret_cast<const uint8_t*>(bytes.data()), std::min(c.head, bytes.size())},
      bytes.size(), c.response ? ComputeResponseFrame::kSpec : ComputeRequestFrame::kSpec,
      c.response ? v1::ComputeResult::kGradHiddenFieldNumber
                 : v1::ComputeChunk::kHiddenFieldNumber);
  ASSERT_EQ(at.has_value(), c.found);
  if (!c.found) return;
  EXPECT_LE(at->member_offset, at->key_offset);
  EXPECT_LT(at->key_offset, at->value_offset);
  const std::string field = bytes.substr(at->value_offset, at->value_size);
  if (c.response) {
    v1::ComputeResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes));
    EXPECT_EQ(field, parsed.result().grad_hidden());
    v1::ComputeResult before;  // the fields before dL/dh
    ASSERT_TRUE(before.ParseFromString(
        bytes.substr(at->member_offset, at->key_offset - at->member_offset)));
    EXPECT_EQ(before.row_offset(), parsed.result().row_offset());
  } else {
    v1::ComputeRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes));
    EXPECT_EQ(field, parsed.chunk().hidden());
  }
}

std::vector<FindFieldCase> FindFieldCases() {
  const std::string hidden(1000, 'h');
  const std::string teacher(300, 't');
  const std::string plain = ChunkBytes(hidden, "");
  v1::ComputeRequest start;
  start.mutable_start()->set_num_tokens(4);
  const std::string teacher_first =
      LengthDelimited(v1::ComputeRequest::kChunkFieldNumber,
                      LengthDelimited(v1::ComputeChunk::kTeacherHiddenFieldNumber, teacher) +
                          LengthDelimited(v1::ComputeChunk::kHiddenFieldNumber, hidden));
  v1::ComputeResponse result;
  result.mutable_result()->set_row_offset(4096);
  result.mutable_result()->set_num_rows(3);
  result.mutable_result()->add_token_loss(0.5f);
  result.mutable_result()->set_grad_hidden_dtype(v1::DTYPE_FLOAT32);
  const std::string server_result = Flatten(EncodeComputeResponse(result, BulkBytes::Copy(hidden)));
  v1::ComputeResponse whole = result;
  whole.mutable_result()->set_grad_hidden(hidden);
  v1::ComputeResponse summary;
  summary.mutable_summary()->set_loss(1.5);
  return {
      {"rows_alone", plain, 32, false, true},  // a chunk of rows, as the clients write it
      {"rows_then_teacher", ChunkBytes(hidden, teacher), 32, false, true},  // teacher after
      {"head_ends_right_after_the_key", plain, 6, false, true},  // key, length, key, length
      {"head_cut_inside_a_length", plain, 4, false, false},      // the rows' length not yet known
      {"a_small_field_first", ChunkBytes(hidden, "", 7), 32, false, true},  // skipped
      {"teacher_first", teacher_first, 32, false, false},        // a field before outruns the head
      {"a_start", start.SerializeAsString(), 32, false, false},  // no chunk at all
      {"bytes_after_the_chunk", plain + std::string("\x10\x01", 2), 32, false,
       false},  // the chunk is not the whole message
      {"rows_shorter_than_the_head", ChunkBytes("ab", teacher), 32, false,
       false},                                                            // the head ends past them
      {"result_as_the_server_writes_it", server_result, 64, true, true},  // small fields first
      {"result_as_protobuf_writes_it", whole.SerializeAsString(), 64, true,
       true},  // dL/dh before field 11, found all the same
      {"result_head_before_its_bytes", server_result, 16, true, false},  // too short a head
      {"a_summary", summary.SerializeAsString(), 64, true, false},       // no result
  };
}

INSTANTIATE_TEST_SUITE_P(Table, FindBulkFieldTest, testing::ValuesIn(FindFieldCases()),
                         [](const auto& info) { return std::string(info.param.name); });

// A reader that received a message's leading rows straight into their destination hands over a
// message whose rows lie there in part: decoding it and copying the rows to that destination gives
// the rows the message carried, the placed bytes untouched, the rest copied after them; and where
// the chunk sets its rows again later (protobuf keeps the last), those are what land.
TEST(ComputeFrameTest, RowsReceivedInPlaceDecodeAndCopyAsTheMessageSays) {
  std::mt19937 rng(7);
  for (const bool rows_twice : {false, true}) {
    SCOPED_TRACE(rows_twice ? "rows twice" : "rows once");
    const std::string hidden = RandomBytes(4096, rng);
    const std::string later_rows = RandomBytes(4096, rng);
    const std::string bytes = LengthDelimited(
        v1::ComputeRequest::kChunkFieldNumber,
        LengthDelimited(v1::ComputeChunk::kHiddenFieldNumber, hidden) +
            LengthDelimited(v1::ComputeChunk::kTeacherHiddenFieldNumber, RandomBytes(512, rng)) +
            (rows_twice ? LengthDelimited(v1::ComputeChunk::kHiddenFieldNumber, later_rows) : ""));
    const std::optional<BulkFieldAt> rows =
        FindBulkField({reinterpret_cast<const uint8_t*>(bytes.data()), 32}, bytes.size(),
                      ComputeRequestFrame::kSpec, v1::ComputeChunk::kHiddenFieldNumber);
    ASSERT_TRUE(rows.has_value());
    ASSERT_EQ(bytes.substr(rows->value_offset, rows->value_size), hidden);
    std::vector<uint8_t> destination(3000);  // room for part of the rows
    const size_t placed = destination.size();
    std::memcpy(destination.data(), bytes.data() + rows->value_offset, placed);
    const grpc::Slice pieces[] = {
        grpc::Slice(bytes.data(), rows->value_offset),
        grpc::Slice(destination.data(), placed, grpc::Slice::STATIC_SLICE),
        grpc::Slice(bytes.data() + rows->value_offset + placed,
                    bytes.size() - rows->value_offset - placed),
    };
    ComputeRequestFrame received;
    ASSERT_TRUE(received.Decode(grpc::ByteBuffer(pieces, 3)).ok());
    const BulkBytes& got = received.rows[kHiddenRows];
    const std::string& expected = rows_twice ? later_rows : hidden;
    ASSERT_EQ(got.size(), static_cast<int64_t>(expected.size()));
    if (!rows_twice) EXPECT_EQ(got.slices().front().begin(), destination.data());
    got.CopyTo(0, static_cast<int64_t>(placed), destination.data());
    std::string rest(expected.size() - placed, '\0');
    got.CopyTo(static_cast<int64_t>(placed), static_cast<int64_t>(rest.size()), rest.data());
    EXPECT_EQ(std::string(destination.begin(), destination.end()) + rest, expected);
  }
}

TEST(MessageBufferPoolTest, ReusesABufferOnceGrpcLetsGoOfIt) {
  std::shared_ptr<MessageBufferPool> pool = MessageBufferPool::Create();
  const std::string rows(1 << 20, 'r');
  const uint8_t* first_memory = nullptr;
  {
    const BulkBytes first = pool->Copy(rows);
    ASSERT_EQ(first.slices().size(), 1u);
    first_memory = first.slices()[0].begin();
    EXPECT_EQ(first.ToString(), rows);
    EXPECT_EQ(pool->idle_buffers(), 0);
  }
  EXPECT_EQ(pool->idle_buffers(), 1);
  {
    const std::string other(1 << 20, 'o');
    const BulkBytes second = pool->Copy(other);
    EXPECT_EQ(second.slices()[0].begin(), first_memory);
    EXPECT_EQ(second.ToString(), other);
  }
  // A slice outlives the pool's owner: it keeps the pool until gRPC lets go of it.
  BulkBytes kept = pool->Copy(rows);
  const std::weak_ptr<MessageBufferPool> weak = pool;
  pool.reset();
  EXPECT_FALSE(weak.expired());
  EXPECT_EQ(kept.ToString(), rows);
  kept.Clear();
  EXPECT_TRUE(weak.expired());
}

}  // namespace
}  // namespace lossd::wire
