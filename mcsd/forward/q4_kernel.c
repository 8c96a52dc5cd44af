/* mcsd's Q4_1 and Q8_0 matrix products for x86-64 CPUs with AVX2 and FMA (built by mcsd/native.py): on
   float32 activations here, on 8-bit ones (the weights "q4q8") further down.

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

   Speed: the dequantisation bounds a 1-row product, so it is shared by all rows of a verify. Up to
   DR (8) rows use each block of weights in registers as soon as it is dequantised; more rows read a
   block of NB output rows dequantised once into a per-thread buffer, in tiles of up to 3 rows x NB
   outputs (12 accumulators). Both make the same operations in the same order. */

#define _DEFAULT_SOURCE                 /* syscall(), for the tile state (below) */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NB 4            /* output rows dequantised together */
#define RB 3            /* input rows per tile */

int mcsd_q4_abi(void) { return 32; }

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* One block of 32 weights as 4 vectors of 8 floats: the only place a weight is dequantised, so the
   buffered path (dequant_row, then tile) and the one-row path (direct_*) compute with the same values. */
static inline void block_q4(const uint8_t *c, float d, float m, __m256 w[4]) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i b = _mm_loadu_si128((const __m128i *)c);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv, mv);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv, mv);
}

static inline void block_q8(const int8_t *c, float d, __m256 w[4]) {
    const __m256 dv = _mm256_set1_ps(d);
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * i)))), dv);
}

/* a weight row into the buffer (Q4_1: q8 == 0, m per block; Q8_0: q8 == 1, m unused) */
static inline __attribute__((always_inline)) void dequant_row(const uint8_t *c, const float *d, const float *m, int64_t K, int q8, float *w) {
    __m256 v[4];
    for (int64_t g = 0; g < K / 32; g++) {
        if (q8) block_q8((const int8_t *)c + 32 * g, d[g], v);
        else block_q4(c + 16 * g, d[g], m[g], v);
        for (int i = 0; i < 4; i++) _mm256_store_ps(w + 32 * g + 8 * i, v[i]);
    }
}

/* up to DR input rows: the weights are dequantised in registers and used at once, never stored (a step
   or a small verify is bound by the dequantisation, which this shares across its rows). The same values,
   multiplied in the same order as tile does, so the results are bit for bit the same. `rows` and `q8`
   are constants at each call site; outputs go J at a time so that rows x J accumulators and a block's 4
   weight vectors stay in the 16 registers (Q4_1: J 4 for 1 row, 2 for 2 and 3 rows, then 1, each FMA
   reading its input from memory; Q8_0: J 1 for any rows). On a 2-core AVX2 EPYC, per layer: 4 to 6 rows
   8-24% faster than the buffered path, 7 and 8 rows 3-8%, 9 rows slower; 2 rows 18% faster with J 2
   than with J 4. The Q8_0 LM head (49,152 x 576) there, 1 / 2 / 3 rows: 1.8-2.2 / 2.3 / 2.6 ms with
   J 1, against 2.7-3.1 / 2.9 / 3.1 ms with J 4, 4 and 2 (the same sums: J never changes an output's
   order); a Q4_1 layer's 1 row wants J 4 (0.206 ms against 0.284 with J 1). Read from memory, as a
   forward reads its 30 layers' codes (80 MB), 1 and 2 rows went 6-16% and 3-5% faster with the codes
   prefetched PF bytes ahead (2 blocks of 4 output rows of the embedded target's 576 columns), 4 rows
   no faster; 1,152 or 3,456 bytes gained less, and prefetching the scales too lost. */
#define DR 8
#define PF 2304
static inline __attribute__((always_inline)) void direct(const float *x, int rows, int64_t K, const uint8_t *c,
                                                         int64_t row, const float *d, const float *m, int q8,
                                                         int nb, float *out, int64_t N) {
    const int64_t G = K / 32;
    const int J = q8 ? 1 : rows == 1 ? NB : rows <= 3 ? 2 : 1;
    for (int j0 = 0; j0 < nb; j0 += J) {
        __m256 acc[DR][NB];
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < J; j++) acc[r][j] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            for (int j = 0; j < J; j++) {
                const int64_t n = j0 + j < nb ? j0 + j : 0;
                if (!q8)               /* Q4_1 codes PF bytes ahead (measured above); no gain for Q8_0 */
                    _mm_prefetch((const char *)(c + n * row + 16 * g + PF), _MM_HINT_T0);
                __m256 v[4];
                if (q8) block_q8((const int8_t *)(c + n * row) + 32 * g, d[n * G + g], v);
                else block_q4(c + n * row + 16 * g, d[n * G + g], m[n * G + g], v);
                for (int i = 0; i < 4; i++)
                    for (int r = 0; r < rows; r++)
                        acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + 32 * g + 8 * i), v[i], acc[r][j]);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < J && j0 + j < nb; j++) out[r * N + j0 + j] = hsum(acc[r][j]);
    }
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

/* NB output rows n0.. for M <= DR input rows, each block of weights used in registers. Kept apart from
   the buffered path (noinline) so that each is compiled and register-allocated on its own. */
static __attribute__((noinline)) void rows_direct(const float *x, int64_t M, int64_t K, const uint8_t *cn,
                                                  int64_t row, const float *dn, const float *mn, int q8, int nb,
                                                  float *out, int64_t N) {
#define DIRECT(R) do { if (q8) direct(x, R, K, cn, row, dn, mn, 1, nb, out, N); \
                       else direct(x, R, K, cn, row, dn, mn, 0, nb, out, N); } while (0)
    switch (M) {                   /* rows and q8 constants at each call: each compiled on its own */
    case 1: DIRECT(1); break;
    case 2: DIRECT(2); break;
    case 3: DIRECT(3); break;
    case 4: DIRECT(4); break;
    case 5: DIRECT(5); break;
    case 6: DIRECT(6); break;
    case 7: DIRECT(7); break;
    default: DIRECT(8); break;
    }
#undef DIRECT
}

/* NB output rows n0.. for any number of input rows: dequantised once into w, then read in tiles */
static __attribute__((noinline)) void rows_buffered(const float *x, int64_t M, int64_t K, const uint8_t *cn,
                                                    int64_t row, const float *dn, const float *mn, int q8,
                                                    int nb, float *w, float *out, int64_t N) {
    const int64_t G = K / 32;
    for (int j = 0; j < NB; j++) {
        const int64_t n = j < nb ? j : 0;          /* a short last block repeats a row */
        if (q8) dequant_row(cn + n * row, dn + n * G, NULL, K, 1, w + j * K);
        else dequant_row(cn + n * row, dn + n * G, mn + n * G, K, 0, w + j * K);
    }
    int64_t r = 0;
    for (; r + RB <= M; r += RB) tile(x + r * K, K, w, RB, nb, out + r * N, N);
    if (M - r == 2) tile(x + r * K, K, w, 2, nb, out + r * N, N);
    else if (M - r == 1) tile(x + r * K, K, w, 1, nb, out + r * N, N);
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
        float *w = M <= DR ? NULL : aligned_alloc(32, sizeof(float) * NB * (size_t)K);
        if (M > DR && !w) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (M > DR && !w) continue;
            const int64_t n0 = b * NB;
            const int nb = N - n0 < NB ? (int)(N - n0) : NB;
            const int64_t G = K / 32, row = q8 ? K : K / 2;            /* bytes of codes a weight row */
            const uint8_t *cn = (const uint8_t *)codes + n0 * row;
            const float *dn = d + n0 * G, *mn = q8 ? NULL : m + n0 * G;
            if (M <= DR) rows_direct(x, M, K, cn, row, dn, mn, q8, nb, out + n0, N);
            else rows_buffered(x, M, K, cn, row, dn, mn, q8, nb, w, out + n0, N);
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

/* ---- products on 8-bit activations (the weights "q4q8"), as llama.cpp computes Q4_1 and Q8_0 ----

   Each input row is quantised per block of 32 along k, as llama.cpp's Q8_1: a = max |x| over the block,
   dx = a / 127, q = x * (127 / a) rounded to the nearest integer (ties to even; 0 where a is 0), and
   sx = dx * sum(q) (Q8_1's block sum; the integer sum is exact). With w = dw c + m (Q4_1) or dw c
   (Q8_0), every output is

     out[r, n] = sum over blocks g, in order:  acc = fma(S[g], dw[n, g] * dx[r, g], acc),
                                              then (Q4_1) acc = fma(m[n, g], sx[r, g], acc)

   where S[g] = sum_k c[n, k] q[r, k] over the block, an exact integer (under 2^16 in magnitude),
   converted to float exactly. So the result is the same whatever instruction computes S: vpdpbusd
   (AVX-VNNI on ymm registers, AVX512-VNNI on zmm ones), AVX2's maddubs then madd by ones, or an AMX tile
   product (further down); the one used is chosen by mcsd_int8_isa from the CPU's flags
   (mcsd/forward/native.py). A row is quantised on its own
   and each output summed in this fixed order whatever the rows beside it, the tile it falls in or the
   thread, so a row's result does not depend on the rows beside it. The result is not the float32
   product's: it is the product with the activations rounded to 8 bits a block, a slightly different
   target (as bfloat16 compute is).

   Layout (made by mcsd/forward/quant.py): the weight's rows in groups of 8 (the last group padded with
   zero rows), so that one 32-byte vector holds 4 consecutive codes of each of 8 outputs and vpdpbusd
   against 4 activation bytes broadcast sums them into 8 outputs' lanes at once, with no horizontal
   sum (as llama.cpp's repacked 8-row layouts do). Per group o and block g:
     Q4_1: 4 x 32 bytes; byte 4j + t of vector p holds output j's code at k = 4p + t in its low nibble
           and at k = 4(p + 4) + t in its high nibble; d and m (groups, G, 8) float32.
     Q8_0: 8 x 32 bytes; byte 4j + t of vector p is output j's code at k = 4p + t; d (groups, G, 8)
           float32 and w128 (groups, G, 8) int32, 128 x the block's sum of codes.
   Q4_1's codes (0..15) are vpdpbusd's unsigned operand. For Q8_0 the VNNI path takes the activations
   as unsigned bytes q + 128 and subtracts 128 x the codes' sum; AVX2, whose maddubs would saturate on
   that, takes |c| and the activation with c's sign, as llama.cpp does. Both give S exactly. */

/* The paths this build holds: each needs its assembler or compiler support, found by test-compiling a
   snippet when the library is built (mcsd/forward/native.py), which defines MCSD_NO_<path> for a path it
   cannot build; the rest still builds. A path left out computes on AVX2's instructions (the same bits). */
#if !defined(MCSD_NO_AVXVNNI)
#define HAVE_AVXVNNI 1
#else
#define HAVE_AVXVNNI 0
#endif
#if !defined(MCSD_NO_AVX512VNNI)
#define HAVE_AVX512VNNI 1
#else
#define HAVE_AVX512VNNI 0
#endif
#if !defined(MCSD_NO_AMX)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

/* bit i: mcsd_int8_isa's set i is built (0 AVX2, always; 1 AVX-VNNI; 2 AVX512-VNNI; 3 AMX) */
int mcsd_int8_isas_built(void) { return 1 | HAVE_AVXVNNI << 1 | HAVE_AVX512VNNI << 2 | HAVE_AMX << 3; }

/* Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA; for every thread of the process); without it a tile instruction faults. Asked
   once: 0 where granted, -1 where not (an old kernel, no AMX, or a build without the path). */
int mcsd_amx_grant(void) {
    static int granted = -2;
#if HAVE_AMX
    if (granted == -2) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 ? 0 : -1;
#else
    granted = -1;
#endif
    return granted;
}

static int int8_isa = 0;        /* 0 AVX2, 1 AVX-VNNI, 2 AVX512-VNNI (zmm), 3 AMX tiles (below) */

/* Sets the instruction set of the 8-bit products where isa >= 0 (the caller has checked the CPU has it;
   AMX only once the tile state is granted); returns the one in use. */
int mcsd_int8_isa(int isa) {
    if (isa >= 0 && isa <= 3 && (mcsd_int8_isas_built() >> isa & 1) && (isa != 3 || mcsd_amx_grant() == 0))
        int8_isa = isa;
    return int8_isa;
}

/* acc + the 8 lanes of u (32 unsigned bytes) times s (32 signed bytes), 4 adjacent products a lane.
   Through inline assembly, so that the file builds with -mavx2 alone and no VNNI instruction is
   emitted where the CPU has none. */
static inline __attribute__((always_inline)) __m256i dot32(int isa, __m256i acc, __m256i u, __m256i s) {
#if HAVE_AVXVNNI
    if (isa == 1) {
        __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
        return acc;
    }
#endif
    (void)isa;
    /* pairs of products summed in 16 bits (at most 2 * 128 * 127, no saturation), then pairs of pairs */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* acc + the 8 lanes of u times the 4 signed bytes at p, broadcast */
static inline __attribute__((always_inline)) __m256i dot32_at(int isa, __m256i acc, __m256i u, const int8_t *p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return dot32(isa, acc, u, _mm256_set1_epi32(v));
}

/* rows x K floats into int8 codes q (rows, K), the same plus 128 as unsigned bytes (qu), and per block
   dx and sx (rows, K / 32), each row alone. Every code lies in -127..127 whatever the input, so that
   every instruction set reads the same values (AVX2's sign trick and VNNI's q + 128 part ways on -128):
   a block whose largest |x| is so small (below 2^-64; denormals) that 127 / a would overflow is scaled
   by 2^64 first, exactly, giving the codes 127 / a would give if it were finite (dx, from a itself,
   may round to 0); x * (127 / a) is clamped to +-127 before rounding, which changes no finite block
   and sends an infinity to +-127 and a NaN to 127. */
#define QUANTIZE_PAR_ROWS 64    /* mm8 quantises a block of at least this many rows on every thread */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *q, uint8_t *qu, float *dx, float *sx) {
    const int64_t G = K / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *xb = x + r * K + 32 * g;
            __m256 v[4], a = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[i]));
            }
            float amax = 0.0f, lanes[8];
            _mm256_storeu_ps(lanes, a);
            for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
            const float up = amax < 0x1p-64f ? 0x1p64f : 1.0f;            /* exact: a power of 2 */
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / (amax * up) : 0.0f;
            const __m256 idv = _mm256_set1_ps(id), upv = _mm256_set1_ps(up);
            __m256i c[4];
            for (int i = 0; i < 4; i++) {
                const __m256 t = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(_mm256_mul_ps(v[i], upv), idv), hi), lo);
                c[i] = _mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
            /* 32 int32 to 32 int8 in order: packs interleave the 128-bit halves, the permute undoes it */
            const __m256i w16 = _mm256_packs_epi32(c[0], c[1]), x16 = _mm256_packs_epi32(c[2], c[3]);
            const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, x16),
                                                          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + r * K + 32 * g), b);
            _mm256_storeu_si256((__m256i *)(qu + r * K + 32 * g), _mm256_xor_si256(b, _mm256_set1_epi8((char)0x80)));
            const __m256i s = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
            int32_t si[8], sum = 0;
            _mm256_storeu_si256((__m256i *)si, s);
            for (int i = 0; i < 8; i++) sum += si[i];
            dx[r * G + g] = d;
            sx[r * G + g] = d * (float)sum;
        }
}

