// The sum of a gradient slice's squares for the norm, in the order `native/squares.py` defines
// ([Note: the squares' order]): a block of 65536 elements spread over lanes, each lane summed in
// element order (fp32 values: 1024 lanes in fp64; bf16 values: 128 lanes in fp32, where their squares
// are exact); a block's lanes summed in fp64 in lane order, the blocks' sums in block order. The
// landing's variant writes `src + 0.0` as it goes and sums the squares of what it wrote.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kLanes = 1024;  // the state's lane slots: fp32 values use them all, bf16 values the first 128
constexpr int64_t kBlock = int64_t(1) << 16;
// state: the current block's lanes, the total of the blocks closed so far, the current block's index.
constexpr int kTotal = kLanes, kIndex = kLanes + 1;

// A lane's arithmetic for an element type. fp32: 1024 lanes in fp64 (a square is exact there). bf16:
// 128 lanes in fp32 (a square has at most 16 significant bits, exact in fp32), few enough to stay in
// registers while a block is read in element order. The state keeps every lane in fp64, which holds
// an fp32 lane exactly.
template <typename T>
struct Lane;
template <>
struct Lane<uint16_t> {
  using type = float;
  static constexpr int64_t kCount = 128;
  static float wide(uint16_t h) { return tz::bf16_to_float(h); }
};
template <>
struct Lane<float> {
  using type = double;
  static constexpr int64_t kCount = kLanes;
  static double wide(float f) { return double(f); }
};

// One element: landed (with `out`) and its square added to `lane`.
template <typename T>
inline void add_one(const T* x, T* out, int64_t k, double* lane) {
  using Acc = typename Lane<T>::type;
  T v = x[k];
  if (out) out[k] = v = tz::plus_zero(v);
  Acc w = Lane<T>::wide(v);
  *lane = double(Acc(*lane) + w * w);
}

// Rows of `Lane<T>::kCount` elements from x, element `l` of each into lane `l`, a row at a time; with
// `out`, each row is landed there first and its landed values are squared. The next rows' lines are
// asked for ahead: the hardware's prefetcher alone left half a core's bandwidth unused.
template <typename T>
void add_rows(const T* __restrict x, T* __restrict out, int64_t rows, double* __restrict state) {
  using Acc = typename Lane<T>::type;
  constexpr int64_t kCount = Lane<T>::kCount, kLine = 64 / int64_t(sizeof(T)), kAhead = 2 * kLanes;
  alignas(64) T landed[kCount];
  alignas(64) Acc lanes[kCount];
  for (int64_t l = 0; l < kCount; ++l) lanes[l] = Acc(state[l]);
  bool streamed = false;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * kCount;
    for (int64_t i = 0; i < kCount; i += kLine) __builtin_prefetch(row + kAhead + i);
    if (out) {
#pragma omp simd
      for (int64_t l = 0; l < kCount; ++l) landed[l] = tz::plus_zero(row[l]);
      for (int64_t i = 0; i < kCount; i += kLine) streamed |= tz::store_line(out + r * kCount + i, landed + i);
      row = landed;
    }
#pragma omp simd
    for (int64_t l = 0; l < kCount; ++l) {
      Acc w = Lane<T>::wide(row[l]);
      lanes[l] += w * w;
    }
  }
  for (int64_t l = 0; l < kCount; ++l) state[l] = double(lanes[l]);
  if (streamed) tz::stream_fence();
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// fp32 values' rows again, with a chunk of 128 lanes at a time held in 16 registers across all the rows
// (a lane's adds stay in element order: the same bits). A row at a time loaded and stored every lane for
// every row, 0.45 cycles an element on the dev VM, twice the memory's time. The chunk's pass reads 64
// rows 4 KiB apart, so the same lines of the next block are asked for meanwhile, into L2.
constexpr int64_t kChunk = 128;

// 16 values' squares added to the lanes of `lo` (the first 8) and `hi`, in fp64. The square is exact,
// so a fused multiply-add rounds once, as the add alone does: the same bits in fewer instructions.
inline void add_squares(__m512 f, __m512d& lo, __m512d& hi) {
  __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
  __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
  lo = _mm512_fmadd_pd(a, a, lo);
  hi = _mm512_fmadd_pd(b, b, hi);
}

