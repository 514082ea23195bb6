/* SPDX-License-Identifier: MIT */

/*
 * vmmctl: the administrator's view of the broker (its pool, leases, users and
 * a lease's share tokens), and the one change it makes: taking a published
 * lease's name away. Each command makes one (top: three a frame)
 * varlink call on a blocking connection whose reads and writes give up after
 * IO_TIMEOUT_S (a stuck broker is an error, not a hang) and prints the reply
 * as a table for people or, with --json, as the broker's own parameters.
 *
 * Exit status: 0 success; 1 the broker answered with an error or a reply that
 * makes no sense; 2 a usage error; 3 the broker cannot be reached.
 */

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <locale.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "json.h"
#include "macro.h"
#include "size.h"
#include "table.h"
#include "varlink.h"
#include "vmmbroker.h"

#define IO_TIMEOUT_S 30                 /* longest wait for the broker to accept, read or answer */
#define BAR_CELLS 20                    /* the usage bar's cells when there is room */
#define BAR_FRAME (sizeof("[] 100%") - 1) /* what the bar cell holds besides the cells */
#define BAR_PERCENT (sizeof("100%") - 1) /* a usage column too narrow for a bar shows the percentage alone */
#define DEFAULT_COLUMNS 80              /* a terminal that does not say its width */

#define ANSI_BOLD "\033[1m"
#define ANSI_LEASED "\033[1;31m"        /* bold red */
#define ANSI_CACHED "\033[33m"          /* yellow */
#define ANSI_FREE "\033[32m"            /* green */
#define ANSI_RESET "\033[0m"

enum {
        EXIT_BROKER_ERROR = 1,          /* the broker refused, or its reply made no sense */
        EXIT_USAGE = 2,
        EXIT_UNREACHABLE = 3,
        CALL_DENIED = 100,              /* not an exit status: broker_call() with ctx->quiet_denied was refused */
};

typedef struct Args {
        const char *socket;
        bool json;
        bool all;
        bool legend;
        double interval;                /* top: seconds between refreshes */
        bool once;                      /* top: print one frame and exit */
        bool has_interval;
} Args;

/* What a command works with: the options, the output's kind and the connection (made on first use). */
typedef struct Context {
        const Args *args;
        const char *socket;
        size_t columns;                 /* the terminal's width; 0 when stdout is not a terminal, or with --json */
        bool color;
        const char *ellipsis;
        VarlinkConn *conn;
        FILE *out;                      /* where tables go: stdout, or vmmctl top's frame */
        bool quiet_denied;              /* broker_call() returns CALL_DENIED for PermissionDenied, silently */
} Context;

typedef struct Verb {
        const char *name;
        unsigned min_args;              /* arguments after the command's name */
        unsigned max_args;
        const char *args_name;          /* what they are, for the usage error when they are missing */
        bool takes_all;                 /* --all means something to it */
        int (*run)(Context *ctx, int argc, char **argv);
} Verb;

_printf_(1, 2) static void log_error(const char *fmt, ...) {
        va_list ap;

        fputs("vmmctl: ", stderr);
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
}

_printf_(1, 2) static int usage_error(const char *fmt, ...);

/*
 * For the system service's socket: what systemd says of vmmbroker.service (its state, and its last
 * STATUS=, where a daemon that cannot serve says why), as one line on stderr. Says nothing where there is
 * no systemd or no such unit. systemctl show answers at once: it asks PID 1, and starts nothing.
 */
static void explain_unit(const Context *ctx) {
        char line[1024], active[64] = "", sub[64] = "", result[64] = "", status[768] = "";
        FILE *f;

        if (strcmp(ctx->socket, VMMB_DEFAULT_SOCKET) != 0)
                return;
        f = popen("systemctl show -p ActiveState -p SubState -p Result -p StatusText vmmbroker.service "
                  "2>/dev/null", "re");
        if (!f)
                return;
        while (fgets(line, sizeof(line), f)) {
                line[strcspn(line, "\n")] = 0;
                if (strncmp(line, "ActiveState=", 12) == 0)
                        snprintf(active, sizeof(active), "%.63s", line + 12);
                else if (strncmp(line, "SubState=", 9) == 0)
                        snprintf(sub, sizeof(sub), "%.63s", line + 9);
                else if (strncmp(line, "Result=", 7) == 0)
                        snprintf(result, sizeof(result), "%.63s", line + 7);
                else if (strncmp(line, "StatusText=", 11) == 0)
                        snprintf(status, sizeof(status), "%.767s", line + 11);
        }
        if (pclose(f) != 0 || !*active)
                return;
        fprintf(stderr, "%s: vmmbroker.service is %s (%s%s%s)%s%s\n", program_invocation_short_name, active, sub,
                *result && strcmp(result, "success") != 0 ? ", " : "",
                *result && strcmp(result, "success") != 0 ? result : "", *status ? ": " : "", status);
}

/* --- talking to the broker --------------------------------------------------------------------------- */

static int broker_connect(Context *ctx) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        struct timeval tv = { .tv_sec = IO_TIMEOUT_S };
        _cleanup_close_ int fd = -EBADF;
        int k;

        if (strlen(ctx->socket) >= sizeof(sa.sun_path)) {
                log_error("The socket path %s is longer than %zu bytes; give a shorter one with --socket.",
                          ctx->socket, sizeof(sa.sun_path) - 1);
                return EXIT_UNREACHABLE;
        }
        strcpy(sa.sun_path, ctx->socket);

        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
                log_error("Cannot make a socket: %m");
                return EXIT_UNREACHABLE;
        }
        /* SO_SNDTIMEO also bounds connect() on a broker whose backlog is full. */
        if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0 ||
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0) {
                log_error("Cannot set the socket's timeouts: %m");
                return EXIT_UNREACHABLE;
        }
        if (connect(fd, (const struct sockaddr *)&sa, sizeof(sa)) < 0) {
                if (errno == EAGAIN)
                        log_error("The broker at %s did not accept the connection within %d s. Is vmmbrokerd "
                                  "stuck (systemctl status vmmbroker.service)?", ctx->socket, IO_TIMEOUT_S);
                else {
                        _cleanup_free_ char *message = NULL;

                        vmmb_connect_message(ctx->socket, VMMB_DEFAULT_SOCKET, -errno, &message);
                        log_error("%s", message ?: strerror(errno));
                        explain_unit(ctx);
                }
                return EXIT_UNREACHABLE;
        }
        k = varlink_conn_new(&ctx->conn, fd, VARLINK_MAX_REPLY, false);
        if (k < 0) {
                log_error("Cannot set up the connection: %s", strerror(-k));
                return EXIT_UNREACHABLE;
        }
        TAKE_FD(fd);                    /* the connection owns it */
        return 0;
}

/* Says why talking to the broker failed (`what`: while doing what) and returns the exit status. */
static int broker_io_failed(const Context *ctx, int error, const char *what, const char *method) {
        switch (error) {
        case -EAGAIN:
                log_error("The broker at %s did not answer %s within %d s. Is vmmbrokerd stuck "
                          "(systemctl status vmmbroker.service)?", ctx->socket, method, IO_TIMEOUT_S);
                return EXIT_UNREACHABLE;
        case -ECONNRESET:
        case -EPIPE:
                log_error("The broker at %s closed the connection while %s %s. Did vmmbrokerd stop "
                          "(systemctl status vmmbroker.service)?", ctx->socket, what, method);
                explain_unit(ctx);
                return EXIT_UNREACHABLE;
        case -EBADMSG:
        case -EMSGSIZE:
        case -ENOBUFS:
        case -EPROTO:
                log_error("The broker at %s sent an unreadable reply to %s: %s. Is it a vmmbrokerd of "
                          "another version?", ctx->socket, method, strerror(-error));
                return EXIT_BROKER_ERROR;
        default:
                log_error("Failed %s %s on %s: %s", what, method, ctx->socket, strerror(-error));
                return EXIT_UNREACHABLE;
        }
}