static inline __m256i bcast4(const void *p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* `rows` quantised rows (<= 4) times GR groups of 8 outputs (GR <= 2) starting at group o; the groups'
   outputs written where they are below N. `isa`, `q8`, `rows` and `GR` are constants at each call.
   Each line of codes read has its counterpart in the next GR groups (the ones this thread reads next,
   GR * G blocks on) prefetched: a forward's weights come from the last-level cache or memory, and the
   hardware's prefetchers alone, or a prefetch a few blocks ahead, leave the loads waiting (SmolLM2-135M,
   2 threads on a 2-core Xeon, 300 cached positions: 1 / 2 / 3 rows 6.93 / 8.01 / 9.00 ms with the
   prefetch 4 blocks ahead, 6.12 / 6.59 / 7.36 with this). */
static inline __attribute__((always_inline)) void tile8(int isa, int q8, int rows, int GR, const int8_t *xq,
                                                        const uint8_t *xu, const float *dx, const float *sx,
                                                        int64_t K, const uint8_t *c, const float *d,
                                                        const float *m, const int32_t *w128, int64_t o,
                                                        int64_t N, float *out) {
    const int64_t G = K / 32, gbytes = q8 ? 256 : 128;           /* code bytes of a group's block */
    __m256 acc[4][2];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < GR; i++) acc[r][i] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < G; g++) {
        __m256i s0[4][2], s1[4][2];                               /* even and odd quads: two chains */
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < GR; i++) s0[r][i] = s1[r][i] = _mm256_setzero_si256();
        if (!q8) {
            for (int p = 0; p < 4; p++)
                for (int i = 0; i < GR; i++) {
                    const uint8_t *cb = c + ((o + i) * G + g) * gbytes + 32 * p;
                    if (!(p & 1)) _mm_prefetch((const char *)(cb + GR * G * gbytes), _MM_HINT_T0);
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)cb);
                    const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    for (int r = 0; r < rows; r++) {
                        const int8_t *xr = xq + r * K + 32 * g;
                        s0[r][i] = dot32_at(isa, s0[r][i], lo, xr + 4 * p);
                        s1[r][i] = dot32_at(isa, s1[r][i], hi, xr + 4 * (p + 4));
                    }
                }
        } else {
            for (int p = 0; p < 8; p++)
                for (int i = 0; i < GR; i++) {
                    if (!(p & 1))
                        _mm_prefetch((const char *)(c + ((o + i + GR) * G + g) * gbytes + 32 * p), _MM_HINT_T0);
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(c + ((o + i) * G + g) * gbytes + 32 * p));
                    if (isa) {
                        for (int r = 0; r < rows; r++) {
                            __m256i *s = p & 1 ? &s1[r][i] : &s0[r][i];
                            *s = dot32(isa, *s, bcast4(xu + r * K + 32 * g + 4 * p), w);
                        }
                    } else {
                        const __m256i aw = _mm256_abs_epi8(w);
                        for (int r = 0; r < rows; r++) {
                            __m256i *s = p & 1 ? &s1[r][i] : &s0[r][i];
                            *s = dot32(isa, *s, aw, _mm256_sign_epi8(bcast4(xq + r * K + 32 * g + 4 * p), w));
                        }
                    }
                }
        }
        for (int i = 0; i < GR; i++) {
            const int64_t at = ((o + i) * G + g) * 8;
            const __m256 dw = _mm256_loadu_ps(d + at);
            const __m256 mw = q8 ? dw : _mm256_loadu_ps(m + at);
            const __m256i fix = q8 && isa ? _mm256_loadu_si256((const __m256i *)(w128 + at)) : _mm256_setzero_si256();
            for (int r = 0; r < rows; r++) {
                const __m256i S = _mm256_sub_epi32(_mm256_add_epi32(s0[r][i], s1[r][i]), fix);
                acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * G + g])),
                                            acc[r][i]);
                if (!q8) acc[r][i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[r * G + g]), acc[r][i]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < GR; i++) {
            const int64_t n0 = (o + i) * 8;
            if (n0 + 8 <= N) _mm256_storeu_ps(out + r * N + n0, acc[r][i]);
            else if (n0 < N) {
                float t[8];
                _mm256_storeu_ps(t, acc[r][i]);
                for (int64_t j = 0; n0 + j < N; j++) out[r * N + n0 + j] = t[j];
            }
        }
}

/* groups o0 .. o0 + GB - 1 (2 groups of 8 outputs, or 1 at the end) for all M rows: 4 rows at a time
   with one group a pass, the rest (1-3 rows) with both; each output's sums are the same either way */
#define GB 2
static inline __attribute__((always_inline)) void block8(int isa, int q8, const int8_t *xq, const uint8_t *xu,
                                                         const float *dx, const float *sx, int64_t M, int64_t K,
                                                         const uint8_t *c, const float *d, const float *m,
                                                         const int32_t *w128, int64_t o0, int ng, int64_t N,
                                                         float *out) {
    const int64_t G = K / 32;
    int64_t r = 0;
#define TILE8(R, GR) do { for (int i = 0; i < ng; i += GR) { \
        if (GR == 2 && ng - i == 1) tile8(isa, q8, R, 1, xq + r * K, xu + r * K, dx + r * G, sx + r * G, K, c, d, m, \
                                          w128, o0 + i, N, out + r * N); \
        else tile8(isa, q8, R, GR, xq + r * K, xu + r * K, dx + r * G, sx + r * G, K, c, d, m, w128, o0 + i, N, \
                   out + r * N); } } while (0)
    for (; r + 4 <= M; r += 4) TILE8(4, 1);
    if (M - r == 3) TILE8(3, 1);
    else if (M - r == 2) TILE8(2, 2);
    else if (M - r == 1) TILE8(1, 2);
#undef TILE8
}

/* one instance of block8 a (instruction set, weight type), each compiled on its own */
#define BLOCK8(NAME, ISA, Q8) \
    static __attribute__((noinline)) void NAME(const int8_t *xq, const uint8_t *xu, const float *dx, const float *sx, \
                                               int64_t M, int64_t K, const uint8_t *c, const float *d, \
                                               const float *m, const int32_t *w128, int64_t o0, int ng, int64_t N, \
                                               float *out) { \
        block8(ISA, Q8, xq, xu, dx, sx, M, K, c, d, m, w128, o0, ng, N, out); }
BLOCK8(block8_q4_avx2, 0, 0)
BLOCK8(block8_q4_avxvnni, 1, 0)
BLOCK8(block8_q8_avx2, 0, 1)
BLOCK8(block8_q8_avxvnni, 1, 1)
#undef BLOCK8

/* ---- AVX512-VNNI on zmm registers (int8_isa 2) ----

   The layout's two groups of a block side by side in one 64-byte vector (the second group's 32 bytes in
   the upper half, as the tile path's B), so that each vpdpbusd sums 16 outputs' lanes: half the dot
   products, loads and scaling steps of the ymm form above for the same sums, and up to 8 rows a pass
   (AVX-512's 32 registers hold their 8 accumulators and 16 partial sums). Each lane's S is the same
   exact integer and each output is scaled by the same operations in the same order: the same bits.
   A lone last group reads its codes twice and writes its own 8 outputs. */
#if HAVE_AVX512VNNI || HAVE_AMX
/* what the 512-bit paths (this one and the tiles') share: built for AVX-512 where the file is not */
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

/* 32 bytes at a and 32 at b as one vector (two groups' codes of a block side by side) */
static inline __attribute__((always_inline)) AVX512_FN __m512i join32(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* 8 floats at a and 8 at b as one vector (two groups' scales of a block) */
static inline __attribute__((always_inline)) AVX512_FN __m512 join8f(const float *a, const float *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

/* acc + one row's block of 16 outputs from its exact sums S, scaled as every path scales them (tile8's
   order): fma(S, dw * dx, acc), then (Q4_1) fma(m, sx, acc) */
static inline __attribute__((always_inline)) AVX512_FN __m512 scale16(int q8, __m512 acc, __m512i S, __m512 dw,
                                                                      __m512 mw, float dx, float sx) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc);
    return q8 ? acc : _mm512_fmadd_ps(mw, _mm512_set1_ps(sx), acc);
}
#endif

#if HAVE_AVX512VNNI
#define ZMM_ROWS 8

/* acc + the 16 lanes of u (64 unsigned bytes) times the 4 signed bytes at p, broadcast ({1to16}) */
static inline __attribute__((always_inline)) AVX512_FN __m512i dot64_at(__m512i acc, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}

/* acc + the 16 lanes of u (unsigned bytes) times s (signed bytes) */
static inline __attribute__((always_inline)) AVX512_FN __m512i dot64(__m512i acc, __m512i u, __m512i s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}

/* R (1..ZMM_ROWS) quantised rows times groups o and o + 1 (o alone where `two` is 0); the outputs below N
   written. `q8` and `R` are constants at each call. The next pair of groups' codes (the ones this thread
   reads next) are prefetched a line at a time, as tile8 does. */
static inline __attribute__((always_inline)) AVX512_FN void tile16(int q8, int R, const int8_t *xq, const uint8_t *xu,
                                                                   const float *dx, const float *sx, int64_t K,
                                                                   const uint8_t *c, const float *d, const float *m,
                                                                   const int32_t *w128, int64_t o, int two, int64_t N,
                                                                   float *out) {
    const int64_t G = K / 32, gbytes = q8 ? 256 : 128, o1 = two ? o + 1 : o;
    __m512 acc[ZMM_ROWS];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *c0 = c + (o * G + g) * gbytes, *c1 = c + (o1 * G + g) * gbytes;
        __m512i s0[ZMM_ROWS], s1[ZMM_ROWS];
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm512_setzero_si512();
        if (!q8) {
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {
                if (!(p & 1)) {
                    _mm_prefetch((const char *)(c0 + 2 * G * gbytes + 32 * p), _MM_HINT_T0);
                    _mm_prefetch((const char *)(c1 + 2 * G * gbytes + 32 * p), _MM_HINT_T0);
                }
                const __m512i raw = join32(c0 + 32 * p, c1 + 32 * p);
                const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                    const int8_t *xr = xq + r * K + 32 * g;
                    s0[r] = dot64_at(s0[r], lo, xr + 4 * p);
                    s1[r] = dot64_at(s1[r], hi, xr + 4 * (p + 4));
                }
            }
        } else {
            _Pragma("GCC unroll 8") for (int p = 0; p < 8; p++) {
                if (!(p & 1)) {
                    _mm_prefetch((const char *)(c0 + 2 * G * gbytes + 32 * p), _MM_HINT_T0);
                    _mm_prefetch((const char *)(c1 + 2 * G * gbytes + 32 * p), _MM_HINT_T0);
                }
                const __m512i w = join32(c0 + 32 * p, c1 + 32 * p);
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                    int32_t v;
                    __builtin_memcpy(&v, xu + r * K + 32 * g + 4 * p, 4);
                    __m512i *s = p & 1 ? &s1[r] : &s0[r];
                    *s = dot64(*s, _mm512_set1_epi32(v), w);
                }
            }
        }
        const int64_t at0 = (o * G + g) * 8, at1 = (o1 * G + g) * 8;
        const __m512 dw = join8f(d + at0, d + at1);
        const __m512 mw = q8 ? dw : join8f(m + at0, m + at1);
        const __m512i fix = q8 ? join32((const uint8_t *)(w128 + at0), (const uint8_t *)(w128 + at1))
                               : _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
            acc[r] = scale16(q8, acc[r], _mm512_sub_epi32(_mm512_add_epi32(s0[r], s1[r]), fix), dw, mw,
                             dx[r * G + g], sx[r * G + g]);
        }
    }
    const int64_t n0 = o * 8, width = two ? 16 : 8;
    const int valid = (int)(N - n0 < width ? N - n0 : width);
    const __mmask16 keep = (__mmask16)((1u << valid) - 1);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + r * N + n0, keep, acc[r]);
}

