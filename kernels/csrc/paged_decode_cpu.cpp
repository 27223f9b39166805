// Paged decode attention for the CPU engine path: one query token per sequence.
//
// The CPU is bound by moving K/V, so every byte of a sequence's context is read exactly
// once, straight out of its pages: no gathered copy, no padding to the batch's longest
// sequence. One work item is a sequence, all heads (each key and value row read once for
// every query head that uses it), walking its pages in order with an online softmax (per
// page: scores for the page, one rescale of the running sums, then the weighted values).
// Items run in parallel on the OpenMP runtime torch already loaded, so
// torch.set_num_threads governs it too.
//
// Layout (shared with kernels/reference.py and the Triton kernels):
//   q, out:           [S, Hq, D] float32, contiguous
//   k_cache, v_cache: [num_blocks, block_size, Hkv, D] float32, bfloat16 or FP8 e4m3,
//                     contiguous
//   block_tables:     [S, table_stride] int32 (row stride table_stride)
//   seq_lens:         [S] int32, context length including the current token
//   sinks:            [Hq] float32 attention-sink logits (gpt-oss), or null
// chunk > 0 is chunked local attention (Llama 4): the last token's own chunk only.
// Plain C ABI (loaded with ctypes): no torch headers, so it compiles in about a second.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// FP8 e4m3 (fn: no infinities, one NaN pattern) -> float32 for every byte, built once.
// A cache of this type holds one byte a value at unit scale (kernels/reference.py).
inline const float* fp8_e4m3_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 0x7;
      float mag = exp == 0 ? std::ldexp(man / 8.0f, -6)  // subnormal
                           : std::ldexp(1.0f + man / 8.0f, exp - 7);
      if (exp == 0xF && man == 0x7) mag = std::nanf("");
      t[b] = sign ? -mag : mag;
    }
    return t;
  }();
  return table.data();
}
inline float to_float(uint8_t fp8) { return fp8_e4m3_table()[fp8]; }

struct Shape {
  int num_kv_heads, group, head_dim, block_size;
  int64_t table_stride;
  float scale, soft_cap;
  int window, chunk;
  const float* sinks;  // [Hq] or null
};

// Below any real score; used instead of -inf because the kernel builds with -ffast-math.
constexpr float kNoScore = -1e30f;

// Ask for a page before it is needed: pages are scattered, so the hardware prefetcher
// cannot guess the next one, while the block table can.
template <typename T>
inline void prefetch_page(const T* page, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(page);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

// The generic per-page code (any head dim): scores, then the weighted values.
template <typename T>
void page_scores(const Shape& sh, const float* q, const T* kp, int lo, int hi, float* scores) {
  const int Hq = sh.num_kv_heads * sh.group, G = sh.group, D = sh.head_dim;
  const int64_t row = static_cast<int64_t>(sh.num_kv_heads) * D;  // one token, all heads
  for (int j = lo; j < hi; ++j) {  // each key row read once for all heads
    const T* kj = kp + j * row;
    for (int h = 0; h < Hq; ++h) {
      const float* qh = q + h * D;
      const T* kh = kj + (h / G) * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < D; ++d) dot += qh[d] * to_float(kh[d]);
      scores[h * sh.block_size + j] = dot * sh.scale;
    }
  }
}

