#include "lossd/storage/safetensors.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lossd/kernels/half.h"
#include "nlohmann/json.hpp"
#include "tests/scratch_files.h"

namespace lossd::storage {
namespace {

using ::lossd::testing::ReadFile;
using ::lossd::testing::ScratchDir;
using ::lossd::testing::WriteFile;

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::StartsWith;

std::vector<float> RandomFloats(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> values(count);
  for (float& value : values) value = normal(rng);
  return values;
}

// Little-endian bytes of `values` in `dtype`, rounded as half.h rounds.
std::vector<uint8_t> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t bits =
          dtype == DType::kBFloat16 ? FloatToBFloat16(values[i]) : FloatToFloat16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &bits, 2);
    }
  }
  return bytes;
}

std::vector<float> DecodeFloat32(const std::vector<uint8_t>& bytes) {
  std::vector<float> values(bytes.size() / 4);
  std::memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

std::string LittleEndian64(uint64_t value) {
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  return bytes;
}

// A file with this header text and `data_bytes` zero bytes of data.
std::string FileWithHeader(const std::string& header, size_t data_bytes) {
  return LittleEndian64(header.size()) + header + std::string(data_bytes, '\0');
}

uint32_t FreshSeed() { return std::random_device{}(); }

class SafetensorsRoundTripTest : public ::testing::TestWithParam<DType> {};

TEST_P(SafetensorsRoundTripTest, WritesAndReadsBackRandomTensorsBitForBit) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const DType dtype = GetParam();
  const int64_t rows = std::uniform_int_distribution<int64_t>(1, 64)(rng);
  const int64_t cols = std::uniform_int_distribution<int64_t>(1, 33)(rng);
  const std::vector<uint8_t> weight = Encode(RandomFloats(rows * cols, rng), dtype);
  const std::vector<uint8_t> bias = Encode(RandomFloats(rows, rng), dtype);
  const std::string dtype_name = *DTypeToSafetensors(dtype);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "round trip"}};

  ScratchDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string path = dir.File("model.safetensors");
  ASSERT_TRUE(WriteSafetensorsAtomically(
                  path,
                  {{"lm_head.weight", dtype_name, {rows, cols}, weight.data(), weight.size()},
                   {"lm_head.bias", dtype_name, {rows}, bias.data(), bias.size()}},
                  metadata)
                  .ok());
  EXPECT_EQ(dir.Names(), std::set<std::string>{"model.safetensors"});

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->TensorNames(), (std::vector<std::string>{"lm_head.bias", "lm_head.weight"}));
  EXPECT_EQ(file->metadata(), metadata);
  absl::StatusOr<TensorRef> tensor = file->Tensor("lm_head.weight");
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_EQ(tensor->name, "lm_head.weight");
  EXPECT_EQ(tensor->dtype, dtype_name);
  EXPECT_EQ(tensor->shape, (std::vector<int64_t>{rows, cols}));
  ASSERT_EQ(tensor->bytes, weight.size());
  EXPECT_EQ(std::memcmp(tensor->data, weight.data(), weight.size()), 0);

  absl::StatusOr<std::vector<uint8_t>> same = ReadAsDType(*tensor, dtype);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(*same, weight);

  // A moved file keeps serving the same bytes.
  SafetensorsFile moved = *std::move(file);
  absl::StatusOr<TensorRef> bias_ref = moved.Tensor("lm_head.bias");
  ASSERT_TRUE(bias_ref.ok()) << bias_ref.status();
  EXPECT_EQ(std::vector<uint8_t>(bias_ref->data, bias_ref->data + bias_ref->bytes), bias);

  // The same bytes through FromBytes.
  absl::StatusOr<SafetensorsFile> in_memory = SafetensorsFile::FromBytes(ReadFile(path));
  ASSERT_TRUE(in_memory.ok()) << in_memory.status();
  absl::StatusOr<TensorRef> from_memory = in_memory->Tensor("lm_head.weight");
  ASSERT_TRUE(from_memory.ok());
  EXPECT_EQ(std::memcmp(from_memory->data, weight.data(), weight.size()), 0);
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, SafetensorsRoundTripTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const ::testing::TestParamInfo<DType>& param_info) {
                           return std::string(DTypeName(param_info.param));
                         });

