#include "server/replicas/gloo_collective.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <utility>

#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include "absl/strings/str_cat.h"

namespace lossd::server {
namespace {

std::chrono::milliseconds Milliseconds(absl::Duration d) {
  return std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// Gloo's element-wise reductions, picked out of their overloads.
using ReduceFunction = void (*)(void*, const void*, const void*, size_t);

}  // namespace

absl::StatusOr<std::unique_ptr<GlooCollective>> GlooCollective::Connect(
    gloo::rendezvous::Store& store, int rank, int size, const std::string& local_host,
    absl::Duration timeout) {
  std::unique_ptr<GlooCollective> collective(new GlooCollective(rank, size));
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = local_host;
    collective->device_ = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(Milliseconds(timeout));
    context->connectFullMesh(store, collective->device_);
    collective->context_ = std::move(context);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("replica ", rank, " of ", size,
                                               ": connecting to the other replicas (Gloo, TCP "
                                               "on ",
                                               local_host, ") failed: ", e.what()));
  }
  return collective;
}

GlooCollective::~GlooCollective() {
  // The context's pairs refer to the device: they go first.
  context_.reset();
  device_.reset();
}

absl::Status GlooCollective::broken() const {
  absl::MutexLock lock(&mu_);
  return broken_;
}

template <typename Op>
absl::Status GlooCollective::Run(absl::string_view what, Op&& op) {
  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) return broken_;
  const uint32_t tag = next_tag_++;
  std::string failure;
  try {
    return std::forward<Op>(op)(tag);
  } catch (const gloo::IoException& e) {
    failure = e.what();
  } catch (const std::exception& e) {
    failure = e.what();
  } catch (...) {
    failure = "an unknown exception";
  }
  broken_ = absl::UnavailableError(absl::StrCat("replica group: ", what, " (operation ", tag,
                                                ") failed on replica ", rank_, " of ", size_, ": ",
                                                failure));
  return broken_;
}

template <typename T>
absl::Status GlooCollective::AllReduce(absl::string_view what, absl::Span<T> values,
                                       ReduceFunction reduce, absl::Duration timeout) {
  if (values.empty()) return absl::OkStatus();
  return Run(what, [&](uint32_t tag) {
    gloo::AllreduceOptions options(context_);
    options.setOutput(values.data(), values.size());
    options.setReduceFunction(reduce);
    options.setTag(tag);
    options.setTimeout(Milliseconds(timeout));
    gloo::allreduce(options);
    return absl::OkStatus();
  });
}

absl::Status GlooCollective::AllReduceSum(absl::Span<float> values, absl::Duration timeout) {
  return AllReduce("all-reduce (sum) of float32", values, &gloo::sum<float>, timeout);
}

absl::Status GlooCollective::AllReduceSum(absl::Span<double> values, absl::Duration timeout) {
  return AllReduce("all-reduce (sum) of float64", values, &gloo::sum<double>, timeout);
}

absl::Status GlooCollective::AllReduceMax(absl::Span<double> values, absl::Duration timeout) {
  return AllReduce("all-reduce (max) of float64", values, &gloo::max<double>, timeout);
}

absl::Status GlooCollective::Broadcast(absl::Span<uint8_t> bytes, int root,
                                       absl::Duration timeout) {
  return Run("broadcast", [&](uint32_t tag) {
    gloo::BroadcastOptions options(context_);
    options.setOutput(bytes.data(), bytes.size());
    options.setRoot(root);
    options.setTag(tag);
    options.setTimeout(Milliseconds(timeout));
    gloo::broadcast(options);
    return absl::OkStatus();
  });
}

absl::Status GlooCollective::Barrier(absl::Duration timeout) {
  return Run("barrier", [&](uint32_t tag) {
    gloo::BarrierOptions options(context_);
    options.setTag(tag);
    options.setTimeout(Milliseconds(timeout));
    gloo::barrier(options);
    return absl::OkStatus();
  });
}

}  // namespace lossd::server