/* block8's work on zmm registers: the groups o0 .. o0 + ng - 1 (ng <= 2) for all M rows, ZMM_ROWS at a time */
#define TILE16_ROWS(Q8, R) case R: tile16(Q8, R, xq + r * K, xu + r * K, dx + r * G, sx + r * G, K, c, d, m, w128, \
                                          o0, ng == 2, N, out + r * N); break;
#define BLOCK16(NAME, Q8) \
    static __attribute__((noinline)) AVX512_FN void NAME(const int8_t *xq, const uint8_t *xu, const float *dx, \
                                                         const float *sx, int64_t M, int64_t K, const uint8_t *c, \
                                                         const float *d, const float *m, const int32_t *w128, \
                                                         int64_t o0, int ng, int64_t N, float *out) { \
        const int64_t G = K / 32; \
        for (int64_t r = 0; r < M; r += ZMM_ROWS) \
            switch (M - r < ZMM_ROWS ? (int)(M - r) : ZMM_ROWS) { \
                TILE16_ROWS(Q8, 1) TILE16_ROWS(Q8, 2) TILE16_ROWS(Q8, 3) TILE16_ROWS(Q8, 4) \
                TILE16_ROWS(Q8, 5) TILE16_ROWS(Q8, 6) TILE16_ROWS(Q8, 7) TILE16_ROWS(Q8, 8) } }
BLOCK16(block16_q4_avx512vnni, 0)
BLOCK16(block16_q8_avx512vnni, 1)
#undef BLOCK16
#undef TILE16_ROWS
#define BLOCK_Q4_AVX512VNNI block16_q4_avx512vnni
#define BLOCK_Q8_AVX512VNNI block16_q8_avx512vnni
#else                                   /* never chosen: mcsd_int8_isas_built leaves set 2 out */
#define BLOCK_Q4_AVX512VNNI block8_q4_avx2
#define BLOCK_Q8_AVX512VNNI block8_q8_avx2
#endif

/* ---- the same products on AMX tiles (int8_isa 3) ----

   tdpbssd C += A B sums, for each of up to 16 rows of A and 16 columns of B, 4 adjacent signed byte
   products a step: A one block of up to 16 quantised rows (R rows x 32 bytes, read where quantize_rows
   left them), B the block's codes of two groups of 8 outputs side by side (8 rows of 64 bytes: row p
   holds each output's 4 codes at k = 4p..4p + 3), which is the layout above with the two groups'
   vectors p joined (Q4_1: the low nibbles as rows 0-3, the high ones as rows 4-7, unpacked into a
   512-byte buffer; Q8_0: copied). One tdpbssd a block, from a zeroed C, so C holds each output's S[g]
   exactly (signed x signed: Q8_0 needs no w128), stored and scaled with AVX-512 in the order the other
   paths scale them (fma(S, dw * dx, acc), then fma(m, sx, acc)): the same bits. Fewer than
   AMX_MIN_ROWS rows run on AVX512-VNNI, which a tile does not beat there. Each thread loads its own
   tile configuration (tile state is per thread) and releases it when done.

   Cost, on a 2-core Xeon with AMX (one thread, a 3,072 x 576 Q4_1 weight, a block of 16 outputs):
   4 / 8 / 9 / 16 rows 16 / 20 / 28 / 35 ns on tiles, 18 / 37 / 46 / 72 ns on AVX512-VNNI's ymm form (2
   and 3 rows no faster on tiles). Its zmm form (above) then beat tiles in whole forwards up to 5 rows
   (SmolLM2-135M, 2 threads, 300 cached positions, medians of 25: 4 / 5 / 6 / 7 / 8 rows 5.24 / 5.66 /
   6.46 / 6.73 / 7.29 ms on zmm, 5.48 / 5.79 / 6.44 / 6.65 / 7.16 on tiles), hence AMX_MIN_ROWS. A tile
   product, its loads and the store of its sums cost about 10 ns whatever the rows (hence two blocks a
   tile product up to 8 rows, amx_pair2); the epilogue that exactness
   requires (a conversion, a product and two FMAs a row for 16 outputs, at two AVX-512 operations a
   cycle) about 0.7 ns a row; and the two did not overlap there: a phase of tile products for a whole
   row of blocks, then one of scaling, ran no faster than the interleaved steps below. */
#if HAVE_AMX
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 6
#endif
/* the tile instructions as assembly, so that no compiler support beyond an assembler that knows them is
   needed; the memory a load reads and a store writes is named as an operand (the whole of what the
   pointer points into), not as a clobber of all memory, which would keep the accumulators out of
   registers */
#define TILE_LOAD(t, base, stride) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t \
    :: "r"(base), "r"((int64_t)(stride)), "m"(*(const char (*)[])(base)))
#define TILE_STORE(t, base, stride) __asm__ volatile("tilestored %%tmm" #t ", (%1,%2,1)" \
    : "=m"(*(char (*)[1024])(base)) : "r"(base), "r"((int64_t)(stride)))
#define TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TILE_DPBSSD(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_config;

/* R rows: R <= 8 pairs blocks (amx_pair2: A and C 2R rows, A 64 bytes, B 16 rows), else one block a
   tile product (amx_pair: A and C R rows, A 32 bytes, B 8 rows) */
static void amx_configure(int R) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int paired = R <= 8;
    for (int t = 0; t < 2; t++) {
        c.rows[t] = (uint8_t)(paired ? 2 * R : R);     c.colsb[t] = 64;         /* C: rows x 16 int32 */
        c.rows[2 + t] = (uint8_t)(paired ? 2 * R : R); c.colsb[2 + t] = paired ? 64 : 32;  /* A: codes */
        c.rows[4 + t] = paired ? 16 : 8;               c.colsb[4 + t] = 64;     /* B: 4 codes x 16 outputs */
    }
    __asm__ volatile("ldtilecfg %0" :: "m"(c));
}

static void amx_release(void) { __asm__ volatile("tilerelease" ::: "memory"); }

/* B for one block: the groups' code vectors at c0 and c1 (the same group twice for a last odd one) */
static inline __attribute__((always_inline)) AVX512_FN void amx_fill(int q8, const uint8_t *c0, const uint8_t *c1,
                                                                     uint8_t *b) {
    if (q8) {
        for (int p = 0; p < 8; p++) _mm512_store_si512(b + 64 * p, join32(c0 + 32 * p, c1 + 32 * p));
    } else {
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int p = 0; p < 4; p++) {
            const __m512i v = join32(c0 + 32 * p, c1 + 32 * p);
            _mm512_store_si512(b + 64 * p, _mm512_and_si512(v, low));
            _mm512_store_si512(b + 64 * (p + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    }
}

/* the same block of the next pair of groups (the ones this thread reads next), a line at a time: a
   product's codes come from the last-level cache or memory, and the hardware's prefetchers alone leave
   the stream waiting on them (see tile8) */
#define AMX_PREFETCH(c0, c1) do { for (int64_t l = 0; l < gbytes; l += 64) { \
        _mm_prefetch((const char *)((c0) + 2 * G * gbytes + l), _MM_HINT_T0); \
        _mm_prefetch((const char *)((c1) + 2 * G * gbytes + l), _MM_HINT_T0); } } while (0)

/* acc[r] for a block from its sums in cb (R rows of 16 int32) and its rows' dx (xs[r]) and sx (xs[16 + r]):
   the scaling of tile8, 16 outputs a row */
static inline __attribute__((always_inline)) AVX512_FN void amx_scale(int q8, int R, const int32_t *cb, const float *d,
                                                                      const float *m, int64_t at0, int64_t at1,
                                                                      const float *xs, __m512 *acc) {
    const __m512 dw = join8f(d + at0, d + at1), mw = q8 ? dw : join8f(m + at0, m + at1);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
        acc[r] = scale16(q8, acc[r], _mm512_load_si512(cb + 16 * r), dw, mw, xs[r], xs[16 + r]);
}

/* R (1..16) quantised rows times groups o and o + 1 (o alone where `two` is 0); the outputs below N
   written. The tiles are configured for R rows. `q8` and `R` are constants at each call.
   Two blocks a step: both blocks' tile products issued back to back (C, A, B tiles 0, 2, 4 and 1, 3, 5),
   the step before's two blocks scaled, and only then the new sums stored, so that no load waits on a
   store just made (B, filled a step ahead, included): 5-10% faster than a block at a time. */
static inline __attribute__((always_inline)) AVX512_FN void amx_pair(int q8, int R, const int8_t *xq, const float *xs,
                                                                     int64_t K, const uint8_t *c,
                                                                     const float *d, const float *m, int64_t o, int two,
                                                                     int64_t N, float *out) {
    const int64_t G = K / 32, gbytes = q8 ? 256 : 128, o1 = two ? o + 1 : o;
    _Alignas(64) uint8_t bbuf[4][512];            /* B of block g in bbuf[g & 3] */
    _Alignas(64) int32_t cbuf[4][256];            /* the sums of block g in cbuf[g & 3] */
    __m512 acc[16];
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
#define FILL(f) do { const uint8_t *c0 = c + (o * G + (f)) * gbytes, *c1 = c + (o1 * G + (f)) * gbytes; \
        AMX_PREFETCH(c0, c1); \
        amx_fill(q8, c0, c1, bbuf[(f) & 3]); } while (0)
#define SCALE(h) amx_scale(q8, R, cbuf[(h) & 3], d, m, (o * G + (h)) * 8, (o1 * G + (h)) * 8, xs + 32 * (h), acc)
    for (int64_t f = 0; f < 2 && f < G; f++) FILL(f);
    for (int64_t g = 0; g < G + 2; g += 2) {      /* blocks g and g + 1 on tiles, g - 2 and g - 1 scaled */
        const int one = g < G, both = g + 1 < G;
        for (int64_t f = g + 2; f < g + 4 && f < G; f++) FILL(f);
        if (one) {
            TILE_LOAD(2, xq + 32 * g, K);
            TILE_LOAD(4, bbuf[g & 3], 64);
            TILE_ZERO(0);
            TILE_DPBSSD(0, 2, 4);
        }
        if (both) {
            TILE_LOAD(3, xq + 32 * (g + 1), K);
            TILE_LOAD(5, bbuf[(g + 1) & 3], 64);
            TILE_ZERO(1);
            TILE_DPBSSD(1, 3, 5);
        }
        if (g >= 2) {
            SCALE(g - 2);
            if (g - 1 < G) SCALE(g - 1);
        }
        if (one) TILE_STORE(0, cbuf[g & 3], 64);
        if (both) TILE_STORE(1, cbuf[(g + 1) & 3], 64);
    }
#undef SCALE
#undef FILL
    const int64_t n0 = o * 8, width = two ? 16 : 8;
    const int valid = (int)(N - n0 < width ? N - n0 : width);
    const __mmask16 keep = (__mmask16)((1u << valid) - 1);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + r * N + n0, keep, acc[r]);
}

