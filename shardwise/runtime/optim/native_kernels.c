/* One-pass CPU kernels for optimizer steps (optim/native.py builds and loads them).

   Written in torch operations, an optimizer step makes one pass over memory per operation;
   these loops make one (or, where a norm must be known first, two), reading and writing
   each array once, as torch's fused AdamW does. Every loop repeats the arithmetic of the
   optimizer's torch path operation for operation, with fused multiply-adds exactly where
   torch's CPU kernels use them (add with alpha, lerp), so the two paths agree bit for bit
   except in the squared norms, which are summed here in double precision.

   Built with -ffp-contract=off: the compiler must not fuse what torch does not. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX512_PATH 1
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX512_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))
#endif

#define PARALLEL_MIN 65536 /* elements below which a loop runs on one thread */

/* torch's lerp(self, end, weight) for a scalar weight */
static inline float lerp(float self, float end, float weight) {
    return fabsf(weight) < 0.5f ? fmaf(weight, end - self, self) : fmaf(-(end - self), 1.0f - weight, end);
}

static inline float adam_direction(float param, float exp_avg, float exp_avg_sq, float eps, float weight_decay,
                                   int eps_inside_sqrt) {
    float denominator = eps_inside_sqrt ? sqrtf(exp_avg_sq + eps) : sqrtf(exp_avg_sq) + eps;
    float update = exp_avg / denominator;
    return weight_decay != 0.0f ? fmaf(param, weight_decay, update) : update;
}

/* Scalars derived in double precision (1 - beta1, ...) are the caller's, rounded once to
   float as torch rounds them: computed here in float they would differ in the last bit.

   Each kernel is a loop over one chunk (vectorised: `restrict`, no branch on data) called
   for every chunk of a tensor by an OpenMP loop over chunks; an OpenMP loop around the
   element loop itself is not vectorised by GCC. */

#define CHUNK 16384
#define CHUNKS(n) (((n) + CHUNK - 1) / CHUNK)
#define CHUNK_LENGTH(n, c) ((n) - (c) * CHUNK < CHUNK ? (n) - (c) * CHUNK : CHUNK)

/* LAMB, pass 1 (weight = 1 - beta1, value = 1 - beta2): moments advanced in place;
   squares[0] += sum w^2, squares[1] += sum u^2 with u Adam's direction (not stored: pass 2
   computes it again). */
static void lamb_moments_and_squares_chunk(const float *restrict param, const float *restrict grad,
                                           float *restrict exp_avg, float *restrict exp_avg_sq, int64_t n,
                                           float weight, float beta2, float value, float eps, float weight_decay,
                                           int eps_inside_sqrt, double *squares) {
    double weight_square = 0.0, update_square = 0.0;
#pragma omp simd reduction(+ : weight_square, update_square)
    for (int64_t i = 0; i < n; i++) {
        float g = grad[i];
        float m = lerp(exp_avg[i], g, weight);
        float v = fmaf(value * g, g, exp_avg_sq[i] * beta2);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        float u = adam_direction(param[i], m, v, eps, weight_decay, eps_inside_sqrt);
        weight_square += (double)param[i] * param[i];
        update_square += (double)u * u;
    }
    squares[0] = weight_square;
    squares[1] = update_square;
}

void lamb_moments_and_squares(const float *param, const float *grad, float *exp_avg, float *exp_avg_sq, int64_t n,
                              float weight, float beta2, float value, float eps, float weight_decay,
                              int eps_inside_sqrt, double *squares, int threads) {
    double weight_square = 0.0, update_square = 0.0;
#pragma omp parallel for reduction(+ : weight_square, update_square) num_threads(threads) if (n >= PARALLEL_MIN)
    for (int64_t c = 0; c < CHUNKS(n); c++) {
        double chunk[2];
        lamb_moments_and_squares_chunk(param + c * CHUNK, grad + c * CHUNK, exp_avg + c * CHUNK,
                                       exp_avg_sq + c * CHUNK, CHUNK_LENGTH(n, c), weight, beta2, value, eps,
                                       weight_decay, eps_inside_sqrt, chunk);
        weight_square += chunk[0];
        update_square += chunk[1];
    }
    squares[0] += weight_square;
    squares[1] += update_square;
}

/* LAMB, pass 2: w += scale u (scale = -step size x trust ratio). */
static void lamb_apply_chunk(float *restrict param, const float *restrict exp_avg, const float *restrict exp_avg_sq,
                             int64_t n, float scale, float eps, float weight_decay, int eps_inside_sqrt) {
    for (int64_t i = 0; i < n; i++) {
        float u = adam_direction(param[i], exp_avg[i], exp_avg_sq[i], eps, weight_decay, eps_inside_sqrt);
        param[i] += u * scale;
    }
}

void lamb_apply(float *param, const float *exp_avg, const float *exp_avg_sq, int64_t n, float scale, float eps,
                float weight_decay, int eps_inside_sqrt, int threads) {
#pragma omp parallel for num_threads(threads) if (n >= PARALLEL_MIN)
    for (int64_t c = 0; c < CHUNKS(n); c++)
        lamb_apply_chunk(param + c * CHUNK, exp_avg + c * CHUNK, exp_avg_sq + c * CHUNK, CHUNK_LENGTH(n, c), scale,
                         eps, weight_decay, eps_inside_sqrt);
}

/* squares[0] += sum a^2, squares[1] += sum b^2 (LARS's weight and gradient norms). */
static void two_squares_chunk(const float *restrict a, const float *restrict b, int64_t n, double *squares) {
    double sa = 0.0, sb = 0.0;
#pragma omp simd reduction(+ : sa, sb)
    for (int64_t i = 0; i < n; i++) {
        sa += (double)a[i] * a[i];
        sb += (double)b[i] * b[i];
    }
    squares[0] = sa;
    squares[1] = sb;
}

void two_squares(const float *a, const float *b, int64_t n, double *squares, int threads) {
    double sa = 0.0, sb = 0.0;
#pragma omp parallel for reduction(+ : sa, sb) num_threads(threads) if (n >= PARALLEL_MIN)
    for (int64_t c = 0; c < CHUNKS(n); c++) {
        double chunk[2];
        two_squares_chunk(a + c * CHUNK, b + c * CHUNK, CHUNK_LENGTH(n, c), chunk);
        sa += chunk[0];
        sb += chunk[1];
    }
    squares[0] += sa;
    squares[1] += sb;
}

/* LARS after its norms: d = (g + wd w) ratio; buffer = d at the first step (`started` 0),
   else momentum buffer + undamped d (undamped = 1 - dampening); w -= lr (d + momentum
   buffer if nesterov else buffer). Without momentum (`buffer` NULL): w -= lr d. */
static void lars_apply_chunk(float *restrict param, const float *restrict grad, float *restrict buffer, int64_t n,
                             float weight_decay, float ratio, float momentum, float undamped, int nesterov,
                             int started, float lr) {
    if (buffer == NULL) {
        for (int64_t i = 0; i < n; i++)
            param[i] = fmaf(fmaf(param[i], weight_decay, grad[i]) * ratio, -lr, param[i]);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        float d = fmaf(param[i], weight_decay, grad[i]) * ratio;
        float b = started ? fmaf(d, undamped, buffer[i] * momentum) : d;
        buffer[i] = b;
        param[i] = fmaf(nesterov ? fmaf(b, momentum, d) : b, -lr, param[i]);
    }
}

void lars_apply(float *param, const float *grad, float *buffer, int64_t n, float weight_decay, float ratio,
                float momentum, float undamped, int nesterov, int started, float lr, int threads) {
#pragma omp parallel for num_threads(threads) if (n >= PARALLEL_MIN)
    for (int64_t c = 0; c < CHUNKS(n); c++)
        lars_apply_chunk(param + c * CHUNK, grad + c * CHUNK, buffer == NULL ? NULL : buffer + c * CHUNK,
                         CHUNK_LENGTH(n, c), weight_decay, ratio, momentum, undamped, nesterov, started, lr);
}

#define BLOCK 256
#define CELL_SHIFT 15
#define CELL_MASK ((1u << (32 - CELL_SHIFT)) - 1)
#define LOW_MASK ((1u << CELL_SHIFT) - 1)
#define TINY_SCALE 1e-38f

/* Dynamic-code rounding (optim/quantization.py's table lookup, one lookup here): the code
   nearest to x is below + (x > the cell's midpoint), the cell being x's sign, exponent and
   top 8 mantissa bits. The midpoint lies inside the cell, so "x above it" is a comparison
   of x's 15 remaining bits with its: for x >= 0, low > its low bits; for x < 0 the order
   is reversed, and low ^ 0x7FFF puts it right. optim/adam8bit.py packs, per cell,
   below | threshold << 8 with threshold the least such key that is above (0x8000: none). */
static void quantize_values_portable(const float *restrict values, uint8_t *restrict codes, int64_t count,
                                     float absmax, const uint32_t *restrict table) {
    const float inverse = 1.0f / (absmax < TINY_SCALE ? TINY_SCALE : absmax); /* NaN stays NaN, as in torch */
    for (int64_t j = 0; j < count; j++) {
        union {
            float f;
            uint32_t u;
        } scaled = {values[j] * inverse};
        uint32_t entry = table[(scaled.u >> CELL_SHIFT) & CELL_MASK];
        uint32_t key = (scaled.u & LOW_MASK) ^ ((scaled.u >> 31) * LOW_MASK);
        codes[j] = (uint8_t)((entry & 0xFF) + (key >= (entry >> 8)));
    }
}

#ifdef HAVE_AVX512_PATH
/* Whether the 8-bit kernels take their AVX-512 blocks, and whether these decode codes by
   byte permutes (AVX-512 VBMI) rather than gathers: decided once per process from the CPU
   (`__builtin_cpu_supports`), and switchable off (`use_avx512`, `use_avx512_vbmi`) so that
   tests can compare the paths on one machine. The portable loops stay for other CPUs. */
static int avx512_enabled = 0, vbmi_enabled = 0;

__attribute__((constructor)) static void detect_avx512(void) {
    __builtin_cpu_init();
    avx512_enabled = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    vbmi_enabled = avx512_enabled && __builtin_cpu_supports("avx512vbmi");
}

/* Turns the AVX-512 blocks on (where the CPU has them) or off; returns whether they are on.
   Turning them on also turns the VBMI decode on where the CPU has it. */
int use_avx512(int enable) {
    detect_avx512();
    avx512_enabled = avx512_enabled && enable;
    vbmi_enabled = vbmi_enabled && enable;
    return avx512_enabled;
}

/* Turns the AVX-512 blocks' VBMI decode on (where the CPU has it) or off (gathers); returns
   whether it is on. */
int use_avx512_vbmi(int enable) {
    __builtin_cpu_init();
    vbmi_enabled = avx512_enabled && __builtin_cpu_supports("avx512vbmi") && enable;
    return vbmi_enabled;
}

/* Loads and stores of 16 lanes, whole where `lanes` is all of them: with every access
   masked, the block loop took twice as long on Zen 4 (profiled: the time sat on the
   masked loads), so only a block's last partial vector is masked. */
AVX512 static inline __attribute__((always_inline)) __m512 load_lanes(const float *from, __mmask16 lanes) {
    return lanes == 0xFFFF ? _mm512_loadu_ps(from) : _mm512_maskz_loadu_ps(lanes, from);
}

AVX512 static inline __attribute__((always_inline)) void store_lanes(float *to, __mmask16 lanes, __m512 values) {
    if (lanes == 0xFFFF)
        _mm512_storeu_ps(to, values);
    else
        _mm512_mask_storeu_ps(to, lanes, values);
}

AVX512 static inline __attribute__((always_inline)) __m512i load_code_lanes(const uint8_t *from, __mmask16 lanes) {
    return _mm512_cvtepu8_epi32(lanes == 0xFFFF ? _mm_loadu_si128((const __m128i *)from)
                                                : _mm_maskz_loadu_epi8(lanes, from));
}

/* The AVX-512 encoder (optim/quantization.py, `decade_rounding`: its words follow the cells
   in `table`): the nearest code by arithmetic, no gather per element, which bound the
   gather-based encode on Zen 4. The same codes as the table lookup for every fp32 value. */
#define CELLS (1u << (32 - CELL_SHIFT))
#define ROUNDING_FRACTION 12
#define ROUNDING_MIDPOINTS 80
#define ROUNDING_SIGNED 336

typedef struct {
    __m512 thresholds, slopes, offsets;
    __m512i bases, caps;
    const float *midpoints;
} decade_rounding;

AVX512 static inline __attribute__((always_inline)) decade_rounding decade_rounding_of(const uint32_t *table) {
    const uint32_t *words = table + CELLS;
    decade_rounding rounding = {_mm512_loadu_ps(words), _mm512_loadu_ps(words + 32), _mm512_loadu_ps(words + 48),
                                _mm512_loadu_si512(words + 16), _mm512_loadu_si512(words + 64),
                                (const float *)(words + ROUNDING_MIDPOINTS)};
    return rounding;
}

/* F(a), the positive midpoints below a, for a >= 0 (a NaN counts all of them). a is kept in
   [2^-30, 1.5] (every midpoint lies inside), where its exponent field >> 1 picks the pair of
   binades; the region is that pair's base, plus one above the pair's decade threshold; the
   count is the region's fixed-point affine position (one unit high), truncated and capped. A
   position within one unit of a count J (its fraction bits 0 or 1: near) is J, or J - 1 when
   a is not above the midpoint J - 1 itself. */
