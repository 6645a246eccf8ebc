/* SBC's CPU kernels: exact selection, binarization sums, Golomb-Rice encoding and decoding.
 *
 * Plain C99 on raw arrays (no Python, torch or numpy headers), loaded with ctypes by
 * horovod_sbc/kernels/__init__.py, which documents every function. The bytes and numbers these
 * kernels produce are those of the numpy reference (horovod_sbc/wire.py is the format's
 * specification, horovod_sbc/core.py the selection's); tests/golden and tests/test_differential.py
 * pin them. Compiled without -ffast-math and with -ffp-contract=off: every float operation is
 * the IEEE one the reference performs, in the same order.
 *
 * Safety: the decoder reads only inside the byte ranges it is given and writes only into the
 * caller's arrays, whatever the bytes say; a range that does not fit is reported, not read.
 */
#include <math.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX512 1 /* compiled for any x86-64 (target attribute), used if the CPU has it */
#endif
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
typedef uint64_t u64;
typedef uint32_t u32;
typedef unsigned __int128 u128;

#define SBC_OK 0
#define SBC_NONFINITE 1
#define SBC_NOMEM -1
#define SBC_BADARG -2

/* ------------------------------------------------------------------------------------------ */
/* candidates: growable (position, key) arrays                                                  */
/* ------------------------------------------------------------------------------------------ */
/* A selection side ranks non-negative scores: x (positive side, x > 0), -x (negative side,
 * x < 0) or |x| (magnitude). For non-negative floats the IEEE bit pattern, read as an unsigned
 * integer, orders exactly like the value, so candidates carry their score as that u32 key and
 * the exact k-th largest is found by a radix select on the keys. */
typedef struct {
    u32 *pos; /* positions fit in 32 bits: sbc_select takes tensors of fewer than 2^32 elements */
    u32 *key;
    i64 n, cap;
} cands;

static int cands_reserve(cands *a, i64 extra) {
    if (a->n + extra <= a->cap) return 1;
    i64 cap = a->cap ? a->cap : 4096;
    while (cap < a->n + extra) cap *= 2;
    u32 *p = (u32 *)realloc(a->pos, (size_t)cap * sizeof(u32));
    if (!p) return 0;
    a->pos = p;
    u32 *k = (u32 *)realloc(a->key, (size_t)cap * sizeof(u32));
    if (!k) return 0;
    a->key = k;
    a->cap = cap;
    return 1;
}

/* Scratch kept per thread between calls: sized by the largest tensor seen, so a training step
 * does not page-fault fresh buffers for every tensor (that alone cost about one torch.add of
 * the tensor at density 0.05). sbc_release() frees it. */
typedef struct {
    void *p;
    size_t cap;
} scratch;

static void *grow(scratch *b, size_t bytes) {
    if (bytes == 0) bytes = 1;
    if (b->cap < bytes) {
        free(b->p);
        b->p = malloc(bytes);
        b->cap = b->p ? bytes : 0;
    }
    return b->p;
}

static __thread struct {
    cands p, q;
    scratch sample, tmp, vals, tree, out[2], dpos;
    i64 count[2], dcount;
} TLS;

void sbc_release(void) {
    free(TLS.p.pos);
    free(TLS.p.key);
    free(TLS.q.pos);
    free(TLS.q.key);
    scratch *all[] = {&TLS.sample, &TLS.tmp, &TLS.vals, &TLS.tree, &TLS.out[0], &TLS.out[1],
                      &TLS.dpos};
    for (int i = 0; i < 7; i++) free(all[i]->p);
    memset(&TLS, 0, sizeof(TLS));
}

static inline u32 fbits(float x) {
    u32 u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float bitsf(u32 u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* side scores: the value ranked by each selection side */
enum { SIDE_POS = 0, SIDE_NEG = 1, SIDE_ABS = 2 };

/* ------------------------------------------------------------------------------------------ */
/* exact k-th largest key (radix select: 11 + 11 + 10 bits)                                     */
/* ------------------------------------------------------------------------------------------ */
/* The element of ascending rank t of v[0..n), v reordered (quickselect, three-way partition,
 * pseudo-random pivots: expected linear time whatever the keys). */
static u32 nth_key(u32 *v, i64 n, i64 t) {
    i64 lo = 0, hi = n;
    u64 seed = 0x9E3779B97F4A7C15ull;
    while (hi - lo > 1) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        u32 pv = v[lo + (i64)(seed % (u64)(hi - lo))];
        i64 lt = lo, i = lo, gt = hi;
        while (i < gt) {
            u32 x = v[i];
            if (x < pv) {
                v[i++] = v[lt];
                v[lt++] = x;
            } else if (x > pv) {
                v[i] = v[--gt];
                v[gt] = x;
            } else {
                i++;
            }
        }
        if (t < lt)
            hi = lt;
        else if (t >= gt)
            lo = gt;
        else
            return pv;
    }
    return v[lo];
}

#define SMALL_SELECT 1024 /* below this a quickselect beats another radix level (whose
                           * histograms are cleared only over the range's buckets) */

#if defined(HAVE_AVX512)
static int simd_level(void);

/* kth_largest_key's compaction for 16 keys at a time: the keys of src[0..n) in the bucket
 * ((x - lo) >> sh == bucket) packed in order into tmp at *m_io by vpcompressd (tmp may be src:
 * the 16 keys are loaded before their packed ones are stored, at or below them; tmp holds n).
 * The scalar loop's chain (the next store's address waits for this key's compare) took 40 % of
 * the radix select. Returns the keys consumed (a multiple of 16); *m_io advances by the kept. */
__attribute__((target("avx512f"), noinline)) static i64 keep_bucket_avx512(
    const u32 *src, i64 n, u32 lo, int sh, u32 bucket, u32 *tmp, i64 *m_io) {
    const __m512i vlo = _mm512_set1_epi32((int)lo), vb = _mm512_set1_epi32((int)bucket);
    const __m128i vsh = _mm_cvtsi32_si128(sh);
    i64 i = 0, m = *m_io;
    for (; i + 16 <= n; i += 16) {
        __m512i x = _mm512_loadu_si512((const void *)(src + i));
        __mmask16 keep = _mm512_cmpeq_epi32_mask(
            _mm512_srl_epi32(_mm512_sub_epi32(x, vlo), vsh), vb);
        /* a full store of the packed lanes (vpcompressd into memory is microcoded on some
         * CPUs): tmp[m .. m + 16) with m <= i lies within src[0 .. i + 16), already loaded */
        _mm512_storeu_si512((void *)(tmp + m), _mm512_maskz_compress_epi32(keep, x));
        m += __builtin_popcount(keep);
    }
    *m_io = m;
    return i;
}
#endif

/* The k-th largest of keys[0..c) (1 <= k <= c), every key in [lo, hi]; *ties gets how many
 * keys equal to it are among the k largest. tmp holds >= c keys. Radix select on the keys'
 * range: each level spreads [lo, hi] over at most 2048 buckets ((key - lo) >> shift), finds the
 * bucket holding the k-th largest and keeps only its keys (compacted into tmp, in place from the
 * second level on; the bucket's bounds are the next level's range), until few enough remain for
 * a quickselect. The top 11 bits of the key would do too, but the candidates of one side share
 * an exponent or two: a handful of crowded buckets and three levels, where the candidates' own
 * range (threshold to largest) leaves about 0.2 % of the keys after one. */
static u32 kth_largest_key(const u32 *keys, i64 c, i64 k, u32 *tmp, i64 *ties, u32 lo, u32 hi) {
    const u32 *src = keys;
    i64 n = c, need = k; /* the k-th largest of all is the need-th largest of src[0..n) */
    for (;;) {
        if (n <= SMALL_SELECT) {
            if (src != tmp) memcpy(tmp, src, (size_t)n * sizeof(u32));
            u32 kth = nth_key(tmp, n, n - need);
            i64 gt = 0;
            for (i64 i = 0; i < n; i++) gt += tmp[i] > kth;
            *ties = need - gt;
            return kth;
        }
        if (lo == hi) { /* all equal: need of them are among the k largest */
            *ties = need;
            return lo;
        }
        int sh = 0;
        while (((hi - lo) >> sh) >= 2048) sh++;
        i64 nb = (i64)((hi - lo) >> sh) + 1, hist[2048];
        /* four interleaved histograms: keys near the threshold share a few buckets, and one
         * counter incremented back to back would serialise on its store. 32-bit counters (all
         * four fit in L1): n < 2^32 */
        u32 h4[4][2048];
        for (int r = 0; r < 4; r++) memset(h4[r], 0, (size_t)nb * sizeof(u32));
        i64 i = 0;
        for (; i + 4 <= n; i += 4) {
            h4[0][(src[i] - lo) >> sh]++;
            h4[1][(src[i + 1] - lo) >> sh]++;
            h4[2][(src[i + 2] - lo) >> sh]++;
            h4[3][(src[i + 3] - lo) >> sh]++;
        }
        for (; i < n; i++) h4[0][(src[i] - lo) >> sh]++;
        for (i64 j = 0; j < nb; j++)
            hist[j] = (i64)h4[0][j] + (i64)h4[1][j] + (i64)h4[2][j] + (i64)h4[3][j];
        i64 bucket = nb - 1;
        for (; bucket > 0; bucket--) {
            if (need <= hist[bucket]) break;
            need -= hist[bucket];
        }
        /* keep that bucket's keys; writing tmp[m] with m <= i never overtakes the reads when
         * src is tmp. The range shrinks by 2^11 per level (or to one value) */
        i64 m = 0;
        i = 0;
#if defined(HAVE_AVX512)
        if (simd_level() == 2) i = keep_bucket_avx512(src, n, lo, sh, (u32)bucket, tmp, &m);
#endif
        for (; i < n; i++) {
            u32 x = src[i];
            tmp[m] = x;
            m += (i64)((x - lo) >> sh) == bucket;
        }
        src = tmp;
        n = m;
        u32 blo = lo + ((u32)bucket << sh), bhi = blo + ((1u << sh) - 1u);
        lo = blo;
        hi = bhi < blo || bhi > hi ? hi : bhi;
    }
}

/* The k-th largest key of the candidates and how many keys equal to it are kept (c > k). */
typedef struct {
    u32 kth;
    i64 ties;
    int all; /* c <= k: every candidate is kept */
} cut;

/* The largest of n >= 1 keys that are finite non-negative floats' bit patterns (candidates:
 * the candidate pass rejected NaN and Inf), as a float max (SSE2: 4 per instruction) */
static u32 max_key(const u32 *key, i64 n) {
    u32 m = key[0];
    i64 i = 0;
#if defined(__SSE2__)
    __m128 vm = _mm_castsi128_ps(_mm_set1_epi32((int)m));
    for (; i + 4 <= n; i += 4) vm = _mm_max_ps(vm, _mm_loadu_ps((const float *)(key + i)));
    float f[4];
    _mm_storeu_ps(f, vm);
    for (int j = 0; j < 4; j++) m = fbits(f[j]) > m ? fbits(f[j]) : m;
#endif
    for (; i < n; i++) m = key[i] > m ? key[i] : m;
    return m;
}

/* lo: a lower bound of the keys (the side's candidate threshold) */
static cut find_cut(const cands *cd, i64 k, u32 *tmp, u32 lo) {
    cut t = {0, 0, 1};
    if (cd->n > k) {
        t.all = 0;
        t.kth = kth_largest_key(cd->key, cd->n, k, tmp, &t.ties, lo, max_key(cd->key, cd->n));
    }
    return t;
}

#if defined(HAVE_AVX512)
static int simd_level(void);

/* keep_cut's loop for 16 candidates at a time while no key of the 16 equals the cut (those
 * need the tie count: the scalar loop takes them): the keys above it packed in order by
 * vpcompressd, their positions widened to int64; masked stores (out and vals hold exactly the
 * k kept). Returns the candidates consumed; *m advances by those kept. */
__attribute__((target("avx512f"), noinline)) static i64 keep_above_avx512(
    const u32 *key, const u32 *pos, i64 c, u32 kth, i64 *out, float *vals, i64 *m_io) {
    const __m512i vk = _mm512_set1_epi32((int)kth);
    i64 i = 0, m = *m_io;
    for (; i + 16 <= c; i += 16) {
        __m512i kv = _mm512_loadu_si512((const void *)(key + i));
        if (_mm512_cmpeq_epu32_mask(kv, vk)) break;
        __mmask16 keep = _mm512_cmpgt_epu32_mask(kv, vk);
        int n = __builtin_popcount(keep);
        __m512i pv = _mm512_maskz_compress_epi32(keep, _mm512_loadu_si512((const void *)(pos + i)));
        __mmask8 lo = (__mmask8)(n >= 8 ? 0xFF : (1u << n) - 1u);
        __mmask8 hi = (__mmask8)(n <= 8 ? 0 : (1u << (n - 8)) - 1u);
        _mm512_mask_storeu_epi64(out + m, lo, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(pv)));
        _mm512_mask_storeu_epi64(out + m + 8, hi,
                                 _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(pv, 1)));
        if (vals)
            _mm512_mask_storeu_epi32(vals + m, (__mmask16)((1u << n) - 1u),
                                     _mm512_maskz_compress_epi32(keep, kv));
        m += n;
    }
    *m_io = m;
    return i;
}
#endif

