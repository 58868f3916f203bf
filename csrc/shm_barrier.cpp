// A barrier of the processes of one host over counters in shared memory: the round trip of
// hybridrl/distributed/shm_allreduce.py, whose ranks copy their tensors into a shared mapping and then wait for each
// other. gloo's barrier (the fallback) hands the wait to its worker thread and a loopback TCP exchange, about 0.6 ms
// on a 2-core machine with both ranks arriving together; here a rank publishes its arrival with one store and
// watches its peers' counters.
//
// Ordering: the fence before the arrival store makes this rank's earlier writes (its slot of the mapping, written
// by any of its threads before the call) visible before its arrival; the acquire loads and the closing fence keep
// its later reads and writes after every peer's arrival. So a peer's slot is read only once it is complete, and a
// slot set is rewritten only after every peer has moved past the round that read it.
//
// Waiting: a spin of spin_us microseconds (the peers usually arrive within microseconds when each has a core; the
// caller passes 0 where ranks outnumber cores, since the spin would take the core of the rank it waits for), then
// sched_yield (the core goes to another runnable thread), then naps of 50 us. The wait ends with an error when a
// peer's process is gone (checked every 50 ms: a dead peer never arrives) or after timeout_s (a stopped or hung
// peer), like a gloo collective's timeout.
#include "shm_barrier.h"

#include <sched.h>
#include <signal.h>
#include <time.h>

#include <cerrno>
#include <chrono>
#include <cstdio>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#elif defined(__aarch64__)
static inline void cpu_relax() { asm volatile("yield" ::: "memory"); }
#else
static inline void cpu_relax() {}
#endif

namespace {

constexpr int64_t kYields = 2000;  // yields before napping (a yield with nothing else to run: about a microsecond)
constexpr long kNapNs = 50000;     // one nap
constexpr double kCheckS = 0.05;   // between looks at the peers' processes

// False when `pid` no longer runs: no such process, or a zombie (exited, not yet reaped by its parent).
bool process_alive(int64_t pid) {
  if (pid <= 0) return true;  // unknown: only the timeout applies
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no /proc here: kill() above is the whole check
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // "pid (comm) S ...": the state follows the last ')' (comm may itself hold parentheses)
  const char* state = nullptr;
  for (size_t i = 0; i < n; ++i)
    if (buf[i] == ')') state = buf + i;
  return !(state != nullptr && state[1] == ' ' && (state[2] == 'Z' || state[2] == 'X'));
}

}  // namespace

extern "C" int64_t hybridrl_shm_barrier(int64_t* counters, int64_t stride, int64_t world, int64_t rank, int64_t round,
                                        double timeout_s, double spin_us, const int64_t* pids, int64_t* peer_out) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  __atomic_store_n(counters + rank * stride, round, __ATOMIC_SEQ_CST);
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto spin_end = start + std::chrono::duration<double, std::micro>(spin_us);
  auto next_check = start + std::chrono::duration<double>(kCheckS);
  bool spinning = spin_us > 0;
  int64_t yields = 0;
  for (int64_t peer = 0; peer < world; ++peer) {
    if (peer == rank) continue;
    int64_t spins = 0;
    while (__atomic_load_n(counters + peer * stride, __ATOMIC_ACQUIRE) < round) {
      if (spinning) {
        cpu_relax();
        if ((++spins & 63) == 0 && clock::now() >= spin_end) spinning = false;
        continue;
      }
      if (yields < kYields) {
        ++yields;
        sched_yield();
      } else {
        const timespec nap{0, kNapNs};
        nanosleep(&nap, nullptr);
      }
      const auto now = clock::now();
      if (now < next_check) continue;
      next_check = now + std::chrono::duration<double>(kCheckS);
      *peer_out = peer;
      if (!process_alive(pids[peer])) return HYBRIDRL_BARRIER_PEER_GONE;
      if (std::chrono::duration<double>(now - start).count() > timeout_s) return HYBRIDRL_BARRIER_TIMEOUT;
    }
  }
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  *peer_out = -1;
  return HYBRIDRL_BARRIER_OK;
}