/* R <= 8 rows: two blocks a tile product. A tile product costs about the same whatever its rows, so
   few rows waste it; here rows 0..R-1 of A are the rows' block g (k 0..31, zero above) and rows
   R..2R-1 their block g + 1 (k 32..63, zero below), from a copy of the quantised rows laid out so
   (xa: per pair of blocks 2R x 64 bytes, made by mm8_amx), and B holds the two blocks' codes one
   above the other (16 rows), so C's rows 0..R-1 are block g's sums and R..2R-1 block g + 1's, each
   exact as before. Half the tile products, loads and stores of amx_pair for the same sums. */
static inline __attribute__((always_inline)) AVX512_FN void amx_pair2(int q8, int R, const int8_t *xa,
                                                                      const float *xs, int64_t K, const uint8_t *c,
                                                                      const float *d, const float *m, int64_t o,
                                                                      int two, int64_t N, float *out) {
    const int64_t G = K / 32, P = (G + 1) / 2, gbytes = q8 ? 256 : 128, o1 = two ? o + 1 : o;
    _Alignas(64) uint8_t bbuf[2][1024];           /* B of blocks 2p, 2p + 1 in bbuf[p & 1] */
    _Alignas(64) int32_t cbuf[2][256];            /* their sums */
    __m512 acc[8];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    /* a lone last block leaves B's rows 8-15 as an earlier pair filled them (or never filled, zeroed
       here): they meet only A's zero half, so they add nothing */
    if (G & 1) memset(bbuf[(P - 1) & 1] + 512, 0, 512);
#define FILL2(p) do { for (int64_t f = 2 * (p); f < 2 * (p) + 2 && f < G; f++) { \
        const uint8_t *c0 = c + (o * G + f) * gbytes, *c1 = c + (o1 * G + f) * gbytes; \
        AMX_PREFETCH(c0, c1); \
        amx_fill(q8, c0, c1, bbuf[(p) & 1] + 512 * (f & 1)); } } while (0)
#define SCALE2(p) do { const int64_t g = 2 * (p); \
        amx_scale(q8, R, cbuf[(p) & 1], d, m, (o * G + g) * 8, (o1 * G + g) * 8, xs + 32 * g, acc); \
        if (g + 1 < G) amx_scale(q8, R, cbuf[(p) & 1] + 16 * R, d, m, (o * G + g + 1) * 8, (o1 * G + g + 1) * 8, \
                                 xs + 32 * (g + 1), acc); } while (0)
    FILL2(0);
    for (int64_t p = 0; p <= P; p++) {            /* pair p on tiles, pair p - 1 scaled */
        if (p + 1 < P) FILL2(p + 1);
        if (p < P) {
            if (p & 1) {
                TILE_LOAD(3, xa + p * 128 * R, 64);
                TILE_LOAD(5, bbuf[1], 64);
                TILE_ZERO(1);
                TILE_DPBSSD(1, 3, 5);
            } else {
                TILE_LOAD(2, xa + p * 128 * R, 64);
                TILE_LOAD(4, bbuf[0], 64);
                TILE_ZERO(0);
                TILE_DPBSSD(0, 2, 4);
            }
        }
        if (p > 0) SCALE2(p - 1);
        if (p < P) {
            if (p & 1) TILE_STORE(1, cbuf[1], 64);
            else TILE_STORE(0, cbuf[0], 64);
        }
    }
#undef SCALE2
#undef FILL2
    const int64_t n0 = o * 8, width = two ? 16 : 8;
    const int valid = (int)(N - n0 < width ? N - n0 : width);
    const __mmask16 keep = (__mmask16)((1u << valid) - 1);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + r * N + n0, keep, acc[r]);
}

#undef AMX_PREFETCH

/* one instance of amx_pair a (weight type, rows), each compiled on its own */
typedef void (*amx_fn)(const int8_t *, const float *, int64_t, const uint8_t *, const float *, const float *, int64_t,
                       int, int64_t, float *);
#define AMX_PAIR(Q8, R) \
    static __attribute__((noinline)) AVX512_FN void amx_pair_##Q8##_##R( \
            const int8_t *xq, const float *xs, int64_t K, const uint8_t *c, const float *d, const float *m, \
            int64_t o, int two, int64_t N, float *out) { \
        if (R <= 8) amx_pair2(Q8, R, xq, xs, K, c, d, m, o, two, N, out); \
        else amx_pair(Q8, R, xq, xs, K, c, d, m, o, two, N, out); }
#define AMX_PAIRS(Q8) AMX_PAIR(Q8, 1) AMX_PAIR(Q8, 2) AMX_PAIR(Q8, 3) AMX_PAIR(Q8, 4) AMX_PAIR(Q8, 5) \
    AMX_PAIR(Q8, 6) AMX_PAIR(Q8, 7) AMX_PAIR(Q8, 8) AMX_PAIR(Q8, 9) AMX_PAIR(Q8, 10) AMX_PAIR(Q8, 11) \
    AMX_PAIR(Q8, 12) AMX_PAIR(Q8, 13) AMX_PAIR(Q8, 14) AMX_PAIR(Q8, 15) AMX_PAIR(Q8, 16)
AMX_PAIRS(0)
AMX_PAIRS(1)
#define AMX_ROW(Q8) {NULL, amx_pair_##Q8##_1, amx_pair_##Q8##_2, amx_pair_##Q8##_3, amx_pair_##Q8##_4, \
    amx_pair_##Q8##_5, amx_pair_##Q8##_6, amx_pair_##Q8##_7, amx_pair_##Q8##_8, amx_pair_##Q8##_9, \
    amx_pair_##Q8##_10, amx_pair_##Q8##_11, amx_pair_##Q8##_12, amx_pair_##Q8##_13, amx_pair_##Q8##_14, \
    amx_pair_##Q8##_15, amx_pair_##Q8##_16}
static const amx_fn amx_fns[2][17] = {AMX_ROW(0), AMX_ROW(1)};
#undef AMX_ROW
#undef AMX_PAIRS
#undef AMX_PAIR

/* mm8's products on tiles for M >= AMX_MIN_ROWS quantised rows: 16 rows at a time (the last R rows;
   R <= 8 two blocks a tile product, from the rows laid out for it in xa), each thread the same pairs
   of groups for every 16 rows, its tiles configured when R changes. The rows' dx and sx are first
   laid out a block at a time (16 of each), so that a block's scaling reads them at fixed offsets.
   Returns -1 where those copies could not be allocated. */
static int mm8_amx(const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K, const void *codes,
                   const float *d, const float *m, int64_t N, float *out, int threads, int q8) {
    const int64_t G = K / 32, P = (G + 1) / 2, groups = (N + 7) / 8, pairs = (groups + 1) / 2,
                  chunks = (M + 15) / 16, last = M - 16 * (chunks - 1);
    float *xs = calloc((size_t)(chunks * G * 32), sizeof(float));
    int8_t *xa = last <= 8 ? aligned_alloc(64, (size_t)(P * 128 * last)) : NULL;   /* the last chunk paired */
    if (!xs || (last <= 8 && !xa)) {
        free(xs);
        free(xa);
        return -1;
    }
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < G; g++) {
            xs[((r / 16) * G + g) * 32 + r % 16] = dx[r * G + g];
            xs[((r / 16) * G + g) * 32 + 16 + r % 16] = sx[r * G + g];
        }
    if (xa) {                                     /* pair p: row r [block 2p | 0], row last + r [0 | 2p + 1] */
        const int64_t r0 = 16 * (chunks - 1);
        memset(xa, 0, (size_t)(P * 128 * last));
        for (int64_t g = 0; g < G; g++)
            for (int64_t r = 0; r < last; r++)
                memcpy(xa + (g / 2) * 128 * last + ((g & 1) * last + r) * 64 + (g & 1) * 32, xq + (r0 + r) * K + 32 * g,
                       32);
    }
    #pragma omp parallel num_threads(threads)
    {
        int configured = 0;
        for (int64_t r0 = 0; r0 < M; r0 += 16) {
            const int R = M - r0 < 16 ? (int)(M - r0) : 16;
            if (R != configured) {
                amx_configure(R);
                configured = R;
            }
            const amx_fn fn = amx_fns[q8][R];
            const int8_t *rows = R <= 8 ? xa : xq + r0 * K;
            #pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < pairs; b++)
                fn(rows, xs + (r0 / 16) * G * 32, K, (const uint8_t *)codes, d, m, 2 * b, 2 * b + 1 < groups, N,
                   out + r0 * N);
        }
        amx_release();
    }
    free(xs);
    free(xa);
    return 0;
}
#endif

/* x (M, K) float32 times N weight rows in the layout above, on 8-bit activations; out (M, N). Q4_1:
   q8 == 0, m the offsets, w128 unused; Q8_0: q8 == 1, m unused. Returns 0, or -1 where the quantised
   rows could not be allocated (out is then untouched). */
static int mm8(const float *x, int64_t M, int64_t K, const void *codes, const float *d, const float *m,
               const int32_t *w128, int64_t N, float *out, int threads, int q8) {
    const int64_t G = K / 32;
    uint8_t *xb = malloc((size_t)(2 * M * K));
    float *dx = malloc(sizeof(float) * (size_t)(2 * M * G));
    if (!xb || !dx) {
        free(xb);
        free(dx);
        return -1;
    }
    int8_t *xq = (int8_t *)xb;
    uint8_t *xu = xb + M * K;
    float *sx = dx + M * G;
    /* a prompt's rows quantised on every thread, each row on its own as alone (the same codes): the four
       longest held-out prompts' prefills 314 / 327 -> 294 / 306 ms on a 2-core Xeon; a tree's few rows
       gained nothing (within 2%) and stay on one */
    if (M >= QUANTIZE_PAR_ROWS && threads > 1) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < M; r++)
            quantize_rows(x + r * K, 1, K, xq + r * K, xu + r * K, dx + r * G, sx + r * G);
    } else
        quantize_rows(x, M, K, xq, xu, dx, sx);
    typedef void (*block_fn)(const int8_t *, const uint8_t *, const float *, const float *, int64_t, int64_t,
                             const uint8_t *, const float *, const float *, const int32_t *, int64_t, int, int64_t,
                             float *);
    static const block_fn fns[2][3] = {{block8_q4_avx2, block8_q4_avxvnni, BLOCK_Q4_AVX512VNNI},
                                       {block8_q8_avx2, block8_q8_avxvnni, BLOCK_Q8_AVX512VNNI}};
#if HAVE_AMX
    if (int8_isa == 3 && M >= AMX_MIN_ROWS) {
        const int failed = mm8_amx(xq, dx, sx, M, K, codes, d, m, N, out, threads, q8);
        free(xb);
        free(dx);
        return failed;
    }
#endif
    const block_fn fn = fns[q8][int8_isa == 3 ? 2 : int8_isa];      /* AMX: few rows on AVX512-VNNI */
    const int64_t groups = (N + 7) / 8, blocks = (groups + GB - 1) / GB;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t o0 = b * GB;
        fn(xq, xu, dx, sx, M, K, (const uint8_t *)codes, d, m, w128, o0, groups - o0 < GB ? (int)(groups - o0) : GB,
           N, out);
    }
    free(xb);
    free(dx);
    return 0;
}

int mcsd_q4q8_mm(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *d, const float *m,
                 int64_t N, float *out, int threads) {
    return mm8(x, M, K, codes, d, m, NULL, N, out, threads, 0);
}