/* Keep the candidates above the cut (ascending positions), ties at the k-th value to the lower
 * position: kept positions (ascending) to out, their scores (as floats) to vals (may be NULL);
 * returns how many (min(c, k)). With AVX-512, runs of 16 without a key equal to the cut are
 * packed 16 at a time (keep_above_avx512), the rest one at a time as below. */
static i64 keep_cut(const cands *cd, i64 k, cut t, i64 *out, float *vals) {
    i64 c = cd->n;
    if (t.all) {
        for (i64 i = 0; i < c; i++) out[i] = cd->pos[i];
        if (vals)
            for (i64 i = 0; i < c; i++) vals[i] = bitsf(cd->key[i]);
        return c;
    }
    u32 kth = t.kth;
    i64 ties = t.ties;
    /* exactly k are kept: stop there (outputs hold k); branch-free, as keeping is a coin flip */
    i64 m = 0, i = 0;
    const u32 *key = cd->key;
    const u32 *pos = cd->pos;
#if defined(HAVE_AVX512)
    const int wide = simd_level() == 2;
#endif
    for (;;) {
        i64 stop = c; /* without AVX-512: all of it one at a time, below */
#if defined(HAVE_AVX512)
        if (wide) { /* the packed runs, then the 16 that stopped them one at a time */
            i += keep_above_avx512(key + i, pos + i, c - i, kth, out, vals, &m);
            if (i + 16 < c) stop = i + 16;
        }
#endif
        /* the stores at out[m] are overwritten unless kept, so m < k bounds them */
        if (vals) {
            for (; i < stop && m < k; i++) {
                u32 eq = key[i] == kth, keep = (key[i] > kth) | (eq & (ties > 0));
                ties -= eq & keep;
                out[m] = pos[i];
                vals[m] = bitsf(key[i]);
                m += keep;
            }
        } else {
            for (; i < stop && m < k; i++) {
                u32 eq = key[i] == kth, keep = (key[i] > kth) | (eq & (ties > 0));
                ties -= eq & keep;
                out[m] = pos[i];
                m += keep;
            }
        }
        if (i >= c || m >= k) break;
    }
    return m;
}

static i64 keep_topk(const cands *cd, i64 k, u32 *tmp, u32 lo, i64 *out, float *vals) {
    return keep_cut(cd, k, find_cut(cd, k, tmp, lo), out, vals);
}

/* The sum of the kept scores (signed sides: all > 0) in float64, and how many are kept: eight
 * interleaved partial sums (a sequential chain of dependent adds was latency-bound), so the
 * order is fixed but not the tree's. Any order of adding n positive values is within
 * (n - 1) 2^-53 of the exact sum, relatively, as is the tree sum: used only where the two
 * sides' means are too far apart for that difference to matter. */
static double cut_sum(const cands *cd, cut t, i64 *count) {
    double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    i64 c = cd->n, m = 0, i = 0;
    const u32 *key = cd->key;
    u32 kth = t.all ? 0u : t.kth; /* keys are > 0 here: "> 0" keeps every candidate */
    /* branch-free: a key not kept becomes +0.0, which adds nothing */
    for (; i + 8 <= c; i += 8)
        for (int j = 0; j < 8; j++) {
            u32 x = key[i + j], keep = x > kth;
            s[j] += (double)bitsf(x & (0u - keep));
            m += keep;
        }
    for (; i < c; i++) {
        u32 x = key[i], keep = x > kth;
        s[0] += (double)bitsf(x & (0u - keep));
        m += keep;
    }
    double sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    if (!t.all) {
        sum += (double)t.ties * (double)bitsf(t.kth);
        m += t.ties;
    }
    *count = m;
    return sum;
}

/* ------------------------------------------------------------------------------------------ */
/* selection                                                                                     */
/* ------------------------------------------------------------------------------------------ */
#define EXACT_BELOW (1 << 14)
#define SAMPLE_MAX (1 << 16)
#define TRUE_MIN 1.401298464324817e-45f /* x >= TRUE_MIN <=> x > 0 for finite x */

static inline u32 side_key(float x, int side) {
    u32 u = fbits(x);
    return side == SIDE_POS ? u : side == SIDE_NEG ? u ^ 0x80000000u : u & 0x7FFFFFFFu;
}

/* What the selection's pass adds to a first (A = R + dW, the residual-corrected update):
 * nothing (all NULL) or g (a + g); or, with w and wref, A is w - wref itself (the drop-in
 * optimizer's residual kept in its weights: weights minus the shared reference) and a is NULL:
 * the pass reads w and wref and writes nothing. consume (g itself, or NULL): the pass also
 * zeroes g as it adds it (sbc_select_consume). */
typedef struct {
    const float *g, *w, *wref;
    float *consume;
} addend;

/* Software prefetch this many elements ahead of the AVX-512 candidate pass (a hint: a prefetch
 * never faults, also past an array's end). With the candidates' branch in the loop the
 * hardware prefetchers alone left the pass over w and wref at ~60 % of the bandwidth of two
 * plain reads (10.5M elements: 13.2 ms vs 8.1); 4 KiB ahead it took 7-8 ms (2 KiB or 8 KiB
 * measured the same) */
#define PREFETCH_AHEAD 1024
#if defined(__GNUC__)
#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#define PREFETCH_W(p) __builtin_prefetch((const void *)(p), 1, 3)
#define ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define PREFETCH(p) ((void)0)
#define PREFETCH_W(p) ((void)0)
#define ALWAYS_INLINE inline
#endif
/* positions ahead whose cache lines the scatters prefetch for writing (the momentum mask of
 * 6.3M elements, 2 ranks at p = 0.01: 4.0 -> 2.9 ms; 8 to 64 ahead alike) */
#define SCATTER_AHEAD 16

static inline float added(const addend *d, const float *a, i64 i) {
    if (d->w) return d->w[i] - d->wref[i];
    if (d->g) return a[i] + d->g[i];
    return a[i];
}

static void add_into(float *a, const addend *d, i64 s, i64 e) {
    if (d->consume) { /* the line of g is in L1 when it is zeroed: a store, no second pass */
        float *g = d->consume;
        for (i64 i = s; i < e; i++) {
            a[i] = a[i] + g[i];
            g[i] = 0.0f;
        }
    } else if (d->g)
        for (i64 i = s; i < e; i++) a[i] = a[i] + d->g[i];
}

/* Thresholds from the strided sample: per side the ks-th largest eligible score, or the "every
 * eligible element" threshold (TRUE_MIN for the signed sides, 0 for magnitudes) when the
 * sample has fewer. buf holds 2 m keys. */
static void sample_thresholds(const float *a, const addend *g, i64 n, i64 stride, i64 ks,
                              int two, u32 *buf, u32 *tmp, float *t) {
    i64 m = (n + stride - 1) / stride, np = 0, nn = 0;
    u32 *pk = buf, *nk = buf + m;
    /* branch-free: each sample element is a cache miss, and a branch on its sign (a coin
     * flip) mispredicted about every other time, each misprediction discarding the loads
     * issued after it: the misses were taken one at a time (about 60 % of what the selection
     * spends outside its candidate pass, ResNet-18 at p = 0.05). The same keys in the same
     * order: a slot is written every time and kept when the count moves past it. */
    if (two) {
        for (i64 i = 0; i < n; i += stride) {
            float x = added(g, a, i);
            u32 u = fbits(x);
            pk[np] = u;
            np += x > 0.0f;
            nk[nn] = u ^ 0x80000000u;
            nn += x < 0.0f;
        }
    } else {
        for (i64 i = 0; i < n; i += stride) pk[np++] = fbits(added(g, a, i)) & 0x7FFFFFFFu;
    }
    i64 ties;
    float all = two ? TRUE_MIN : 0.0f;
    /* every key < 2^31 (sign bit clear; NaN too) */
    t[0] = np >= ks && ks > 0 ? bitsf(kth_largest_key(pk, np, ks, tmp, &ties, 0, 0x7FFFFFFFu))
                              : all;
    if (t[0] < all) t[0] = all;
    if (two) {
        t[1] = nn >= ks && ks > 0 ? bitsf(kth_largest_key(nk, nn, ks, tmp, &ties, 0, 0x7FFFFFFFu))
                                  : all;
        if (t[1] < all) t[1] = all;
    }
}

/* Push the elements of a block whose bits are set in mask (bit j: element s + j, its value
 * x[j]). */
static inline void push_mask(const float *x, i64 s, u64 mask, u32 flip, cands *c) {
    i64 n = c->n;
    while (mask) {
        int j = __builtin_ctzll(mask);
        mask &= mask - 1;
        c->pos[n] = (u32)(s + j);
        c->key[n] = fbits(x[j]) ^ flip;
        n++;
    }
    c->n = n;
}

/* One pass: candidates of the positive (x >= tp) and negative (x <= -tn) sides, or of the
 * magnitude side (|x| >= tp) when two == 0, by blocks of BLOCK elements (with g, each chunk of
 * SCAN_CHUNK elements first becomes a += g: the residual-corrected update, computed in the same pass,
 * then hot in cache): per-block, per-side bit masks whose set bits are pushed, and the NaN/Inf
 * check. A chunk's whole blocks go through chunk_avx512 (compares and packed pushes) where the
 * CPU has AVX-512, else their masks come from masks_sse2 or masks_c (exact compares: all three
 * find the same candidates; an AVX2 masks variant measured no faster, the pass being bound by
 * memory; the per-candidate pushes were what AVX-512's packing saves). With prefilter (low densities: most blocks hold no candidate) a
 * block is first tested with one cheap compare (|x| below both thresholds; NaN and Inf fail it
 * too) and skipped whole (its masks 0). Returns 1 if a non-finite value was seen. */
