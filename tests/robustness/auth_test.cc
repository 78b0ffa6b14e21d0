// Authentication and TLS: with a token configured, a call without it or with anything else in
// its place is UNAUTHENTICATED and reaches nothing; with a certificate, TLS clients that trust it
// are served and plaintext or untrusting clients cannot connect.

#include "tests/robustness/robustness_common.h"

namespace lossd::testing {
namespace {

constexpr char kToken[] = "s3cret-token";
constexpr char kGuardedHead[] = "guarded";
constexpr int64_t kGuardedVocab = 200;
constexpr int64_t kGuardedHidden = 32;

std::string WriteTokenFile(const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/token";
  std::ofstream(path) << kToken << "\n";
  return path;
}

struct BadCredential {
  const char* name;
  const char* why;
  const char* authorization;  // the metadata value sent; null sends none
};

void PrintTo(const BadCredential& credential, std::ostream* os) { *os << credential.name; }

const BadCredential kBadCredentials[] = {
    {"none", "no authorization metadata at all", nullptr},
    {"empty_token", "the scheme without a token", "Bearer "},
    {"wrong_token", "another token", "Bearer wrong-token"},
    {"token_prefix", "a prefix of the token, as a byte-by-byte compare that stops early accepts",
     "Bearer s3cret"},
    {"token_extended", "the token with a byte more", "Bearer s3cret-token2"},
    {"bare_token", "the token without its scheme", "s3cret-token"},
    {"basic_scheme", "the token under another scheme", "Basic s3cret-token"},
};

void Authorize(grpc::ClientContext& context, const char* authorization) {
  if (authorization != nullptr) context.AddMetadata("authorization", authorization);
  context.set_deadline(In(absl::Seconds(20)));
}

// Each RPC of the service once, sent with `authorization`: the writing ones aim at kGuardedHead.
struct RpcOutcome {
  const char* rpc;
  grpc::Status status;
  int64_t messages_received = 0;  // stream messages that reached the client
};

std::vector<RpcOutcome> CallEveryRpc(v1::LossService::Stub& stub, const char* authorization,
                                     const Batch& batch, const std::vector<float>& other_weight) {
  std::vector<RpcOutcome> outcomes;
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    auto stream = stub.Compute(&context);
    v1::ComputeRequest request;
    *request.mutable_start() = StartFor(kGuardedHead, batch, kGuardedHidden, true);
    stream->Write(request);
    request.mutable_chunk()->set_hidden(FloatBytes(batch.hidden));
    stream->Write(request);
    stream->WritesDone();
    RpcOutcome outcome{"Compute", grpc::Status(), 0};
    v1::ComputeResponse response;
    while (stream->Read(&response)) ++outcome.messages_received;
    outcome.status = stream->Finish();
    outcomes.push_back(outcome);
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::HeadInfo info;
    auto writer = stub.UploadHead(&context, &info);
    v1::UploadHeadRequest request;
    v1::UploadHeadStart& start = *request.mutable_start();
    start.set_head(kGuardedHead);
    start.set_vocab_size(kGuardedVocab);
    start.set_hidden_size(kGuardedHidden);
    start.set_dtype(v1::DTYPE_FLOAT32);
    start.set_replace(true);
    writer->Write(request);
    request.set_weight(FloatBytes(other_weight));
    writer->Write(request);
    writer->WritesDone();
    outcomes.push_back({"UploadHead", writer->Finish()});
  }
  for (const bool gradient : {false, true}) {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::FetchTensorRequest request;
    request.set_head(kGuardedHead);
    auto reader =
        gradient ? stub.FetchGradWeight(&context, request) : stub.FetchWeight(&context, request);
    RpcOutcome outcome{gradient ? "FetchGradWeight" : "FetchWeight", grpc::Status(), 0};
    v1::TensorChunk chunk;
    while (reader->Read(&chunk)) ++outcome.messages_received;
    outcome.status = reader->Finish();
    outcomes.push_back(outcome);
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::ZeroGradWeightRequest request;
    request.set_head(kGuardedHead);
    v1::ZeroGradWeightResponse response;
    outcomes.push_back({"ZeroGradWeight", stub.ZeroGradWeight(&context, request, &response)});
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::StepRequest request;
    request.set_head(kGuardedHead);
    request.mutable_sgd()->set_learning_rate(0.5);
    v1::StepResponse response;
    outcomes.push_back({"Step", stub.Step(&context, request, &response)});
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::SaveCheckpointResponse response;
    outcomes.push_back({"SaveCheckpoint", stub.SaveCheckpoint(&context, {}, &response)});
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::ListHeadsResponse response;
    outcomes.push_back({"ListHeads", stub.ListHeads(&context, {}, &response)});
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::GetHeadRequest request;
    request.set_head(kGuardedHead);
    v1::HeadInfo response;
    outcomes.push_back({"GetHead", stub.GetHead(&context, request, &response)});
  }
  return outcomes;
}

class AuthTest : public ::testing::TestWithParam<BadCredential> {
 protected:
  // W and the gradient are compared bitwise around every row, so a call that slipped through shows.
  static void SetUpTestSuite() {
    std::mt19937_64 rng(FreshSeed());
    dir_ = new std::string(::testing::TempDir() + "/lossd-auth-" + std::to_string(FreshSeed()));
    server::ServerConfig config;
    config.token_file = WriteTokenFile(*dir_);
    config.demo = {kGuardedHead, kGuardedVocab, kGuardedHidden, 13};
    server_ = StartTestServer(config).release();
    ASSERT_NE(server_, nullptr);
    batch_ = new Batch(RandomBatch(16, kGuardedVocab, kGuardedHidden, rng));
    other_weight_ = new std::vector<float>(RandomWeight(kGuardedVocab, kGuardedHidden, rng));
    auto stub = ConnectTo(server_->port());
    ASSERT_TRUE(CallCompute(*stub, StartFor(kGuardedHead, *batch_, kGuardedHidden, true),
                            FloatBytes(batch_->hidden), 16, -1, kToken)
                    .status.ok());
  }
  static void TearDownTestSuite() {
    delete server_;
    std::filesystem::remove_all(*dir_);
    delete dir_;
    delete batch_;
    delete other_weight_;
  }

