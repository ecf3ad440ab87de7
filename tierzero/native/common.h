// Helpers the native kernels share: bf16 conversions as torch's vectorized copies do them, the
// landing's `x + 0.0`, stores past the caches, and a parallel for.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tz {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) { return float_of(uint32_t(h) << 16); }

// Round to nearest even, as torch's vectorized conversion does; every NaN becomes 0xffff, as there.
inline uint16_t float_to_bf16(float f) {
  uint32_t u = bits_of(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? 0xffffu : rounded);
}

// Zero plus a bf16 value in fp32, rounded back (`torch.add(x, 0.0)`'s bits): the value itself, except
// -0.0 (which becomes +0.0) and a NaN (which becomes 0xffff, as torch's vectorized rounding makes every NaN).
inline uint16_t plus_zero(uint16_t h) {
  if ((h & 0x7fffu) > 0x7f80u) return 0xffffu;
  return h == 0x8000u ? uint16_t(0) : h;
}
inline float plus_zero(float f) { return f + 0.0f; }

#ifdef __AVX512F__
// Writes a line held in a register to `dst`: past the caches where `dst` starts a cache line, for
// memory nothing reads again soon (a plain store first reads every line it writes); a plain store
// elsewhere. Whether it streamed: a thread that did calls `stream_fence` before its writes are read
// by others.
inline bool store_vector(void* dst, __m512i line) {
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), line);
    return true;
  }
  _mm512_storeu_si512(dst, line);
  return false;
}
#endif

// The 64 bytes at `line` (64-byte aligned) written to `dst` as `store_vector` writes them; a plain
// copy without AVX-512. Whether it streamed.
inline bool store_line(void* dst, const void* line) {
#ifdef __AVX512F__
  return store_vector(dst, _mm512_load_si512(line));
#else
  std::memcpy(dst, line, 64);
  return false;
#endif
}

// Orders a thread's streamed stores before whatever reads their memory once its call returns.
inline void stream_fence() {
#ifdef __AVX512F__
  _mm_sfence();
#endif
}

// Set in a fork()ed child (`tz_own_threads`, from native/build.py's at-fork hook): the team it inherited
// has no threads behind it there, and a parallel region would wait for them forever.
inline std::atomic<bool> own_threads{false};

#ifdef _OPENMP
// Whether the caller is the process's main thread, whose team torch's kernels use. Another thread (the
// decoder's, a swapper's) would get a team of its own, whose workers spin beside the main thread's.
inline bool on_main_thread() {
  thread_local const bool main = syscall(SYS_gettid) == getpid();
  return main;
}
#endif

// Runs body(lo, hi) over [0, n) on `threads` threads (the caller's among them), cut at
// multiples of `align` elements: the same cuts whichever threads run them, so the same bits.
//
// Built with OpenMP (native/build.py links torch's own runtime), the main thread's parts run on the
// team torch's kernels use. Its workers spin for a while after each of torch's parallel ops
// (libgomp's default wait policy), so a thread of our own started then shares a core with a
// spinning one: the squares of 100M bf16 gradients took 14.4 ms on two such threads, no less than
// on one, and 6.0-8.1 ms on the team, whose spinning workers take the parts at once (the 2-vCPU
// VM, session 40).
template <typename Body>
void parallel(int64_t n, int threads, int64_t align, Body body) {
  constexpr int64_t kMinPerThread = int64_t(1) << 16;
  int64_t parts = std::min<int64_t>(threads, n / kMinPerThread);
  if (parts <= 1) {
    body(int64_t(0), n);
    return;
  }
  int64_t per = ((n + parts - 1) / parts + align - 1) / align * align;  // parts * per >= n
  auto part = [&](int64_t t) {
    int64_t lo = std::min(n, t * per), hi = std::min(n, (t + 1) * per);
    if (lo < hi) body(lo, hi);
  };
#ifdef _OPENMP
  if (!own_threads.load(std::memory_order_relaxed) && on_main_thread()) {
    // A team may come smaller than asked (nested, or a thread limit): its threads take the parts in turn.
#pragma omp parallel num_threads(int(parts))
    for (int64_t t = omp_get_thread_num(); t < parts; t += omp_get_num_threads()) part(t);
    return;
  }
#endif
  std::vector<std::thread> workers;
  workers.reserve(parts - 1);
  for (int64_t t = 1; t < parts; ++t) workers.emplace_back(part, t);
  part(0);
  for (auto& w : workers) w.join();
}

}  // namespace tz