#define BLOCK 64
#define SCAN_CHUNK 4096
typedef struct {
    float tp, ntn, tmin; /* thresholds: x >= tp, x <= ntn (= -tn), prefilter |x| >= tmin */
    int two, prefilter;
} scan_cfg;

/* masks of nb whole blocks at x (pm, nm: one u64 per block); returns non-zero if a value of a
 * block that was not skipped is NaN or +-Inf */
typedef u32 (*masks_fn)(const float *x, i64 nb, const scan_cfg *c, u64 *pm, u64 *nm);

/* portable, one block of len (<= BLOCK) elements: the reference for the vector variants */
static u32 block_masks_c(const float *x, int len, const scan_cfg *c, u64 *pm, u64 *nm) {
    u32 bad = 0;
    u64 p = 0, n = 0;
    *pm = *nm = 0;
    if (c->prefilter) {
        u32 any = 0;
        for (int j = 0; j < len; j++) any |= !(fabsf(x[j]) < c->tmin);
        if (!any) return 0;
    }
    for (int j = 0; j < len; j++) {
        float v = x[j];
        bad |= !(fabsf(v) <= 3.4028234663852886e38f);
        if (c->two) {
            p |= (u64)(v >= c->tp) << j;
            n |= (u64)(v <= c->ntn) << j;
        } else {
            p |= (u64)(fabsf(v) >= c->tp) << j;
        }
    }
    *pm = p;
    *nm = n;
    return bad;
}

static u32 masks_c(const float *x, i64 nb, const scan_cfg *c, u64 *pm, u64 *nm) {
    u32 bad = 0;
    for (i64 b = 0; b < nb; b++) bad |= block_masks_c(x + b * BLOCK, BLOCK, c, pm + b, nm + b);
    return bad;
}

#if defined(__SSE2__)
static u32 masks_sse2(const float *x, i64 nb, const scan_cfg *c, u64 *pm, u64 *nm) {
    const __m128 vt = _mm_set1_ps(c->tmin), vtp = _mm_set1_ps(c->tp), vntn = _mm_set1_ps(c->ntn);
    const __m128 vmax = _mm_set1_ps(3.4028234663852886e38f);
    const __m128 vabs = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
    __m128 bad = _mm_setzero_ps();
    for (i64 b = 0; b < nb; b++, x += BLOCK) {
        if (c->prefilter) {
            __m128 acc = _mm_setzero_ps();
            for (int j = 0; j < BLOCK; j += 4)
                acc = _mm_or_ps(acc, _mm_cmpnlt_ps(_mm_and_ps(_mm_loadu_ps(x + j), vabs), vt));
            if (!_mm_movemask_ps(acc)) {
                pm[b] = nm[b] = 0;
                continue;
            }
        }
        u64 p = 0, n = 0;
        for (int j = 0; j < BLOCK; j += 4) {
            __m128 v = _mm_loadu_ps(x + j), av = _mm_and_ps(v, vabs);
            bad = _mm_or_ps(bad, _mm_cmpnle_ps(av, vmax));
            if (c->two) {
                p |= (u64)_mm_movemask_ps(_mm_cmpge_ps(v, vtp)) << j;
                n |= (u64)_mm_movemask_ps(_mm_cmple_ps(v, vntn)) << j;
            } else {
                p |= (u64)_mm_movemask_ps(_mm_cmpge_ps(av, vtp)) << j;
            }
        }
        pm[b] = p;
        nm[b] = n;
    }
    return (u32)_mm_movemask_ps(bad);
}
#endif

#if defined(HAVE_AVX512)
/* AVX-512 (F): the masks and the pushes of len (a multiple of 16) elements at x, position s
 * onwards, in one loop: per 16 elements, compares into lane masks, then the candidates'
 * positions and keys packed in order by vpcompressd (no per-candidate branch; the pushes were
 * about a quarter of the pass at density 0.05). The same compares as block_masks_c, so the
 * same candidates in the same order. p and q have room for len + 16 more entries (a full
 * 16-lane store follows each pack). Returns non-zero if a value is NaN or +-Inf. */
/* Append the lanes of idx (positions) and keys selected by m, in lane order, at *pos and *key
 * (room for 16 more entries: the stores are full vectors), advancing both. */
__attribute__((target("avx512f"), always_inline)) static inline void pack16(
    __mmask16 m, __m512i idx, __m512i keys, u32 **pos, u32 **key) {
    _mm512_storeu_si512((void *)*pos, _mm512_maskz_compress_epi32(m, idx));
    _mm512_storeu_si512((void *)*key, _mm512_maskz_compress_epi32(m, keys));
    *pos += __builtin_popcount(m);
    *key += __builtin_popcount(m);
}

/* How chunk_avx512_impl forms the elements: x[j] (PLAIN); x[j] - y[j] (DIFF, in registers);
 * x[j] + y[j], stored into x (ADD: A = R + dW); the same with y[j] = 0 stored too (CONSUME).
 * float32 operations, as the C loops round them. */
enum { PLAIN, DIFF, ADD, CONSUME };

__attribute__((target("avx512f"), always_inline)) static inline u32 chunk_avx512_impl(
    float *x, float *y, int kind, i64 s, i64 len, const scan_cfg *c, cands *p, cands *q) {
    const __m512 vtp = _mm512_set1_ps(c->tp), vntn = _mm512_set1_ps(c->ntn);
    const __m512 vmax = _mm512_set1_ps(3.4028234663852886e38f);
    const __m512i vabs = _mm512_set1_epi32(0x7FFFFFFF), vsign = _mm512_set1_epi32((int)0x80000000u);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(u32)s),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                     13, 14, 15));
    u32 *pp = p->pos + p->n, *pk = p->key + p->n;
    u32 *qp = q ? q->pos + q->n : NULL, *qk = q ? q->key + q->n : NULL;
    __mmask16 bad = 0;
    for (i64 j = 0; j < len; j += 16, idx = _mm512_add_epi32(idx, step)) {
        PREFETCH(x + j + PREFETCH_AHEAD);
        if (kind != PLAIN) PREFETCH(y + j + PREFETCH_AHEAD);
        __m512i u;
        if (kind == DIFF) {
            u = _mm512_castps_si512(_mm512_sub_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(y + j)));
        } else if (kind == ADD || kind == CONSUME) {
            __m512 sum = _mm512_add_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(y + j));
            _mm512_storeu_ps(x + j, sum);
            if (kind == CONSUME) _mm512_storeu_ps(y + j, _mm512_setzero_ps());
            u = _mm512_castps_si512(sum);
        } else {
            u = _mm512_loadu_si512((const void *)(x + j));
        }
        __m512i au = _mm512_and_si512(u, vabs);
        __m512 v = _mm512_castsi512_ps(u), av = _mm512_castsi512_ps(au);
        bad |= _mm512_cmp_ps_mask(av, vmax, _CMP_NLE_UQ);
        if (c->two) {
            __mmask16 mp = _mm512_cmp_ps_mask(v, vtp, _CMP_GE_OQ);
            __mmask16 mn = _mm512_cmp_ps_mask(v, vntn, _CMP_LE_OQ);
            if (!(mp | mn)) continue; /* low densities: nearly always taken */
            pack16(mp, idx, u, &pp, &pk);
            pack16(mn, idx, _mm512_xor_si512(u, vsign), &qp, &qk);
        } else {
            __mmask16 mp = _mm512_cmp_ps_mask(av, vtp, _CMP_GE_OQ);
            if (mp) pack16(mp, idx, au, &pp, &pk);
        }
    }
    p->n = pp - p->pos;
    if (q) q->n = qp - q->pos;
    return bad;
}

__attribute__((target("avx512f"))) static u32 chunk_avx512(const float *x, i64 s, i64 len,
                                                           const scan_cfg *c, cands *p,
                                                           cands *q) {
    return chunk_avx512_impl((float *)x, NULL, PLAIN, s, len, c, p, q); /* only read */
}

/* chunk_avx512 of a[j] + g[j], stored into a (A = R + dW formed in the same loop); g zeroed
 * too when consume is set (sbc_select_consume) */
__attribute__((target("avx512f"))) static u32 chunk_avx512_add(float *a, float *g, int consume,
                                                               i64 s, i64 len,
                                                               const scan_cfg *c, cands *p,
                                                               cands *q) {
    return consume ? chunk_avx512_impl(a, g, CONSUME, s, len, c, p, q)
                   : chunk_avx512_impl(a, g, ADD, s, len, c, p, q);
}

/* chunk_avx512 of w[j] - wref[j] (sbc_select_diff): A is never stored */
__attribute__((target("avx512f"))) static u32 chunk_avx512_diff(const float *w, const float *wref,
                                                                i64 s, i64 len,
                                                                const scan_cfg *c, cands *p,
                                                                cands *q) {
    return chunk_avx512_impl((float *)w, (float *)wref, DIFF, s, len, c, p, q); /* only read */
}
#endif

/* The SIMD variant: 2 AVX-512 (where the CPU has it), 1 SSE2 masks, 0 portable C;
 * HOROVOD_SBC_SIMD=c or =sse2 asks for an older one (otherwise the best available; tests
 * compare all three). */
static int simd_level(void) {
    static int chosen = -1;
    if (chosen >= 0) return chosen;
    const char *want = getenv("HOROVOD_SBC_SIMD");
    int cap = 0, lvl;
#if defined(__SSE2__)
    cap = 1;
#endif
#if defined(HAVE_AVX512)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) cap = 2;
#endif
    lvl = cap;
    if (want && !strcmp(want, "c")) lvl = 0;
    if (want && !strcmp(want, "sse2") && cap > 1) lvl = 1;
    chosen = lvl;
    return lvl;
}

/* the level sbc_select uses (tests report it) */
int sbc_simd_level(void) {
    return simd_level();
}

static masks_fn pick_masks(void) {
#if defined(__SSE2__)
    if (simd_level() >= 1) return masks_sse2;
#endif
    return masks_c;
}

/* noipa: inlined into sbc_select, or with p = &TLS.p propagated into it (a clone, or the
 * parameter dropped), the candidate arrays' addresses were recomputed through __tls_get_addr
 * for every block with candidates (about 4 % of the selection) */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_IPA __attribute__((noipa))