AVX512 static inline __attribute__((always_inline)) __m512i count_midpoints_below(__m512 a,
                                                                                 const decade_rounding *rounding) {
    a = _mm512_max_ps(_mm512_min_ps(a, _mm512_set1_ps(1.5f)), _mm512_set1_ps(0x1p-30f)); /* NaN: 1.5 */
    __m512i pair = _mm512_srli_epi32(_mm512_castps_si512(a), 24);
    __m512i base = _mm512_permutexvar_epi32(pair, rounding->bases);
    __mmask16 above = _mm512_cmp_ps_mask(a, _mm512_permutexvar_ps(pair, rounding->thresholds), _CMP_GT_OQ);
    __m512i region = _mm512_mask_add_epi32(base, above, base, _mm512_set1_epi32(1));
    __m512 position = _mm512_fmadd_ps(a, _mm512_permutexvar_ps(region, rounding->slopes),
                                      _mm512_permutexvar_ps(region, rounding->offsets));
    __m512i fixed = _mm512_cvttps_epi32(position);
    __m512i count = _mm512_min_epi32(_mm512_srli_epi32(fixed, ROUNDING_FRACTION),
                                     _mm512_permutexvar_epi32(region, rounding->caps));
    __mmask16 near = _mm512_testn_epi32_mask(fixed, _mm512_set1_epi32((1 << ROUNDING_FRACTION) - 2));
    if (__builtin_expect(near != 0, 0)) {
        const __m512i one = _mm512_set1_epi32(1);
        __m512 midpoint = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), near, _mm512_sub_epi32(count, one),
                                                   rounding->midpoints, 4);
        count = _mm512_mask_sub_epi32(count, _mm512_mask_cmp_ps_mask(near, a, midpoint, _CMP_LE_OQ), count, one);
    }
    return count;
}

/* Codes of sixteen scaled values. Signed: 127 + F(x) for x >= 0 (and NaN); for x < 0 the
   midpoints m with -m < x, 127 - #(m <= |x|) = 127 - F(|x| one ulp up), at least 0.
   Unsigned: F(x), negative values clamped to the bottom. */
AVX512 static inline __attribute__((always_inline)) __m128i codes_of(__m512 scaled, const decade_rounding *rounding,
                                                                    const int is_signed) {
    if (!is_signed)
        return _mm512_cvtepi32_epi8(count_midpoints_below(scaled, rounding));
    __mmask16 negative = _mm512_cmp_ps_mask(scaled, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(scaled), _mm512_set1_epi32(0x7FFFFFFF));
    magnitude = _mm512_mask_add_epi32(magnitude, negative, magnitude, _mm512_set1_epi32(1));
    __m128i count = _mm512_cvtepi32_epi8(count_midpoints_below(_mm512_castsi512_ps(magnitude), rounding));
    const __m128i middle = _mm_set1_epi8(127); /* on bytes: 127 + F <= 255, 127 - F saturates at 0 */
    return _mm_mask_subs_epu8(_mm_adds_epu8(middle, count), negative, middle, count);
}

AVX512 static inline __attribute__((always_inline)) void quantize_values_avx512_of(
    const float *restrict values, uint8_t *restrict codes, int64_t count, float absmax, const uint32_t *restrict table,
    const int is_signed) {
    const __m512 inverse = _mm512_set1_ps(1.0f / (absmax < TINY_SCALE ? TINY_SCALE : absmax));
    const decade_rounding rounding = decade_rounding_of(table);
    for (int64_t j = 0; j < count; j += 16) {
        const __mmask16 lanes = count - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - j)) - 1);
        __m128i packed = codes_of(_mm512_mul_ps(load_lanes(values + j, lanes), inverse), &rounding, is_signed);
        if (lanes == 0xFFFF)
            _mm_storeu_si128((__m128i *)(codes + j), packed);
        else
            _mm_mask_storeu_epi8(codes + j, lanes, packed);
    }
}

/* `quantize_values` by the AVX-512 encoder, one loop per kind of code. */
AVX512 static void quantize_values_avx512(const float *restrict values, uint8_t *restrict codes, int64_t count,
                                          float absmax, const uint32_t *restrict table) {
    if (table[CELLS + ROUNDING_SIGNED])
        quantize_values_avx512_of(values, codes, count, absmax, table, 1);
    else
        quantize_values_avx512_of(values, codes, count, absmax, table, 0);
}
#endif

void quantize_values(const float *values, uint8_t *codes, int64_t count, float absmax, const uint32_t *table) {
#ifdef HAVE_AVX512_PATH
    if (avx512_enabled) {
        quantize_values_avx512(values, codes, count, absmax, table);
        return;
    }
#endif
    quantize_values_portable(values, codes, count, absmax, table);
}

/* A cut block's new fp32 moments, as the whole padded block (zeros outside the piece). */
static void write_edges(const float *m, const float *v, int64_t count, int64_t lead, float *m_edge, float *v_edge) {
    memset(m_edge, 0, BLOCK * sizeof(float));
    memset(v_edge, 0, BLOCK * sizeof(float));
    memcpy(m_edge + lead, m, count * sizeof(float));
    memcpy(v_edge + lead, v, count * sizeof(float));
}

/* One block of 8-bit Adam: both moments decoded, Adam's step (bitsandbytes' 8-bit
   arithmetic, as optim/adam8bit.py), the new absolute maxima, the moments coded again.
   The moments are read from `m_in` / `v_in` instead where these are given (fp32 moments:
   fresh, or loaded from a checkpoint). The block's elements held here start at position
   `lead` of the block; where `m_edge`
   is given, the new fp32 moments are also written there as the whole padded block
   (zeros elsewhere), for a block cut by a piece boundary. */
static inline __attribute__((always_inline)) void adam8bit_block_body(float *restrict param, const float *restrict grad, uint8_t *restrict m_codes,
                           float *restrict m_absmax, uint8_t *restrict v_codes, float *restrict v_absmax,
                           int64_t count, const float *restrict m_values, const uint32_t *restrict m_table,
                           const float *restrict v_values, const uint32_t *restrict v_table, float beta1,
                           float weight, float beta2, float value, float eps, float decay_factor, int decay,
                           float correction2, float step_size, int64_t lead, float *m_edge, float *v_edge,
                           const float *restrict m_in, const float *restrict v_in, const int from_fp32) {
    float m[BLOCK], v[BLOCK];
    const float m_scale = *m_absmax, v_scale = *v_absmax;
    float m_max = 0.0f, v_max = 0.0f;
    int m_nan = 0, v_nan = 0; /* torch's amax propagates a NaN, the max below would drop it */
#pragma omp simd reduction(max : m_max, v_max) reduction(| : m_nan, v_nan)
    for (int64_t j = 0; j < count; j++) {
        float g = grad[j];
        float m_old = from_fp32 ? m_in[j] : m_values[m_codes[j]] * m_scale;
        float v_old = from_fp32 ? v_in[j] : v_values[v_codes[j]] * v_scale;
        float mj = fmaf(g, weight, m_old * beta1);
        float vj = fmaf(value * g, g, v_old * beta2);
        float p = decay ? param[j] * decay_factor : param[j];
        float denominator = sqrtf(vj) / correction2 + eps;
        param[j] = step_size * mj / denominator + p;
        m[j] = mj;
        v[j] = vj;
        m_max = m_max > fabsf(mj) ? m_max : fabsf(mj);
        v_max = v_max > fabsf(vj) ? v_max : fabsf(vj);
        m_nan |= mj != mj;
        v_nan |= vj != vj;
    }
    *m_absmax = m_max = m_nan ? NAN : m_max;
    *v_absmax = v_max = v_nan ? NAN : v_max;
    quantize_values_portable(m, m_codes, count, m_max, m_table);
    quantize_values_portable(v, v_codes, count, v_max, v_table);
    if (m_edge != NULL)
        write_edges(m, v, count, lead, m_edge, v_edge);
}

#ifdef HAVE_AVX512_PATH
/* Adam's constants broadcast to vectors, as both AVX-512 block loops below use them. */
typedef struct {
    __m512 beta1s, weights, beta2s, values, epss, decays, corrections, steps;
    int decay;
} adam_vectors;

AVX512 static inline __attribute__((always_inline)) adam_vectors adam_vectors_of(
    float beta1, float weight, float beta2, float value, float eps, float decay_factor, int decay, float correction2,
    float step_size) {
    const adam_vectors adam = {_mm512_set1_ps(beta1), _mm512_set1_ps(weight), _mm512_set1_ps(beta2),
                               _mm512_set1_ps(value), _mm512_set1_ps(eps), _mm512_set1_ps(decay_factor),
                               _mm512_set1_ps(correction2), _mm512_set1_ps(step_size), decay};
    return adam;
}

/* Sixteen elements of Adam's update, in the scalar body's order of operations (so the
   same bits): the new moments from the old ones and the gradient, written whole to
   `m_out`/`v_out` (they hold a whole block), the parameter stepped in place in `lanes`,
   and the moments' running maxima and NaN lanes for the block's scales. */
AVX512 static inline __attribute__((always_inline)) void adam_lanes(
    const adam_vectors *adam, float *param, __m512 g, __m512 m_old, __m512 v_old, __mmask16 lanes, float *m_out,
    float *v_out, __m512 *m_max, __m512 *v_max, __mmask16 *nan) {
    __m512 mj = _mm512_fmadd_ps(g, adam->weights, _mm512_mul_ps(m_old, adam->beta1s));
    __m512 vj = _mm512_fmadd_ps(_mm512_mul_ps(adam->values, g), g, _mm512_mul_ps(v_old, adam->beta2s));
    __m512 p = load_lanes(param, lanes);
    if (adam->decay)
        p = _mm512_mul_ps(p, adam->decays);
    __m512 denominator = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vj), adam->corrections), adam->epss);
    store_lanes(param, lanes, _mm512_add_ps(_mm512_div_ps(_mm512_mul_ps(adam->steps, mj), denominator), p));
    _mm512_storeu_ps(m_out, mj);
    _mm512_storeu_ps(v_out, vj);
    *m_max = _mm512_mask_max_ps(*m_max, lanes, *m_max, _mm512_abs_ps(mj));
    *v_max = _mm512_mask_max_ps(*v_max, lanes, *v_max, _mm512_abs_ps(vj));
    *nan |= _mm512_mask_cmp_ps_mask(lanes, mj, vj, _CMP_UNORD_Q);
}

/* A block's scales from the vector maxima; a NaN in either moment makes that moment's
   scale NaN, each tracked apart as the portable loop does. */
AVX512 static inline __attribute__((always_inline)) void block_maxima(const float *m, const float *v, int64_t count,
                                                                     __m512 m_max, __m512 v_max, __mmask16 nan,
                                                                     float *m_found, float *v_found) {
    *m_found = _mm512_reduce_max_ps(m_max);
    *v_found = _mm512_reduce_max_ps(v_max);
    if (nan) {
        int m_nan = 0, v_nan = 0;
        for (int64_t j = 0; j < count; j++) {
            m_nan |= m[j] != m[j];
            v_nan |= v[j] != v[j];
        }
        *m_found = m_nan ? NAN : *m_found;
        *v_found = v_nan ? NAN : *v_found;
    }
}

/* `adam8bit_block_body` sixteen elements at a time, the codes decoded by gathers from the
   256 code values and coded again by the AVX-512 encoder: the same operations in the
   same order (IEEE multiplies, fused multiply-adds, square roots and divisions round as the
   scalar ones), so parameters, codes and scales equal the portable path's bit for bit. The
   maxima are exact whatever the order; a NaN is tracked apart, as there. */
AVX512 static inline __attribute__((always_inline)) void adam8bit_block_avx512_body(
    float *restrict param, const float *restrict grad, uint8_t *restrict m_codes, float *restrict m_absmax,
    uint8_t *restrict v_codes, float *restrict v_absmax, int64_t count, const float *restrict m_values,
    const uint32_t *restrict m_table, const float *restrict v_values, const uint32_t *restrict v_table, float beta1,
    float weight, float beta2, float value, float eps, float decay_factor, int decay, float correction2,
    float step_size, int64_t lead, float *m_edge, float *v_edge, const float *restrict m_in,
    const float *restrict v_in, const int from_fp32) {
    float m[BLOCK], v[BLOCK];
    const __m512 m_scale = _mm512_set1_ps(*m_absmax), v_scale = _mm512_set1_ps(*v_absmax);
    const adam_vectors adam = adam_vectors_of(beta1, weight, beta2, value, eps, decay_factor, decay, correction2,
                                              step_size);
    __m512 m_max = _mm512_setzero_ps(), v_max = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t j = 0; j < count; j += 16) {
        const __mmask16 lanes = count - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - j)) - 1);
        __m512 g = load_lanes(grad + j, lanes), m_old, v_old;
        if (from_fp32) {
            m_old = load_lanes(m_in + j, lanes);
            v_old = load_lanes(v_in + j, lanes);
        } else {
            __m512i m_code = load_code_lanes(m_codes + j, lanes);
            __m512i v_code = load_code_lanes(v_codes + j, lanes);
            m_old = _mm512_mul_ps(_mm512_i32gather_ps(m_code, m_values, 4), m_scale);
            v_old = _mm512_mul_ps(_mm512_i32gather_ps(v_code, v_values, 4), v_scale);
        }
        adam_lanes(&adam, param + j, g, m_old, v_old, lanes, m + j, v + j, &m_max, &v_max, &nan);
    }
    float m_found, v_found;
    block_maxima(m, v, count, m_max, v_max, nan, &m_found, &v_found);
    *m_absmax = m_found;
    *v_absmax = v_found;
    quantize_values_avx512_of(m, m_codes, count, m_found, m_table, 1);
    quantize_values_avx512_of(v, v_codes, count, v_found, v_table, 0);
    if (m_edge != NULL)
        write_edges(m, v, count, lead, m_edge, v_edge);
}

AVX512 static void adam8bit_block_avx512_fp32(float *restrict param, const float *restrict grad,
                                              uint8_t *restrict m_codes, float *restrict m_absmax,
                                              uint8_t *restrict v_codes, float *restrict v_absmax, int64_t count,
                                              const float *restrict m_values, const uint32_t *restrict m_table,
                                              const float *restrict v_values, const uint32_t *restrict v_table,
                                              float beta1, float weight, float beta2, float value, float eps,
                                              float decay_factor, int decay, float correction2, float step_size,
                                              int64_t lead, float *m_edge, float *v_edge, const float *restrict m_in,
                                              const float *restrict v_in) {
    adam8bit_block_avx512_body(param, grad, m_codes, m_absmax, v_codes, v_absmax, count, m_values, m_table, v_values,
                               v_table, beta1, weight, beta2, value, eps, decay_factor, decay, correction2, step_size,
                               lead, m_edge, v_edge, m_in, v_in, 1);
}

