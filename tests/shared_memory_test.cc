// Shared memory (SharedMemory in lossd.proto) against clients that misbehave on purpose, through a
// real server on loopback: malformed requests on the handover socket, handles that are guessed,
// stale or revoked, layouts that do not fit, rows rewritten while the calls that read them run,
// and a sparse memfd far larger than the call. Users other than the server's are covered by
// python/test_shared_memory_users.py. Cases and figures: ROBUSTNESS.md.
#include <dirent.h>
#include <fcntl.h>
#include <google/protobuf/unknown_field_set.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cpp/shared_buffer.h"
#include "lossd/common/unique_fd.h"
#include "lossd/kernels/half.h"
#include "server/shm/handover_socket.h"
#include "server/shm/shared_memory.h"
#include "tests/engine_harness.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

using grpc::StatusCode;

constexpr int64_t kVocab = 2999;
constexpr int64_t kHidden = 48;
constexpr char kHead[] = "shm";

std::string SocketName(v1::LossService::Stub& stub) {
  grpc::ClientContext context;
  v1::SharedMemorySocket response;
  const grpc::Status status = stub.GetSharedMemorySocket(&context, {}, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response.abstract_name();
}

std::shared_ptr<client::HandoverConnection> OpenHandover(v1::LossService::Stub& stub) {
  auto connection = client::HandoverConnection::Connect(SocketName(stub));
  EXPECT_TRUE(connection.ok()) << connection.status();
  return connection.ok() ? *connection : nullptr;
}

// A memfd of `bytes` with `seals` added, as a client makes one (F_SEAL_SHRINK) or not.
UniqueFd MakeMemfd(uint64_t bytes, int seals, const char* name = "lossd-test") {
  UniqueFd fd(memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(ftruncate(fd.get(), static_cast<off_t>(bytes)), 0);
  if (seals != 0) {
    EXPECT_EQ(fcntl(fd.get(), F_ADD_SEALS, seals), 0);
  }
  return fd;
}

// Writes `bytes` at the start of the memfd, through a descriptor of its own that may write; false
// where the memfd is sealed against writes.
bool Fill(const UniqueFd& memfd, const std::string& bytes, off_t offset = 0) {
  const UniqueFd writable(
      open(absl::StrCat("/proc/self/fd/", memfd.get()).c_str(), O_RDWR | O_CLOEXEC));
  return writable.valid() && pwrite(writable.get(), bytes.data(), bytes.size(), offset) ==
                                 static_cast<ssize_t>(bytes.size());
}

std::string ReadAll(const UniqueFd& memfd) {
  struct stat info;
  if (fstat(memfd.get(), &info) != 0) return "";
  std::string bytes(static_cast<size_t>(info.st_size), '\0');
  const ssize_t n = pread(memfd.get(), bytes.data(), bytes.size(), 0);
  bytes.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return bytes;
}

// Descriptors open in this process (the server's among them).
int OpenDescriptors() {
  int count = 0;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  while (readdir(dir) != nullptr) ++count;
  closedir(dir);
  return count;
}

std::vector<float> RandomNormal(int64_t count, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> values(count);
  for (float& value : values) value = normal(rng);
  return values;
}

std::vector<int64_t> RandomLabels(int64_t count, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> token(0, kVocab - 1);
  std::vector<int64_t> labels(count);
  for (int64_t& label : labels) label = token(rng);
  return labels;
}

// A training call on `rows` fp32 rows at offset 0 of a memfd, dL/dh right after them.
v1::ComputeStart TrainingStart(const std::string& head, const std::vector<int64_t>& labels,
                               const std::string& handle, v1::DType dtype = v1::DTYPE_FLOAT32) {
  v1::ComputeStart start;
  start.set_head(head);
  start.set_num_tokens(static_cast<int64_t>(labels.size()));
  start.set_hidden_size(kHidden);
  start.set_hidden_dtype(dtype);
  for (int64_t label : labels) start.add_labels(label);
  start.mutable_outputs()->set_token_loss(true);
  start.mutable_outputs()->set_grad_hidden(true);
  start.mutable_outputs()->set_grad_hidden_dtype(v1::DTYPE_FLOAT32);
  start.mutable_outputs()->set_accumulate_grad_weight(true);
  v1::SharedMemory& shared = *start.mutable_shared_memory();
  shared.set_handle(handle);
  const uint64_t row_bytes = kHidden * (dtype == v1::DTYPE_FLOAT32 ? 4 : 2);
  shared.set_grad_hidden_offset((labels.size() * row_bytes + 63) / 64 * 64);
  return start;
}

class SharedMemoryTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // About 80 rows of this head per engine chunk: a few hundred rows run as several.
    server_ = StartTestServer(MultiChunkDemoConfig(kHead, kVocab, kHidden, 5)).release();
    ASSERT_NE(server_, nullptr);
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    rng_.seed(FreshSeed());
    stub_ = ConnectTo(server_->port());
  }

  // A fresh head of random W, so that tests share no gradient.
  std::vector<float> UploadHead(const std::string& head) {
    std::vector<float> weight =
        RandomNormal(kVocab * kHidden, 1.0f / std::sqrt(float{kHidden}), rng_);
    EXPECT_TRUE(Upload(*stub_, head, kVocab, kHidden, weight, /*replace=*/true).ok());
    return weight;
  }
  std::vector<float> Gradient(const std::string& head) {
    FetchedTensor fetched = Fetch(*stub_, head, /*gradient=*/true);
    EXPECT_TRUE(fetched.status.ok()) << fetched.status.error_message();
    return fetched.values;
  }
  int64_t AccumulatedTokens(const std::string& head) {
    grpc::ClientContext context;
    v1::GetHeadRequest request;
    request.set_head(head);
    v1::HeadInfo info;
    EXPECT_TRUE(stub_->GetHead(&context, request, &info).ok());
    return info.accumulated_tokens();
  }

  static server::LossServer* server_;
  std::unique_ptr<v1::LossService::Stub> stub_;
  std::mt19937_64 rng_;
};

server::LossServer* SharedMemoryTest::server_ = nullptr;

// ---------------------------------------------------------------------------------------------
// Calls whose shared memory does not fit: refused by field, nothing read, written or accumulated.

constexpr int64_t kRows = 4;
constexpr uint64_t kRowBytes = kRows * kHidden * sizeof(float);

struct Layout {
  UniqueFd memfd;
  UniqueFd grad_memfd;  // when dL/dh has a memfd of its own
  std::string handle;
  std::shared_ptr<client::HandoverConnection> connection;
};

struct LayoutErrorCase {
  const char* name;
  // Spoils the start (or the layout's memfd) of a call that would otherwise succeed.
  std::function<void(v1::ComputeStart&, Layout&, v1::LossService::Stub&)> spoil;
  bool send_rows_in_messages;
  StatusCode code;
  const char* expected_in_message;
};

void PrintTo(const LayoutErrorCase& c, std::ostream* os) { *os << c.name; }

class LayoutErrorTest : public SharedMemoryTest,
                        public ::testing::WithParamInterface<LayoutErrorCase> {};

// Replaces the layout's memfd with `memfd`, registered on the same connection.
void UseMemfd(Layout& layout, v1::ComputeStart& start, UniqueFd memfd) {
  absl::StatusOr<std::string> handle = layout.connection->Register(memfd.get());
  ASSERT_TRUE(handle.ok()) << handle.status();
  layout.memfd = std::move(memfd);
  start.mutable_shared_memory()->set_handle(*handle);
}

// Takes dL/dh into `memfd`, registered on the same connection; the layout keeps it.
void UseGradMemfd(Layout& layout, v1::ComputeStart& start, UniqueFd memfd) {
  absl::StatusOr<std::string> handle = layout.connection->Register(memfd.get());
  ASSERT_TRUE(handle.ok()) << handle.status();
  layout.grad_memfd = std::move(memfd);
  start.mutable_shared_memory()->set_grad_hidden_handle(*handle);
}