#else
#define NO_IPA __attribute__((noinline))
#endif
NO_IPA static int scan(float *a, const addend *g, i64 n, float tp, float tn, int two,
                       int prefilter, cands *p, cands *q, int *oom) {
    scan_cfg cfg = {tp, -tn, two && tn < tp ? tn : tp, two, prefilter};
    masks_fn masks = pick_masks();
    u64 pm[SCAN_CHUNK / BLOCK], nm[SCAN_CHUNK / BLOCK];
    float xb[g->w ? SCAN_CHUNK : 1]; /* w - wref: the chunk's A, never stored */
    i64 full = n - n % BLOCK;
    u32 bad = 0;
#if defined(HAVE_AVX512)
    int wide = simd_level() == 2;
#endif
    for (i64 s = 0; s < n; s += SCAN_CHUNK) {
        i64 e = s + SCAN_CHUNK < n ? s + SCAN_CHUNK : n, ew = e < full ? e : full;
        i64 nb = ew > s ? (ew - s) / BLOCK : 0;
        i64 base = 0; /* offset of pm[0]'s block in the chunk */
        const float *x; /* the chunk's A: x[i - s] */
        if (g->w) { /* formed into xb (AVX-512: the partial block only, the rest in registers) */
            i64 from = s;
#if defined(HAVE_AVX512)
            if (wide && nb) from = ew;
#endif
            for (i64 i = from; i < e; i++) xb[i - s] = g->w[i] - g->wref[i];
            x = xb;
        } else { /* A = R + dW, chunk by chunk (AVX-512: the whole blocks in its loop) */
            i64 from = s;
#if defined(HAVE_AVX512)
            if (wide && nb && g->g) from = ew;
#endif
            add_into(a, g, from, e);
            x = a + s;
        }
#if defined(HAVE_AVX512)
        if (wide && nb) { /* the whole blocks in one loop, the partial one below as before */
            if (!cands_reserve(p, SCAN_CHUNK + 16) || (two && !cands_reserve(q, SCAN_CHUNK + 16))) {
                *oom = 1;
                add_into(a, g, s, ew); /* the caller's A = R + dW is complete either way */
                add_into(a, g, e, n);
                return 0;
            }
            if (g->w)
                bad |= chunk_avx512_diff(g->w + s, g->wref + s, s, nb * BLOCK, &cfg, p,
                                         two ? q : NULL);
            else if (g->g)
                bad |= chunk_avx512_add(a + s, (float *)g->g + s, g->consume != NULL, s,
                                        nb * BLOCK, &cfg, p, two ? q : NULL);
            else
                bad |= chunk_avx512(x, s, nb * BLOCK, &cfg, p, two ? q : NULL);
            base = ew - s;
            nb = 0;
        } else
#endif
        bad |= masks(x, nb, &cfg, pm, nm);
        if (ew < e) { /* the tensor's last, partial block */
            bad |= block_masks_c(x + (ew - s), (int)(e - ew), &cfg, &pm[nb], &nm[nb]);
            nb++;
        }
        for (i64 b = 0; b < nb; b++) {
            u64 pb = pm[b], nbm = nm[b];
            if (!(pb | nbm)) continue;
            if (!cands_reserve(p, BLOCK) || (two && !cands_reserve(q, BLOCK))) {
                *oom = 1;
                add_into(a, g, e, n); /* the caller's A = R + dW is complete either way */
                return 0;
            }
            i64 rel = base + b * BLOCK;
            if (two) {
                push_mask(x + rel, s + rel, pb, 0u, p);
                push_mask(x + rel, s + rel, nbm, 0x80000000u, q);
            } else { /* magnitude keys: the sign bit cleared */
                i64 c0 = p->n;
                push_mask(x + rel, s + rel, pb, 0u, p);
                for (i64 i = c0; i < p->n; i++) p->key[i] &= 0x7FFFFFFFu;
            }
        }
    }
    return bad != 0;
}

/* Fixed-order float64 tree sum of v[0..c) (horovod_sbc.core.tree_sum_np: zero padding to a
 * power of two, then x[:h] + x[h:] until one value is left); x holds >= c doubles. The values
 * are > 0 here (never -0.0), so adding a padding zero leaves them unchanged: only the real
 * values are stored and only sums with a real right operand are formed. */
static double tree_sum(const float *v, i64 c, double *x) {
    if (c == 0) return 0.0;
    i64 size = 1;
    while (size < c) size <<= 1;
    for (i64 i = 0; i < c; i++) x[i] = (double)v[i];
    i64 len = c; /* x[len..size) are (virtual) zeros */
    while (size > 1) {
        i64 h = size / 2;
        for (i64 i = 0; i + h < len; i++) x[i] = x[i] + x[i + h];
        len = len < h ? len : h;
        size = h;
    }
    return x[0];
}

/* Which side's mean is larger beyond any doubt (0 or 1; -1: too close, or a mean outside the
 * normal float range, or both sides empty): s0/n0 and s1/n1 are float64 sums (cut_sum) of
 * positive values, each within 2 (n - 1) 2^-53 of the exact (and of the tree) sum relatively;
 * a relative gap above twice that plus 2^-20 (float32's spacing is at most 2^-23 relatively
 * for normal values, and the division rounds once) keeps float32(sum / n) in the same strict
 * order for every rounding of the sums. An empty side has mean 0: the other side wins. */
static int decisive(double s0, i64 n0, double s1, i64 n1) {
    if (!n0 && !n1) return -1;
    double m0 = n0 ? s0 / (double)n0 : 0.0, m1 = n1 ? s1 / (double)n1 : 0.0;
    const double lo = 1.1754943508222875e-38 * 4.0, hi = 3.4028234663852886e38 / 4.0;
    if ((n0 && (m0 < lo || m0 > hi)) || (n1 && (m1 < lo || m1 > hi))) return -1;
    if (!n1) return 0;
    if (!n0) return 1;
    i64 c = n0 > n1 ? n0 : n1;
    double tol = 4.0 * (double)c * 1.1102230246251565e-16 + 9.5367431640625e-07;
    if (m0 > m1 * (1.0 + tol)) return 0;
    if (m1 > m0 * (1.0 + tol)) return 1;
    return -1;
}

/* With an addend (see addend; sbc_select: g, may be NULL), first a += it over the whole tensor,
 * in the selection's pass: the residual-corrected update A = R + dW (a is then A whatever the
 * return code, except SBC_BADARG). mode: 0 paper (side 0 = P, the min(k, #positive) largest positive entries; side 1 = N, the
 * most negative ones), 1 magnitude split (the k largest |a|: side 0 their positive entries,
 * side 1 the negative ones), 2 magnitude (side 0 = the k largest |a|, zeros included). Ties at
 * the k-th score go to the lower position. counts[2]: the sides' sizes; sums[2] (modes 0, 1):
 * tree sums of a[P] and of -a[N]; mode 2: the tree sum of |a| over the k (zeros included, in
 * position order) and the number of non-zeros among them. The positions (ascending) stay in this thread's scratch until
 * the next call: sbc_take copies a side out.
 *
 * dst (may be NULL; mode 0 only; room for k positions): when the sides' means are so far apart
 * that their order cannot depend on how each sum is rounded (relative gap above 4 c 2^-53 +
 * 2^-20, both means normal floats), only the side with the larger mean is materialised: its
 * positions go straight to dst, *in_dst = that side, its sum is the exact tree sum and the other
 * side's sum is cut_sum's float64 sum (so float32(sum / count) orders the two means
 * exactly as the tree sums would, and horovod_sbc's choose_side picks the side in dst). Else
 * *in_dst = -1 and both sides are in scratch as without dst.
 * Returns SBC_OK, SBC_NONFINITE, SBC_NOMEM or SBC_BADARG. */
static int select_impl(float *a, const addend *add, i64 n, i64 k, int mode, i64 *counts,
                       double *sums, i64 *dst, int *in_dst) {
    addend none = {NULL, NULL, NULL, NULL};
    const addend *g = add;
    if (in_dst) *in_dst = -1;
    counts[0] = counts[1] = TLS.count[0] = TLS.count[1] = 0;
    sums[0] = sums[1] = 0.0;
    if (n < 0 || n >= ((i64)1 << 32) || k < 0 || k > n || mode < 0 || mode > 2) return SBC_BADARG;
    if (n == 0 || k == 0) {
        add_into(a, g, 0, n);
        for (i64 i = 0; i < n; i++)
            if (!isfinite(added(g->w ? g : &none, a, i))) return SBC_NONFINITE;
        return SBC_OK;
    }
    int two = mode == 0;
    /* Sample size: at least 16 expected sample elements above the k-th value (16 n / k), and
     * cbrt(k n) at higher densities: each sample element costs a cache miss in each input
     * (~6 ns), while a sample m gives about 4 sqrt(k n / m) surplus candidates (a push, a radix
     * pass and a filter read each); their sum is least near m ~ cbrt(k n). (A fixed floor of
     * 16384 measured 6-8 % slower on ResNet-18 at p = 0.01 and 0.05.) */
    i64 m_target = 16 * (n / k), m_bal = (i64)cbrt((double)k * (double)n);
    if (m_target < m_bal) m_target = m_bal;
    if (m_target < 1024) m_target = 1024;
    if (m_target > SAMPLE_MAX) m_target = SAMPLE_MAX;
    if (m_target > n / 16) m_target = n / 16; /* at most one sample per cache line */
    double frac = (two ? 2.6 : 1.3) * (double)k / (double)n;
    int exact = n <= EXACT_BELOW || frac > 0.3 || m_target < 1;
    i64 stride = exact ? 1 : n / m_target;
    if (stride < 1) stride = 1;
    i64 m = (n + stride - 1) / stride;
    double expect = (double)k * (double)m / (double)n;
    /* the sample's count above the true k-th value is about Poisson(expect): ks this far
     * above it makes a rescan (too few candidates) a one in ~10^4 event, while the candidates
     * stay close to k (every candidate costs a store, a radix pass and a filter read) */
    i64 ks = (i64)ceil(1.02 * expect + 4.0 * sqrt(expect) + 4.0);
    if (ks > m) ks = m;
    cands *p = &TLS.p, *q = &TLS.q;
    int oom = 0;
    float all = two ? TRUE_MIN : 0.0f, t[2] = {all, all};
    u32 *sbuf = exact ? NULL : (u32 *)grow(&TLS.sample, (size_t)(3 * m) * sizeof(u32));
    if (!exact && !sbuf) return SBC_NOMEM;
    for (;;) {
        if (!exact) sample_thresholds(a, g, n, stride, ks, two, sbuf, sbuf + 2 * m, t);
        else t[0] = t[1] = all;
        p->n = q->n = 0;
        /* expected candidates per block below ~1/2: most blocks are skipped whole */
        int prefilter = exact ? 0 : frac * BLOCK < 0.5;
        int bad = scan(a, g, n, t[0], t[1], two, prefilter, p, q, &oom);
        if (!g->w) g = &none; /* added: a rescan reads A (w - wref: forms it again) */
        if (bad) return SBC_NONFINITE;
        if (oom) return SBC_NOMEM;
        /* enough candidates on each side, or every eligible element is a candidate already */
        int ok = (p->n >= k || t[0] <= all) && (!two || q->n >= k || t[1] <= all);
        if (ok) break;
        if (ks >= m) {
            exact = 1;
            continue;
        }
        ks = 2 * ks < m ? 2 * ks : m;
    }
    i64 cmax = p->n > q->n ? p->n : q->n;
    u32 *tmp = (u32 *)grow(&TLS.tmp, (size_t)cmax * sizeof(u32));
    float *vals = (float *)grow(&TLS.vals, (size_t)k * sizeof(float));
    double *x = (double *)grow(&TLS.tree, (size_t)k * sizeof(double));
    i64 *out0 = (i64 *)grow(&TLS.out[0], (size_t)k * sizeof(i64));
    i64 *out1 = (i64 *)grow(&TLS.out[1], (size_t)k * sizeof(i64));
    if (!tmp || !vals || !x || !out0 || !out1) return SBC_NOMEM;
    if (mode == 0 && dst && in_dst) {
        cut c0 = find_cut(p, k, tmp, fbits(t[0])), c1 = find_cut(q, k, tmp, fbits(t[1]));
        i64 n0, n1;
        double s0 = cut_sum(p, c0, &n0), s1 = cut_sum(q, c1, &n1);
        int win = decisive(s0, n0, s1, n1);
        if (win >= 0) {
            const cands *w = win ? q : p;
            cut cw = win ? c1 : c0;
            counts[win] = keep_cut(w, k, cw, dst, vals);
            sums[win] = tree_sum(vals, counts[win], x);
            counts[1 - win] = 1 - win ? n1 : n0;
            sums[1 - win] = 1 - win ? s1 : s0;
            *in_dst = win;
            return SBC_OK; /* nothing in scratch: sbc_take has nothing to copy */
        }
        counts[0] = keep_cut(p, k, c0, out0, vals);
        sums[0] = tree_sum(vals, counts[0], x);
        counts[1] = keep_cut(q, k, c1, out1, vals);
        sums[1] = tree_sum(vals, counts[1], x);
    } else if (mode == 0) {
        counts[0] = keep_topk(p, k, tmp, fbits(t[0]), out0, vals);
        sums[0] = tree_sum(vals, counts[0], x);
        counts[1] = keep_topk(q, k, tmp, fbits(t[1]), out1, vals);
        sums[1] = tree_sum(vals, counts[1], x);
    } else {
        i64 c = keep_topk(p, k, tmp, fbits(t[0]), out0, NULL);
        if (mode == 2) { /* STC's mean: the magnitudes' tree sum, zeros in their places */
            i64 nz = 0;
            for (i64 i = 0; i < c; i++) {
                vals[i] = fabsf(added(g, a, out0[i]));
                nz += vals[i] != 0.0f;
            }
            counts[0] = c;
            sums[0] = tree_sum(vals, c, x);
            sums[1] = (double)nz;
        } else { /* split by sign: positives in place, their values and the negatives' */
            i64 np = 0, nn = 0;
            for (i64 i = 0; i < c; i++) {
                i64 j = out0[i];
                float v = added(g, a, j);
                if (v > 0.0f)
                    out0[np++] = j;
                else if (v < 0.0f)
                    out1[nn++] = j;
            }
            counts[0] = np;
            counts[1] = nn;
            for (i64 i = 0; i < np; i++) vals[i] = added(g, a, out0[i]);
            sums[0] = tree_sum(vals, np, x);
            for (i64 i = 0; i < nn; i++) vals[i] = -added(g, a, out1[i]);
            sums[1] = tree_sum(vals, nn, x);
        }
    }
    TLS.count[0] = counts[0];
    TLS.count[1] = counts[1];
    return SBC_OK;
}