AVX512 static void adam8bit_block_avx512_coded(float *restrict param, const float *restrict grad,
                                               uint8_t *restrict m_codes, float *restrict m_absmax,
                                               uint8_t *restrict v_codes, float *restrict v_absmax, int64_t count,
                                               const float *restrict m_values, const uint32_t *restrict m_table,
                                               const float *restrict v_values, const uint32_t *restrict v_table,
                                               float beta1, float weight, float beta2, float value, float eps,
                                               float decay_factor, int decay, float correction2, float step_size,
                                               int64_t lead, float *m_edge, float *v_edge) {
    adam8bit_block_avx512_body(param, grad, m_codes, m_absmax, v_codes, v_absmax, count, m_values, m_table, v_values,
                               v_table, beta1, weight, beta2, value, eps, decay_factor, decay, correction2, step_size,
                               lead, m_edge, v_edge, NULL, NULL, 0);
}
/* Codes decoded 64 at a time without a gather: the code values' four byte planes (plane b:
   byte b of each of the 256 values, after the values in `values`, from optim/adam8bit.py)
   are four 256-byte tables, each looked up by two 128-byte permutes and a blend on the
   code's top bit; the planes are then interleaved back into fp32 values. Interleaving
   works within 128-bit lanes, so the codes are first put in the order that brings the
   values out in theirs. Exactly the gathers' values: the same bytes, then the same product
   with the block's scale. */
#define VALUE_PLANES 256 /* floats of code values before the planes */
#define PIPELINED_ROWS 64 /* rows per pipelined run (`adam8bit_rows_avx512_vbmi`), the unit of threads' work */

AVX512_VBMI static inline __attribute__((always_inline)) void decode_codes_vbmi(
    const uint8_t *restrict codes, int64_t count, const float *restrict values, float scale, float *restrict out) {
    static const uint8_t order[64] = {0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
                                      4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
                                      8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
                                      12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    const uint8_t *planes = (const uint8_t *)(values + VALUE_PLANES);
    const __m512i ordering = _mm512_loadu_si512(order);
    const __m512 scales = _mm512_set1_ps(scale);
    __m512i table[16];
    for (int q = 0; q < 16; q++)
        table[q] = _mm512_loadu_si512(planes + 64 * q);
    for (int64_t j = 0; j < count; j += 64) {
        __m512i code = count - j >= 64 ? _mm512_loadu_si512(codes + j)
                                       : _mm512_maskz_loadu_epi8((1ull << (count - j)) - 1, codes + j);
        code = _mm512_permutexvar_epi8(ordering, code);
        const __mmask64 high = _mm512_movepi8_mask(code);
        __m512i byte[4];
        for (int b = 0; b < 4; b++)
            byte[b] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(table[4 * b], code, table[4 * b + 1]),
                                             _mm512_permutex2var_epi8(table[4 * b + 2], code, table[4 * b + 3]));
        __m512i low01 = _mm512_unpacklo_epi8(byte[0], byte[1]), high01 = _mm512_unpackhi_epi8(byte[0], byte[1]);
        __m512i low23 = _mm512_unpacklo_epi8(byte[2], byte[3]), high23 = _mm512_unpackhi_epi8(byte[2], byte[3]);
        _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23)), scales));
        _mm512_storeu_ps(out + j + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23)), scales));
        _mm512_storeu_ps(out + j + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23)), scales));
        _mm512_storeu_ps(out + j + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23)), scales));
    }
}

/* The coded block with both moments decoded first (into whole-block buffers: the last
   64-code group may run past `count`, never past the block), then stepped from them. */
AVX512_VBMI static void adam8bit_block_avx512_vbmi(float *restrict param, const float *restrict grad,
                                                   uint8_t *restrict m_codes, float *restrict m_absmax,
                                                   uint8_t *restrict v_codes, float *restrict v_absmax, int64_t count,
                                                   const float *restrict m_values, const uint32_t *restrict m_table,
                                                   const float *restrict v_values, const uint32_t *restrict v_table,
                                                   float beta1, float weight, float beta2, float value, float eps,
                                                   float decay_factor, int decay, float correction2, float step_size,
                                                   int64_t lead, float *m_edge, float *v_edge) {
    float m_old[BLOCK], v_old[BLOCK];
    decode_codes_vbmi(m_codes, count, m_values, *m_absmax, m_old);
    decode_codes_vbmi(v_codes, count, v_values, *v_absmax, v_old);
    adam8bit_block_avx512_body(param, grad, m_codes, m_absmax, v_codes, v_absmax, count, m_values, m_table, v_values,
                               v_table, beta1, weight, beta2, value, eps, decay_factor, decay, correction2, step_size,
                               lead, m_edge, v_edge, m_old, v_old, 1);
}

/* Sixteen values (fewer at a block's end) coded by the AVX-512 encoder, as
   `quantize_values_avx512_of` codes them. */
AVX512_VBMI static inline __attribute__((always_inline)) void encode_lanes(const float *restrict values,
                                                                           uint8_t *restrict codes, int64_t j,
                                                                           int64_t count, __m512 inverse,
                                                                           const decade_rounding *rounding,
                                                                           const int is_signed) {
    const __mmask16 lanes = count - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - j)) - 1);
    __m128i packed = codes_of(_mm512_mul_ps(load_lanes(values + j, lanes), inverse), rounding, is_signed);
    if (lanes == 0xFFFF)
        _mm_storeu_si128((__m128i *)(codes + j), packed);
    else
        _mm_mask_storeu_epi8(codes + j, lanes, packed);
}

AVX512_VBMI static inline __attribute__((always_inline)) __m512 inverse_of(float absmax) {
    return _mm512_set1_ps(1.0f / (absmax < TINY_SCALE ? TINY_SCALE : absmax)); /* NaN stays NaN */
}

/* Rows [first_row, last_row) of `adam8bit_step`'s coded piece, each row as
   `adam8bit_block_avx512_vbmi` steps it, but software-pipelined: a row's moments are
   coded while the next row is updated, sixteen values of each in one loop, so the
   encoder's integer and permute work overlaps the update's square roots and divisions
   (which occupy the divider, not the vector ports; one after the other, each waited on
   the other's unit). The same operations on the same values: the same bits. */
AVX512_VBMI static void adam8bit_rows_avx512_vbmi(
    float *param, const float *grad, uint8_t *m_codes, float *m_absmax, uint8_t *v_codes, float *v_absmax, int64_t n,
    int64_t offset, int64_t rows, int64_t first_row, int64_t last_row, const float *m_values,
    const uint32_t *m_table, const float *v_values, const uint32_t *v_table, float beta1, float weight, float beta2,
    float value, float eps, float decay_factor, int decay, float correction2, float step_size, float *edges) {
    float m_new[2][BLOCK], v_new[2][BLOCK], m_old[BLOCK], v_old[BLOCK];
    const decade_rounding m_rounding = decade_rounding_of(m_table), v_rounding = decade_rounding_of(v_table);
    const adam_vectors adam = adam_vectors_of(beta1, weight, beta2, value, eps, decay_factor, decay, correction2,
                                              step_size);
    uint8_t *pending_m = NULL, *pending_v = NULL; /* the row coded during this one: its codes */
    int64_t pending_count = 0;
    __m512 pending_m_inverse = _mm512_setzero_ps(), pending_v_inverse = _mm512_setzero_ps();
    int current = 0;
    for (int64_t row = first_row; row < last_row; row++) {
        const int64_t first = row == 0 ? 0 : row * BLOCK - offset;
        const int64_t stop = (row + 1) * BLOCK - offset < n ? (row + 1) * BLOCK - offset : n;
        const int64_t count = stop - first, lead = row == 0 ? offset : 0;
        decode_codes_vbmi(m_codes + first, count, m_values, m_absmax[row], m_old);
        decode_codes_vbmi(v_codes + first, count, v_values, v_absmax[row], v_old);
        float *restrict m = m_new[current], *restrict v = v_new[current];
        const float *restrict pending_m_values = m_new[current ^ 1], *restrict pending_v_values = v_new[current ^ 1];
        float *restrict p_row = param + first;
        const float *restrict g_row = grad + first;
        __m512 m_max = _mm512_setzero_ps(), v_max = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int64_t j = 0; j < count; j += 16) {
            const __mmask16 lanes = count - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - j)) - 1);
            __m512 g = load_lanes(g_row + j, lanes);
            __m512 m_before = _mm512_loadu_ps(m_old + j), v_before = _mm512_loadu_ps(v_old + j);
            adam_lanes(&adam, p_row + j, g, m_before, v_before, lanes, m + j, v + j, &m_max, &v_max, &nan);
            if (j < pending_count) {
                encode_lanes(pending_m_values, pending_m, j, pending_count, pending_m_inverse, &m_rounding, 1);
                encode_lanes(pending_v_values, pending_v, j, pending_count, pending_v_inverse, &v_rounding, 0);
            }
        }
        for (int64_t j = (count + 15) / 16 * 16; j < pending_count; j += 16) {
            encode_lanes(pending_m_values, pending_m, j, pending_count, pending_m_inverse, &m_rounding, 1);
            encode_lanes(pending_v_values, pending_v, j, pending_count, pending_v_inverse, &v_rounding, 0);
        }
        float m_found, v_found;
        block_maxima(m, v, count, m_max, v_max, nan, &m_found, &v_found);
        m_absmax[row] = m_found;
        v_absmax[row] = v_found;
        if (edges != NULL && (row == 0 || row == rows - 1)) {
            float *m_edge = edges + (row == 0 ? 0 : BLOCK);
            write_edges(m, v, count, lead, m_edge, m_edge + 2 * BLOCK);
        }
        pending_m = m_codes + first;
        pending_v = v_codes + first;
        pending_count = count;
        pending_m_inverse = inverse_of(m_found);
        pending_v_inverse = inverse_of(v_found);
        current ^= 1;
    }
    for (int64_t j = 0; j < pending_count; j += 16) {
        encode_lanes(m_new[current ^ 1], pending_m, j, pending_count, pending_m_inverse, &m_rounding, 1);
        encode_lanes(v_new[current ^ 1], pending_v, j, pending_count, pending_v_inverse, &v_rounding, 0);
    }
}
#endif

/* The block loop specialised for each source of the moments: a choice made inside the
   loop (not hoisted by GCC) cost a third of the step. */
static void adam8bit_block(float *restrict param, const float *restrict grad, uint8_t *restrict m_codes,
                           float *restrict m_absmax, uint8_t *restrict v_codes, float *restrict v_absmax,
                           int64_t count, const float *restrict m_values, const uint32_t *restrict m_table,
                           const float *restrict v_values, const uint32_t *restrict v_table, float beta1,
                           float weight, float beta2, float value, float eps, float decay_factor, int decay,
                           float correction2, float step_size, int64_t lead, float *m_edge, float *v_edge,
                           const float *restrict m_in, const float *restrict v_in) {
#ifdef HAVE_AVX512_PATH
    if (avx512_enabled && m_in != NULL) {
        adam8bit_block_avx512_fp32(param, grad, m_codes, m_absmax, v_codes, v_absmax, count, m_values, m_table,
                                   v_values, v_table, beta1, weight, beta2, value, eps, decay_factor, decay,
                                   correction2, step_size, lead, m_edge, v_edge, m_in, v_in);
        return;
    }
    if (vbmi_enabled) {
        adam8bit_block_avx512_vbmi(param, grad, m_codes, m_absmax, v_codes, v_absmax, count, m_values, m_table,
                                   v_values, v_table, beta1, weight, beta2, value, eps, decay_factor, decay,
                                   correction2, step_size, lead, m_edge, v_edge);
        return;
    }
    if (avx512_enabled) {
        adam8bit_block_avx512_coded(param, grad, m_codes, m_absmax, v_codes, v_absmax, count, m_values, m_table,
                                    v_values, v_table, beta1, weight, beta2, value, eps, decay_factor, decay,
                                    correction2, step_size, lead, m_edge, v_edge);
        return;
    }
#endif
    if (m_in != NULL)
        adam8bit_block_body(param, grad, m_codes, m_absmax, v_codes, v_absmax, count, m_values, m_table, v_values,
                            v_table, beta1, weight, beta2, value, eps, decay_factor, decay, correction2, step_size,
                            lead, m_edge, v_edge, m_in, v_in, 1);
    else
        adam8bit_block_body(param, grad, m_codes, m_absmax, v_codes, v_absmax, count, m_values, m_table, v_values,
                            v_table, beta1, weight, beta2, value, eps, decay_factor, decay, correction2, step_size,
                            lead, m_edge, v_edge, NULL, NULL, 0);
}

/* 8-bit Adam on a piece of n elements starting at position `offset` of a block of the
   parameter (blocks are the parameter's, not the piece's), one pass over each block.
   edges (or NULL): (2 moments, first and last block, BLOCK) fp32 moments of the piece's first and
   last blocks, padded with zeros (optim/adam8bit.py quantises cut blocks again from them
   once their whole absmax is known). m_in / v_in: fp32 moments to start from, or NULL. */
