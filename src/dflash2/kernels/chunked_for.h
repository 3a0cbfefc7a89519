// Work over [0, n) split across threads in chunks taken from a shared counter, rather than at::parallel_for's fixed
// halves: the panels of every linear-layer kernel (bf16, int8, gguf; AVX2, AVX-512, AMX) and the attention items.
//
// Why: on a shared machine the cores do not run at one speed. On the 2-core Intel Xeon (AMX, model 207) VM the
// same single-thread AMX product took 37 ms on one core and 16 ms on the other for seconds at a time (a neighbour
// on the other hyperthread), and with fixed halves every layer waits for the slower core. With chunks the faster
// core takes more of them. Each chunk is a contiguous stretch of the packed weight; which thread computes an output
// does not change its arithmetic, so results do not depend on the split (the row-count invariance holds as before).
//
// Chunks shrink as the work runs out (guided): each take claims a 1 / (4 x threads) share of what is left, at least
// the caller's minimum, so the last ones are small and the threads finish close together. Equal chunks of 1 / (8 x
// threads) (before commit 2376368) left a thread waiting for up to a chunk at the end of every call: whole 1.5B gguf
// forwards on that VM, 1 / 4 / 9 rows 50.9 / 76.3 / 89.4 -> 50.0 / 74.2 / 84.1 ms in a busy phase, 9 rows 63.8 ->
// 61.9 in a quiet one (interleaved builds, medians of 11).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// The chunks of one call: take(i0, i1) claims the next one, max(min_chunk, what is left / share) items (false when
// none is left); each(f) runs f on the items of every chunk the calling thread takes.
class Chunks {
 public:
  Chunks(int64_t n, int64_t min_chunk, int64_t share) : n_(n), min_chunk_(min_chunk), share_(share) {}
  bool take(int64_t& i0, int64_t& i1) {
    int64_t start = next_.load(std::memory_order_relaxed);
    for (;;) {
      if (start >= n_) return false;
      const int64_t size = std::max(min_chunk_, (n_ - start) / share_);
      if (next_.compare_exchange_weak(start, start + size, std::memory_order_relaxed)) {
        i0 = start;
        i1 = std::min(n_, start + size);
        return true;
      }
    }
  }
  // f(i) for each item of every chunk this thread takes, in order.
  template <class F>
  void each(F&& f) {
    int64_t i0, i1;
    while (take(i0, i1))
      for (int64_t i = i0; i < i1; ++i) f(i);
  }

 private:
  const int64_t n_, min_chunk_, share_;
  std::atomic<int64_t> next_{0};
};

// worker(chunks) once per thread, each taking chunks of >= min_chunk items of [0, n) until none is left: a thread's
// own state (tile configuration, buffers) lives in its worker call. A call whose n is under two chunks' worth, or
// with one thread, runs one worker on the calling thread.
template <class Worker>
void chunked_threads(int64_t n, int64_t min_chunk, Worker&& worker) {
  min_chunk = std::max<int64_t>(1, min_chunk);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / min_chunk));
  if (threads <= 1 || at::in_parallel_region()) {
    Chunks all(n, std::max<int64_t>(1, n), 1);
    worker(all);
    return;
  }
  Chunks chunks(n, min_chunk, 4 * threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { worker(chunks); });
}

// run(i0, i1) for each chunk (chunked_threads without per-thread state).
template <class Run>
void chunked_for(int64_t n, int64_t min_chunk, Run&& run) {
  chunked_threads(n, min_chunk, [&](Chunks& chunks) {
    int64_t i0, i1;
    while (chunks.take(i0, i1)) run(i0, i1);
  });
}
