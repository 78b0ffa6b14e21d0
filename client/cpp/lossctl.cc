// lossctl: the command line of lossd. Lists and describes heads, runs loss/score calls from files
// or synthetic data, fetches W and dL/dW, steps, saves, uploads heads, and benchmarks.
//
// Exit codes: 0 success, 1 a failed call or unreadable file (the server's code and message go to
// stderr), 2 a usage error.
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/cpp/npy.h"
#include "lossd/common/counter_random.h"
#include "lossd/common/status_macros.h"
#include "lossd/common/version.h"
#include "lossd/client/client.h"
#include "nlohmann/json.hpp"
#include "lossd/storage/hf_checkpoint.h"
#include "lossd/storage/safetensors.h"

namespace lossd::client {
namespace {

// ---------------------------------------------------------------------------------------------
// Usage errors carry a payload so that main() can tell them (exit 2) from failed calls (exit 1).

constexpr char kUsagePayload[] = "lossctl/usage";

absl::Status UsageError(absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kUsagePayload, absl::Cord("1"));
  return status;
}

bool IsUsageError(const absl::Status& status) { return status.GetPayload(kUsagePayload).has_value(); }

// ---------------------------------------------------------------------------------------------
// Flags: --name=value or --name value; booleans as --name, --name=true or --name=false.

enum class FlagKind { kBool, kInt, kDouble, kString };

struct FlagSpec {
  std::string name;
  FlagKind kind;
  std::string default_value;  // as it would be written on the command line; "" for none
  std::string help;
};

class Flags {
 public:
  // Fills every flag in `specs` with its default, then parses `args` against them.
  static absl::StatusOr<Flags> Parse(const std::vector<FlagSpec>& specs,
                                     const std::vector<std::string>& args) {
    Flags flags;
    for (const FlagSpec& spec : specs) RETURN_IF_ERROR(flags.Set(spec, spec.default_value, false));
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& arg = args[i];
      if (!absl::StartsWith(arg, "--")) {
        flags.positional_.push_back(arg);
        continue;
      }
      const size_t equals = arg.find('=');
      const std::string name = arg.substr(2, equals == std::string::npos ? std::string::npos : equals - 2);
      const auto spec =
          std::find_if(specs.begin(), specs.end(), [&](const FlagSpec& s) { return s.name == name; });
      if (spec == specs.end()) return UsageError(absl::StrCat("unknown flag --", name));
      std::string value;
      if (equals != std::string::npos) {
        value = arg.substr(equals + 1);
      } else if (spec->kind == FlagKind::kBool) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return UsageError(absl::StrCat("--", name, " needs a value"));
      }
      RETURN_IF_ERROR(flags.Set(*spec, value, true));
    }
    return flags;
  }

  bool given(const std::string& name) const { return given_.contains(name); }
  bool Bool(const std::string& name) const { return bools_.at(name); }
  int64_t Int(const std::string& name) const { return ints_.at(name); }
  double Double(const std::string& name) const { return doubles_.at(name); }
  const std::string& String(const std::string& name) const { return strings_.at(name); }
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  absl::Status Set(const FlagSpec& spec, const std::string& value, bool from_command_line) {
    if (from_command_line) given_.insert(spec.name);
    auto bad = [&](absl::string_view expected) {
      return UsageError(absl::StrCat("--", spec.name, ": expected ", expected, ", got \"", value, "\""));
    };
    switch (spec.kind) {
      case FlagKind::kBool: {
        bool parsed = false;
        if (!absl::SimpleAtob(value, &parsed)) return bad("true or false");
        bools_[spec.name] = parsed;
        break;
      }
      case FlagKind::kInt: {
        int64_t parsed = 0;
        if (!value.empty() && !absl::SimpleAtoi(value, &parsed)) return bad("an integer");
        ints_[spec.name] = parsed;
        break;
      }
      case FlagKind::kDouble: {
        double parsed = 0.0;
        if (!value.empty() && (!absl::SimpleAtod(value, &parsed) || !std::isfinite(parsed))) {
          return bad("a finite number");
        }
        doubles_[spec.name] = parsed;
        break;
      }
      case FlagKind::kString: strings_[spec.name] = value; break;
    }
    return absl::OkStatus();
  }

  std::set<std::string> given_;
  std::map<std::string, bool> bools_;
  std::map<std::string, int64_t> ints_;
  std::map<std::string, double> doubles_;
  std::map<std::string, std::string> strings_;
  std::vector<std::string> positional_;
};

const std::vector<FlagSpec>& GlobalFlags() {
  static const auto* flags = new std::vector<FlagSpec>{
      {"server", FlagKind::kString, "127.0.0.1:50051",
       "lossd server: HOST:PORT, or a gRPC target such as dns:///HOST:PORT, unix:PATH or "
       "ipv4:ADDR:PORT,ADDR:PORT (scoring spreads over every address; training needs one server)"},
      {"token_file", FlagKind::kString, "", "file whose first line is the server's bearer token"},
      {"tls_ca_file", FlagKind::kString, "", "PEM root certificates; turns TLS on"},
      {"max_message_mib", FlagKind::kInt, "256", "largest gRPC message sent or received, in MiB"},
      {"deadline_seconds", FlagKind::kDouble, "0", "deadline of each call in seconds; 0 sets none"},
      {"max_attempts", FlagKind::kInt, "4",
       "attempts per compute call: UNAVAILABLE and DEADLINE_EXCEEDED are retried with backoff, "
       "under the same call id, so that dL/dW is never accumulated twice"},
      {"quiet", FlagKind::kBool, "false",
       "no progress on stderr (else shown when stderr is a terminal; bench also logs each call)"},
  };
  return *flags;
}

// ---------------------------------------------------------------------------------------------
// Connecting and finding the head.

absl::StatusOr<std::string> ReadTextFile(const std::string& path, absl::string_view flag) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::ErrnoToStatus(errno, absl::StrCat("--", flag, ": cannot open ", path));
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

absl::StatusOr<Client> ConnectFromFlags(const Flags& flags) {
  ChannelOptions options;
  options.address = flags.String("server");
  if (const absl::Status address = CheckServerAddress(options.address, "--server"); !address.ok()) {
    return UsageError(address.message());
  }
  if (!flags.String("token_file").empty()) {
    ASSIGN_OR_RETURN(const std::string text, ReadTextFile(flags.String("token_file"), "token_file"));
    const absl::string_view first_line = absl::string_view(text).substr(0, text.find('\n'));
    options.bearer_token = std::string(absl::StripAsciiWhitespace(first_line));
    if (options.bearer_token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--token_file: ", flags.String("token_file"), " is empty"));
    }
  }
  if (!flags.String("tls_ca_file").empty()) {
    ASSIGN_OR_RETURN(options.tls_root_cert_pem, ReadTextFile(flags.String("tls_ca_file"), "tls_ca_file"));
  }
  const int64_t max_message_mib = flags.Int("max_message_mib");
  if (max_message_mib < 1 || max_message_mib > 2047) {
    return UsageError(absl::StrCat("--max_message_mib: expected 1 to 2047, got ", max_message_mib));
  }
  options.max_message_bytes = max_message_mib << 20;
  const double deadline_seconds = flags.Double("deadline_seconds");
  if (deadline_seconds < 0) {
    return UsageError(absl::StrCat("--deadline_seconds: expected >= 0, got ", deadline_seconds));
  }
  if (deadline_seconds > 0) options.deadline = absl::Seconds(deadline_seconds);
  const int64_t max_attempts = flags.Int("max_attempts");
  if (max_attempts < 1 || max_attempts > 100) {
    return UsageError(absl::StrCat("--max_attempts: expected 1 to 100, got ", max_attempts));
  }
  options.compute_retry.max_attempts = static_cast<int>(max_attempts);
  options.compute_retry.on_retry = [](const absl::Status& failure, int attempt,
                                      absl::Duration wait) {
    absl::FPrintF(stderr, "lossctl: attempt %d failed (%s); retrying in %s\n", attempt,
                  failure.ToString(), absl::FormatDuration(wait));
  };
  return Client::Connect(std::move(options));
}

