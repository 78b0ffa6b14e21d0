// The compute budget: with --compute_memory_mib 0 it follows the heads the server holds, so that
// a head added by an upload can be trained on; a call the budget cannot hold is told what would
// make it fit.

#include "tests/robustness/robustness_common.h"

namespace lossd::testing {
namespace {

TEST(ComputeBudgetTest, FollowsTheHeadsWhenNotSet) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  server::ServerConfig config = StallConfig();  // a [2000, 64] head
  config.demo.vocab_size = 500;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  auto budget_for = [&](int64_t largest_vocab) {
    return config.max_running_calls *
           (static_cast<int64_t>(config.workspace_budget_bytes) +
            largest_vocab * kStallHidden * static_cast<int64_t>(sizeof(float)));
  };
  EXPECT_EQ(server->scheduler().capacity_bytes(), budget_for(500));

  // A head 40 times larger: its staging dL/dW alone is over the budget the demo head gave.
  constexpr int64_t kLargeVocab = 20000;
  const std::vector<float> weight = RandomWeight(kLargeVocab, kStallHidden, rng);
  ASSERT_TRUE(Upload(*stub, "large", kLargeVocab, kStallHidden, weight, false).ok());
  EXPECT_EQ(server->scheduler().capacity_bytes(), budget_for(kLargeVocab));
  const Batch batch = RandomBatch(60, kLargeVocab, kStallHidden, rng);
  const ComputeOutcome out = CallCompute(*stub, StartFor("large", batch, kStallHidden, true),
                                         FloatBytes(batch.hidden), kStallRowsPerMessage);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  const ReferenceResult ref = Reference(weight, kLargeVocab, kStallHidden, batch);
  EXPECT_TRUE(LossMatches(out.summary.loss(), ref));
  EXPECT_LE(RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden), kGradBound);

  // Replaced by a smaller head, it no longer sizes the budget.
  ASSERT_TRUE(
      Upload(*stub, "large", 1000, kStallHidden, RandomWeight(1000, kStallHidden, rng), true).ok());
  EXPECT_EQ(server->scheduler().capacity_bytes(), budget_for(1000));
  // The trained head went with its accumulator; no call holds anything.
  EXPECT_TRUE(SettlesToIdle(*server, 0));
}

struct OverBudgetCase {
  const char* name;
  const char* why;
  int64_t compute_memory_bytes;
  size_t workspace_budget_bytes;
  int64_t vocab;
  int64_t rows;
  bool training;
  std::vector<const char*> says;
  std::vector<const char*> never_says;
};

void PrintTo(const OverBudgetCase& c, std::ostream* os) { *os << c.name; }

const OverBudgetCase kOverBudgetCases[] = {
    {"staging_over_budget",
     "a 20000 x 64 staging dL/dW (5 MB) over a 1 MiB budget",
     1 << 20,
     1 << 20,
     20000,
     16,
     true,
     {"--compute_memory_mib of at least 6", "Fewer tokens cannot make it fit",
      "staging dL/dW of head 'stalled'"},
     {"fewer tokens per call", "--workspace_budget_mib"}},
    {"workspace_over_budget",
     "a 4 MiB workspace budget over a 3 MiB compute budget",
     3 << 20,
     4 << 20,
     4000,
     4000,
     true,
     {"--workspace_budget_mib of at most 2", "--compute_memory_mib of at least",
      "fewer tokens per call"},
     {"cannot"}},
    {"scoring_workspace_over_budget",
     "a scoring call with no staging, same budgets",
     3 << 20,
     4 << 20,
     4000,
     4000,
     false,
     {"--workspace_budget_mib of at most 3", "fewer tokens per call"},
     {"staging", "cannot"}},
};

class OverBudgetTest : public ::testing::TestWithParam<OverBudgetCase> {};

TEST_P(OverBudgetTest, RefusalSaysWhatWouldMakeTheCallFit) {
  const OverBudgetCase& c = GetParam();
  SCOPED_TRACE(c.why);
  std::mt19937_64 rng(FreshSeed());
  server::ServerConfig config = StallConfig();
  config.demo.vocab_size = c.vocab;
  config.compute_memory_bytes = c.compute_memory_bytes;
  config.workspace_budget_bytes = c.workspace_budget_bytes;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  const Batch batch = RandomBatch(c.rows, c.vocab, kStallHidden, rng);
  const ComputeOutcome out =
      CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, c.training),
                  FloatBytes(batch.hidden), c.rows);
  const std::string& message = out.status.error_message();
  EXPECT_EQ(out.status.error_code(), StatusCode::RESOURCE_EXHAUSTED) << message;
  for (const char* text : c.says) EXPECT_NE(message.find(text), std::string::npos) << message;
  for (const char* text : c.never_says) EXPECT_EQ(message.find(text), std::string::npos) << message;
  // Typed in the status details, for clients to act on without reading the message.
  const std::optional<v1::ErrorInfo> info = ErrorInfoIn(out.status);
  ASSERT_TRUE(info.has_value()) << "no ErrorInfo in the refusal's details";
  EXPECT_EQ(info->reason(), v1::ErrorInfo::OVER_BUDGET);
  // Counted before the client could hear its status.
  EXPECT_EQ(EventMetric(*server, "lossd_admission_rejected_total", {{"reason", "over_budget"}}), 1);
}

INSTANTIATE_TEST_SUITE_P(Table, OverBudgetTest, ::testing::ValuesIn(kOverBudgetCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace lossd::testing
