/* SPDX-License-Identifier: MIT */

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "json.h"
#include "macro.h"
#include "message.h"
#include "store.h"

#define FILE_MAGIC "VMMBTBL"            /* 8 bytes with its NUL */
#define FILE_HEADER_SIZE 32
#define RECORD_HEADER_SIZE 16           /* u32 crc, u32 length, u64 sequence */
#define GROW_MIN (UINT64_C(64) << 10)   /* the smallest memfd */
#define COMPACT_SLACK (UINT64_C(1) << 20)
#define READ_CHUNK ((size_t)1 << 20)

enum {
        OP_SNAPSHOT = 1,
        OP_PUT_LEASE,
        OP_END_LEASE,
        OP_PUT_HOLD,
        OP_END_HOLD,
        OP_PUT_TOKEN,
        OP_END_TOKEN,
};

enum {
        LEASE_F_FOREIGN = 1,
        LEASE_F_LABEL = 2,
        LEASE_F_NAME = 4,
        LEASE_F_NAME_READONLY = 8,
        LEASE_F_PARKED = 16,
        LEASE_F_KEPT = 32,
        _LEASE_F_ALL = 63,
};

/* ---- CRC-32C (Castagnoli), as iSCSI and ext4 use it: the SSE 4.2 instruction where there is one ----------- */

static uint32_t crc_table[8][256];
static bool crc_hw;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
        for (uint32_t i = 0; i < 256; i++) {
                uint32_t c = i;

                for (int j = 0; j < 8; j++)
                        c = c & 1 ? (c >> 1) ^ UINT32_C(0x82f63b78) : c >> 1;
                crc_table[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; i++)
                for (int t = 1; t < 8; t++)
                        crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
#if defined(__x86_64__)
        __builtin_cpu_init();
        crc_hw = __builtin_cpu_supports("sse4.2");
#endif
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_update_hw(uint32_t c, const uint8_t *p, size_t n) {
        uint64_t c64 = c;

        for (; n >= 8; p += 8, n -= 8) {
                uint64_t v;

                memcpy(&v, p, 8);
                c64 = __builtin_ia32_crc32di(c64, v);
        }
        c = (uint32_t)c64;
        for (; n > 0; p++, n--)
                c = __builtin_ia32_crc32qi(c, *p);
        return c;
}
#endif

/* Slicing by 8. */
static uint32_t crc_update_sw(uint32_t c, const uint8_t *p, size_t n) {
        for (; n >= 8; p += 8, n -= 8) {
                uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
                uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;

                c = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^ crc_table[5][(lo >> 16) & 0xff] ^
                    crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff] ^
                    crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
        }
        for (; n > 0; p++, n--)
                c = (c >> 8) ^ crc_table[0][(c ^ *p) & 0xff];
        return c;
}

static uint32_t crc32c(const void *data, size_t n) {
        uint32_t c = UINT32_MAX;

        (void)pthread_once(&crc_once, crc_init);
#if defined(__x86_64__)
        if (crc_hw)
                return ~crc_update_hw(c, data, n);
#endif
        return ~crc_update_sw(c, data, n);
}

/* ---- little-endian fields ------------------------------------------------------------------------------- */

static inline void put_le16(uint8_t *p, uint16_t v) {
        v = htole16(v);
        memcpy(p, &v, 2);
}

static inline void put_le32(uint8_t *p, uint32_t v) {
        v = htole32(v);
        memcpy(p, &v, 4);
}

static inline void put_le64(uint8_t *p, uint64_t v) {
        v = htole64(v);
        memcpy(p, &v, 8);
}

static inline uint16_t get_le16(const uint8_t *p) {
        uint16_t v;

        memcpy(&v, p, 2);
        return le16toh(v);
}

static inline uint32_t get_le32(const uint8_t *p) {
        uint32_t v;

        memcpy(&v, p, 4);
        return le32toh(v);
}

static inline uint64_t get_le64(const uint8_t *p) {
        uint64_t v;

        memcpy(&v, p, 8);
        return le64toh(v);
}

/* ---- the buffer a change or a snapshot is encoded into ---------------------------------------------------- */

typedef struct Buffer {
        uint8_t *data;
        size_t len, cap;
} Buffer;

/* Makes room for `more` bytes; the writers below then write without checking. */
static int buffer_reserve(Buffer *b, size_t more) {
        size_t need, cap;
        uint8_t *p;

        if (b->cap - b->len >= more)
                return 0;
        if (__builtin_add_overflow(b->len, more, &need))
                return -ENOMEM;
        cap = MAX(need, MAX(b->cap * 2, (size_t)4096));
        p = realloc(b->data, cap);
        if (!p)
                return -ENOMEM;
        b->data = p;
        b->cap = cap;
        return 0;
}

static void buffer_done(Buffer *b) {
        free(b->data);
        *b = (Buffer){};
}

static inline void w_u8(Buffer *b, uint8_t v) {
        b->data[b->len++] = v;
}

static inline void w_u16(Buffer *b, uint16_t v) {
        put_le16(b->data + b->len, v);
        b->len += 2;
}

static inline void w_u32(Buffer *b, uint32_t v) {
        put_le32(b->data + b->len, v);
        b->len += 4;
}

static inline void w_u64(Buffer *b, uint64_t v) {
        put_le64(b->data + b->len, v);
        b->len += 8;
}

/* A string of at most `max` (<= 255) bytes: as many as there are, cut at `max`. Room: 1 + max. */
static inline void w_str(Buffer *b, const char *s, size_t max) {
        size_t n = strnlen(s, max);

        w_u8(b, (uint8_t)n);
        memcpy(b->data + b->len, s, n);
        b->len += n;
}

/*
 * A string as JSON would have written it (json_printable_copy(): bad UTF-8 bytes and control characters
 * become '?'), cut at a character boundary to at most `max` (<= 255) bytes; `in_max` bounds what is read of
 * s. Room: 1 + max.
 */
static void w_printable(Buffer *b, const char *s, size_t in_max, size_t max) {
        size_t o = json_printable_copy((char *)b->data + b->len + 1, s, strnlen(s, in_max), max, false);

        b->data[b->len] = (uint8_t)o;
        b->len += 1 + o;
}

#define STR_ROOM(max) (1 + (size_t)(max))
#define ID_MAX (LEASE_ID_LEN + 1)       /* what is written of an id or token: a longer one is refused on reading */
#define NAME_MAX_BYTES 255

