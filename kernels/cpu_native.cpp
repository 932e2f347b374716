// Fused CPU loops for decode-time attention over GSRQ codes (compiled on first use by kernels/cpu_native.py).
//
// Same math as kernels/reference.py; what the PyTorch CPU path (kernels/cpu.py) does with a chain of ops and
// multi-megabyte temporaries, these loops do per token with the vector in a stack buffer:
//   decode_attention  one layer's whole decode attention over pre-RoPE coded keys and its exact tokens: the key
//                     loop (prerope_scores_into), the exact tokens' scores, masks, one softmax, the value sums and
//                     the synthesis, in one call;
//   prerope_scores_into  key = mean + sum of S rows of the folded table (float32, float16, or int16 fixed point
//                     with a step per dimension), rotated with the token's cos/sin, dotted with every query row of
//                     its KV head, times the token's scale and the softmax scaling;
//   conditional_scores_into  the same for keys coded conditionally on the heads before them, tile by tile, one
//                     source head's slice of the table at a time (decode_attention with conditional_keys=True); for
//                     values coded given the keys it also forms the attention-weighted sums of the keys it rebuilds
//                     (ConditionalKeySums), which the prediction of the values needs, and it does so for keys coded
//                     per head too (each head its own only source);
//   value_transform_sums  probability x value scale added into one bin per (stage, codeword), per query row, then
//                     the bins times the codebooks: the attention-weighted sum of the values' transform-domain vectors
//                     (also an op of its own: kernels/cpu.py uses it for keys coded after RoPE).
// prerope_scores_into splits the tokens of every (batch, KV head) into blocks, value_transform_sums its stages, run in
// parallel on torch's intra-op threads.
//   residual_encode_beam  the beam-search encoder (reference: residual_encode_beam_reference), one vector at a time
//                     with its beams in stack-sized buffers instead of [rows, beams * K] score tensors; rows run in
//                     parallel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlockTokens = 256;
constexpr int64_t kMaxHeadDim = 512;
// How many tokens ahead the key loops ask for table rows: 8 tokens' rows (~240 cache lines for 15 stages of 64-dim
// float16 rows) cover the latency of L3; fewer tokens ahead leave part of it exposed where the tables do not fit in
// L2.
constexpr int64_t kPrefetchDistance = 8;
// The fused loop (values coded given the keys) runs one head over a whole tile of up to 2048 tokens. Its first ~400
// tokens read ~80 % of a 15-stage table's rows, which then mostly stay in L2 for the rest of the tile, and from there
// on the prefetches (two per 64-dim int16 row, load-port work like any load) cost more than the misses they hide, so
// they stop after a tile's first kPrefetchTileTokens tokens. The conditional loop without the prediction, whose
// slices share L2 with a partial-key scratch and so keep missing, prefetches throughout.
constexpr int64_t kPrefetchTileTokens = 384;

// One SIMD register of floats in GCC/Clang's vector extension, as wide as -march=native allows (loop-based code
// left the compiler emitting scalar adds for these loops). Never wider than a register: GCC keeps a vector twice a
// register's width (16 floats on an AVX2 CPU) in memory across loops, so every add would become a load and a store.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));  // aligned(4): unaligned loads

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline float horizontal_sum(Vec v) {
  float total = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) total += v[l];
  return total;
}
inline Vec splat(float v) { return Vec{} + v; }
// Lane l of the result: the sum of v[l]'s lanes. With 8-float registers, a tree of horizontal adds: 8 sums in 9
// instructions instead of 8 chains of 7 dependent scalar adds.
inline Vec lane_sums(const Vec* v) {
#if defined(__AVX__) && !defined(__AVX512F__)
  static_assert(kLanes == 8, "AVX registers hold 8 floats");
  const __m256 pairs01 = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]);
  const __m256 pairs23 = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
  const __m256 pairs45 = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]);
  const __m256 pairs67 = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
  // quads: per 128-bit half, the sums of four lanes of v[0..3] (low) and v[4..7]
  const __m256 quads0123 = _mm256_hadd_ps(pairs01, pairs23), quads4567 = _mm256_hadd_ps(pairs45, pairs67);
  return (Vec)_mm256_add_ps(_mm256_permute2f128_ps(quads0123, quads4567, 0x20),
                            _mm256_permute2f128_ps(quads0123, quads4567, 0x31));
#elif defined(__AVX512F__)
  // The same tree in 16 lanes: each level adds the even and odd lanes of pairs of vectors (two-source permutes), so
  // lane l ends as v[l]'s sum in 15 pair steps; reducing each vector on its own took 16 chains of shuffles and adds.
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512 level[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) level[l] = (__m512)v[l];
  for (int64_t width = kLanes; width > 1; width /= 2) {
    for (int64_t i = 0; i < width / 2; ++i) {
      level[i] = _mm512_add_ps(_mm512_permutex2var_ps(level[2 * i], even, level[2 * i + 1]),
                               _mm512_permutex2var_ps(level[2 * i], odd, level[2 * i + 1]));
    }
  }
  return (Vec)level[0];
#else
  Vec sums;
  for (int64_t l = 0; l < kLanes; ++l) sums[l] = horizontal_sum(v[l]);
  return sums;
#endif
}
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(4)));

