// What a lossd server refuses to start on, and what it says: heads whose W or optimizer state is
// not finite (from safetensors files and from checkpoints), token and TLS files it cannot use,
// listening addresses it cannot take. Each refusal names the flag or file and the value at fault.
// The real binary meets a taken port in tests/python/test_listen_ports.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lossd/kernels/half.h"
#include "lossd/storage/checkpoint.h"
#include "lossd/storage/safetensors.h"
#include "tests/engine_harness.h"
#include "tests/scratch_files.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

constexpr int64_t kVocab = 40;
constexpr int64_t kHidden = 8;

std::vector<float> RandomWeight(std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::vector<float> weight(kVocab * kHidden);
  for (float& x : weight) x = normal(rng);
  return weight;
}

// A random element of W, and how a refusal names it.
struct Element {
  int64_t row;
  int64_t column;
  int64_t index() const { return row * kHidden + column; }
  std::string Named(const std::string& tensor) const {
    return tensor + "[" + std::to_string(row) + ", " + std::to_string(column) + "]";
  }
};

Element RandomElement(std::mt19937_64& rng) {
  return {std::uniform_int_distribution<int64_t>(0, kVocab - 1)(rng),
          std::uniform_int_distribution<int64_t>(0, kHidden - 1)(rng)};
}

std::string WriteF32Head(const std::string& path, const std::string& tensor,
                         const std::vector<float>& weight) {
  const absl::Status written = storage::WriteSafetensorsAtomically(
      path, {{tensor, "F32", {kVocab, kHidden}, weight.data(), weight.size() * sizeof(float)}}, {});
  return written.ok() ? path : std::string(written.message());
}

std::string WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// A checkpoint of head "main" at version 7, as a step could have left it, plus `poison`.
std::string WriteCheckpoint(const std::string& dir, std::mt19937_64& rng,
                            void (*poison)(storage::CheckpointState&, int64_t index),
                            int64_t index) {
  storage::CheckpointState state;
  state.head = "main";
  state.version = 7;
  state.steps = 3;
  state.vocab_size = kVocab;
  state.hidden_size = kHidden;
  const std::vector<float> weight = RandomWeight(rng);
  state.weight.resize(weight.size() * sizeof(float));
  std::memcpy(state.weight.data(), weight.data(), state.weight.size());
  state.optimizer = storage::OptimizerKind::kSgd;
  state.state1 = RandomWeight(rng);
  poison(state, index);
  return WriteUncheckedCheckpoint(dir, state);
}

struct Refusal {
  const char* name;
  const char* why;
  absl::StatusCode code;
  // Writes the files the case needs into `dir` and sets `config` up; returns what the refusal's
  // message must contain.
  std::vector<std::string> (*prepare)(const std::string& dir, std::mt19937_64& rng,
                                      server::ServerConfig& config);
};

void PrintTo(const Refusal& refusal, std::ostream* os) { *os << refusal.name; }

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