template <typename T>
void page_values(const Shape& sh, const T* vp, int lo, int hi, const float* scores,
                 const float* correction, float* acc) {
  const int Hq = sh.num_kv_heads * sh.group, G = sh.group, D = sh.head_dim;
  const int64_t row = static_cast<int64_t>(sh.num_kv_heads) * D;
  for (int h = 0; h < Hq; ++h) {
    float* ah = acc + h * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) ah[d] *= correction[h];
  }
  for (int j = lo; j < hi; ++j) {  // each value row read once
    const T* vj = vp + j * row;
    for (int h = 0; h < Hq; ++h) {
      const float p = scores[h * sh.block_size + j];
      const T* vh = vj + (h / G) * D;
      float* ah = acc + h * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) ah[d] += p * to_float(vh[d]);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#define FERRY_DECODE_AVX2 1
// Head dims of NC x 8 floats (32, 64, 128) with the sizes known at compile time. The
// generic loops spend most of a small head's time outside the arithmetic: a horizontal sum
// per key and head (32 MACs at head dim 32), loop control around 4-vector bodies, and the
// head's accumulator loaded and stored for every value row. Here 8 keys' dot products
// run as 8 independent FMA chains reduced together (one hadd tree for 8 scores), and a
// head's accumulator stays in registers across the page's value rows.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bfloat16 -> float32: the high half of each
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const uint8_t* p) {  // FP8 e4m3 -> float32 through the table
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_i32gather_ps(fp8_e4m3_table(), _mm256_cvtepu8_epi32(b), 4);
}

// {sum of a[0]'s lanes, ..., sum of a[7]'s lanes}; each lane sums one input only.
inline __m256 lane_sums(const __m256* a) {
  const __m256 t01 = _mm256_hadd_ps(a[0], a[1]), t23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t45 = _mm256_hadd_ps(a[4], a[5]), t67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t01, t23), u1 = _mm256_hadd_ps(t45, t67);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <int NC, typename T>
void page_scores_vec(const Shape& sh, const float* q, const T* kp, int lo, int hi,
                     float* scores) {
  constexpr int D = NC * 8;
  const int Hq = sh.num_kv_heads * sh.group, G = sh.group;
  const int64_t row = static_cast<int64_t>(sh.num_kv_heads) * D;
  const __m256 scale = _mm256_set1_ps(sh.scale);
  for (int h = 0; h < Hq; ++h) {
    const float* qh = q + h * D;
    const T* kh = kp + (h / G) * D;
    float* out = scores + h * sh.block_size;
    for (int j0 = lo; j0 < hi; j0 += 8) {
      // a block past hi repeats key hi - 1 (a key of this page): its lanes are dropped
      const T* key[8];
      for (int i = 0; i < 8; ++i) key[i] = kh + std::min(j0 + i, hi - 1) * row;
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int c = 0; c < NC; ++c) {
        const __m256 qc = _mm256_loadu_ps(qh + 8 * c);
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qc, load8(key[i] + 8 * c), acc[i]);
      }
      alignas(32) float s[8];
      _mm256_store_ps(s, _mm256_mul_ps(lane_sums(acc), scale));
      const int n = std::min(8, hi - j0);
      for (int i = 0; i < n; ++i) out[j0 + i] = s[i];
    }
  }
}

template <int NC, typename T>
void page_values_vec(const Shape& sh, const T* vp, int lo, int hi, const float* scores,
                     const float* correction, float* acc) {
  constexpr int D = NC * 8, W = 4;  // 4 vectors (32 floats) of a head's sums at a time
  static_assert(NC % W == 0, "head dim must be a multiple of 32");
  const int Hq = sh.num_kv_heads * sh.group, G = sh.group;
  const int64_t row = static_cast<int64_t>(sh.num_kv_heads) * D;
  for (int h = 0; h < Hq; ++h) {
    const T* vh = vp + (h / G) * D;
    const float* p = scores + h * sh.block_size;
    const __m256 corr = _mm256_set1_ps(correction[h]);
    for (int c0 = 0; c0 < NC; c0 += W) {
      float* ah = acc + h * D + 8 * c0;
      __m256 a[W];
      for (int c = 0; c < W; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(ah + 8 * c), corr);
      for (int j = lo; j < hi; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        const T* vj = vh + j * row + 8 * c0;
        for (int c = 0; c < W; ++c) a[c] = _mm256_fmadd_ps(pj, load8(vj + 8 * c), a[c]);
      }
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(ah + 8 * c, a[c]);
    }
  }
}
#endif