/* Who may make the call `method` that the broker refused with PermissionDenied. */
static const char *permission_hint(const char *method) {
        if (strcmp(method, VMMB_METHOD_UNPUBLISH) == 0)
                return "Only the lease's owner, root and the members of the broker's AdminGroup= "
                       "(vmmbroker.conf(5)) may unpublish it.";
        return "Run it as root or as a member of the broker's AdminGroup= (vmmbroker.conf(5)).";
}

/* What else the broker's error `error` to `method` may mean, or NULL. */
static const char *error_hint(const char *error, const char *method) {
        if (strcmp(error, VMMB_ERROR_PERMISSION_DENIED) == 0)
                return permission_hint(method);
        /* vmmctl holds no lease: only an administrator is shown a lease it does not hold */
        if (strcmp(error, VMMB_ERROR_NO_SUCH_LEASE) == 0 && strcmp(method, VMMB_METHOD_TOKENS) == 0)
                return "Unless vmmctl runs as root or a member of the broker's AdminGroup= (vmmbroker.conf(5)), "
                       "the broker shows it no lease's tokens; the owner's own programs list theirs with "
                       "vmmb_tokens() (libvmmbroker(3)).";
        return NULL;
}

/* Says what the broker's error reply means and how to get past it; returns EXIT_BROKER_ERROR. */
static int broker_refused(const VarlinkReply *reply, const char *method) {
        _cleanup_free_ char *message = NULL;
        const char *hint = error_hint(reply->error, method);

        vmmb_error_describe(reply->error, reply->parameters, method, &message);
        if (hint)
                log_error("%s %s", message ?: "The broker refused the call.", hint);
        else
                log_error("%s", message ?: "The broker refused the call.");
        return EXIT_BROKER_ERROR;
}

/*
 * Calls `method` with `params` (borrowed; NULL is {}). Returns 0 with the
 * reply's parameters in *ret, or the exit status after saying what failed.
 */
static int broker_call(Context *ctx, const char *method, json_object *params, json_object **ret) {
        _cleanup_(json_object_putp) json_object *call = NULL, *msg = NULL;
        VarlinkReply reply = {};
        int k;

        if (!ctx->conn) {
                k = broker_connect(ctx);
                if (k != 0)
                        return k;
        }
        k = varlink_call_new(method, params, false, false, &call);
        if (k == 0)
                k = varlink_conn_send(ctx->conn, call, NULL, 0);
        if (k < 0) {
                log_error("Cannot make the call %s: %s", method, strerror(-k));
                return EXIT_BROKER_ERROR;
        }
        k = varlink_conn_flush(ctx->conn);
        if (k < 0)
                return broker_io_failed(ctx, k, "sending", method);
        k = varlink_conn_receive(ctx->conn, &msg, NULL, NULL);
        if (k < 0)
                return broker_io_failed(ctx, k, "waiting for the reply to", method);
        k = varlink_reply_parse(msg, &reply);
        if (k < 0 || reply.continues) {
                varlink_reply_done(&reply);
                return broker_io_failed(ctx, -EBADMSG, "reading", method);
        }
        if (reply.error && ctx->quiet_denied && strcmp(reply.error, VMMB_ERROR_PERMISSION_DENIED) == 0) {
                varlink_reply_done(&reply);
                return CALL_DENIED;
        }
        if (reply.error) {
                k = broker_refused(&reply, method);
                varlink_reply_done(&reply);
                return k;
        }
        *ret = reply.parameters ? TAKE_PTR(reply.parameters) : json_object_new_object();
        varlink_reply_done(&reply);
        if (!*ret) {
                log_error("Out of memory.");
                return EXIT_BROKER_ERROR;
        }
        return 0;
}

/* For a reply that does not match the interface: says so and returns EXIT_BROKER_ERROR. */
static int reply_unreadable(const Context *ctx, const char *method, int error, const char *message) {
        log_error("The reply of the broker at %s to %s does not match the interface: %s Is it a vmmbrokerd of "
                  "another version?", ctx->socket, method, message ?: strerror(-error));
        return EXIT_BROKER_ERROR;
}

/* --- output ------------------------------------------------------------------------------------------ */

/* Prints reply parameters as --json does: pretty, as the broker sent them (they passed the decoder). */
static int print_json(json_object *params) {
        const char *s = json_object_to_json_string_ext(
                params, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED | JSON_C_TO_STRING_NOSLASHESCAPE);

        if (!s) {
                log_error("Out of memory.");
                return EXIT_BROKER_ERROR;
        }
        puts(s);
        return 0;
}

/* Fits a table to the terminal, if stdout is one; what still does not fit wraps: nothing more can give. */
static void fit_table(const Context *ctx, Table *t) {
        if (ctx->columns > 0)
                (void)table_fit(t, ctx->columns);
}

/* Prints a table as the options say; returns 0 or an exit status. */
static int print_table(const Context *ctx, const Table *t) {
        int k;

        k = table_print(t, ctx->out ?: stdout, ctx->args->legend, ctx->color, ctx->ellipsis);
        if (k < 0) {
                log_error("Cannot print the table: %s", strerror(-k));
                return EXIT_BROKER_ERROR;
        }
        return 0;
}

/* Adds a row of cells; returns 0 or an exit status. */
static int table_add_row(Table *t, const char *const *cells, size_t n) {
        for (size_t i = 0; i < n; i++)
                if (table_add(t, cells[i]) < 0) {
                        log_error("Out of memory.");
                        return EXIT_BROKER_ERROR;
                }
        return 0;
}

/* "45s", "3m12s", "2h05m", "4d03h". */
static char *format_age(uint64_t usec, char *buf, size_t len) {
        uint64_t s = usec / 1000000;

        if (s < 60)
                snprintf(buf, len, "%" PRIu64 "s", s);
        else if (s < 3600)
                snprintf(buf, len, "%" PRIu64 "m%02" PRIu64 "s", s / 60, s % 60);
        else if (s < 86400)
                snprintf(buf, len, "%" PRIu64 "h%02" PRIu64 "m", s / 3600, s / 60 % 60);
        else
                snprintf(buf, len, "%" PRIu64 "d%02" PRIu64 "h", s / 86400, s / 3600 % 24);
        return buf;
}

/* Device memory the pool has not allocated: capacity - leased - scrubbing - cached, at least 0. */
static uint64_t device_free(const WireDevice *d) {
        uint64_t used = d->leased + d->scrubbing + d->cached;

        return used < d->capacity ? d->capacity - used : 0;
}

/* The bar's cells in a usage column `width` cells wide: 0 when only the percentage fits. */
static size_t bar_cells_for(size_t width) {
        return width >= BAR_FRAME + BAR_CELLS ? BAR_CELLS : width > BAR_FRAME ? width - BAR_FRAME : 0;
}

/* Cells of `cells` that `part` of `whole` takes, rounded, at most `cells`. */
static size_t bar_cells(uint64_t part, uint64_t whole, size_t cells) {
        double n;

        if (whole == 0)
                return 0;
        n = (double)part * (double)cells / (double)whole + 0.5;
        return n >= (double)cells ? cells : (size_t)n;
}

/*
 * A usage bar in `cells` cells followed by `percent`: "[###++.......]  21%": `first` of `whole` (#, red),
 * then up to `second` (+, yellow), then the rest (., green). Parts over `whole` fill the bar and no more.
 */
static void format_bar_of(uint64_t first, uint64_t second, uint64_t whole, unsigned percent, size_t cells,
                          bool color, char *buf, size_t len) {
        size_t leased = bar_cells(first, whole, cells);
        size_t held = bar_cells(second, whole, cells);
        FILE *f = fmemopen(buf, len, "w");

        if (!f) {
                snprintf(buf, len, "%u%%", percent);
                return;
        }
        if (held < leased)
                held = leased;
        if (cells == 0) {
                /* the percentage alone, flush left under the column's header */
                fprintf(f, "%u%%", percent);
                fclose(f);
                return;
        }
        fputc('[', f);
        for (size_t i = 0; i < cells; i++) {
                const char *c = i < leased ? ANSI_LEASED : i < held ? ANSI_CACHED : ANSI_FREE;

                /* a colour sequence where the kind of cell changes */
                if (color && (i == 0 || i == leased || i == held))
                        fputs(c, f);
                fputc(i < leased ? '#' : i < held ? '+' : '.', f);
        }
        if (color)
                fputs(ANSI_RESET, f);
        fprintf(f, "] %3u%%", percent);
        fclose(f);
}