// e^x of each float of a vector as 2^n e^r, n = round(x / ln 2), |r| <= ln 2 / 2, e^r by the degree-6 polynomial
// of Cephes' expf (relative error about 1e-7, like std::exp); exactly 0 below -87.3, so a masked (-inf) score
// weighs nothing. Only the loops that exponentiate scores tile by tile use it; elsewhere ATen's exp_ does the whole
// score tensor.
inline Vec exp_lanes(Vec x) {
  const Vec low = splat(-87.3f), high = splat(88.3f);
  const auto underflow = x < low;
  x = x < low ? low : x;
  x = x > high ? high : x;
  const Vec magic = splat(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const Vec n = (x * 1.44269504088896341f + magic) - magic;
  const Vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
  Vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Vec y = p * r * r + r + 1.f;
  const VecI exponent = (__builtin_convertvector(n, VecI) + 127) << 23;
  const Vec result = y * (Vec)exponent;  // same-size vector cast: the bits read as floats, i.e. 2^n
  return underflow ? splat(0.f) : result;
}

// x[i] = e^(x[i] - shift) in place
void exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    *reinterpret_cast<Vec*>(x + i) = exp_lanes(load(x + i) - shift);
  }
  for (; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

// The key tables' rows are float32 or float16 (kernels/cpu.py decides): a row as float lanes either way.
inline Vec load_row(const float* p) { return load(p); }
inline Vec load_row(const at::Half* p) {
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  static_assert(kLanes == 8, "F16C converts 8 halves at a time");
  return (Vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  Vec v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

// Prefetches a table row: one request per cache line.
template <int64_t kDim, typename Table>
inline void prefetch_row(const Table* row) {
  constexpr int64_t kLineElements = 64 / sizeof(Table);
  for (int64_t offset = 0; offset < kDim; offset += kLineElements) __builtin_prefetch(row + offset);
}

// The per-token scales of one (batch, head): float values, or 8-bit indices into the head's table of levels (how the
// cache stores them; looking them up here saves a gather and an index conversion per layer and step).
struct HeadScales {
  const float* values;  // nullptr: use index + levels
  const uint8_t* index;
  const float* levels;
  float operator[](int64_t t) const { return values != nullptr ? values[t] : levels[index[t]]; }
};

// One rebuilt pre-RoPE key: rotated with its token's cos/sin, dotted with `rows` query rows, each score times
// `factor` into out[m * out_stride]. `c`/`n` hold the token's D/2 rotary cos/sin: in the rotate-half convention both
// halves of a key use the same angles.
template <int64_t kDim>
inline void rotate_key(const Vec* key, const float* c, const float* n, Vec* rotated) {
  constexpr int64_t kHalf = kDim / kLanes / 2;
  for (int64_t b = 0; b < kHalf; ++b) {
    const Vec low = key[b], high = key[b + kHalf];
    const Vec cb = load(c + b * kLanes), sb = load(n + b * kLanes);
    rotated[b] = low * cb - high * sb;
    rotated[b + kHalf] = high * cb + low * sb;
  }
}

// Lanes of the dot product of a rotated key with one query row (their sum is the dot product).
template <int64_t kDim>
inline Vec query_products(const Vec* rotated, const float* qm) {
  Vec acc = rotated[0] * load(qm);
  for (int64_t b = 1; b < kDim / kLanes; ++b) acc += rotated[b] * load(qm + b * kLanes);
  return acc;
}

template <int64_t kDim>
inline void rotate_and_score(const Vec* key, const float* c, const float* n, const float* q, int64_t rows,
                             float* out, int64_t out_stride, float factor) {
  Vec rotated[kDim / kLanes];
  rotate_key<kDim>(key, c, n, rotated);
  for (int64_t m = 0; m < rows; ++m) {
    out[m * out_stride] = horizontal_sum(query_products<kDim>(rotated, q + m * kDim)) * factor;
  }
}

// Scores of kLanes consecutive tokens at a time: each token's products with the query rows are kept, and each row's
// kLanes dot products are reduced together (lane_sums) and stored as one vector. Up to kMaxGroupedRows query rows;
// a group cut short by the end of the block is reduced token by token.
constexpr int64_t kMaxGroupedRows = 8;
struct TokenGroupScores {
  Vec products[kMaxGroupedRows][kLanes];
  float factors[kLanes];
  int64_t first = 0, count = 0;

  template <int64_t kDim>
  inline void add(const Vec* key, const float* c, const float* n, const float* q, int64_t rows, int64_t t,
                  float factor) {
    Vec rotated[kDim / kLanes];
    rotate_key<kDim>(key, c, n, rotated);
    if (count == 0) first = t;
    for (int64_t m = 0; m < rows; ++m) products[m][count] = query_products<kDim>(rotated, q + m * kDim);
    factors[count++] = factor;
  }
  inline void flush(float* out, int64_t rows, int64_t out_stride) {
    if (count == kLanes) {
      const Vec factor = load(factors);
      for (int64_t m = 0; m < rows; ++m) {
        *reinterpret_cast<Vec*>(out + m * out_stride + first) = lane_sums(products[m]) * factor;
      }
    } else {
      for (int64_t m = 0; m < rows; ++m) {
        for (int64_t j = 0; j < count; ++j) {
          out[m * out_stride + first + j] = horizontal_sum(products[m][j]) * factors[j];
        }
      }
    }
    count = 0;
  }
};

// head_dim a multiple of two vectors (both rotary halves whole vectors: 32 floats with AVX-512), known at compile time.
template <int64_t kDim, typename Table>
void prerope_scores_block_vec(const float* q, const uint8_t* codes, const HeadScales& scales, const Table* table,
                              const float* mean, const float* cos, const float* sin, float* out, int64_t rows,
                              int64_t out_stride, int64_t stages, int64_t codebook_size, int64_t begin, int64_t end,
                              float scaling) {
  constexpr int64_t kBlocks = kDim / kLanes;
  static_assert(kDim % (2 * kLanes) == 0, "head_dim must be a multiple of two vectors");
  Vec mean_blocks[kBlocks];
  for (int64_t b = 0; b < kBlocks; ++b) mean_blocks[b] = load(mean + b * kLanes);
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* token_codes = codes + t * stages;
    // The per-layer tables do not stay in cache between decode steps and rows are read at random: ask for the
    // rows of a token a few tokens ahead so their memory latency overlaps with this token's arithmetic.
    if (t + kPrefetchDistance < end) {
      const uint8_t* ahead = codes + (t + kPrefetchDistance) * stages;
      for (int64_t s = 0; s < stages; ++s) prefetch_row<kDim>(table + (s * codebook_size + ahead[s]) * kDim);
    }
    Vec key[kBlocks];
    for (int64_t b = 0; b < kBlocks; ++b) key[b] = mean_blocks[b];
    for (int64_t s = 0; s < stages; ++s) {
      const Table* row = table + (s * codebook_size + token_codes[s]) * kDim;
      for (int64_t b = 0; b < kBlocks; ++b) key[b] += load_row(row + b * kLanes);
    }
    rotate_and_score<kDim>(key, cos + t * kDim / 2, sin + t * kDim / 2, q, rows, out + t, out_stride,
                           scales[t] * scaling);
  }
}

// key = mean + step * (the sum of a token's S rows of a fixed-point table: kernels/cpu.py's FixedPointKeyTable, int16
// rows, row element d standing for step[d] times its value, and no sum of a token's rows can leave int16: the steps
// are chosen so). The rows add in 16-bit lanes, twice as many per register as float lanes and with no widening per
// row; the sum is widened and scaled once per key, where float16 rows are widened row by row.
template <int64_t kDim>
inline void add_fixed_point_rows(const int16_t* table, const uint8_t* token_codes, int64_t stages,
                                 int64_t codebook_size, const Vec* mean, const Vec* step, Vec* key) {
  constexpr int64_t kWide = 2 * kLanes, kWideBlocks = kDim / kWide;
  typedef int16_t VecW __attribute__((vector_size(kWide * sizeof(int16_t)), aligned(2)));
  typedef int16_t VecN __attribute__((vector_size(kLanes * sizeof(int16_t)), aligned(2)));
  VecW sum[kWideBlocks] = {};
  for (int64_t s = 0; s < stages; ++s) {
    const VecW* row = reinterpret_cast<const VecW*>(table + (s * codebook_size + token_codes[s]) * kDim);
    for (int64_t w = 0; w < kWideBlocks; ++w) sum[w] += row[w];
  }
  alignas(64) int16_t sums[kDim];
  for (int64_t w = 0; w < kWideBlocks; ++w) *reinterpret_cast<VecW*>(sums + w * kWide) = sum[w];
  for (int64_t b = 0; b < kDim / kLanes; ++b) {
    const VecN narrow = *reinterpret_cast<const VecN*>(sums + b * kLanes);
    key[b] = mean[b] + step[b] * __builtin_convertvector(__builtin_convertvector(narrow, VecI), Vec);
  }
}

// prerope_scores_block_vec over a fixed-point table.
template <int64_t kDim>
void prerope_scores_block_fixed(const float* q, const uint8_t* codes, const HeadScales& scales, const int16_t* table,
                                const float* step, const float* mean, const float* cos, const float* sin, float* out,
                                int64_t rows, int64_t out_stride, int64_t stages, int64_t codebook_size, int64_t begin,
                                int64_t end, float scaling) {
  Vec mean_blocks[kDim / kLanes], step_blocks[kDim / kLanes];
  for (int64_t b = 0; b < kDim / kLanes; ++b) {
    mean_blocks[b] = load(mean + b * kLanes);
    step_blocks[b] = load(step + b * kLanes);
  }
  TokenGroupScores group;
  const bool grouped = rows <= kMaxGroupedRows;
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* token_codes = codes + t * stages;
    if (t + kPrefetchDistance < end) {  // as in prerope_scores_block_vec
      const uint8_t* ahead = codes + (t + kPrefetchDistance) * stages;
      for (int64_t s = 0; s < stages; ++s) prefetch_row<kDim>(table + (s * codebook_size + ahead[s]) * kDim);
    }
    Vec key[kDim / kLanes];
    add_fixed_point_rows<kDim>(table, token_codes, stages, codebook_size, mean_blocks, step_blocks, key);
    if (!grouped) {
      rotate_and_score<kDim>(key, cos + t * kDim / 2, sin + t * kDim / 2, q, rows, out + t, out_stride,
                             scales[t] * scaling);
      continue;
    }
    group.add<kDim>(key, cos + t * kDim / 2, sin + t * kDim / 2, q, rows, t, scales[t] * scaling);
    if (group.count == kLanes || t + 1 == end) group.flush(out, rows, out_stride);
  }
}

// Keys coded head by head, each predicted from the heads before it (hf_kvcodecs/codecs/conditional.py): head h of
// token t is sum over source heads j <= h of scale_j[t] * (mean[j, h] + the S rows of slice (j, h)). Slice (j, h) of
// the table is [R, D]: codeword rows of source head j with their contribution to head h folded in, so a key is rebuilt
// from S rows per source head with no matrix product. The loop runs one target head at a time over a tile of tokens
// and one source head at a time within it, so that the rows it reads at random come from one slice (R * D values,
// 1 MB in float32 for the default model, 0.5 MB in float16: it stays in L2 across the tile on most CPUs) instead of
// all H (H+1) / 2 slices at once (6 MB, more than an L2 holds: every row would come from L3). Sources before h
// add into a tile of partial keys; the last source, h itself, completes each key in registers, which is then rotated
// and dotted with head h's query rows.
constexpr int64_t kMaxConditionalHeads = 16;
constexpr int64_t kConditionalTileTokens = 1024;

// part = the source's mean plus its S rows of the slice; `step` (the slice's, [kDim]) is read for fixed-point rows
// only.
template <int64_t kDim, typename Table>
inline void add_source_rows(const Table* slice, const float* step, const float* source_mean,
                            const uint8_t* token_codes, int64_t stages, int64_t codebook_size, Vec* part) {
  constexpr int64_t kBlocks = kDim / kLanes;
  if constexpr (std::is_same_v<Table, int16_t>) {
    Vec mean_blocks[kBlocks], step_blocks[kBlocks];
    for (int64_t b = 0; b < kBlocks; ++b) {
      mean_blocks[b] = load(source_mean + b * kLanes);
      step_blocks[b] = load(step + b * kLanes);
    }
    add_fixed_point_rows<kDim>(slice, token_codes, stages, codebook_size, mean_blocks, step_blocks, part);
  } else {
    for (int64_t b = 0; b < kBlocks; ++b) part[b] = load(source_mean + b * kLanes);
    for (int64_t s = 0; s < stages; ++s) {
      const Table* row = slice + (s * codebook_size + token_codes[s]) * kDim;
      for (int64_t b = 0; b < kBlocks; ++b) part[b] += load_row(row + b * kLanes);
    }
  }
}

template <int64_t kDim, typename Table>
inline void prefetch_source_rows(const Table* slice, const uint8_t* token_codes, int64_t stages,
                                 int64_t codebook_size) {
  for (int64_t s = 0; s < stages; ++s) prefetch_row<kDim>(slice + (s * codebook_size + token_codes[s]) * kDim);
}

// Target head h of tokens [begin, end); `partial` holds (end - begin) * kDim floats of scratch, which ends holding
// head h's rebuilt pre-RoPE keys (before rotation) if `keep_keys`. `per_head`: keys coded per head, each from its
// own codes only (a per-head table [H, R, D], mean and steps [H, D], as prerope_scores_into reads them), so head h
// has one source, itself: the fused loop for values coded given the keys reads them this way too.
template <int64_t kDim, typename Table>
void conditional_scores_tile(const float* q, const uint8_t* codes, const HeadScales* scales, const Table* table,
                             const float* steps, const float* mean, const float* cos, const float* sin, float* out,
                             int64_t heads, int64_t h, int64_t rows, int64_t out_stride, int64_t tokens, int64_t stages,
                             int64_t codebook_size, int64_t table_rows, int64_t begin, int64_t end, float scaling,
                             float* partial, bool keep_keys, bool per_head = false,
                             int64_t prefetch_tokens = std::numeric_limits<int64_t>::max()) {
  constexpr int64_t kBlocks = kDim / kLanes;
  static_assert(kDim % (2 * kLanes) == 0, "head_dim must be a multiple of two vectors");
  const int64_t slice_elements = table_rows * kDim;
  const Table* block = table;  // source j's slices (j, j..H-1) follow one another
  TokenGroupScores group;
  const bool grouped = rows <= kMaxGroupedRows;
  const float* qh = q + h * rows * kDim;
  float* out_h = out + h * rows * out_stride;
  const float* step_block = steps;  // fixed point: one step row per slice, in the slices' order
  const int64_t first_source = per_head ? h : 0;
  for (int64_t j = first_source; j <= h; ++j) {
    const Table* slice = per_head ? table + h * slice_elements : block + (h - j) * slice_elements;
    const float* slice_step = steps == nullptr ? nullptr : (per_head ? steps + h * kDim : step_block + (h - j) * kDim);
    const float* source_mean = mean + (per_head ? h : j * heads + h) * kDim;
    const uint8_t* source_codes = codes + j * tokens * stages;
    const HeadScales& scale = scales[j];
    for (int64_t t = begin; t < end; ++t) {
      if (t + kPrefetchDistance < end && t - begin < prefetch_tokens) {
        prefetch_source_rows<kDim>(slice, source_codes + (t + kPrefetchDistance) * stages, stages, codebook_size);
      }
      Vec part[kBlocks];
      add_source_rows<kDim>(slice, slice_step, source_mean, source_codes + t * stages, stages, codebook_size, part);
      float* keep = partial + (t - begin) * kDim;
      const float factor = scale[t];
      if (j < h) {
        for (int64_t b = 0; b < kBlocks; ++b) {
          Vec* target = reinterpret_cast<Vec*>(keep + b * kLanes);
          *target = (j == 0 ? Vec{} : *target) + factor * part[b];
        }
        continue;
      }
      Vec key[kBlocks];
      for (int64_t b = 0; b < kBlocks; ++b) {
        key[b] = factor * part[b] + (j == first_source ? Vec{} : load(keep + b * kLanes));
      }
      if (keep_keys) {
        for (int64_t b = 0; b < kBlocks; ++b) *reinterpret_cast<Vec*>(keep + b * kLanes) = key[b];
      }
      if (!grouped) {
        rotate_and_score<kDim>(key, cos + t * kDim / 2, sin + t * kDim / 2, qh, rows, out_h + t, out_stride,
                               scaling);
        continue;
      }
      group.add<kDim>(key, cos + t * kDim / 2, sin + t * kDim / 2, qh, rows, t, scaling);
      if (group.count == kLanes || t + 1 == end) group.flush(out_h, rows, out_stride);
    }
    block += (heads - j) * slice_elements;
    if (steps != nullptr) step_block += (heads - j) * kDim;
  }
}

// Any even head_dim up to kMaxHeadDim; `step` is read for fixed-point tables only.
template <typename Table>
void prerope_scores_block(const float* q, const uint8_t* codes, const HeadScales& scales, const Table* table,
                          const float* step, const float* mean, const float* cos, const float* sin, float* out,
                          int64_t rows,
                          int64_t out_stride, int64_t stages, int64_t codebook_size, int64_t begin, int64_t end,
                          float scaling, int64_t dim) {
  const int64_t half = dim / 2;
  float key[kMaxHeadDim];
  float rotated[kMaxHeadDim];
  int32_t sums[kMaxHeadDim];
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* token_codes = codes + t * stages;
    if constexpr (std::is_same_v<Table, int16_t>) {  // fixed point: integer sums, then scaled
      for (int64_t d = 0; d < dim; ++d) sums[d] = 0;
      for (int64_t s = 0; s < stages; ++s) {
        const Table* row = table + (s * codebook_size + token_codes[s]) * dim;
        for (int64_t d = 0; d < dim; ++d) sums[d] += row[d];
      }
      for (int64_t d = 0; d < dim; ++d) key[d] = mean[d] + step[d] * static_cast<float>(sums[d]);
    } else {
      for (int64_t d = 0; d < dim; ++d) key[d] = mean[d];
      for (int64_t s = 0; s < stages; ++s) {
        const Table* row = table + (s * codebook_size + token_codes[s]) * dim;
        for (int64_t d = 0; d < dim; ++d) key[d] += static_cast<float>(row[d]);
      }
    }
    const float* c = cos + t * half;
    const float* n = sin + t * half;
    for (int64_t d = 0; d < half; ++d) {
      rotated[d] = key[d] * c[d] - key[d + half] * n[d];
      rotated[d + half] = key[d + half] * c[d] + key[d] * n[d];
    }
    const float factor = scales[t] * scaling;
    for (int64_t m = 0; m < rows; ++m) {
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += q[m * dim + d] * rotated[d];
      out[m * out_stride + t] = dot * factor;
    }
  }
}

void check(bool condition, const char* message) { TORCH_CHECK(condition, "hf_kvcodecs cpu_native: ", message); }

// Row reductions in kLanes lanes: vectorized (a plain float loop is one dependency chain) and, for the sum, kLanes
// partial sums rather than one, so the rounding error grows like a blocked sum's, as in ATen's sum.
float row_max(const float* x, int64_t n) {
  Vec lanes = {};
  lanes -= std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = load(x + i);
    lanes = v > lanes ? v : lanes;
  }
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < kLanes; ++l) peak = std::max(peak, lanes[l]);
  for (; i < n; ++i) peak = std::max(peak, x[i]);
  return peak;
}

float row_sum(const float* x, int64_t n) {
  Vec lanes = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) lanes += load(x + i);
  float total = horizontal_sum(lanes);
  for (; i < n; ++i) total += x[i];
  return total;
}

// scales [B, H, N]: float32 values, or with scale_levels [H, 256] f32, uint8 level indices.
void check_scales(const at::Tensor& scales, const c10::optional<at::Tensor>& scale_levels, int64_t batch,
                  int64_t heads, int64_t tokens) {
  check(scales.dim() == 3 && scales.size(0) == batch && scales.size(1) == heads && scales.size(2) == tokens &&
            scales.is_contiguous() && scales.device().is_cpu(),
        "scales must be contiguous [batch, heads, tokens] on CPU");
  if (scale_levels.has_value()) {
    const at::Tensor& levels = *scale_levels;
    check(scales.scalar_type() == at::kByte, "with scale_levels, scales must be uint8 level indices");
    check(levels.scalar_type() == at::kFloat && levels.is_contiguous() && levels.dim() == 2 &&
              levels.size(0) == heads && levels.size(1) >= 256,
          "scale_levels must be contiguous float32 [heads, 256]");
  } else {
    check(scales.scalar_type() == at::kFloat, "scales must be float32 (or uint8 with scale_levels)");
  }
}

