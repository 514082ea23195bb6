/* SPDX-License-Identifier: MIT */
#pragma once

/**
 * libvmmbroker: lease GPU memory from vmmbrokerd.
 *
 * A client connects to the broker, asks for device memory and gets a lease:
 * the daemon sends the lease's slabs as file descriptors, and the library
 * imports them, maps them back to back into one reserved device address
 * range, sets access for the whole range and closes the descriptors. The
 * caller uses the pointer like any device memory from cuMemAlloc.
 *
 * The memory reads zero when leased. It stays the caller's until
 * vmmb_free(), vmmb_close() or the end of the process; closing the
 * connection alone does not end a lease.
 *
 * A lease belongs to the user that made it, its owner, who is charged for
 * it. It may be shared with other processes: vmmb_share() makes a token with
 * which another process (of any user that can reach the broker, or of one
 * user) gets the same memory by vmmb_attach(); vmmb_publish() gives the lease
 * a name that vmmb_attach_name() finds, and keeps the lease alive after every
 * process holding it has exited, until vmmb_unpublish(). Only the owner's
 * processes make tokens and publish. Each process holding a lease frees its
 * own hold; the memory goes back to the broker when no process holds it and
 * it is not published.
 *
 * Names live in their owner's namespace: "NAME" is one of the calling user's
 * own, "OWNER/NAME" one of user OWNER's (a user name or a uid), so two users
 * may each publish "weights". A name the caller may not attach and one that
 * does not exist are the same -ENOENT: nobody learns which names another
 * user has.
 *
 * A client outlives its connection. When the broker stops, crashes or is
 * restarted, the call that finds the connection lost (or the next one)
 * connects again to the same socket, waiting up to
 * $VMMBROKER_RECONNECT_TIMEOUT seconds (30 by default; "0.5" and "0" work
 * too) for a broker to listen there. A socket that a service manager holds
 * for the broker (systemd's socket activation) takes the connection at once,
 * and the call waits for the broker to answer it, as any call does. Leases
 * stay mapped and usable throughout: their memory is held by this process,
 * and vmmb_free() on them later talks to the new broker. The call that was
 * under way is sent again on the new connection when the broker cannot have
 * carried it out (the connection was lost before the broker read it), and
 * vmmb_publish() and vmmb_tokens() in any case (twice is as once). Otherwise
 * it returns -ECONNRESET, and vmmb_error_message() says the broker went away
 * after it received the call and whether it carried it out is unknown; each function
 * says what that leaves. When no broker listens within the timeout (the
 * socket refuses connections or is missing), the call returns -ECONNREFUSED.
 * Either way the client stays usable: the next call connects again.
 *
 * Errors are negative errno values; vmmb_error_message() gives the daemon's
 * or the library's sentence for the calling thread's last failure. Every
 * function may be called from several threads at once on the same client
 * (calls on one client take turns on its connection), except vmmb_close(),
 * which must be the client's last call. The library never logs.
 */

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/** A connection to the broker. */
typedef struct vmmb_client vmmb_client;

/** Device memory leased from the broker and mapped into this process. */
typedef struct vmmb_lease vmmb_lease;

/** The broker's socket when neither the caller nor $VMMBROKER_SOCKET names one. */
#define VMMB_DEFAULT_SOCKET "/run/vmmbroker/io.vmmbroker"

/** Pass as `device` to vmmb_alloc() to let the broker place the lease (its Placement= rule: by default the
 * device with the most room). */
#define VMMB_ANY_DEVICE (-1)

/** Flag for vmmb_share(), vmmb_attach(), vmmb_attach_name() and vmmb_publish(): read-only access. */
#define VMMB_READONLY (1u << 0)

/** Pass as `uid` to vmmb_share() for a token that any user may attach with. */
#define VMMB_ANY_UID ((uid_t)-1)

/** Bytes of the buffer vmmb_share() writes a token to: room for the longest token and its NUL. */
#define VMMB_TOKEN_SIZE 65

/** A live share token of a lease, as vmmb_tokens() lists it. */
typedef struct vmmb_token {
        /** The token, as vmmb_share() returned it, NUL-terminated. */
        char token[VMMB_TOKEN_SIZE];
        /** The only user that may attach with it, or VMMB_ANY_UID for any user. */
        uid_t uid;
        /** The user whose process made it. */
        uid_t creator;
        /** 1 when attaching with it gives a read-only hold, else 0. */
        int readonly;
} vmmb_token;

/**
 * vmmb_connect() - connect to the broker.
 * @socket_path: the broker's socket; NULL for $VMMBROKER_SOCKET, else VMMB_DEFAULT_SOCKET.
 * @ret: the new client, on success.
 *
 * Also loads the CUDA driver (libcuda.so.1, or $VMMBROKER_LIBCUDA) the first
 * time a client is made in the process, and reads $VMMBROKER_RECONNECT_TIMEOUT
 * and $VMMBROKER_REPLY_SPIN_USEC for the client. Connecting here does not wait
 * for a broker; connecting again after a lost connection does (see above).
 *
 * Return: 0, or a negative errno: -ENOENT or -ECONNREFUSED when no broker
 * listens there, -EACCES when the caller may not connect (not in the
 * vmmbroker group), -ENODEV when the CUDA driver cannot be loaded (the
 * answer stays for the life of the process), -EINVAL for an empty path, a
 * NULL ret, a $VMMBROKER_RECONNECT_TIMEOUT that is not a number of seconds
 * or a $VMMBROKER_REPLY_SPIN_USEC that is not 0 to 100000 microseconds,
 * -ENAMETOOLONG for a path too long for a Unix socket.
 */
int vmmb_connect(const char *socket_path, vmmb_client **ret);

/**
 * vmmb_close() - close the connection and free the client.
 * @client: the client, or NULL.
 *
 * Every lease still held through this client is freed first, as by
 * vmmb_free(), which does not wait for queued work: do not use their pointers
 * afterwards, nor the lease objects, and let no queued work still use them.
 * A broker that is gone (its socket missing or refusing connections) is not
 * waited for: each lease is unmapped, connecting is tried once, and holds the
 * broker was not told of end when the process exits. The leases kept through
 * the client (vmmb_free_keep()) are given back as by vmmb_give_back_kept().
 * Must be the last call on the client: no other thread may be using it or
 * its leases, and it must not be called from a reclaim callback of one of
 * them (vmmb_lease_set_reclaimable()): the library waits for that callback
 * before it lets the client go. Leaves vmmb_error_message() as it was.
 */
void vmmb_close(vmmb_client *client);