const Refusal kRefusals[] = {
    // Heads whose W is not finite: every call on them would fail, blamed on its hidden states.
    {"heads_file_nan", "a NaN in lm_head.weight", kInvalid,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       std::vector<float> weight = RandomWeight(rng);
       const Element bad = RandomElement(rng);
       weight[bad.index()] = std::nanf("");
       const std::string path = WriteF32Head(dir + "/model.safetensors", "lm_head.weight", weight);
       config.heads = {"main=" + path};
       return std::vector<std::string>{
           "head 'main' from " + path + "#lm_head.weight",
           bad.Named("weight") + ": expected a finite float32 value, got nan"};
     }},
    {"heads_file_tied_bf16_inf", "an Inf in a bf16 embedding that serves as the tied head",
     kInvalid,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       const std::vector<float> weight = RandomWeight(rng);
       std::vector<uint16_t> bf16(weight.size());
       for (size_t i = 0; i < weight.size(); ++i) bf16[i] = FloatToBFloat16(weight[i]);
       const Element bad = RandomElement(rng);
       bf16[bad.index()] = FloatToBFloat16(-INFINITY);
       const std::string path = dir + "/tied.safetensors";
       EXPECT_TRUE(storage::WriteSafetensorsAtomically(path,
                                                       {{"model.embed_tokens.weight",
                                                         "BF16",
                                                         {kVocab, kHidden},
                                                         bf16.data(),
                                                         bf16.size() * sizeof(uint16_t)}},
                                                       {})
                       .ok());
       // The model's config says the embedding is the head.
       std::ofstream(dir + "/config.json")
           << R"({"model_type": "qwen2", "tie_word_embeddings": true})";
       config.heads = {"main=" + path};
       config.head_dtype = DType::kBFloat16;
       return std::vector<std::string>{
           path + "#model.embed_tokens.weight",
           bad.Named("weight") + ": expected a finite bfloat16 value, got -inf"};
     }},
    {"heads_file_overflows_float16", "1e5 is finite in the file's F32 but Inf as float16", kInvalid,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       std::vector<float> weight = RandomWeight(rng);
       const Element bad = RandomElement(rng);
       weight[bad.index()] = 1e5f;
       const std::string path = WriteF32Head(dir + "/model.safetensors", "lm_head.weight", weight);
       config.heads = {"main=" + path + "#lm_head.weight"};
       config.head_dtype = DType::kFloat16;
       return std::vector<std::string>{
           path + "#lm_head.weight",
           bad.Named("weight") + ": expected a finite float16 value, got inf"};
     }},
    {"checkpoint_inf_weight",
     "a step drove W to Inf before the checkpoint was saved, and no "
     "older checkpoint is there to fall back to",
     absl::StatusCode::kDataLoss,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       const Element bad = RandomElement(rng);
       const std::string path = WriteCheckpoint(
           dir + "/checkpoints", rng,
           [](storage::CheckpointState& state, int64_t index) {
             const float inf = INFINITY;
             std::memcpy(state.weight.data() + index * sizeof(float), &inf, sizeof(float));
           },
           bad.index());
       config.checkpoint_dir = dir + "/checkpoints";
       return std::vector<std::string>{
           "--checkpoint_dir: every checkpoint of head 'main' in " + dir + "/checkpoints/main",
           path + ": " + bad.Named("weight") + ": expected a finite float32 value, got inf",
           "refusing to start"};
     }},
    {"checkpoint_nan_momentum", "a NaN momentum would carry into W at the next step",
     absl::StatusCode::kDataLoss,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       const Element bad = RandomElement(rng);
       const std::string path = WriteCheckpoint(
           dir + "/checkpoints", rng,
           [](storage::CheckpointState& state, int64_t index) {
             state.state1[index] = std::nanf("");
           },
           bad.index());
       config.checkpoint_dir = dir + "/checkpoints";
       return std::vector<std::string>{"every checkpoint of head 'main'",
                                       path + ": " + bad.Named("optimizer.state1") +
                                           ": expected a finite float32 value, got nan"};
     }},
    {"checkpoint_of_another_shape",
     "a [41, 8] checkpoint must not silently replace the [40, 8] "
     "head named by --heads",
     absl::StatusCode::kFailedPrecondition,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       const std::string source =
           WriteF32Head(dir + "/model.safetensors", "lm_head.weight", RandomWeight(rng));
       storage::CheckpointState state;
       state.head = "main";
       state.version = 3;
       state.vocab_size = kVocab + 1;
       state.hidden_size = kHidden;
       state.weight.assign((kVocab + 1) * kHidden * sizeof(float), 0);
       const std::string checkpoint = WriteUncheckedCheckpoint(dir + "/checkpoints", state);
       config.heads = {"main=" + source};
       config.checkpoint_dir = dir + "/checkpoints";
       return std::vector<std::string>{"--heads: head 'main' is [40, 8] in " + source,
                                       "checkpoint " + checkpoint, "is [41, 8]"};
     }},
    // Soft caps fp32 cannot hold: every default call on the head would be refused naming a
    // field its client never sent.
    {"config_softcap_rounds_to_zero", "final_logit_softcapping 1e-300 is 0 in fp32", kInvalid,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       WriteF32Head(dir + "/model.safetensors", "lm_head.weight", RandomWeight(rng));
       WriteText(dir + "/config.json", R"({"model_type": "gemma2", "tie_word_embeddings": false,
                                           "final_logit_softcapping": 1e-300})");
       config.heads = {"main=" + dir};
       return std::vector<std::string>{dir + "/config.json: final_logit_softcapping",
                                       "a normal fp32 number", "got 1e-300"};
     }},
    {"config_softcap_overflows", "final_logit_softcapping 1e39 is Inf in fp32", kInvalid,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       WriteF32Head(dir + "/model.safetensors", "lm_head.weight", RandomWeight(rng));
       WriteText(dir + "/config.json",
                 R"({"text_config": {"final_logit_softcapping": 1e39}, "model_type": "x"})");
       config.heads = {"main=" + dir};
       return std::vector<std::string>{dir + "/config.json: text_config.final_logit_softcapping",
                                       "got 1e+39"};
     }},
    // Files that are not what they claim, and what they say about themselves.
    {"config_not_utf8", "a parse error quotes the bytes it read: escaped, not raw", kInvalid,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       WriteF32Head(dir + "/model.safetensors", "lm_head.weight", RandomWeight(rng));
       WriteText(dir + "/config.json", "{\"model_type\": \xff\xfe\x01}");
       config.heads = {"main=" + dir};
       return std::vector<std::string>{dir + "/config.json: not valid JSON", "\\xff"};
     }},
    {"config_nested_deep", "a config nested a million levels deep", kInvalid,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       WriteF32Head(dir + "/model.safetensors", "lm_head.weight", RandomWeight(rng));
       WriteText(dir + "/config.json",
                 "{\"a\": " + std::string(1 << 20, '[') + std::string(1 << 20, ']') + "}");
       config.heads = {"main=" + dir};
       return std::vector<std::string>{dir + "/config.json: nested deeper than 64 levels"};
     }},
    {"config_too_large", "a config of 5 MiB", kInvalid,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       WriteF32Head(dir + "/model.safetensors", "lm_head.weight", RandomWeight(rng));
       WriteText(dir + "/config.json", "{\"a\": \"" + std::string(5 << 20, 'x') + "\"}");
       config.heads = {"main=" + dir};
       return std::vector<std::string>{dir + "/config.json: 5242889 bytes, more than the"};
     }},
    {"head_dtype_not_float", "the dtype error names the file", kInvalid,
     [](const std::string& dir, std::mt19937_64&, server::ServerConfig& config) {
       const std::vector<int32_t> ids(kVocab * kHidden, 1);
       const std::string path = dir + "/ids.safetensors";
       EXPECT_TRUE(storage::WriteSafetensorsAtomically(path,
                                                       {{"lm_head.weight",
                                                         "I32",
                                                         {kVocab, kHidden},
                                                         ids.data(),
                                                         ids.size() * sizeof(int32_t)}},
                                                       {})
                       .ok());
       config.heads = {"main=" + path};
       return std::vector<std::string>{path + ": tensor 'lm_head.weight': has dtype 'I32'"};
     }},
    {"checkpoint_dir_dangling_link", "saves would go nowhere",
     absl::StatusCode::kFailedPrecondition,
     [](const std::string& dir, std::mt19937_64&, server::ServerConfig& config) {
       std::filesystem::create_symlink(dir + "/gone", dir + "/checkpoints");
       config.checkpoint_dir = dir + "/checkpoints";
       return std::vector<std::string>{"--checkpoint_dir: " + dir + "/checkpoints",
                                       "symbolic link to " + dir + "/gone"};
     }},
    // The --heads list.
    {"heads_duplicate_name", "the second entry was skipped as if a checkpoint were newer", kInvalid,
     [](const std::string& dir, std::mt19937_64& rng, server::ServerConfig& config) {
       const std::string first =
           WriteF32Head(dir + "/a.safetensors", "lm_head.weight", RandomWeight(rng));
       const std::string second =
           WriteF32Head(dir + "/b.safetensors", "lm_head.weight", RandomWeight(rng));
       config.heads = {"main=" + first, "other=" + second, "main=" + second};
       return std::vector<std::string>{"--heads: head name 'main' is given twice, as \"main=" +
                                       first + "\" and \"main=" + second + "\""};
     }},
    // Token and TLS files.
    {"token_file_first_line_empty", "the token must be on the first line", kInvalid,
     [](const std::string& dir, std::mt19937_64&, server::ServerConfig& config) {
       config.token_file = WriteText(dir + "/token", "\ns3cret-token\n");
       return std::vector<std::string>{
           "--token_file: expected the bearer token on the first line of " + config.token_file +
           ", got an empty line"};
     }},
    {"token_file_blank", "only whitespace", kInvalid,
     [](const std::string& dir, std::mt19937_64&, server::ServerConfig& config) {
       config.token_file = WriteText(dir + "/token", " \t\r\n");
       return std::vector<std::string>{"--token_file", "got an empty line"};
     }},
    {"tls_key_of_another_certificate", "gRPC would only fail to bind the port", kInvalid,
     [](const std::string& dir, std::mt19937_64&, server::ServerConfig& config) {
       const Certificate mine = MakeCertificate(dir, "mine");
       const Certificate other = MakeCertificate(dir, "other");
       if (mine.pem.empty() || other.pem.empty()) {
         return std::vector<std::string>{"(the openssl CLI could not make test certificates)"};
       }
       config.tls_cert_file = mine.cert_file;
       config.tls_key_file = other.key_file;
       return std::vector<std::string>{"--tls_key_file: the key in " + other.key_file +
                                       " is not the private key of the certificate in "
                                       "--tls_cert_file " +
                                       mine.cert_file};
     }},
    {"tls_cert_not_pem", "a certificate file that holds no certificate", kInvalid,
     [](const std::string& dir, std::mt19937_64&, server::ServerConfig& config) {
       const Certificate mine = MakeCertificate(dir, "mine");
       config.tls_cert_file = WriteText(dir + "/garbage.crt", "not a certificate\n");
       config.tls_key_file = mine.key_file;
       return std::vector<std::string>{"--tls_cert_file: expected a PEM certificate",
                                       config.tls_cert_file};
     }},
    {"tls_key_is_a_certificate", "the certificate given twice, for the key too", kInvalid,
     [](const std::string& dir, std::mt19937_64&, server::ServerConfig& config) {
       const Certificate mine = MakeCertificate(dir, "mine");
       config.tls_cert_file = mine.cert_file;
       config.tls_key_file = mine.cert_file;
       return std::vector<std::string>{
           "--tls_key_file: expected an unencrypted PEM private key in " + mine.cert_file};
     }},
    {"tls_key_without_certificate", "a key alone turns nothing on", kInvalid,
     [](const std::string& dir, std::mt19937_64&, server::ServerConfig& config) {
       config.tls_key_file = MakeCertificate(dir, "mine").key_file;
       return std::vector<std::string>{"--tls_cert_file: required with --tls_key_file"};
     }},
    // Listening addresses.
    {"listen_port_70000", "gRPC would listen on 70000 mod 65536", kInvalid,
     [](const std::string&, std::mt19937_64&, server::ServerConfig& config) {
       config.listen_address = "127.0.0.1:70000";
       return std::vector<std::string>{
           "--listen: expected HOST:PORT with a port in [0, 65535], got \"127.0.0.1:70000\""};
     }},
    {"listen_without_port", "no port at all", kInvalid,
     [](const std::string&, std::mt19937_64&, server::ServerConfig& config) {
       config.listen_address = "127.0.0.1";
       return std::vector<std::string>{"--listen: expected HOST:PORT"};
     }},
    {"metrics_listen_port_negative", "a port of -1", kInvalid,
     [](const std::string&, std::mt19937_64&, server::ServerConfig& config) {
       config.metrics_address = "127.0.0.1:-1";
       return std::vector<std::string>{"--metrics_listen: expected HOST:PORT"};
     }},
    // Compute's bounds.
    {"pending_memory_zero", "every Compute call would be refused", kInvalid,
     [](const std::string&, std::mt19937_64&, server::ServerConfig& config) {
       config.pending_memory_bytes = 0;
       return std::vector<std::string>{"--pending_memory_mib: expected a size > 0, got 0"};
     }},
    {"pending_memory_per_connection_negative", "a negative share would refuse every call", kInvalid,
     [](const std::string&, std::mt19937_64&, server::ServerConfig& config) {
       config.pending_memory_per_connection_bytes = int64_t{-1} << 20;
       return std::vector<std::string>{
           "--pending_memory_per_connection_mib: expected a size in MiB >= 0"};
     }},
    {"stream_idle_zero", "every Compute call would end before its rows came", kInvalid,
     [](const std::string&, std::mt19937_64&, server::ServerConfig& config) {
       config.stream_idle = absl::ZeroDuration();
       return std::vector<std::string>{
           "--stream_idle_seconds: expected a positive duration, got 0"};
     }},
    {"workspace_budget_negative", "-1 MiB would wrap to a budget of 16 EiB", kInvalid,
     [](const std::string&, std::mt19937_64&, server::ServerConfig& config) {
       config.workspace_budget_bytes = int64_t{-1} << 20;
       return std::vector<std::string>{"--workspace_budget_mib: expected a size in MiB >= 0"};
     }},
    {"stream_idle_negative", "-1 s", kInvalid,
     [](const std::string&, std::mt19937_64&, server::ServerConfig& config) {
       config.stream_idle = absl::Seconds(-1);
       return std::vector<std::string>{
           "--stream_idle_seconds: expected a positive duration, got -1s"};
     }},
    // Flags are checked before heads load (which may take minutes): a head that cannot load
    // must not be what a bad flag is reported as.
    {"max_call_ids_zero", "checked before the heads", kInvalid,
     [](const std::string& dir, std::mt19937_64&, server::ServerConfig& config) {
       config.max_call_ids = 0;
       config.heads = {"main=" + dir + "/missing.safetensors"};
       return std::vector<std::string>{"--max_call_ids: expected a count > 0, got 0"};
     }},
    {"max_connection_age_negative", "checked before the heads", kInvalid,
     [](const std::string& dir, std::mt19937_64&, server::ServerConfig& config) {
       config.max_connection_age = absl::Seconds(-1);
       config.heads = {"main=" + dir + "/missing.safetensors"};
       return std::vector<std::string>{"--max_connection_age_seconds: expected 0 (unlimited)"};
     }},
};