TEST_P(LayoutErrorTest, IsRefusedByFieldAndTouchesNothing) {
  const LayoutErrorCase& c = GetParam();
  const std::string head = absl::StrCat("refused-", c.name);
  UploadHead(head);
  Layout layout;
  layout.connection = OpenHandover(*stub_);
  ASSERT_NE(layout.connection, nullptr);
  layout.memfd = MakeMemfd(2 * kRowBytes, F_SEAL_SHRINK);
  absl::StatusOr<std::string> handle = layout.connection->Register(layout.memfd.get());
  ASSERT_TRUE(handle.ok()) << handle.status();
  v1::ComputeStart start = TrainingStart(head, {1, 2, 3, 4}, *handle);
  c.spoil(start, layout, *stub_);
  // Recognizable bytes everywhere (unless sealed against writes): dL/dh must not land in them.
  struct stat info;
  ASSERT_EQ(fstat(layout.memfd.get(), &info), 0);
  const std::string sentinel(static_cast<size_t>(info.st_size), '\x5a');
  const bool filled = Fill(layout.memfd, sentinel);
  std::string grad_sentinel;
  if (layout.grad_memfd.valid()) {
    ASSERT_EQ(fstat(layout.grad_memfd.get(), &info), 0);
    grad_sentinel.assign(static_cast<size_t>(info.st_size), '\x5b');
    ASSERT_TRUE(Fill(layout.grad_memfd, grad_sentinel));
  }

  const std::string rows = c.send_rows_in_messages ? std::string(kRowBytes, '\0') : std::string();
  const ComputeOutcome outcome = CallCompute(*stub_, start, rows, kRows);
  EXPECT_EQ(outcome.status.error_code(), c.code) << outcome.status.error_message();
  EXPECT_NE(outcome.status.error_message().find(c.expected_in_message), std::string::npos)
      << outcome.status.error_message();
  EXPECT_EQ(outcome.result_messages, 0) << "results of memory the call was refused";
  if (filled) {
    EXPECT_TRUE(ReadAll(layout.memfd) == sentinel) << "a refused call wrote into the memfd";
  }
  if (layout.grad_memfd.valid()) {
    EXPECT_TRUE(ReadAll(layout.grad_memfd) == grad_sentinel)
        << "a refused call wrote into dL/dh's memfd";
  }
  EXPECT_EQ(AccumulatedTokens(head), 0);

  // The same connection serves the next call.
  UniqueFd fresh = MakeMemfd(2 * kRowBytes, F_SEAL_SHRINK);
  absl::StatusOr<std::string> fresh_handle = layout.connection->Register(fresh.get());
  ASSERT_TRUE(fresh_handle.ok()) << fresh_handle.status();
  const std::string hidden = FloatBytes(RandomNormal(kRows * kHidden, 1.0f, rng_));
  ASSERT_TRUE(Fill(fresh, hidden));
  const ComputeOutcome next =
      CallCompute(*stub_, TrainingStart(head, {1, 2, 3, 4}, *fresh_handle), "", 1);
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(AccumulatedTokens(head), kRows);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LayoutErrorTest,
    ::testing::Values(
        // dL/dh would run past its end.
        LayoutErrorCase{"too_small",
                        [](v1::ComputeStart& start, Layout& layout, v1::LossService::Stub&) {
                          UseMemfd(layout, start, MakeMemfd(kRowBytes + 64, F_SEAL_SHRINK));
                        },
                        false, StatusCode::INVALID_ARGUMENT,
                        "shared_memory.handle: expected a memfd of at least 1536 bytes"},
        // Sealed after it was handed over: the server cannot write dL/dh.
        LayoutErrorCase{"sealed_against_writes",
                        [](v1::ComputeStart& start, Layout& layout, v1::LossService::Stub&) {
                          UseMemfd(layout, start, MakeMemfd(2 * kRowBytes, F_SEAL_SHRINK));
                          ASSERT_EQ(fcntl(layout.memfd.get(), F_ADD_SEALS, F_SEAL_WRITE), 0);
                        },
                        false, StatusCode::INVALID_ARGUMENT, "got a memfd sealed against writes"},
        // Handed over through a read-only descriptor: rows yes, dL/dh no.
        LayoutErrorCase{
            "handed_over_read_only",
            [](v1::ComputeStart& start, Layout& layout, v1::LossService::Stub&) {
              const std::string path = absl::StrCat("/proc/self/fd/", layout.memfd.get());
              UseMemfd(layout, start, UniqueFd(open(path.c_str(), O_RDONLY | O_CLOEXEC)));
            },
            false, StatusCode::INVALID_ARGUMENT,
            "shared_memory.handle: expected a memfd the server may write dL/dh into, got "
            "one handed over open for reading only"},
        LayoutErrorCase{"misaligned_rows",
                        [](v1::ComputeStart& start, Layout&, v1::LossService::Stub&) {
                          start.mutable_shared_memory()->set_hidden_offset(8);
                        },
                        false, StatusCode::INVALID_ARGUMENT,
                        "shared_memory.hidden_offset: expected a multiple of 64"},
        // dL/dh would overwrite rows not yet read.
        LayoutErrorCase{"overlapping_regions",
                        [](v1::ComputeStart& start, Layout&, v1::LossService::Stub&) {
                          start.mutable_shared_memory()->set_grad_hidden_offset(kRowBytes / 2);
                        },
                        false, StatusCode::INVALID_ARGUMENT,
                        "shared_memory.grad_hidden_offset: expected a region clear of the rows"},
        // Wraps around 2^64 unless checked.
        LayoutErrorCase{"offset_overflows",
                        [](v1::ComputeStart& start, Layout&, v1::LossService::Stub&) {
                          start.mutable_shared_memory()->set_grad_hidden_offset(~uint64_t{63});
                        },
                        false, StatusCode::INVALID_ARGUMENT,
                        "shared_memory.grad_hidden_offset: expected an offset at which"},
        // 128 bits nobody handed out.
        LayoutErrorCase{"guessed_handle",
                        [](v1::ComputeStart& start, Layout&, v1::LossService::Stub&) {
                          std::string guess(16, '\0');
                          std::random_device random;
                          for (char& byte : guess) byte = static_cast<char>(random());
                          start.mutable_shared_memory()->set_handle(guess);
                        },
                        false, StatusCode::NOT_FOUND,
                        "shared_memory.handle: expected a handle registered on this server's "
                        "handover socket and not revoked"},
        LayoutErrorCase{"all_zero_handle",
                        [](v1::ComputeStart& start, Layout&, v1::LossService::Stub&) {
                          start.mutable_shared_memory()->set_handle(std::string(16, '\0'));
                        },
                        false, StatusCode::NOT_FOUND, "shared_memory.handle"},
        LayoutErrorCase{"short_handle",
                        [](v1::ComputeStart& start, Layout&, v1::LossService::Stub&) {
                          start.mutable_shared_memory()->set_handle(
                              start.shared_memory().handle().substr(0, 15));
                        },
                        false, StatusCode::INVALID_ARGUMENT,
                        "shared_memory.handle: expected the 16-byte handle the server's handover "
                        "socket returned, got 15 bytes"},
        // What a client of the earlier protocol sends: its pid and the memfd's descriptor, now
        // unknown fields 1 and 2, and no handle.
        LayoutErrorCase{"pid_and_fd_fields",
                        [](v1::ComputeStart& start, Layout& layout, v1::LossService::Stub&) {
                          v1::SharedMemory& shared = *start.mutable_shared_memory();
                          shared.clear_handle();
                          google::protobuf::UnknownFieldSet& unknown =
                              *shared.GetReflection()->MutableUnknownFields(&shared);
                          unknown.AddVarint(1, static_cast<uint64_t>(getpid()));
                          unknown.AddVarint(2, static_cast<uint64_t>(layout.memfd.get()));
                        },
                        false, StatusCode::INVALID_ARGUMENT,
                        "shared_memory.handle: expected the 16-byte handle the server's handover "
                        "socket returned, got 0 bytes"},
        // Released by its connection: gone, though the memfd is still open here.
        LayoutErrorCase{"released_handle",
                        [](v1::ComputeStart& start, Layout& layout, v1::LossService::Stub&) {
                          ASSERT_TRUE(
                              layout.connection->Release(start.shared_memory().handle()).ok());
                        },
                        false, StatusCode::NOT_FOUND, "got an unknown or revoked handle"},
        // dL/dh in a memfd of its own: each handle answers for its own range and rights.
        LayoutErrorCase{"grad_memfd_too_small",
                        [](v1::ComputeStart& start, Layout& layout, v1::LossService::Stub&) {
                          UseGradMemfd(layout, start, MakeMemfd(kRowBytes / 2, F_SEAL_SHRINK));
                          start.mutable_shared_memory()->set_grad_hidden_offset(0);
                        },
                        false, StatusCode::INVALID_ARGUMENT,
                        "shared_memory.grad_hidden_handle: expected a memfd of at least 768 bytes"},
        LayoutErrorCase{"grad_memfd_read_only",
                        [](v1::ComputeStart& start, Layout& layout, v1::LossService::Stub&) {
                          const UniqueFd grad = MakeMemfd(kRowBytes, F_SEAL_SHRINK);
                          const std::string path = absl::StrCat("/proc/self/fd/", grad.get());
                          UseGradMemfd(layout, start,
                                       UniqueFd(open(path.c_str(), O_RDONLY | O_CLOEXEC)));
                          start.mutable_shared_memory()->set_grad_hidden_offset(0);
                        },
                        false, StatusCode::INVALID_ARGUMENT,
                        "shared_memory.grad_hidden_handle: expected a memfd the server may write "
                        "dL/dh into, got one handed over open for reading only"},
        LayoutErrorCase{"grad_handle_unknown",
                        [](v1::ComputeStart& start, Layout&, v1::LossService::Stub&) {
                          start.mutable_shared_memory()->set_grad_hidden_handle(
                              std::string(16, '\x01'));
                        },
                        false, StatusCode::NOT_FOUND,
                        "shared_memory.grad_hidden_handle: expected a handle registered"},
        // The rows' memfd handed over a second time is still the rows' memory.
        LayoutErrorCase{"grad_handle_of_the_rows_memfd_overlapping",
                        [](v1::ComputeStart& start, Layout& layout, v1::LossService::Stub&) {
                          absl::StatusOr<std::string> again =
                              layout.connection->Register(layout.memfd.get());
                          ASSERT_TRUE(again.ok()) << again.status();
                          start.mutable_shared_memory()->set_grad_hidden_handle(*again);
                          start.mutable_shared_memory()->set_grad_hidden_offset(kRowBytes / 2);
                        },
                        false, StatusCode::INVALID_ARGUMENT,
                        "shared_memory.grad_hidden_offset: expected a region clear of the rows"},
        // (Messages after a start with shared memory are not read: the start is the whole call.)
        LayoutErrorCase{"handle_of_zeros",
                        [](v1::ComputeStart& start, Layout&, v1::LossService::Stub&) {
                          start.mutable_shared_memory()->set_handle(std::string(16, '\0'));
                        },
                        false, StatusCode::NOT_FOUND, "got an unknown or revoked handle"}),
    [](const ::testing::TestParamInfo<LayoutErrorCase>& info) {
      return std::string(info.param.name);
    });

