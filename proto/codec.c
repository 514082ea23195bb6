/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <stdlib.h>
#include <pwd.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "codec.h"
#include "json.h"
#include "macro.h"
#include "message.h"
#include "varlink.h"

#ifndef VMMBROKER_VERSION
#error "VMMBROKER_VERSION must be defined by the build"
#endif

/* The project's home page for GetInfo; empty until it has a public one. */
#define VMMBROKER_URL ""

const char varlink_service_interface_description[] =
        "# The Varlink Service Interface is provided by every varlink service. It\n"
        "# describes the service and the interfaces it implements.\n"
        "interface org.varlink.service\n"
        "\n"
        "# Get a list of all the interfaces a service provides and information\n"
        "# about the implementation.\n"
        "method GetInfo() -> (\n"
        "  vendor: string,\n"
        "  product: string,\n"
        "  version: string,\n"
        "  url: string,\n"
        "  interfaces: []string\n"
        ")\n"
        "\n"
        "# Get the description of an interface that is implemented by this service.\n"
        "method GetInterfaceDescription(interface: string) -> (description: string)\n"
        "\n"
        "# The requested interface was not found.\n"
        "error InterfaceNotFound (interface: string)\n"
        "\n"
        "# The requested method was not found\n"
        "error MethodNotFound (method: string)\n"
        "\n"
        "# The interface defines the requested method, but the service does not\n"
        "# implement it.\n"
        "error MethodNotImplemented (method: string)\n"
        "\n"
        "# One of the passed parameters is invalid.\n"
        "error InvalidParameter (parameter: string)\n"
        "\n"
        "# Client is denied access\n"
        "error PermissionDenied ()\n"
        "\n"
        "# Method is expected to be called with 'more' set to true, but wasn't\n"
        "error ExpectedMore ()\n";

/* ---- Tables ---- */

static const JsonField alloc_params_fields[] = {
        JSON_FIELD_UINT64("size", AllocParams, size),
        JSON_FIELD_INT64("device", AllocParams, device, false, true),
        JSON_FIELD_STRING("label", AllocParams, label, false, VMMB_LABEL_MAX),
        JSON_FIELD_INT64("wait_usec", AllocParams, wait_usec, false, true),
        JSON_FIELD_UINT64V("devices", AllocParams, devices, n_devices, false, VMMB_ALLOC_DEVICES_MAX),
        JSON_FIELD_END,
};

/* Free's; Park, Unpark and Tokens take the same id alone (id_params_fields). */
static const JsonField free_params_fields[] = {
        JSON_FIELD_STRING("id", FreeParams, id, true, VMMB_ID_MAX),
        JSON_FIELD_BOOL("keep", FreeParams, keep, false),
        JSON_FIELD_END,
};

static const JsonField id_params_fields[] = {
        JSON_FIELD_STRING("id", FreeParams, id, true, VMMB_ID_MAX),
        JSON_FIELD_END,
};

static const JsonField free_reply_fields[] = {
        JSON_FIELD_BOOL("kept", FreeReply, kept, true),
        JSON_FIELD_END,
};

static const JsonField set_reclaimable_params_fields[] = {
        JSON_FIELD_STRING("id", SetReclaimableParams, id, true, VMMB_ID_MAX),
        JSON_FIELD_INT64("priority", SetReclaimableParams, priority, false, true),
        JSON_FIELD_END,
};

static const JsonField park_reply_fields[] = {
        JSON_FIELD_BOOL("parked", ParkReply, parked, true),
        JSON_FIELD_END,
};

static const JsonField reclaim_request_fields[] = {
        JSON_FIELD_STRING("id", ReclaimRequest, id, false, VMMB_ID_MAX),
        JSON_FIELD_INT64("device", ReclaimRequest, device, false, true),
        JSON_FIELD_INT64("size", ReclaimRequest, size, false, true),
        JSON_FIELD_INT64("timeout_usec", ReclaimRequest, timeout_usec, false, true),
        JSON_FIELD_END,
};

static const JsonField share_params_fields[] = {
        JSON_FIELD_STRING("id", ShareParams, id, true, VMMB_ID_MAX),
        JSON_FIELD_INT64("uid", ShareParams, uid, false, true),
        JSON_FIELD_BOOL("readonly", ShareParams, readonly, false),
        JSON_FIELD_END,
};

static const JsonField share_reply_fields[] = {
        JSON_FIELD_STRING("token", ShareReply, token, true, VMMB_TOKEN_MAX),
        JSON_FIELD_END,
};

static const JsonField revoke_params_fields[] = {
        JSON_FIELD_STRING("token", RevokeParams, token, true, VMMB_TOKEN_MAX),
        JSON_FIELD_END,
};

static const JsonField attach_params_fields[] = {
        JSON_FIELD_STRING("token", AttachParams, token, false, VMMB_TOKEN_MAX),
        JSON_FIELD_STRING("name", AttachParams, name, false, VMMB_LEASE_NAME_REF_MAX),
        JSON_FIELD_BOOL("readonly", AttachParams, readonly, false),
        JSON_FIELD_END,
};

static const JsonField publish_params_fields[] = {
        JSON_FIELD_STRING("id", PublishParams, id, true, VMMB_ID_MAX),
        JSON_FIELD_STRING("name", PublishParams, name, true, VMMB_LEASE_NAME_MAX),
        JSON_FIELD_UINT64V("uids", PublishParams, uids, n_uids, false, VMMB_PUBLISH_UIDS_MAX),
        JSON_FIELD_BOOL("readonly", PublishParams, readonly, false),
        JSON_FIELD_END,
};

static const JsonField unpublish_params_fields[] = {
        JSON_FIELD_STRING("name", UnpublishParams, name, true, VMMB_LEASE_NAME_REF_MAX),
        JSON_FIELD_END,
};

