// Shared-memory seqlock mailbox between one worker process and its node agent.
//
// Pure C++17 + POSIX, no Python or torch: the pybind11 bindings live in mailbox_bindings.cpp.
//
// One POSIX shared-memory segment (shm_open, /dev/shm/<name> on Linux) holds a header and one
// one-record slot with a single writer:
//   metrics    writer: worker (the creator), reader: agent  -- step + up to 32 float64 values
// The writer overwrites the slot's record; a reader gets the newest complete record (or nothing):
// it is a "latest value" register, not a queue. (Assignments reach the worker by gRPC and
// broadcast, not through the mailbox: layout 1 had an agent -> worker slot that nothing used.)
//
// Layout (kLayoutVersion 2, little-endian, every field naturally aligned, see Segment below):
//   offset    0  SegmentHeader   64 bytes. Its first 32 bytes (magic, layout_version,
//                                 segment_bytes, owner_pid, owner_start_ticks) keep their
//                                 offsets in every layout version, so any build can tell a
//                                 mailbox of another version and find its owner.
//   offset   64  MetricsSlot     seq, version, step, count, values[32]
//
// Seqlock protocol and memory ordering (H. Boehm, "Can seqlocks get along with
// programming language memory models?", MSPC 2012, the fence variant):
//   writer:  s = seq (relaxed; the only writer reads its own last store)
//            begin = (s + 1) | 1           odd: a write is in progress. If s is already odd a
//                                          previous writer died mid-write; skipping to the next
//                                          odd value keeps readers that sampled s retrying.
//            seq.store(begin, relaxed)
//            atomic_thread_fence(release)  F1: orders the odd seq store before every field store
//            fields.store(..., relaxed)
//            seq.store(begin + 1, release) even again: publishes the fields
//   reader:  s1 = seq.load(acquire)        odd: write in progress, retry; 0: never written
//            fields.load(..., relaxed)     copy out (counts clamped, so a torn count is harmless)
//            atomic_thread_fence(acquire)  F2
//            s2 = seq.load(relaxed)        s2 == s1: the copy is one whole record; else retry
//   Why no torn read is accepted: (a) s1's acquire load reads the release store that ended some
//   write W, so every field store of W and of earlier writes happens-before the copy; the copy
//   therefore sees W's values or values of later writes. (b) If it saw any value of a later
//   write W', that relaxed load read a store sequenced after W''s release fence F1, and is
//   itself sequenced before the reader's acquire fence F2, so F1 synchronizes-with F2 and the
//   odd store of W' (before F1) happens-before s2's load: s2 >= begin(W') > s1, and the read
//   is retried. So s2 == s1 implies the copy is exactly W's record.
//   All fields are std::atomic (relaxed), so the concurrent reads are not data races in the C++
//   model and the compiler can neither tear nor cache them; on x86-64 relaxed loads/stores and
//   both fences compile to plain movs (fences only restrain the compiler), on AArch64 the
//   fences are dmb instructions. std::atomic<uint32_t/uint64_t> is lock-free and address-free
//   here (static_asserts below), which is what makes it valid across processes.
//
// Progress: writes are wait-free (a fixed number of stores, no loop). A read makes at most
// kMaxReadAttempts attempts and then reports kBusy ("no new value"), so the worker never waits
// on the agent, even if the agent was descheduled or killed in the middle of a write.
// Lifetime: the creator stores its pid and start time in the header; create() replaces an
// existing mailbox only when that process is gone (ESRCH, zombie, or pid reused). Two live
// processes replacing the same stale name at the same instant could race (a configuration
// error: one name per worker). close() unlinks only if the name still refers to this inode.
//
// Exactly one writer is the contract (the bindings enforce it: metrics only through the
// creating handle, and the GIL serialises calls on one handle); two concurrent writers could
// publish a mixed record.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace dynamix {
namespace mailbox {

constexpr uint64_t kMagic = 0x584F424D584E5944ULL;  // the bytes "DYNXMBOX" in little-endian order
constexpr uint32_t kLayoutVersion = 2;
constexpr uint32_t kMetricsCapacity = 32;   // float64 values per metrics record
constexpr int kMaxReadAttempts = 64;        // seqlock read attempts before reporting kBusy
constexpr size_t kMaxNameLength = 255;      // NAME_MAX, leading '/' included

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared-memory atomics must be lock-free");
static_assert(sizeof(std::atomic<uint64_t>) == 8 && sizeof(std::atomic<uint32_t>) == 4, "atomic size");

struct SegmentHeader {
  std::atomic<uint64_t> magic;      // kMagic; stored last by the creator (release)
  uint32_t layout_version;          // kLayoutVersion
  uint32_t segment_bytes;           // sizeof(Segment) of the creator's layout
  int64_t owner_pid;                // creating (worker) process
  uint64_t owner_start_ticks;       // its start time, /proc/<pid>/stat field 22; 0 = unknown
  uint32_t metrics_capacity;        // kMetricsCapacity
  uint8_t reserved[28];             // layout 1 kept the assignment slot's capacity in the first 4
};

struct alignas(64) MetricsSlot {
  std::atomic<uint64_t> seq;        // seqlock counter: odd while a write is in progress
  std::atomic<uint64_t> version;    // 1, 2, 3, ... one per publish; 0 = never published
  std::atomic<uint64_t> step;       // the worker's training step the values belong to
  std::atomic<uint32_t> count;      // values in use, <= kMetricsCapacity
  uint32_t reserved;
  std::atomic<uint64_t> values[kMetricsCapacity];  // IEEE-754 float64 bit patterns
};

struct Segment {
  SegmentHeader header;
  MetricsSlot metrics;
};

static_assert(std::is_standard_layout<Segment>::value, "Segment must be standard layout");
static_assert(sizeof(SegmentHeader) == 64, "header layout");
static_assert(offsetof(SegmentHeader, owner_pid) == 16 && offsetof(SegmentHeader, owner_start_ticks) == 24,
              "the header's first 32 bytes are fixed across layout versions");
static_assert(offsetof(Segment, metrics) == 64, "metrics slot offset");
static_assert(sizeof(Segment) == 384, "segment size of layout 2");

struct MetricsRecord {
  uint64_t version = 0;
  uint64_t step = 0;
  uint32_t count = 0;
  double values[kMetricsCapacity];
};

enum class ReadStatus {
  kOk,        // `out` holds a complete record newer than `newer_than`
  kEmpty,     // nothing was ever published in this slot
  kNotNewer,  // the newest record's version is <= newer_than
  kBusy,      // every attempt overlapped a write (kMaxReadAttempts); try again later
};

// An OS call failed; `err` is the errno value (translated to the matching OSError subclass).
struct OsError : std::runtime_error {
  OsError(int e, const std::string& msg, std::string file) : std::runtime_error(msg), err(e), filename(std::move(file)) {}
  int err;
  std::string filename;
};

// The segment exists but is not a mailbox of this layout (bad magic, version or size).
struct LayoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The segment exists but its creator has not finished initialising it (size or magic still 0).
struct NotReadyError : LayoutError {
  using LayoutError::LayoutError;
};

// A write was attempted through the wrong end (see "exactly one writer" above).
struct RoleError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// ---- seqlock primitives ---------------------------------------------------------------------

// `store_fields()` performs the relaxed field stores. Wait-free; single writer per slot.
template <class Slot, class StoreFields>
inline void seqlock_write(Slot& slot, StoreFields&& store_fields) noexcept {
  const uint64_t s = slot.seq.load(std::memory_order_relaxed);
  const uint64_t begin = (s + 1) | 1;
  slot.seq.store(begin, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // F1
  store_fields();
  slot.seq.store(begin + 1, std::memory_order_release);
}

// `load_fields()` copies the fields with relaxed loads (it must tolerate torn values: clamp
// counts before indexing). Version check first, so a poll that finds nothing new copies nothing.
// `attempts`, when given, receives the number of attempts made (1 = no retry).
template <class Slot, class LoadFields>
inline ReadStatus seqlock_read(const Slot& slot, uint64_t newer_than, uint64_t& version_out,
                               LoadFields&& load_fields, int* attempts = nullptr) noexcept {
  for (int attempt = 0; attempt < kMaxReadAttempts; ++attempt) {
    if (attempts) *attempts = attempt + 1;
    if (attempt > 0) cpu_relax();
    const uint64_t s1 = slot.seq.load(std::memory_order_acquire);
    if (s1 == 0) return ReadStatus::kEmpty;
    if (s1 & 1) continue;
    const uint64_t version = slot.version.load(std::memory_order_relaxed);
    const bool newer = version > newer_than;
    if (newer) load_fields();
    std::atomic_thread_fence(std::memory_order_acquire);  // F2
    if (slot.seq.load(std::memory_order_relaxed) != s1) continue;
    if (!newer) return ReadStatus::kNotNewer;
    version_out = version;
    return ReadStatus::kOk;
  }
  return ReadStatus::kBusy;
}

inline uint64_t double_bits(double v) noexcept {
  uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

inline double bits_double(uint64_t b) noexcept {
  double v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// Writes one metrics record and returns its version (previous + 1). n <= kMetricsCapacity.
inline uint64_t write_metrics(MetricsSlot& slot, uint64_t step, const double* values, uint32_t n) noexcept {
  const uint64_t version = slot.version.load(std::memory_order_relaxed) + 1;
  seqlock_write(slot, [&] {
    slot.version.store(version, std::memory_order_relaxed);
    slot.step.store(step, std::memory_order_relaxed);
    slot.count.store(n, std::memory_order_relaxed);
    for (uint32_t i = 0; i < n; ++i) slot.values[i].store(double_bits(values[i]), std::memory_order_relaxed);
  });
  return version;
}

inline ReadStatus read_metrics(const MetricsSlot& slot, uint64_t newer_than, MetricsRecord& out,
                               int* attempts = nullptr) noexcept {
  return seqlock_read(slot, newer_than, out.version, [&] {
    out.step = slot.step.load(std::memory_order_relaxed);
    uint32_t n = slot.count.load(std::memory_order_relaxed);
    if (n > kMetricsCapacity) n = kMetricsCapacity;  // torn or hostile: never index past the array
    out.count = n;
    for (uint32_t i = 0; i < n; ++i) out.values[i] = bits_double(slot.values[i].load(std::memory_order_relaxed));
  }, attempts);
}

// ---- processes ------------------------------------------------------------------------------

// Fields 3 (state) and 22 (starttime, clock ticks since boot) of /proc/<pid>/stat.
// Returns false when the file cannot be read (no /proc, process gone).
inline bool proc_stat(int64_t pid, char& state, uint64_t& start_ticks) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return false;
  std::string line;
  std::getline(f, line);
  const size_t close_paren = line.rfind(')');  // comm may contain spaces and parentheses
  if (close_paren == std::string::npos) return false;
  std::istringstream rest(line.substr(close_paren + 1));
  std::string field;
  rest >> state;  // field 3
  for (int i = 4; i <= 22; ++i) {
    if (!(rest >> field)) return false;
  }
  try {
    start_ticks = std::stoull(field);
  } catch (...) {
    return false;
  }
  return true;
}

inline uint64_t self_start_ticks() {
  char state = 0;
  uint64_t ticks = 0;
  return proc_stat(static_cast<int64_t>(getpid()), state, ticks) ? ticks : 0;
}

// True when `pid` (with start time `start_ticks`, 0 = unknown) no longer runs: kill(pid, 0)
// says ESRCH, or the process with that pid is a zombie, or it started at another time (the pid
// was reused). EPERM means it runs under another user: alive.
inline bool owner_is_dead(int64_t pid, uint64_t start_ticks) {
  if (pid <= 0) return true;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  char state = 0;
  uint64_t ticks = 0;
  if (proc_stat(pid, state, ticks)) {
    if (state == 'Z' || state == 'X') return true;
    if (start_ticks != 0 && ticks != start_ticks) return true;
  }
  return false;
}

// ---- segments -------------------------------------------------------------------------------

// "/name" with 1..254 characters from [A-Za-z0-9._-] after the slash; throws std::invalid_argument.
inline void check_name(const std::string& name) {
  bool ok = name.size() >= 2 && name.size() <= kMaxNameLength && name[0] == '/' && name != "/." && name != "/..";
  for (size_t i = 1; ok && i < name.size(); ++i) {
    const char c = name[i];
    ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
  }
  if (!ok) {
    throw std::invalid_argument("mailbox name " + name +
                                " must be '/' followed by 1-254 characters from [A-Za-z0-9._-], e.g. /dynamix.job.0");
  }
}

inline std::string shm_path(const std::string& name) { return "/dev/shm" + name; }

inline OsError os_error(int err, const std::string& what, const std::string& name) {
  return OsError(err, what + " " + name + ": " + std::strerror(err), shm_path(name));
}

// A mapping of one segment; munmap on destruction. Shared so that test threads can keep it
// alive past close().
struct Mapping {
  Mapping(Segment* s, size_t n) : seg(s), bytes(n) {}
  ~Mapping() { munmap(seg, bytes); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Segment* seg;
  size_t bytes;
};

class Mailbox {
 public:
  // Worker side: creates the segment (O_CREAT|O_EXCL, mode 0600), sizes and initialises it.
  // If the name exists and belongs to a mailbox whose owner process is dead, that stale segment
  // is unlinked and replaced; `replaced_pid` then receives the dead owner's pid (else 0).
  // Throws std::invalid_argument (bad name), OsError (EEXIST: live owner or not a mailbox;
  // others from shm_open/ftruncate/mmap).
  static std::unique_ptr<Mailbox> create(const std::string& name, int64_t* replaced_pid = nullptr) {
    check_name(name);
    if (replaced_pid) *replaced_pid = 0;
    int fd = -1;
    for (int tries = 0;; ++tries) {
      fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
      if (fd >= 0) break;
      if (errno != EEXIST || tries >= 3) throw os_error(errno, "cannot create mailbox", name);
      const int64_t stale = stale_owner(name);  // throws EEXIST if not replaceable
      if (stale >= 0) {
        if (shm_unlink(name.c_str()) != 0 && errno != ENOENT) throw os_error(errno, "cannot remove stale mailbox", name);
        if (replaced_pid) *replaced_pid = stale;
      }
    }
    struct stat st;
    void* addr = MAP_FAILED;
    if (ftruncate(fd, static_cast<off_t>(sizeof(Segment))) != 0 || fstat(fd, &st) != 0 ||
        (addr = mmap(nullptr, sizeof(Segment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      shm_unlink(name.c_str());
      throw os_error(err, "cannot size or map mailbox", name);
    }
    ::close(fd);
    // ftruncate zero-filled the segment: seq = 0 (never written) in the slot. Construct the
    // objects formally, fill the header, and publish it by storing the magic last.
    auto* seg = new (addr) Segment();
    seg->header.layout_version = kLayoutVersion;
    seg->header.segment_bytes = static_cast<uint32_t>(sizeof(Segment));
    seg->header.owner_pid = static_cast<int64_t>(getpid());
    seg->header.owner_start_ticks = self_start_ticks();
    seg->header.metrics_capacity = kMetricsCapacity;
    seg->header.magic.store(kMagic, std::memory_order_release);
    std::unique_ptr<Mailbox> mb(new Mailbox(name, true, std::make_shared<Mapping>(seg, sizeof(Segment))));
    mb->dev_ = st.st_dev;
    mb->ino_ = st.st_ino;
    return mb;
  }

  // Agent side: maps an existing segment. Throws std::invalid_argument (bad name), OsError
  // (ENOENT when it does not exist, EACCES, ...), LayoutError (not a mailbox of this layout),
  // NotReadyError (its creator has not finished initialising it; retry).
  static std::unique_ptr<Mailbox> open(const std::string& name) {
    check_name(name);
    const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) throw os_error(errno, "cannot open mailbox", name);
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      throw os_error(err, "cannot stat mailbox", name);
    }
    const size_t size = static_cast<size_t>(st.st_size);
    if (size < sizeof(SegmentHeader)) {
      ::close(fd);
      if (size == 0) throw NotReadyError("mailbox " + name + " is empty: its creator has not initialised it yet");
      throw LayoutError("mailbox " + name + " is " + std::to_string(size) +
                        " bytes: not a dynamix mailbox, or its creator has not initialised it yet");
    }
    void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    if (addr == MAP_FAILED) throw os_error(err, "cannot map mailbox", name);
    auto mapping = std::make_shared<Mapping>(static_cast<Segment*>(addr), size);
    check_layout(name, *mapping->seg, size);
    return std::unique_ptr<Mailbox>(new Mailbox(name, false, std::move(mapping)));
  }

  ~Mailbox() { close(); }
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // Unmaps; the creator (in the creating process only, not in a forked child) also unlinks the
  // name if it still refers to this segment. Idempotent, never throws.
  void close() noexcept {
    if (!mapping_) return;
    if (creator_ && getpid() == creator_pid_) {
      struct stat st;
      if (stat(shm_path(name_).c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_) {
        shm_unlink(name_.c_str());
      }
    }
    mapping_.reset();
  }

  bool closed() const noexcept { return !mapping_; }
  bool is_creator() const noexcept { return creator_; }
  const std::string& name() const noexcept { return name_; }
  int64_t owner_pid() const { return seg().header.owner_pid; }
  // The creating process still runs: not gone, not a zombie, and not another process that got its pid.
  bool owner_alive() const { return !owner_is_dead(seg().header.owner_pid, seg().header.owner_start_ticks); }
  uint64_t busy_reads() const noexcept { return busy_reads_; }
  std::shared_ptr<Mapping> mapping() const { return mapping_; }

  // Worker only. Returns the record's version. Throws std::invalid_argument if n > 32.
  uint64_t publish_metrics(uint64_t step, const double* values, size_t n) {
    Segment& s = seg();
    if (!creator_) throw RoleError("publish_metrics: metrics are written by the worker that created the mailbox");
    if (n > kMetricsCapacity) {
      throw std::invalid_argument("publish_metrics: " + std::to_string(n) + " values, at most " +
                                  std::to_string(kMetricsCapacity));
    }
    return write_metrics(s.metrics, step, values, static_cast<uint32_t>(n));
  }

  ReadStatus read_metrics(uint64_t newer_than, MetricsRecord& out) {
    return count_busy(mailbox::read_metrics(seg().metrics, newer_than, out));
  }

 private:
  Mailbox(std::string name, bool creator, std::shared_ptr<Mapping> mapping)
      : name_(std::move(name)), creator_(creator), creator_pid_(getpid()), mapping_(std::move(mapping)) {}

  Segment& seg() const {
    if (!mapping_) throw std::domain_error("mailbox " + name_ + " is closed");
    return *mapping_->seg;
  }

  ReadStatus count_busy(ReadStatus r) noexcept {
    if (r == ReadStatus::kBusy) ++busy_reads_;
    return r;
  }

  static void check_layout(const std::string& name, const Segment& seg, size_t size) {
    const SegmentHeader& h = seg.header;
    const uint64_t magic = h.magic.load(std::memory_order_acquire);  // pairs with the creator's release
    char hex[40];
    if (magic == 0) throw NotReadyError("mailbox " + name + " has no magic yet: its creator has not initialised it yet");
    if (magic != kMagic) {
      std::snprintf(hex, sizeof hex, "0x%016llx", static_cast<unsigned long long>(magic));
      throw LayoutError("mailbox " + name + " has magic " + hex +
                        ", expected 0x584f424d584e5944 (\"DYNXMBOX\"): not a dynamix mailbox");
    }
    if (h.layout_version != kLayoutVersion) {
      throw LayoutError("mailbox " + name + " has layout version " + std::to_string(h.layout_version) +
                        ", this build reads version " + std::to_string(kLayoutVersion) +
                        ": worker and agent run different dynamix_byteps versions");
    }
    if (h.segment_bytes != sizeof(Segment) || size < sizeof(Segment) || h.metrics_capacity != kMetricsCapacity) {
      throw LayoutError("mailbox " + name + " is " + std::to_string(size) + " bytes (header says " +
                        std::to_string(h.segment_bytes) + ", " + std::to_string(h.metrics_capacity) +
                        " metrics); layout " + std::to_string(kLayoutVersion) + " needs " +
                        std::to_string(sizeof(Segment)) + " bytes, " + std::to_string(kMetricsCapacity) + " metrics");
    }
  }

  // For an existing name: the pid of its dead owner (>= 0) when it is a stale mailbox (any
  // layout version) that may be replaced; throws OsError(EEXIST) otherwise. Returns -1 if the
  // name vanished meanwhile (just retry the create).
  static int64_t stale_owner(const std::string& name) {
    // O_NONBLOCK: a FIFO under the name would block a read-only open until a writer came (forever).
    const int fd = shm_open(name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC, 0);
    if (fd < 0) {
      if (errno == ENOENT) return -1;
      throw os_error(EEXIST, "mailbox exists and cannot be inspected (" + std::string(std::strerror(errno)) + ")", name);
    }
    struct stat st;
    void* addr = MAP_FAILED;
    if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= sizeof(SegmentHeader)) {
      addr = mmap(nullptr, sizeof(SegmentHeader), PROT_READ, MAP_SHARED, fd, 0);
    }
    ::close(fd);
    if (addr == MAP_FAILED) {
      throw OsError(EEXIST,
                    "mailbox " + name + " exists and is not an initialised dynamix mailbox; remove " + shm_path(name) +
                        " if no process uses it",
                    shm_path(name));
    }
    const auto* h = static_cast<const SegmentHeader*>(addr);
    const uint64_t magic = h->magic.load(std::memory_order_acquire);
    const int64_t pid = h->owner_pid;
    const uint64_t ticks = h->owner_start_ticks;
    munmap(addr, sizeof(SegmentHeader));
    if (magic != kMagic) {
      throw OsError(EEXIST,
                    "mailbox " + name + " exists and is not an initialised dynamix mailbox; remove " + shm_path(name) +
                        " if no process uses it",
                    shm_path(name));
    }
    if (!owner_is_dead(pid, ticks)) {
      throw OsError(EEXIST,
                    "mailbox " + name + " is in use: its creator, pid " + std::to_string(pid) +
                        ", is alive (two workers with the same job name and rank?)",
                    shm_path(name));
    }
    return pid;
  }

  std::string name_;
  bool creator_;
  pid_t creator_pid_;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  uint64_t busy_reads_ = 0;
  std::shared_ptr<Mapping> mapping_;
};

}  // namespace mailbox
}  // namespace dynamix