/*
 * The usage bar of a device in `cells` cells and its leased percentage: leased (#), then cached and
 * scrubbing (+), then free (.), scaled to the capacity.
 */
static void format_bar(const WireDevice *d, size_t cells, bool color, char *buf, size_t len) {
        format_bar_of(d->leased, d->leased + d->scrubbing + d->cached, d->capacity,
                      (unsigned)bar_cells(d->leased, d->capacity, 100), cells, color, buf, len);
}

#define PERCENT_MAX 999                 /* what the bar's three digits show of a use over the limit */

/*
 * A user's bar on one device: the bytes it owns (#) of its limit (.), and that percentage, which goes over
 * 100 (up to PERCENT_MAX) when the limit was lowered below the use. Bytes under a limit of 0 are 100%.
 */
static void format_user_bar(const WireUserDevice *d, size_t cells, bool color, char *buf, size_t len) {
        double percent;

        if (d->max_bytes == 0)
                percent = d->bytes > 0 ? 100 : 0;
        else
                percent = (double)d->bytes * 100 / (double)d->max_bytes + 0.5;
        format_bar_of(d->bytes, d->bytes, d->max_bytes > 0 ? d->max_bytes : d->bytes,
                      percent >= PERCENT_MAX ? PERCENT_MAX : (unsigned)percent, cells, color, buf, len);
}

/* --- commands ---------------------------------------------------------------------------------------- */

enum {
        STATUS_DEVICE,
        STATUS_NUMA,
        STATUS_NAME,
        STATUS_CAPACITY,
        STATUS_LEASED,
        STATUS_CACHED,
        STATUS_FREE,
        STATUS_LEASES,
        STATUS_WAITERS,
        STATUS_USAGE,
        STATUS_COLUMNS,
};

static const TableColumn status_columns[STATUS_COLUMNS] = {
        [STATUS_DEVICE] = { "DEVICE", TABLE_RIGHT, 0 },
        [STATUS_NUMA] = { "NUMA", TABLE_RIGHT, 0 },       /* the host NUMA node nearest the device */
        [STATUS_NAME] = { "NAME", TABLE_LEFT, 4 },     /* down to "NVI…": real sizes take 9 cells */
        [STATUS_CAPACITY] = { "CAPACITY", TABLE_RIGHT, 0 },
        [STATUS_LEASED] = { "LEASED", TABLE_RIGHT, 0 },
        [STATUS_CACHED] = { "CACHED", TABLE_RIGHT, 0 },
        [STATUS_FREE] = { "FREE", TABLE_RIGHT, 0 },
        [STATUS_LEASES] = { "LEASES", TABLE_RIGHT, 0 },
        [STATUS_WAITERS] = { "WAIT", TABLE_RIGHT, 0 },    /* Alloc calls waiting for room */
        [STATUS_USAGE] = { "USAGE", TABLE_LEFT, BAR_PERCENT },
};

#define BAR_MAX (BAR_CELLS + BAR_FRAME + 64)    /* the bar with its colour sequences */

/* Prints Status' reply as a table. Returns 0 or an exit status. */
static int print_status(Context *ctx, const StatusReply *status) {
        Table *t = NULL;
        int k = 0;

        if (table_new(&t, status_columns, STATUS_COLUMNS) < 0) {
                log_error("Out of memory.");
                return EXIT_BROKER_ERROR;
        }
        for (size_t i = 0; i < status->n_devices && k == 0; i++) {
                const WireDevice *d = &status->devices[i];
                char index[24], numa[24], leases[24], waiters[24], capacity[FORMAT_SIZE_MAX], leased[FORMAT_SIZE_MAX];
                char cached[FORMAT_SIZE_MAX], free_[FORMAT_SIZE_MAX], bar[BAR_MAX];

                snprintf(index, sizeof(index), "%" PRId64, d->index);
                snprintf(leases, sizeof(leases), "%" PRIu64, d->leases);
                /* The device's host NUMA node; "-" when unknown, or from a daemon older than NUMA. */
                if (d->numa_node < 0)
                        snprintf(numa, sizeof(numa), "-");
                else
                        snprintf(numa, sizeof(numa), "%" PRId64, d->numa_node);
                /* Alloc calls waiting for room; "-" from a daemon that has no waiting. */
                if (d->waiters < 0)
                        snprintf(waiters, sizeof(waiters), "-");
                else
                        snprintf(waiters, sizeof(waiters), "%" PRId64, d->waiters);
                format_bar(d, BAR_CELLS, ctx->color, bar, sizeof(bar));
                k = table_add_row(t, (const char *const[]){
                        [STATUS_DEVICE] = index,
                        [STATUS_NUMA] = numa,
                        [STATUS_NAME] = d->name,
                        [STATUS_CAPACITY] = format_size(d->capacity, capacity, sizeof(capacity)),
                        [STATUS_LEASED] = format_size(d->leased, leased, sizeof(leased)),
                        [STATUS_CACHED] = format_size(d->cached, cached, sizeof(cached)),
                        [STATUS_FREE] = format_size(device_free(d), free_, sizeof(free_)),
                        [STATUS_LEASES] = leases,
                        [STATUS_WAITERS] = waiters,
                        [STATUS_USAGE] = bar,
                }, STATUS_COLUMNS);
        }
        if (k == 0 && ctx->columns > 0) {
                /* A narrowed usage column takes a shorter bar rather than an ellipsis. */
                size_t width, cells;

                fit_table(ctx, t);
                width = table_column_width(t, STATUS_USAGE);
                cells = bar_cells_for(width);
                for (size_t i = 0; i < status->n_devices && k == 0; i++) {
                        char bar[BAR_MAX];

                        format_bar(&status->devices[i], cells, ctx->color, bar, sizeof(bar));
                        if (table_set(t, i, STATUS_USAGE, bar) < 0) {
                                log_error("Out of memory.");
                                k = EXIT_BROKER_ERROR;
                        }
                }
        }
        if (k == 0)
                k = print_table(ctx, t);
        table_free(t);
        /* Parked leases are in host memory, not in the table's device columns: a line per device that has any. */
        for (size_t i = 0; i < status->n_devices && k == 0; i++) {
                const WireDevice *d = &status->devices[i];
                char parked[FORMAT_SIZE_MAX], capacity[FORMAT_SIZE_MAX];

                if (d->parked > 0)
                        fprintf(ctx->out ?: stdout, "device %" PRId64 ": %s parked in host memory (HostCapacity= %s)\n",
                                d->index, format_size((uint64_t)d->parked, parked, sizeof(parked)),
                                format_size((uint64_t)MAX(d->host_capacity, 0), capacity, sizeof(capacity)));
        }
        /* Where an Alloc that names no device goes: a choice only when there are several. */
        if (k == 0 && status->n_devices > 1 && status->placement)
                fprintf(ctx->out ?: stdout, "placement: %s (Placement=, for an Alloc that names no device)\n",
                        status->placement);
        return k;
}

static int verb_status(Context *ctx, int argc, char **argv) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        _cleanup_free_ char *message = NULL;
        StatusReply status = {};
        int k;

        k = broker_call(ctx, VMMB_METHOD_STATUS, NULL, &params);
        if (k != 0)
                return k;
        k = status_reply_decode(params, &status, &message);
        if (k < 0)
                return reply_unreadable(ctx, VMMB_METHOD_STATUS, k, message);
        if (ctx->args->json) {
                status_reply_done(&status);
                return print_json(params);
        }
        k = print_status(ctx, &status);
        status_reply_done(&status);
        return k;
}

