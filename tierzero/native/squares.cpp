// The sum of a gradient slice's squares for the norm, in the order `native/squares.py` defines
// ([Note: the squares' order]): 1024 fp64 lanes a block of 65536 elements, each lane summed in
// element order; a block's lanes summed in lane order, the blocks' sums in block order. The
// landing's variant writes `src + 0.0` as it goes and sums the squares of what it wrote.
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kLanes = 1024;
constexpr int64_t kBlock = int64_t(1) << 16;
// state: the current block's lanes, the total of the blocks closed so far, the current block's index.
constexpr int kTotal = kLanes, kIndex = kLanes + 1;

inline double wide(uint16_t h) { return double(tz::bf16_to_float(h)); }
inline double wide(float f) { return double(f); }

// One element: landed (with `out`) and its square added to `lane`.
template <typename T>
inline void add_one(const T* x, T* out, int64_t k, double* lane) {
  T v = x[k];
  if (out) out[k] = v = tz::plus_zero(v);
  double w = wide(v);
  *lane += w * w;
}

// out[0, kLanes) = row, a line at a time (`tz::store_line`: past the caches where `out` is aligned,
// as the step reads the landed gradient a forward later). Whether any line was streamed.
template <typename T>
inline bool copy_out(T* __restrict out, const T* __restrict row) {
  constexpr int64_t kLine = 64 / int64_t(sizeof(T));
  bool streamed = false;
  for (int64_t i = 0; i < kLanes; i += kLine) streamed |= tz::store_line(out + i, row + i);
  return streamed;
}

// Rows of `kLanes` elements from x, element `l` of each into lane `l`, a row at a time; with `out`,
// each row is landed there first and its landed values are squared. The next rows' lines are asked
// for ahead: the hardware's prefetcher alone left half a core's bandwidth unused.
template <typename T>
void add_rows(const T* __restrict x, T* __restrict out, int64_t rows, double* __restrict lanes) {
  constexpr int64_t kLine = 64 / int64_t(sizeof(T)), kAhead = 2 * kLanes;
  alignas(64) T landed[kLanes];
  bool streamed = false;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * kLanes;
    for (int64_t i = 0; i < kLanes; i += kLine) __builtin_prefetch(row + kAhead + i);
    if (out) {
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) landed[l] = tz::plus_zero(row[l]);
      streamed |= copy_out(out + r * kLanes, landed);
      row = landed;
    }
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      double w = wide(row[l]);
      lanes[l] += w * w;
    }
  }
  if (streamed) tz::stream_fence();
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The rows again, with a chunk of 128 lanes at a time held in 16 registers across all the rows (a lane's
// adds stay in element order: the same bits). A row at a time loaded and stored every lane for every
// row, 0.45 cycles an element on the dev VM, twice the memory's time. The chunk's pass reads 64 rows
// 2 KiB apart, so the same lines of the next block are asked for meanwhile, into L2.
constexpr int64_t kChunk = 128;

// 16 values' squares added to the lanes of `lo` (the first 8) and `hi`, in fp64. The square is exact,
// so a fused multiply-add rounds once, as the add alone does: the same bits in fewer instructions.
inline void add_squares(__m512 f, __m512d& lo, __m512d& hi) {
  __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
  __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
  lo = _mm512_fmadd_pd(a, a, lo);
  hi = _mm512_fmadd_pd(b, b, hi);
}

// A line's `plus_zero`, and its squares added to the lanes of `acc` (8 lanes a register).
inline __m512i land_line(__m512i v, uint16_t) {
  __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(v, _mm512_set1_epi16(0x7fff)), _mm512_set1_epi16(0x7f80));
  v = _mm512_mask_mov_epi16(v, nan, _mm512_set1_epi16(-1));
  return _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(v, _mm512_set1_epi16(int16_t(0x8000))), _mm512_setzero_si512());
}
inline __m512i land_line(__m512i v, float) { return _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(v), _mm512_setzero_ps())); }

inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline void square_line(__m512i v, uint16_t, __m512d* acc) {
  add_squares(widen16(_mm512_castsi512_si256(v)), acc[0], acc[1]);
  add_squares(widen16(_mm512_extracti64x4_epi64(v, 1)), acc[2], acc[3]);
}
inline void square_line(__m512i v, float, __m512d* acc) { add_squares(_mm512_castsi512_ps(v), acc[0], acc[1]); }

template <typename T>
void add_rows_chunked(const T* __restrict x, T* __restrict out, int64_t rows, double* __restrict lanes) {
  constexpr int64_t kLine = 64 / int64_t(sizeof(T)), kLines = kChunk / kLine, kPerLine = kLine / 8;
  const int64_t next = rows * kLanes;
  bool streamed = false;
  for (int64_t c = 0; c < kLanes; c += kChunk) {
    __m512d acc[kChunk / 8];
#pragma GCC unroll 16
    for (int j = 0; j < kChunk / 8; ++j) acc[j] = _mm512_loadu_pd(lanes + c + 8 * j);
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = x + r * kLanes + c;
#pragma GCC unroll 8
      for (int64_t k = 0; k < kLines; ++k) {
        __builtin_prefetch(row + next + k * kLine, 0, 2);
        __m512i v = _mm512_loadu_si512(row + k * kLine);
        if (out) {
          v = land_line(v, T{});
          streamed |= tz::store_vector(out + r * kLanes + c + k * kLine, v);
        }
        square_line(v, T{}, acc + k * kPerLine);
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < kChunk / 8; ++j) _mm512_storeu_pd(lanes + c + 8 * j, acc[j]);
  }
  if (streamed) tz::stream_fence();
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
#if defined(__AVX512F__) && defined(__AVX512BW__)
  add_rows_chunked(x + head, out ? out + head : nullptr, rows, lanes);
#else
  add_rows(x + head, out ? out + head : nullptr, rows, lanes);
#endif
  for (int64_t k = head + rows * kLanes; k < n; ++k) add_one(x, out, k, lanes + (at + k) % kLanes);
}

// A block's lanes added in lane order from zero.
double lanes_sum(const double* lanes) {
  double sum = 0.0;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// Adds the current block's sum to the total and starts the lanes again.
void close_block(double* state) {
  state[kTotal] += lanes_sum(state);
  std::fill(state, state + kLanes, 0.0);
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
      alignas(64) double lanes[kLanes] = {};
      int64_t k = skip + b * kBlock;
      add_lanes(x + k, out ? out + k : nullptr, kBlock, 0, lanes);
      sums[b] = lanes_sum(lanes);
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

// The sum so far: the closed blocks' total plus the current block's lanes added in lane order.
double tz_squares_total(const double* state) { return state[kTotal] + lanes_sum(state); }

}  // extern "C"