static const JsonField list_params_fields[] = {
        JSON_FIELD_BOOL("all", ListParams, all, false),
        JSON_FIELD_END,
};

static const JsonField empty_fields[] = {
        JSON_FIELD_END,
};

static const JsonField slab_fields[] = {
        JSON_FIELD_UINT64("size", WireSlab, size),
        JSON_FIELD_UINT64("fd", WireSlab, fd),
        JSON_FIELD_END,
};

static const JsonField lease_fields[] = {
        JSON_FIELD_STRING("id", WireLease, id, true, VMMB_ID_MAX),
        JSON_FIELD_INT64("device", WireLease, device, true, true),
        JSON_FIELD_UINT64("size", WireLease, size),
        JSON_FIELD_ARRAY("slabs", WireLease, slabs, n_slabs, WireSlab, slab_fields, true, 0),
        JSON_FIELD_INT64("owner", WireLease, owner, false, true),
        JSON_FIELD_STRING("owner_name", WireLease, owner_name, false, VMMB_USER_NAME_MAX),
        JSON_FIELD_BOOL("readonly", WireLease, readonly, false),
        JSON_FIELD_END,
};

static const JsonField token_fields[] = {
        JSON_FIELD_STRING("token", WireToken, token, true, VMMB_TOKEN_MAX),
        JSON_FIELD_INT64("uid", WireToken, uid, false, true),
        JSON_FIELD_INT64("creator", WireToken, creator, true, true),
        JSON_FIELD_BOOL("readonly", WireToken, readonly, true),
        JSON_FIELD_END,
};

static const JsonField tokens_reply_fields[] = {
        JSON_FIELD_ARRAY("tokens", TokensReply, tokens, n_tokens, WireToken, token_fields, true, 0),
        JSON_FIELD_END,
};

static const JsonField alloc_reply_fields[] = {
        JSON_FIELD_OBJECT("lease", AllocReply, lease, WireLease, lease_fields),
        JSON_FIELD_END,
};

static const JsonField holder_fields[] = {
        JSON_FIELD_INT64("pid", WireHolder, pid, true, true),
        JSON_FIELD_INT64("uid", WireHolder, uid, true, true),
        JSON_FIELD_STRING("comm", WireHolder, comm, false, VMMB_NAME_MAX),
        JSON_FIELD_BOOL("readonly", WireHolder, readonly, true),
        JSON_FIELD_BOOL("parked", WireHolder, parked, false),
        JSON_FIELD_END,
};

static const JsonField lease_info_fields[] = {
        JSON_FIELD_STRING("id", WireLeaseInfo, id, true, VMMB_ID_MAX),
        JSON_FIELD_INT64("device", WireLeaseInfo, device, true, true),
        JSON_FIELD_UINT64("size", WireLeaseInfo, size),
        JSON_FIELD_UINT64("slabs", WireLeaseInfo, slabs),
        JSON_FIELD_INT64("pid", WireLeaseInfo, pid, true, true),
        JSON_FIELD_INT64("uid", WireLeaseInfo, uid, true, true),
        JSON_FIELD_STRING("comm", WireLeaseInfo, comm, false, VMMB_NAME_MAX),
        JSON_FIELD_STRING("label", WireLeaseInfo, label, false, VMMB_LABEL_MAX),
        JSON_FIELD_INT64("created", WireLeaseInfo, created, true, false),
        JSON_FIELD_STRING("name", WireLeaseInfo, name, false, VMMB_LEASE_NAME_MAX),
        JSON_FIELD_ARRAY("holders", WireLeaseInfo, holders, n_holders, WireHolder, holder_fields, true, 0),
        JSON_FIELD_INT64("reclaim_priority", WireLeaseInfo, reclaim_priority, false, true),
        JSON_FIELD_STRING("reclaim", WireLeaseInfo, reclaim, false, VMMB_NAME_MAX),
        JSON_FIELD_BOOL("parked", WireLeaseInfo, parked, false),
        JSON_FIELD_BOOL("kept", WireLeaseInfo, kept, false),
        JSON_FIELD_END,
};

static const JsonField list_reply_fields[] = {
        JSON_FIELD_ARRAY("leases", ListReply, leases, n_leases, WireLeaseInfo, lease_info_fields, true, 0),
        JSON_FIELD_END,
};

static const JsonField user_device_fields[] = {
        JSON_FIELD_INT64("index", WireUserDevice, index, true, true),
        JSON_FIELD_UINT64("bytes", WireUserDevice, bytes),
        JSON_FIELD_UINT64("max_bytes", WireUserDevice, max_bytes),
        JSON_FIELD_INT64("host_bytes", WireUserDevice, host_bytes, false, true),
        JSON_FIELD_INT64("max_host_bytes", WireUserDevice, max_host_bytes, false, true),
        JSON_FIELD_END,
};

static const JsonField user_fields[] = {
        JSON_FIELD_INT64("uid", WireUser, uid, true, true),
        JSON_FIELD_UINT64("leases", WireUser, leases),
        JSON_FIELD_UINT64("max_leases", WireUser, max_leases),
        JSON_FIELD_UINT64("connections", WireUser, connections),
        JSON_FIELD_UINT64("max_connections", WireUser, max_connections),
        JSON_FIELD_UINT64("requests", WireUser, requests),
        JSON_FIELD_ARRAY("devices", WireUser, devices, n_devices, WireUserDevice, user_device_fields, true, 0),
        JSON_FIELD_END,
};

static const JsonField users_reply_fields[] = {
        JSON_FIELD_ARRAY("users", UsersReply, users, n_users, WireUser, user_fields, true, 0),
        JSON_FIELD_END,
};

