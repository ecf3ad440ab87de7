// Adam and AdamW in one pass over host memory, with the gradient's widening, the clip's scale and the cast fused.
//
// Built by tierzero/native/build.py with `-O3 -march=native -ffp-contract=off`: the compiler
// vectorizes the loops and contracts nothing on its own, so every fused multiply-add below is
// one written as std::fma, placed where torch's CPU fused Adam rounds once (tierzero/native/adam.py
// checks the bits against torch's kernel before the engine uses these).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "adam_math.h"
#include "common.h"

namespace {

using tz::float_to_bf16;
using tz::AdamHypers;
using tz::adam_scalar;
using tz::adam_vector;
using tz::parallel;
using tz::widen;

template <typename Grad, bool kScale, bool kVector>
void adam_run(float* __restrict p, const Grad* __restrict grad, float scale, float* __restrict m,
              float* __restrict v, int64_t lo, int64_t hi, const AdamHypers& hypers) {
  const AdamHypers h = hypers;
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    float g = widen(grad[i]);
    if (kScale) g = g * scale;
    float mi = m[i], vi = v[i];
    p[i] = kVector ? adam_vector(p[i], g, mi, vi, h) : adam_scalar(p[i], g, mi, vi, h);
    m[i] = mi;
    v[i] = vi;
  }
}

void cast_scalar(const float* __restrict p, uint16_t* __restrict cast, int64_t lo, int64_t hi) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) cast[i] = float_to_bf16(p[i]);
}

// The cast written past the caches, a line at a time from where its lines start (`tz::store_line`):
// nothing reads it before the next forward, and a plain store first reads every line it writes
// (bench step-host, session 34: the cast's stores cost 17 of the step's 79 ms at 100M parameters,
// against 62 without them).
void cast_run(const float* __restrict p, uint16_t* __restrict cast, int64_t lo, int64_t hi) {
  constexpr int64_t kRow = 32;  // bf16 values a 64-byte line
  int64_t head = std::min(hi, lo + int64_t((64 - reinterpret_cast<uintptr_t>(cast + lo) % 64) % 64 / 2));
  cast_scalar(p, cast, lo, head);
  int64_t i = head;
  for (; i + kRow <= hi; i += kRow) {
    alignas(64) uint16_t row[kRow];
#pragma omp simd
    for (int l = 0; l < kRow; ++l) row[l] = float_to_bf16(p[i + l]);
    tz::store_line(cast + i, row);
  }
  cast_scalar(p, cast, i, hi);
}

// Elements a block: the cast reads back what the step just wrote while a core's L1 still holds it.
constexpr int64_t kCastBlock = 2048;

template <typename Grad, bool kScale, bool kCast>
void adam_range(float* p, const void* grad, float scale, float* m, float* v, uint16_t* cast, int64_t lo, int64_t hi,
                int64_t vector_end, const AdamHypers& h) {
  const Grad* g = static_cast<const Grad*>(grad);
  for (int64_t a = lo; a < hi; a += kCastBlock) {
    int64_t b = std::min(hi, a + kCastBlock), mid = std::max(a, std::min(b, vector_end));
    adam_run<Grad, kScale, true>(p, g, scale, m, v, a, mid, h);
    adam_run<Grad, kScale, false>(p, g, scale, m, v, mid, b, h);
    if (kCast) cast_run(p, cast, a, b);
  }
  if (kCast) tz::stream_fence();  // the cast is read once the call returns
}

using AdamRange = void (*)(float*, const void*, float, float*, float*, uint16_t*, int64_t, int64_t, int64_t,
                           const AdamHypers&);

template <typename Grad, bool kScale>
AdamRange pick_cast(bool cast) {
  return cast ? adam_range<Grad, kScale, true> : adam_range<Grad, kScale, false>;
}

}  // namespace

extern "C" {

int tz_abi_version() { return 1; }

// Nonzero: the kernels' parts run on threads of their own, not on OpenMP's team (a fork()ed child's).
void tz_own_threads(int on) { tz::own_threads.store(on != 0); }

// Adam or AdamW over n fp32 parameters in place, in torch's fused CPU kernel's arithmetic: elements
// before `vector_end` as its SIMD lanes compute them, the rest as its scalar tail does. The gradient
// is fp32 or bf16 (`grad_bf16`), read only, multiplied by `scale` first when it is not 1 (as a
// separate `mul_` would). `cast`, when not null, receives the new parameters in bf16.
void tz_adam(float* param, const void* grad, int grad_bf16, float scale, float* exp_avg, float* exp_avg_sq,
             uint16_t* cast, int64_t n, int64_t vector_end, int adamw, double lr, double beta1, double beta2,
             double weight_decay, double eps, double step, int threads) {
  AdamHypers h = tz::adam_hypers(adamw != 0, lr, beta1, beta2, weight_decay, eps, step);
  bool scaled = scale != 1.0f;
  AdamRange run = grad_bf16 ? (scaled ? pick_cast<uint16_t, true>(cast) : pick_cast<uint16_t, false>(cast))
                            : (scaled ? pick_cast<float, true>(cast) : pick_cast<float, false>(cast));
  parallel(n, threads, 64, [&](int64_t lo, int64_t hi) {
    run(param, grad, scale, exp_avg, exp_avg_sq, cast, lo, hi, vector_end, h);
  });
}

// Parameter slots stepped in one call, each with memory of its own: slot s is params[s], exp_avgs[s],
// exp_avg_sqs[s] and casts[s] (null: no cast) over numels[s] elements, its gradient grads[s], its vector
// lanes up to vector_ends[s], its learning rate and weight decay lrs[s] and weight_decays[s] (a unit's
// slots, or every unit's of a step). Each element is stepped as tz_adam steps its slot alone, so the
// bits are the same; the threads share the slots' elements, started once for all of them.
void tz_adam_many(float* const* params, float* const* exp_avgs, float* const* exp_avg_sqs, uint16_t* const* casts,
                  const void* const* grads, int64_t slots, const int64_t* numels, const int64_t* vector_ends,
                  const double* lrs, const double* weight_decays, int grad_bf16, float scale, int adamw, double beta1,
                  double beta2, double eps, double step, int threads) {
  std::vector<int64_t> starts(slots + 1, 0);  // slot s's first element in the slots laid end to end
  std::vector<AdamHypers> hypers(slots);
  for (int64_t s = 0; s < slots; ++s) {
    starts[s + 1] = starts[s] + numels[s];
    hypers[s] = tz::adam_hypers(adamw != 0, lrs[s], beta1, beta2, weight_decays[s], eps, step);
  }
  bool scaled = scale != 1.0f;
  auto pick = [&](bool cast) {
    return grad_bf16 ? (scaled ? pick_cast<uint16_t, true>(cast) : pick_cast<uint16_t, false>(cast))
                     : (scaled ? pick_cast<float, true>(cast) : pick_cast<float, false>(cast));
  };
  AdamRange with_cast = pick(true), without_cast = pick(false);
  parallel(starts[slots], threads, 64, [&](int64_t lo, int64_t hi) {
    int64_t s = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
    for (; s < slots && starts[s] < hi; ++s) {
      int64_t a = std::max(lo, starts[s]) - starts[s], b = std::min(hi, starts[s + 1]) - starts[s];
      if (a >= b) continue;
      AdamRange run = casts[s] ? with_cast : without_cast;
      run(params[s], grads[s], scale, exp_avgs[s], exp_avg_sqs[s], casts[s], a, b, vector_ends[s], hypers[s]);
    }
  });
}

}  // extern "C"