/**
 * vmmb_alloc() - lease device memory.
 * @client: the client.
 * @size: bytes wanted, more than 0; the broker rounds it up to the device's granularity (2 MiB).
 * @device: CUDA device index, or VMMB_ANY_DEVICE.
 * @label: a label that `vmmctl list` shows, or NULL; at most 128 bytes of printable UTF-8
 *         (a longer one is refused; other characters are replaced when sent).
 * @ret: the lease, mapped read-write and zeroed, on success.
 *
 * The received slab descriptors are always closed. If the memory cannot be
 * mapped, the lease is given back to the broker before returning the error.
 *
 * When the broker hands back a lease this process kept (vmmb_free_keep()) of
 * the size asked for, rounded up to the granularity, on a device the call
 * allows, the lease comes back with the same identifier, pointer and slabs,
 * zeroed by the broker, and is not imported, mapped or given access again:
 * no driver call is made. (A lease kept through another client of the
 * process comes back too: the process holds it.) When the broker refuses for
 * room (-ENOMEM) or a limit of the user (-EDQUOT) while the process keeps
 * leases of it, which are still leased and charged to the user, the library
 * gives them all back (vmmb_give_back_kept(), for every client of the
 * process connected to the same socket) and asks once more.
 * When the device has no room but other processes keep leases there, the
 * broker asks them back and the call waits for them, at most the broker's
 * ReclaimTimeout= (5 s by default), before it fails with -ENOMEM. Memory
 * freed and still being scrubbed by the broker is room: the broker waits for
 * the scrubs the call needs rather than refuse it (-EIO if the device has not
 * finished them in 30 s).
 *
 * Return: 0, or a negative errno: -ENOMEM when the device has no room,
 * -ENODEV for a device the broker does not serve, -EINVAL for a bad
 * parameter (a size of 0 or more than the device can serve, a label too
 * long), -EDQUOT over a limit of the calling user, -EIO when the driver
 * failed, -ECONNRESET when the broker went away after it received the call
 * (it may have made a lease that this process then holds, unmapped, until it
 * exits), -ECONNREFUSED when no broker came back in time,
 * -EPROTO when the broker's reply makes no sense, -EAGAIN when the broker
 * could not store the change (StoreFailed: nothing changed, call again).
 */
int vmmb_alloc(vmmb_client *client, uint64_t size, int device, const char *label, vmmb_lease **ret);

/**
 * vmmb_alloc_wait() - lease device memory, waiting for room if there is none now.
 * @client: the client.
 * @size: as for vmmb_alloc().
 * @device: as for vmmb_alloc().
 * @label: as for vmmb_alloc().
 * @timeout_usec: how long to wait for room, in microseconds; 0 does not wait (vmmb_alloc()). The broker
 *                waits at most its MaxAllocWait= (5 minutes by default) whatever this says.
 * @ret: the lease, mapped read-write and zeroed, on success.
 *
 * When the device has no room now, the call waits in the device's queue in
 * the broker, where users take turns and each user's calls are served first
 * come, first served, and returns as soon as room comes back (another lease
 * freed). A call that can never be served (more than the device's capacity,
 * over the calling user's limits) fails at once. The client is busy while it
 * waits: calls on it from other threads wait too (use another client for
 * them). If the broker stops while the call waits, the call fails with
 * -ENOMEM and a message saying so: nothing was leased, and the call may be
 * made again once the broker is back.
 *
 * Return: as vmmb_alloc(); -ENOMEM when no room came back in time (the
 * message says how long it waited).
 */
int vmmb_alloc_wait(vmmb_client *client, uint64_t size, int device, const char *label, uint64_t timeout_usec,
                    vmmb_lease **ret);

/**
 * vmmb_alloc_among() - lease device memory on one of a set of devices, placed by the broker.
 * @client: the client.
 * @size: as for vmmb_alloc().
 * @devices: the CUDA device indices to choose from; duplicates count once. NULL when n_devices is 0.
 * @n_devices: how many, at most 64; 0 lets the broker choose among every device it serves, as
 *             VMMB_ANY_DEVICE does.
 * @label: as for vmmb_alloc().
 * @timeout_usec: as for vmmb_alloc_wait(); 0 does not wait.
 * @ret: the lease, mapped read-write and zeroed, on success; vmmb_lease_device() says where it went.
 *
 * The broker picks the device by its Placement= rule (vmmbroker.conf(5)): by
 * default the one with the most room for the request (its capacity less what
 * is leased and being scrubbed), ties to the one it lists first; or the first
 * device. A device where the calling user is over a limit (MaxBytes= per
 * device, MaxLeases=), or whose capacity is smaller than the request, is
 * passed over for the next. A device that is merely full ends the choice:
 * the call fails with -ENOMEM, or with a timeout waits for room on that
 * device and is served there.
 *
 * Return: as vmmb_alloc_wait(); -ENODEV for a device in the set that the
 * broker does not serve (the message names it) or a negative index; -EDQUOT
 * when every device in the set was refused and one of them for a limit of the
 * calling user; -EINVAL for more than 64 devices, or a size more than every
 * device in the set can serve.
 */
int vmmb_alloc_among(vmmb_client *client, uint64_t size, const int *devices, size_t n_devices, const char *label,
                     uint64_t timeout_usec, vmmb_lease **ret);

/**
 * vmmb_free() - end a lease.
 * @lease: the lease, or NULL.
 *
 * Tells the broker, which scrubs the memory and reuses it, and unmaps the
 * memory while the broker's answer is on the way (so the round trip costs
 * nothing beyond the unmap). Neither the driver nor the library waits for
 * work that the GPU still has queued on the memory: cuMemUnmap returns while a kernel, copy or
 * memset queued on a stream may still use the range, and that work then
 * faults (CUDA_ERROR_ILLEGAL_ADDRESS, a sticky error that ends the CUDA
 * context of the process). The caller must make sure that no queued work
 * uses the memory (synchronize the streams that use it, wait for an event
 * recorded after the last use), or call vmmb_free_stream(), which waits for
 * a stream first. The lease object is freed in every case but -EDEADLK
 * (from the lease's own reclaim callback: see vmmb_reclaim_fn).
 * When telling the broker fails, the broker reclaims the memory when this
 * process exits: -ECONNREFUSED when no broker came back in time,
 * and -ECONNRESET when the broker went away after it received the call, and
 * may or may not have ended the hold. That Free is not sent again: a process
 * that holds a lease more than once (vmmb_attach()) would lose another hold;
 * the memory is unmapped all the same. When the call could not be sent at
 * all, the memory is unmapped afterwards. When unmapping fails after the call
 * was sent (the driver refused: it is being torn down, say), the broker has
 * ended the lease all the same; what could not be unmapped stays reserved in
 * this process, and the broker hands that memory, scrubbed, only to later
 * leases of this user. vmmb_free_oneway() unmaps first and does not tell the
 * broker when unmapping fails.
 *
 * For a lease that other processes hold too (vmmb_attach()), or that is
 * published (vmmb_publish()), this ends only this process's hold: the memory
 * stays theirs. Each lease object that vmmb_alloc(), vmmb_attach() or
 * vmmb_attach_name() returned is freed on its own, even when two of them are
 * the same lease.
 *
 * Of a lease parked here (vmmb_lease_park()), nothing is mapped: only the
 * reserved address range is freed, and the hold ends with the broker as any.
 *
 * Return: 0, or a negative errno from the unmapping or from the broker.
 */
int vmmb_free(vmmb_lease *lease);

