/* The block codec of proto/codec.py in C, byte for byte the same (see its docstring for
 * the format). The geometry comes from the caller (proto's Format); BLOCK is checked
 * against proto's at load. A generic path codes any (E, M); with AVX2 (chosen at run
 * time) bfloat16 and float16 code a block from registers, float32 in byte arrays the
 * compiler's vector loops fill; bit planes come out of movemask and back through a byte
 * shuffle and compare. */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <immintrin.h>

#define BLOCK 64

enum { CC_SHORT = -1, CC_RESERVED = -2, CC_K = -3, CC_BASE = -4, CC_Z = -5, CC_CODE = -6,
       CC_LONG = -7, CC_FORMAT = -8 };

typedef struct {
    int bits, E, M, S, sbytes, sbits, width; /* width: bytes per element */
    uint32_t emask, mmask;
} fmt_t;

int cc_block(void) { return BLOCK; }

static int fmt_init(fmt_t *f, int bits, int E, int M) {
    if ((bits != 16 && bits != 32) || 1 + E + M != bits || E < 1 || E > 8)
        return 0;
    f->bits = bits; f->E = E; f->M = M; f->S = 1 + M;
    f->sbytes = f->S / 8; f->sbits = f->S % 8; f->width = bits / 8;
    f->emask = (1u << E) - 1; f->mmask = (1u << M) - 1;
    return 1;
}

static inline int bitlen(uint32_t v) { return v ? 32 - __builtin_clz(v) : 0; }

/* The canonical (k, z, base) of proto.codec.block_params. */
static inline int choose(int lo, int hi, int lo_nz, int E, int *z, int *base) {
    int k0 = bitlen((uint32_t)(hi - lo));
    int k1 = lo_nz <= hi ? bitlen((uint32_t)(hi - lo_nz + 1)) : E + 1;
    if (k1 < k0) { *z = 1; *base = lo_nz; return k1; }
    *z = 0; *base = lo;
    return k0;
}

static inline void put64(uint8_t *o, uint64_t w) { memcpy(o, &w, 8); }
static inline uint64_t get64(const uint8_t *o) { uint64_t w; memcpy(&w, o, 8); return w; }

static inline uint32_t load_elem(const uint8_t *p, int width) {
    if (width == 2) { uint16_t v; memcpy(&v, p, 2); return v; }
    uint32_t v; memcpy(&v, p, 4); return v;
}

static uint8_t *enc_block_generic(const fmt_t *f, const uint8_t *src, uint8_t *o) {
    uint32_t e[BLOCK], sm[BLOCK];
    int lo = 1 << f->E, hi = 0, lo_nz = 1 << f->E;
    for (int i = 0; i < BLOCK; i++) {
        uint32_t x = load_elem(src + i * f->width, f->width);
        e[i] = (x >> f->M) & f->emask;
        sm[i] = ((x >> (f->E + f->M)) << f->M) | (x & f->mmask);
        int v = (int)e[i];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        if (v && v < lo_nz) lo_nz = v;
    }
    int z, base, k = choose(lo, hi, lo_nz, f->E, &z, &base);
    o[0] = (uint8_t)(k | z << 4);
    o[1] = (uint8_t)base;
    o += 2;
    for (int p = 0; p < f->sbytes; p++, o += BLOCK)
        for (int i = 0; i < BLOCK; i++) o[i] = (uint8_t)(sm[i] >> (8 * p));
    for (int j = 0; j < f->sbits; j++, o += 8) {
        uint64_t w = 0;
        for (int i = 0; i < BLOCK; i++) w |= (uint64_t)((sm[i] >> (8 * f->sbytes + j)) & 1) << i;
        put64(o, w);
    }
    uint32_t code[BLOCK];
    for (int i = 0; i < BLOCK; i++)
        code[i] = z ? (e[i] ? e[i] - (uint32_t)base + 1 : 0) : e[i] - (uint32_t)base;
    for (int j = 0; j < k; j++, o += 8) {
        uint64_t w = 0;
        for (int i = 0; i < BLOCK; i++) w |= (uint64_t)((code[i] >> j) & 1) << i;
        put64(o, w);
    }
    return o;
}