class StartupRefusalTest : public ::testing::TestWithParam<Refusal> {};

TEST_P(StartupRefusalTest, NamesWhatIsWrong) {
  const Refusal& refusal = GetParam();
  SCOPED_TRACE(refusal.why);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  ScratchDir dir("lossd_startup");
  server::ServerConfig config;
  config.listen_address = "127.0.0.1:0";
  config.metrics_address = "";
  config.demo = {"demo", kVocab, kHidden, 1};
  const std::vector<std::string> fields = refusal.prepare(dir.path(), rng, config);

  auto started = server::LossServer::Start(config, CreateBackend("cpu").value());
  ASSERT_FALSE(started.ok()) << "the server started";
  EXPECT_EQ(started.status().code(), refusal.code) << started.status();
  for (const std::string& field : fields) {
    EXPECT_NE(started.status().message().find(field), absl::string_view::npos)
        << "the message does not name " << field << ": " << started.status().message();
  }
}

INSTANTIATE_TEST_SUITE_P(Table, StartupRefusalTest, ::testing::ValuesIn(kRefusals),
                         [](const auto& info) { return std::string(info.param.name); });

// Settings ServerConfig::Validate refuses before anything is opened, each naming its flag; a
// head that cannot load is configured too, so that it is not what the refusal names.
struct BadSetting {
  const char* name;
  const char* why;
  void (*set)(server::ServerConfig& config);
  const char* message;
};