  static server::LossServer* server_;
  static std::string* dir_;
  static Batch* batch_;
  static std::vector<float>* other_weight_;  // what a slipped-through upload would write
};

server::LossServer* AuthTest::server_ = nullptr;
std::string* AuthTest::dir_ = nullptr;
Batch* AuthTest::batch_ = nullptr;
std::vector<float>* AuthTest::other_weight_ = nullptr;

TEST_P(AuthTest, RejectedCredentialsReachNothing) {
  const BadCredential& credential = GetParam();
  SCOPED_TRACE(credential.why);
  auto stub = ConnectTo(server_->port());
  const FetchedTensor weight_before = Fetch(*stub, kGuardedHead, false, kToken);
  const FetchedTensor grad_before = Fetch(*stub, kGuardedHead, true, kToken);
  ASSERT_TRUE(weight_before.status.ok() && grad_before.status.ok());

  for (const RpcOutcome& outcome :
       CallEveryRpc(*stub, credential.authorization, *batch_, *other_weight_)) {
    EXPECT_EQ(outcome.status.error_code(), StatusCode::UNAUTHENTICATED)
        << outcome.rpc << ": " << outcome.status.error_message();
    EXPECT_NE(outcome.status.error_message().find("authorization"), std::string::npos)
        << outcome.rpc;
    EXPECT_EQ(outcome.messages_received, 0) << outcome.rpc << " streamed data back";
  }

  const FetchedTensor weight_after = Fetch(*stub, kGuardedHead, false, kToken);
  const FetchedTensor grad_after = Fetch(*stub, kGuardedHead, true, kToken);
  EXPECT_EQ(weight_after.version, weight_before.version);
  EXPECT_TRUE(BitwiseEqual(weight_after.values, weight_before.values)) << "W changed";
  EXPECT_TRUE(BitwiseEqual(grad_after.values, grad_before.values)) << "the gradient changed";
}

INSTANTIATE_TEST_SUITE_P(Table, AuthTest, ::testing::ValuesIn(kBadCredentials),
                         [](const auto& info) { return std::string(info.param.name); });

// The same calls with the token all get through (SaveCheckpoint then fails on its own terms).
TEST_F(AuthTest, TheTokenOpensEveryRpc) {
  auto stub = ConnectTo(server_->port());
  const std::string authorization = std::string("Bearer ") + kToken;
  for (const RpcOutcome& outcome :
       CallEveryRpc(*stub, authorization.c_str(), *batch_, *other_weight_)) {
    const StatusCode expected = std::string(outcome.rpc) == "SaveCheckpoint"
                                    ? StatusCode::FAILED_PRECONDITION
                                    : StatusCode::OK;
    EXPECT_EQ(outcome.status.error_code(), expected)
        << outcome.rpc << ": " << outcome.status.error_message();
  }
}

std::unique_ptr<v1::LossService::Stub> ConnectWithTls(int port, const std::string& trusted_pem) {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = trusted_pem;
  return v1::LossService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::SslCredentials(options)));
}

