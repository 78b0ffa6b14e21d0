#include "server/server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "lossd/common/status_macros.h"
#include "lossd/common/version.h"
#include "lossd/storage/checkpoint.h"
#include "lossd/storage/hf_checkpoint.h"
#include "lossd/storage/safetensors.h"
#include "server/replicas/head_sync.h"

namespace lossd::server {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

// The bearer token: the first line of the file, without the whitespace around it (its newline, the
// CR of a file written on Windows). Later lines are the operator's, for comments.
absl::StatusOr<std::string> ReadBearerToken(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string contents, ReadFile(path, "--token_file"));
  const absl::string_view first_line =
      absl::StripAsciiWhitespace(absl::string_view(contents).substr(0, contents.find('\n')));
  if (first_line.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--token_file: expected the bearer token on the first line of ", path,
                     ", got an empty line"));
  }
  return std::string(first_line);
}

// This thread's oldest OpenSSL error as text; empties the queue.
std::string TakeOpenSslError() {
  const unsigned long code = ERR_get_error();
  std::string text = "no reason given";
  if (code != 0) {
    char buffer[256];
    ERR_error_string_n(code, buffer, sizeof(buffer));
    text = buffer;
  }
  ERR_clear_error();
  return text;
}

// Asked for a key's passphrase: there is none to give (gRPC takes unencrypted keys only), and
// OpenSSL must not prompt on the terminal for one.
int NoPassphrase(char*, int, int, void*) { return 0; }

// gRPC reports a certificate or key it cannot use only as a failure to bind the port, so both
// are parsed here first, and the key is checked to be the certificate's. Both files are named
// (ServerConfig::Validate).
absl::StatusOr<grpc::SslServerCredentialsOptions::PemKeyCertPair> ReadTlsKeyPair(
    const ServerConfig& config) {
  ASSIGN_OR_RETURN(std::string cert_pem, ReadFile(config.tls_cert_file, "--tls_cert_file"));
  ASSIGN_OR_RETURN(std::string key_pem, ReadFile(config.tls_key_file, "--tls_key_file"));
  using Bio = std::unique_ptr<BIO, decltype(&BIO_free)>;
  Bio cert_bio(BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())), &BIO_free);
  const std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr), &X509_free);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert_file: expected a PEM certificate (BEGIN CERTIFICATE) in ",
                     config.tls_cert_file, ", got none that parses (", TakeOpenSslError(), ")"));
  }
  Bio key_bio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())), &BIO_free);
  const std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, &NoPassphrase, nullptr), &EVP_PKEY_free);
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key_file: expected an unencrypted PEM private key in ",
                     config.tls_key_file, ", got none that parses (", TakeOpenSslError(), ")"));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    TakeOpenSslError();
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key_file: the key in ", config.tls_key_file,
        " is not the private key of the certificate in --tls_cert_file ", config.tls_cert_file));
  }
  return grpc::SslServerCredentialsOptions::PemKeyCertPair{std::move(key_pem), std::move(cert_pem)};
}

// A TCP listening address: HOST:PORT, [HOST]:PORT, or a bare PORT for every interface
// (civetweb's form). False unless the port is a number in [0, 65535]: gRPC would take port
// 70000 as 70000 mod 65536.
bool SplitHostPort(absl::string_view address, std::string* host, int* port) {
  absl::string_view host_part;
  absl::string_view port_part = address;
  if (const size_t colon = address.rfind(':'); colon != absl::string_view::npos) {
    host_part = address.substr(0, colon);
    port_part = address.substr(colon + 1);
    if (absl::ConsumePrefix(&host_part, "[") && !absl::ConsumeSuffix(&host_part, "]")) return false;
  }
  *host = std::string(host_part);
  return absl::SimpleAtoi(port_part, port) && *port >= 0 && *port <= 65535;
}

absl::Status CheckListenAddress(absl::string_view flag, const std::string& address) {
  std::string host;
  int port = 0;
  // gRPC also listens on Unix sockets.
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:") ||
      SplitHostPort(address, &host, &port)) {
    return absl::OkStatus();
  }
  return InvalidField(flag, "HOST:PORT with a port in [0, 65535]",
                      absl::StrCat("\"", address, "\""));
}