int mcsd_q8q8_mm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *d, const int32_t *w128,
                 int64_t N, float *out, int threads) {
    return mm8(x, M, K, codes, d, NULL, w128, N, out, threads, 1);
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

/* exp of 8 floats: Cephes' polynomial after a range reduction by powers of 2 (relative error about
   2e-7); arguments below -87 give exactly 0, so a masked (-inf) score weighs nothing. */
static inline __m256 exp8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

/* attention_rows' work for n (1..3) query vectors of one row whose heads share a key / value head
   (their vectors at qv, qv + D, ...; outputs likewise at o), each computed exactly as described above,
   the n interleaved: each key and value is read once for the n, and their chains (the scores' maxima,
   the sums of weights, the weighted values) run side by side. s: n score buffers of Ls floats (L
   rounded up to 8); `n` is a constant at each call. (The order of each vector's operations is given
   with mcsd_attention, below.) One layer of SmolLM2-135M (9 heads over 3), 300 cached positions, 2
   threads on a 2-core Xeon, 1 / 2 / 3 rows: 21.7 / 32.6 / 42.2 us a vector at a time, 20.4 / 29.8 / 37.3
   so (the keys and values read from the last-level cache; 13.4 / 20.4 / 29.2 and 11.7 / 17.4 / 23.6 from
   L2). */
static inline __attribute__((always_inline)) void attend_heads(const int n, const float *qv, const float *K,
                                                               const float *V, const float *mr, int64_t L,
                                                               int64_t Ls, int64_t D, float scale, float *s,
                                                               float *o) {
    float mx[3] = {-INFINITY, -INFINITY, -INFINITY};
    int64_t j = 0;
    for (; j + 4 <= L; j += 4) {                /* four keys at a time, reduced together */
        __m256 a[3][4];
        for (int h = 0; h < n; h++)
            for (int k = 0; k < 4; k++) a[h][k] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 k0 = _mm256_loadu_ps(K + j * D + d), k1 = _mm256_loadu_ps(K + (j + 1) * D + d),
                         k2 = _mm256_loadu_ps(K + (j + 2) * D + d), k3 = _mm256_loadu_ps(K + (j + 3) * D + d);
            for (int h = 0; h < n; h++) {
                const __m256 x = _mm256_loadu_ps(qv + h * D + d);
                a[h][0] = _mm256_fmadd_ps(x, k0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(x, k1, a[h][1]);
                a[h][2] = _mm256_fmadd_ps(x, k2, a[h][2]);
                a[h][3] = _mm256_fmadd_ps(x, k3, a[h][3]);
            }
        }
        for (int h = 0; h < n; h++) {
            const __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
            const __m128 dots = _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1));
            const __m128 v = _mm_add_ps(_mm_mul_ps(dots, _mm_set1_ps(scale)), _mm_loadu_ps(mr + j));
            float *sh = s + h * Ls;
            _mm_storeu_ps(sh + j, v);
            for (int i = 0; i < 4; i++) mx[h] = sh[j + i] > mx[h] ? sh[j + i] : mx[h];
        }
    }
    for (; j < L; j++)                          /* the rest one at a time, summed as above */
        for (int h = 0; h < n; h++) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qv + h * D + d), _mm256_loadu_ps(K + j * D + d), a);
            const __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(a, a), _mm256_hadd_ps(a, a));
            const float dot = _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
            const float v = dot * scale + mr[j];
            s[h * Ls + j] = v;
            mx[h] = v > mx[h] ? v : mx[h];
        }
    /* exponentials 8 at a time (the buffer holds L rounded up to 8; the tail's extra lanes are -inf, so
       0), then summed one by one in key order: a key's lane would depend on its index in the block, and
       a tree's sibling rows put a row's own key at another index than the step that computes it alone
       (masked keys add exact zeros, which change no sum) */
    float sum[3] = {0.0f, 0.0f, 0.0f};
    for (int h = 0; h < n; h++) {
        float *sh = s + h * Ls;
        for (int64_t j = L; j < Ls; j++) sh[j] = -INFINITY;
        const __m256 mxv = _mm256_set1_ps(mx[h]);
        for (int64_t j = 0; j < L; j += 8)
            _mm256_storeu_ps(sh + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), mxv)));
    }
    for (int64_t j = 0; j < L; j++)
        for (int h = 0; h < n; h++) sum[h] += s[h * Ls + j];
    /* the weighted sum of values, 32 of the head's dimensions at a time in registers (4 x n) */
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const int w = D - d0 >= 32 ? 4 : (int)(D - d0) / 8;
        __m256 c[3][4];
        for (int h = 0; h < n; h++)
            for (int i = 0; i < 4; i++) c[h][i] = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < L; jj++) {
            const float *vj = V + jj * D + d0;
            for (int h = 0; h < n; h++) {
                const float e = s[h * Ls + jj];
                if (e == 0.0f) continue;
                const __m256 p = _mm256_set1_ps(e);
                if (w == 4)
                    for (int i = 0; i < 4; i++) c[h][i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * i), c[h][i]);
                else
                    for (int i = 0; i < w; i++) c[h][i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * i), c[h][i]);
            }
        }
        for (int h = 0; h < n; h++) {
            const __m256 inv = _mm256_set1_ps(sum[h]);
            for (int i = 0; i < w; i++)
                _mm256_storeu_ps(o + h * D + d0 + 8 * i, _mm256_div_ps(c[h][i], inv));
        }
    }
}

/* Attention of Q query rows over the first L cached positions, key / value heads grouped:
   out[r, h] = softmax_j(q[r, h] . k[h / g, j] * scale + mask[r, j]) v[h / g, j], g = H / Hkv.
   q and out (Q, H, D); keys and values (Hkv, cap, D) (a static cache's buffers); mask (Q, L) with row
   stride mask_stride, additive (-inf where a key is not seen). D a multiple of 8.

   Each (row, head) is computed on its own in one fixed order, so a row's result does not depend on the
   rows beside it, on how many positions the block attends over, or on where among them its allowed keys
   lie (a verify's row, siblings masked out, and the step that computes it alone):
     score_j = dot(q, k_j) * scale + mask_j, the dot as eight partial sums (dimension i mod 8, each an
       FMA chain over i in order) added as ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7));
     their maximum; e_j = exp8(score_j - max), summed in key order from 0;
     each output dimension an FMA chain of e_j v_j over the keys in order, keys with e_j = 0 left out
     (a masked sibling adds nothing, not even a signed zero), then one division by the sum.
   Two implementations compute exactly that, so either may run any block:
   - attention_rows: a row's vectors that share a key / value head up to three at a time
     (attend_heads), their dimensions in the lanes (few rows); the rows of a batch's sequences
     together in one parallel region, each thread a contiguous share, so a sequence's keys and values
     are read by one thread where it can (4 slots of 2 rows, 300 cached positions each, the whole
     forward on a 2-core Xeon: 15.8 -> 13.0 ms; of 1 row 11.1 -> 10.8 ms);
   - attention_lanes (AVX-512): the query vectors of a key / value head (its rows times the g heads that
     share it), sixteen at a time, in the lanes, so that each key's and value's elements are read once
     for sixteen of them; for a verify of many rows (one layer of SmolLM2-135M, 9 heads over 3, 300
     cached positions, 2 threads on a 2-core Xeon: 16 rows 170.7 us on the first, 101.8 on this); a
     group of rows reads the keys up to its last row's last unmasked one (a prompt's causal block).
   mcsd_attention_lanes sets from how many query vectors a key / value head has the second runs.
   Returns 0, or -1 where a thread's scratch could not be allocated (out is then incomplete). */
static int attention_rows(const float *q, const float *keys, const float *values, int64_t cap,
                          int64_t cache_stride, int64_t n_seg, const int64_t *first, const int64_t *cache,
                          const int64_t *lens, const float *mask, int64_t mask_stride, int64_t H, int64_t Hkv,
                          int64_t D, float scale, float *out, int threads) {
    const int64_t group = H / Hkv, total = first[n_seg] * H;
    int64_t most = 0;
    for (int64_t i = 0; i < n_seg; i++) most = lens[i] > most ? lens[i] : most;
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        float *s = malloc(sizeof(float) * (size_t)(3 * ((most + 7) & ~(int64_t)7) + 8));
        failed = !s;
        /* each thread a contiguous share of the (row, head) vectors of every sequence together, as a
           static schedule splits them, taken in runs of up to three that share a row and a key / value
           head: one parallel region for a batch's sequences, not one each. Within a sequence the vectors
           go by key / value head, then row, so that a thread reads a head's keys and values from memory
           once for all its rows (the next rows find them in its cache): a 2-row verify's attention read
           4 heads' instead of 6 on 2 threads */
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num(), per = (total + nt - 1) / nt;
        const int64_t t1 = (tid + 1) * per < total ? (tid + 1) * per : total;
        int64_t i = 0;                                                   /* the sequence of vector t */
        for (int64_t t = tid * per; s && t < t1;) {
            while (t >= first[i + 1] * H) i++;
            const int64_t rows = first[i + 1] - first[i], u = t - first[i] * H, w = u % (rows * group);
            const int64_t kv = u / (rows * group), r = first[i] + w / group, h = kv * group + w % group;
            const int64_t sharing = group - w % group;
            const int64_t L = lens[i], Ls = (L + 7) & ~(int64_t)7;
            int64_t n = t1 - t < sharing ? t1 - t : sharing;         /* this thread's, of this head's group */
            if (n > 3) n = 3;
            const float *qv = q + (r * H + h) * D, *K = keys + cache[i] * cache_stride + kv * cap * D,
                        *V = values + cache[i] * cache_stride + kv * cap * D;
            const float *mr = mask + r * mask_stride;
            float *o = out + (r * H + h) * D;
            if (n == 3) attend_heads(3, qv, K, V, mr, L, Ls, D, scale, s, o);
            else if (n == 2) attend_heads(2, qv, K, V, mr, L, Ls, D, scale, s, o);
            else attend_heads(1, qv, K, V, mr, L, Ls, D, scale, s, o);
            t += n;
        }
        free(s);
    }
    return failed ? -1 : 0;
}


#if HAVE_AVX512VNNI
#define LANES_FN __attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma")))
static inline __attribute__((always_inline)) LANES_FN __m512 exp16(__m512 x) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(exp8(_mm512_castps512_ps256(x))),
                              exp8(_mm512_extractf32x8_ps(x, 1)), 1);
}

/* mcsd_attention with sixteen query vectors in the lanes (see above); the same bits as attention_rows.
   A task is one key / value head's vectors p0 .. p0 + 15 (vector p: row p / g, head kv g + p mod g;
   lanes past the last repeat the first). Scores two keys at a time (sixteen partial sums in registers,
   each query load serving both), each key's mask entries gathered from its lanes' rows; then the
   exponentials and their sum, with a note per key of whether every lane, none or some weigh it; then
   the values, sixteen dimensions at a time (D a multiple of 16). */
#define MASKED (-3.0e38f)          /* a mask at or below this hides its key (-inf, float32's most negative) */
static LANES_FN int attention_lanes(const float *q, const float *keys, const float *values, int64_t cap, int64_t L,
                                    const float *mask, int64_t mask_stride, int64_t Q, int64_t H, int64_t Hkv,
                                    int64_t D, float scale, float *out, int threads) {
    const int64_t group = H / Hkv, pairs = Q * group, chunks = (pairs + 15) / 16, tasks = Hkv * chunks;
    if (L > ((int64_t)1 << 48)) return -1;          /* sixteen floats a key: no allocation holds it */
    /* live[r]: row r's keys from live[r] on are all masked out (a mask of -inf or of float32's most
       negative value, as the engine's masks hold): a prompt's row sees the keys up to its own, so a task
       of rows stops at its last row's. Their scores would lie some 3e38 below the row's own key's, their
       weights exp8's exact 0, adding +0 to the sum and nothing to the outputs: the same bits (for scores
       short of overflow). With the tasks dealt to the threads in turn, the prefills of the four longest
       held-out prompts (449-862 tokens, 2 threads on a 2-core Xeon) took 406 / 382 -> 333 / 332 ms. */
    int64_t *live = malloc(sizeof(int64_t) * (size_t)(Q > 0 ? Q : 1));
    if (!live) return -1;
    const __m512 masked = _mm512_set1_ps(MASKED);
    for (int64_t r = 0; r < Q; r++) {
        const float *mr = mask + r * mask_stride;
        int64_t j = L;
        for (; j >= 16; j -= 16) {
            const __mmask16 alive = _mm512_cmp_ps_mask(_mm512_loadu_ps(mr + j - 16), masked, _CMP_NLE_UQ);
            if (alive) {
                j -= __builtin_clz((unsigned)alive) - 16;            /* past the last live key of the 16 */
                break;
            }
        }
        if (j < 16)
            while (j > 0 && mr[j - 1] <= MASKED) j--;
        live[r] = j;
    }
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        const size_t keys_n = (size_t)(L > 0 ? L : 1);
        float *e = aligned_alloc(64, sizeof(float) * 16 * keys_n);    /* per key: its scores, then weights */
        float *qt = aligned_alloc(64, sizeof(float) * 16 * (size_t)D); /* qt[i][lane]: dimension i of the lane's query */
        uint8_t *weighs = malloc(keys_n);                                /* per key: 0 no lane, 1 every lane, 2 some */
        failed = !e || !qt || !weighs;
        /* a task's keys end at its last row's: tasks one by one to the threads in turn, so that early and
           late rows (a prompt's cheap and dear ones) are shared out */
        #pragma omp for schedule(static, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!e || !qt || !weighs) continue;
            const int64_t kv = t / chunks, p0 = (t % chunks) * 16;
            const int n = pairs - p0 < 16 ? (int)(pairs - p0) : 16;
            const float *K = keys + kv * cap * D, *V = values + kv * cap * D;
            const int64_t r0 = p0 / group;
            int64_t Lt = 0;                             /* the keys any of its rows sees: 0 .. Lt - 1 */
            for (int64_t r = r0; r <= (p0 + n - 1) / group; r++) Lt = live[r] > Lt ? live[r] : Lt;
            int64_t at[16];                             /* lane l: its query's offset in q and out */
            int32_t mrow[16];                           /* its mask row's offset from row r0's */
            for (int l = 0; l < 16; l++) {
                const int64_t p = p0 + (l < n ? l : 0);
                at[l] = (p / group * H + kv * group + p % group) * D;
                mrow[l] = (int32_t)((p / group - r0) * mask_stride);
            }
            for (int64_t i = 0; i < D; i++)
                for (int l = 0; l < 16; l++) qt[i * 16 + l] = q[at[l] + i];
            const float *mbase = mask + r0 * mask_stride;
            const __m512i mi = _mm512_loadu_si512(mrow);
            const __m512 sc = _mm512_set1_ps(scale);
            __m512 mx = _mm512_set1_ps(-INFINITY);
#define PARTIALS_SUM(p) _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])), \
                                      _mm512_add_ps(_mm512_add_ps(p[4], p[5]), _mm512_add_ps(p[6], p[7])))