static const JsonField device_fields[] = {
        JSON_FIELD_INT64("index", WireDevice, index, true, true),
        JSON_FIELD_STRING("name", WireDevice, name, true, VMMB_NAME_MAX),
        JSON_FIELD_UINT64("total", WireDevice, total),
        JSON_FIELD_UINT64("granularity", WireDevice, granularity),
        JSON_FIELD_UINT64("capacity", WireDevice, capacity),
        JSON_FIELD_UINT64("leased", WireDevice, leased),
        JSON_FIELD_UINT64("scrubbing", WireDevice, scrubbing),
        JSON_FIELD_UINT64("cached", WireDevice, cached),
        JSON_FIELD_UINT64("leases", WireDevice, leases),
        JSON_FIELD_INT64("waiters", WireDevice, waiters, false, true),
        JSON_FIELD_INT64("numa_node", WireDevice, numa_node, false, true),
        JSON_FIELD_INT64("host_capacity", WireDevice, host_capacity, false, true),
        JSON_FIELD_INT64("parked", WireDevice, parked, false, true),
        JSON_FIELD_INT64("host_cached", WireDevice, host_cached, false, true),
        JSON_FIELD_INT64("kept", WireDevice, kept, false, true),
        JSON_FIELD_END,
};

static const JsonField status_reply_fields[] = {
        JSON_FIELD_ARRAY("devices", StatusReply, devices, n_devices, WireDevice, device_fields, true, 0),
        JSON_FIELD_STRING("placement", StatusReply, placement, false, 32),
        JSON_FIELD_END,
};

static const JsonField metrics_reply_fields[] = {
        JSON_FIELD_TEXT("text", MetricsReply, text, true, VMMB_METRICS_MAX),
        JSON_FIELD_END,
};

static const JsonField info_fields[] = {
        JSON_FIELD_STRING("vendor", VarlinkInfo, vendor, true, VMMB_NAME_MAX),
        JSON_FIELD_STRING("product", VarlinkInfo, product, true, VMMB_NAME_MAX),
        JSON_FIELD_STRING("version", VarlinkInfo, version, true, VMMB_NAME_MAX),
        JSON_FIELD_STRING("url", VarlinkInfo, url, true, VMMB_NAME_MAX),
        JSON_FIELD_STRV("interfaces", VarlinkInfo, interfaces, n_interfaces, true, VARLINK_MAX_NAME),
        JSON_FIELD_END,
};

static const JsonField interface_params_fields[] = {
        JSON_FIELD_STRING("interface", InterfaceParams, interface, true, VARLINK_MAX_NAME),
        JSON_FIELD_END,
};

static const JsonField interface_description_fields[] = {
        JSON_FIELD_TEXT("description", InterfaceDescription, description, true, VMMB_DESCRIPTION_MAX),
        JSON_FIELD_END,
};

/* Errors: one table per error, all over VmmbError. */
static const JsonField error_out_of_memory_fields[] = {
        JSON_FIELD_INT64("device", VmmbError, device, true, true),
        JSON_FIELD_UINT64("requested", VmmbError, requested),
        JSON_FIELD_UINT64("available", VmmbError, available),
        JSON_FIELD_STRING("message", VmmbError, message, true, VMMB_MESSAGE_MAX),
        JSON_FIELD_END,
};

static const JsonField error_quota_exceeded_fields[] = {
        JSON_FIELD_STRING("resource", VmmbError, resource, true, VMMB_NAME_MAX),
        JSON_FIELD_UINT64("limit", VmmbError, limit),
        JSON_FIELD_UINT64("current", VmmbError, current),
        JSON_FIELD_STRING("message", VmmbError, message, true, VMMB_MESSAGE_MAX),
        JSON_FIELD_END,
};

static const JsonField error_no_such_lease_fields[] = {
        /* echoes what the caller sent, which may be longer than a real id */
        JSON_FIELD_STRING("id", VmmbError, id, true, VMMB_ID_MAX),
        JSON_FIELD_END,
};

static const JsonField error_name_fields[] = {
        /* echoes what the caller sent */
        JSON_FIELD_STRING("name", VmmbError, name, true, VMMB_LEASE_NAME_MAX),
        JSON_FIELD_END,
};

static const JsonField error_no_such_device_fields[] = {
        JSON_FIELD_INT64("device", VmmbError, device, true, true),
        JSON_FIELD_END,
};

static const JsonField error_invalid_parameter_fields[] = {
        JSON_FIELD_STRING("parameter", VmmbError, parameter, true, VMMB_NAME_MAX),
        JSON_FIELD_STRING("message", VmmbError, message, true, VMMB_MESSAGE_MAX),
        JSON_FIELD_END,
};

static const JsonField error_message_fields[] = {
        JSON_FIELD_STRING("message", VmmbError, message, true, VMMB_MESSAGE_MAX),
        JSON_FIELD_END,
};

static const JsonField error_method_fields[] = {
        JSON_FIELD_STRING("method", VmmbError, method, true, VARLINK_MAX_NAME),
        JSON_FIELD_END,
};

static const JsonField error_interface_fields[] = {
        JSON_FIELD_STRING("interface", VmmbError, interface, true, VARLINK_MAX_NAME),
        JSON_FIELD_END,
};

static const JsonField error_parameter_fields[] = {
        JSON_FIELD_STRING("parameter", VmmbError, parameter, true, VMMB_NAME_MAX),
        JSON_FIELD_END,
};