void PrintTo(const BadSetting& bad, std::ostream* os) { *os << bad.name; }

// clang-format off
const BadSetting kBadSettings[] = {
    {"no_running_calls", "every call would wait in the queue for ever",
     [](server::ServerConfig& c) { c.max_running_calls = 0; },
     "--max_running_calls: expected a count > 0, got 0"},
    {"negative_queue", "a queue cannot hold -1 calls",
     [](server::ServerConfig& c) { c.max_queued_calls = -1; },
     "--max_queued_calls: expected a count >= 0, got -1"},
    {"negative_compute_memory", "-5 MiB is no budget",
     [](server::ServerConfig& c) { c.compute_memory_bytes = int64_t{-5} << 20; },
     "--compute_memory_mib: expected a size in MiB >= 0"},
    {"negative_host_cache", "-1 MiB of idle buffers",
     [](server::ServerConfig& c) { c.host_cache_bytes = int64_t{-1} << 20; },
     "--host_cache_mib: expected a size in MiB >= 0"},
    {"zero_message_size", "no message would fit",
     [](server::ServerConfig& c) { c.max_message_bytes = 0; },
     "--max_message_mib: expected a size in [1, 2047] MiB"},
    {"message_size_past_int", "gRPC takes the limit as an int",
     [](server::ServerConfig& c) { c.max_message_bytes = int64_t{4096} << 20; },
     "--max_message_mib: expected a size in [1, 2047] MiB (gRPC's limit is an int), got 4096"},
    {"keep_no_checkpoint", "a save would delete the checkpoint it wrote",
     [](server::ServerConfig& c) { c.keep_checkpoints = 0; },
     "--keep_checkpoints: expected a count > 0, got 0"},
    {"empty_demo_head", "a [0, H] head serves nothing",
     [](server::ServerConfig& c) { c.heads.clear(); c.demo.vocab_size = 0; },
     "--demo_vocab_size: expected a size > 0, got 0"},
    {"head_spec_without_path", "NAME= names no file",
     [](server::ServerConfig& c) { c.heads = {"main="}; },
     "--heads: expected NAME=PATH or NAME=PATH#TENSOR, got \"main=\""},
    {"key_without_certificate", "TLS needs both",
     [](server::ServerConfig& c) { c.tls_key_file = "/nonexistent/key.pem"; },
     "--tls_cert_file: required with --tls_key_file"},
    {"compute_socket_port_70000", "a TCP port is at most 65535",
     [](server::ServerConfig& c) { c.compute_socket_listen = "127.0.0.1:70000"; },
     "--compute_socket_listen: expected HOST:PORT with a port in [0, 65535] (a TCP address), "
     "got \"127.0.0.1:70000\""},
    {"compute_socket_with_tls", "the socket would carry rows and the token in the clear",
     [](server::ServerConfig& c) {
       c.compute_socket_listen = "127.0.0.1:0";
       c.tls_cert_file = "/nonexistent/cert.pem";
       c.tls_key_file = "/nonexistent/key.pem";
     },
     "--compute_socket_listen: expected none with TLS on (--tls_cert_file)"},
    {"compute_socket_host_over_total", "one host could never reach its share",
     [](server::ServerConfig& c) {
       c.compute_socket_max_connections = 8;
       c.compute_socket_max_connections_per_host = 9;
     },
     "--compute_socket_max_connections_per_host: expected a count in [1, "
     "--compute_socket_max_connections], got 9"},
    {"compute_socket_idle_zero", "every kept connection would close at once",
     [](server::ServerConfig& c) { c.compute_socket_idle = absl::ZeroDuration(); },
     "--compute_socket_idle_seconds: expected a duration > 0, got 0"},
    {"compute_socket_flow_below_1_mb", "a rate the kernel would pace to a crawl",
     [](server::ServerConfig& c) { c.compute_socket_max_flow_bytes_per_second = 5000; },
     "--compute_socket_max_flow_mb_per_second: expected 0 (no limit) or 1 to 1099511 MB per "
     "second, got 0.005"},
    {"rank_without_group", "a rank only means something in a replica group",
     [](server::ServerConfig& c) { c.replica_rank = 3; },
     "--replica_rank: expected 0 (or -1) without --replicas, got 3"},
    {"group_without_timeout", "a collective that may never end",
     [](server::ServerConfig& c) { c.replicas = 2; c.replica_timeout = absl::ZeroDuration(); },
     "--replica_timeout_seconds: expected a positive duration, got 0"},
};
// clang-format on

