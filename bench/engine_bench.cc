// engine_bench: the engine against its two peers on the CPU's BLAS, in one process and one run,
// so that their ratios are comparable on a noisy machine.
//
// For each shape (N tokens, H hidden, V vocabulary; hidden states and W in --dtype, fp32 or bf16)
// and each pass (forward: loss and logprobs; forward+backward: also dL/dh and dL/dW accumulated;
// on request, forward + dL/dh: a frozen head), three methods:
//   engine  Backend::Compute with the workspace budget (--budget-mib), chunked, never [N, V];
//   naive   materializes logits[N, V] = h W^T, log-softmax, dz = (softmax - onehot) / N in place,
//           dh = dz W, dW += dz^T h; skipped when its [N, V] buffer exceeds --naive-cap-gib;
//   floor   the GEMMs alone (logits, dh, dW) with no elementwise work, over the whole batch or in
//           blocks of rows whose logits fill at most 1 GiB (large enough for BLAS's full rate):
//           the cost of the useful flops on this BLAS, independent of the engine's plan.
// Useful flops are 2NHV forward, 4NHV forward + dL/dh and 6NHV forward+backward for every method.
// --methods picks a subset (one per process, say, to measure each one's memory on its own). The
// engine runs on --device (any backend; the hidden states and dL/dh are in host memory, by
// default in the backend's host buffers, page-locked on a GPU, as lossd_server receives rows and
// returns dL/dh; --host-memory pageable gives the engine plain memory instead); the naive baseline
// and the floor are CPU BLAS in fp32 on the same (rounded) values, so with another device only the
// engine runs. With bf16 the naive baseline still computes in fp32: it is what a caller without a
// bf16 GEMM would run.
//
// Each measurement is one warm-up run (on the first 64 tokens, or --warmup-tokens), then the
// median of up to --reps timed runs (fewer when one run would exceed --rep-seconds); the three
// methods of a pass take turns, and the engine is also compared with the naive baseline round by
// round (median ratio, rounds won, one-sided sign test). Times are the host's clock around each
// call; on a GPU the engine also reports the device's own time of each call (CUDA events,
// BatchSummary::device_seconds), which leaves out the host's side of pageable copies and the
// call's setup. A table goes to stderr, one JSON object per measurement to stdout (and to --json
// FILE), each with its rounds' times (device_seconds and device_round_seconds where measured).
// The engine's loss and dL/dh are checked against the naive baseline; the exit status is 1 when
// they disagree.
#include <cblas.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "lossd/common/counter_random.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/half.h"
#include "lossd/kernels/loss_math.h"
#include "nlohmann/json.hpp"