static const struct {
        const char *name;
        const JsonField *fields;
        int error;
} error_table[] = {
        { VMMB_ERROR_OUT_OF_MEMORY, error_out_of_memory_fields, -ENOMEM },
        { VMMB_ERROR_OUT_OF_HOST_MEMORY, error_out_of_memory_fields, -ENOSPC },
        { VMMB_ERROR_QUOTA_EXCEEDED, error_quota_exceeded_fields, -EDQUOT },
        { VMMB_ERROR_NO_SUCH_LEASE, error_no_such_lease_fields, -ENOENT },
        { VMMB_ERROR_NO_SUCH_TOKEN, empty_fields, -ENOKEY },
        { VMMB_ERROR_NO_SUCH_NAME, error_name_fields, -ENOENT },
        { VMMB_ERROR_NAME_IN_USE, error_name_fields, -EEXIST },
        { VMMB_ERROR_NO_SUCH_DEVICE, error_no_such_device_fields, -ENODEV },
        { VMMB_ERROR_INVALID_PARAMETER, error_invalid_parameter_fields, -EINVAL },
        { VMMB_ERROR_PERMISSION_DENIED, error_message_fields, -EACCES },
        { VMMB_ERROR_DRIVER_ERROR, error_message_fields, -EIO },
        { VMMB_ERROR_STORE_FAILED, error_message_fields, -EAGAIN },
        { VARLINK_ERROR_METHOD_NOT_FOUND, error_method_fields, -EOPNOTSUPP },
        { VARLINK_ERROR_METHOD_NOT_IMPLEMENTED, error_method_fields, -EOPNOTSUPP },
        { VARLINK_ERROR_INTERFACE_NOT_FOUND, error_interface_fields, -EOPNOTSUPP },
        { VARLINK_ERROR_INVALID_PARAMETER, error_parameter_fields, -EINVAL },
};

/* ---- Codecs ---- */

#define DEFINE_ENCODE(name, type, fields)                                      \
        int name##_encode(const type *in, json_object **ret) {                 \
                return json_build(fields, in, ret);                            \
        }
/* A whole reply message as text, from the table the encoder uses: the bytes the encoder's object makes. */
#define DEFINE_WRITE(name, type, fields)                                       \
        int name##_write(const type *in, VarlinkText *t) {                     \
                return varlink_reply_write(t, fields, in);                     \
        }
#define DEFINE_DONE(name, type, fields)                                        \
        void name##_done(type *p) {                                            \
                json_dispatch_free(fields, p);                                 \
        }
/* For parameters: the bad field is reported for an InvalidParameter error. */
#define DEFINE_PARAMS_CODEC(name, type, fields)                                \
        int name##_decode(json_object *params, type *ret, const char **ret_bad_field, \
                          char **ret_message) {                                \
                return json_dispatch(params, fields, ret, ret_bad_field, ret_message); \
        }                                                                      \
        DEFINE_ENCODE(name, type, fields)
/* For replies: the client only needs the sentence. */
#define DEFINE_REPLY_CODEC(name, type, fields)                                 \
        int name##_decode(json_object *params, type *ret, char **ret_message) { \
                return json_dispatch(params, fields, ret, NULL, ret_message);  \
        }                                                                      \
        DEFINE_ENCODE(name, type, fields)                                      \
        DEFINE_DONE(name, type, fields)

/* What alloc_params_decode() refuses beyond the table, in a struct json_dispatch() filled (r its result). */
static int alloc_params_check(int r, AllocParams *ret, const char **ret_bad_field, char **ret_message) {
        if (r < 0)
                return r;
        if (ret->size == 0) {
                alloc_params_done(ret);
                if (ret_bad_field)
                        *ret_bad_field = "size";
                set_message(ret_message, "Parameter 'size' must be at least 1.");
                return -EINVAL;
        }
        if (ret->devices && ret->device != VMMB_DEVICE_ANY) {
                alloc_params_done(ret);
                if (ret_bad_field)
                        *ret_bad_field = "devices";
                set_message(ret_message, "Give 'device' or 'devices', not both.");
                return -EINVAL;
        }
        return 0;
}

int alloc_params_decode(json_object *params, AllocParams *ret, const char **ret_bad_field, char **ret_message) {
        return alloc_params_check(json_dispatch(params, alloc_params_fields, ret, ret_bad_field, ret_message), ret,
                                  ret_bad_field, ret_message);
}

int alloc_params_decode_text(const char *text, size_t len, AllocParams *ret, const char **ret_bad_field,
                             char **ret_message) {
        return alloc_params_check(json_dispatch_text(text, len, alloc_params_fields, ret, ret_bad_field,
                                                     ret_message), ret, ret_bad_field, ret_message);
}

/* Alloc's parameters as they go on the wire, whether built or written: a wait_usec of 0 left out. */
static AllocParams alloc_params_wire(const AllocParams *in) {
        AllocParams a = *in;

        if (a.wait_usec == 0)
                a.wait_usec = JSON_ABSENT;      /* the same to the daemon, and what a daemon without waiting takes */
        return a;
}

int alloc_params_encode(const AllocParams *in, json_object **ret) {
        AllocParams a = alloc_params_wire(in);

        return json_build(alloc_params_fields, &a, ret);
}
int alloc_params_write(const AllocParams *in, VarlinkText *t) {
        AllocParams a = alloc_params_wire(in);

        return varlink_call_write(t, VMMB_METHOD_ALLOC, alloc_params_fields, &a, false, false);
}
DEFINE_DONE(alloc_params, AllocParams, alloc_params_fields)

DEFINE_PARAMS_CODEC(free_params, FreeParams, free_params_fields)
int free_params_decode_text(const char *text, size_t len, FreeParams *ret, const char **ret_bad_field,
                            char **ret_message) {
        return json_dispatch_text(text, len, free_params_fields, ret, ret_bad_field, ret_message);
}
int free_params_write(const FreeParams *in, bool oneway, VarlinkText *t) {
        return varlink_call_write(t, VMMB_METHOD_FREE, free_params_fields, in, oneway, false);
}
DEFINE_DONE(free_params, FreeParams, free_params_fields)
DEFINE_PARAMS_CODEC(id_params, FreeParams, id_params_fields)