HeadScales head_scales(const at::Tensor& scales, const c10::optional<at::Tensor>& scale_levels, int64_t b, int64_t h) {
  const int64_t offset = (b * scales.size(1) + h) * scales.size(2);
  if (!scale_levels.has_value()) return {scales.const_data_ptr<float>() + offset, nullptr, nullptr};
  return {nullptr, scales.const_data_ptr<uint8_t>() + offset,
          scale_levels->const_data_ptr<float>() + h * scale_levels->size(1)};
}

// Both key loops: rotary tables [B, N, D/2] for the coded tokens (one half of transformers' [B, N, D] tables: in the
// rotate-half convention both halves hold the same angles), and score rows long enough to hold them.
void check_rotary_and_scores(const at::Tensor& cos, const at::Tensor& sin, int64_t batch, int64_t tokens, int64_t dim,
                             int64_t out_stride) {
  check(cos.size(0) == batch && cos.size(1) == tokens && cos.size(2) == dim / 2 && sin.sizes() == cos.sizes(),
        "rotary tables do not match the coded tokens (expected [batch, tokens, head_dim / 2])");
  check(out_stride >= tokens, "score rows shorter than the coded tokens");
}

void check_key_table(const at::Tensor& table, bool fixed_point_allowed = false) {
  const auto type = table.scalar_type();
  check((type == at::kFloat || type == at::kHalf || (fixed_point_allowed && type == at::kShort)) &&
            table.is_contiguous() && table.device().is_cpu(),
        fixed_point_allowed ? "the key table must be contiguous float32, float16 or int16 (fixed point) on CPU"
                            : "the key table must be contiguous float32 or float16 on CPU");
}

// Calls body(pointer to the table's first row) with the table's element type (float, at::Half, or, where the loop
// reads fixed point, int16_t).
template <bool kFixedPoint = false, typename Body>
void with_table_rows(const at::Tensor& table, const Body& body) {
  if (table.scalar_type() == at::kHalf) {
    body(table.const_data_ptr<at::Half>());
  } else if (kFixedPoint && table.scalar_type() == at::kShort) {
    if constexpr (kFixedPoint) body(table.const_data_ptr<int16_t>());
  } else {
    body(table.const_data_ptr<float>());
  }
}

// body(item) for every item of [0, total), on all threads. Each thread owns a contiguous range of items, as with
// at::parallel_for, and takes them from its front, so it keeps reading one head's table; a thread whose range is
// done takes the items left at the back of the others' ranges. With a static split, the thread that finishes first
// waits for the other at the end of every call whenever the cores run at different speeds (a shared or noisy host).
// Items must be independent: which thread runs an item does not change any result.
template <typename Body>
void parallel_items_balanced(int64_t total, const Body& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), total);
  if (threads <= 1 || at::in_parallel_region() || total > std::numeric_limits<uint32_t>::max()) {
    at::parallel_for(0, total, 1, [&](int64_t first, int64_t last) {
      for (int64_t item = first; item < last; ++item) body(item);
    });
    return;
  }
  const auto pack = [](uint64_t front, uint64_t back) { return front << 32 | back; };
  std::unique_ptr<std::atomic<uint64_t>[]> ranges(new std::atomic<uint64_t>[threads]);  // [front, back) each
  for (int64_t t = 0; t < threads; ++t) ranges[t].store(pack(total * t / threads, total * (t + 1) / threads));
  // takes one item from `range` (its front, or its back for another thread's range); -1 when it is empty
  const auto take = [&](std::atomic<uint64_t>& range, bool from_front) -> int64_t {
    uint64_t current = range.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t front = current >> 32, back = current & 0xffffffffu;
      if (front >= back) return -1;
      const uint64_t next = from_front ? pack(front + 1, back) : pack(front, back - 1);
      if (range.compare_exchange_weak(current, next, std::memory_order_relaxed)) {
        return static_cast<int64_t>(from_front ? front : back - 1);
      }
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t own = first; own < last; ++own) {
      for (int64_t item; (item = take(ranges[own], true)) >= 0;) body(item);
      for (int64_t k = 1; k < threads; ++k) {
        for (int64_t item; (item = take(ranges[(own + k) % threads], false)) >= 0;) body(item);
      }
    }
  });
}

// q [B, H, M, D] f32; codes [B, H or 1, N, S] u8 (1: joint-head codes, shared by every head); scales [B, H, N] f32
// (or u8 with scale_levels [H, 256] f32);
// table [H, R, D] f32 or f16 (R >= S * K), or i16 with table_step [H, D] f32 (fixed point);
// mean [H, D] f32; cos, sin [B, N, D/2] f32  ->  scores written to out[((b * H + h) * M + m) * out_stride + n]
void prerope_scores_into(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& scale_levels, const at::Tensor& table,
                         const c10::optional<at::Tensor>& table_step, const at::Tensor& mean, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t codebook_size, double scaling, float* op,
                         int64_t out_stride) {
  check(q.dim() == 4 && codes.dim() == 4 && scales.dim() == 3 && table.dim() == 3 && mean.dim() == 2 &&
            cos.dim() == 3 && sin.dim() == 3,
        "unexpected ranks");
  for (const auto* t : {&q, &mean, &cos, &sin}) {
    check(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
          "float tensors must be contiguous float32 on CPU");
  }
  check_key_table(table, /*fixed_point_allowed=*/true);
  const bool fixed_point = table.scalar_type() == at::kShort;
  check(fixed_point == table_step.has_value(), "a fixed-point (int16) key table needs its step, and only it");
  check(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), dim = q.size(3);
  const int64_t tokens = codes.size(2), stages = codes.size(3);
  check(dim % 2 == 0 && dim <= kMaxHeadDim, "head_dim must be even and at most 512");
  if (fixed_point) {
    check(table_step->scalar_type() == at::kFloat && table_step->is_contiguous() && table_step->dim() == 2 &&
              table_step->size(0) == table.size(0) && table_step->size(1) == dim,
          "the key table's step must be contiguous float32 [H, head_dim]");
  }
  const float* step_rows = fixed_point ? table_step->const_data_ptr<float>() : nullptr;
  check(codes.size(0) == batch && (codes.size(1) == heads || codes.size(1) == 1),
        "codes do not match the query's batch and heads");
  const int64_t code_heads = codes.size(1);
  check_scales(scales, scale_levels, batch, heads, tokens);
  check(table.size(0) == heads && table.size(2) == dim && table.size(1) >= stages * codebook_size,
        "key table too small for these codes");
  check(mean.size(0) == heads && mean.size(1) == dim, "mean does not match heads/head_dim");
  check_rotary_and_scores(cos, sin, batch, tokens, dim, out_stride);
  const int64_t blocks = (tokens + kBlockTokens - 1) / kBlockTokens;
  const float* qp = q.const_data_ptr<float>();
  const uint8_t* cp = codes.const_data_ptr<uint8_t>();
  const float* mp = mean.const_data_ptr<float>();
  const float* cosp = cos.const_data_ptr<float>();
  const float* sinp = sin.const_data_ptr<float>();
  const int64_t table_rows = table.size(1);
  const float scale = static_cast<float>(scaling);
  parallel_items_balanced(batch * heads * blocks, [&](int64_t item) {
    const int64_t bh = item / blocks, block = item % blocks;
    const int64_t b = bh / heads, h = bh % heads;
    const int64_t begin = block * kBlockTokens, end = std::min(tokens, begin + kBlockTokens);
    const float* qi = qp + bh * rows * dim;
    const uint8_t* ci = cp + (b * code_heads + h % code_heads) * tokens * stages;
    const HeadScales si = head_scales(scales, scale_levels, b, h);
    const float* mi = mp + h * dim;
    const float* cosi = cosp + b * tokens * dim / 2;
    const float* sini = sinp + b * tokens * dim / 2;
    float* oi = op + bh * rows * out_stride;
    const float* stepi = fixed_point ? step_rows + h * dim : nullptr;
    with_table_rows</*kFixedPoint=*/true>(table, [&](const auto* rows_begin) {
      const auto* ti = rows_begin + h * table_rows * dim;
      constexpr bool kFixed = std::is_same_v<std::decay_t<decltype(*ti)>, int16_t>;
      if (dim == 64) {
        if constexpr (kFixed) {
          prerope_scores_block_fixed<64>(qi, ci, si, ti, stepi, mi, cosi, sini, oi, rows, out_stride, stages,
                                         codebook_size, begin, end, scale);
        } else {
          prerope_scores_block_vec<64>(qi, ci, si, ti, mi, cosi, sini, oi, rows, out_stride, stages, codebook_size,
                                       begin, end, scale);
        }
      } else if (dim == 128) {
        if constexpr (kFixed) {
          prerope_scores_block_fixed<128>(qi, ci, si, ti, stepi, mi, cosi, sini, oi, rows, out_stride, stages,
                                          codebook_size, begin, end, scale);
        } else {
          prerope_scores_block_vec<128>(qi, ci, si, ti, mi, cosi, sini, oi, rows, out_stride, stages,
                                        codebook_size, begin, end, scale);
        }
      } else {
        prerope_scores_block(qi, ci, si, ti, stepi, mi, cosi, sini, oi, rows, out_stride, stages, codebook_size,
                             begin, end, scale, dim);
      }
    });
  });
}

// The attention-weighted sums of the rebuilt keys that values coded given the keys need (v = residual + [k^, 1] @
// predictor, linear in the keys), formed by the conditional key loop while each tile's keys are at hand, so neither
// a key history nor a histogram per key head is ever built. Per (batch, tile, query row r of all heads): the tile's
// score peak and sum over its tokens of e^(score - peak) * (every head's rebuilt pre-RoPE key) [H*D]; the tile's
// scores are left as those weights, masks applied (decode_attention rescales them to the row's global peak).
struct ConditionalKeySums {
  const float* coded_mask;  // [B, Lq, N] additive, or nullptr
  int64_t query_length;
  int64_t tile_tokens;
  float* tile_peaks;  // [B, tiles, H*M]
  float* key_sums;    // [B, tiles, H*M, H*D]
};

// The fused loop's tiles (values coded given the keys): at most kFusedTileTokens, but enough of them to give every
// thread work, as its items are whole tiles (all heads) and one tile would leave a second thread idle at 1K context.
// Each tile reads every head's table afresh, so longer tiles read the tables less often, at the price of a larger
// scratch (2048 tokens: scratch keys 1.5 MB for three 64-dim heads).
constexpr int64_t kFusedTileTokens = 2048;
int64_t conditional_tile_tokens(int64_t batch, int64_t tokens) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t wanted = std::max((tokens + kFusedTileTokens - 1) / kFusedTileTokens, (threads + batch - 1) / batch);
  const int64_t size = (std::max<int64_t>(tokens, 1) + wanted - 1) / wanted;
  return std::min(kFusedTileTokens, std::max<int64_t>(kLanes, (size + kLanes - 1) / kLanes * kLanes));
}

// sums[r * sums_stride + :kDim] = sum over t < n of weights[r * weight_stride + t] * keys[t * kDim + :kDim] for kRows
// rows: the rows' sums stay in registers while the keys stream past once.
template <int64_t kDim, int64_t kRows>
void weighted_key_sums(const float* weights, int64_t weight_stride, const float* keys, int64_t n, float* sums,
                       int64_t sums_stride) {
  constexpr int64_t kBlocks = kDim / kLanes;
  Vec acc[kRows][kBlocks] = {};
  for (int64_t t = 0; t < n; ++t) {
    Vec key[kBlocks];
    for (int64_t b = 0; b < kBlocks; ++b) key[b] = load(keys + t * kDim + b * kLanes);
    for (int64_t r = 0; r < kRows; ++r) {
      const float w = weights[r * weight_stride + t];
      for (int64_t b = 0; b < kBlocks; ++b) acc[r][b] += w * key[b];
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t b = 0; b < kBlocks; ++b) *reinterpret_cast<Vec*>(sums + r * sums_stride + b * kLanes) = acc[r][b];
  }
}

// Rows in blocks whose accumulators and one key fill at most 28 of AVX-512's 32 vector registers (6 rows of 64-dim
// keys: 9 query rows take two passes over the keys instead of three; narrower vectors use blocks of 4 and 2 rows);
// the rest in one block of its own size.
template <int64_t kDim>
void weighted_key_sums_rows(const float* weights, int64_t weight_stride, const float* keys, int64_t n, float* sums,
                            int64_t sums_stride, int64_t rows) {
  constexpr int64_t kRowBlock = kDim == 64 ? (kLanes == 16 ? 6 : 4) : 2;
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) {
    weighted_key_sums<kDim, kRowBlock>(weights + r * weight_stride, weight_stride, keys, n, sums + r * sums_stride,
                                       sums_stride);
  }
  const float* w = weights + r * weight_stride;
  float* o = sums + r * sums_stride;
  switch (rows - r) {
    case 0: return;
    case 1: return weighted_key_sums<kDim, 1>(w, weight_stride, keys, n, o, sums_stride);
    case 2: return weighted_key_sums<kDim, 2>(w, weight_stride, keys, n, o, sums_stride);
    case 3: return weighted_key_sums<kDim, 3>(w, weight_stride, keys, n, o, sums_stride);
    case 4: return weighted_key_sums<kDim, 4>(w, weight_stride, keys, n, o, sums_stride);
    default: return weighted_key_sums<kDim, 5>(w, weight_stride, keys, n, o, sums_stride);
  }
}