namespace lossd {
namespace {

struct Shape {
  int64_t n, h, v;
};

// Spans N = 1k..16k, H = 1k..4k and V = 32k..152k (Llama 2, Llama 3 and Qwen 2 vocabularies), with
// single- and multi-chunk plans; N=16384, V=128256 is where the memory target is read. One
// forward+backward there is 13 TFLOP, so the list stays short: about 10 minutes on 2 cores.
const std::vector<Shape> kDefaultShapes = {
    {1024, 1024, 32000},  {4096, 1024, 32000},   {1024, 2048, 128256},
    {1024, 4096, 152064}, {16384, 1024, 128256},
};
const std::vector<Shape> kQuickShapes = {{512, 1024, 32000}, {1024, 1024, 32000}};

// kForwardGradHidden is a call on a frozen head (dL/dh only), as in fine-tuning below the head.
enum class Pass { kForward, kForwardGradHidden, kForwardBackward };

bool WantsGradHidden(Pass pass) { return pass != Pass::kForward; }
bool WantsGradWeight(Pass pass) { return pass == Pass::kForwardBackward; }
absl::string_view PassSuffix(Pass pass) {
  switch (pass) {
    case Pass::kForward: return "fwd";
    case Pass::kForwardGradHidden: return "fwd_dh";
    case Pass::kForwardBackward: return "fwd_bwd";
  }
  return "";
}
// 2NHV per GEMM: logits, then dL/dh and dL/dW where asked for.
double UsefulFlops(const Shape& s, Pass pass) {
  return 2.0 * (1 + WantsGradHidden(pass) + WantsGradWeight(pass)) * s.n * s.h * s.v;
}
double Gib(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

absl::StatusOr<std::vector<Shape>> ParseShapes(absl::string_view text) {
  std::vector<Shape> shapes;
  for (absl::string_view item : absl::StrSplit(text, ';', absl::SkipWhitespace())) {
    std::vector<absl::string_view> parts = absl::StrSplit(item, ',');
    Shape s{};
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &s.n) ||
        !absl::SimpleAtoi(parts[1], &s.h) || !absl::SimpleAtoi(parts[2], &s.v) || s.n <= 0 ||
        s.h <= 0 || s.v <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shapes: expected positive N,H,V triples separated by ';', got '", item, "'"));
    }
    shapes.push_back(s);
  }
  if (shapes.empty()) return absl::InvalidArgumentError("--shapes: expected at least one N,H,V");
  return shapes;
}

constexpr size_t kFloorBlockBytes = size_t{1} << 30;
constexpr int64_t kWarmUpTokens = 64;

struct Options {
  std::vector<Shape> shapes = kDefaultShapes;
  std::string device = "cpu";
  DType dtype = DType::kFloat32;
  std::set<std::string> methods = {"floor", "engine", "naive"};
  bool methods_given = false;
  std::set<Pass> passes = {Pass::kForward, Pass::kForwardBackward};
  size_t budget_bytes = 0;       // 0: the backend's default, as the server takes it
  bool exact_gradients = false;  // LossOptions::exact_gradients
  bool pageable = false;         // the engine's rows and dL/dh in plain memory, not HostBuffers
  int reps = 3;
  int64_t warmup_tokens = kWarmUpTokens;  // 0: all of N
  double rep_seconds = 20.0;
  double naive_cap_gib = 6.0;
  std::string json_path;
};

constexpr char kUsage[] = R"(usage: engine_bench [flags]
  --shapes N,H,V;N,H,V;...  run these shapes instead of the default list
  --quick                   small shapes only, about 30 seconds in all
  --device D                the engine's backend: cpu, cuda, cuda:N or auto (default cpu); with
                            any but the CPU only the engine runs
  --dtype T                 hidden states and W: fp32 or bf16 (default fp32)
  --budget-mib M            the engine's workspace budget in MiB (default: the device's, as
                            lossd_server takes it)
  --reps R                  timed runs per measurement after one warm-up, median kept (default 3)
  --warmup-tokens W         tokens of the untimed warm-up run (default 64; 0: all of N, so that a
                            GPU's libraries meet the timed runs' shapes before the clock starts)
  --rep-seconds S           fewer runs when one is long: clamp(S / run seconds, 1, R) (default 20)
  --naive-cap-gib G         skip the naive baseline when its [N, V] logits exceed G GiB (default 6)
  --gradients G             the engine's dL/da for 16-bit products on a GPU: default (rounded
                            once to 16 bits) or exact (two 16-bit halves); LossOptions
  --methods M,M             run only these of floor, engine, naive (default all three)
  --passes P,P              run only these of fwd, fwd_dh, fwd_bwd (default fwd and fwd_bwd)
  --host-memory M           the engine's rows and dL/dh: server (default; the backend's host
                            buffers, page-locked on a GPU, where lossd_server puts them) or
                            pageable (plain memory, as an in-process caller's own arrays)
  --json FILE               also write the JSON lines to FILE
)";

// Flags as --name=value or --name value.
absl::StatusOr<Options> ParseOptions(int argc, char** argv) {
  Options o;
  std::string shapes;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t equals = arg.find('=');
    const std::string name = arg.substr(0, equals);
    if (name == "--quick") {
      quick = true;
      continue;
    }
    static const std::set<std::string> kValueFlags = {
        "--shapes",        "--device",      "--dtype",         "--budget-mib", "--reps",
        "--warmup-tokens", "--rep-seconds", "--naive-cap-gib", "--methods",    "--passes",
        "--json",          "--gradients",   "--host-memory"};
    if (!kValueFlags.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag '", arg, "'\n", kUsage));
    }
    std::string value;
    if (equals != std::string::npos) {
      value = arg.substr(equals + 1);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected a value"));
    }
    int64_t budget_mib = 0;
    bool valid = true;
    if (name == "--shapes") {
      shapes = value;
    } else if (name == "--device") {
      valid = !value.empty();
      o.device = value;
    } else if (name == "--dtype") {
      valid = value == "fp32" || value == "bf16";
      o.dtype = value == "bf16" ? DType::kBFloat16 : DType::kFloat32;
    } else if (name == "--budget-mib") {
      valid = absl::SimpleAtoi(value, &budget_mib) && budget_mib > 0;
      o.budget_bytes = static_cast<size_t>(budget_mib) << 20;
    } else if (name == "--reps") {
      valid = absl::SimpleAtoi(value, &o.reps) && o.reps >= 1;
    } else if (name == "--warmup-tokens") {
      valid = absl::SimpleAtoi(value, &o.warmup_tokens) && o.warmup_tokens >= 0;
    } else if (name == "--rep-seconds") {
      valid = absl::SimpleAtod(value, &o.rep_seconds) && o.rep_seconds >= 0;
    } else if (name == "--naive-cap-gib") {
      valid = absl::SimpleAtod(value, &o.naive_cap_gib) && o.naive_cap_gib >= 0;
    } else if (name == "--methods") {
      o.methods.clear();
      o.methods_given = true;
      for (absl::string_view m : absl::StrSplit(value, ',')) {
        valid = valid && (m == "floor" || m == "engine" || m == "naive");
        o.methods.insert(std::string(m));
      }
    } else if (name == "--passes") {
      o.passes.clear();
      for (absl::string_view name : absl::StrSplit(value, ',')) {
        bool known = false;
        for (Pass pass : {Pass::kForward, Pass::kForwardGradHidden, Pass::kForwardBackward}) {
          if (name != PassSuffix(pass)) continue;
          o.passes.insert(pass);
          known = true;
        }
        valid = valid && known;
      }
    } else if (name == "--json") {
      o.json_path = value;
    } else if (name == "--gradients") {
      valid = value == "default" || value == "exact";
      o.exact_gradients = value == "exact";
    } else if (name == "--host-memory") {
      valid = value == "server" || value == "pageable";
      o.pageable = value == "pageable";
    }
    if (!valid) {
      static const std::map<std::string, std::string> kExpected = {
          {"--device", "a backend: cpu, cuda, cuda:N or auto"},
          {"--dtype", "fp32 or bf16"},
          {"--budget-mib", "a positive integer"},
          {"--reps", "an integer >= 1"},
          {"--warmup-tokens", "an integer >= 0"},
          {"--rep-seconds", "a number >= 0"},
          {"--naive-cap-gib", "a number >= 0"},
          {"--methods", "a comma-separated subset of floor, engine, naive"},
          {"--passes", "a comma-separated subset of fwd, fwd_dh, fwd_bwd"},
          {"--gradients", "default or exact"},
          {"--host-memory", "server or pageable"}};
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected ", kExpected.at(name), ", got '", value, "'"));
    }
  }
  if (quick) o.shapes = kQuickShapes;
  if (!shapes.empty()) {
    ASSIGN_OR_RETURN(o.shapes, ParseShapes(shapes));
  }
  return o;
}

