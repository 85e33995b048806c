// guided_for: a parallel loop whose threads take contiguous chunks off one shared counter, large
// first and smaller towards the end (OpenMP's "guided" schedule), for the products that stream
// their weights one chunk at a time (the interleaved int8 / int4 panels, bf16's rows). With
// at::parallel_for's equal halves the thread that streamed faster (or started first) spun at the
// end of every call: a profile (perf, 2 threads) of the 1B shape's compiled int4 decode on an Intel
// Xeon with AMX found the calling thread 19% of its time in libgomp's spin loop and 36% in the
// products, against the other thread's 42%; with these chunks 2% and 41% against 41%. Each chunk is
// as many whole units as a 2T-th of what is left (T threads), at least one, so the last ones are
// small; the split changes no sum (every unit is computed whole by one thread). Inside a decode
// step's team (team.h) the team's threads share the units the same way, without a region.
#pragma once

#include <ATen/Parallel.h>

#include "team.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

// body(b, e) over the units [0, n), each chunk [b, e) by one thread.
template <class F>
void guided_for(int64_t n, const F& body) {
  if (team_chunks(n, body)) return;  // a step's team (team.h) shares the call instead
  const int64_t T = std::min<int64_t>(at::get_num_threads(), n);
  if (T <= 1 || at::in_parallel_region()) return body(0, n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, T, 1, [&](int64_t, int64_t) { take_chunks(next, n, T, body); });
}
