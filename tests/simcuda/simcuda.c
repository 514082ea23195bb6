/* SPDX-License-Identifier: MIT */

/*
 * The simulated CUDA device: a libcuda.so.1 that implements, over host memory,
 * every Driver API entry point the project uses (CUDA_DRIVER_ENTRY_POINTS in
 * proto/driver.h) and enforces the real driver's rules. README.md describes
 * the rules, the environment and the limitations.
 *
 * The model:
 *  - an allocation (cuMemCreate, cuMemAlloc) is a memfd named "simcuda-devN"
 *    (device memory) or "simcuda-hostN" (host memory on NUMA node N), and an
 *    exported handle is an fd to it;
 *  - a reservation is a PROT_NONE anonymous mapping; cuMemMap maps the memfd
 *    over part of it (MAP_FIXED) and cuMemUnmap puts PROT_NONE memory back;
 *  - cuMemSetAccess is mprotect(); a device pointer is the host address;
 *  - a stream is a worker thread with a FIFO of operations;
 *  - an event is a counter of records and of those that have run on their stream.
 *
 * Only cuGetProcAddress_v2, cuGetProcAddress and the simcuda_* test hooks are
 * exported; the entry points are static and reached through cuGetProcAddress.
 *
 * Locking: one mutex guards all state. Every entry point holds it for its
 * whole body, except while it waits on a condition variable, joins a stream's
 * worker or runs a host function. Copies and memsets run under it, so that no
 * mapping can go away under them. A cuMemCreate of host memory held by
 * SIMCUDA_HOLD_CREATE_FILE waits before it takes the lock.
 */

#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "driver.h"     /* CUDA_DRIVER_ENTRY_POINTS; cuda.h and cudaTypedefs.h */
#include "list.h"
#include "macro.h"
#include "simcuda.h"
#include "size.h"

#define _public_ __attribute__((visibility("default")))

#define GRANULARITY (UINT64_C(2) << 20)         /* minimum and recommended, as on an H100/H200 */
#define HOST_GRANULARITY (UINT64_C(2) << 20)    /* of pinned host-NUMA memory, as on an H100 (parking-spec) */
#define MAX_DEVICES 64                          /* a Mapping keeps one bit per device in a uint64_t */
#define DEFAULT_MEMORY (UINT64_C(8) << 30)
#define DEFAULT_HOST_MEMORY (UINT64_C(64) << 30)
#define SIM_BUCKETS 16384                       /* hash buckets for allocations and handles */
#define DEFAULT_DRIVER_VERSION 13000
#define HANDLE_TAG UINT64_C(0x5c0da00000000000) /* in every handle id, so that a small integer is never one */

/* The address rules (reserve, map, unmap, set access) use GRANULARITY for every allocation. */
_Static_assert(HOST_GRANULARITY == GRANULARITY, "host memory would need address rules of its own");

/* ---- Entry points ------------------------------------------------------------------------------------ */

#define ENTRY_ENUM(name, abi) ENTRY_##name,
typedef enum Entry { CUDA_DRIVER_ENTRY_POINTS(ENTRY_ENUM) N_ENTRIES } Entry;
#undef ENTRY_ENUM

#define ENTRY_NAME(name, abi) [ENTRY_##name] = #name,
static const char *const entry_names[N_ENTRIES] = { CUDA_DRIVER_ENTRY_POINTS(ENTRY_NAME) };
#undef ENTRY_NAME

static int entry_by_name(const char *name) {
        for (int e = 0; e < N_ENTRIES; e++)
                if (strcmp(entry_names[e], name) == 0)
                        return e;
        return -1;
}

/* ---- Errors: what cuGetErrorName/cuGetErrorString know ----------------------------------------------- */

typedef struct ErrorInfo {
        CUresult code;
        const char *name;
        const char *text;
} ErrorInfo;