// One whole tile (every target head) of the fused loop: scores, then per query row its masks, peak and weights, then
// the weighted sums of every head's keys, kept in `keys` ([H, tile_tokens, kDim] scratch).
template <int64_t kDim, typename Table>
void conditional_tile_with_key_sums(const float* q, const uint8_t* codes, const HeadScales* scales, const Table* table,
                                    const float* steps, const float* mean, const float* cos, const float* sin,
                                    float* out, int64_t heads, int64_t rows, int64_t out_stride, int64_t tokens,
                                    int64_t stages,
                                    int64_t codebook_size, int64_t table_rows, int64_t begin, int64_t end,
                                    float scaling, float* keys, const ConditionalKeySums& spec, const float* mask,
                                    float* peaks, float* sums, bool per_head) {
  const int64_t n = end - begin;
  for (int64_t h = 0; h < heads; ++h) {
    conditional_scores_tile<kDim>(q, codes, scales, table, steps, mean, cos, sin, out, heads, h, rows, out_stride,
                                  tokens, stages, codebook_size, table_rows, begin, end, scaling,
                                  keys + h * spec.tile_tokens * kDim, true, per_head, kPrefetchTileTokens);
  }
  const int64_t all_rows = heads * rows;
  for (int64_t r = 0; r < all_rows; ++r) {
    float* s = out + r * out_stride + begin;
    if (mask != nullptr) {
      const float* row_mask = mask + (r % rows % spec.query_length) * tokens + begin;
      for (int64_t t = 0; t < n; ++t) s[t] += row_mask[t];
    }
    const float peak = row_max(s, n);
    peaks[r] = peak;
    if (peak == -std::numeric_limits<float>::infinity()) {
      std::fill(s, s + n, 0.f);  // a fully masked tile weighs nothing (and -inf would turn a later rescale into NaN)
    } else {
      exp_shifted(s, n, peak);
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
    weighted_key_sums_rows<kDim>(out + begin, out_stride, keys + i * spec.tile_tokens * kDim, n, sums + i * kDim,
                                 heads * kDim, all_rows);
  }
}

// Conditional keys: q [B, H, M, D] f32 (D 64 or 128); codes [B, H, N, S] u8; scales [B, H, N] f32 (or u8 with
// scale_levels [H, 256] f32); table flat f32 or f16, slices (j, h) for j = 0..H-1, h = j..H-1 in that order, each
// [R, D] (R >= S * K); mean [H, H*D] f32;
// cos, sin [B, N, D/2] f32  ->  scores written to out[((b * H + h) * M + m) * out_stride + n]; with `key_sums`, the
// fused loop for values coded given the keys (ConditionalKeySums).
// `per_head` (with key_sums only): keys coded per head instead, with the table, mean and step prerope_scores_into
// reads ([H, R, D], [H, D], [H, D]): the same fused loop, each head rebuilt from its own codes.
void conditional_scores_into(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& scale_levels, const at::Tensor& table,
                             const c10::optional<at::Tensor>& table_step, const at::Tensor& mean,
                             const at::Tensor& cos, const at::Tensor& sin, int64_t codebook_size, double scaling,
                             float* op, int64_t out_stride,
                             const ConditionalKeySums* key_sums = nullptr, bool per_head = false) {
  check(!per_head || key_sums != nullptr, "keys per head take this loop only to form the values' key sums");
  check(q.dim() == 4 && codes.dim() == 4 && table.dim() == (per_head ? 3 : 1) && mean.dim() == 2 && cos.dim() == 3 &&
            sin.dim() == 3,
        "unexpected ranks for conditional keys");
  for (const auto* t : {&q, &mean, &cos, &sin}) {
    check(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
          "float tensors must be contiguous float32 on CPU");
  }
  check_key_table(table, /*fixed_point_allowed=*/true);
  const bool fixed_point = table.scalar_type() == at::kShort;
  check(fixed_point == table_step.has_value(), "a fixed-point (int16) key table needs its step, and only it");
  check(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), dim = q.size(3);
  const int64_t tokens = codes.size(2), stages = codes.size(3);
  check(dim == 64 || dim == 128, "conditional keys need head_dim 64 or 128");
  const int64_t slice_count = per_head ? heads : heads * (heads + 1) / 2;
  if (fixed_point) {
    check(table_step->scalar_type() == at::kFloat && table_step->is_contiguous() && table_step->dim() == 2 &&
              table_step->size(0) == slice_count && table_step->size(1) == dim,
          "the key table's step must be contiguous float32 [slices (heads for keys per head), head_dim]");
  }
  const float* step_rows = fixed_point ? table_step->const_data_ptr<float>() : nullptr;
  check(heads <= kMaxConditionalHeads, "conditional keys support at most 16 KV heads");
  check(codes.size(0) == batch && codes.size(1) == heads, "codes do not match the query's batch and heads");
  check_scales(scales, scale_levels, batch, heads, tokens);
  check(!per_head || (table.size(0) == heads && table.size(2) == dim), "per-head key table must be [heads, R, head_dim]");
  const int64_t slices = slice_count * dim;
  check(table.numel() % slices == 0 && table.numel() / slices >= stages * codebook_size,
        "key table too small for these codes");
  const int64_t table_rows = table.numel() / slices;
  check(mean.size(0) == heads && mean.size(1) == (per_head ? dim : heads * dim),
        "key mean must be [heads, heads * head_dim] for conditional keys, [heads, head_dim] for keys per head");
  check_rotary_and_scores(cos, sin, batch, tokens, dim, out_stride);
  const int64_t tiles = (tokens + kConditionalTileTokens - 1) / kConditionalTileTokens;
  const float* qp = q.const_data_ptr<float>();
  const uint8_t* cp = codes.const_data_ptr<uint8_t>();
  const float* mp = mean.const_data_ptr<float>();
  const float* cosp = cos.const_data_ptr<float>();
  const float* sinp = sin.const_data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  with_table_rows</*kFixedPoint=*/true>(table, [&](const auto* tp) {
    using Table = std::remove_const_t<std::remove_pointer_t<decltype(tp)>>;
    if (key_sums != nullptr) {
      const int64_t tile_tokens = key_sums->tile_tokens;
      const int64_t tiles = (tokens + tile_tokens - 1) / tile_tokens;
      const int64_t all_rows = heads * rows;
      at::parallel_for(0, batch * tiles, 1, [&](int64_t first, int64_t last) {
        HeadScales head_scale[kMaxConditionalHeads];
        std::unique_ptr<float[]> keys(new float[heads * tile_tokens * dim]);  // scratch: written before it is read
        for (int64_t item = first; item < last; ++item) {
          const int64_t b = item / tiles, tile = item % tiles;
          const int64_t begin = tile * tile_tokens, end = std::min(tokens, begin + tile_tokens);
          for (int64_t j = 0; j < heads; ++j) head_scale[j] = head_scales(scales, scale_levels, b, j);
          const float* mask = key_sums->coded_mask == nullptr
                                  ? nullptr
                                  : key_sums->coded_mask + b * key_sums->query_length * tokens;
          float* peaks = key_sums->tile_peaks + item * all_rows;
          float* sums = key_sums->key_sums + item * all_rows * heads * dim;
          const auto run =
              dim == 64 ? conditional_tile_with_key_sums<64, Table> : conditional_tile_with_key_sums<128, Table>;
          run(qp + b * heads * rows * dim, cp + b * heads * tokens * stages, head_scale, tp, step_rows, mp,
              cosp + b * tokens * dim / 2, sinp + b * tokens * dim / 2, op + b * heads * rows * out_stride, heads, rows,
              out_stride, tokens, stages, codebook_size, table_rows, begin, end, scale, keys.get(), *key_sums, mask,
              peaks, sums, per_head);
        }
      });
      return;
    }
    // Items in (batch, tile, target head) order: head h costs h + 1 slice passes, and parallel_for hands each thread
    // one contiguous range, so ranges of whole tiles carry equal work (head-major order gave one of two threads twice
    // the other's). A tile reads most rows of every slice it needs anyway, so which item ran before barely matters.
    at::parallel_for(0, batch * tiles * heads, 1, [&](int64_t first, int64_t last) {
      HeadScales head_scale[kMaxConditionalHeads];
      // scratch only: the first source writes each partial key before anything reads it, so it is left uninitialized
      // (a zeroed vector cost a 256-512 KB memset per layer call); one head alone never uses it
      std::unique_ptr<float[]> partial(heads > 1 ? new float[kConditionalTileTokens * dim] : nullptr);
      for (int64_t item = first; item < last; ++item) {
        const int64_t b = item / (tiles * heads), tile = item / heads % tiles, h = item % heads;
        const int64_t begin = tile * kConditionalTileTokens, end = std::min(tokens, begin + kConditionalTileTokens);
        for (int64_t j = 0; j <= h; ++j) head_scale[j] = head_scales(scales, scale_levels, b, j);
        const float* qi = qp + b * heads * rows * dim;
        const uint8_t* ci = cp + b * heads * tokens * stages;
        const float* cosi = cosp + b * tokens * dim / 2;
        const float* sini = sinp + b * tokens * dim / 2;
        float* oi = op + b * heads * rows * out_stride;
        if (dim == 64) {
          conditional_scores_tile<64>(qi, ci, head_scale, tp, step_rows, mp, cosi, sini, oi, heads, h, rows,
                                      out_stride, tokens, stages, codebook_size, table_rows, begin, end, scale,
                                      partial.get(), false);
        } else {
          conditional_scores_tile<128>(qi, ci, head_scale, tp, step_rows, mp, cosi, sini, oi, heads, h, rows,
                                       out_stride, tokens, stages, codebook_size, table_rows, begin, end, scale,
                                       partial.get(), false);
        }
      }
    });
  });
}

// The rows of one pass over the codes: `heads` heads (several when their codes are shared, at most kMaxPassHeads) of
// `rows` query rows. Row (h, m) of token t weighs probabilities[h * head_stride + m * row_stride + t] * scales[h][t].
constexpr int64_t kMaxPassHeads = 64;
struct WeightSource {
  const float* probabilities;
  int64_t head_stride, row_stride;
  HeadScales scales[kMaxPassHeads];
  int64_t heads, rows;
};

// The weights of all tokens, formed once per pass before the histograms read them: [tokens, padded], the rows padded
// with zeros to weight_row_floats. Adds the weight sum only when asked.
std::vector<float> token_weights(const WeightSource& source, float* weight_sum, int64_t padded, int64_t tokens) {
  const int64_t rows = source.heads * source.rows;
  std::vector<float> weights(tokens * padded, 0.f);
  for (int64_t h = 0; h < source.heads; ++h) {
    const HeadScales& scale = source.scales[h];
    for (int64_t m = 0; m < source.rows; ++m) {
      const float* p = source.probabilities + h * source.head_stride + m * source.row_stride;
      float* column = weights.data() + h * source.rows + m;
      for (int64_t t = 0; t < tokens; ++t) column[t * padded] = p[t] * scale[t];
    }
  }
  if (weight_sum != nullptr) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t m = 0; m < rows; ++m) weight_sum[m] += weights[t * padded + m];
    }
  }
  return weights;
}

// Adds one token's weight row (P floats) into a bin, a register at a time (GCC moved a vector wider than a register
// through the stack in 16-byte pieces); a 12-float row is an 8-float and a 4-float add (vector sizes must be powers
// of two, so with 16-float registers too).
template <int64_t P>
inline void add_weight_row(float* bin, const float* w) {
  constexpr int64_t R = P >= kLanes ? kLanes : (P >= 8 ? 8 : P), kWhole = P / R, kTail = P % R;
  static_assert(kTail == 0 || kTail == 4, "weight rows are whole registers, or 12 floats");
  typedef float VecR __attribute__((vector_size(4 * R), aligned(4)));
  typedef float Vec4 __attribute__((vector_size(16), aligned(4)));
  for (int64_t c = 0; c < kWhole; ++c) reinterpret_cast<VecR*>(bin)[c] += reinterpret_cast<const VecR*>(w)[c];
  if (kTail == 4) *reinterpret_cast<Vec4*>(bin + kWhole * R) += *reinterpret_cast<const Vec4*>(w + kWhole * R);
}

// The histograms of kCount consecutive stages over all tokens, into `bins` (kCount x K x P floats, zeroed here), one
// pass over the weights for all of them. A few stages at a time, each pass's bins multiplied by the codebooks before
// the next pass reuses them: 12-24 KB for 256 codewords, which stay in L1 while the weights stream past in order.
// Token by token, each token's adds spread over every stage's bins (737 KB for the default model's 45 value stages),
// more than a 512 KB L2 holds; and a histogram of all stages at once, zeroed and read back, is a fixed cost per layer
// at any context. The weights and codes are read again by every pass, from L2: two stages per pass halve that
// traffic.
template <int64_t P, int64_t kCount>
void stage_histograms(const float* weights, const uint8_t* stage_codes, int64_t stages, int64_t tokens,
                      int64_t codebook_size, float* bins) {
  std::fill(bins, bins + kCount * codebook_size * P, 0.f);
  for (int64_t t = 0; t < tokens; ++t) {
    const uint8_t* token_codes = stage_codes + t * stages;
    for (int64_t c = 0; c < kCount; ++c) {
      add_weight_row<P>(bins + (c * codebook_size + token_codes[c]) * P, weights + t * P);
    }
  }
}