nlohmann::json DescribeMachine() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string cpu = "unknown";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  return {{"hostname", host},
          {"cpu", cpu},
          {"threads", omp_get_max_threads()},
          {"blas_threads", openblas_get_num_threads()},
          {"blas", openblas_get_config()}};
}

// Uniform with standard deviation `stddev`, in parallel: multi-GB weights fill in a second.
void FillUniform(float* data, int64_t count, double stddev, uint64_t stream) {
  const float half_width = static_cast<float>(stddev * std::sqrt(3.0));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) data[i] = half_width * CounterUniform(stream, i);
}

// Everything one shape's measurements share. W and dL/dW live in backend memory; with the CPU
// backend and fp32 that is host memory, and the peers read the very bytes the engine reads.
struct Problem {
  Shape shape;
  DType dtype = DType::kFloat32;
  std::vector<float> hidden;         // [N, H], rounded to dtype
  std::vector<uint16_t> hidden16;    // [N, H], the engine's input when dtype is 16-bit
  std::vector<int64_t> labels;       // [N]
  DeviceBuffer weight;               // [V, H] in dtype, for the engine
  std::vector<float> weight32;       // [V, H] for the CPU peers, unless `weight` is already that
  DeviceBuffer grad_weight;          // [V, H], accumulated into by every backward run
  std::vector<float> loss, logprob;  // [N], written by the engine and by the naive baseline
  std::vector<float> engine_grad_hidden, naive_grad_hidden, floor_grad_hidden;  // [N, H]
  // The engine's rows and dL/dh in the backend's host buffers, unless --host-memory pageable:
  // then `hidden` (or `hidden16`) and `engine_grad_hidden` are the engine's.
  DeviceBuffer engine_rows, engine_grad_hidden_host;
  double engine_loss = 0.0, naive_loss = 0.0;
  double engine_device_seconds = 0.0;  // the last engine call's BatchSummary::device_seconds
};

// Rounds x to bf16 in place and returns the bf16 bit patterns.
std::vector<uint16_t> RoundToBFloat16(float* x, int64_t count) {
  std::vector<uint16_t> narrow(count);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    narrow[i] = FloatToBFloat16(x[i]);
    x[i] = BFloat16ToFloat(narrow[i]);
  }
  return narrow;
}