void adam8bit_step(float *param, const float *grad, uint8_t *m_codes, float *m_absmax, uint8_t *v_codes,
                   float *v_absmax, int64_t n, int64_t offset, const float *m_values, const uint32_t *m_table,
                   const float *v_values, const uint32_t *v_table,
                   float beta1, float weight, float beta2, float value, float eps, float decay_factor, int decay,
                   float correction2, float step_size, float *edges, const float *m_in, const float *v_in,
                   int threads) {
    const int64_t rows = n == 0 ? 0 : (offset + n + BLOCK - 1) / BLOCK; /* as PaddedRows.rows */
#ifdef HAVE_AVX512_PATH
    if (vbmi_enabled && m_in == NULL) {
#pragma omp parallel for num_threads(threads) if (n >= PARALLEL_MIN)
        for (int64_t group = 0; group < (rows + PIPELINED_ROWS - 1) / PIPELINED_ROWS; group++) {
            const int64_t last = (group + 1) * PIPELINED_ROWS < rows ? (group + 1) * PIPELINED_ROWS : rows;
            adam8bit_rows_avx512_vbmi(param, grad, m_codes, m_absmax, v_codes, v_absmax, n, offset, rows,
                                      group * PIPELINED_ROWS, last, m_values, m_table, v_values, v_table, beta1,
                                      weight, beta2, value, eps, decay_factor, decay, correction2, step_size, edges);
        }
    } else
#endif
#pragma omp parallel for num_threads(threads) if (n >= PARALLEL_MIN)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t first = row == 0 ? 0 : row * BLOCK - offset;
        const int64_t stop = (row + 1) * BLOCK - offset < n ? (row + 1) * BLOCK - offset : n;
        const int64_t lead = row == 0 ? offset : 0;
        float *m_edge = NULL, *v_edge = NULL;
        if (edges != NULL && (row == 0 || row == rows - 1)) {
            m_edge = edges + (row == 0 ? 0 : BLOCK);
            v_edge = m_edge + 2 * BLOCK;
        }
        adam8bit_block(param + first, grad + first, m_codes + first, m_absmax + row, v_codes + first, v_absmax + row,
                       stop - first, m_values, m_table, v_values, v_table, beta1, weight,
                       beta2, value, eps, decay_factor, decay, correction2, step_size, lead, m_edge, v_edge,
                       m_in == NULL ? NULL : m_in + first, v_in == NULL ? NULL : v_in + first);
    }
    if (edges != NULL && rows == 1) { /* one block: it is both the first and the last */
        memcpy(edges + BLOCK, edges, BLOCK * sizeof(float));
        memcpy(edges + 3 * BLOCK, edges + 2 * BLOCK, BLOCK * sizeof(float));
    }
}

/* A param group's hyper-parameters, as optim/adam8bit.py's `_Group` writes them each step. */
typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
} adam8bit_group;

/* A step's scalars from the group's hyper-parameters and the step count t, in double
   precision as optim/adam8bit.py's `_Hyper` computes them (the same libm `pow`; built
   without contraction), each rounded once to float as a float argument of
   `adam8bit_step` is. */
typedef struct {
    float beta1, weight, beta2, value, eps, decay_factor, correction2, step_size, eps_correction, alpha;
    int decay;
} adam8bit_scalars;

static adam8bit_scalars adam8bit_scalars_of(const adam8bit_group *group, double t) {
    const double correction1 = 1.0 - pow(group->beta1, t), correction2 = sqrt(1.0 - pow(group->beta2, t));
    adam8bit_scalars s = {(float)group->beta1,
                          (float)(1.0 - group->beta1),
                          (float)group->beta2,
                          (float)(1.0 - group->beta2),
                          (float)group->eps,
                          (float)(1.0 - group->lr * group->weight_decay),
                          (float)correction2,
                          (float)(-group->lr / correction1),
                          (float)(group->eps * correction2),
                          (float)(-group->lr * correction2 / correction1),
                          group->weight_decay > 0.0};
    return s;
}

/* A piece whose moments are coded, in a batched step (optim/adam8bit.py, `_CodedDescriptor`). */
typedef struct {
    float *param;
    const float *grad;
    float *step; /* the state's step count (a float tensor), advanced here as torch's `+= 1` does */
    uint8_t *m_codes;
    float *m_absmax;
    uint8_t *v_codes;
    float *v_absmax;
    float *edges; /* NULL where no block of the piece is cut */
    int64_t n, offset;
    adam8bit_group group;
} adam8bit_coded_piece;

/* `adam8bit_step` on each of `count` coded pieces: one call per optimizer step, so that
   the Python per tensor is only the refresh of its descriptor's pointers. */
void adam8bit_steps(const adam8bit_coded_piece *pieces, int64_t count, const float *m_values,
                    const uint32_t *m_table, const float *v_values, const uint32_t *v_table, int threads) {
    for (int64_t i = 0; i < count; i++) {
        const adam8bit_coded_piece *piece = pieces + i;
        *piece->step += 1.0f;
        const adam8bit_scalars s = adam8bit_scalars_of(&piece->group, *piece->step);
        adam8bit_step(piece->param, piece->grad, piece->m_codes, piece->m_absmax, piece->v_codes, piece->v_absmax,
                      piece->n, piece->offset, m_values, m_table, v_values, v_table, s.beta1, s.weight, s.beta2,
                      s.value, s.eps, s.decay_factor, s.decay, s.correction2, s.step_size, piece->edges, NULL, NULL,
                      threads);
    }
}

/* A small parameter's piece with fp32 moments, in a batched step (optim/adam8bit.py,
   `_Fp32Descriptor`). Its update needs torch's square root (not correctly rounded on a
   CPU, so not computed here): `adam8bit_fp32_moments` copies the new second moment into
   `root`, torch takes its square root in place, then `adam8bit_fp32_apply` updates the
   weights. The arithmetic is that of `_adam_step`'s 32-bit update in torch operations, fused
   multiply-adds where torch's kernels use them (add with alpha, addcmul). */
typedef struct {
    float *param;
    const float *grad;
    float *step;
    float *exp_avg;
    float *exp_avg_sq;
    float *root;
    int64_t n;
    adam8bit_group group;
} adam8bit_fp32_piece;

void adam8bit_fp32_moments(const adam8bit_fp32_piece *pieces, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        const adam8bit_fp32_piece *piece = pieces + i;
        *piece->step += 1.0f;
        const adam8bit_scalars s = adam8bit_scalars_of(&piece->group, *piece->step);
        const float *restrict grad = piece->grad;
        float *restrict m = piece->exp_avg, *restrict v = piece->exp_avg_sq, *restrict root = piece->root;
        for (int64_t j = 0; j < piece->n; j++) {
            m[j] = fmaf(grad[j], s.weight, m[j] * s.beta1);
            v[j] = fmaf(s.value * grad[j], grad[j], v[j] * s.beta2);
            root[j] = v[j];
        }
    }
}

/* After `adam8bit_fp32_moments` (the step already advanced) and the square roots. */
void adam8bit_fp32_apply(const adam8bit_fp32_piece *pieces, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        const adam8bit_fp32_piece *piece = pieces + i;
        const adam8bit_scalars s = adam8bit_scalars_of(&piece->group, *piece->step);
        float *restrict param = piece->param;
        const float *restrict m = piece->exp_avg, *restrict root = piece->root;
        for (int64_t j = 0; j < piece->n; j++) {
            const float p = s.decay ? param[j] * s.decay_factor : param[j];
            param[j] = fmaf(m[j] / (root[j] + s.eps_correction), s.alpha, p);
        }
    }
}

/* Adafactor on a piece of a parameter factored into matrices of `height` rows of `width`
   elements: the piece is elements [start, start + n) of the flattened parameter (pointers
   at its first element), the statistics are indexed by the whole parameter's row
   (position / width) and column ((position / matrix size) x width + position % width). */

/* One run of elements [p, end) inside a row: its squared gradients added to the row's sum
   (returned) and to the columns' sums; squared weights to *weight_square. */
static inline double adafactor_row_squares(const float *restrict param, const float *restrict grad,
                                           double *restrict columns, int64_t count, double *weight_square) {
    double row = 0.0, weights = 0.0;
#pragma omp simd reduction(+ : row, weights)
    for (int64_t j = 0; j < count; j++) {
        double square = (double)grad[j] * grad[j]; /* exact: a float's square fits a double */
        row += square;
        columns[j] += square;
        weights += (double)param[j] * param[j];
    }
    *weight_square += weights;
    return row;
}

/* Rows [first_row, last_row) of the piece (clipped to it): row sums into row_squares,
   column sums into columns (indexed from column `column_base`), weight squares summed. */
static double adafactor_squares_rows(const float *param, const float *grad, int64_t n, int64_t start, int64_t width,
                                     int64_t height, int64_t first_row, int64_t last_row, double *row_squares,
                                     double *columns, int64_t column_base) {
    double weight_square = 0.0;
    for (int64_t row = first_row; row < last_row; row++) {
        int64_t low = row * width > start ? row * width : start;
        int64_t high = (row + 1) * width < start + n ? (row + 1) * width : start + n;
        int64_t column = (row / height) * width + (low - row * width) - column_base;
        row_squares[row] += adafactor_row_squares(param + (low - start), grad + (low - start), columns + column,
                                                  high - low, &weight_square);
    }
    return weight_square;
}

/* Pass 1: squares[0] += sum w^2; row_squares[row] += sum of the row's g^2 (over the
   piece's elements); column_squares[column] += the column's. Summed in double, so a
   piece's sums equal the whole matrix's to fp32 whatever the cut. Threads split the rows,
   each with its own column sums, added in thread order. */
void adafactor_squares(const float *param, const float *grad, int64_t n, int64_t start, int64_t width,
                       int64_t height, double *row_squares, double *column_squares, double *squares, int threads) {
    if (n == 0)
        return;
    const int64_t first_row = start / width, last_row = (start + n - 1) / width + 1;
    const int64_t column_base = (first_row / height) * width;
    const int64_t column_count = ((last_row - 1) / height + 1) * width - column_base;
    double weight_square = 0.0;
#ifdef _OPENMP
    if (threads > 1 && n >= PARALLEL_MIN) {
        double *partial = calloc((size_t)threads * column_count, sizeof(double));
        double weight_parts[threads];
        if (partial == NULL)
            goto one_thread;
        int used = threads;
#pragma omp parallel num_threads(threads)
        {
            int thread = omp_get_thread_num();
            used = omp_get_num_threads();
            int64_t rows = last_row - first_row, share = (rows + used - 1) / used;
            int64_t low = first_row + thread * share, high = low + share < last_row ? low + share : last_row;
            weight_parts[thread] = low < high ? adafactor_squares_rows(param, grad, n, start, width, height, low, high,
                                                                       row_squares, partial + thread * column_count,
                                                                       column_base)
                                             : 0.0;
        }
        for (int thread = 0; thread < used; thread++) {
            weight_square += weight_parts[thread];
            for (int64_t c = 0; c < column_count; c++)
                column_squares[column_base + c] += partial[thread * column_count + c];
        }
        free(partial);
        squares[0] += weight_square;
        return;
    }
    one_thread:
#endif
    weight_square = adafactor_squares_rows(param, grad, n, start, width, height, first_row, last_row, row_squares,
                                           column_squares + column_base, column_base);
    squares[0] += weight_square;
}

/* Adafactor's direction U = g / max(sqrt(V), eps1) with V = row x column / row mean (the
   matrix's mean row statistic), without a square root or a division per element: per
   row a = row / row mean and its 1 / sqrt(a), per column 1 / sqrt(column) (computed once
   per call, `adafactor_column_factors`), so U = g x row factor x column factor, or g / eps1
   where a x column falls below eps1^2 (`square_floor`). torch's path divides and takes
   the square root per element; the two agree to a few fp32 ulps (the rounding of three
   operations instead of two), and a NaN statistic gives NaN in both. */
static inline float adafactor_direction(float grad, float row_ratio, float row_factor, float column,
                                        float column_factor, float square_floor, float floor_factor) {
    return grad * (row_ratio * column < square_floor ? floor_factor : row_factor * column_factor);
}

/* 1 / sqrt(column statistic) for the columns a piece touches, from `column_base`. */
static float *adafactor_column_factors(const float *col_var, int64_t start, int64_t n, int64_t width, int64_t height,
                                       int64_t *column_base) {
    const int64_t first_row = start / width, last_row = (start + n - 1) / width + 1;
    *column_base = (first_row / height) * width;
    const int64_t count = ((last_row - 1) / height + 1) * width - *column_base;
    float *factors = malloc((size_t)count * sizeof(float));
    if (factors != NULL)
        for (int64_t c = 0; c < count; c++)
            factors[c] = 1.0f / sqrtf(col_var[*column_base + c]);
    return factors;
}

/* One row's run [low, high) of the piece's elements, with what U needs of its row and
   columns: the loop both passes share. */
struct adafactor_run {
    int64_t offset, count;          /* the run's first element in the piece, its length */
    const float *columns, *factors; /* its columns' statistics and their 1 / sqrt */
    float row_ratio, row_factor;    /* row / row mean, and its 1 / sqrt */
};

static inline struct adafactor_run adafactor_run_of(int64_t row, int64_t n, int64_t start, int64_t width,
                                                    int64_t height, const float *row_var, const float *col_var,
                                                    const float *row_means, const float *column_factors,
                                                    int64_t column_base) {
    const int64_t low = row * width > start ? row * width : start;
    const int64_t high = (row + 1) * width < start + n ? (row + 1) * width : start + n;
    const int64_t column = (row / height) * width + (low - row * width);
    const float ratio = row_var[row] / row_means[row / height];
    return (struct adafactor_run){low - start, high - low, col_var + column, column_factors + (column - column_base),
                                  ratio, 1.0f / sqrtf(ratio)};
}

/* Pass 2: *square += sum U^2 over the piece (U is not stored: pass 3 computes it again). */
void adafactor_update_square(const float *grad, int64_t n, int64_t start, int64_t width, int64_t height,
                             const float *row_var, const float *col_var, const float *row_means, float square_floor,
                             double *square, int threads) {
    if (n == 0)
        return;
    int64_t column_base;
    float *column_factors = adafactor_column_factors(col_var, start, n, width, height, &column_base);
    if (column_factors == NULL) {
        *square = NAN; /* out of memory: a NaN step rather than a wrong one */
        return;
    }
    const float floor_factor = 1.0f / sqrtf(square_floor);
    const int64_t first_row = start / width, last_row = (start + n - 1) / width + 1;
    double total = 0.0;
#pragma omp parallel for reduction(+ : total) num_threads(threads) if (n >= PARALLEL_MIN)
    for (int64_t row = first_row; row < last_row; row++) {
        struct adafactor_run run = adafactor_run_of(row, n, start, width, height, row_var, col_var, row_means,
                                                    column_factors, column_base);
        const float *restrict g = grad + run.offset, *restrict columns = run.columns, *restrict factors = run.factors;
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < run.count; j++) {
            float u = adafactor_direction(g[j], run.row_ratio, run.row_factor, columns[j], factors[j], square_floor,
                                          floor_factor);
            sum += (double)u * u;
        }
        total += sum;
    }
    free(column_factors);
    *square += total;
}