int sbc_select(float *a, const float *g, i64 n, i64 k, int mode, i64 *counts, double *sums,
               i64 *dst, int *in_dst) {
    addend add = {g, NULL, NULL, NULL};
    return select_impl(a, &add, n, k, mode, counts, sums, dst, in_dst);
}

/* sbc_select with g (not NULL, not overlapping a) consumed: the pass that forms a = A = R + g
 * also sets g = 0, whatever the return code except SBC_BADARG. The stock hook's gradient
 * buffer, into which the decoded average is scattered next, then needs no memset of its own
 * (42 MB of stores with their reads for ownership, where a zero stored into a line the pass
 * has just read costs nearly nothing). */
int sbc_select_consume(float *a, float *g, i64 n, i64 k, int mode, i64 *counts, double *sums,
                       i64 *dst, int *in_dst) {
    if (!g) return SBC_BADARG;
    addend add = {g, NULL, NULL, g};
    return select_impl(a, &add, n, k, mode, counts, sums, dst, in_dst);
}

/* sbc_select of A = w - wref (float32), formed in the selection's pass and never stored: the
 * drop-in optimizer's update when its residual lives in the weights (the weights w minus the
 * shared reference wref). Reads w and wref only, writes nothing of them: a NaN/Inf
 * (SBC_NONFINITE) leaves nothing to undo. */
int sbc_select_diff(const float *w, const float *wref, i64 n, i64 k, int mode, i64 *counts,
                    double *sums, i64 *dst, int *in_dst) {
    addend add = {NULL, w, wref, NULL};
    return select_impl(NULL, &add, n, k, mode, counts, sums, dst, in_dst);
}

