// A quantized frozen base (NF4 or int8) dequantized into the compute dtype in one pass, bit for bit
// as tierzero/units/quantized_base.py's torch path decodes it.
//
// Every value is the code's fp32 value times its block's fp32 scale, rounded once to fp32, then
// once to the output dtype, as `torch.mul(fp32, fp32, out=bf16)` does; built with
// `-ffp-contract=off` (tierzero/native/build.py) so that no step is fused. A double-quantized
// absmax is rebuilt first as `QuantizedAbsmax.dequantize` does it: the dynamic code's value times
// its 256-block's scale, rounded, plus the offset, rounded. The stored scales are checked before
// anything is written; a bad one (not finite, or < 0) makes the call return 1 and write nothing, and
// the caller's torch path then raises its error. Only a double-quantized absmax rebuilt out of range
// (not finite) leaves a piece to the torch path half written.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

using tz::bits_of;
using tz::float_of;

constexpr int64_t kBlock = 64;         // elements a scale, NF4 and int8
constexpr int64_t kAbsmaxBlock = 256;  // double-quantized absmax codes a scale
constexpr int64_t kBlocksAChunk = 256;  // blocks whose absmax are rebuilt at a time, on the stack

inline float load_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

inline bool valid_scale(float s) { return std::isfinite(s) && s >= 0.0f; }

// fp32 to fp16, rounded to nearest even, as c10::Half does it (fp16_ieee_from_fp32_value).
inline uint16_t float_to_f16(float f) {
  const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = bits_of(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits_of(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

struct ToF32 {
  using T = float;
  static T put(float f) { return f; }
};
struct ToBF16 {
  using T = uint16_t;
  static T put(float f) { return tz::float_to_bf16(f); }
};
struct ToF16 {
  using T = uint16_t;
  static T put(float f) { return float_to_f16(f); }
};

// The absmax of blocks [lo, hi) into `into`: stored fp32, or rebuilt from double-quantized codes.
struct Absmax {
  const uint8_t* floats;     // fp32 absmax (unaligned); null when double-quantized
  const uint8_t* codes;      // one uint8 dynamic code a block
  const uint8_t* scales;     // fp32 a 256 blocks (unaligned)
  const float* dynamic;      // the signed dynamic code's 256 values
  float offset;

  // False where a rebuilt absmax is not finite (an offset near the fp32 limit): its products could be
  // NaN, whose bits torch's casts and these do not share, so the piece is left to the torch path.
  bool get(int64_t lo, int64_t hi, float* into) const {
    if (floats != nullptr) {
      std::memcpy(into, floats + 4 * lo, size_t(4 * (hi - lo)));
      return true;
    }
    bool finite = true;
    for (int64_t b = lo; b < hi; ++b) {
      const float centred = dynamic[codes[b]] * load_f32(scales + 4 * (b / kAbsmaxBlock));
      into[b - lo] = centred + offset;
      finite &= std::isfinite(into[b - lo]);
    }
    return finite;
  }
};

#if defined(__AVX512BF16__)
// Scales at least this large give every nonzero product a normal fp32 value: NF4's smallest nonzero
// code is 0.0796 (> 1/16), an int8 code at least 1. `_mm512_cvtneps_pbh` rounds a normal value to
// nearest even as `tz::float_to_bf16` does, but reads a subnormal as zero, so a block with a smaller
// scale goes the portable way. No product is NaN: the scales are checked finite first.
constexpr float kNf4NormalScale = 0x1.0p-122f;
constexpr float kInt8NormalScale = 0x1.0p-126f;

// 32 products rounded to bf16 in registers, into one cache line: streamed past the caches where the
// line is aligned (`tz::store_vector`: a unit's decoded weights are read next by a matmul, long after
// they would have been evicted).
inline void store_bf16_line(uint16_t* o, __m512 lo, __m512 hi) { tz::store_vector(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)); }
#endif

#if defined(__AVX512F__)
// One whole block: its 32 bytes with each byte doubled, shifted by 4 or 0 bits in turn to leave the
// element's nibble in the low bits, which are all `_mm512_permutexvar_ps` reads of an index: a
// 16-entry lookup a vector. Into bf16 the products are rounded in registers (`store_bf16_line`); else
// they go through L1 to the portable rounding loop.
template <typename Out>
inline void nf4_block(const uint8_t* __restrict c, float s, const float* table, typename Out::T* __restrict o) {
  const __m512 values = _mm512_loadu_ps(table), scale = _mm512_set1_ps(s);
  const __m512i shifts = _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  __m512 product[4];
  for (int h = 0; h < 2; ++h) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * h));
    const __m128i pairs[2] = {_mm_unpacklo_epi8(bytes, bytes), _mm_unpackhi_epi8(bytes, bytes)};
    for (int q = 0; q < 2; ++q) {
      const __m512i index = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(pairs[q]), shifts);
      product[2 * h + q] = _mm512_mul_ps(_mm512_permutexvar_ps(index, values), scale);
    }
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Out, ToBF16>) {
    if (s >= kNf4NormalScale) {
      store_bf16_line(o, product[0], product[1]);
      store_bf16_line(o + 32, product[2], product[3]);
      return;
    }
  }