/* The real driver's strings. */
#define E(code, text) { code, #code, text }
static const ErrorInfo errors[] = {
        E(CUDA_SUCCESS, "no error"),
        E(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
        E(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
        E(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
        E(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
        E(CUDA_ERROR_STUB_LIBRARY, "CUDA driver is a stub library"),
        E(CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER, "API call is not supported in the installed CUDA driver"),
        E(CUDA_ERROR_DEVICE_UNAVAILABLE, "CUDA-capable device(s) is/are busy or unavailable"),
        E(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
        E(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
        E(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"),
        E(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
        E(CUDA_ERROR_MAP_FAILED, "mapping of buffer object failed"),
        E(CUDA_ERROR_UNMAP_FAILED, "unmapping of buffer object failed"),
        E(CUDA_ERROR_ALREADY_MAPPED, "resource already mapped"),
        E(CUDA_ERROR_NOT_MAPPED, "resource not mapped"),
        E(CUDA_ERROR_ECC_UNCORRECTABLE, "uncorrectable ECC error encountered"),
        E(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access is not supported between these two devices"),
        E(CUDA_ERROR_FILE_NOT_FOUND, "file not found"),
        E(CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS"),
        E(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
        E(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state"),
        E(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
        E(CUDA_ERROR_NOT_READY, "device not ready"),
        E(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
        E(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "too many resources requested for launch"),
        E(CUDA_ERROR_LAUNCH_TIMEOUT, "the launch timed out and was terminated"),
        E(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled"),
        E(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled"),
        E(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "cannot set while device is active in this process"),
        E(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"),
        E(CUDA_ERROR_ASSERT, "device-side assert triggered"),
        E(CUDA_ERROR_HARDWARE_STACK_ERROR, "hardware stack error"),
        E(CUDA_ERROR_ILLEGAL_INSTRUCTION, "an illegal instruction was encountered"),
        E(CUDA_ERROR_MISALIGNED_ADDRESS, "misaligned address"),
        E(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure"),
        E(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
        E(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
        E(CUDA_ERROR_SYSTEM_NOT_READY, "system not yet initialized"),
        E(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "system has unsupported display driver / cuda driver combination"),
        E(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, "forward compatibility was attempted on non supported HW"),
        E(CUDA_ERROR_TIMEOUT, "wait operation timed out"),
        E(CUDA_ERROR_UNKNOWN, "unknown error"),
};
#undef E

static const ErrorInfo *error_by_code(CUresult code) {
        for (size_t i = 0; i < ELEMENTSOF(errors); i++)
                if (errors[i].code == code)
                        return &errors[i];
        return NULL;
}

static const ErrorInfo *error_by_name(const char *name) {
        for (size_t i = 0; i < ELEMENTSOF(errors); i++)
                if (strcmp(errors[i].name, name) == 0)
                        return &errors[i];
        return NULL;
}

/* ---- State ------------------------------------------------------------------------------------------- */

/* Physical memory: a memfd. Lives while a handle or a mapping in this process refers to it. */
typedef struct Allocation {
        List link;                      /* in sim.allocations */
        int fd;                         /* the memfd */
        CUmemLocation location;         /* a device, or a host NUMA node (CU_MEM_LOCATION_TYPE_HOST_NUMA) */
        uint64_t size;
        dev_t st_dev;                   /* the memfd's identity, to recognise an import of our own export */
        ino_t st_ino;
        bool charged;                   /* created here, so counted against its location's budget */
        unsigned refs;                  /* handles and mappings that refer to it */
} Allocation;

/* A CUmemGenericAllocationHandle: an opaque id, never a pointer. */
typedef struct Handle {
        List link;                      /* in sim.handles */
        CUmemGenericAllocationHandle id;
        Allocation *allocation;
        bool exportable;                /* created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (not imported) */
} Handle;

typedef struct Reservation {
        List link;                      /* in sim.reservations */
        uint64_t start, size;
        List mappings;                  /* Mapping.link */
        CUcontext alloc_ctx;            /* made by cuMemAlloc in this context (and then off limits to VMM calls) */
} Reservation;

typedef struct Mapping {
        List link;                      /* in Reservation.mappings */
        uint64_t start, size;
        Allocation *allocation;         /* mapped whole, from offset 0 */
        uint64_t readers, writers;      /* the devices that may read, write it: bit N is device N */
} Mapping;

typedef enum OpKind {
        OP_MEMSET,
        OP_COPY_TO_DEVICE,
        OP_COPY_FROM_DEVICE,
        OP_COPY_DEVICE,                 /* cuMemcpyDtoDAsync: device memory to device memory */
        OP_HOST_FUNC,
        OP_EVENT,                       /* cuEventRecord: marks the event's record `seq` done */
        OP_WAIT_EVENT,                  /* cuStreamWaitEvent: the stream waits until the event's record `seq` ran */
} OpKind;

/* One operation on a stream. */
typedef struct Op {
        List link;                      /* in CUstream_st.ops */
        OpKind kind;
        CUdeviceptr device;             /* the device range a memset or copy touches (OP_COPY_DEVICE: writes) */
        CUdeviceptr from;               /* OP_COPY_DEVICE: the device range it reads */
        size_t bytes;
        uint32_t value;                 /* OP_MEMSET: the pattern, `width` (1 or 4) bytes wide */
        unsigned width;
        const void *src;                /* OP_COPY_TO_DEVICE */
        void *dst;                      /* OP_COPY_FROM_DEVICE */
        CUhostFn fn;                    /* OP_HOST_FUNC */
        void *data;
        CUevent event;                  /* OP_EVENT, OP_WAIT_EVENT */
        uint64_t seq;
} Op;

/* cuda.h declares these two structs and leaves them to the driver. */
struct CUstream_st {
        List link;                      /* in CUctx_st.streams */
        CUcontext ctx;
        unsigned flags;                 /* CU_STREAM_DEFAULT or CU_STREAM_NON_BLOCKING */
        List ops;                       /* queued; the one running stays first until it is done */
        pthread_t worker;
        bool quit;                      /* cuStreamDestroy: drain, then exit */
};

struct CUctx_st {                       /* a device's primary context */
        int device;
        unsigned refs;                  /* retained minus released; 0: inactive */
        CUresult sticky;                /* a fault poisoned the context, for the rest of the process */
        List streams;                   /* CUstream_st.link */
        List events;                    /* CUevent_st.link */
};

/*
 * An event: cuEventRecord counts a record and queues an operation that marks
 * it done when it runs on its stream. The event is complete when every record
 * has run. Destroyed while a record is still queued, it lives on (out of the
 * context's list, so no call finds it) until that operation has run.
 */
struct CUevent_st {
        List link;                      /* in CUctx_st.events, until destroyed */
        CUcontext ctx;
        uint64_t recorded, done;        /* records made, and the last one that ran */
        unsigned queued;                /* OP_EVENT and OP_WAIT_EVENT operations still on a stream */
        bool destroyed;
};

/* "The Nth call of ENTRY from now fails with ERROR." */
typedef struct Fault {
        List link;                      /* in sim.faults */
        int entry;
        uint64_t countdown;             /* calls to go, this one included */
        CUresult error;
} Fault;

static struct {
        pthread_mutex_t lock;
        pthread_cond_t work;            /* for stream workers: work queued, hold lifted, or quit */
        pthread_cond_t idle;            /* for waiters: a queued operation finished */

        /* From the environment, read once by setup() and fixed afterwards. */
        const char *env_error;          /* the line cuInit() prints when a variable is bad, or NULL */
        int n_devices;
        uint64_t budget;                /* per device */
        uint64_t host_budget;           /* SIMCUDA_HOST_MEMORY: host memory, all NUMA nodes together */
        int driver_version;
        bool vmm, posix_fd;
        uint64_t peers[MAX_DEVICES];    /* SIMCUDA_PEERS: bit P of peers[D] says device D may access P's memory */
        int numa[MAX_DEVICES];          /* SIMCUDA_NUMA: device D's host NUMA node (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID) */

        bool initialized;               /* cuInit() succeeded */
        bool held;                      /* simcuda_hold_streams(1) */
        bool no_wait;                   /* simcuda_hold_streams(SIMCUDA_HOLD_NO_WAIT): a wait for held work aborts */
        char hold_file[PATH_MAX];       /* SIMCUDA_HOLD_FILE: streams are held while a file is there; "": none */
        char hold_host_file[PATH_MAX];  /* SIMCUDA_HOLD_HOST_FILE: host functions are held while a file is there */
        char hold_host_reached[PATH_MAX];       /* made when a stream waits at a held host function */
        bool copies_held;               /* simcuda_hold_copies(1) */
        char hold_copy_file[PATH_MAX];  /* SIMCUDA_HOLD_COPY_FILE: device-to-device copies wait while it is there */
        char hold_copy_reached[PATH_MAX];       /* made when a stream waits at a held copy */
        char hold_memset_file[PATH_MAX];        /* SIMCUDA_HOLD_MEMSET_FILE: memsets wait while it is there */
        char hold_memset_reached[PATH_MAX];     /* made when a stream waits at a held memset */
        char hold_create_file[PATH_MAX];        /* SIMCUDA_HOLD_CREATE_FILE: host cuMemCreate waits while it is there */
        char hold_create_reached[PATH_MAX];     /* made when a host cuMemCreate starts to wait */
        struct CUctx_st ctx[MAX_DEVICES];
        uint64_t charged[MAX_DEVICES];
        uint64_t host_charged;
        /* Allocations by inode and handles by id, hashed into buckets: a daemon with 100,000 slabs must not
         * pay a walk of them per import or export (bench-scale's start with 10,000 leases did). */
        List allocations[SIM_BUCKETS], handles[SIM_BUCKETS], reservations, faults;
        unsigned long n_allocations;
        uint64_t next_handle;
        uint64_t calls[N_ENTRIES];
} sim = {
        .lock = PTHREAD_MUTEX_INITIALIZER,
        .work = PTHREAD_COND_INITIALIZER,
        .idle = PTHREAD_COND_INITIALIZER,
        .reservations = LIST_INIT(sim.reservations),
        .faults = LIST_INIT(sim.faults),
};

/* The bucket for a key, its list head made on first use. */
static List *bucket(List *buckets, uint64_t key) {
        List *b = &buckets[key % SIM_BUCKETS];

        if (!b->next)
                list_init(b);
        return b;
}

/* The context current to this thread (cuCtxSetCurrent). */
static __thread CUcontext current;

/* ---- Fault rules ------------------------------------------------------------------------------------- */

static void faults_clear(List *faults) {
        Fault *f, *tmp;

        list_for_each_entry_safe(f, tmp, faults, link) {
                list_unlink(&f->link);
                free(f);
        }
}

/* Parses "ENTRY:N[:ERROR],..." onto the end of `faults`. On error, adds nothing and returns -EINVAL. */
static int faults_parse(const char *spec, List *faults) {
        _cleanup_free_ char *copy = NULL;
        List parsed = LIST_INIT(parsed);
        char *rest, *item;

        if (!spec)
                return -EINVAL;
        if (!*spec)
                return 0;
        copy = strdup(spec);
        if (!copy)
                return -ENOMEM;

        rest = copy;
        while ((item = strsep(&rest, ","))) {
                const char *name = strsep(&item, ":"), *count = strsep(&item, ":"), *error = item;
                const ErrorInfo *e = NULL;
                unsigned long long n = 0;
                char *end = NULL;
                Fault *f;
                int entry;

                entry = entry_by_name(name);
                if (count && *count >= '0' && *count <= '9') {
                        errno = 0;
                        n = strtoull(count, &end, 10);
                }
                if (error)
                        e = error_by_name(error);
                if (entry < 0 || !end || *end || errno != 0 || n == 0 || (error && (!e || e->code == CUDA_SUCCESS)))
                        goto fail;

                f = calloc(1, sizeof(*f));
                if (!f)
                        goto fail;
                f->entry = entry;
                f->countdown = n;
                f->error = e ? e->code
                             : entry == ENTRY_cuMemCreate ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN;
                list_link_tail(&parsed, &f->link);
        }

        while (!list_is_empty(&parsed)) {
                List *l = parsed.next;

                list_unlink(l);
                list_link_tail(faults, l);
        }
        return 0;

fail:
        faults_clear(&parsed);
        return -EINVAL;
}

/* ---- Set-up: the environment, read once -------------------------------------------------------------- */

static char env_error_line[256];

static bool env_get(const char *name, const char **ret) {
        const char *v = getenv(name);

        if (!v || !*v)
                return false;
        *ret = v;
        return true;
}

static bool parse_int(const char *s, long min, long max, int *ret) {
        char *end;
        long v;

        if (*s < '0' || *s > '9')
                return false;
        errno = 0;
        v = strtol(s, &end, 10);
        if (errno != 0 || *end || v < min || v > max)
                return false;
        *ret = (int)v;
        return true;
}

static bool parse_flag(const char *s, bool *ret) {
        if (strcmp(s, "0") != 0 && strcmp(s, "1") != 0)
                return false;
        *ret = s[0] == '1';
        return true;
}

/* One device index of SIMCUDA_PEERS at *s, below the device count; advances *s past its digits. */
static bool parse_peer_index(const char **s, int *ret) {
        char *end;
        long v;

        if (**s < '0' || **s > '9')
                return false;
        errno = 0;
        v = strtol(*s, &end, 10);
        if (errno != 0 || v >= sim.n_devices)
                return false;
        *ret = (int)v;
        *s = end;
        return true;
}

/*
 * SIMCUDA_PEERS: "all" (every device may access every other's memory), "none", or a comma-separated list of
 * "A-B" (A and B may access each other's memory) and "A>B" (A may access B's, not the other way). A device
 * is never its own peer (cuDeviceCanAccessPeer(&can, D, D) says 0, as on the real driver).
 */
static bool parse_peers(const char *v, uint64_t peers[static MAX_DEVICES]) {
        uint64_t parsed[MAX_DEVICES] = {};

        if (strcmp(v, "all") == 0 || strcmp(v, "none") == 0) {
                for (int d = 0; d < MAX_DEVICES; d++)
                        peers[d] = v[0] == 'a' ? ~(UINT64_C(1) << d) : 0;
                return true;
        }
        for (const char *s = v;;) {
                bool both;
                int a, b;

                if (!parse_peer_index(&s, &a) || (*s != '-' && *s != '>'))
                        return false;
                both = *s++ == '-';
                if (!parse_peer_index(&s, &b) || a == b || (*s != ',' && *s != '\0'))
                        return false;
                parsed[a] |= UINT64_C(1) << b;
                if (both)
                        parsed[b] |= UINT64_C(1) << a;
                if (*s == '\0')
                        break;
                s++;
        }
        memcpy(peers, parsed, sizeof(parsed));
        return true;
}

/*
 * SIMCUDA_NUMA: a comma-separated list of host NUMA nodes, device i's at position i ("0,0,1,1"), each from
 * -1 (the driver does not know) to 1023, at most one per device; devices past the list are on node 0.
 */
static bool parse_numa(const char *v, int numa[static MAX_DEVICES]) {
        int parsed[MAX_DEVICES] = {};

        for (int d = 0;; d++) {
                char *end;
                long n;

                if (d >= sim.n_devices || !((*v >= '0' && *v <= '9') || (v[0] == '-' && v[1] == '1')))
                        return false;
                errno = 0;
                n = strtol(v, &end, 10);
                if (errno != 0 || n < -1 || n > 1023 || (*end != ',' && *end != '\0'))
                        return false;
                parsed[d] = (int)n;
                if (*end == '\0')
                        break;
                v = end + 1;
        }
        memcpy(numa, parsed, sizeof(parsed));
        return true;
}

/* Records why a variable is bad, for cuInit() to print; the first one wins, the others keep their defaults. */
_printf_(1, 2) static void env_bad(const char *fmt, ...) {
        va_list ap;

        if (sim.env_error)
                return;
        va_start(ap, fmt);
        vsnprintf(env_error_line, sizeof(env_error_line), fmt, ap);
        va_end(ap);
        sim.env_error = env_error_line;
}

/* A size variable (SIMCUDA_MEMORY, SIMCUDA_HOST_MEMORY): bytes above 0; a bad one leaves *ret as it is. */
static void env_size(const char *name, uint64_t *ret) {
        uint64_t size;
        const char *v;

        if (!env_get(name, &v))
                return;
        if (parse_size(v, &size) < 0 || size == 0)
                env_bad("simcuda: %s=\"%.64s\" is not a size in bytes above 0 (digits with an optional K, M, G or T "
                        "suffix)", name, v);
        else
                *ret = size;
}

/* A hold file variable (SIMCUDA_HOLD_*_FILE): its path into `file` (PATH_MAX) and PATH.reached into `reached`;
 * a path too long for both leaves them empty. */
static void env_hold_file(const char *name, char *file, char *reached) {
        const char *v;

        if (!env_get(name, &v))
                return;
        if (snprintf(file, PATH_MAX, "%s", v) >= PATH_MAX || snprintf(reached, PATH_MAX, "%s.reached", v) >= PATH_MAX) {
                file[0] = reached[0] = 0;
                env_bad("simcuda: %s=\"%.64s...\" is longer than a path may be", name, v);
        }
}

static void setup_once(void) {
        const char *v;
        bool flag;

        for (int i = 0; i < MAX_DEVICES; i++) {
                sim.ctx[i].device = i;
                list_init(&sim.ctx[i].streams);
                list_init(&sim.ctx[i].events);
        }
        sim.n_devices = 1;
        sim.budget = DEFAULT_MEMORY;
        sim.host_budget = DEFAULT_HOST_MEMORY;
        sim.driver_version = DEFAULT_DRIVER_VERSION;
        sim.vmm = sim.posix_fd = true;
        (void)parse_peers("all", sim.peers);

        if (env_get("SIMCUDA_DEVICES", &v) && !parse_int(v, 0, MAX_DEVICES, &sim.n_devices))
                env_bad("simcuda: SIMCUDA_DEVICES=\"%.64s\" is not a number of devices from 0 to %d", v, MAX_DEVICES);
        env_size("SIMCUDA_MEMORY", &sim.budget);
        env_size("SIMCUDA_HOST_MEMORY", &sim.host_budget);
        if (env_get("SIMCUDA_DRIVER_VERSION", &v) && !parse_int(v, 1, INT_MAX, &sim.driver_version))
                env_bad("simcuda: SIMCUDA_DRIVER_VERSION=\"%.64s\" is not a CUDA version number such as 13000", v);
        if (env_get("SIMCUDA_NO_VMM", &v)) {
                if (parse_flag(v, &flag))
                        sim.vmm = !flag;
                else
                        env_bad("simcuda: SIMCUDA_NO_VMM=\"%.64s\" is neither 0 nor 1", v);
        }
        if (env_get("SIMCUDA_NO_POSIX_FD", &v)) {
                if (parse_flag(v, &flag))
                        sim.posix_fd = !flag;
                else
                        env_bad("simcuda: SIMCUDA_NO_POSIX_FD=\"%.64s\" is neither 0 nor 1", v);
        }
        if (env_get("SIMCUDA_PEERS", &v) && !parse_peers(v, sim.peers))
                env_bad("simcuda: SIMCUDA_PEERS=\"%.64s\" is neither \"all\", \"none\" nor a list of device pairs "
                        "such as 0-1,2>3 (indices below SIMCUDA_DEVICES, two different devices a pair)", v);
        if (env_get("SIMCUDA_NUMA", &v) && !parse_numa(v, sim.numa))
                env_bad("simcuda: SIMCUDA_NUMA=\"%.64s\" is not a list of host NUMA nodes such as 0,0,1,1 (one per "
                        "device at most, each from -1 to 1023)", v);
        if (env_get("SIMCUDA_HOLD_FILE", &v) && snprintf(sim.hold_file, sizeof(sim.hold_file), "%s", v) >=
                                                          (int)sizeof(sim.hold_file)) {
                sim.hold_file[0] = 0;
                env_bad("simcuda: SIMCUDA_HOLD_FILE=\"%.64s...\" is longer than a path may be", v);
        }
        env_hold_file("SIMCUDA_HOLD_HOST_FILE", sim.hold_host_file, sim.hold_host_reached);
        env_hold_file("SIMCUDA_HOLD_COPY_FILE", sim.hold_copy_file, sim.hold_copy_reached);
        env_hold_file("SIMCUDA_HOLD_MEMSET_FILE", sim.hold_memset_file, sim.hold_memset_reached);
        env_hold_file("SIMCUDA_HOLD_CREATE_FILE", sim.hold_create_file, sim.hold_create_reached);
        if (env_get("SIMCUDA_FAIL", &v) && faults_parse(v, &sim.faults) < 0)
                env_bad("simcuda: SIMCUDA_FAIL=\"%.64s\" is not a list of ENTRY:N[:ERROR] such as "
                        "cuMemCreate:3,cuMemMap:1:CUDA_ERROR_INVALID_VALUE", v);
}

static void setup(void) {
        static pthread_once_t once = PTHREAD_ONCE_INIT;

        pthread_once(&once, setup_once);
}

/* ---- Entering an entry point ------------------------------------------------------------------------- */

static pthread_mutex_t *sim_lock(void) {
        setup();
        pthread_mutex_lock(&sim.lock);
        return &sim.lock;
}

static void sim_unlockp(pthread_mutex_t **lock) {
        if (*lock)
                pthread_mutex_unlock(*lock);
}

/* Counts the call and fires an injected fault; then, unless the entry works before cuInit, checks cuInit. */
static CUresult enter(Entry entry, bool needs_init) {
        CUresult r = CUDA_SUCCESS;
        Fault *f, *tmp;

        sim.calls[entry]++;
        list_for_each_entry_safe(f, tmp, &sim.faults, link) {
                if (f->entry != (int)entry || --f->countdown > 0)
                        continue;
                if (r == CUDA_SUCCESS)
                        r = f->error;
                list_unlink(&f->link);
                free(f);
        }
        if (r == CUDA_SUCCESS && needs_init && !sim.initialized)
                r = CUDA_ERROR_NOT_INITIALIZED;
        return r;
}

/* The first statement of every entry point: takes the lock until the function returns. */
#define ENTER_ENTRY(entry, needs_init)                                                          \
        _cleanup_(sim_unlockp) _unused_ pthread_mutex_t *_locked_ = sim_lock();                 \
        do {                                                                                    \
                CUresult _r_ = enter(entry, needs_init);                                        \
                if (_r_ != CUDA_SUCCESS)                                                        \
                        return _r_;                                                             \
        } while (0)
#define ENTER(name) ENTER_ENTRY(ENTRY_##name, true)
#define ENTER_BEFORE_INIT(name) ENTER_ENTRY(ENTRY_##name, false)

static bool device_valid(CUdevice dev) {
        return dev >= 0 && dev < sim.n_devices;
}

/* A host NUMA node the simulated machine has: 0, and every node SIMCUDA_NUMA names. */
static bool numa_node_valid(int node) {
        if (node == 0)
                return true;
        for (int d = 0; d < sim.n_devices; d++)
                if (node > 0 && sim.numa[d] == node)
                        return true;
        return false;
}

static bool location_is_host(CUmemLocation loc) {
        return loc.type == CU_MEM_LOCATION_TYPE_HOST_NUMA;
}

/* What memory at `loc` is charged to: its device's budget, or the host's (one for every NUMA node). */
static uint64_t *location_charged(CUmemLocation loc) {
        return location_is_host(loc) ? &sim.host_charged : &sim.charged[loc.id];
}

static uint64_t location_budget(CUmemLocation loc) {
        return location_is_host(loc) ? sim.host_budget : sim.budget;
}

/* What an allocation's size at `loc` is a multiple of (minimum and recommended alike). */
static uint64_t location_granularity(CUmemLocation loc) {
        return location_is_host(loc) ? HOST_GRANULARITY : GRANULARITY;
}

/* The current context, active, for calls that clean up even after a fault. */
static CUresult ctx_current(CUcontext *ret) {
        if (!current)
                return CUDA_ERROR_INVALID_CONTEXT;
        if (current->refs == 0)
                return CUDA_ERROR_CONTEXT_IS_DESTROYED;
        *ret = current;
        return CUDA_SUCCESS;
}

/* The current context, active and not poisoned, for everything else that needs one. */
static CUresult ctx_usable(CUcontext *ret) {
        CUresult r = ctx_current(ret);

        if (r == CUDA_SUCCESS && (*ret)->sticky != CUDA_SUCCESS)
                r = (*ret)->sticky;
        return r;
}

/* ---- Allocations and handles ------------------------------------------------------------------------- */

/* A fresh allocation at `loc` (valid), charged to its budget; the caller owns its one reference. */
static CUresult allocation_new(CUmemLocation loc, uint64_t size, Allocation **ret) {
        _cleanup_close_ int fd = -EBADF;
        char name[32];
        struct stat st;
        Allocation *a;

        if (size > location_budget(loc) - *location_charged(loc))
                return CUDA_ERROR_OUT_OF_MEMORY;
        snprintf(name, sizeof(name), location_is_host(loc) ? "simcuda-host%d" : "simcuda-dev%d", loc.id);
        fd = memfd_create(name, MFD_CLOEXEC);
        if (fd < 0 || size > INT64_MAX || ftruncate(fd, (off_t)size) < 0 || fstat(fd, &st) < 0)
                return CUDA_ERROR_OUT_OF_MEMORY;
        a = calloc(1, sizeof(*a));
        if (!a)
                return CUDA_ERROR_OUT_OF_MEMORY;
        *a = (Allocation){
                .fd = TAKE_FD(fd),
                .location = loc,
                .size = size,
                .st_dev = st.st_dev,
                .st_ino = st.st_ino,
                .charged = true,
                .refs = 1,
        };
        list_link_tail(bucket(sim.allocations, st.st_ino), &a->link);
        *location_charged(loc) += size;
        sim.n_allocations++;
        *ret = a;
        return CUDA_SUCCESS;
}

/* Drops one reference; the last one frees the allocation and its charge. */
static void allocation_put(Allocation *a) {
        if (--a->refs > 0)
                return;
        if (a->charged)
                *location_charged(a->location) -= a->size;
        list_unlink(&a->link);
        sim.n_allocations--;
        safe_close(a->fd);
        free(a);
}

/*
 * Where the memory of a simcuda memfd lives ("/memfd:simcuda-devN (deleted)", "/memfd:simcuda-hostN
 * (deleted)"), if that device or NUMA node exists here; false for any other fd.
 */
static bool memfd_location(int fd, CUmemLocation *ret) {
        char path[64], target[128];
        int id, end = 0;
        ssize_t n;

        snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
        n = readlink(path, target, sizeof(target) - 1);
        if (n < 0)
                return false;
        target[n] = '\0';
        if (sscanf(target, "/memfd:simcuda-dev%d (deleted)%n", &id, &end) == 1 && end == n && device_valid(id)) {
                *ret = (CUmemLocation){ .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = id };
                return true;
        }
        if (sscanf(target, "/memfd:simcuda-host%d (deleted)%n", &id, &end) == 1 && end == n && numa_node_valid(id)) {
                *ret = (CUmemLocation){ .type = CU_MEM_LOCATION_TYPE_HOST_NUMA, .id = id };
                return true;
        }
        return false;
}

static Handle *handle_find(CUmemGenericAllocationHandle id) {
        Handle *h;

        list_for_each_entry(h, bucket(sim.handles, id), link)
                if (h->id == id)
                        return h;
        return NULL;
}

/* ---- Reservations and mappings ----------------------------------------------------------------------- */

/* Puts PROT_NONE, unbacked memory over [start, start + size) of a reservation. */
static int reserve_fixed(uint64_t start, uint64_t size) {
        void *p = mmap((void *)(uintptr_t)start, size, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);

        return p == MAP_FAILED ? -errno : 0;
}

static CUresult reservation_new(uint64_t size, uint64_t alignment, uint64_t hint, Reservation **ret) {
        const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
        Reservation *res;
        void *p = MAP_FAILED;
        uint64_t start = hint, span, base;

        res = calloc(1, sizeof(*res));
        if (!res)
                return CUDA_ERROR_OUT_OF_MEMORY;

        /* The requested address, when it is free and aligned (a kernel older than 4.17 takes it as a hint). */
        if (hint != 0 && hint % alignment == 0) {
                p = mmap((void *)(uintptr_t)hint, size, PROT_NONE, flags | MAP_FIXED_NOREPLACE, -1, 0);
                if (p != MAP_FAILED && (uintptr_t)p != hint) {
                        munmap(p, size);
                        p = MAP_FAILED;
                }
        }
        /* Else anywhere: reserve `alignment` more than asked, then trim both ends. */
        if (p == MAP_FAILED) {
                if (__builtin_add_overflow(size, alignment, &span) ||
                    (p = mmap(NULL, span, PROT_NONE, flags, -1, 0)) == MAP_FAILED) {
                        free(res);
                        return CUDA_ERROR_OUT_OF_MEMORY;
                }
                base = (uintptr_t)p;
                start = ALIGN_UP(base, alignment);
                if (start > base)
                        munmap(p, start - base);
                if (base + span > start + size)
                        munmap((void *)(uintptr_t)(start + size), base + span - (start + size));
        }

        res->start = start;
        res->size = size;
        list_init(&res->mappings);
        list_link_tail(&sim.reservations, &res->link);
        *ret = res;
        return CUDA_SUCCESS;
}

/* Frees a reservation that has nothing mapped in it. */
static void reservation_free(Reservation *res) {
        munmap((void *)(uintptr_t)res->start, res->size);
        list_unlink(&res->link);
        free(res);
}

static Reservation *reservation_find(uint64_t addr) {
        Reservation *res;

        list_for_each_entry(res, &sim.reservations, link)
                if (addr >= res->start && addr - res->start < res->size)
                        return res;
        return NULL;
}

static Mapping *mapping_find(uint64_t addr) {
        Reservation *res = reservation_find(addr);
        Mapping *m;

        if (!res)
                return NULL;
        list_for_each_entry(m, &res->mappings, link)
                if (addr >= m->start && addr - m->start < m->size)
                        return m;
        return NULL;
}

/* Maps all of `a` at `start` in `res`, with no access yet. The mapping takes its own reference. */
static CUresult mapping_new(Reservation *res, uint64_t start, Allocation *a, Mapping **ret) {
        Mapping *m;

        m = calloc(1, sizeof(*m));
        if (!m)
                return CUDA_ERROR_OUT_OF_MEMORY;
        if (mmap((void *)(uintptr_t)start, a->size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0) == MAP_FAILED) {
                (void)reserve_fixed(start, a->size);    /* a failed MAP_FIXED may have unmapped the range */
                free(m);
                return CUDA_ERROR_OUT_OF_MEMORY;
        }
        m->start = start;
        m->size = a->size;
        m->allocation = a;
        a->refs++;
        list_link_tail(&res->mappings, &m->link);
        *ret = m;
        return CUDA_SUCCESS;
}

/* Unmaps, leaving the range reserved, and drops the mapping's reference. */
static void mapping_free(Mapping *m) {
        (void)reserve_fixed(m->start, m->size);
        list_unlink(&m->link);
        allocation_put(m->allocation);
        free(m);
}

/* Grants or revokes `device`'s access to a mapping, and mprotect()s it to what any device may do. */
static int mapping_set_access(Mapping *m, int device, CUmemAccess_flags flags) {
        uint64_t bit = UINT64_C(1) << device;

        m->readers = (flags & CU_MEM_ACCESS_FLAGS_PROT_READ) ? m->readers | bit : m->readers & ~bit;
        m->writers = flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? m->writers | bit : m->writers & ~bit;
        if (mprotect((void *)(uintptr_t)m->start, m->size,
                     (m->readers ? PROT_READ : 0) | (m->writers ? PROT_WRITE : 0)) < 0)
                return -errno;
        return 0;
}

/* Whether `device` may read (or write) every byte of [ptr, ptr + bytes). */
static bool accessible(int device, uint64_t ptr, uint64_t bytes, bool write) {
        uint64_t bit = UINT64_C(1) << device, end;

        if (__builtin_add_overflow(ptr, bytes, &end))
                return false;
        for (uint64_t cur = ptr; cur < end;) {
                Mapping *m = mapping_find(cur);

                if (!m || !(m->readers & bit) || (write && !(m->writers & bit)))
                        return false;
                cur = m->start + m->size;
        }
        return true;
}

/* Whether a mapping lies entirely within [start, end). */
static bool mapping_within(const Mapping *m, uint64_t start, uint64_t end) {
        return m->start >= start && m->start + m->size <= end;
}

/* Whether [start, end) cuts a mapping in two at either end. */
static bool range_splits_mapping(uint64_t start, uint64_t end) {
        Mapping *first = mapping_find(start), *last = mapping_find(end - 1);

        return (first && first->start != start) || (last && last->start + last->size != end);
}

/* cuMemAlloc's memory: one allocation mapped read-write for the context's device in its own reservation. */
static CUresult alloc_new(CUcontext ctx, uint64_t size, CUdeviceptr *ret) {
        Reservation *res = NULL;
        Mapping *m = NULL;
        Allocation *a;
        CUresult r;

        r = allocation_new((CUmemLocation){ .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ctx->device }, size, &a);
        if (r != CUDA_SUCCESS)
                return r;
        r = reservation_new(size, GRANULARITY, 0, &res);
        if (r == CUDA_SUCCESS) {
                r = mapping_new(res, res->start, a, &m);
                if (r != CUDA_SUCCESS)
                        reservation_free(res);
        }
        allocation_put(a);              /* the mapping holds it now, or nothing does */
        if (r != CUDA_SUCCESS)
                return r;

        if (mapping_set_access(m, ctx->device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE) < 0) {
                mapping_free(m);
                reservation_free(res);
                return CUDA_ERROR_OUT_OF_MEMORY;
        }
        res->alloc_ctx = ctx;
        *ret = res->start;
        return CUDA_SUCCESS;
}

static void alloc_free(Reservation *res) {
        Mapping *m = list_first_entry(&res->mappings, Mapping, link);

        if (m)
                mapping_free(m);
        reservation_free(res);
}

/* ---- Streams ----------------------------------------------------------------------------------------- */

static Mapping *mapping_find(uint64_t addr);

static void op_fill(const Op *op) {
        void *p = (void *)(uintptr_t)op->device;
        uint8_t byte = op->value & 0xff;
        Mapping *m;

        /*
         * Zeroing a whole allocation (the broker's scrub) drops its pages instead of writing them: they read
         * zero again, as a device zeroes at TB/s where a CPU memset costs the simulated machine's time.
         */
        if (op->value == 0 && (m = mapping_find(op->device)) && m->start == op->device && m->size == op->bytes &&
            fallocate(m->allocation->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)op->bytes) == 0)
                return;
        if (op->width == 1 || op->value == byte * UINT32_C(0x01010101))
                memset(p, byte, op->bytes);
        else
                for (size_t i = 0; i < op->bytes / sizeof(uint32_t); i++)
                        ((uint32_t *)p)[i] = op->value;
}

/* Whether the context's device may do what `op` does to device memory. */
static bool op_accessible(CUcontext ctx, const Op *op) {
        switch (op->kind) {
        case OP_MEMSET:
        case OP_COPY_TO_DEVICE:
                return accessible(ctx->device, op->device, op->bytes, true);
        case OP_COPY_FROM_DEVICE:
                return accessible(ctx->device, op->device, op->bytes, false);
        case OP_COPY_DEVICE:
                return accessible(ctx->device, op->device, op->bytes, true) &&
                       accessible(ctx->device, op->from, op->bytes, false);
        case OP_HOST_FUNC:
        case OP_EVENT:
        case OP_WAIT_EVENT:
                break;
        }
        return true;
}

/*
 * Runs one operation, under the lock; a host function runs with the lock
 * dropped. Device memory was checked when the operation was issued, and is
 * checked again here: it may have been unmapped since. Touching it then is
 * what faults on a GPU, so it poisons the context instead
 * (CUDA_ERROR_ILLEGAL_ADDRESS). A poisoned context runs nothing more, host
 * functions included, as on a real device.
 */
static void op_run(CUcontext ctx, const Op *op) {
        if (ctx->sticky != CUDA_SUCCESS)
                return;
        if (op->kind == OP_HOST_FUNC) {
                pthread_mutex_unlock(&sim.lock);
                op->fn(op->data);
                pthread_mutex_lock(&sim.lock);
                return;
        }
        if (op->kind == OP_EVENT) {
                op->event->done = MAX(op->event->done, op->seq);
                pthread_cond_broadcast(&sim.work);      /* a stream may wait for it (OP_WAIT_EVENT) */
                return;
        }
        if (op->kind == OP_WAIT_EVENT)
                return;                                 /* the stream waited for it (stream_held()) */
        if (op->bytes == 0)
                return;
        if (!op_accessible(ctx, op)) {
                ctx->sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
                return;
        }
        switch (op->kind) {
        case OP_MEMSET:
                op_fill(op);
                break;
        case OP_COPY_TO_DEVICE:
                memcpy((void *)(uintptr_t)op->device, op->src, op->bytes);
                break;
        case OP_COPY_FROM_DEVICE:
                memcpy(op->dst, (const void *)(uintptr_t)op->device, op->bytes);
                break;
        case OP_COPY_DEVICE:    /* the ranges may overlap (the result is undefined on a GPU) */
                memmove((void *)(uintptr_t)op->device, (const void *)(uintptr_t)op->from, op->bytes);
                break;
        case OP_HOST_FUNC:
        case OP_EVENT:
        case OP_WAIT_EVENT:
                break;
        }
}

/* A queued operation leaves its stream (run, or skipped in a poisoned context): what it held goes. */
static void op_done(Op *op) {
        if ((op->kind == OP_EVENT || op->kind == OP_WAIT_EVENT) && --op->event->queued == 0 && op->event->destroyed)
                free(op->event);
        free(op);
}

/*
 * Whether the streams are held: by simcuda_hold_streams(1) in this process, or while the file SIMCUDA_HOLD_FILE
 * names is there (another process, a test, holds the daemon's streams so).
 */
static bool streams_held(void) {
        return sim.held || (sim.hold_file[0] && access(sim.hold_file, F_OK) == 0);
}

/* Whether the hold file `path` (none when "") is there; when it is, makes `reached` so that its holder knows a
 * stream waits at it. */
static bool hold_file_present(const char *path, const char *reached) {
        int fd;

        if (!path[0] || access(path, F_OK) != 0)
                return false;
        fd = open(reached, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0)
                close(fd);
        return true;
}

/*
 * Whether host functions are held: while the file SIMCUDA_HOLD_HOST_FILE names is there, a stream that reaches
 * one waits before running it (what was queued before it is done: its events have completed). It then makes
 * the file's name + ".reached", so that the test holding it knows.
 */
static bool host_funcs_held(void) {
        return hold_file_present(sim.hold_host_file, sim.hold_host_reached);
}

/*
 * Whether memsets are held: while the file SIMCUDA_HOLD_MEMSET_FILE names is there, a stream whose next
 * operation is a memset (the daemon's scrubs and zeroings in place) waits before it, and makes the file's name
 * + ".reached"; copies and other streams run on.
 */
static bool memsets_held(void) {
        return hold_file_present(sim.hold_memset_file, sim.hold_memset_reached);
}

/*
 * Whether the hold file `path` lets one more held operation run: it holds a count of them (a decimal number;
 * empty or anything else is none), which this takes one from, writing it back in place.
 */
static bool hold_file_passes_one(const char *path) {
        char buf[32] = "";
        unsigned long n;
        ssize_t len;
        char *end;
        int fd;

        fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0)
                return false;
        len = pread(fd, buf, sizeof(buf) - 1, 0);
        n = len > 0 ? strtoul(buf, &end, 10) : 0;
        if (len <= 0 || end == buf || n == 0) {
                close(fd);
                return false;
        }
        len = snprintf(buf, sizeof(buf), "%lu", n - 1);
        if (ftruncate(fd, 0) < 0 || pwrite(fd, buf, (size_t)len, 0) != len)
                fprintf(stderr, "simcuda: could not write %s back: %m\n", path);
        close(fd);
        return true;
}

/*
 * Whether device-to-device copies are held: by simcuda_hold_copies(1), or while the file SIMCUDA_HOLD_COPY_FILE
 * names is there; a stream that reaches one waits before running it (other streams run on), and makes the
 * file's name + ".reached". A hold file that holds a number N lets N more copies run first, one at a time, so
 * that a test lets one copy through and holds the next (test-park's test_own_unparks_after_own_park_copy).
 */
static bool copies_held(void) {
        if (sim.copies_held)
                return true;
        if (sim.hold_copy_file[0] && hold_file_passes_one(sim.hold_copy_file))
                return false;
        return hold_file_present(sim.hold_copy_file, sim.hold_copy_reached);
}

/* Whether the first operation of `s` must wait: the streams are held, or it is a host function or a copy and
 * those are, or it waits for an event's record that has not run (in a context that still runs anything). */
static bool stream_held(CUstream s) {
        const Op *op = list_first_entry(&s->ops, Op, link);

        if (op->kind == OP_WAIT_EVENT && op->event->done < op->seq && op->event->ctx->sticky == CUDA_SUCCESS)
                return true;
        return streams_held() || (op->kind == OP_HOST_FUNC && host_funcs_held()) ||
               (op->kind == OP_COPY_DEVICE && copies_held()) || (op->kind == OP_MEMSET && memsets_held());
}

/* Waits for work, the hold to be lifted, or the end; a hold file is looked at again every millisecond. */
static void stream_wait(bool busy) {
        struct timespec ts;

        if (!busy || (!sim.hold_file[0] && !sim.hold_host_file[0] && !sim.hold_copy_file[0] &&
                      !sim.hold_memset_file[0])) {
                pthread_cond_wait(&sim.work, &sim.lock);
                return;
        }
        (void)clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 1000000;
        if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
        }
        (void)pthread_cond_timedwait(&sim.work, &sim.lock, &ts);
}

static void *stream_worker(void *arg) {
        CUstream s = arg;

        (void)pthread_setname_np(pthread_self(), "simcuda-stream");
        pthread_mutex_lock(&sim.lock);
        for (;;) {
                Op *op;

                /* Idle: wait for work or for the end. Busy: run, unless the streams are held. */
                while (list_is_empty(&s->ops) ? !s->quit : stream_held(s))
                        stream_wait(!list_is_empty(&s->ops));
                op = list_first_entry(&s->ops, Op, link);
                if (!op)
                        break;
                op_run(s->ctx, op);
                list_unlink(&op->link);
                op_done(op);
                pthread_cond_broadcast(&sim.idle);
        }
        pthread_mutex_unlock(&sim.lock);
        return NULL;
}

/* Drains a stream (waiting while streams are held), joins its worker and frees it. Drops the lock meanwhile. */
static void stream_destroy(CUstream s) {
        s->quit = true;
        pthread_cond_broadcast(&sim.work);
        pthread_mutex_unlock(&sim.lock);
        (void)pthread_join(s->worker, NULL);
        pthread_mutex_lock(&sim.lock);
        list_unlink(&s->link);
        free(s);
}

static bool stream_is_special(CUstream hStream) {
        return !hStream || hStream == CU_STREAM_LEGACY || hStream == CU_STREAM_PER_THREAD;
}

/* A created stream of `ctx`, or NULL in *ret for the NULL (legacy) and per-thread streams. */
static CUresult stream_find(CUcontext ctx, CUstream hStream, CUstream *ret) {
        CUstream s;

        *ret = NULL;
        if (stream_is_special(hStream))
                return CUDA_SUCCESS;
        list_for_each_entry(s, &ctx->streams, link)
                if (s == hStream && !s->quit) {
                        *ret = s;
                        return CUDA_SUCCESS;
                }
        return CUDA_ERROR_INVALID_HANDLE;
}

/* Whether the streams of `ctx` have work pending: all of them, or those the NULL stream waits for. */
static bool streams_busy(CUcontext ctx, bool blocking_only) {
        CUstream s;

        list_for_each_entry(s, &ctx->streams, link)
                if (!list_is_empty(&s->ops) && !(blocking_only && (s->flags & CU_STREAM_NON_BLOCKING)))
                        return true;
        return false;
}

/*
 * The context of `hStream`, in which work is queued on it, waited for or asked about: for the NULL, legacy and
 * per-thread streams, the current one; for a created stream, the one it belongs to, whatever context is current
 * or none, as the driver finds it. Measured on H200s (driver 580.159.04): from a thread with no current context,
 * or with another context current (another device's, or a second one of the same device), cuStreamSynchronize,
 * cuStreamQuery, cuMemsetD32Async, cuMemcpyDtoDAsync, cuLaunchHostFunc, cuEventRecord (of the stream's own
 * context's event), cuStreamWaitEvent and cuStreamDestroy of a created stream succeed; the NULL stream's with
 * none is CUDA_ERROR_INVALID_CONTEXT.
 */
static CUresult stream_context(CUstream hStream, CUcontext *ret) {
        if (stream_is_special(hStream))
                return ctx_usable(ret);
        for (int i = 0; i < sim.n_devices; i++) {
                CUcontext ctx = &sim.ctx[i];
                CUstream s;

                if (ctx->refs > 0 && stream_find(ctx, hStream, &s) == CUDA_SUCCESS) {
                        *ret = ctx;
                        return ctx->sticky;
                }
        }
        /* not a stream of an active context: what the current one says of it, or that there is none */
        return ctx_usable(ret);
}

/* simcuda_hold_streams(SIMCUDA_HOLD_NO_WAIT): `call` was about to wait for held work, which its test forbids. */
static void no_wait_check(const char *call, bool would_wait) {
        if (would_wait && sim.no_wait && sim.held) {
                fprintf(stderr, "simcuda: %s would wait for work held by simcuda_hold_streams(SIMCUDA_HOLD_NO_WAIT): "
                        "the code under test waited where it must not\n", call);
                abort();
        }
}

/* Waits until the streams of `ctx` are idle (only the blocking ones: what the NULL stream waits for); `call`, the
 * entry point waiting, is named when SIMCUDA_HOLD_NO_WAIT forbids the wait. */
static void streams_wait(CUcontext ctx, bool blocking_only, const char *call) {
        no_wait_check(call, streams_busy(ctx, blocking_only));
        while (streams_busy(ctx, blocking_only))
                pthread_cond_wait(&sim.idle, &sim.lock);
}

/*
 * Issues `op` on a stream of `ctx`. Device memory is checked now, as the real
 * driver does: memory that the context's device may not access (not mapped,
 * no cuMemSetAccess, read-only for a write) is CUDA_ERROR_INVALID_VALUE, and
 * does not poison the context. On a created stream the operation is queued; on
 * the NULL stream it runs on the calling thread once the blocking streams are
 * idle (the legacy stream's implicit synchronisation); on the per-thread
 * stream it runs at once.
 */
static CUresult submit(CUcontext ctx, CUstream hStream, const Op *op) {
        CUstream s;
        Op *queued;
        CUresult r;

        r = stream_find(ctx, hStream, &s);
        if (r != CUDA_SUCCESS)
                return r;
        if (!op_accessible(ctx, op))
                return CUDA_ERROR_INVALID_VALUE;
        if (!s) {
                if (hStream != CU_STREAM_PER_THREAD)
                        streams_wait(ctx, true, "an operation on the NULL stream");
                op_run(ctx, op);
                return ctx->sticky;
        }
        queued = malloc(sizeof(*queued));
        if (!queued)
                return CUDA_ERROR_OUT_OF_MEMORY;
        *queued = *op;
        if (op->kind == OP_EVENT || op->kind == OP_WAIT_EVENT)
                op->event->queued++;
        list_link_tail(&s->ops, &queued->link);
        pthread_cond_broadcast(&sim.work);
        return CUDA_SUCCESS;
}

/* The first stream of `ctx` that is not being destroyed already, or NULL. */
static CUstream stream_first_live(CUcontext ctx) {
        CUstream s;

        list_for_each_entry(s, &ctx->streams, link)
                if (!s->quit)
                        return s;
        return NULL;
}

/*
 * The last release of a primary context: its streams are drained and
 * destroyed, its cuMemAlloc memory freed. A fault stays: on a real GPU the
 * process has to start again.
 */
static void ctx_reset(CUcontext ctx) {
        Reservation *res, *tmp;
        CUstream s;

        CUevent e, etmp;

        while ((s = stream_first_live(ctx)))
                stream_destroy(s);
        list_for_each_entry_safe(res, tmp, &sim.reservations, link)
                if (res->alloc_ctx == ctx)
                        alloc_free(res);
        /* the streams are drained: no record of these events is queued any more */
        list_for_each_entry_safe(e, etmp, &ctx->events, link) {
                list_unlink(&e->link);
                free(e);
        }
}

/* ---- Entry points: errors, initialisation, devices --------------------------------------------------- */

static CUresult sim_cuGetErrorName(CUresult error, const char **pStr) {
        ENTER_BEFORE_INIT(cuGetErrorName);
        const ErrorInfo *e = error_by_code(error);

        if (!pStr)
                return CUDA_ERROR_INVALID_VALUE;
        *pStr = e ? e->name : NULL;
        return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult sim_cuGetErrorString(CUresult error, const char **pStr) {
        ENTER_BEFORE_INIT(cuGetErrorString);
        const ErrorInfo *e = error_by_code(error);

        if (!pStr)
                return CUDA_ERROR_INVALID_VALUE;
        *pStr = e ? e->text : NULL;
        return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult sim_cuInit(unsigned int Flags) {
        ENTER_BEFORE_INIT(cuInit);

        if (sim.env_error) {
                fprintf(stderr, "%s\n", sim.env_error);
                return CUDA_ERROR_INVALID_VALUE;
        }
        if (Flags != 0)
                return CUDA_ERROR_INVALID_VALUE;
        if (sim.n_devices == 0)
                return CUDA_ERROR_NO_DEVICE;
        sim.initialized = true;
        return CUDA_SUCCESS;
}

static CUresult sim_cuDriverGetVersion(int *driverVersion) {
        ENTER_BEFORE_INIT(cuDriverGetVersion);

        if (!driverVersion)
                return CUDA_ERROR_INVALID_VALUE;
        *driverVersion = sim.driver_version;
        return CUDA_SUCCESS;
}

static CUresult sim_cuDeviceGetCount(int *count) {
        ENTER(cuDeviceGetCount);

        if (!count)
                return CUDA_ERROR_INVALID_VALUE;
        *count = sim.n_devices;
        return CUDA_SUCCESS;
}

static CUresult sim_cuDeviceGet(CUdevice *device, int ordinal) {
        ENTER(cuDeviceGet);

        if (!device)
                return CUDA_ERROR_INVALID_VALUE;
        if (!device_valid(ordinal))
                return CUDA_ERROR_INVALID_DEVICE;
        *device = ordinal;
        return CUDA_SUCCESS;
}

static CUresult sim_cuDeviceGetName(char *name, int len, CUdevice dev) {
        ENTER(cuDeviceGetName);

        if (!name || len <= 0)
                return CUDA_ERROR_INVALID_VALUE;
        if (!device_valid(dev))
                return CUDA_ERROR_INVALID_DEVICE;
        snprintf(name, (size_t)len, "Simulated CUDA device %d", dev);
        return CUDA_SUCCESS;
}

static CUresult sim_cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
        ENTER(cuDeviceGetAttribute);

        if (!pi || (int)attrib <= 0 || (int)attrib >= (int)CU_DEVICE_ATTRIBUTE_MAX)
                return CUDA_ERROR_INVALID_VALUE;
        if (!device_valid(dev))
                return CUDA_ERROR_INVALID_DEVICE;
        if (attrib == CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID) {
                /* not a case label: before CUDA 12.2's cuda.h it is driver.h's value, outside the enum */
                *pi = sim.numa[dev];
                return CUDA_SUCCESS;
        }
        if (attrib == CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) {      /* likewise */
                *pi = sim.vmm;
                return CUDA_SUCCESS;
        }
        switch (attrib) {
        case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
                *pi = sim.vmm;
                break;
        case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
                *pi = sim.posix_fd;
                break;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
                *pi = 9;
                break;
        default:        /* minor 0, no multicast, no fabric handles, and nothing else either */
                *pi = 0;
                break;
        }
        return CUDA_SUCCESS;
}

/* SIMCUDA_PEERS's answer; a device is not its own peer (0, as the real driver says for one GPU). */
static CUresult sim_cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
        ENTER(cuDeviceCanAccessPeer);

        if (!canAccessPeer)
                return CUDA_ERROR_INVALID_VALUE;
        if (!device_valid(dev) || !device_valid(peerDev))
                return CUDA_ERROR_INVALID_DEVICE;
        *canAccessPeer = (sim.peers[dev] >> peerDev) & 1;
        return CUDA_SUCCESS;
}

static CUresult sim_cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
        ENTER(cuDeviceTotalMem);

        if (!bytes)
                return CUDA_ERROR_INVALID_VALUE;
        if (!device_valid(dev))
                return CUDA_ERROR_INVALID_DEVICE;
        *bytes = sim.budget;
        return CUDA_SUCCESS;
}

/* ---- Entry points: contexts -------------------------------------------------------------------------- */

/* Active while retained (the driver's primary context lives from the first retain to the last release); no flags. */
static CUresult sim_cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
        ENTER(cuDevicePrimaryCtxGetState);

        if (!flags || !active)
                return CUDA_ERROR_INVALID_VALUE;
        if (!device_valid(dev))
                return CUDA_ERROR_INVALID_DEVICE;
        *flags = 0;
        *active = sim.ctx[dev].refs > 0;
        return CUDA_SUCCESS;
}

static CUresult sim_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
        ENTER(cuDevicePrimaryCtxRetain);

        if (!pctx)
                return CUDA_ERROR_INVALID_VALUE;
        if (!device_valid(dev))
                return CUDA_ERROR_INVALID_DEVICE;
        if (sim.ctx[dev].sticky != CUDA_SUCCESS)
                return sim.ctx[dev].sticky;
        sim.ctx[dev].refs++;
        *pctx = &sim.ctx[dev];
        return CUDA_SUCCESS;
}

static CUresult sim_cuDevicePrimaryCtxRelease(CUdevice dev) {
        ENTER(cuDevicePrimaryCtxRelease);
        CUcontext ctx;

        if (!device_valid(dev))
                return CUDA_ERROR_INVALID_DEVICE;
        ctx = &sim.ctx[dev];
        if (ctx->refs == 0)
                return CUDA_ERROR_INVALID_CONTEXT;
        if (--ctx->refs == 0)
                ctx_reset(ctx);
        return CUDA_SUCCESS;
}

static CUresult sim_cuCtxSetCurrent(CUcontext ctx) {
        ENTER(cuCtxSetCurrent);

        if (ctx) {
                int i;

                for (i = 0; i < sim.n_devices && ctx != &sim.ctx[i]; i++)
                        ;
                if (i == sim.n_devices)
                        return CUDA_ERROR_INVALID_CONTEXT;
        }
        current = ctx;
        return CUDA_SUCCESS;
}

static CUresult sim_cuCtxGetCurrent(CUcontext *pctx) {
        ENTER(cuCtxGetCurrent);

        if (!pctx)
                return CUDA_ERROR_INVALID_VALUE;
        *pctx = current;
        return CUDA_SUCCESS;
}

static CUresult sim_cuCtxSynchronize(void) {
        ENTER(cuCtxSynchronize);
        CUcontext ctx;
        CUresult r;

        r = ctx_usable(&ctx);
        if (r != CUDA_SUCCESS)
                return r;
        streams_wait(ctx, false, "cuCtxSynchronize");
        return ctx->sticky;
}

/* ---- Entry points: virtual memory management --------------------------------------------------------- */

static CUresult sim_cuMemGetInfo(size_t *free_bytes, size_t *total) {
        ENTER(cuMemGetInfo);
        CUcontext ctx;
        CUresult r;

        r = ctx_usable(&ctx);
        if (r != CUDA_SUCCESS)
                return r;
        if (!free_bytes || !total)
                return CUDA_ERROR_INVALID_VALUE;
        *free_bytes = sim.budget - sim.charged[ctx->device];
        *total = sim.budget;
        return CUDA_SUCCESS;
}

/* As lax as the real driver: any properties, any device or node; host-NUMA memory has its own granularity. */
static CUresult sim_cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                  CUmemAllocationGranularity_flags option) {
        ENTER(cuMemGetAllocationGranularity);

        if (!granularity || !prop ||
            (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
                return CUDA_ERROR_INVALID_VALUE;
        *granularity = location_granularity(prop->location);
        return CUDA_SUCCESS;
}

/*
 * SIMCUDA_HOLD_CREATE_FILE: while the file is there, a cuMemCreate of host memory waits before it does anything
 * (it is not counted yet), where pinning takes its time on a real driver (about 0.3 s per GiB), and makes the
 * file's name + ".reached" when it starts to wait, so that the test holding it knows the create is under way.
 * A file that holds a number N lets N more creates through first, one at a time (hold_file_passes_one()), so
 * that a test sees which create comes next (test-park's test_park_not_behind_anothers). It waits without the
 * simulator's lock, so other threads' calls go on meanwhile, as they do while a thread pins on the real driver;
 * nothing wakes it when the file goes, so it looks every millisecond. Device memory is never held. The names
 * are fixed by setup() before any call can get here.
 */
static void host_create_hold(const CUmemAllocationProp *prop) {
        const struct timespec ms = { .tv_nsec = 1000000 };
        bool reached = false;

        if (!sim.hold_create_file[0] || !prop || !location_is_host(prop->location))
                return;
        while (access(sim.hold_create_file, F_OK) == 0 && !hold_file_passes_one(sim.hold_create_file)) {
                if (!reached) {
                        int fd = open(sim.hold_create_reached, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);

                        if (fd >= 0)
                                close(fd);
                        reached = true;
                }
                (void)nanosleep(&ms, NULL);
        }
}

static CUresult mem_create(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                           unsigned long long flags) {
        ENTER(cuMemCreate);
        const unsigned known = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC;
        bool posix_fd, host;
        Allocation *a;
        Handle *h;
        CUresult r;

        if (!handle || !prop || flags != 0 || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
            (prop->requestedHandleTypes & ~known))
                return CUDA_ERROR_INVALID_VALUE;
        host = location_is_host(prop->location);
        if (host ? !numa_node_valid(prop->location.id) : prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
                return CUDA_ERROR_INVALID_VALUE;
        if (!host && !device_valid(prop->location.id))
                return CUDA_ERROR_INVALID_DEVICE;
        posix_fd = prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        if (!sim.vmm || (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC) || (posix_fd && !sim.posix_fd))
                return CUDA_ERROR_NOT_SUPPORTED;
        if (size == 0 || size % location_granularity(prop->location) != 0)
                return CUDA_ERROR_INVALID_VALUE;

        h = calloc(1, sizeof(*h));
        if (!h)
                return CUDA_ERROR_OUT_OF_MEMORY;
        r = allocation_new(prop->location, size, &a);
        if (r != CUDA_SUCCESS) {
                free(h);
                return r;
        }
        h->id = HANDLE_TAG | ++sim.next_handle;
        h->allocation = a;              /* takes allocation_new()'s reference */
        h->exportable = posix_fd;
        list_link_tail(bucket(sim.handles, h->id), &h->link);
        *handle = h->id;
        return CUDA_SUCCESS;
}

static CUresult sim_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags) {
        setup();
        host_create_hold(prop);
        return mem_create(handle, size, prop, flags);
}

static CUresult sim_cuMemRelease(CUmemGenericAllocationHandle handle) {
        ENTER(cuMemRelease);
        Handle *h = handle_find(handle);

        if (!h)
                return CUDA_ERROR_INVALID_VALUE;
        list_unlink(&h->link);
        allocation_put(h->allocation);
        free(h);
        return CUDA_SUCCESS;
}

/* Only a handle created with the POSIX fd type: as on the real driver, not one that was imported. */
static CUresult sim_cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags) {
        ENTER(cuMemExportToShareableHandle);
        Handle *h;
        int fd;

        if (!shareableHandle || flags != 0)
                return CUDA_ERROR_INVALID_VALUE;
        h = handle_find(handle);
        if (!h || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !h->exportable)
                return CUDA_ERROR_INVALID_VALUE;
        fd = fcntl(h->allocation->fd, F_DUPFD_CLOEXEC, 3);
        if (fd < 0)
                return CUDA_ERROR_OPERATING_SYSTEM;
        *(int *)shareableHandle = fd;
        return CUDA_SUCCESS;
}

/*
 * Only a simcuda memfd (of a device that exists here, of a whole number of
 * granules); anything else is CUDA_ERROR_UNKNOWN, which is what the real
 * driver answers for an fd that is not one of its own.
 */
static CUresult sim_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                   CUmemAllocationHandleType shHandleType) {
        ENTER(cuMemImportFromShareableHandle);
        _cleanup_free_ Handle *h = NULL;
        Allocation *a, *found = NULL;
        CUmemLocation loc;
        struct stat st;
        int fd;

        if (!handle)
                return CUDA_ERROR_INVALID_VALUE;
        if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !sim.posix_fd)
                return CUDA_ERROR_NOT_SUPPORTED;
        if ((uintptr_t)osHandle > INT_MAX)
                return CUDA_ERROR_UNKNOWN;
        fd = (int)(uintptr_t)osHandle;
        if (!memfd_location(fd, &loc) || fstat(fd, &st) < 0 || st.st_size <= 0 ||
            (uint64_t)st.st_size % location_granularity(loc) != 0)
                return CUDA_ERROR_UNKNOWN;

        h = calloc(1, sizeof(*h));
        if (!h)
                return CUDA_ERROR_OUT_OF_MEMORY;

        /* Memory that lives in this process already (our own export) is the same allocation. */
        list_for_each_entry(a, bucket(sim.allocations, st.st_ino), link)
                if (a->st_dev == st.st_dev && a->st_ino == st.st_ino) {
                        found = a;
                        break;
                }
        if (found) {
                a = found;
                a->refs++;
        } else {
                a = calloc(1, sizeof(*a));
                if (!a)
                        return CUDA_ERROR_OUT_OF_MEMORY;
                *a = (Allocation){
                        .fd = fcntl(fd, F_DUPFD_CLOEXEC, 3),    /* our own: the caller may close theirs */
                        .location = loc,
                        .size = (uint64_t)st.st_size,
                        .st_dev = st.st_dev,
                        .st_ino = st.st_ino,
                        .charged = false,                       /* created elsewhere: see README */
                        .refs = 1,
                };
                if (a->fd < 0) {
                        free(a);
                        return CUDA_ERROR_OPERATING_SYSTEM;
                }
                list_link_tail(bucket(sim.allocations, a->st_ino), &a->link);
                sim.n_allocations++;
        }
        h->id = HANDLE_TAG | ++sim.next_handle;
        h->allocation = a;
        list_link_tail(bucket(sim.handles, h->id), &h->link);
        *handle = TAKE_PTR(h)->id;
        return CUDA_SUCCESS;
}

/* Any power-of-two alignment; never less than the granularity. */
static CUresult sim_cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                        unsigned long long flags) {
        ENTER(cuMemAddressReserve);
        Reservation *res;
        CUresult r;

        if (!ptr || flags != 0 || size == 0 || size % GRANULARITY != 0 || (alignment != 0 && !IS_POWER_OF_2(alignment)))
                return CUDA_ERROR_INVALID_VALUE;
        r = reservation_new(size, alignment > GRANULARITY ? alignment : GRANULARITY, addr, &res);
        if (r != CUDA_SUCCESS)
                return r;
        *ptr = res->start;
        return CUDA_SUCCESS;
}

static CUresult sim_cuMemAddressFree(CUdeviceptr ptr, size_t size) {
        ENTER(cuMemAddressFree);
        Reservation *res = reservation_find(ptr);

        if (!res || res->start != ptr || res->size != size || res->alloc_ctx || !list_is_empty(&res->mappings))
                return CUDA_ERROR_INVALID_VALUE;
        reservation_free(res);
        return CUDA_SUCCESS;
}

/* A whole allocation from offset 0 (anything else is CUDA_ERROR_NOT_SUPPORTED, as on the real driver). */
static CUresult sim_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags) {
        ENTER(cuMemMap);
        Reservation *res;
        Handle *h;
        Mapping *m;

        if (flags != 0)
                return CUDA_ERROR_INVALID_VALUE;
        h = handle_find(handle);
        if (!h)
                return CUDA_ERROR_INVALID_VALUE;
        if (offset != 0 || size != h->allocation->size)
                return CUDA_ERROR_NOT_SUPPORTED;
        res = reservation_find(ptr);
        if (ptr % GRANULARITY != 0 || !res || res->alloc_ctx || size > res->size - (ptr - res->start))
                return CUDA_ERROR_INVALID_VALUE;
        list_for_each_entry(m, &res->mappings, link)
                if (m->start < ptr + size && ptr < m->start + m->size)
                        return CUDA_ERROR_INVALID_VALUE;
        return mapping_new(res, ptr, h->allocation, &m);
}

/*
 * Unmaps every mapping in the range, which starts in a reservation and cuts no
 * mapping in two. Unmapped parts are allowed (the real driver allows them).
 */
static CUresult sim_cuMemUnmap(CUdeviceptr ptr, size_t size) {
        ENTER(cuMemUnmap);
        Reservation *res, *start;
        Mapping *m, *tmp;
        uint64_t end;

        if (size == 0 || ptr % GRANULARITY != 0 || size % GRANULARITY != 0 || __builtin_add_overflow(ptr, size, &end))
                return CUDA_ERROR_INVALID_VALUE;
        start = reservation_find(ptr);
        if (!start || range_splits_mapping(ptr, end))
                return CUDA_ERROR_INVALID_VALUE;
        list_for_each_entry(res, &sim.reservations, link)
                if (res->alloc_ctx && res->start < end && ptr < res->start + res->size)
                        return CUDA_ERROR_INVALID_VALUE;        /* cuMemAlloc's memory: cuMemFree only */
        list_for_each_entry(res, &sim.reservations, link)
                list_for_each_entry_safe(m, tmp, &res->mappings, link)
                        if (mapping_within(m, ptr, end))
                                mapping_free(m);
        return CUDA_SUCCESS;
}

/*
 * Sets access to every mapping in the range, which starts at the start of a
 * mapping and ends at the end of one; unmapped parts between mappings are
 * allowed (the real driver allows them).
 */
static CUresult sim_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
        ENTER(cuMemSetAccess);
        Mapping *first, *last, *m;
        Reservation *res;
        uint64_t end;

        if (!desc || count == 0 || size == 0 || ptr % GRANULARITY != 0 || size % GRANULARITY != 0 ||
            __builtin_add_overflow(ptr, size, &end))
                return CUDA_ERROR_INVALID_VALUE;
        for (size_t i = 0; i < count; i++) {
                if (desc[i].location.type == CU_MEM_LOCATION_TYPE_HOST)
                        return CUDA_ERROR_NOT_SUPPORTED;
                if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
                    (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
                     desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
                        return CUDA_ERROR_INVALID_VALUE;
                /* not the CUDA_ERROR_INVALID_DEVICE the documentation lists: the H100's driver 580 says
                 * CUDA_ERROR_INVALID_VALUE for the index equal to the device count (conformance records it) */
                if (!device_valid(desc[i].location.id))
                        return CUDA_ERROR_INVALID_VALUE;
        }
        first = mapping_find(ptr);
        last = mapping_find(end - 1);
        if (!first || !last || range_splits_mapping(ptr, end))
                return CUDA_ERROR_INVALID_VALUE;
        list_for_each_entry(res, &sim.reservations, link)
                if (res->alloc_ctx && res->start < end && ptr < res->start + res->size)
                        return CUDA_ERROR_INVALID_VALUE;        /* cuMemAlloc's memory */
        /*
         * Access for a device to another's memory needs peer capability (cuDeviceCanAccessPeer); checked for every
         * mapping before any changes, so a refused call changes nothing. Revoking (PROT_NONE) is always allowed.
         * Unverified on a machine with GPUs that cannot reach each other: the documentation lists
         * CUDA_ERROR_INVALID_DEVICE among cuMemSetAccess's codes and says no more (tests/simcuda/README.md).
         */
        list_for_each_entry(res, &sim.reservations, link)
                list_for_each_entry(m, &res->mappings, link) {
                        int owner = m->allocation->location.id;

                        /* host memory: every device may access it */
                        if (!mapping_within(m, ptr, end) || location_is_host(m->allocation->location))
                                continue;
                        for (size_t i = 0; i < count; i++)
                                if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].location.id != owner &&
                                    !((sim.peers[desc[i].location.id] >> owner) & 1))
                                        return CUDA_ERROR_INVALID_DEVICE;
                }
        list_for_each_entry(res, &sim.reservations, link)
                list_for_each_entry(m, &res->mappings, link) {
                        if (!mapping_within(m, ptr, end))
                                continue;
                        for (size_t i = 0; i < count; i++)
                                if (mapping_set_access(m, desc[i].location.id, desc[i].flags) < 0)
                                        return CUDA_ERROR_OPERATING_SYSTEM;
                }
        return CUDA_SUCCESS;
}

/* ---- Entry points: cuMemAlloc, copies, memsets ------------------------------------------------------- */

static CUresult sim_cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
        ENTER(cuMemAlloc);
        CUcontext ctx;
        CUresult r;

        r = ctx_usable(&ctx);
        if (r != CUDA_SUCCESS)
                return r;
        if (!dptr || bytesize == 0)
                return CUDA_ERROR_INVALID_VALUE;
        if (bytesize > UINT64_MAX - GRANULARITY)
                return CUDA_ERROR_OUT_OF_MEMORY;
        return alloc_new(ctx, ALIGN_UP((uint64_t)bytesize, GRANULARITY), dptr);
}

static CUresult sim_cuMemFree(CUdeviceptr dptr) {
        ENTER(cuMemFree);
        Reservation *res;
        CUcontext ctx;
        CUresult r;

        r = ctx_current(&ctx);
        if (r != CUDA_SUCCESS || dptr == 0)
                return r;
        res = reservation_find(dptr);
        if (!res || !res->alloc_ctx || res->start != dptr)
                return CUDA_ERROR_INVALID_VALUE;
        alloc_free(res);
        return ctx->sticky;
}

static CUresult sim_cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
        ENTER(cuMemcpyHtoD);
        CUcontext ctx;
        CUresult r;

        r = ctx_usable(&ctx);
        if (r != CUDA_SUCCESS)
                return r;
        if (!srcHost && ByteCount > 0)
                return CUDA_ERROR_INVALID_VALUE;
        return submit(ctx, NULL,
                      &(Op){ .kind = OP_COPY_TO_DEVICE, .device = dstDevice, .bytes = ByteCount, .src = srcHost });
}

static CUresult sim_cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
        ENTER(cuMemcpyDtoH);
        CUcontext ctx;
        CUresult r;

        r = ctx_usable(&ctx);
        if (r != CUDA_SUCCESS)
                return r;
        if (!dstHost && ByteCount > 0)
                return CUDA_ERROR_INVALID_VALUE;
        return submit(ctx, NULL,
                      &(Op){ .kind = OP_COPY_FROM_DEVICE, .device = srcDevice, .bytes = ByteCount, .dst = dstHost });
}

/*
 * Queued in stream order like the async memsets; the ranges may span mappings (device pointers are host
 * addresses here). Both are checked when issued and again when the copy runs (op_run()).
 */
static CUresult sim_cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                      CUstream hStream) {
        ENTER(cuMemcpyDtoDAsync);
        CUcontext ctx;
        CUresult r;

        r = stream_context(hStream, &ctx);
        if (r != CUDA_SUCCESS)
                return r;
        return submit(ctx, hStream,
                      &(Op){ .kind = OP_COPY_DEVICE, .device = dstDevice, .from = srcDevice, .bytes = ByteCount });
}

/* The memsets: N elements of `width` bytes, 4-byte elements aligned. */
static CUresult memset_submit(CUdeviceptr dst, uint32_t value, unsigned width, size_t n, CUstream hStream) {
        CUcontext ctx;
        size_t bytes;
        CUresult r;

        r = stream_context(hStream, &ctx);
        if (r != CUDA_SUCCESS)
                return r;
        if (__builtin_mul_overflow(n, width, &bytes) || dst % width != 0)
                return CUDA_ERROR_INVALID_VALUE;
        return submit(ctx, hStream,
                      &(Op){ .kind = OP_MEMSET, .device = dst, .bytes = bytes, .value = value, .width = width });
}

static CUresult sim_cuMemsetD8(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
        ENTER(cuMemsetD8);
        return memset_submit(dstDevice, uc, 1, N, NULL);
}

static CUresult sim_cuMemsetD32(CUdeviceptr dstDevice, unsigned int ui, size_t N) {
        ENTER(cuMemsetD32);
        return memset_submit(dstDevice, ui, 4, N, NULL);
}

static CUresult sim_cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
        ENTER(cuMemsetD8Async);
        return memset_submit(dstDevice, uc, 1, N, hStream);
}

static CUresult sim_cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream) {
        ENTER(cuMemsetD32Async);
        return memset_submit(dstDevice, ui, 4, N, hStream);
}

/* ---- Entry points: streams --------------------------------------------------------------------------- */

static CUresult sim_cuStreamCreate(CUstream *phStream, unsigned int Flags) {
        ENTER(cuStreamCreate);
        sigset_t all, saved;
        CUcontext ctx;
        CUstream s;
        CUresult r;
        int k;

        r = ctx_usable(&ctx);
        if (r != CUDA_SUCCESS)
                return r;
        if (!phStream || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
                return CUDA_ERROR_INVALID_VALUE;
        s = calloc(1, sizeof(*s));
        if (!s)
                return CUDA_ERROR_OUT_OF_MEMORY;
        s->ctx = ctx;
        s->flags = Flags;
        list_init(&s->ops);

        /* The worker takes no signals: a program that blocks them to read a signalfd must not lose them. */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &saved);
        k = pthread_create(&s->worker, NULL, stream_worker, s);
        pthread_sigmask(SIG_SETMASK, &saved, NULL);
        if (k != 0) {
                free(s);
                return CUDA_ERROR_OUT_OF_MEMORY;
        }
        list_link_tail(&ctx->streams, &s->link);
        *phStream = s;
        return CUDA_SUCCESS;
}

static CUresult sim_cuStreamDestroy(CUstream hStream) {
        ENTER(cuStreamDestroy);
        CUcontext ctx = NULL;
        CUstream s;
        CUresult r;

        /* the stream's context, whatever is current (a poisoned one too: its streams can still be destroyed) */
        r = stream_context(hStream, &ctx);
        if (!ctx)
                return r;
        r = stream_find(ctx, hStream, &s);
        if (r != CUDA_SUCCESS)
                return r;
        if (!s)
                return CUDA_ERROR_INVALID_HANDLE;
        stream_destroy(s);
        return ctx->sticky;
}

static CUresult sim_cuStreamSynchronize(CUstream hStream) {
        ENTER(cuStreamSynchronize);
        CUcontext ctx;
        CUstream s;
        CUresult r;

        r = stream_context(hStream, &ctx);
        if (r != CUDA_SUCCESS)
                return r;
        r = stream_find(ctx, hStream, &s);
        if (r != CUDA_SUCCESS)
                return r;
        if (s) {
                no_wait_check("cuStreamSynchronize", !list_is_empty(&s->ops));
                while (!list_is_empty(&s->ops))
                        pthread_cond_wait(&sim.idle, &sim.lock);
        }
        else if (hStream != CU_STREAM_PER_THREAD)
                streams_wait(ctx, true, "cuStreamSynchronize of the NULL stream");
        return ctx->sticky;
}

static CUresult sim_cuStreamQuery(CUstream hStream) {
        ENTER(cuStreamQuery);
        CUcontext ctx;
        CUstream s;
        CUresult r;
        bool busy;

        r = stream_context(hStream, &ctx);
        if (r != CUDA_SUCCESS)
                return r;
        r = stream_find(ctx, hStream, &s);
        if (r != CUDA_SUCCESS)
                return r;
        if (s)
                busy = !list_is_empty(&s->ops);
        else
                busy = hStream != CU_STREAM_PER_THREAD && streams_busy(ctx, true);
        return busy ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

static CUresult sim_cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
        ENTER(cuLaunchHostFunc);
        CUcontext ctx;
        CUresult r;

        r = stream_context(hStream, &ctx);
        if (r != CUDA_SUCCESS)
                return r;
        if (!fn)
                return CUDA_ERROR_INVALID_VALUE;
        return submit(ctx, hStream, &(Op){ .kind = OP_HOST_FUNC, .fn = fn, .data = userData });
}

/* ---- Entry points: events ---------------------------------------------------------------------------- */

static CUevent event_find(CUevent hEvent);

/*
 * Work queued on the stream after this waits until the event's last record (made before this call) has run; a
 * record made later does not count. An event never recorded is no wait. On the NULL and per-thread streams the
 * caller waits. The event may be another context's, as on the real driver. CU_EVENT_WAIT_EXTERNAL (for graphs)
 * is accepted and changes nothing.
 */
static CUresult sim_cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
        ENTER(cuStreamWaitEvent);
        CUcontext ctx;
        CUstream s;
        CUevent e;
        CUresult r;

        r = stream_context(hStream, &ctx);
        if (r != CUDA_SUCCESS)
                return r;
        e = event_find(hEvent);
        if (!e)
                return CUDA_ERROR_INVALID_HANDLE;
        if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL)  /* the driver's flags: it makes no difference here */
                return CUDA_ERROR_INVALID_VALUE;
        r = stream_find(ctx, hStream, &s);
        if (r != CUDA_SUCCESS)
                return r;
        if (!s) {
                while (e->done < e->recorded && e->ctx->sticky == CUDA_SUCCESS)
                        pthread_cond_wait(&sim.idle, &sim.lock);
                return ctx->sticky;
        }
        return submit(ctx, hStream, &(Op){ .kind = OP_WAIT_EVENT, .event = e, .seq = e->recorded });
}