// Why listening on `address` failed, from a bind of our own: gRPC and civetweb say only that it
// did. `unexplained` is the message when that bind succeeds. A port in use is the usual case:
// gRPC is told not to share ports (SO_REUSEPORT), so that a second server on the port fails
// instead of silently taking part of the first one's calls.
absl::Status ListenFailure(absl::string_view flag, const std::string& address,
                           absl::string_view unexplained) {
  std::string host;
  int port = 0;
  if (!SplitHostPort(address, &host, &port)) {
    return absl::UnavailableError(absl::StrCat(flag, ": ", unexplained));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int resolved = getaddrinfo(host.empty() ? nullptr : host.c_str(),
                                   std::to_string(port).c_str(), &hints, &found);
  if (resolved != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot resolve the host of ", address, ": ", gai_strerror(resolved)));
  }
  int error = 0;
  for (const addrinfo* a = found; a != nullptr && error == 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    // As gRPC and civetweb do: a port whose last connections wait in TIME_WAIT can be taken.
    const int on = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) error = errno;
    close(fd);
  }
  freeaddrinfo(found);
  switch (error) {
    case 0: return absl::UnavailableError(absl::StrCat(flag, ": ", unexplained));
    case EADDRINUSE:
      return absl::UnavailableError(
          absl::StrCat(flag, ": ", address, " is in use by another process"));
    case EACCES:
      return absl::PermissionDeniedError(
          absl::StrCat(flag, ": cannot bind ", address, ": permission denied",
                       port < 1024 ? " (ports below 1024 need root or CAP_NET_BIND_SERVICE)" : ""));
    case EADDRNOTAVAIL:
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": cannot bind ", address, ": no interface of this host has that address"));
    default:
      return absl::UnavailableError(
          absl::StrCat(flag, ": cannot bind ", address, ": ", std::strerror(error)));
  }
}

struct HeadSpec {
  std::string name;
  std::string path;    // a model directory, a sharded checkpoint's index or a safetensors file
  std::string tensor;  // empty: chosen from the checkpoint and its config.json
};

absl::StatusOr<HeadSpec> ParseHeadSpec(absl::string_view text) {
  std::pair<std::string, std::string> name_rest = absl::StrSplit(text, absl::MaxSplits('=', 1));
  std::pair<std::string, std::string> path_tensor =
      absl::StrSplit(name_rest.second, absl::MaxSplits('#', 1));
  HeadSpec spec{name_rest.first, path_tensor.first, path_tensor.second};
  if (spec.name.empty() || spec.path.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heads: expected NAME=PATH or NAME=PATH#TENSOR, got \"", text, "\""));
  }
  RETURN_IF_ERROR(storage::ValidateCheckpointHeadName(spec.name));
  return spec;
}

// Each head named once: a second NAME=PATH for a name would be skipped as if a checkpoint of the
// name had resumed first.
absl::StatusOr<std::vector<HeadSpec>> ParseHeadSpecs(const std::vector<std::string>& texts) {
  std::vector<HeadSpec> specs;
  for (size_t i = 0; i < texts.size(); ++i) {
    ASSIGN_OR_RETURN(HeadSpec spec, ParseHeadSpec(texts[i]));
    for (size_t j = 0; j < specs.size(); ++j) {
      if (specs[j].name == spec.name) {
        return absl::InvalidArgumentError(
            absl::StrCat("--heads: head name '", spec.name, "' is given twice, as \"", texts[j],
                         "\" and \"", texts[i], "\"; give each head a name of its own"));
      }
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

// 512 B, 2.5 KiB, 62.5 MiB, 1.2 GiB.
std::string HumanBytes(size_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

// How a head is held, for its startup line: W's storage dtype and bytes, what a file's other
// dtype became (the --head_dtype choice), and the optimizer state a checkpoint brought.
std::string StorageNote(const HeadState& state, absl::string_view file_dtype) {
  std::string note = absl::StrCat("W stored as ", DTypeName(state.weight_dtype), ", ",
                                  HumanBytes(state.weight.size()));
  const absl::StatusOr<DType> in_file = storage::DTypeFromSafetensors(file_dtype);
  if (in_file.ok() && DTypeSize(*in_file) < DTypeSize(state.weight_dtype)) {
    absl::StrAppend(
        &note, " (the file's ", file_dtype, " widened; --head_dtype=", DTypeName(*in_file),
        " keeps it as it is, in ",
        HumanBytes(state.weight.size() / DTypeSize(state.weight_dtype) * DTypeSize(*in_file)), ")");
  } else if (in_file.ok() && *in_file != state.weight_dtype) {
    absl::StrAppend(&note, " (rounded from the file's ", file_dtype, ")");
  }
  const size_t optimizer_bytes = (state.state1.size() + state.state2.size()) * sizeof(float);
  if (optimizer_bytes > 0) {
    absl::StrAppend(&note, ", optimizer state ", HumanBytes(optimizer_bytes));
  }
  return note;
}

absl::StatusOr<HeadState> LoadCheckpointHead(const HeadSpec& spec, DType dtype, std::string* source,
                                             std::string* explanation, std::string* file_dtype) {
  ASSIGN_OR_RETURN(storage::CheckpointHead loaded,
                   storage::LoadCheckpointHead(spec.path, spec.tensor, dtype));
  HeadState state;
  state.head = spec.name;
  state.vocab_size = loaded.vocab_size;
  state.hidden_size = loaded.hidden_size;
  state.weight_dtype = loaded.weight_dtype;
  state.version = 1;
  state.weight = std::move(loaded.weight);
  state.tied_embeddings = loaded.tied_embeddings;
  state.logit_softcap = loaded.logit_softcap;
  *source = std::move(loaded.source);
  *explanation = std::move(loaded.explanation);
  *file_dtype = std::move(loaded.file_dtype);
  return state;
}

}  // namespace

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "float32" || name == "fp32") return DType::kFloat32;
  if (name == "bfloat16" || name == "bf16") return DType::kBFloat16;
  if (name == "float16" || name == "fp16") return DType::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: expected float32, bfloat16 or float16, got \"", name, "\""));
}