absl::StatusOr<std::unique_ptr<Problem>> MakeProblem(Backend& backend, const Shape& s,
                                                     const Options& options) {
  const std::set<std::string>& methods = options.methods;
  auto p = std::make_unique<Problem>();
  p->shape = s;
  p->dtype = options.dtype;
  p->hidden.resize(s.n * s.h);
  FillUniform(p->hidden.data(), s.n * s.h, 1.0, 1);
  const bool bf16 = p->dtype == DType::kBFloat16;
  if (bf16) p->hidden16 = RoundToBFloat16(p->hidden.data(), s.n * s.h);
  p->labels.resize(s.n);
  for (int64_t i = 0; i < s.n; ++i) p->labels[i] = (i * 7919 + 13) % s.v;

  const int64_t weight_count = s.v * s.h;
  ASSIGN_OR_RETURN(p->weight, backend.Allocate(weight_count * DTypeSize(p->dtype)));
  const bool weight_is_host_fp32 = backend.kind() == "cpu" && p->dtype == DType::kFloat32;
  float* values = static_cast<float*>(p->weight.data());
  if (!weight_is_host_fp32) {
    p->weight32.resize(weight_count);
    values = p->weight32.data();
  }
  // Logits with standard deviation 3, as a trained head gives.
  FillUniform(values, weight_count, 3.0 / std::sqrt(double(s.h)), 2);
  if (!weight_is_host_fp32) {
    const std::vector<uint16_t> narrow =
        bf16 ? RoundToBFloat16(values, weight_count) : std::vector<uint16_t>();
    const void* bytes = bf16 ? static_cast<const void*>(narrow.data()) : values;
    RETURN_IF_ERROR(backend.CopyToDevice(bytes, p->weight.bytes(), p->weight, 0));
    if (!methods.contains("floor") && !methods.contains("naive")) {
      std::vector<float>().swap(p->weight32);  // only the engine runs: its copy is on the device
    }
  }
  ASSIGN_OR_RETURN(p->grad_weight, backend.Allocate(weight_count * sizeof(float)));
  RETURN_IF_ERROR(backend.Zero(p->grad_weight));
  p->loss.resize(s.n);
  p->logprob.resize(s.n);
  // Only the methods that run get an output buffer, so that a process running one method holds
  // only what that method needs.
  for (const auto& [method, grad] :
       {std::pair{"engine", &p->engine_grad_hidden}, std::pair{"naive", &p->naive_grad_hidden},
        std::pair{"floor", &p->floor_grad_hidden}}) {
    if (methods.contains(method)) grad->resize(s.n * s.h);
  }
  if (methods.contains("engine") && !options.pageable) {
    const void* rows =
        p->hidden16.empty() ? static_cast<const void*>(p->hidden.data()) : p->hidden16.data();
    const size_t row_bytes = s.n * s.h * DTypeSize(p->dtype);
    ASSIGN_OR_RETURN(p->engine_rows, backend.HostBuffers().Allocate(row_bytes));
    std::memcpy(p->engine_rows.data(), rows, row_bytes);
    ASSIGN_OR_RETURN(p->engine_grad_hidden_host,
                     backend.HostBuffers().Allocate(s.n * s.h * sizeof(float)));
    std::vector<float>().swap(p->engine_grad_hidden);
  }
  return p;
}

const void* EngineRows(const Problem& p) {
  if (p.engine_rows.data() != nullptr) return p.engine_rows.data();
  return p.hidden16.empty() ? static_cast<const void*>(p.hidden.data()) : p.hidden16.data();
}
float* EngineGradHidden(Problem& p) {
  if (p.engine_grad_hidden_host.data() != nullptr) {
    return static_cast<float*>(p.engine_grad_hidden_host.data());
  }
  return p.engine_grad_hidden.data();
}

const float* Weight(const Problem& p) {
  return p.weight32.empty() ? static_cast<const float*>(p.weight.data()) : p.weight32.data();
}
float* GradWeight(Problem& p) { return static_cast<float*>(p.grad_weight.data()); }

ProblemShape EngineShape(const Shape& s, DType dtype, Pass pass, bool exact_gradients) {
  ProblemShape shape;
  shape.exact_gradients = exact_gradients;
  shape.hidden_dtype = dtype;
  shape.weight_dtype = dtype;
  shape.num_tokens = s.n;
  shape.hidden_size = s.h;
  shape.vocab_size = s.v;
  shape.grad_hidden = WantsGradHidden(pass);
  shape.grad_weight = WantsGradWeight(pass);
  return shape;
}

// Each method runs on the first `n` tokens: all of them when timed, a few to warm up.
absl::Status RunEngine(Backend& backend, Problem& p, Pass pass, const LossOptions& options,
                       DeviceBuffer& workspace, int64_t n) {
  BatchInputs in;
  in.hidden = EngineRows(p);
  in.hidden_dtype = p.dtype;
  in.num_tokens = n;
  in.hidden_size = p.shape.h;
  in.labels = p.labels.data();
  TokenOutputs out;
  out.token_loss = p.loss.data();
  out.logprob = p.logprob.data();
  if (WantsGradHidden(pass)) out.grad_hidden = EngineGradHidden(p);
  const WeightView weight{&p.weight, p.dtype, p.shape.v, p.shape.h};
  ASSIGN_OR_RETURN(const BatchSummary summary,
                   backend.Compute(in, weight, options, out,
                                   WantsGradWeight(pass) ? &p.grad_weight : nullptr, workspace));
  p.engine_loss = summary.loss;
  p.engine_device_seconds = summary.device_seconds;
  return absl::OkStatus();
}