// --head, or the server's only head when there is exactly one.
absl::StatusOr<HeadInfo> ResolveHead(const Client& client, const Flags& flags) {
  if (!flags.String("head").empty()) return client.GetHead(flags.String("head"));
  ASSIGN_OR_RETURN(HeadList list, client.ListHeads());
  if (list.heads.size() == 1) return list.heads[0];
  std::vector<std::string> names;
  for (const HeadInfo& head : list.heads) names.push_back(head.name);
  return UsageError(absl::StrCat("--head: the server has ", list.heads.size(), " heads (",
                                 absl::StrJoin(names, ", "), "); name one"));
}

// With --pin_weights, the SHA-256 of the head's W that the calls are pinned to (GetHead computes it
// where a listing had none yet); empty without.
absl::StatusOr<std::string> PinnedWeights(const Client& client, const Flags& flags,
                                          const HeadInfo& head) {
  if (!flags.Bool("pin_weights")) return std::string();
  if (!head.weight_sha256.empty()) return head.weight_sha256;
  ASSIGN_OR_RETURN(const HeadInfo described, client.GetHead(head.name));
  return described.weight_sha256;
}

// ---------------------------------------------------------------------------------------------
// Input files: .npy, or .safetensors with an optional #TENSOR.

// A file's array as a matrix: its rows are every dimension but the last, flattened.
absl::StatusOr<Tensor> MatrixFromShape(std::string bytes, DType dtype, const std::vector<int64_t>& shape,
                                       absl::string_view source) {
  if (shape.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": expected an array of 2 or more dimensions [..., hidden], got ", shape.size()));
  }
  Tensor matrix;
  matrix.bytes = std::move(bytes);
  matrix.dtype = dtype;
  matrix.cols = shape.back();
  matrix.rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) matrix.rows *= shape[i];
  return matrix;
}

absl::StatusOr<Tensor> ReadNpyMatrix(const std::string& path) {
  ASSIGN_OR_RETURN(NpyArray array, ReadNpyFile(path));
  DType dtype;
  switch (array.dtype) {
    case NpyDType::kFloat32: dtype = DType::kFloat32; break;
    case NpyDType::kFloat16: dtype = DType::kFloat16; break;
    case NpyDType::kUInt16: dtype = DType::kBFloat16; break;  // bfloat16 bits, see npy.h
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": expected <f4, <f2 or <u2 (bfloat16 bits), got ", NpyDescr(array.dtype)));
  }
  return MatrixFromShape(std::move(array.data), dtype, array.shape, path);
}

// "FILE.safetensors#TENSOR" names a tensor; without "#", `default_tensors` are tried in order, and
// a file holding a single tensor needs no name.
absl::StatusOr<Tensor> ReadSafetensorsMatrix(absl::string_view spec,
                                             const std::vector<std::string>& default_tensors) {
  const size_t hash = spec.rfind('#');
  const std::string path(hash == absl::string_view::npos ? spec : spec.substr(0, hash));
  ASSIGN_OR_RETURN(const storage::SafetensorsFile file, storage::SafetensorsFile::Open(path));
  std::string tensor_name;
  if (hash != absl::string_view::npos) {
    tensor_name = std::string(spec.substr(hash + 1));
  } else {
    const std::vector<std::string> names = file.TensorNames();
    for (const std::string& candidate : default_tensors) {
      if (std::find(names.begin(), names.end(), candidate) != names.end()) {
        tensor_name = candidate;
        break;
      }
    }
    if (tensor_name.empty() && names.size() == 1) tensor_name = names[0];
    if (tensor_name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": holds ", names.size(), " tensors; name one as ", path, "#TENSOR"));
    }
  }
  ASSIGN_OR_RETURN(const storage::TensorRef tensor, file.Tensor(tensor_name));
  DType dtype;
  if (tensor.dtype == "F32") {
    dtype = DType::kFloat32;
  } else if (tensor.dtype == "BF16") {
    dtype = DType::kBFloat16;
  } else if (tensor.dtype == "F16") {
    dtype = DType::kFloat16;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, "#", tensor_name, ": expected dtype F32, BF16 or F16, got ", tensor.dtype));
  }
  return MatrixFromShape(std::string(reinterpret_cast<const char*>(tensor.data), tensor.bytes), dtype,
                         tensor.shape, absl::StrCat(path, "#", tensor_name));
}

absl::StatusOr<Tensor> ReadMatrix(const std::string& spec, const std::vector<std::string>& default_tensors) {
  if (absl::StrContains(spec, ".safetensors")) return ReadSafetensorsMatrix(spec, default_tensors);
  return ReadNpyMatrix(spec);
}

absl::StatusOr<std::vector<int64_t>> ReadLabels(const std::string& path, int64_t expected_count) {
  ASSIGN_OR_RETURN(const NpyArray array, ReadNpyFile(path));
  if (array.num_elements() != expected_count) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": expected ", expected_count, " labels (one per hidden row), got ", array.num_elements()));
  }
  std::vector<int64_t> labels(expected_count);
  if (array.dtype == NpyDType::kInt64) {
    std::memcpy(labels.data(), array.data.data(), array.data.size());
  } else if (array.dtype == NpyDType::kInt32) {
    for (int64_t i = 0; i < expected_count; ++i) {
      int32_t label;
      std::memcpy(&label, array.data.data() + 4 * i, sizeof label);
      labels[i] = label;
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected labels as <i8 or <i4, got ", NpyDescr(array.dtype)));
  }
  return labels;
}

absl::StatusOr<std::vector<float>> ReadTokenWeights(const std::string& path, int64_t expected_count) {
  ASSIGN_OR_RETURN(const NpyArray array, ReadNpyFile(path));
  if (array.dtype != NpyDType::kFloat32 || array.num_elements() != expected_count) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": expected ", expected_count,
                                                   " token weights as <f4, got ", array.num_elements(),
                                                   " of ", NpyDescr(array.dtype)));
  }
  std::vector<float> weights(expected_count);
  std::memcpy(weights.data(), array.data.data(), array.data.size());
  return weights;
}

// Labels from (--seed, purpose), a stream of their own.
std::mt19937_64 SeededStream(uint64_t seed, uint32_t purpose) {
  std::seed_seq sequence{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), purpose};
  return std::mt19937_64(sequence);
}

// Hidden states of zero mean and unit variance per element, the scale a transformer's final
// layer norm gives; uniform from a counter-based generator, so that a bench batch of 16384 x 2048
// is drawn in a tenth of a second rather than over a second (std::normal_distribution). Their
// stream is apart from the server's demo head's, whose rows they would otherwise copy.
Tensor SyntheticHidden(int64_t rows, int64_t cols, DType dtype, uint64_t seed) {
  constexpr uint64_t kHiddenStream = 0x6c6f7373726f7773ULL;  // "lossrows"
  const float sqrt3 = std::sqrt(3.0f);
  std::vector<float> values(rows * cols);
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = sqrt3 * CounterUniform(seed ^ kHiddenStream, i);
  }
  Tensor hidden;
  hidden.bytes = EncodeFromFloat32(values, dtype);
  hidden.dtype = dtype;
  hidden.rows = rows;
  hidden.cols = cols;
  return hidden;
}