// Rows in one memfd (handed over read-only: the server only reads them), dL/dh in another: the
// layout of a caller whose rows already lie in shared memory and who takes dL/dh elsewhere. The
// same results, bit for bit, as the rows and dL/dh in messages.
TEST_F(SharedMemoryTest, RowsAndGradHiddenMayLieInTwoMemfds) {
  const std::string head = "two-memfds";
  UploadHead(head);
  constexpr int64_t kCallRows = 233;  // about three engine chunks, the last one short
  const uint64_t rows_bytes = kCallRows * kHidden * sizeof(float);
  const std::string hidden = FloatBytes(RandomNormal(kCallRows * kHidden, 1.0f, rng_));
  const std::vector<int64_t> labels = RandomLabels(kCallRows, rng_);

  UniqueFd rows_memfd = MakeMemfd(rows_bytes, F_SEAL_SHRINK);
  ASSERT_TRUE(Fill(rows_memfd, hidden));
  const std::string path = absl::StrCat("/proc/self/fd/", rows_memfd.get());
  const UniqueFd rows_read_only(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  constexpr uint64_t kGradOffset = 4096;  // not at the start of its memfd
  UniqueFd grad_memfd = MakeMemfd(kGradOffset + rows_bytes, F_SEAL_SHRINK);
  std::shared_ptr<client::HandoverConnection> connection = OpenHandover(*stub_);
  ASSERT_NE(connection, nullptr);
  const absl::StatusOr<std::string> rows_handle = connection->Register(rows_read_only.get());
  ASSERT_TRUE(rows_handle.ok()) << rows_handle.status();
  const absl::StatusOr<std::string> grad_handle = connection->Register(grad_memfd.get());
  ASSERT_TRUE(grad_handle.ok()) << grad_handle.status();

  v1::ComputeStart in_memory = TrainingStart(head, labels, *rows_handle);
  in_memory.mutable_outputs()->set_accumulate_grad_weight(false);
  in_memory.mutable_shared_memory()->set_grad_hidden_handle(*grad_handle);
  in_memory.mutable_shared_memory()->set_grad_hidden_offset(kGradOffset);
  v1::ComputeStart by_messages = in_memory;
  by_messages.clear_shared_memory();

  const ComputeOutcome shared = CallCompute(*stub_, in_memory, "", 1);
  ASSERT_TRUE(shared.status.ok()) << shared.status.error_message();
  const ComputeOutcome messages = CallCompute(*stub_, by_messages, hidden, 50);
  ASSERT_TRUE(messages.status.ok()) << messages.status.error_message();
  EXPECT_EQ(shared.token_loss, messages.token_loss);
  const std::string grad_bytes = ReadAll(grad_memfd);
  ASSERT_EQ(grad_bytes.size(), kGradOffset + rows_bytes);
  EXPECT_TRUE(grad_bytes.substr(kGradOffset) == messages.grad_hidden) << "dL/dh differs";
  EXPECT_EQ(grad_bytes.substr(0, kGradOffset), std::string(kGradOffset, '\0'))
      << "dL/dh landed outside its range";
  EXPECT_TRUE(ReadAll(rows_memfd) == hidden) << "the rows changed";
}

// ---------------------------------------------------------------------------------------------
// Rows that follow the start (SharedMemory.rows_follow): written and announced piece by piece.

v1::ComputeRequest Announcement(int64_t rows) {
  v1::ComputeRequest request;
  request.mutable_chunk()->set_shared_rows(rows);
  return request;
}

// Pieces that end inside engine chunks (about 80 rows each), each written only just before its
// announcement, and after a pause past the first: a server that read rows before they were
// announced would compute on zeros meanwhile.
TEST_F(SharedMemoryTest, RowsThatFollowTheStartGiveTheBitsOfRowsInPlace) {
  const std::string head = "rows-follow";
  UploadHead(head);
  constexpr int64_t kCallRows = 233;
  const int64_t row_bytes = kHidden * sizeof(float);
  const std::string hidden = FloatBytes(RandomNormal(kCallRows * kHidden, 1.0f, rng_));
  const std::vector<int64_t> labels = RandomLabels(kCallRows, rng_);
  UniqueFd memfd = MakeMemfd(2 * kCallRows * row_bytes + 64, F_SEAL_SHRINK);
  std::shared_ptr<client::HandoverConnection> connection = OpenHandover(*stub_);
  ASSERT_NE(connection, nullptr);
  const absl::StatusOr<std::string> handle = connection->Register(memfd.get());
  ASSERT_TRUE(handle.ok()) << handle.status();

  v1::ComputeStart following = TrainingStart(head, labels, *handle);
  following.mutable_outputs()->set_accumulate_grad_weight(false);
  following.mutable_shared_memory()->set_rows_follow(true);
  v1::ComputeStart by_messages = following;
  by_messages.clear_shared_memory();

  const std::vector<int64_t> ends = {50, 120, 121, kCallRows};
  std::vector<v1::ComputeRequest> announcements;
  for (const int64_t end : ends) announcements.push_back(Announcement(end));
  const ComputeOutcome shared =
      CallComputeWithMessages(*stub_, following, announcements, [&](size_t i) {
        const int64_t first = i == 0 ? 0 : ends[i - 1];
        if (i > 0) absl::SleepFor(absl::Milliseconds(100));
        ASSERT_TRUE(Fill(memfd, hidden.substr(first * row_bytes, (ends[i] - first) * row_bytes),
                         first * row_bytes));
      });
  ASSERT_TRUE(shared.status.ok()) << shared.status.error_message();
  const ComputeOutcome messages = CallCompute(*stub_, by_messages, hidden, 50);
  ASSERT_TRUE(messages.status.ok()) << messages.status.error_message();
  EXPECT_EQ(shared.token_loss, messages.token_loss);
  const uint64_t grad_offset = following.shared_memory().grad_hidden_offset();
  EXPECT_TRUE(ReadAll(memfd).substr(grad_offset, kCallRows * row_bytes) == messages.grad_hidden)
      << "dL/dh differs";
}

// The CPU backend computes on the host's cores, which a client copying its next rows would share.
TEST_F(SharedMemoryTest, ACpuServerSaysRowsThatFollowDoNotPay) {
  grpc::ClientContext context;
  v1::SharedMemorySocket socket;
  ASSERT_TRUE(
      stub_->GetSharedMemorySocket(&context, v1::GetSharedMemorySocketRequest(), &socket).ok());
  EXPECT_FALSE(socket.abstract_name().empty());
  EXPECT_FALSE(socket.rows_follow_pays());
}

struct FollowErrorCase {
  const char* name;
  bool rows_follow;  // else the rows travel in one message after the messages below
  std::vector<v1::ComputeRequest> messages;
  const char* expected_in_message;
};

void PrintTo(const FollowErrorCase& c, std::ostream* os) { *os << c.name; }

class FollowErrorTest : public SharedMemoryTest,
                        public ::testing::WithParamInterface<FollowErrorCase> {};

v1::ComputeRequest RowBytesMessage() {
  v1::ComputeRequest request;
  request.mutable_chunk()->set_hidden(std::string(kHidden * sizeof(float), '\0'));
  return request;
}

TEST_P(FollowErrorTest, IsRefusedByFieldAndAccumulatesNothing) {
  const FollowErrorCase& c = GetParam();
  const std::string head = absl::StrCat("follow-", c.name);
  UploadHead(head);
  constexpr int64_t kCallRows = 233;
  const std::string hidden = FloatBytes(RandomNormal(kCallRows * kHidden, 1.0f, rng_));
  const std::vector<int64_t> labels = RandomLabels(kCallRows, rng_);
  UniqueFd memfd = MakeMemfd(2 * hidden.size() + 64, F_SEAL_SHRINK);
  ASSERT_TRUE(Fill(memfd, hidden));
  std::shared_ptr<client::HandoverConnection> connection = OpenHandover(*stub_);
  ASSERT_NE(connection, nullptr);
  const absl::StatusOr<std::string> handle = connection->Register(memfd.get());
  ASSERT_TRUE(handle.ok()) << handle.status();
  v1::ComputeStart start = TrainingStart(head, labels, *handle);
  std::vector<v1::ComputeRequest> messages = c.messages;
  if (c.rows_follow) {
    start.mutable_shared_memory()->set_rows_follow(true);
  } else {
    start.clear_shared_memory();
    v1::ComputeRequest rows;
    rows.mutable_chunk()->set_hidden(hidden);
    messages.push_back(rows);
  }
  const ComputeOutcome outcome = CallComputeWithMessages(*stub_, start, messages);
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << outcome.status.error_message();
  EXPECT_NE(outcome.status.error_message().find(c.expected_in_message), std::string::npos)
      << outcome.status.error_message();
  EXPECT_EQ(AccumulatedTokens(head), 0);
  EXPECT_EQ(Gradient(head), std::vector<float>(kVocab * kHidden, 0.0f));
}

INSTANTIATE_TEST_SUITE_P(
    Announcements, FollowErrorTest,
    ::testing::Values(
        // A count only grows: the rows before it are in place.
        FollowErrorCase{"shrinking",
                        true,
                        {Announcement(100), Announcement(50)},
                        "chunk.shared_rows: expected a count of rows in place in (100, 233]"},
        // More rows than the call has.
        FollowErrorCase{"beyond_the_call", true, {Announcement(300)}, "chunk.shared_rows"},
        // Rows that follow in shared memory are not also sent.
        FollowErrorCase{
            "row_bytes_as_well", true, {RowBytesMessage()}, "chunk: expected only shared_rows"},
        // The stream ends before the last row is announced.
        FollowErrorCase{"short",
                        true,
                        {Announcement(100)},
                        "chunk.shared_rows: expected 233 rows (num_tokens), got 100"},
        // A call whose rows travel in messages announces none.
        FollowErrorCase{
            "without_rows_follow", false, {Announcement(5)}, "chunk.shared_rows: expected 0"}),
    [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// The handover socket against peers that send what they should not.

// A connection to the handover socket that sends whatever it is told.
class RawHandover {
 public:
  explicit RawHandover(const std::string& abstract_name)
      : socket_(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)) {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path + 1, abstract_name.data(), abstract_name.size());
    const auto length =
        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + abstract_name.size());
    connected_ = connect(socket_.get(), reinterpret_cast<const sockaddr*>(&address), length) == 0;
  }

  bool connected() const { return connected_; }

  // One message of `bytes`, with `fds` in an SCM_RIGHTS control message when there are any;
  // false when it could not be sent (the server closed, or takes no more just now).
  bool Send(const std::string& bytes, const std::vector<int>& fds = {}) {
    iovec data{const_cast<char*>(bytes.data()), bytes.size()};
    msghdr message{};
    message.msg_iov = &data;
    message.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
    if (!fds.empty()) {
      message.msg_control = control.data();
      message.msg_controllen = control.size();
      cmsghdr* rights = CMSG_FIRSTHDR(&message);
      rights->cmsg_level = SOL_SOCKET;
      rights->cmsg_type = SCM_RIGHTS;
      rights->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(rights), fds.data(), sizeof(int) * fds.size());
    }
    return sendmsg(socket_.get(), &message, MSG_NOSIGNAL | MSG_DONTWAIT) >= 0;
  }

  // The next reply; nothing once the connection has ended, or after 5 s without one.
  std::optional<v1::HandoverReply> Reply() {
    if (!WaitReadable()) return std::nullopt;
    std::string bytes(4096, '\0');
    const ssize_t n = recv(socket_.get(), bytes.data(), bytes.size(), 0);
    v1::HandoverReply reply;
    if (n <= 0 || !reply.ParseFromArray(bytes.data(), static_cast<int>(n))) return std::nullopt;
    return reply;
  }

  // True once the connection has ended: the server closed it (after any replies still queued),
  // or this side did; false when it is still open 5 s on.
  bool Ended() {
    if (!socket_.valid()) return true;
    std::string bytes(4096, '\0');
    while (WaitReadable()) {
      if (recv(socket_.get(), bytes.data(), bytes.size(), 0) <= 0) return true;
    }
    return false;
  }

  void Close() { socket_.Reset(); }

 private:
  bool WaitReadable() {
    if (!socket_.valid()) return false;
    pollfd polled{socket_.get(), POLLIN, 0};
    return poll(&polled, 1, 5000) == 1;
  }

  UniqueFd socket_;
  bool connected_ = false;
};

