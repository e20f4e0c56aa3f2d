/* fpgaccl software engine: the per-packet loops of the RoCEv2 data path in C.
 *
 * Python keeps every protocol decision (which packets, which PSNs, what a failed check
 * means); these functions only run the loops that Python would run per packet: seal a
 * run of staged datagram rows (BTH, PSN word, ICRC), check a run of received WRITE
 * MIDDLE datagrams and copy their payloads, and move many datagrams per system call
 * (sendmmsg of UDP_SEGMENT runs, recvmmsg of UDP_GRO runs). Header offsets, opcode bytes
 * and masks arrive as arguments from fpgaccl.proto (one source of truth); the ICRC's
 * CRC-32 is the caller's function (ISA-L's or zlib's), so there is one CRC code too.
 *
 * Built by fpgaccl.host.native with the system's C compiler; no Python headers needed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

typedef uint32_t (*crc_fn)(uint32_t crc, const unsigned char *buf, uint64_t len);

/* Payload copies into the landing buffer are plain memcpy, and so are the fold's stores:
 * the chunk a step lands or folds is what this rank sends at the next step (of a ring or
 * of halving-doubling), so its lines are wanted in the cache. Non-temporal stores pushed
 * them out to memory, to be read back by the ICRC and the kernel's copy: in alternating
 * 64 MiB 4-rank allreduces they cost 0.4-3 ms of user time a call (means of two runs of
 * 5-6 pairs; 80-83 ms a call against 82-88 where both runs were in the fast mode). */

static inline uint32_t load_be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline void store_be32(uint8_t *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static inline uint32_t load_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline void store_le32(uint8_t *p, uint32_t v) {
    p[0] = v; p[1] = v >> 8; p[2] = v >> 16; p[3] = v >> 24;
}

/* The PSN word of packet i of a run from psn0: its PSN, and the AckReq bit when it is the
 * `half`-th packet since the last one that asked (*since counts them across runs). */
static inline uint32_t psn_word(uint32_t psn0, uint32_t i, uint32_t psn_mask,
                                uint32_t ackreq_bit, uint32_t *since, uint32_t half) {
    uint32_t w2 = (psn0 + i) & psn_mask;
    if (++*since >= half) {
        w2 |= ackreq_bit;
        *since = 0;
    }
    return w2;
}

/* Seal k rows of seg bytes (BTH | payload | ICRC) as consecutive WRITE MIDDLE packets:
 * the first 8 BTH bytes are `head8`, the PSN word of row i is (psn0 + i) & psn_mask with
 * `ackreq_bit` on every row whose count since the last AckReq (`since` before row 0)
 * reaches `half`, and the ICRC (little-endian, last 4 bytes) is crc(state, row[8:seg-4])
 * where `state` already covers the pseudo-header and the masked first 8 BTH bytes.
 * Returns the AckReq count after the run. */
uint32_t fp_seal_rows(uint8_t *rows, uint32_t k, uint32_t seg, const uint8_t *head8,
                      uint32_t psn0, uint32_t psn_mask, uint32_t ackreq_bit, uint32_t since,
                      uint32_t half, uint32_t state, crc_fn crc) {
    for (uint32_t i = 0; i < k; i++) {
        uint8_t *row = rows + (uint64_t)i * seg;
        memcpy(row, head8, 8);
        store_be32(row + 8, psn_word(psn0, i, psn_mask, ackreq_bit, &since, half));
        store_le32(row + seg - 4, crc(state, row + 8, seg - 12));
    }
    return since;
}

/* Seal k consecutive WRITE MIDDLE packets whose payloads are not copied anywhere: packet
 * i's payload is the mtu bytes at src + i * mtu (the sender's own memory), and its row of
 * bth_len + 4 bytes in `meta` receives its BTH (as fp_seal_rows writes it) and then its
 * ICRC, crc(crc(state, BTH[8:bth_len]), payload), little-endian. fp_send_gather sends
 * each packet as those three pieces. Returns the AckReq count after the run. */
uint32_t fp_seal_meta(uint8_t *meta, uint32_t bth_len, const uint8_t *src, uint32_t k,
                      uint32_t mtu, const uint8_t *head8, uint32_t psn0, uint32_t psn_mask,
                      uint32_t ackreq_bit, uint32_t since, uint32_t half, uint32_t state,
                      crc_fn crc) {
    for (uint32_t i = 0; i < k; i++) {
        uint8_t *m = meta + (uint64_t)i * (bth_len + 4);
        memcpy(m, head8, 8);
        store_be32(m + 8, psn_word(psn0, i, psn_mask, ackreq_bit, &since, half));
        uint32_t c = crc(state, m + 8, bth_len - 8);
        store_le32(m + bth_len, crc(c, src + (uint64_t)i * mtu, mtu));
    }
    return since;
}

/* Reduce-on-receive (the DESIGN's data flow: a RECV_REDUCE's payload goes through the
 * reduction unit, not to memory first): out[i] = a[i] op b[i], b a received payload, a the
 * local operand, out its destination, which may be a itself. `kind` is one of FOLD_*
 * (fpgaccl.host.fold maps proto.reduce's dtypes and ops onto them). Float sums follow
 * proto.reduce's NaN rule: a NaN result becomes a's NaN made quiet, else b's made quiet,
 * else the default NaN `dflt`; `quiet` is the quiet bit. Blocks go through aligned
 * scratch: payloads lie 4 bytes off an 8-byte boundary, and a aliases out in place. */
#define FOLD_F32_SUM 1
#define FOLD_F64_SUM 2
#define FOLD_U32_SUM 3
#define FOLD_U64_SUM 4
#define FOLD_BLOCK 512 /* elements */

typedef struct {
    uint64_t a, out; /* addresses of element 0 of the landing's operand and destination */
    uint64_t quiet, dflt;
    uint32_t kind, pad;
} fold_t;

#if defined(__x86_64__) && defined(__GNUC__)
#define FOLD_CLONES __attribute__((optimize("O3"), target_clones("avx2", "default")))
#else
#define FOLD_CLONES __attribute__((optimize("O3")))
#endif

#define FOLD_SUM(NAME, T, U)                                                                 \
    FOLD_CLONES static int NAME##_add(T *restrict r, const T *restrict a, const T *restrict b, \
                                      uint32_t n) {                                          \
        int nan = 0;                                                                         \
        for (uint32_t i = 0; i < n; i++) {                                                   \
            r[i] = a[i] + b[i];                                                              \
            nan |= r[i] != r[i];                                                             \
        }                                                                                    \
        return nan;                                                                          \
    }                                                                                        \
    static void NAME##_nans(T *r, const T *a, const T *b, uint32_t n, U quiet, U dflt) {     \
        for (uint32_t i = 0; i < n; i++) {                                                   \
            if (r[i] == r[i])                                                                \
                continue;                                                                    \
            U u = dflt;                                                                      \
            if (a[i] != a[i])                                                                \
                memcpy(&u, &a[i], sizeof(u)), u |= quiet;                                    \
            else if (b[i] != b[i])                                                           \
                memcpy(&u, &b[i], sizeof(u)), u |= quiet;                                    \
            memcpy(&r[i], &u, sizeof(u));                                                    \
        }                                                                                    \
    }