static int encode_put_lease(Buffer *b, const Lease *l) {
        size_t n_slabs = MIN(l->n_slabs, (size_t)UINT16_MAX), n_uids = 0;
        uint8_t flags = 0;
        int k;

        if (l->name)
                n_uids = MIN(l->n_name_uids, (size_t)UINT8_MAX);
        k = buffer_reserve(b, 1 + STR_ROOM(ID_MAX) + 4 + 8 + 8 + 4 + 4 + STR_ROOM(STATE_COMM_MAX) + 1 +
                                      STR_ROOM(LEASE_LABEL_MAX) + 2 + 16 * n_slabs + STR_ROOM(NAME_MAX_BYTES) + 1 +
                                      4 * n_uids);
        if (k < 0)
                return k;
        if (l->foreign)
                flags |= LEASE_F_FOREIGN;
        if (l->parked)
                flags |= LEASE_F_PARKED;
        if (l->kept)
                flags |= LEASE_F_KEPT;
        if (l->label)
                flags |= LEASE_F_LABEL;
        if (l->name) {
                flags |= LEASE_F_NAME;
                if (l->name_readonly)
                        flags |= LEASE_F_NAME_READONLY;
        }
        w_u8(b, OP_PUT_LEASE);
        w_str(b, l->id, ID_MAX);
        w_u32(b, (uint32_t)l->device);
        w_u64(b, l->size);
        w_u64(b, l->created_usec);
        w_u32(b, (uint32_t)l->uid);
        w_u32(b, (uint32_t)l->pid);
        w_printable(b, l->comm, sizeof(l->comm), STATE_COMM_MAX);
        w_u8(b, flags);
        if (l->label)
                w_printable(b, l->label, SIZE_MAX, LEASE_LABEL_MAX);
        w_u16(b, (uint16_t)n_slabs);
        for (size_t i = 0; i < n_slabs; i++) {
                w_u64(b, l->slabs[i]->id);
                w_u64(b, l->slabs[i]->size);
        }
        if (l->name) {
                w_str(b, l->name, NAME_MAX_BYTES);
                w_u8(b, (uint8_t)n_uids);
                for (size_t i = 0; i < n_uids; i++)
                        w_u32(b, (uint32_t)l->name_uids[i]);
        }
        return 0;
}

static int encode_end_lease(Buffer *b, const char *lease_id) {
        int k = buffer_reserve(b, 1 + STR_ROOM(ID_MAX));

        if (k < 0)
                return k;
        w_u8(b, OP_END_LEASE);
        w_str(b, lease_id, ID_MAX);
        return 0;
}

/* PUT_HOLD's flags byte (a bool "readonly" before parking: 0 and 1 read the same). */
enum {
        HOLD_F_READONLY = 1,
        HOLD_F_PARKED = 2,
        _HOLD_F_ALL = 3,
};

static int encode_put_hold(Buffer *b, const char *lease_id, const Holder *h, unsigned refs, bool readonly,
                           bool parked) {
        int k = buffer_reserve(b, 1 + STR_ROOM(ID_MAX) + 4 + 8 + 4 + 4 + STR_ROOM(STATE_COMM_MAX) + 4 + 1);

        if (k < 0)
                return k;
        w_u8(b, OP_PUT_HOLD);
        w_str(b, lease_id, ID_MAX);
        w_u32(b, (uint32_t)h->pid);
        w_u64(b, h->start_time);
        w_u32(b, (uint32_t)h->uid);
        w_u32(b, (uint32_t)h->gid);
        w_printable(b, h->comm, sizeof(h->comm), STATE_COMM_MAX);
        w_u32(b, refs);
        w_u8(b, (readonly ? HOLD_F_READONLY : 0) | (parked ? HOLD_F_PARKED : 0));
        return 0;
}

static int encode_end_hold(Buffer *b, const char *lease_id, const Holder *h) {
        int k = buffer_reserve(b, 1 + STR_ROOM(ID_MAX) + 4 + 8);

        if (k < 0)
                return k;
        w_u8(b, OP_END_HOLD);
        w_str(b, lease_id, ID_MAX);
        w_u32(b, (uint32_t)h->pid);
        w_u64(b, h->start_time);
        return 0;
}

static int encode_put_token(Buffer *b, const char *lease_id, const Token *t) {
        int k = buffer_reserve(b, 1 + 2 * STR_ROOM(ID_MAX) + 4 + 4 + 1);

        if (k < 0)
                return k;
        w_u8(b, OP_PUT_TOKEN);
        w_str(b, lease_id, ID_MAX);
        w_str(b, t->token, ID_MAX);
        w_u32(b, (uint32_t)t->uid);
        w_u32(b, (uint32_t)t->creator);
        w_u8(b, t->readonly);
        return 0;
}

static int encode_end_token(Buffer *b, const char *token) {
        int k = buffer_reserve(b, 1 + STR_ROOM(ID_MAX));

        if (k < 0)
                return k;
        w_u8(b, OP_END_TOKEN);
        w_str(b, token, ID_MAX);
        return 0;
}

/* Fills in the header of the record that starts at b->data + at and runs to the end of b. */
static void finish_record(Buffer *b, size_t at, uint64_t seq) {
        uint8_t *r = b->data + at;

        put_le32(r + 4, (uint32_t)(b->len - at - RECORD_HEADER_SIZE));
        put_le64(r + 8, seq);
        put_le32(r, crc32c(r + 4, b->len - at - 4));
}

/* ---- the store ------------------------------------------------------------------------------------------- */

typedef struct StoreFault {
        unsigned nth;
        int error;
        bool crash;
} StoreFault;

struct Store {
        StoreBackend backend;
        int fd;                         /* the memfd in use, or -EBADF */
        uint64_t generation;
        uint64_t end;                   /* where the next record goes: the log's length */
        uint64_t allocated;             /* the memfd's size */
        uint64_t seq;                   /* the last record's sequence */
        uint64_t dirty_end;             /* bytes up to here past `end` may hold a failed record's: zeroed
                                           before a shorter record is written */
        Buffer change;                  /* the change being built, its record header first */
        int change_error;
        StoreStats stats;
        StoreFault faults[_STORE_STEP_MAX];
};

int store_new(Store **ret, const StoreBackend *backend) {
        Store *s = calloc(1, sizeof(*s));

        if (!s)
                return -ENOMEM;
        s->backend = *backend;
        s->fd = -EBADF;
        *ret = s;
        return 0;
}

Store *store_free(Store *s) {
        if (!s)
                return NULL;
        safe_close(s->fd);
        buffer_done(&s->change);
        free(s);
        return NULL;
}

void store_set_generation(Store *s, uint64_t generation) {
        if (s->fd < 0 && s->stats.snapshots == 0)
                s->generation = generation;
}

bool store_is_open(const Store *s) {
        return s->fd >= 0;
}

StoreStats store_stats(const Store *s) {
        StoreStats st = s->stats;

        st.generation = s->fd >= 0 ? s->generation : 0;
        st.log_bytes = s->fd >= 0 ? s->end : 0;
        return st;
}

bool store_wants_snapshot(const Store *s) {
        return s->fd >= 0 && s->end > 2 * s->stats.snapshot_bytes + COMPACT_SLACK;
}

void store_inject_fault(Store *s, StoreStep step, unsigned nth, int error, bool crash) {
        if ((unsigned)step >= _STORE_STEP_MAX)
                return;
        s->faults[step] = (StoreFault){ .nth = nth, .error = error ?: -EIO, .crash = crash };
}