enum {
        LIST_ID,
        LIST_DEVICE,
        LIST_SIZE,
        LIST_SLABS,
        LIST_OWNER,
        LIST_NAME,
        LIST_LABEL,
        LIST_RECLAIM,
        LIST_AGE,
        LIST_PID,
        LIST_USER,
        LIST_MODE,
        LIST_COMMAND,
        LIST_COLUMNS,
};

/* The lease's own columns first, then its holder's: a continuation row fills only the last four. */
static const TableColumn list_columns[LIST_COLUMNS] = {
        [LIST_ID] = { "ID", TABLE_LEFT, 8 },
        [LIST_DEVICE] = { "DEVICE", TABLE_RIGHT, 0 },
        [LIST_SIZE] = { "SIZE", TABLE_RIGHT, 0 },
        [LIST_SLABS] = { "SLABS", TABLE_RIGHT, 0 },
        [LIST_OWNER] = { "OWNER", TABLE_LEFT, 5 },
        [LIST_NAME] = { "NAME", TABLE_LEFT, 4 },
        [LIST_LABEL] = { "LABEL", TABLE_LEFT, 5 },
        [LIST_RECLAIM] = { "RECLAIM", TABLE_LEFT, 0 },
        [LIST_AGE] = { "AGE", TABLE_RIGHT, 0 },
        [LIST_PID] = { "PID", TABLE_RIGHT, 0 },
        [LIST_USER] = { "USER", TABLE_LEFT, 4 },
        [LIST_MODE] = { "MODE", TABLE_LEFT, 0 },
        [LIST_COMMAND] = { "COMMAND", TABLE_LEFT, 7 },
};

#define USER_MAX 256                    /* a user's name as a table shows it (LOGIN_NAME_MAX) */

/* Oldest first; leases made in the same microsecond by identifier. */
static int lease_compare(const void *a, const void *b) {
        const WireLeaseInfo *x = a, *y = b;

        if (x->created != y->created)
                return x->created < y->created ? -1 : 1;
        return strcmp(x->id, y->id);
}

/* A user's name, or its number when the user database does not know it. */
static const char *format_user(int64_t uid, char *buf, size_t len) {
        const struct passwd *pw = uid >= 0 && uid < (int64_t)UINT32_MAX ? getpwuid((uid_t)uid) : NULL;

        if (pw)
                snprintf(buf, len, "%s", pw->pw_name);
        else
                snprintf(buf, len, "%" PRId64, uid);
        return buf;
}

/*
 * A published name as others attach it: OWNER/NAME, OWNER the owner's user name, or its uid when the name
 * is unknown or would not be read back as this user's (the broker takes an OWNER that begins with a digit
 * for a uid).
 */
static const char *format_published(int64_t uid, const char *name, char *buf, size_t len) {
        char owner[USER_MAX];

        format_user(uid, owner, sizeof(owner));
        if (strlen(owner) > VMMB_USER_NAME_MAX || strchr(owner, '/') || (owner[0] >= '0' && owner[0] <= '9'))
                snprintf(owner, sizeof(owner), "%" PRId64, uid);
        snprintf(buf, len, "%s/%s", owner, name);
        return buf;
}

/* Where a lease stands in reclaiming: "-", "5" (reclaimable, priority 5), "5,asked", "unresponsive". */
static const char *format_reclaim(const WireLeaseInfo *l, char *buf, size_t len) {
        if (!l->reclaim)
                snprintf(buf, len, "-");
        else if (l->reclaim_priority < 0)
                snprintf(buf, len, "%s", l->reclaim);
        else if (strcmp(l->reclaim, "marked") == 0)
                snprintf(buf, len, "%" PRId64, l->reclaim_priority);
        else
                snprintf(buf, len, "%" PRId64 ",%s", l->reclaim_priority, l->reclaim);
        return buf;
}

/*
 * The rows of one lease: the lease with its first holder, then a continuation
 * row (holder columns only) for each further holder. A lease nobody holds (a
 * published one) shows "-" for the holder. Returns 0 or an exit status.
 */
static int list_add_lease(Table *t, const WireLeaseInfo *l, uint64_t now_usec) {
        char device[24], slabs[24], size[FORMAT_SIZE_MAX], age[32], owner[USER_MAX], reclaim[48];
        char name[USER_MAX + 1 + VMMB_LEASE_NAME_MAX + 1] = "-";
        uint64_t created = l->created > 0 ? (uint64_t)l->created : 0;
        int k = 0;

        /* A parked lease's content is in host memory, kept for its device. */
        snprintf(device, sizeof(device), "%" PRId64 "%s", l->device, l->parked ? ":host" : "");
        snprintf(slabs, sizeof(slabs), "%" PRIu64, l->slabs);
        format_user(l->uid, owner, sizeof(owner));
        format_reclaim(l, reclaim, sizeof(reclaim));
        if (l->name)
                format_published(l->uid, l->name, name, sizeof(name));
        for (size_t i = 0; k == 0 && i < (l->n_holders > 0 ? l->n_holders : 1); i++) {
                const WireHolder *h = l->n_holders > 0 ? &l->holders[i] : NULL;
                char pid[24] = "-", user[USER_MAX] = "-";

                if (h) {
                        snprintf(pid, sizeof(pid), "%" PRId64, h->pid);
                        format_user(h->uid, user, sizeof(user));
                }
                k = table_add_row(t, (const char *const[]){
                        [LIST_ID] = i == 0 ? l->id : "",
                        [LIST_DEVICE] = i == 0 ? device : "",
                        [LIST_SIZE] = i == 0 ? format_size(l->size, size, sizeof(size)) : "",
                        [LIST_SLABS] = i == 0 ? slabs : "",
                        [LIST_OWNER] = i == 0 ? owner : "",
                        [LIST_NAME] = i == 0 ? name : "",
                        [LIST_LABEL] = i == 0 ? l->label ?: "-" : "",
                        [LIST_RECLAIM] = i == 0 ? reclaim : "",
                        [LIST_AGE] = i == 0 ? format_age(now_usec > created ? now_usec - created : 0, age,
                                                         sizeof(age))
                                            : "",
                        [LIST_PID] = pid,
                        [LIST_USER] = user,
                        [LIST_MODE] = !h ? "-" : l->kept ? "kept" : h->readonly ? (h->parked ? "ro,parked" : "ro")
                                                                         : (h->parked ? "rw,parked" : "rw"),
                        [LIST_COMMAND] = h && h->comm ? h->comm : "-",
                }, LIST_COLUMNS);
        }
        return k;
}

static int verb_list(Context *ctx, int argc, char **argv) {
        _cleanup_(json_object_putp) json_object *params = NULL, *reply = NULL;
        _cleanup_free_ char *message = NULL;
        ListParams lp = { .all = ctx->args->all };
        ListReply list = {};
        Table *t = NULL;
        struct timespec now;
        uint64_t now_usec;
        int k;

        k = list_params_encode(&lp, &params);
        if (k < 0) {
                log_error("Cannot make the call %s: %s", VMMB_METHOD_LIST, strerror(-k));
                return EXIT_BROKER_ERROR;
        }
        k = broker_call(ctx, VMMB_METHOD_LIST, params, &reply);
        if (k != 0)
                return k;
        k = list_reply_decode(reply, &list, &message);
        if (k < 0)
                return reply_unreadable(ctx, VMMB_METHOD_LIST, k, message);
        if (ctx->args->json) {
                list_reply_done(&list);
                return print_json(reply);
        }

        (void)clock_gettime(CLOCK_REALTIME, &now);
        now_usec = (uint64_t)now.tv_sec * 1000000 + (uint64_t)now.tv_nsec / 1000;
        if (list.n_leases > 0)          /* no leases: no array, and qsort() may not be given NULL */
                qsort(list.leases, list.n_leases, sizeof(list.leases[0]), lease_compare);
        if (table_new(&t, list_columns, LIST_COLUMNS) < 0) {
                log_error("Out of memory.");
                k = EXIT_BROKER_ERROR;
                goto finish;
        }
        for (size_t i = 0; i < list.n_leases && k == 0; i++)
                k = list_add_lease(t, &list.leases[i], now_usec);
        fit_table(ctx, t);
        if (k == 0)
                k = print_table(ctx, t);
        if (k == 0 && list.n_leases == 0 && ctx->args->legend)
                printf("No leases%s.\n", ctx->args->all ? "" : " of yours");
finish:
        table_free(t);
        list_reply_done(&list);
        return k;
}

