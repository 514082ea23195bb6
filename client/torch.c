/* SPDX-License-Identifier: MIT */

/*
 * PyTorch's pluggable allocator (torch.cuda.memory.CUDAPluggableAllocator)
 * over broker leases: one lease per segment that PyTorch's caching allocator
 * asks for, through one client for the whole process.
 *
 * The free path. cuMemUnmap does not wait for work queued on the range: work
 * that runs after it faults (CUDA_ERROR_ILLEGAL_ADDRESS, sticky for the
 * context). PyTorch frees a segment while work queued on the segment's stream
 * may still use it (cudaFree, which its own allocator calls, synchronizes the
 * device; these entry points must be as safe). So vmmb_torch_free() records an
 * event on the stream and puts the segment on the pending list; a pending
 * segment is unmapped and given back only once cuEventQuery() says its event
 * has completed. The list is looked at (without waiting) by every alloc and
 * free in any thread; vmmb_torch_release_all(), vmmb_torch_sleep() and an
 * alloc that the broker refused for room wait for it. Nothing is done at
 * exit: the broker takes back every hold of a process that is gone, as a
 * free would, and a hook there
 * could only add waits (for a broker that is down, or a driver being torn
 * down) to the exit. PyTorch's stream is not stalled and
 * the freeing thread does not block, where cuStreamSynchronize() would block
 * it for all the work queued on the stream (cudaFree blocks for the device's).
 * The rule that makes it safe: a lease is unmapped only after the driver said
 * the work before it is done (an event completed, a stream or the context
 * synchronized). A driver error there (the context failed) leaves the segment
 * mapped and leased until the process exits, when the broker takes it back.
 *
 * A segment whose work is done is freed with vmmb_free_keep(): the broker
 * keeps the lease for this process, and the next segment of its size comes
 * back already mapped (PyTorch asks for the same sizes again and again). The
 * broker asks for kept leases back when another call waits for room, and
 * vmmb_torch_release_all() and vmmb_torch_sleep() give them back for good.
 *
 * Every call into the driver that needs a context is made in the primary
 * context of the segment's device (PyTorch's), made current for the call and
 * the caller's put back after. The primary contexts are retained on first
 * use and kept for the life of the process.
 *
 * Locking: `torch.lock` guards the segment map, the pending list, the spare
 * events and the device table; no call into the driver that can wait, and no
 * call to the broker, is made with it held. `torch.connect_lock` guards the
 * client while it is made.
 */

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "internal.h"
#include "macro.h"
#include "vmmbroker.h"

#define VMMB_EXPORT __attribute__((visibility("default")))

#define TORCH_LABEL "torch"
#define SPARE_EVENTS_MAX 64                     /* completed events kept per device for the next free */

/* A live segment: what vmmb_torch_alloc() returned and PyTorch has not freed. */
typedef struct Segment {
        uint64_t base, size;
        vmmb_lease *lease;
} Segment;

/* A freed segment waiting for the work queued before its free. */
typedef struct Pending {
        struct Pending *next;
        vmmb_lease *lease;
        int device;
        CUevent event;                  /* NULL: stuck, its context failed; never unmapped */
} Pending;

typedef struct TorchDevice {
        CUcontext ctx;                  /* the device's primary context, retained; NULL until first used */
        CUevent spare[SPARE_EVENTS_MAX];
        size_t n_spare;
} TorchDevice;

static struct {
        pthread_mutex_t connect_lock;   /* guards making the client */
        vmmb_client *client;            /* set once, never closed (read under connect_lock) */

        pthread_mutex_t lock;           /* guards everything below */
        Segment *segments;              /* sorted by base */
        size_t n_segments, n_allocated;
        Pending *pending;               /* waiting for their events */
        Pending *stuck;                 /* their contexts failed: left to the end of the process */
        TorchDevice *devices;           /* indexed by device */
        size_t n_devices;
} torch = {
        .connect_lock = PTHREAD_MUTEX_INITIALIZER,
        .lock = PTHREAD_MUTEX_INITIALIZER,
};

/* --- the client, the driver and the contexts --------------------------------------------------------- */