// One row of the naive baseline: log-softmax, and with `backward` dz = (softmax - onehot) / N in
// place. Compiled like the engine's row loops (AVX2 + FMA clone, no trapping math, the same Exp),
// so that the comparison isolates what materializing [N, V] costs.
__attribute__((target_clones("arch=x86-64-v3", "default"))) float NaiveRow(float* z, int64_t v,
                                                                           int64_t label,
                                                                           bool backward,
                                                                           float inv_n) {
  float max = -INFINITY;
#pragma omp simd reduction(max : max)
  for (int64_t c = 0; c < v; ++c) max = MaxStep(max, z[c]);
  float sum_exp = 0.0f;
#pragma omp simd reduction(+ : sum_exp)
  for (int64_t c = 0; c < v; ++c) sum_exp += Exp(z[c] - max);
  const float lse = max + std::log(sum_exp);
  const float logprob = z[label] - lse;
  if (backward) {
#pragma omp simd
    for (int64_t c = 0; c < v; ++c) z[c] = Exp(z[c] - lse) * inv_n;
    z[label] -= inv_n;
  }
  return logprob;
}

// The textbook implementation. `logits` holds N * V floats.
void RunNaive(Problem& p, Pass pass, float* logits, int64_t n) {
  const int64_t h = p.shape.h, v = p.shape.v;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, v, h, 1.0f, p.hidden.data(), h, Weight(p),
              h, 0.0f, logits, v);
  const float inv_n = 1.0f / static_cast<float>(n);
  const bool backward = WantsGradHidden(pass);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    p.logprob[i] = NaiveRow(logits + i * v, v, p.labels[i], backward, inv_n);
    p.loss[i] = -p.logprob[i];
  }
  double loss_sum = 0.0;
  for (int64_t i = 0; i < n; ++i) loss_sum += p.loss[i];
  p.naive_loss = loss_sum / n;
  if (!backward) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, h, v, 1.0f, logits, v, Weight(p), h,
              0.0f, p.naive_grad_hidden.data(), h);
  if (!WantsGradWeight(pass)) return;
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v, h, n, 1.0f, logits, v, p.hidden.data(), h,
              1.0f, GradWeight(p), h);
}

// Rows per floor block: the whole batch when its logits fit kFloorBlockBytes, else a multiple
// of 64.
int64_t FloorBlockRows(const Shape& s) {
  const int64_t fitting = std::max<int64_t>(1, kFloorBlockBytes / (s.v * sizeof(float)));
  return fitting >= s.n ? s.n
                        : std::max<int64_t>(fitting / 64 * 64, std::min<int64_t>(fitting, 64));
}

// The useful GEMMs, in blocks of `block_rows` tokens over the whole vocabulary.
void RunFloor(Problem& p, Pass pass, int64_t block_rows, float* logits, int64_t n) {
  const int64_t h = p.shape.h, v = p.shape.v;
  for (int64_t r0 = 0; r0 < n; r0 += block_rows) {
    const int64_t rows = std::min(block_rows, n - r0);
    const float* hidden = p.hidden.data() + r0 * h;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, v, h, 1.0f, hidden, h, Weight(p), h,
                0.0f, logits, v);
    if (!WantsGradHidden(pass)) continue;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, h, v, 1.0f, logits, v, Weight(p),
                h, 0.0f, p.floor_grad_hidden.data() + r0 * h, h);
    if (!WantsGradWeight(pass)) continue;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v, h, rows, 1.0f, logits, v, hidden, h,
                1.0f, GradWeight(p), h);
  }
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

// The timed runs of one method, by round.
struct Timing {
  std::vector<double> rounds;  // seconds of each, by the host's clock
  // The device's own time of each round, where the backend reports one (BatchSummary's
  // device_seconds): the host's clock also counts copying the rows and dL/dh over PCIe.
  std::vector<double> device_rounds;
  double seconds() const { return Median(rounds); }
  int reps() const { return static_cast<int>(rounds.size()); }
};

// The engine against the naive baseline round by round: within a round the two run back to back,
// so a slow spell of the shared machine that spans the round divides out of their ratio.
struct PairedComparison {
  double median_ratio = 0.0;  // of engine / naive, over rounds
  int faster_rounds = 0;      // rounds in which the engine took less time
  int rounds = 0;
  double sign_test_p = 1.0;  // one-sided: P(at least faster_rounds of rounds by a coin's toss)
};

// One row of the report.
struct Result {
  Shape shape;
  std::string method;  // engine_fwd, naive_fwd_bwd, ...
  Pass pass;
  std::optional<Timing> timing;  // empty when skipped
  std::string skipped;           // why, when skipped
  size_t peak_extra_bytes = 0;
  std::optional<double> ratio_to_floor, ratio_to_naive;
  std::optional<PairedComparison> paired_to_naive;  // engine rows with a timed naive baseline
  int64_t token_chunk = 0, vocab_chunk = 0;
  int64_t logit_rows = 0;  // rows of logits held at once, when fewer than token_chunk (windows)
};

using Clock = std::chrono::steady_clock;

absl::StatusOr<double> TimeOnce(const std::function<absl::Status(int64_t)>& run, int64_t rows) {
  const auto start = Clock::now();
  RETURN_IF_ERROR(run(rows));
  return std::chrono::duration<double>(Clock::now() - start).count();
}