std::vector<int64_t> RandomLabels(int64_t count, int64_t vocab_size, uint64_t seed) {
  std::mt19937_64 rng = SeededStream(seed, 2);
  std::uniform_int_distribution<int64_t> token(0, vocab_size - 1);
  std::vector<int64_t> labels(count);
  for (int64_t& label : labels) label = token(rng);
  return labels;
}

// ---------------------------------------------------------------------------------------------
// Output helpers.

absl::Status WriteTensorNpy(const std::string& path, const Tensor& tensor) {
  NpyDType dtype = NpyDType::kFloat32;
  switch (tensor.dtype) {
    case DType::kFloat32: dtype = NpyDType::kFloat32; break;
    case DType::kFloat16: dtype = NpyDType::kFloat16; break;
    case DType::kBFloat16: dtype = NpyDType::kUInt16; break;  // bfloat16 bits, see npy.h
  }
  return WriteNpyFile(path, dtype, {tensor.rows, tensor.cols}, tensor.bytes);
}

// Row by row, so that a large tensor is never converted to float32 all at once.
double L2Norm(const Tensor& tensor) {
  const size_t row_bytes = static_cast<size_t>(tensor.cols) * DTypeSize(tensor.dtype);
  double sum = 0.0;
  for (size_t offset = 0; offset < tensor.bytes.size(); offset += row_bytes) {
    for (float value :
         DecodeToFloat32(absl::string_view(tensor.bytes).substr(offset, row_bytes), tensor.dtype)) {
      sum += static_cast<double>(value) * value;
    }
  }
  return std::sqrt(sum);
}

std::string Mebibytes(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

// Progress of long work for a person watching: when enabled (stderr is a terminal and --quiet is
// not given), one line on stderr, redrawn in place five times a second from `describe` until
// Stop(), which draws the last state and ends the line. Disabled, it writes nothing, so that logs
// and pipes get only the results.
class TerminalProgress {
 public:
  TerminalProgress(bool enabled, std::function<std::string()> describe)
      : describe_(std::move(describe)) {
    if (enabled) thread_ = std::thread([this] { Redraw(); });
  }
  ~TerminalProgress() { Stop(); }

  void Stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
    }
    stop_.notify_one();
    thread_.join();
    Draw();
    absl::FPrintF(stderr, "\n");
  }

 private:
  void Redraw() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stopped_; })) {
      Draw();
    }
  }
  // Back to the line's start, the text, then erase what a longer line before left.
  void Draw() { absl::FPrintF(stderr, "\r%s\033[K", describe_()); }

  const std::function<std::string()> describe_;
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopped_ = false;
  std::thread thread_;
};

bool ShowProgress(const Flags& flags) {
  return !flags.Bool("quiet") && isatty(fileno(stderr)) != 0;
}

std::string DTypeNote(DType dtype) {
  return dtype == DType::kBFloat16 ? " (bfloat16 bits stored as <u2)" : "";
}

absl::StatusOr<std::optional<DType>> OptionalDType(const Flags& flags, const std::string& name) {
  if (flags.String(name).empty()) return std::optional<DType>();
  absl::StatusOr<DType> dtype = ParseDType(flags.String(name));
  if (!dtype.ok()) return UsageError(absl::StrCat("--", name, ": ", dtype.status().message()));
  return std::optional<DType>(*dtype);
}

absl::StatusOr<DType> DTypeFlag(const Flags& flags, const std::string& name) {
  ASSIGN_OR_RETURN(const std::optional<DType> dtype, OptionalDType(flags, name));
  if (!dtype.has_value()) return UsageError(absl::StrCat("--", name, " needs a value"));
  return *dtype;
}