enum {
        USERS_USER,
        USERS_LEASES,
        USERS_CONNECTIONS,
        USERS_REQUESTS,
        USERS_DEVICE,
        USERS_BYTES,
        USERS_LIMIT,
        USERS_USAGE,
        USERS_COLUMNS,
};

/* The user's own columns first, then its use of one device: a continuation row fills only the last four. */
static const TableColumn users_columns[USERS_COLUMNS] = {
        [USERS_USER] = { "USER", TABLE_LEFT, 4 },
        [USERS_LEASES] = { "LEASES", TABLE_RIGHT, 0 },
        [USERS_CONNECTIONS] = { "CONNECTIONS", TABLE_RIGHT, 0 },
        [USERS_REQUESTS] = { "REQUESTS", TABLE_RIGHT, 0 },
        [USERS_DEVICE] = { "DEVICE", TABLE_RIGHT, 0 },
        [USERS_BYTES] = { "BYTES", TABLE_RIGHT, 0 },
        [USERS_LIMIT] = { "LIMIT", TABLE_RIGHT, 0 },
        [USERS_USAGE] = { "USAGE", TABLE_LEFT, BAR_PERCENT },
};

static int user_compare(const void *a, const void *b) {
        const WireUser *x = a, *y = b;

        return x->uid < y->uid ? -1 : x->uid > y->uid;
}

static int user_device_compare(const void *a, const void *b) {
        const WireUserDevice *x = a, *y = b;

        return x->index < y->index ? -1 : x->index > y->index;
}

/*
 * The rows of one user: its own use and limits with its first device, then a continuation row (device
 * columns only) for each further device. A user of no device shows "-" for one. Returns 0 or an exit status.
 */
static int users_add_user(Table *t, const WireUser *u, size_t bar_cells_n, bool color) {
        char name[USER_MAX], leases[48], connections[48], requests[24];
        int k = 0;

        format_user(u->uid, name, sizeof(name));
        snprintf(leases, sizeof(leases), "%" PRIu64 "/%" PRIu64, u->leases, u->max_leases);
        snprintf(connections, sizeof(connections), "%" PRIu64 "/%" PRIu64, u->connections, u->max_connections);
        snprintf(requests, sizeof(requests), "%" PRIu64, u->requests);
        for (size_t i = 0; k == 0 && i < (u->n_devices > 0 ? u->n_devices : 1); i++) {
                const WireUserDevice *d = u->n_devices > 0 ? &u->devices[i] : NULL;
                char device[24] = "-", bytes[FORMAT_SIZE_MAX] = "-", limit[FORMAT_SIZE_MAX] = "-", bar[BAR_MAX] = "-";

                if (d) {
                        snprintf(device, sizeof(device), "%" PRId64, d->index);
                        format_size(d->bytes, bytes, sizeof(bytes));
                        format_size(d->max_bytes, limit, sizeof(limit));
                        format_user_bar(d, bar_cells_n, color, bar, sizeof(bar));
                }
                k = table_add_row(t, (const char *const[]){
                        [USERS_USER] = i == 0 ? name : "",
                        [USERS_LEASES] = i == 0 ? leases : "",
                        [USERS_CONNECTIONS] = i == 0 ? connections : "",
                        [USERS_REQUESTS] = i == 0 ? requests : "",
                        [USERS_DEVICE] = device,
                        [USERS_BYTES] = bytes,
                        [USERS_LIMIT] = limit,
                        [USERS_USAGE] = bar,
                }, USERS_COLUMNS);
        }
        return k;
}

/* Prints Users' reply as a table (sorting it). Returns 0 or an exit status. */
static int print_users(Context *ctx, UsersReply *users) {
        Table *t = NULL;
        int k = 0;

        /* by user, then by device: no users or devices means no array, and qsort() may not be given NULL */
        if (users->n_users > 0)
                qsort(users->users, users->n_users, sizeof(users->users[0]), user_compare);
        for (size_t i = 0; i < users->n_users; i++)
                if (users->users[i].n_devices > 0)
                        qsort(users->users[i].devices, users->users[i].n_devices,
                              sizeof(users->users[i].devices[0]), user_device_compare);
        if (table_new(&t, users_columns, USERS_COLUMNS) < 0) {
                log_error("Out of memory.");
                return EXIT_BROKER_ERROR;
        }
        for (size_t i = 0; i < users->n_users && k == 0; i++)
                k = users_add_user(t, &users->users[i], BAR_CELLS, ctx->color);
        if (k == 0 && ctx->columns > 0) {
                /* A narrowed usage column takes shorter bars rather than an ellipsis: the rows again. */
                size_t width, cells, row = 0;

                fit_table(ctx, t);
                width = table_column_width(t, USERS_USAGE);
                cells = bar_cells_for(width);
                for (size_t i = 0; i < users->n_users && k == 0; i++) {
                        const WireUser *u = &users->users[i];

                        for (size_t j = 0; j < u->n_devices && k == 0; j++) {
                                char bar[BAR_MAX];

                                format_user_bar(&u->devices[j], cells, ctx->color, bar, sizeof(bar));
                                if (table_set(t, row + j, USERS_USAGE, bar) < 0) {
                                        log_error("Out of memory.");
                                        k = EXIT_BROKER_ERROR;
                                }
                        }
                        row += u->n_devices > 0 ? u->n_devices : 1;
                }
        }
        if (k == 0)                     /* never empty: the caller's own user is always there */
                k = print_table(ctx, t);
        table_free(t);
        /* Parked leases are in host memory, not in BYTES: a line per user and device that has any. */
        for (size_t i = 0; i < users->n_users && k == 0; i++)
                for (size_t j = 0; j < users->users[i].n_devices; j++) {
                        const WireUserDevice *d = &users->users[i].devices[j];
                        char name[USER_MAX], parked[FORMAT_SIZE_MAX], limit[FORMAT_SIZE_MAX];

                        if (d->host_bytes <= 0)
                                continue;
                        fprintf(ctx->out ?: stdout, "%s: %s parked in host memory for device %" PRId64
                                " (MaxHostBytes= %s)\n", format_user(users->users[i].uid, name, sizeof(name)),
                                format_size((uint64_t)d->host_bytes, parked, sizeof(parked)), d->index,
                                format_size((uint64_t)MAX(d->max_host_bytes, 0), limit, sizeof(limit)));
                }
        return k;
}

static int verb_users(Context *ctx, int argc, char **argv) {
        _cleanup_(json_object_putp) json_object *params = NULL, *reply = NULL;
        _cleanup_free_ char *message = NULL;
        ListParams lp = { .all = ctx->args->all };
        UsersReply users = {};
        int k;

        k = list_params_encode(&lp, &params);
        if (k < 0) {
                log_error("Cannot make the call %s: %s", VMMB_METHOD_USERS, strerror(-k));
                return EXIT_BROKER_ERROR;
        }
        k = broker_call(ctx, VMMB_METHOD_USERS, params, &reply);
        if (k != 0)
                return k;
        k = users_reply_decode(reply, &users, &message);
        if (k < 0)
                return reply_unreadable(ctx, VMMB_METHOD_USERS, k, message);
        if (ctx->args->json) {
                users_reply_done(&users);
                return print_json(reply);
        }
        k = print_users(ctx, &users);
        users_reply_done(&users);
        return k;
}