PairedComparison CompareByRound(const Timing& engine, const Timing& naive) {
  PairedComparison c;
  std::vector<double> ratios;
  for (size_t i = 0; i < engine.rounds.size() && i < naive.rounds.size(); ++i) {
    ratios.push_back(engine.rounds[i] / naive.rounds[i]);
    c.faster_rounds += engine.rounds[i] < naive.rounds[i];
  }
  c.rounds = static_cast<int>(ratios.size());
  c.median_ratio = Median(ratios);
  // Sum over k >= faster_rounds of C(rounds, k) / 2^rounds.
  double tail = 0.0, choose = 1.0;
  for (int k = 0; k <= c.rounds; ++k) {
    if (k >= c.faster_rounds) tail += choose;
    choose = choose * (c.rounds - k) / (k + 1);
  }
  c.sign_test_p = tail / std::pow(2.0, c.rounds);
  return c;
}

// One method of a pass and how to run it on the first `rows` tokens.
struct Contender {
  Result* result;
  std::function<absl::Status(int64_t rows)> run;
  // The device seconds of the last run, or 0 where there is no device clock.
  std::function<double()> device_seconds = [] { return 0.0; };
};

// One warm-up run each, then timed rounds that run every contender in turn, so that a slow spell
// of the shared machine hits all of them rather than one. Every buffer was touched when allocated,
// so the warm-up needs only a few tokens to start the threads and page in the code: a full token
// chunk, as it once was, cost as much as a timed run wherever the batch is one chunk.
absl::Status MeasureInRounds(const Options& options, int64_t num_tokens, int64_t warm_up_tokens,
                             const std::vector<Contender>& contenders) {
  double longest_run = 0.0;  // estimated for all tokens from the warm-up
  for (const Contender& c : contenders) {
    ASSIGN_OR_RETURN(const double seconds, TimeOnce(c.run, warm_up_tokens));
    longest_run = std::max(longest_run, seconds * num_tokens / warm_up_tokens);
  }
  const int reps = static_cast<int>(
      std::clamp(options.rep_seconds / longest_run, 1.0, static_cast<double>(options.reps)));
  // Each round starts with the next contender, so that none always runs first (after the
  // warm-up's allocations) or right after the same neighbour.
  std::vector<Timing> timings(contenders.size());
  for (int round = 0; round < reps; ++round) {
    for (size_t j = 0; j < contenders.size(); ++j) {
      const size_t i = (j + round) % contenders.size();
      ASSIGN_OR_RETURN(const double s, TimeOnce(contenders[i].run, num_tokens));
      timings[i].rounds.push_back(s);
      if (const double device = contenders[i].device_seconds(); device > 0) {
        timings[i].device_rounds.push_back(device);
      }
    }
  }
  for (size_t i = 0; i < contenders.size(); ++i) {
    if (timings[i].device_rounds.size() != timings[i].rounds.size()) {
      timings[i].device_rounds.clear();
    }
    contenders[i].result->timing = std::move(timings[i]);
  }
  return absl::OkStatus();
}

std::string FormatRatio(const std::optional<double>& ratio) {
  return ratio ? absl::StrFormat("%.3f", *ratio) : "-";
}

void PrintTableHeader() {
  std::cerr << absl::StrFormat("%-20s %-14s %4s %10s %9s %8s %8s %11s  %s\n", "shape N,H,V",
                               "method", "reps", "seconds", "GFLOP/s", "x floor", "x naive",
                               "extra MiB", "chunk Nc x Vc");
}

void PrintTableRow(const Result& r) {
  const std::string shape = absl::StrCat(r.shape.n, ",", r.shape.h, ",", r.shape.v);
  if (!r.timing) {
    std::cerr << absl::StrFormat("%-20s %-14s %4s %10s %9s %8s %8s %11.1f  %s\n", shape, r.method,
                                 "-", "-", "-", "-", "-", r.peak_extra_bytes / 1048576.0,
                                 r.skipped);
    return;
  }
  std::string chunk = r.token_chunk > 0 ? absl::StrCat(r.token_chunk, " x ", r.vocab_chunk) : "-";
  if (r.logit_rows > 0) absl::StrAppend(&chunk, " in pieces of ", r.logit_rows);
  if (!r.timing->device_rounds.empty()) {
    absl::StrAppendFormat(&chunk, "; device %.4f s", Median(r.timing->device_rounds));
  }
  std::cerr << absl::StrFormat("%-20s %-14s %4d %10.3f %9.1f %8s %8s %11.1f  %s\n", shape, r.method,
                               r.timing->reps(), r.timing->seconds(),
                               UsefulFlops(r.shape, r.pass) / r.timing->seconds() / 1e9,
                               FormatRatio(r.ratio_to_floor), FormatRatio(r.ratio_to_naive),
                               r.peak_extra_bytes / 1048576.0, chunk);
}