/**
 * vmmb_free_oneway() - end a lease without waiting for the broker's answer.
 * @lease: the lease, or NULL.
 *
 * Unmaps the memory first (the caller makes sure no queued work uses it, as
 * for vmmb_free()), then sends the broker the Free as a one-way call (the
 * broker sends no answer) and returns as soon as it is written: the answer
 * that vmmb_free() waits for while it unmaps is left out.
 * The broker ends the hold when it reads the call, and it reads it before any
 * later call of this client: a vmmb_alloc() that follows on the same client
 * may use the memory. Other processes may see the lease held for that moment
 * still: to hand memory over to another process ("I freed, now you
 * allocate"), use vmmb_free(), which returns after the broker has ended the
 * hold. For allocators that free their own segments (PyTorch, CuPy).
 *
 * What the broker makes of the call does not come back: a hold it no longer
 * knows of is the only refusal it could give, and leaves nothing to do. When
 * the connection is lost before the call is written whole, the broker has
 * not read it: the library connects again and sends it once more, as for any
 * call. When the broker goes away after the call is written and before it
 * reads it (a restart at that moment), the hold ends when this process exits.
 * The lease object is freed in every case but -EDEADLK.
 *
 * Return: 0 once the call is written; or a negative errno: from the unmapping
 * (unmapped first, the broker is not told then), -ECONNREFUSED when no broker came
 * back in time, -ECONNRESET when the connection was lost twice while sending,
 * -EDEADLK from the lease's own reclaim callback (nothing is done).
 */
int vmmb_free_oneway(vmmb_lease *lease);

/**
 * vmmb_free_keep() - end a lease, keeping its memory mapped for this process's next vmmb_alloc() of its size.
 * @lease: the lease, or NULL.
 *
 * For allocators that free memory and soon ask for the same size again:
 * asks the broker to keep the lease for this process (a Free with keep),
 * without unmapping it. The broker zeroes it and hands the same lease back to
 * the process's next vmmb_alloc(), vmmb_alloc_wait() or vmmb_alloc_among()
 * of its size (rounded up to the granularity) on a device the call allows,
 * on any client of the process, which then reuses the mapping as it is:
 * neither this call nor that one imports, maps, sets access or unmaps, and
 * this one does not wait for the broker's answer (but see below). The caller
 * must not use the memory or the lease object afterwards, as after
 * vmmb_free(), and must have made sure that no queued work uses the memory
 * (the broker zeroes it on its own stream, which does not wait for this
 * process's work). Nothing is waited for here.
 *
 * A kept lease is still the user's lease: it counts toward the user's limits
 * (MaxBytes=, MaxLeases=) and the device's use (`vmmctl list` shows it
 * "kept"). The broker asks for kept leases back before any lease marked
 * reclaimable, when another call waits for room: the library then gives it
 * back on its own (unmaps and frees it, with no callback), so the library
 * watches for the broker's requests (as vmmb_lease_set_reclaimable() does)
 * before it keeps anything. vmmb_close() and vmmb_give_back_kept() give back
 * what a client kept, and vmmb_alloc() gives every lease kept with its
 * broker back and asks again when the broker refuses for room or a limit.
 *
 * The broker keeps a lease only when this process holds it once,
 * read-write, and of the owner's user, and it is neither published nor
 * parked. The library keeps only what it can tell the broker will keep: a
 * lease that vmmb_alloc() (not vmmb_attach()) returned, never given to
 * vmmb_share(), vmmb_publish(), vmmb_lease_park() or
 * vmmb_lease_grant_access(), not marked reclaimable nor given back, and not
 * attached again through the same client. Any other lease, or when the
 * broker is older than keeping, or does not ask for leases back (no
 * WatchReclaim), is freed as by vmmb_free_oneway(). The first keep on a
 * connection (and the first after the library connects again) waits for the
 * broker's answer, which says whether it keeps leases at all; later ones
 * only send the call, as vmmb_free_oneway() does. When the broker answers
 * that it did not keep this lease, or is older than keeping and took the
 * call for a plain Free, the lease is unmapped then.
 *
 * Return: 0, or a negative errno: those of vmmb_free_oneway(), or of the
 * broker's answer to the first keep on a connection (-ENOENT for a lease it
 * does not know, -ECONNRESET when it went away after it received the call:
 * the lease is unmapped, and if the broker kept it, it is freed when the
 * broker asks for it), -EDEADLK from the lease's own reclaim callback. In
 * every case but -EDEADLK the lease object is gone.
 */
int vmmb_free_keep(vmmb_lease *lease);

/**
 * vmmb_give_back_kept() - give back every lease kept through a client.
 * @client: the client whose vmmb_free_keep() kept the leases.
 *
 * Unmaps each lease that vmmb_free_keep() kept through @client and the broker
 * has not handed back yet, and frees it with the broker, waiting for each
 * answer: the memory goes back to the broker for good. For a program that
 * will not ask for those sizes again (a pool torn down); vmmb_close() does it
 * too.
 *
 * Return: the number of leases given back, or a negative errno after trying
 * them all (the first failure; vmmb_error_message() says why): -EINVAL for a
 * NULL client, the errors of unmapping (the broker is not told of that lease,
 * which stays held until the process exits) and of vmmb_free() (the lease is
 * unmapped all the same; if the broker did not carry the Free out and still
 * keeps it, it is freed when the broker asks for it).
 */
int vmmb_give_back_kept(vmmb_client *client);

/**
 * vmmb_free_stream() - end a lease once the work queued on a stream is done.
 * @lease: the lease, or NULL.
 * @stream: a CUstream (a cudaStream_t: the same pointer), or NULL for the legacy default stream;
 *          CU_STREAM_LEGACY and CU_STREAM_PER_THREAD too. Declared void * so that this header
 *          needs no CUDA header.
 *
 * Waits for every piece of work queued on @stream so far (cuStreamSynchronize),
 * then frees the lease as vmmb_free() does. Work on other streams is not
 * waited for. A stream the caller created is waited for as it is, in any
 * thread, whatever context is current or none (the driver finds the stream's
 * context; no context is retained). NULL, CU_STREAM_LEGACY and
 * CU_STREAM_PER_THREAD name the calling thread's current context's own
 * streams; in a thread with none, those of the primary context of the
 * lease's device, when it is active (else nothing can be queued there, and
 * nothing is waited for). When the wait fails, nothing is unmapped or freed: the lease
 * stays mapped and held (its work may still run), and the caller may
 * vmmb_free() it once sure that nothing uses it, or leave it to the end of the
 * process.
 *
 * Return: 0, or a negative errno: those of vmmb_free(), -EINVAL when the driver
 * does not know the stream, -EIO (or another
 * errno of the driver) when the context failed (a fault in work queued
 * earlier: CUDA_ERROR_ILLEGAL_ADDRESS is sticky); then the lease is left as it was.
 */
int vmmb_free_stream(vmmb_lease *lease, void *stream);

