// The sum of a gradient slice's squares for the norm, in the order `native/squares.py` defines
// ([Note: the squares' order]): 32 fp64 lanes a block of 65536 elements, each lane summed in
// element order; a block's lanes summed in lane order, the blocks' sums in block order. The
// landing's variant writes `src + 0.0` as it goes and sums the squares of what it wrote.
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kLanes = 32;
constexpr int64_t kBlock = int64_t(1) << 16;
// state: the current block's lanes, the total of the blocks closed so far, the current block's index.
constexpr int kTotal = kLanes, kIndex = kLanes + 1;

inline double wide(uint16_t h) { return double(tz::bf16_to_float(h)); }
inline double wide(float f) { return double(f); }

// Zero plus a value, as the landing writes it (convert.cpp's kernels, the same bits as torch's add).
inline uint16_t plus_zero(uint16_t h) {
  if ((h & 0x7fffu) > 0x7f80u) return 0xffffu;
  return h == 0x8000u ? uint16_t(0) : h;
}
inline float plus_zero(float f) { return f + 0.0f; }

// One element: landed (with `out`) and its square added to `lane`.
template <typename T>
inline void add_one(const T* x, T* out, int64_t k, double* lane) {
  T v = x[k];
  if (out) out[k] = v = plus_zero(v);
  double w = wide(v);
  *lane += w * w;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr int64_t kAhead = 16;  // rows prefetched ahead: the hardware's prefetcher alone left half the bandwidth unused

// The landed gradient is written past the caches where its rows are whole lines (the step reads it
// a forward later, and a plain store would first read every line it writes); then fenced.

// Lanes 8k to 8k + 7 are `acc[k]`: element `l` of a row of 32 goes to lane `l`.
inline void add_squares(__m512 f, __m512d& lo, __m512d& hi) {
  __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(f)), b = _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1));
  lo = _mm512_add_pd(lo, _mm512_mul_pd(a, a));
  hi = _mm512_add_pd(hi, _mm512_mul_pd(b, b));
}

inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

void add_rows(const uint16_t* x, uint16_t* out, int64_t rows, double* lanes) {
  __m512d acc[4];
  for (int k = 0; k < 4; ++k) acc[k] = _mm512_loadu_pd(lanes + 8 * k);
  bool streams = out && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  const __m512i magnitude = _mm512_set1_epi16(0x7fff), inf = _mm512_set1_epi16(0x7f80), negative_zero = _mm512_set1_epi16(-0x8000);
  for (int64_t r = 0; r < rows; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(x + (r + kAhead) * kLanes), _MM_HINT_T0);
    __m512i v = _mm512_loadu_si512(x + r * kLanes);
    if (out) {  // plus_zero: every NaN becomes 0xffff, -0.0 becomes +0.0
      __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(v, magnitude), inf);
      __mmask32 zero = _mm512_cmpeq_epi16_mask(v, negative_zero);
      v = _mm512_mask_mov_epi16(v, nan, _mm512_set1_epi16(-1));
      v = _mm512_mask_mov_epi16(v, zero, _mm512_setzero_si512());
      if (streams) _mm512_stream_si512(reinterpret_cast<__m512i*>(out + r * kLanes), v);
      else _mm512_storeu_si512(out + r * kLanes, v);
    }
    add_squares(widen16(_mm512_castsi512_si256(v)), acc[0], acc[1]);
    add_squares(widen16(_mm512_extracti64x4_epi64(v, 1)), acc[2], acc[3]);
  }
  for (int k = 0; k < 4; ++k) _mm512_storeu_pd(lanes + 8 * k, acc[k]);
  if (streams) _mm_sfence();
}