nlohmann::json ToJson(const Result& r, const nlohmann::json& machine, const Options& options) {
  const size_t budget_bytes = options.budget_bytes;
  nlohmann::json j = {
      {"machine", machine},
      {"shape", {{"n", r.shape.n}, {"h", r.shape.h}, {"v", r.shape.v}}},
      {"dtype", DTypeName(options.dtype)},
      {"method", r.method},
      {"budget_bytes", budget_bytes},
      {"gradients", options.exact_gradients ? "exact" : "default"},
      {"host_memory", options.pageable ? "pageable" : "server"},
      {"peak_extra_bytes", r.peak_extra_bytes},
  };
  auto number_or_null = [](const std::optional<double>& x) {
    return x ? nlohmann::json(*x) : nlohmann::json(nullptr);
  };
  j["seconds"] = number_or_null(r.timing ? std::optional(r.timing->seconds()) : std::nullopt);
  j["gflops"] = number_or_null(
      r.timing ? std::optional(UsefulFlops(r.shape, r.pass) / r.timing->seconds() / 1e9)
               : std::nullopt);
  j["reps"] = r.timing ? r.timing->reps() : 0;
  j["ratio_to_floor"] = number_or_null(r.ratio_to_floor);
  j["ratio_to_naive"] = number_or_null(r.ratio_to_naive);
  if (r.timing) j["round_seconds"] = r.timing->rounds;
  if (r.timing && !r.timing->device_rounds.empty()) {
    j["device_seconds"] = Median(r.timing->device_rounds);
    j["device_round_seconds"] = r.timing->device_rounds;
  }
  if (r.paired_to_naive) {
    j["paired_to_naive"] = {{"median_ratio", r.paired_to_naive->median_ratio},
                            {"faster_rounds", r.paired_to_naive->faster_rounds},
                            {"rounds", r.paired_to_naive->rounds},
                            {"sign_test_p", r.paired_to_naive->sign_test_p}};
  }
  if (r.token_chunk > 0) j["chunk"] = {{"tokens", r.token_chunk}, {"vocab", r.vocab_chunk}};
  if (r.logit_rows > 0) j["chunk"]["logit_rows"] = r.logit_rows;
  if (!r.skipped.empty()) j["skipped"] = r.skipped;
  return j;
}