/* Whether this operation of `step` is the one to fail: 0, or the error, with *ret_crash set to crash. */
static int fault(Store *s, StoreStep step, bool *ret_crash) {
        StoreFault *f = &s->faults[step];

        *ret_crash = false;
        if (_likely_(f->nth == 0) || --f->nth > 0)
                return 0;
        *ret_crash = f->crash;
        return f->error;
}

/* A fault of a step that fails before doing anything: aborts there for a crash. */
static int fault_before(Store *s, StoreStep step) {
        bool crash;
        int k = fault(s, step, &crash);

        if (k < 0 && crash)
                abort();
        return k;
}

static int pwrite_all(int fd, const void *data, size_t n, uint64_t offset) {
        const uint8_t *p = data;

        while (n > 0) {
                ssize_t w = pwrite(fd, p, n, (off_t)offset);

                if (w < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                if (w == 0)
                        return -EIO;
                p += w;
                n -= (size_t)w;
                offset += (uint64_t)w;
        }
        return 0;
}

/* Writes a record (or a snapshot) at offset, with the WRITE fault: a failed or crashing write is torn. */
static int write_record(Store *s, int fd, const uint8_t *data, size_t n, uint64_t offset) {
        bool crash;
        int k = fault(s, STORE_STEP_WRITE, &crash);

        if (k < 0) {
                (void)pwrite_all(fd, data, n / 2, offset);
                if (crash)
                        abort();
                return k;
        }
        return pwrite_all(fd, data, n, offset);
}

/* Zeroes [from, to) of the memfd. */
static int write_zeros(int fd, uint64_t from, uint64_t to) {
        static const uint8_t zeros[4096];

        while (from < to) {
                size_t n = (size_t)MIN(to - from, (uint64_t)sizeof(zeros));
                int k = pwrite_all(fd, zeros, n, from);

                if (k < 0)
                        return k;
                from += n;
        }
        return 0;
}

/* Grows a memfd to `size` bytes, allocated, so that the writes that follow allocate nothing. */
static int grow(Store *s, int fd, uint64_t size) {
        int k = fault_before(s, STORE_STEP_GROW);

        if (k < 0)
                return k;
        if (fallocate(fd, 0, 0, (off_t)size) == 0)
                return 0;
        if (errno != EOPNOTSUPP)
                return -errno;
        return ftruncate(fd, (off_t)size) < 0 ? -errno : 0;
}

/* The size the memfd grows to, to hold `need` bytes: doubling, within STATE_SIZE_MAX. */
static uint64_t grown_size(uint64_t allocated, uint64_t need) {
        uint64_t size = MAX(allocated, GROW_MIN);

        while (size < need)
                size *= 2;
        return MIN(size, STATE_SIZE_MAX);
}

void store_begin(Store *s) {
        s->change.len = 0;
        s->change_error = buffer_reserve(&s->change, RECORD_HEADER_SIZE);
        if (s->change_error == 0)
                s->change.len = RECORD_HEADER_SIZE;
}

void store_abort(Store *s) {
        s->change.len = 0;
        s->change_error = 0;
        /* A large change's buffer is not kept. */
        if (s->change.cap > (size_t)1 << 20)
                buffer_done(&s->change);
}

/* An op's outcome: the first failure sticks to the change. */
static int op_done(Store *s, int k) {
        if (k < 0 && s->change_error == 0)
                s->change_error = k;
        return k;
}

/* Before an op: a change is begun (an op without store_begin() begins one). */
static void op_begin(Store *s) {
        if (s->change.len < RECORD_HEADER_SIZE && s->change_error == 0)
                store_begin(s);
}

int store_put_lease(Store *s, const Lease *l) {
        op_begin(s);
        return op_done(s, s->change_error ?: encode_put_lease(&s->change, l));
}

int store_end_lease(Store *s, const char *lease_id) {
        op_begin(s);
        return op_done(s, s->change_error ?: encode_end_lease(&s->change, lease_id));
}

int store_put_hold(Store *s, const char *lease_id, const Holder *h, unsigned refs, bool readonly, bool parked) {
        op_begin(s);
        return op_done(s, s->change_error ?: encode_put_hold(&s->change, lease_id, h, refs, readonly, parked));
}

int store_end_hold(Store *s, const char *lease_id, const Holder *h) {
        op_begin(s);
        return op_done(s, s->change_error ?: encode_end_hold(&s->change, lease_id, h));
}

int store_put_token(Store *s, const char *lease_id, const Token *t) {
        op_begin(s);
        return op_done(s, s->change_error ?: encode_put_token(&s->change, lease_id, t));
}

int store_end_token(Store *s, const char *token) {
        op_begin(s);
        return op_done(s, s->change_error ?: encode_end_token(&s->change, token));
}

static int commit_failed(Store *s, int k) {
        s->stats.failures++;
        store_abort(s);
        return k;
}

int store_commit(Store *s) {
        uint64_t need, rec_end;
        size_t n;
        int k;

        if (s->change_error < 0)
                return commit_failed(s, s->change_error);
        if (s->change.len <= RECORD_HEADER_SIZE) {
                store_abort(s);         /* nothing changed: nothing to write, whether or not a table is stored */
                return 0;
        }
        if (s->fd < 0)
                return commit_failed(s, -ENOLINK);
        n = s->change.len;
        if (n - RECORD_HEADER_SIZE > UINT32_MAX || __builtin_add_overflow(s->end, (uint64_t)n, &rec_end) ||
            rec_end > STATE_SIZE_MAX)
                return commit_failed(s, -EFBIG);
        finish_record(&s->change, 0, s->seq + 1);

        need = MAX(rec_end, s->dirty_end);
        if (need > s->allocated) {
                uint64_t size = grown_size(s->allocated, need);

                k = grow(s, s->fd, size);
                if (k < 0)
                        return commit_failed(s, k);
                s->allocated = size;
        }
        /* A failed record longer than this one left bytes past it: zeroed first, so that nothing of it is
         * ever read as a record after this one. */
        if (s->dirty_end > rec_end) {
                k = write_zeros(s->fd, rec_end, s->dirty_end);
                if (k < 0)
                        return commit_failed(s, k);
        }
        k = write_record(s, s->fd, s->change.data, n, s->end);
        if (k < 0) {
                s->dirty_end = MAX(s->dirty_end, rec_end);
                return commit_failed(s, k);
        }
        /* The commit point: the record is whole. */
        s->dirty_end = 0;
        s->end = rec_end;
        s->seq++;
        s->stats.commits++;
        store_abort(s);
        return 0;
}

static int encode_lease_whole(Buffer *b, const Lease *l) {
        const Token *tok;
        const Hold *hold;
        int k;

        k = encode_put_lease(b, l);
        if (k < 0)
                return k;
        list_for_each_entry(tok, &l->tokens, link) {
                k = encode_put_token(b, l->id, tok);
                if (k < 0)
                        return k;
        }
        list_for_each_entry(hold, &l->holds, link_lease) {
                k = encode_put_hold(b, l->id, hold->holder, hold->refs, hold->readonly, hold->parked);
                if (k < 0)
                        return k;
        }
        return 0;
}

/* The new memfd, its snapshot written: header, then one record. */
static int snapshot_encode(Store *s, const LeaseTable *t, Buffer *b) {
        const Lease *l;
        int k;

        if (t->n_leases > STATE_LEASES_MAX)
                return -EFBIG;
        k = buffer_reserve(b, FILE_HEADER_SIZE + RECORD_HEADER_SIZE + 5);
        if (k < 0)
                return k;
        memset(b->data, 0, FILE_HEADER_SIZE + RECORD_HEADER_SIZE);
        memcpy(b->data, FILE_MAGIC, 8);
        put_le32(b->data + 8, STORE_FORMAT);
        put_le64(b->data + 16, s->generation + 1);
        put_le32(b->data + 24, crc32c(b->data, 24));
        b->len = FILE_HEADER_SIZE + RECORD_HEADER_SIZE;
        w_u8(b, OP_SNAPSHOT);
        w_u32(b, t->n_leases);
        list_for_each_entry(l, &t->leases, link_table) {
                if (l->n_holds > STATE_HOLDS_MAX)
                        return -EFBIG;
                k = encode_lease_whole(b, l);
                if (k < 0)
                        return k;
        }
        if (b->len > STATE_SIZE_MAX || b->len - FILE_HEADER_SIZE - RECORD_HEADER_SIZE > UINT32_MAX)
                return -EFBIG;
        finish_record(b, FILE_HEADER_SIZE, s->seq + 1);
        return 0;
}

static int snapshot_store(Store *s, const LeaseTable *t, Buffer *b, int *ret_fd, uint64_t *ret_allocated) {
        _cleanup_close_ int fd = -EBADF;
        char name[64];
        uint64_t size;
        int k;

        k = snapshot_encode(s, t, b);
        if (k < 0)
                return k;
        fd = memfd_create(STORE_MEMFD_NAME, MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0)
                return -errno;
        size = grown_size(0, (uint64_t)b->len + GROW_MIN);
        size = MAX(size, (uint64_t)b->len);
        k = grow(s, fd, size);
        if (k < 0)
                return k;
        k = write_record(s, fd, b->data, b->len, 0);
        if (k < 0)
                return k;
        k = fault_before(s, STORE_STEP_SEAL);
        if (k < 0)
                return k;
        if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) < 0)
                return -errno;
        k = fault_before(s, STORE_STEP_NOTIFY);
        if (k < 0)
                return k;
        snprintf(name, sizeof(name), STORE_NAME_PREFIX "%" PRIu64, s->generation + 1);
        s->stats.messages++;
        k = s->backend.save(s->backend.userdata, name, fd);
        if (k < 0)
                return k;
        *ret_fd = TAKE_FD(fd);
        *ret_allocated = size;
        return 0;
}

