// Lock-free bounded multi-producer ring of timing events, plus per-step aggregates per kind.
//
// Pure C++17, no Python or torch: the pybind11 bindings live in timing_bindings.cpp, and an
// engine written in C++ can include this header and record into the same ring.
//
// Ring: a bounded MPMC queue with one sequence number per slot (the design D. Vyukov
// published as "bounded MPMC queue"). Slot i starts with seq = i. Positions are 64-bit and
// never wrap in practice.
//   producer at position p owns slot p & mask when slot.seq == p; it claims p by CAS on
//     enqueue_pos_, writes the event, then publishes it with seq.store(p + 1, release).
//   consumer at position p may read slot p & mask when slot.seq == p + 1 (acquire load, which
//     pairs with the producer's release store, so the event bytes are visible); it claims p by
//     CAS on dequeue_pos_, copies the event, then frees the slot for the next lap with
//     seq.store(p + capacity, release) (pairs with the next producer's acquire load).
//   slot.seq < p for a producer means the slot still holds last lap's event: the ring is full.
// Position counters themselves are only CAS'd with relaxed order: they hand out indices, all
// data hand-over goes through the per-slot seq. record() never blocks or waits for another
// thread; a thread stalled between claim and publish only delays consumers at that slot.
//
// Kinds: every event says what it timed (a push_pull of a collective engine, or the push or the
// pull of a parameter-server engine), and the step aggregates are kept per kind, so a consumer
// reads a worker's push time and pull time apart without parsing names.
//
// Step aggregates: two banks of atomic accumulators and an epoch counter. record() adds to
// bank[epoch & 1] while holding that bank's `writers` count; end_step() bumps the epoch, waits
// until the old bank's writers drain to zero, then reads and resets it. The writer's
// (writers++ ; load epoch) and end_step's (store epoch ; load writers) are all seq_cst, the
// Dekker pattern: either the writer sees the new epoch and retries on the new bank, or
// end_step sees its writers count and waits for it. So each event lands wholly in exactly one
// step, and record() stays lock-free (it retries only when an end_step intervenes).
#pragma once

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace dynamix {

// CLOCK_MONOTONIC in nanoseconds: the clock of Python's time.monotonic_ns() on Linux.
inline int64_t monotonic_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// What an event timed. Values are stable: they are what drain() returns in its "kind" column.
enum TimingKind : uint32_t {
  kPushPull = 0,  // a whole collective (all-reduce, broadcast, ...) of a collective engine
  kPush = 1,      // a parameter-server push: issue until the server acknowledged it
  kPull = 2,      // a parameter-server pull: the sum's transfer, the server's wait for others excluded
};
constexpr uint32_t kNumKinds = 3;
constexpr const char* kKindNames[kNumKinds] = {"push_pull", "push", "pull"};

struct TimingEvent {
  uint32_t name_id;  // interned tensor/operation name
  uint32_t kind;     // TimingKind, < kNumKinds; occupies what was padding, the event stays 32 bytes
  uint64_t nbytes;   // payload size, bytes
  int64_t start_ns;  // CLOCK_MONOTONIC, ns
  int64_t end_ns;    // CLOCK_MONOTONIC, ns, >= start_ns
};
static_assert(sizeof(TimingEvent) == 32, "a timing event is 32 bytes");

struct KindStats {
  uint64_t count = 0;   // events recorded in the step (dropped ones included)
  uint64_t bytes = 0;   // sum of nbytes
  int64_t busy_ns = 0;  // sum of (end_ns - start_ns)
  int64_t span_ns = 0;  // max end_ns - min start_ns, 0 when count == 0
};

struct StepStats {
  KindStats total;                // every kind together (span over all of them)
  KindStats by_kind[kNumKinds];   // index = TimingKind
};

class TimingRing {
 public:
  static constexpr size_t kMaxCapacity = size_t{1} << 30;

  // Rounds `requested` up to a power of two, at least 2 (the per-slot sequence scheme needs
  // two slots to tell "full" from "free"). Throws std::invalid_argument outside [1, kMaxCapacity].
  explicit TimingRing(size_t requested) {
    if (requested < 1 || requested > kMaxCapacity) {
      throw std::invalid_argument("TimingRing capacity must be between 1 and 2**30 events");
    }
    size_t cap = 2;
    while (cap < requested) cap <<= 1;
    mask_ = cap - 1;
    cells_.reset(new Cell[cap]);
    for (size_t i = 0; i < cap; ++i) cells_[i].seq.store(i, std::memory_order_relaxed);
    for (Bank& b : banks_) reset_bank(b);
  }

  TimingRing(const TimingRing&) = delete;
  TimingRing& operator=(const TimingRing&) = delete;

  size_t capacity() const noexcept { return mask_ + 1; }

  // Adds the event to the current step's aggregates and appends it to the ring. Returns false
  // (and counts it in dropped()) when the ring is full. Preconditions: end_ns >= start_ns,
  // kind < kNumKinds.
  bool record(const TimingEvent& ev) noexcept {
    accumulate(ev);
    uint64_t pos = enqueue_pos_.load(std::memory_order_relaxed);
    Cell* cell;
    for (;;) {
      cell = &cells_[pos & mask_];
      const uint64_t seq = cell->seq.load(std::memory_order_acquire);
      const int64_t dif = static_cast<int64_t>(seq - pos);
      if (dif == 0) {
        if (enqueue_pos_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) break;
      } else if (dif < 0) {
        dropped_.fetch_add(1, std::memory_order_relaxed);
        return false;
      } else {
        pos = enqueue_pos_.load(std::memory_order_relaxed);
      }
    }
    cell->ev = ev;
    cell->seq.store(pos + 1, std::memory_order_release);
    return true;
  }

  // Removes the oldest published event into `out`; false when none is ready. Safe to call from
  // several threads, though one consumer is the intended use.
  bool pop(TimingEvent& out) noexcept {
    uint64_t pos = dequeue_pos_.load(std::memory_order_relaxed);
    Cell* cell;
    for (;;) {
      cell = &cells_[pos & mask_];
      const uint64_t seq = cell->seq.load(std::memory_order_acquire);
      const int64_t dif = static_cast<int64_t>(seq - (pos + 1));
      if (dif == 0) {
        if (dequeue_pos_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) break;
      } else if (dif < 0) {
        return false;
      } else {
        pos = dequeue_pos_.load(std::memory_order_relaxed);
      }
    }
    out = cell->ev;
    cell->seq.store(pos + mask_ + 1, std::memory_order_release);
    return true;
  }

  // Events claimed by producers and not yet consumed (a snapshot under concurrency).
  size_t size() const noexcept {
    const uint64_t deq = dequeue_pos_.load(std::memory_order_acquire);
    const uint64_t enq = enqueue_pos_.load(std::memory_order_acquire);
    const int64_t n = static_cast<int64_t>(enq - deq);
    if (n <= 0) return 0;
    return static_cast<size_t>(n) > capacity() ? capacity() : static_cast<size_t>(n);
  }

  uint64_t dropped() const noexcept { return dropped_.load(std::memory_order_relaxed); }

  // Returns the aggregates of the events recorded since the previous end_step() and starts a
  // new step. Independent of pop(). Serialised with other end_step() calls by a mutex.
  StepStats end_step() {
    std::lock_guard<std::mutex> lock(step_mutex_);
    const uint64_t e = epoch_.load(std::memory_order_relaxed);
    epoch_.store(e + 1, std::memory_order_seq_cst);
    Bank& b = banks_[e & 1];
    for (unsigned spins = 0; b.writers.load(std::memory_order_seq_cst) != 0; ++spins) {
      if (spins > 64) std::this_thread::yield();
    }
    StepStats s;
    int64_t first = std::numeric_limits<int64_t>::max(), last = std::numeric_limits<int64_t>::min();
    for (uint32_t k = 0; k < kNumKinds; ++k) {
      const Acc& a = b.kinds[k];
      KindStats& out = s.by_kind[k];
      out.count = a.count.load(std::memory_order_relaxed);
      out.bytes = a.bytes.load(std::memory_order_relaxed);
      out.busy_ns = a.busy_ns.load(std::memory_order_relaxed);
      if (out.count > 0) {
        const int64_t f = a.first_start.load(std::memory_order_relaxed);
        const int64_t l = a.last_end.load(std::memory_order_relaxed);
        out.span_ns = l - f;
        first = std::min(first, f);
        last = std::max(last, l);
      }
      s.total.count += out.count;
      s.total.bytes += out.bytes;
      s.total.busy_ns += out.busy_ns;
    }
    if (s.total.count > 0) s.total.span_ns = last - first;
    reset_bank(b);  // published to the next writers of this bank by the next epoch store
    return s;
  }

 private:
  struct Cell {
    std::atomic<uint64_t> seq;
    TimingEvent ev;
  };

  struct Acc {  // one kind's accumulators in one bank
    std::atomic<uint64_t> count{0};
    std::atomic<uint64_t> bytes{0};
    std::atomic<int64_t> busy_ns{0};
    std::atomic<int64_t> first_start{0};
    std::atomic<int64_t> last_end{0};
  };

  struct alignas(64) Bank {
    std::atomic<uint64_t> writers{0};
    Acc kinds[kNumKinds];
  };

  static void reset_bank(Bank& b) noexcept {
    for (Acc& a : b.kinds) {
      a.count.store(0, std::memory_order_relaxed);
      a.bytes.store(0, std::memory_order_relaxed);
      a.busy_ns.store(0, std::memory_order_relaxed);
      a.first_start.store(std::numeric_limits<int64_t>::max(), std::memory_order_relaxed);
      a.last_end.store(std::numeric_limits<int64_t>::min(), std::memory_order_relaxed);
    }
  }

  void accumulate(const TimingEvent& ev) noexcept {
    for (;;) {
      const uint64_t e = epoch_.load(std::memory_order_seq_cst);
      Bank& b = banks_[e & 1];
      b.writers.fetch_add(1, std::memory_order_seq_cst);
      if (epoch_.load(std::memory_order_seq_cst) != e) {  // an end_step() flipped the bank
        b.writers.fetch_sub(1, std::memory_order_release);
        continue;
      }
      Acc& a = b.kinds[ev.kind];
      a.count.fetch_add(1, std::memory_order_relaxed);
      a.bytes.fetch_add(ev.nbytes, std::memory_order_relaxed);
      a.busy_ns.fetch_add(ev.end_ns - ev.start_ns, std::memory_order_relaxed);
      int64_t cur = a.first_start.load(std::memory_order_relaxed);
      while (ev.start_ns < cur &&
             !a.first_start.compare_exchange_weak(cur, ev.start_ns, std::memory_order_relaxed)) {
      }
      cur = a.last_end.load(std::memory_order_relaxed);
      while (ev.end_ns > cur && !a.last_end.compare_exchange_weak(cur, ev.end_ns, std::memory_order_relaxed)) {
      }
      // release: end_step's seq_cst load that sees writers == 0 sees the updates above.
      b.writers.fetch_sub(1, std::memory_order_release);
      return;
    }
  }

  size_t mask_ = 0;
  std::unique_ptr<Cell[]> cells_;
  alignas(64) std::atomic<uint64_t> enqueue_pos_{0};
  std::atomic<uint64_t> dropped_{0};
  alignas(64) std::atomic<uint64_t> dequeue_pos_{0};
  alignas(64) std::atomic<uint64_t> epoch_{0};
  Bank banks_[2];
  std::mutex step_mutex_;
};

}  // namespace dynamix
