// A team: the threads of one parallel region that run a whole decode step (step.cpp) instead of
// one region per product. The step's threads each call the same kernels in the same order; where a
// kernel would open a region of its own (guided.h `guided_for`, the attention's tasks), a member
// takes chunks of that call's work off the call's own counter instead and waits at the team's
// barrier at the end, so every thread sees the whole result before it reads it. Outside a step
// (`member` unset) the kernels open their regions as before.
//
// Why: at the toy shape (6 layers, hidden 512) a batch-1 step of int4 panels spent ~0.3 ms of ~0.6
// outside its products (a perf profile, 2 threads, the Intel Xeon of fast-paths.md): a region per
// call, the calls' allocations, the compiled graph's glue kernels, the dispatcher, Python; the
// second thread spun 62% of the step.
#pragma once

#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

struct Team {
  int threads = 1;
  std::vector<std::atomic<int64_t>> counters;  // one per shared call of a step, zeroed before it
  std::atomic<int> arrived{0};
  std::atomic<int> phase{0};

  explicit Team(int64_t calls) : counters(calls) {}

  void reset(int n) {
    threads = n;
    for (auto& c : counters) c.store(0, std::memory_order_relaxed);
  }
  // Every member waits here until all have arrived: their writes before are seen by all after.
  void wait() {
    const int p = phase.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == threads - 1) {
      arrived.store(0, std::memory_order_relaxed);
      phase.store(p + 1, std::memory_order_release);
    } else {
      while (phase.load(std::memory_order_acquire) == p) _mm_pause();
    }
  }
};

struct Member {
  Team* team;
  int id;
  int64_t turn = 0;  // the shared calls this member has made in the step: the next counter's index
};

// The team this thread runs a step in, or null.
inline thread_local Member* member = nullptr;

// body(b, e) over chunks of the units [0, n) taken off `next` by one of T threads until none is
// left: each chunk as many units as a 2T-th of what is left, at least one (OpenMP's "guided").
template <class F>
void take_chunks(std::atomic<int64_t>& next, int64_t n, int64_t T, const F& body) {
  for (;;) {
    int64_t b = next.load(std::memory_order_relaxed), c = 0;
    do {
      if (b >= n) return;
      c = std::max<int64_t>(1, (n - b) / (2 * T));
    } while (!next.compare_exchange_weak(b, b + c, std::memory_order_relaxed));
    body(b, std::min(n, b + c));
  }
}

// Member id's share [b, e) of n units split evenly among T (empty where n < T): team_static's, and
// what a step computes ahead for the share a team_static call will take (step.cpp).
inline std::pair<int64_t, int64_t> share(int64_t n, int id, int T) { return {n * id / T, n * (id + 1) / T}; }

// In a team: body(b, e) over this member's equal share of the units [0, n) (none where n < the
// team), then the team's barrier; true. Outside one: false, nothing run. For calls of equal units
// too few to chunk (the attention's KV heads): a chunk of one or two heads at a time restarted the
// attention's prefetch walk and its buffers at every chunk (~7 us a token at the toy shape's int4).
template <class F>
bool team_static(int64_t n, const F& body) {
  Member* m = member;
  if (!m) return false;
  Team& t = *m->team;
  ++m->turn;  // the call's counter goes unused; the calls after keep theirs
  const auto [b, e] = share(n, m->id, t.threads);
  if (b < e) body(b, e);
  t.wait();
  return true;
}

// In a team: body(b, e) over the units [0, n) in chunks off this call's counter, then the team's
// barrier; true. Outside one: false, nothing run.
template <class F>
bool team_chunks(int64_t n, const F& body) {
  Member* m = member;
  if (!m) return false;
  Team& t = *m->team;
  TORCH_CHECK(m->turn < static_cast<int64_t>(t.counters.size()), "team: more shared calls than the step counted");
  take_chunks(t.counters[m->turn++], n, t.threads, body);
  t.wait();
  return true;
}