/* Header checks of proto.codec.block_offsets; returns k, or a negative CC_ code. */
static inline int check_header(const fmt_t *f, const uint8_t *in) {
    int head = in[0], base = in[1], k = head & 0xF;
    if (head >> 5) return CC_RESERVED;
    if (k > f->E) return CC_K;
    if (base >> f->E) return CC_BASE;
    if ((head >> 4) && (k == 0 || base == 0)) return CC_Z;
    return k;
}

static int dec_block_generic(const fmt_t *f, const uint8_t *in, int k, uint8_t *dst) {
    int z = in[0] >> 4 & 1, base = in[1];
    uint32_t sm[BLOCK] = {0}, code[BLOCK] = {0};
    const uint8_t *p = in + 2;
    for (int b = 0; b < f->sbytes; b++, p += BLOCK)
        for (int i = 0; i < BLOCK; i++) sm[i] |= (uint32_t)p[i] << (8 * b);
    for (int j = 0; j < f->sbits; j++, p += 8) {
        uint64_t w = get64(p);
        for (int i = 0; i < BLOCK; i++) sm[i] |= (uint32_t)((w >> i) & 1) << (8 * f->sbytes + j);
    }
    for (int j = 0; j < k; j++, p += 8) {
        uint64_t w = get64(p);
        for (int i = 0; i < BLOCK; i++) code[i] |= (uint32_t)((w >> i) & 1) << j;
    }
    uint32_t over = 0;
    for (int i = 0; i < BLOCK; i++) {
        uint32_t e = z ? (code[i] ? (uint32_t)base + code[i] - 1 : 0) : (uint32_t)base + code[i];
        over |= e & ~f->emask;
        uint32_t x = ((sm[i] >> f->M) << (f->E + f->M)) | (e << f->M) | (sm[i] & f->mmask);
        if (f->width == 2) { uint16_t v = (uint16_t)x; memcpy(dst + 2 * i, &v, 2); }
        else memcpy(dst + 4 * i, &x, 4);
    }
    return over ? CC_CODE : 0;
}

/* ---- bfloat16, AVX2 ---- */