static int verb_unpublish(Context *ctx, int argc, char **argv) {
        _cleanup_(json_object_putp) json_object *params = NULL, *reply = NULL;
        _cleanup_free_ char *message = NULL;
        UnpublishParams up = { .name = argv[0] };
        char buf[VMMB_LEASE_NAME_REF_MAX + 1];
        const char *owner, *name;
        int k;

        /* A name that is neither NAME nor OWNER/NAME is published nowhere: a typo, best said before asking. */
        if (vmmb_lease_name_split(up.name, buf, &owner, &name) < 0)
                return usage_error("'%s' is not a lease name: a name is NAME (your own) or OWNER/NAME (OWNER a "
                                   "user name or uid, as 'vmmctl list' shows it), NAME 1-%d letters, digits and "
                                   "._-:@+ that begin with a letter or digit.", up.name, VMMB_LEASE_NAME_MAX);
        k = unpublish_params_encode(&up, &params);
        if (k < 0) {
                log_error("Cannot make the call %s: %s", VMMB_METHOD_UNPUBLISH, strerror(-k));
                return EXIT_BROKER_ERROR;
        }
        k = broker_call(ctx, VMMB_METHOD_UNPUBLISH, params, &reply);
        if (k != 0)
                return k;
        k = empty_params_decode(reply, NULL, &message);
        if (k < 0)
                return reply_unreadable(ctx, VMMB_METHOD_UNPUBLISH, k, message);
        if (ctx->args->json)
                return print_json(reply);
        return 0;
}

enum {
        TOKENS_TOKEN,
        TOKENS_FOR,
        TOKENS_CREATOR,
        TOKENS_MODE,
        TOKENS_COLUMNS,
};

static const TableColumn tokens_columns[TOKENS_COLUMNS] = {
        [TOKENS_TOKEN] = { "TOKEN", TABLE_LEFT, 8 },
        [TOKENS_FOR] = { "FOR", TABLE_LEFT, 3 },
        [TOKENS_CREATOR] = { "CREATOR", TABLE_LEFT, 4 },
        [TOKENS_MODE] = { "MODE", TABLE_LEFT, 0 },
};

static int verb_tokens(Context *ctx, int argc, char **argv) {
        _cleanup_(json_object_putp) json_object *params = NULL, *reply = NULL;
        _cleanup_free_ char *message = NULL;
        FreeParams fp = { .id = argv[0] };
        TokensReply tokens = {};
        Table *t = NULL;
        int k;

        /* An identifier the broker would refuse is held by no lease: a typo, best said before asking. */
        if (!*fp.id || strlen(fp.id) > VMMB_ID_MAX)
                return usage_error("'%s' is not a lease identifier: 'vmmctl list --all' shows them.", fp.id);
        k = free_params_encode(&fp, &params);
        if (k < 0) {
                log_error("Cannot make the call %s: %s", VMMB_METHOD_TOKENS, strerror(-k));
                return EXIT_BROKER_ERROR;
        }
        k = broker_call(ctx, VMMB_METHOD_TOKENS, params, &reply);
        if (k != 0)
                return k;
        k = tokens_reply_decode(reply, &tokens, &message);
        if (k < 0)
                return reply_unreadable(ctx, VMMB_METHOD_TOKENS, k, message);
        if (ctx->args->json) {
                tokens_reply_done(&tokens);
                return print_json(reply);
        }

        if (table_new(&t, tokens_columns, TOKENS_COLUMNS) < 0) {
                log_error("Out of memory.");
                k = EXIT_BROKER_ERROR;
                goto finish;
        }
        for (size_t i = 0; i < tokens.n_tokens && k == 0; i++) {
                const WireToken *w = &tokens.tokens[i];
                char user[USER_MAX] = "anyone", creator[USER_MAX];

                if (w->uid != JSON_ABSENT)
                        format_user(w->uid, user, sizeof(user));
                k = table_add_row(t, (const char *const[]){
                        [TOKENS_TOKEN] = w->token,
                        [TOKENS_FOR] = user,
                        [TOKENS_CREATOR] = format_user(w->creator, creator, sizeof(creator)),
                        [TOKENS_MODE] = w->readonly ? "ro" : "rw",
                }, TOKENS_COLUMNS);
        }
        fit_table(ctx, t);
        if (k == 0)
                k = print_table(ctx, t);
        if (k == 0 && tokens.n_tokens == 0 && ctx->args->legend)
                printf("No tokens of lease %s.\n", fp.id);
finish:
        table_free(t);
        tokens_reply_done(&tokens);
        return k;
}

static int verb_metrics(Context *ctx, int argc, char **argv) {
        _cleanup_(json_object_putp) json_object *reply = NULL;
        _cleanup_free_ char *message = NULL;
        MetricsReply metrics = {};
        int k;

        k = broker_call(ctx, VMMB_METHOD_METRICS, NULL, &reply);
        if (k != 0)
                return k;
        k = metrics_reply_decode(reply, &metrics, &message);
        if (k < 0)
                return reply_unreadable(ctx, VMMB_METHOD_METRICS, k, message);
        if (ctx->args->json)
                k = print_json(reply);
        else
                fputs(metrics.text, stdout);
        metrics_reply_done(&metrics);
        return k;
}

/* --- top --------------------------------------------------------------------------------------------- */

#define TOP_LEASES_DEFAULT 10           /* largest leases shown when the terminal's height is unknown */

enum {
        TOP_ID,
        TOP_DEVICE,
        TOP_SIZE,
        TOP_OWNER,
        TOP_NAME,
        TOP_LABEL,
        TOP_AGE,
        TOP_HOLDERS,
        TOP_COMMAND,
        TOP_COLUMNS,
};

static const TableColumn top_columns[TOP_COLUMNS] = {
        [TOP_ID] = { "LEASE", TABLE_LEFT, 8 },
        [TOP_DEVICE] = { "DEVICE", TABLE_RIGHT, 0 },
        [TOP_SIZE] = { "SIZE", TABLE_RIGHT, 0 },
        [TOP_OWNER] = { "OWNER", TABLE_LEFT, 5 },
        [TOP_NAME] = { "NAME", TABLE_LEFT, 4 },
        [TOP_LABEL] = { "LABEL", TABLE_LEFT, 5 },
        [TOP_AGE] = { "AGE", TABLE_RIGHT, 0 },
        [TOP_HOLDERS] = { "HOLDERS", TABLE_RIGHT, 0 },
        [TOP_COMMAND] = { "COMMAND", TABLE_LEFT, 7 },
};

/* Largest first; equal sizes oldest first. */
static int lease_size_compare(const void *a, const void *b) {
        const WireLeaseInfo *x = a, *y = b;

        if (x->size != y->size)
                return x->size > y->size ? -1 : 1;
        return lease_compare(a, b);
}

/* The `n` largest leases as a table. Returns 0 or an exit status. */
static int print_top_leases(Context *ctx, ListReply *list, size_t n) {
        struct timespec now;
        uint64_t now_usec;
        Table *t = NULL;
        int k = 0;

        (void)clock_gettime(CLOCK_REALTIME, &now);
        now_usec = (uint64_t)now.tv_sec * 1000000 + (uint64_t)now.tv_nsec / 1000;
        if (list->n_leases > 0)
                qsort(list->leases, list->n_leases, sizeof(list->leases[0]), lease_size_compare);
        if (table_new(&t, top_columns, TOP_COLUMNS) < 0) {
                log_error("Out of memory.");
                return EXIT_BROKER_ERROR;
        }
        for (size_t i = 0; i < list->n_leases && i < n && k == 0; i++) {
                const WireLeaseInfo *l = &list->leases[i];
                char device[24], size[FORMAT_SIZE_MAX], owner[USER_MAX], age[32], holders[24];
                char name[USER_MAX + 1 + VMMB_LEASE_NAME_MAX + 1] = "-";
                uint64_t created = l->created > 0 ? (uint64_t)l->created : 0;

                snprintf(device, sizeof(device), "%" PRId64, l->device);
                snprintf(holders, sizeof(holders), "%zu", l->n_holders);
                if (l->name)
                        format_published(l->uid, l->name, name, sizeof(name));
                k = table_add_row(t, (const char *const[]){
                        [TOP_ID] = l->id,
                        [TOP_DEVICE] = device,
                        [TOP_SIZE] = format_size(l->size, size, sizeof(size)),
                        [TOP_OWNER] = format_user(l->uid, owner, sizeof(owner)),
                        [TOP_NAME] = name,
                        [TOP_LABEL] = l->label ?: "-",
                        [TOP_AGE] = format_age(now_usec > created ? now_usec - created : 0, age, sizeof(age)),
                        [TOP_HOLDERS] = holders,
                        [TOP_COMMAND] = l->n_holders > 0 && l->holders[0].comm ? l->holders[0].comm
                                        : l->comm ?: "-",
                }, TOP_COLUMNS);
        }
        fit_table(ctx, t);
        if (k == 0)
                k = print_table(ctx, t);
        table_free(t);
        return k;
}