/**
 * vmmb_share() - make a token with which another process can attach a lease.
 * @lease: the lease, held by this process.
 * @uid: the only user that may attach with the token, or VMMB_ANY_UID for any user that can reach the broker.
 * @flags: 0, or VMMB_READONLY for a token that gives read-only holds.
 * @token: VMMB_TOKEN_SIZE bytes, where the token (32 hex digits today) is written with its NUL, on success.
 *
 * Pass the token to the other process, which calls vmmb_attach(). A token
 * may be used any number of times, until vmmb_revoke() or until the lease
 * ends; whoever presents it gets the memory, so keep it as secret as a
 * password. Only processes of the lease's owner may make tokens: a holder of
 * another user (one that attached it) cannot hand the memory on. A read-only
 * holder can only make read-only tokens.
 *
 * Return: 0, or a negative errno: -EACCES when the calling user is not the
 * lease's owner, or a read-only holder asks for a read-write token, -EDQUOT when the lease has as many live tokens as the
 * broker allows (64), -ENOENT when the broker has no such lease of this
 * process, -EINVAL for a NULL lease or token or a flag other than
 * VMMB_READONLY, -ECONNRESET when the broker went away after it received
 * the call (it may have made a token, which lasts as long as the lease),
 * -ECONNREFUSED when no broker came back in time, -EPROTO when the
 * broker's reply makes no sense.
 */
int vmmb_share(vmmb_lease *lease, uid_t uid, unsigned flags, char token[VMMB_TOKEN_SIZE]);

/**
 * vmmb_revoke() - revoke a token of vmmb_share().
 * @client: the client.
 * @token: the token.
 *
 * Later attaches with the token fail with -ENOKEY. Holds already taken with
 * it stay: the broker cannot take a mapping back from a process. Allowed to
 * the lease's owner (the user that made it with vmmb_alloc()), the user that
 * made the token, and the broker's administrators.
 *
 * Return: 0, or a negative errno: -ENOKEY when the broker knows no such token
 * (mistyped, revoked already, or its lease has ended), -EACCES when the
 * caller may not revoke it, -EINVAL for a NULL client, a NULL or empty token
 * or one longer than VMMB_TOKEN_SIZE - 1 bytes, -ECONNRESET when the broker
 * went away after it received the call (call again: -ENOKEY then says the
 * token is gone), -ECONNREFUSED when no broker came back in time,
 * -EPROTO when the broker's reply makes no sense.
 */
int vmmb_revoke(vmmb_client *client, const char *token);

/**
 * vmmb_attach() - map a lease that another process shared, by its token.
 * @client: the client.
 * @token: a token from vmmb_share().
 * @flags: 0, or VMMB_READONLY to map the memory read-only even when the token gives read-write.
 * @ret: the lease, mapped, on success: the same memory as every other holder's, as they left it.
 *
 * The memory is mapped read-only when @flags has VMMB_READONLY, or when the
 * token gives read-only holds and this process does not hold the lease
 * read-write already (its hold then stays read-write, whatever the token);
 * vmmb_lease_readonly() says which. The broker cannot
 * enforce read-only in this process: the library sets the access itself,
 * as any process importing the memory does. Attaching a lease this process
 * holds already maps it once more, at another address; each lease object
 * is freed on its own. End the hold with vmmb_free(), as for vmmb_alloc().
 *
 * Return: 0, or a negative errno: -ENOKEY when the broker knows no such token
 * (mistyped, revoked, or its lease has ended), -EACCES when the token was
 * made for another user, -EINVAL for a NULL client or ret, a NULL or empty
 * token or one longer than VMMB_TOKEN_SIZE - 1 bytes, or a flag other than
 * VMMB_READONLY, -ENOMEM when this process ran out of memory, -ENODEV when
 * the CUDA driver cannot be loaded, -EIO or another errno of the driver when
 * the memory cannot be mapped, -ECONNRESET when the broker went away after it
 * received the call (it may have given this process a hold, which then lasts
 * until the process exits), -ECONNREFUSED when no broker came back in time, -EPROTO when the broker's reply makes no sense.
 */
int vmmb_attach(vmmb_client *client, const char *token, unsigned flags, vmmb_lease **ret);

/**
 * vmmb_attach_name() - map a published lease, by its name.
 * @client: the client.
 * @name: "NAME", a name the calling user published with vmmb_publish(), or "OWNER/NAME", one that
 *        user OWNER (a user name or a uid) published.
 * @flags: 0, or VMMB_READONLY to map the memory read-only even when the name gives read-write.
 * @ret: the lease, mapped, on success.
 *
 * As vmmb_attach(), for a lease that vmmb_publish() named: allowed to the
 * lease's owner and to the users the publisher listed. Names live in their
 * owner's namespace: another user's lease is attached as "OWNER/NAME"
 * ("alice/weights", "1000/weights"); the owner may use either form.
 * vmmb_lease_owner() and vmmb_lease_owner_name() then say whose lease it is.
 * Mapped read-only when @flags has VMMB_READONLY or the lease was published
 * read-only.
 *
 * Return: 0, or a negative errno: -ENOENT when no lease is published under
 * the name, or one is that the calling user may not attach (the broker does
 * not tell the two apart: nobody learns another user's names), or OWNER names
 * no user, -EINVAL for a NULL client or ret, a name that is neither NAME nor
 * OWNER/NAME (NAME as vmmb_publish() takes it) or a flag other than
 * VMMB_READONLY, and the errors of vmmb_attach() for the mapping and the
 * connection.
 */
int vmmb_attach_name(vmmb_client *client, const char *name, unsigned flags, vmmb_lease **ret);

/**
 * vmmb_publish() - give a lease a name, and keep it alive under it.
 * @lease: the lease, held read-write by this process, which must be of the user that made it.
 * @name: 1-128 bytes of ASCII letters, digits and "._-:@+", beginning with a letter or digit;
 *        unique among the owner's names. No '/': that separates the owner in OWNER/NAME.
 * @uids: users, besides the owner, who may attach by the name; may be NULL when @n_uids is 0.
 * @n_uids: the number of @uids, at most 64.
 * @flags: 0, or VMMB_READONLY for read-only holds through the name (the owner's included).
 *
 * The name lives in the owner's namespace: the owner's processes attach it
 * as "NAME", the users of @uids as "OWNER/NAME" (OWNER the owner's user name
 * or uid). A published lease outlives every process that holds it: it stays
 * charged to its owner, and its memory is kept as the last holder left it,
 * until vmmb_unpublish(). A lease has at most one name; publishing it again
 * under the same name replaces @uids and @flags.
 *
 * Return: 0, or a negative errno: -EEXIST when another of the owner's leases
 * is published under the name, -EACCES when the caller is not of the lease's
 * owner or holds it read-only, -EINVAL for a NULL lease, a name that cannot be
 * published (one with '/' among them: vmmb_error_message() says that others
 * attach it as OWNER/NAME), a lease published under another name already, more than 64
 * users, NULL @uids with @n_uids above 0, VMMB_ANY_UID among them or a flag
 * other than VMMB_READONLY, -ENOENT when the broker has no such lease of
 * this process, -ECONNRESET when the connection was lost twice during the
 * call (a call lost once is sent again), -ECONNREFUSED when no broker came
 * back in time, -EPROTO when the broker's reply makes no sense.
 */