#define SCORE(dot, j) do { \
                const __m512 v = _mm512_add_ps(_mm512_mul_ps(dot, sc), _mm512_i32gather_ps(mi, mbase + (j), 4)); \
                _mm512_store_ps(e + 16 * (j), v); \
                mx = _mm512_max_ps(mx, v); } while (0)
            int64_t j = 0;
            for (; j + 2 <= Lt; j += 2) {
                const float *ka = K + j * D, *kb = ka + D;
                for (int64_t c = 0; c < 2 * D; c += 16)     /* the keys eight ahead, read from the cache */
                    _mm_prefetch((const char *)(ka + 8 * D + c), _MM_HINT_T0);
                __m512 a[8], b[8];
                for (int i = 0; i < 8; i++) a[i] = b[i] = _mm512_setzero_ps();
                for (int64_t c = 0; c < D; c += 8)
                    for (int i = 0; i < 8; i++) {
                        const __m512 x = _mm512_load_ps(qt + (c + i) * 16);
                        a[i] = _mm512_fmadd_ps(x, _mm512_set1_ps(ka[c + i]), a[i]);
                        b[i] = _mm512_fmadd_ps(x, _mm512_set1_ps(kb[c + i]), b[i]);
                    }
                SCORE(PARTIALS_SUM(a), j);
                SCORE(PARTIALS_SUM(b), j + 1);
            }
            for (; j < Lt; j++) {
                const float *ka = K + j * D;
                __m512 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
                for (int64_t c = 0; c < D; c += 8)
                    for (int i = 0; i < 8; i++)
                        a[i] = _mm512_fmadd_ps(_mm512_load_ps(qt + (c + i) * 16), _mm512_set1_ps(ka[c + i]), a[i]);
                SCORE(PARTIALS_SUM(a), j);
            }
#undef SCORE
#undef PARTIALS_SUM
            const __m512 zero = _mm512_setzero_ps();
            __m512 sum = zero;
            for (int64_t j = 0; j < Lt; j++) {
                const __m512 w = exp16(_mm512_sub_ps(_mm512_load_ps(e + 16 * j), mx));
                _mm512_store_ps(e + 16 * j, w);
                sum = _mm512_add_ps(sum, w);
                const __mmask16 live = _mm512_cmp_ps_mask(w, zero, _CMP_NEQ_UQ);
                weighs[j] = live == 0 ? 0 : live == 0xFFFF ? 1 : 2;
            }
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
                __m512 c[16];
                for (int i = 0; i < 16; i++) c[i] = zero;
                for (int64_t j = 0; j < Lt; j++) {
                    const int how = weighs[j];
                    if (!how) continue;
                    const __m512 w = _mm512_load_ps(e + 16 * j);
                    const float *vj = V + j * D + d0;
                    _mm_prefetch((const char *)(vj + 8 * D), _MM_HINT_T0);
                    if (how == 1) {
                        for (int i = 0; i < 16; i++) c[i] = _mm512_fmadd_ps(w, _mm512_set1_ps(vj[i]), c[i]);
                    } else {
                        const __mmask16 live = _mm512_cmp_ps_mask(w, zero, _CMP_NEQ_UQ);
                        for (int i = 0; i < 16; i++) c[i] = _mm512_mask3_fmadd_ps(w, _mm512_set1_ps(vj[i]), c[i], live);
                    }
                }
                _Alignas(64) float o[16][16];
                for (int i = 0; i < 16; i++) _mm512_store_ps(o[i], _mm512_div_ps(c[i], sum));
                for (int l = 0; l < n; l++)
                    for (int i = 0; i < 16; i++) out[at[l] + d0 + i] = o[i][l];
            }
        }
        free(e);
        free(qt);
        free(weighs);
    }
    free(live);
    return failed ? -1 : 0;
}
#endif

/* from how many query vectors per key / value head (rows x heads sharing it) attention_lanes runs, where
   the CPU has AVX-512; `n` > 0 sets it (tests: 1 and a huge number compare the two), else it is kept;
   returns the one in use (0: attention_lanes is not built or this CPU lacks AVX-512) */
static int lanes_from = 12;
int mcsd_attention_lanes(int n) {
#if HAVE_AVX512VNNI
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("avx512vl"))
        return 0;
    if (n > 0) lanes_from = n;
    return lanes_from;
#else
    (void)n;
    return 0;
#endif
}

/* whether a block of Q rows runs on attention_lanes (else attention_rows) */
static int on_lanes(int64_t Q, int64_t H, int64_t Hkv, int64_t D) {
#if HAVE_AVX512VNNI
    static int avx512 = -1;
    if (avx512 < 0) avx512 = mcsd_attention_lanes(0) > 0;
    return avx512 && D % 16 == 0 && Q * (H / Hkv) >= lanes_from;
#else
    (void)Q, (void)H, (void)Hkv, (void)D;
    return 0;
#endif
}

int mcsd_attention(const float *q, const float *keys, const float *values, int64_t cap, int64_t L,
                    const float *mask, int64_t mask_stride, int64_t Q, int64_t H, int64_t Hkv, int64_t D,
                    float scale, float *out, int threads) {
#if HAVE_AVX512VNNI
    if (on_lanes(Q, H, Hkv, D))
        return attention_lanes(q, keys, values, cap, L, mask, mask_stride, Q, H, Hkv, D, scale, out, threads);
#endif
    const int64_t first[2] = {0, Q}, at[1] = {0};
    return attention_rows(q, keys, values, cap, 0, 1, first, at, &L, mask, mask_stride, H, Hkv, D, scale, out,
                          threads);
}

/* ---- one decoder layer of a Llama-family model on Q4_1 weights, in one call ---- */

/* a Q4_1 weight (N, K) (or, q8 = 1, a Q8_0 one: m NULL; on 8-bit activations with w128, 128 x each
   block's sum of codes, as mcsd_q8q8_mm reads it) and its optional bias (N,) */
typedef struct {
    const void *codes;
    const float *d, *m, *bias;
    int64_t n, k;
    const int32_t *w128;
    int q8;
} mcsd_q4w;

/* a layer's weights: q / k / v joined (rows q, then k, then v), gate and up joined (gate rows first).
   q_norm and k_norm (Qwen3's per-head norms) are NULL where the model has none. */
typedef struct {
    const float *norm, *post_norm, *q_norm, *k_norm;
    float eps, post_eps, qk_eps, scale;
    mcsd_q4w qkv, o, gate_up, down;
    int64_t heads, kv_heads, head_dim;
    int act8;                                 /* 1: the products on 8-bit activations (mm8), else float32 */
} mcsd_layer_t;

static int product(const float *x, int64_t M, const mcsd_q4w *w, int act8, float *out, int threads) {
    if (act8 ? mm8(x, M, w->k, w->codes, w->d, w->m, w->w128, w->n, out, threads, w->q8)
             : mm(x, M, w->k, w->codes, w->d, w->m, w->n, out, threads, w->q8)) return -1;
    if (w->bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < w->n; j++) out[r * w->n + j] += w->bias[j];
    return 0;
}

/* one head's vector rotated as transformers rotates it: t * cos + rotate_half(t) * sin, with the
   sign of rotate_half already in `sin` (so rotate_half(t) is t rolled by D / 2) */
static inline void rotate(const float *t, const float *cos, const float *sin, int64_t D, float *out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) {
        const float a = t[i] * cos[i], b = t[i < half ? i + half : i - half] * sin[i];
        out[i] = a + b;
    }
}

/* h_out = the layer applied to h_in, Q rows of C = qkv.k floats (h_out may be h_in), the rows of
   n_seg sequences one after another (a batch of slots; one sequence: n_seg = 1):

     x = norm(h);  q, k, v = x Wqkv (+ bias);  (q_norm, k_norm per head);  rotary on q and k;
     k, v written to their sequence's cache at slots;  a = attention(q, that cache[0 .. len), mask);
     h = h + a Wo;  x = post_norm(h);  g, u = x Wgate_up;  h = h + (silu(g) * u) Wdown

   Sequence i holds rows first[i] .. first[i + 1] - 1; its cache's keys and values (Hkv, cap, D) start
   at keys + cache[i] * cache_stride (values likewise), its rows attend over their first lens[i] entries.
   cos and sin (Q, D), sin signed as `rotate` takes it; slots (Q,) each row's cache entry in its own
   sequence's cache; mask (Q, >= max lens) with row stride mask_stride, row r's first lens[i] entries
   used. Every step computes a row on its own in a fixed order (the products, norms and attention
   above), so a row's result does not depend on the rows beside it, its own sequence's or another's.
   Returns 0, or -1 where memory could not be allocated (h_out is then incomplete). */
int mcsd_layer_slots(const mcsd_layer_t *L, const float *h_in, float *h_out, int64_t Q, const float *cos,
                     const float *sin, float *keys, float *values, int64_t cap, int64_t cache_stride,
                     int64_t n_seg, const int64_t *first, const int64_t *cache, const int64_t *slots,
                     const int64_t *lens, const float *mask, int64_t mask_stride, int threads) {
    const int64_t C = L->qkv.k, H = L->heads, Hkv = L->kv_heads, D = L->head_dim, F = L->down.k;
    const int64_t Nqkv = L->qkv.n, HD = H * D;
    float *buf = malloc(sizeof(float) * (size_t)(Q * (C + Nqkv + 2 * HD + C + 2 * F + F)));
    if (!buf) return -1;
    float *x = buf, *qkv = x + Q * C, *qr = qkv + Q * Nqkv, *att = qr + Q * HD, *y = att + Q * HD,
          *gu = y + Q * C, *act = gu + Q * 2 * F;
    int failed = 0;
    mcsd_rms_norm(h_in, Q, C, L->norm, L->eps, x);
    failed |= product(x, Q, &L->qkv, L->act8, qkv, threads);
    for (int64_t i = 0; i < n_seg && !failed; i++)
    for (int64_t r = first[i]; r < first[i + 1]; r++) {
        float *row = qkv + r * Nqkv;
        float *ks = keys + cache[i] * cache_stride, *vs = values + cache[i] * cache_stride;
        const float *c = cos + r * D, *s = sin + r * D;
        if (L->q_norm) {
            mcsd_rms_norm(row, H, D, L->q_norm, L->qk_eps, row);
            mcsd_rms_norm(row + HD, Hkv, D, L->k_norm, L->qk_eps, row + HD);
        }
        for (int64_t h = 0; h < H; h++) rotate(row + h * D, c, s, D, qr + r * HD + h * D);
        for (int64_t h = 0; h < Hkv; h++) {
            float *kd = ks + (h * cap + slots[r]) * D, *vd = vs + (h * cap + slots[r]) * D;
            rotate(row + HD + h * D, c, s, D, kd);
            const float *v = row + HD + Hkv * D + h * D;
            for (int64_t i = 0; i < D; i++) vd[i] = v[i];
        }
    }
    int lanes = 0;                       /* a sequence's rows on attention_lanes: each sequence on its own */
    for (int64_t i = 0; i < n_seg; i++) lanes |= on_lanes(first[i + 1] - first[i], H, Hkv, D);
    if (!failed && !lanes)               /* every sequence's vectors in one parallel region */
        failed |= attention_rows(qr, keys, values, cap, cache_stride, n_seg, first, cache, lens, mask, mask_stride,
                                 H, Hkv, D, L->scale, att, threads);
    else
        for (int64_t i = 0; i < n_seg && !failed; i++)
            failed |= mcsd_attention(qr + first[i] * HD, keys + cache[i] * cache_stride, values + cache[i] * cache_stride,
                           cap, lens[i], mask + first[i] * mask_stride, mask_stride, first[i + 1] - first[i], H,
                           Hkv, D, L->scale, att + first[i] * HD, threads);
    if (!failed) failed |= product(att, Q, &L->o, L->act8, y, threads);
    if (!failed) {
        for (int64_t i = 0; i < Q * C; i++) h_out[i] = h_in[i] + y[i];
        mcsd_rms_norm(h_out, Q, C, L->post_norm, L->post_eps, x);
        failed |= product(x, Q, &L->gate_up, L->act8, gu, threads);
    }
    if (!failed) {
        /* silu(g) * u, silu(g) = g / (1 + exp(-g)) as torch computes it, 8 at a time */
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (int64_t r = 0; r < Q; r++) {
            const float *g = gu + r * 2 * F, *u = g + F;
            float *a = act + r * F;
            for (int64_t j = 0; j < F; j += 8) {
                const __m256 gv = _mm256_loadu_ps(g + j);
                const __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
                _mm256_storeu_ps(a + j, _mm256_mul_ps(sv, _mm256_loadu_ps(u + j)));
            }
        }
        failed |= product(act, Q, &L->down, L->act8, y, threads);
    }
    if (!failed)
        for (int64_t i = 0; i < Q * C; i++) h_out[i] += y[i];
    free(buf);
    return failed ? -1 : 0;
}

