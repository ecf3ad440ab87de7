// Adam and AdamW over compact moments (int8 block-wise dynamic codes, or bf16) in one pass a block:
// the stored moments decoded, the step, the moments encoded again, the parameter's bf16 cast.
//
// Each decode, step and encode is the torch path's (tierzero/optim/windows.py, units/code_tables.py)
// element for element: a code's value times its block's absmax; the step of adam_math.h on the lane
// or the tail each element has there; a block's new absmax the largest |x|, each ratio x / absmax
// (|x| / absmax unsigned) a correctly rounded division whose fp32 bits, flipped below zero, pick a
// cell of the code's table, whose offset added to them carries the nearest code into bits 16-23.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "adam_math.h"
#include "common.h"

namespace {

using tz::AdamHypers;

// One moment of a slice: int8 codes with an fp32 absmax per block and the code's tables, or bf16.
struct Moment {
  void* stored;            // uint8 codes or bf16 values
  float* absmax;           // int8: one per block
  const float* values;     // int8: the 256 code values
  const int32_t* offsets;  // int8: per cell of a ratio's bits, what carries the nearest code into bits 16-23
};

// Elements [start, end) of one parameter group: torch's SIMD lanes before vector_end, its scalar tail after.
struct Range {
  int64_t start, end, vector_end, group;
};

// Not inlined: inside step_blocks g++ 12 leaves the bf16 gradient's loop scalar.
template <typename Grad, bool kScale, bool kVector>
__attribute__((noinline)) void step_run(float* __restrict p, const Grad* __restrict grad, float scale, float* __restrict m,
                                        float* __restrict v, int64_t count, const AdamHypers& hypers) {
  const AdamHypers h = hypers;
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    float g = tz::widen(grad[i]);
    if (kScale) g = g * scale;
    float mi = m[i], vi = v[i];
    p[i] = kVector ? tz::adam_vector(p[i], g, mi, vi, h) : tz::adam_scalar(p[i], g, mi, vi, h);
    m[i] = mi;
    v[i] = vi;
  }
}

void decode_codes(const uint8_t* __restrict codes, float absmax, const float* __restrict values, float* __restrict out,
                  int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) out[i] = values[codes[i]] * absmax;
}

void decode_bf16(const uint16_t* __restrict stored, float* __restrict out, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) out[i] = tz::bf16_to_float(stored[i]);
}

// The block's absmax and nearest codes, written in place; or, where a value is inf or NaN, nothing
// written and the count of such values returned (the torch path refuses them).
template <bool kSigned>
int64_t encode_codes(const float* __restrict x, int64_t count, const int32_t* __restrict offsets,
                     uint8_t* __restrict codes, float* absmax) {
  float top = 0.0f;
  int64_t bad = 0;
#pragma omp simd reduction(max : top) reduction(+ : bad)
  for (int64_t i = 0; i < count; ++i) {
    float a = std::fabs(x[i]);
    top = std::max(top, a);
    bad += !(a <= FLT_MAX);
  }
  if (bad) return bad;
  *absmax = top;
  const float divisor = top > 0.0f ? top : 1.0f;  // an all-zero block's ratios are its zeros
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    float r = (kSigned ? x[i] : std::fabs(x[i])) / divisor;
    int32_t q;
    std::memcpy(&q, &r, 4);
    if (kSigned) q ^= q >> 31;
    codes[i] = uint8_t((uint32_t(offsets[q >> 16]) + uint32_t(q)) >> 16);
  }
  return 0;
}

void encode_bf16(const float* __restrict x, uint16_t* __restrict stored, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) stored[i] = tz::float_to_bf16(x[i]);
}

struct Step {
  float* param;
  const void* grad;
  float scale;
  uint16_t* cast;
  bool int8;
  int64_t block;
  Moment avg, sq;
  const Range* ranges;
  int64_t nranges;
  const AdamHypers* hypers;
  int64_t window;
  int64_t* bad;
};