/* Pass 3: w <- w x decay_factor (when `decay`), then w += scale U, with torch's fused
   multiply-add of `add_(U, alpha=scale)`. */
void adafactor_apply(float *param, const float *grad, int64_t n, int64_t start, int64_t width, int64_t height,
                     const float *row_var, const float *col_var, const float *row_means, float square_floor,
                     float decay_factor, int decay, float scale, int threads) {
    if (n == 0)
        return;
    int64_t column_base;
    float *column_factors = adafactor_column_factors(col_var, start, n, width, height, &column_base);
    if (column_factors == NULL) {
        param[0] = NAN;
        return;
    }
    const float floor_factor = 1.0f / sqrtf(square_floor);
    const int64_t first_row = start / width, last_row = (start + n - 1) / width + 1;
#pragma omp parallel for num_threads(threads) if (n >= PARALLEL_MIN)
    for (int64_t row = first_row; row < last_row; row++) {
        struct adafactor_run run = adafactor_run_of(row, n, start, width, height, row_var, col_var, row_means,
                                                    column_factors, column_base);
        float *restrict w = param + run.offset;
        const float *restrict g = grad + run.offset, *restrict columns = run.columns, *restrict factors = run.factors;
        const float ratio = run.row_ratio, factor = run.row_factor;
        if (decay) {
            for (int64_t j = 0; j < run.count; j++)
                w[j] = fmaf(adafactor_direction(g[j], ratio, factor, columns[j], factors[j], square_floor,
                                                floor_factor),
                            scale, w[j] * decay_factor);
        } else {
            for (int64_t j = 0; j < run.count; j++)
                w[j] = fmaf(adafactor_direction(g[j], ratio, factor, columns[j], factors[j], square_floor,
                                                floor_factor),
                            scale, w[j]);
        }
    }
    free(column_factors);
}

/* Adafactor's factored statistics of a whole tensor advanced in place from pass 1's
   squared row and column sums (double): row_var[i] <- lerp(row_var[i], (float)row_squares[i]
   / width, weight), col_var[j] likewise from the column sums and height. These are
   `_Piece.advance`'s torch operations (the sums rounded to fp32, divided by the count,
   torch's lerp with a scalar weight), the same values, without a dozen small torch calls
   per tensor. */
void adafactor_advance_whole(const double *restrict row_squares, const double *restrict column_squares,
                             float *restrict row_var, float *restrict col_var, int64_t rows, int64_t columns,
                             int64_t width, int64_t height, float weight) {
    const float row_count = (float)width, column_count = (float)height;
    for (int64_t i = 0; i < rows; i++)
        row_var[i] = lerp(row_var[i], (float)row_squares[i] / row_count, weight);
    for (int64_t j = 0; j < columns; j++)
        col_var[j] = lerp(col_var[j], (float)column_squares[j] / column_count, weight);
}

/* Adafactor on a tensor it does not factor (V per element), pass 1: squares[0] += sum w^2;
   V <- lerp(V, g^2, weight) in place; squares[1] += sum U^2 with U = g / max(sqrt(V), eps1)
   as torch computes it (V clamped at eps1^2, then 1 / sqrt). V needs no statistic of the
   whole tensor, so the update's square is known in the same pass. */
void adafactor_vector_squares(const float *restrict param, const float *restrict grad, float *restrict variance,
                              int64_t n, float weight, float square_floor, double *weight_square,
                              double *update_square) {
    double weights = 0.0, updates = 0.0;
#pragma omp simd reduction(+ : weights, updates)
    for (int64_t i = 0; i < n; i++) {
        float g = grad[i];
        float v = lerp(variance[i], g * g, weight);
        variance[i] = v;
        float u = g * (1.0f / sqrtf(v < square_floor ? square_floor : v));
        weights += (double)param[i] * param[i];
        updates += (double)u * u;
    }
    *weight_square += weights;
    *update_square += updates;
}

/* Pass 2: w <- w x decay_factor (when `decay`), then w += scale U. */
void adafactor_vector_apply(float *restrict param, const float *restrict grad, const float *restrict variance,
                            int64_t n, float square_floor, float decay_factor, int decay, float scale) {
    for (int64_t i = 0; i < n; i++) {
        float v = variance[i];
        float u = grad[i] * (1.0f / sqrtf(v < square_floor ? square_floor : v));
        param[i] = fmaf(u, scale, decay ? param[i] * decay_factor : param[i]);
    }
}

/* 1-bit compression (distributed/compressed.py's arithmetic, for optim/onebit_exchange.py):
   x's signs, 8 per byte (the first element in the highest bit, 1 for >= 0), at the scale
   ||x|| / sqrt(n) that gives them x's L2 norm; signs decoded as +-scale, exactly as
   torch's (+-1) x scale.

   One pass per compression: the signs do not depend on the scale, so they are packed in
   the pass that adds the input to the error buffer and sums its squares; what the
   compression loses (error -= +-scale) is taken off in the next compression's pass (or by
   `onebit_settle` when the buffer is read), from the signs and scale the caller keeps:
   the same operations in the same order as the torch path's, one pass later. */

#define ONEBIT_BLOCK 1024
/* 8 bytes of 0/1 read as a little-endian word, times this, have byte i's bit at bit 63 - i
   (distributed/compressed.py's `_PACK`: the other partial products never carry into the
   top byte). On a little-endian host; a big-endian one packs bit by bit. */
#define PACK_MULTIPLIER 0x8040201008040201ull

/* packed = positive's 0/1 bytes, 8 per byte (count: whole bytes). */
static void onebit_pack(const uint8_t *restrict positive, int64_t count, uint8_t *restrict packed) {
    for (int64_t byte = 0; byte < count / 8; byte++) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        uint64_t word;
        memcpy(&word, positive + 8 * byte, 8);
        packed[byte] = (uint8_t)((word * PACK_MULTIPLIER) >> 56);
#else
        unsigned bits = 0;
        for (int k = 0; k < 8; k++)
            bits |= (unsigned)positive[8 * byte + k] << (7 - k);
        packed[byte] = (uint8_t)bits;
#endif
    }
}

/* Every byte's eight signs as eight bytes of 0/1 (the first element's from the highest
   bit), filled when the library is loaded: a block's signs are unpacked a word per byte,
   then read as +-s by a loop the compiler vectorises (exact: +-s is +-1 x s). And every
   byte with its bits reversed (the first element's in bit 0): the AVX-512 blocks' lane
   masks, 16 elements from two bytes. */
static uint64_t bits_of_byte[256];
static uint8_t reversed_bits[256];

__attribute__((constructor)) static void fill_bits_of_byte(void) {
    for (int byte = 0; byte < 256; byte++) {
        uint8_t bits[8];
        unsigned reversed = 0;
        for (int k = 0; k < 8; k++) {
            bits[k] = (byte >> (7 - k)) & 1;
            reversed |= (unsigned)bits[k] << k;
        }
        memcpy(&bits_of_byte[byte], bits, 8);
        reversed_bits[byte] = (uint8_t)reversed;
    }
}

/* positive[t] = bit first + t of row (the first element in the highest bit), t < n. */
static void onebit_unpack(const uint8_t *restrict row, int64_t first, int64_t n, uint8_t *restrict positive) {
    int64_t t = 0;
    for (; t < n && (first + t) % 8; t++) /* to the next whole byte */
        positive[t] = (row[(first + t) / 8] >> (7 - (first + t) % 8)) & 1;
    for (; t + 8 <= n; t += 8)
        memcpy(positive + t, &bits_of_byte[row[(first + t) / 8]], 8);
    for (; t < n; t++)
        positive[t] = (row[(first + t) / 8] >> (7 - (first + t) % 8)) & 1;
}

/* Signs read as +-s (bit first + t of row for element t < n <= ONEBIT_BLOCK) and written
   to out, added to it or taken off it: the decode, the server's sum and the settling of
   what a compression lost. The portable loop unpacks the block's bits to bytes and
   selects; the AVX-512 one selects 16 lanes at once by a mask made of two or three bytes
   (a shift for a first bit inside a byte): in perf, unpacking and selecting had become
   the passes' largest cost once they read the momentum from signs. The same values either
   way: +-s exactly,
   added or subtracted as the portable loop does. The 8-bit kernels' switch
   (`avx512_enabled`, `use_avx512`) turns these blocks on and off too. */
enum onebit_use { ONEBIT_SET, ONEBIT_ADD, ONEBIT_SUBTRACT };

static void onebit_signed_portable(const uint8_t *restrict row, int64_t first, int64_t n, float s,
                                   float *restrict out, enum onebit_use use) {
    uint8_t positive[ONEBIT_BLOCK];
    onebit_unpack(row, first, n, positive);
    if (use == ONEBIT_SET)
        for (int64_t t = 0; t < n; t++)
            out[t] = positive[t] ? s : -s;
    else if (use == ONEBIT_ADD)
        for (int64_t t = 0; t < n; t++)
            out[t] += positive[t] ? s : -s;
    else
        for (int64_t t = 0; t < n; t++)
            out[t] -= positive[t] ? s : -s;
}

#ifdef HAVE_AVX512_PATH
/* The lane mask of elements t .. t + count - 1 (count <= 16) of a row from bit `first`:
   element k in bit k, from only the bytes that hold them. */
AVX512 static inline __attribute__((always_inline)) __mmask16 onebit_lanes_of(const uint8_t *restrict row,
                                                                              int64_t first, int64_t t,
                                                                              int64_t count) {
    const int64_t bit = first + t, shift = bit % 8;
    const uint8_t *restrict bytes = row + bit / 8;
    if (shift == 0 && count == 16)
        return (__mmask16)(reversed_bits[bytes[0]] | (unsigned)reversed_bits[bytes[1]] << 8);
    uint32_t word = 0;
    for (int64_t k = 0; k < (shift + count + 7) / 8; k++)
        word |= (uint32_t)reversed_bits[bytes[k]] << (8 * k);
    return (__mmask16)((word >> shift) & (count == 16 ? 0xFFFFu : (1u << count) - 1));
}

/* The lane mask of the 16 signs of elements t .. t + 15 of a row from bit first (bytes =
   row + first / 8, shift = first % 8), as `onebit_signed_vectors_avx512` reads them. */
AVX512 static inline __attribute__((always_inline)) __mmask16 onebit_vector_lanes(const uint8_t *restrict bytes,
                                                                                  int shift, int64_t t) {
    const uint8_t *restrict at = bytes + t / 8;
    uint32_t word = reversed_bits[at[0]] | (uint32_t)reversed_bits[at[1]] << 8;
    if (shift != 0)
        word = (word | (uint32_t)reversed_bits[at[2]] << 16) >> shift;
    return (__mmask16)word;
}

/* Whole vectors: the shift of the first element in its byte is the same for every vector
   (16 elements are two bytes), so each vector's mask is two table lookups, or three and a
   shift; `use` a constant where this is inlined, so each loop is branch-free. */
AVX512 static inline __attribute__((always_inline)) int64_t onebit_signed_vectors_avx512(
    const uint8_t *restrict row, int64_t first, int64_t n, __m512 plus, __m512 minus, float *restrict out,
    enum onebit_use use) {
    const uint8_t *restrict bytes = row + first / 8;
    const int shift = (int)(first % 8);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const uint8_t *restrict at = bytes + t / 8;
        uint32_t word = reversed_bits[at[0]] | (uint32_t)reversed_bits[at[1]] << 8;
        if (shift != 0)
            word = (word | (uint32_t)reversed_bits[at[2]] << 16) >> shift;
        const __m512 value = _mm512_mask_blend_ps((__mmask16)word, minus, plus);
        if (use == ONEBIT_SET)
            _mm512_storeu_ps(out + t, value);
        else if (use == ONEBIT_ADD)
            _mm512_storeu_ps(out + t, _mm512_add_ps(_mm512_loadu_ps(out + t), value));
        else
            _mm512_storeu_ps(out + t, _mm512_sub_ps(_mm512_loadu_ps(out + t), value));
    }
    return t;
}

AVX512 static void onebit_signed_avx512(const uint8_t *restrict row, int64_t first, int64_t n, float s,
                                        float *restrict out, enum onebit_use use) {
    const __m512 plus = _mm512_set1_ps(s), minus = _mm512_set1_ps(-s);
    int64_t t;
    if (use == ONEBIT_SET)
        t = onebit_signed_vectors_avx512(row, first, n, plus, minus, out, ONEBIT_SET);
    else if (use == ONEBIT_ADD)
        t = onebit_signed_vectors_avx512(row, first, n, plus, minus, out, ONEBIT_ADD);
    else
        t = onebit_signed_vectors_avx512(row, first, n, plus, minus, out, ONEBIT_SUBTRACT);
    if (t < n) { /* the last, partial vector */
        const int64_t count = n - t;
        const __mmask16 lanes = (__mmask16)((1u << count) - 1);
        const __m512 value = _mm512_mask_blend_ps(onebit_lanes_of(row, first, t, count), minus, plus);
        if (use == ONEBIT_SET)
            store_lanes(out + t, lanes, value);
        else if (use == ONEBIT_ADD)
            store_lanes(out + t, lanes, _mm512_add_ps(load_lanes(out + t, lanes), value));
        else
            store_lanes(out + t, lanes, _mm512_sub_ps(load_lanes(out + t, lanes), value));
    }
}
#endif

static void onebit_signed(const uint8_t *restrict row, int64_t first, int64_t n, float s, float *restrict out,
                          enum onebit_use use) {
#ifdef HAVE_AVX512_PATH
    if (avx512_enabled) {
        onebit_signed_avx512(row, first, n, s, out, use);
        return;
    }
#endif
    onebit_signed_portable(row, first, n, s, out, use);
}

/* error -= +-s by the signs `pending` (count elements, whole bytes): what a compression lost. */
static void onebit_settle_block(float *restrict error, const uint8_t *restrict pending, int64_t count, float s) {
    onebit_signed(pending, 0, count, s, error, ONEBIT_SUBTRACT);
}