__attribute__((target("avx2"))) static inline int hmin_u8(__m256i v) {
    __m128i m = _mm_min_epu8(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_min_epu8(m, _mm_srli_si128(m, 8));
    m = _mm_min_epu8(m, _mm_srli_si128(m, 4));
    m = _mm_min_epu8(m, _mm_srli_si128(m, 2));
    m = _mm_min_epu8(m, _mm_srli_si128(m, 1));
    return _mm_cvtsi128_si32(m) & 0xFF;
}

__attribute__((target("avx2"))) static inline int hmax_u8(__m256i v) {
    __m128i m = _mm_max_epu8(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epu8(m, _mm_srli_si128(m, 8));
    m = _mm_max_epu8(m, _mm_srli_si128(m, 4));
    m = _mm_max_epu8(m, _mm_srli_si128(m, 2));
    m = _mm_max_epu8(m, _mm_srli_si128(m, 1));
    return _mm_cvtsi128_si32(m) & 0xFF;
}

/* 32 bf16 (two registers) -> their exponent bytes and sign/mantissa bytes, in order. */
__attribute__((target("avx2"))) static inline void bf16_split(const uint8_t *src, __m256i *e,
                                                              __m256i *sm) {
    __m256i a = _mm256_loadu_si256((const __m256i *)src);
    __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
    const __m256i m7f = _mm256_set1_epi16(0x7F), mff = _mm256_set1_epi16(0xFF),
                  m80 = _mm256_set1_epi16(0x80);
    __m256i ea = _mm256_and_si256(_mm256_srli_epi16(a, 7), mff);
    __m256i eb = _mm256_and_si256(_mm256_srli_epi16(b, 7), mff);
    __m256i sa = _mm256_or_si256(_mm256_and_si256(a, m7f), _mm256_and_si256(_mm256_srli_epi16(a, 8), m80));
    __m256i sb = _mm256_or_si256(_mm256_and_si256(b, m7f), _mm256_and_si256(_mm256_srli_epi16(b, 8), m80));
    *e = _mm256_permute4x64_epi64(_mm256_packus_epi16(ea, eb), 0xD8);
    *sm = _mm256_permute4x64_epi64(_mm256_packus_epi16(sa, sb), 0xD8);
}

/* Bit planes first..first+n-1 of two registers of bytes -> n*8 bytes. */
__attribute__((target("avx2"))) static inline void planes_out2(__m256i a, __m256i b, int first,
                                                               int n, uint8_t *o) {
    __m128i s = _mm_cvtsi32_si128(8 - first - n);
    a = _mm256_sll_epi16(a, s);
    b = _mm256_sll_epi16(b, s);
    for (int j = n - 1; j >= 0; j--) {
        uint32_t wa = (uint32_t)_mm256_movemask_epi8(a), wb = (uint32_t)_mm256_movemask_epi8(b);
        put64(o + 8 * j, (uint64_t)wb << 32 | wa);
        a = _mm256_add_epi8(a, a);
        b = _mm256_add_epi8(b, b);
    }
}

/* The 64 exponents as k offset planes from base (with z, exact zeros code 0 and the
   others sit one above): a coded block's last field; returns its end. */
__attribute__((target("avx2"))) static inline uint8_t *exp_planes_out(__m256i e0, __m256i e1,
                                                                      int k, int z, int base,
                                                                      uint8_t *o) {
    __m256i c0, c1;
    if (z) {
        __m256i off = _mm256_set1_epi8((char)(base - 1)), zero = _mm256_setzero_si256();
        c0 = _mm256_andnot_si256(_mm256_cmpeq_epi8(e0, zero), _mm256_sub_epi8(e0, off));
        c1 = _mm256_andnot_si256(_mm256_cmpeq_epi8(e1, zero), _mm256_sub_epi8(e1, off));
    } else {
        __m256i off = _mm256_set1_epi8((char)base);
        c0 = _mm256_sub_epi8(e0, off);
        c1 = _mm256_sub_epi8(e1, off);
    }
    planes_out2(c0, c1, 0, k, o);
    return o + 8 * k;
}

__attribute__((target("avx2"))) static uint8_t *enc_block_bf16(const uint8_t *src, uint8_t *o) {
    __m256i e0, e1, s0, s1;
    bf16_split(src, &e0, &s0);
    bf16_split(src + 64, &e1, &s1);
    const __m256i one = _mm256_set1_epi8(1);
    int lo = hmin_u8(_mm256_min_epu8(e0, e1)), hi = hmax_u8(_mm256_max_epu8(e0, e1));
    /* e - 1 wraps 0 to 255, so its minimum + 1 is the least non-zero exponent (256: none) */
    int lo_nz = hmin_u8(_mm256_min_epu8(_mm256_sub_epi8(e0, one), _mm256_sub_epi8(e1, one))) + 1;
    int z, base, k = choose(lo, hi, lo_nz, 8, &z, &base);
    o[0] = (uint8_t)(k | z << 4);
    o[1] = (uint8_t)base;
    _mm256_storeu_si256((__m256i *)(o + 2), s0);
    _mm256_storeu_si256((__m256i *)(o + 34), s1);
    o += 66;
    if (k == 0) return o;
    return exp_planes_out(e0, e1, k, z, base, o);
}

/* 32 bits -> 32 bytes, 0xFF where the bit is set. */
__attribute__((target("avx2"))) static inline __m256i bits_to_bytes(uint32_t w) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)w), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