class BadSettingTest : public ::testing::TestWithParam<BadSetting> {};

TEST_P(BadSettingTest, IsRefusedByValidateAndStartNamingTheFlag) {
  const BadSetting& bad = GetParam();
  SCOPED_TRACE(bad.why);
  ScratchDir dir("lossd_settings");
  server::ServerConfig config;
  config.listen_address = "127.0.0.1:0";
  config.metrics_address = "";
  config.demo = {"demo", kVocab, kHidden, 1};
  config.heads = {"main=" + dir.path() + "/missing.safetensors"};
  ASSERT_TRUE(config.Validate().ok()) << config.Validate();
  bad.set(config);
  const absl::Status validated = config.Validate();
  EXPECT_EQ(validated.code(), kInvalid) << validated;
  EXPECT_TRUE(absl::StrContains(validated.message(), bad.message)) << validated;
  auto started = server::LossServer::Start(config, CreateBackend("cpu").value());
  ASSERT_FALSE(started.ok()) << "the server started";
  EXPECT_EQ(started.status(), validated);
}

INSTANTIATE_TEST_SUITE_P(Table, BadSettingTest, ::testing::ValuesIn(kBadSettings),
                         [](const auto& info) { return std::string(info.param.name); });

// A newest checkpoint the server would refuse (a step drove W to Inf before it was saved) is
// passed over: the head resumes from the newest good one, and the log says what was skipped.
TEST(CheckpointFallbackTest, ResumesFromTheNewestGoodCheckpoint) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  ScratchDir dir("lossd_startup");
  const std::string checkpoints = dir.path() + "/checkpoints";
  const std::string good = WriteCheckpoint(
      checkpoints, rng, [](storage::CheckpointState&, int64_t) {}, 0);
  const Element bad = RandomElement(rng);
  const std::string newest = WriteCheckpoint(
      checkpoints, rng,
      [](storage::CheckpointState& state, int64_t index) {
        state.version = 8;
        const float inf = -INFINITY;
        std::memcpy(state.weight.data() + index * sizeof(float), &inf, sizeof(float));
      },
      bad.index());
  server::ServerConfig config;
  config.listen_address = "127.0.0.1:0";
  config.metrics_address = "";
  config.checkpoint_dir = checkpoints;
  auto server = server::LossServer::Start(config, CreateBackend("cpu").value());
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::shared_ptr<server::Head>> head = (*server)->heads().Get("main");
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->version(), 7u);
  EXPECT_EQ((*head)->Summary().source, "checkpoint " + good);
  const std::string log = absl::StrJoin((*server)->startup_log(), "\n");
  EXPECT_NE(log.find("skipped checkpoint: " + newest + ": " + bad.Named("weight") +
                     ": expected a finite float32 value, got -inf"),
            std::string::npos)
      << log;
}