// ||a - b|| / ||b|| in double.
double RelativeDifference(const float* a, const std::vector<float>& b) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = double(a[i]) - b[i];
    diff += d * d;
    norm += double(b[i]) * b[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// The measurements of one shape: floor, engine and naive (those --methods names), for each pass.
absl::StatusOr<std::vector<Result>> BenchShape(Backend& backend, const Shape& s,
                                               const Options& options, bool& check_failed) {
  ASSIGN_OR_RETURN(std::unique_ptr<Problem> p, MakeProblem(backend, s, options));
  const bool with_floor = options.methods.contains("floor");
  const bool with_engine = options.methods.contains("engine");
  const bool with_naive = options.methods.contains("naive");
  const size_t naive_bytes = static_cast<size_t>(s.n) * s.v * sizeof(float);
  const bool naive_fits = Gib(naive_bytes) <= options.naive_cap_gib;
  // Every method's large buffers come from the backend's allocator, so that the comparison is
  // between algorithms, not allocators; touched up front.
  const auto touched = [&](size_t bytes) -> absl::StatusOr<DeviceBuffer> {
    ASSIGN_OR_RETURN(DeviceBuffer buffer, backend.Allocate(bytes));
    RETURN_IF_ERROR(backend.Zero(buffer));
    return buffer;
  };
  DeviceBuffer naive_logits;
  if (with_naive && naive_fits) {
    ASSIGN_OR_RETURN(naive_logits, touched(naive_bytes));
  }
  const int64_t floor_rows = FloorBlockRows(s);
  DeviceBuffer floor_logits;
  if (with_floor) {
    ASSIGN_OR_RETURN(floor_logits, touched(static_cast<size_t>(floor_rows) * s.v * sizeof(float)));
  }

  LossOptions loss_options;
  loss_options.exact_gradients = options.exact_gradients;
  std::vector<Result> results;
  for (Pass pass : options.passes) {
    ASSIGN_OR_RETURN(const ChunkPlan plan,
                     backend.Plan(EngineShape(s, options.dtype, pass, options.exact_gradients),
                                  options.budget_bytes));
    const std::string suffix(PassSuffix(pass));

    Result floor{s, "floor_" + suffix, pass};
    floor.peak_extra_bytes = floor_logits.bytes();
    floor.token_chunk = floor_rows;
    floor.vocab_chunk = s.v;
    Result engine{s, "engine_" + suffix, pass};
    engine.peak_extra_bytes = plan.workspace_bytes;
    engine.token_chunk = plan.token_chunk;
    engine.vocab_chunk = plan.vocab_chunk;
    engine.logit_rows = plan.logit_rows;
    DeviceBuffer workspace;
    if (with_engine) {
      ASSIGN_OR_RETURN(workspace, touched(plan.workspace_bytes));
    }
    Result naive{s, "naive_" + suffix, pass};
    naive.peak_extra_bytes = naive_bytes;

    std::vector<Contender> contenders;
    if (with_floor) {
      contenders.push_back({&floor, [&](int64_t n) {
                              RunFloor(*p, pass, floor_rows,
                                       static_cast<float*>(floor_logits.data()), n);
                              return absl::OkStatus();
                            }});
    }
    if (with_engine) {
      contenders.push_back(
          {&engine,
           [&](int64_t n) { return RunEngine(backend, *p, pass, loss_options, workspace, n); },
           [&] { return p->engine_device_seconds; }});
    }
    if (with_naive && naive_fits) {
      contenders.push_back({&naive, [&](int64_t n) {
                              RunNaive(*p, pass, static_cast<float*>(naive_logits.data()), n);
                              return absl::OkStatus();
                            }});
    } else if (with_naive) {
      naive.skipped = absl::StrFormat("skipped: needs %.1f GiB", Gib(naive_bytes));
    }
    const int64_t warm_up_tokens = options.warmup_tokens > 0 ? options.warmup_tokens : s.n;
    RETURN_IF_ERROR(MeasureInRounds(options, s.n, std::min(s.n, warm_up_tokens), contenders));

    if (engine.timing && naive.timing) {
      engine.paired_to_naive = CompareByRound(*engine.timing, *naive.timing);
    }
    for (Result* r : {&floor, &engine, &naive}) {
      if (!options.methods.contains(r->method.substr(0, r->method.find('_')))) continue;
      if (r->timing) {
        if (floor.timing) r->ratio_to_floor = r->timing->seconds() / floor.timing->seconds();
        if (naive.timing) r->ratio_to_naive = r->timing->seconds() / naive.timing->seconds();
      }
      PrintTableRow(*r);
      results.push_back(*r);
    }
    if (engine.paired_to_naive) {
      const PairedComparison& c = *engine.paired_to_naive;
      std::cerr << absl::StrFormat(
          "%-20s engine vs naive by round: median %.3f, faster in %d of %d (sign test p %.3g)\n",
          "", c.median_ratio, c.faster_rounds, c.rounds, c.sign_test_p);
    }
  }

  if (with_engine && naive_logits.data() != nullptr) {
    const double loss_difference =
        std::abs(p->engine_loss - p->naive_loss) / std::abs(p->naive_loss);
    const double grad_difference = RelativeDifference(EngineGradHidden(*p), p->naive_grad_hidden);
    const bool agree = loss_difference < 1e-4 && grad_difference < 1e-3;
    check_failed = check_failed || !agree;
    std::cerr << absl::StrFormat(
        "%-20s check engine vs naive: loss %.6f vs %.6f (rel %.1e), dL/dh rel %.1e: %s\n", "",
        p->engine_loss, p->naive_loss, loss_difference, grad_difference,
        agree ? "agree" : "DISAGREE");
  }
  return results;
}

absl::Status Run(const Options& options) {
  std::ofstream json_file;
  if (!options.json_path.empty()) {
    json_file.open(options.json_path);
    if (!json_file) {
      return absl::InvalidArgumentError(absl::StrCat("--json: cannot write ", options.json_path));
    }
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(options.device));
  Options run_options = options;
  if (backend->kind() != "cpu") {
    const bool cpu_peers_asked =
        options.methods.contains("floor") || options.methods.contains("naive");
    if (options.methods_given && cpu_peers_asked) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--methods: floor and naive run on the CPU's BLAS; with --device=", options.device,
          " expected engine only"));
    }
    run_options.methods = {"engine"};
  }
  if (run_options.budget_bytes == 0) run_options.budget_bytes = backend->DefaultWorkspaceBudget();
  nlohmann::json machine = DescribeMachine();
  machine["device"] = backend->Describe();
  std::cerr << "machine: " << machine.dump() << "\n"
            << "engine workspace budget " << (run_options.budget_bytes >> 20) << " MiB, "
            << DTypeName(options.dtype) << " inputs; useful flops "
            << "2NHV forward, 4NHV fwd_dh, 6NHV forward+backward; seconds are medians\n";
  PrintTableHeader();

  bool check_failed = false;
  for (const Shape& s : options.shapes) {
    ASSIGN_OR_RETURN(const std::vector<Result> results,
                     BenchShape(*backend, s, run_options, check_failed));
    for (const Result& r : results) {
      const std::string line = ToJson(r, machine, run_options).dump();
      std::cout << line << std::endl;
      if (json_file.is_open()) json_file << line << std::endl;
    }
  }
  if (check_failed) return absl::InternalError("the engine disagrees with the naive baseline");
  return absl::OkStatus();
}

}  // namespace
}  // namespace lossd

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::cout << lossd::kUsage;
      return 0;
    }
  }
  absl::StatusOr<lossd::Options> options = lossd::ParseOptions(argc, argv);
  absl::Status status = options.ok() ? lossd::Run(*options) : options.status();
  if (!status.ok()) {
    std::cerr << "engine_bench: " << status.message() << "\n";
    return 1;
  }
  return 0;
}