__attribute__((target("avx2"))) static inline void bf16_join(uint8_t *dst, __m256i e, __m256i sm) {
    e = _mm256_permute4x64_epi64(e, 0xD8);
    sm = _mm256_permute4x64_epi64(sm, 0xD8);
    __m256i lo = _mm256_unpacklo_epi8(sm, e), hi = _mm256_unpackhi_epi8(sm, e);
    const __m256i m7f = _mm256_set1_epi16(0x7F), m8000 = _mm256_set1_epi16((short)0x8000),
                  m7f80 = _mm256_set1_epi16(0x7F80);
    lo = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(lo, m7f),
                                         _mm256_and_si256(_mm256_slli_epi16(lo, 8), m8000)),
                         _mm256_and_si256(_mm256_srli_epi16(lo, 1), m7f80));
    hi = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(hi, m7f),
                                         _mm256_and_si256(_mm256_slli_epi16(hi, 8), m8000)),
                         _mm256_and_si256(_mm256_srli_epi16(hi, 1), m7f80));
    _mm256_storeu_si256((__m256i *)dst, lo);
    _mm256_storeu_si256((__m256i *)(dst + 32), hi);
}

__attribute__((target("avx2"))) static int dec_block_bf16(const uint8_t *in, int k, uint8_t *dst) {
    int z = in[0] >> 4 & 1, base = in[1];
    __m256i s0 = _mm256_loadu_si256((const __m256i *)(in + 2));
    __m256i s1 = _mm256_loadu_si256((const __m256i *)(in + 34));
    __m256i c0 = _mm256_setzero_si256(), c1 = _mm256_setzero_si256();
    const uint8_t *p = in + 66;
    for (int j = 0; j < k; j++, p += 8) {
        uint64_t w = get64(p);
        __m256i bit = _mm256_set1_epi8((char)(1 << j));
        c0 = _mm256_or_si256(c0, _mm256_and_si256(bits_to_bytes((uint32_t)w), bit));
        c1 = _mm256_or_si256(c1, _mm256_and_si256(bits_to_bytes((uint32_t)(w >> 32)), bit));
    }
    __m256i e0, e1, over;
    if (z) {
        __m256i off = _mm256_set1_epi8((char)(base - 1)), zero = _mm256_setzero_si256();
        __m256i nz0 = _mm256_cmpeq_epi8(c0, zero), nz1 = _mm256_cmpeq_epi8(c1, zero); /* code 0 */
        __m256i t0 = _mm256_adds_epu8(c0, off), t1 = _mm256_adds_epu8(c1, off);
        /* a non-zero code overflows where the wrapping sum differs from the saturating one */
        __m256i w0 = _mm256_add_epi8(c0, off), w1 = _mm256_add_epi8(c1, off);
        over = _mm256_or_si256(_mm256_andnot_si256(nz0, _mm256_xor_si256(w0, t0)),
                               _mm256_andnot_si256(nz1, _mm256_xor_si256(w1, t1)));
        e0 = _mm256_andnot_si256(nz0, w0);
        e1 = _mm256_andnot_si256(nz1, w1);
    } else {
        __m256i off = _mm256_set1_epi8((char)base);
        e0 = _mm256_add_epi8(c0, off);
        e1 = _mm256_add_epi8(c1, off);
        over = _mm256_or_si256(_mm256_xor_si256(e0, _mm256_adds_epu8(c0, off)),
                               _mm256_xor_si256(e1, _mm256_adds_epu8(c1, off)));
    }
    bf16_join(dst, e0, s0);
    bf16_join(dst + 64, e1, s1);
    return _mm256_testz_si256(over, over) ? 0 : CC_CODE;
}

/* ---- float16 and float32, AVX2 ---- */

/* Bit planes first..first+n-1 of 64 bytes (each below 2**(first+n)) -> n*8 bytes. */
__attribute__((target("avx2"))) static inline void planes_out(const uint8_t *v, int first, int n,
                                                              uint8_t *o) {
    if (n == 0) return;
    __m128i s = _mm_cvtsi32_si128(8 - first - n);
    __m256i a = _mm256_sll_epi16(_mm256_loadu_si256((const __m256i *)v), s);
    __m256i b = _mm256_sll_epi16(_mm256_loadu_si256((const __m256i *)(v + 32)), s);
    for (int j = n - 1; j >= 0; j--) {
        uint32_t wa = (uint32_t)_mm256_movemask_epi8(a), wb = (uint32_t)_mm256_movemask_epi8(b);
        put64(o + 8 * j, (uint64_t)wb << 32 | wa);
        a = _mm256_add_epi8(a, a);
        b = _mm256_add_epi8(b, b);
    }
}