/* A live event of any context, or NULL. */
static CUevent event_find(CUevent hEvent) {
        CUevent e;

        if (!hEvent)
                return NULL;
        for (int i = 0; i < sim.n_devices; i++)
                list_for_each_entry(e, &sim.ctx[i].events, link)
                        if (e == hEvent)
                                return e;
        return NULL;
}

static CUresult sim_cuEventCreate(CUevent *phEvent, unsigned int Flags) {
        ENTER(cuEventCreate);
        const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING;
        CUcontext ctx;
        CUevent e;
        CUresult r;

        r = ctx_usable(&ctx);
        if (r != CUDA_SUCCESS)
                return r;
        if (!phEvent || (Flags & ~known))
                return CUDA_ERROR_INVALID_VALUE;
        e = calloc(1, sizeof(*e));
        if (!e)
                return CUDA_ERROR_OUT_OF_MEMORY;
        e->ctx = ctx;
        list_link_tail(&ctx->events, &e->link);
        *phEvent = e;
        return CUDA_SUCCESS;
}

/* The event must be of the stream's context (the current one's for the NULL and per-thread streams), whatever
 * context is current: measured on H200s, as for the other work queued on a created stream (stream_context()). */
static CUresult sim_cuEventRecord(CUevent hEvent, CUstream hStream) {
        ENTER(cuEventRecord);
        CUcontext ctx;
        CUevent e;
        CUresult r;

        r = stream_context(hStream, &ctx);
        if (r != CUDA_SUCCESS)
                return r;
        e = event_find(hEvent);
        if (!e || e->ctx != ctx)
                return CUDA_ERROR_INVALID_HANDLE;
        /* the lock is held: a queued record cannot run before it is counted */
        r = submit(ctx, hStream, &(Op){ .kind = OP_EVENT, .event = e, .seq = e->recorded + 1 });
        if (r == CUDA_SUCCESS)
                e->recorded++;
        return r;
}