/* error -= +-s by the signs `pending` of a compression of these n elements at scale s. */
void onebit_settle(float *restrict error, int64_t n, const uint8_t *restrict pending, float s) {
    for (int64_t start = 0; start < n; start += ONEBIT_BLOCK)
        onebit_settle_block(error + start, pending + start / 8, n - start < ONEBIT_BLOCK ? n - start : ONEBIT_BLOCK,
                            s);
}

/* packed = the signs of e (1 for e >= 0, NaN 0; count elements, whole bytes): the
   portable loops' (the AVX-512 ones pack each vector as they make it, `pack_vector_signs`). */
static void onebit_pack_signs(const float *restrict e, int64_t count, uint8_t *restrict packed) {
    uint8_t positive[ONEBIT_BLOCK];
    for (int64_t j = 0; j < count; j++)
        positive[j] = e[j] >= 0.0f;
    onebit_pack(positive, count, packed);
}

/* The first lines of a stream's page PREFETCH_BLOCKS blocks (of floats: 4 KB pages) ahead
   of a pass, asked for before the pass gets there. A core's hardware prefetcher follows a
   stream only within a 4 KB page and starts again at each new one; in the compressions'
   passes, each page's first misses of the error buffer waited in full. Asked for early,
   the page's translation and first lines are ready and the prefetcher is already running:
   on an Intel Xeon core (2 of a shared host) the server's pass took 0.6x the time, the
   worker's 0.85x. Asking for the gradient's pages too, or for whole pages, made the
   worker slower, as it did the LAMB passes. (Prefetches never fault: past an array's end
   they are dropped.) */
#define PREFETCH_BLOCKS 8
#define PREFETCH_LINES 4

static inline void prefetch_ahead(const float *stream, int write) {
    for (int line = 0; line < PREFETCH_LINES; line++) {
        if (write)
            __builtin_prefetch(stream + PREFETCH_BLOCKS * ONEBIT_BLOCK + 16 * line, 1, 3);
        else
            __builtin_prefetch(stream + PREFETCH_BLOCKS * ONEBIT_BLOCK + 16 * line, 0, 3);
    }
}

/* A compression's sum of squares, in one order that the AVX-512 loops and the portable
   ones share (so that their scales agree bit for bit): element t of the pass (from its
   first) adds its square, (double)e x (double)e, to lane t % 16, each lane in element
   order; the lanes are then added 0 to 15. */
#define SQUARE_LANES 16

static void add_squares(const float *restrict e, int64_t count, double *restrict lanes) {
    int64_t t = 0;
    for (; t + SQUARE_LANES <= count; t += SQUARE_LANES)
        for (int k = 0; k < SQUARE_LANES; k++)
            lanes[k] += (double)e[t + k] * (double)e[t + k];
    for (int k = 0; t + k < count; k++)
        lanes[k] += (double)e[t + k] * (double)e[t + k];
}

/* The scale of a compression of n elements from its lanes of squares: the norm from the
   double sum, rounded to fp32, divided as torch divides an fp32 norm by the Python float
   sqrt(n). */
static float compression_scale(const double *lanes, int64_t n) {
    double square = 0.0;
    for (int k = 0; k < SQUARE_LANES; k++)
        square += lanes[k];
    return (float)sqrt(square) / (float)sqrt((double)n);
}

/* The momentum fold's segments (`MomentumFolds`) read in ascending order: which of them
   holds a flat element, so that a pass knows what each run of elements adds to the
   error. */
typedef struct {
    int64_t segments, k;
    const int64_t *bounds, *grads;
    const float *factors;
} fold_cursor;

/* What the elements from flat index `at` add to the error, up to the returned end (at most
   `end`): x as it is (`beta1` 1, `grad` NULL, padding or no folds), x x beta1 (a segment
   without gradient), or fmaf(g, weight, x x beta1) with `grad` the gradient at `at`. */
enum fold_kind { FOLD_AS_IS, FOLD_DECAY, FOLD_GRADIENT };

static inline int64_t fold_run(fold_cursor *cursor, int64_t at, int64_t end, enum fold_kind *kind,
                               const float **grad, float *beta1, float *weight) {
    while (cursor->k < cursor->segments && cursor->bounds[2 * cursor->k + 1] <= at)
        cursor->k++;
    const int64_t k = cursor->k;
    if (k == cursor->segments || cursor->bounds[2 * k] >= end) {
        *kind = FOLD_AS_IS;
        return end;
    }
    if (cursor->bounds[2 * k] > at) { /* a gap before the segment */
        *kind = FOLD_AS_IS;
        return cursor->bounds[2 * k];
    }
    *beta1 = cursor->factors[2 * k];
    *weight = cursor->factors[2 * k + 1];
    *kind = cursor->grads[k] ? FOLD_GRADIENT : FOLD_DECAY;
    *grad = cursor->grads[k] ? (const float *)(intptr_t)cursor->grads[k] + (at - cursor->bounds[2 * k]) : NULL;
    return cursor->bounds[2 * k + 1] < end ? cursor->bounds[2 * k + 1] : end;
}

/* error += x's contribution over [0, n) of a run (`fold_run`): `momentum_fold`'s arithmetic
   (torch's mul_ then add_ with alpha, a fused multiply-add) added to the error. */
static inline float fold_add(float error, float x, enum fold_kind kind, float g, float beta1, float weight) {
    if (kind == FOLD_AS_IS)
        return error + x;
    if (kind == FOLD_DECAY)
        return error + x * beta1;
    return error + fmaf(g, weight, x * beta1);
}

static void onebit_worker_block_portable(const float *restrict x, const uint8_t *restrict known, int64_t first,
                                         float known_scale, float *restrict e, const uint8_t *restrict pending,
                                         float pending_scale, int64_t at, int64_t count, fold_cursor *cursor,
                                         double *restrict lanes, uint8_t *restrict packed) {
    if (pending != NULL)
        onebit_settle_block(e, pending, count, pending_scale);
    float decoded[ONEBIT_BLOCK];
    if (known != NULL)
        onebit_signed(known, first, count, known_scale, decoded, ONEBIT_SET);
    const float *restrict xs = known != NULL ? decoded : x;
    for (int64_t t = 0; t < count;) {
        enum fold_kind kind;
        const float *grad = NULL;
        float beta1 = 1.0f, weight = 0.0f;
        const int64_t until = fold_run(cursor, at + t, at + count, &kind, &grad, &beta1, &weight) - at;
        if (kind == FOLD_AS_IS)
            for (int64_t j = t; j < until; j++)
                e[j] = e[j] + xs[j];
        else if (kind == FOLD_DECAY)
            for (int64_t j = t; j < until; j++)
                e[j] = e[j] + xs[j] * beta1;
        else
            for (int64_t j = t; j < until; j++)
                e[j] = e[j] + fmaf(grad[j - t], weight, xs[j] * beta1);
        t = until;
    }
    add_squares(e, count, lanes);
    onebit_pack_signs(e, count, packed);
}

#ifdef HAVE_AVX512_PATH
/* The squares of a vector's lanes added to two 8-lane accumulators (lanes 0-7, 8-15). */
AVX512 static inline __attribute__((always_inline)) void add_vector_squares(__m512 e, __m512d *low, __m512d *high) {
    const __m512d below = _mm512_cvtps_pd(_mm512_castps512_ps256(e));
    const __m512d above = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    *low = _mm512_add_pd(*low, _mm512_mul_pd(below, below));
    *high = _mm512_add_pd(*high, _mm512_mul_pd(above, above));
}

/* The packed signs of a vector of 8 or 16 lanes (1 for >= 0, NaN 0), as
   `onebit_pack_signs` writes them. */
AVX512 static inline __attribute__((always_inline)) void pack_vector_signs(__m512 e, __mmask16 lanes,
                                                                          uint8_t *restrict packed) {
    const __mmask16 positive = _mm512_mask_cmp_ps_mask(lanes, e, _mm512_setzero_ps(), _CMP_GE_OQ);
    packed[0] = reversed_bits[positive & 0xFF];
    if (lanes == 0xFFFF)
        packed[1] = reversed_bits[positive >> 8];
}

/* A compression's vector of its error buffer (lanes `lanes` of e + t), less what the
   previous compression of it lost (its `pending` signs at +-scale; NULL for none). */
AVX512 static inline __attribute__((always_inline)) __m512 settled_vector(const float *restrict e,
                                                                         const uint8_t *restrict pending, int64_t t,
                                                                         int64_t width, __mmask16 lanes, __m512 plus,
                                                                         __m512 minus) {
    const __m512 error = load_lanes(e + t, lanes);
    if (pending == NULL)
        return error;
    return _mm512_sub_ps(error, _mm512_mask_blend_ps(onebit_lanes_of(pending, 0, t, width), minus, plus));
}

/* A compression's vector done: stored back to its error buffer, its squares summed (the
   unused lanes add +0), its signs packed. */
AVX512 static inline __attribute__((always_inline)) void finish_vector(float *restrict e, __mmask16 lanes,
                                                                      __m512 error, __m512d *low, __m512d *high,
                                                                      uint8_t *restrict packed) {
    store_lanes(e, lanes, error);
    add_vector_squares(_mm512_maskz_mov_ps(lanes, error), low, high);
    pack_vector_signs(error, lanes, packed);
}

/* The worker's block in one loop: each vector settled, its x read (or decoded from the
   known signs), its fold added, its squares summed and its signs packed while it is in
   registers, so the error and the gradient stream through together (the portable way
   makes four passes over the block, whose first waited on one stream at a time: on an
   Intel Xeon core the step's worker pass is about 10% shorter this way, both with their
   pages asked for ahead). A vector that spans two runs of the fold takes them element by
   element, with the same operations. */
AVX512 static void onebit_worker_block_avx512(const float *restrict x, const uint8_t *restrict known, int64_t first,
                                              float known_scale, float *restrict e, const uint8_t *restrict pending,
                                              float pending_scale, int64_t at, int64_t count, fold_cursor *cursor,
                                              double *restrict lanes, uint8_t *restrict packed) {
    const __m512 known_plus = _mm512_set1_ps(known_scale), known_minus = _mm512_set1_ps(-known_scale);
    const __m512 pending_plus = _mm512_set1_ps(pending_scale), pending_minus = _mm512_set1_ps(-pending_scale);
    const uint8_t *restrict known_bytes = known != NULL ? known + first / 8 : NULL;
    const int shift = (int)(first % 8);
    __m512d low = _mm512_loadu_pd(lanes), high = _mm512_loadu_pd(lanes + 8);
    enum fold_kind kind = FOLD_AS_IS;
    const float *grad = NULL;
    float beta1 = 1.0f, weight = 0.0f;
    int64_t run_start = 0, run_end = 0; /* the current run of the fold, block-relative */
    for (int64_t t = 0; t < count; t += 16) {
        const int64_t width = count - t < 16 ? count - t : 16;
        const __mmask16 lanes_used = width == 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
        __m512 error = settled_vector(e, pending, t, width, lanes_used, pending_plus, pending_minus);
        __m512 xv;
        if (known != NULL)
            xv = _mm512_mask_blend_ps(width == 16 ? onebit_vector_lanes(known_bytes, shift, t)
                                                  : onebit_lanes_of(known, first, t, width),
                                      known_minus, known_plus);
        else
            xv = load_lanes(x + t, lanes_used);
        if (t >= run_end) {
            run_start = t;
            run_end = fold_run(cursor, at + t, at + count, &kind, &grad, &beta1, &weight) - at;
        }
        if (t + width <= run_end) { /* the whole vector in one run */
            if (kind == FOLD_AS_IS)
                error = _mm512_add_ps(error, xv);
            else if (kind == FOLD_DECAY)
                error = _mm512_add_ps(error, _mm512_mul_ps(xv, _mm512_set1_ps(beta1)));
            else
                error = _mm512_add_ps(error, _mm512_fmadd_ps(load_lanes(grad + (t - run_start), lanes_used),
                                                             _mm512_set1_ps(weight),
                                                             _mm512_mul_ps(xv, _mm512_set1_ps(beta1))));
        } else { /* lane by lane across runs */
            float errors[16], xs[16];
            _mm512_storeu_ps(errors, error);
            _mm512_storeu_ps(xs, xv);
            for (int64_t j = 0; j < width; j++) {
                if (t + j >= run_end) {
                    run_start = t + j;
                    run_end = fold_run(cursor, at + t + j, at + count, &kind, &grad, &beta1, &weight) - at;
                }
                errors[j] = fold_add(errors[j], xs[j], kind, kind == FOLD_GRADIENT ? grad[t + j - run_start] : 0.0f,
                                     beta1, weight);
            }
            error = load_lanes(errors, lanes_used);
        }
        finish_vector(e + t, lanes_used, error, &low, &high, packed + t / 8);
    }
    _mm512_storeu_pd(lanes, low);
    _mm512_storeu_pd(lanes + 8, high);
}
#endif

/* The worker's compression of x (the momentum, or the vector exchanged) into one message
   per rank, with error feedback: chunk r (elements [r x chunk, (r + 1) x chunk), whole
   bytes) goes to rank r as packed + r x frame (its signs) and scales[r]. Error (indexed as
   x) first loses what the previous compression of those elements lost (pending + r x
   frame: its signs, pending NULL for none, at pending_scales[r]), then gains x. With
   segments, x is the momentum before the fold, which this pass applies: segment k
   (bounds[2k] .. bounds[2k + 1], ascending, disjoint, flat indices) folds its gradient
   grads[k] (its element 0 at bounds[2k]; 0: no gradient) with beta1 = factors[2k], weight
   = factors[2k + 1]; elements of no segment (padding) enter as they are. The folded
   momentum is never stored.
   With `known` non-NULL, chunk r of x is known to be +-known_scales[r] by the signs
   known + r x frame (the previous step's decoded average, which nothing has written
   since): it is read from those signs, 32 times fewer bytes than x's.
   Every chunk in one call; one after the other (advanced together, a block of each in
   turn, they took about 1.2x as long on an Intel Xeon core). */
