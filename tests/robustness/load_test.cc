// Load: 32 clients with 50 mixed calls each on the CPU backend. Every result is checked against
// the float64 reference for the W version it was computed on; the only error allowed is ABORTED
// for a training call on a head that a concurrent Step moved (retried); the scheduler and the
// memory ledger stay within their bounds throughout.

#include "tests/robustness/robustness_common.h"

namespace lossd::testing {
namespace {

constexpr int kLoadClients = 32;
constexpr int kCallsPerClient = 50;
constexpr int64_t kLoadVocab = 512;
constexpr int64_t kLoadHidden = 64;
constexpr int64_t kLoadRows = 32;
constexpr int64_t kLoadRowsPerMessage = 8;
constexpr int kLoadBatches = 16;
constexpr int kLoadRunning = 2;
constexpr int kLoadQueued = 64;
constexpr size_t kLoadWorkspaceBudget = 1 << 20;
constexpr char kFrozenHead[] = "frozen";    // never stepped: one reference per batch
constexpr char kSteppedHead[] = "stepped";  // stepped while other clients train on it

enum class LoadCall { kScoreFrozen, kTrainFrozen, kTrainStepped, kFetchGrad, kStepStepped };
// Relative frequencies of the calls above.
const std::vector<double> kLoadMix = {32, 26, 26, 12, 4};

// The scheduler's and the ledger's bounds, checked by polling while the clients run.
struct BoundsWatch {
  int64_t samples = 0;
  int64_t violations = 0;
  std::string first_violation;
  int peak_queued = 0;
  int peak_running = 0;
  int64_t peak_admitted_bytes = 0;
  int64_t peak_workspace_bytes = 0;
};

void WatchBounds(server::LossServer& server, const std::atomic<bool>& done,
                 int64_t accumulator_bytes, BoundsWatch& watch) {
  while (!done) {
    const CallResources s = ReadCallResources(server);
    ++watch.samples;
    watch.peak_queued = std::max(watch.peak_queued, s.queued);
    watch.peak_running = std::max(watch.peak_running, s.running);
    watch.peak_admitted_bytes = std::max(watch.peak_admitted_bytes, s.admitted_bytes);
    watch.peak_workspace_bytes = std::max(watch.peak_workspace_bytes, s.workspace_bytes);
    const bool within =
        s.admitted_bytes <= server.scheduler().capacity_bytes() && s.running <= kLoadRunning &&
        s.queued <= kLoadQueued &&
        s.workspace_bytes <= kLoadRunning * static_cast<int64_t>(kLoadWorkspaceBudget) &&
        // Staging dL/dW: of the running calls and of those paused waiting for their clients,
        // all admitted against the budget.
        s.gradient_bytes <= accumulator_bytes + server.scheduler().capacity_bytes() &&
        s.cache_bytes <= server.scheduler().capacity_bytes();
    if (!within && watch.violations++ == 0) {
      watch.first_violation =
          absl::StrCat("admitted ", s.admitted_bytes, " B, running ", s.running, ", queued ",
                       s.queued, ", workspace ", s.workspace_bytes, " B, gradients ",
                       s.gradient_bytes, " B, idle buffers ", s.cache_bytes, " B");
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// What one client saw; merged after the run.
struct ClientLog {
  int64_t rpcs = 0;
  int64_t compute_calls = 0;
  int64_t tokens = 0;
  int64_t aborted = 0;
  int64_t steps = 0;
  std::vector<int> frozen_trained;  // per batch: committed training calls on kFrozenHead
  struct SteppedCall {
    uint64_t version;
    int batch;
    double loss;
  };
  std::vector<SteppedCall> stepped_calls;
  std::vector<std::string> failures;  // unexpected errors and wrong results
};

class LoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = FreshSeed();
    std::mt19937_64 rng(seed_);
    server::ServerConfig config;
    config.demo = {kFrozenHead, kLoadVocab, kLoadHidden, 3};
    config.workspace_budget_bytes = kLoadWorkspaceBudget;
    config.max_running_calls = kLoadRunning;
    config.max_queued_calls = kLoadQueued;
    server_ = StartTestServer(config);
    ASSERT_NE(server_, nullptr);
    auto stub = ConnectTo(server_->port());
    ASSERT_TRUE(Upload(*stub, kSteppedHead, kLoadVocab, kLoadHidden,
                       RandomWeight(kLoadVocab, kLoadHidden, rng), false)
                    .ok());
    frozen_weight_ = Fetch(*stub, kFrozenHead, false).values;
    const FetchedTensor stepped = Fetch(*stub, kSteppedHead, false);
    stepped_weights_[stepped.version] = stepped.values;
    for (int b = 0; b < kLoadBatches; ++b) {
      batches_.push_back(RandomBatch(kLoadRows, kLoadVocab, kLoadHidden, rng));
      frozen_refs_.push_back(Reference(frozen_weight_, kLoadVocab, kLoadHidden, batches_.back()));
    }
  }

  void RunClient(uint64_t seed, ClientLog& log) {
    std::mt19937_64 rng(seed);
    std::discrete_distribution<int> pick_call(kLoadMix.begin(), kLoadMix.end());
    std::uniform_int_distribution<int> pick_batch(0, kLoadBatches - 1);
    log.frozen_trained.assign(kLoadBatches, 0);
    // Calls fail fast while a channel is not connected, so a connection attempt lost to a
    // loaded machine would fail every call of the client: connect first, with gRPC's retries.
    auto channel = PrivateChannel(server_->port());
    if (!channel->WaitForConnected(In(absl::Seconds(30)))) {
      log.failures.push_back("could not connect within 30 s");
      return;
    }
    auto stub = v1::LossService::NewStub(channel);
    auto fail = [&](absl::string_view what, const grpc::Status& status) {
      log.failures.push_back(absl::StrCat(what, ": ", server::GrpcCodeName(status.error_code()),
                                          " ", status.error_message()));
    };
    for (int i = 0; i < kCallsPerClient; ++i) {
      const auto call = static_cast<LoadCall>(pick_call(rng));
      const int b = pick_batch(rng);
      const Batch& batch = batches_[b];
      const std::string hidden = FloatBytes(batch.hidden);
      switch (call) {
        case LoadCall::kScoreFrozen:
        case LoadCall::kTrainFrozen: {
          const bool training = call == LoadCall::kTrainFrozen;
          const ComputeOutcome out =
              CallCompute(*stub, StartFor(kFrozenHead, batch, kLoadHidden, training), hidden,
                          kLoadRowsPerMessage);
          ++log.rpcs;
          ++log.compute_calls;
          if (!out.status.ok()) {
            fail("frozen compute", out.status);
            break;
          }
          log.tokens += kLoadRows;
          const ReferenceResult& ref = frozen_refs_[b];
          if (!LossMatches(out.summary.loss(), ref) ||
              RelativeError(out.token_loss, ref.token_loss) > kLossBound ||
              (training &&
               RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden) > kGradBound)) {
            log.failures.push_back(absl::StrCat("frozen compute on batch ", b, ": loss ",
                                                out.summary.loss(), ", reference ", ref.loss));
          }
          if (training) ++log.frozen_trained[b];
          break;
        }
        case LoadCall::kTrainStepped: {
          ComputeOutcome out;
          do {
            out = CallCompute(*stub, StartFor(kSteppedHead, batch, kLoadHidden, true), hidden,
                              kLoadRowsPerMessage);
            ++log.rpcs;
            ++log.compute_calls;
            log.aborted += out.status.error_code() == StatusCode::ABORTED;
          } while (out.status.error_code() == StatusCode::ABORTED);
          if (!out.status.ok()) {
            fail("stepped compute", out.status);
            break;
          }
          log.tokens += kLoadRows;
          log.stepped_calls.push_back({out.summary.head_version(), b, out.summary.loss()});
          break;
        }
        case LoadCall::kFetchGrad: {
          const bool frozen = b % 2 == 0;
          const FetchedTensor grad = Fetch(*stub, frozen ? kFrozenHead : kSteppedHead, true);
          ++log.rpcs;
          if (!grad.status.ok()) {
            fail("fetch gradient", grad.status);
          } else if (grad.values.size() != static_cast<size_t>(kLoadVocab * kLoadHidden) ||
                     !std::all_of(grad.values.begin(), grad.values.end(),
                                  [](float x) { return std::isfinite(x); })) {
            log.failures.push_back("fetched gradient is not V x H finite values");
          }
          break;
        }
        case LoadCall::kStepStepped: {
          // Steps are serialized here (not in the server) so that W of every version is fetched
          // before the next step moves it.
          std::lock_guard<std::mutex> lock(step_mu_);
          grpc::ClientContext context;
          v1::StepRequest request;
          request.set_head(kSteppedHead);
          request.mutable_sgd()->set_learning_rate(0.05);
          request.mutable_sgd()->set_momentum(0.9);
          v1::StepResponse response;
          const grpc::Status status = stub->Step(&context, request, &response);
          const FetchedTensor weight = Fetch(*stub, kSteppedHead, false);
          log.rpcs += 2;
          log.steps += status.ok();
          if (!status.ok() || !weight.status.ok()) {
            fail("step", status.ok() ? weight.status : status);
          } else if (weight.version != response.head_version()) {
            log.failures.push_back("W moved between a step and its fetch");
          } else {
            stepped_weights_[weight.version] = weight.values;
          }
          break;
        }
      }
    }
  }

  uint64_t seed_ = 0;  // of the batches, the heads and the clients' call mixes
  std::unique_ptr<server::LossServer> server_;
  std::vector<Batch> batches_;
  std::vector<float> frozen_weight_;
  std::vector<ReferenceResult> frozen_refs_;
  std::mutex step_mu_;
  std::map<uint64_t, std::vector<float>> stepped_weights_;  // guarded by step_mu_ while clients run
};

TEST_F(LoadTest, ConcurrentMixedCallsAreAllCorrectAndStayWithinBounds) {
  // A head's accumulator exists from its first committed training call or step on.
  const int64_t accumulator_bytes = kLoadVocab * kLoadHidden * static_cast<int64_t>(sizeof(float));
  std::atomic<bool> done{false};
  BoundsWatch watch;
  // Two heads, so two accumulators at most.
  std::thread watcher([&] { WatchBounds(*server_, done, 2 * accumulator_bytes, watch); });
  std::vector<ClientLog> logs(kLoadClients);
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed_);
  std::mt19937_64 seeds(seed_ + 1);
  const absl::Time start = absl::Now();
  std::vector<std::thread> clients;
  for (int c = 0; c < kLoadClients; ++c) {
    clients.emplace_back([this, seed = seeds(), &log = logs[c]] { RunClient(seed, log); });
  }
  for (auto& client : clients) client.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  done = true;
  watcher.join();