FOLD_SUM(f32, float, uint32_t)
FOLD_SUM(f64, double, uint64_t)
FOLD_SUM(u32, uint32_t, uint32_t)
FOLD_SUM(u64, uint64_t, uint64_t)

#define FOLD_BLOCKS(NAME, T, U, FLOAT)                                                       \
    static void NAME##_fold(uint8_t *out, const uint8_t *a, const uint8_t *b, uint64_t n,    \
                            U quiet, U dflt) {                                               \
        T ta[FOLD_BLOCK], tb[FOLD_BLOCK], tr[FOLD_BLOCK];                                    \
        for (uint64_t off = 0; off < n; off += sizeof(ta)) {                                 \
            uint32_t m = (uint32_t)((n - off < sizeof(ta) ? n - off : sizeof(ta)) / sizeof(T)); \
            memcpy(ta, a + off, m * sizeof(T));                                              \
            memcpy(tb, b + off, m * sizeof(T));                                              \
            if (NAME##_add(tr, ta, tb, m) && FLOAT)                                          \
                NAME##_nans(tr, ta, tb, m, quiet, dflt);                                     \
            memcpy(out + off, tr, m * sizeof(T));                                            \
        }                                                                                    \
    }

FOLD_BLOCKS(f32, float, uint32_t, 1)
FOLD_BLOCKS(f64, double, uint64_t, 1)
FOLD_BLOCKS(u32, uint32_t, uint32_t, 0)
FOLD_BLOCKS(u64, uint64_t, uint64_t, 0)

static void fold_scalar(const fold_t *f, uint8_t *out, const uint8_t *a, const uint8_t *b,
                        uint64_t n) {
    switch (f->kind) {
    case FOLD_F32_SUM: f32_fold(out, a, b, n, (uint32_t)f->quiet, (uint32_t)f->dflt); break;
    case FOLD_F64_SUM: f64_fold(out, a, b, n, f->quiet, f->dflt); break;
    case FOLD_U32_SUM: u32_fold(out, a, b, n, 0, 0); break;
    case FOLD_U64_SUM: u64_fold(out, a, b, n, 0, 0); break;
    }
}

/* fold_scalar for a few bytes (the AVX2 fold's tail, at most 28): element by
 * element, without the block scratch that costs more than the work here. */
#define FOLD_FEW(NAME, T, U, FLOAT)                                                          \
    for (uint64_t i = 0; i < n; i += sizeof(T)) {                                            \
        T x, y, r;                                                                           \
        memcpy(&x, a + i, sizeof(T));                                                        \
        memcpy(&y, b + i, sizeof(T));                                                        \
        r = x + y;                                                                           \
        if (FLOAT && r != r)                                                                 \
            NAME##_nans(&r, &x, &y, 1, (U)f->quiet, (U)f->dflt);                             \
        memcpy(out + i, &r, sizeof(T));                                                      \
    }

static void fold_few(const fold_t *f, uint8_t *out, const uint8_t *a, const uint8_t *b,
                     uint64_t n) {
    switch (f->kind) {
    case FOLD_F32_SUM: FOLD_FEW(f32, float, uint32_t, 1) break;
    case FOLD_F64_SUM: FOLD_FEW(f64, double, uint64_t, 1) break;
    case FOLD_U32_SUM: FOLD_FEW(u32, uint32_t, uint32_t, 0) break;
    case FOLD_U64_SUM: FOLD_FEW(u64, uint64_t, uint64_t, 0) break;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* The AVX2 fold: 32 bytes at a time, about twice fold_scalar's speed (48 MiB from cold
 * memory, measured alone: 4.4 ms against 6.8; 3.7 with non-temporal stores). Stores are
 * plain and unaligned (see the payload copies above): the folded chunk is the next
 * step's SEND. The tail, and any 32 bytes whose float sum has a NaN, go element by
 * element (fold_few). */
__attribute__((target("avx2"))) static void fold_avx2(const fold_t *f, uint8_t *out,
                                                      const uint8_t *a, const uint8_t *b,
                                                      uint64_t n) {
    uint64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i r;
        int nan = 0;
        switch (f->kind) {
        case FOLD_F32_SUM: {
            __m256 x = _mm256_add_ps(_mm256_loadu_ps((const float *)(a + i)),
                                     _mm256_loadu_ps((const float *)(b + i)));
            nan = _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            r = _mm256_castps_si256(x);
            break;
        }
        case FOLD_F64_SUM: {
            __m256d x = _mm256_add_pd(_mm256_loadu_pd((const double *)(a + i)),
                                      _mm256_loadu_pd((const double *)(b + i)));
            nan = _mm256_movemask_pd(_mm256_cmp_pd(x, x, _CMP_UNORD_Q));
            r = _mm256_castpd_si256(x);
            break;
        }
        case FOLD_U32_SUM:
            r = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(a + i)),
                                 _mm256_loadu_si256((const __m256i *)(b + i)));
            break;
        default:
            r = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(a + i)),
                                 _mm256_loadu_si256((const __m256i *)(b + i)));
        }
        if (nan)
            fold_few(f, out + i, a + i, b + i, 32); /* a is intact: nothing stored yet */
        else
            _mm256_storeu_si256((__m256i *)(out + i), r);
    }
    fold_few(f, out + i, a + i, b + i, n - i);
}