int free_reply_decode(json_object *params, FreeReply *ret, char **ret_message) {
        if (!params || !json_object_is_type(params, json_type_object) ||
            !json_object_object_get_ex(params, "kept", NULL)) {
                *ret = (FreeReply){};
                return -ENODATA;
        }
        return json_dispatch(params, free_reply_fields, ret, NULL, ret_message);
}
int free_reply_decode_text(const char *text, size_t len, FreeReply *ret, char **ret_message) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        int r;

        /* `kept` is required in the table: read without error, it was there */
        r = text ? json_dispatch_text(text, len, free_reply_fields, ret, NULL, NULL) : -ENODATA;
        if (r == 0 || r == -ENOMEM)
                return r;
        /* else it is missing (-ENODATA) or the reply is bad: as free_reply_decode() says */
        if (text) {
                r = json_parse_message(text, len, &params);
                if (r < 0)
                        return r;
        }
        return free_reply_decode(params, ret, ret_message);
}
DEFINE_ENCODE(free_reply, FreeReply, free_reply_fields)
DEFINE_WRITE(free_reply, FreeReply, free_reply_fields)
DEFINE_DONE(free_reply, FreeReply, free_reply_fields)

int set_reclaimable_params_decode(json_object *params, SetReclaimableParams *ret, const char **ret_bad_field,
                                  char **ret_message) {
        int r = json_dispatch(params, set_reclaimable_params_fields, ret, ret_bad_field, ret_message);

        if (r < 0)
                return r;
        if (ret->priority > VMMB_RECLAIM_PRIORITY_MAX) {
                set_reclaimable_params_done(ret);
                if (ret_bad_field)
                        *ret_bad_field = "priority";
                set_message(ret_message, "Parameter 'priority' must be at most %" PRId64 ".",
                            VMMB_RECLAIM_PRIORITY_MAX);
                return -EINVAL;
        }
        return 0;
}
DEFINE_ENCODE(set_reclaimable_params, SetReclaimableParams, set_reclaimable_params_fields)
DEFINE_DONE(set_reclaimable_params, SetReclaimableParams, set_reclaimable_params_fields)
DEFINE_REPLY_CODEC(reclaim_request, ReclaimRequest, reclaim_request_fields)

DEFINE_REPLY_CODEC(park_reply, ParkReply, park_reply_fields)

DEFINE_PARAMS_CODEC(list_params, ListParams, list_params_fields)

DEFINE_PARAMS_CODEC(share_params, ShareParams, share_params_fields)
DEFINE_DONE(share_params, ShareParams, share_params_fields)
DEFINE_REPLY_CODEC(share_reply, ShareReply, share_reply_fields)

DEFINE_PARAMS_CODEC(revoke_params, RevokeParams, revoke_params_fields)
DEFINE_DONE(revoke_params, RevokeParams, revoke_params_fields)

DEFINE_PARAMS_CODEC(unpublish_params, UnpublishParams, unpublish_params_fields)
DEFINE_DONE(unpublish_params, UnpublishParams, unpublish_params_fields)

/* Fails a decode that json_dispatch() accepted: names the field, frees what was read. */
static int refuse_field(const JsonField *fields, void *p, const char *field, const char **ret_bad_field,
                        char **ret_message, const char *message) {
        json_dispatch_free(fields, p);
        if (ret_bad_field)
                *ret_bad_field = field;
        set_message(ret_message, "%s", message);
        return -EINVAL;
}

int attach_params_decode(json_object *params, AttachParams *ret, const char **ret_bad_field, char **ret_message) {
        int r;

        r = json_dispatch(params, attach_params_fields, ret, ret_bad_field, ret_message);
        if (r < 0)
                return r;
        if (!ret->token == !ret->name)
                return refuse_field(attach_params_fields, ret, "token", ret_bad_field, ret_message,
                                    "Give exactly one of 'token' and 'name'.");
        return 0;
}
DEFINE_ENCODE(attach_params, AttachParams, attach_params_fields)
int attach_params_write(const AttachParams *in, VarlinkText *t) {
        return varlink_call_write(t, VMMB_METHOD_ATTACH, attach_params_fields, in, false, false);
}
DEFINE_DONE(attach_params, AttachParams, attach_params_fields)

static bool name_is_valid(const char *name, const char *chars) {
        size_t n = name ? strlen(name) : 0;

        if (n == 0 || n > VMMB_LEASE_NAME_MAX || !((name[0] >= 'a' && name[0] <= 'z') ||
                                                   (name[0] >= 'A' && name[0] <= 'Z') ||
                                                   (name[0] >= '0' && name[0] <= '9')))
                return false;
        return strspn(name, chars) == n;
}

#define NAME_CHARS "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-:@+"

bool vmmb_lease_name_is_valid(const char *name) {
        return name_is_valid(name, NAME_CHARS);
}

bool vmmb_lease_name_was_valid(const char *name) {
        return name_is_valid(name, NAME_CHARS "/");
}

int vmmb_lease_name_split(const char *ref, char *buf, const char **ret_owner, const char **ret_name) {
        const char *slash = ref ? strchr(ref, '/') : NULL;
        size_t n = ref ? strlen(ref) : 0;

        if (n == 0 || n > VMMB_LEASE_NAME_REF_MAX)
                return -EINVAL;
        if (!slash) {
                if (!vmmb_lease_name_is_valid(ref))
                        return -EINVAL;
                *ret_owner = NULL;
                *ret_name = ref;
                return 0;
        }
        if (slash == ref || (size_t)(slash - ref) > VMMB_USER_NAME_MAX || !vmmb_lease_name_was_valid(slash + 1))
                return -EINVAL;
        memcpy(buf, ref, n + 1);
        buf[slash - ref] = 0;
        *ret_owner = buf;
        *ret_name = buf + (slash - ref) + 1;
        return 0;
}