/*
 * Calls `method` with {all: true} when the caller is an administrator, else with {} (the caller's own).
 * *all says which was answered. Returns 0 or an exit status.
 */
static int call_all_or_own(Context *ctx, const char *method, bool *all, json_object **ret) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        ListParams lp = { .all = *all };
        int k;

        k = list_params_encode(&lp, &params);
        if (k < 0) {
                log_error("Cannot make the call %s: %s", method, strerror(-k));
                return EXIT_BROKER_ERROR;
        }
        ctx->quiet_denied = *all;
        k = broker_call(ctx, method, params, ret);
        ctx->quiet_denied = false;
        if (k == CALL_DENIED) {
                *all = false;
                return call_all_or_own(ctx, method, all, ret);
        }
        return k;
}

static size_t count_lines(const char *s, size_t len) {
        size_t n = 0;

        for (size_t i = 0; i < len; i++)
                n += s[i] == '\n';
        return n;
}

/* The terminal's height, or 0 when stdout is no terminal. */
static size_t terminal_rows(void) {
        struct winsize ws = {};

        if (!isatty(STDOUT_FILENO))
                return 0;
        if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row > 0)
                return ws.ws_row;
        return 24;
}

/*
 * One frame of top into *ret (malloc'd): a title, the devices, the users and the largest leases, as many as
 * fit `rows` lines (0: TOP_LEASES_DEFAULT). *all starts true and turns false when the broker says the caller
 * is no administrator (then the users and leases are its own). Returns 0 or an exit status.
 */
static int top_frame(Context *ctx, size_t rows, bool *all, char **ret, size_t *ret_len) {
        _cleanup_(json_object_putp) json_object *status_params = NULL, *users_params = NULL, *list_params = NULL;
        _cleanup_free_ char *message = NULL;
        StatusReply status = {};
        UsersReply users = {};
        ListReply list = {};
        char *buf = NULL, clock[32];
        size_t len = 0, used, n_leases;
        time_t now = time(NULL);
        struct tm tm;
        FILE *f;
        int k;

        k = broker_call(ctx, VMMB_METHOD_STATUS, NULL, &status_params);
        if (k == 0)
                k = call_all_or_own(ctx, VMMB_METHOD_USERS, all, &users_params);
        if (k == 0)
                k = call_all_or_own(ctx, VMMB_METHOD_LIST, all, &list_params);
        if (k != 0)
                return k;
        k = status_reply_decode(status_params, &status, &message);
        if (k < 0)
                return reply_unreadable(ctx, VMMB_METHOD_STATUS, k, message);
        k = users_reply_decode(users_params, &users, &message);
        if (k < 0) {
                status_reply_done(&status);
                return reply_unreadable(ctx, VMMB_METHOD_USERS, k, message);
        }
        k = list_reply_decode(list_params, &list, &message);
        if (k < 0) {
                status_reply_done(&status);
                users_reply_done(&users);
                return reply_unreadable(ctx, VMMB_METHOD_LIST, k, message);
        }

        f = open_memstream(&buf, &len);
        if (!f) {
                log_error("Out of memory.");
                k = EXIT_BROKER_ERROR;
                goto finish;
        }
        ctx->out = f;
        strftime(clock, sizeof(clock), "%H:%M:%S", localtime_r(&now, &tm));
        fprintf(f, "vmmctl top: the broker at %s, %s", ctx->socket, clock);
        if (ctx->args->once || rows == 0)
                fputc('\n', f);
        else
                fprintf(f, ", every %gs (q quits)\n", ctx->args->interval);
        fputc('\n', f);
        k = print_status(ctx, &status);
        if (k == 0) {
                fprintf(f, "\n%s\n", *all ? "Users:" : "Your user (every user's needs an administrator):");
                k = print_users(ctx, &users);
        }
        if (k == 0) {
                fflush(f);
                used = count_lines(buf, len) + 3;
                n_leases = rows == 0 ? TOP_LEASES_DEFAULT : rows > used + 1 ? rows - used - 1 : 0;
                fprintf(f, "\n%s (%zu in all):\n", *all ? "Largest leases" : "Your largest leases", list.n_leases);
                if (n_leases > 0)
                        k = print_top_leases(ctx, &list, n_leases);
        }
        ctx->out = NULL;
        if (fclose(f) != 0 && k == 0) {
                log_error("Out of memory.");
                k = EXIT_BROKER_ERROR;
        }
        if (k == 0) {
                *ret = buf;
                *ret_len = len;
                buf = NULL;
        }
        free(buf);
finish:
        status_reply_done(&status);
        users_reply_done(&users);
        list_reply_done(&list);
        return k;
}

static volatile sig_atomic_t top_quit, top_resized;

static void top_on_signal(int sig) {
        if (sig == SIGWINCH)
                top_resized = 1;
        else
                top_quit = 1;
}

static size_t terminal_columns(void);

/*
 * Writes a frame over the previous one: home, each line ended by clearing the rest of it, then clearing
 * what is below the frame. Returns 0 or -errno.
 */
static int top_draw(const char *buf, size_t len) {
        fputs("\033[H", stdout);
        for (size_t i = 0; i < len; i++) {
                if (buf[i] == '\n')
                        fputs("\033[K", stdout);
                fputc(buf[i], stdout);
        }
        fputs("\033[J", stdout);
        return fflush(stdout) == 0 ? 0 : -errno;
}

static int verb_top(Context *ctx, int argc, char **argv) {
        bool live = !ctx->args->once && isatty(STDOUT_FILENO), keys = live && isatty(STDIN_FILENO), all = true;
        struct sigaction sa = { .sa_handler = top_on_signal };
        struct termios saved, raw;
        int k = 0;

        if (ctx->args->json) {
                log_error("'top' draws tables: use 'status', 'users --all' and 'list --all' with --json.");
                return EXIT_USAGE;
        }
        if (!live) {
                char *buf = NULL;
                size_t len = 0;

                k = top_frame(ctx, 0, &all, &buf, &len);
                if (k == 0)
                        fwrite(buf, 1, len, stdout);
                free(buf);
                return k;
        }
        (void)sigaction(SIGINT, &sa, NULL);
        (void)sigaction(SIGTERM, &sa, NULL);
        (void)sigaction(SIGWINCH, &sa, NULL);
        if (keys && tcgetattr(STDIN_FILENO, &saved) == 0) {
                raw = saved;
                raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
                raw.c_cc[VMIN] = 0;
                raw.c_cc[VTIME] = 0;
                keys = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
        } else
                keys = false;
        fputs("\033[?25l\033[2J", stdout);      /* hide the cursor, clear the screen */
        while (!top_quit) {
                struct pollfd p = { .fd = STDIN_FILENO, .events = POLLIN };
                char *buf = NULL;
                size_t len = 0;
                int timeout = (int)(ctx->args->interval * 1000);

                ctx->columns = terminal_columns();
                k = top_frame(ctx, terminal_rows(), &all, &buf, &len);
                if (k == 0 && top_draw(buf, len) < 0)
                        k = EXIT_BROKER_ERROR;
                free(buf);
                if (k != 0)
                        break;
                top_resized = 0;
                while (!top_quit && !top_resized) {
                        char c;
                        int n = poll(&p, keys ? 1 : 0, timeout);

                        if (n == 0 || (n < 0 && errno != EINTR))
                                break;
                        if (n > 0 && read(STDIN_FILENO, &c, 1) == 1) {
                                if (c == 'q' || c == 'Q')
                                        top_quit = 1;
                                else if (c == ' ' || c == '\f')
                                        break;          /* refresh now */
                        } else if (n > 0)
                                break;
                }
        }
        if (keys)
                (void)tcsetattr(STDIN_FILENO, TCSANOW, &saved);
        fputs("\033[?25h\n", stdout);           /* the cursor back, below the last frame */
        return k;
}