static int fold_vector = -1;
static const uint8_t fold_size[] = {0, 4, 8, 4, 8}; /* element bytes by FOLD_* kind */
#endif

/* out = a op b over n bytes (whole elements) as f says; the offsets are from f's a/out
 * element 0. Returns 0, or -1 for a kind this library does not know. */
int fp_fold(const fold_t *f, uint64_t at, const uint8_t *b, uint64_t n) {
    uint8_t *out = (uint8_t *)(uintptr_t)(f->out + at);
    const uint8_t *a = (const uint8_t *)(uintptr_t)(f->a + at);
    if (f->kind < FOLD_F32_SUM || f->kind > FOLD_U64_SUM)
        return -1;
#if defined(__x86_64__) && defined(__GNUC__)
    if (fold_vector < 0)
        fold_vector = __builtin_cpu_supports("avx2");
    if (fold_vector && n >= 256 && (uintptr_t)out % fold_size[f->kind] == 0) {
        fold_avx2(f, out, a, b, n);
        return 0;
    }
#endif
    fold_scalar(f, out, a, b, n);
    return 0;
}

/* Check up to k received datagrams of seg bytes lying back to back in `buf`: take the
 * leading ones whose first 8 bytes equal `head`, whose PSN word (AckReq masked off) is
 * (epsn + i) & psn_mask, and whose ICRC is crc(state, dgram[8:seg-4]); copy each taken
 * one's payload (bytes [bth_len, seg - 4)) to dst + i * payload. A datagram that fails
 * a check is not copied, and neither is any after it. Returns how many were taken,
 * and ORs their PSN words' AckReq bits into *ackreq. With `fold`, payload i is folded at
 * offset at + i * payload instead of copied. */
static uint32_t take_run(const uint8_t *buf, uint32_t k, uint32_t seg, const uint8_t *head,
                         uint32_t bth_len, uint32_t epsn, uint32_t psn_mask,
                         uint32_t ackreq_bit, uint32_t state, crc_fn crc, uint8_t *dst,
                         uint32_t *ackreq, const fold_t *fold, uint64_t at) {
    uint32_t pay = seg - bth_len - 4, acc = 0, i;
    for (i = 0; i < k; i++) {
        const uint8_t *d = buf + (uint64_t)i * seg;
        uint32_t w2 = load_be32(d + 8);
        if (memcmp(d, head, 8) != 0 || (w2 & ~ackreq_bit) != ((epsn + i) & psn_mask))
            break;
        if (crc(state, d + 8, seg - 12) != load_le32(d + seg - 4))
            break;
        if (fold)
            fp_fold(fold, at + (uint64_t)i * pay, d + bth_len, pay);
        else
            memcpy(dst + (uint64_t)i * pay, d + bth_len, pay);
        acc |= w2;
    }
    *ackreq |= acc & ackreq_bit;
    return i;
}