/* The process's client, connected on first use. NULL with the message set when it cannot connect. */
static vmmb_client *client_get(void) {
        vmmb_client *c;

        (void)pthread_mutex_lock(&torch.connect_lock);
        if (!torch.client)
                (void)vmmb_connect(NULL, &torch.client);        /* sets the message on failure */
        c = torch.client;
        (void)pthread_mutex_unlock(&torch.connect_lock);
        return c;
}

/* The device's entry, grown on first use. Lock held. NULL when out of memory. */
static TorchDevice *device_entry(int device) {
        if ((size_t)device >= torch.n_devices) {
                TorchDevice *d = realloc(torch.devices, ((size_t)device + 1) * sizeof(TorchDevice));

                if (!d)
                        return NULL;
                memset(d + torch.n_devices, 0, ((size_t)device + 1 - torch.n_devices) * sizeof(TorchDevice));
                torch.devices = d;
                torch.n_devices = (size_t)device + 1;
        }
        return &torch.devices[device];
}

/*
 * Makes the device's primary context current, retaining it the first time,
 * and returns the context that was current in *ret_prev. Returns a CUresult;
 * on failure nothing changed.
 */
static CUresult ctx_enter(CudaDriver *cu, int device, CUcontext *ret_prev) {
        CUcontext ctx = NULL, prev = NULL;
        TorchDevice *d;
        CUdevice dev;
        CUresult r;

        (void)pthread_mutex_lock(&torch.lock);
        d = device_entry(device);
        if (d)
                ctx = d->ctx;
        (void)pthread_mutex_unlock(&torch.lock);
        if (!d)
                return CUDA_ERROR_OUT_OF_MEMORY;
        if (!ctx) {
                r = cu->cuDeviceGet(&dev, device);
                if (r == CUDA_SUCCESS)
                        r = cu->cuDevicePrimaryCtxRetain(&ctx, dev);
                if (r != CUDA_SUCCESS)
                        return r;
                (void)pthread_mutex_lock(&torch.lock);
                if (torch.devices[device].ctx)
                        (void)cu->cuDevicePrimaryCtxRelease(dev);       /* another thread was first */
                else
                        torch.devices[device].ctx = ctx;
                ctx = torch.devices[device].ctx;
                (void)pthread_mutex_unlock(&torch.lock);
        }
        r = cu->cuCtxGetCurrent(&prev);
        if (r != CUDA_SUCCESS)
                return r;
        if (prev != ctx) {
                r = cu->cuCtxSetCurrent(ctx);
                if (r != CUDA_SUCCESS)
                        return r;
        }
        *ret_prev = prev;
        return CUDA_SUCCESS;
}

/* Puts back the context ctx_enter() found. */
static void ctx_leave(CudaDriver *cu, int device, CUcontext prev) {
        CUcontext ctx;

        (void)pthread_mutex_lock(&torch.lock);
        ctx = torch.devices[device].ctx;
        (void)pthread_mutex_unlock(&torch.lock);
        if (prev != ctx)
                (void)cu->cuCtxSetCurrent(prev);
}

/* An event for a free on `device`: a spare one, or a new one. Context of the device current. */
static CUresult event_get(CudaDriver *cu, int device, CUevent *ret) {
        CUevent e = NULL;

        (void)pthread_mutex_lock(&torch.lock);
        if (torch.devices[device].n_spare > 0)
                e = torch.devices[device].spare[--torch.devices[device].n_spare];
        (void)pthread_mutex_unlock(&torch.lock);
        if (e) {
                *ret = e;
                return CUDA_SUCCESS;
        }
        return cu->cuEventCreate(ret, CU_EVENT_DISABLE_TIMING);
}

/* Keeps a completed event for the next free, or destroys it. */
static void event_put(CudaDriver *cu, int device, CUevent e) {
        bool kept = false;

        (void)pthread_mutex_lock(&torch.lock);
        if (torch.devices[device].n_spare < SPARE_EVENTS_MAX) {
                torch.devices[device].spare[torch.devices[device].n_spare++] = e;
                kept = true;
        }
        (void)pthread_mutex_unlock(&torch.lock);
        if (!kept)
                (void)cu->cuEventDestroy(e);
}

/* --- the segment map ------------------------------------------------------------------------------------ */

/* The index of the first segment whose base is above `addr`. Lock held. */
static size_t segment_upper(uint64_t addr) {
        size_t lo = 0, hi = torch.n_segments;

        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;

                if (torch.segments[mid].base <= addr)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        return lo;
}