// The same, one stage, for rows padded to any multiple of 16 floats (more than 16 query rows per pass).
void stage_histogram_wide(const float* weights, const uint8_t* stage_codes, int64_t stages, int64_t tokens,
                          int64_t padded, int64_t codebook_size, float* bins) {
  std::fill(bins, bins + codebook_size * padded, 0.f);
  for (int64_t t = 0; t < tokens; ++t) {
    float* bin = bins + stage_codes[t * stages] * padded;
    for (int64_t c = 0; c < padded; c += 16) add_weight_row<16>(bin + c, weights + t * padded + c);
  }
}

// How many floats a token's weight row takes: the pass's query rows rounded up to whole vectors, so that a token adds
// into a bin with a few vector read-modify-writes instead of `rows` scalar ones. 9 rows (joint-head values, three
// heads of three query rows) take 12 floats (16 wastes a third of the bytes streamed), with AVX-512 too: two
// stages' bins of 256 x 12 floats fit in L1 where 256 x 16 do not, and one pass over the weights for two stages
// outweighs the single add per token that 16-float rows would allow.
int64_t weight_row_floats(int64_t rows) {
  if (rows <= 4) return 4;
  if (rows <= 8) return 8;
  if (rows <= 12) return 12;
  return (rows + 15) / 16 * 16;
}

// Stages per histogram pass: two while their bins fit in 24 KB (L1 also holds the streaming weights) and the rows
// are one of the compiled widths; one for wider rows (stage_histogram_wide).
int64_t stages_per_pass(int64_t padded, int64_t codebook_size) {
  const bool fits = 2 * codebook_size * padded * static_cast<int64_t>(sizeof(float)) <= 24 * 1024;
  return padded <= 16 && fits ? 2 : 1;
}

// Histograms of `count` stages (count <= stages_per_pass) starting at `stage_codes`' first stage.
void histogram_pass(const float* weights, const uint8_t* stage_codes, int64_t stages, int64_t tokens, int64_t padded,
                    int64_t codebook_size, int64_t count, float* bins) {
  const auto run = [&](auto one, auto two) {
    (count == 2 ? two : one)(weights, stage_codes, stages, tokens, codebook_size, bins);
  };
  switch (padded) {
    case 4: return run(stage_histograms<4, 1>, stage_histograms<4, 2>);
    case 8: return run(stage_histograms<8, 1>, stage_histograms<8, 2>);
    case 12: return run(stage_histograms<12, 1>, stage_histograms<12, 2>);
    case 16: return run(stage_histograms<16, 1>, stage_histograms<16, 2>);
    default:
      check(count == 1, "rows wider than 16 floats are histogrammed one stage per pass");
      return stage_histogram_wide(weights, stage_codes, stages, tokens, padded, codebook_size, bins);
  }
}

// z[m, :g] += sum over codewords k of counts[k, m] * words[k, :g], for every query row m: the query rows' sums kept
// in registers while the stage's codewords stream past once.
template <int64_t G>
void stage_times_codebook(const float* counts, const float* words, float* z, int64_t rows, int64_t padded,
                          int64_t codebook_size, int64_t transform_dim) {
  typedef float VecG __attribute__((vector_size(4 * G), aligned(4)));
  constexpr int64_t kRowBlock = 8;
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, rows - m0);
    VecG sums[kRowBlock] = {};
    for (int64_t k = 0; k < codebook_size; ++k) {
      const VecG word = *reinterpret_cast<const VecG*>(words + k * G);
      const float* c = counts + k * padded + m0;
      for (int64_t m = 0; m < block; ++m) sums[m] += c[m] * word;
    }
    for (int64_t m = 0; m < block; ++m) {
      VecG* target = reinterpret_cast<VecG*>(z + (m0 + m) * transform_dim);
      *target += sums[m];
    }
  }
}

void stage_times_codebook_any(const float* counts, const float* words, float* z, int64_t rows, int64_t padded,
                              int64_t codebook_size, int64_t transform_dim, int64_t group_dim) {
  for (int64_t k = 0; k < codebook_size; ++k) {
    for (int64_t m = 0; m < rows; ++m) {
      const float c = counts[k * padded + m];
      for (int64_t j = 0; j < group_dim; ++j) z[m * transform_dim + j] += c * words[k * group_dim + j];
    }
  }
}

// probabilities [B, H, M, >= N] f32, any strides but unit stride within a row (only the first N columns are read: the
// coded tokens of a softmax that may also span exact tokens; they need not be normalized); codes [B, H or 1, N, S] u8
// (1: joint-head codes, shared by every head); scales [B, H, N] f32 (or u8 with scale_levels [H, 256] f32);
// codebooks [S, K, g] f32; stage_groups [S] i64
//   -> z [B, H, M, Dt] f32: sum over tokens of p * scale * (the token's transform-domain vector: codeword of each
//      stage placed in its group), weight sum [B, H, M] f32 (sum of p * scale).
// Per pass over a code sequence and range of stages, a histogram of p * scale per (stage, codeword) is built, then
// multiplied by the codebooks: each codeword is read once per call instead of once per token. Joint-head codes are
// read once for all heads, with every head's rows in the histogram.
std::tuple<at::Tensor, at::Tensor> value_transform_sums(const at::Tensor& probabilities, const at::Tensor& codes,
                                                        const at::Tensor& scales,
                                                        const c10::optional<at::Tensor>& scale_levels,
                                                        const at::Tensor& codebooks, const at::Tensor& stage_groups,
                                                        int64_t transform_dim) {
  check(probabilities.dim() == 4 && codes.dim() == 4 && scales.dim() == 3 && codebooks.dim() == 3 &&
            stage_groups.dim() == 1,
        "unexpected ranks");
  check(probabilities.scalar_type() == at::kFloat && (probabilities.stride(3) == 1 || probabilities.size(3) <= 1),
        "probabilities must be float32 with contiguous rows");
  check(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  check(codebooks.scalar_type() == at::kFloat && codebooks.is_contiguous(), "codebooks must be contiguous float32");
  check(stage_groups.scalar_type() == at::kLong && stage_groups.is_contiguous(), "stage_groups must be int64");
  const int64_t batch = probabilities.size(0), heads = probabilities.size(1), rows = probabilities.size(2);
  const int64_t tokens = codes.size(2), stages = codes.size(3);
  const int64_t codebook_size = codebooks.size(1), group_dim = codebooks.size(2);
  check(probabilities.size(3) >= tokens, "fewer probabilities than coded tokens");
  check(codes.size(0) == batch && (codes.size(1) == heads || codes.size(1) == 1), "codes do not match");
  check_scales(scales, scale_levels, batch, heads, tokens);
  check(codebooks.size(0) >= stages && stage_groups.size(0) >= stages, "fewer codebooks than code stages");
  check(group_dim >= 1 && transform_dim % group_dim == 0, "group_dim must divide transform_dim");
  const int64_t* groups = stage_groups.data_ptr<int64_t>();
  for (int64_t s = 0; s < stages; ++s) {
    check(groups[s] >= 0 && groups[s] < transform_dim / group_dim, "stage group out of range");
  }
  // One pass per code sequence: per head, or (joint-head codes) one for all heads.
  const int64_t code_heads = codes.size(1);
  const int64_t heads_per_pass = heads / code_heads, pass_rows = heads_per_pass * rows;
  check(heads_per_pass <= kMaxPassHeads, "too many heads share one code sequence (at most 64)");
  const int64_t padded = weight_row_floats(pass_rows);
  const int64_t pass_stages = stages_per_pass(padded, codebook_size);
  // Threads split the stages, not the tokens: each histograms its own stages over all tokens, so there are no
  // private histograms to add up afterwards; only the small per-range sums [rows, Dt] are added at the end.
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), stages));
  const int64_t range_stages = (stages + ranges - 1) / ranges;
  const int64_t passes = batch * code_heads;
  auto partial = at::zeros({ranges, batch, heads, rows, transform_dim}, probabilities.options());
  auto weight_sum = at::zeros({batch, heads, rows}, probabilities.options());
  const float* pp = probabilities.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* bp = codebooks.data_ptr<float>();
  float* zp = partial.data_ptr<float>();
  float* wp = weight_sum.data_ptr<float>();
  at::parallel_for(0, passes * ranges, 1, [&](int64_t first, int64_t last) {
    // Bins outermost, query rows innermost (padded): one token's rows add into one cache line.
    std::vector<float> bins(pass_stages * codebook_size * padded);
    for (int64_t item = first; item < last; ++item) {
      const int64_t pass = item / ranges, range = item % ranges;
      const int64_t b = pass / code_heads, first_head = (pass % code_heads) * heads_per_pass;
      const int64_t first_stage = std::min(stages, range * range_stages);
      const int64_t last_stage = std::min(stages, first_stage + range_stages);
      WeightSource source{pp + b * probabilities.stride(0) + first_head * probabilities.stride(1),
                          probabilities.stride(1), probabilities.stride(2), {}, heads_per_pass, rows};
      for (int64_t h = 0; h < heads_per_pass; ++h) source.scales[h] = head_scales(scales, scale_levels, b, first_head + h);
      const int64_t first_row = (b * heads + first_head) * rows;  // of the [B, H, M] rows, this pass's are consecutive
      const std::vector<float> weights = token_weights(source, range == 0 ? wp + first_row : nullptr, padded, tokens);
      const uint8_t* pass_codes = cp + pass * tokens * stages;
      float* z = zp + (range * batch * heads * rows + first_row) * transform_dim;
      for (int64_t s = first_stage; s < last_stage; s += pass_stages) {
        const int64_t count = std::min(pass_stages, last_stage - s);
        histogram_pass(weights.data(), pass_codes + s, stages, tokens, padded, codebook_size, count, bins.data());
        for (int64_t c = 0; c < count; ++c) {
          const float* counts = bins.data() + c * codebook_size * padded;
          const float* words = bp + (s + c) * codebook_size * group_dim;
          float* zs = z + groups[s + c] * group_dim;
          if (group_dim == 8) {
            stage_times_codebook<8>(counts, words, zs, pass_rows, padded, codebook_size, transform_dim);
          } else {
            stage_times_codebook_any(counts, words, zs, pass_rows, padded, codebook_size, transform_dim, group_dim);
          }
        }
      }
    }
  });
  return {ranges == 1 ? partial[0] : partial.sum(0), weight_sum};
}