#endif
  alignas(64) float prod[kBlock];
  for (int k = 0; k < 4; ++k) _mm512_store_ps(prod + 16 * k, product[k]);
#pragma omp simd
  for (int j = 0; j < kBlock; ++j) o[j] = Out::put(prod[j]);
}
#else
template <typename Out>
inline void nf4_block(const uint8_t* __restrict c, float s, const float* table, typename Out::T* __restrict o) {
#pragma omp simd
  for (int j = 0; j < kBlock / 2; ++j) {
    const uint8_t byte = c[j];
    o[2 * j] = Out::put(table[byte >> 4] * s);
    o[2 * j + 1] = Out::put(table[byte & 0x0F] * s);
  }
}
#endif

// Elements [lo, hi) of one NF4 piece (lo a multiple of the block; hi of the block or n).
template <typename Out>
bool nf4_range(const uint8_t* __restrict codes, const Absmax& absmax, const float* __restrict nf4, typename Out::T* __restrict out,
               int64_t lo, int64_t hi) {
  float table[16];
  std::memcpy(table, nf4, sizeof(table));
  float scale[kBlocksAChunk];
  for (int64_t a = lo; a < hi; a += kBlocksAChunk * kBlock) {
    int64_t b = std::min(hi, a + kBlocksAChunk * kBlock);
    int64_t first = a / kBlock, blocks = (b - a + kBlock - 1) / kBlock;
    if (!absmax.get(first, first + blocks, scale)) return false;
    int64_t whole = (b - a) / kBlock;
    for (int64_t k = 0; k < whole; ++k) nf4_block<Out>(codes + (a + k * kBlock) / 2, scale[k], table, out + a + k * kBlock);
    for (int64_t i = a + whole * kBlock; i < b; ++i) {  // a short last block
      const uint8_t byte = codes[i / 2];
      out[i] = Out::put(table[i % 2 ? byte & 0x0F : byte >> 4] * scale[whole]);
    }
  }
  return true;
}

template <typename Out>
void int8_range(const int8_t* __restrict codes, const uint8_t* scales, typename Out::T* __restrict out, int64_t lo, int64_t hi) {
  for (int64_t a = lo; a < hi; a += kBlock) {
    const int64_t b = std::min(hi, a + kBlock);
    const float s = load_f32(scales + 4 * (a / kBlock));
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<Out, ToBF16>) {
      if (b - a == kBlock && s >= kInt8NormalScale) {
        const __m512 scale = _mm512_set1_ps(s);
        for (int64_t i = a; i < b; i += 32) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
          store_bf16_line(out + i, _mm512_mul_ps(lo, scale), _mm512_mul_ps(hi, scale));
        }
        continue;
      }
    }
#endif
#pragma omp simd
    for (int64_t i = a; i < b; ++i) out[i] = Out::put(float(codes[i]) * s);
  }
}

bool scales_valid(const uint8_t* scales, int64_t count) {
  bool ok = true;
  for (int64_t i = 0; i < count; ++i) ok &= valid_scale(load_f32(scales + 4 * i));
  return ok;
}