/* n*8 bytes of bit planes -> 64 bytes, plane j as bit first+j. */
__attribute__((target("avx2"))) static inline void planes_in(const uint8_t *p, int first, int n,
                                                             uint8_t *v) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (int j = 0; j < n; j++, p += 8) {
        uint64_t w = get64(p);
        __m256i bit = _mm256_set1_epi8((char)(1 << (first + j)));
        a = _mm256_or_si256(a, _mm256_and_si256(bits_to_bytes((uint32_t)w), bit));
        b = _mm256_or_si256(b, _mm256_and_si256(bits_to_bytes((uint32_t)(w >> 32)), bit));
    }
    _mm256_storeu_si256((__m256i *)v, a);
    _mm256_storeu_si256((__m256i *)(v + 32), b);
}

/* float32: the element loops are the compiler's (32-bit lanes), three byte planes of
 * sign and mantissa, exponent codes as bit planes */
__attribute__((target("avx2"))) static uint8_t *enc_block_fp32(const uint8_t *src, uint8_t *o) {
    uint8_t e[BLOCK], s0[BLOCK], s1[BLOCK], s2[BLOCK], code[BLOCK];
    uint32_t x[BLOCK];
    memcpy(x, src, sizeof x);
    for (int i = 0; i < BLOCK; i++) {
        uint32_t v = x[i];
        e[i] = (uint8_t)(v >> 23);
        s0[i] = (uint8_t)v;
        s1[i] = (uint8_t)(v >> 8);
        s2[i] = (uint8_t)((v >> 16 & 0x7F) | (v >> 24 & 0x80));
    }
    uint8_t lo = 255, hi = 0, lo_nz1 = 255;
    for (int i = 0; i < BLOCK; i++) {
        lo = e[i] < lo ? e[i] : lo;
        hi = e[i] > hi ? e[i] : hi;
        uint8_t m1 = (uint8_t)(e[i] - 1); /* 0 wraps to 255 */
        lo_nz1 = m1 < lo_nz1 ? m1 : lo_nz1;
    }
    int z, base, k = choose(lo, hi, lo_nz1 + 1, 8, &z, &base);
    o[0] = (uint8_t)(k | z << 4);
    o[1] = (uint8_t)base;
    memcpy(o + 2, s0, BLOCK);
    memcpy(o + 2 + BLOCK, s1, BLOCK);
    memcpy(o + 2 + 2 * BLOCK, s2, BLOCK);
    o += 2 + 3 * BLOCK;
    if (k == 0) return o;
    const uint8_t off = (uint8_t)(z ? base - 1 : base);
    for (int i = 0; i < BLOCK; i++)
        code[i] = (uint8_t)((z && e[i] == 0) ? 0 : (uint8_t)(e[i] - off));
    planes_out(code, 0, k, o);
    return o + 8 * k;
}

__attribute__((target("avx2"))) static int dec_block_fp32(const uint8_t *in, int k, uint8_t *dst) {
    const int z = in[0] >> 4 & 1, base = in[1];
    const uint8_t *s0 = in + 2, *s1 = in + 2 + BLOCK, *s2 = in + 2 + 2 * BLOCK;
    uint8_t code[BLOCK], e[BLOCK];
    planes_in(in + 2 + 3 * BLOCK, 0, k, code);
    /* exponents as bytes first (32 lanes), checked in 16 bits, then widened once */
    const uint8_t off = (uint8_t)(z ? base - 1 : base);
    uint16_t over = 0;
    for (int i = 0; i < BLOCK; i++) {
        uint16_t wide = (uint16_t)(code[i] + off);
        uint8_t keep = (z && code[i] == 0) ? 0 : 0xFF;
        over |= (uint16_t)(wide & 0xFF00 & (uint16_t)(keep * 0x0101u));
        e[i] = (uint8_t)wide & keep;
    }
    uint32_t x[BLOCK];
    for (int i = 0; i < BLOCK; i++)
        x[i] = (uint32_t)(s2[i] >> 7) << 31 | (uint32_t)e[i] << 23
             | (uint32_t)(s2[i] & 0x7F) << 16 | (uint32_t)s1[i] << 8 | s0[i];
    memcpy(dst, x, sizeof x);
    return over ? CC_CODE : 0;
}

