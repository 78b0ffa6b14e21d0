// Admission of Compute calls: refusals carry their reason as a typed payload (what the
// lossd_admission_rejected_total metric counts by), a budget that shrinks refuses waiting calls
// that no longer fit, and the pending-memory bound holds exactly.
#include "server/memory/scheduler.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "absl/time/clock.h"

namespace lossd::server {
namespace {

bool Never() { return false; }

TEST(AdmissionRefusalTest, TravelsAsAPayloadNotAsText) {
  // A message that speaks of a queue says nothing about the reason.
  const absl::Status over =
      WithAdmissionRefusal(absl::ResourceExhaustedError("the queue is not what refused this call"),
                           AdmissionRefusal::kOverBudget);
  EXPECT_EQ(AdmissionRefusalOf(over), AdmissionRefusal::kOverBudget);
  EXPECT_EQ(AdmissionRefusalOf(absl::ResourceExhaustedError("admission queue is full")),
            std::nullopt);
  EXPECT_EQ(AdmissionRefusalOf(absl::OkStatus()), std::nullopt);
  for (const auto& [refusal, name] :
       {std::pair{AdmissionRefusal::kQueueFull, "queue_full"},
        std::pair{AdmissionRefusal::kOverBudget, "over_budget"},
        std::pair{AdmissionRefusal::kPendingMemory, "pending_memory"}}) {
    EXPECT_EQ(AdmissionRefusalOf(WithAdmissionRefusal(absl::ResourceExhaustedError(""), refusal)),
              refusal);
    EXPECT_STREQ(AdmissionRefusalName(refusal), name);
  }
}

TEST(SchedulerTest, RefusalsCarryTheirReason) {
  Scheduler scheduler(/*capacity_bytes=*/100, /*max_running=*/1, /*max_queued=*/0);
  EXPECT_EQ(AdmissionRefusalOf(scheduler.Admit(101, Never, absl::Seconds(1)).status()),
            AdmissionRefusal::kOverBudget);
  absl::StatusOr<Admission> running = scheduler.Admit(10, Never, absl::Seconds(1));
  ASSERT_TRUE(running.ok()) << running.status();
  EXPECT_EQ(AdmissionRefusalOf(scheduler.Admit(10, Never, absl::Seconds(1)).status()),
            AdmissionRefusal::kQueueFull);
}

TEST(SchedulerTest, AWaitingCallThatNoLongerFitsAShrunkBudgetIsRefused) {
  Scheduler scheduler(/*capacity_bytes=*/100, /*max_running=*/1, /*max_queued=*/4);
  absl::StatusOr<Admission> running = scheduler.Admit(10, Never, absl::Seconds(1));
  ASSERT_TRUE(running.ok()) << running.status();
  absl::Status waited;
  std::thread waiter([&] { waited = scheduler.Admit(80, Never, absl::Seconds(30)).status(); });
  while (scheduler.queued() == 0) absl::SleepFor(absl::Milliseconds(1));
  scheduler.SetCapacity(50);
  waiter.join();
  // Refused for the budget, not at its 30 s limit (DEADLINE_EXCEEDED, no refusal).
  EXPECT_EQ(AdmissionRefusalOf(waited), AdmissionRefusal::kOverBudget) << waited;
  EXPECT_EQ(scheduler.queued(), 0);

  // Grown, it admits what it refused, once the running call is gone.
  scheduler.SetCapacity(200);
  EXPECT_EQ(scheduler.capacity_bytes(), 200);
  running->Release();
  EXPECT_TRUE(scheduler.Admit(150, Never, absl::Seconds(1)).ok());
}

TEST(PendingChargeTest, ChargesStayWithinTheBound) {
  PendingMemory pending(/*capacity_bytes=*/100, /*per_connection_bytes=*/100);
  absl::StatusOr<PendingCharge> a = pending.Reserve("a", 60);
  ASSERT_TRUE(a.ok()) << a.status();
  const absl::StatusOr<PendingCharge> refused = pending.Reserve("b", 50);
  EXPECT_EQ(AdmissionRefusalOf(refused.status()), AdmissionRefusal::kPendingMemory);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(refused.status().message());
  EXPECT_NE(message.find("--pending_memory_mib"), std::string::npos) << message;
  EXPECT_NE(message.find("100 bytes"), std::string::npos) << message;
  EXPECT_EQ(pending.held_bytes(), 60);

  ASSERT_TRUE(a->Resize(20).ok());
  absl::StatusOr<PendingCharge> b = pending.Reserve("b", 80);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(pending.held_bytes(), 100);
  // Growing past the bound fails and leaves the charge as it was.
  EXPECT_EQ(AdmissionRefusalOf(a->Resize(21)), AdmissionRefusal::kPendingMemory);
  EXPECT_EQ(a->bytes(), 20);
  EXPECT_EQ(pending.held_bytes(), 100);

  a->Release();
  EXPECT_EQ(pending.held_bytes(), 80);
  PendingCharge moved = *std::move(b);
  EXPECT_EQ(pending.held_bytes(), 80);
  moved.Release();
  EXPECT_EQ(pending.held_bytes(), 0);
}

// One connection's calls stop at its share; another connection still gets what is left.
TEST(PendingChargeTest, OneConnectionCannotTakeItAll) {
  PendingMemory pending(/*capacity_bytes=*/100, /*per_connection_bytes=*/50);
  absl::StatusOr<PendingCharge> first = pending.Reserve("ipv4:10.0.0.1:1000", 30);
  ASSERT_TRUE(first.ok()) << first.status();
  const absl::StatusOr<PendingCharge> refused = pending.Reserve("ipv4:10.0.0.1:1000", 21);
  EXPECT_EQ(AdmissionRefusalOf(refused.status()), AdmissionRefusal::kPendingMemory);
  const std::string message(refused.status().message());
  EXPECT_NE(message.find("--pending_memory_per_connection_mib"), std::string::npos) << message;
  EXPECT_NE(message.find("50 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("hold 30 bytes now"), std::string::npos) << message;
  // Growing one of its charges past the share fails too, and changes nothing.
  EXPECT_EQ(AdmissionRefusalOf(first->Resize(51)), AdmissionRefusal::kPendingMemory);
  EXPECT_EQ(pending.held_bytes("ipv4:10.0.0.1:1000"), 30);

  absl::StatusOr<PendingCharge> other = pending.Reserve("ipv4:10.0.0.1:1001", 50);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(pending.held_bytes(), 80);
  // The server-wide bound still holds whoever asks: 80 + 30 > 100.
  const absl::StatusOr<PendingCharge> over = pending.Reserve("ipv4:10.0.0.2:1000", 30);
  EXPECT_NE(std::string(over.status().message()).find("--pending_memory_mib"), std::string::npos)
      << over.status();

  // Released, a connection's share is whole again.
  first->Release();
  EXPECT_EQ(pending.held_bytes("ipv4:10.0.0.1:1000"), 0);
  EXPECT_TRUE(pending.Reserve("ipv4:10.0.0.1:1000", 50).ok());
}

}  // namespace
}  // namespace lossd::server