void onebit_worker_compress(const float *restrict x, float *restrict error, int64_t chunk, int64_t ranks,
                            int64_t frame, int64_t segments, const int64_t *restrict bounds,
                            const int64_t *restrict grads, const float *restrict factors,
                            const uint8_t *restrict pending, const float *restrict pending_scales,
                            const uint8_t *restrict known, const float *restrict known_scales,
                            uint8_t *restrict packed, float *restrict scales) {
    for (int64_t rank = 0; rank < ranks; rank++) {
        const int64_t start = rank * chunk;
        const uint8_t *restrict signs = known != NULL ? known + rank * frame : NULL;
        const float known_scale = known != NULL ? known_scales[rank] : 0.0f;
        const float pending_scale = pending != NULL ? pending_scales[rank] : 0.0f;
        double lanes[SQUARE_LANES] = {0.0};
        fold_cursor cursor = {segments, 0, bounds, grads, factors};
        for (int64_t block = 0; block < chunk; block += ONEBIT_BLOCK) {
            const int64_t count = chunk - block < ONEBIT_BLOCK ? chunk - block : ONEBIT_BLOCK, at = start + block;
            prefetch_ahead(error + at, 1); /* (the gradient's too made the pass slower) */
            const uint8_t *restrict settled = pending != NULL ? pending + rank * frame + block / 8 : NULL;
#ifdef HAVE_AVX512_PATH
            if (avx512_enabled) {
                onebit_worker_block_avx512(x + at, signs, block, known_scale, error + at, settled, pending_scale, at,
                                           count, &cursor, lanes, packed + rank * frame + block / 8);
                continue;
            }
#endif
            onebit_worker_block_portable(x + at, signs, block, known_scale, error + at, settled, pending_scale, at,
                                         count, &cursor, lanes, packed + rank * frame + block / 8);
        }
        scales[rank] = compression_scale(lanes, chunk);
    }
}

/* The server's average of n <= ONEBIT_BLOCK elements of the received rows into sum: their
   signs at their scales summed in row order, each added to the sum so far as torch's add
   with alpha adds it, then divided by the row count (multiplied by its inverse where the
   count is a power of two: the same value, as a power of two's inverse is exact). */
static void onebit_server_block_portable(const uint8_t *restrict incoming, int64_t stride,
                                         const float *restrict scales, int64_t rows, float *restrict e,
                                         const uint8_t *restrict pending, float pending_scale, int64_t count,
                                         double *restrict lanes, uint8_t *restrict packed) {
    const float divisor = (float)rows, inverse = 1.0f / divisor;
    const int exact_inverse = (rows & (rows - 1)) == 0;
    if (pending != NULL)
        onebit_settle_block(e, pending, count, pending_scale);
    float sum[ONEBIT_BLOCK];
    onebit_signed(incoming, 0, count, scales[0], sum, ONEBIT_SET);
    for (int64_t r = 1; r < rows; r++)
        onebit_signed(incoming + r * stride, 0, count, scales[r], sum, ONEBIT_ADD);
    if (exact_inverse)
        for (int64_t j = 0; j < count; j++)
            e[j] = e[j] + sum[j] * inverse;
    else
        for (int64_t j = 0; j < count; j++)
            e[j] = e[j] + sum[j] / divisor;
    add_squares(e, count, lanes);
    onebit_pack_signs(e, count, packed);
}

#ifdef HAVE_AVX512_PATH
/* The server's block in one loop, as the worker's: each vector settled, the rows' signs
   summed into it, its squares and signs taken in registers. */
AVX512 static void onebit_server_block_avx512(const uint8_t *restrict incoming, int64_t stride,
                                              const float *restrict scales, int64_t rows, float *restrict e,
                                              const uint8_t *restrict pending, float pending_scale, int64_t count,
                                              double *restrict lanes, uint8_t *restrict packed) {
    const __m512 divisor = _mm512_set1_ps((float)rows), inverse = _mm512_set1_ps(1.0f / (float)rows);
    const int exact_inverse = (rows & (rows - 1)) == 0;
    const __m512 pending_plus = _mm512_set1_ps(pending_scale), pending_minus = _mm512_set1_ps(-pending_scale);
    __m512d low = _mm512_loadu_pd(lanes), high = _mm512_loadu_pd(lanes + 8);
    for (int64_t t = 0; t < count; t += 16) {
        const int64_t width = count - t < 16 ? count - t : 16;
        const __mmask16 lanes_used = width == 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
        __m512 error = settled_vector(e, pending, t, width, lanes_used, pending_plus, pending_minus);
        __m512 sum = _mm512_mask_blend_ps(onebit_lanes_of(incoming, 0, t, width), _mm512_set1_ps(-scales[0]),
                                          _mm512_set1_ps(scales[0]));
        for (int64_t r = 1; r < rows; r++)
            sum = _mm512_add_ps(sum, _mm512_mask_blend_ps(onebit_lanes_of(incoming + r * stride, 0, t, width),
                                                          _mm512_set1_ps(-scales[r]), _mm512_set1_ps(scales[r])));
        error = _mm512_add_ps(error, exact_inverse ? _mm512_mul_ps(sum, inverse) : _mm512_div_ps(sum, divisor));
        finish_vector(e + t, lanes_used, error, &low, &high, packed + t / 8);
    }
    _mm512_storeu_pd(lanes, low);
    _mm512_storeu_pd(lanes + 8, high);
}
#endif

/* The server's compression of the average of the received rows (never stored), with
   error feedback as the worker's. */
void onebit_server_compress(const uint8_t *restrict incoming, int64_t stride, const float *restrict scales,
                            int64_t rows, int64_t n, float *restrict error, const uint8_t *restrict pending,
                            float pending_scale, uint8_t *restrict packed, float *scale) {
    double lanes[SQUARE_LANES] = {0.0};
    for (int64_t block = 0; block < n; block += ONEBIT_BLOCK) {
        const int64_t count = n - block < ONEBIT_BLOCK ? n - block : ONEBIT_BLOCK;
        const uint8_t *restrict settled = pending != NULL ? pending + block / 8 : NULL;
        prefetch_ahead(error + block, 1);
#ifdef HAVE_AVX512_PATH
        if (avx512_enabled) {
            onebit_server_block_avx512(incoming + block / 8, stride, scales, rows, error + block, settled,
                                       pending_scale, count, lanes, packed + block / 8);
            continue;
        }
#endif
        onebit_server_block_portable(incoming + block / 8, stride, scales, rows, error + block, settled,
                                     pending_scale, count, lanes, packed + block / 8);
    }
    *scale = compression_scale(lanes, n);
}

#ifdef HAVE_AVX512_PATH
/* Adam's denominator d(x) = sqrt(x) + eps, or sqrt(x + eps) inside the root, as
   `adam_direction` computes it. */
AVX512 static inline __attribute__((always_inline)) __m512 adam_denominator(__m512 x, __m512 epsilon,
                                                                           int eps_inside_sqrt) {
    return eps_inside_sqrt ? _mm512_sqrt_ps(_mm512_add_ps(x, epsilon)) : _mm512_add_ps(_mm512_sqrt_ps(x), epsilon);
}

/* The decode and 1-bit Adam / LAMB's update of n <= ONEBIT_BLOCK elements of one rank's
   chunk in one loop: each vector's average +-s from its lane mask, written to the
   momentum, and the update w += scale x (m / d(v) + weight_decay x w) computed from it in
   registers (the same operations as `adam_direction`). The momentum is written by
   streaming stores where it is aligned: nothing reads it before the next step, and its
   lines are then not read from memory before they are written (on an Intel Xeon core,
   1-bit LAMB's step 0.7 ms shorter). */
AVX512 static void onebit_decode_update_avx512(const uint8_t *restrict row, int64_t first, int64_t n, float s,
                                               float *restrict m, const float *restrict v, float *restrict w,
                                               float scale, float eps, float weight_decay, int eps_inside_sqrt) {
    const __m512 plus = _mm512_set1_ps(s), minus = _mm512_set1_ps(-s), epsilon = _mm512_set1_ps(eps);
    const __m512 decay = _mm512_set1_ps(weight_decay), step = _mm512_set1_ps(scale);
    for (int64_t t = 0; t < n;) {
        int64_t width = n - t < 16 ? n - t : 16;
        const uintptr_t misaligned = (uintptr_t)(m + t) & 63;
        if (misaligned != 0 && misaligned % 4 == 0) { /* up to the momentum's next aligned element */
            const int64_t to = (int64_t)((64 - misaligned) / 4);
            width = width < to ? width : to;
        }
        const __mmask16 lanes = width == 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
        const __m512 average = _mm512_mask_blend_ps(onebit_lanes_of(row, first, t, width), minus, plus);
        const __m512 variance = load_lanes(v + t, lanes), weights = load_lanes(w + t, lanes);
        __m512 update = _mm512_div_ps(average, adam_denominator(variance, epsilon, eps_inside_sqrt));
        if (weight_decay != 0.0f)
            update = _mm512_fmadd_ps(weights, decay, update);
        store_lanes(w + t, lanes, _mm512_add_ps(weights, _mm512_mul_ps(update, step)));
        if (misaligned == 0 && width == 16)
            _mm512_stream_ps(m + t, average);
        else
            store_lanes(m + t, lanes, average);
        t += width;
    }
}
#endif

/* The gathered signs of flat elements [start, start + n) decoded into m (m[0] is element
   `start`; rank r's chunk of `chunk` elements from packed + r x stride at scales[r]), and,
   with param non-NULL, 1-bit Adam's update in the same pass (`lamb_apply`'s arithmetic:
   param += scale x (m / d(v) + weight_decay x param)): the decoded momentum read back by
   no second pass. */
void onebit_decode_apply(const uint8_t *restrict packed, int64_t stride, const float *restrict scales, int64_t chunk,
                         int64_t start, int64_t n, float *restrict m, const float *restrict v, float *restrict param,
                         float scale, float eps, float weight_decay, int eps_inside_sqrt) {
    for (int64_t i = 0; i < n;) { /* blocks within one rank's chunk */
        const int64_t flat = start + i, r = flat / chunk, first = flat % chunk;
        int64_t length = n - i < chunk - first ? n - i : chunk - first;
        length = length < ONEBIT_BLOCK ? length : ONEBIT_BLOCK;
        float *restrict out = m + i;
#ifdef HAVE_AVX512_PATH
        if (avx512_enabled && param != NULL) {
            onebit_decode_update_avx512(packed + r * stride, first, length, scales[r], out, v + i, param + i, scale,
                                        eps, weight_decay, eps_inside_sqrt);
            i += length;
            continue;
        }
#endif
        onebit_signed(packed + r * stride, first, length, scales[r], out, ONEBIT_SET);
        if (param != NULL) {
            float *restrict w = param + i;
            const float *restrict variance = v + i;
            for (int64_t j = 0; j < length; j++)
                w[j] += adam_direction(w[j], out[j], variance[j], eps, weight_decay, eps_inside_sqrt) * scale;
        }
        i += length;
    }
#ifdef HAVE_AVX512_PATH
    _mm_sfence(); /* the streamed momentum ordered before what follows */
#endif
}

/* `onebit_decode_apply` over 1-bit Adam's trained tensors in one call (no call per tensor
   from Python): tensor k starts at flat index table[4k], has table[4k + 1] elements, its
   variance at address table[4k + 2] and weights at table[4k + 3]; settings[3k .. 3k + 2]
   its scale, eps and weight decay, eps_inside_sqrt[k] its flag; momentum the flat one. */
void onebit_decode_adam_apply(const uint8_t *restrict packed, int64_t stride, const float *restrict scales,
                              int64_t chunk, float *restrict momentum, int64_t tensors, const int64_t *restrict table,
                              const float *restrict settings, const int32_t *restrict eps_inside_sqrt) {
    for (int64_t k = 0; k < tensors; k++) {
        const int64_t start = table[4 * k];
        onebit_decode_apply(packed, stride, scales, chunk, start, table[4 * k + 1], momentum + start,
                            (const float *)(intptr_t)table[4 * k + 2], (float *)(intptr_t)table[4 * k + 3],
                            settings[3 * k], settings[3 * k + 1], settings[3 * k + 2], eps_inside_sqrt[k]);
    }
}

/* m <- m x beta1 + weight x g (weight = 1 - beta1; g NULL: no gradient), torch's mul_ then
   add_ with alpha (a fused multiply-add). */
void momentum_fold(float *restrict m, const float *restrict g, int64_t n, float beta1, float weight) {
    if (g == NULL) {
        for (int64_t i = 0; i < n; i++)
            m[i] *= beta1;
        return;
    }
    for (int64_t i = 0; i < n; i++)
        m[i] = fmaf(g[i], weight, m[i] * beta1);
}

/* 1-bit LAMB after its warm-up, the statistics pass (optim/onebit_lamb.py): the gradient
   reconstructed from the exchanged momentum m and the previous one, g = (m - beta1 last) /
   (1 - beta1); the fresh variance advanced, f <- f beta2 + (1 - beta2) g g; out[0] =
   max(out[0], max of d(v) / d(f)) with d Adam's denominator (NaN kept, as torch's max
   keeps it); with weight decay, out[1] += sum p^2 and out[2] += sum u^2 of p = m / d(v)
   and u = p + weight_decay w. */
static inline __attribute__((always_inline)) void onebit_lamb_statistics_body(
    const float *restrict param, const float *restrict m, const float *restrict last, const float *restrict v,
    float *restrict fresh, int64_t n, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
    int eps_inside_sqrt, int decay, float weight_decay, int tabled, const float *restrict table, double *out) {
    float maximum = -INFINITY;
    int nan = 0;
    double preliminary_square = 0.0, update_square = 0.0;
    const float t00 = tabled ? table[0] : 0.0f, t01 = tabled ? table[1] : 0.0f;
    const float t10 = tabled ? table[2] : 0.0f, t11 = tabled ? table[3] : 0.0f;
#pragma omp simd reduction(max : maximum) reduction(| : nan) reduction(+ : preliminary_square, update_square)
    for (int64_t i = 0; i < n; i++) {
        float f;
        if (tabled) { /* (1 - beta2) g g of the four pairs of signs, computed as below */
            const int later = last[i] >= 0.0f;
            f = fresh[i] * beta2 + (m[i] >= 0.0f ? (later ? t11 : t10) : (later ? t01 : t00));
        } else {
            float g = (m[i] - beta1 * last[i]) / one_minus_beta1;
            f = fresh[i] * beta2 + one_minus_beta2 * g * g;
        }
        fresh[i] = f;
        float d = eps_inside_sqrt ? sqrtf(v[i] + eps) : sqrtf(v[i]) + eps;
        float ratio = d / (eps_inside_sqrt ? sqrtf(f + eps) : sqrtf(f) + eps);
        maximum = maximum > ratio ? maximum : ratio;
        nan |= ratio != ratio;
        if (decay) { /* the norms only weight decay needs: without it, no third division */
            float p = m[i] / d;
            float u = fmaf(param[i], weight_decay, p);
            preliminary_square += (double)p * p;
            update_square += (double)u * u;
        }
    }
    double found = nan ? NAN : (double)maximum;
    out[0] = out[0] != out[0] || found != found ? NAN : (found > out[0] ? found : out[0]);
    if (decay) {
        out[1] += preliminary_square;
        out[2] += update_square;
    }
}