/* float16 from registers, as bfloat16: sm = sign << 10 | mantissa, 11 bits in two bytes */
__attribute__((target("avx2"))) static inline void fp16_split(const uint8_t *src, __m256i *e,
                                                              __m256i *s0, __m256i *s1) {
    __m256i a = _mm256_loadu_si256((const __m256i *)src);
    __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
    const __m256i m1f = _mm256_set1_epi16(0x1F), mff = _mm256_set1_epi16(0xFF),
                  m3 = _mm256_set1_epi16(0x3), m4 = _mm256_set1_epi16(0x4);
    __m256i ea = _mm256_and_si256(_mm256_srli_epi16(a, 10), m1f);
    __m256i eb = _mm256_and_si256(_mm256_srli_epi16(b, 10), m1f);
    __m256i la = _mm256_and_si256(a, mff), lb = _mm256_and_si256(b, mff);
    __m256i ha = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 8), m3),
                                 _mm256_and_si256(_mm256_srli_epi16(a, 13), m4));
    __m256i hb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 8), m3),
                                 _mm256_and_si256(_mm256_srli_epi16(b, 13), m4));
    *e = _mm256_permute4x64_epi64(_mm256_packus_epi16(ea, eb), 0xD8);
    *s0 = _mm256_permute4x64_epi64(_mm256_packus_epi16(la, lb), 0xD8);
    *s1 = _mm256_permute4x64_epi64(_mm256_packus_epi16(ha, hb), 0xD8);
}

__attribute__((target("avx2"))) static uint8_t *enc_block_fp16(const uint8_t *src, uint8_t *o) {
    __m256i e0, e1, l0, l1, h0, h1;
    fp16_split(src, &e0, &l0, &h0);
    fp16_split(src + 64, &e1, &l1, &h1);
    const __m256i one = _mm256_set1_epi8(1);
    int lo = hmin_u8(_mm256_min_epu8(e0, e1)), hi = hmax_u8(_mm256_max_epu8(e0, e1));
    int lo_nz = hmin_u8(_mm256_min_epu8(_mm256_sub_epi8(e0, one), _mm256_sub_epi8(e1, one))) + 1;
    if (lo_nz > 31) lo_nz = 32; /* none */
    int z, base, k = choose(lo, hi, lo_nz, 5, &z, &base);
    o[0] = (uint8_t)(k | z << 4);
    o[1] = (uint8_t)base;
    _mm256_storeu_si256((__m256i *)(o + 2), l0);
    _mm256_storeu_si256((__m256i *)(o + 34), l1);
    planes_out2(h0, h1, 0, 3, o + 66);
    o += 90;
    if (k == 0) return o;
    return exp_planes_out(e0, e1, k, z, base, o);
}

/* 32 float16 from their exponent, low and high sign/mantissa bytes (in element order). */
__attribute__((target("avx2"))) static inline void fp16_join(uint8_t *dst, __m256i e, __m256i l,
                                                             __m256i h) {
    e = _mm256_permute4x64_epi64(e, 0xD8);
    l = _mm256_permute4x64_epi64(l, 0xD8);
    h = _mm256_permute4x64_epi64(h, 0xD8);
    const __m256i zero = _mm256_setzero_si256(), m3ff = _mm256_set1_epi16(0x3FF),
                  m400 = _mm256_set1_epi16(0x400);
    __m256i sm_lo = _mm256_unpacklo_epi8(l, h), sm_hi = _mm256_unpackhi_epi8(l, h);
    __m256i e_lo = _mm256_unpacklo_epi8(e, zero), e_hi = _mm256_unpackhi_epi8(e, zero);
    __m256i x_lo = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(sm_lo, m3ff),
                                                   _mm256_slli_epi16(_mm256_and_si256(sm_lo, m400), 5)),
                                   _mm256_slli_epi16(e_lo, 10));
    __m256i x_hi = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(sm_hi, m3ff),
                                                   _mm256_slli_epi16(_mm256_and_si256(sm_hi, m400), 5)),
                                   _mm256_slli_epi16(e_hi, 10));
    _mm256_storeu_si256((__m256i *)dst, x_lo);
    _mm256_storeu_si256((__m256i *)(dst + 32), x_hi);
}