std::string RegisterRequest() {
  v1::HandoverRequest request;
  request.mutable_register_memfd();
  return request.SerializeAsString();
}

std::string ReleaseRequest(const std::string& handle) {
  v1::HandoverRequest request;
  request.mutable_release_handle()->set_handle(handle);
  return request.SerializeAsString();
}

// Registers a fresh sealed memfd on `raw`; its handle.
std::string RegisterFresh(RawHandover& raw, std::vector<UniqueFd>& keep) {
  keep.push_back(MakeMemfd(4096, F_SEAL_SHRINK));
  EXPECT_TRUE(raw.Send(RegisterRequest(), {keep.back().get()}));
  const std::optional<v1::HandoverReply> reply = raw.Reply();
  EXPECT_TRUE(reply.has_value() && reply->code() == 0) << (reply ? reply->message() : "no reply");
  return reply ? reply->handle() : "";
}

struct HandoverCase {
  const char* name;
  // Sends the case's messages on `raw`; descriptors it makes go into `keep`, closed after the case.
  std::function<void(RawHandover& raw, std::vector<UniqueFd>& keep)> send;
  StatusCode code;
  // What the reply's message must contain; null: the server closes the connection instead.
  const char* expected_in_message;
};

void PrintTo(const HandoverCase& c, std::ostream* os) { *os << c.name; }

class HandoverRequestTest : public SharedMemoryTest,
                            public ::testing::WithParamInterface<HandoverCase> {};

// Whatever a peer sends, the server answers it or closes that connection, keeps no descriptor it
// did not register, revokes what a closed connection registered, and goes on serving.
TEST_P(HandoverRequestTest, IsAnsweredOrClosedAndLeaksNothing) {
  const HandoverCase& c = GetParam();
  server::SharedMemoryMaps& maps = server_->shared_memory_maps();
  const std::string socket_name = SocketName(*stub_);
  ASSERT_TRUE(Eventually([&] { return maps.handles() == 0; })) << "earlier tests left handles";
  const int descriptors_before = OpenDescriptors();
  {
    RawHandover raw(socket_name);
    ASSERT_TRUE(raw.connected());
    std::vector<UniqueFd> keep;
    c.send(raw, keep);
    if (c.expected_in_message != nullptr) {
      const std::optional<v1::HandoverReply> reply = raw.Reply();
      ASSERT_TRUE(reply.has_value()) << "no reply";
      EXPECT_EQ(reply->code(), static_cast<int>(c.code)) << reply->message();
      EXPECT_NE(reply->message().find(c.expected_in_message), std::string::npos)
          << reply->message();
      EXPECT_TRUE(reply->handle().empty());
    } else {
      EXPECT_TRUE(raw.Ended()) << "the server kept the connection open";
    }
  }
  EXPECT_TRUE(Eventually([&] { return maps.handles() == 0; })) << maps.handles() << " handles left";
  // At most as many: gRPC may close a descriptor of its own meanwhile.
  EXPECT_TRUE(Eventually([&] { return OpenDescriptors() <= descriptors_before; }))
      << OpenDescriptors() << " descriptors open, " << descriptors_before << " before";

  // Still serving: a fresh connection hands a memfd over and a call computes on it.
  std::shared_ptr<client::HandoverConnection> connection = OpenHandover(*stub_);
  ASSERT_NE(connection, nullptr);
  UniqueFd memfd = MakeMemfd(2 * kRowBytes, F_SEAL_SHRINK);
  ASSERT_TRUE(Fill(memfd, FloatBytes(RandomNormal(kRows * kHidden, 1.0f, rng_))));
  const absl::StatusOr<std::string> handle = connection->Register(memfd.get());
  ASSERT_TRUE(handle.ok()) << handle.status();
  v1::ComputeStart start = TrainingStart(kHead, {1, 2, 3, 4}, *handle);
  start.mutable_outputs()->set_accumulate_grad_weight(false);
  const ComputeOutcome outcome = CallCompute(*stub_, start, "", 1);
  EXPECT_TRUE(outcome.status.ok()) << outcome.status.error_message();
}