absl::Status LossServer::LoadHeads(const ServerConfig& config) {
  ASSIGN_OR_RETURN(const std::vector<HeadSpec> specs, ParseHeadSpecs(config.heads));
  if (!config.checkpoint_dir.empty()) {
    absl::StatusOr<storage::ResumeResult> resuming =
        storage::ResumeFromDirectory(config.checkpoint_dir);
    if (!resuming.ok()) {
      return absl::Status(resuming.status().code(),
                          absl::StrCat("--checkpoint_dir: ", resuming.status().message()));
    }
    const storage::ResumeResult& resumed = *resuming;
    for (const std::string& skipped : resumed.skipped) {
      startup_log_.push_back(absl::StrCat("skipped checkpoint: ", skipped));
    }
    // A head that trained and whose every checkpoint is damaged would otherwise start again from
    // its source W (or not at all) as if it had never trained.
    if (!resumed.damaged.empty()) {
      std::vector<std::string> heads;
      for (const storage::DamagedHead& damaged : resumed.damaged) {
        heads.push_back(absl::StrCat("head '", damaged.head, "' in ", damaged.directory, " (",
                                     absl::StrJoin(damaged.reasons, "; "), ")"));
      }
      return absl::DataLossError(absl::StrCat(
          "--checkpoint_dir: every checkpoint of ", absl::StrJoin(heads, ", and of "),
          " is damaged; refusing to start rather than serve the head as if it had never been "
          "trained. Restore a good checkpoint into the head's directory, or move the directory "
          "aside to start the head from its source"));
    }
    for (const HeadState& state : resumed.heads) {
      const std::string source = absl::StrCat(
          "checkpoint ", storage::CheckpointPath(config.checkpoint_dir, state.head, state.version));
      ASSIGN_OR_RETURN(auto head, Head::Create(*backend_, ledger_, state, source));
      RETURN_IF_ERROR(heads_.Put(head, false));
      startup_log_.push_back(absl::StrCat("head '", state.head, "' [", state.vocab_size, ", ",
                                          state.hidden_size, "] resumed from ", source, "; ",
                                          StorageNote(state, "")));
    }
  }
  for (const HeadSpec& spec : specs) {
    if (absl::StatusOr<std::shared_ptr<Head>> resumed = heads_.Get(spec.name); resumed.ok()) {
      // A checkpoint of another shape is of another model: it must not silently replace the
      // head the operator named.
      ASSIGN_OR_RETURN(const storage::CheckpointHead source,
                       storage::ProbeCheckpointHead(spec.path, spec.tensor));
      const Head& head = **resumed;
      if (source.vocab_size != head.vocab_size() || source.hidden_size != head.hidden_size()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "--heads: head '", spec.name, "' is [", source.vocab_size, ", ", source.hidden_size,
            "] in ", source.source, ", but its checkpoint in --checkpoint_dir (",
            head.Summary().source, ") is [", head.vocab_size(), ", ", head.hidden_size(),
            "]: a checkpoint of another model. Point --checkpoint_dir elsewhere, or move the "
            "head's checkpoint directory aside"));
      }
      startup_log_.push_back(absl::StrCat("head '", spec.name, "': ", spec.path,
                                          " not loaded, its checkpoint is newer"));
      continue;
    }
    std::string source, explanation, file_dtype;
    ASSIGN_OR_RETURN(const HeadState state, LoadCheckpointHead(spec, config.head_dtype, &source,
                                                               &explanation, &file_dtype));
    ASSIGN_OR_RETURN(auto head, Head::Create(*backend_, ledger_, state, source));
    RETURN_IF_ERROR(heads_.Put(head, false));
    startup_log_.push_back(absl::StrCat("head '", spec.name, "' [", state.vocab_size, ", ",
                                        state.hidden_size, "] from ", source, " (", explanation,
                                        "); ", StorageNote(state, file_dtype)));
  }
  if (heads_.List().empty()) {
    const DemoHeadConfig& demo = config.demo;
    const HeadState state =
        MakeDemoHead(demo.name, demo.vocab_size, demo.hidden_size, config.head_dtype, demo.seed);
    const std::string source = absl::StrCat("demo: seeded random init (seed ", demo.seed, ")");
    ASSIGN_OR_RETURN(auto head, Head::Create(*backend_, ledger_, state, source));
    RETURN_IF_ERROR(heads_.Put(head, false));
    startup_log_.push_back(absl::StrCat("head '", demo.name, "' [", demo.vocab_size, ", ",
                                        demo.hidden_size, "] from ", source, "; ",
                                        StorageNote(state, "")));
  }
  return absl::OkStatus();
}