/* n*8 bytes of bit planes -> two registers of bytes, plane j as bit j. */
__attribute__((target("avx2"))) static inline void planes_in2(const uint8_t *p, int n, __m256i *a,
                                                              __m256i *b) {
    __m256i x = _mm256_setzero_si256(), y = _mm256_setzero_si256();
    for (int j = 0; j < n; j++, p += 8) {
        uint64_t w = get64(p);
        __m256i bit = _mm256_set1_epi8((char)(1 << j));
        x = _mm256_or_si256(x, _mm256_and_si256(bits_to_bytes((uint32_t)w), bit));
        y = _mm256_or_si256(y, _mm256_and_si256(bits_to_bytes((uint32_t)(w >> 32)), bit));
    }
    *a = x;
    *b = y;
}

__attribute__((target("avx2"))) static int dec_block_fp16(const uint8_t *in, int k, uint8_t *dst) {
    int z = in[0] >> 4 & 1, base = in[1];
    __m256i l0 = _mm256_loadu_si256((const __m256i *)(in + 2));
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(in + 34));
    __m256i h0, h1, c0, c1;
    planes_in2(in + 66, 3, &h0, &h1);
    planes_in2(in + 90, k, &c0, &c1);
    /* codes and base are below 32: sums fit a byte, and past 31 is an overflow */
    __m256i off = _mm256_set1_epi8((char)(z ? base - 1 : base));
    __m256i e0 = _mm256_add_epi8(c0, off), e1 = _mm256_add_epi8(c1, off);
    if (z) {
        __m256i zero = _mm256_setzero_si256();
        e0 = _mm256_andnot_si256(_mm256_cmpeq_epi8(c0, zero), e0);
        e1 = _mm256_andnot_si256(_mm256_cmpeq_epi8(c1, zero), e1);
    }
    __m256i high = _mm256_set1_epi8((char)0xE0);
    __m256i over = _mm256_and_si256(_mm256_or_si256(e0, e1), high);
    fp16_join(dst, e0, l0, h0);
    fp16_join(dst + 64, e1, l1, h1);
    return _mm256_testz_si256(over, over) ? 0 : CC_CODE;
}

/* One pass over the blocks: each header is checked, then the block decoded. The verdict
 * is proto's, which checks every header and the length before any code: a code error is
 * kept, the headers after it are still walked, and it is reported only if they and the
 * length are good. The walk is a chain of dependent loads, so it is not a pass of its
 * own: through memory that pass cost as much as the decoding. */
#define DECODE_LOOP(DECODE_BLOCK)                                                          \
    do {                                                                                   \
        uint64_t at = 0, err_at = 0;                                                       \
        int err = 0;                                                                       \
        for (uint64_t b = 0; b < nb; b++, dst += BLOCK * f->width) {                       \
            *where = b;                                                                    \
            if (at + 1 >= len) return CC_SHORT;                                            \
            int k = check_header(f, in + at);                                              \
            if (k < 0) return k;                                                           \
            uint64_t size = fixed + 8 * (uint64_t)k;                                       \
            if (!err && at + size <= len) {                                                \
                int r = DECODE_BLOCK;                                                      \
                if (r < 0) { err = r; err_at = b; }                                        \
            }                                                                              \
            at += size;                                                                    \
        }                                                                                  \
        *where = nb;                                                                       \
        uint64_t tail = (count % BLOCK) * (uint64_t)f->width;                              \
        if (at + tail != len) return at + tail > len ? CC_SHORT : CC_LONG;                 \
        if (err) { *where = err_at; return err; }                                          \
        memcpy(dst, in + at, tail);                                                        \
        return 0;                                                                          \
    } while (0)

