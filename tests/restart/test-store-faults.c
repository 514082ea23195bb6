/* SPDX-License-Identifier: MIT */

/*
 * A store that fails is not acknowledged; a crash loses nothing acknowledged and brings back nothing ended.
 *
 * The daemon runs under the test supervisor (tests/supervisor, systemd's fd store without systemd) and keeps
 * its lease table in one memfd in the store ("table-<generation>"), one record appended per change. Its
 * test hook $VMMBROKER_TEST_STORE_FAULT="STEP:N[:crash]" (STEP: write, grow, seal, notify) makes the Nth
 * operation of that step since the daemon's start fail with EIO, or with ":crash" makes the daemon abort()
 * right there (a write after writing part of its record). A request whose change could not be stored gets
 * io.vmmbroker.StoreFailed {message} and changes nothing; the next one may succeed.
 *
 * The start itself stores a snapshot (writes, seals, notifies), so the test does not guess which N falls
 * on which request: for each STEP it scans N = 1..M. Each run starts a fresh supervisor and daemon with the
 * fault, lets a client process (kept alive: it is the holder) make a fixed script of requests on one
 * connection, recording for each whether it was acknowledged, refused with StoreFailed, or lost with the
 * daemon (":crash"); then restarts the daemon with SIGKILL and without the fault and checks, with
 * List(all) as root, that
 *  - every acknowledged Alloc whose lease was not acknowledged freed is there, held by the client;
 *  - every acknowledged Free's lease is gone; a Free refused with StoreFailed left its lease;
 *  - an Alloc refused with StoreFailed left nothing; an acknowledged Publish's name is there, a refused
 *    one's is not; an acknowledged Share's token still attaches while its lease lives;
 *  - the one request that was in flight when the daemon died is all there or all absent: at most one
 *    unknown lease, of that Alloc's size, held by the client;
 *  - nothing else is there.
 * When a request was refused, the supervisor's STATUS= must be non-empty; and it must differ from the one
 * before the refusal in every run of "write" whose first refusal is a change's own commit failing (its
 * exact text is not fixed: it is printed): the daemon says so before it answers. (A first refusal that
 * follows a failed snapshot, as for "grow" or "notify", may find STATUS= saying so already.) And the hook must be
 * honoured: some N of "write" must refuse a request, and some N of "write:crash" must kill the daemon
 * during the script.
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "harness.h"
#include "json.h"
#include "macro.h"
#include "rawclient.h"
#include "supervisor.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)
#define STORE_MAX 4096
#define FAULT_ENV "VMMBROKER_TEST_STORE_FAULT"
#define ERROR_STORE_FAILED "io.vmmbroker.StoreFailed"
#define PUBLISH_NAME "store-faults"
#define N_LEASES 5

/* ---- the script ---------------------------------------------------------------------------------------- */

typedef enum StepKind { STEP_ALLOC, STEP_FREE, STEP_SHARE, STEP_PUBLISH } StepKind;

typedef struct Step {
        StepKind kind;
        unsigned lease;                 /* which of the script's leases */
        uint64_t size;                  /* an Alloc's size: each lease its own, so that an unknown one is known */
} Step;

static const Step script[] = {
        { STEP_ALLOC, 0, 4 * MiB },
        { STEP_ALLOC, 1, 2 * MiB },
        { STEP_ALLOC, 2, 6 * MiB },
        { STEP_FREE, 0, 0 },
        { STEP_SHARE, 1, 0 },
        { STEP_PUBLISH, 2, 0 },
        { STEP_ALLOC, 3, 8 * MiB },
        { STEP_ALLOC, 4, 10 * MiB },
        { STEP_FREE, 1, 0 },
};
#define N_STEPS ELEMENTSOF(script)

static const char *const step_names[] = { "Alloc", "Free", "Share", "Publish" };