// MemTotal from /proc/meminfo, read here rather than through the backend under test.
int64_t HostMemoryBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024;
  }
  return -1;
}

// Without a configured budget the CPU server takes 1/16 of the host's memory within
// [256 MiB, 1 GiB], and says so; a configured budget is used as it is.
TEST(WorkspaceBudgetTest, ZeroTakesTheDevicesDefaultAndTheLogSaysWhich) {
  const int64_t host = HostMemoryBytes();
  ASSERT_GT(host, 0) << "/proc/meminfo has no MemTotal";
  const int64_t expected_mib =
      std::clamp<int64_t>(host / 16, int64_t{256} << 20, int64_t{1} << 30) >> 20;
  for (const int64_t configured_mib : {int64_t{0}, int64_t{3}}) {
    SCOPED_TRACE(::testing::Message() << "--workspace_budget_mib=" << configured_mib);
    server::ServerConfig config;
    config.listen_address = "127.0.0.1:0";
    config.metrics_address = "";
    config.demo = {"demo", kVocab, kHidden, 1};
    config.workspace_budget_bytes = configured_mib << 20;
    auto started = server::LossServer::Start(config, CreateBackend("cpu").value());
    ASSERT_TRUE(started.ok()) << started.status();
    const std::string wanted =
        configured_mib == 0 ? absl::StrCat("workspace budget: ", expected_mib,
                                           " MiB per call (the device's default)")
                            : absl::StrCat("workspace budget: ", configured_mib, " MiB per call");
    const std::vector<std::string>& log = (*started)->startup_log();
    EXPECT_NE(std::find(log.begin(), log.end(), wanted), log.end())
        << "no line '" << wanted << "' in:\n"
        << absl::StrJoin(log, "\n");
  }
}