template <typename Out>
bool nf4_run(const uint8_t* codes, const Absmax& absmax, const float* nf4, void* out, int64_t n, int threads) {
  auto* o = static_cast<typename Out::T*>(out);
  std::atomic<bool> done{true};
  tz::parallel(n, threads, kBlock * kBlocksAChunk, [&](int64_t lo, int64_t hi) {
    if (!nf4_range<Out>(codes, absmax, nf4, o, lo, hi)) done = false;
    tz::stream_fence();
  });
  return done;
}

template <typename Out>
void int8_run(const uint8_t* piece, void* out, int64_t n, int threads) {
  auto* o = static_cast<typename Out::T*>(out);
  const auto* codes = reinterpret_cast<const int8_t*>(piece);
  tz::parallel(n, threads, kBlock, [&](int64_t lo, int64_t hi) {
    int8_range<Out>(codes, piece + n, o, lo, hi);
    tz::stream_fence();
  });
}

// [Note: a shared decode]
// One piece's decode shared by every thread that calls a `_shared` entry point on the same state: each
// claims the next chunk of `chunk` elements until none is left, so a thread that needs the values
// now (the compute, waiting for a unit decoded ahead) works beside the one that started them rather
// than waiting for it. With `wait`, a call returns once every chunk is done, by whichever thread:
// it spins for a chunk's time, then sleeps, which leaves its core to a decoding thread that only runs
// on idle cores. A chunk whose stored scales are bad is left unwritten and the call returns 1; the
// caller's torch path then decodes the piece again, all of it, and raises its error.
struct Shared {
  std::atomic<int64_t> next;      // the next chunk to claim
  std::atomic<int64_t> finished;  // chunks done, by any thread
  std::atomic<int> refused;       // a chunk left to the torch path
};

// `prepare` runs once a call, at its first chunk: a call that finds none left reads nothing of the
// piece, which the thread that finished it may have handed back by then.
template <typename Prepare, typename Range>
int share(void* state, int64_t n, int64_t chunk, int wait, Prepare prepare, Range range) {
  auto* s = static_cast<Shared*>(state);
  const int64_t chunks = (n + chunk - 1) / chunk;
  bool prepared = false, valid = false;
  for (int64_t i = s->next.fetch_add(1); i < chunks; i = s->next.fetch_add(1)) {
    if (!prepared) valid = prepare(), prepared = true;
    if (!valid || !range(i * chunk, std::min(n, (i + 1) * chunk))) s->refused.store(1);
    tz::stream_fence();
    s->finished.fetch_add(1, std::memory_order_release);
  }
  if (wait) {
    const auto start = std::chrono::steady_clock::now();
    while (s->finished.load(std::memory_order_acquire) < chunks) {
      if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(200)) continue;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return s->refused.load();
}

// The absmax of an NF4 piece of n elements; false where a stored scale or the offset is bad.
bool nf4_absmax(const uint8_t* piece, int64_t n, int double_quant, const float* dynamic, Absmax* absmax) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  *absmax = Absmax{nullptr, nullptr, nullptr, dynamic, 0.0f};
  if (!double_quant) {
    absmax->floats = piece + n / 2;
    return true;
  }
  const int64_t scales = (blocks + kAbsmaxBlock - 1) / kAbsmaxBlock;
  absmax->codes = piece + n / 2;
  absmax->scales = absmax->codes + blocks;
  absmax->offset = load_f32(absmax->scales + 4 * scales);
  return scales_valid(absmax->scales, scales) && std::isfinite(absmax->offset);
}

// Elements [lo, hi) of an NF4 piece, its stored fp32 absmax checked first where it has them.
template <typename Out>
bool nf4_checked(const uint8_t* piece, const Absmax& absmax, const float* nf4, void* out, int64_t lo, int64_t hi) {
  if (absmax.floats != nullptr && !scales_valid(absmax.floats + 4 * (lo / kBlock), (hi - lo + kBlock - 1) / kBlock)) return false;
  return nf4_range<Out>(piece, absmax, nf4, static_cast<typename Out::T*>(out), lo, hi);
}

