/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The io.vmmbroker calls and replies (see io.vmmbroker.varlink), and the
 * parts of org.varlink.service the daemon serves, as C structs with one
 * JsonField table each. Both sides use the same tables: the daemon decodes
 * parameters and encodes replies, the client the other way round.
 *
 * Every codec has three functions:
 *   - NAME_decode(params, ret, ret_bad_field, ret_message): json_dispatch()
 *     into *ret (-EINVAL names the field; see json.h); params may be NULL;
 *   - NAME_encode(in, ret): a new parameters object for the envelope
 *     (varlink_call_new(), varlink_reply_new());
 *   - NAME_done(p): frees the strings and arrays of a decoded struct.
 * Those the daemon reads most (Alloc's, Free's and Status's parameters) and
 * the client (Alloc's, Free's and Status's replies) also have
 * NAME_decode_text(text, len, ...): the same from the parameters' text
 * (json_dispatch_text(), VarlinkCall.parameters_text), NULL text for absent
 * parameters, without json-c objects.
 * The replies the daemon sends most (Alloc, Free, Status) also have
 * NAME_write(in, t): the whole reply message as text, written from the same
 * table without json-c objects (varlink_reply_write()), for
 * varlink_conn_send_text().
 * Optional members hold their absent value (json.h): NULL strings, -1 for an
 * absent device, false.
 */

#include <json-c/json.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "varlink.h"

#define VMMB_INTERFACE "io.vmmbroker"
#define VMMB_METHOD_ALLOC VMMB_INTERFACE ".Alloc"
#define VMMB_METHOD_FREE VMMB_INTERFACE ".Free"
#define VMMB_METHOD_LIST VMMB_INTERFACE ".List"
#define VMMB_METHOD_STATUS VMMB_INTERFACE ".Status"
#define VMMB_METHOD_SHARE VMMB_INTERFACE ".Share"
#define VMMB_METHOD_REVOKE VMMB_INTERFACE ".Revoke"
#define VMMB_METHOD_ATTACH VMMB_INTERFACE ".Attach"
#define VMMB_METHOD_PUBLISH VMMB_INTERFACE ".Publish"
#define VMMB_METHOD_UNPUBLISH VMMB_INTERFACE ".Unpublish"
#define VMMB_METHOD_USERS VMMB_INTERFACE ".Users"
#define VMMB_METHOD_TOKENS VMMB_INTERFACE ".Tokens"
#define VMMB_METHOD_METRICS VMMB_INTERFACE ".Metrics"
#define VMMB_METHOD_SET_RECLAIMABLE VMMB_INTERFACE ".SetReclaimable"
#define VMMB_METHOD_WATCH_RECLAIM VMMB_INTERFACE ".WatchReclaim"
#define VMMB_METHOD_PARK VMMB_INTERFACE ".Park"
#define VMMB_METHOD_UNPARK VMMB_INTERFACE ".Unpark"

#define VMMB_ERROR_OUT_OF_MEMORY VMMB_INTERFACE ".OutOfMemory"
#define VMMB_ERROR_QUOTA_EXCEEDED VMMB_INTERFACE ".QuotaExceeded"
#define VMMB_ERROR_NO_SUCH_LEASE VMMB_INTERFACE ".NoSuchLease"
#define VMMB_ERROR_NO_SUCH_TOKEN VMMB_INTERFACE ".NoSuchToken"
#define VMMB_ERROR_NO_SUCH_NAME VMMB_INTERFACE ".NoSuchName"
#define VMMB_ERROR_NAME_IN_USE VMMB_INTERFACE ".NameInUse"
#define VMMB_ERROR_NO_SUCH_DEVICE VMMB_INTERFACE ".NoSuchDevice"
#define VMMB_ERROR_INVALID_PARAMETER VMMB_INTERFACE ".InvalidParameter"
#define VMMB_ERROR_PERMISSION_DENIED VMMB_INTERFACE ".PermissionDenied"
#define VMMB_ERROR_DRIVER_ERROR VMMB_INTERFACE ".DriverError"
#define VMMB_ERROR_STORE_FAILED VMMB_INTERFACE ".StoreFailed"
#define VMMB_ERROR_OUT_OF_HOST_MEMORY VMMB_INTERFACE ".OutOfHostMemory"

#define VARLINK_SERVICE_INTERFACE "org.varlink.service"
#define VARLINK_METHOD_GET_INFO VARLINK_SERVICE_INTERFACE ".GetInfo"
#define VARLINK_METHOD_GET_INTERFACE_DESCRIPTION VARLINK_SERVICE_INTERFACE ".GetInterfaceDescription"
#define VARLINK_ERROR_INTERFACE_NOT_FOUND VARLINK_SERVICE_INTERFACE ".InterfaceNotFound"
#define VARLINK_ERROR_METHOD_NOT_FOUND VARLINK_SERVICE_INTERFACE ".MethodNotFound"
#define VARLINK_ERROR_METHOD_NOT_IMPLEMENTED VARLINK_SERVICE_INTERFACE ".MethodNotImplemented"
#define VARLINK_ERROR_INVALID_PARAMETER VARLINK_SERVICE_INTERFACE ".InvalidParameter"

/* Limits on strings, in bytes. */
#define VMMB_LABEL_MAX 128      /* Alloc's label, as the interface says */
#define VMMB_ID_MAX 64          /* lease identifiers */
#define VMMB_NAME_MAX 256       /* device names, process names, error resources */
#define VMMB_MESSAGE_MAX 1024   /* messages for a person */
#define VMMB_DESCRIPTION_MAX (60U * 1024U) /* an interface description (fits a 64 KiB reply) */
#define VMMB_METRICS_MAX (32U * 1024U * 1024U) /* Metrics' text (a reply is at most 64 MiB) */
#define VMMB_LEASE_NAME_MAX 128 /* Publish's name */
#define VMMB_USER_NAME_MAX 64   /* a user name in OWNER/NAME */
#define VMMB_LEASE_NAME_REF_MAX (VMMB_USER_NAME_MAX + 1 + VMMB_LEASE_NAME_MAX) /* Attach's and Unpublish's name */
#define VMMB_TOKEN_LEN 32       /* hex digits of a token the daemon makes */
#define VMMB_TOKEN_MAX 64       /* a token as the daemon reads it: longer is refused */

/* Limits on lists. */
#define VMMB_PUBLISH_UIDS_MAX 64 /* users a Publish may name */
#define VMMB_ALLOC_DEVICES_MAX 64 /* devices an Alloc may name to choose from */

/* Value of AllocParams.device when no device was asked for. */
#define VMMB_DEVICE_ANY INT64_C(-1)

/* The interface file, embedded at build time (generated from io.vmmbroker.varlink). */
extern const char vmmb_interface_description[];

/* The org.varlink.service interface, as the varlink specification gives it. */
extern const char varlink_service_interface_description[];

/* Alloc(size: int, device: ?int, label: ?string, wait_usec: ?int, devices: ?[]int) */
typedef struct AllocParams {
        uint64_t size;          /* at least 1 */
        int64_t device;         /* VMMB_DEVICE_ANY when absent */
        char *label;            /* NULL when absent */
        int64_t wait_usec;      /* JSON_ABSENT (-1) when absent: fail at once, as 0 */
        uint64_t *devices;      /* the devices to choose from, each 0..INT64_MAX; NULL when absent or empty;
                                   never with `device` */
        size_t n_devices;       /* at most VMMB_ALLOC_DEVICES_MAX */
} AllocParams;

/* Free(id: string, keep: ?bool) */
typedef struct FreeParams {
        char *id;
        bool keep;              /* Free only: keep the lease for this process's next Alloc of its size */
} FreeParams;

/* Free's reply: (kept: ?bool), `kept` present when the call asked to keep */
typedef struct FreeReply {
        bool kept;
} FreeReply;

/* The highest reclaim priority SetReclaimable takes. */
#define VMMB_RECLAIM_PRIORITY_MAX INT64_C(2147483647)

/* SetReclaimable(id: string, priority: ?int) */
typedef struct SetReclaimableParams {
        char *id;
        int64_t priority;       /* JSON_ABSENT when absent: not reclaimable */
} SetReclaimableParams;

/* Park's reply: (parked: bool); its parameters, and Unpark's, are an id (id_params_*()); Unpark's reply an AllocReply */
typedef struct ParkReply {
        bool parked;
} ParkReply;

/* WatchReclaim's replies: (id: ?string, device: ?int, size: ?int, timeout_usec: ?int); the first has no id */
typedef struct ReclaimRequest {
        char *id;               /* NULL in the first reply: the watch is on */
        int64_t device;         /* JSON_ABSENT when absent */
        int64_t size;
        int64_t timeout_usec;
} ReclaimRequest;

/* List(all: ?bool), and Users(all: ?bool) */
typedef struct ListParams {
        bool all;
} ListParams;

/* Share(id: string, uid: ?int, readonly: ?bool) */
typedef struct ShareParams {
        char *id;
        int64_t uid;            /* JSON_ABSENT when absent: anyone */
        bool readonly;
} ShareParams;

/* Share's reply: (token: string) */
typedef struct ShareReply {
        char *token;
} ShareReply;

/* Revoke(token: string) */
typedef struct RevokeParams {
        char *token;
} RevokeParams;

/* Attach(token: ?string, name: ?string, readonly: ?bool); the reply is an AllocReply */
typedef struct AttachParams {
        char *token;            /* exactly one of token and name */
        char *name;
        bool readonly;
} AttachParams;

/* Publish(id: string, name: string, uids: ?[]int, readonly: ?bool) */
typedef struct PublishParams {
        char *id;
        char *name;
        uint64_t *uids;
        size_t n_uids;
        bool readonly;
} PublishParams;

/* Unpublish(name: string) */
typedef struct UnpublishParams {
        char *name;
} UnpublishParams;

/* Parameters of a method that takes none (Status) and the empty reply (Free). */
typedef struct EmptyParams {
        char dummy_;
} EmptyParams;

/* Slab (size: int, fd: int) */
typedef struct WireSlab {
        uint64_t size;
        uint64_t fd;            /* index among the fds sent with the reply */
} WireSlab;

/* Lease (id, device, size, slabs: []Slab, owner: int, owner_name: ?string, readonly: ?bool) */
typedef struct WireLease {
        char *id;
        int64_t device;
        uint64_t size;
        WireSlab *slabs;
        size_t n_slabs;
        int64_t owner;          /* uid; JSON_ABSENT from a daemon older than the field */
        char *owner_name;       /* NULL when absent */
        bool readonly;
} WireLease;

/* Token (token: string, uid: ?int, creator: int, readonly: bool) */
typedef struct WireToken {
        char *token;
        int64_t uid;            /* JSON_ABSENT: any user */
        int64_t creator;
        bool readonly;
} WireToken;

/* Tokens' reply: (tokens: []Token); its parameters are an id (id_params_*()) */
typedef struct TokensReply {
        WireToken *tokens;
        size_t n_tokens;
} TokensReply;

/* Alloc's and Attach's reply: (lease: Lease) */
typedef struct AllocReply {
        WireLease lease;
} AllocReply;

/* Holder (pid, uid, comm: ?string, readonly, parked: ?bool) */
typedef struct WireHolder {
        int64_t pid;
        int64_t uid;
        char *comm;             /* NULL when absent */
        bool readonly;
        bool parked;            /* it parked the lease (false when absent) */
} WireHolder;

/* LeaseInfo (id, device, size, slabs, pid, uid, comm: ?string, label: ?string, created, name: ?string,
 * holders: []Holder, reclaim_priority: ?int, reclaim: ?string, parked: ?bool, kept: ?bool) */
typedef struct WireLeaseInfo {
        char *id;
        int64_t device;
        uint64_t size;
        uint64_t slabs;
        int64_t pid;            /* the process that made it */
        int64_t uid;            /* its owner */
        char *comm;             /* NULL when absent */
        char *label;            /* NULL when absent */
        int64_t created;        /* µs since the epoch */
        char *name;             /* NULL when not published */
        WireHolder *holders;
        size_t n_holders;
        int64_t reclaim_priority; /* JSON_ABSENT (-1) when not marked reclaimable */
        char *reclaim;          /* "marked", "asked", "unresponsive"; NULL otherwise */
        bool parked;            /* its content is in host memory (false when absent) */
        bool kept;              /* kept for its process's next Alloc (false when absent) */
} WireLeaseInfo;

/* List's reply: (leases: []LeaseInfo) */
typedef struct ListReply {
        WireLeaseInfo *leases;
        size_t n_leases;
} ListReply;

/* UserDevice (index, bytes, max_bytes, host_bytes: ?int, max_host_bytes: ?int) */
typedef struct WireUserDevice {
        int64_t index;
        uint64_t bytes;
        uint64_t max_bytes;
        int64_t host_bytes;     /* parked leases' host bytes; JSON_ABSENT from daemons older than parking */
        int64_t max_host_bytes;
} WireUserDevice;

/* User (uid, leases, max_leases, connections, max_connections, requests, devices) */
typedef struct WireUser {
        int64_t uid;
        uint64_t leases;
        uint64_t max_leases;
        uint64_t connections;
        uint64_t max_connections;
        uint64_t requests;
        WireUserDevice *devices;
        size_t n_devices;
} WireUser;

/* Users' reply: (users: []User); its parameters are a ListParams (all: ?bool) */
typedef struct UsersReply {
        WireUser *users;
        size_t n_users;
} UsersReply;

/* Device (index, name, total, granularity, capacity, leased, scrubbing, cached, leases, waiters: ?int,
 * numa_node: ?int, host_capacity: ?int, parked: ?int, host_cached: ?int, kept: ?int) */
typedef struct WireDevice {
        int64_t index;
        char *name;
        uint64_t total;
        uint64_t granularity;
        uint64_t capacity;
        uint64_t leased;
        uint64_t scrubbing;
        uint64_t cached;
        uint64_t leases;
        int64_t waiters;        /* JSON_ABSENT (-1) from a daemon that has no waiting */
        int64_t numa_node;      /* JSON_ABSENT (-1) when unknown, or from a daemon older than NUMA */
        int64_t host_capacity;  /* host memory for parked leases; JSON_ABSENT from daemons older than parking */
        int64_t parked;         /* bytes of it holding parked leases */
        int64_t host_cached;    /* bytes of it zeroed and kept for the next park */
        int64_t kept;           /* bytes of kept leases; JSON_ABSENT from daemons older than keeping */
} WireDevice;

/* Status's reply: (devices: []Device, placement: ?string) */
typedef struct StatusReply {
        WireDevice *devices;
        size_t n_devices;
        char *placement;        /* the Placement= rule; NULL from daemons older than placement */
} StatusReply;

/* Metrics' reply: (text: string), the OpenMetrics text exposition */
typedef struct MetricsReply {
        char *text;
} MetricsReply;

/* org.varlink.service.GetInfo's reply */
typedef struct VarlinkInfo {
        char *vendor;
        char *product;
        char *version;
        char *url;
        char **interfaces;
        size_t n_interfaces;
} VarlinkInfo;

/* org.varlink.service.GetInterfaceDescription(interface: string) */
typedef struct InterfaceParams {
        char *interface;
} InterfaceParams;

/* org.varlink.service.GetInterfaceDescription's reply: (description: string) */
typedef struct InterfaceDescription {
        char *description;
} InterfaceDescription;

/*
 * The parameters of every error this interface and org.varlink.service name;
 * each error uses some of them (see io.vmmbroker.varlink). Unused strings are
 * NULL, unused integers 0 (device: -1).
 */
typedef struct VmmbError {
        int64_t device;         /* OutOfMemory, OutOfHostMemory, NoSuchDevice */
        uint64_t requested;     /* OutOfMemory, OutOfHostMemory */
        uint64_t available;     /* OutOfMemory, OutOfHostMemory */
        char *resource;         /* QuotaExceeded */
        uint64_t limit;         /* QuotaExceeded */
        uint64_t current;       /* QuotaExceeded */
        char *id;               /* NoSuchLease */
        char *name;             /* NoSuchName, NameInUse */
        char *parameter;        /* InvalidParameter (both interfaces) */
        char *method;           /* MethodNotFound, MethodNotImplemented */
        char *interface;        /* InterfaceNotFound */
        char *message;          /* OutOfMemory, OutOfHostMemory, QuotaExceeded, InvalidParameter, PermissionDenied,
                                   DriverError, StoreFailed */
} VmmbError;

/* Decodes Alloc's parameters; a size of 0 is refused as well (-EINVAL naming "size"), and so are both device and
 * devices (-EINVAL naming "devices"). */
int alloc_params_decode(json_object *params, AllocParams *ret, const char **ret_bad_field, char **ret_message);
int alloc_params_decode_text(const char *text, size_t len, AllocParams *ret, const char **ret_bad_field,
                             char **ret_message);
/* Encodes Alloc's parameters (a wait_usec of 0 is left out, as absent). Returns 0, -EINVAL, -ERANGE or -ENOMEM (json_build()). */
int alloc_params_encode(const AllocParams *in, json_object **ret);
/*
 * Writes the whole call message {"method": "io.vmmbroker.Alloc", "parameters": ...} as text
 * (varlink_call_write()): the bytes json_write() makes of varlink_call_new() of alloc_params_encode()'s
 * object, without making either. Returns alloc_params_encode()'s errors.
 */
int alloc_params_write(const AllocParams *in, VarlinkText *t);
/* Frees AllocParams' strings. */
void alloc_params_done(AllocParams *p);

/* Decodes Free's parameters. */
int free_params_decode(json_object *params, FreeParams *ret, const char **ret_bad_field, char **ret_message);
int free_params_decode_text(const char *text, size_t len, FreeParams *ret, const char **ret_bad_field,
                            char **ret_message);
/* Encodes Free's parameters. */
int free_params_encode(const FreeParams *in, json_object **ret);
/* Writes the whole Free call as text, "oneway" when asked (varlink_call_write(), as alloc_params_write()). */
int free_params_write(const FreeParams *in, bool oneway, VarlinkText *t);
/* Frees FreeParams' strings. */
void free_params_done(FreeParams *p);
/* Park's, Unpark's and Tokens' parameters: the id alone (a `keep` is an unknown parameter there); freed by
 * free_params_done(). */
int id_params_decode(json_object *params, FreeParams *ret, const char **ret_bad_field, char **ret_message);
int id_params_encode(const FreeParams *in, json_object **ret);

/* Decodes SetReclaimable's parameters (a priority over VMMB_RECLAIM_PRIORITY_MAX is -EINVAL naming it). */
int set_reclaimable_params_decode(json_object *params, SetReclaimableParams *ret, const char **ret_bad_field,
                                  char **ret_message);
/* Encodes SetReclaimable's parameters. */
int set_reclaimable_params_encode(const SetReclaimableParams *in, json_object **ret);
/* Frees SetReclaimableParams' strings. */
void set_reclaimable_params_done(SetReclaimableParams *p);

/* Decodes, encodes and frees a WatchReclaim reply. */
int reclaim_request_decode(json_object *params, ReclaimRequest *ret, char **ret_message);
int reclaim_request_encode(const ReclaimRequest *in, json_object **ret);
void reclaim_request_done(ReclaimRequest *p);

/* Decodes Free's reply to a keep; a reply without `kept` (a Free without keep, or a daemon older than keeping)
 * is -ENODATA. */
int free_reply_decode(json_object *params, FreeReply *ret, char **ret_message);
int free_reply_decode_text(const char *text, size_t len, FreeReply *ret, char **ret_message);
/* Encodes Free's reply to a keep, `kept` always present. */
int free_reply_encode(const FreeReply *in, json_object **ret);
/* Writes the whole reply message {"parameters": {"kept": ...}} as text: the bytes of free_reply_encode()'s. */
int free_reply_write(const FreeReply *in, VarlinkText *t);
void free_reply_done(FreeReply *p);

/* Park's reply. */
int park_reply_decode(json_object *params, ParkReply *ret, char **ret_message);
int park_reply_encode(const ParkReply *in, json_object **ret);
void park_reply_done(ParkReply *p);

/* Decodes Share's parameters. */
int share_params_decode(json_object *params, ShareParams *ret, const char **ret_bad_field, char **ret_message);
/* Encodes Share's parameters. */
int share_params_encode(const ShareParams *in, json_object **ret);
/* Frees ShareParams' strings. */
void share_params_done(ShareParams *p);

/* Decodes Share's reply. */
int share_reply_decode(json_object *params, ShareReply *ret, char **ret_message);
/* Encodes Share's reply. */
int share_reply_encode(const ShareReply *in, json_object **ret);
/* Frees ShareReply's token. */
void share_reply_done(ShareReply *p);

/* Decodes Revoke's parameters. */
int revoke_params_decode(json_object *params, RevokeParams *ret, const char **ret_bad_field, char **ret_message);
/* Encodes Revoke's parameters. */
int revoke_params_encode(const RevokeParams *in, json_object **ret);
/* Frees RevokeParams' strings. */
void revoke_params_done(RevokeParams *p);

/* Decodes Attach's parameters; exactly one of token and name is required (-EINVAL naming "token"). */
int attach_params_decode(json_object *params, AttachParams *ret, const char **ret_bad_field, char **ret_message);
/* Encodes Attach's parameters. */
int attach_params_encode(const AttachParams *in, json_object **ret);
/* Writes the whole Attach call as text (varlink_call_write(), as alloc_params_write()): the bytes of
 * varlink_call_new() of attach_params_encode()'s object, or its error. */
int attach_params_write(const AttachParams *in, VarlinkText *t);
/* Frees AttachParams' strings. */
void attach_params_done(AttachParams *p);

/* Decodes Publish's parameters; the name is checked with vmmb_lease_name_is_valid() (-EINVAL naming "name"). */
int publish_params_decode(json_object *params, PublishParams *ret, const char **ret_bad_field, char **ret_message);
/* Encodes Publish's parameters. */
int publish_params_encode(const PublishParams *in, json_object **ret);
/* Frees PublishParams' strings and users. */
void publish_params_done(PublishParams *p);

/* Decodes Unpublish's parameters. */
int unpublish_params_decode(json_object *params, UnpublishParams *ret, const char **ret_bad_field,
                            char **ret_message);
/* Encodes Unpublish's parameters. */
int unpublish_params_encode(const UnpublishParams *in, json_object **ret);
/* Frees UnpublishParams' strings. */
void unpublish_params_done(UnpublishParams *p);

/*
 * Whether `name` may be published: 1-VMMB_LEASE_NAME_MAX bytes of ASCII
 * letters, digits and "._-:@+", the first a letter or digit (so that it is
 * never taken for an option on a command line). No '/': that separates the
 * owner in OWNER/NAME.
 */
bool vmmb_lease_name_is_valid(const char *name);

/*
 * Whether `name` could have been published by a daemon: as above, or with
 * '/' in it, which versions before owner namespaces allowed (a table stored by
 * one is read with its names as they were).
 */
bool vmmb_lease_name_was_valid(const char *name);

/*
 * Splits Attach's or Unpublish's name: "NAME" (the caller's own: *ret_owner
 * NULL) or "OWNER/NAME" (*ret_owner points into a copy: `buf` of at least
 * VMMB_LEASE_NAME_REF_MAX + 1 bytes), *ret_name the name. Returns 0, or
 * -EINVAL when OWNER is empty or NAME is not one vmmb_lease_name_was_valid()
 * accepts.
 */
int vmmb_lease_name_split(const char *ref, char *buf, const char **ret_owner, const char **ret_name);

/* Decodes List's parameters. */
int list_params_decode(json_object *params, ListParams *ret, const char **ret_bad_field, char **ret_message);
/* Encodes List's parameters. */
int list_params_encode(const ListParams *in, json_object **ret);

/* Decodes an empty parameter object (Status's call, Free's reply): any key is unknown. */
int empty_params_decode(json_object *params, const char **ret_bad_field, char **ret_message);
int empty_params_decode_text(const char *text, size_t len, const char **ret_bad_field, char **ret_message);
/* Makes an empty parameters object. */
int empty_params_encode(json_object **ret);
/* Writes the reply message {"parameters": {}} as text (varlink_reply_write()). */
int empty_reply_write(VarlinkText *t);

/*
 * Decodes Alloc's reply and checks it against the `n_fds` fds that came with
 * it: one fd per slab, each index used once (-EINVAL otherwise).
 */
int alloc_reply_decode(json_object *params, size_t n_fds, AllocReply *ret, char **ret_message);
int alloc_reply_decode_text(const char *text, size_t len, size_t n_fds, AllocReply *ret, char **ret_message);
/*
 * A whole reply message read with its parameters in one pass, for Alloc
 * (varlink_reply_parse_text_into() with Alloc's reply table): when
 * *ret_decoded, *ret holds them as alloc_reply_decode() reads them, before its
 * check of the fds (alloc_reply_check_fds(), which frees *ret when it fails).
 */
int alloc_reply_parse_text(const char *text, size_t len, VarlinkReply *ret_reply, AllocReply *ret, bool *ret_decoded);
int alloc_reply_check_fds(AllocReply *r, size_t n_fds, char **ret_message);
/* Encodes Alloc's reply. */
int alloc_reply_encode(const AllocReply *in, json_object **ret);
/*
 * Writes the whole reply message {"parameters": {"lease": ...}} as text (varlink_reply_write()): the bytes
 * that json_write() makes of varlink_reply_new() of alloc_reply_encode()'s object, without making it.
 */
int alloc_reply_write(const AllocReply *in, VarlinkText *t);
/* Frees AllocReply's strings and slabs. */
void alloc_reply_done(AllocReply *p);

/* Decodes List's reply. */
int list_reply_decode(json_object *params, ListReply *ret, char **ret_message);
/* Encodes List's reply; comm and label are made printable (json_build()). */
int list_reply_encode(const ListReply *in, json_object **ret);
/* Frees ListReply's leases. */
void list_reply_done(ListReply *p);

/* Decodes Users' reply. */
int users_reply_decode(json_object *params, UsersReply *ret, char **ret_message);
/* Encodes Users' reply. */
int users_reply_encode(const UsersReply *in, json_object **ret);
/* Frees UsersReply's users. */
void users_reply_done(UsersReply *p);

/* Decodes Status's reply. */
int status_reply_decode(json_object *params, StatusReply *ret, char **ret_message);
int status_reply_decode_text(const char *text, size_t len, StatusReply *ret, char **ret_message);
/* A whole reply message read with its parameters in one pass, for Status, as alloc_reply_parse_text() is. */
int status_reply_parse_text(const char *text, size_t len, VarlinkReply *ret_reply, StatusReply *ret,
                            bool *ret_decoded);
/* Encodes Status's reply. */
int status_reply_encode(const StatusReply *in, json_object **ret);
/* Writes the whole reply message {"parameters": {"devices": ...}} as text, as alloc_reply_write() does. */
int status_reply_write(const StatusReply *in, VarlinkText *t);

/* Tokens' reply. */
int tokens_reply_decode(json_object *params, TokensReply *ret, char **ret_message);
int tokens_reply_encode(const TokensReply *in, json_object **ret);
void tokens_reply_done(TokensReply *p);
/* Frees StatusReply's devices. */
void status_reply_done(StatusReply *p);

/* Metrics' reply. */
int metrics_reply_decode(json_object *params, MetricsReply *ret, char **ret_message);
int metrics_reply_encode(const MetricsReply *in, json_object **ret);
void metrics_reply_done(MetricsReply *p);

/* Encodes GetInfo's reply: vendor "vmmbroker", product "vmmbrokerd", the version, the URL, the interfaces. */
int varlink_info_encode(json_object **ret);
/* Decodes GetInfo's reply. */
int varlink_info_decode(json_object *params, VarlinkInfo *ret, char **ret_message);
/* Frees VarlinkInfo's strings. */
void varlink_info_done(VarlinkInfo *p);

/* Decodes GetInterfaceDescription's parameters. */
int interface_params_decode(json_object *params, InterfaceParams *ret, const char **ret_bad_field,
                            char **ret_message);
/* Encodes GetInterfaceDescription's parameters. */
int interface_params_encode(const InterfaceParams *in, json_object **ret);
/* Frees InterfaceParams' strings. */
void interface_params_done(InterfaceParams *p);

/*
 * Encodes GetInterfaceDescription's reply for `interface`: io.vmmbroker or
 * org.varlink.service. Returns -ENOENT for another interface (answer with
 * varlink_error_interface_not_found()).
 */
int interface_description_encode(const char *interface, json_object **ret);
/* Decodes GetInterfaceDescription's reply. */
int interface_description_decode(json_object *params, InterfaceDescription *ret, char **ret_message);
/* Frees InterfaceDescription's string. */
void interface_description_done(InterfaceDescription *p);

/*
 * Error replies: each builds a whole error envelope ({"error": ...,
 * "parameters": {...}}) for varlink_conn_send(). Messages are made printable
 * and cut to VMMB_MESSAGE_MAX. Return 0 or -ENOMEM (-EINVAL for a NULL string).
 */
int vmmb_error_out_of_host_memory(int64_t device, uint64_t requested, uint64_t available, const char *message,
                                  json_object **ret);
int vmmb_error_out_of_memory(int64_t device, uint64_t requested, uint64_t available, const char *message,
                             json_object **ret);
/* QuotaExceeded: `resource` is "bytes", "host_bytes", "leases", "connections", "processes" or "tokens". */
int vmmb_error_quota_exceeded(const char *resource, uint64_t limit, uint64_t current, const char *message,
                              json_object **ret);
/* NoSuchLease for the identifier asked for. */
int vmmb_error_no_such_lease(const char *id, json_object **ret);
/* NoSuchToken. */
int vmmb_error_no_such_token(json_object **ret);
/* NoSuchName for the name asked for. */
int vmmb_error_no_such_name(const char *name, json_object **ret);
/* NameInUse for the name asked for. */
int vmmb_error_name_in_use(const char *name, json_object **ret);
/* NoSuchDevice for the device asked for. */
int vmmb_error_no_such_device(int64_t device, json_object **ret);
/* io.vmmbroker.InvalidParameter naming the parameter, e.g. from json_dispatch()'s outputs. */
int vmmb_error_invalid_parameter(const char *parameter, const char *message, json_object **ret);
/* PermissionDenied. */
int vmmb_error_permission_denied(const char *message, json_object **ret);
/* StoreFailed. */
int vmmb_error_store_failed(const char *message, json_object **ret);
/* DriverError. */
int vmmb_error_driver_error(const char *message, json_object **ret);
/* org.varlink.service.MethodNotFound for an unknown method. */
int varlink_error_method_not_found(const char *method, json_object **ret);
/* org.varlink.service.InterfaceNotFound for an unknown interface. */
int varlink_error_interface_not_found(const char *interface, json_object **ret);
/* org.varlink.service.InvalidParameter, for the org.varlink.service methods. */
int varlink_error_invalid_parameter(const char *parameter, json_object **ret);

/*
 * Decodes the parameters of the error `error` (a name from above) into *ret;
 * an unknown error name leaves *ret empty and returns 0. Returns -EINVAL (with
 * *ret_message) when the parameters do not match the error, -ENOMEM.
 */
int vmmb_error_decode(const char *error, json_object *params, VmmbError *ret, char **ret_message);
/* Frees VmmbError's strings. */
void vmmb_error_done(VmmbError *e);

/*
 * The negative errno a client returns for an error name: OutOfMemory -ENOMEM,
 * OutOfHostMemory -ENOSPC, QuotaExceeded -EDQUOT, NoSuchLease -ENOENT, NoSuchToken -ENOKEY,
 * NoSuchName -ENOENT, NameInUse -EEXIST, NoSuchDevice -ENODEV,
 * InvalidParameter (either) -EINVAL, PermissionDenied -EACCES, DriverError
 * -EIO, StoreFailed -EAGAIN, MethodNotFound/MethodNotImplemented/InterfaceNotFound -EOPNOTSUPP,
 * anything else -EPROTO.
 */
int vmmb_error_to_errno(const char *error);

/*
 * A sentence for a person about the named error `error` (with its parameters)
 * that the broker answered to `method`: the error's own message when it has
 * one, else one made from its parameters, else its name. Sets *ret_message
 * (NULL if memory runs out).
 */
void vmmb_error_describe(const char *error, json_object *params, const char *method, char **ret_message);

/*
 * Why connecting to the broker at `path` failed with `error` (a negative errno of connect()) and what to do
 * about it, as one message for a person, malloc'd into *ret: "Cannot connect to the broker at PATH: WHY.
 * HINT" (NULL when out of memory). The hint fits what is at the path: nothing (a broker not started; for
 * `default_path`, the service's socket unit), something that is not a socket, a socket nobody listens on,
 * a socket of the broker's group the caller is not in, or another user's own (development) broker.
 */
void vmmb_connect_message(const char *path, const char *default_path, int error, char **ret);