// A head's startup line says how W is stored and what it costs, and when the storage dtype is
// wider than the file's, what --head_dtype would save: a bf16 checkpoint served as fp32 takes
// twice its memory, which the operator should not learn from the GPU's memory gauge.
struct StorageLineCase {
  const char* name;
  DType file_dtype;
  DType head_dtype;
  const char* line_ends_with;  // for a [1024, 512] head
};

void PrintTo(const StorageLineCase& c, std::ostream* os) { *os << c.name; }

class StorageLineTest : public ::testing::TestWithParam<StorageLineCase> {};

TEST_P(StorageLineTest, NamesTheDTypesAndTheBytes) {
  const StorageLineCase& c = GetParam();
  constexpr int64_t kRows = 1024, kCols = 512;
  ScratchDir dir("lossd_startup");
  std::vector<float> weight(kRows * kCols);
  std::mt19937_64 rng(FreshSeed());
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (float& x : weight) x = normal(rng);
  std::vector<uint16_t> halves(weight.size());
  for (size_t i = 0; i < weight.size(); ++i) {
    halves[i] =
        c.file_dtype == DType::kBFloat16 ? FloatToBFloat16(weight[i]) : FloatToFloat16(weight[i]);
  }
  const bool wide = c.file_dtype == DType::kFloat32;
  const std::string path = dir.File("model.safetensors");
  const void* data = wide ? static_cast<const void*>(weight.data()) : halves.data();
  const size_t bytes = wide ? weight.size() * sizeof(float) : halves.size() * sizeof(uint16_t);
  ASSERT_TRUE(
      storage::WriteSafetensorsAtomically(path,
                                          {{"lm_head.weight",
                                            storage::DTypeToSafetensors(c.file_dtype).value(),
                                            {kRows, kCols},
                                            data,
                                            bytes}},
                                          {})
          .ok());
  server::ServerConfig config;
  config.heads = {"main=" + path};
  config.head_dtype = c.head_dtype;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  // Between the source and the storage: why that tensor (a file without config.json beside it).
  const std::string expected = "head 'main' [1024, 512] from " + path + "#lm_head.weight (" +
                               storage::DTypeToSafetensors(c.file_dtype).value() +
                               ") (no config.json: untied, the checkpoint's lm_head); " +
                               c.line_ends_with;
  const std::vector<std::string>& log = server->startup_log();
  EXPECT_NE(std::find(log.begin(), log.end(), expected), log.end())
      << "no line\n  " << expected << "\nin\n  " << absl::StrJoin(log, "\n  ");
}