/* With `table` (m and last each +-a scale: the decode pass's case), (1 - beta2) g g comes
   from the table of its four values by the signs of m and last, computed once per block
   with the same operations: the same fresh variance without a division per element. */
static void onebit_lamb_statistics_cases(const float *restrict param, const float *restrict m,
                                         const float *restrict last, const float *restrict v, float *restrict fresh,
                                         int64_t n, float beta1, float one_minus_beta1, float beta2,
                                         float one_minus_beta2, float eps, int eps_inside_sqrt, float weight_decay,
                                         const float *restrict table, double *out) {
    /* one loop per case, each vectorised without a branch */
#define ONEBIT_LAMB_STATISTICS(inside, decay, tabled)                                                                  \
    onebit_lamb_statistics_body(param, m, last, v, fresh, n, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,      \
                                inside, decay, weight_decay, tabled, table, out)
#define ONEBIT_LAMB_STATISTICS_TABLED(inside, decay)                                                                   \
    if (table != NULL)                                                                                                 \
        ONEBIT_LAMB_STATISTICS(inside, decay, 1);                                                                      \
    else                                                                                                               \
        ONEBIT_LAMB_STATISTICS(inside, decay, 0)
    if (weight_decay != 0.0f) {
        if (eps_inside_sqrt) {
            ONEBIT_LAMB_STATISTICS_TABLED(1, 1);
        } else {
            ONEBIT_LAMB_STATISTICS_TABLED(0, 1);
        }
    } else {
        if (eps_inside_sqrt) {
            ONEBIT_LAMB_STATISTICS_TABLED(1, 0);
        } else {
            ONEBIT_LAMB_STATISTICS_TABLED(0, 0);
        }
    }
#undef ONEBIT_LAMB_STATISTICS_TABLED
#undef ONEBIT_LAMB_STATISTICS
}

void onebit_lamb_statistics(const float *restrict param, const float *restrict m, const float *restrict last,
                            const float *restrict v, float *restrict fresh, int64_t n, float beta1,
                            float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                            int eps_inside_sqrt, float weight_decay, double *out) {
    onebit_lamb_statistics_cases(param, m, last, v, fresh, n, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                                 eps_inside_sqrt, weight_decay, NULL, out);
}

#ifdef HAVE_AVX512_PATH
/* `adam_denominator` from 14-bit approximations: within 2^-12 of d(x) (relative), 0 at
   0, +inf at +inf, NaN at NaN and below 0. */
AVX512 static inline __attribute__((always_inline)) __m512 approximate_denominator(__m512 x, __m512 epsilon,
                                                                                  int eps_inside_sqrt) {
    if (eps_inside_sqrt)
        return _mm512_rcp14_ps(_mm512_rsqrt14_ps(_mm512_add_ps(x, epsilon)));
    return _mm512_add_ps(_mm512_rcp14_ps(_mm512_rsqrt14_ps(x)), epsilon);
}

/* 1-bit LAMB's statistics pass without weight decay where both momenta are decoded signs
   at positive scales (the decode pass's usual case), over n <= ONEBIT_BLOCK elements: the
   fresh variance f <- f beta2 + table[2 (average >= 0) + (last >= 0)] and out[0] =
   max(out[0], max of d(v) / d(f)), the same operations as `onebit_lamb_statistics_body`,
   with each element's pair of signs read as lane masks straight from the two rows: the
   portable way (both rows decoded into buffers, then compared with zero) took 1.4x as
   long on this pass.
   Only the largest ratio matters, so a vector's ratios are computed exactly (two square
   roots and a division per element, which held the pass on an Intel Xeon core) only
   where an estimate from approximate square roots could reach the largest so far: the
   estimate's numerator, raised by 2^-9, against the largest times its denominator, where
   each is within 2^-11 of the exact one. Below that, a ratio is below the largest, and
   the result is the same bit for bit. A comparison with NaN, an infinity or a zero counts
   as reaching, so those lanes are computed exactly. */
AVX512 static void onebit_lamb_signs_maximum_avx512(const uint8_t *restrict average, const uint8_t *restrict last,
                                                    int64_t first, int64_t n, const float *restrict v,
                                                    float *restrict fresh, float beta2, float eps, int eps_inside_sqrt,
                                                    const float *restrict table, double *out) {
    const uint8_t *restrict average_bytes = average + first / 8, *restrict last_bytes = last + first / 8;
    const int shift = (int)(first % 8);
    const __m512 t00 = _mm512_set1_ps(table[0]), t01 = _mm512_set1_ps(table[1]);
    const __m512 t10 = _mm512_set1_ps(table[2]), t11 = _mm512_set1_ps(table[3]);
    const __m512 decay = _mm512_set1_ps(beta2), epsilon = _mm512_set1_ps(eps);
    const __m512 raised = _mm512_set1_ps(1.0f + 0x1p-9f);
    /* the largest so far: out[0] is a float's value (or 0, or NaN, which makes every lane reach) */
    __m512 maximum = _mm512_set1_ps((float)out[0]);
    __mmask16 nan = 0;
    for (int64_t t = 0; t < n; t += 16) {
        const int64_t count = n - t < 16 ? n - t : 16;
        const __mmask16 lanes = count == 16 ? 0xFFFF : (__mmask16)((1u << count) - 1);
        const __mmask16 positive = count == 16 ? onebit_vector_lanes(average_bytes, shift, t)
                                               : onebit_lanes_of(average, first, t, count);
        const __mmask16 later = count == 16 ? onebit_vector_lanes(last_bytes, shift, t)
                                            : onebit_lanes_of(last, first, t, count);
        const __m512 added = _mm512_mask_blend_ps(positive, _mm512_mask_blend_ps(later, t00, t01),
                                                  _mm512_mask_blend_ps(later, t10, t11));
        const __m512 f = _mm512_add_ps(_mm512_mul_ps(load_lanes(fresh + t, lanes), decay), added);
        store_lanes(fresh + t, lanes, f);
        const __m512 xv = load_lanes(v + t, lanes);
        const __m512 reach = _mm512_mul_ps(approximate_denominator(xv, epsilon, eps_inside_sqrt), raised);
        const __m512 bar = _mm512_mul_ps(maximum, approximate_denominator(f, epsilon, eps_inside_sqrt));
        const __mmask16 candidates = _mm512_mask_cmp_ps_mask(lanes, reach, bar, _CMP_NLT_UQ);
        if (candidates == 0)
            continue;
        const __m512 ratio = _mm512_div_ps(adam_denominator(xv, epsilon, eps_inside_sqrt),
                                           adam_denominator(f, epsilon, eps_inside_sqrt));
        nan |= _mm512_mask_cmp_ps_mask(candidates, ratio, ratio, _CMP_UNORD_Q);
        maximum = _mm512_mask_max_ps(maximum, candidates, maximum, ratio);
    }
    const double found = nan ? NAN : (double)_mm512_reduce_max_ps(maximum);
    out[0] = out[0] != out[0] || found != found ? NAN : (found > out[0] ? found : out[0]);
}
#endif

/* 1-bit LAMB's statistics pass on the gathered signs: the average decoded block by block
   (as `onebit_decode_apply`) into a buffer in cache, against the previous momentum m (a
   tensor's view of the flat momentum from flat index start), which is only read: the
   average is written by the update's pass (`onebit_decode_apply`), so the previous
   momentum needs no copy. With `known` non-NULL the previous momentum is known to be the
   decode of those gathered signs at `known_scales` (the same layout as `packed`) and is
   read from them, not from m; without weight decay, on AVX-512, straight from both rows
   of signs (`onebit_lamb_signs_maximum_avx512`). */
void onebit_lamb_decode_statistics(const uint8_t *restrict packed, int64_t stride, const float *restrict scales,
                                   int64_t chunk, int64_t start, const float *restrict param,
                                   const float *restrict m, const uint8_t *restrict known,
                                   const float *restrict known_scales, const float *restrict v,
                                   float *restrict fresh, int64_t n, float beta1, float one_minus_beta1, float beta2,
                                   float one_minus_beta2, float eps, int eps_inside_sqrt, float weight_decay,
                                   double *out) {
    for (int64_t i = 0; i < n;) { /* blocks within one rank's chunk */
        const int64_t flat = start + i, r = flat / chunk, first = flat % chunk;
        int64_t length = n - i < chunk - first ? n - i : chunk - first;
        length = length < ONEBIT_BLOCK ? length : ONEBIT_BLOCK;
        float average[ONEBIT_BLOCK], last[ONEBIT_BLOCK], table[4];
        if (known != NULL)
            for (int pair = 0; pair < 4; pair++) { /* index 2 x (average >= 0) + (last >= 0) */
                const float a = pair & 2 ? scales[r] : -scales[r], l = pair & 1 ? known_scales[r] : -known_scales[r];
                const float g = (a - beta1 * l) / one_minus_beta1;
                table[pair] = one_minus_beta2 * g * g;
            }
#ifdef HAVE_AVX512_PATH
        /* positive scales: an element's sign bit is then whether its value is >= 0 */
        if (avx512_enabled && known != NULL && weight_decay == 0.0f && scales[r] > 0.0f && known_scales[r] > 0.0f) {
            onebit_lamb_signs_maximum_avx512(packed + r * stride, known + r * stride, first, length, v + i, fresh + i,
                                             beta2, eps, eps_inside_sqrt, table, out);
            i += length;
            continue;
        }
#endif
        onebit_signed(packed + r * stride, first, length, scales[r], average, ONEBIT_SET);
        if (known != NULL)
            onebit_signed(known + r * stride, first, length, known_scales[r], last, ONEBIT_SET);
        onebit_lamb_statistics_cases(param + i, average, known != NULL ? last : m + i, v + i, fresh + i, length,
                                     beta1, one_minus_beta1, beta2, one_minus_beta2, eps, eps_inside_sqrt,
                                     weight_decay, known != NULL ? table : NULL, out);
        i += length;
    }
}

/* Python's max(a, b) and min(a, b) for floats (the first unless the second is larger, or
   smaller), NaN kept where Python keeps it: optim/onebit_lamb.py's `_bounded_factor` here. */
static inline double python_max(double a, double b) { return b > a ? b : a; }
static inline double python_min(double a, double b) { return b < a ? b : a; }

/* 1-bit LAMB's compressed step on the gathered signs over all of its trained tensors in
   one call (no call per tensor from Python; optim/onebit_lamb.py `_decode_step_by_tensor`):
   per tensor its statistics pass (`onebit_lamb_decode_statistics`), its update's scale
   from them (`_update_scale` and `_bounded_factor`'s arithmetic, in double precision as
   Python's floats, the scale then rounded to float as a float argument is), and its
   update's pass (`onebit_decode_apply`), which finds the tensor's variance where the
   first pass left it in cache. Tensor k: table[6k .. 6k + 5] its first flat index in the
   momentum, element count, the addresses of its weights, variance and fresh variance, and
   eps_inside_sqrt; settings[10k .. 10k + 9] its step size, lamb_coeff_freeze, last factor
   (replaced by the new one), beta1, beta2, eps, weight decay, factor_min, factor_max and
   factor_threshold. momentum: the flat momentum; known, known_scales as in
   `onebit_lamb_decode_statistics` (NULL: the momentum read from memory). */
void onebit_lamb_decode_steps(const uint8_t *restrict packed, int64_t stride, const float *restrict scales,
                              int64_t chunk, float *restrict momentum, const uint8_t *restrict known,
                              const float *restrict known_scales, int64_t tensors, const int64_t *restrict table,
                              double *restrict settings) {
    for (int64_t k = 0; k < tensors; k++) {
        const int64_t *row = table + 6 * k;
        double *s = settings + 10 * k;
        const int64_t start = row[0], n = row[1];
        float *param = (float *)(intptr_t)row[2], *fresh = (float *)(intptr_t)row[4];
        const float *variance = (const float *)(intptr_t)row[3];
        const int eps_inside_sqrt = (int)row[5];
        const double beta1 = s[3], beta2 = s[4], eps = s[5], weight_decay = s[6];
        double statistics[3] = {0.0, 0.0, 0.0};
        onebit_lamb_decode_statistics(packed, stride, scales, chunk, start, param, momentum + start, known,
                                      known_scales, variance, fresh, n, (float)beta1, (float)(1.0 - beta1),
                                      (float)beta2, (float)(1.0 - beta2), (float)eps, eps_inside_sqrt,
                                      (float)weight_decay, statistics);
        double share = 1.0;
        if (weight_decay != 0.0) { /* weight decay's share of the update is not rescaled */
            const double preliminary = sqrt(statistics[1]), update = sqrt(statistics[2]);
            share = update != 0.0 ? python_min(1.0, preliminary / update) : 1.0;
        }
        const double last = s[2], threshold = s[9];
        double factor = statistics[0] * share + (1.0 - share);
        factor = python_min(python_max(factor, s[7]), s[8]);
        factor = python_min(python_max(factor, last * (1.0 - threshold)), last * (1.0 + threshold));
        s[2] = factor;
        const double scale = -s[0] * s[1] * factor;
        onebit_decode_apply(packed, stride, scales, chunk, start, n, momentum + start, variance, param, (float)scale,
                            (float)eps, (float)weight_decay, eps_inside_sqrt);
    }
}