TEST(SafetensorsTest, ReadAsDTypeConvertsLikeHalfH) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const std::vector<float> values = RandomFloats(257, rng);
  for (const DType source : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const std::vector<uint8_t> encoded = Encode(values, source);
    const TensorRef tensor{"t", *DTypeToSafetensors(source), {257}, encoded.data(), encoded.size()};
    absl::StatusOr<std::vector<uint8_t>> as_float = ReadAsDType(tensor, DType::kFloat32);
    ASSERT_TRUE(as_float.ok()) << as_float.status();
    const std::vector<float> decoded = DecodeFloat32(*as_float);
    for (const DType target : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(source) << " -> " << DTypeName(target));
      absl::StatusOr<std::vector<uint8_t>> converted = ReadAsDType(tensor, target);
      ASSERT_TRUE(converted.ok()) << converted.status();
      // Every conversion goes through the exact fp32 value of the source element.
      EXPECT_EQ(*converted, source == target ? encoded : Encode(decoded, target));
    }
  }
}

TEST(SafetensorsTest, ReadAsDTypeRefusesOtherDTypes) {
  const std::vector<uint8_t> bytes(16);
  const TensorRef tensor{"token_ids", "I64", {2}, bytes.data(), bytes.size()};
  const absl::Status status = ReadAsDType(tensor, DType::kFloat32).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("'token_ids'"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("I64"));

  const TensorRef inconsistent{"w", "F32", {3}, bytes.data(), bytes.size()};
  EXPECT_EQ(ReadAsDType(inconsistent, DType::kFloat32).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, DTypeHelpers) {
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    absl::StatusOr<std::string> name = DTypeToSafetensors(dtype);
    ASSERT_TRUE(name.ok());
    EXPECT_EQ(*DTypeFromSafetensors(*name), dtype);
    EXPECT_EQ(*SafetensorsDTypeSize(*name), DTypeSize(dtype));
  }
  EXPECT_EQ(DTypeFromSafetensors("F64").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DTypeFromSafetensors("f32").status().code(), absl::StatusCode::kInvalidArgument);
  const std::map<std::string, size_t> sizes = {
      {"F64", 8},     {"F32", 4},     {"F16", 2}, {"BF16", 2}, {"I64", 8},
      {"I32", 4},     {"I16", 2},     {"I8", 1},  {"U8", 1},   {"BOOL", 1},
      {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"U16", 2}, {"U32", 4},  {"U64", 8}};
  for (const auto& [name, size] : sizes) EXPECT_EQ(*SafetensorsDTypeSize(name), size) << name;
  EXPECT_FALSE(SafetensorsDTypeSize("F128").ok());
}