int publish_params_decode(json_object *params, PublishParams *ret, const char **ret_bad_field,
                          char **ret_message) {
        int r;

        r = json_dispatch(params, publish_params_fields, ret, ret_bad_field, ret_message);
        if (r < 0)
                return r;
        if (!vmmb_lease_name_is_valid(ret->name))
                return refuse_field(publish_params_fields, ret, "name", ret_bad_field, ret_message,
                                    "A name is 1-128 letters, digits and ._-:@+ that begins with a letter or "
                                    "digit (others attach it as OWNER/NAME).");
        return 0;
}
DEFINE_ENCODE(publish_params, PublishParams, publish_params_fields)
DEFINE_DONE(publish_params, PublishParams, publish_params_fields)

DEFINE_PARAMS_CODEC(interface_params, InterfaceParams, interface_params_fields)
DEFINE_DONE(interface_params, InterfaceParams, interface_params_fields)

int empty_params_decode(json_object *params, const char **ret_bad_field, char **ret_message) {
        EmptyParams p;

        return json_dispatch(params, empty_fields, &p, ret_bad_field, ret_message);
}

int empty_params_decode_text(const char *text, size_t len, const char **ret_bad_field, char **ret_message) {
        EmptyParams p;

        return json_dispatch_text(text, len, empty_fields, &p, ret_bad_field, ret_message);
}

int empty_params_encode(json_object **ret) {
        EmptyParams p = {};

        return json_build(empty_fields, &p, ret);
}

int empty_reply_write(VarlinkText *t) {
        EmptyParams p = {};

        return varlink_reply_write(t, empty_fields, &p);
}

/* What alloc_reply_decode() refuses beyond the table, in a struct json_dispatch() filled (r its result). */
static int alloc_reply_check(int r, size_t n_fds, AllocReply *ret, char **ret_message) {
        _cleanup_free_ bool *seen = NULL;

        if (r < 0)
                return r;
        if (ret->lease.n_slabs != n_fds) {
                set_message(ret_message, "The lease has %zu slabs but came with %zu file descriptors.",
                            ret->lease.n_slabs, n_fds);
                r = -EINVAL;
                goto fail;
        }
        seen = calloc(n_fds ?: 1, sizeof(bool));
        if (!seen) {
                r = -ENOMEM;
                goto fail;
        }
        for (size_t i = 0; i < ret->lease.n_slabs; i++) {
                uint64_t fd = ret->lease.slabs[i].fd;

                if (fd >= n_fds || seen[fd]) {
                        set_message(ret_message, "Slab %zu names file descriptor %llu, which is %s.", i,
                                    (unsigned long long)fd, fd >= n_fds ? "not there" : "taken");
                        r = -EINVAL;
                        goto fail;
                }
                seen[fd] = true;
        }
        return 0;

fail:
        alloc_reply_done(ret);
        return r;
}

int alloc_reply_decode(json_object *params, size_t n_fds, AllocReply *ret, char **ret_message) {
        return alloc_reply_check(json_dispatch(params, alloc_reply_fields, ret, NULL, ret_message), n_fds, ret,
                                 ret_message);
}

int alloc_reply_check_fds(AllocReply *r, size_t n_fds, char **ret_message) {
        return alloc_reply_check(0, n_fds, r, ret_message);
}

int alloc_reply_parse_text(const char *text, size_t len, VarlinkReply *ret_reply, AllocReply *ret, bool *ret_decoded) {
        return varlink_reply_parse_text_into(text, len, ret_reply, alloc_reply_fields, ret, ret_decoded);
}

int alloc_reply_decode_text(const char *text, size_t len, size_t n_fds, AllocReply *ret, char **ret_message) {
        return alloc_reply_check(json_dispatch_text(text, len, alloc_reply_fields, ret, NULL, ret_message), n_fds,
                                 ret, ret_message);
}
DEFINE_ENCODE(alloc_reply, AllocReply, alloc_reply_fields)
DEFINE_WRITE(alloc_reply, AllocReply, alloc_reply_fields)
DEFINE_DONE(alloc_reply, AllocReply, alloc_reply_fields)

DEFINE_REPLY_CODEC(list_reply, ListReply, list_reply_fields)
DEFINE_REPLY_CODEC(status_reply, StatusReply, status_reply_fields)
DEFINE_WRITE(status_reply, StatusReply, status_reply_fields)
int status_reply_parse_text(const char *text, size_t len, VarlinkReply *ret_reply, StatusReply *ret,
                            bool *ret_decoded) {
        return varlink_reply_parse_text_into(text, len, ret_reply, status_reply_fields, ret, ret_decoded);
}

int status_reply_decode_text(const char *text, size_t len, StatusReply *ret, char **ret_message) {
        return json_dispatch_text(text, len, status_reply_fields, ret, NULL, ret_message);
}
DEFINE_REPLY_CODEC(users_reply, UsersReply, users_reply_fields)
DEFINE_REPLY_CODEC(tokens_reply, TokensReply, tokens_reply_fields)
DEFINE_REPLY_CODEC(metrics_reply, MetricsReply, metrics_reply_fields)

int varlink_info_encode(json_object **ret) {
        char *interfaces[] = { (char *)VARLINK_SERVICE_INTERFACE, (char *)VMMB_INTERFACE, NULL };
        VarlinkInfo info = {
                .vendor = (char *)"vmmbroker",
                .product = (char *)"vmmbrokerd",
                .version = (char *)VMMBROKER_VERSION,
                .url = (char *)VMMBROKER_URL,
                .interfaces = interfaces,
                .n_interfaces = ELEMENTSOF(interfaces) - 1,
        };

        return json_build(info_fields, &info, ret);
}

int varlink_info_decode(json_object *params, VarlinkInfo *ret, char **ret_message) {
        return json_dispatch(params, info_fields, ret, NULL, ret_message);
}
DEFINE_DONE(varlink_info, VarlinkInfo, info_fields)