#define DECODE_ARGS const fmt_t *f, const uint8_t *in, uint64_t len, uint64_t count,       \
                    uint8_t *dst, uint64_t *where
#define DECODE_SETUP                                                                       \
    uint64_t nb = count / BLOCK;                                                           \
    uint64_t fixed = 2 + BLOCK * (uint64_t)f->sbytes + 8 * (uint64_t)f->sbits

/* Per vector path: whole runs of blocks, no call per block. */
#define RUNS(name, width)                                                                  \
    __attribute__((target("avx2"))) static uint8_t *enc_run_##name(const uint8_t *src,     \
                                                                  uint64_t nb, uint8_t *o) { \
        for (uint64_t b = 0; b < nb; b++, src += BLOCK * width)                          \
            o = enc_block_##name(src, o);                                                  \
        return o;                                                                          \
    }                                                                                      \
    __attribute__((target("avx2"))) static int64_t dec_run_##name(DECODE_ARGS) {          \
        DECODE_SETUP;                                                                      \
        DECODE_LOOP(dec_block_##name(in + at, k, dst));                                    \
    }
RUNS(bf16, 2)
RUNS(fp16, 2)
RUNS(fp32, 4)


static int64_t dec_run_generic(DECODE_ARGS) {
    DECODE_SETUP;
    DECODE_LOOP(dec_block_generic(f, in + at, k, dst));
}

static int use_avx2 = -1;

static inline int avx2(void) {
    if (use_avx2 < 0) use_avx2 = __builtin_cpu_supports("avx2");
    return use_avx2;
}

/* Force the generic path (tests hold both to the same bytes); returns the previous state. */
int cc_set_vector(int on) {
    int was = avx2();
    use_avx2 = on ? __builtin_cpu_supports("avx2") : 0;
    return was;
}

int cc_vector(void) { return avx2(); }

/* 1: bfloat16; 2: float16; 4: float32; 0: generic. */
static int vector_path(const fmt_t *f) {
    if (!avx2()) return 0;
    if (f->width == 2 && f->E == 8 && f->M == 7) return 1;
    if (f->width == 2 && f->E == 5 && f->M == 10) return 2;
    if (f->width == 4 && f->E == 8 && f->M == 23) return 4;
    return 0;
}

/* Codes count elements of src into dst (room: proto.codec.encoded_size_bound); returns
 * the bytes written, or CC_FORMAT. */
int64_t cc_encode(int bits, int E, int M, const uint8_t *src, uint64_t count, uint8_t *dst) {
    fmt_t f;
    if (!fmt_init(&f, bits, E, M)) return CC_FORMAT;
    uint64_t nb = count / BLOCK;
    uint8_t *o = dst;
    switch (vector_path(&f)) {
    case 1: o = enc_run_bf16(src, nb, o); break;
    case 2: o = enc_run_fp16(src, nb, o); break;
    case 4: o = enc_run_fp32(src, nb, o); break;
    default:
        for (uint64_t b = 0; b < nb; b++) o = enc_block_generic(&f, src + b * BLOCK * f.width, o);
    }
    src += nb * BLOCK * f.width;
    uint64_t tail = (count % BLOCK) * (uint64_t)f.width;
    memcpy(o, src, tail);
    return (int64_t)(o - dst) + (int64_t)tail;
}

/* Decodes len bytes into count elements at dst; returns 0, or a negative CC_ code with
 * the block it concerns in *where (dst then holds an undefined part of the result). */
int64_t cc_decode(int bits, int E, int M, const uint8_t *in, uint64_t len, uint64_t count,
                  uint8_t *dst, uint64_t *where) {
    fmt_t f;
    if (!fmt_init(&f, bits, E, M)) return CC_FORMAT;
    switch (vector_path(&f)) {
    case 1: return dec_run_bf16(&f, in, len, count, dst, where);
    case 2: return dec_run_fp16(&f, in, len, count, dst, where);
    case 4: return dec_run_fp32(&f, in, len, count, dst, where);
    default: return dec_run_generic(&f, in, len, count, dst, where);
    }
}