// One page's online softmax step for every head: scores become weights, the running max
// and sum move on, and correction[h] is what the head's sums so far are scaled by.
inline void page_softmax(const Shape& sh, int Hq, int lo, int hi, float* scores,
                         float* run_max, float* run_sum, float* correction) {
  for (int h = 0; h < Hq; ++h) {
    float* sh_ = scores + h * sh.block_size;
    if (sh.soft_cap > 0.0f) {
      for (int j = lo; j < hi; ++j) sh_[j] = sh.soft_cap * std::tanh(sh_[j] / sh.soft_cap);
    }
    float page_max = kNoScore;
    for (int j = lo; j < hi; ++j) page_max = std::max(page_max, sh_[j]);
    const float new_max = std::max(run_max[h], page_max);
    correction[h] = std::exp(run_max[h] - new_max);
    float page_sum = 0.0f;
#pragma omp simd reduction(+ : page_sum)
    for (int j = lo; j < hi; ++j) {
      sh_[j] = std::exp(sh_[j] - new_max);
      page_sum += sh_[j];
    }
    run_sum[h] = run_sum[h] * correction[h] + page_sum;
    run_max[h] = new_max;
  }
}

// One sequence, all heads, page by page (NC: the head dim's vectors of 8 when the
// vectorised code handles it, 0 for the generic loops). Scratch: acc [Hq, D],
// scores [Hq, BS], run_max, run_sum, correction [Hq].
template <int NC, typename T>
void attend_seq(const Shape& sh, const float* q, const T* k_cache, const T* v_cache,
                const int32_t* table, int seq_len, float* out, std::vector<float>& scratch) {
  const int Hq = sh.num_kv_heads * sh.group, D = sh.head_dim;
  const int BS = sh.block_size;
  const int64_t page_elems = BS * static_cast<int64_t>(sh.num_kv_heads) * D;
  scratch.assign(static_cast<size_t>(Hq) * (D + BS + 3), 0.0f);
  float* acc = scratch.data();
  float* scores = acc + Hq * D;
  float* run_max = scores + Hq * BS;
  float* run_sum = run_max + Hq;
  float* correction = run_sum + Hq;
  std::fill(run_max, run_max + Hq, kNoScore);
  int first = sh.window > 0 ? std::max(0, seq_len - sh.window) : 0;
  if (sh.chunk > 0) first = std::max(first, (seq_len - 1) / sh.chunk * sh.chunk);
  const int last_page = (seq_len - 1) / BS;
  for (int b = first / BS; b <= last_page; ++b) {
    const T* kp = k_cache + table[b] * page_elems;
    const T* vp = v_cache + table[b] * page_elems;
    if (b < last_page) {
      prefetch_page(k_cache + table[b + 1] * page_elems, page_elems);
      prefetch_page(v_cache + table[b + 1] * page_elems, page_elems);
    }
    const int lo = std::max(first - b * BS, 0), hi = std::min(seq_len - b * BS, BS);
#ifdef FERRY_DECODE_AVX2
    if constexpr (NC > 0) {
      page_scores_vec<NC>(sh, q, kp, lo, hi, scores);
      page_softmax(sh, Hq, lo, hi, scores, run_max, run_sum, correction);
      page_values_vec<NC>(sh, vp, lo, hi, scores, correction, acc);
      continue;
    }
#endif
    page_scores(sh, q, kp, lo, hi, scores);
    page_softmax(sh, Hq, lo, hi, scores, run_max, run_sum, correction);
    page_values(sh, vp, lo, hi, scores, correction, acc);
  }
  for (int h = 0; h < Hq; ++h) {
    float inv = run_sum[h] > 0.0f ? 1.0f / run_sum[h] : 0.0f;
    if (sh.sinks != nullptr) {  // one more logit in the denominator, with no value
      const float top = std::max(run_max[h], sh.sinks[h]);
      const float alpha = std::exp(run_max[h] - top);
      inv = alpha / (run_sum[h] * alpha + std::exp(sh.sinks[h] - top));
    }
    for (int d = 0; d < D; ++d) out[h * D + d] = acc[h * D + d] * inv;
  }
}

