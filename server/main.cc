// lossd_server: serves lm_head heads over gRPC and exports metrics for Prometheus.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "lossd/common/version.h"
#include "server/server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "gRPC address, HOST:PORT (port 0: any free port); a port in use is refused");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "HTTP address of the Prometheus /metrics endpoint; empty turns it off");
ABSL_FLAG(std::string, device, "auto", "compute device: auto, cpu, cuda or cuda:N");
ABSL_FLAG(int64_t, workspace_budget_mib, 0,
          "per-call workspace budget in MiB; the engine's chunking keeps every call under it (0: "
          "the device's default, on the CPU 1/16 of the host's memory within [256, 1024] MiB, on "
          "a GPU 256)");
ABSL_FLAG(int64_t, compute_memory_mib, 0,
          "device memory admitted calls may hold together, in MiB (0: room for --max_running_calls "
          "training calls on the largest head)");
ABSL_FLAG(int, max_running_calls, 2, "Compute calls running on the device at once");
ABSL_FLAG(bool, cache_call_buffers, true,
          "keep calls' workspaces and staging dL/dW (within --compute_memory_mib), and their host "
          "rows and dL/dh sent in messages (within --host_cache_mib), for the next call instead of "
          "freeing them");
ABSL_FLAG(int64_t, host_cache_mib, 1024,
          "bound, in MiB, on the host buffers of calls whose rows and dL/dh travel in messages: "
          "idle ones are kept for the next call only while those in use and idle fit it");
ABSL_FLAG(bool, shared_memory, true,
          "let clients on this host hand rows and dL/dh over in a memfd instead of messages");
ABSL_FLAG(std::string, compute_socket_listen, "",
          "HOST:PORT where Compute calls are also taken over plain TCP connections of their own, "
          "around gRPC's HTTP/2 transport, which moves rows at about a third of the connection's "
          "speed (port 0: any free one; empty: none); clients that reach the server over an "
          "insecure channel use it. Not with TLS: it carries rows and the token in the clear");
ABSL_FLAG(double, compute_socket_idle_seconds, 300,
          "how long a Compute socket connection may wait for its client's next call before the "
          "server closes it");
ABSL_FLAG(int, compute_socket_max_connections, 256,
          "connections the Compute socket holds at once (each a thread); more are refused and "
          "their clients' calls go over gRPC");
ABSL_FLAG(int, compute_socket_max_connections_per_host, 64,
          "of those, connections from one host (one address: a NAT counts as one), so that no one "
          "host locks the others out");
ABSL_FLAG(double, compute_socket_max_flow_mb_per_second, 0,
          "MB (10^6 bytes) per second each Compute socket connection sends at most, paced by the "
          "kernel (SO_MAX_PACING_RATE); 0: no limit. Shares a link among clients, or stands in "
          "for a network whose flows are capped one by one (clients then spread a call over "
          "lanes: compute_socket_lanes)");
ABSL_FLAG(int64_t, max_call_ids, 65536,
          "calls with a call_id whose ids each head keeps per accumulator epoch (until its "
          "gradient is zeroed), so that a retried call is never accumulated twice; a new id past "
          "them is refused");
ABSL_FLAG(double, staged_grad_seconds, 300,
          "how long a Compute call's staged dL/dW (stage_grad_weight) waits for its commit before "
          "it is dropped");
ABSL_FLAG(int64_t, staged_grad_mib, 0,
          "device memory, in MiB, that staged dL/dW may hold together; a call past it commits at "
          "once instead (0: room for 8 of the largest head's gradients)");
ABSL_FLAG(double, step_wait_seconds, 300,
          "how long the ranks of a collective Step (or gradient norm) wait for the last of them; "
          "then the step fails on every rank and nothing is applied");
ABSL_FLAG(int, max_queued_calls, 64,
          "Compute calls waiting for admission before new ones are refused");
ABSL_FLAG(int64_t, pending_memory_mib, 2048,
          "host memory, in MiB, that Compute calls not yet admitted may hold together (start "
          "messages, per-token values, rows read ahead); calls beyond it are refused with "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, pending_memory_per_connection_mib, 0,
          "of --pending_memory_mib, what the calls of one client connection may hold together, "
          "so that no one client can take it all (0: half of --pending_memory_mib)");
ABSL_FLAG(double, stream_idle_seconds, 60,
          "a Compute call whose client sends no start message or complete chunk of rows (nor "
          "reads its results) for this long is ended with DEADLINE_EXCEEDED");
ABSL_FLAG(int64_t, max_message_mib, 256, "largest gRPC message accepted or sent, in MiB");
ABSL_FLAG(int64_t, max_connection_age_seconds, 0,
          "close each client connection after about this many seconds (calls in flight finish), "
          "so that clients balancing over replicas reach replicas added since; 0: never");
ABSL_FLAG(std::string, token_file, "",
          "file whose first line (trimmed) is the bearer token every call must carry");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain, the server's first; with --tls_key_file turns TLS on");