absl::Status RequireFlag(const Flags& flags, const std::string& name) {
  if (flags.String(name).empty()) return UsageError(absl::StrCat("--", name, " is required"));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Subcommands.

const char* OptimizerName(Optimizer optimizer) {
  switch (optimizer) {
    case Optimizer::kSgd: return "sgd";
    case Optimizer::kAdamW: return "adamw";
    case Optimizer::kNone: return "-";
  }
  return "-";
}

absl::Status RunHeads(const Flags& flags) {
  ASSIGN_OR_RETURN(const Client client, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(const HeadList list, client.ListHeads());
  absl::PrintF("backend: %s\n", list.backend);
  absl::PrintF("%-24s %10s %8s %-9s %8s %6s %-9s %12s  %s\n", "HEAD", "VOCAB", "HIDDEN", "DTYPE", "VERSION",
               "STEPS", "OPTIMIZER", "GRAD_TOKENS", "SOURCE");
  for (const HeadInfo& head : list.heads) {
    absl::PrintF("%-24s %10d %8d %-9s %8d %6d %-9s %12d  %s\n", head.name, head.vocab_size, head.hidden_size,
                 DTypeName(head.dtype), head.version, head.steps, OptimizerName(head.optimizer),
                 head.accumulated_tokens, head.source);
  }
  return absl::OkStatus();
}

absl::Status RunHead(const Flags& flags) {
  if (flags.positional().size() != 1)
    return UsageError("head: expected one head name, as in `lossctl head NAME`");
  ASSIGN_OR_RETURN(const Client client, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(const HeadInfo head, client.GetHead(flags.positional()[0]));
  absl::PrintF("name:               %s\n", head.name);
  absl::PrintF("vocab_size:         %d\n", head.vocab_size);
  absl::PrintF("hidden_size:        %d\n", head.hidden_size);
  absl::PrintF("dtype:              %s\n", DTypeName(head.dtype));
  absl::PrintF("version:            %d\n", head.version);
  absl::PrintF("source:             %s\n", head.source);
  absl::PrintF("accumulated_tokens: %d\n", head.accumulated_tokens);
  absl::PrintF("accumulated_calls:  %d\n", head.accumulated_calls);
  absl::PrintF("optimizer:          %s\n", OptimizerName(head.optimizer));
  absl::PrintF("steps:              %d\n", head.steps);
  absl::PrintF("tied_embeddings:    %s\n", head.tied_embeddings ? "true" : "false");
  absl::PrintF("logit_softcap:      %g\n", head.logit_softcap);
  absl::PrintF("weight_sha256:      %s\n", head.weight_sha256);
  return absl::OkStatus();
}

absl::StatusOr<Reduction> ParseReduction(const std::string& name) {
  if (name == "mean") return Reduction::kMean;
  if (name == "sum") return Reduction::kSum;
  if (name == "none") return Reduction::kNone;
  return UsageError(absl::StrCat("--reduction: expected mean, sum or none, got \"", name, "\""));
}

absl::Status WriteComputeJson(const std::string& path, const ComputeRequest& request,
                              const ComputeResult& result) {
  nlohmann::json json;
  json["head"] = request.head;
  json["head_version"] = result.summary.head_version;
  json["backend"] = result.summary.backend;
  json["loss"] = result.summary.loss;
  json["loss_sum"] = result.summary.loss_sum;
  json["counted_tokens"] = result.summary.counted_tokens;
  json["correct_tokens"] = result.summary.correct_tokens;
  json["labels"] = std::vector<int64_t>(request.labels.begin(), request.labels.end());
  json["token_loss"] = result.token_loss;
  json["logprob"] = result.logprob;
  json["argmax"] = result.argmax;
  if (!result.entropy.empty()) json["entropy"] = result.entropy;
  if (result.top_k > 0) {
    nlohmann::json tokens = nlohmann::json::array(), logprobs = nlohmann::json::array();
    for (int64_t row = 0; row < request.hidden.rows; ++row) {
      const auto first = static_cast<size_t>(row * result.top_k);
      tokens.push_back(std::vector<int32_t>(result.top_k_token.begin() + first,
                                            result.top_k_token.begin() + first + result.top_k));
      logprobs.push_back(std::vector<float>(result.top_k_logprob.begin() + first,
                                            result.top_k_logprob.begin() + first + result.top_k));
    }
    json["top_k_token"] = std::move(tokens);
    json["top_k_logprob"] = std::move(logprobs);
  }
  std::ofstream file(path);
  if (!file) return absl::ErrnoToStatus(errno, absl::StrCat("--out: cannot create ", path));
  file << json.dump() << "\n";
  file.close();
  if (!file) return absl::ErrnoToStatus(errno, absl::StrCat("--out: write to ", path, " failed"));
  return absl::OkStatus();
}

absl::Status RunCompute(const Flags& flags) {
  if (flags.String("hidden").empty() == !flags.given("synthetic")) {
    return UsageError("compute: give exactly one of --hidden FILE and --synthetic N");
  }
  if (flags.given("synthetic") && flags.Int("synthetic") < 0) {
    return UsageError(absl::StrCat("--synthetic: expected a token count >= 0, got ", flags.Int("synthetic")));
  }
  if (!flags.String("grad_out").empty() && !flags.Bool("grad")) return UsageError("--grad_out needs --grad");
  ASSIGN_OR_RETURN(const Reduction reduction, ParseReduction(flags.String("reduction")));
  ASSIGN_OR_RETURN(const DType synthetic_dtype, DTypeFlag(flags, "dtype"));
  ASSIGN_OR_RETURN(const std::optional<DType> grad_dtype, OptionalDType(flags, "grad_dtype"));

  ASSIGN_OR_RETURN(const Client client, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(const HeadInfo head, ResolveHead(client, flags));
  const uint64_t seed = static_cast<uint64_t>(flags.Int("seed"));
  Tensor hidden;
  if (flags.given("synthetic")) {
    hidden = SyntheticHidden(flags.Int("synthetic"), head.hidden_size, synthetic_dtype, seed);
  } else {
    ASSIGN_OR_RETURN(hidden, ReadMatrix(flags.String("hidden"), {}));
  }
  std::vector<int64_t> labels;
  if (flags.String("labels").empty()) {
    labels = RandomLabels(hidden.rows, head.vocab_size, seed);
  } else {
    ASSIGN_OR_RETURN(labels, ReadLabels(flags.String("labels"), hidden.rows));
  }
  std::vector<float> token_weights;
  if (!flags.String("weights").empty()) {
    ASSIGN_OR_RETURN(token_weights, ReadTokenWeights(flags.String("weights"), hidden.rows));
  }

  ComputeRequest request;
  request.head = head.name;
  request.hidden = hidden.view();
  request.labels = labels;
  request.token_weights = token_weights;
  request.rows_per_message = flags.Int("rows_per_message");
  request.shared_memory = flags.Bool("shared_memory");
  LossOptions& options = request.options;
  options.reduction = reduction;
  options.ignore_index = flags.Int("ignore_index");
  options.label_smoothing = flags.Double("label_smoothing");
  options.z_loss_scale = flags.Double("z_loss");
  if (const std::string& cap = flags.String("softcap"); !cap.empty()) {
    double value = 0;
    if (!absl::SimpleAtod(cap, &value)) {
      return UsageError(absl::StrCat("--softcap: expected a number, got ", cap));
    }
    options.logit_softcap = value;
  }
  options.temperature = flags.Double("temperature");
  options.grad_scale = flags.Double("grad_scale");
  OutputSelection& outputs = request.outputs;
  const bool per_token = !flags.String("out").empty();
  outputs.token_loss = per_token;
  outputs.logprob = per_token;
  outputs.argmax = per_token;
  outputs.entropy = flags.Bool("entropy");
  outputs.top_k = static_cast<int>(flags.Int("top_k"));
  outputs.grad_hidden = flags.Bool("grad");
  outputs.grad_hidden_dtype = grad_dtype;
  outputs.accumulate_grad_weight = flags.Bool("accumulate");
  request.call_id = flags.String("call_id");
  ASSIGN_OR_RETURN(request.weight_sha256, PinnedWeights(client, flags, head));

  std::atomic<int64_t> rows_done{0};
  request.on_progress = [&](int64_t done, int64_t) { rows_done.store(done); };
  const absl::Time start = absl::Now();
  TerminalProgress progress(ShowProgress(flags), [&] {
    return absl::StrFormat("compute: %d/%d rows, %.1f s", rows_done.load(), hidden.rows,
                           absl::ToDoubleSeconds(absl::Now() - start));
  });
  absl::StatusOr<ComputeResult> computed = client.Compute(request);
  progress.Stop();
  RETURN_IF_ERROR(computed.status());
  const ComputeResult& result = *computed;
  const ComputeSummary& summary = result.summary;
  absl::PrintF("head %s at version %d, backend %s: %d tokens of %s, %d counted\n", head.name,
               summary.head_version, summary.backend, hidden.rows, DTypeName(hidden.dtype),
               summary.counted_tokens);
  if (!request.weight_sha256.empty()) {
    absl::PrintF("W pinned to SHA-256 %s\n", request.weight_sha256);
  }
  // The server reports the sum as the loss of an unreduced call.
  const char* reduction_name = reduction == Reduction::kMean  ? "mean"
                               : reduction == Reduction::kSum ? "sum"
                                                              : "sum; reduction none";
  absl::PrintF("loss %.9g (%s), loss_sum %.9g\n", summary.loss, reduction_name, summary.loss_sum);
  absl::PrintF(
      "accuracy %.6f (%d of %d counted tokens)\n",
      summary.counted_tokens > 0 ? static_cast<double>(summary.correct_tokens) / summary.counted_tokens : 0.0,
      summary.correct_tokens, summary.counted_tokens);
  if (!result.entropy.empty()) {
    double total = 0.0;
    for (float value : result.entropy) total += value;
    absl::PrintF("entropy mean %.6g nats\n", total / static_cast<double>(result.entropy.size()));
  }
  if (result.top_k > 0 && !per_token && hidden.rows > 0) {
    // The whole table goes to --out; without it, the first row shows what came back.
    std::vector<std::string> first_row;
    for (int j = 0; j < result.top_k; ++j) {
      first_row.push_back(
          absl::StrFormat("%d:%.4g", result.top_k_token[j], result.top_k_logprob[j]));
    }
    absl::PrintF("top-%d of row 0 (token:logprob) %s; every row's top-%d: --out FILE.json\n",
                 result.top_k, absl::StrJoin(first_row, " "), result.top_k);
  }
  if (outputs.grad_hidden) {
    absl::PrintF("dL/dh [%d, %d] %s, norm %.6g\n", result.grad_hidden.rows, result.grad_hidden.cols,
                 DTypeName(result.grad_hidden.dtype), L2Norm(result.grad_hidden));
    if (!flags.String("grad_out").empty()) {
      RETURN_IF_ERROR(WriteTensorNpy(flags.String("grad_out"), result.grad_hidden));
      absl::PrintF("wrote dL/dh to %s%s\n", flags.String("grad_out"), DTypeNote(result.grad_hidden.dtype));
    }
  }
  if (outputs.accumulate_grad_weight) {
    absl::PrintF("dL/dW %s the head's accumulator (call id %s)\n",
                 summary.replayed                  ? "was already in (replayed), not added again to"
                 : summary.grad_weight_accumulated ? "added to"
                                                   : "NOT added to",
                 result.call_id);
  }
  if (per_token) {
    RETURN_IF_ERROR(WriteComputeJson(flags.String("out"), request, result));
    absl::PrintF("wrote per-token results to %s\n", flags.String("out"));
  }
  absl::PrintF("time %.3f s wall, %.3f s queued, %.3f s computing; sent %s, received %s; peak workspace %s\n",
               result.wall_seconds, summary.queue_seconds, summary.compute_seconds,
               Mebibytes(result.bytes_sent), Mebibytes(result.bytes_received),
               Mebibytes(summary.peak_workspace_bytes));
  return absl::OkStatus();
}

absl::Status RunFetch(const Flags& flags, bool gradient) {
  RETURN_IF_ERROR(RequireFlag(flags, "out"));
  ASSIGN_OR_RETURN(const DType dtype, DTypeFlag(flags, "dtype"));
  ASSIGN_OR_RETURN(const Client client, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(const HeadInfo head, ResolveHead(client, flags));
  ASSIGN_OR_RETURN(const Tensor tensor, gradient ? client.FetchGradWeight(head.name, dtype)
                                                 : client.FetchWeight(head.name, dtype));
  RETURN_IF_ERROR(WriteTensorNpy(flags.String("out"), tensor));
  absl::PrintF("wrote %s of head %s (version %d) to %s: [%d, %d] %s%s, norm %.6g", gradient ? "dL/dW" : "W",
               head.name, tensor.head_version, flags.String("out"), tensor.rows, tensor.cols,
               DTypeName(tensor.dtype), DTypeNote(tensor.dtype), L2Norm(tensor));
  if (gradient) absl::PrintF(", %d accumulated tokens", tensor.accumulated_tokens);
  absl::PrintF("\n");
  return absl::OkStatus();
}

absl::Status RunZeroGrad(const Flags& flags) {
  ASSIGN_OR_RETURN(const Client client, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(const HeadInfo head, ResolveHead(client, flags));
  ASSIGN_OR_RETURN(const uint64_t version, client.ZeroGrad(head.name));
  absl::PrintF("zeroed the gradient of head %s (version %d)\n", head.name, version);
  return absl::OkStatus();
}

absl::Status RunStep(const Flags& flags) {
  RETURN_IF_ERROR(RequireFlag(flags, "optimizer"));
  StepOptions options;
  const std::string optimizer = flags.String("optimizer");
  // Flags left out keep torch.optim's defaults, which SgdOptions and AdamWOptions hold.
  if (optimizer == "sgd") {
    for (const char* flag : {"beta1", "beta2", "eps"}) {
      if (flags.given(flag))
        return UsageError(absl::StrCat("--", flag, " is an AdamW setting; --optimizer is sgd"));
    }
    SgdOptions sgd;
    if (flags.given("lr")) sgd.learning_rate = flags.Double("lr");
    if (flags.given("momentum")) sgd.momentum = flags.Double("momentum");
    if (flags.given("weight_decay")) sgd.weight_decay = flags.Double("weight_decay");
    options.optimizer = sgd;
  } else if (optimizer == "adamw") {
    if (flags.given("momentum")) return UsageError("--momentum is an SGD setting; --optimizer is adamw");
    AdamWOptions adamw;
    if (flags.given("lr")) adamw.learning_rate = flags.Double("lr");
    if (flags.given("beta1")) adamw.beta1 = flags.Double("beta1");
    if (flags.given("beta2")) adamw.beta2 = flags.Double("beta2");
    if (flags.given("eps")) adamw.epsilon = flags.Double("eps");
    if (flags.given("weight_decay")) adamw.weight_decay = flags.Double("weight_decay");
    options.optimizer = adamw;
  } else {
    return UsageError(absl::StrCat("--optimizer: expected sgd or adamw, got \"", optimizer, "\""));
  }
  options.max_grad_norm = flags.Double("max_grad_norm");
  options.keep_grad = flags.Bool("keep_grad");
  ASSIGN_OR_RETURN(const Client client, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(const HeadInfo head, ResolveHead(client, flags));
  options.head = head.name;
  ASSIGN_OR_RETURN(const StepResult result, client.Step(options));
  absl::PrintF(
      "stepped head %s with %s: version %d -> %d, grad norm %.6g (clip multiplier %.6g), %d tokens%s\n",
      head.name, optimizer, head.version, result.head_version, result.grad_norm, result.clip_multiplier,
      result.accumulated_tokens, options.keep_grad ? ", gradient kept" : ", gradient zeroed");
  return absl::OkStatus();
}

absl::Status RunSave(const Flags& flags) {
  ASSIGN_OR_RETURN(const Client client, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(const std::vector<std::string> paths, client.SaveCheckpoint(flags.String("head")));
  for (const std::string& path : paths) absl::PrintF("saved %s\n", path);
  return absl::OkStatus();
}

absl::Status RunUpload(const Flags& flags) {
  RETURN_IF_ERROR(RequireFlag(flags, "head"));
  RETURN_IF_ERROR(RequireFlag(flags, "weight"));
  ASSIGN_OR_RETURN(const DType storage_dtype, DTypeFlag(flags, "storage_dtype"));
  const std::string& spec = flags.String("weight");
  Tensor weight;
  ModelTraits model;
  if (absl::EndsWith(spec, ".npy")) {
    ASSIGN_OR_RETURN(weight, ReadNpyMatrix(spec));
  } else {
    // A model checkpoint, read by the server's own rules: the head of an untied model, the
    // input embedding of a tied one, with the tie and soft cap from its config.json.
    const size_t hash = spec.rfind('#');
    const std::string tensor = hash == std::string::npos ? "" : spec.substr(hash + 1);
    ASSIGN_OR_RETURN(
        storage::CheckpointHead loaded,
        storage::LoadCheckpointHead(spec.substr(0, hash), tensor, lossd::DType::kFloat32));
    absl::PrintF("%s (%s)\n", loaded.source, loaded.explanation);
    ASSIGN_OR_RETURN(
        weight,
        MatrixFromShape(std::string(loaded.weight.begin(), loaded.weight.end()), DType::kFloat32,
                        {loaded.vocab_size, loaded.hidden_size}, loaded.source));
    model = {loaded.tied_embeddings, loaded.logit_softcap};
  }
  ASSIGN_OR_RETURN(const Client client, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(const HeadInfo head, client.UploadHead(flags.String("head"), weight.view(), storage_dtype,
                                                          flags.Bool("replace"), model));
  absl::PrintF("uploaded head %s: [%d, %d] %s, stored as %s, version %d%s\n", head.name,
               head.vocab_size, head.hidden_size, DTypeName(weight.dtype), DTypeName(head.dtype),
               head.version, head.tied_embeddings ? ", tied to the input embedding" : "");
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// bench: repeated synthetic calls from concurrent streams, with a progress line on stderr.

double Percentile(std::vector<double> sorted, double fraction) {
  if (sorted.empty()) return 0.0;
  // Nearest rank: the smallest value with at least `fraction` of the samples at or below it.
  const size_t rank = static_cast<size_t>(std::ceil(fraction * static_cast<double>(sorted.size())));
  return sorted[std::min(sorted.size() - 1, rank == 0 ? 0 : rank - 1)];
}

struct BenchTotals {
  std::vector<double> latencies;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  double compute_seconds = 0.0;
  double queue_seconds = 0.0;
  absl::Status first_error;
};

absl::Status RunBench(const Flags& flags) {
  const int64_t tokens = flags.Int("tokens");
  const int64_t calls = flags.Int("calls");
  const int64_t streams = flags.Int("streams");
  const int64_t warmup = flags.Int("warmup");
  const int64_t warmup_tokens_flag = flags.Int("warmup_tokens");
  const int64_t warmup_tokens = warmup_tokens_flag > 0 ? warmup_tokens_flag : tokens;
  if (tokens < 1 || calls < 1 || streams < 1 || warmup < 0) {
    return UsageError("bench: --tokens, --calls and --streams must be >= 1, --warmup >= 0");
  }
  if (warmup_tokens_flag < 0 || warmup_tokens > tokens) {
    return UsageError(absl::StrCat("bench: --warmup_tokens: expected 0 (all of --tokens) to ", tokens,
                                   ", got ", warmup_tokens_flag));
  }
  ASSIGN_OR_RETURN(const DType dtype, DTypeFlag(flags, "dtype"));
  ASSIGN_OR_RETURN(const Client client, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(const HeadInfo head, ResolveHead(client, flags));

  const uint64_t seed = static_cast<uint64_t>(flags.Int("seed"));
  const Tensor hidden = SyntheticHidden(tokens, head.hidden_size, dtype, seed);
  const std::vector<int64_t> labels = RandomLabels(tokens, head.vocab_size, seed);
  ComputeRequest request;
  request.head = head.name;
  request.hidden = hidden.view();
  request.labels = labels;
  request.outputs.grad_hidden = flags.Bool("grad");
  request.outputs.accumulate_grad_weight = flags.Bool("accumulate");
  request.rows_per_message = flags.Int("rows_per_message");
  request.shared_memory = flags.Bool("shared_memory");
  ASSIGN_OR_RETURN(request.weight_sha256, PinnedWeights(client, flags, head));

  const bool quiet = flags.Bool("quiet");
  if (!quiet) {
    const std::string pinned =
        request.weight_sha256.empty() ? "" : absl::StrCat(", W pinned to ", request.weight_sha256);
    absl::FPrintF(stderr,
                  "bench: head %s [%d x %d], %d tokens of %s per call, %d calls, %d at a "
                  "time%s%s%s\n",
                  head.name, head.vocab_size, head.hidden_size, tokens, DTypeName(dtype), calls,
                  streams, request.outputs.grad_hidden ? ", dL/dh" : "",
                  request.outputs.accumulate_grad_weight ? ", dL/dW accumulated" : "", pinned);
  }
  // The first rows only, where a whole call would cost as much as a timed one: enough to connect,
  // start the server's threads and bring this machine's cores up to speed.
  ComputeRequest warmup_request = request;
  warmup_request.hidden.rows = warmup_tokens;
  warmup_request.labels = warmup_request.labels.subspan(0, warmup_tokens);
  for (int64_t i = 0; i < warmup; ++i) RETURN_IF_ERROR(client.Compute(warmup_request).status());

  // Each stream writes dL/dh into a buffer of its own, reused from call to call as a training
  // loop would, allocated (and its pages faulted in) before the clock starts.
  const size_t grad_hidden_bytes_per_call = request.outputs.grad_hidden ? hidden.bytes.size() : 0;
  std::vector<std::string> grad_hidden_outs(streams, std::string(grad_hidden_bytes_per_call, '\0'));

  std::mutex mutex;
  std::condition_variable progressed;
  BenchTotals totals;
  std::atomic<int64_t> next_call{0};
  std::atomic<bool> failed{false};
  const absl::Time start = absl::Now();
  std::vector<std::thread> workers;
  for (int64_t s = 0; s < streams; ++s) {
    workers.emplace_back([&, s] {
      ComputeRequest own = request;
      if (grad_hidden_bytes_per_call > 0) own.grad_hidden_out = grad_hidden_outs[s].data();
      while (!failed.load() && next_call.fetch_add(1) < calls) {
        absl::StatusOr<ComputeResult> result = client.Compute(own);
        std::lock_guard<std::mutex> lock(mutex);
        if (!result.ok()) {
          if (!failed.exchange(true)) totals.first_error = result.status();
        } else {
          totals.latencies.push_back(result->wall_seconds);
          totals.bytes_sent += result->bytes_sent;
          totals.bytes_received += result->bytes_received;
          totals.compute_seconds += result->summary.compute_seconds;
          totals.queue_seconds += result->summary.queue_seconds;
        }
        progressed.notify_one();
      }
    });
  }
  {
    // On a terminal one line is redrawn in place (carriage return, trailing spaces) five times a
    // second; in a log, a line per finished call.
    const bool terminal = isatty(fileno(stderr)) != 0;
    size_t shown = 0;
    std::unique_lock<std::mutex> lock(mutex);
    while (shown < static_cast<size_t>(calls) && !failed.load()) {
      progressed.wait_for(lock, std::chrono::milliseconds(200));
      std::vector<double> sorted = totals.latencies;
      if (!terminal && sorted.size() == shown) continue;
      shown = sorted.size();
      if (quiet) continue;
      std::sort(sorted.begin(), sorted.end());
      const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
      absl::FPrintF(stderr, "%s%d/%d calls, %.2f calls/s, %.0f tokens/s, p50 %.3f s%s", terminal ? "\r" : "",
                    shown, calls, shown / elapsed, shown * tokens / elapsed, Percentile(sorted, 0.5),
                    terminal ? "      " : "\n");
    }
    if (terminal && !quiet) absl::FPrintF(stderr, "\n");
  }
  for (std::thread& worker : workers) worker.join();
  if (failed.load()) return totals.first_error;

  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  std::sort(totals.latencies.begin(), totals.latencies.end());
  // The tensors each way, however they travelled (messages or shared memory).
  const int64_t hidden_bytes = calls * static_cast<int64_t>(hidden.bytes.size());
  const int64_t grad_hidden_bytes = request.outputs.grad_hidden ? hidden_bytes : 0;
  if (flags.Bool("json")) {
    absl::PrintF(
        "{\"calls\": %d, \"tokens_per_call\": %d, \"streams\": %d, \"dtype\": \"%s\", "
        "\"shared_memory\": %s, \"seconds\": %.6f, \"tokens_per_second\": %.1f, \"bytes_sent\": %d, "
        "\"bytes_received\": %d, \"hidden_bytes\": %d, \"grad_hidden_bytes\": %d, "
        "\"latency_p50\": %.6f, \"latency_p90\": %.6f, "
        "\"latency_max\": %.6f, \"server_compute_seconds\": %.6f, "
        "\"server_queue_seconds\": %.6f}\n",
        calls, tokens, streams, DTypeName(dtype), request.shared_memory ? "true" : "false", elapsed,
        calls * tokens / elapsed, totals.bytes_sent, totals.bytes_received, hidden_bytes, grad_hidden_bytes,
        Percentile(totals.latencies, 0.5),
        Percentile(totals.latencies, 0.9), totals.latencies.back(), totals.compute_seconds,
        totals.queue_seconds);
    return absl::OkStatus();
  }
  absl::PrintF("%d calls in %.3f s: %.2f calls/s, %.0f tokens/s\n", calls, elapsed, calls / elapsed,
               calls * tokens / elapsed);
  absl::PrintF("sent %.3f GB/s, received %.3f GB/s (gRPC message payloads)\n",
               totals.bytes_sent / elapsed / 1e9, totals.bytes_received / elapsed / 1e9);
  absl::PrintF("rows in %.3f GB/s, dL/dh out %.3f GB/s (%s)\n", hidden_bytes / elapsed / 1e9,
               grad_hidden_bytes / elapsed / 1e9, request.shared_memory ? "shared memory" : "messages");
  absl::PrintF("latency p50 %.4f s, p90 %.4f s, p99 %.4f s\n", Percentile(totals.latencies, 0.5),
               Percentile(totals.latencies, 0.9), Percentile(totals.latencies, 0.99));
  absl::PrintF("server per call: %.4f s computing, %.4f s queued (means)\n", totals.compute_seconds / calls,
               totals.queue_seconds / calls);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The subcommand table, help and main.

struct Subcommand {
  std::string name;
  std::string synopsis;
  std::string summary;
  std::vector<FlagSpec> flags;
  absl::Status (*run)(const Flags& flags);
};

FlagSpec SharedMemoryFlag() {
  return {"shared_memory", FlagKind::kBool, "false",
          "rows and dL/dh through a memfd handed over to the server instead of messages (a server "
          "on this host, any user)"};
}

FlagSpec HeadFlag() { return {"head", FlagKind::kString, "", "head name (default: the server's only head)"}; }

FlagSpec PinWeightsFlag() {
  return {"pin_weights", FlagKind::kBool, "false",
          "pin the calls to the SHA-256 of the head's W as the first server asked reports it: a "
          "replica with another W refuses them (FAILED_PRECONDITION)"};
}

const std::vector<Subcommand>& Subcommands() {
  static const auto* subcommands = new std::vector<Subcommand>{
      {"heads", "heads", "list the server's heads", {}, RunHeads},
      {"head", "head NAME", "describe one head", {}, RunHead},
      {"compute",
       "compute [--head H] (--hidden FILE | --synthetic N) [--labels FILE.npy] [options]",
       "one loss/score call: prints loss, counted tokens, accuracy and timings",
       {HeadFlag(),
        {"hidden", FlagKind::kString, "",
         "hidden states [..., H]: FILE.npy (<f4, <f2, or <u2 holding bfloat16 bits) or "
         "FILE.safetensors[#TENSOR] (F32, BF16, F16)"},
        {"synthetic", FlagKind::kInt, "", "N random hidden rows (zero mean, unit variance) instead of --hidden"},
        {"dtype", FlagKind::kString, "float32", "dtype of --synthetic rows: float32, bfloat16, float16"},
        {"seed", FlagKind::kInt, "0", "seed of --synthetic rows and of random labels"},
        {"labels", FlagKind::kString, "",
         "labels FILE.npy (<i8 or <i4, one per row); default: uniform random"},
        {"weights", FlagKind::kString, "", "per-token weights FILE.npy (<f4, one per row)"},
        {"reduction", FlagKind::kString, "mean", "mean, sum or none"},
        {"ignore_index", FlagKind::kInt, "-100", "label value whose rows count for nothing"},
        {"label_smoothing", FlagKind::kDouble, "0", "label smoothing in [0, 1]"},
        {"z_loss", FlagKind::kDouble, "0", "z-loss scale: adds scale * lse^2 per token"},
        {"softcap", FlagKind::kString, "",
         "logit soft cap c: logits <- c tanh(logits / c); empty: the head's, 0: off"},
        {"temperature", FlagKind::kDouble, "1", "divides the logits, after the soft cap"},
        {"grad_scale", FlagKind::kDouble, "1", "multiplies dL/dh and dL/dW"},
        {"top_k", FlagKind::kInt, "0", "top-k log-probabilities per token (0..64), in --out"},
        {"entropy", FlagKind::kBool, "false", "per-token entropy; prints its mean"},
        {"grad", FlagKind::kBool, "false", "ask for dL/dh; prints its norm"},
        {"grad_dtype", FlagKind::kString, "", "dtype of dL/dh (default: that of the hidden states)"},
        {"grad_out", FlagKind::kString, "", "save dL/dh to FILE.npy (needs --grad)"},
        {"accumulate", FlagKind::kBool, "false", "add dL/dW to the head's accumulator on the server"},
        {"call_id", FlagKind::kString, "",
         "with --accumulate: the call's id (default: a fresh random one); running the same call "
         "again with it adds nothing twice"},
        {"out", FlagKind::kString, "", "write per-token results (loss, logprob, argmax, ...) to FILE.json"},
        {"rows_per_message", FlagKind::kInt, "0", "hidden rows per chunk message; 0 sends about 4 MiB each"},
        SharedMemoryFlag(),
        PinWeightsFlag()},
       RunCompute},
      {"fetch-grad",
       "fetch-grad [--head H] --out FILE.npy [--dtype D]",
       "save the head's accumulated dL/dW [V, H] to an .npy file",
       {HeadFlag(),
        {"out", FlagKind::kString, "", "output FILE.npy"},
        {"dtype", FlagKind::kString, "float32", "float32, bfloat16 (stored as <u2 bits) or float16"}},
       [](const Flags& flags) { return RunFetch(flags, /*gradient=*/true); }},
      {"fetch-weight",
       "fetch-weight [--head H] --out FILE.npy [--dtype D]",
       "save the head's weight W [V, H] to an .npy file",
       {HeadFlag(),
        {"out", FlagKind::kString, "", "output FILE.npy"},
        {"dtype", FlagKind::kString, "float32", "float32, bfloat16 (stored as <u2 bits) or float16"}},
       [](const Flags& flags) { return RunFetch(flags, /*gradient=*/false); }},
      {"zero-grad",
       "zero-grad [--head H]",
       "zero the head's gradient accumulator",
       {HeadFlag()},
       RunZeroGrad},
      {"step",
       "step [--head H] --optimizer sgd|adamw [--lr LR] [options]",
       "apply an optimizer step to W from the accumulated gradient (torch.optim's defaults)",
       {HeadFlag(),
        {"optimizer", FlagKind::kString, "", "sgd or adamw"},
        {"lr", FlagKind::kDouble, "", "learning rate (default 1e-3, torch's for both)"},
        {"momentum", FlagKind::kDouble, "0", "SGD momentum"},
        {"beta1", FlagKind::kDouble, "0.9", "AdamW beta1"},
        {"beta2", FlagKind::kDouble, "0.999", "AdamW beta2"},
        {"eps", FlagKind::kDouble, "1e-8", "AdamW epsilon"},
        {"weight_decay", FlagKind::kDouble, "",
         "decoupled weight decay for AdamW (default 0.01) or L2 penalty for SGD (default 0)"},
        {"max_grad_norm", FlagKind::kDouble, "0", "clip the gradient to this global norm first (0: off)"},
        {"keep_grad", FlagKind::kBool, "false", "keep the accumulator after the step (default: zero it)"}},
       RunStep},
      {"save",
       "save [--head H]",
       "write checkpoints on the server (all heads without --head)",
       {{"head", FlagKind::kString, "", "head name (default: every head)"}},
       RunSave},
      {"upload",
       "upload --head NAME --weight PATH [--storage_dtype D] [--replace]",
       "create or replace a head from a weight file or a Hugging Face model checkpoint",
       {{"head", FlagKind::kString, "", "name of the new head"},
        {"weight", FlagKind::kString, "",
         "W [V, H]: FILE.npy, or a model directory, model.safetensors.index.json or safetensors "
         "file, with #TENSOR to name the tensor; chosen as lossd_server --heads does, with the "
         "tie and soft cap of the model's config.json"},
        {"storage_dtype", FlagKind::kString, "float32", "dtype the server keeps W in: float32 or bfloat16"},
        {"replace", FlagKind::kBool, "false", "overwrite an existing head of that name"}},
       RunUpload},
      {"bench",
       "bench [--head H] [--tokens N] [--calls K] [--streams S] [options]",
       "repeated synthetic Compute calls; prints calls/s, tokens/s, GB/s each way and latency percentiles",
       {HeadFlag(),
        {"tokens", FlagKind::kInt, "4096", "tokens per call"},
        {"calls", FlagKind::kInt, "10", "timed calls in all"},
        {"streams", FlagKind::kInt, "1", "calls in flight at once"},
        {"warmup", FlagKind::kInt, "1", "untimed calls first"},
        {"warmup_tokens", FlagKind::kInt, "0", "rows of each untimed call (0: all of --tokens)"},
        {"dtype", FlagKind::kString, "float32", "dtype of the hidden rows"},
        {"seed", FlagKind::kInt, "0", "seed of the synthetic batch"},
        {"grad", FlagKind::kBool, "false", "ask for dL/dh"},
        {"accumulate", FlagKind::kBool, "false", "add dL/dW to the head's accumulator on every call"},
        {"rows_per_message", FlagKind::kInt, "0",
         "hidden rows per chunk message; 0 sends about 4 MiB each, --tokens sends the whole batch "
         "in one message, so that the server computes nothing before all of it has arrived"},
        SharedMemoryFlag(),
        PinWeightsFlag(),
        {"json", FlagKind::kBool, "false",
         "print the totals as one JSON object (seconds, tokens/s, bytes each way, latencies, "
         "server compute and queue seconds summed over calls)"}},
       RunBench},
  };
  return *subcommands;
}

void PrintFlagHelp(std::FILE* out, const std::vector<FlagSpec>& flags) {
  for (const FlagSpec& flag : flags) {
    const std::string value = flag.kind == FlagKind::kBool ? "" : "=VALUE";
    const std::string default_text = flag.default_value.empty() || flag.kind == FlagKind::kBool
                                         ? ""
                                         : absl::StrCat(" (default ", flag.default_value, ")");
    absl::FPrintF(out, "  --%-26s %s%s\n", absl::StrCat(flag.name, value), flag.help, default_text);
  }
}

// To stdout when asked for, to stderr after a usage error.
void PrintMainHelp(std::FILE* out) {
  absl::FPrintF(
      out, "lossctl: the command line of lossd.\n\nUsage: lossctl [global flags] SUBCOMMAND [flags]\n\n");
  absl::FPrintF(out, "Subcommands:\n");
  for (const Subcommand& sub : Subcommands()) absl::FPrintF(out, "  %-14s %s\n", sub.name, sub.summary);
  absl::FPrintF(out, "\nGlobal flags (before or after the subcommand):\n");
  PrintFlagHelp(out, GlobalFlags());
  absl::FPrintF(out,
                "\n`lossctl SUBCOMMAND --help` describes a subcommand's flags, `lossctl --version` "
                "prints the version. Exit codes: 0 success, 1 a failed call or file, 2 a usage "
                "error.\n");
}

void PrintSubcommandHelp(const Subcommand& sub) {
  absl::PrintF("lossctl %s: %s\n\nUsage: lossctl %s\n", sub.name, sub.summary, sub.synopsis);
  if (!sub.flags.empty()) {
    absl::PrintF("\nFlags:\n");
    PrintFlagHelp(stdout, sub.flags);
  }
  absl::PrintF("\nGlobal flags:\n");
  PrintFlagHelp(stdout, GlobalFlags());
}

bool IsHelpFlag(const std::string& arg) { return arg == "--help" || arg == "-h"; }

const Subcommand* FindSubcommand(const std::string& name) {
  const auto sub = std::find_if(Subcommands().begin(), Subcommands().end(),
                                [&](const Subcommand& s) { return s.name == name; });
  return sub == Subcommands().end() ? nullptr : &*sub;
}

int Main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  // Global flags may come before the subcommand; the first other word names it.
  size_t index = 0;
  std::vector<std::string> leading;
  while (index < args.size() && absl::StartsWith(args[index], "--") && !IsHelpFlag(args[index]) &&
         args[index] != "--version") {
    leading.push_back(args[index]);
    const auto global = std::find_if(GlobalFlags().begin(), GlobalFlags().end(),
                                     [&](const FlagSpec& spec) { return args[index] == "--" + spec.name; });
    // "--server ADDR": the next word is the value, not the subcommand.
    if (global != GlobalFlags().end() && index + 1 < args.size()) leading.push_back(args[++index]);
    ++index;
  }
  if (index == args.size()) {
    PrintMainHelp(stderr);
    return 2;
  }
  if (args[index] == "--version") {
    absl::PrintF("lossctl %s\n", kVersion);
    return 0;
  }
  if (IsHelpFlag(args[index]) || args[index] == "help") {
    // `lossctl help SUBCOMMAND` describes that subcommand; plain help lists them all.
    const Subcommand* sub = index + 1 < args.size() ? FindSubcommand(args[index + 1]) : nullptr;
    if (sub != nullptr) {
      PrintSubcommandHelp(*sub);
    } else {
      PrintMainHelp(stdout);
    }
    return 0;
  }
  const std::string& name = args[index];
  const Subcommand* sub = FindSubcommand(name);
  if (sub == nullptr) {
    absl::FPrintF(stderr, "lossctl: unknown subcommand \"%s\"; `lossctl --help` lists them\n", name);
    return 2;
  }
  std::vector<std::string> rest = leading;
  for (size_t i = index + 1; i < args.size(); ++i) {
    if (IsHelpFlag(args[i])) {
      PrintSubcommandHelp(*sub);
      return 0;
    }
    rest.push_back(args[i]);
  }
  std::vector<FlagSpec> specs = GlobalFlags();
  specs.insert(specs.end(), sub->flags.begin(), sub->flags.end());
  absl::StatusOr<Flags> flags = Flags::Parse(specs, rest);
  absl::Status status = flags.status();
  if (status.ok() && sub->name != "head" && !flags->positional().empty()) {
    status = UsageError(absl::StrCat("unexpected argument \"", flags->positional()[0], "\""));
  }
  if (status.ok()) status = sub->run(*flags);
  if (status.ok()) return 0;
  if (IsUsageError(status)) {
    absl::FPrintF(stderr, "lossctl %s: %s\n`lossctl %s --help` describes its flags\n", sub->name,
                  status.message(), sub->name);
    return 2;
  }
  absl::FPrintF(stderr, "lossctl %s: %s: %s\n", sub->name, absl::StatusCodeToString(status.code()),
                status.message());
  return 1;
}

}  // namespace
}  // namespace lossd::client

// A Compute call allocates and frees message buffers of a few MiB for every message each way. By
// default glibc maps blocks that large afresh each time (and hands freed heap tops back to the
// kernel), so every message paid for page faults on new memory. Blocks up to 32 MiB (glibc's
// largest threshold) come from the heap instead, which keeps up to 256 MiB of freed memory for the
// next message. It lifted a 16384-row fp32 call from 0.25-0.28 to 0.36 GB/s each way while client
// and server built a fresh message per message; now that both reuse one, it is worth a few percent
// here (0.48 against 0.52 s, interleaved) and nothing measurable in the server, which does not set
// it.
void KeepMessageBuffersInHeap() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

int main(int argc, char** argv) {
  KeepMessageBuffersInHeap();
  return lossd::client::Main(argc, argv);
}