/* take_run over the received runs j0, j0 + 1, ... of a recv batch (run j at
 * buf + j * slot, lens/segs/addrs/ports as fp_recv_batch left them): each run must hold
 * whole seg-byte datagrams from run j0's source, and its datagrams must pass
 * take_run's checks against run j0's first 8 bytes, PSNs continuing from run to
 * run; at most `room` datagrams in all. Stops at the first datagram that fails.
 * Returns the datagrams taken; *whole gets how many runs were taken entirely (the run
 * after them, if any, had its first (return - their datagrams) taken). With `fold`, the
 * payloads are not copied to dst but folded (fp_fold) into fold's destination, the first
 * one at offset fold_at. */
uint64_t fp_take_runs(const uint8_t *buf, uint32_t slot, uint32_t j0, uint32_t r,
                      const uint32_t *lens, const uint32_t *segs, const uint32_t *addrs,
                      const uint32_t *ports, uint32_t seg, uint32_t bth_len, uint32_t epsn,
                      uint32_t psn_mask, uint32_t ackreq_bit, uint32_t state, crc_fn crc,
                      uint8_t *dst, uint64_t room, uint32_t *ackreq, uint32_t *whole,
                      const fold_t *fold, uint64_t fold_at) {
    const uint8_t *head = buf + (uint64_t)j0 * slot;
    uint32_t pay = seg - bth_len - 4;
    uint64_t taken = 0;
    *ackreq = 0;
    *whole = 0;
    for (uint32_t j = j0; j < r && taken < room; j++) {
        uint32_t n = lens[j];
        if (n % seg || (segs[j] != seg && n != seg) || addrs[j] != addrs[j0] ||
            ports[j] != ports[j0])
            break;
        uint32_t k = n / seg;
        if (k > room - taken)
            k = (uint32_t)(room - taken);
        uint32_t t = take_run(buf + (uint64_t)j * slot, k, seg, head, bth_len,
                              (epsn + (uint32_t)taken) & psn_mask, psn_mask, ackreq_bit,
                              state, crc, dst + taken * pay, ackreq, fold, fold_at + taken * pay);
        taken += t;
        if (t < n / seg)
            break;
        (*whole)++;
    }
    return taken;
}

#define BATCH 64

typedef union {
    char buf[CMSG_SPACE(sizeof(uint16_t))];
    struct cmsghdr align;
} gso_ctl;

/* Address message m to dst; when it holds more than one datagram, have the kernel cut it
 * into seg-byte datagrams (UDP_SEGMENT), the control message kept in ctl. */
static void address_msg(struct mmsghdr *m, gso_ctl *ctl, const struct sockaddr_in *dst,
                        uint32_t cnt, uint16_t seg) {
    m->msg_hdr.msg_name = (void *)dst;
    m->msg_hdr.msg_namelen = sizeof(*dst);
    if (cnt > 1) {
        struct cmsghdr *c = (struct cmsghdr *)ctl->buf;
        m->msg_hdr.msg_control = ctl->buf;
        m->msg_hdr.msg_controllen = sizeof(ctl->buf);
        c->cmsg_level = SOL_UDP;
        c->cmsg_type = UDP_SEGMENT;
        c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        memcpy(CMSG_DATA(c), &seg, sizeof(seg));
    }
}

/* One sendmmsg of n messages, message j holding cnts[j] datagrams; adds the datagrams the
 * kernel took to *done. Returns 1 when all n went (go on), 0 when the batch stopped short
 * (a full socket buffer, or a failure after some datagrams went: report *done), or
 * -errno when nothing at all went. */