/* Needs no current context: the event knows its own. */
static CUresult sim_cuEventQuery(CUevent hEvent) {
        ENTER(cuEventQuery);
        CUevent e = event_find(hEvent);

        if (!e)
                return CUDA_ERROR_INVALID_HANDLE;
        if (e->ctx->sticky != CUDA_SUCCESS)
                return e->ctx->sticky;
        return e->done >= e->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

static CUresult sim_cuEventSynchronize(CUevent hEvent) {
        ENTER(cuEventSynchronize);
        CUevent e = event_find(hEvent);

        if (!e)
                return CUDA_ERROR_INVALID_HANDLE;
        no_wait_check("cuEventSynchronize", e->done < e->recorded && e->ctx->sticky == CUDA_SUCCESS);
        while (e->done < e->recorded && e->ctx->sticky == CUDA_SUCCESS)
                pthread_cond_wait(&sim.idle, &sim.lock);
        return e->ctx->sticky;
}

/* A record still queued runs, and the event is freed after it. Works in a poisoned context. */
static CUresult sim_cuEventDestroy(CUevent hEvent) {
        ENTER(cuEventDestroy);
        CUevent e = event_find(hEvent);

        if (!e)
                return CUDA_ERROR_INVALID_HANDLE;
        list_unlink(&e->link);
        if (e->queued)
                e->destroyed = true;
        else
                free(e);
        return CUDA_SUCCESS;
}

/* ---- cuGetProcAddress: the only way in ---------------------------------------------------------------- */

/* Every implementation has exactly the signature of the entry point at the ABI version the project asks for. */
#define ENTRY_CHECK(name, abi)                                                                          \
        _Static_assert(__builtin_types_compatible_p(__typeof__(&sim_##name), PFN_##name##_v##abi),      \
                       "sim_" #name " does not match PFN_" #name "_v" #abi);
CUDA_DRIVER_ENTRY_POINTS(ENTRY_CHECK)
#undef ENTRY_CHECK

static const struct {
        int abi;                        /* the CUDA version that introduced this ABI of the entry point */
        void *fn;
} entries[N_ENTRIES] = {
#define ENTRY_ROW(name, abi) [ENTRY_##name] = { abi, (void *)sim_##name },
        CUDA_DRIVER_ENTRY_POINTS(ENTRY_ROW)
#undef ENTRY_ROW
};

/*
 * Looks an entry point up by its base name ("cuMemAlloc"). Only the ABI the
 * project uses is provided: a cudaVersion older than that finds nothing
 * (CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT). As on the real driver, a
 * name or version that finds nothing still returns CUDA_SUCCESS, with *pfn
 * NULL and the reason in *symbolStatus. The per-thread-stream flag gives the
 * same functions.
 */
_public_ CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                      CUdriverProcAddressQueryResult *symbolStatus) {
        CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        int e;

        setup();
        if (!symbol || !pfn ||
            (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                                   CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)) ||
            cudaVersion > sim.driver_version)
                return CUDA_ERROR_INVALID_VALUE;
        *pfn = NULL;
        e = entry_by_name(symbol);
        if (e >= 0) {
                if (cudaVersion < entries[e].abi)
                        status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
                else {
                        *pfn = entries[e].fn;
                        status = CU_GET_PROC_ADDRESS_SUCCESS;
                }
        }
        if (symbolStatus)
                *symbolStatus = status;
        return CUDA_SUCCESS;
}

/* The CUDA 11.3 spelling, without the status; cuda.h renames cuGetProcAddress to the _v2 one. */
#undef cuGetProcAddress
_public_ CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
_public_ CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
        return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}

/* ---- Test hooks (simcuda.h) -------------------------------------------------------------------------- */

_public_ void simcuda_hold_streams(int hold) {
        _cleanup_(sim_unlockp) _unused_ pthread_mutex_t *locked = sim_lock();

        sim.held = hold != 0;
        sim.no_wait = hold == SIMCUDA_HOLD_NO_WAIT;
        pthread_cond_broadcast(&sim.work);
}

_public_ void simcuda_hold_copies(int hold) {
        _cleanup_(sim_unlockp) _unused_ pthread_mutex_t *locked = sim_lock();

        sim.copies_held = hold != 0;
        pthread_cond_broadcast(&sim.work);
}

_public_ unsigned long simcuda_live_allocations(void) {
        _cleanup_(sim_unlockp) _unused_ pthread_mutex_t *locked = sim_lock();

        return sim.n_allocations;
}

_public_ uint64_t simcuda_charged(int device) {
        _cleanup_(sim_unlockp) _unused_ pthread_mutex_t *locked = sim_lock();

        return device_valid(device) ? sim.charged[device] : 0;
}

_public_ uint64_t simcuda_host_charged(void) {
        _cleanup_(sim_unlockp) _unused_ pthread_mutex_t *locked = sim_lock();

        return sim.host_charged;
}

_public_ int simcuda_fail(const char *spec) {
        _cleanup_(sim_unlockp) _unused_ pthread_mutex_t *locked = sim_lock();

        return faults_parse(spec, &sim.faults);
}

_public_ void simcuda_reset_faults(void) {
        _cleanup_(sim_unlockp) _unused_ pthread_mutex_t *locked = sim_lock();

        faults_clear(&sim.faults);
}

_public_ uint64_t simcuda_calls(const char *entry) {
        _cleanup_(sim_unlockp) _unused_ pthread_mutex_t *locked = sim_lock();
        int e = entry ? entry_by_name(entry) : -1;

        return e >= 0 ? sim.calls[e] : 0;
}