/* The segment that holds `addr`, or NULL. Lock held. */
static Segment *segment_holding(uint64_t addr) {
        size_t i = segment_upper(addr);

        if (i == 0)
                return NULL;
        if (addr - torch.segments[i - 1].base < torch.segments[i - 1].size)
                return &torch.segments[i - 1];
        return NULL;
}

/* Adds a lease's segment. Lock held. -ENOMEM when the map cannot grow. */
static int segment_add(vmmb_lease *lease) {
        uint64_t base = vmmb_lease_ptr(lease);
        size_t i;

        if (torch.n_segments == torch.n_allocated) {
                size_t n = MAX(torch.n_allocated * 2, (size_t)64);
                Segment *s = realloc(torch.segments, n * sizeof(Segment));

                if (!s)
                        return -ENOMEM;
                torch.segments = s;
                torch.n_allocated = n;
        }
        i = segment_upper(base);
        memmove(&torch.segments[i + 1], &torch.segments[i], (torch.n_segments - i) * sizeof(Segment));
        torch.segments[i] = (Segment){ .base = base, .size = vmmb_lease_size(lease), .lease = lease };
        torch.n_segments++;
        return 0;
}

/* Removes the segment that starts at `base` and returns its lease, or NULL. Lock held. */
static vmmb_lease *segment_remove(uint64_t base) {
        size_t i = segment_upper(base);
        vmmb_lease *lease;

        if (i == 0 || torch.segments[i - 1].base != base)
                return NULL;
        i--;
        lease = torch.segments[i].lease;
        memmove(&torch.segments[i], &torch.segments[i + 1], (torch.n_segments - i - 1) * sizeof(Segment));
        torch.n_segments--;
        return lease;
}

/* --- pending frees -------------------------------------------------------------------------------------- */

static void pending_push(Pending **list, Pending *p) {
        p->next = *list;
        *list = p;
}

/* How pending_reap() frees the leases whose work is done. */
typedef enum ReapHow {
        REAP_KEEP,                      /* vmmb_free_keep(): for the next segment of the size */
        REAP_ONEWAY,                    /* vmmb_free_oneway(): for room, the next Alloc of this client follows */
        REAP_FREE,                      /* vmmb_free(): for good, the broker's answer waited for */
} ReapHow;

/*
 * Looks at the pending frees taken from the list: those whose work is done
 * (their event completed: queried, or waited for when `wait`) are freed as
 * `how` says; those not done yet go back on the list; those whose context
 * failed are stuck for good. Kept and one-way Frees are not answered (but a
 * connection's first keep, which asks whether the broker keeps): the broker
 * reads them before this client's next call, the Alloc that follows.
 * Returns 0, or the first error (message set).
 */
static int pending_reap(bool wait, ReapHow how) {
        Pending *todo, *p, *next;
        CudaDriver *cu = NULL;
        int ret = 0, k;

        (void)pthread_mutex_lock(&torch.lock);
        todo = TAKE_PTR(torch.pending);
        (void)pthread_mutex_unlock(&torch.lock);
        if (!todo)
                return 0;
        k = client_driver(&cu);                 /* loaded: the leases were mapped with it */
        if (k < 0)
                return k;

        for (p = todo; p; p = next) {
                CUcontext prev = NULL;
                CUresult r;

                next = p->next;
                r = ctx_enter(cu, p->device, &prev);
                if (r == CUDA_SUCCESS) {
                        r = wait ? cu->cuEventSynchronize(p->event) : cu->cuEventQuery(p->event);
                        ctx_leave(cu, p->device, prev);
                }
                if (r == CUDA_ERROR_NOT_READY) {
                        (void)pthread_mutex_lock(&torch.lock);
                        pending_push(&torch.pending, p);
                        (void)pthread_mutex_unlock(&torch.lock);
                        continue;
                }
                if (r != CUDA_SUCCESS) {
                        /* no answer about the work: it may still run, so the memory stays mapped */
                        if (ret == 0)
                                ret = client_set_error(cuda_result_to_errno(r), "Cannot tell whether the work "
                                                       "queued before freeing lease %s is done: %s. It stays "
                                                       "leased until the process exits.",
                                                       vmmb_lease_id(p->lease), cuda_result_name(cu, r));
                        (void)cu->cuEventDestroy(p->event);
                        p->event = NULL;
                        (void)pthread_mutex_lock(&torch.lock);
                        pending_push(&torch.stuck, p);
                        (void)pthread_mutex_unlock(&torch.lock);
                        continue;
                }
                event_put(cu, p->device, p->event);
                k = how == REAP_KEEP ? vmmb_free_keep(p->lease) :
                    how == REAP_ONEWAY ? vmmb_free_oneway(p->lease) : vmmb_free(p->lease);
                if (k < 0 && ret == 0)
                        ret = k;
                free(p);
        }
        return ret;
}