static int64_t send_batch(int fd, struct mmsghdr *msgs, uint32_t n, const uint32_t *cnts,
                          uint64_t *done) {
    int r;
    do {
        r = sendmmsg(fd, msgs, n, MSG_DONTWAIT);
    } while (r < 0 && errno == EINTR);
    if (r < 0)
        return (*done || errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -(int64_t)errno;
    for (int j = 0; j < r; j++)
        *done += cnts[j];
    return (uint32_t)r == n;
}

/* Send k datagrams of seg bytes lying back to back at `data` to `dst`, `per` datagrams
 * per UDP_SEGMENT message (per == 1: plain datagrams), up to BATCH messages per
 * sendmmsg. Returns the number of datagrams handed to the kernel (fewer than k when the
 * socket buffer is full), or -errno if the first call failed otherwise. */
int64_t fp_send_rows(int fd, const uint8_t *data, uint32_t k, uint32_t seg, uint32_t per,
                     const struct sockaddr_in *dst) {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    gso_ctl ctl[BATCH];
    uint32_t cnts[BATCH];
    uint64_t done = 0;
    while (done < k) {
        uint32_t n = 0;
        uint64_t at = done;
        for (; n < BATCH && at < k; n++) {
            uint32_t cnt = (k - at) < per ? (uint32_t)(k - at) : per;
            memset(&msgs[n], 0, sizeof(msgs[n]));
            iov[n].iov_base = (void *)(data + at * seg);
            iov[n].iov_len = (size_t)cnt * seg;
            msgs[n].msg_hdr.msg_iov = &iov[n];
            msgs[n].msg_hdr.msg_iovlen = 1;
            address_msg(&msgs[n], &ctl[n], dst, cnt, (uint16_t)seg);
            cnts[n] = cnt;
            at += cnt;
        }
        int64_t s = send_batch(fd, msgs, n, cnts, &done);
        if (s <= 0)
            return s < 0 ? s : (int64_t)done;
    }
    return (int64_t)done;
}

#define GATHER_IOV 768 /* iovecs per sendmmsg: 256 datagrams of three pieces */

/* fp_send_rows for packets sealed by fp_seal_meta: datagram i is gathered from its BTH
 * (the first bth_len bytes of meta row i), its payload (src + i * mtu, mtu bytes) and its
 * ICRC (the row's last 4 bytes), so the payload goes from the caller's memory to the
 * kernel with no copy in between. Same returns as fp_send_rows. */
int64_t fp_send_gather(int fd, const uint8_t *meta, uint32_t bth_len, const uint8_t *src,
                       uint32_t k, uint32_t mtu, uint32_t per, const struct sockaddr_in *dst) {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[GATHER_IOV];
    gso_ctl ctl[BATCH];
    uint32_t cnts[BATCH];
    uint64_t done = 0, row = bth_len + 4;
    if (per > GATHER_IOV / 3)
        per = GATHER_IOV / 3;
    while (done < k) {
        uint32_t n = 0, v = 0;
        uint64_t at = done;
        for (; n < BATCH && at < k; n++) {
            uint32_t cnt = (k - at) < per ? (uint32_t)(k - at) : per;
            if (v + 3 * cnt > GATHER_IOV)
                break;
            memset(&msgs[n], 0, sizeof(msgs[n]));
            msgs[n].msg_hdr.msg_iov = &iov[v];
            msgs[n].msg_hdr.msg_iovlen = 3 * cnt;
            for (uint32_t i = 0; i < cnt; i++) {
                const uint8_t *m = meta + (at + i) * row;
                iov[v].iov_base = (void *)m;
                iov[v++].iov_len = bth_len;
                iov[v].iov_base = (void *)(src + (at + i) * mtu);
                iov[v++].iov_len = mtu;
                iov[v].iov_base = (void *)(m + bth_len);
                iov[v++].iov_len = 4;
            }
            address_msg(&msgs[n], &ctl[n], dst, cnt, (uint16_t)(row + mtu));
            cnts[n] = cnt;
            at += cnt;
        }
        int64_t s = send_batch(fd, msgs, n, cnts, &done);
        if (s <= 0)
            return s < 0 ? s : (int64_t)done;
    }
    return (int64_t)done;
}

/* Receive up to `nmax` datagrams (each possibly a UDP_GRO run) without blocking, the
 * j-th into buf + j * slot. lens[j]: its bytes; segs[j]: the GRO segment size (= lens[j]
 * when not coalesced); addrs[j]: source IPv4 address (network order) and ports[j] the
 * source port (host order). Returns how many arrived (0: none waiting) or -errno. */
int fp_recv_batch(int fd, uint8_t *buf, uint32_t slot, uint32_t nmax, uint32_t *lens,
                  uint32_t *segs, uint32_t *addrs, uint32_t *ports) {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in from[BATCH];
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl[BATCH];
    if (nmax > BATCH)
        nmax = BATCH;
    for (uint32_t j = 0; j < nmax; j++) {
        memset(&msgs[j], 0, sizeof(msgs[j]));
        iov[j].iov_base = buf + (uint64_t)j * slot;
        iov[j].iov_len = slot;
        msgs[j].msg_hdr.msg_name = &from[j];
        msgs[j].msg_hdr.msg_namelen = sizeof(from[j]);
        msgs[j].msg_hdr.msg_iov = &iov[j];
        msgs[j].msg_hdr.msg_iovlen = 1;
        msgs[j].msg_hdr.msg_control = ctl[j].buf;
        msgs[j].msg_hdr.msg_controllen = sizeof(ctl[j].buf);
    }
    int r;
    do {
        r = recvmmsg(fd, msgs, nmax, MSG_DONTWAIT, NULL);
    } while (r < 0 && errno == EINTR);
    if (r < 0)
        return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -errno;
    for (int j = 0; j < r; j++) {
        uint32_t n = msgs[j].msg_len, seg = n;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msgs[j].msg_hdr); c;
             c = CMSG_NXTHDR(&msgs[j].msg_hdr, c)) {
            if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
                int s;
                memcpy(&s, CMSG_DATA(c), sizeof(s));
                if (s > 0 && (uint32_t)s < n)
                    seg = (uint32_t)s;
            }
        }
        lens[j] = n;
        segs[j] = seg;
        addrs[j] = from[j].sin_addr.s_addr;
        ports[j] = ntohs(from[j].sin_port);
    }
    return r;
}

/* ------------------------------------------------------------------ the steady state
 * fp_bulk runs the engine's loop while a large transfer is in its steady state: one queue
 * pair receiving the MIDDLEs of a WRITE (checked, landed or folded, ACKed where they ask)
 * and one sending the MIDDLEs of a borrowed message within its window (sealed in place,
 * gathered by the kernel, its plain ACKs taken). Everything else -- a FIRST or LAST, a
 * NAK, a datagram that fails a check, another queue pair's traffic, a timer, a message
 * the sequencer waits on being ACKed, a wake-up from the caller's thread -- ends the call,
 * and the engine's Python loop goes on where this one stopped, so every protocol decision
 * beyond those two paths stays in one place. The fields are fpgaccl.host.native.Bulk's. */