grpc::Status ListHeads(v1::LossService::Stub& stub, const char* authorization) {
  grpc::ClientContext context;
  Authorize(context, authorization);
  v1::ListHeadsResponse response;
  return stub.ListHeads(&context, {}, &response);
}

TEST(TlsTest, ServesTrustingTlsClientsOnly) {
  const uint64_t seed = FreshSeed();
  std::mt19937_64 rng(seed);
  const std::string dir = ::testing::TempDir() + "/lossd-tls-" + std::to_string(seed);
  const Certificate server_certificate = MakeCertificate(dir, "server");
  const Certificate other_certificate = MakeCertificate(dir, "other");
  ASSERT_FALSE(server_certificate.pem.empty() || other_certificate.pem.empty())
      << "the openssl CLI could not make test certificates";
  server::ServerConfig config;
  config.tls_cert_file = server_certificate.cert_file;
  config.tls_key_file = server_certificate.key_file;
  config.token_file = WriteTokenFile(dir);
  config.demo = {kGuardedHead, kGuardedVocab, kGuardedHidden, 17};
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  const std::string authorization = std::string("Bearer ") + kToken;

  // Trusting client: served, and right.
  auto tls = ConnectWithTls(server->port(), server_certificate.pem);
  EXPECT_TRUE(ListHeads(*tls, authorization.c_str()).ok());
  const FetchedTensor weight = Fetch(*tls, kGuardedHead, false, kToken);
  ASSERT_TRUE(weight.status.ok()) << weight.status.error_message();
  const Batch batch = RandomBatch(24, kGuardedVocab, kGuardedHidden, rng);
  const ComputeOutcome out = CallCompute(*tls, StartFor(kGuardedHead, batch, kGuardedHidden, true),
                                         FloatBytes(batch.hidden), 8, -1, kToken);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  const ReferenceResult ref = Reference(weight.values, kGuardedVocab, kGuardedHidden, batch);
  EXPECT_TRUE(LossMatches(out.summary.loss(), ref));
  EXPECT_LE(RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden), kGradBound);
  // TLS does not replace the token.
  EXPECT_EQ(ListHeads(*tls, nullptr).error_code(), StatusCode::UNAUTHENTICATED);

  // Plaintext and untrusting clients never get a connection.
  EXPECT_EQ(ListHeads(*ConnectTo(server->port()), authorization.c_str()).error_code(),
            StatusCode::UNAVAILABLE);
  EXPECT_EQ(ListHeads(*ConnectWithTls(server->port(), other_certificate.pem), authorization.c_str())
                .error_code(),
            StatusCode::UNAVAILABLE);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace lossd::testing