/* Gives back the leases kept by the frees above (vmmb_give_back_kept()); 0, or the first error. */
static int give_back_kept(void) {
        vmmb_client *c;
        int k;

        (void)pthread_mutex_lock(&torch.connect_lock);
        c = torch.client;
        (void)pthread_mutex_unlock(&torch.connect_lock);
        if (!c)
                return 0;               /* never connected: nothing leased, nothing kept */
        k = vmmb_give_back_kept(c);
        return k < 0 ? k : 0;
}

static bool pending_any(void) {
        bool any;

        (void)pthread_mutex_lock(&torch.lock);
        any = torch.pending != NULL;
        (void)pthread_mutex_unlock(&torch.lock);
        return any;
}

/* --- the entry points ---------------------------------------------------------------------------------- */

VMMB_EXPORT void *vmmb_torch_alloc(ssize_t size, int device, void *stream) {
        vmmb_lease *lease = NULL;
        vmmb_client *c;
        int k;

        (void)stream;
        if (size <= 0) {
                (void)client_set_error(-EINVAL, "Cannot lease %zd bytes for PyTorch: the size must be more than 0.",
                                       size);
                return NULL;
        }
        if (device < 0) {
                (void)client_set_error(-ENODEV, "Cannot lease memory for PyTorch on device %d: devices are "
                                       "numbered from 0.", device);
                return NULL;
        }
        c = client_get();
        if (!c)
                return NULL;

        /* the segments whose work is done are kept first, unanswered: the broker reads them before the Alloc,
         * which gets one back when it is of the same size */
        (void)pending_reap(false, REAP_KEEP);
        k = vmmb_alloc(c, (uint64_t)size, device, TORCH_LABEL, &lease);
        if ((k == -ENOMEM || k == -EDQUOT) && pending_any()) {
                /* frees still waiting for their streams hold room: wait for them, give them back, ask again (the
                 * kept ones vmmb_alloc() gave back already) */
                (void)pending_reap(true, REAP_ONEWAY);
                k = vmmb_alloc(c, (uint64_t)size, device, TORCH_LABEL, &lease);
        }
        if (k < 0)
                return NULL;

        (void)pthread_mutex_lock(&torch.lock);
        k = segment_add(lease);
        (void)pthread_mutex_unlock(&torch.lock);
        if (k < 0) {
                (void)vmmb_free(lease);         /* nothing was queued on it yet */
                (void)client_set_error(-ENOMEM, "Out of memory.");
                return NULL;
        }
        return (void *)(uintptr_t)vmmb_lease_ptr(lease);
}