#include <poll.h>
#include <sched.h>
#include <time.h>

#define BULK_FDS 16

enum { BULK_WAKE = 1, BULK_TIMER, BULK_BATCH, BULK_TX_DONE, BULK_ACKED, BULK_RX_ERROR,
       BULK_TX_ERROR, BULK_SOCKET_ERROR };

typedef struct {
    int32_t tx_fd, wake_fd, nfds, pad0;
    int32_t fds[BULK_FDS];
    uint64_t rxbuf, lens, segs, addrs, ports; /* the engine's receive batch */
    uint32_t slot, nslots;
    uint32_t bth_len, psn_mask, ackreq_bit, ack_syndrome, syn_shift, mtu;
    uint64_t crc;
    double deadline;  /* CLOCK_MONOTONIC seconds: the engine's next timer */
    double rto;       /* the sending side's retransmit timeout */
    uint64_t yields;  /* sched_yield()s before sleeping in poll */
    /* receive side */
    uint32_t rx_on, rx_seg, rx_addr, rx_port;
    uint8_t rx_head[8];
    uint32_t rx_state, epsn;
    uint64_t rx_dst, rx_room, fold, fold_at;
    uint8_t ack_head[8];
    uint32_t ack_state, aeth;
    struct sockaddr_in ack_dst;
    /* send side */
    uint32_t tx_on, per;
    uint8_t tx_head[8];
    uint32_t tx_state, next_psn, inflight, window, since, half;
    uint64_t src, k_left, meta, sealed, sent;
    struct sockaddr_in tx_dst;
    uint8_t peer_ack_head[8];
    uint32_t peer_ack_state, notify_on, notify_psn, acked, acked_psn, pad1;
    double last_progress;
    /* results */
    uint32_t stop, r, j, part, ack_lost, sock_error;
    uint64_t rx_taken, acks_tx, acks_rx;
    int64_t err;
} bulk_t;

static double monotonic_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* a - b as a signed distance in PSN space (psn_mask + 1 a power of two). */
static int32_t psn_dist(uint32_t a, uint32_t b, uint32_t psn_mask) {
    uint32_t d = (a - b) & psn_mask, half = (psn_mask >> 1) + 1;
    return d >= half ? (int32_t)d - (int32_t)(psn_mask + 1) : (int32_t)d;
}

/* Seal and send the MIDDLEs the window allows. 0, or -1 with b->err when the kernel
 * refused some (they are sealed and counted in b->sealed, not in b->sent). */
static int bulk_send(bulk_t *b, double now) {
    uint32_t row = b->bth_len + 4;
    crc_fn crc = (crc_fn)(uintptr_t)b->crc;
    while (b->k_left && b->inflight < b->window) {
        uint64_t k = b->window - b->inflight;
        if (k > b->k_left)
            k = b->k_left;
        uint8_t *meta = (uint8_t *)(uintptr_t)b->meta + b->sealed * row;
        const uint8_t *src = (const uint8_t *)(uintptr_t)b->src;
        b->since = fp_seal_meta(meta, b->bth_len, src, (uint32_t)k, b->mtu, b->tx_head,
                                b->next_psn, b->psn_mask, b->ackreq_bit, b->since, b->half,
                                b->tx_state, crc);
        if (!b->inflight)
            b->last_progress = now; /* the retransmit timer starts with the first unACKed */
        b->sealed += k;
        b->inflight += (uint32_t)k;
        b->next_psn = (b->next_psn + (uint32_t)k) & b->psn_mask;
        b->src += k * b->mtu;
        b->k_left -= k;
        uint64_t done = 0;
        for (int tries = 0; done < k && tries < 1000; tries++) {
            int64_t s = fp_send_gather(b->tx_fd, meta + done * row, b->bth_len,
                                       src + done * b->mtu, (uint32_t)(k - done), b->mtu,
                                       b->per, &b->tx_dst);
            if (s < 0) {
                if (s == -ECONNREFUSED || s == -EHOSTUNREACH || s == -ENETUNREACH) {
                    /* Another datagram's ICMP error, reported once (IP_RECVERR): these
                     * did not go. Send again; the engine reads the error queue. */
                    b->sock_error = 1;
                    continue;
                }
                b->sent += done;
                b->err = s;
                return -1;
            }
            done += (uint64_t)s;
            if (done < k) {
                struct pollfd p = {.fd = b->tx_fd, .events = POLLOUT};
                poll(&p, 1, 10);
            }
        }
        b->sent += done;
        if (done < k) {
            b->err = -EAGAIN;
            return -1;
        }
    }
    return 0;
}