std::vector<GaugeSample> LossServer::ReadState() const {
  std::vector<GaugeSample> samples;
  if (auto memory = backend_->QueryMemory(); memory.ok()) {
    const std::string device = std::string(backend_->kind());
    samples.push_back({StateGauge::kDeviceMemoryTotal,
                       {{"device", device}},
                       static_cast<double>(memory->total_bytes)});
    samples.push_back({StateGauge::kDeviceMemoryUsed,
                       {{"device", device}},
                       static_cast<double>(memory->used_bytes)});
  }
  for (int p = 0; p < kMemoryPurposeCount; ++p) {
    const auto purpose = static_cast<MemoryPurpose>(p);
    samples.push_back({StateGauge::kMemory,
                       {{"purpose", MemoryPurposeName(purpose)}},
                       static_cast<double>(ledger_.current(purpose))});
  }
  for (int p = 0; p < kMemoryPurposeCount; ++p) {
    const auto purpose = static_cast<MemoryPurpose>(p);
    samples.push_back({StateGauge::kMemoryPeak,
                       {{"purpose", MemoryPurposeName(purpose)}},
                       static_cast<double>(ledger_.peak(purpose))});
  }
  for (const auto& [state, purpose] :
       {std::pair{"in_use", MemoryPurpose::kWorkspace}, std::pair{"idle", MemoryPurpose::kCache}}) {
    samples.push_back({StateGauge::kHostBuffer,
                       {{"state", state}},
                       static_cast<double>(host_ledger_.current(purpose))});
  }
  samples.push_back({StateGauge::kQueueDepth, {}, static_cast<double>(scheduler_->queued())});
  samples.push_back({StateGauge::kRunningCalls, {}, static_cast<double>(scheduler_->running())});
  samples.push_back(
      {StateGauge::kComputeBudget, {}, static_cast<double>(scheduler_->capacity_bytes())});
  samples.push_back({StateGauge::kPendingMemory, {}, static_cast<double>(pending_->held_bytes())});
  samples.push_back(
      {StateGauge::kComputeAdmitted, {}, static_cast<double>(scheduler_->admitted_bytes())});
  samples.push_back({StateGauge::kStepRendezvousWaiting,
                     {},
                     static_cast<double>(service_->rendezvous().waiting_meetings())});
  const SharedMemoryMaps& maps = service_->shared_memory_maps();
  samples.push_back({StateGauge::kSharedMemoryHandles, {}, static_cast<double>(maps.handles())});
  samples.push_back({StateGauge::kSharedMemoryMappings, {}, static_cast<double>(maps.mappings())});
  samples.push_back(
      {StateGauge::kSharedMemoryMappedBytes, {}, static_cast<double>(maps.mapped_bytes())});
  samples.push_back({StateGauge::kComputeSocketConnections,
                     {},
                     static_cast<double>(service_->compute_socket_connections())});
  for (const auto& head : heads_.List()) {
    const HeadSummary s = head->Summary();
    samples.push_back(
        {StateGauge::kHeadVersion, {{"head", s.name}}, static_cast<double>(s.version)});
    samples.push_back({StateGauge::kHeadAccumulatedTokens,
                       {{"head", s.name}},
                       static_cast<double>(s.accumulated_tokens)});
    samples.push_back({StateGauge::kHeadStagedGradients,
                       {{"head", s.name}},
                       static_cast<double>(s.staged_gradients)});
  }
  samples.push_back(
      {StateGauge::kReplicaInfo,
       {{"rank", absl::StrCat(replica_rank())}, {"replicas", absl::StrCat(replicas())}},
       1.0});
  samples.push_back({StateGauge::kBuildInfo,
                     {{"version", kVersion}, {"backend", std::string(backend_->kind())}},
                     1.0});
  return samples;
}