int vmmb_publish(vmmb_lease *lease, const char *name, const uid_t *uids, size_t n_uids, unsigned flags);

/**
 * vmmb_unpublish() - remove a lease's name.
 * @client: the client.
 * @name: "NAME", one of the calling user's names, or "OWNER/NAME", one of user OWNER's (a user name or
 *        a uid), as vmmb_attach_name() takes it.
 *
 * The lease ends when no process holds it any more; the processes that hold
 * it keep it. Allowed to the lease's owner and the broker's administrators.
 *
 * Return: 0, or a negative errno: -ENOENT when no lease is published under
 * the name, or one is that the calling user may not even attach, -EACCES when
 * the caller may attach it but not unpublish it, -EINVAL for a NULL client or
 * a name that is neither NAME nor OWNER/NAME, -ECONNRESET when the broker
 * went away after it received the call (call again: -ENOENT then says the
 * name is gone), -ECONNREFUSED when no broker came back in time,
 * -EPROTO when the broker's reply makes no sense.
 */
int vmmb_unpublish(vmmb_client *client, const char *name);

/**
 * vmmb_tokens() - list the live share tokens of a lease.
 * @lease: the lease, held by this process, which must be of the lease's owner.
 * @ret: on success, a new array of the tokens, to free with vmmb_tokens_free(); NULL when there are none.
 * @ret_n: on success, the number of tokens in *@ret.
 *
 * Every live token of the lease, whichever of the owner's processes made it
 * with vmmb_share(): what the owner may vmmb_revoke(). Tokens are secrets;
 * the broker shows them to processes of the owner that hold the lease, and
 * to its administrators (`vmmctl tokens`), no one else.
 *
 * Return: 0, or a negative errno: -EACCES when the calling user is not the
 * lease's owner (a holder that attached another user's lease), -ENOENT when
 * the broker has no such lease of this process, -EINVAL for a NULL lease, ret
 * or ret_n, -ENOMEM when this process ran out of memory, -EOPNOTSUPP from a
 * broker older than the call, -ECONNRESET when the connection was lost twice
 * during the call (a call lost once is sent again: listing changes nothing),
 * -ECONNREFUSED when no broker came back in time, -EPROTO when the broker's
 * reply makes no sense.
 */
int vmmb_tokens(vmmb_lease *lease, vmmb_token **ret, size_t *ret_n);

/**
 * vmmb_tokens_free() - free an array of vmmb_tokens().
 * @tokens: the array, or NULL.
 * @n: the number of tokens in it, as vmmb_tokens() returned it.
 */
void vmmb_tokens_free(vmmb_token *tokens, size_t n);

/**
 * vmmb_lease_ptr() - the lease's device address.
 * @lease: the lease.
 *
 * Return: the start of the mapping, a CUdeviceptr (usable as a device pointer).
 */
uint64_t vmmb_lease_ptr(const vmmb_lease *lease);

/**
 * vmmb_lease_size() - the lease's size.
 * @lease: the lease.
 *
 * Return: bytes mapped at vmmb_lease_ptr(): the request rounded up.
 */
uint64_t vmmb_lease_size(const vmmb_lease *lease);

/**
 * vmmb_lease_device() - the lease's device.
 * @lease: the lease.
 *
 * Return: the CUDA device index of the memory.
 */
int vmmb_lease_device(const vmmb_lease *lease);

/**
 * vmmb_lease_id() - the lease's identifier, as `vmmctl list` shows it.
 * @lease: the lease.
 *
 * Return: a string owned by the lease.
 */
const char *vmmb_lease_id(const vmmb_lease *lease);

/**
 * vmmb_lease_owner() - the user that owns the lease.
 * @lease: the lease.
 *
 * The owner is the user that made the lease with vmmb_alloc(), who is
 * charged for it, publishes it and makes its tokens: for a lease from
 * vmmb_attach() or vmmb_attach_name(), the user whose memory this is, as the
 * broker said in its reply.
 *
 * Return: the owner's uid; (uid_t)-1 when the broker did not say (a broker
 * older than owner namespaces sends no owner) or for a NULL lease.
 */
uid_t vmmb_lease_owner(const vmmb_lease *lease);

/**
 * vmmb_lease_owner_name() - the user name of the lease's owner.
 * @lease: the lease.
 *
 * The name is the broker's, from its user database, as it was when the
 * lease was mapped: the OWNER of "OWNER/NAME" for vmmb_attach_name().
 *
 * Return: a string owned by the lease, valid until the lease is freed; NULL
 * when the broker did not send one (it could not look the user up, or is
 * older than owner namespaces) or for a NULL lease.
 */
const char *vmmb_lease_owner_name(const vmmb_lease *lease);

/**
 * vmmb_lease_readonly() - whether the lease is mapped read-only here.
 * @lease: the lease.
 *
 * A lease from vmmb_attach() or vmmb_attach_name() is mapped read-only when
 * asked, or when the token or name gives read-only holds. Writing to it from
 * the device then fails (the driver refuses copies and sets, and a kernel's
 * write faults).
 *
 * Return: 1 when mapped read-only, 0 when read-write (or for a NULL lease).
 */
int vmmb_lease_readonly(const vmmb_lease *lease);

/**
 * vmmb_lease_read() - copy bytes of a lease into host memory.
 * @lease: a lease mapped in this process (not parked, not given back).
 * @offset: the first byte to read, from the start of the lease.
 * @buf: where the bytes go: @n bytes of host memory (may be NULL when @n is 0).
 * @n: how many bytes.
 *
 * One synchronous cuMemcpyDtoH from the lease's mapping, made for small
 * reads such as a header at the start of a published lease (the weight store
 * of the Python package reads its layout so). The copy is ordered as
 * cuMemcpyDtoH orders it: after the work queued on the context's legacy
 * default stream; work that writes the range on another stream must be
 * waited for first. It runs in the calling thread's current context or, when
 * the thread has none, in the primary context of the lease's device. While
 * the copy runs nothing unmaps the lease: a reclaim of it waits for the copy,
 * and so does another thread's vmmb_free(), vmmb_free_keep(),
 * vmmb_lease_park() or vmmb_close() of it. Nothing else waits: the client's
 * other leases and calls, and the answers to reclaim requests for them, go on
 * while a read waits behind queued work. The copy is synchronous: copy large
 * ranges through the mapping on a stream instead. Works on read-only leases.
 * Like every driver call, not from a stream's host function.
 *
 * Return: 0, or a negative errno with vmmb_error_message() set: -EINVAL for
 * a NULL lease, or a NULL @buf with @n > 0; -ERANGE when @offset + @n is past
 * the lease's size (nothing is read); -ENXIO for a parked lease
 * (vmmb_lease_unpark() maps it again); -ESTALE for a lease given back on
 * the broker's request, -EBUSY while it is being given back; the driver's
 * error as an errno when the copy fails.
 */
int vmmb_lease_read(vmmb_lease *lease, uint64_t offset, void *buf, size_t n);

