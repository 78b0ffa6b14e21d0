// CreateBackend: the CPU backend is linked in; the CUDA backend is a module opened at run time.
#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_module.h"
#include "lossd/kernels/backend.h"

namespace lossd {
namespace {

constexpr char kCudaModuleName[] = "liblossd_cuda.so";

// The module that created a backend, for CudaModuleSymbol.
std::atomic<void*> opened_cuda_module{nullptr};

std::string ExecutableDirectory() {
  std::string path(4096, '\0');
  const ssize_t length = readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (length <= 0) return ".";
  path.resize(static_cast<size_t>(length));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// Where the module is looked for, first match wins: the caller's path, $LOSSD_CUDA_MODULE, beside
// the executable, then the dynamic loader's search path.
std::vector<std::string> CudaModuleCandidates(absl::string_view explicit_path) {
  if (!explicit_path.empty()) return {std::string(explicit_path)};
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("LOSSD_CUDA_MODULE"); env != nullptr && *env != '\0') {
    candidates.emplace_back(env);
  }
  candidates.push_back(absl::StrCat(ExecutableDirectory(), "/", kCudaModuleName));
  candidates.emplace_back(kCudaModuleName);
  return candidates;
}

absl::StatusOr<std::unique_ptr<Backend>> LoadCudaBackend(int ordinal,
                                                         absl::string_view module_path) {
  std::vector<std::string> failures;
  for (const std::string& path : CudaModuleCandidates(module_path)) {
    // The handle stays open for the life of the process: backends created from it may outlive
    // any scope that could close it.
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      failures.push_back(dlerror());
      continue;
    }
    auto abi = reinterpret_cast<int (*)()>(dlsym(handle, "lossd_cuda_module_abi"));
    auto create = reinterpret_cast<Backend* (*)(int, char*, size_t)>(
        dlsym(handle, "lossd_cuda_create_backend"));
    if (abi == nullptr || create == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(path, ": not a lossd CUDA module"));
    }
    if (abi() != LOSSD_CUDA_MODULE_ABI) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": module ABI ", abi(), ", expected ", LOSSD_CUDA_MODULE_ABI));
    }
    char error[512] = {0};
    Backend* backend = create(ordinal, error, sizeof error);
    if (backend == nullptr) {
      return absl::UnavailableError(absl::StrCat("cuda:", ordinal, ": ", error));
    }
    opened_cuda_module.store(handle);
    return std::unique_ptr<Backend>(backend);
  }
  return absl::UnavailableError(
      absl::StrCat("CUDA backend module not found (", absl::StrJoin(failures, "; "), ")"));
}

}  // namespace

void* CudaModuleSymbol(const char* name) {
  void* module = opened_cuda_module.load();
  return module != nullptr ? dlsym(module, name) : nullptr;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view device,
                                                       absl::string_view cuda_module_path,
                                                       std::string* cuda_unavailable) {
  if (device == "cpu") return CreateCpuBackend();
  if (device == "auto") {
    auto cuda = LoadCudaBackend(0, cuda_module_path);
    if (cuda.ok()) return cuda;
    if (cuda_unavailable != nullptr) *cuda_unavailable = std::string(cuda.status().message());
    return CreateCpuBackend();
  }
  if (device == "cuda") return LoadCudaBackend(0, cuda_module_path);
  int ordinal = 0;
  if (absl::StartsWith(device, "cuda:") && absl::SimpleAtoi(device.substr(5), &ordinal) &&
      ordinal >= 0) {
    return LoadCudaBackend(ordinal, cuda_module_path);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device: expected auto, cpu, cuda or cuda:N, got \"", device, "\""));
}

}  // namespace lossd