// A file assembled byte by byte from the format description, shaped like a Hugging Face export.
TEST(SafetensorsTest, ReadsHandBuiltHuggingFaceFile) {
  const std::string json =
      R"({"__metadata__":{"format":"pt"},)"
      R"("lm_head.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},)"
      R"("model.embed_tokens.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[12,36]}})";
  const uint16_t bf16_bits[6] = {0x3f80, 0xc000, 0x3f00, 0x4040, 0xbe80, 0x3fc0};
  const float bf16_values[6] = {1.0f, -2.0f, 0.5f, 3.0f, -0.25f, 1.5f};
  const uint32_t f32_bits[6] = {0x3f800000, 0xbf800000, 0x3f000000,
                                0x40000000, 0x3e800000, 0xc0400000};
  const float f32_values[6] = {1.0f, -1.0f, 0.5f, 2.0f, 0.25f, -3.0f};

  // Padded as the reference writer does, and unpadded as some others do (then the data is
  // unaligned).
  for (const bool padded : {true, false}) {
    SCOPED_TRACE(padded ? "padded header" : "unpadded header");
    std::string header = json;
    if (padded) header.append((8 - header.size() % 8) % 8, ' ');
    std::string bytes;
    for (int i = 0; i < 8; ++i)
      bytes.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));
    bytes += header;
    for (const uint16_t bits : bf16_bits) {
      bytes.push_back(static_cast<char>(bits & 0xff));
      bytes.push_back(static_cast<char>(bits >> 8));
    }
    for (const uint32_t bits : f32_bits) {
      for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
    }

    ScratchDir dir;
    const std::string path = dir.File("model.safetensors");
    WriteFile(path, bytes);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(file->TensorNames(),
              (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight"}));
    EXPECT_EQ(file->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));

    absl::StatusOr<TensorRef> head = file->Tensor("lm_head.weight");
    ASSERT_TRUE(head.ok()) << head.status();
    EXPECT_EQ(head->dtype, "BF16");
    EXPECT_EQ(head->shape, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(head->bytes, 12u);
    absl::StatusOr<std::vector<uint8_t>> head_f32 = ReadAsDType(*head, DType::kFloat32);
    ASSERT_TRUE(head_f32.ok()) << head_f32.status();
    EXPECT_EQ(DecodeFloat32(*head_f32), std::vector<float>(bf16_values, bf16_values + 6));

    absl::StatusOr<TensorRef> embed = file->Tensor("model.embed_tokens.weight");
    ASSERT_TRUE(embed.ok()) << embed.status();
    absl::StatusOr<std::vector<uint8_t>> embed_f32 = ReadAsDType(*embed, DType::kFloat32);
    ASSERT_TRUE(embed_f32.ok());
    EXPECT_EQ(DecodeFloat32(*embed_f32), std::vector<float>(f32_values, f32_values + 6));
    absl::StatusOr<std::vector<uint8_t>> embed_bf16 = ReadAsDType(*embed, DType::kBFloat16);
    ASSERT_TRUE(embed_bf16.ok());
    const uint16_t expected_bf16[6] = {0x3f80, 0xbf80, 0x3f00, 0x4000, 0x3e80, 0xc040};
    EXPECT_EQ(std::memcmp(embed_bf16->data(), expected_bf16, sizeof expected_bf16), 0);
  }
}

TEST(SafetensorsTest, SerializationIsDeterministicAndAligned) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<TensorToWrite> tensors;
  const std::vector<std::pair<std::string, std::string>> specs = {
      {"mask", "BOOL"}, {"ids", "U8"}, {"scale", "F64"},  {"half", "F16"}, {"brain", "BF16"},
      {"count", "I32"}, {"w", "F32"},  {"f8", "F8_E4M3"}, {"big", "U64"},  {"empty", "F32"}};
  for (const auto& [name, dtype] : specs) {
    const int64_t count = name == "empty" ? 0 : std::uniform_int_distribution<int64_t>(1, 9)(rng);
    std::vector<uint8_t> bytes(count * *SafetensorsDTypeSize(dtype));
    for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(rng());
    buffers.push_back(std::move(bytes));
    tensors.push_back({name, dtype, {count}, buffers.back().data(), buffers.back().size()});
  }
  const std::map<std::string, std::string> metadata = {{"b", "2"}, {"a", "1"}};
  absl::StatusOr<std::string> forward = SerializeSafetensors(tensors, metadata);
  ASSERT_TRUE(forward.ok()) << forward.status();
  std::vector<TensorToWrite> reversed(tensors.rbegin(), tensors.rend());
  absl::StatusOr<std::string> backward = SerializeSafetensors(reversed, metadata);
  ASSERT_TRUE(backward.ok());
  EXPECT_EQ(*forward, *backward);

  ScratchDir dir;
  const std::string path = dir.File("mixed.safetensors");
  ASSERT_TRUE(WriteSafetensorsAtomically(path, reversed, metadata).ok());
  EXPECT_EQ(ReadFile(path), *forward);

  uint64_t header_length = 0;
  std::memcpy(&header_length, forward->data(), 8);
  EXPECT_EQ(header_length % 8, 0u);
  const nlohmann::json header = nlohmann::json::parse(forward->substr(8, header_length));
  for (const TensorToWrite& tensor : tensors) {
    const uint64_t begin = header[tensor.name]["data_offsets"][0].get<uint64_t>();
    EXPECT_EQ(begin % *SafetensorsDTypeSize(tensor.dtype), 0u) << tensor.name << " is unaligned";
  }
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::FromBytes(*forward);
  ASSERT_TRUE(file.ok()) << file.status();
  for (const TensorToWrite& tensor : tensors) {
    absl::StatusOr<TensorRef> read = file->Tensor(tensor.name);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->bytes, tensor.bytes);
    if (tensor.bytes > 0) {
      EXPECT_EQ(std::memcmp(read->data, tensor.data, tensor.bytes), 0) << tensor.name;
    }
  }
}

