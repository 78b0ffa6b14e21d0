// distill_bench: the engine's distill call timed on one backend, for bench/distill_peers.py.
//
// For each shape (N tokens, H the student's hidden size, H_t the teacher's, V the vocabulary) and
// each pass (fwd: the loss and the per-token KD; fwd_bwd: also dL/dh and dL/dW of the student),
// one Backend::Compute of the distill objective against a teacher head, within the workspace
// budget (--budget-mib). The inputs are counter-based random values that distill_peers.py makes
// the same way, so that its torch peers and the engine compute on the very same numbers:
//   student rows  stream 1, standard deviation 1      student W  stream 2, 3 / sqrt(H)
//   teacher rows  stream 3, standard deviation 1      teacher W  stream 4, 3 / sqrt(H_t)
// uniform (CounterUniform scaled by sqrt(3) times the deviation), rounded to --dtype; labels
// (i * 7919 + 13) mod V, none ignored; reduction mean.
//
// One warm-up run, then the median of --reps timed runs. One JSON object per measurement to
// stdout: seconds, the loss, the plan's chunks, the workspace (the call's peak extra memory) and
// the device. With --grad-hidden-out=PREFIX, fwd_bwd also writes dL/dh of the last run as raw
// float32 to PREFIX_N_H_Ht_V.f32 for comparison.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "lossd/common/counter_random.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/loss_math.h"
#include "nlohmann/json.hpp"

namespace lossd {
namespace {

struct Shape {
  int64_t n, h, ht, v;
};

struct Options {
  std::vector<Shape> shapes = {{1024, 1024, 1024, 32000}};
  std::string device = "cpu";
  DType dtype = DType::kFloat32;
  std::vector<std::string> passes = {"fwd_bwd"};
  double beta = 0.5;
  double alpha = 0.0;
  double temperature = 1.0;
  size_t budget_bytes = size_t{256} << 20;
  int reps = 3;
  std::string grad_hidden_out;
};

absl::Status Usage(absl::string_view message) { return absl::InvalidArgumentError(message); }

absl::StatusOr<Options> ParseFlags(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t equals = arg.find('=');
    if (arg.rfind("--", 0) != 0 || equals == std::string::npos) {
      return Usage(absl::StrCat("expected --flag=value arguments, got '", arg, "'"));
    }
    const std::string flag = arg.substr(0, equals);
    const std::string value = arg.substr(equals + 1);
    if (flag == "--shapes") {
      o.shapes.clear();
      for (absl::string_view item : absl::StrSplit(value, ';', absl::SkipWhitespace())) {
        std::vector<absl::string_view> parts = absl::StrSplit(item, ',');
        Shape s{};
        if (parts.size() != 4 || !absl::SimpleAtoi(parts[0], &s.n) ||
            !absl::SimpleAtoi(parts[1], &s.h) || !absl::SimpleAtoi(parts[2], &s.ht) ||
            !absl::SimpleAtoi(parts[3], &s.v) || s.n <= 0 || s.h <= 0 || s.ht <= 0 || s.v <= 0) {
          return Usage(absl::StrCat(
              "--shapes: expected positive N,H,H_t,V quadruples separated by ';', got '", item,
              "'"));
        }
        o.shapes.push_back(s);
      }
      if (o.shapes.empty()) return Usage("--shapes: expected at least one N,H,H_t,V");
    } else if (flag == "--device") {
      o.device = value;
    } else if (flag == "--dtype") {
      if (value != "fp32" && value != "bf16") {
        return Usage(absl::StrCat("--dtype: expected fp32 or bf16, got '", value, "'"));
      }
      o.dtype = value == "bf16" ? DType::kBFloat16 : DType::kFloat32;
    } else if (flag == "--passes") {
      o.passes = absl::StrSplit(value, ',', absl::SkipEmpty());
      for (const std::string& pass : o.passes) {
        if (pass != "fwd" && pass != "fwd_bwd") {
          return Usage(absl::StrCat("--passes: expected fwd and/or fwd_bwd, got '", pass, "'"));
        }
      }
    } else if (flag == "--beta" || flag == "--alpha" || flag == "--temperature") {
      double x = 0.0;
      if (!absl::SimpleAtod(value, &x)) {
        return Usage(absl::StrCat(flag, ": expected a number, got '", value, "'"));
      }
      (flag == "--beta" ? o.beta : flag == "--alpha" ? o.alpha : o.temperature) = x;
    } else if (flag == "--budget-mib" || flag == "--reps") {
      int x = 0;
      if (!absl::SimpleAtoi(value, &x) || x < 1) {
        return Usage(absl::StrCat(flag, ": expected an integer >= 1, got '", value, "'"));
      }
      if (flag == "--reps") {
        o.reps = x;
      } else {
        o.budget_bytes = static_cast<size_t>(x) << 20;
      }
    } else if (flag == "--grad-hidden-out") {
      o.grad_hidden_out = value;
    } else {
      return Usage(absl::StrCat("unknown flag ", flag));
    }
  }
  return o;
}

// Uniform with standard deviation `stddev` from stream `stream`, rounded to `dtype`; the bytes
// the engine takes.
std::vector<uint8_t> RandomTensor(int64_t count, double stddev, uint64_t stream, DType dtype) {
  std::vector<uint8_t> bytes(count * DTypeSize(dtype));
  const float half_width = static_cast<float>(stddev * std::sqrt(3.0));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    StoreFromFloat(bytes.data(), dtype, i, half_width * CounterUniform(stream, i));
  }
  return bytes;
}