void add_rows_chunked(const float* __restrict x, float* __restrict out, int64_t rows, double* __restrict lanes) {
  constexpr int64_t kLine = 16, kLines = kChunk / kLine;
  const int64_t next = rows * kLanes;
  bool streamed = false;
  for (int64_t c = 0; c < kLanes; c += kChunk) {
    __m512d acc[kChunk / 8];
#pragma GCC unroll 16
    for (int j = 0; j < kChunk / 8; ++j) acc[j] = _mm512_loadu_pd(lanes + c + 8 * j);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x + r * kLanes + c;
#pragma GCC unroll 8
      for (int64_t k = 0; k < kLines; ++k) {
        __builtin_prefetch(row + next + k * kLine, 0, 2);
        __m512 v = _mm512_loadu_ps(row + k * kLine);
        if (out) {
          v = _mm512_add_ps(v, _mm512_setzero_ps());
          streamed |= tz::store_vector(out + r * kLanes + c + k * kLine, _mm512_castps_si512(v));
        }
        add_squares(v, acc[2 * k], acc[2 * k + 1]);
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < kChunk / 8; ++j) _mm512_storeu_pd(lanes + c + 8 * j, acc[j]);
  }
  if (streamed) tz::stream_fence();
}

inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// A line of bf16 values landed: `plus_zero` of each (-0 to +0, every NaN to 0xffff).
inline __m512i land_bf16(__m512i v) {
  __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(v, _mm512_set1_epi16(0x7fff)), _mm512_set1_epi16(0x7f80));
  v = _mm512_mask_mov_epi16(v, nan, _mm512_set1_epi16(-1));
  return _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(v, _mm512_set1_epi16(int16_t(0x8000))), _mm512_setzero_si512());
}

// bf16 rows of 128 values of `kCount` blocks side by side (two: two streams from memory, which this
// VM's cores need to read at its speed: 0.73 against 0.77 ms for 25 MB on two threads, and the 1024
// lanes' chunks above 0.97 ms), each block's 128 fp32 lanes in 8 registers (16 values a register, in
// element order: a square is exact in fp32, so the fused multiply-add rounds once, as the add does).
// lanes[c]: block c's 128 lanes, fp32 values kept in fp64.
template <int kCount>
void narrow_rows(const uint16_t* const* x, uint16_t* const* out, int64_t rows, double* const* lanes) {
  __m512 acc[kCount][8];
  for (int c = 0; c < kCount; ++c) {
    for (int j = 0; j < 8; ++j) {
      __m256 a = _mm512_cvtpd_ps(_mm512_loadu_pd(lanes[c] + 16 * j));
      __m256 b = _mm512_cvtpd_ps(_mm512_loadu_pd(lanes[c] + 16 * j + 8));
      acc[c][j] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b), 1));
    }
  }
  bool streamed = false;
  for (int64_t r = 0; r < rows; ++r) {
#pragma GCC unroll 2
    for (int c = 0; c < kCount; ++c) {
      const uint16_t* row = x[c] + r * 128;
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        __m512i v = _mm512_loadu_si512(row + 32 * k);
        if (out[c]) {
          v = land_bf16(v);
          streamed |= tz::store_vector(out[c] + r * 128 + 32 * k, v);
        }
        __m512 lo = widen16(_mm512_castsi512_si256(v)), hi = widen16(_mm512_extracti64x4_epi64(v, 1));
        acc[c][2 * k] = _mm512_fmadd_ps(lo, lo, acc[c][2 * k]);
        acc[c][2 * k + 1] = _mm512_fmadd_ps(hi, hi, acc[c][2 * k + 1]);
      }
    }
  }
  for (int c = 0; c < kCount; ++c) {
    for (int j = 0; j < 8; ++j) {
      _mm512_storeu_pd(lanes[c] + 16 * j, _mm512_cvtps_pd(_mm512_castps512_ps256(acc[c][j])));
      _mm512_storeu_pd(lanes[c] + 16 * j + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[c][j]), 1))));
    }
  }
  if (streamed) tz::stream_fence();
}
#endif