int store_snapshot(Store *s, const LeaseTable *t) {
        Buffer b = {};
        uint64_t allocated = 0;
        int fd = -EBADF, k;

        k = snapshot_store(s, t, &b, &fd, &allocated);
        if (k < 0) {
                buffer_done(&b);
                s->stats.failures++;
                return k;
        }
        /* Stored: the old generation is no longer needed. Failing to remove it is no failure: the higher
         * generation wins at start. */
        if (s->generation > 0 && s->backend.remove) {
                char name[64];

                snprintf(name, sizeof(name), STORE_NAME_PREFIX "%" PRIu64, s->generation);
                s->stats.messages++;
                (void)s->backend.remove(s->backend.userdata, name);
        }
        safe_close(s->fd);
        s->fd = fd;
        s->generation++;
        s->end = b.len;
        s->allocated = allocated;
        s->seq++;
        s->dirty_end = 0;
        s->stats.snapshot_bytes = b.len - FILE_HEADER_SIZE;
        s->stats.snapshots++;
        buffer_done(&b);
        return 0;
}

/* ---- reading: replaying the log into a State ---------------------------------------------------------------- */

/* An open-addressing hash map (linear probing, backward-shift deletion) of (lease, index) pairs; the keys
 * are in the replay's arrays. A hash of 0 marks an empty slot. */
typedef struct MapSlot {
        uint64_t hash;
        uint32_t lease, index;
} MapSlot;

typedef struct Map {
        MapSlot *slots;
        size_t mask;                    /* capacity - 1, or 0 with no slots */
        size_t n;
} Map;

static void map_done(Map *m) {
        free(m->slots);
        *m = (Map){};
}

static void map_clear(Map *m) {
        if (m->slots)
                memset(m->slots, 0, (m->mask + 1) * sizeof(MapSlot));
        m->n = 0;
}

static void map_put_slot(MapSlot *slots, size_t mask, MapSlot v) {
        size_t i = v.hash & mask;

        while (slots[i].hash != 0)
                i = (i + 1) & mask;
        slots[i] = v;
}

/* Adds an entry the map does not hold. */
static int map_add(Map *m, uint64_t hash, uint32_t lease, uint32_t index) {
        if ((m->n + 1) * 2 > (m->slots ? m->mask + 1 : 0)) {
                size_t cap = m->slots ? (m->mask + 1) * 2 : 64;
                MapSlot *slots = calloc(cap, sizeof(MapSlot));

                if (!slots)
                        return -ENOMEM;
                for (size_t i = 0; m->slots && i <= m->mask; i++)
                        if (m->slots[i].hash != 0)
                                map_put_slot(slots, cap - 1, m->slots[i]);
                free(m->slots);
                m->slots = slots;
                m->mask = cap - 1;
        }
        map_put_slot(m->slots, m->mask, (MapSlot){ .hash = hash, .lease = lease, .index = index });
        m->n++;
        return 0;
}

static void map_remove(Map *m, MapSlot *slot) {
        size_t i = (size_t)(slot - m->slots), j = i;

        m->slots[i].hash = 0;
        for (;;) {
                size_t k;

                j = (j + 1) & m->mask;
                if (m->slots[j].hash == 0)
                        break;
                k = m->slots[j].hash & m->mask;
                /* Moved back to i unless its home k lies cyclically in (i, j]. */
                if (i <= j ? (i < k && k <= j) : (i < k || k <= j))
                        continue;
                m->slots[i] = m->slots[j];
                m->slots[j].hash = 0;
                i = j;
        }
        m->n--;
}

typedef struct ReplayLease {
        StateLease l;
        size_t cap_holds, cap_tokens;
        size_t live_holds, live_tokens; /* l.n_holds and l.n_tokens count ended ones too, until compaction */
        bool dead;
} ReplayLease;

typedef struct Replay {
        ReplayLease *leases;
        size_t n_leases, cap_leases, live_leases;
        size_t dead;                    /* ended leases, holds and tokens still in the arrays */
        size_t live;                    /* live leases, holds and tokens */
        Map by_id, by_token, by_hold;
        uint64_t seed;
        const char *why;                /* what is wrong, for a record that is refused */
} Replay;