/* Copy side (0 or 1) of this thread's last sbc_select into dst (counts[side] positions). */
int sbc_take(int side, i64 *dst) {
    if (side < 0 || side > 1) return SBC_BADARG;
    if (TLS.count[side]) memcpy(dst, TLS.out[side].p, (size_t)TLS.count[side] * sizeof(i64));
    return SBC_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Golomb-Rice encoding                                                                          */
/* ------------------------------------------------------------------------------------------ */
/* out[j] = sum over i of (gap_i >> bs[j]) for the gaps of ascending pos (gap_0 = pos_0). */
void sbc_gap_shift_sums(const i64 *pos, i64 c, const i64 *bs, i64 nb, i64 *out) {
    if (nb == 3 && c > 0) { /* the usual three candidates: one pass, the gap formed once */
        int b0 = (int)bs[0], b1 = (int)bs[1], b2 = (int)bs[2];
        u64 g = (u64)pos[0], s0 = g >> b0, s1 = g >> b1, s2 = g >> b2;
        for (i64 i = 1; i < c; i++) {
            g = (u64)(pos[i] - pos[i - 1] - 1);
            s0 += g >> b0;
            s1 += g >> b1;
            s2 += g >> b2;
        }
        out[0] = (i64)s0;
        out[1] = (i64)s1;
        out[2] = (i64)s2;
        return;
    }
    for (i64 j = 0; j < nb; j++) { /* one vectorisable pass per b */
        int b = (int)bs[j];
        u64 sum = c ? (u64)pos[0] >> b : 0;
        for (i64 i = 1; i < c; i++) sum += (u64)(pos[i] - pos[i - 1] - 1) >> b;
        out[j] = (i64)sum;
    }
}

/* a[pos[i]] += v for the count (distinct) positions: the error feedback's commit (v = -mu). */
void sbc_add_at(float *a, const i64 *pos, i64 count, float v) {
    for (i64 i = 0; i < count; i++) a[pos[i]] += v;
}

/* Unary and remainder streams of ascending pos with Rice parameter b (0..62), written into
 * unary[0..ubytes) and rem[0..rbytes) (zeroed here). Returns SBC_BADARG if the sizes are not
 * the stream sizes (then the outputs are incomplete). */
int sbc_rice_encode(const i64 *pos, i64 c, i64 b, uint8_t *unary, i64 ubytes, uint8_t *rem,
                    i64 rbytes) {
    if (b < 0 || b > 62 || c < 0) return SBC_BADARG;
    if (rbytes != (i64)(((u128)c * (u64)b + 7) / 8)) return SBC_BADARG;
    if (ubytes < 0) return SBC_BADARG;
    if (ubytes) memset(unary, 0, (size_t)ubytes);
    if (rbytes) memset(rem, 0, (size_t)rbytes);
    u64 bit = 0, mask = b ? (~0ull >> (64 - b)) : 0;
    i64 prev = -1;
    u64 acc = 0;
    int nacc = 0;
    i64 out = 0;
    if (b >= 1 && b <= 32) { /* remainders flushed 32 bits at a time (one test per field, taken
                              * every 32 / b fields, instead of a loop per byte) */
        for (i64 i = 0; i < c; i++) {
            u64 g = (u64)(pos[i] - prev - 1);
            prev = pos[i];
            bit += g >> b;
            if ((i64)(bit >> 3) >= ubytes) return SBC_BADARG;
            unary[bit >> 3] |= (uint8_t)(0x80u >> (bit & 7));
            bit++;
            acc = (acc << b) | (g & mask); /* nacc < 32 before: at most 63 bits pending */
            nacc += (int)b;
            if (nacc >= 32) { /* 32 whole stream bits: within rem[0..rbytes) */
                nacc -= 32;
                u32 w = __builtin_bswap32((u32)(acc >> nacc));
                memcpy(rem + out, &w, 4);
                out += 4;
            }
        }
        while (nacc >= 8) {
            nacc -= 8;
            rem[out++] = (uint8_t)(acc >> nacc);
        }
        if (nacc) rem[out++] = (uint8_t)(acc << (8 - nacc));
        if ((i64)((bit + 7) >> 3) != ubytes || out != rbytes) return SBC_BADARG;
        return SBC_OK;
    }
    for (i64 i = 0; i < c; i++) {
        u64 g = (u64)(pos[i] - prev - 1);
        prev = pos[i];
        bit += g >> b;
        if ((i64)(bit >> 3) >= ubytes) return SBC_BADARG;
        unary[bit >> 3] |= (uint8_t)(0x80u >> (bit & 7));
        bit++;
        if (!b) continue;
        u64 r = g & mask;
        if (b > 56) { /* two pushes keep the accumulator within 64 bits */
            acc = (acc << (b - 32)) | (r >> 32);
            nacc += (int)b - 32;
            while (nacc >= 8) {
                nacc -= 8;
                rem[out++] = (uint8_t)(acc >> nacc);
            }
            acc = (acc << 32) | (r & 0xFFFFFFFFull);
            nacc += 32;
        } else {
            acc = (acc << b) | r;
            nacc += (int)b;
        }
        while (nacc >= 8) {
            nacc -= 8;
            rem[out++] = (uint8_t)(acc >> nacc);
        }
    }
    if (nacc) rem[out++] = (uint8_t)(acc << (8 - nacc));
    if ((i64)((bit + 7) >> 3) != ubytes || out != rbytes) return SBC_BADARG;
    return SBC_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* A whole sync's SBC messages in one call                                                      */
/* ------------------------------------------------------------------------------------------ */
static i64 put_uvarint(uint8_t *o, u64 v) {
    i64 n = 0;
    while (v >= 0x80) {
        o[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    o[n++] = (uint8_t)v;
    return n;
}

/* The tensor message header of horovod_sbc.wire (magic b"SB", version 1, flags, rice_b, the
 * uvarints numel, count, unary_nbytes, the float32 value little-endian); its length. */
static i64 put_header(uint8_t *o, i64 numel, i64 count, i64 b, i64 ubytes, float value,
                      int negative) {
    i64 h = 0;
    o[h++] = 'S';
    o[h++] = 'B';
    o[h++] = 1;
    o[h++] = negative ? 1 : 0;
    o[h++] = (uint8_t)b;
    h += put_uvarint(o + h, (u64)numel);
    h += put_uvarint(o + h, (u64)count);
    h += put_uvarint(o + h, (u64)ubytes);
    u32 bits;
    memcpy(&bits, &value, 4);
    for (int j = 0; j < 4; j++) o[h++] = (uint8_t)(bits >> (8 * j));
    return h;
}

#define SBC_MAX_HEADER 36 /* 5 fixed bytes, three uvarints of at most 9, the value */

/* One sync's SBC messages (binarized, horovod_sbc.compressors.sbc), tensor after tensor, with
 * the bytes of the per-tensor path (sbc_select, the side with the larger float32 mean as
 * horovod_sbc.reference.choose_side takes it, wire.choose_rice_b, sbc_rice_encode). Tensor i:
 * kind[i] 0 a[i] itself, 1 a[i] += b[i] in the selection's pass, 2 the same with b[i] zeroed
 * (consumed), 3 A = a[i] - b[i] (weights minus reference, nothing written); n[i] elements, its
 * top k[i] per side (mode 0, the paper's, or 1, the magnitude split); b*(count) =
 * rice_b1[i] - #{rice_t[rice_off[i] .. rice_off[i + 1]) <= count} (horovod_sbc.wire.rice_table).
 * Writes the messages back to back into out (out_cap bytes) and the positions sent, tensor
 * after tensor, into pos (room for the sum of k); per tensor: msg_end (the offset after its
 * message), count, mu (the magnitude sent) and negative. On a failure returns its code with
 * *failed = the tensor (its A formed as sbc_select leaves it; the tensors before it encoded). */
int sbc_encode_binary_many(i64 m, const i64 *kind, const i64 *pa, const i64 *pb, const i64 *n,
                           const i64 *k, int mode, const i64 *rice_b1, const i64 *rice_off,
                           const i64 *rice_t, uint8_t *out, i64 out_cap, i64 *pos,
                           i64 *msg_end, i64 *count, float *mu, i64 *negative, i64 *failed) {
    if (m < 0 || (mode != 0 && mode != 1)) return SBC_BADARG;
    i64 o = 0, po = 0;
    for (i64 i = 0; i < m; i++) {
        *failed = i;
        count[i] = 0;
        mu[i] = 0.0f;
        negative[i] = 0;
        float *a = (float *)(intptr_t)pa[i];
        const float *b = (const float *)(intptr_t)pb[i];
        addend add = {NULL, NULL, NULL, NULL};
        switch (kind[i]) {
        case 0: break;
        case 1: add.g = b; break;
        case 2: add.g = b; add.consume = (float *)(intptr_t)pb[i]; break;
        case 3: add.w = a; add.wref = b; a = NULL; break;
        default: return SBC_BADARG;
        }
        i64 counts[2];
        double sums[2];
        int in_dst = -1;
        i64 c = 0, rb = 0, ub = 0, sq = 0;
        float v = 0.0f;
        int neg = 0;
        if (n[i] > 0) {
            int rc = select_impl(a, &add, n[i], k[i], mode, counts, sums,
                                 mode == 0 ? pos + po : NULL, mode == 0 ? &in_dst : NULL);
            if (rc != SBC_OK) return rc;
            float mp = counts[0] ? (float)(sums[0] / (double)counts[0]) : 0.0f;
            float mn = counts[1] ? (float)(sums[1] / (double)counts[1]) : 0.0f;
            int side = mp >= mn && mp > 0.0f ? 0 : mn > 0.0f ? 1 : -1;
            if (side >= 0) {
                if (in_dst >= 0 && in_dst != side) return SBC_BADARG; /* cannot happen */
                c = counts[side];
                if (in_dst < 0 && c) memcpy(pos + po, TLS.out[side].p, (size_t)c * sizeof(i64));
                v = side ? mn : mp;
                neg = side;
            }
        }
        if (c) {
            i64 b0 = rice_b1[i];
            for (i64 j = rice_off[i]; j < rice_off[i + 1]; j++) b0 -= rice_t[j] <= c;
            i64 bs[3], nb = 0, sums3[3];
            for (i64 d = -1; d <= 1; d++)
                if (b0 + d >= 0 && b0 + d <= 62) bs[nb++] = b0 + d;
            sbc_gap_shift_sums(pos + po, c, bs, nb, sums3);
            i64 best = -1;
            for (i64 j = 0; j < nb; j++) {
                i64 len = (sums3[j] + c + 7) / 8 + (i64)(((u128)c * (u64)bs[j] + 7) / 8);
                if (best < 0 || len < best) {
                    best = len;
                    rb = bs[j];
                    sq = sums3[j];
                }
            }
            ub = (sq + c + 7) / 8;
        }
        i64 rbytes = (i64)(((u128)c * (u64)rb + 7) / 8);
        uint8_t head[SBC_MAX_HEADER];
        i64 h = put_header(head, n[i], c, rb, ub, v, neg);
        if (o + h + ub + rbytes > out_cap) return SBC_BADARG;
        memcpy(out + o, head, (size_t)h);
        if (c) {
            int rc = sbc_rice_encode(pos + po, c, rb, out + o + h, ub, out + o + h + ub, rbytes);
            if (rc != SBC_OK) return rc;
        }
        o += h + ub + rbytes;
        msg_end[i] = o;
        count[i] = c;
        mu[i] = v;
        negative[i] = neg;
        po += c;
    }
    *failed = -1;
    return SBC_OK;
}

/* The error feedback of sbc_encode_binary_many's messages: t[i][pos] -= the value sent (-mu[i]
 * with negative[i]), tensor after tensor (pos as it wrote them). */
void sbc_commit_binary_many(i64 m, const i64 *pt, const i64 *pos, const i64 *count,
                            const float *mu, const i64 *negative) {
    i64 po = 0;
    for (i64 i = 0; i < m; i++) {
        if (count[i]) sbc_add_at((float *)(intptr_t)pt[i], pos + po, count[i],
                                 negative[i] ? mu[i] : -mu[i]);
        po += count[i];
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Golomb-Rice decoding                                                                          */
/* ------------------------------------------------------------------------------------------ */
static inline u64 load_be64(const uint8_t *p, i64 len, i64 at) {
    u64 w = 0;
    if (at + 8 <= len) {
        memcpy(&w, p + at, 8);
        return __builtin_bswap64(w);
    }
    for (int i = 0; i < 8; i++) w = (w << 8) | (at + i < len ? p[at + i] : 0u);
    return w;
}

/* b bits (1..62) MSB first at bit offset off of p[0..len) (bits past the end read as 0) */
static inline u64 read_bits(const uint8_t *p, i64 len, u64 off, i64 b) {
    if (b <= 56) return (load_be64(p, len, (i64)(off >> 3)) << (off & 7)) >> (64 - b);
    u64 hi = (load_be64(p, len, (i64)(off >> 3)) << (off & 7)) >> (64 - (b - 32));
    u64 o2 = off + (u64)(b - 32);
    u64 lo = (load_be64(p, len, (i64)(o2 >> 3)) << (o2 & 7)) >> 32;
    return (hi << 32) | lo;
}

/* ONE_AT[v][t]: bit offset (MSB = 0) of the t-th set bit of byte value v (8 entries each, the
 * unused ones 0); ONES[v]: its popcount. Filled once when the library loads. */
static uint8_t ONE_AT[256][8], ONES[256];

__attribute__((constructor)) static void init_tables(void) {
    for (int v = 0; v < 256; v++) {
        int c = 0;
        for (int bit = 0; bit < 8; bit++)
            if (v & (0x80 >> bit)) ONE_AT[v][c++] = (uint8_t)bit;
        ONES[v] = (uint8_t)c;
    }
}

/* decode_one for the common case: exactly count one bits, b <= 32, a unary stream under 2^28
 * bytes (bit offsets fit 32 bits, no sum below can wrap). Chunk by chunk, two branch-free
 * passes: the bit offsets of the one bits, byte by byte from a table (eight stores per byte,
 * the cursor advancing by the byte's popcount), then quotients as offset differences,
 * remainders read at fixed offsets and positions as a running sum. Positions past
 * numel are computed anyway (the protocol rejects such a message from st; nothing is added).
 * The body is inlined once per Rice parameter (decode_fast dispatches on b): constant shifts
 * leave the loop its registers (about a quarter faster at b = 4). With AVX-512 (b <= 25) the
 * second pass takes 16 offsets at a time (pass2_avx512; ResNet-18 at p = 0.05, 8 ranks: the
 * whole decode 22.5 -> 17.7 ms), the scalar loop finishing each chunk. */
typedef struct {
    u64 p, max_r;
    u32 max_q, prev;
} fast_state;

#if defined(HAVE_AVX512)
/* The second pass for 16 one bits at a time (AVX-512 F, BW and VBMI), while at least 16 are
 * left in the chunk loc[0..m) and the remainder stream has 64 bytes from the current field on
 * (b <= 25): quotients as lane differences of the offsets (the previous offset shifted in),
 * the 16 remainders cut out of one 64-byte load (vpermb gathers each field's four bytes,
 * big-endian, into its lane; variable shifts align it: 16 fields of b bits advance 2 b bytes,
 * so the lanes' byte and bit offsets stay fixed for the chunk), the gaps' in-register prefix
 * sum plus the running position. The same statistics as the scalar loop (max_q and max_r as
 * lane maxima; the 64-bit position from the telescoping sum of the quotients, so it does not
 * wrap) and the same stored (u32) positions. Returns the entries consumed; *off (the field
 * offset in bits) and fs advance. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"), noinline)) static i64 pass2_avx512(
    const u32 *loc, i64 m, const uint8_t *r, i64 rlen, int b, u64 *off_io, u32 *pos,
    fast_state *fs) {
    u64 off = *off_io, p = fs->p;
    u32 prev = fs->prev;
    uint8_t idxb[64];
    u32 sh[16];
    for (int j = 0; j < 16; j++) {
        u32 bit = (u32)(off & 7) + (u32)(j * b), base = bit >> 3;
        for (int t = 0; t < 4; t++) idxb[4 * j + t] = (uint8_t)(base + 3 - t);
        sh[j] = bit & 7;
    }
    const __m512i idx = _mm512_loadu_si512((const void *)idxb);
    const __m512i shl = _mm512_loadu_si512((const void *)sh);
    const __m512i shr = _mm512_set1_epi32(32 - b), one = _mm512_set1_epi32(1);
    const __m512i zero = _mm512_setzero_si512();
    const __m128i bsh = _mm_cvtsi32_si128(b);
    __m512i vmaxq = zero, vmaxr = zero;
    i64 c = 0;
    for (; c + 16 <= m; c += 16) {
        __m512i rv = zero;
        if (b) {
            i64 at = (i64)(off >> 3);
            if (at + 64 > rlen) break;
            __m512i w = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512((const void *)(r + at)));
            rv = _mm512_srlv_epi32(_mm512_sllv_epi32(w, shl), shr);
        }
        __m512i L = _mm512_loadu_si512((const void *)(loc + c));
        __m512i q = _mm512_sub_epi32(
            _mm512_sub_epi32(L, _mm512_alignr_epi32(L, _mm512_set1_epi32((int)prev), 15)), one);
        vmaxq = _mm512_max_epu32(vmaxq, q);
        vmaxr = _mm512_max_epu32(vmaxr, rv);
        __m512i x = _mm512_add_epi32(_mm512_add_epi32(_mm512_sll_epi32(q, bsh), rv), one);
        x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, zero, 15));
        x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, zero, 14));
        x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, zero, 12));
        x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, zero, 8));
        _mm512_storeu_si512((void *)(pos + c), _mm512_add_epi32(x, _mm512_set1_epi32((int)(u32)p)));
        u32 last = (u32)_mm512_cvtsi512_si32(_mm512_alignr_epi32(L, L, 15));
        p += ((u64)(u32)(last - prev - 16u) << b) + (u64)(u32)_mm512_reduce_add_epi32(rv) + 16u;
        prev = last;
        off += 16u * (u64)b;
    }
    u32 mq = (u32)_mm512_reduce_max_epu32(vmaxq), mr = (u32)_mm512_reduce_max_epu32(vmaxr);
    fs->max_q = mq > fs->max_q ? mq : fs->max_q;
    fs->max_r = mr > fs->max_r ? mr : fs->max_r;
    fs->p = p;
    fs->prev = prev;
    *off_io = off;
    return c;
}

/* 1 if the decoder's second pass may use pass2_avx512 (HOROVOD_SBC_SIMD as for the selection) */
static int decode_wide(void) {
    static int chosen = -1;
    if (chosen < 0)
        chosen = simd_level() == 2 && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vbmi");
    return chosen;
}
#endif

static inline __attribute__((always_inline)) void decode_fast_b(
    const uint8_t *u, i64 ulen, const uint8_t *r, i64 rlen, i64 count, const int b, u32 *pos,
    fast_state *fs) {
    enum { LOCAL = 2048 };
    u32 loc[LOCAL + 8]; /* one chunk of one-bit offsets, kept in L1 between the two passes */
    u64 p = fs->p, max_r = fs->max_r;
    u32 max_q = fs->max_q, prev = fs->prev;
    i64 safe = 0;
    if (b) {
        safe = rlen >= 8 ? ((rlen - 8) * 8) / b : 0; /* fields whose 8-byte load fits */
        if (safe > count) safe = count;
    }
    i64 i = 0, j = 0;
    u64 off = 0; /* i * b */
    while (j < ulen) {
        i64 m = 0;
        for (; j < ulen && m <= LOCAL - 8; j++) {
            const uint8_t *t = ONE_AT[u[j]];
            u32 base = (u32)(j * 8);
            for (int k = 0; k < 8; k++) loc[m + k] = base + t[k];
            m += ONES[u[j]];
        }
        i64 c = 0;
#if defined(HAVE_AVX512)
        if (b <= 25 && m >= 16 && decode_wide()) {
            fast_state v = {p, max_r, max_q, prev};
            c = pass2_avx512(loc, m, r, rlen, b, &off, pos + i, &v);
            p = v.p, max_r = v.max_r, max_q = v.max_q, prev = v.prev;
            i += c;
        }
#endif
        for (; c < m; c++, i++) {
            u32 bit = loc[c], qv = bit - prev - 1;
            prev = bit;
            max_q = qv > max_q ? qv : max_q;
            u64 rv = 0;
            if (b) {
                u64 w;
                if (i < safe) {
                    memcpy(&w, r + (off >> 3), 8);
                    w = __builtin_bswap64(w);
                } else {
                    w = load_be64(r, rlen, (i64)(off >> 3));
                }
                rv = (w << (off & 7)) >> (64 - b);
                max_r = rv > max_r ? rv : max_r;
                off += (u64)b;
            }
            p += ((u64)qv << b) + rv + 1;
            pos[i] = (u32)p;
        }
    }
    fs->p = p;
    fs->max_r = max_r;
    fs->max_q = max_q;
    fs->prev = prev;
}

#define FAST_B(B)                                                                      \
    case B:                                                                            \
        decode_fast_b(u, ulen, r, rlen, count, B, pos, &fs);                           \
        break;

static void decode_fast(const uint8_t *u, i64 ulen, const uint8_t *r, i64 rlen, i64 count,
                        i64 b, i64 numel, u32 *pos, i64 *st) {
    fast_state fs = {(u64)-1, 0, 0, (u32)-1};
    switch (b) {
        FAST_B(0) FAST_B(1) FAST_B(2) FAST_B(3) FAST_B(4) FAST_B(5) FAST_B(6) FAST_B(7)
        FAST_B(8) FAST_B(9) FAST_B(10) FAST_B(11) FAST_B(12) FAST_B(13) FAST_B(14) FAST_B(15)
        FAST_B(16) FAST_B(17) FAST_B(18) FAST_B(19) FAST_B(20) FAST_B(21) FAST_B(22)
        FAST_B(23) FAST_B(24) FAST_B(25) FAST_B(26) FAST_B(27) FAST_B(28) FAST_B(29)
        FAST_B(30) FAST_B(31) FAST_B(32)
    }
    st[2] = (i64)fs.max_q;
    st[3] = (i64)fs.max_r;
    st[5] = ((u128)fs.max_q << b) + fs.max_r < (u128)numel ? (i64)fs.p : -1;
}

/* Stream statistics of one binary message (horovod_sbc.protocol.StreamStats fields ones,
 * unary_last_zero, max_q, max_r, rem_pad_nonzero, pos_max into st[0..6)) and, when the
 * message is valid (count one bits, no gap reaching numel), its positions into pos[0..count)
 * (numel <= 2^32: they fit 32 bits). pos_max is -1 when positions were not decoded; when a
 * position reaches numel it is that position (>= numel; storing stops there). */
static int decode_one(const uint8_t *u, i64 ulen, const uint8_t *r, i64 rlen, i64 count, i64 b,
                      i64 numel, u32 *pos, i64 *st) {
    if (ulen < 0 || rlen < 0 || count < 0 || b < 0 || b > 62 || numel < 0 ||
        numel > ((i64)1 << 32))
        return SBC_BADARG;
    u128 used = (u128)count * (u64)b;
    if ((u128)rlen != (used + 7) / 8) return SBC_BADARG; /* header parsing guarantees it */
    i64 ones = 0;
    i64 j = 0;
    for (; j + 8 <= ulen; j += 8) {
        u64 w;
        memcpy(&w, u + j, 8);
        ones += __builtin_popcountll(w);
    }
    for (; j < ulen; j++) ones += __builtin_popcount(u[j]);
    st[0] = ones;
    st[1] = ulen > 0 && u[ulen - 1] == 0;
    i64 pad = (i64)((u128)rlen * 8 - used);
    st[4] = pad > 0 && (r[rlen - 1] & ((1u << pad) - 1u)) != 0;
    st[5] = -1;
    if (ones == count && pos != NULL && b <= 32 && ulen < ((i64)1 << 28)) {
        decode_fast(u, ulen, r, rlen, count, b, numel, pos, st);
        return SBC_OK;
    }
    i64 n = ones < count ? ones : count;
    u64 max_q = 0, max_r = 0, mask = b ? (~0ull >> (64 - b)) : 0;
    u64 qlim = (u64)numel >> b; /* q > qlim: the gap reaches numel (and q << b may overflow) */
    int want_pos = ones == count && pos != NULL;
    int pos_ok = want_pos;
    u64 p = (u64)-1; /* position accumulator: -1 + sum(gap + 1) */
    u64 prev_bit = (u64)-1;
    i64 i = 0;
    u64 roff = 0;
    for (i64 wi = 0; i < n && wi < ulen; wi += 8) {
        u64 w = load_be64(u, ulen, wi);
        while (w && i < n) {
            int lz = __builtin_clzll(w);
            u64 bit = (u64)wi * 8 + (u64)lz;
            w &= ~(0x8000000000000000ull >> lz);
            u64 qv = bit - prev_bit - 1;
            prev_bit = bit;
            u64 rv = 0;
            if (b) {
                rv = b <= 56 ? (load_be64(r, rlen, (i64)(roff >> 3)) << (roff & 7)) >> (64 - b)
                             : read_bits(r, rlen, roff, b);
                rv &= mask;
                roff += (u64)b;
            }
            max_q = qv > max_q ? qv : max_q;
            max_r = rv > max_r ? rv : max_r;
            if (pos_ok) {
                if (qv > qlim) {
                    pos_ok = 0;
                } else {
                    u64 gap = (qv << b) + rv; /* < 2^63: qv <= numel >> b, numel <= 2^32 */
                    p += gap + 1;
                    if (gap >= (u64)numel || p >= (u64)numel)
                        pos_ok = 0;
                    else
                        pos[i] = (u32)p;
                }
            }
            i++;
        }
    }
    st[2] = (i64)max_q;
    st[3] = (i64)max_r;
    if (want_pos && ((u128)max_q << b) + max_r < (u128)numel) st[5] = count ? (i64)p : -1;
    return SBC_OK;
}

/* The byte ranges of m messages lie inside buf[0..buflen) and each count needs no more unary
 * bits than there are; *total_out = sum(count) (<= 2^40). SBC_BADARG otherwise. */
static int check_ranges(i64 buflen, i64 m, const i64 *ustart, const i64 *ulen,
                        const i64 *rstart, const i64 *rlen, const i64 *count, i64 *total_out) {
    u128 total = 0;
    for (i64 j = 0; j < m; j++) {
        if (ustart[j] < 0 || ulen[j] < 0 || ustart[j] > buflen - ulen[j] || rstart[j] < 0 ||
            rlen[j] < 0 || rstart[j] > buflen - rlen[j] || count[j] < 0 ||
            count[j] > 8 * ulen[j]) /* a position needs a unary bit */
            return SBC_BADARG;
        total += (u64)count[j];
    }
    if (total > ((u64)1 << 40)) return SBC_BADARG;
    *total_out = (i64)total;
    return SBC_OK;
}

/* sbc_decode_batch's work with the positions written to the caller's pos[0..sum(count)) instead
 * of the thread's scratch (the TensorFlow op's output tensor). */
int sbc_decode_batch_into(const uint8_t *buf, i64 buflen, i64 m, const i64 *ustart,
                          const i64 *ulen, const i64 *rstart, const i64 *rlen, const i64 *count,
                          const i64 *rb, const i64 *numel, i64 *stats, uint32_t *pos) {
    i64 total;
    int rc = check_ranges(buflen, m, ustart, ulen, rstart, rlen, count, &total);
    if (rc != SBC_OK) return rc;
    i64 off = 0;
    for (i64 j = 0; j < m; j++) {
        int rc = decode_one(buf + ustart[j], ulen[j], buf + rstart[j], rlen[j], count[j], rb[j],
                            numel[j], pos + off, stats + 6 * j);
        if (rc != SBC_OK) return rc;
        off += count[j];
    }
    return SBC_OK;
}

/* Batched decoding of m binary messages of one gathered buffer buf[0..buflen): message j has
 * unary bytes [ustart[j], ustart[j] + ulen[j]), remainder bytes [rstart[j], ...+rlen[j]),
 * count[j] positions with Rice parameter rb[j] in a tensor of numel[j] <= 2^32 elements; its
 * statistics go to stats[6 j .. 6 j + 6) and its positions (uint32: at most 32 bytes of
 * scratch per message byte, as a position takes at least one bit) to this thread's scratch
 * at offset sum(count[0..j)) (kept until the next call: sbc_scatter_add_groups adds them,
 * sbc_positions copies them out). Returns SBC_BADARG (nothing trusted) if any range lies
 * outside the buffer, SBC_NOMEM if the scratch cannot grow. */
int sbc_decode_batch(const uint8_t *buf, i64 buflen, i64 m, const i64 *ustart, const i64 *ulen,
                     const i64 *rstart, const i64 *rlen, const i64 *count, const i64 *rb,
                     const i64 *numel, i64 *stats) {
    i64 total;
    int rc = check_ranges(buflen, m, ustart, ulen, rstart, rlen, count, &total);
    if (rc != SBC_OK) return rc;
    u32 *pos = (u32 *)grow(&TLS.dpos, (size_t)total * sizeof(u32));
    if (!pos) return SBC_NOMEM;
    TLS.dcount = total;
    return sbc_decode_batch_into(buf, buflen, m, ustart, ulen, rstart, rlen, count, rb, numel,
                                 stats, pos);
}

/* Copy count decoded positions from offset off of the position scratch into dst. */
int sbc_positions(i64 off, i64 count, i64 *dst) {
    if (off < 0 || count < 0 || off > TLS.dcount - count) return SBC_BADARG;
    const u32 *src = (const u32 *)TLS.dpos.p + off;
    for (i64 i = 0; i < count; i++) dst[i] = src[i];
    return SBC_OK;
}

int sbc_scatter_add_groups_from(const uint32_t *pos, i64 npos, i64 ng, const i64 *gstart,
                                const i64 *outs, const i64 *numel, const i64 *pos_off,
                                const i64 *count, const float *value, int zero);
/* What scatter_groups finds in its outputs: ADD_TO adds to them; ZERO_FIRST zeroes each chunk
 * first; ALREADY_ZERO: they are all zero (the caller's guarantee). With the last two the outputs
 * end holding just the sum, which the mask bufs needs. */
enum { ADD_TO, ZERO_FIRST, ALREADY_ZERO };
static int scatter_groups(const uint32_t *pos, i64 npos, i64 ng, const i64 *gstart,
                          const i64 *outs, const i64 *bufs, const i64 *also, const i64 *numel,
                          const i64 *pos_off, const i64 *count, const float *value, int zero);

#define CHUNK 16384 /* output elements (64 KiB of float32) kept hot while every rank adds */

/* Add the decoded messages to their float32 outputs: group g is the messages
 * [gstart[g], gstart[g + 1]) of one output tensor (address outs[g], numel[g] elements), in
 * rank order; message j's count[j] positions sit at pos_off[j] in the position scratch and all
 * get value[j]. Each element receives its ranks' values in rank order (float32 adds, the
 * reference's order), but the output is walked once, chunk by chunk (zeroed first when zero
 * is set: the output then holds just the sum), every rank adding its positions of the chunk in
 * turn: at high density the ranks' positions cover most cache lines,
 * and adding rank after rank would stream the whole output once per rank. Positions were
 * validated (< numel) by the protocol before this is called; they are checked again. */
int sbc_scatter_add_groups(i64 ng, const i64 *gstart, const i64 *outs, const i64 *numel,
                           const i64 *pos_off, const i64 *count, const float *value, int zero) {
    return scatter_groups((const u32 *)TLS.dpos.p, TLS.dcount, ng, gstart, outs, NULL, NULL,
                          numel, pos_off, count, value, zero ? ZERO_FIRST : ADD_TO);
}

/* sbc_scatter_add_groups (adding, no zeroing) where every group g with also[g] != 0 (a float32
 * tensor of numel[g] elements) receives the same additions in the same order as its output, in
 * the same walk over the positions: the drop-in optimizer's weights W beside the shared
 * weights W_ref when its residual lives in the weights. */
int sbc_scatter_add_also_groups(i64 ng, const i64 *gstart, const i64 *outs, const i64 *also,
                                const i64 *numel, const i64 *pos_off, const i64 *count,
                                const float *value) {
    return scatter_groups((const u32 *)TLS.dpos.p, TLS.dcount, ng, gstart, outs, NULL, also,
                          numel, pos_off, count, value, ADD_TO);
}

/* sbc_scatter_add_groups into outputs that hold just the sum (zeroed here chunk by chunk, or,
 * with zeroed set, all zero already: the caller's guarantee, e.g. a gradient consumed by
 * sbc_select_consume), and for every group g with bufs[g] != 0 (bufs[g] a float32 tensor of
 * numel[g] elements) bufs[g][p] = 0 at each position p of the group's messages where the
 * output is non-zero (-0.0 counts as 0), chunk by chunk while the chunk is hot. Every non-zero
 * of such an output lies at one of those positions, so this is "buf = 0 wherever out != 0"
 * (DGC's momentum factor masking, the stock hook) in O(positions), not O(numel). */
int sbc_scatter_add_mask_groups(i64 ng, const i64 *gstart, const i64 *outs, const i64 *bufs,
                                const i64 *numel, const i64 *pos_off, const i64 *count,
                                const float *value, int zeroed) {
    return scatter_groups((const u32 *)TLS.dpos.p, TLS.dcount, ng, gstart, outs, bufs, NULL,
                          numel, pos_off, count, value, zeroed ? ALREADY_ZERO : ZERO_FIRST);
}

/* sbc_scatter_add_groups with the positions read from the caller's pos[0..npos) (as written by
 * sbc_decode_batch_into) instead of the thread's scratch. */
int sbc_scatter_add_groups_from(const uint32_t *pos, i64 npos, i64 ng, const i64 *gstart,
                                const i64 *outs, const i64 *numel, const i64 *pos_off,
                                const i64 *count, const float *value, int zero) {
    return scatter_groups(pos, npos, ng, gstart, outs, NULL, NULL, numel, pos_off, count, value,
                          zero ? ZERO_FIRST : ADD_TO);
}

/* Adds v at message positions pj[c..) below hi to o (and to o2; prefetching buf, which is masked
 * afterwards); returns where it stopped. Inlined with buf and o2 constant at each call. */
static ALWAYS_INLINE i64
add_run(float *o, float *buf, float *o2, const u32 *pj, i64 c, i64 cnt, i64 hi, float v) {
    for (; c < cnt && pj[c] < hi; c++) {
        if (c + SCATTER_AHEAD < cnt) {
            PREFETCH_W(o + pj[c + SCATTER_AHEAD]);
            if (buf) PREFETCH_W(buf + pj[c + SCATTER_AHEAD]);
            if (o2) PREFETCH_W(o2 + pj[c + SCATTER_AHEAD]);
        }
        o[pj[c]] += v;
        if (o2) o2[pj[c]] += v;
    }
    return c;
}

/* Adds v at message positions pj[c..) below hi to the local chunk L (L[0] is element lo);
 * returns where it stopped. The chunk is in L1: no prefetch. Four at a time while the fourth
 * is below hi (ascending: then all four are; distinct: the four adds are independent). */
static ALWAYS_INLINE i64 add_local(float *L, i64 lo, const u32 *pj, i64 c, i64 cnt, i64 hi,
                                   float v) {
    for (; c + 4 <= cnt && pj[c + 3] < hi; c += 4) {
        L[pj[c] - lo] += v;
        L[pj[c + 1] - lo] += v;
        L[pj[c + 2] - lo] += v;
        L[pj[c + 3] - lo] += v;
    }
    for (; c < cnt && pj[c] < hi; c++) L[pj[c] - lo] += v;
    return c;
}

#define LCHUNK 4096 /* the local chunk (16 KiB of float32: half of an L1 data cache) */

/* Outputs of at least this many elements (1 MiB: beyond a core's L2) are streamed out */
#define STREAM_MIN (1 << 18)

/* Copy len floats of the local chunk to dst; with stream set, a 16-byte aligned dst is written
 * with non-temporal stores (SSE2 movntps): the output is written without first being read for
 * ownership (half the memory traffic of zeroing it and adding in place), and the caller's next
 * pass over it finds it in memory, not in a cache it would have been evicted from anyway. The
 * bytes stored are those of L either way. */
static void stream_out(float *dst, const float *L, i64 len, int stream) {
#if defined(__SSE2__)
    if (stream && ((uintptr_t)dst & 15) == 0) {
        i64 i = 0;
        for (; i + 16 <= len; i += 16) {
            _mm_stream_ps(dst + i, _mm_load_ps(L + i));
            _mm_stream_ps(dst + i + 4, _mm_load_ps(L + i + 4));
            _mm_stream_ps(dst + i + 8, _mm_load_ps(L + i + 8));
            _mm_stream_ps(dst + i + 12, _mm_load_ps(L + i + 12));
        }
        if (i < len) memcpy(dst + i, L + i, (size_t)(len - i) * sizeof(float));
        return;
    }
#endif
    memcpy(dst, L, (size_t)len * sizeof(float));
}

/* scatter_groups' walk for outputs that end holding just the sum (ZERO_FIRST, ALREADY_ZERO)
 * and no second output: each LCHUNK-element chunk is summed in a zeroed local buffer (in L1:
 * the ranks' adds hit it, in rank order, the same float32 additions onto +0.0 as in a zeroed
 * output), masked from it (bufs), then copied out (stream_out; large outputs with
 * non-temporal stores): the output is written once and never read. cur: 2 nm entries (see
 * scatter_groups). */
static void scatter_local(const u32 *pos, const i64 *pos_off, const i64 *count,
                          const float *value, i64 a, i64 nm, i64 n, float *o, float *buf,
                          i64 *cur) {
    float L[LCHUNK] __attribute__((aligned(64)));
    for (i64 lo = 0; lo < n; lo += LCHUNK) {
        i64 hi = lo + LCHUNK < n ? lo + LCHUNK : n;
        memset(L, 0, sizeof(L));
        for (i64 j = 0; j < nm; j++) {
            const u32 *pj = pos + pos_off[a + j];
            cur[nm + j] = cur[j];
            cur[j] = add_local(L, lo, pj, cur[j], count[a + j], hi, value[a + j]);
        }
        if (buf) /* the chunk's sums are final: mask where they are non-zero */
            for (i64 j = 0; j < nm; j++) {
                const u32 *pj = pos + pos_off[a + j];
                for (i64 c = cur[nm + j]; c < cur[j]; c++)
                    if (L[pj[c] - lo] != 0.0f) buf[pj[c]] = 0.0f;
            }
        stream_out(o + lo, L, hi - lo, n >= STREAM_MIN);
    }
#if defined(__SSE2__)
    if (n >= STREAM_MIN) _mm_sfence(); /* the non-temporal stores are ordered before whatever
                                        * the caller does next */
#endif
}

/* zero: ADD_TO, ZERO_FIRST or ALREADY_ZERO (see there); also (may be NULL): per group a second
 * output (or 0) added to alike, never zeroed */
static int scatter_groups(const uint32_t *pos, i64 npos, i64 ng, const i64 *gstart,
                          const i64 *outs, const i64 *bufs, const i64 *also, const i64 *numel,
                          const i64 *pos_off, const i64 *count, const float *value, int zero) {
    i64 stack_cur[128];
    if (bufs && zero == ADD_TO) return SBC_BADARG; /* the mask needs outputs holding the sum */
    for (i64 g = 0; g < ng; g++) {
        i64 a = gstart[g], nm = gstart[g + 1] - a, n = numel[g];
        float *o = (float *)(intptr_t)outs[g];
        float *buf = bufs ? (float *)(intptr_t)bufs[g] : NULL;
        float *o2 = also ? (float *)(intptr_t)also[g] : NULL;
        for (i64 j = a; j < a + nm; j++)
            if (pos_off[j] < 0 || count[j] < 0 || pos_off[j] > npos - count[j] ||
                (count[j] && pos[pos_off[j] + count[j] - 1] >= n))
                return SBC_BADARG; /* ascending: first and last bound them all */
        /* cur[j]: message j's next position; cur[nm + j]: where it was when the chunk began */
        i64 *cur = nm <= 64 ? stack_cur : (i64 *)calloc((size_t)(2 * nm), sizeof(i64));
        if (!cur) return SBC_NOMEM;
        for (i64 j = 0; j < nm; j++) cur[j] = 0;
        if (zero != ADD_TO && !o2) { /* the output ends holding just the sum: built locally */
            scatter_local(pos, pos_off, count, value, a, nm, n, o, buf, cur);
            if (cur != stack_cur) free(cur);
            continue;
        }
        for (i64 lo = 0; lo < n; lo += CHUNK) {
            i64 hi = lo + CHUNK;
            if (zero == ZERO_FIRST) memset(o + lo, 0, (size_t)((hi < n ? hi : n) - lo) * sizeof(float));
            for (i64 j = 0; j < nm; j++) {
                const u32 *pj = pos + pos_off[a + j];
                i64 c = cur[j], cnt = count[a + j];
                float v = value[a + j];
                cur[nm + j] = c;
                /* each combination its own loop: no test of buf or o2 per position */
                if (o2) cur[j] = add_run(o, NULL, o2, pj, c, cnt, hi, v);
                else if (buf) cur[j] = add_run(o, buf, NULL, pj, c, cnt, hi, v);
                else cur[j] = add_run(o, NULL, NULL, pj, c, cnt, hi, v);
            }
            if (buf) /* the chunk's sums are final: mask where they are non-zero */
                for (i64 j = 0; j < nm; j++) {
                    const u32 *pj = pos + pos_off[a + j];
                    for (i64 c = cur[nm + j]; c < cur[j]; c++)
                        if (o[pj[c]] != 0.0f) buf[pj[c]] = 0.0f;
                }
        }
        if (cur != stack_cur) free(cur);
    }
    return SBC_OK;
}