static void bulk_ack(bulk_t *b) {
    uint8_t d[20];
    crc_fn crc = (crc_fn)(uintptr_t)b->crc;
    memcpy(d, b->ack_head, 8);
    store_be32(d + 8, (b->epsn - 1) & b->psn_mask);
    store_be32(d + 12, b->aeth);
    store_le32(d + 16, crc(b->ack_state, d + 8, 8));
    int r;
    do {
        r = (int)sendto(b->tx_fd, d, sizeof(d), MSG_DONTWAIT, (const struct sockaddr *)&b->ack_dst,
                        sizeof(b->ack_dst));
    } while (r < 0 && errno == EINTR);
    if (r < 0)
        b->ack_lost = 1; /* the queue pair sends it again, with its own handling */
    else
        b->acks_tx++;
}

/* A plain ACK from the sending side's peer: 1 if taken, 0 if it is Python's. */
static int bulk_take_ack(bulk_t *b, const uint8_t *d, double now) {
    crc_fn crc = (crc_fn)(uintptr_t)b->crc;
    if (memcmp(d, b->peer_ack_head, 8) != 0 || crc(b->peer_ack_state, d + 8, 8) != load_le32(d + 16))
        return 0;
    uint32_t aeth = load_be32(d + 12);
    if ((aeth >> b->syn_shift & 0xFF) != b->ack_syndrome)
        return 0; /* a NAK, an RNR or a duplicate report: the queue pair's decision */
    uint32_t psn = load_be32(d + 8) & b->psn_mask;
    uint32_t oldest = (b->next_psn - b->inflight) & b->psn_mask;
    int32_t n = psn_dist(psn, oldest, b->psn_mask) + 1;
    if (n < 0 || n > (int32_t)b->inflight)
        return 0; /* not outstanding (nor the newest ACKed): Python drops and counts it */
    b->acks_rx++;
    if (n > 0) {
        b->inflight -= (uint32_t)n;
        b->last_progress = now;
        b->acked = 1;
        /* No further than what was sent: an ACK beyond it must not cover what this
         * call seals later. */
        b->acked_psn = (oldest + (uint32_t)n - 1) & b->psn_mask;
    }
    return 1;
}

/* Take what this call may of receive batch entries [0, r): 1 when a datagram is left for
 * Python (b->j, b->part), else 0. */
static int bulk_batch(bulk_t *b, uint32_t r, double now, uint32_t *ackreq) {
    const uint8_t *buf = (const uint8_t *)(uintptr_t)b->rxbuf;
    const uint32_t *lens = (const uint32_t *)(uintptr_t)b->lens;
    const uint32_t *segs = (const uint32_t *)(uintptr_t)b->segs;
    const uint32_t *addrs = (const uint32_t *)(uintptr_t)b->addrs;
    const uint32_t *ports = (const uint32_t *)(uintptr_t)b->ports;
    crc_fn crc = (crc_fn)(uintptr_t)b->crc;
    uint32_t pay = b->rx_seg - b->bth_len - 4;
    for (uint32_t j = 0; j < r; j++) {
        const uint8_t *run = buf + (uint64_t)j * b->slot;
        uint32_t n = lens[j], seg = segs[j] < n ? segs[j] : n;
        uint32_t k = seg ? n / seg : 0, i = 0;
        while (i < k) {
            const uint8_t *d = run + (uint64_t)i * seg;
            if (b->rx_on && seg == b->rx_seg && addrs[j] == b->rx_addr &&
                ports[j] == b->rx_port && b->rx_room) {
                uint32_t m = k - i;
                if (m > b->rx_room)
                    m = (uint32_t)b->rx_room;
                uint32_t t = take_run(d, m, seg, b->rx_head, b->bth_len, b->epsn, b->psn_mask,
                                      b->ackreq_bit, b->rx_state, crc,
                                      (uint8_t *)(uintptr_t)b->rx_dst, ackreq,
                                      (const fold_t *)(uintptr_t)b->fold, b->fold_at);
                if (t) {
                    b->epsn = (b->epsn + t) & b->psn_mask;
                    b->rx_dst += (uint64_t)t * pay;
                    b->fold_at += (uint64_t)t * pay;
                    b->rx_room -= t;
                    b->rx_taken += t;
                    i += t;
                    continue;
                }
            }
            if (b->tx_on && seg == b->bth_len + 8 && addrs[j] == b->tx_dst.sin_addr.s_addr &&
                ports[j] == ntohs(b->tx_dst.sin_port) && bulk_take_ack(b, d, now)) {
                i++;
                continue;
            }
            break;
        }
        if (i < k || n % (seg ? seg : 1) || !n) {
            b->j = j;
            b->part = i;
            return 1;
        }
    }
    return 0;
}

/* Run the steady state until something needs the engine's Python loop (b->stop says
 * what). Returns b->stop. */