static uint64_t mix64(uint64_t h) {
        h ^= h >> 33;
        h *= UINT64_C(0xff51afd7ed558ccd);
        h ^= h >> 33;
        h *= UINT64_C(0xc4ceb9fe1a85ec53);
        h ^= h >> 33;
        return h ?: 1;
}

static uint64_t hash_str(uint64_t seed, const char *s, size_t n) {
        uint64_t h = seed ^ (n * UINT64_C(0x9e3779b97f4a7c15));

        for (; n >= 8; s += 8, n -= 8) {
                uint64_t v;

                memcpy(&v, s, 8);
                h = (h ^ v) * UINT64_C(0x100000001b3);
                h ^= h >> 29;
        }
        for (; n > 0; s++, n--)
                h = (h ^ (uint8_t)*s) * UINT64_C(0x100000001b3);
        return mix64(h);
}

static uint64_t hash_hold(uint64_t seed, size_t lease, pid_t pid, uint64_t start_time) {
        return mix64(seed ^ mix64((uint64_t)lease * UINT64_C(0x9e3779b97f4a7c15) ^ (uint32_t)pid) ^
                     (start_time * UINT64_C(0xc2b2ae3d27d4eb4f)));
}

static void replay_done(Replay *r) {
        for (size_t i = 0; i < r->n_leases; i++)
                state_lease_done(&r->leases[i].l);
        free(r->leases);
        map_done(&r->by_id);
        map_done(&r->by_token);
        map_done(&r->by_hold);
        *r = (Replay){};
}

static MapSlot *find_lease(Replay *r, const char *id, size_t n, uint64_t *ret_hash) {
        uint64_t hash = hash_str(r->seed, id, n);
        Map *m = &r->by_id;

        *ret_hash = hash;
        if (!m->slots)
                return NULL;
        for (size_t i = hash & m->mask; m->slots[i].hash != 0; i = (i + 1) & m->mask)
                if (m->slots[i].hash == hash && strncmp(r->leases[m->slots[i].lease].l.id, id, n) == 0 &&
                    r->leases[m->slots[i].lease].l.id[n] == 0)
                        return &m->slots[i];
        return NULL;
}

static MapSlot *find_token(Replay *r, const char *token, size_t n, uint64_t *ret_hash) {
        uint64_t hash = hash_str(~r->seed, token, n);
        Map *m = &r->by_token;

        *ret_hash = hash;
        if (!m->slots)
                return NULL;
        for (size_t i = hash & m->mask; m->slots[i].hash != 0; i = (i + 1) & m->mask) {
                const char *t = r->leases[m->slots[i].lease].l.tokens[m->slots[i].index].token;

                if (m->slots[i].hash == hash && strncmp(t, token, n) == 0 && t[n] == 0)
                        return &m->slots[i];
        }
        return NULL;
}

static MapSlot *find_hold(Replay *r, size_t lease, pid_t pid, uint64_t start_time, uint64_t *ret_hash) {
        uint64_t hash = hash_hold(r->seed, lease, pid, start_time);
        Map *m = &r->by_hold;

        *ret_hash = hash;
        if (!m->slots)
                return NULL;
        for (size_t i = hash & m->mask; m->slots[i].hash != 0; i = (i + 1) & m->mask) {
                const MapSlot *sl = &m->slots[i];
                const StateHold *h;

                if (sl->hash != hash || sl->lease != lease)
                        continue;
                h = &r->leases[lease].l.holds[sl->index];
                if (h->pid == pid && h->start_time == start_time)
                        return &m->slots[i];
        }
        return NULL;
}

/*
 * Drops what has ended from the arrays. With `final`, sizes the arrays to what is left and leaves the
 * maps empty; otherwise rebuilds the maps over the new positions.
 */
static int replay_compact(Replay *r, bool final) {
        size_t o = 0;
        int k;

        map_clear(&r->by_id);
        map_clear(&r->by_token);
        map_clear(&r->by_hold);
        for (size_t i = 0; i < r->n_leases; i++) {
                ReplayLease *rl = &r->leases[i];
                StateLease *l = &rl->l;
                size_t n;

                if (rl->dead) {
                        state_lease_done(l);
                        continue;
                }
                n = 0;
                for (size_t j = 0; j < l->n_holds; j++)
                        if (l->holds[j].refs > 0)
                                l->holds[n++] = l->holds[j];
                l->n_holds = n;
                n = 0;
                for (size_t j = 0; j < l->n_tokens; j++)
                        if (l->tokens[j].token[0] != 0)
                                l->tokens[n++] = l->tokens[j];
                l->n_tokens = n;
                if (final && l->n_holds == 0) {
                        free(l->holds);
                        l->holds = NULL;
                }
                if (final && l->n_tokens == 0) {
                        free(l->tokens);
                        l->tokens = NULL;
                }
                rl->cap_holds = l->n_holds;
                rl->cap_tokens = l->n_tokens;
                if (o != i) {
                        r->leases[o] = *rl;
                        *rl = (ReplayLease){};
                }
                o++;
        }
        r->n_leases = o;
        r->dead = 0;
        if (final)
                return 0;
        for (size_t i = 0; i < r->n_leases; i++) {
                StateLease *l = &r->leases[i].l;

                k = map_add(&r->by_id, hash_str(r->seed, l->id, strlen(l->id)), (uint32_t)i, 0);
                for (size_t j = 0; k >= 0 && j < l->n_tokens; j++)
                        k = map_add(&r->by_token, hash_str(~r->seed, l->tokens[j].token, strlen(l->tokens[j].token)),
                                    (uint32_t)i, (uint32_t)j);
                for (size_t j = 0; k >= 0 && j < l->n_holds; j++)
                        k = map_add(&r->by_hold, hash_hold(r->seed, i, l->holds[j].pid, l->holds[j].start_time),
                                    (uint32_t)i, (uint32_t)j);
                if (k < 0)
                        return k;
        }
        return 0;
}

/* Grows an array of `size`-byte elements to hold one more than *n. */
static int grow_array(void **p, size_t *cap, size_t n, size_t size) {
        size_t c;
        void *q;

        if (n < *cap)
                return 0;
        c = MAX(*cap * 2, (size_t)4);
        if (c > UINT32_MAX)
                return -EBADMSG;        /* more than the maps can index: more than any valid file holds */
        q = reallocarray(*p, c, size);
        if (!q)
                return -ENOMEM;
        *p = q;
        *cap = c;
        return 0;
}

/* A cursor over a record's payload: reads past its end set `bad` and return zeros. */
typedef struct Cursor {
        const uint8_t *p, *end;
        bool bad;
} Cursor;

static inline bool cursor_need(Cursor *c, size_t n) {
        if (_unlikely_(c->bad || (size_t)(c->end - c->p) < n)) {
                c->bad = true;
                return false;
        }
        return true;
}

static inline uint8_t r_u8(Cursor *c) {
        return cursor_need(c, 1) ? *c->p++ : 0;
}