void add_rows(const float* x, float* out, int64_t rows, double* lanes) {
  __m512d acc[4];
  for (int k = 0; k < 4; ++k) acc[k] = _mm512_loadu_pd(lanes + 8 * k);
  bool streams = out && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  for (int64_t r = 0; r < rows; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(x + (r + kAhead) * kLanes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(x + (r + kAhead) * kLanes + 16), _MM_HINT_T0);
    __m512 a = _mm512_loadu_ps(x + r * kLanes), b = _mm512_loadu_ps(x + r * kLanes + 16);
    if (out) {
      a = _mm512_add_ps(a, _mm512_setzero_ps());
      b = _mm512_add_ps(b, _mm512_setzero_ps());
      if (streams) {
        _mm512_stream_ps(out + r * kLanes, a);
        _mm512_stream_ps(out + r * kLanes + 16, b);
      } else {
        _mm512_storeu_ps(out + r * kLanes, a);
        _mm512_storeu_ps(out + r * kLanes + 16, b);
      }
    }
    add_squares(a, acc[0], acc[1]);
    add_squares(b, acc[2], acc[3]);
  }
  for (int k = 0; k < 4; ++k) _mm512_storeu_pd(lanes + 8 * k, acc[k]);
  if (streams) _mm_sfence();
}
#else
// Rows of `kLanes` elements, element `l` of each into lane `l`.
template <typename T>
void add_rows(const T* __restrict x, T* __restrict out, int64_t rows, double* __restrict lanes) {
  double acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = lanes[l];
  for (int64_t r = 0; r < rows; ++r) {
    T v[kLanes];
    for (int l = 0; l < kLanes; ++l) v[l] = out ? plus_zero(x[r * kLanes + l]) : x[r * kLanes + l];
    if (out) std::memcpy(out + r * kLanes, v, sizeof(v));
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      double w = wide(v[l]);
      acc[l] += w * w;
    }
  }
  for (int l = 0; l < kLanes; ++l) lanes[l] = acc[l];
}
#endif

// Adds the squares of x[0, n) (slice elements `at` on, all in one block) to `lanes`; with `out`,
// writes `plus_zero` of each element there and squares that. A square of a bf16 or fp32 value is
// exact in fp64, so a fused multiply-add would give the same bits.
template <typename T>
void add_lanes(const T* x, T* out, int64_t n, int64_t at, double* lanes) {
  int64_t head = std::min(n, (kLanes - at % kLanes) % kLanes);
  for (int64_t k = 0; k < head; ++k) add_one(x, out, k, lanes + (at + k) % kLanes);
  int64_t rows = (n - head) / kLanes;
  add_rows(x + head, out ? out + head : nullptr, rows, lanes);
  for (int64_t k = head + rows * kLanes; k < n; ++k) add_one(x, out, k, lanes + (at + k) % kLanes);
}

// Adds the current block's lane sum to the total and starts the lanes again.
void close_block(double* state) {
  double sum = 0.0;
  for (int l = 0; l < kLanes; ++l) {
    sum += state[l];
    state[l] = 0.0;
  }
  state[kTotal] += sum;
}

// Slice elements [at, at + n) from x (into out, for the landing), `at` at or past the state's position.
template <typename T>
void squares(const T* x, T* out, int64_t n, int64_t at, double* state, int threads) {
  int64_t end = at + n;
  if (n <= 0) return;
  int64_t block = at / kBlock;
  if (block != int64_t(state[kIndex])) {
    close_block(state);
    state[kIndex] = double(block);
  }
  int64_t first = std::min(end, (block + 1) * kBlock);
  add_lanes(x, out, first - at, at, state);
  if (first == end) return;
  // Whole blocks from `first` on, summed apart (on `threads`), then added in block order.
  close_block(state);
  int64_t whole = (end - first) / kBlock;
  std::vector<double> sums(whole, 0.0);
  int64_t skip = first - at;
  tz::parallel(whole * kBlock, threads, kBlock, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo / kBlock; b < hi / kBlock; ++b) {
      double lanes[kLanes] = {};
      int64_t k = skip + b * kBlock;
      add_lanes(x + k, out ? out + k : nullptr, kBlock, 0, lanes);
      double sum = 0.0;
      for (int l = 0; l < kLanes; ++l) sum += lanes[l];
      sums[b] = sum;
    }
  });
  for (int64_t b = 0; b < whole; ++b) state[kTotal] += sums[b];
  int64_t last = first + whole * kBlock;
  state[kIndex] = double(last / kBlock);
  if (last < end) add_lanes(x + (last - at), out ? out + (last - at) : nullptr, end - last, last, state);
}

}  // namespace

extern "C" {

// Adds the squares of `n` slice elements from `at` on to `state` (see squares.py).
void tz_squares_bf16(const uint16_t* x, int64_t n, int64_t at, double* state, int threads) {
  squares<uint16_t>(x, nullptr, n, at, state, threads);
}

void tz_squares_f32(const float* x, int64_t n, int64_t at, double* state, int threads) {
  squares<float>(x, nullptr, n, at, state, threads);
}

// out = src + 0.0 (the landing), and the squares of out added to `state`.
void tz_land_squares_bf16(const uint16_t* src, uint16_t* out, int64_t n, int64_t at, double* state, int threads) {
  squares<uint16_t>(src, out, n, at, state, threads);
}

void tz_land_squares_f32(const float* src, float* out, int64_t n, int64_t at, double* state, int threads) {
  squares<float>(src, out, n, at, state, threads);
}

}  // extern "C"