absl::StatusOr<DeviceBuffer> OnDevice(Backend& backend, const std::vector<uint8_t>& bytes) {
  ASSIGN_OR_RETURN(DeviceBuffer buffer, backend.Allocate(bytes.size()));
  RETURN_IF_ERROR(backend.CopyToDevice(bytes.data(), bytes.size(), buffer, 0));
  return buffer;
}

absl::Status Run(const Options& o) {
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(o.device));
  for (const Shape& s : o.shapes) {
    const std::vector<uint8_t> hidden = RandomTensor(s.n * s.h, 1.0, 1, o.dtype);
    const std::vector<uint8_t> teacher_hidden = RandomTensor(s.n * s.ht, 1.0, 3, o.dtype);
    ASSIGN_OR_RETURN(
        DeviceBuffer weight,
        OnDevice(*backend, RandomTensor(s.v * s.h, 3.0 / std::sqrt(double(s.h)), 2, o.dtype)));
    ASSIGN_OR_RETURN(
        DeviceBuffer teacher_weight,
        OnDevice(*backend, RandomTensor(s.v * s.ht, 3.0 / std::sqrt(double(s.ht)), 4, o.dtype)));
    std::vector<int64_t> labels(s.n);
    for (int64_t i = 0; i < s.n; ++i) labels[i] = (i * 7919 + 13) % s.v;
    const WeightView student_view{&weight, o.dtype, s.v, s.h};
    const WeightView teacher_view{&teacher_weight, o.dtype, s.v, s.ht};
    LossOptions options;
    options.objective = Objective::kDistill;
    options.distill.beta = o.beta;
    options.distill.alpha = o.alpha;
    options.distill.temperature = o.temperature;
    BatchInputs in;
    in.hidden = hidden.data();
    in.hidden_dtype = o.dtype;
    in.num_tokens = s.n;
    in.hidden_size = s.h;
    in.labels = labels.data();
    in.teacher.weight = &teacher_view;
    in.teacher.hidden = teacher_hidden.data();
    in.teacher.hidden_dtype = o.dtype;
    in.teacher.hidden_size = s.ht;
    for (const std::string& pass : o.passes) {
      const bool backward = pass == "fwd_bwd";
      std::vector<float> kd(s.n);
      std::vector<float> grad_hidden(backward ? s.n * s.h : 0);
      TokenOutputs out;
      out.kd = kd.data();
      out.grad_hidden = backward ? grad_hidden.data() : nullptr;
      DeviceBuffer grad_weight;
      if (backward) {
        ASSIGN_OR_RETURN(grad_weight, backend->Allocate(s.v * s.h * sizeof(float)));
        RETURN_IF_ERROR(backend->Zero(grad_weight));
      }
      ASSIGN_OR_RETURN(DeviceBuffer workspace, backend->Allocate(o.budget_bytes));
      const auto once = [&]() -> absl::StatusOr<std::pair<double, BatchSummary>> {
        const auto start = std::chrono::steady_clock::now();
        ASSIGN_OR_RETURN(BatchSummary summary,
                         backend->Compute(in, student_view, options, out,
                                          backward ? &grad_weight : nullptr, workspace));
        const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
        return std::make_pair(seconds.count(), summary);
      };
      RETURN_IF_ERROR(once().status());  // warm-up
      std::vector<double> rounds;
      BatchSummary summary;
      for (int r = 0; r < o.reps; ++r) {
        ASSIGN_OR_RETURN(const auto timed, once());
        rounds.push_back(timed.first);
        summary = timed.second;
      }
      std::vector<double> sorted = rounds;
      std::sort(sorted.begin(), sorted.end());
      const double median = sorted[sorted.size() / 2];
      if (backward && !o.grad_hidden_out.empty()) {
        std::ofstream file(
            absl::StrCat(o.grad_hidden_out, "_", s.n, "_", s.h, "_", s.ht, "_", s.v, ".f32"),
            std::ios::binary);
        file.write(reinterpret_cast<const char*>(grad_hidden.data()),
                   static_cast<std::streamsize>(grad_hidden.size() * sizeof(float)));
      }
      nlohmann::json row = {{"method", "engine"},
                            {"n", s.n},
                            {"h", s.h},
                            {"ht", s.ht},
                            {"v", s.v},
                            {"dtype", o.dtype == DType::kBFloat16 ? "bf16" : "fp32"},
                            {"pass", pass},
                            {"beta", o.beta},
                            {"alpha", o.alpha},
                            {"temperature", o.temperature},
                            {"seconds", median},
                            {"rounds", rounds},
                            {"reps", o.reps},
                            {"loss", summary.loss},
                            {"all_finite", summary.all_finite},
                            {"chunk", {summary.token_chunk, summary.vocab_chunk}},
                            {"peak_extra_bytes", summary.workspace_bytes},
                            {"device", backend->Describe()},
                            {"threads", omp_get_max_threads()}};
      std::cout << row.dump() << std::endl;
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace lossd

int main(int argc, char** argv) {
  absl::StatusOr<lossd::Options> options = lossd::ParseFlags(argc, argv);
  if (!options.ok()) {
    std::cerr << options.status().message() << "\n";
    return 2;
  }
  const absl::Status status = lossd::Run(*options);
  if (!status.ok()) {
    std::cerr << status << "\n";
    return 1;
  }
  return 0;
}