typedef enum Outcome {
        OUT_ACK,                        /* a successful reply */
        OUT_STORE_FAILED,               /* io.vmmbroker.StoreFailed with a message */
        OUT_LOST,                       /* no reply: the connection ended (the daemon died) */
        OUT_SKIPPED,                    /* not sent: the connection was lost before, or its lease never existed */
        OUT_OTHER,                      /* any other reply: a failure */
} Outcome;

static const char *const outcome_names[] = { "ack", "StoreFailed", "lost", "skipped", "other" };

typedef struct StepReport {
        int outcome;
        char id[VMMB_ID_MAX + 1];       /* an acknowledged Alloc's lease */
        char token[VMMB_TOKEN_MAX + 1]; /* an acknowledged Share's token */
        char error[256];                /* OUT_OTHER: what came */
} StepReport;

/* ---- the client: one step per command, on one connection; the holder of the leases ------------------- */

typedef struct ClientArgs {
        const char *socket;
        int report_w, hold_r;
} ClientArgs;

static Outcome outcome_of(const Reply *r, StepReport *rep) {
        const char *message;

        if (!r->error)
                return OUT_ACK;
        message = reply_str(r, "message");
        if (strcmp(r->error, ERROR_STORE_FAILED) == 0 && message)
                return OUT_STORE_FAILED;
        snprintf(rep->error, sizeof(rep->error), "%s %s", r->error, json_object_to_json_string(r->params));
        return OUT_OTHER;
}

static int child_client(void *arg) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char ids[N_LEASES][VMMB_ID_MAX + 1] = {};
        ClientArgs *a = arg;
        bool lost = false;
        char cmd;
        int k;

        CHILD_CHECK(close_all_but((const int[]){ a->report_w, a->hold_r }, 2) == 0, "close fds");
        k = conn_open(a->socket, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        CHILD_CHECK(pipe_put(a->report_w, 'c') == 0, "pipe");

        for (size_t i = 0; i < N_STEPS; i++) {
                const Step *s = &script[i];
                StepReport rep = { .outcome = OUT_SKIPPED };
                char params[256];
                Reply r = {};

                CHILD_CHECK(pipe_get(a->hold_r, &cmd, 1) == 1, "no command for step %zu", i);
                if (lost || (s->kind != STEP_ALLOC && !ids[s->lease][0])) {
                        CHILD_CHECK(write(a->report_w, &rep, sizeof(rep)) == (ssize_t)sizeof(rep), "pipe");
                        continue;
                }
                switch (s->kind) {
                case STEP_ALLOC:
                        snprintf(params, sizeof(params), "{\"size\": %" PRIu64 "}", s->size);
                        k = call_text(c, VMMB_METHOD_ALLOC, params, &r);
                        break;
                case STEP_FREE:
                        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", ids[s->lease]);
                        k = call_text(c, VMMB_METHOD_FREE, params, &r);
                        break;
                case STEP_SHARE:
                        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", ids[s->lease]);
                        k = call_text(c, VMMB_METHOD_SHARE, params, &r);
                        break;
                case STEP_PUBLISH:
                        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"name\": \"%s\"}", ids[s->lease],
                                 PUBLISH_NAME);
                        k = call_text(c, VMMB_METHOD_PUBLISH, params, &r);
                        break;
                }
                if (k < 0) {
                        rep.outcome = OUT_LOST;
                        lost = true;
                } else {
                        rep.outcome = outcome_of(&r, &rep);
                        if (rep.outcome == OUT_ACK && s->kind == STEP_ALLOC) {
                                TestLease l;

                                CHILD_CHECK(lease_take(&r, &l) == 0, "lease");
                                test_lease_close(&l);   /* the process holds it, not the fds */
                                snprintf(ids[s->lease], sizeof(ids[s->lease]), "%s", l.id);
                                snprintf(rep.id, sizeof(rep.id), "%s", l.id);
                        }
                        if (rep.outcome == OUT_ACK && s->kind == STEP_SHARE) {
                                const char *t = reply_str(&r, "token");

                                CHILD_CHECK(t, "Share without a token");
                                snprintf(rep.token, sizeof(rep.token), "%s", t);
                        }
                        if (rep.outcome == OUT_ACK && s->kind == STEP_FREE)
                                ids[s->lease][0] = 0;
                        reply_done(&r);
                }
                CHILD_CHECK(write(a->report_w, &rep, sizeof(rep)) == (ssize_t)sizeof(rep), "pipe");
        }
        /* Holds its leases until the test has checked them. */
        CHILD_CHECK(pipe_wait_eof(a->hold_r) == 0, "hold");
        return 0;
}