/** The most devices vmmb_lease_grant_access() takes in one call. */
#define VMMB_ACCESS_MAX 64

/**
 * vmmb_lease_grant_access() - let other devices of this process use a lease.
 * @lease: a lease mapped in this process, on device A (vmmb_lease_device()).
 * @devices: CUDA device indices B, C, ... that may use the memory; A itself, and a device named twice, are
 *           allowed (each is given access once).
 * @n: how many indices @devices holds, at most VMMB_ACCESS_MAX; 0 does nothing.
 *
 * A lease is mapped for its own device only. This gives each device named
 * access to the whole mapping in this process, read-write, or read-only when
 * the lease is held read-only (vmmb_lease_readonly()), with one
 * cuMemSetAccess that also carries the lease's own device (which keeps its
 * access). Kernels and copies on those devices' contexts may then use
 * vmmb_lease_ptr() directly, over NVLink or PCIe: peer access to the
 * memory. No cuCtxEnablePeerAccess() is needed: that call is for memory from
 * cuMemAlloc() (cudaMalloc()), while access to VMM memory, which a lease is,
 * is the mapping's own, set per device.
 *
 * Before any change, the library asks the driver for each device B other than
 * A whether B can access A's memory (cuDeviceCanAccessPeer(&can, B, A)); one
 * "no" fails the call and changes nothing. Access is added to what was
 * given before and lasts until the lease is freed (vmmb_free() unmaps the
 * range, whatever devices had access); it is this process's alone: the
 * broker does not know about it, other holders of the same lease map it for
 * themselves, and the memory stays on A and is counted there. To use a lease
 * on several devices right after vmmb_alloc(), vmmb_alloc_among(),
 * vmmb_attach() or vmmb_attach_name(), call this next: a lease is not used
 * before its maker returns it, so no separate form of those calls is needed.
 *
 * A lease given back on the broker's request (vmmb_lease_set_reclaimable())
 * is first waited for in the primary context of every device given access,
 * as of its own device.
 *
 * Of a lease parked here (vmmb_lease_park()), the access is remembered and
 * given when vmmb_lease_unpark() maps it again.
 *
 * Return: 0, or a negative errno: -EOPNOTSUPP when a device cannot access
 * A's memory (the message names the pair), -ENODEV for an index that is not
 * a device of this process (negative, or not below the device count),
 * -EINVAL for a NULL lease, a NULL @devices with @n above 0, or @n above
 * VMMB_ACCESS_MAX, -ESTALE for a lease given back on the broker's request
 * (-EBUSY while that is under way), or the driver's error from
 * cuMemSetAccess.
 */
int vmmb_lease_grant_access(vmmb_lease *lease, const int *devices, size_t n);

/*
 * Reclaimable leases: memory this process is willing to give back when
 * another process waits for room (vmmb_alloc_wait()), such as a cache it can
 * drop. The broker cannot take memory from a process; it asks, and the
 * library answers for its caller.
 */

/* vmmb_lease_set_reclaimable()'s priority that makes a lease not reclaimable. */
#define VMMB_NOT_RECLAIMABLE (-1)

/**
 * vmmb_reclaim_fn - decides whether to give a lease back.
 * @lease: the lease the broker asks for, still mapped.
 * @timeout_usec: how long the broker waits for it (its ReclaimTimeout=, 5 s by default).
 * @userdata: as given to vmmb_lease_set_reclaimable().
 *
 * Runs on the library's watch thread, one request at a time. Stop using the
 * memory (drop what points into it, finish or queue nothing more on it) and
 * return 0: the library then waits for the work queued in the device's
 * primary context, unmaps the lease and frees it with the broker. Work
 * queued in another context of the caller's own (not the primary one that
 * the CUDA runtime, PyTorch and CuPy use) must be finished by the callback
 * itself. Return any other value (a negative errno, say) to refuse: the lease stays mapped and is
 * no longer reclaimable (mark it again to offer it again). The refusal ends
 * the mark, one that the callback set on @lease itself with
 * vmmb_lease_set_reclaimable() too: there that call returns 0 and tells the
 * broker nothing, the callback's return is the answer (an unmark there is
 * no refusal either). To offer it for later, mark it again once the
 * callback has returned. A lease marked again may be asked again at once, by
 * a call that still waits (the broker keeps no record of refusals). The
 * callback must not call vmmb_free() on @lease (it fails with -EDEADLK) nor
 * wait for another thread that does.
 */
typedef int (*vmmb_reclaim_fn)(vmmb_lease *lease, uint64_t timeout_usec, void *userdata);

/**
 * vmmb_lease_set_reclaimable() - offer a lease back to the broker, or stop offering it.
 * @lease: a lease this process holds read-write, of its own user.
 * @priority: 0 to INT_MAX, lower is asked first; or VMMB_NOT_RECLAIMABLE.
 * @callback: called when the broker asks for the lease, or NULL to give it back without asking.
 * @userdata: passed to @callback.
 *
 * When an Alloc of another process waits for room on the lease's device,
 * the broker asks the holders of reclaimable leases on that device, lowest
 * priority first (then the earliest marked), for what the waiting call needs.
 * The first call starts the process's watch (the broker takes one per
 * process): a thread of the library with two connections of its own to the
 * broker (one for its requests, one for its answers), which every client of
 * the process that needs it shares (this one for its marks, another for
 * vmmb_free_keep()); it stops when the last of them is closed with
 * vmmb_close(). When asked, the library calls @callback (see
 * vmmb_reclaim_fn), then, unless it refused: waits for the work queued in the
 * device's primary context (cuCtxSynchronize()), unmaps the lease and frees
 * it. The lease object stays valid: vmmb_lease_reclaimed() says 1,
 * vmmb_lease_ptr() 0, and vmmb_free() frees only the object. A vmmb_free()
 * from another thread while the callback runs waits for the callback.
 *
 * A request that is not answered within the broker's deadline makes the
 * lease "unresponsive" (vmmctl list): the broker stops asking for it, and it
 * is not reclaimable until marked again. A lease shared with other processes
 * is asked only when every holder watches; a published lease is never asked.
 * Marks are not kept across a restart of the broker: the watch thread
 * reconnects and marks the leases again, however long the broker is away
 * (it tries again 0.1 s after, then twice as long each time up to 2 s; it
 * does not give up after $VMMBROKER_RECONNECT_TIMEOUT, as a call does), and
 * the same when the broker goes away again while it marks them.
 * A request for a lease this process holds but has not marked (a mark that
 * another holder of the lease set, or one withdrawn here while the watch's
 * marking again after a reconnect was on its way) is refused, so that the
 * broker asks the next.
 *
 * Return: 0, or a negative errno: -ENOENT for a lease the broker does not
 * know (any more), -EACCES when this process holds it read-only or is not
 * of the owner's user, -ESTALE for a lease given back already,
 * -EOPNOTSUPP for a broker older than reclaiming, -EINVAL for a bad
 * priority, or the errors of connecting (vmmb_connect()).
 */
