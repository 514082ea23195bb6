/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Lease events, sent to the journal with structured fields, and counted
 * (metrics.h). docs/metrics.md lists the events, their MESSAGE_IDs and
 * fields:
 *
 *   made          a lease was made (Alloc)                         INFO
 *   ended         a lease ended: freed, unpublished, or its last   INFO
 *                 holder exited
 *   reclaimed     the hold of a process that exited was dropped    INFO
 *   published     a lease was published under a name               INFO
 *   unpublished   a name was taken away                            INFO
 *   parked        a lease's content moved into host memory (Park)  INFO
 *   unparked      ... and back into device memory                  INFO
 *   store failed  storing the table for restarts began to fail     ERR
 *   store recovered  ... and works again                           NOTICE
 *
 * Every field is VMMBROKER_*: LEASE, UID (the owner), PID, HOLDER_UID and COMM
 * (the process that asked, or that exited), DEVICE, SIZE (bytes), NAME, EVENT;
 * ERRNO for the store's.
 *
 * Sending never blocks the daemon: the events go on a non-blocking datagram
 * socket of the daemon's own, connected to journald's native socket
 * (/run/systemd/journal/socket, or $VMMBROKER_JOURNAL_SOCKET for tests), one
 * send() each; an event the socket does not take (journald behind, or not
 * running) is dropped and counted (vmmbroker_journal_events_dropped_total).
 * Without a journal socket at start nothing is sent; the socket is looked for
 * again at most every EVENTS_RETRY_USEC.
 *
 * The broker's rules call these functions after a change is made, before
 * the memory it concerns is freed; each is one line in broker.c.
 */

#include <stdbool.h>

#include "holder.h"
#include "lease.h"

#define EVENTS_RETRY_USEC (UINT64_C(10) * 1000000)

/* Alloc made lease l for holder h. */
void event_lease_made(const Lease *l, const Holder *h);

/* A Free is about to drop one reference of `hold`: when it is the last and so ends the lease, "ended". */
void event_hold_freed(const Hold *hold);

/* The hold of an exited process is about to be dropped: "reclaimed", and "ended" when it ends the lease. */
void event_hold_reclaimed(const Hold *hold);

/* Lease l was published under its name by h. */
void event_lease_published(const Lease *l, const Holder *h);

/* Lease l's content moved into host memory when h parked it (`parked`), or back into device memory for h. */
void event_lease_parked(const Lease *l, const Holder *h, bool parked);

/* Lease l's name is about to be taken away by h: "unpublished", and "ended" when nobody holds it. */
void event_lease_unpublished(const Lease *l, const Holder *h);

/* Storing went from `old` to `now` (0, or a negative errno): "store failed" or "store recovered" on a change. */
void event_store_health(int old, int now);

/*
 * Where events go: the real sender, or (tests) a function given each event as one buffer of KEY=VALUE
 * lines, as journald's native protocol has it. NULL puts the real one back.
 */
void events_set_sink(void (*sink)(const char *buf, size_t len, void *userdata), void *userdata);

/* Closes the journal socket (at exit, and for tests). */
void events_close(void);