template <typename Out>
bool int8_checked(const uint8_t* piece, int64_t n, void* out, int64_t lo, int64_t hi) {
  if (!scales_valid(piece + n + 4 * (lo / kBlock), (hi - lo + kBlock - 1) / kBlock)) return false;
  int8_range<Out>(reinterpret_cast<const int8_t*>(piece), piece + n, static_cast<typename Out::T*>(out), lo, hi);
  return true;
}

}  // namespace

extern "C" {

// Bytes of a shared decode's state ([Note: a shared decode]): the caller's, zeroed before the first call.
int64_t tz_shared_state_bytes() { return sizeof(Shared); }

// One NF4 piece of n elements (n even) as tierzero/units/quantized_base.py lays it out: n / 2 bytes
// of codes (the even element in the high nibble), then ceil(n / 64) fp32 absmax, or with
// `double_quant` ceil(n / 64) uint8 absmax codes, ceil(n / 16384) fp32 scales and the fp32 offset.
// `nf4` holds the 16 code values, `dynamic` the signed dynamic code's 256 (for `double_quant`).
// `out_kind`: 0 fp32, 1 bf16, 2 fp16. Returns 0, or 1 where the piece is left to the torch path: a
// stored scale is bad (nothing written), or a rebuilt absmax is not finite (some of `out` written).
int tz_dequant_nf4(const uint8_t* piece, int64_t n, int double_quant, const float* nf4, const float* dynamic, void* out,
                   int out_kind, int threads) {
  Absmax absmax;
  if (!nf4_absmax(piece, n, double_quant, dynamic, &absmax)) return 1;
  if (!double_quant && !scales_valid(absmax.floats, (n + kBlock - 1) / kBlock)) return 1;
  bool done = out_kind == 1 ? nf4_run<ToBF16>(piece, absmax, nf4, out, n, threads)
              : out_kind == 2 ? nf4_run<ToF16>(piece, absmax, nf4, out, n, threads)
                              : nf4_run<ToF32>(piece, absmax, nf4, out, n, threads);
  return done ? 0 : 1;
}

// One int8 piece of n elements: n int8 codes, then ceil(n / 64) fp32 scales. As tz_dequant_nf4 otherwise.
int tz_dequant_int8(const uint8_t* piece, int64_t n, void* out, int out_kind, int threads) {
  if (!scales_valid(piece + n, (n + kBlock - 1) / kBlock)) return 1;
  if (out_kind == 1) int8_run<ToBF16>(piece, out, n, threads);
  else if (out_kind == 2) int8_run<ToF16>(piece, out, n, threads);
  else int8_run<ToF32>(piece, out, n, threads);
  return 0;
}

// tz_dequant_nf4's piece, decoded by every thread that calls this with the same `state` ([Note: a
// shared decode]), in chunks of `chunk` elements (a multiple of 16384). Returns 0, or 1 where a chunk is
// left to the torch path (with `wait`, once every chunk is done).
int tz_dequant_nf4_shared(void* state, const uint8_t* piece, int64_t n, int double_quant, const float* nf4, const float* dynamic,
                          void* out, int out_kind, int64_t chunk, int wait) {
  Absmax absmax;
  auto prepare = [&] { return nf4_absmax(piece, n, double_quant, dynamic, &absmax); };
  return share(state, n, chunk, wait, prepare, [&](int64_t lo, int64_t hi) {
    return out_kind == 1 ? nf4_checked<ToBF16>(piece, absmax, nf4, out, lo, hi)
           : out_kind == 2 ? nf4_checked<ToF16>(piece, absmax, nf4, out, lo, hi)
                           : nf4_checked<ToF32>(piece, absmax, nf4, out, lo, hi);
  });
}

// tz_dequant_int8's piece, shared as tz_dequant_nf4_shared's.
int tz_dequant_int8_shared(void* state, const uint8_t* piece, int64_t n, void* out, int out_kind, int64_t chunk, int wait) {
  return share(state, n, chunk, wait, [] { return true; }, [&](int64_t lo, int64_t hi) {
    return out_kind == 1 ? int8_checked<ToBF16>(piece, n, out, lo, hi)
           : out_kind == 2 ? int8_checked<ToF16>(piece, n, out, lo, hi)
                           : int8_checked<ToF32>(piece, n, out, lo, hi);
  });
}

}  // extern "C"