// The whole decode-time attention of one layer over pre-RoPE coded keys, jointly with its exact tokens, in one call:
// what kernels/cpu.py otherwise strings together from a dozen PyTorch ops, each a dispatch and a temporary, per layer
// and step: at short contexts that glue costs as much as the key loop itself.
//   q [B, H, M, D] f32 (M = query heads per KV head x query_length, row m uses mask row m % query_length);
//   coded keys as prerope_scores_into takes them; coded values as value_transform_sums takes them, with
//   value_mean [H, D] and value_synthesis [H, Dt, D] f32; coded_mask [B, Lq, N] / exact_mask [B, Lq, T] additive f32
//   or absent;
//   exact_keys / exact_values [B, H, T, D] f32 (RoPE applied), T may be 0
//   -> (output [B, H, M, D] f32, log-sum-exp [B, H, M] f32), one softmax over the coded and the exact tokens.
std::tuple<at::Tensor, at::Tensor> decode_attention(
    const at::Tensor& q, const at::Tensor& key_codes, const at::Tensor& key_scales,
    const c10::optional<at::Tensor>& key_scale_levels, const at::Tensor& key_table, const at::Tensor& key_mean,
    const at::Tensor& cos, const at::Tensor& sin, int64_t codebook_size, const at::Tensor& value_codes,
    const at::Tensor& value_scales, const c10::optional<at::Tensor>& value_scale_levels,
    const at::Tensor& value_codebooks, const at::Tensor& value_stage_groups, const at::Tensor& value_mean,
    const at::Tensor& value_synthesis, const c10::optional<at::Tensor>& coded_mask,
    const at::Tensor& exact_keys, const at::Tensor& exact_values, const c10::optional<at::Tensor>& exact_mask,
    int64_t query_length, double scaling, bool conditional_keys, const c10::optional<at::Tensor>& predicted_codes,
    const c10::optional<at::Tensor>& predicted_scales, const c10::optional<at::Tensor>& predicted_scale_levels,
    const c10::optional<at::Tensor>& predicted_codebooks, const c10::optional<at::Tensor>& predicted_stage_groups,
    const c10::optional<at::Tensor>& predicted_mean, const c10::optional<at::Tensor>& predicted_synthesis,
    const c10::optional<at::Tensor>& predicted_bias, const c10::optional<at::Tensor>& value_predictor,
    const c10::optional<at::Tensor>& key_table_step) {
  check(q.dim() == 4 && key_codes.dim() == 4, "unexpected ranks");
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), dim = q.size(3);
  const int64_t tokens = key_codes.size(2), exact = exact_keys.size(2), width = tokens + exact;
  check(query_length >= 1 && rows % query_length == 0, "query rows must be a multiple of query_length");
  for (const auto* t : {&exact_keys, &exact_values}) {
    check(t->dim() == 4 && t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == batch &&
              t->size(1) == heads && t->size(2) == exact && t->size(3) == dim,
          "exact keys and values must be contiguous float32 [batch, heads, tokens, head_dim]");
  }
  check(value_mean.scalar_type() == at::kFloat && value_mean.is_contiguous() && value_mean.dim() == 2 &&
            value_mean.size(0) == heads && value_mean.size(1) == dim,
        "value_mean must be contiguous float32 [heads, head_dim]");
  check(value_synthesis.scalar_type() == at::kFloat && value_synthesis.is_contiguous() &&
            value_synthesis.dim() == 3 && value_synthesis.size(0) == heads && value_synthesis.size(2) == dim,
        "value_synthesis must be contiguous float32 [heads, transform_dim, head_dim]");
  const int64_t transform_dim = value_synthesis.size(1);
  check(value_codes.dim() == 4 && value_codes.size(2) == tokens,
        "value codes must cover the same tokens as key codes");
  for (const auto& [mask, length] : {std::make_pair(&coded_mask, tokens), std::make_pair(&exact_mask, exact)}) {
    if (mask->has_value()) {
      const at::Tensor& m = **mask;
      check(m.scalar_type() == at::kFloat && m.is_contiguous() && m.dim() == 3 && m.size(0) == batch &&
                m.size(1) == query_length && m.size(2) == length,
            "masks must be contiguous float32 [batch, query_length, tokens]");
    }
  }
  auto scores = at::empty({batch, heads, rows, width}, q.options());
  float* sp = scores.data_ptr<float>();
  // Values coded given the keys (value_predictor): the key loop also forms the attention-weighted key sums the
  // prediction needs (ConditionalKeySums), tile by tile, with the coded tokens' masks and weights. Keys per head go
  // through the conditional loop for this, each head its own only source; the other way to add the prediction, a
  // histogram of the key codes per key head (predicted_codes...), is one more pass over every key head's codes.
  const bool fused_prediction = value_predictor.has_value();
  check(!fused_prediction || !predicted_codes.has_value(),
        "give the values' prediction either as value_predictor or as predicted codes and tables, not both");
  check(!fused_prediction || conditional_keys || (key_codes.size(1) == heads && (dim == 64 || dim == 128)),
        "value_predictor with keys per head needs a code per head and head_dim 64 or 128 (else pass predicted codes)");
  const float* predictor = nullptr;
  int64_t tiles = 0, tile_tokens = 0;
  at::Tensor tile_peaks, tile_key_sums, key_sums;
  if (fused_prediction) {
    check(value_predictor->scalar_type() == at::kFloat && value_predictor->is_contiguous() &&
              value_predictor->dim() == 2 && value_predictor->size(0) == heads * dim + 1 &&
              value_predictor->size(1) == heads * dim,
          "value_predictor must be contiguous float32 [heads * head_dim + 1, heads * head_dim]");
    predictor = value_predictor->const_data_ptr<float>();
    tile_tokens = conditional_tile_tokens(batch, tokens);
    tiles = (tokens + tile_tokens - 1) / tile_tokens;
    tile_peaks = at::empty({batch, tiles, heads * rows}, q.options());
    tile_key_sums = at::empty({batch, tiles, heads * rows, heads * dim}, q.options());
    key_sums = at::zeros({batch * heads * rows, heads * dim}, q.options());
  }
  if (conditional_keys || fused_prediction) {
    const ConditionalKeySums spec{coded_mask.has_value() ? coded_mask->const_data_ptr<float>() : nullptr,
                                  query_length, tile_tokens,
                                  fused_prediction ? tile_peaks.data_ptr<float>() : nullptr,
                                  fused_prediction ? tile_key_sums.data_ptr<float>() : nullptr};
    conditional_scores_into(q, key_codes, key_scales, key_scale_levels, key_table, key_table_step, key_mean, cos, sin,
                            codebook_size, scaling, sp, width, fused_prediction ? &spec : nullptr,
                            /*per_head=*/!conditional_keys);
  } else {
    prerope_scores_into(q, key_codes, key_scales, key_scale_levels, key_table, key_table_step, key_mean, cos, sin,
                        codebook_size, scaling, sp, width);
  }
  const float scale = static_cast<float>(scaling);
  const float* qp = q.const_data_ptr<float>();
  const float* kp = exact_keys.const_data_ptr<float>();
  const float* coded_mp = coded_mask.has_value() ? coded_mask->const_data_ptr<float>() : nullptr;
  const float* exact_mp = exact_mask.has_value() ? exact_mask->const_data_ptr<float>() : nullptr;
  auto peaks = at::empty({batch, heads, rows}, q.options());
  float* pk = peaks.data_ptr<float>();
  const float* tile_peak_data = fused_prediction ? tile_peaks.const_data_ptr<float>() : nullptr;
  const float* tile_key_sum_data = fused_prediction ? tile_key_sums.const_data_ptr<float>() : nullptr;
  float* key_sum_data = fused_prediction ? key_sums.data_ptr<float>() : nullptr;
  // exact tokens' scores, masks, and each row's maximum (0 for a fully masked row, as reference.exp_weights)
  at::parallel_for(0, batch * heads * rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t bh = row / rows, m = row % rows, b = bh / heads;
      const int64_t l = m % query_length;
      float* out = sp + row * width;
      const float* qm = qp + row * dim;
      const float* keys = kp + bh * exact * dim;
      for (int64_t t = 0; t < exact; ++t) {
        float dot = 0.f;
        for (int64_t d = 0; d < dim; ++d) dot += qm[d] * keys[t * dim + d];
        out[tokens + t] = dot * scale;
      }
      if (coded_mp != nullptr && !fused_prediction) {
        const float* mask = coded_mp + (b * query_length + l) * tokens;
        for (int64_t n = 0; n < tokens; ++n) out[n] += mask[n];
      }
      if (exact_mp != nullptr) {
        const float* mask = exact_mp + (b * query_length + l) * exact;
        for (int64_t t = 0; t < exact; ++t) out[tokens + t] += mask[t];
      }
      constexpr float kNone = -std::numeric_limits<float>::infinity();
      if (!fused_prediction) {
        float peak = row_max(out, width);
        if (peak == kNone) peak = 0.f;
        for (int64_t n = 0; n < width; ++n) out[n] -= peak;
        pk[row] = peak;
        continue;
      }
      // the coded tokens already hold e^(score - tile peak): rescale each tile, and its key sums, to the row's peak
      const int64_t r = row % (heads * rows);
      float peak = row_max(out + tokens, exact);
      const float* row_peaks = tile_peak_data + b * tiles * heads * rows + r;  // stride heads * rows per tile
      for (int64_t tile = 0; tile < tiles; ++tile) peak = std::max(peak, row_peaks[tile * heads * rows]);
      if (peak == kNone) peak = 0.f;
      float* sums = key_sum_data + row * heads * dim;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const float tile_peak = row_peaks[tile * heads * rows];
        const float factor = tile_peak == kNone ? 0.f : std::exp(tile_peak - peak);
        const int64_t begin = tile * tile_tokens, end = std::min(tokens, begin + tile_tokens);
        if (factor != 1.f) {
          for (int64_t n = begin; n < end; ++n) out[n] *= factor;
        }
        const float* tile_sums = tile_key_sum_data + ((b * tiles + tile) * heads * rows + r) * heads * dim;
        for (int64_t d = 0; d < heads * dim; ++d) sums[d] += factor * tile_sums[d];
      }
      exp_shifted(out + tokens, exact, peak);
      pk[row] = peak;
    }
  });
  if (!fused_prediction) scores.exp_();  // ATen's vectorized exp; unnormalized weights: outputs are divided by totals
  auto [z, weight_sum] = value_transform_sums(scores, value_codes, value_scales, value_scale_levels, value_codebooks,
                                              value_stage_groups, transform_dim);
  // Values coded given the keys (v = residual + k^ @ A + bias): the value codes above hold the residual, and each
  // source key head j adds sum_t p_t s_tj (mean_j + z_tj @ synthesis_j) @ A[j, h] to every value head h, i.e.
  // w_j * predicted_mean[j, h] + z_j @ predicted_synthesis[j, h] with z_j, w_j a histogram of head j's key codes over
  // the query rows of all heads (each value head reads every key head).
  const bool predicted = predicted_codes.has_value() && !fused_prediction;
  int64_t source_heads = 0, predicted_dim = 0;
  std::vector<at::Tensor> predicted_sums;  // per source head: z [B, 1, H*M, Dt'] and w [B, 1, H*M]
  if (predicted) {
    check(predicted_scales.has_value() && predicted_codebooks.has_value() && predicted_stage_groups.has_value() &&
              predicted_mean.has_value() && predicted_synthesis.has_value() && predicted_bias.has_value(),
          "predicted values need codes, scales, codebooks, stage groups, mean, synthesis and bias");
    const at::Tensor& codes = *predicted_codes;
    check(codes.dim() == 4 && codes.size(0) == batch && codes.size(2) == tokens,
          "predicted codes must be [batch, source heads, coded tokens, stages]");
    source_heads = codes.size(1);
    const at::Tensor& synthesis = *predicted_synthesis;
    check(synthesis.scalar_type() == at::kFloat && synthesis.is_contiguous() && synthesis.dim() == 4 &&
              synthesis.size(0) == source_heads && synthesis.size(1) == heads && synthesis.size(3) == dim,
          "predicted_synthesis must be contiguous float32 [source heads, heads, transform_dim, head_dim]");
    predicted_dim = synthesis.size(2);
    check(predicted_mean->scalar_type() == at::kFloat && predicted_mean->is_contiguous() &&
              predicted_mean->dim() == 3 && predicted_mean->size(0) == source_heads &&
              predicted_mean->size(1) == heads && predicted_mean->size(2) == dim,
          "predicted_mean must be contiguous float32 [source heads, heads, head_dim]");
    check(predicted_bias->scalar_type() == at::kFloat && predicted_bias->is_contiguous() &&
              predicted_bias->dim() == 2 && predicted_bias->size(0) == heads && predicted_bias->size(1) == dim,
          "predicted_bias must be contiguous float32 [heads, head_dim]");
    check(predicted_codebooks->dim() == 4 && predicted_stage_groups->dim() == 2 &&
              (predicted_codebooks->size(0) == 1 || predicted_codebooks->size(0) == source_heads) &&
              predicted_stage_groups->size(0) == predicted_codebooks->size(0),
          "predicted codebooks must be [1 or source heads, stages, K, g] with stage groups [1 or source heads, stages]");
    const auto all_rows = scores.view({batch, 1, heads * rows, width});
    for (int64_t j = 0; j < source_heads; ++j) {
      const int64_t book = predicted_codebooks->size(0) == 1 ? 0 : j;
      c10::optional<at::Tensor> levels;
      if (predicted_scale_levels.has_value()) levels = predicted_scale_levels->narrow(0, j, 1).contiguous();
      auto [zj, wj] = value_transform_sums(all_rows, codes.narrow(1, j, 1).contiguous(),
                                           predicted_scales->narrow(1, j, 1).contiguous(), levels,
                                           (*predicted_codebooks)[book].contiguous(),
                                           (*predicted_stage_groups)[book].contiguous(), predicted_dim);
      predicted_sums.push_back(zj.contiguous());
      predicted_sums.push_back(wj.contiguous());
    }
  }
  auto out = at::empty({batch, heads, rows, dim}, q.options());
  auto lse = at::empty({batch, heads, rows}, q.options());
  const float* zp = z.const_data_ptr<float>();
  const float* wp = weight_sum.const_data_ptr<float>();
  const float* vm = value_mean.const_data_ptr<float>();
  const float* vs = value_synthesis.const_data_ptr<float>();
  const float* ev = exact_values.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, batch * heads * rows, 1, [&](int64_t first, int64_t last) {
    std::vector<float> acc(dim);
    for (int64_t row = first; row < last; ++row) {
      const int64_t bh = row / rows, h = bh % heads;
      const float* weights = sp + row * width;
      float total = row_sum(weights, width);
      lp[row] = std::log(total) + pk[row];
      total = std::max(total, std::numeric_limits<float>::min());
      // values are s_n * (mean + z_n @ synthesis): linear, so the weighted sum is weight_sum * mean + z @ synthesis
      const float w = wp[row];
      for (int64_t d = 0; d < dim; ++d) acc[d] = w * vm[h * dim + d];
      const float* zr = zp + row * transform_dim;
      const float* synthesis = vs + h * transform_dim * dim;
      for (int64_t j = 0; j < transform_dim; ++j) {
        const float c = zr[j];
        if (c == 0.f) continue;  // components no stage codes (weak principal components) stay exactly zero
        const float* srow = synthesis + j * dim;
        for (int64_t d = 0; d < dim; ++d) acc[d] += c * srow[d];
      }
      if (predicted) {
        const float* pm = predicted_mean->const_data_ptr<float>();
        const float* ps = predicted_synthesis->const_data_ptr<float>();
        for (int64_t j = 0; j < source_heads; ++j) {
          const float w_j = predicted_sums[2 * j + 1].const_data_ptr<float>()[row];  // rows of [B, 1, H*M] = [B, H, M]
          const float* mean = pm + (j * heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) acc[d] += w_j * mean[d];
          const float* zj = predicted_sums[2 * j].const_data_ptr<float>() + row * predicted_dim;
          const float* synthesis_j = ps + (j * heads + h) * predicted_dim * dim;
          for (int64_t k = 0; k < predicted_dim; ++k) {
            const float c = zj[k];
            if (c == 0.f) continue;
            const float* srow = synthesis_j + k * dim;
            for (int64_t d = 0; d < dim; ++d) acc[d] += c * srow[d];
          }
        }
        const float coded_weight = row_sum(weights, tokens);  // the bias is predicted for the coded tokens only
        const float* bias = predicted_bias->const_data_ptr<float>() + h * dim;
        for (int64_t d = 0; d < dim; ++d) acc[d] += coded_weight * bias[d];
      }
      if (fused_prediction) {  // [sum_t p_t k^_t, sum_t p_t] @ predictor, value head h's columns
        const int64_t flat = heads * dim;
        const float* sums = key_sum_data + row * flat;
        for (int64_t i = 0; i < flat; ++i) {
          const float c = sums[i];
          if (c == 0.f) continue;
          const float* prow = predictor + i * flat + h * dim;
          for (int64_t d = 0; d < dim; ++d) acc[d] += c * prow[d];
        }
        const float coded_weight = row_sum(weights, tokens);
        const float* bias = predictor + flat * flat + h * dim;
        for (int64_t d = 0; d < dim; ++d) acc[d] += coded_weight * bias[d];
      }
      const float* values = ev + bh * exact * dim;
      for (int64_t t = 0; t < exact; ++t) {
        const float p = weights[tokens + t];
        for (int64_t d = 0; d < dim; ++d) acc[d] += p * values[t * dim + d];
      }
      float* o = op + row * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = acc[d] / total;
    }
  });
  return {out, lse};
}