const StorageLineCase kStorageLines[] = {
    {"bf16_file_as_fp32", DType::kBFloat16, DType::kFloat32,
     "W stored as float32, 2.0 MiB (the file's BF16 widened; --head_dtype=bfloat16 keeps it as "
     "it is, in 1.0 MiB)"},
    {"fp16_file_as_fp32", DType::kFloat16, DType::kFloat32,
     "W stored as float32, 2.0 MiB (the file's F16 widened; --head_dtype=float16 keeps it as it "
     "is, in 1.0 MiB)"},
    {"bf16_file_as_bf16", DType::kBFloat16, DType::kBFloat16, "W stored as bfloat16, 1.0 MiB"},
    {"fp32_file_as_bf16", DType::kFloat32, DType::kBFloat16,
     "W stored as bfloat16, 1.0 MiB (rounded from the file's F32)"},
    {"fp32_file_as_fp32", DType::kFloat32, DType::kFloat32, "W stored as float32, 2.0 MiB"},
};

INSTANTIATE_TEST_SUITE_P(Table, StorageLineTest, ::testing::ValuesIn(kStorageLines),
                         [](const auto& info) { return std::string(info.param.name); });

grpc::StatusCode ListHeadsWith(int port, const std::string& token) {
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer " + token);
  v1::ListHeadsResponse response;
  return ConnectTo(port)->ListHeads(&context, {}, &response).error_code();
}

// The README's contract: the first line is the token, so a file may carry a comment or the
// previous token below it; whitespace around it, a CR LF line end, is not part of the token. (The
// whole file as the token locked every client out: no metadata value can hold a line break.)
TEST(TokenFileTest, TheFirstLineIsTheToken) {
  ScratchDir dir("lossd_startup");
  server::ServerConfig config;
  config.token_file =
      WriteText(dir.File("token"), "  s3cret-token\r\n# rotated: old-token\nold-token\n");
  config.demo = {"demo", kVocab, kHidden, 1};
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(ListHeadsWith(server->port(), "s3cret-token"), grpc::StatusCode::OK);
  EXPECT_EQ(ListHeadsWith(server->port(), "old-token"), grpc::StatusCode::UNAUTHENTICATED);
}

// gRPC sets SO_REUSEPORT by default: a second server on the port would start, and the kernel would
// spread new connections over both. The second one must fail, and the first keep every client.
TEST(ListenTest, ASecondServerOnATakenPortIsRefused) {
  server::ServerConfig config;
  config.demo = {"first", kVocab, kHidden, 1};
  auto first = StartTestServer(config);
  ASSERT_NE(first, nullptr);
  const std::string address = "127.0.0.1:" + std::to_string(first->port());

  server::ServerConfig second_config;
  second_config.listen_address = address;
  second_config.metrics_address = "";
  second_config.demo = {"second", kVocab, kHidden, 2};
  auto second = server::LossServer::Start(second_config, CreateBackend("cpu").value());
  ASSERT_FALSE(second.ok()) << "a second server listens on " << address;
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(second.status().message(), "--listen: " + address + " is in use by another process");

  grpc::ClientContext context;
  v1::ListHeadsResponse response;
  ASSERT_TRUE(ConnectTo(first->port())->ListHeads(&context, {}, &response).ok());
  ASSERT_EQ(response.heads_size(), 1);
  EXPECT_EQ(response.heads(0).name(), "first");
}

}  // namespace
}  // namespace lossd::testing
