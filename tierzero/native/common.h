// Helpers the native kernels share: bf16 conversions as torch's vectorized copies do them, and a parallel for.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

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

// Runs body(lo, hi) over [0, n) on `threads` threads (the caller's among them), cut at
// multiples of `align` elements.
template <typename Body>
void parallel(int64_t n, int threads, int64_t align, Body body) {
  constexpr int64_t kMinPerThread = int64_t(1) << 16;
  int64_t parts = std::min<int64_t>(threads, n / kMinPerThread);
  if (parts <= 1) {
    body(int64_t(0), n);
    return;
  }
  int64_t per = ((n + parts - 1) / parts + align - 1) / align * align;  // parts * per >= n
  std::vector<std::thread> workers;
  workers.reserve(parts - 1);
  for (int64_t t = 1; t < parts; ++t) {
    int64_t lo = std::min(n, t * per), hi = std::min(n, (t + 1) * per);
    if (lo < hi) workers.emplace_back(body, lo, hi);
  }
  body(int64_t(0), std::min(n, per));
  for (auto& w : workers) w.join();
}

}  // namespace tz