constexpr char kExpectedMemfd[] = "register_memfd: expected a memfd sealed against shrinking";

INSTANTIATE_TEST_SUITE_P(
    Cases, HandoverRequestTest,
    ::testing::Values(
        // A length-delimited field that claims 5 bytes and has 2.
        HandoverCase{"garbage",
                     [](RawHandover& raw, auto&) {
                       raw.Send(
                           "\x0a\x05"
                           "ab");
                     },
                     StatusCode::INVALID_ARGUMENT,
                     "request: expected a serialized lossd.v1.HandoverRequest, got 4 bytes"},
        // Well-formed, with a memfd, but a field no request has: the memfd is closed.
        HandoverCase{"neither_kind",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       keep.push_back(MakeMemfd(4096, F_SEAL_SHRINK));
                       raw.Send(std::string("\x18\x01", 2), {keep.back().get()});
                     },
                     StatusCode::INVALID_ARGUMENT,
                     "request: expected register_memfd or release_handle, got neither"},
        HandoverCase{
            "oversized", [](RawHandover& raw, auto&) { raw.Send(std::string(8192, '\x01')); },
            StatusCode::INVALID_ARGUMENT, "request: expected a message of at most 4096 bytes"},
        HandoverCase{"register_without_descriptor",
                     [](RawHandover& raw, auto&) { raw.Send(RegisterRequest()); },
                     StatusCode::INVALID_ARGUMENT,
                     "register_memfd: expected exactly one descriptor, in an SCM_RIGHTS control "
                     "message, got 0"},
        HandoverCase{"register_two_descriptors",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       keep.push_back(MakeMemfd(4096, F_SEAL_SHRINK));
                       keep.push_back(MakeMemfd(4096, F_SEAL_SHRINK));
                       raw.Send(RegisterRequest(), {keep[0].get(), keep[1].get()});
                     },
                     StatusCode::INVALID_ARGUMENT,
                     "register_memfd: expected exactly one descriptor"},
        // More than the server's control buffer holds: the kernel closes the rest, the server
        // the ones it got.
        HandoverCase{"register_twelve_descriptors",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       std::vector<int> fds;
                       for (int i = 0; i < 12; ++i) {
                         keep.push_back(MakeMemfd(4096, F_SEAL_SHRINK));
                         fds.push_back(keep.back().get());
                       }
                       raw.Send(RegisterRequest(), fds);
                     },
                     StatusCode::INVALID_ARGUMENT, "request: expected at most 8 descriptors"},
        HandoverCase{"pipe",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       int ends[2];
                       ASSERT_EQ(pipe2(ends, O_CLOEXEC), 0);
                       keep.emplace_back(ends[0]);
                       keep.emplace_back(ends[1]);
                       raw.Send(RegisterRequest(), {ends[0]});
                     },
                     StatusCode::INVALID_ARGUMENT, "got a pipe"},
        HandoverCase{"directory",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       keep.emplace_back(open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
                       raw.Send(RegisterRequest(), {keep.back().get()});
                     },
                     StatusCode::INVALID_ARGUMENT, "got a directory"},
        HandoverCase{"regular_file",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       keep.emplace_back(open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
                       raw.Send(RegisterRequest(), {keep.back().get()});
                     },
                     StatusCode::INVALID_ARGUMENT, "got a regular file that is not a memfd"},
        HandoverCase{"socket",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       keep.emplace_back(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
                       raw.Send(RegisterRequest(), {keep.back().get()});
                     },
                     StatusCode::INVALID_ARGUMENT, "got a socket"},
        HandoverCase{"eventfd",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       keep.emplace_back(eventfd(0, EFD_CLOEXEC));
                       raw.Send(RegisterRequest(), {keep.back().get()});
                     },
                     StatusCode::INVALID_ARGUMENT, "got a descriptor of anon_inode:[eventfd]"},
        // It could shrink under the server's mapping: SIGBUS.
        HandoverCase{"unsealed_memfd",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       keep.push_back(MakeMemfd(4096, 0));
                       raw.Send(RegisterRequest(), {keep.back().get()});
                     },
                     StatusCode::INVALID_ARGUMENT, "got a memfd without F_SEAL_SHRINK"},
        HandoverCase{"memfd_without_sealing",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       keep.emplace_back(memfd_create("lossd-test", MFD_CLOEXEC));
                       raw.Send(RegisterRequest(), {keep.back().get()});
                     },
                     StatusCode::INVALID_ARGUMENT, kExpectedMemfd},
        HandoverCase{
            "write_only",
            [](RawHandover& raw, std::vector<UniqueFd>& keep) {
              keep.push_back(MakeMemfd(4096, F_SEAL_SHRINK));
              const std::string path = absl::StrCat("/proc/self/fd/", keep.back().get());
              keep.emplace_back(open(path.c_str(), O_WRONLY | O_CLOEXEC));
              raw.Send(RegisterRequest(), {keep.back().get()});
            },
            StatusCode::INVALID_ARGUMENT,
            "register_memfd: expected a memfd open for reading, got one open for writing only"},
        HandoverCase{
            "release_unknown_handle",
            [](RawHandover& raw, auto&) { raw.Send(ReleaseRequest(std::string(16, '\x07'))); },
            StatusCode::NOT_FOUND, "release_handle.handle: expected a handle this connection"},
        HandoverCase{"release_with_descriptor",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       const std::string handle = RegisterFresh(raw, keep);
                       keep.push_back(MakeMemfd(4096, F_SEAL_SHRINK));
                       raw.Send(ReleaseRequest(handle), {keep.back().get()});
                     },
                     StatusCode::INVALID_ARGUMENT, "release_handle: expected no descriptor, got 1"},
        // A SOCK_SEQPACKET message of no bytes reads as the end of the connection.
        HandoverCase{"empty_message", [](RawHandover& raw, auto&) { raw.Send(""); }, StatusCode::OK,
                     nullptr},
        // Its memfd registered, the peer gone before the reply: the handle is revoked.
        HandoverCase{"gone_before_the_reply",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       keep.push_back(MakeMemfd(4096, F_SEAL_SHRINK));
                       raw.Send(RegisterRequest(), {keep.back().get()});
                       raw.Close();
                     },
                     StatusCode::OK, nullptr},
        // Registered several, then left: all revoked.
        HandoverCase{"gone_holding_handles",
                     [](RawHandover& raw, std::vector<UniqueFd>& keep) {
                       for (int i = 0; i < 5; ++i) RegisterFresh(raw, keep);
                       raw.Close();
                     },
                     StatusCode::OK, nullptr},
        // Requests without end, replies never read: the server stops answering a peer that does
        // not take its replies and closes it.
        HandoverCase{"never_reads_replies",
                     [](RawHandover& raw, auto&) {
                       const std::string request = ReleaseRequest(std::string(16, '\x07'));
                       // Until the server closes the connection. A full send buffer only says
                       // that the server has not read yet (a loaded machine): wait, send again.
                       const absl::Time give_up = absl::Now() + absl::Seconds(20);
                       for (int sent = 0; sent < 100000 && absl::Now() < give_up;) {
                         if (raw.Send(request)) {
                           if (++sent % 64 == 0) absl::SleepFor(absl::Microseconds(200));
                         } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
                           absl::SleepFor(absl::Milliseconds(1));
                         } else {
                           break;
                         }
                       }
                     },
                     StatusCode::OK, nullptr}),
    [](const ::testing::TestParamInfo<HandoverCase>& info) {
      return std::string(info.param.name);
    });