template <int NC, typename T>
void decode_rows(const Shape& sh, int num_seqs, const float* q, const T* k_cache,
                 const T* v_cache, const int32_t* block_tables, const int32_t* seq_lens,
                 float* out) {
  const int64_t per_seq = static_cast<int64_t>(sh.num_kv_heads) * sh.group * sh.head_dim;
  // One sequence is one work item: no team (waking the other threads, and waiting for
  // them at the end, cost more than the item itself on a loaded machine).
#pragma omp parallel if (num_seqs > 1)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int s = 0; s < num_seqs; ++s) {
      attend_seq<NC>(sh, q + s * per_seq, k_cache, v_cache,
                     block_tables + s * sh.table_stride, seq_lens[s], out + s * per_seq,
                     scratch);
    }
  }
}

template <typename T>
void decode(const Shape& sh, int num_seqs, const float* q, const T* k_cache,
            const T* v_cache, const int32_t* block_tables, const int32_t* seq_lens,
            float* out) {
#ifdef FERRY_DECODE_AVX2
  switch (sh.head_dim) {
    case 32:
      return decode_rows<4>(sh, num_seqs, q, k_cache, v_cache, block_tables, seq_lens, out);
    case 64:
      return decode_rows<8>(sh, num_seqs, q, k_cache, v_cache, block_tables, seq_lens, out);
    case 128:
      return decode_rows<16>(sh, num_seqs, q, k_cache, v_cache, block_tables, seq_lens, out);
    default:
      break;
  }
#endif
  decode_rows<0>(sh, num_seqs, q, k_cache, v_cache, block_tables, seq_lens, out);
}

// Every sequence's length must fit its table row and every page it reads must exist:
// a bad table would otherwise read outside the cache. One cheap pass before any work.
int check_tables(const int32_t* block_tables, int64_t table_width, int64_t table_stride,
                 const int32_t* seq_lens, int num_seqs, int block_size, int64_t num_blocks) {
  for (int s = 0; s < num_seqs; ++s) {
    const int64_t len = seq_lens[s];
    if (len < 1 || len > table_width * block_size) return 2;
    const int32_t* row = block_tables + s * table_stride;
    for (int64_t b = 0; b * block_size < len; ++b)
      if (row[b] < 0 || row[b] >= num_blocks) return 3;
  }
  return 0;
}

}  // namespace

extern "C" {

// Returns 0; 1 for bad shapes; 2 when a seq_len is < 1 or longer than its table row;
// 3 when a table entry a sequence reads is not a page of the cache. Nothing is written
// unless it returns 0. cache_is_bf16: 0 for a float32 cache, 1 for bfloat16, 2 for FP8
// e4m3 (unit scale).
int ferry_paged_decode(const float* q, const void* k_cache, const void* v_cache,
                       int64_t num_blocks, const int32_t* block_tables, int64_t table_width,
                       int64_t table_stride, const int32_t* seq_lens, float* out,
                       int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                       int block_size, float scale, int sliding_window, float soft_cap,
                       int cache_is_bf16, const float* sinks, int chunk) {
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || head_dim <= 0 ||
      block_size <= 0 || num_seqs < 0)
    return 1;
  const int bad = check_tables(block_tables, table_width, table_stride, seq_lens, num_seqs,
                               block_size, num_blocks);
  if (bad) return bad;
  const Shape sh{num_kv_heads, num_q_heads / num_kv_heads, head_dim, block_size,
                 table_stride, scale, soft_cap, sliding_window, chunk, sinks};
  if (cache_is_bf16 == 2)
    decode(sh, num_seqs, q, static_cast<const uint8_t*>(k_cache),
           static_cast<const uint8_t*>(v_cache), block_tables, seq_lens, out);
  else if (cache_is_bf16)
    decode(sh, num_seqs, q, static_cast<const uint16_t*>(k_cache),
           static_cast<const uint16_t*>(v_cache), block_tables, seq_lens, out);
  else
    decode(sh, num_seqs, q, static_cast<const float*>(k_cache),
           static_cast<const float*>(v_cache), block_tables, seq_lens, out);
  return 0;
}

}  // extern "C"