VMMB_EXPORT void vmmb_torch_free(void *ptr, ssize_t size, int device, void *stream) {
        CudaDriver *cu = NULL;
        CUcontext prev = NULL;
        vmmb_lease *lease;
        CUevent event = NULL;
        Pending *p;
        CUresult r;
        int dev;

        (void)size;
        if (!ptr)
                return;
        (void)pthread_mutex_lock(&torch.lock);
        lease = segment_remove((uint64_t)(uintptr_t)ptr);
        (void)pthread_mutex_unlock(&torch.lock);
        if (!lease) {
                (void)client_set_error(-ENOENT, "%p is not a segment of vmmb_torch_alloc() still leased.", ptr);
                return;
        }
        if (client_driver(&cu) < 0)             /* cannot happen: the lease was mapped with it */
                return;
        dev = vmmb_lease_device(lease);
        (void)device;

        p = calloc(1, sizeof(*p));
        r = p ? ctx_enter(cu, dev, &prev) : CUDA_ERROR_OUT_OF_MEMORY;
        if (r == CUDA_SUCCESS) {
                r = event_get(cu, dev, &event);
                if (r == CUDA_SUCCESS) {
                        r = cu->cuEventRecord(event, (CUstream)stream);
                        if (r != CUDA_SUCCESS) {
                                (void)cu->cuEventDestroy(event);
                                event = NULL;
                        }
                }
                if (r != CUDA_SUCCESS) {
                        /* no event: wait for the stream, or for everything in the context */
                        r = cu->cuStreamSynchronize((CUstream)stream);
                        if (r != CUDA_SUCCESS)
                                r = cu->cuCtxSynchronize();
                }
                ctx_leave(cu, dev, prev);
        }

        if (event) {
                *p = (Pending){ .lease = lease, .device = dev, .event = event };
                (void)pthread_mutex_lock(&torch.lock);
                pending_push(&torch.pending, p);
                (void)pthread_mutex_unlock(&torch.lock);
        } else if (r == CUDA_SUCCESS) {
                free(p);
                (void)vmmb_free(lease);         /* waited for: nothing queued uses it */
        } else if (p) {
                (void)client_set_error(cuda_result_to_errno(r), "Cannot wait for the work queued on stream %p "
                                       "before freeing lease %s: %s. It stays leased until the process exits.",
                                       stream, vmmb_lease_id(lease), cuda_result_name(cu, r));
                *p = (Pending){ .lease = lease, .device = dev };
                (void)pthread_mutex_lock(&torch.lock);
                pending_push(&torch.stuck, p);
                (void)pthread_mutex_unlock(&torch.lock);
        } else {
                (void)client_set_error(-ENOMEM, "Out of memory: lease %s stays leased until the process exits.",
                                       vmmb_lease_id(lease));
                return;                 /* leaked, mapped: the broker takes it back at exit */
        }
        (void)pending_reap(false, REAP_KEEP);
}

VMMB_EXPORT int vmmb_torch_release_all(void) {
        _cleanup_free_ Segment *segments = NULL;
        _cleanup_free_ CUresult *synced = NULL;
        CudaDriver *cu = NULL;
        size_t n = 0, freed = 0;
        int ret = 0, k;

        (void)pthread_mutex_lock(&torch.lock);
        segments = TAKE_PTR(torch.segments);
        n = torch.n_segments;
        torch.n_segments = torch.n_allocated = 0;
        (void)pthread_mutex_unlock(&torch.lock);

        /* the frees PyTorch made: wait for their events, and give them back for good with what was kept */
        while (pending_any()) {
                k = pending_reap(true, REAP_FREE);
                if (k < 0 && ret == 0)
                        ret = k;
        }
        k = give_back_kept();
        if (k < 0 && ret == 0)
                ret = k;
        if (n == 0)
                return ret < 0 ? ret : 0;

        /* the segments never freed: no stream is known, so wait for all the work of their device's context,
         * once per device */
        k = client_driver(&cu);
        if (k < 0)
                return k;
        synced = calloc(n, sizeof(CUresult));
        if (!synced)
                return client_set_error(-ENOMEM, "Out of memory.");
        for (size_t i = 0; i < n; i++) {
                int dev = vmmb_lease_device(segments[i].lease);
                CUcontext prev = NULL;
                size_t j;

                for (j = 0; j < i && vmmb_lease_device(segments[j].lease) != dev; j++)
                        ;
                if (j < i) {
                        synced[i] = synced[j];
                        continue;
                }
                synced[i] = ctx_enter(cu, dev, &prev);
                if (synced[i] == CUDA_SUCCESS) {
                        synced[i] = cu->cuCtxSynchronize();
                        ctx_leave(cu, dev, prev);
                }
        }
        for (size_t i = 0; i < n; i++) {
                int dev = vmmb_lease_device(segments[i].lease);

                if (synced[i] != CUDA_SUCCESS) {
                        Pending *p = calloc(1, sizeof(*p));

                        if (ret == 0)
                                ret = client_set_error(cuda_result_to_errno(synced[i]), "Cannot wait for the work "
                                                       "on device %d before freeing lease %s: %s. It stays "
                                                       "leased until the process exits.", dev,
                                                       vmmb_lease_id(segments[i].lease),
                                                       cuda_result_name(cu, synced[i]));
                        if (p) {
                                *p = (Pending){ .lease = segments[i].lease, .device = dev };
                                (void)pthread_mutex_lock(&torch.lock);
                                pending_push(&torch.stuck, p);
                                (void)pthread_mutex_unlock(&torch.lock);
                        }
                        continue;
                }
                k = vmmb_free(segments[i].lease);
                if (k < 0 && ret == 0)
                        ret = k;
                if (k >= 0)
                        freed++;
        }
        if (ret < 0)
                return ret;
        return freed > INT32_MAX ? INT32_MAX : (int)freed;
}