static const Verb verbs[] = {
        { "status", 0, 0, NULL, false, verb_status },   /* the first is the default */
        { "list", 0, 0, NULL, true, verb_list },
        { "tokens", 1, 1, "ID", false, verb_tokens },
        { "unpublish", 1, 1, "NAME", false, verb_unpublish },
        { "users", 0, 0, NULL, true, verb_users },
        { "metrics", 0, 0, NULL, false, verb_metrics },
        { "top", 0, 0, NULL, false, verb_top },
};

/* --- the command line -------------------------------------------------------------------------------- */

static void help(void) {
        printf("Usage: vmmctl [OPTIONS] [COMMAND]\n"
               "\n"
               "Shows what the vmmbroker GPU memory broker holds, and takes published names away.\n"
               "\n"
               "Commands:\n"
               "  status                 Each device's pool: capacity, leased, cached, free (the default)\n"
               "  list                   Your leases, their names (OWNER/NAME) and their holders\n"
               "  tokens ID              A lease's live share tokens (administrators)\n"
               "  unpublish NAME|OWNER/NAME\n"
               "                         Remove a published lease's name (its owner or an administrator)\n"
               "  users                  Your use and limits: leases, connections, bytes per device\n"
               "  metrics                The broker's metrics, OpenMetrics text (administrators)\n"
               "  top                    Devices, users and the largest leases, refreshed (q quits)\n"
               "\n"
               "Options:\n"
               "  -h --help              Show this help and exit\n"
               "     --version           Show the version and exit\n"
               "     --socket PATH       The broker's socket (default $VMMBROKER_SOCKET, else\n"
               "                         " VMMB_DEFAULT_SOCKET ")\n"
               "     --json              Print the broker's reply as JSON\n"
               "  -a --all               list, users: every user's, not only yours (administrators only)\n"
               "     --no-legend         Print no header line\n"
               "     --interval SECONDS  top: seconds between refreshes (default 2)\n"
               "     --once              top: print one frame and exit (as when stdout is no terminal)\n"
               "\n"
               "Exit status: 0 success, 1 the broker refused or answered nonsense, 2 usage error,\n"
               "3 the broker cannot be reached.\n");
}

/* Says that the command line is wrong and returns EXIT_USAGE. */
_printf_(1, 2) static int usage_error(const char *fmt, ...) {
        va_list ap;

        fputs("vmmctl: ", stderr);
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputs("\nSee 'vmmctl --help'.\n", stderr);
        return EXIT_USAGE;
}

/* Returns -1 to go on, else the exit status. */
static int parse_argv(int argc, char *argv[], Args *args) {
        enum { ARG_VERSION = 0x100, ARG_SOCKET, ARG_JSON, ARG_NO_LEGEND, ARG_INTERVAL, ARG_ONCE };
        static const struct option options[] = {
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, ARG_VERSION },
                { "socket", required_argument, NULL, ARG_SOCKET },
                { "json", no_argument, NULL, ARG_JSON },
                { "all", no_argument, NULL, 'a' },
                { "no-legend", no_argument, NULL, ARG_NO_LEGEND },
                { "interval", required_argument, NULL, ARG_INTERVAL },
                { "once", no_argument, NULL, ARG_ONCE },
                {}
        };
        int c;

        opterr = 0;                     /* our own messages, named "vmmctl" whatever argv[0] is */
        while ((c = getopt_long(argc, argv, ":ha", options, NULL)) >= 0) {
                switch (c) {
                case 'h':
                        help();
                        return 0;
                case ARG_VERSION:
                        printf("vmmctl %s\n", VMMBROKER_VERSION);
                        return 0;
                case ARG_SOCKET:
                        if (!*optarg)
                                return usage_error("--socket needs a path.");
                        args->socket = optarg;
                        break;
                case ARG_JSON:
                        args->json = true;
                        break;
                case 'a':
                        args->all = true;
                        break;
                case ARG_NO_LEGEND:
                        args->legend = false;
                        break;
                case ARG_INTERVAL: {
                        char *end;

                        errno = 0;
                        args->interval = strtod(optarg, &end);
                        if (errno != 0 || end == optarg || *end || !(args->interval >= 0.1 && args->interval <= 3600))
                                return usage_error("--interval takes seconds from 0.1 to 3600, not '%s'.", optarg);
                        args->has_interval = true;
                        break;
                }
                case ARG_ONCE:
                        args->once = true;
                        break;
                case ':':
                        return usage_error("Option %s needs an argument.", argv[optind - 1]);
                case '?':
                        if (optopt > 0 && optopt < 0x100)
                                return usage_error("Unknown option -%c.", optopt);
                        return usage_error("Unknown option %s.", argv[optind - 1]);
                default:
                        abort();
                }
        }
        return -1;
}

/* The terminal's width for fitting tables, or 0 when stdout is no terminal. */
static size_t terminal_columns(void) {
        const char *e = getenv("COLUMNS");
        struct winsize ws = {};
        char *end;
        unsigned long v;

        if (!isatty(STDOUT_FILENO))
                return 0;
        if (e && *e) {
                errno = 0;
                v = strtoul(e, &end, 10);
                if (errno == 0 && !*end && v > 0 && v < 100000)
                        return v;
        }
        if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0)
                return ws.ws_col;
        return DEFAULT_COLUMNS;
}

static bool use_color(void) {
        const char *term = getenv("TERM");

        return isatty(STDOUT_FILENO) && !getenv("NO_COLOR") && term && strcmp(term, "dumb") != 0;
}

int main(int argc, char *argv[]) {
        Args args = { .legend = true, .interval = 2 };
        Context ctx = { .args = &args };
        const Verb *verb = &verbs[0];
        int k, n_args;

        (void)setlocale(LC_ALL, "");
        k = parse_argv(argc, argv, &args);
        if (k >= 0)
                return k;

        if (optind < argc) {
                verb = NULL;
                for (size_t i = 0; i < ELEMENTSOF(verbs) && !verb; i++)
                        if (strcmp(argv[optind], verbs[i].name) == 0)
                                verb = &verbs[i];
                if (!verb)
                        return usage_error("Unknown command '%s'.", argv[optind]);
                optind++;
        }
        n_args = argc - optind;
        if ((unsigned)n_args < verb->min_args)
                return usage_error("'%s' needs %s: vmmctl %s %s.", verb->name, verb->args_name, verb->name,
                                   verb->args_name);
        if ((unsigned)n_args > verb->max_args)
                return usage_error("Too many arguments for '%s': '%s'.", verb->name,
                                   argv[optind + verb->max_args]);
        if (args.all && !verb->takes_all)
                return usage_error("--all goes with 'list' and 'users', not '%s'.", verb->name);
        if ((args.once || args.has_interval) && verb->run != verb_top)
                return usage_error("--%s goes with 'top', not '%s'.", args.once ? "once" : "interval", verb->name);

        ctx.socket = args.socket ?: getenv("VMMBROKER_SOCKET");
        if (!ctx.socket || !*ctx.socket)
                ctx.socket = VMMB_DEFAULT_SOCKET;
        if (!args.json) {
                ctx.columns = terminal_columns();
                ctx.color = use_color();
                ctx.ellipsis = MB_CUR_MAX > 1 ? "…" : "...";
        }

        k = verb->run(&ctx, n_args, argv + optind);
        varlink_conn_free(ctx.conn);
        if (fflush(stdout) != 0 || ferror(stdout)) {
                log_error("Cannot write the output: %m");
                return k ?: EXIT_BROKER_ERROR;
        }
        return k;
}
