// Work over [0, n) split across threads in chunks taken from a shared counter, rather than at::parallel_for's fixed
// halves: the gguf kernels' panels (gemm_gguf_avx2.cpp, gemm_gguf_amx.h).
//
// Why: on a shared machine the cores do not run at one speed. On the 2-core Intel Xeon (AMX, model 207) VM the
// same single-thread AMX product took 37 ms on one core and 16 ms on the other for seconds at a time (a neighbour
// on the other hyperthread), and with fixed halves every layer waits for the slower core. With chunks the faster
// core takes more of them. Each chunk is a contiguous stretch of the packed weight; which thread computes an output
// does not change its arithmetic, so results do not depend on the split (the row-count invariance holds as before).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// run(i0, i1) over [0, n) in chunks of >= min_chunk items (about 8 per thread), each chunk on one thread. A call
// whose n is under two chunks' worth, or with one thread, runs on the calling thread.
template <class Run>
void chunked_for(int64_t n, int64_t min_chunk, Run&& run) {
  min_chunk = std::max<int64_t>(1, min_chunk);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / min_chunk));
  if (threads <= 1 || at::in_parallel_region()) {
    run(int64_t{0}, n);
    return;
  }
  const int64_t chunk = std::max(min_chunk, n / (threads * 8));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (;;) {
      const int64_t i0 = next.fetch_add(chunk, std::memory_order_relaxed);
      if (i0 >= n) break;
      run(i0, std::min(n, i0 + chunk));
    }
  });
}