int interface_description_encode(const char *interface, json_object **ret) {
        InterfaceDescription d;

        if (interface && strcmp(interface, VMMB_INTERFACE) == 0)
                d.description = (char *)vmmb_interface_description;
        else if (interface && strcmp(interface, VARLINK_SERVICE_INTERFACE) == 0)
                d.description = (char *)varlink_service_interface_description;
        else
                return -ENOENT;
        return json_build(interface_description_fields, &d, ret);
}

int interface_description_decode(json_object *params, InterfaceDescription *ret, char **ret_message) {
        return json_dispatch(params, interface_description_fields, ret, NULL, ret_message);
}
DEFINE_DONE(interface_description, InterfaceDescription, interface_description_fields)

/* ---- Errors ---- */

static const JsonField *error_fields(const char *error) {
        for (size_t i = 0; i < ELEMENTSOF(error_table); i++)
                if (strcmp(error_table[i].name, error) == 0)
                        return error_table[i].fields;
        return NULL;
}

static int error_build(const char *error, const VmmbError *e, json_object **ret) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        int r;

        r = json_build(error_fields(error), e, &params);
        if (r < 0)
                return r;
        return varlink_error_new(error, params, ret);
}

/* OutOfMemory and OutOfHostMemory: the same fields. */
static int error_no_room(const char *name, int64_t device, uint64_t requested, uint64_t available,
                         const char *message, json_object **ret) {
        VmmbError e = {
                .device = device,
                .requested = requested,
                .available = available,
                .message = (char *)message,
        };

        return error_build(name, &e, ret);
}

int vmmb_error_out_of_memory(int64_t device, uint64_t requested, uint64_t available, const char *message,
                             json_object **ret) {
        return error_no_room(VMMB_ERROR_OUT_OF_MEMORY, device, requested, available, message, ret);
}

int vmmb_error_out_of_host_memory(int64_t device, uint64_t requested, uint64_t available, const char *message,
                                  json_object **ret) {
        return error_no_room(VMMB_ERROR_OUT_OF_HOST_MEMORY, device, requested, available, message, ret);
}

int vmmb_error_quota_exceeded(const char *resource, uint64_t limit, uint64_t current, const char *message,
                              json_object **ret) {
        VmmbError e = {
                .resource = (char *)resource,
                .limit = limit,
                .current = current,
                .message = (char *)message,
        };

        return error_build(VMMB_ERROR_QUOTA_EXCEEDED, &e, ret);
}

int vmmb_error_no_such_lease(const char *id, json_object **ret) {
        VmmbError e = { .id = (char *)id };

        return error_build(VMMB_ERROR_NO_SUCH_LEASE, &e, ret);
}

int vmmb_error_no_such_token(json_object **ret) {
        VmmbError e = {};

        return error_build(VMMB_ERROR_NO_SUCH_TOKEN, &e, ret);
}

int vmmb_error_no_such_name(const char *name, json_object **ret) {
        VmmbError e = { .name = (char *)name };

        return error_build(VMMB_ERROR_NO_SUCH_NAME, &e, ret);
}

int vmmb_error_name_in_use(const char *name, json_object **ret) {
        VmmbError e = { .name = (char *)name };

        return error_build(VMMB_ERROR_NAME_IN_USE, &e, ret);
}

int vmmb_error_no_such_device(int64_t device, json_object **ret) {
        VmmbError e = { .device = device };

        return error_build(VMMB_ERROR_NO_SUCH_DEVICE, &e, ret);
}

int vmmb_error_invalid_parameter(const char *parameter, const char *message, json_object **ret) {
        VmmbError e = { .parameter = (char *)parameter, .message = (char *)message };

        return error_build(VMMB_ERROR_INVALID_PARAMETER, &e, ret);
}

int vmmb_error_permission_denied(const char *message, json_object **ret) {
        VmmbError e = { .message = (char *)message };

        return error_build(VMMB_ERROR_PERMISSION_DENIED, &e, ret);
}

int vmmb_error_driver_error(const char *message, json_object **ret) {
        VmmbError e = { .message = (char *)message };

        return error_build(VMMB_ERROR_DRIVER_ERROR, &e, ret);
}

int vmmb_error_store_failed(const char *message, json_object **ret) {
        VmmbError e = { .message = (char *)message };

        return error_build(VMMB_ERROR_STORE_FAILED, &e, ret);
}

int varlink_error_method_not_found(const char *method, json_object **ret) {
        VmmbError e = { .method = (char *)method };

        return error_build(VARLINK_ERROR_METHOD_NOT_FOUND, &e, ret);
}

int varlink_error_interface_not_found(const char *interface, json_object **ret) {
        VmmbError e = { .interface = (char *)interface };

        return error_build(VARLINK_ERROR_INTERFACE_NOT_FOUND, &e, ret);
}

int varlink_error_invalid_parameter(const char *parameter, json_object **ret) {
        VmmbError e = { .parameter = (char *)parameter };

        return error_build(VARLINK_ERROR_INVALID_PARAMETER, &e, ret);
}

int vmmb_error_decode(const char *error, json_object *params, VmmbError *ret, char **ret_message) {
        const JsonField *fields = error ? error_fields(error) : NULL;

        *ret = (VmmbError){ .device = -1 };
        if (!fields)
                return 0;
        return json_dispatch(params, fields, ret, NULL, ret_message);
}

void vmmb_error_done(VmmbError *e) {
        free(e->resource);
        free(e->id);
        free(e->name);
        free(e->parameter);
        free(e->method);
        free(e->interface);
        free(e->message);
        *e = (VmmbError){ .device = -1 };
}

int vmmb_error_to_errno(const char *error) {
        for (size_t i = 0; error && i < ELEMENTSOF(error_table); i++)
                if (strcmp(error_table[i].name, error) == 0)
                        return error_table[i].error;
        return -EPROTO;
}