ABSL_FLAG(std::string, tls_key_file, "",
          "unencrypted PEM private key of --tls_cert_file, checked against it at startup");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "directory to resume heads from and save checkpoints to");
ABSL_FLAG(int, keep_checkpoints, 3, "checkpoints kept per head");
ABSL_FLAG(std::vector<std::string>, heads, {},
          "comma-separated NAME=PATH[#TENSOR] heads from Hugging Face checkpoints: PATH a model "
          "directory, a model.safetensors.index.json or a safetensors file; with config.json "
          "beside it, lm_head.weight for untied models, the input embedding for tied ones");
ABSL_FLAG(std::string, head_dtype, "float32",
          "storage dtype of heads: float32, bfloat16 or float16");
ABSL_FLAG(int64_t, demo_vocab_size, 32000,
          "vocabulary of the demo head served when no head is given");
ABSL_FLAG(int64_t, demo_hidden_size, 512, "hidden size of the demo head");
ABSL_FLAG(uint64_t, demo_seed, 0, "seed of the demo head's random init");
ABSL_FLAG(int, replicas, 1,
          "servers that train their heads together as one (a replica group): every Step and "
          "GradWeightNorm all-reduces the gradient across them; 1: this server alone");
ABSL_FLAG(int, replica_rank, 0,
          "this server's rank in its replica group, 0 to --replicas - 1; -1: the ordinal that "
          "ends the hostname (a StatefulSet pod NAME-N)");
ABSL_FLAG(std::string, replica_store, "",
          "HOST:PORT of replica 0's gRPC address, where the replicas meet (every replica, "
          "replica 0 too)");
ABSL_FLAG(double, replica_join_seconds, 600,
          "how long a replica waits at startup for the whole group to meet");
ABSL_FLAG(double, replica_timeout_seconds, 60,
          "how long a collective operation (the all-reduce of a gradient) may take once every "
          "replica has reached it; past it the group ends");
ABSL_FLAG(int, drain_seconds, 30,
          "on SIGTERM, how long in-flight calls may run before they are cancelled");

// The exit status after a device fault (1: the server could not start, 2: a bad flag).
constexpr int kExitDeviceFault = 3;
// The exit status of a replica whose group ended: its supervisor restarts it, and the group
// forms again from the last checkpoint.
constexpr int kExitReplicaGroupEnded = 4;