/* --- sleep and wake ------------------------------------------------------------------------------------ */

/* The leases of the live segments, copied (the caller frees the array), in *ret; their number, or -ENOMEM. */
static ssize_t segments_snapshot(vmmb_lease ***ret) {
        vmmb_lease **leases;
        size_t n;

        (void)pthread_mutex_lock(&torch.lock);
        n = torch.n_segments;
        leases = calloc(n ?: 1, sizeof(vmmb_lease *));
        for (size_t i = 0; leases && i < n; i++)
                leases[i] = torch.segments[i].lease;
        (void)pthread_mutex_unlock(&torch.lock);
        if (!leases)
                return client_set_error(-ENOMEM, "Out of memory.");
        *ret = leases;
        return (ssize_t)n;
}

/*
 * Parks (`park`) or unparks every live segment, each in the primary context of its device; a segment parked
 * already (or not parked, to unpark) is passed over. Returns how many it parked or unparked, or the first error
 * once it has tried them all.
 */
static int segments_park(bool park, void *stream) {
        _cleanup_free_ vmmb_lease **leases = NULL;
        CudaDriver *cu = NULL;
        int done = 0, ret = 0, k;
        ssize_t n;

        n = segments_snapshot(&leases);
        if (n < 0)
                return (int)n;
        if (n > 0) {
                k = client_driver(&cu);         /* loaded: the leases were mapped with it */
                if (k < 0)
                        return k;
        }
        for (ssize_t i = 0; i < n; i++) {
                int dev = vmmb_lease_device(leases[i]);
                CUcontext prev = NULL;
                CUresult r;

                if (vmmb_lease_parked(leases[i]) == park)
                        continue;
                r = ctx_enter(cu, dev, &prev);
                if (r != CUDA_SUCCESS) {
                        k = client_set_error(cuda_result_to_errno(r), "Cannot use the primary context of device %d "
                                             "for lease %s: %s.", dev, vmmb_lease_id(leases[i]),
                                             cuda_result_name(cu, r));
                } else {
                        k = park ? vmmb_lease_park(leases[i], stream) : vmmb_lease_unpark(leases[i]);
                        ctx_leave(cu, dev, prev);
                }
                if (k >= 0)
                        done = done < INT32_MAX ? done + 1 : done;
                else if (ret == 0)
                        ret = k;
        }
        return ret < 0 ? ret : done;
}

VMMB_EXPORT int vmmb_torch_sleep(void *stream) {
        int k;

        /* frees waiting for their streams, and what was kept: their memory goes back to the broker rather than
         * to host memory */
        while (pending_any()) {
                k = pending_reap(true, REAP_FREE);
                if (k < 0)
                        return k;
        }
        k = give_back_kept();
        if (k < 0)
                return k;
        return segments_park(true, stream);
}

VMMB_EXPORT int vmmb_torch_wake(void) {
        return segments_park(false, NULL);
}

VMMB_EXPORT int vmmb_torch_lease_id(const void *ptr, char *buf, size_t size) {
        const Segment *s;
        size_t n;
        int ret;

        if (!buf)
                return client_set_error(-EINVAL, "vmmb_torch_lease_id() needs somewhere to put the identifier.");
        (void)pthread_mutex_lock(&torch.lock);
        s = segment_holding((uint64_t)(uintptr_t)ptr);
        if (!s)
                ret = client_set_error(-ENOENT, "%p is in no segment of vmmb_torch_alloc() still leased.", ptr);
        else {
                n = strlen(vmmb_lease_id(s->lease));
                if (n >= size)
                        ret = client_set_error(-ERANGE, "The lease's identifier needs %zu bytes, %zu given.",
                                               n + 1, size);
                else {
                        memcpy(buf, vmmb_lease_id(s->lease), n + 1);
                        ret = (int)n;
                }
        }
        (void)pthread_mutex_unlock(&torch.lock);
        return ret;
}