  ClientLog total;
  total.frozen_trained.assign(kLoadBatches, 0);
  for (const ClientLog& log : logs) {
    total.rpcs += log.rpcs;
    total.compute_calls += log.compute_calls;
    total.tokens += log.tokens;
    total.aborted += log.aborted;
    total.steps += log.steps;
    for (int b = 0; b < kLoadBatches; ++b) total.frozen_trained[b] += log.frozen_trained[b];
    total.stepped_calls.insert(total.stepped_calls.end(), log.stepped_calls.begin(),
                               log.stepped_calls.end());
    total.failures.insert(total.failures.end(), log.failures.begin(), log.failures.end());
  }
  EXPECT_TRUE(total.failures.empty())
      << total.failures.size() << " failures, the first: " << total.failures.front();
  EXPECT_EQ(watch.violations, 0) << "over " << watch.samples
                                 << " samples; the first: " << watch.first_violation;
  const bool frozen_trained = std::any_of(total.frozen_trained.begin(), total.frozen_trained.end(),
                                          [](int calls) { return calls > 0; });
  const bool stepped_trained = !total.stepped_calls.empty() || total.steps > 0;
  EXPECT_TRUE(SettlesToIdle(*server_, (frozen_trained + stepped_trained) * accumulator_bytes));

  // Training calls on the stepped head match the reference for the version they report; one
  // reference per (version, batch), computed on every core.
  const absl::Time verify_start = absl::Now();
  std::map<std::pair<uint64_t, int>, ReferenceResult> stepped_refs;
  for (const ClientLog::SteppedCall& call : total.stepped_calls) {
    ASSERT_TRUE(stepped_weights_.count(call.version))
        << "no W recorded for version " << call.version;
    stepped_refs.try_emplace({call.version, call.batch});
  }
  std::vector<std::pair<const std::pair<uint64_t, int>, ReferenceResult>*> pending;
  for (auto& entry : stepped_refs) pending.push_back(&entry);
  std::atomic<size_t> next{0};
  std::vector<std::thread> workers;
  for (unsigned w = 0; w < std::max(2u, std::thread::hardware_concurrency()); ++w) {
    workers.emplace_back([&] {
      for (size_t i = next++; i < pending.size(); i = next++) {
        const auto& [version, batch] = pending[i]->first;
        pending[i]->second =
            Reference(stepped_weights_.at(version), kLoadVocab, kLoadHidden, batches_[batch]);
      }
    });
  }
  for (auto& worker : workers) worker.join();
  for (const ClientLog::SteppedCall& call : total.stepped_calls) {
    const ReferenceResult& ref = stepped_refs.at({call.version, call.batch});
    EXPECT_TRUE(LossMatches(call.loss, ref))
        << "version " << call.version << ", batch " << call.batch << ": loss " << call.loss
        << ", reference " << ref.loss << ", largest logit " << ref.max_abs_logit;
  }
  RecordProperty("verify_seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - verify_start)));

  // The frozen head's accumulator holds exactly the committed training calls.
  auto stub = ConnectTo(server_->port());
  std::vector<double> expected(kLoadVocab * kLoadHidden, 0.0);
  int64_t expected_tokens = 0;
  for (int b = 0; b < kLoadBatches; ++b) {
    for (size_t i = 0; i < expected.size(); ++i) {
      expected[i] += total.frozen_trained[b] * frozen_refs_[b].grad_weight[i];
    }
    expected_tokens += total.frozen_trained[b] * frozen_refs_[b].counted_tokens;
  }
  grpc::ClientContext context;
  v1::GetHeadRequest request;
  request.set_head(kFrozenHead);
  v1::HeadInfo info;
  ASSERT_TRUE(stub->GetHead(&context, request, &info).ok());
  EXPECT_EQ(info.accumulated_tokens(), expected_tokens);
  EXPECT_LE(RelativeError(Fetch(*stub, kFrozenHead, true).values, expected), kGradBound);

  RecordProperty("clients", kLoadClients);
  RecordProperty("rpcs", total.rpcs);
  RecordProperty("compute_calls", total.compute_calls);
  RecordProperty("aborted_and_retried", total.aborted);
  RecordProperty("steps", static_cast<int>(stepped_weights_.size()) - 1);
  RecordProperty("seconds", absl::StrCat(seconds));
  RecordProperty("rpcs_per_second", absl::StrCat(total.rpcs / seconds));
  RecordProperty("compute_calls_per_second", absl::StrCat(total.compute_calls / seconds));
  RecordProperty("tokens_per_second", absl::StrCat(total.tokens / seconds));
  RecordProperty("peak_queued", watch.peak_queued);
  RecordProperty("peak_running", watch.peak_running);
  RecordProperty("peak_admitted_bytes", absl::StrCat(watch.peak_admitted_bytes));
  RecordProperty("compute_budget_bytes", absl::StrCat(server_->scheduler().capacity_bytes()));
  RecordProperty("peak_workspace_bytes", absl::StrCat(watch.peak_workspace_bytes));
  RecordProperty("bound_samples", absl::StrCat(watch.samples));
}

}  // namespace
}  // namespace lossd::testing