// Full rows of x into the lanes, the fastest way this build has.
inline void rows_into(const float* x, float* out, int64_t rows, double* lanes) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  add_rows_chunked(x, out, rows, lanes);
#else
  add_rows(x, out, rows, lanes);
#endif
}
inline void rows_into(const uint16_t* x, uint16_t* out, int64_t rows, double* lanes) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  narrow_rows<1>(&x, &out, rows, &lanes);
#else
  add_rows(x, out, rows, lanes);
#endif
}

// Adds the squares of x[0, n) (slice elements `at` on, all in one block) to `lanes`; with `out`,
// writes `plus_zero` of each element there and squares that.
template <typename T>
void add_lanes(const T* x, T* out, int64_t n, int64_t at, double* lanes) {
  constexpr int64_t kCount = Lane<T>::kCount;
  int64_t head = std::min(n, (kCount - at % kCount) % kCount);
  for (int64_t k = 0; k < head; ++k) add_one(x, out, k, lanes + (at + k) % kCount);
  int64_t rows = (n - head) / kCount;
  rows_into(x + head, out ? out + head : nullptr, rows, lanes);
  for (int64_t k = head + rows * kCount; k < n; ++k) add_one(x, out, k, lanes + (at + k) % kCount);
}

// A block's first `count` lanes added in lane order from zero (the rest are zeros, which add nothing).
double lanes_sum(const double* lanes, int64_t count = kLanes) {
  double sum = 0.0;
  for (int64_t l = 0; l < count; ++l) sum += lanes[l];
  return sum;
}

// Adds the current block's sum to the total and starts the lanes again.
void close_block(double* state) {
  state[kTotal] += lanes_sum(state);
  std::fill(state, state + kLanes, 0.0);
}

// The sums of whole blocks [b, end) of x into sums[b, end); bf16 blocks two at a time where the
// build reads them as two streams.
template <typename T>
void blocks_sum(const T* x, T* out, int64_t b, int64_t end, double* sums) {
  constexpr int64_t kCount = Lane<T>::kCount;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    for (; b + 1 < end; b += 2) {
      alignas(64) double lanes[2][kCount] = {};
      const uint16_t* xs[2] = {x + b * kBlock, x + (b + 1) * kBlock};
      uint16_t* outs[2] = {out ? out + b * kBlock : nullptr, out ? out + (b + 1) * kBlock : nullptr};
      double* into[2] = {lanes[0], lanes[1]};
      narrow_rows<2>(xs, outs, kBlock / kCount, into);
      sums[b] = lanes_sum(lanes[0], kCount);
      sums[b + 1] = lanes_sum(lanes[1], kCount);
    }
  }
#endif
  for (; b < end; ++b) {
    alignas(64) double lanes[kCount] = {};
    add_lanes(x + b * kBlock, out ? out + b * kBlock : nullptr, kBlock, 0, lanes);
    sums[b] = lanes_sum(lanes, kCount);
  }
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
    blocks_sum(x + skip, out ? out + skip : nullptr, lo / kBlock, hi / kBlock, sums.data());
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

// Ranges in one call: xs[i] holds its `ns[i]` elements from `ats[i]` on, added into states[i] as
// tz_squares_* adds it alone; the ranges of one state come in increasing order (a unit's gradient
// pieces, or every held unit's, each unit with its own state).
void tz_squares_pieces_bf16(const uint16_t* const* xs, const int64_t* ns, const int64_t* ats, int64_t count,
                            double* const* states, int threads) {
  for (int64_t i = 0; i < count; ++i) squares<uint16_t>(xs[i], nullptr, ns[i], ats[i], states[i], threads);
}

void tz_squares_pieces_f32(const float* const* xs, const int64_t* ns, const int64_t* ats, int64_t count,
                           double* const* states, int threads) {
  for (int64_t i = 0; i < count; ++i) squares<float>(xs[i], nullptr, ns[i], ats[i], states[i], threads);
}

// The sum so far: the closed blocks' total plus the current block's lanes added in lane order.
double tz_squares_total(const double* state) { return state[kTotal] + lanes_sum(state); }

}  // extern "C"
