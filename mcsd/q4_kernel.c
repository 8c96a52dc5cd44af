/* mcsd's Q4_1 and Q8_0 matrix products for x86-64 CPUs with AVX2 and FMA (built by mcsd/native.py).

   out[r, n] = sum_k x[r, k] * w[n, k],   w[n, k] = d[n, g] * q[n, k] + m[n, g],   g = k / 32

   q is a 4-bit code in 0..15, stored 16 bytes per block of 32 along k: element j of a block in the low
   nibble of byte j, element j + 16 in its high nibble (as a GGUF stores Q4_1). d and m are float32 (the
   file's float16 scale and offset, widened exactly). Each weight is dequantised as fma(q, d, m): q * d is
   exact in float32 (an 11-bit mantissa times a 4-bit integer), so the weight is the float32 value a GGUF
   loader computes as q * d + m, bit for bit.

   Q8_0 (a GGUF's token embedding, tied to the LM head): w[n, k] = d[n, g] * q[n, k] with q an int8
   code stored one a byte, exact in float32 likewise (8 bits times 11).

   Exactness across block sizes: every output r, n is one float32 accumulator over k in steps of 8
   (fma(x, w, acc)), then a fixed horizontal sum. Neither the number of rows, the tile a row falls in,
   nor the thread that computes it changes that sequence, so a row's result does not depend on the
   rows beside it: a 9-row verify computes each row exactly as a 1-row step does.

   Speed: a block of NB output rows is dequantised once into a per-thread buffer, then read by every
   input row in tiles of up to 3 rows x NB outputs (12 accumulators), so the dequantisation, which
   bounds a 1-row product, is shared by all rows of a verify. A single row uses the dequantised
   weights in registers instead (the same operations, in the same order). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define NB 4            /* output rows dequantised together */
#define RB 3            /* input rows per tile */

int mcsd_q4_abi(void) { return 4; }

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

static inline void dequant_row(const uint8_t *c, const float *d, const float *m, int64_t K, float *w) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < K / 32; g++) {
        __m128i b = _mm_loadu_si128((const __m128i *)(c + 16 * g));
        __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        __m256 dv = _mm256_set1_ps(d[g]), mv = _mm256_set1_ps(m[g]);
        float *o = w + 32 * g;
        _mm256_store_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv));
        _mm256_store_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv, mv));
        _mm256_store_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv));
        _mm256_store_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv, mv));
    }
}

static inline void dequant_row_q8(const int8_t *c, const float *d, int64_t K, float *w) {
    for (int64_t g = 0; g < K / 32; g++) {
        __m256 dv = _mm256_set1_ps(d[g]);
        for (int i = 0; i < 4; i++) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(c + 32 * g + 8 * i));
            _mm256_store_ps(w + 32 * g + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), dv));
        }
    }
}

/* one input row: the weights are dequantised in registers and used at once, never stored (a 1-row
   step is bound by the dequantisation). The same operations in the same order as dequant_row
   followed by tile, so the results are bit for bit the same. */
static inline void direct_q4(const float *x, int64_t K, const uint8_t *c, const float *d, const float *m,
                             int nb, float *out) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m256 acc[NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / 32; g++) {
        for (int j = 0; j < NB; j++) {
            const int64_t n = j < nb ? j : 0;
            __m128i b = _mm_loadu_si128((const __m128i *)(c + n * (K / 2) + 16 * g));
            __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
            __m256 dv = _mm256_set1_ps(d[n * (K / 32) + g]), mv = _mm256_set1_ps(m[n * (K / 32) + g]);
            const float *xg = x + 32 * g;
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(xg),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv), acc[j]);
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv, mv), acc[j]);
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv), acc[j]);
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv, mv), acc[j]);
        }
    }
    for (int j = 0; j < nb; j++) out[j] = hsum(acc[j]);
}

static inline void direct_q8(const float *x, int64_t K, const int8_t *c, const float *d, int nb, float *out) {
    __m256 acc[NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / 32; g++) {
        for (int j = 0; j < NB; j++) {
            const int64_t n = j < nb ? j : 0;
            __m256 dv = _mm256_set1_ps(d[n * (K / 32) + g]);
            for (int i = 0; i < 4; i++) {
                __m128i b = _mm_loadl_epi64((const __m128i *)(c + n * K + 32 * g + 8 * i));
                __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), dv);
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 32 * g + 8 * i), w, acc[j]);
            }
        }
    }
    for (int j = 0; j < nb; j++) out[j] = hsum(acc[j]);
}