// A handle is only released by the connection that registered it; another one (which learned the
// handle) gets NOT_FOUND and the handle keeps working.
TEST_F(SharedMemoryTest, OnlyTheRegisteringConnectionReleasesAHandle) {
  const std::string socket_name = SocketName(*stub_);
  RawHandover owner(socket_name);
  RawHandover other(socket_name);
  std::vector<UniqueFd> keep;
  const std::string handle = RegisterFresh(owner, keep);
  ASSERT_TRUE(other.Send(ReleaseRequest(handle)));
  const std::optional<v1::HandoverReply> refused = other.Reply();
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->code(), static_cast<int>(StatusCode::NOT_FOUND)) << refused->message();
  ASSERT_TRUE(owner.Send(ReleaseRequest(handle)));
  const std::optional<v1::HandoverReply> released = owner.Reply();
  ASSERT_TRUE(released.has_value());
  EXPECT_EQ(released->code(), 0) << released->message();
  EXPECT_EQ(released->handle(), handle);
}

// A handle dies with the connection that registered it: a call naming it afterwards is refused
// and reads and writes nothing, though the memfd itself is still open in the client.
TEST_F(SharedMemoryTest, AHandleIsRevokedWhenItsConnectionCloses) {
  server::SharedMemoryMaps& maps = server_->shared_memory_maps();
  ASSERT_TRUE(Eventually([&] { return maps.handles() == 0 && maps.mappings() == 0; }));
  UploadHead("revoked");
  const std::vector<int64_t> labels = RandomLabels(100, rng_);
  const std::string hidden = FloatBytes(RandomNormal(100 * kHidden, 1.0f, rng_));
  UniqueFd memfd = MakeMemfd(2 * hidden.size(), F_SEAL_SHRINK);
  ASSERT_TRUE(Fill(memfd, hidden));
  std::shared_ptr<client::HandoverConnection> connection = OpenHandover(*stub_);
  ASSERT_NE(connection, nullptr);
  const absl::StatusOr<std::string> handle = connection->Register(memfd.get());
  ASSERT_TRUE(handle.ok()) << handle.status();
  const v1::ComputeStart start = TrainingStart("revoked", labels, *handle);
  const ComputeOutcome served = CallCompute(*stub_, start, "", 1);
  ASSERT_TRUE(served.status.ok()) << served.status.error_message();
  EXPECT_EQ(maps.handles(), 1u);
  EXPECT_EQ(maps.mappings(), 2u);
  const std::vector<float> gradient = Gradient("revoked");

  connection.reset();
  EXPECT_TRUE(Eventually([&] { return maps.handles() == 0 && maps.mappings() == 0; }))
      << maps.handles() << " handles, " << maps.mappings() << " mappings left";
  const std::string sentinel(2 * hidden.size(), '\x5a');
  ASSERT_TRUE(Fill(memfd, sentinel));
  const ComputeOutcome refused = CallCompute(*stub_, start, "", 1);
  EXPECT_EQ(refused.status.error_code(), StatusCode::NOT_FOUND) << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("shared_memory.handle"), std::string::npos);
  EXPECT_EQ(refused.result_messages, 0);
  EXPECT_TRUE(ReadAll(memfd) == sentinel) << "a revoked handle's memfd was written";
  EXPECT_TRUE(Gradient("revoked") == gradient) << "a refused call accumulated";
}

server::ServerConfig SmallServerConfig() {
  server::ServerConfig config;
  config.demo = {"small", 100, 16, 3};
  return config;
}

// Sends one more memfd on `raw`, which must be refused with RESOURCE_EXHAUSTED saying `why`.
void ExpectRegistrationRefused(RawHandover& raw, std::vector<UniqueFd>& keep,
                               const std::string& why) {
  keep.push_back(MakeMemfd(4096, F_SEAL_SHRINK));
  ASSERT_TRUE(raw.Send(RegisterRequest(), {keep.back().get()}));
  const std::optional<v1::HandoverReply> refused = raw.Reply();
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->code(), static_cast<int>(StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_NE(refused->message().find(why), std::string::npos) << refused->message();
}

// 64 handles per connection, 128 per local user: beyond them RESOURCE_EXHAUSTED, until some are
// released.
TEST(HandoverLimitsTest, HandlesAreBoundedPerConnectionAndPerUser) {
  std::unique_ptr<server::LossServer> server = StartTestServer(SmallServerConfig());
  ASSERT_NE(server, nullptr);
  const std::string socket_name = SocketName(*ConnectTo(server->port()));
  std::vector<std::unique_ptr<RawHandover>> connections;
  std::vector<UniqueFd> keep;
  std::vector<std::string> first_handles;
  for (int c = 0; c < 2; ++c) {
    connections.push_back(std::make_unique<RawHandover>(socket_name));
    for (int i = 0; i < 64; ++i) {
      const std::string handle = RegisterFresh(*connections.back(), keep);
      ASSERT_EQ(handle.size(), 16u);
      if (i == 0) first_handles.push_back(handle);
    }
    ExpectRegistrationRefused(*connections.back(), keep,
                              "expected at most 64 handles per connection");
  }
  EXPECT_EQ(server->shared_memory_maps().handles(), 128u);
  connections.push_back(std::make_unique<RawHandover>(socket_name));
  ExpectRegistrationRefused(
      *connections.back(), keep,
      absl::StrCat("expected at most 128 handles per local user (uid ", geteuid(), " holds 128"));

  // A release makes room on both counts.
  ASSERT_TRUE(connections[0]->Send(ReleaseRequest(first_handles[0])));
  ASSERT_TRUE(connections[0]->Reply().has_value());
  EXPECT_EQ(RegisterFresh(*connections.back(), keep).size(), 16u);
}

// The server-wide bound on handles holds across users, and each user's own bound beside it.
// (Other users through the real socket: python/test_shared_memory_users.py.)
TEST(HandoverLimitsTest, HandlesAreBoundedPerUserAndInAll) {
  server::SharedMemoryMaps maps({.max_idle_mappings = 4,
                                 .max_handles_per_connection = 2,
                                 .max_handles_per_user = 3,
                                 .max_handles = 5});
  const auto register_one = [&](uint64_t connection, uint32_t user) {
    return maps.Register(MakeMemfd(4096, F_SEAL_SHRINK), connection, user);
  };
  constexpr uint32_t kAlice = 1001, kBob = 1002, kCarol = 1003;
  for (const uint64_t connection : {1, 1, 2}) {
    ASSERT_TRUE(register_one(connection, kAlice).ok());
  }
  const absl::StatusOr<std::string> alice_over = register_one(3, kAlice);
  EXPECT_EQ(alice_over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(alice_over.status().message(),
                                "expected at most 3 handles per local user (uid 1001"))
      << alice_over.status();
  // Bob is not held back by Alice's handles, only by the server's bound.
  ASSERT_TRUE(register_one(4, kBob).ok());
  ASSERT_TRUE(register_one(4, kBob).ok());
  const absl::StatusOr<std::string> carol_over = register_one(5, kCarol);
  EXPECT_TRUE(absl::StrContains(carol_over.status().message(), "the server holds 5 handles"))
      << carol_over.status();
  // Alice's connections close: her handles go, and so does her share.
  maps.RevokeConnection(1);
  maps.RevokeConnection(2);
  EXPECT_EQ(maps.handles(), 2u);
  EXPECT_TRUE(register_one(5, kCarol).ok());
  EXPECT_TRUE(register_one(3, kAlice).ok());
}

// At most 16 connections of one local user: the 17th is told so and closed; once one closes, a
// new one is served.
TEST(HandoverLimitsTest, ConnectionsAreBoundedPerUser) {
  std::unique_ptr<server::LossServer> server = StartTestServer(SmallServerConfig());
  ASSERT_NE(server, nullptr);
  const std::string socket_name = SocketName(*ConnectTo(server->port()));
  std::vector<std::unique_ptr<RawHandover>> connections;
  std::vector<UniqueFd> keep;
  for (int c = 0; c < 16; ++c) {
    connections.push_back(std::make_unique<RawHandover>(socket_name));
    RegisterFresh(*connections.back(), keep);  // served: the connection is counted
  }
  RawHandover extra(socket_name);
  const std::optional<v1::HandoverReply> refused = extra.Reply();
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->code(), static_cast<int>(StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_NE(
      refused->message().find(absl::StrCat(
          "expected at most 16 open handover connections per local user (uid ", geteuid(), ")")),
      std::string::npos)
      << refused->message();
  EXPECT_TRUE(extra.Ended());

  connections.front()->Close();
  EXPECT_TRUE(Eventually([&] { return server->shared_memory_maps().handles() == 15; }));
  RawHandover next(socket_name);
  EXPECT_EQ(RegisterFresh(next, keep).size(), 16u);
}

// The server-wide bound on connections comes first, whoever connects.
TEST(HandoverLimitsTest, ConnectionsAreBoundedInAll) {
  server::SharedMemoryMaps maps;
  absl::StatusOr<std::unique_ptr<server::HandoverSocket>> socket =
      server::HandoverSocket::Open(maps, {.max_connections = 3, .max_connections_per_user = 16});
  ASSERT_TRUE(socket.ok()) << socket.status();
  std::vector<std::unique_ptr<RawHandover>> connections;
  std::vector<UniqueFd> keep;
  for (int c = 0; c < 3; ++c) {
    connections.push_back(std::make_unique<RawHandover>((*socket)->abstract_name()));
    RegisterFresh(*connections.back(), keep);
  }
  RawHandover extra((*socket)->abstract_name());
  const std::optional<v1::HandoverReply> refused = extra.Reply();
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->code(), static_cast<int>(StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_NE(refused->message().find("expected at most 3 open handover connections, got one more"),
            std::string::npos)
      << refused->message();
  EXPECT_TRUE(extra.Ended());
}

// Shutdown closes the socket: open connections end (their handles with them) and the name is
// free, so nothing can reach a server that is gone.
TEST(HandoverLimitsTest, ShutdownClosesTheSocket) {
  std::unique_ptr<server::LossServer> server = StartTestServer(SmallServerConfig());
  ASSERT_NE(server, nullptr);
  const std::string socket_name = SocketName(*ConnectTo(server->port()));
  RawHandover open_connection(socket_name);
  std::vector<UniqueFd> keep;
  RegisterFresh(open_connection, keep);
  server->Shutdown(absl::ZeroDuration());
  EXPECT_TRUE(open_connection.Ended());
  EXPECT_EQ(server->shared_memory_maps().handles(), 0u);
  EXPECT_FALSE(RawHandover(socket_name).connected());
}

// ---------------------------------------------------------------------------------------------
// A sparse memfd far larger than the call.

// VmRSS of this process (server and test alike), in bytes.
int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      std::istringstream fields(line.substr(6));
      int64_t kib = 0;
      fields >> kib;
      return kib * 1024;
    }
  }
  return -1;
}