static inline uint16_t r_u16(Cursor *c) {
        uint16_t v = 0;

        if (cursor_need(c, 2)) {
                v = get_le16(c->p);
                c->p += 2;
        }
        return v;
}

static inline uint32_t r_u32(Cursor *c) {
        uint32_t v = 0;

        if (cursor_need(c, 4)) {
                v = get_le32(c->p);
                c->p += 4;
        }
        return v;
}

static inline uint64_t r_u64(Cursor *c) {
        uint64_t v = 0;

        if (cursor_need(c, 8)) {
                v = get_le64(c->p);
                c->p += 8;
        }
        return v;
}

static inline bool r_bool(Cursor *c) {
        uint8_t v = r_u8(c);

        if (v > 1)
                c->bad = true;
        return v == 1;
}

/* A string of at most `max` bytes, no NUL in it; *ret_len its length. */
static const char *r_str(Cursor *c, size_t max, size_t *ret_len) {
        size_t n = r_u8(c);
        const char *s;

        *ret_len = 0;
        if (n > max || !cursor_need(c, n)) {
                c->bad = true;
                return "";
        }
        s = (const char *)c->p;
        if (memchr(s, 0, n)) {
                c->bad = true;
                return "";
        }
        c->p += n;
        *ret_len = n;
        return s;
}

static void r_fixed(Cursor *c, char *dst, size_t size) {
        size_t n;
        const char *s = r_str(c, size - 1, &n);

        memcpy(dst, s, n);
        dst[n] = 0;
}

static char *r_strdup(Cursor *c, size_t max, int *error) {
        size_t n;
        const char *s = r_str(c, max, &n);
        char *d;

        if (c->bad)
                return NULL;
        d = strndup(s, n);
        if (!d)
                *error = -ENOMEM;
        return d;
}

static int bad(Replay *r, const char *why) {
        r->why = why;
        return -EBADMSG;
}

static int apply_put_lease(Replay *r, Cursor *c) {
        StateLease v = {};
        ReplayLease *rl;
        MapSlot *slot;
        uint64_t hash;
        uint8_t flags;
        int error = 0, k;

        r_fixed(c, v.id, sizeof(v.id));
        v.device = (int)r_u32(c);
        v.size = r_u64(c);
        v.created_usec = r_u64(c);
        v.uid = (uid_t)r_u32(c);
        v.pid = (pid_t)r_u32(c);
        r_fixed(c, v.comm, sizeof(v.comm));
        flags = r_u8(c);
        if (flags & ~_LEASE_F_ALL)
                c->bad = true;
        v.foreign = flags & LEASE_F_FOREIGN;
        v.parked = flags & LEASE_F_PARKED;
        v.kept = flags & LEASE_F_KEPT;
        if (flags & LEASE_F_LABEL)
                v.label = r_strdup(c, LEASE_LABEL_MAX, &error);
        v.n_slabs = r_u16(c);
        if (c->bad) {
                free(v.label);
                return error < 0 ? error : bad(r, "a lease that cannot be decoded");
        }
        if (v.n_slabs == 0 || v.n_slabs > pool_max_slabs(v.parked) || !cursor_need(c, v.n_slabs * 16)) {
                free(v.label);
                return bad(r, "a lease with no slabs or too many");
        }
        v.slabs = calloc(v.n_slabs, sizeof(StateSlab));
        if (!v.slabs)
                error = -ENOMEM;
        for (size_t i = 0; i < v.n_slabs; i++) {
                uint64_t id = r_u64(c), size = r_u64(c);

                if (v.slabs)
                        v.slabs[i] = (StateSlab){ .id = id, .size = size };
        }
        if (flags & LEASE_F_NAME) {
                v.name = r_strdup(c, VMMB_LEASE_NAME_MAX, &error);
                v.name_readonly = flags & LEASE_F_NAME_READONLY;
                v.n_name_uids = r_u8(c);
                if (v.n_name_uids > STATE_NAME_UIDS_MAX)
                        c->bad = true;
                else if (v.n_name_uids > 0 && cursor_need(c, 4 * v.n_name_uids)) {
                        v.name_uids = calloc(v.n_name_uids, sizeof(uid_t));
                        if (!v.name_uids)
                                error = -ENOMEM;
                        for (size_t i = 0; i < v.n_name_uids; i++) {
                                uid_t u = (uid_t)r_u32(c);

                                if (v.name_uids)
                                        v.name_uids[i] = u;
                        }
                }
        } else if (flags & LEASE_F_NAME_READONLY)
                c->bad = true;
        if (error < 0 || c->bad) {
                state_lease_done(&v);
                return error < 0 ? error : bad(r, "a lease that cannot be decoded");
        }

        slot = find_lease(r, v.id, strlen(v.id), &hash);
        if (slot) {
                /* Replaced: its holds and tokens stay. */
                StateLease *l = &r->leases[slot->lease].l;

                v.holds = l->holds;
                v.n_holds = l->n_holds;
                v.tokens = l->tokens;
                v.n_tokens = l->n_tokens;
                l->holds = NULL;
                l->tokens = NULL;
                state_lease_done(l);
                *l = v;
                return 0;
        }
        if (r->live_leases >= STATE_LEASES_MAX) {
                state_lease_done(&v);
                return bad(r, "more leases than a table holds");
        }
        k = grow_array((void **)&r->leases, &r->cap_leases, r->n_leases, sizeof(ReplayLease));
        if (k >= 0)
                k = map_add(&r->by_id, hash, (uint32_t)r->n_leases, 0);
        if (k < 0) {
                state_lease_done(&v);
                return k == -EBADMSG ? bad(r, "too many leases") : k;
        }
        rl = &r->leases[r->n_leases++];
        *rl = (ReplayLease){ .l = v };
        r->live_leases++;
        r->live++;
        return 0;
}

/* The lease an op names; NULL (and why) if it is not there, or cannot be read. */
static ReplayLease *op_lease(Replay *r, Cursor *c, size_t *ret_index) {
        MapSlot *slot;
        uint64_t hash;
        size_t n;
        const char *id = r_str(c, LEASE_ID_LEN, &n);

        if (c->bad)
                return NULL;
        slot = find_lease(r, id, n, &hash);
        if (!slot)
                return NULL;
        *ret_index = slot->lease;
        return &r->leases[slot->lease];
}