void vmmb_error_describe(const char *error, json_object *params, const char *method, char **ret_message) {
        _cleanup_free_ char *problem = NULL;
        VmmbError e;

        if (vmmb_error_decode(error, params, &e, &problem) < 0) {
                set_message(ret_message, "The broker refused %s with %s.", method, error);
                return;
        }
        if (e.message && *e.message)
                set_message(ret_message, "%s", e.message);
        else if (strcmp(error, VMMB_ERROR_NO_SUCH_DEVICE) == 0)
                set_message(ret_message, "The broker serves no device %" PRId64 ".", e.device);
        else if (strcmp(error, VMMB_ERROR_NO_SUCH_LEASE) == 0)
                set_message(ret_message, "The broker has no lease %s of this process.", e.id ?: "(unnamed)");
        else if (strcmp(error, VMMB_ERROR_NO_SUCH_TOKEN) == 0)
                set_message(ret_message, "The broker knows no such token: it is mistyped, revoked, or its lease "
                            "has ended.");
        else if (strcmp(error, VMMB_ERROR_NO_SUCH_NAME) == 0)
                set_message(ret_message, "No lease is published as '%s'.", e.name ?: "");
        else if (strcmp(error, VMMB_ERROR_NAME_IN_USE) == 0)
                set_message(ret_message, "Another lease is published as '%s' already.", e.name ?: "");
        else if (e.parameter)
                set_message(ret_message, "The broker refused parameter '%s' of %s.", e.parameter, method);
        else if (e.method)
                set_message(ret_message, "The broker does not implement %s (%s): is it older than this client?",
                            e.method, error);
        else
                set_message(ret_message, "The broker refused %s with %s.", method, error);
        vmmb_error_done(&e);
}

static const char *file_kind(mode_t mode) {
        return S_ISREG(mode) ? "regular file" : S_ISDIR(mode) ? "directory" : S_ISFIFO(mode) ? "FIFO"
               : S_ISLNK(mode) ? "symbolic link" : "special file";
}

void vmmb_connect_message(const char *path, const char *default_path, int error, char **ret) {
        bool service = default_path && strcmp(path, default_path) == 0;
        const struct group *gr;
        const struct passwd *pw;
        char owner[64], group[64];
        struct stat st;
        int k = stat(path, &st) < 0 ? -errno : 0;

        *ret = NULL;
        if (k == -EACCES) {
                set_message(ret, "Cannot connect to the broker at %s: %s. You may not enter the folder it is in: "
                            "it is another user's, or the broker's folder is not open to you.", path,
                            strerror(EACCES));
                return;
        }
        switch (error) {
        case -ENOENT:
        case -ENOTDIR:
                if (service)
                        set_message(ret, "Cannot connect to the broker at %s: nothing is there. The broker's "
                                    "service is not installed or its socket is not active: 'systemctl start "
                                    "vmmbroker.socket' starts it ('systemctl status vmmbroker.socket' says why "
                                    "it stopped). For a broker of your own, set VMMBROKER_SOCKET to its socket "
                                    "('./dev.sh run' prints it).", path);
                else
                        set_message(ret, "Cannot connect to the broker at %s: nothing is there. No broker was "
                                    "started on that socket: start one ('./dev.sh run', or 'vmmbrokerd --socket "
                                    "%s'), or set VMMBROKER_SOCKET to the socket of one that runs (the "
                                    "service's is %s).", path, path, default_path ?: "its default");
                return;
        case -ECONNREFUSED:
                if (k == 0 && !S_ISSOCK(st.st_mode))
                        set_message(ret, "Cannot connect to the broker at %s: it is a %s, not a socket. "
                                    "VMMBROKER_SOCKET or --socket names the wrong file.", path,
                                    file_kind(st.st_mode));
                else if (service)
                        set_message(ret, "Cannot connect to the broker at %s: nobody listens on that socket. "
                                    "The broker stopped and its socket unit is not active: 'systemctl status "
                                    "vmmbroker.socket vmmbroker.service' says why.", path);
                else
                        set_message(ret, "Cannot connect to the broker at %s: nobody listens on that socket. "
                                    "The broker that made it has stopped: start it again.", path);
                return;
        case -EACCES:
        case -EPERM:
                if (k < 0)
                        break;
                pw = getpwuid(st.st_uid);
                gr = getgrgid(st.st_gid);
                snprintf(owner, sizeof(owner), "%s", pw ? pw->pw_name : "");
                if (!pw)
                        snprintf(owner, sizeof(owner), "uid %u", (unsigned)st.st_uid);
                snprintf(group, sizeof(group), "%s", gr ? gr->gr_name : "");
                if (!gr)
                        snprintf(group, sizeof(group), "%u", (unsigned)st.st_gid);
                if ((st.st_mode & S_IWGRP) && st.st_gid != 0)
                        set_message(ret, "Cannot connect to the broker at %s: %s. Leasing GPU memory needs "
                                    "membership of the socket's group, %s: an administrator adds you with "
                                    "'usermod -aG %s %s', then you log in again.", path, strerror(-error), group,
                                    group, getpwuid(geteuid()) ? getpwuid(geteuid())->pw_name : "USER");
                else
                        set_message(ret, "Cannot connect to the broker at %s: %s. Only %s may connect to it "
                                    "(mode %04o, group %s): it is %s's own broker, as './dev.sh run' starts one. "
                                    "Start your own, or use the service's socket%s%s.", path, strerror(-error),
                                    owner, (unsigned)(st.st_mode & 07777), group, owner,
                                    default_path ? ", " : "", default_path ?: "");
                return;
        default:
                break;
        }
        set_message(ret, "Cannot connect to the broker at %s: %s.", path, strerror(-error));
}