template <typename Grad, bool kScale>
void step_blocks(const Step& s, int64_t lo, int64_t hi) {
  const Grad* grad = static_cast<const Grad*>(s.grad);
  std::vector<float> m(s.block), v(s.block);
  const Range* r = std::lower_bound(s.ranges, s.ranges + s.nranges, lo,
                                    [](const Range& range, int64_t at) { return range.end <= at; });
  const Range* last = s.ranges + s.nranges;
  for (int64_t a = lo; a < hi; a += s.block) {
    const int64_t b = std::min(hi, a + s.block), count = b - a, k = a / s.block;
    if (s.int8) {
      decode_codes(static_cast<const uint8_t*>(s.avg.stored) + a, s.avg.absmax[k], s.avg.values, m.data(), count);
      decode_codes(static_cast<const uint8_t*>(s.sq.stored) + a, s.sq.absmax[k], s.sq.values, v.data(), count);
    } else {
      decode_bf16(static_cast<const uint16_t*>(s.avg.stored) + a, m.data(), count);
      decode_bf16(static_cast<const uint16_t*>(s.sq.stored) + a, v.data(), count);
    }
    while (r < last && r->end <= a) ++r;
    for (const Range* q = r; q < last && q->start < b; ++q) {
      const int64_t x = std::max(a, q->start), y = std::min(b, q->end), mid = std::max(x, std::min(y, q->vector_end));
      const AdamHypers& h = s.hypers[q->group];
      step_run<Grad, kScale, true>(s.param + x, grad + x, s.scale, m.data() + (x - a), v.data() + (x - a), mid - x, h);
      step_run<Grad, kScale, false>(s.param + mid, grad + mid, s.scale, m.data() + (mid - a), v.data() + (mid - a), y - mid, h);
    }
    if (s.int8) {
      int64_t bad_avg = encode_codes<true>(m.data(), count, s.avg.offsets, static_cast<uint8_t*>(s.avg.stored) + a, s.avg.absmax + k);
      int64_t bad_sq = encode_codes<false>(v.data(), count, s.sq.offsets, static_cast<uint8_t*>(s.sq.stored) + a, s.sq.absmax + k);
      if (bad_avg) __atomic_fetch_add(s.bad + 2 * (a / s.window), bad_avg, __ATOMIC_RELAXED);
      if (bad_sq) __atomic_fetch_add(s.bad + 2 * (a / s.window) + 1, bad_sq, __ATOMIC_RELAXED);
    } else {
      encode_bf16(m.data(), static_cast<uint16_t*>(s.avg.stored) + a, count);
      encode_bf16(v.data(), static_cast<uint16_t*>(s.sq.stored) + a, count);
    }
    if (s.cast) encode_bf16(s.param + a, s.cast + a, count);
  }
}

}  // namespace

extern "C" {

// One step of n fp32 parameters in place over moments stored as int8 codes (`int8`, `block` elements an
// absmax) or bf16, decoded, stepped and encoded `block` elements at a time. `ranges` holds `nranges`
// (start, end, vector_end, group) in order: each element is stepped with its group's `lrs` and
// `weight_decays` in torch's lanes before vector_end, its scalar tail after; elements of no range
// are decoded and encoded only. The gradient is fp32 or bf16 (`grad_bf16`), times `scale` when it is
// not 1; `cast`, when not null, receives the new parameters in bf16. int8 moments that come out inf
// or NaN are left as they were, their count added to `bad` at 2 x (element / window) for exp_avg,
// one more for exp_avg_sq; the return value is their total.
int64_t tz_adam_moments(float* param, const void* grad, int grad_bf16, float scale, uint16_t* cast, int64_t n,
                        int int8, int64_t block, void* avg, float* avg_absmax, const float* avg_values,
                        const int32_t* avg_offsets, void* sq, float* sq_absmax, const float* sq_values,
                        const int32_t* sq_offsets, const int64_t* ranges, int64_t nranges, const double* lrs,
                        const double* weight_decays, int64_t ngroups, int adamw, double beta1, double beta2,
                        double eps, double step, int64_t window, int64_t* bad, int threads) {
  std::vector<AdamHypers> hypers;
  for (int64_t i = 0; i < ngroups; ++i)
    hypers.push_back(tz::adam_hypers(adamw != 0, lrs[i], beta1, beta2, weight_decays[i], eps, step));
  static_assert(sizeof(Range) == 4 * sizeof(int64_t), "a range is four int64");
  Step s{param, grad, scale, cast, int8 != 0, block, Moment{avg, avg_absmax, avg_values, avg_offsets},
         Moment{sq, sq_absmax, sq_values, sq_offsets}, reinterpret_cast<const Range*>(ranges), nranges,
         hypers.data(), window, bad};
  bool scaled = scale != 1.0f;
  auto run = grad_bf16 ? (scaled ? step_blocks<uint16_t, true> : step_blocks<uint16_t, false>)
                       : (scaled ? step_blocks<float, true> : step_blocks<float, false>);
  int64_t total = 0;
  tz::parallel(n, threads, block, [&](int64_t lo, int64_t hi) { run(s, lo, hi); });
  if (int8)
    for (int64_t i = 0; i < 2 * ((n + window - 1) / window); ++i) total += bad[i];
  return total;
}

}  // extern "C"