int vmmb_lease_set_reclaimable(vmmb_lease *lease, int priority, vmmb_reclaim_fn callback, void *userdata);

/**
 * vmmb_lease_reclaimed() - whether a lease was given back on the broker's request.
 * @lease: the lease.
 *
 * Return: 1 when the library gave it back (it is unmapped: free the object
 * with vmmb_free()), 0 otherwise (or for a NULL lease).
 */
int vmmb_lease_reclaimed(const vmmb_lease *lease);

/*
 * Parking: a lease's content moved to host memory while a process does not
 * need it on the device (an engine put to sleep), and brought back at the
 * same address. Each process holding the lease parks its own hold; the broker
 * copies the content into host memory (on the device's NUMA node) once every
 * holder has parked, gives the device memory back to its pool, and charges
 * the owner host bytes (its MaxHostBytes= limit) instead of device bytes.
 * The address range stays reserved in every holder, so pointers into the
 * lease (tensors, tables of addresses) stay valid while nothing uses them.
 */

/**
 * vmmb_lease_park() - unmap a lease here, keeping its address, and let the broker move it to host memory.
 * @lease: a lease this process holds read-write, of its own user, mapped here.
 * @stream: a CUstream (cudaStream_t) whose queued work may still use the lease, waited for with
 *          cuStreamSynchronize(); NULL waits for all the work of the context (cuCtxSynchronize()).
 *          As vmmb_free_stream() does: a stream the caller created as it is, in any thread; NULL
 *          in the calling thread's current context, or when the thread has none, in the primary
 *          context of the lease's device. When the thread has no context and the primary context is
 *          not active, nothing can be queued: nothing is waited for, and no context is created.
 *
 * Waits for the queued work, unmaps each slab of the lease (the address
 * range from vmmb_lease_ptr() stays reserved for it: no other allocation of
 * this process gets it), then tells the broker (Park). While the lease is
 * parked here, nothing is mapped at vmmb_lease_ptr(): work that touches the
 * range faults (CUDA_ERROR_ILLEGAL_ADDRESS, sticky for the context), and
 * copies to or from it fail. When other processes still map the lease, the
 * content stays in device memory, theirs to use, and moves to host memory
 * when the last of them parks too.
 *
 * When the broker refuses (a read-only hold, another user's lease, no host
 * memory, the owner's host-bytes limit), the library maps the lease again at
 * the same address with the same access (it keeps no slab fds after
 * mapping: it asks the broker for them with Unpark, which returns the slabs
 * of a lease that is not parked as they are) and returns the broker's
 * error. When that too fails (the broker is gone), the lease is left parked
 * here, unmapped with its address kept: vmmb_lease_parked() says 1, and
 * vmmb_lease_unpark() maps it again once the broker answers; the message says
 * which. Before the first park on a connection, the library asks the
 * broker whether it parks at all (its interface description): a broker
 * older than parking gets -EOPNOTSUPP with nothing unmapped.
 *
 * A reclaim request (vmmb_lease_set_reclaimable()) that reaches a parked
 * lease is refused (nothing is mapped to give back) and the lease is no
 * longer reclaimable; the broker does not ask for parked leases. When the
 * content moves into host memory (it returns 1), the lease's reclaimable
 * mark ends, in the broker and here: mark it again after
 * vmmb_lease_unpark() to offer it again. Parking
 * waits for a reclaim callback of the lease running on the watch thread.
 * Calls on other leases may run at the same time; vmmb_lease_park(),
 * vmmb_lease_unpark(), vmmb_lease_grant_access() and vmmb_free() of one
 * lease must not run at the same time as each other.
 *
 * Return: 1 when the content is in host memory now, 0 when the broker waits
 * for other holders to park (this process's hold is parked either way), or a
 * negative errno: -EACCES when the hold is read-only or the calling user is
 * not the owner, -ENOSPC when the host has no room for the content, -EDQUOT
 * over the owner's host-bytes limit, -ENOENT for a lease the broker does not
 * know, -EALREADY for a lease parked here already, -ESTALE for a lease given
 * back on the broker's request, -EDEADLK from the lease's own reclaim
 * callback, -EINVAL for a NULL lease or a stream the driver does not know,
 * -EIO (or another errno of the driver) when waiting for the work failed
 * (nothing was unmapped) or unmapping failed (some of the lease may still be
 * mapped: vmmb_free() it), -EOPNOTSUPP from a broker older than parking,
 * -ECONNRESET or -ECONNREFUSED as vmmb_alloc().
 */
int vmmb_lease_park(vmmb_lease *lease, void *stream);

/**
 * vmmb_lease_unpark() - bring a parked lease back and map it at the address it had.
 * @lease: a lease parked here by vmmb_lease_park().
 *
 * Tells the broker (Unpark), which brings the content back into fresh
 * device memory when it was in host memory (any holder may), then maps the
 * slabs it returns back to back at vmmb_lease_ptr(), the address kept
 * reserved, with the access the lease had: read-only when it was held
 * read-only, and for every device given access by vmmb_lease_grant_access()
 * (before or while parked). The slab fds are closed. The content is what it
 * was when the last holder parked. The owner is charged device bytes again.
 *
 * When the broker refuses, the lease stays parked (here, and in host memory)
 * and the call may be made again. When mapping fails after the broker
 * answered, the lease stays parked here while the broker counts the hold as
 * mapped; calling vmmb_lease_unpark() again maps it then. Threading as
 * vmmb_lease_park().
 *
 * Return: 0, or a negative errno: -ENOMEM when the device has no room for it
 * now, -EDQUOT over a limit of the owner, -EALREADY for a lease not parked
 * here (it is mapped: nothing to do), -ESTALE for a lease given back on the
 * broker's request, -ENOENT for a lease the broker does not know, -EINVAL
 * for a NULL lease, -EIO (or another errno of the driver) when mapping
 * failed, -EPROTO when the broker's reply does not fit the lease (another
 * size or device), -EOPNOTSUPP from a broker older than parking,
 * -ECONNRESET or -ECONNREFUSED as vmmb_alloc().
 */
int vmmb_lease_unpark(vmmb_lease *lease);

/**
 * vmmb_lease_parked() - whether a lease is parked here.
 * @lease: the lease.
 *
 * Return: 1 while this process has the lease parked (nothing mapped at
 * vmmb_lease_ptr(), the address kept), 0 otherwise (or for a NULL lease).
 * Whether the content is in host memory yet is what vmmb_lease_park()
 * returned, or the broker's list (`vmmctl list`).
 */
int vmmb_lease_parked(const vmmb_lease *lease);

/*
 * PyTorch's pluggable allocator.
 *
 * vmmb_torch_alloc() and vmmb_torch_free() have exactly the signatures that
 * torch.cuda.memory.CUDAPluggableAllocator takes, so PyTorch calls them from
 * C, with no Python on the allocation path: each segment PyTorch's caching
 * allocator asks for is a lease of its own. They use one client for the whole
 * process, connected on first use to $VMMBROKER_SOCKET (else
 * VMMB_DEFAULT_SOCKET), and never closed: at exit the broker takes back what
 * is still leased. Every function may be called from any thread. The stream
 * parameters are cudaStream_t, which is a CUstream: declared void * so that
 * this header needs no CUDA header.
 */