constexpr int64_t kScoreBlocks = 4;
constexpr int64_t kEncodeTileRows = 32;

// a * b + c rounded once, in every loop that scores codewords: left to the compiler, one loop form was contracted
// into fused multiply-adds and another was not, so two equal codewords could score differently and the search
// broke their tie toward the later one. Scalar tails do the same operation.
inline Vec multiply_add(float a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return reinterpret_cast<Vec>(_mm512_fmadd_ps(_mm512_set1_ps(a), reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  return reinterpret_cast<Vec>(_mm256_fmadd_ps(_mm256_set1_ps(a), reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
#else
  return a * b + c;  // no FMA unit: std::fma would be a slow library call
#endif
}
inline float multiply_add(float a, float b, float c) {
#if defined(__FMA__) || defined(__AVX512F__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// scores[b, k] = <r_b, c_k> - |c_k|^2 / 2 for `beams` residuals r [beams, g] and one stage's K codewords, transposed
// (book_t [g, K]). Four residuals at a time share each load of codewords (a tile of 4 x 2 registers of sums): 6
// loads, broadcasts included, per 8 multiply-adds, against 5 per 4 one residual at a time. Each sum adds its g
// products in the same order as the one-residual loop, so the scores, and the codes, are the same.
constexpr int64_t kScoreBeams = 4;

// One codeword's score, past the last whole block of registers.
inline float codeword_score(const float* r, int64_t group_dim, const float* book_t, const float* half, int64_t size,
                            int64_t k) {
  float score = -half[k];
  for (int64_t j = 0; j < group_dim; ++j) score = multiply_add(r[j], book_t[j * size + k], score);
  return score;
}

// Scores of kBeams residuals (r [kBeams, g]) against codewords k .. k + 2 kLanes - 1, in two registers per residual.
template <int64_t kBeams>
inline void score_tile(const float* r, int64_t group_dim, const float* book_t, const float* half, int64_t size,
                       int64_t k, Vec (&acc)[kBeams][2]) {
  const Vec h0 = -load(half + k), h1 = -load(half + k + kLanes);
  for (int64_t u = 0; u < kBeams; ++u) {
    acc[u][0] = h0;
    acc[u][1] = h1;
  }
  for (int64_t j = 0; j < group_dim; ++j) {
    const Vec w0 = load(book_t + j * size + k), w1 = load(book_t + j * size + k + kLanes);
    for (int64_t u = 0; u < kBeams; ++u) {
      const float rj = r[u * group_dim + j];
      acc[u][0] = multiply_add(rj, w0, acc[u][0]);
      acc[u][1] = multiply_add(rj, w1, acc[u][1]);
    }
  }
}

void one_residual_scores(const float* r, int64_t group_dim, const float* book_t, const float* half, int64_t size,
                         float* scores) {
  // kScoreBlocks registers of sums at once: one register's g dependent adds would leave the loop waiting on the
  // adder's latency
  int64_t k = 0;
  for (; k + kScoreBlocks * kLanes <= size; k += kScoreBlocks * kLanes) {
    Vec acc[kScoreBlocks];
    for (int64_t u = 0; u < kScoreBlocks; ++u) acc[u] = -load(half + k + u * kLanes);
    for (int64_t j = 0; j < group_dim; ++j) {
      const float* words = book_t + j * size + k;
      for (int64_t u = 0; u < kScoreBlocks; ++u) acc[u] = multiply_add(r[j], load(words + u * kLanes), acc[u]);
    }
    for (int64_t u = 0; u < kScoreBlocks; ++u) *reinterpret_cast<Vec*>(scores + k + u * kLanes) = acc[u];
  }
  for (; k + kLanes <= size; k += kLanes) {
    Vec acc = -load(half + k);
    for (int64_t j = 0; j < group_dim; ++j) acc = multiply_add(r[j], load(book_t + j * size + k), acc);
    *reinterpret_cast<Vec*>(scores + k) = acc;
  }
  for (; k < size; ++k) {
    scores[k] = codeword_score(r, group_dim, book_t, half, size, k);
  }
}

void beam_scores(const float* residuals, int64_t beams, int64_t group_dim, const float* book_t, const float* half,
                 int64_t size, float* scores) {
  int64_t b = 0;
  for (; b + kScoreBeams <= beams; b += kScoreBeams) {
    const float* r = residuals + b * group_dim;
    float* out = scores + b * size;
    int64_t k = 0;
    for (; k + 2 * kLanes <= size; k += 2 * kLanes) {
      Vec acc[kScoreBeams][2];
      score_tile<kScoreBeams>(r, group_dim, book_t, half, size, k, acc);
      for (int64_t u = 0; u < kScoreBeams; ++u) {
        *reinterpret_cast<Vec*>(out + u * size + k) = acc[u][0];
        *reinterpret_cast<Vec*>(out + u * size + k + kLanes) = acc[u][1];
      }
    }
    for (; k < size; ++k) {
      for (int64_t u = 0; u < kScoreBeams; ++u) {
        out[u * size + k] = codeword_score(r + u * group_dim, group_dim, book_t, half, size, k);
      }
    }
  }
  for (; b < beams; ++b) {
    one_residual_scores(residuals + b * group_dim, group_dim, book_t, half, size, scores + b * size);
  }
}

// The last stage of a group keeps one path: the (beam b, codeword k) of least error |r_b - c_k|^2 = E_b - 2 score,
// the first in (b, k) order among equal errors, as the ranked list's offers find it. Errors are formed in registers
// and each lane keeps its running least error and its candidate's index: no scores stored, no branch per candidate
// (the ranked list's "does any of these 8 enter?" branch was mispredicted often enough to cost more than the
// arithmetic).
struct NearestPath {
  Vec error[2];
  VecI index[2];  // b * K + k

  // Starts at candidate 0 with an infinite error, so that inputs whose errors are all NaN or infinite (non-finite
  // keys or values) still get a real path, (0, 0), as the ranked list's first offer would give them.
  NearestPath() {
    for (int64_t v = 0; v < 2; ++v) {
      error[v] = Vec{} + std::numeric_limits<float>::infinity();
      index[v] = VecI{};
    }
  }
  inline void offer(int64_t v, Vec e, VecI candidate) {
    const VecI better = (e < error[v]) | ((e == error[v]) & (candidate < index[v]));
    error[v] = better ? e : error[v];
    index[v] = better ? candidate : index[v];
  }
  // the least error over the lanes, ties to the smallest index; scalar candidates (tails) join here
  inline void best(float* best_error, int64_t* best_index, float tail_error, int64_t tail_index) const {
    float e = tail_error;
    int64_t i = tail_index;
    for (int64_t v = 0; v < 2; ++v) {
      for (int64_t l = 0; l < kLanes; ++l) {
        if (error[v][l] < e || (error[v][l] == e && index[v][l] < i)) {
          e = error[v][l];
          i = index[v][l];
        }
      }
    }
    *best_error = e;
    *best_index = i;
  }
};

template <int64_t kBeams>
inline void nearest_path_tile(const float* residuals, const float* energies, int64_t first_beam, int64_t group_dim,
                              const float* book_t, const float* half, int64_t size, int64_t full_blocks,
                              NearestPath& nearest) {
  VecI lane;
  for (int64_t l = 0; l < kLanes; ++l) lane[l] = static_cast<int32_t>(l);
  const float* r = residuals + first_beam * group_dim;
  for (int64_t k = 0; k < full_blocks; k += 2 * kLanes) {
    Vec acc[kBeams][2];
    score_tile<kBeams>(r, group_dim, book_t, half, size, k, acc);
    for (int64_t u = 0; u < kBeams; ++u) {
      const Vec energy = splat(energies[first_beam + u]);
      const int32_t base = static_cast<int32_t>((first_beam + u) * size + k);
      nearest.offer(0, energy - (acc[u][0] + acc[u][0]), lane + base);
      nearest.offer(1, energy - (acc[u][1] + acc[u][1]), lane + (base + static_cast<int32_t>(kLanes)));
    }
  }
}

// residuals [beams, g] with their energies |r_b|^2 -> the least error and its b * K + k
void nearest_path(const float* residuals, const float* energies, int64_t beams, int64_t group_dim,
                  const float* book_t, const float* half, int64_t size, float* best_error, int64_t* best_index) {
  NearestPath nearest;
  const int64_t full_blocks = size - size % (2 * kLanes);
  int64_t b = 0;
  for (; b + kScoreBeams <= beams; b += kScoreBeams) {
    nearest_path_tile<kScoreBeams>(residuals, energies, b, group_dim, book_t, half, size, full_blocks, nearest);
  }
  for (; b < beams; ++b) {
    nearest_path_tile<1>(residuals, energies, b, group_dim, book_t, half, size, full_blocks, nearest);
  }
  float tail_error = std::numeric_limits<float>::infinity();
  int64_t tail_index = std::numeric_limits<int64_t>::max();
  for (int64_t t = 0; t < beams && full_blocks < size; ++t) {  // codewords past the last whole pair of registers
    const float* r = residuals + t * group_dim;
    for (int64_t k = full_blocks; k < size; ++k) {
      const float error = energies[t] - 2.f * codeword_score(r, group_dim, book_t, half, size, k);
      const int64_t index = t * size + k;
      if (error < tail_error || (error == tail_error && index < tail_index)) {
        tail_error = error;
        tail_index = index;
      }
    }
  }
  nearest.best(best_error, best_index, tail_error, tail_index);
}

// The `keep` paths of least error so far, sorted; candidates are offered in (b, k) order and ties keep the earlier.
struct RankedPaths {
  float* error;
  int64_t* parent;
  int64_t* word;
  int64_t keep, kept = 0;

  inline void offer(int64_t b, int64_t k, float candidate_error) {
    if (kept == keep && candidate_error >= error[keep - 1]) return;
    int64_t slot = kept < keep ? kept++ : keep - 1;
    while (slot > 0 && error[slot - 1] > candidate_error) {
      error[slot] = error[slot - 1];
      parent[slot] = parent[slot - 1];
      word[slot] = word[slot - 1];
      --slot;
    }
    error[slot] = candidate_error;
    parent[slot] = b;
    word[slot] = k;
  }
};

// One bit per lane of a comparison's result, lane l in bit l.
inline uint32_t lane_bits(VecI mask) {
#if defined(__AVX512F__)
  return _mm512_cmpneq_epi32_mask(reinterpret_cast<__m512i>(mask), _mm512_setzero_si512());
#elif defined(__AVX__)
  return static_cast<uint32_t>(_mm256_movemask_ps(reinterpret_cast<__m256>(mask)));
#else
  uint32_t bits = 0;
  for (int64_t l = 0; l < kLanes; ++l) bits |= (mask[l] != 0 ? 1u : 0u) << l;
  return bits;
#endif
}

// The sorted list's insertions are data-dependent branches, mispredicted often; most of them insert candidates that a
// later one pushes out. So when keep <= kLanes, a first pass bounds the keep-th least error from above: each lane's
// least error is a distinct candidate, so at least kLanes candidates lie at or below the largest of them. Only
// candidates at or below that bound are offered, in the same (b, k) order, so the list, ties included, is the same.
// Returns -1, having kept nothing, when there is no finite bound.
int64_t rank_paths_bounded(const float* scores, const float* energies, int64_t beams, int64_t size, int64_t keep,
                           float* best_error, int64_t* best_parent, int64_t* best_word) {
  const int64_t blocks_end = size - size % kLanes;
  Vec least = Vec{} + std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < beams; ++b) {
    const Vec energy = splat(energies[b]);
    const float* row = scores + b * size;
    for (int64_t k = 0; k < blocks_end; k += kLanes) {
      const Vec s = load(row + k);
      const Vec e = energy - (s + s);
      least = e < least ? e : least;
    }
  }
  float bound = least[0];
  for (int64_t l = 1; l < kLanes; ++l) bound = std::max(bound, least[l]);
  if (!std::isfinite(bound)) return -1;  // a lane with no finite error (non-finite input): no bound
  const Vec bound_v = splat(bound);
  RankedPaths ranked{best_error, best_parent, best_word, keep};
  for (int64_t b = 0; b < beams; ++b) {
    const float energy = energies[b];
    const Vec energy_v = splat(energy);
    const float* row = scores + b * size;
    for (int64_t k = 0; k < blocks_end; k += kLanes) {
      const Vec s = load(row + k);
      const Vec e = energy_v - (s + s);
      for (uint32_t bits = lane_bits(e <= bound_v); bits != 0; bits &= bits - 1) {
        const int64_t lane = __builtin_ctz(bits);
        ranked.offer(b, k + lane, e[lane]);
      }
    }
    for (int64_t k = blocks_end; k < size; ++k) {
      const float error = energy - 2.f * row[k];
      if (error <= bound) ranked.offer(b, k, error);
    }
  }
  return ranked.kept;
}

// Stages before a group's last: scores [beams, K] -> the `keep` paths of least error, sorted, in best_*; returns how
// many were kept. Candidates enter the sorted list only if they beat its worst entry, so most cost one comparison.
int64_t rank_paths(const float* scores, const float* energies, int64_t beams, int64_t size, int64_t keep,
                   float* best_error, int64_t* best_parent, int64_t* best_word) {
  if (keep <= kLanes && size >= kLanes) {
    const int64_t kept = rank_paths_bounded(scores, energies, beams, size, keep, best_error, best_parent, best_word);
    if (kept >= 0) return kept;
  }
  RankedPaths ranked{best_error, best_parent, best_word, keep};
  for (int64_t b = 0; b < beams; ++b) {
    const float r_energy = energies[b];
    const float* beam_scores_row = scores + b * size;
    auto offer = [&](int64_t k) { ranked.offer(b, k, r_energy - 2.f * beam_scores_row[k]); };  // |r - c|^2
    int64_t k = 0;
    for (; k < size && ranked.kept < keep; ++k) offer(k);
#if defined(__AVX512F__)
    // Once the beam is full, few candidates beat its worst entry: compare 16 at a time and offer only
    // those (same errors, same order as the scalar loop, so the same codes).
    const __m512 energy_v = _mm512_set1_ps(r_energy);
    for (; k + 16 <= size; k += 16) {
      const __m512 s = _mm512_loadu_ps(beam_scores_row + k);
      const __m512 error = _mm512_sub_ps(energy_v, _mm512_add_ps(s, s));
      __mmask16 below = _mm512_cmp_ps_mask(error, _mm512_set1_ps(best_error[keep - 1]), _CMP_LT_OQ);
      while (below) {
        offer(k + __builtin_ctz(below));
        below &= below - 1;
      }
    }
#elif defined(__AVX__)
    // the same, 8 at a time
    const __m256 energy_v = _mm256_set1_ps(r_energy);
    for (; k + 8 <= size; k += 8) {
      const __m256 s = _mm256_loadu_ps(beam_scores_row + k);
      const __m256 error = _mm256_sub_ps(energy_v, _mm256_add_ps(s, s));
      unsigned below = _mm256_movemask_ps(
          _mm256_cmp_ps(error, _mm256_set1_ps(best_error[keep - 1]), _CMP_LT_OQ));
      while (below) {
        offer(k + __builtin_ctz(below));
        below &= below - 1;
      }
    }
#endif
    for (; k < size; ++k) offer(k);
  }
  return ranked.kept;
}

// z [R, D] f32; codebooks [S, K, g] f32; stage_groups [S] i64 -> codes [R, S] u8. Per group, over its stages in order:
// extend each kept code path by every codeword, keep the beam_width smallest remaining errors (at the group's last
// stage, only the smallest). Candidates enter a sorted list only if they beat its worst entry, so most cost one
// comparison.
at::Tensor residual_encode_beam(const at::Tensor& z, const at::Tensor& codebooks, const at::Tensor& stage_groups,
                                int64_t beam_width) {
  check(z.dim() == 2 && codebooks.dim() == 3 && stage_groups.dim() == 1, "unexpected ranks");
  check(z.scalar_type() == at::kFloat && z.is_contiguous() && z.device().is_cpu(), "z must be contiguous float32");
  check(codebooks.scalar_type() == at::kFloat && codebooks.is_contiguous(), "codebooks must be contiguous float32");
  check(stage_groups.scalar_type() == at::kLong && stage_groups.is_contiguous(), "stage_groups must be int64");
  check(beam_width >= 1, "beam_width must be at least 1");
  const int64_t rows = z.size(0), dim = z.size(1);
  const int64_t stages = codebooks.size(0), size = codebooks.size(1), group_dim = codebooks.size(2);
  check(stage_groups.size(0) == stages, "one group per stage");
  check(size >= 1 && size <= 256, "codebooks must have 1..256 codewords (codes are uint8)");
  check(group_dim >= 1 && dim % group_dim == 0, "group_dim must divide the vector length");
  auto codes = at::empty({rows, stages}, z.options().dtype(at::kByte));
  if (rows == 0 || stages == 0) return codes;
  const int64_t* groups = stage_groups.data_ptr<int64_t>();
  for (int64_t s = 0; s < stages; ++s) check(groups[s] >= 0 && groups[s] < dim / group_dim, "stage group out of range");
  // Transposed codebooks [S, g, K]: the scores of all K codewords are then a sum of g vectorizable rows.
  auto transposed = codebooks.transpose(1, 2).contiguous();
  auto half_norms = (codebooks * codebooks).sum(-1).mul(0.5).contiguous();  // [S, K]
  const float* tp = transposed.data_ptr<float>();
  const float* cp = codebooks.data_ptr<float>();
  const float* hp = half_norms.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  uint8_t* op = codes.data_ptr<uint8_t>();
  // Groups in first-appearance order, each with its stages.
  std::vector<std::vector<int64_t>> members;
  std::vector<int64_t> group_order;
  for (int64_t s = 0; s < stages; ++s) {
    auto found = std::find(group_order.begin(), group_order.end(), groups[s]);
    if (found == group_order.end()) {
      group_order.push_back(groups[s]);
      members.emplace_back();
      found = group_order.end() - 1;
    }
    members[found - group_order.begin()].push_back(s);
  }
  const int64_t width = beam_width;
  size_t deepest = 1;
  for (const auto& stage_list : members) deepest = std::max(deepest, stage_list.size());
  // Rows are searched a tile at a time, group by group, so that a group's codebooks (8 KB per stage at K = 256,
  // g = 8) are reused across the tile's rows rather than all S codebooks passing through for every row (the value
  // codebooks of the default model are 368 KB, more than some CPUs' L2 holds). Tiles are small enough to give every
  // thread work on a 32-token flush.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t tile_rows = std::clamp<int64_t>((rows + threads - 1) / threads, 1, kEncodeTileRows);
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  at::parallel_for(0, tiles, 1, [&](int64_t first_tile, int64_t last_tile) {
    std::vector<float> residual(width * group_dim), next_residual(width * group_dim);
    std::vector<float> best_error(width), scores(width * size), energies(width);
    std::vector<int64_t> best_parent(width), best_word(width);
    std::vector<int64_t> path_parent(deepest * width), path_word(deepest * width);  // [stage in group][beam]
    for (int64_t tile = first_tile; tile < last_tile; ++tile) {
      const int64_t first_row = tile * tile_rows, last_row = std::min(rows, first_row + tile_rows);
      for (size_t gi = 0; gi < group_order.size(); ++gi) {
        const int64_t group = group_order[gi];
        const auto& stage_list = members[gi];
        for (int64_t row = first_row; row < last_row; ++row) {
          const float* zr = zp + row * dim;
          uint8_t* out = op + row * stages;
          int64_t beams = 1;
          std::copy(zr + group * group_dim, zr + (group + 1) * group_dim, residual.begin());
          for (size_t depth = 0; depth < stage_list.size(); ++depth) {
            const int64_t stage = stage_list[depth];
            // The last stage of a group keeps only its best path (the one the group's code is read back from):
            // the ranking of the rest is never used, and keeping it was most of the search's cost in one-stage
            // groups
            const int64_t keep = depth + 1 == stage_list.size() ? 1 : width;
            const float* book_t = tp + stage * group_dim * size;
            const float* half = hp + stage * size;
            for (int64_t b = 0; b < beams; ++b) {
              const float* r = residual.data() + b * group_dim;
              float r_energy = 0.f;
              for (int64_t j = 0; j < group_dim; ++j) r_energy += r[j] * r[j];
              energies[b] = r_energy;
            }
            int64_t kept = 0;
            if (keep == 1) {
              int64_t index = 0;
              nearest_path(residual.data(), energies.data(), beams, group_dim, book_t, half, size, best_error.data(),
                           &index);
              best_parent[0] = index / size;
              best_word[0] = index % size;
              kept = 1;
            } else {
              beam_scores(residual.data(), beams, group_dim, book_t, half, size, scores.data());
              kept = rank_paths(scores.data(), energies.data(), beams, size, keep, best_error.data(),
                                best_parent.data(), best_word.data());
            }
            for (int64_t n = 0; n < kept; ++n) {
              path_parent[depth * width + n] = best_parent[n];
              path_word[depth * width + n] = best_word[n];
            }
            if (depth + 1 == stage_list.size()) break;  // no stage left to search: no residual needed
            for (int64_t n = 0; n < kept; ++n) {
              const float* parent = residual.data() + best_parent[n] * group_dim;
              const float* word = cp + (stage * size + best_word[n]) * group_dim;
              for (int64_t j = 0; j < group_dim; ++j) next_residual[n * group_dim + j] = parent[j] - word[j];
            }
            std::swap(residual, next_residual);
            beams = kept;
          }
          int64_t best = 0;  // the group's last stage kept one path: the best
          for (int64_t depth = static_cast<int64_t>(stage_list.size()) - 1; depth >= 0; --depth) {
            out[stage_list[depth]] = static_cast<uint8_t>(path_word[depth * width + best]);
            best = path_parent[depth * width + best];
          }
        }
      }
    }
  });
  return codes;
}

}  // namespace

TORCH_LIBRARY(hf_kvcodecs_cpu_native, m) {
  m.def("value_transform_sums(Tensor probabilities, Tensor codes, Tensor scales, Tensor? scale_levels, "
        "Tensor codebooks, Tensor stage_groups, int transform_dim) -> (Tensor, Tensor)");
  m.def("residual_encode_beam(Tensor z, Tensor codebooks, Tensor stage_groups, int beam_width) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor key_codes, Tensor key_scales, Tensor? key_scale_levels, Tensor key_table, "
        "Tensor key_mean, Tensor cos, Tensor sin, int codebook_size, Tensor value_codes, Tensor value_scales, "
        "Tensor? value_scale_levels, Tensor value_codebooks, Tensor value_stage_groups, Tensor value_mean, "
        "Tensor value_synthesis, Tensor? coded_mask, Tensor exact_keys, Tensor exact_values, Tensor? exact_mask, "
        "int query_length, float scaling, bool conditional_keys=False, Tensor? predicted_codes=None, "
        "Tensor? predicted_scales=None, Tensor? predicted_scale_levels=None, Tensor? predicted_codebooks=None, "
        "Tensor? predicted_stage_groups=None, Tensor? predicted_mean=None, Tensor? predicted_synthesis=None, "
        "Tensor? predicted_bias=None, Tensor? value_predictor=None, Tensor? key_table_step=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_kvcodecs_cpu_native, CPU, m) {
  m.impl("value_transform_sums", &value_transform_sums);
  m.impl("residual_encode_beam", &residual_encode_beam);
  m.impl("decode_attention", &decode_attention);
}