TEST(SafetensorsTest, MissingTensorListsSomeNames) {
  std::vector<TensorToWrite> tensors;
  const float value = 1.0f;
  for (int i = 0; i < 15; ++i) {
    tensors.push_back({absl::StrCat("t", i < 10 ? "0" : "", i), "F32", {1}, &value, sizeof value});
  }
  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::FromBytes(*SerializeSafetensors(tensors, {}), "x.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  const absl::Status status = file->Tensor("lm_head.weight").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(status.message()),
              StartsWith("x.safetensors: no tensor 'lm_head.weight'"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("15 tensors"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("'t00'"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("'t09'"));
  EXPECT_THAT(std::string(status.message()), ::testing::Not(HasSubstr("'t10'")));
  EXPECT_THAT(std::string(status.message()), HasSubstr("and 5 more"));
}

struct MalformedCase {
  std::string id;
  std::string reason;  // why the file is invalid
  std::string bytes;
  absl::StatusCode code;
  std::vector<std::string> fragments;  // what the message must name
};

std::vector<MalformedCase> MalformedCases() {
  const auto header = [](const std::string& json, size_t data_bytes) {
    return FileWithHeader(json, data_bytes);
  };
  // A file whose only tensor 'w' has these fields.
  const auto w = [](const std::string& fields, size_t data_bytes) {
    return FileWithHeader(absl::StrCat(R"({"w":{)", fields, "}}"), data_bytes);
  };
  const std::string a_then_b =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32",)";
  const absl::StatusCode invalid = absl::StatusCode::kInvalidArgument;
  const absl::StatusCode data_loss = absl::StatusCode::kDataLoss;
  // clang-format off
  return {
      {"empty_file", "no room for the length field", "", data_loss, {"8-byte header length"}},
      {"seven_bytes", "length field cut short", std::string(7, '\0'), data_loss, {"8-byte header length"}},
      {"header_past_end", "length says 1000 bytes, 10 follow", LittleEndian64(1000) + std::string(10, ' '),
       data_loss, {"header length 1000", "truncated"}},
      {"header_absurd", "length beyond the 100 MB limit", LittleEndian64(uint64_t{1} << 40),
       invalid, {"header length", "limit"}},
      {"header_max_u64", "length 2^64-1 must not overflow the bounds check", LittleEndian64(~uint64_t{0}),
       invalid, {"header length", "limit"}},
      {"header_empty", "zero-length header is not JSON",
       header("", 0), invalid, {"header", "not valid JSON"}},
      {"not_json", "garbage instead of JSON", header("{not json", 0), invalid, {"header", "not valid JSON"}},
      {"invalid_utf8", "tensor name with a bare 0xff byte", header("{\"w\xff\":{}}", 0),
       invalid, {"header", "not valid JSON"}},
      {"top_level_array", "header must be an object", header("[1,2]", 0),
       invalid, {"header", "expected a JSON object"}},
      {"entry_not_object", "tensor entry is a number", header(R"({"w":5})", 0),
       invalid, {"tensor 'w'", "expected an object"}},
      {"dtype_missing", "no dtype", w(R"("shape":[2],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "dtype"}},
      {"dtype_not_string", "dtype is a number", w(R"("dtype":32,"shape":[2],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "dtype"}},
      {"dtype_unknown", "F128 is no safetensors dtype",
       w(R"("dtype":"F128","shape":[2],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "dtype", "F128"}},
      {"dtype_lowercase", "dtype names are case-sensitive",
       w(R"("dtype":"f32","shape":[2],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "dtype"}},
      {"shape_missing", "no shape", w(R"("dtype":"F32","data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "shape"}},
      {"shape_not_list", "shape is a number", w(R"("dtype":"F32","shape":2,"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "shape"}},
      {"shape_nested", "a list where a dimension belongs",
       w(R"("dtype":"F32","shape":[[2]],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "shape"}},
      {"shape_negative", "negative dimension", w(R"("dtype":"F32","shape":[-2,-1],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "shape", "-2"}},
      {"shape_float", "dimension written as a float",
       w(R"("dtype":"F32","shape":[2.0],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "shape"}},
      {"shape_string", "dimension written as a string",
       w(R"("dtype":"F32","shape":["2"],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "shape"}},
      {"shape_beyond_int64", "dimension above INT64_MAX",
       w(R"("dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "shape"}},
      {"shape_overflow", "element count times size overflows 64 bits",
       w(R"("dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "shape", "overflows"}},
      {"offsets_missing", "no data_offsets", w(R"("dtype":"F32","shape":[2])", 8),
       invalid, {"tensor 'w'", "data_offsets"}},
      {"offsets_one", "one offset instead of two", w(R"("dtype":"F32","shape":[2],"data_offsets":[8])", 8),
       invalid, {"tensor 'w'", "data_offsets"}},
      {"offsets_three", "three offsets instead of two",
       w(R"("dtype":"F32","shape":[2],"data_offsets":[0,8,16])", 16),
       invalid, {"tensor 'w'", "data_offsets"}},
      {"offsets_negative", "negative begin", w(R"("dtype":"F32","shape":[2],"data_offsets":[-1,7])", 8),
       invalid, {"tensor 'w'", "data_offsets"}},
      {"offsets_float", "offsets written as floats",
       w(R"("dtype":"F32","shape":[2],"data_offsets":[0.0,8.0])", 8),
       invalid, {"tensor 'w'", "data_offsets"}},
      {"offsets_reversed", "end before begin", w(R"("dtype":"F32","shape":[2],"data_offsets":[8,0])", 8),
       invalid, {"tensor 'w'", "data_offsets [8, 0)"}},
      {"offsets_past_buffer", "end beyond the data buffer (truncated data)",
       w(R"("dtype":"F32","shape":[4],"data_offsets":[0,16])", 8),
       data_loss, {"tensor 'w'", "data_offsets [0, 16)", "8 bytes"}},
      {"offsets_size_mismatch", "byte range shorter than the shape needs",
       w(R"("dtype":"F32","shape":[4],"data_offsets":[0,8])", 8),
       invalid, {"tensor 'w'", "data_offsets [0, 8)", "shape [4] of F32 (16 bytes)"}},
      {"gap", "bytes between two tensors belong to neither",
       header(a_then_b + R"("shape":[2],"data_offsets":[12,20]}})", 20),
       invalid, {"tensor 'b'", "data_offsets [12, 20)", "gap"}},
      {"overlap", "two tensors share bytes",
       header(a_then_b + R"("shape":[2],"data_offsets":[4,12]}})", 12),
       invalid, {"tensor 'b'", "data_offsets [4, 12)", "overlap"}},
      {"trailing_bytes", "data after the last tensor",
       w(R"("dtype":"F32","shape":[2],"data_offsets":[0,8])", 12),
       invalid, {"data buffer", "4 bytes"}},
      {"metadata_not_object", "__metadata__ is a list", header(R"({"__metadata__":[1]})", 0),
       invalid, {"__metadata__", "expected an object"}},
      {"metadata_value_not_string", "__metadata__ values must be strings",
       header(R"({"__metadata__":{"epoch":3}})", 0),
       invalid, {"__metadata__", "'epoch'", "expected a string"}},
  };
  // clang-format on
}

class MalformedHeaderTest : public ::testing::TestWithParam<MalformedCase> {};

TEST_P(MalformedHeaderTest, IsRejectedNamingTheField) {
  const MalformedCase& c = GetParam();
  SCOPED_TRACE(c.reason);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::FromBytes(c.bytes, "bad.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), c.code) << file.status();
  EXPECT_THAT(std::string(file.status().message()), StartsWith("bad.safetensors: "));
  for (const std::string& fragment : c.fragments)
    EXPECT_THAT(std::string(file.status().message()), HasSubstr(fragment));

  // The mmap path must agree.
  ScratchDir dir;
  const std::string path = dir.File("bad.safetensors");
  WriteFile(path, c.bytes);
  const absl::Status from_disk = SafetensorsFile::Open(path).status();
  EXPECT_EQ(from_disk.code(), c.code) << from_disk;
  EXPECT_THAT(std::string(from_disk.message()), StartsWith(path + ": "));
}

INSTANTIATE_TEST_SUITE_P(Cases, MalformedHeaderTest, ::testing::ValuesIn(MalformedCases()),
                         [](const ::testing::TestParamInfo<MalformedCase>& param_info) {
                           return param_info.param.id;
                         });

TEST(SafetensorsTest, SizeMismatchMessageNamesEverything) {
  const std::string bytes = FileWithHeader(
      R"({"lm_head.weight":{"dtype":"BF16","shape":[10,4],"data_offsets":[0,100]}})", 100);
  const absl::Status status = SafetensorsFile::FromBytes(bytes, "model.safetensors").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "model.safetensors: tensor 'lm_head.weight': data_offsets [0, 100) do not match shape "
            "[10, 4] of "
            "BF16 (80 bytes)");
}

std::string ValidTestFile(std::mt19937& rng) {
  const std::vector<float> a = RandomFloats(24, rng), b = RandomFloats(7, rng);
  const std::vector<uint8_t> b_bf16 = Encode(b, DType::kBFloat16);
  absl::StatusOr<std::string> bytes =
      SerializeSafetensors({{"a", "F32", {4, 6}, a.data(), a.size() * 4},
                            {"b", "BF16", {7}, b_bf16.data(), b_bf16.size()},
                            {"empty", "F16", {0, 3}, nullptr, 0}},
                           {{"format", "pt"}});
  return bytes.ok() ? *bytes : "";
}

TEST(SafetensorsTest, EveryTruncationIsDataLoss) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const std::string whole = ValidTestFile(rng);
  ASSERT_FALSE(whole.empty());
  ASSERT_TRUE(SafetensorsFile::FromBytes(whole).ok());
  ScratchDir dir;
  const std::string path = dir.File("cut.safetensors");
  for (size_t cut = 0; cut < whole.size(); ++cut) {
    SCOPED_TRACE(::testing::Message() << "cut at " << cut << " of " << whole.size());
    const absl::Status status = SafetensorsFile::FromBytes(whole.substr(0, cut)).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    if (cut % 5 == 0) {
      WriteFile(path, whole.substr(0, cut));
      EXPECT_EQ(SafetensorsFile::Open(path).status().code(), absl::StatusCode::kDataLoss);
    }
  }
}

// A miniature fuzzer: damaged files must load cleanly or fail with a status, never crash or read
// outside the buffer (run under ASan to make the latter visible).
TEST(SafetensorsTest, RandomlyDamagedFilesNeverCrash) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const std::string whole = ValidTestFile(rng);
  ASSERT_FALSE(whole.empty());
  const std::string printable = "{}[]\",:0123456789-.eE \\u";
  int loaded = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string damaged = whole;
    const int edits = std::uniform_int_distribution<int>(1, 4)(rng);
    for (int e = 0; e < edits; ++e) {
      const size_t at = std::uniform_int_distribution<size_t>(0, damaged.size() - 1)(rng);
      damaged[at] = (rng() & 1) ? static_cast<char>(rng()) : printable[rng() % printable.size()];
    }
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::FromBytes(std::move(damaged));
    if (!file.ok()) {
      EXPECT_TRUE(file.status().code() == absl::StatusCode::kInvalidArgument ||
                  file.status().code() == absl::StatusCode::kDataLoss)
          << file.status();
      continue;
    }
    ++loaded;
    for (const std::string& name : file->TensorNames()) {
      absl::StatusOr<TensorRef> tensor = file->Tensor(name);
      ASSERT_TRUE(tensor.ok());
      const std::vector<uint8_t> copy(tensor->data, tensor->data + tensor->bytes);
      EXPECT_EQ(copy.size(), tensor->bytes);
      const absl::StatusOr<std::vector<uint8_t>> converted = ReadAsDType(*tensor, DType::kFloat32);
      EXPECT_TRUE(converted.ok() ||
                  converted.status().code() == absl::StatusCode::kInvalidArgument);
    }
  }
  // Damage to the data buffer leaves the structure valid, so some trials must still load.
  EXPECT_GT(loaded, 0);
}

class AtomicWriteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    const uint32_t seed = FreshSeed();
    seed_trace_.emplace(__FILE__, __LINE__, ::testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    old_values_ = RandomFloats(64, rng);
    new_values_ = RandomFloats(1 << 18, rng);  // 1 MiB
    path_ = dir_.File("head.safetensors");
    ASSERT_TRUE(
        WriteSafetensorsAtomically(path_, {Tensor("w", old_values_)}, {{"version", "1"}}).ok());
    old_bytes_ = ReadFile(path_);
  }

  static TensorToWrite Tensor(const std::string& name, const std::vector<float>& values) {
    return {name,
            "F32",
            {static_cast<int64_t>(values.size())},
            values.data(),
            values.size() * sizeof(float)};
  }

  // The old file is untouched and no temporary file remains.
  void ExpectOldFileIntact() {
    EXPECT_EQ(dir_.Names(), std::set<std::string>{"head.safetensors"});
    EXPECT_EQ(ReadFile(path_), old_bytes_);
  }

  ScratchDir dir_;
  std::optional<::testing::ScopedTrace> seed_trace_;
  std::vector<float> old_values_, new_values_;
  std::string path_;
  std::string old_bytes_;
};

TEST_F(AtomicWriteTest, ReplacesTheFileAndLeavesNoTemporaryFile) {
  ASSERT_TRUE(
      WriteSafetensorsAtomically(path_, {Tensor("w", new_values_)}, {{"version", "2"}}).ok());
  EXPECT_EQ(dir_.Names(), std::set<std::string>{"head.safetensors"});
  EXPECT_EQ(ReadFile(path_), *SerializeSafetensors({Tensor("w", new_values_)}, {{"version", "2"}}));
}

TEST_F(AtomicWriteTest, FailedWriteKeepsTheOldFile) {
  // A file-size limit makes write() fail with EFBIG part way through the 1 MiB of data: a genuine
  // half-written temporary file, which must never reach the target name.
  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const sighandler_t saved_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limited = saved;
  limited.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  const absl::Status status = WriteSafetensorsAtomically(path_, {Tensor("w", new_values_)}, {});
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, saved_handler);

  EXPECT_FALSE(status.ok());
  EXPECT_THAT(std::string(status.message()), HasSubstr("write failed"));
  ExpectOldFileIntact();
}

TEST_F(AtomicWriteTest, FailedRenameLeavesNoTemporaryFile) {
  const std::string target = dir_.File("occupied");
  ASSERT_TRUE(fs::create_directory(target));
  WriteFile(target + "/keep", "x");
  const absl::Status status = WriteSafetensorsAtomically(target, {Tensor("w", new_values_)}, {});
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(std::string(status.message()), HasSubstr("rename"));
  EXPECT_EQ(dir_.Names(), (std::set<std::string>{"head.safetensors", "occupied"}));
  EXPECT_EQ(ReadFile(target + "/keep"), "x");
}

TEST_F(AtomicWriteTest, MissingDirectoryIsNotFound) {
  const std::string path = dir_.File("no/such/dir/head.safetensors");
  const absl::Status status = WriteSafetensorsAtomically(path, {Tensor("w", new_values_)}, {});
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  ExpectOldFileIntact();
}

TEST_F(AtomicWriteTest, InvalidTensorsWriteNothing) {
  const float one = 1.0f;
  // clang-format off
  const struct {
    const char* reason;
    std::vector<TensorToWrite> tensors;
    const char* fragment;
  } cases[] = {
      {"byte count disagrees with the shape", {{"w", "F32", {2}, &one, 4}}, "4 bytes given for shape [2]"},
      {"unknown dtype", {{"w", "F42", {1}, &one, 4}}, "F42"},
      {"negative dimension", {{"w", "F32", {-1}, &one, 4}}, "negative"},
      {"null data", {{"w", "F32", {1}, nullptr, 4}}, "null"},
      {"same name twice", {{"w", "F32", {1}, &one, 4}, {"w", "F32", {1}, &one, 4}}, "twice"},
      {"reserved name", {{"__metadata__", "F32", {1}, &one, 4}}, "reserved"},
      {"name not UTF-8", {{"w\xff", "F32", {1}, &one, 4}}, "UTF-8"},
  };
  // clang-format on

  for (const auto& c : cases) {
    SCOPED_TRACE(c.reason);
    const absl::Status status = WriteSafetensorsAtomically(path_, c.tensors, {});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.fragment));
    ExpectOldFileIntact();
  }
}

}  // namespace
}  // namespace lossd::storage