/* Every decoder layer of a model in one call, over the rows of n_seg sequences (as `mcsd_layer_slots`
   takes them): layers[0 .. n_layers) applied in turn to Q rows h_in (C = layers[0].qkv.k floats each),
   the result in h_out (which may be h_in), each layer as `mcsd_layer_slots` computes it. Layer i's
   caches start at keys + i * layer_stride (values likewise: a cache's one buffer for every layer),
   sequence j's at cache[j] * cache_stride beyond. The rows after layer keep[j] (1-based: after the first
   layer is 1; each below n_layers) are copied to kept[j], row r at kept[j] + r * kept_stride (a column
   block of a wider buffer, where the caller joins them), for the n_keep layers asked. One call instead
   of one per layer saves a forward the interpreter's work between layers (about 50 us a layer on a
   2-core Xeon). Returns 0, or -1 where memory could not be allocated (h_out is then incomplete). */
int mcsd_layers_slots(const mcsd_layer_t *layers, int64_t n_layers, const float *h_in, float *h_out, int64_t Q,
                      const float *cos, const float *sin, float *keys, float *values, int64_t layer_stride,
                      int64_t cap, int64_t cache_stride, int64_t n_seg, const int64_t *first, const int64_t *cache,
                      const int64_t *slots, const int64_t *lens, const float *mask, int64_t mask_stride,
                      const int64_t *keep, int64_t n_keep, float *const *kept, int64_t kept_stride, int threads) {
    const int64_t C = n_layers > 0 ? layers[0].qkv.k : 0;
    for (int64_t i = 0; i < n_layers; i++) {
        if (mcsd_layer_slots(&layers[i], i == 0 ? h_in : h_out, h_out, Q, cos, sin, keys + i * layer_stride,
                             values + i * layer_stride, cap, cache_stride, n_seg, first, cache, slots, lens, mask,
                             mask_stride, threads))
            return -1;
        for (int64_t j = 0; j < n_keep; j++)
            if (keep[j] == i + 1)
                for (int64_t r = 0; r < Q; r++)
                    memcpy(kept[j] + r * kept_stride, h_out + r * C, sizeof(float) * (size_t)C);
    }
    if (n_layers == 0 && h_out != h_in) memcpy(h_out, h_in, sizeof(float) * (size_t)(Q * C));
    return 0;
}

/* One sequence's layers (`mcsd_layers_slots` with one sequence): layer i's keys and values (Hkv, cap, D)
   at keys + i * layer_stride, its Q rows written at slots and attending over the first len entries
   under mask (Q, len). */
int mcsd_layers(const mcsd_layer_t *layers, int64_t n_layers, const float *h_in, float *h_out, int64_t Q,
                const float *cos, const float *sin, float *keys, float *values, int64_t layer_stride,
                int64_t cap, const int64_t *slots, int64_t len, const float *mask, int64_t mask_stride,
                const int64_t *keep, int64_t n_keep, float *const *kept, int64_t kept_stride, int threads) {
    const int64_t first[2] = {0, Q}, cache[1] = {0}, lens[1] = {len};
    return mcsd_layers_slots(layers, n_layers, h_in, h_out, Q, cos, sin, keys, values, layer_stride, cap, 0, 1,
                             first, cache, slots, lens, mask, mask_stride, keep, n_keep, kept, kept_stride,
                             threads);
}

/* Nucleus (top-p) filtering of R rows of V float32 scores (-inf allowed): out[r, i] = s[r, i] where
   token i is kept, -inf elsewhere. A token is kept when the probability of the tokens ranked above it
   (by score, then by lower index) is below `mass`; the top token always stays.

   Per row: the maximum; the exponentials below it (exp8) into a scratch row, summed in double; a
   histogram of their mass by bins 1/8 nat wide below the maximum. A token of a lower bin ranks below
   every token of a higher one, so every token of the bins above the one where the mass crosses is
   kept, and only the tokens of that bin and the next (for rounding; where even they fall short, of
   every lower bin) are sorted and walked down, their mass added in double after the mass above.
   Rows are independent, one thread each. Returns 0, or -1 where scratch memory could not be had. */
#define TP_BINS 512
#define TP_SCALE 8.0f

typedef struct { float s; int32_t i; } tp_cand;

static int tp_order(const void *a, const void *b) {
    const tp_cand *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

/* cand[0 .. n) in tp_order's order (score down, then index up), tmp room for n more: an LSD radix sort
   on the scores' bits, four stable passes of a byte, which keeps tp_order's order for equal scores
   (their order as given: the candidates come in index order, or a sorted run then lower-scored ones
   in index order), -0 counted as 0 as tp_order counts it. A nucleus of thousands of candidates (a
   flat row at T 1) sorts in a few passes over them rather than in thousands of comparisons; few
   candidates go to qsort. Each score is turned into its key once, in place, for the passes, and back
   after them (a -0 comes back as 0: callers read a kept token's score from the row, by its index). */
static inline uint32_t tp_key(float s) {
    uint32_t u;
    if (s == 0.0f) s = 0.0f;                            /* -0 ranks as 0 */
    memcpy(&u, &s, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);     /* ascending as the floats */
    return ~u;                                          /* descending */
}

static inline float tp_unkey(uint32_t k) {
    uint32_t u = ~k;
    u = (u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u;
    float s;
    memcpy(&s, &u, sizeof s);
    return s;
}

static void tp_sort(tp_cand *cand, int64_t n, tp_cand *tmp) {
    if (n < 256) {
        qsort(cand, (size_t)n, sizeof(tp_cand), tp_order);
        return;
    }
    uint32_t k;
    for (int64_t j = 0; j < n; j++) {
        k = tp_key(cand[j].s);
        memcpy(&cand[j].s, &k, sizeof k);
    }
    tp_cand *from = cand, *to = tmp;
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t j = 0; j < n; j++) {
            memcpy(&k, &from[j].s, sizeof k);
            count[((k >> shift) & 0xFF) + 1]++;
        }
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (int64_t j = 0; j < n; j++) {
            memcpy(&k, &from[j].s, sizeof k);
            to[count[(k >> shift) & 0xFF]++] = from[j];
        }
        tp_cand *t = from;
        from = to;
        to = t;
    }
    for (int64_t j = 0; j < n; j++) {                   /* four passes: the result is back in cand */
        memcpy(&k, &cand[j].s, sizeof k);
        cand[j].s = tp_unkey(k);
    }
}

static inline int tp_bin(float mx, float s) {
    const float depth = (mx - s) * TP_SCALE;
    return depth < (float)(TP_BINS - 1) ? (int)depth : TP_BINS - 1;      /* -inf, nan: the last */
}

/* A row's kept set: every token whose bin is above `crossing` (tp_bin(mx, s[i]) < crossing), and the
   first `kept` of `cand` (room for 2V: the sort's too) once sorted. Fills e with the exponentials
   below the maximum. mx == -INFINITY:
   nothing to rank (every score is -inf). */
typedef struct { float mx; int crossing; int64_t kept; } tp_sel;

/* A row's maximum, and e[i] = exp(s[i] - max) (exp8, the tail through the same polynomial); e is left
   alone where the maximum is -INFINITY. */
static float row_exp(const float *s, int64_t V, float *e) {
    /* the scalar `mx = s[i] > mx ? s[i] : mx` 8 lanes at a time: max_ps returns its second operand (the
       running lane) where the new value is NaN, so a NaN is passed over as the comparison passes it; the
       lanes' maxima are then folded the same way (only the sign of a zero maximum can differ, and no
       caller tells the two zeros apart) */
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= V; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(s + j), mv);
    float lanes[8], mx = -INFINITY;
    _mm256_storeu_ps(lanes, mv);
    for (int l = 0; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
    for (; j < V; j++) mx = s[j] > mx ? s[j] : mx;
    if (mx == -INFINITY) return mx;
    const __m256 mxv = _mm256_set1_ps(mx);
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) _mm256_storeu_ps(e + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mxv)));
    if (i < V) {
        float t[8];
        for (int j = 0; j < 8; j++) t[j] = i + j < V ? s[i + j] - mx : -INFINITY;
        _mm256_storeu_ps(t, exp8(_mm256_loadu_ps(t)));
        for (int j = 0; i + j < V; j++) e[i + j] = t[j];
    }
    return mx;
}

/* bin[i] = tp_bin(mx, s[i]) for a whole row, 8 at a time: the same float product, the same truncation
   of the depths below the last bin, the last bin for the rest (-inf, NaN). */
static void row_bins(const float *s, int64_t V, float mx, uint16_t *bin) {
    const __m256 mxv = _mm256_set1_ps(mx), scale = _mm256_set1_ps(TP_SCALE), top = _mm256_set1_ps((float)(TP_BINS - 1));
    const __m256i last = _mm256_set1_epi32(TP_BINS - 1);
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 depth = _mm256_mul_ps(_mm256_sub_ps(mxv, _mm256_loadu_ps(s + i)), scale);
        const __m256 below = _mm256_cmp_ps(depth, top, _CMP_LT_OQ);
        const __m256i b = _mm256_blendv_epi8(last, _mm256_cvttps_epi32(_mm256_and_ps(depth, below)),
                                             _mm256_castps_si256(below));
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        _mm_storeu_si128((__m128i *)(bin + i), packed);
    }
    for (; i < V; i++) bin[i] = (uint16_t)tp_bin(mx, s[i]);
}

static tp_sel tp_select(const float *s, int64_t V, double mass, float *e, uint16_t *bin, tp_cand *cand) {
    tp_sel sel = { -INFINITY, 0, 0 };
    const float mx = row_exp(s, V, e);
    if (mx == -INFINITY) return sel;
    row_bins(s, V, mx, bin);
    double total = 0.0, bins[TP_BINS] = {0};
    int64_t i;
    for (i = 0; i < V; i++) {
        bins[bin[i]] += e[i];
        total += e[i];
    }
    const double target = mass * total;
    double above = 0.0;                                 /* the mass of the bins above the crossing */
    int crossing = TP_BINS - 1;
    for (int b = 0; b < TP_BINS - 1; b++) {
        if (above + bins[b] >= target) { crossing = b; break; }
        above += bins[b];
    }
    /* the candidates of the crossing bin and the next */
    int last = crossing + 1 < TP_BINS - 1 ? crossing + 1 : TP_BINS - 1;
    int64_t n = 0, kept;
    for (i = 0; i < V; i++) {
        const int b = bin[i];
        if (b >= crossing && b <= last) { cand[n].s = s[i]; cand[n].i = (int32_t)i; n++; }
    }
    for (;;) {
        tp_sort(cand, n, cand + V);
        double before = above;
        kept = 0;
        while (kept < n && before < target) before += e[cand[kept++].i];
        if (kept < n || before >= target || last == TP_BINS - 1) break;
        last = TP_BINS - 1;                             /* rounding left it short: every lower bin too */
        for (i = 0; i < V; i++)
            if (bin[i] > crossing + 1) { cand[n].s = s[i]; cand[n].i = (int32_t)i; n++; }
    }
    sel.mx = mx;
    sel.crossing = crossing;
    sel.kept = kept;
    return sel;
}