/* ---- one run ------------------------------------------------------------------------------------------- */

typedef struct Run {
        char fault[32];
        bool crash;
        bool start_failed;              /* the fault hit the start: the daemon never got ready */
        bool died;                      /* the daemon died during the script */
        int exit_status;
        unsigned store_failed;          /* requests refused with StoreFailed */
        StepReport rep[N_STEPS];
        char *status_before, *status_after;     /* STATUS= before and after the first refusal */
} Run;

static Supervisor *supervisor_make(char *dir, size_t dir_len) {
        static char socket_arg[128], config_arg[128];
        const char *daemon = getenv("VMMBROKER_DAEMON");
        Supervisor *s = NULL;

        ck_assert_ptr_nonnull(daemon);
        snprintf(dir, dir_len, "/tmp/vmmb-storefault-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(dir));
        snprintf(socket_arg, sizeof(socket_arg), "%s/not-inherited", dir);
        snprintf(config_arg, sizeof(config_arg), "%s/vmmbroker.conf", dir);   /* missing: the defaults */
        ck_assert_int_eq(supervisor_new(&(SupervisorOptions){
                                 .path = daemon,
                                 .argv = (const char *const[]){ daemon, "--socket", socket_arg, "--config", config_arg,
                                                                NULL },
                                 .fd_store_max = STORE_MAX,
                         }, &s), 0);
        return s;
}

/* Starts the daemon with `fault` in its environment (NULL: none); returns what supervisor_wait_ready() did. */
static int64_t start_with(Supervisor *s, const char *fault) {
        int64_t ready;

        if (fault)
                ck_assert_int_eq(setenv(FAULT_ENV, fault, 1), 0);
        else
                ck_assert_int_eq(unsetenv(FAULT_ENV), 0);
        ck_assert_int_eq(supervisor_start(s), 0);
        ck_assert_int_eq(unsetenv(FAULT_ENV), 0);
        ready = supervisor_wait_ready(s, 60000);
        ck_assert_msg(ready >= 0 || ready == -ECHILD, "the daemon (%s=%s) neither got ready nor exited: %s", FAULT_ENV,
                      fault ?: "", strerror((int)-ready));
        return ready;
}

/* STATUS= after every notification the daemon sent before answering a round trip of ours. */
static char *status_now(Supervisor *s) {
        WireDevice d;

        ck_assert_int_eq(harness_status(supervisor_socket_path(s), &d), 0);
        return supervisor_status(s);
}

static const char *lease_id(const Run *run, unsigned lease) {
        for (size_t i = 0; i < N_STEPS; i++)
                if (script[i].kind == STEP_ALLOC && script[i].lease == lease && run->rep[i].outcome == OUT_ACK)
                        return run->rep[i].id;
        return NULL;
}

/* The outcome of the step of `kind` on `lease`, OUT_SKIPPED when the script has none. */
static Outcome outcome_for(const Run *run, StepKind kind, unsigned lease, size_t *ret_step) {
        for (size_t i = 0; i < N_STEPS; i++)
                if (script[i].kind == kind && script[i].lease == lease) {
                        if (ret_step)
                                *ret_step = i;
                        return run->rep[i].outcome;
                }
        return OUT_SKIPPED;
}

/* After the restart without the fault: the leases are exactly what was acknowledged. */
static void check_after(Supervisor *s, const Run *run, pid_t holder) {
        ListReply list = {};
        bool known[64] = {};
        unsigned unknown = 0;

        ck_assert_int_eq(list_get(supervisor_socket_path(s), true, &list), 0);
        ck_assert_uint_le(list.n_leases, ELEMENTSOF(known));
        for (unsigned l = 0; l < N_LEASES; l++) {
                const char *id = lease_id(run, l);
                const WireLeaseInfo *info;
                Outcome free_out, pub;
                size_t alloc_step = 0;

                (void)outcome_for(run, STEP_ALLOC, l, &alloc_step);
                if (!id)
                        continue;       /* never acknowledged: see the unknown ones below */
                info = list_find(&list, id);
                if (info)
                        known[info - list.leases] = true;
                free_out = outcome_for(run, STEP_FREE, l, NULL);
                if (free_out == OUT_ACK) {
                        ck_assert_msg(!info, "%s: lease %u (%s) was freed, acknowledged, and came back", run->fault, l,
                                      id);
                        continue;
                }
                if (free_out != OUT_LOST)
                        ck_assert_msg(info, "%s: lease %u (%s) was acknowledged and is lost (its Free: %s)", run->fault,
                                      l, id, outcome_names[free_out]);
                if (!info)
                        continue;       /* the Free in flight when the daemon died took effect: allowed */
                ck_assert_uint_eq(info->size, script[alloc_step].size);
                ck_assert_msg(info->n_holders == 1 && info->holders[0].pid == holder,
                              "%s: lease %u (%s) is not held by its client (pid %d) alone", run->fault, l, id,
                              (int)holder);
                pub = outcome_for(run, STEP_PUBLISH, l, NULL);
                if (pub == OUT_ACK)
                        ck_assert_msg(info->name && strcmp(info->name, PUBLISH_NAME) == 0,
                                      "%s: lease %u's acknowledged name is lost", run->fault, l);
                else if (pub != OUT_LOST)
                        ck_assert_msg(!info->name, "%s: lease %u has a name its Publish did not get (%s)", run->fault,
                                      l, outcome_names[pub]);
        }
        /* An acknowledged token attaches as long as its lease lives. */
        for (size_t i = 0; i < N_STEPS; i++) {
                _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
                char params[128];
                TestLease t;
                Reply r;

                if (script[i].kind != STEP_SHARE || run->rep[i].outcome != OUT_ACK ||
                    !list_find(&list, lease_id(run, script[i].lease)))
                        continue;
                ck_assert_int_eq(conn_open(supervisor_socket_path(s), &c), 0);
                snprintf(params, sizeof(params), "{\"token\": \"%s\"}", run->rep[i].token);
                ck_assert_int_eq(call_text(c, VMMB_METHOD_ATTACH, params, &r), 0);
                ck_assert_msg(!r.error, "%s: the acknowledged token of lease %u does not attach: %s", run->fault,
                              script[i].lease, r.error);
                ck_assert_int_eq(lease_take(&r, &t), 0);
                reply_done(&r);
                test_lease_close(&t);
                ck_assert_int_eq(lease_free(c, t.id), 0);       /* our hold only: the client's stays */
        }
        /* Anything else is the one Alloc in flight when the daemon died, whole. */
        for (size_t j = 0; j < list.n_leases; j++) {
                const WireLeaseInfo *info = &list.leases[j];
                bool allowed = false;

                if (known[j])
                        continue;
                unknown++;
                for (size_t i = 0; i < N_STEPS; i++)
                        if (script[i].kind == STEP_ALLOC && run->rep[i].outcome == OUT_LOST &&
                            info->size == script[i].size)
                                allowed = true;
                ck_assert_msg(allowed, "%s: lease %s (%" PRIu64 " bytes) is there and was never acknowledged", run->fault,
                              info->id, info->size);
                ck_assert_msg(info->n_holders == 1 && info->holders[0].pid == holder,
                              "%s: the unacknowledged lease %s is not held by the client", run->fault, info->id);
                ck_assert_msg(!info->name, "%s: the unacknowledged lease %s has a name", run->fault, info->id);
        }
        ck_assert_uint_le(unknown, 1);
        list_reply_done(&list);
}

static void run_one(Run *run) {
        char dir[64], x;
        Supervisor *s;
        HeldChild client;
        ClientArgs a;
        int64_t ready;

        s = supervisor_make(dir, sizeof(dir));
        ready = start_with(s, run->fault);
        if (ready < 0) {
                /* The fault hit the start's own snapshot: nothing was acknowledged. */
                run->start_failed = true;
                run->exit_status = supervisor_stop(s, SIGKILL);
                for (size_t i = 0; i < N_STEPS; i++)
                        run->rep[i].outcome = OUT_SKIPPED;
                ck_assert_int_ge(start_with(s, NULL), 0);
                check_after(s, run, 0);
                ck_assert_int_eq(supervisor_stop(s, SIGTERM), 0);
                supervisor_free(s);
                (void)rmdir(dir);
                return;
        }

        a = (ClientArgs){ .socket = supervisor_socket_path(s) };
        ck_assert_int_eq(held_child_start(child_client, &a, &a.report_w, &a.hold_r, &x, 1, &client), 0);
        for (size_t i = 0; i < N_STEPS; i++) {
                _cleanup_free_ char *before = NULL;

                if (!run->crash && run->store_failed == 0 && !run->died)
                        before = status_now(s);
                ck_assert_int_eq(pipe_put(client.hold_w, 's'), 0);
                ck_assert_msg(pipe_get_all(client.report_r, &run->rep[i], sizeof(run->rep[i])) == 0,
                              "%s: the client did not report step %zu (see its stderr)", run->fault, i);
                ck_assert_msg(run->rep[i].outcome != OUT_OTHER, "%s: step %zu (%s) got %s", run->fault, i,
                              step_names[script[i].kind], run->rep[i].error);
                if (run->rep[i].outcome == OUT_LOST) {
                        ck_assert_msg(run->crash, "%s: the daemon went away during step %zu without :crash",
                                      run->fault, i);
                        run->died = true;
                }
                if (run->rep[i].outcome == OUT_STORE_FAILED) {
                        ck_assert_msg(!run->crash, "%s: step %zu was refused, but :crash asked for an abort", run->fault,
                                      i);
                        if (run->store_failed++ == 0) {
                                /* Right away, without another round trip: a daemon that stores again at its
                                 * next chance may already have said that it works again. */
                                run->status_before = TAKE_PTR(before);
                                run->status_after = supervisor_status(s);
                        }
                }
        }

        /* Down by SIGKILL (or by its own abort), up again without the fault. */
        if (run->died) {
                run->exit_status = supervisor_wait_exit(s, 30000);
                ck_assert_msg(run->exit_status == 128 + SIGABRT, "%s: the daemon died with status %d, not by abort()",
                              run->fault, run->exit_status);
        } else
                run->exit_status = supervisor_stop(s, SIGKILL);
        ck_assert_int_ge(start_with(s, NULL), 0);
        check_after(s, run, client.pid);

        ck_assert_int_eq(held_child_finish(&client), 0);
        ck_assert_int_eq(supervisor_stop(s, SIGTERM), 0);
        supervisor_free(s);
        (void)rmdir(dir);
}

static void run_print(const Run *run) {
        fprintf(stderr, "store faults: %-16s", run->fault);
        if (run->start_failed) {
                fprintf(stderr, " the daemon did not start (status %d)\n", run->exit_status);
                return;
        }
        for (size_t i = 0; i < N_STEPS; i++)
                fprintf(stderr, " %s %u:%s", step_names[script[i].kind], script[i].lease,
                        outcome_names[run->rep[i].outcome]);
        if (run->died)
                fprintf(stderr, " (died, status %d)", run->exit_status);
        fputc('\n', stderr);
        if (run->store_failed > 0)
                fprintf(stderr, "store faults: %-16s STATUS= before the refusal \"%s\", after \"%s\"\n", run->fault,
                        run->status_before ?: "(none)", run->status_after ?: "(none)");
}

/*
 * Scans N = 1..max for `step`, with or without :crash; returns how many runs refused a request, in how many
 * of those STATUS= said something else than before the refusal, and how many runs died.
 */
/* What STATUS= begins with while storing fails (manager.c's send_status()). */
#define STATUS_FAILING "Storing the lease table for restarts failed"

static void scan(const char *step, unsigned max, bool crash, unsigned *ret_refused, unsigned *ret_status,
                 unsigned *ret_died) {
        *ret_refused = *ret_status = *ret_died = 0;
        for (unsigned n = 1; n <= max; n++) {
                Run run = { .crash = crash };

                snprintf(run.fault, sizeof(run.fault), "%s:%u%s", step, n, crash ? ":crash" : "");
                run_one(&run);
                run_print(&run);
                if (run.store_failed > 0) {
                        ck_assert_msg(run.status_after && *run.status_after,
                                      "%s: no STATUS= while storing failed", run.fault);
                        (*ret_refused)++;
                        /* Storing worked until this refusal: the daemon said it fails before answering. */
                        if (!run.status_before || !strstr(run.status_before, STATUS_FAILING)) {
                                ck_assert_msg(strstr(run.status_after, STATUS_FAILING),
                                              "%s: STATUS= \"%s\" when the refusal came", run.fault,
                                              run.status_after);
                                (*ret_status)++;
                        }
                }
                if (run.died || run.start_failed)
                        (*ret_died)++;
                free(run.status_before);
                free(run.status_after);
        }
}

static void no_core_dumps(void) {
        /* an abort() asked for is not a crash to keep */
        ck_assert_int_eq(setrlimit(RLIMIT_CORE, &(struct rlimit){ 0, 0 }), 0);
}

/* Writes that fail: each refused request changes nothing, the rest are kept; the hook is honoured. */
START_TEST(test_write_fails) {
        unsigned refused, status, died;

        no_core_dumps();
        scan("write", 16, false, &refused, &status, &died);
        ck_assert_msg(refused > 0, "no N of write:N refused a request with %s: the daemon does not honour %s",
                      ERROR_STORE_FAILED, FAULT_ENV);
        /* Some run must have refused a change while storing had worked until then (checked in scan()). */
        ck_assert_msg(status > 0, "in none of the %u runs that refused a request had storing worked before", refused);
}
END_TEST

/* Aborts in the middle of a write: nothing acknowledged is lost, nothing ended comes back. */
START_TEST(test_write_crashes) {
        unsigned refused, status, died;

        no_core_dumps();
        scan("write", 16, true, &refused, &status, &died);
        ck_assert_msg(died > 0, "no N of write:N:crash killed the daemon: it does not honour %s", FAULT_ENV);
}
END_TEST

/* Growing, sealing and handing the memfd to the service manager, failing or aborting: the same rules, for
 * whichever requests (if any) meet them. */
START_TEST(test_other_steps) {
        static const char *const steps[] = { "grow", "seal", "notify" };
        unsigned refused, status, died;

        no_core_dumps();
        for (size_t i = 0; i < ELEMENTSOF(steps); i++) {
                scan(steps[i], 3, false, &refused, &status, &died);
                fprintf(stderr, "store faults: %s: %u of 3 runs refused a request (STATUS= changed in %u)\n", steps[i],
                        refused, status);
                scan(steps[i], 3, true, &refused, &status, &died);
                fprintf(stderr, "store faults: %s:crash: the daemon died in %u of 3 runs\n", steps[i], died);
        }
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("store faults", NULL, test_write_fails, test_write_crashes, test_other_steps)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
