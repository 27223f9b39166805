// Weight-only INT8 linear layer for the CPU engine path at a few rows (decode steps).
//
//   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]  (+ bias[n])
//
// x and y are float32, w is int8 with one float32 scale per output row (symmetric,
// per channel). Each int8 weight is widened to float32 in registers (exact) and multiplied
// with the float32 activation; the sums are float32, and the row's scale multiplies the
// finished sum (a factor constant along k). So this is the dequantized fp32 product up to
// float32 rounding, with no bf16 activations and no dtype casts around the call: at decode
// sizes those casts cost as much as the product (quant/int8.py).
//
// Blocking: a tile of MR activation rows times NR weight rows keeps MR*NR accumulators of
// kLanes floats (16 on AVX-512) in registers; each weight vector is loaded and widened once per tile and used
// MR times, each activation vector NR times. GCC vector extensions for the arithmetic and
// one intrinsic per width for the widening (the compiler scalarizes a generic int8 ->
// float conversion): one zmm register a vector on AVX-512, one ymm on AVX2.
// Output rows are split over the OpenMP threads torch already runs (one when the caller
// serializes a small step). Plain C ABI, loaded with ctypes.
//
// Layout: x [M, K] row stride ldx; w [N, K] contiguous; scale [N]; bias [N] or null;
//         y [M, N] contiguous.

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

inline vf load_f(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// kLanes int8 weights widened to float32 (sign-extend, convert: both exact)
inline vf load_w(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// One MR x NR tile: rows x[0..MR) against weight rows w[0..NR), all of K.
template <int MR, int NR>
void tile(const float* x, int64_t ldx, const int8_t* w, int64_t k, const float* scale,
          const float* bias, float* y, int64_t ldy) {
  vf acc[MR][NR];  // fully unrolled: every accumulator stays in a register
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = vf{};
  const int64_t kv = k - k % kLanes;
  for (int64_t p = 0; p < kv; p += kLanes) {
    vf wv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) wv[j] = load_w(w + j * k + p);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const vf xv = load_f(x + i * ldx + p);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t p = kv; p < k; ++p) s += x[i * ldx + p] * static_cast<float>(w[j * k + p]);
      s *= scale[j];
      if (bias) s += bias[j];
      y[i * ldy + j] = s;
    }
  }
}

constexpr int kNR = 4;  // weight rows per tile
constexpr int kMR = 4;  // activation rows per tile

template <int MR>
void rows_block(const float* x, int64_t ldx, const int8_t* w, int64_t n, int64_t k,
                const float* scale, const float* bias, float* y, int64_t j0, int64_t j1) {
  int64_t j = j0;
  for (; j + kNR <= j1; j += kNR)
    tile<MR, kNR>(x, ldx, w + j * k, k, scale + j, bias ? bias + j : nullptr, y + j, n);
  for (; j < j1; ++j)
    tile<MR, 1>(x, ldx, w + j * k, k, scale + j, bias ? bias + j : nullptr, y + j, n);
}

void block(const float* x, int64_t ldx, int64_t m, const int8_t* w, int64_t n, int64_t k,
           const float* scale, const float* bias, float* y, int64_t j0, int64_t j1) {
  int64_t i = 0;
  for (; i + kMR <= m; i += kMR)
    rows_block<kMR>(x + i * ldx, ldx, w, n, k, scale, bias, y + i * n, j0, j1);
  const float* xr = x + i * ldx;
  float* yr = y + i * n;
  switch (m - i) {
    case 3: rows_block<3>(xr, ldx, w, n, k, scale, bias, yr, j0, j1); break;
    case 2: rows_block<2>(xr, ldx, w, n, k, scale, bias, yr, j0, j1); break;
    case 1: rows_block<1>(xr, ldx, w, n, k, scale, bias, yr, j0, j1); break;
    default: break;
  }
}

}  // namespace

extern "C" int ferry_int8_linear(const float* x, int64_t ldx, int64_t m, const int8_t* w,
                                 int64_t n, int64_t k, const float* scale, const float* bias,
                                 float* y) {
  if (m < 0 || n < 0 || k < 0 || ldx < k) return 1;
  if (m == 0 || n == 0) return 0;
  // chunks of output rows, a multiple of the tile width: enough of them to share out
  const int64_t chunk = 64;
  const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (m * n * k >= (int64_t{1} << 20))
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t j0 = c * chunk;
    const int64_t j1 = j0 + chunk < n ? j0 + chunk : n;
    block(x, ldx, m, w, n, k, scale, bias, y, j0, j1);
  }
  return 0;
}