static void top_p_row(const float *s, int64_t V, double mass, float *out, float *e, uint16_t *bin,
                      tp_cand *cand) {
    const tp_sel sel = tp_select(s, V, mass, e, bin, cand);
    if (sel.mx == -INFINITY) {                          /* nothing to rank: the row as it is */
        for (int64_t i = 0; i < V; i++) out[i] = s[i];
        return;
    }
    for (int64_t i = 0; i < V; i++) out[i] = bin[i] < sel.crossing ? s[i] : -INFINITY;
    for (int64_t j = 0; j < sel.kept; j++) out[cand[j].i] = s[cand[j].i];
}

/* A thread's scratch rows for the filters and draws, kept while the thread lives and grown as asked (the
   draws run once a token or more: no allocation on that path), freed when it ends. */
typedef struct { float *e, *s; uint16_t *bin; tp_cand *cand; int64_t v; } tp_scratch;
static pthread_key_t tp_scratch_key;
static pthread_once_t tp_scratch_once = PTHREAD_ONCE_INIT;

static void tp_scratch_free(void *p) {
    tp_scratch *t = p;
    free(t->e);
    free(t->s);
    free(t->bin);
    free(t->cand);
    free(t);
}

static void tp_scratch_init(void) { pthread_key_create(&tp_scratch_key, tp_scratch_free); }

static tp_scratch *tp_scratch_for(int64_t V) {
    pthread_once(&tp_scratch_once, tp_scratch_init);
    tp_scratch *t = pthread_getspecific(tp_scratch_key);
    if (!t) {
        t = calloc(1, sizeof *t);
        if (!t || pthread_setspecific(tp_scratch_key, t)) {
            free(t);
            return NULL;
        }
    }
    if (t->v < V) {
        free(t->e);
        free(t->s);
        free(t->bin);
        free(t->cand);
        t->e = malloc((size_t)V * sizeof(float));
        t->s = malloc((size_t)V * sizeof(float));
        t->bin = malloc((size_t)V * sizeof(uint16_t));
        t->cand = malloc((size_t)(2 * V) * sizeof(tp_cand));       /* candidates, then the sort's room */
        t->v = t->e && t->s && t->bin && t->cand ? V : 0;
    }
    return t->v ? t : NULL;
}

int mcsd_top_p(const float *s, int64_t R, int64_t V, float mass, float *out, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|:failed) if(R > 1)
    {
        tp_scratch *t = tp_scratch_for(V);
        failed = !t;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++)
            if (t) top_p_row(s + r * V, V, (double)mass, out + r * V, t->e, t->bin, t->cand);
    }
    return failed ? -1 : 0;
}

/* Position noise: a uniform u in (0, 1) for token i of a sequence position whose 64-bit key is `key`,
   a function of (key, i) alone (splitmix64's finaliser over key + (i + 1) * golden ratio; the top 23
   bits, centred: u = (2h + 1) / 2^24, exact in float32). mcsd/sampling.py computes the same bits in
   torch where this library is not in use. */
static inline float noise_u(uint64_t key, int64_t i) {
    uint64_t z = key + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (float)(2 * (z >> 41) + 1) * 0x1p-24f;
}

/* log of 8 positive, finite floats: Cephes' logf polynomial after splitting off the exponent (relative
   error about 1e-7, as logf's). */
static inline __m256 log8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256i xi = _mm256_castps_si256(x);
    const __m256i ex = _mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(0x7f));
    xi = _mm256_or_si256(_mm256_and_si256(xi, _mm256_set1_epi32(0x807FFFFF)), _mm256_castps_si256(_mm256_set1_ps(0.5f)));
    x = _mm256_castsi256_ps(xi);                                        /* the mantissa, in [0.5, 1) */
    __m256 e = _mm256_add_ps(_mm256_cvtepi32_ps(ex), one);
    const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    const __m256 t = _mm256_and_ps(x, small);
    x = _mm256_sub_ps(x, one);
    e = _mm256_sub_ps(e, _mm256_and_ps(one, small));
    x = _mm256_add_ps(x, t);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(7.0376836292e-2f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.1514610310e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.1676998740e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.2420140846e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.4249322787e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.6668057665e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(2.0000714765e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-2.4999993993e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(3.3333331174e-1f));
    y = _mm256_mul_ps(_mm256_mul_ps(y, x), z);
    y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
    return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(x, y));
}

/* Standard Gumbel noise -log(-log u): out[r, k] for position key keys[r] and token ids[r * stride + k]
   (stride 0: the same K tokens for every key; 1 with K = 1: R (key, token) pairs). The hashes one at a
   time, then the logarithms 8 at a time over the whole block (lane by lane, so a token's noise does not
   depend on the tokens beside it). */
/* u[0..m) (m <= 8) uniforms -> their Gumbel noise -log(-log u), in place: the logarithms 8 lanes at a
   time (the unused lanes at 0.5), so every caller makes the same float for the same uniform. */
static void gumbel_lanes(float *u, int m) {
    const __m256 zero = _mm256_setzero_ps();
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = i < m ? u[i] : 0.5f;
    _mm256_storeu_ps(t, _mm256_sub_ps(zero, log8(_mm256_sub_ps(zero, log8(_mm256_loadu_ps(t))))));
    for (int i = 0; i < m; i++) u[i] = t[i];
}

void mcsd_gumbel(const uint64_t *keys, int64_t R, const int64_t *ids, int64_t K, int64_t stride, float *out) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < K; k++) out[r * K + k] = noise_u(keys[r], ids[r * stride + k]);
    const int64_t n = R * K;
    for (int64_t j = 0; j < n; j += 8) gumbel_lanes(out + j, n - j < 8 ? (int)(n - j) : 8);
}

/* Gumbel keys over the finite entries of R rows of scores s (R, K): out[r, c] = s[r, c] + g(keys[r],
   ids[c]) where s[r, c] is finite (ids NULL: the token is c), else -inf; g is `mcsd_gumbel`'s noise
   for that (key, token), the same float (`gumbel_lanes`, as there). A draft's nucleus keeps a few dozen
   of its 8,192 entries: noise for those alone, in one pass. */
static void keyed_lanes(float *dst, const float *row, const int64_t *at, float *u, int m) {
    gumbel_lanes(u, m);                                         /* u[i]: the noise of entry at[i] */
    for (int i = 0; i < m; i++) dst[at[i]] = row[at[i]] + u[i];
}

void mcsd_keys(const float *s, int64_t R, int64_t K, const int64_t *ids, const uint64_t *keys, float *out) {
    for (int64_t r = 0; r < R; r++) {
        const float *row = s + r * K;
        float *dst = out + r * K;
        int64_t at[8];
        float g[8];
        int m = 0;
        for (int64_t c = 0; c < K; c++) {
            const float v = row[c];
            dst[c] = -INFINITY;
            if (v - v != 0.0f) continue;                        /* -inf, inf, NaN: not a candidate */
            at[m] = c;
            g[m++] = noise_u(keys[r], ids ? ids[c] : c);
            if (m == 8) {
                keyed_lanes(dst, row, at, g, m);
                m = 0;
            }
        }
        if (m) keyed_lanes(dst, row, at, g, m);
    }
}

/* One Gumbel-max draw from a row of scaled scores x (the temperature applied; -inf where a processor
   dropped a token) after nucleus filtering with `mass` (none when mass >= 1), under the row's position
   key: the kept token i with the largest x[i] + g[i], g[i] = -log(-log u(key, i)). Made as the smallest
   E[i] / e[i], E[i] = -log u(key, i) and e[i] = exp(x[i] - max) (the same order up to rounding), which
   needs noise only for the kept tokens, and for those only where the bound E >= 1 - u leaves them a
   chance: a draw costs about a filter's passes, not a noise row. Ties go to the lower index. */
static int64_t draw_row(const float *x, int64_t V, double mass, uint64_t key, float *e, uint16_t *bin,
                        tp_cand *cand) {
    tp_sel sel;
    if (mass < 1.0) {
        sel = tp_select(x, V, mass, e, bin, cand);
    } else {                                            /* every token with a finite score is kept */
        sel.mx = row_exp(x, V, e);
        sel.crossing = TP_BINS;
        sel.kept = 0;
    }
    if (sel.mx == -INFINITY) return 0;                  /* nothing to draw from: the first token */
    int64_t best = 0;
    while (x[best] != sel.mx) best++;                   /* the top token: always kept */
    float best_r = -logf(noise_u(key, best)) / e[best];
    for (int64_t t = 0; t < V + sel.kept; t++) {
        const int64_t i = t < V ? t : cand[t - V].i;
        if (t < V && sel.crossing < TP_BINS && bin[i] >= sel.crossing) continue;
        if (e[i] <= 0.0f) continue;
        const float u = noise_u(key, i);
        if ((1.0f - u) * 0.999f > best_r * e[i]) continue;     /* -log u >= 1 - u: it cannot win */
        const float r = -logf(u) / e[i];
        if (r < best_r || (r == best_r && i < best)) { best_r = r; best = i; }
    }
    return best;
}

/* A row of raw logits x as sampling scales it: s[i] = (x[i] - max) / t in float32, the same values as
   torch's (x - x.amax()) / t (true division; a NaN anywhere makes every entry NaN, as amax's does). */
static void scale_row(const float *x, int64_t V, float t, float *s) {
    __m256 mv = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        mv = _mm256_max_ps(mv, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], flags[8], mx = -INFINITY;
    int any_nan = 0;
    _mm256_storeu_ps(lanes, mv);
    _mm256_storeu_ps(flags, nan);
    for (int j = 0; j < 8; j++) {
        mx = lanes[j] > mx ? lanes[j] : mx;
        any_nan |= flags[j] != 0.0f;
    }
    for (; i < V; i++) {
        mx = x[i] > mx ? x[i] : mx;
        any_nan |= x[i] != x[i];
    }
    if (any_nan) mx = NAN;
    const __m256 mxv = _mm256_set1_ps(mx), tv = _mm256_set1_ps(t);
    for (i = 0; i + 8 <= V; i += 8) _mm256_storeu_ps(s + i, _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mxv), tv));
    for (; i < V; i++) s[i] = (x[i] - mx) / t;
}

/* Gumbel-max draws from raw float32 logits x (R, V): row r scaled by the temperature t (`scale_row`),
   then `draw_row` under keys[r]. Returns 0, or -1 where scratch memory could not be had. */
int mcsd_draw(const float *x, int64_t R, int64_t V, float t, float mass, const uint64_t *keys, int64_t *out,
              int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|:failed) if(R > 1)
    {
        tp_scratch *sc = tp_scratch_for(V);
        failed = !sc;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++)
            if (sc) {
                scale_row(x + r * V, V, t, sc->s);
                out[r] = draw_row(sc->s, V, (double)mass, keys[r], sc->e, sc->bin, sc->cand);
            }
    }
    return failed ? -1 : 0;
}

/* The indices of a row's k largest scores, largest first (k <= 64): ties go to the lower index, a NaN
   ranks above every number (the first NaN first). A block of eight floats is looked at only where one
   of them beats the k-th kept (or is NaN); most blocks of a vocabulary's row are passed over with one
   comparison. Greedy's token (k = 1: torch.argmax's index) and context drafting's recycled predictions
   read it: torch's argmax took 74 us a 49,152-token row, its topk 100-250 us. */
static inline int tk_above(float a, float b) { return (a != a) ? (b == b) : a > b; }

static void topk_row(const float *x, int64_t V, int k, int64_t *out) {
    float val[64];
    int64_t idx[64];
    int n = 0;
    float bar = -INFINITY;                              /* the k-th kept, once k are kept */
    for (int64_t i0 = 0; i0 < V; i0 += 8) {
        const int64_t end = i0 + 8 < V ? i0 + 8 : V;
        if (n == k && end - i0 == 8) {
            const __m256 v = _mm256_loadu_ps(x + i0);
            if (!_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(bar), _CMP_NLE_UQ))) continue;
        }
        for (int64_t i = i0; i < end; i++) {
            const float v = x[i];
            if (n == k && !tk_above(v, val[k - 1])) continue;
            int p = n < k ? n++ : k - 1;                /* the new last place, then moved up */
            while (p > 0 && tk_above(v, val[p - 1])) {
                val[p] = val[p - 1];
                idx[p] = idx[p - 1];
                p--;
            }
            val[p] = v;
            idx[p] = i;
            if (n == k) bar = val[k - 1] != val[k - 1] ? NAN : val[k - 1];
        }
    }
    for (int j = 0; j < n; j++) out[j] = idx[j];
    for (int j = n; j < k; j++) out[j] = -1;
}

void mcsd_topk(const float *x, int64_t R, int64_t V, int k, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if(R > 2)
    for (int64_t r = 0; r < R; r++) topk_row(x + r * V, V, k, out + r * k);
}