absl::Status ServerConfig::Validate() const {
  RETURN_IF_ERROR(CheckListenAddress("--listen", listen_address));
  if (!metrics_address.empty()) {
    RETURN_IF_ERROR(CheckListenAddress("--metrics_listen", metrics_address));
  }
  // 0 would refuse every Compute call, or end it before its client could send a row.
  if (pending_memory_bytes <= 0) {
    return InvalidField("--pending_memory_mib", "a size > 0",
                        absl::StrCat(pending_memory_bytes >> 20));
  }
  if (pending_memory_per_connection_bytes < 0) {
    return InvalidField("--pending_memory_per_connection_mib",
                        "a size in MiB >= 0 (0: half of --pending_memory_mib)",
                        absl::StrCat(pending_memory_per_connection_bytes >> 20));
  }
  if (workspace_budget_bytes < 0) {
    return InvalidField("--workspace_budget_mib", "a size in MiB >= 0 (0: the device's default)",
                        absl::StrCat(workspace_budget_bytes >> 20));
  }
  if (stream_idle <= absl::ZeroDuration()) {
    return InvalidField("--stream_idle_seconds", "a positive duration",
                        absl::FormatDuration(stream_idle));
  }
  if (staged_grad_ttl <= absl::ZeroDuration()) {
    return InvalidField("--staged_grad_seconds", "a positive duration",
                        absl::FormatDuration(staged_grad_ttl));
  }
  if (staged_grad_bytes < 0) {
    return InvalidField("--staged_grad_mib",
                        "a size in MiB >= 0 (0: room for 8 of the largest "
                        "head's gradients)",
                        absl::StrCat(staged_grad_bytes >> 20));
  }
  if (step_wait <= absl::ZeroDuration()) {
    return InvalidField("--step_wait_seconds", "a positive duration",
                        absl::FormatDuration(step_wait));
  }
  if (max_call_ids <= 0) {
    return InvalidField("--max_call_ids", "a count > 0", absl::StrCat(max_call_ids));
  }
  if (max_connection_age < absl::ZeroDuration()) {
    return InvalidField("--max_connection_age_seconds", "0 (unlimited) or a positive duration",
                        absl::FormatDuration(max_connection_age));
  }
  if (compute_memory_bytes < 0) {
    return InvalidField("--compute_memory_mib", "a size in MiB >= 0 (0: follow the heads served)",
                        absl::StrCat(compute_memory_bytes >> 20));
  }
  // 0 running calls would queue every Compute call for ever.
  if (max_running_calls < 1) {
    return InvalidField("--max_running_calls", "a count > 0", absl::StrCat(max_running_calls));
  }
  if (max_queued_calls < 0) {
    return InvalidField("--max_queued_calls", "a count >= 0", absl::StrCat(max_queued_calls));
  }
  if (host_cache_bytes < 0) {
    return InvalidField("--host_cache_mib", "a size in MiB >= 0 (0: keep none)",
                        absl::StrCat(host_cache_bytes >> 20));
  }
  if (max_message_bytes < (int64_t{1} << 20) || max_message_bytes > (int64_t{2047} << 20)) {
    return InvalidField("--max_message_mib", "a size in [1, 2047] MiB (gRPC's limit is an int)",
                        absl::StrCat(max_message_bytes >> 20));
  }
  if (keep_checkpoints < 1) {
    return InvalidField("--keep_checkpoints", "a count > 0", absl::StrCat(keep_checkpoints));
  }
  if (heads.empty() && (demo.vocab_size < 1 || demo.hidden_size < 1)) {
    return InvalidField(demo.vocab_size < 1 ? "--demo_vocab_size" : "--demo_hidden_size",
                        "a size > 0",
                        absl::StrCat(demo.vocab_size < 1 ? demo.vocab_size : demo.hidden_size));
  }
  RETURN_IF_ERROR(ParseHeadSpecs(heads).status());
  if (!compute_socket_listen.empty()) {
    std::string host;
    int port = 0;
    if (!SplitHostPort(compute_socket_listen, &host, &port)) {
      return InvalidField("--compute_socket_listen",
                          "HOST:PORT with a port in [0, 65535] (a TCP address)",
                          absl::StrCat("\"", compute_socket_listen, "\""));
    }
    if (!tls_cert_file.empty()) {
      return InvalidField("--compute_socket_listen",
                          "none with TLS on (--tls_cert_file): the Compute socket carries rows "
                          "and its token in the clear",
                          absl::StrCat("\"", compute_socket_listen, "\""));
    }
  }
  if (compute_socket_max_connections < 1 || compute_socket_max_connections > 4096) {
    return InvalidField("--compute_socket_max_connections", "a count in [1, 4096]",
                        absl::StrCat(compute_socket_max_connections));
  }
  if (compute_socket_max_connections_per_host < 1 ||
      compute_socket_max_connections_per_host > compute_socket_max_connections) {
    return InvalidField("--compute_socket_max_connections_per_host",
                        "a count in [1, --compute_socket_max_connections]",
                        absl::StrCat(compute_socket_max_connections_per_host));
  }
  // SO_MAX_PACING_RATE takes bytes per second in an unsigned long; 1 MB/s is the least useful.
  if (compute_socket_max_flow_bytes_per_second != 0 &&
      (compute_socket_max_flow_bytes_per_second < 1000000 ||
       compute_socket_max_flow_bytes_per_second > (int64_t{1} << 40))) {
    return InvalidField("--compute_socket_max_flow_mb_per_second",
                        "0 (no limit) or 1 to 1099511 MB per second",
                        absl::StrCat(compute_socket_max_flow_bytes_per_second / 1e6));
  }
  if (compute_socket_idle <= absl::ZeroDuration()) {
    return InvalidField("--compute_socket_idle_seconds", "a duration > 0",
                        absl::FormatDuration(compute_socket_idle));
  }
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return absl::InvalidArgumentError(tls_cert_file.empty()
                                          ? "--tls_cert_file: required with --tls_key_file"
                                          : "--tls_key_file: required with --tls_cert_file");
  }
  if (replicas < 1) {
    return InvalidField("--replicas", "1 (a server alone) or more", absl::StrCat(replicas));
  }
  if (replicas == 1 && replica_rank != 0 && replica_rank != -1) {
    return InvalidField("--replica_rank", "0 (or -1) without --replicas",
                        absl::StrCat(replica_rank));
  }
  if (replicas > 1 &&
      (replica_timeout <= absl::ZeroDuration() || replica_join <= absl::ZeroDuration())) {
    return InvalidField(replica_timeout <= absl::ZeroDuration() ? "--replica_timeout_seconds"
                                                                : "--replica_join_seconds",
                        "a positive duration",
                        absl::FormatDuration(std::min(replica_timeout, replica_join)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LossServer>> LossServer::Start(const ServerConfig& config,
                                                              std::unique_ptr<Backend> backend) {
  // What a misconfigured server fails on is checked before heads that may take minutes to load.
  RETURN_IF_ERROR(config.Validate());
  std::string bearer_token;
  if (!config.token_file.empty()) {
    ASSIGN_OR_RETURN(bearer_token, ReadBearerToken(config.token_file));
  }
  std::unique_ptr<ReplicaGroup> replicas;
  if (config.replicas > 1) {
    ReplicaGroupOptions group;
    group.replicas = config.replicas;
    group.rank = config.replica_rank;
    if (group.rank == -1) {
      char hostname[256] = {};
      gethostname(hostname, sizeof(hostname) - 1);
      ASSIGN_OR_RETURN(group.rank, ReplicaRankFromHostname(hostname));
    }
    group.store_address = config.replica_store;
    group.bearer_token = bearer_token;
    group.tls = !config.tls_cert_file.empty();
    group.join_timeout = config.replica_join;
    group.timeout = config.replica_timeout;
    group.step_wait = config.step_wait;
    ASSIGN_OR_RETURN(replicas, ReplicaGroup::Create(group));
  }
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!config.tls_cert_file.empty() || !config.tls_key_file.empty()) {
    ASSIGN_OR_RETURN(auto key_cert_pair, ReadTlsKeyPair(config));
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back(std::move(key_cert_pair));
    credentials = grpc::SslServerCredentials(ssl);
  }

  std::unique_ptr<LossServer> server(new LossServer(config));
  server->replicas_ = std::move(replicas);
  if (backend == nullptr) {
    // A GPU host that silently serves on the CPU (a module built for other GPUs, a missing
    // driver) would look healthy: the log says why "auto" did not take CUDA.
    std::string cuda_unavailable;
    ASSIGN_OR_RETURN(backend, CreateBackend(config.device, {}, &cuda_unavailable));
    if (!cuda_unavailable.empty()) {
      server->startup_log_.push_back(
          absl::StrCat("device auto: CPU (CUDA unavailable: ", cuda_unavailable, ")"));
    }
  }
  server->backend_ = std::move(backend);
  server->startup_log_.push_back(absl::StrCat("backend: ", server->backend_->Describe()));
  if (config.workspace_budget_bytes == 0) {
    server->config_.workspace_budget_bytes =
        static_cast<int64_t>(server->backend_->DefaultWorkspaceBudget());
  }
  server->startup_log_.push_back(absl::StrCat(
      "workspace budget: ", server->config_.workspace_budget_bytes >> 20, " MiB per call",
      config.workspace_budget_bytes == 0 ? " (the device's default)" : ""));
  RETURN_IF_ERROR(server->LoadHeads(config));

  const int64_t compute_memory = server->ComputeBudget(0);
  server->scheduler_ = std::make_unique<Scheduler>(compute_memory, config.max_running_calls,
                                                   config.max_queued_calls);
  server->pending_ = std::make_unique<PendingMemory>(
      config.pending_memory_bytes,
      config.pending_memory_per_connection_bytes == 0
          ? config.pending_memory_bytes / 2
          : std::min(config.pending_memory_per_connection_bytes, config.pending_memory_bytes));
  server->buffers_ = std::make_unique<BufferCache>(*server->backend_, server->ledger_,
                                                   config.cache_call_buffers ? compute_memory : 0);
  server->host_buffers_ =
      std::make_unique<BufferCache>(server->backend_->HostBuffers(), server->host_ledger_,
                                    config.cache_call_buffers ? config.host_cache_bytes : 0);

  ServiceOptions options;
  options.compute.workspace_budget_bytes =
      static_cast<size_t>(server->config_.workspace_budget_bytes);
  options.compute.allow_shared_memory = config.shared_memory;
  options.compute.max_call_ids = config.max_call_ids;
  options.compute.stream_idle = config.stream_idle;
  options.compute.staged_grad_ttl = config.staged_grad_ttl;
  server->staging_room_.SetCapacity(server->StagedGradBudget(0));
  options.rendezvous.wait = config.step_wait;
  options.compute.max_unstarted_streams = config.max_unstarted_streams;
  LossServer* raw_server = server.get();
  options.resize_compute_budget = [raw_server](int64_t incoming_head_elements) {
    raw_server->ResizeComputeBudget(incoming_head_elements);
  };
  options.compute.max_result_message_bytes =
      std::min<int64_t>(config.max_message_bytes / 2, 8 << 20);
  options.max_fetch_chunk_bytes = config.max_message_bytes / 2;
  options.default_fetch_chunk_bytes = std::min<int64_t>(4 << 20, options.max_fetch_chunk_bytes);
  options.checkpoint_dir = config.checkpoint_dir;
  options.keep_checkpoints = config.keep_checkpoints;
  options.bearer_token = std::move(bearer_token);
  options.max_message_bytes = config.max_message_bytes;
  // Load balancers and orchestrators read health; a faulted device serves nothing again, nor
  // does a replica whose group ended.
  options.on_fault = [raw = server.get()](const absl::Status&) {
    if (raw->server_ != nullptr) raw->server_->GetHealthCheckService()->SetServingStatus(false);
  };
  options.replicas = server->replicas_.get();
  server->service_ = std::make_unique<LossService>(
      *server->backend_, server->heads_, server->staging_room_, *server->scheduler_,
      *server->pending_, server->metrics_, server->ledger_, *server->buffers_,
      *server->host_buffers_, std::move(options));
  server->heads_.SetStagedDropObserver([metrics = &server->metrics_](StagedDrop reason, int n) {
    metrics->CountStagedDropped(StagedDropName(reason), n);
  });

  if (config.shared_memory) {
    const absl::Status opened = server->service_->OpenSharedMemorySocket();
    if (!opened.ok()) {
      return absl::Status(opened.code(),
                          absl::StrCat("--shared_memory: ", opened.message(),
                                       " (--shared_memory=false serves without it)"));
    }
  }

  if (!config.compute_socket_listen.empty()) {
    RETURN_IF_ERROR(server->service_->OpenComputeSocket(
        config.compute_socket_listen,
        {.idle = config.compute_socket_idle,
         .max_connections = config.compute_socket_max_connections,
         .max_connections_per_host = config.compute_socket_max_connections_per_host,
         .max_flow_bytes_per_second = config.compute_socket_max_flow_bytes_per_second}));
    server->startup_log_.push_back(
        absl::StrCat("Compute socket on port ", server->service_->compute_socket_port(),
                     " (--compute_socket_listen=", config.compute_socket_listen, ")"));
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config.listen_address, credentials, &server->port_);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (config.max_connection_age > absl::ZeroDuration()) {
    // Calls still running when a connection reaches its age get this long to finish; one that
    // takes longer fails with UNAVAILABLE, which the clients retry on another connection.
    constexpr absl::Duration kConnectionAgeGrace = absl::Minutes(5);
    const auto milliseconds = [](absl::Duration d) {
      return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d), INT_MAX));
    };
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               milliseconds(config.max_connection_age));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                               milliseconds(kConnectionAgeGrace));
  }
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  builder.RegisterService(server->service_.get());
  if (server->replicas_ != nullptr) {
    server->replicas_->SetFailureHandler([raw = server.get()](const absl::Status& failure) {
      raw->service_->EndAfterReplicaFailure(failure);
    });
    if (server->replicas_->service() != nullptr) {
      builder.RegisterService(server->replicas_->service());
    }
    // The other replicas ping replica 0 every 10 s on their Join streams (a replica that stops
    // answering has left), and replica 0 pings them: allow it.
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  }
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return ListenFailure("--listen", config.listen_address,
                         absl::StrCat("gRPC cannot listen on ", config.listen_address));
  }
  if (server->replicas_ != nullptr) {
    // Health stays NOT_SERVING until every replica is in: a group that has not formed trains
    // nothing.
    server->server_->GetHealthCheckService()->SetServingStatus(false);
    RETURN_IF_ERROR(server->replicas_->Form());
    ASSIGN_OR_RETURN(const std::string local, LocalAddressTowards(config.replica_store));
    server->startup_log_.push_back(
        absl::StrCat("replica ", server->replicas_->rank(), " of ", server->replicas_->replicas(),
                     ": the group met at replica 0 (", config.replica_store,
                     "); gradients all-reduce over Gloo, TCP from ", local));
    // Replica 0's heads are the group's.
    ASSIGN_OR_RETURN(Collective* const collective, server->replicas_->collective());
    RETURN_IF_ERROR(SyncHeadsFromReplicaZero(*collective, server->heads_, *server->backend_,
                                             server->ledger_, config.replica_join,
                                             server->startup_log_));
    server->ResizeComputeBudget(0);
  }
  server->server_->GetHealthCheckService()->SetServingStatus(true);

  if (!config.metrics_address.empty()) {
    try {
      server->exposer_ = std::make_unique<prometheus::Exposer>(config.metrics_address);
    } catch (const std::exception& e) {
      return ListenFailure("--metrics_listen", config.metrics_address,
                           absl::StrCat("cannot serve ", config.metrics_address, ": ", e.what()));
    }
    LossServer* raw = server.get();
    server->metrics_.SetStateReader([raw] { return raw->ReadState(); });
    server->exposer_->RegisterCollectable(server->metrics_.registry());
    server->exposer_->RegisterCollectable(server->metrics_.state_collector());
  }
  // Last: a server that failed to start has no thread to join.
  server->staged_sweeper_ = std::make_unique<std::thread>([raw = server.get()] {
    while (!raw->stop_sweeping_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
      const absl::Time now = absl::Now();
      for (const auto& head : raw->heads_.List()) head->ExpireStaged(now);
    }
  });
  return server;
}