/* rows x NB outputs; `rows` is a constant at each call site, so each is compiled on its own */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const float *w, int rows,
                                                       int nb, float *out, int64_t N) {
    __m256 acc[RB][NB];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        /* the rows' inputs stay in registers and each weight vector is loaded once: 12 accumulators,
           3 inputs and 1 weight fill the 16 vector registers without spilling */
        __m256 xv[RB];
        for (int r = 0; r < rows; r++) xv[r] = _mm256_loadu_ps(x + r * K + k);
        for (int j = 0; j < NB; j++) {
            const __m256 wv = _mm256_load_ps(w + j * K + k);
            for (int r = 0; r < rows; r++) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < nb; j++) out[r * N + j] = hsum(acc[r][j]);
}

/* x (M, K) float32 times N weight rows, out (M, N) float32; K a multiple of 32. Q4_1 (q8 == 0): codes
   (N, K / 2) bytes, d and m (N, K / 32) float32. Q8_0 (q8 == 1): codes (N, K) int8, d (N, K / 32), m
   unused. Returns 0, or -1 where a thread's buffer could not be allocated (out is then incomplete). */
static int mm(const float *x, int64_t M, int64_t K, const void *codes, const float *d, const float *m,
              int64_t N, float *out, int threads, int q8) {
    const int64_t blocks = (N + NB - 1) / NB;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *w = aligned_alloc(32, sizeof(float) * NB * (size_t)K);
        if (!w) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!w) continue;
            const int64_t n0 = b * NB;
            const int nb = N - n0 < NB ? (int)(N - n0) : NB;
            if (M == 1) {
                const float *dn = d + n0 * (K / 32);
                if (q8) direct_q8(x, K, (const int8_t *)codes + n0 * K, dn, nb, out + n0);
                else direct_q4(x, K, (const uint8_t *)codes + n0 * (K / 2), dn, m + n0 * (K / 32), nb, out + n0);
                continue;
            }
            for (int j = 0; j < NB; j++) {
                const int64_t n = n0 + (j < nb ? j : 0);          /* a short last block repeats a row */
                if (q8)
                    dequant_row_q8((const int8_t *)codes + n * K, d + n * (K / 32), K, w + j * K);
                else
                    dequant_row((const uint8_t *)codes + n * (K / 2), d + n * (K / 32), m + n * (K / 32), K,
                                w + j * K);
            }
            int64_t r = 0;
            for (; r + RB <= M; r += RB) tile(x + r * K, K, w, RB, nb, out + r * N + n0, N);
            if (M - r == 2) tile(x + r * K, K, w, 2, nb, out + r * N + n0, N);
            else if (M - r == 1) tile(x + r * K, K, w, 1, nb, out + r * N + n0, N);
        }
        free(w);
    }
    return failed ? -1 : 0;
}

int mcsd_q4_mm(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *d, const float *m,
               int64_t N, float *out, int threads) {
    return mm(x, M, K, codes, d, m, N, out, threads, 0);
}

int mcsd_q8_mm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *d, int64_t N, float *out,
               int threads) {
    return mm(x, M, K, codes, d, NULL, N, out, threads, 1);
}

/* RMS norm of M rows of K floats (K a multiple of 8), as transformers' Llama norm computes it:
   w * (x * rsqrt(mean(x^2) + eps)). The sum of squares runs over 8 lanes in a fixed order, so a row's
   result does not depend on the rows beside it. One call for a block's rows replaces the seven
   tensor operations torch's norm makes for each. */
void mcsd_rms_norm(const float *x, int64_t M, int64_t K, const float *w, float eps, float *out) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * K;
        float *o = out + r * K;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const float scale = 1.0f / sqrtf(hsum(acc) / (float)K + eps);
        const __m256 s = _mm256_set1_ps(scale);
        for (int64_t k = 0; k < K; k += 8)
            _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(xr + k), s)));
    }
}
