// C interface of the shared-memory barrier (csrc/shm_barrier.cpp), free of torch headers.
#pragma once

#include <cstdint>

#define HYBRIDRL_BARRIER_OK 0
#define HYBRIDRL_BARRIER_TIMEOUT 1    // a peer did not arrive within timeout_s
#define HYBRIDRL_BARRIER_PEER_GONE 2  // a peer's process no longer runs

extern "C" {

// Round `round` (1, 2, ... : every rank counts its calls) of a barrier of `world` processes: counters[r * stride]
// is rank r's last round (int64, in memory all of them map, zero at first). Publishes this rank's arrival, then
// waits until every peer's counter reaches `round`: spinning for spin_us microseconds, then yielding the core.
// pids[r]: rank r's process id (<= 0: unknown, only the timeout applies). Returns one of the HYBRIDRL_BARRIER_*
// codes; *peer_out is the peer it was waiting for when it gave up (-1 on success).
int64_t hybridrl_shm_barrier(int64_t* counters, int64_t stride, int64_t world, int64_t rank, int64_t round,
                             double timeout_s, double spin_us, const int64_t* pids, int64_t* peer_out);

}  // extern "C"