struct MappingLine {
  std::string permissions;
  uint64_t file_offset = 0;
  uint64_t length = 0;
};

// This process's mappings of the memfd named `name` (memfd_create's name).
std::vector<MappingLine> MappingsOf(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::vector<MappingLine> found;
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(absl::StrCat("/memfd:", name, " ")) == std::string::npos) continue;
    std::istringstream fields(line);
    std::string range;
    MappingLine mapping;
    fields >> range >> mapping.permissions >> std::hex >> mapping.file_offset;
    const size_t dash = range.find('-');
    mapping.length = std::stoull(range.substr(dash + 1), nullptr, 16) -
                     std::stoull(range.substr(0, dash), nullptr, 16);
    found.push_back(mapping);
  }
  return found;
}

// A one-row call on a sparse 1 GiB memfd maps (and faults in) the pages of its row and of its
// dL/dh, read-only for the rows: not the memfd.
TEST(SparseMemfdTest, AOneRowCallMapsOnlyThePagesItUses) {
  std::unique_ptr<server::LossServer> server = StartTestServer(SmallServerConfig());
  ASSERT_NE(server, nullptr);
  const server::SharedMemoryMaps& maps = server->shared_memory_maps();
  std::unique_ptr<v1::LossService::Stub> stub = ConnectTo(server->port());
  constexpr int64_t kSmallHidden = 16;
  constexpr uint64_t kMemfdBytes = uint64_t{1} << 30;
  constexpr uint64_t kRowsOffset = uint64_t{768} << 20;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t grad_offset = kRowsOffset + page;
  UniqueFd memfd = MakeMemfd(kMemfdBytes, F_SEAL_SHRINK, "lossd-sparse");
  std::mt19937_64 rng(FreshSeed());
  const std::string row = FloatBytes(RandomNormal(kSmallHidden, 1.0f, rng));
  ASSERT_EQ(pwrite(memfd.get(), row.data(), row.size(), static_cast<off_t>(kRowsOffset)),
            static_cast<ssize_t>(row.size()));
  std::shared_ptr<client::HandoverConnection> connection = OpenHandover(*stub);
  ASSERT_NE(connection, nullptr);
  const absl::StatusOr<std::string> handle = connection->Register(memfd.get());
  ASSERT_TRUE(handle.ok()) << handle.status();

  v1::ComputeStart by_messages;
  by_messages.set_head("small");
  by_messages.set_num_tokens(1);
  by_messages.set_hidden_size(kSmallHidden);
  by_messages.set_hidden_dtype(v1::DTYPE_FLOAT32);
  by_messages.add_labels(42);
  by_messages.mutable_outputs()->set_token_loss(true);
  v1::ComputeStart in_memory = by_messages;
  v1::SharedMemory& shared = *in_memory.mutable_shared_memory();
  shared.set_handle(*handle);
  shared.set_hidden_offset(kRowsOffset);
  shared.set_grad_hidden_offset(grad_offset);
  const int64_t resident_before = ResidentBytes();

  // Scoring: the row's page, read-only.
  const ComputeOutcome scored = CallCompute(*stub, in_memory, "", 1);
  ASSERT_TRUE(scored.status.ok()) << scored.status.error_message();
  const ComputeOutcome scored_by_messages = CallCompute(*stub, by_messages, row, 1);
  ASSERT_TRUE(scored_by_messages.status.ok());
  EXPECT_EQ(scored.token_loss, scored_by_messages.token_loss);
  std::vector<MappingLine> mappings = MappingsOf("lossd-sparse");
  ASSERT_EQ(mappings.size(), 1u);
  EXPECT_EQ(mappings[0].permissions, "r--s");
  EXPECT_EQ(mappings[0].file_offset, kRowsOffset);
  EXPECT_EQ(mappings[0].length, page);
  EXPECT_EQ(maps.mapped_bytes(), page);

  // Training: dL/dh's page as well, read-write.
  in_memory.mutable_outputs()->set_grad_hidden(true);
  by_messages.mutable_outputs()->set_grad_hidden(true);
  const ComputeOutcome trained = CallCompute(*stub, in_memory, "", 1);
  ASSERT_TRUE(trained.status.ok()) << trained.status.error_message();
  const ComputeOutcome trained_by_messages = CallCompute(*stub, by_messages, row, 1);
  ASSERT_TRUE(trained_by_messages.status.ok());
  std::string grad_hidden(row.size(), '\0');
  ASSERT_EQ(
      pread(memfd.get(), grad_hidden.data(), grad_hidden.size(), static_cast<off_t>(grad_offset)),
      static_cast<ssize_t>(grad_hidden.size()));
  EXPECT_TRUE(grad_hidden == trained_by_messages.grad_hidden) << "dL/dh differs";
  mappings = MappingsOf("lossd-sparse");
  ASSERT_EQ(mappings.size(), 2u);
  EXPECT_EQ(maps.mappings(), 2u);
  EXPECT_EQ(maps.mapped_bytes(), 2 * page);
  for (const MappingLine& mapping : mappings) {
    EXPECT_EQ(mapping.length, page);
    EXPECT_EQ(mapping.permissions, mapping.file_offset == grad_offset ? "rw-s" : "r--s");
  }
  const int64_t growth = ResidentBytes() - resident_before;
  ::testing::Test::RecordProperty("resident_growth_bytes", std::to_string(growth));
  EXPECT_LT(growth, int64_t{64} << 20)
      << "a 1-row call on a 1 GiB memfd grew the server by " << growth << " bytes";
}

// ---------------------------------------------------------------------------------------------
// A client that rewrites its rows while the calls that read them run.

struct RaceCase {
  const char* name;
  v1::DType dtype;
};

void PrintTo(const RaceCase& c, std::ostream* os) { *os << c.name; }

class RowWriterRaceTest : public SharedMemoryTest,
                          public ::testing::WithParamInterface<RaceCase> {};

// Values that make a call fail wherever they are seen: W's row of token 0 is all 4.0, so the
// logit of token 0 is non-finite for Inf or NaN, and overflows for |h| >= 1e38 (4e38 > FLT_MAX).
std::vector<float> BadValues() {
  return {std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN(),
          1e38f,
          -1e38f,
          std::numeric_limits<float>::max(),
          -std::numeric_limits<float>::max()};
}

bool AllFinite(const std::vector<float>& values) {
  for (float value : values) {
    if (!std::isfinite(value)) return false;
  }
  return true;
}