int main(int argc, char** argv) {
  // Abseil prints this after "lossd_server: ".
  absl::SetProgramUsageMessage(
      "linear cross-entropy as a service.\n"
      "  lossd_server --heads=main=/models/Llama-3.1-8B --device=cuda");
  // Abseil lists under --help only flags defined in a file named after the program; ours live here.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) { return file == "lossd_server"; };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.version_string = [] { return std::string("lossd_server ") + lossd::kVersion + "\n"; };
  // The help names the program, not the file its flags are defined in.
  usage.normalize_filename = [](absl::string_view file) {
    return absl::EndsWith(file, "main.cc") ? std::string("lossd_server") : std::string(file);
  };
  absl::SetFlagsUsageConfig(usage);
  // Abseil's own parse ends --help with status 1, as it ends a bad flag: help that was asked for
  // is printed on stdout and ends with 0.
  absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  if (absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) >= 0) {
    return 0;
  }

  // Block the stop signals before any thread starts, so that only sigwait below receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  lossd::server::ServerConfig config;
  config.listen_address = absl::GetFlag(FLAGS_listen);
  config.metrics_address = absl::GetFlag(FLAGS_metrics_listen);
  config.device = absl::GetFlag(FLAGS_device);
  config.workspace_budget_bytes = absl::GetFlag(FLAGS_workspace_budget_mib) << 20;
  config.compute_memory_bytes = absl::GetFlag(FLAGS_compute_memory_mib) << 20;
  config.max_running_calls = absl::GetFlag(FLAGS_max_running_calls);
  config.cache_call_buffers = absl::GetFlag(FLAGS_cache_call_buffers);
  config.host_cache_bytes = absl::GetFlag(FLAGS_host_cache_mib) << 20;
  config.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  config.compute_socket_listen = absl::GetFlag(FLAGS_compute_socket_listen);
  config.compute_socket_idle = absl::Seconds(absl::GetFlag(FLAGS_compute_socket_idle_seconds));
  config.compute_socket_max_connections = absl::GetFlag(FLAGS_compute_socket_max_connections);
  config.compute_socket_max_connections_per_host =
      absl::GetFlag(FLAGS_compute_socket_max_connections_per_host);
  config.compute_socket_max_flow_bytes_per_second =
      static_cast<int64_t>(absl::GetFlag(FLAGS_compute_socket_max_flow_mb_per_second) * 1e6);
  config.max_call_ids = absl::GetFlag(FLAGS_max_call_ids);
  config.staged_grad_ttl = absl::Seconds(absl::GetFlag(FLAGS_staged_grad_seconds));
  config.staged_grad_bytes = absl::GetFlag(FLAGS_staged_grad_mib) << 20;
  config.step_wait = absl::Seconds(absl::GetFlag(FLAGS_step_wait_seconds));
  config.max_queued_calls = absl::GetFlag(FLAGS_max_queued_calls);
  config.pending_memory_bytes = absl::GetFlag(FLAGS_pending_memory_mib) << 20;
  config.pending_memory_per_connection_bytes =
      absl::GetFlag(FLAGS_pending_memory_per_connection_mib) << 20;
  config.stream_idle = absl::Seconds(absl::GetFlag(FLAGS_stream_idle_seconds));
  config.max_message_bytes = absl::GetFlag(FLAGS_max_message_mib) << 20;
  config.max_connection_age = absl::Seconds(absl::GetFlag(FLAGS_max_connection_age_seconds));
  config.token_file = absl::GetFlag(FLAGS_token_file);
  config.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  config.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  config.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  config.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  config.heads = absl::GetFlag(FLAGS_heads);
  config.demo.vocab_size = absl::GetFlag(FLAGS_demo_vocab_size);
  config.demo.hidden_size = absl::GetFlag(FLAGS_demo_hidden_size);
  config.demo.seed = absl::GetFlag(FLAGS_demo_seed);
  config.replicas = absl::GetFlag(FLAGS_replicas);
  config.replica_rank = absl::GetFlag(FLAGS_replica_rank);
  config.replica_store = absl::GetFlag(FLAGS_replica_store);
  config.replica_join = absl::Seconds(absl::GetFlag(FLAGS_replica_join_seconds));
  config.replica_timeout = absl::Seconds(absl::GetFlag(FLAGS_replica_timeout_seconds));
  auto dtype = lossd::server::ParseDType(absl::GetFlag(FLAGS_head_dtype));
  if (!dtype.ok()) {
    std::fprintf(stderr, "lossd_server: --head_%s\n",
                 std::string(dtype.status().message()).c_str());
    return 2;
  }
  config.head_dtype = *dtype;
  if (absl::GetFlag(FLAGS_drain_seconds) < 0) {
    std::fprintf(stderr, "lossd_server: --drain_seconds: expected seconds >= 0, got %d\n",
                 absl::GetFlag(FLAGS_drain_seconds));
    return 2;
  }

  // Loading heads can take minutes (or wait on a slow disk): a stop signal meanwhile ends the
  // process at once, as it would one that serves nothing yet. Started after the signals are
  // blocked, so that this thread takes them until serving begins.
  std::atomic<bool> started{false};
  std::thread startup_watch([&] {
    constexpr timespec kPoll = {0, 50'000'000};
    while (!started.load()) {
      const int received = sigtimedwait(&stop_signals, nullptr, &kPoll);
      if (received > 0) {
        std::fprintf(stderr, "lossd_server: signal %d while starting; exiting\n", received);
        std::_Exit(128 + received);
      }
    }
  });
  auto server = lossd::server::LossServer::Start(config);
  started.store(true);
  startup_watch.join();
  if (!server.ok()) {
    std::fprintf(stderr, "lossd_server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  for (const std::string& line : (*server)->startup_log()) {
    std::fprintf(stderr, "lossd_server: %s\n", line.c_str());
  }
  std::fprintf(stderr, "lossd_server: serving gRPC on %s (port %d)\n",
               config.listen_address.c_str(), (*server)->port());
  if ((*server)->metrics_port() != 0) {
    std::fprintf(stderr, "lossd_server: metrics on http://%s/metrics (port %d)\n",
                 config.metrics_address.c_str(), (*server)->metrics_port());
  }

  // Until a stop signal, a device fault, which no call in this process can get past, or the end
  // of the replica group.
  absl::Status fault;
  int fault_status = 0;
  constexpr timespec kFaultPoll = {0, 100'000'000};
  while (true) {
    if (!(fault = (*server)->device_fault()).ok()) {
      fault_status = kExitDeviceFault;
      break;
    }
    if (!(fault = (*server)->replica_failure()).ok()) {
      fault_status = kExitReplicaGroupEnded;
      break;
    }
    const int received = sigtimedwait(&stop_signals, nullptr, &kFaultPoll);
    if (received > 0) {
      std::fprintf(stderr, "lossd_server: signal %d, draining in-flight calls (up to %d s)\n",
                   received, absl::GetFlag(FLAGS_drain_seconds));
      break;
    }
  }
  if (!fault.ok()) {
    std::string heads;
    for (const auto& head : (*server)->heads().List()) {
      absl::StrAppend(&heads, heads.empty() ? "" : ", ", "'", head->name(), "' at version ",
                      head->version());
    }
    std::fprintf(stderr,
                 "lossd_server: %s; health is NOT_SERVING, draining in-flight calls (up to %d s), "
                 "then exiting with status %d to be restarted (heads: %s)\n",
                 std::string(fault.message()).c_str(), absl::GetFlag(FLAGS_drain_seconds),
                 fault_status, heads.c_str());
  }
  (*server)->Shutdown(absl::Seconds(absl::GetFlag(FLAGS_drain_seconds)));
  std::fprintf(stderr, "lossd_server: stopped\n");
  return fault_status;
}