static int apply_end_lease(Replay *r, Cursor *c) {
        ReplayLease *rl;
        MapSlot *slot;
        uint64_t hash;
        size_t i = 0;

        rl = op_lease(r, c, &i);
        if (c->bad)
                return bad(r, "an end of a lease that cannot be decoded");
        if (!rl)
                return 0;       /* ended already: ending is idempotent */
        for (size_t j = 0; j < rl->l.n_tokens; j++) {
                StateToken *t = &rl->l.tokens[j];

                if (t->token[0] == 0)
                        continue;
                slot = find_token(r, t->token, strlen(t->token), &hash);
                if (slot)
                        map_remove(&r->by_token, slot);
        }
        for (size_t j = 0; j < rl->l.n_holds; j++) {
                StateHold *h = &rl->l.holds[j];

                if (h->refs == 0)
                        continue;
                slot = find_hold(r, i, h->pid, h->start_time, &hash);
                if (slot)
                        map_remove(&r->by_hold, slot);
        }
        slot = find_lease(r, rl->l.id, strlen(rl->l.id), &hash);
        if (slot)
                map_remove(&r->by_id, slot);
        /* Its holds and tokens are freed now, ended or not: only its own slot waits for compaction. */
        r->dead = r->dead - (rl->l.n_holds - rl->live_holds) - (rl->l.n_tokens - rl->live_tokens) + 1;
        r->live -= 1 + rl->live_holds + rl->live_tokens;
        rl->dead = true;
        r->live_leases--;
        state_lease_done(&rl->l);
        rl->l = (StateLease){};
        rl->live_holds = rl->live_tokens = 0;
        return 0;
}

static int apply_put_hold(Replay *r, Cursor *c) {
        StateHold h = {};
        ReplayLease *rl;
        MapSlot *slot;
        uint64_t hash;
        uint8_t flags;
        size_t i = 0;
        int k;

        rl = op_lease(r, c, &i);
        h.pid = (pid_t)r_u32(c);
        h.start_time = r_u64(c);
        h.uid = (uid_t)r_u32(c);
        h.gid = (gid_t)r_u32(c);
        r_fixed(c, h.comm, sizeof(h.comm));
        h.refs = r_u32(c);
        flags = r_u8(c);
        if (flags & ~_HOLD_F_ALL)
                c->bad = true;
        h.readonly = flags & HOLD_F_READONLY;
        h.parked = flags & HOLD_F_PARKED;
        if (c->bad)
                return bad(r, "a hold that cannot be decoded");
        if (!rl)
                return bad(r, "a hold on a lease that is not there");
        if (h.refs == 0)
                return bad(r, "a hold of 0 references");
        slot = find_hold(r, i, h.pid, h.start_time, &hash);
        if (slot) {
                rl->l.holds[slot->index] = h;
                return 0;
        }
        if (rl->live_holds >= STATE_HOLDS_MAX)
                return bad(r, "more holds on a lease than a table holds");
        k = grow_array((void **)&rl->l.holds, &rl->cap_holds, rl->l.n_holds, sizeof(StateHold));
        if (k >= 0)
                k = map_add(&r->by_hold, hash, (uint32_t)i, (uint32_t)rl->l.n_holds);
        if (k < 0)
                return k == -EBADMSG ? bad(r, "too many holds") : k;
        rl->l.holds[rl->l.n_holds++] = h;
        rl->live_holds++;
        r->live++;
        return 0;
}

static int apply_end_hold(Replay *r, Cursor *c) {
        ReplayLease *rl;
        MapSlot *slot;
        uint64_t hash, start_time;
        size_t i = 0;
        pid_t pid;

        rl = op_lease(r, c, &i);
        pid = (pid_t)r_u32(c);
        start_time = r_u64(c);
        if (c->bad)
                return bad(r, "an end of a hold that cannot be decoded");
        if (!rl)
                return 0;
        slot = find_hold(r, i, pid, start_time, &hash);
        if (!slot)
                return 0;
        rl->l.holds[slot->index].refs = 0;      /* ended */
        map_remove(&r->by_hold, slot);
        rl->live_holds--;
        r->live--;
        r->dead++;
        return 0;
}

static int apply_put_token(Replay *r, Cursor *c) {
        StateToken t = {};
        ReplayLease *rl;
        MapSlot *slot;
        uint64_t hash;
        size_t i = 0;
        int k;

        rl = op_lease(r, c, &i);
        r_fixed(c, t.token, sizeof(t.token));
        t.uid = (uid_t)r_u32(c);
        t.creator = (uid_t)r_u32(c);
        t.readonly = r_bool(c);
        if (c->bad || t.token[0] == 0)
                return bad(r, "a token that cannot be decoded");
        if (!rl)
                return bad(r, "a token of a lease that is not there");
        slot = find_token(r, t.token, strlen(t.token), &hash);
        if (slot) {
                if (slot->lease != i)
                        return bad(r, "a token of two leases");
                rl->l.tokens[slot->index] = t;
                return 0;
        }
        if (rl->live_tokens >= LEASE_TOKENS_MAX)
                return bad(r, "more tokens on a lease than it may have");
        k = grow_array((void **)&rl->l.tokens, &rl->cap_tokens, rl->l.n_tokens, sizeof(StateToken));
        if (k >= 0)
                k = map_add(&r->by_token, hash, (uint32_t)i, (uint32_t)rl->l.n_tokens);
        if (k < 0)
                return k == -EBADMSG ? bad(r, "too many tokens") : k;
        rl->l.tokens[rl->l.n_tokens++] = t;
        rl->live_tokens++;
        r->live++;
        return 0;
}

static int apply_end_token(Replay *r, Cursor *c) {
        MapSlot *slot;
        uint64_t hash;
        size_t n;
        const char *token = r_str(c, LEASE_TOKEN_LEN, &n);
        ReplayLease *rl;

        if (c->bad)
                return bad(r, "an end of a token that cannot be decoded");
        slot = find_token(r, token, n, &hash);
        if (!slot)
                return 0;
        rl = &r->leases[slot->lease];
        rl->l.tokens[slot->index].token[0] = 0; /* ended */
        map_remove(&r->by_token, slot);
        rl->live_tokens--;
        r->live--;
        r->dead++;
        return 0;
}

/* Applies one record's ops. The snapshot's begins with SNAPSHOT and holds only PUT_ ops. */
static int apply_record(Replay *r, const uint8_t *payload, size_t len, bool snapshot) {
        Cursor c = { .p = payload, .end = payload + len };
        size_t puts = 0, n_leases = 0;
        int k;

        if (snapshot) {
                if (r_u8(&c) != OP_SNAPSHOT)
                        return bad(r, "the first record is not a snapshot");
                n_leases = r_u32(&c);
                if (c.bad || n_leases > STATE_LEASES_MAX)
                        return bad(r, "the snapshot's count of leases is out of range");
        }
        while (c.p < c.end) {
                uint8_t op = r_u8(&c);

                switch (op) {
                case OP_PUT_LEASE:
                        k = apply_put_lease(r, &c);
                        puts++;
                        break;
                case OP_PUT_HOLD:
                        k = apply_put_hold(r, &c);
                        break;
                case OP_PUT_TOKEN:
                        k = apply_put_token(r, &c);
                        break;
                case OP_END_LEASE:
                case OP_END_HOLD:
                case OP_END_TOKEN:
                        if (snapshot)
                                return bad(r, "the snapshot ends something");
                        k = op == OP_END_LEASE ? apply_end_lease(r, &c) :
                            op == OP_END_HOLD  ? apply_end_hold(r, &c) :
                                                 apply_end_token(r, &c);
                        break;
                default:
                        return bad(r, op == OP_SNAPSHOT ? "a snapshot after the first record" : "an unknown op");
                }
                if (k < 0)
                        return k;
                /* What has ended is dropped once it is as much as what lives: O(1) amortised per op. */
                if (r->dead > 4096 && r->dead > r->live) {
                        k = replay_compact(r, false);
                        if (k < 0)
                                return k;
                }
        }
        if (snapshot && (puts != n_leases || r->live_leases != n_leases))
                return bad(r, "the snapshot does not hold the leases it counts");
        return 0;
}