// While a writer thread keeps putting Inf, NaN and huge values into random elements of a
// client's rows (and taking them out again), that client's training calls run on them, with
// another client's calls through messages in between. Every call either fails or commits what
// the untouched rows give, bit for bit (its per-token loss and dL/dh say it computed on them); a
// failed call leaves the accumulator as it was; no non-finite value ever reaches it; after every
// call it equals the sum of the committed calls' dL/dW in commit order.
TEST_P(RowWriterRaceTest, EachCallCommitsWhatOneViewOfItsRowsGivesOrFails) {
  const RaceCase& c = GetParam();
  const std::string head = absl::StrCat("race-", c.name);
  constexpr int64_t kRaceRows = 400;  // five engine chunks
  std::vector<float> weight =
      RandomNormal(kVocab * kHidden, 1.0f / std::sqrt(float{kHidden}), rng_);
  std::fill(weight.begin(), weight.begin() + kHidden, 4.0f);
  ASSERT_TRUE(Upload(*stub_, head, kVocab, kHidden, weight, /*replace=*/true).ok());
  const bool fp32 = c.dtype == v1::DTYPE_FLOAT32;
  const size_t element_bytes = fp32 ? 4 : 2;
  auto encode = [&](float value) -> uint32_t {
    if (fp32) {
      uint32_t bits;
      std::memcpy(&bits, &value, 4);
      return bits;
    }
    return FloatToBFloat16(value);
  };
  const std::vector<float> rows = RandomNormal(kRaceRows * kHidden, 1.0f, rng_);
  std::string row_bytes(rows.size() * element_bytes, '\0');
  for (size_t i = 0; i < rows.size(); ++i) {
    const uint32_t bits = encode(rows[i]);
    std::memcpy(&row_bytes[i * element_bytes], &bits, element_bytes);
  }
  const std::vector<int64_t> labels = RandomLabels(kRaceRows, rng_);
  const std::vector<int64_t> other_labels = RandomLabels(kRaceRows, rng_);
  const std::string other_rows = FloatBytes(RandomNormal(kRaceRows * kHidden, 1.0f, rng_));

  // What each client's call commits, alone on a zeroed accumulator, through messages.
  v1::ComputeStart by_messages = TrainingStart(head, labels, "", c.dtype);
  by_messages.clear_shared_memory();
  const v1::ComputeStart other = [&] {
    v1::ComputeStart start = TrainingStart(head, other_labels, "");
    start.clear_shared_memory();
    return start;
  }();
  auto zero = [&] {
    grpc::ClientContext context;
    v1::ZeroGradWeightRequest request;
    request.set_head(head);
    v1::ZeroGradWeightResponse response;
    ASSERT_TRUE(stub_->ZeroGradWeight(&context, request, &response).ok());
  };
  zero();
  const ComputeOutcome reference = CallCompute(*stub_, by_messages, row_bytes, 100);
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  const std::vector<float> racing_gradient = Gradient(head);
  zero();
  ASSERT_TRUE(CallCompute(*stub_, other, other_rows, 100).status.ok());
  const std::vector<float> other_gradient = Gradient(head);
  zero();

  // The racing client's memory: rows, then dL/dh.
  const uint64_t grad_offset = (row_bytes.size() + 63) / 64 * 64;
  const uint64_t grad_bytes = kRaceRows * kHidden * sizeof(float);
  absl::StatusOr<std::unique_ptr<client::SharedBuffer>> buffer =
      client::SharedBuffer::Create(grad_offset + grad_bytes);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memcpy((*buffer)->data(), row_bytes.data(), row_bytes.size());
  std::shared_ptr<client::HandoverConnection> connection = OpenHandover(*stub_);
  ASSERT_NE(connection, nullptr);
  const absl::StatusOr<std::string> handle = (*buffer)->HandleOn(connection);
  ASSERT_TRUE(handle.ok()) << handle.status();
  const v1::ComputeStart racing = TrainingStart(head, labels, *handle, c.dtype);

  // Calm spells (rows as they should be) and storms (bad values come and go in random elements),
  // of random lengths, so that some calls run in calm, some see a bad value and some race a storm
  // without seeing one.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> changes{0};       // stores into the rows, bad or good
  std::atomic<bool> bad_present{false};  // set before a bad value goes in, cleared once it is out
  std::thread writer([&, seed = rng_()] {
    std::mt19937_64 writer_rng(seed);
    const std::vector<float> bad = BadValues();
    std::uniform_int_distribution<int64_t> element(0, kRaceRows * kHidden - 1);
    std::uniform_int_distribution<size_t> which(0, bad.size() - 1);
    std::uniform_int_distribution<int> calm_us(0, 25000), storm_us(1000, 8000), gap_us(0, 200);
    uint8_t* const data = (*buffer)->data();
    auto store = [&](int64_t e, uint32_t bits) {
      if (fp32) {
        reinterpret_cast<volatile uint32_t*>(data)[e] = bits;
      } else {
        reinterpret_cast<volatile uint16_t*>(data)[e] = static_cast<uint16_t>(bits);
      }
    };
    while (!stop.load()) {
      absl::SleepFor(absl::Microseconds(calm_us(writer_rng)));
      const absl::Time storm_end = absl::Now() + absl::Microseconds(storm_us(writer_rng));
      while (absl::Now() < storm_end && !stop.load()) {
        const int64_t e = element(writer_rng);
        bad_present = true;
        store(e, encode(bad[which(writer_rng)]));
        changes += 1;
        absl::SleepFor(absl::Microseconds(gap_us(writer_rng) / 4));
        store(e, encode(rows[e]));
        changes += 1;
        bad_present = false;
        absl::SleepFor(absl::Microseconds(gap_us(writer_rng)));
      }
    }
  });

  std::vector<float> expected(kVocab * kHidden, 0.0f);
  auto add = [&expected](const std::vector<float>& gradient) {
    for (size_t i = 0; i < expected.size(); ++i) expected[i] += gradient[i];
  };
  int calls = 0, failed = 0, committed = 0, raced_commits = 0, other_calls = 0;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (calls < 300 && absl::Now() < give_up && (failed < 3 || raced_commits < 3 || calls < 60)) {
    ++calls;
    const bool bad_at_start = bad_present.load();
    const int64_t changes_before = changes.load();
    const ComputeOutcome outcome = CallCompute(*stub_, racing, "", 1);
    const bool raced = changes.load() != changes_before;
    const bool bad_seen_possible = raced || bad_at_start || bad_present.load();
    if (outcome.status.ok()) {
      ++committed;
      raced_commits += raced;
      add(racing_gradient);
      // It computed on the rows as they should be: the same per-token loss and dL/dh.
      EXPECT_EQ(outcome.token_loss, reference.token_loss) << "call " << calls;
      EXPECT_EQ(
          std::memcmp((*buffer)->data() + grad_offset, reference.grad_hidden.data(), grad_bytes), 0)
          << "call " << calls << ": dL/dh differs";
    } else {
      ++failed;
      EXPECT_EQ(outcome.status.error_code(), StatusCode::INVALID_ARGUMENT)
          << outcome.status.error_message();
      EXPECT_TRUE(bad_seen_possible)
          << "call " << calls << " failed with rows left alone: " << outcome.status.error_message();
    }
    const std::vector<float> accumulated = Gradient(head);
    ASSERT_TRUE(AllFinite(accumulated))
        << "call " << calls << " put a non-finite value into the accumulator";
    ASSERT_TRUE(accumulated == expected)
        << "call " << calls
        << (outcome.status.ok() ? " committed something else than its dL/dW"
                                : " failed and changed the accumulator");
    if (calls % 3 == 0) {
      // Another client's contribution, which no failure of this one may lose.
      ASSERT_TRUE(CallCompute(*stub_, other, other_rows, 100).status.ok());
      ++other_calls;
      add(other_gradient);
      ASSERT_TRUE(Gradient(head) == expected) << "after the other client's call " << other_calls;
    }
  }
  stop = true;
  writer.join();
  EXPECT_EQ(AccumulatedTokens(head), (committed + other_calls) * kRaceRows);
  ::testing::Test::RecordProperty("calls", calls);
  ::testing::Test::RecordProperty("failed", failed);
  ::testing::Test::RecordProperty("committed_while_rows_changed", raced_commits);
  ::testing::Test::RecordProperty("committed", committed);
  // The race happened: calls saw the writer's values and failed, and others committed while the
  // writer was at work on their rows.
  EXPECT_GE(failed, 1) << calls << " calls";
  EXPECT_GE(raced_commits, 1) << calls << " calls";
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, RowWriterRaceTest,
    ::testing::Values(
        // The CPU engine reads fp32 rows where they lie, twice: the server copies each chunk.
        RaceCase{"float32", v1::DTYPE_FLOAT32},
        // bf16 rows are widened once per chunk by the engine itself: no copy.
        RaceCase{"bfloat16", v1::DTYPE_BFLOAT16}),
    [](const ::testing::TestParamInfo<RaceCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace lossd::testing