/**
 * vmmb_torch_alloc() - lease a segment for PyTorch.
 * @size: bytes, more than 0; rounded up to the granularity (2 MiB) by the broker.
 * @device: the CUDA device index (PyTorch passes its current device; never VMMB_ANY_DEVICE).
 * @stream: the stream the segment is for (a cudaStream_t); unused, as leased memory is ready at once.
 *
 * Leases @size bytes on @device (labelled "torch" in `vmmctl list`), mapped
 * read-write and zeroed. Before asking, it frees the leases of earlier
 * vmmb_torch_free() calls whose work is done with vmmb_free_keep(), so that
 * a segment of the same size comes back already mapped (vmmb_alloc()); when
 * the broker refuses for room (-ENOMEM) or the user's limit (-EDQUOT) while
 * such frees still wait for their streams, it waits for them, gives them back
 * and asks once more.
 *
 * Return: the device pointer, or NULL on failure (PyTorch then raises its
 * out-of-memory error). The calling thread's vmmb_error_message() says why
 * (the broker's sentence when it refused); nothing is printed.
 */
void *vmmb_torch_alloc(ssize_t size, int device, void *stream);

/**
 * vmmb_torch_free() - give a segment of vmmb_torch_alloc() back, once the work queued on its stream is done.
 * @ptr: the pointer vmmb_torch_alloc() returned; NULL, or any other pointer, is ignored.
 * @size: the segment's size as PyTorch knows it (unused: the library knows the lease).
 * @device: the segment's device (unused: the library knows the lease).
 * @stream: the stream whose queued work may still use the segment (a cudaStream_t), or NULL for
 *          the legacy default stream, in the primary context of the segment's device.
 *
 * Does not wait for @stream. An event is recorded on @stream, and the lease is freed
 * only once the event has completed: checked by later calls of
 * vmmb_torch_alloc() and vmmb_torch_free() in any thread, and by
 * vmmb_torch_release_all(); at exit the broker takes back what is left. It
 * is freed with vmmb_free_keep(): the broker keeps it, still mapped, for the
 * next segment of its size, until another call waits for room (then the
 * library gives it back), vmmb_torch_release_all() or vmmb_torch_sleep(). When the event cannot be recorded, it
 * waits for @stream (then for the whole context) instead. A segment whose
 * work the driver cannot say is done (its context failed) is never unmapped:
 * the broker takes it back when the process exits.
 * Work queued on other streams is not waited for: PyTorch's caching allocator
 * waits for the segment's other streams before it frees it.
 */
void vmmb_torch_free(void *ptr, ssize_t size, int device, void *stream);

/**
 * vmmb_torch_release_all() - give back every segment of vmmb_torch_alloc() still leased.
 *
 * For a pool being torn down: waits for the frees of vmmb_torch_free() still
 * pending, gives back the segments kept for reuse (vmmb_give_back_kept()),
 * then, for each device with segments that were never freed, synchronizes
 * its primary context (all work on the device in this process) and frees
 * them. Call it only when nothing will use those segments again
 * (every PyTorch pool that allocated through these functions is gone);
 * vmmb_torch_free() of one of them afterwards is ignored. Frees made at the
 * same time in other threads finish on their own.
 *
 * Return: the number of segments given back that were never freed with
 * vmmb_torch_free(), or a negative errno when some segment could not be given
 * back (the first failure; vmmb_error_message() says why): those whose context
 * failed stay leased until the process exits, and the others are freed.
 */
int vmmb_torch_release_all(void);

/**
 * vmmb_torch_sleep() - park every segment of vmmb_torch_alloc() still leased, keeping their addresses.
 * @stream: a stream (a cudaStream_t) whose queued work may use the segments, waited for before each is
 *          unmapped; NULL waits for all the work of each segment's device's primary context (PyTorch's).
 *
 * For an engine put to sleep: first waits for the frees of vmmb_torch_free()
 * still pending and gives those back, with the segments kept for reuse
 * (vmmb_give_back_kept()), then parks each live segment with
 * vmmb_lease_park(), in the primary context of its device: its content goes
 * to host memory and its device memory back to the broker, while its address
 * stays reserved, so PyTorch's tensors (and its caching allocator's blocks,
 * free or not) keep their data pointers. Nothing may use the segments until
 * vmmb_torch_wake(): no kernel, copy, allocation from the pool or free of a
 * tensor in it (PyTorch may reuse a cached block, whose memory is not
 * mapped). Segments parked already are passed over, so calling it twice
 * parks what was allocated in between. Must not run at the same time as
 * vmmb_torch_alloc(), vmmb_torch_free() or vmmb_torch_wake() in other threads.
 *
 * Return: the number of segments parked by this call, or a negative errno
 * (the first failure; vmmb_error_message() says why). When waiting for the
 * pending frees or giving back the kept segments fails, it returns that
 * error at once, with nothing parked. Otherwise it tries every segment: those
 * parked stay parked (vmmb_torch_wake() brings them back), the others stay
 * mapped. The errors are those of vmmb_lease_park(), or the driver's when the
 * primary context cannot be used.
 */
int vmmb_torch_sleep(void *stream);

/**
 * vmmb_torch_wake() - unpark every segment vmmb_torch_sleep() parked, at the same addresses.
 *
 * Unparks each parked segment with vmmb_lease_unpark(): fresh device memory
 * with the content the segment had, mapped at its address, so tensors read
 * what they held before the sleep. Threading as vmmb_torch_sleep().
 *
 * Return: the number of segments unparked, or a negative errno (the first
 * failure, such as -ENOMEM when the device has no room now) after trying
 * every segment: those unparked are usable, the others stay parked and a
 * later call tries them again.
 */
int vmmb_torch_wake(void);

/**
 * vmmb_torch_lease_id() - the lease that holds a pointer of vmmb_torch_alloc().
 * @ptr: the pointer vmmb_torch_alloc() returned, or any address inside its segment.
 * @buf: where to write the lease's identifier (as vmmb_lease_id() gives it), with its NUL.
 * @size: bytes at @buf.
 *
 * Return: the identifier's length (without the NUL), or a negative errno:
 * -ENOENT when no segment still leased holds @ptr, -ERANGE when @size is too
 * small, -EINVAL for a NULL @buf.
 */
int vmmb_torch_lease_id(const void *ptr, char *buf, size_t size);

/**
 * vmmb_error_message() - what went wrong in the calling thread's last failed call.
 *
 * Every failing call sets the calling thread's message (vmmb_close() aside);
 * successful calls do not clear it, and one that succeeded on a second try
 * (vmmb_alloc() after giving back kept leases) may have set it on the first:
 * check return values, not this.
 *
 * Return: a sentence for a person (the broker's own message when it refused a
 * request), valid until the thread's next call into the library; "" if no
 * call has failed in this thread.
 */
const char *vmmb_error_message(void);

#ifdef __cplusplus
}
#endif