int fp_bulk(bulk_t *b) {
    b->stop = b->r = b->j = b->part = b->ack_lost = b->sock_error = 0;
    b->rx_taken = b->acks_tx = b->acks_rx = b->sealed = b->sent = 0;
    b->acked = 0;
    b->err = 0;
    struct pollfd p[BULK_FDS + 1];
    uint32_t nf = (uint32_t)b->nfds;
    for (uint32_t f = 0; f < nf; f++)
        p[f] = (struct pollfd){.fd = b->fds[f], .events = POLLIN};
    p[nf] = (struct pollfd){.fd = b->wake_fd, .events = POLLIN};
    uint64_t idle = 0, busy = 0;
    for (;;) {
        double now = monotonic_s(), until = b->deadline;
        if (b->tx_on && b->inflight && b->last_progress + b->rto < until)
            until = b->last_progress + b->rto;
        if (now >= until) {
            b->stop = BULK_TIMER;
            break;
        }
        if (b->tx_on) {
            if (bulk_send(b, now) < 0) {
                b->stop = BULK_TX_ERROR;
                break;
            }
            if (b->sock_error) {
                b->stop = BULK_SOCKET_ERROR;
                break;
            }
            if (!b->k_left) {
                b->stop = BULK_TX_DONE; /* the LAST is the queue pair's to build */
                break;
            }
        }
        int got = 0;
        for (uint32_t f = 0; f < nf && !b->stop; f++) {
            /* A socket error (an ICMP message, IP_RECVERR) comes back as -errno once: the
             * engine reads the error queue and calls again. */
            int r = fp_recv_batch(b->fds[f], (uint8_t *)(uintptr_t)b->rxbuf, b->slot,
                                  b->nslots, (uint32_t *)(uintptr_t)b->lens,
                                  (uint32_t *)(uintptr_t)b->segs,
                                  (uint32_t *)(uintptr_t)b->addrs,
                                  (uint32_t *)(uintptr_t)b->ports);
            if (r < 0) {
                b->err = r;
                b->stop = BULK_RX_ERROR;
                break;
            }
            if (!r)
                continue;
            got = 1;
            uint32_t ackreq = 0;
            int left = bulk_batch(b, (uint32_t)r, now, &ackreq);
            if (ackreq)
                bulk_ack(b);
            if (left) {
                b->stop = BULK_BATCH;
                b->r = (uint32_t)r;
            } else if (b->notify_on && b->acked &&
                       psn_dist(b->acked_psn, b->notify_psn, b->psn_mask) >= 0) {
                b->stop = BULK_ACKED; /* a message is ACKed whole: the sequencer may go on */
            }
        }
        if (b->stop)
            break;
        if (got) {
            idle = 0;
            /* While datagrams keep coming poll is not reached: look for a wake-up (a
             * new job, a stop) every few batches all the same. */
            if (++busy % 16 == 0) {
                struct pollfd w = {.fd = b->wake_fd, .events = POLLIN};
                if (poll(&w, 1, 0) > 0) {
                    b->stop = BULK_WAKE;
                    break;
                }
            }
            continue;
        }
        if (idle++ < b->yields) {
            /* On a shared CPU the peer often runs now, and its datagrams are here
             * without a sleep and a wake-up, which cost both sides system time. */
            sched_yield();
            continue;
        }
        idle = 0;
        int ms = (int)((until - now) * 1000.0) + 1;
        int n = poll(p, nf + 1, ms);
        if (n < 0 && errno != EINTR) {
            b->err = -errno;
            b->stop = BULK_RX_ERROR;
            break;
        }
        if (n > 0 && p[nf].revents) {
            b->stop = BULK_WAKE;
            break;
        }
        for (uint32_t f = 0; n > 0 && f < nf; f++)
            if (p[f].revents & POLLERR)
                b->stop = BULK_SOCKET_ERROR; /* queued until the engine reads it */
        if (b->stop)
            break;
    }
    return (int)b->stop;
}

/* sizeof(bulk_t), checked against the ctypes mirror at load. */
uint32_t fp_bulk_size(void) { return (uint32_t)sizeof(bulk_t); }

/* Wait for any of fds[0..n) to be readable: first a spin of sched_yield() and poll(0) for
 * up to spin_ns nanoseconds (the answer a caller waits for is often a few microseconds
 * away, and a sleep costs a wake-up on both sides), then poll() for up to timeout_ms.
 * Here, not in Python: the spin must not hold the GIL the process's other threads need.
 * Returns a bit mask of the readable fds (n <= 32), with bit 32 set where one has an error
 * queued (POLLERR), 0 on a timeout, -errno on an error. */
int64_t fp_wait(const int32_t *fds, uint32_t n, uint64_t spin_ns, int32_t timeout_ms) {
    struct pollfd p[32];
    if (n > 32)
        return -EINVAL;
    for (uint32_t i = 0; i < n; i++) {
        p[i].fd = fds[i];
        p[i].events = POLLIN;
        p[i].revents = 0;
    }
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int got = 0;
    for (;;) {
        sched_yield();
        got = poll(p, n, 0);
        if (got != 0)
            break;
        clock_gettime(CLOCK_MONOTONIC, &t);
        uint64_t spent = (uint64_t)(t.tv_sec - t0.tv_sec) * 1000000000u +
                         (uint64_t)(t.tv_nsec - t0.tv_nsec);
        if (spent >= spin_ns)
            break;
    }
    if (got == 0)
        got = poll(p, n, timeout_ms);
    if (got < 0)
        return errno == EINTR ? 0 : -errno;
    int64_t mask = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (p[i].revents)
            mask |= (int64_t)1 << i;
        if (p[i].revents & POLLERR)
            mask |= (int64_t)1 << 32;
    }
    return mask;
}