absl::Status LossServer::device_fault() const { return service_->device_fault(); }

absl::Status LossServer::replica_failure() const { return service_->replica_failure(); }

int64_t LossServer::LargestGradientBytes(int64_t incoming_head_elements) const {
  int64_t largest_head_elements = incoming_head_elements;
  for (const auto& head : heads_.List()) {
    largest_head_elements =
        std::max(largest_head_elements, head->vocab_size() * head->hidden_size());
  }
  return largest_head_elements * static_cast<int64_t>(sizeof(float));
}

int64_t LossServer::ComputeBudget(int64_t incoming_head_elements) const {
  if (config_.compute_memory_bytes > 0) return config_.compute_memory_bytes;
  return config_.max_running_calls *
         (config_.workspace_budget_bytes + LargestGradientBytes(incoming_head_elements));
}

int64_t LossServer::StagedGradBudget(int64_t incoming_head_elements) const {
  if (config_.staged_grad_bytes > 0) return config_.staged_grad_bytes;
  constexpr int64_t kStagedGradients = 8;
  return kStagedGradients * LargestGradientBytes(incoming_head_elements);
}

void LossServer::ResizeComputeBudget(int64_t incoming_head_elements) {
  if (config_.staged_grad_bytes == 0) {
    staging_room_.SetCapacity(StagedGradBudget(incoming_head_elements));
  }
  if (config_.compute_memory_bytes > 0) return;
  const int64_t budget = ComputeBudget(incoming_head_elements);
  scheduler_->SetCapacity(budget);
  if (config_.cache_call_buffers) buffers_->SetCapacity(budget);
}