/* A window onto the file: pread() in chunks, so that the zeros past the log are not read. */
typedef struct Window {
        int fd;
        uint64_t size;                  /* the file's */
        uint8_t *buf;
        size_t cap;
        uint64_t base;                  /* the file offset of buf[0] */
        size_t len;
} Window;

/* Bytes [off, off + n) of the file, which must be within it. */
static int window_get(Window *w, uint64_t off, size_t n, const uint8_t **ret) {
        size_t want, done = 0;

        if (off >= w->base && off + n <= w->base + w->len) {
                *ret = w->buf + (off - w->base);
                return 0;
        }
        want = (size_t)MIN((uint64_t)MAX(n, READ_CHUNK), w->size - off);
        if (want > w->cap) {
                uint8_t *p = realloc(w->buf, want);

                if (!p)
                        return -ENOMEM;
                w->buf = p;
                w->cap = want;
        }
        w->base = off;
        w->len = 0;
        while (done < want) {
                ssize_t k = pread(w->fd, w->buf + done, want - done, (off_t)(off + done));

                if (k < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                if (k == 0)
                        break;          /* cut short while read: what is there is what is read */
                done += (size_t)k;
        }
        w->len = done;
        if (done < n)
                return -ENODATA;
        *ret = w->buf;
        return 0;
}

/* Turns the replay into a checked State. */
static int replay_finish(Replay *r, State *ret, char **ret_message) {
        State s = {};
        int k;

        k = replay_compact(r, true);
        if (k < 0)
                return k;
        if (r->n_leases > 0) {
                s.leases = calloc(r->n_leases, sizeof(StateLease));
                if (!s.leases)
                        return -ENOMEM;
        }
        for (size_t i = 0; i < r->n_leases; i++) {
                s.leases[i] = r->leases[i].l;
                r->leases[i].l = (StateLease){};
        }
        s.n_leases = r->n_leases;
        k = state_check(&s, ret_message);
        if (k < 0) {
                if (k == -EBADMSG && ret_message && *ret_message) {
                        char *m = NULL;

                        if (asprintf(&m, "The stored table is inconsistent: %s", *ret_message) >= 0) {
                                free(*ret_message);
                                *ret_message = m;
                        }
                }
                state_done(&s);
                return k;
        }
        *ret = s;
        return 0;
}

static int read_log(Window *w, State *ret, char **ret_message) {
        _cleanup_(replay_done) Replay r = {};
        const uint8_t *p;
        uint64_t off = FILE_HEADER_SIZE, seq = 0, records = 0;
        int k;

        if (getrandom(&r.seed, sizeof(r.seed), GRND_NONBLOCK) != sizeof(r.seed))
                r.seed = (uint64_t)(uintptr_t)&r ^ (uint64_t)time(NULL);

        for (;;) {
                uint32_t crc, len;
                uint64_t s;

                if (w->size - off < RECORD_HEADER_SIZE)
                        break;
                k = window_get(w, off, RECORD_HEADER_SIZE, &p);
                if (k == -ENODATA)
                        break;
                if (k < 0)
                        return k;
                crc = get_le32(p);
                len = get_le32(p + 4);
                s = get_le64(p + 8);
                if (len == 0 || len > w->size - off - RECORD_HEADER_SIZE || (records > 0 && s != seq + 1))
                        break;
                k = window_get(w, off, RECORD_HEADER_SIZE + (size_t)len, &p);
                if (k == -ENODATA)
                        break;
                if (k < 0)
                        return k;
                if (crc32c(p + 4, RECORD_HEADER_SIZE - 4 + (size_t)len) != crc)
                        break;
                k = apply_record(&r, p + RECORD_HEADER_SIZE, len, records == 0);
                if (k == -EBADMSG)
                        return set_message_error(ret_message, k,
                                                 "The stored table's record %" PRIu64 " (at byte %" PRIu64
                                                 ") holds %s.",
                                                 records, off, r.why ?: "something invalid");
                if (k < 0)
                        return k;
                seq = s;
                records++;
                off += RECORD_HEADER_SIZE + (uint64_t)len;
        }
        if (records == 0)
                return set_message_error(ret_message, -EBADMSG,
                                         "The stored table has no whole snapshot: it was cut short or damaged.");
        return replay_finish(&r, ret, ret_message);
}

int store_read(int fd, State *ret, char **ret_message) {
        Window w = { .fd = fd };
        const uint8_t *p;
        struct stat st;
        uint32_t format;
        int k;

        *ret = (State){};
        if (fstat(fd, &st) < 0)
                return -errno;
        if (!S_ISREG(st.st_mode))
                return set_message_error(ret_message, -EBADMSG, "The stored table is not a regular file.");
        if ((uint64_t)st.st_size > STATE_SIZE_MAX)
                return set_message_error(ret_message, -EFBIG,
                                         "The stored table is %" PRIu64 " bytes, over the %" PRIu64
                                         " bytes this daemon reads.",
                                         (uint64_t)st.st_size, STATE_SIZE_MAX);
        if (st.st_size == 0)
                return set_message_error(ret_message, -EBADMSG, "The stored table is empty.");
        w.size = (uint64_t)st.st_size;

        k = window_get(&w, 0, 1, &p);
        if (k >= 0 && p[0] == '{') {
                free(w.buf);
                return state_read(fd, ret, ret_message);        /* format 1: the previous daemon's JSON */
        }
        if (k >= 0)
                k = window_get(&w, 0, FILE_HEADER_SIZE, &p);
        if (k == -ENODATA || (k >= 0 && memcmp(p, FILE_MAGIC, 8) != 0))
                k = set_message_error(ret_message, -EBADMSG, "The stored table is not a vmmbroker lease table.");
        else if (k >= 0 && (format = get_le32(p + 8)) != STORE_FORMAT)
                k = set_message_error(ret_message, -EPROTONOSUPPORT,
                                      "The stored table is in format %" PRIu32 "; this daemon reads formats %d and %d.",
                                      format, STATE_FORMAT, STORE_FORMAT);
        else if (k >= 0 && (get_le32(p + 24) != crc32c(p, 24) || get_le32(p + 12) != 0 || get_le32(p + 28) != 0))
                k = set_message_error(ret_message, -EBADMSG, "The stored table's header is damaged.");
        else if (k >= 0)
                k = read_log(&w, ret, ret_message);
        free(w.buf);
        return k;
}