int LossServer::metrics_port() const {
  if (exposer_ == nullptr) return 0;
  const std::vector<int> ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

void LossServer::Shutdown(absl::Duration drain) {
  if (shut_down_) return;
  shut_down_ = true;
  // This replica leaving ends its group for the others (their streams to it end).
  if (replicas_ != nullptr) replicas_->Shutdown();
  server_->GetHealthCheckService()->SetServingStatus(false);
  // gRPC's own Shutdown(deadline) also waits for idle client connections to hang up, up to the
  // deadline (seconds, for a client that keeps its channel open). So the service refuses new
  // calls and drains the running ones itself; gRPC then gets a short grace to deliver the last
  // calls' statuses (a handler that has returned may not have sent its status yet, and
  // cancelling it would report a call that took effect as failed) before it closes everything.
  constexpr absl::Duration kStatusGrace = absl::Milliseconds(500);
  const absl::Time deadline = absl::Now() + drain;
  service_->StopAccepting();
  const bool drained = service_->WaitForCallsInFlight(deadline);
  // Its calls still running after the drain end at their next read or write, as gRPC's are
  // cancelled below; its idle connections close.
  service_->StopComputeSocket();
  const absl::Time close_at =
      drained ? std::min(deadline, absl::Now() + kStatusGrace) : absl::Now();
  server_->Shutdown(absl::ToChronoTime(close_at));
  server_->Wait();
  // Compute calls run on threads of their own, which gRPC does not wait for: those cancelled
  // above end promptly (their reads and writes fail, admission notices). The service joins the
  // threads when it goes away.
  service_->WaitForCallsInFlight(absl::InfiniteFuture());
  service_->CloseComputeSocket();
  service_->CloseSharedMemorySocket();
  if (staged_sweeper_ != nullptr) {
    stop_sweeping_.Notify();
    staged_sweeper_->join();
  }
}

LossServer::~LossServer() {
  if (server_ != nullptr) Shutdown(absl::ZeroDuration());
  metrics_.SetStateReader(nullptr);
}

}  // namespace lossd::server
