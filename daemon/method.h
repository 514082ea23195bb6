/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The methods of io.vmmbroker and org.varlink.service: each decodes its
 * parameters (proto/codec.c), calls one operation of the broker (broker.c,
 * where the rules are) and encodes its outcome, a reply or a named error.
 * Nothing here decides who may do what.
 */

#include <json-c/json.h>

#include "broker.h"
#include "varlink.h"

typedef struct MethodReply {
        json_object *msg;               /* a whole envelope: a reply or an error */
        int fds[POOL_MAX_SLABS];        /* sent with it (borrowed from the slabs) */
        size_t n_fds;
} MethodReply;

/*
 * Answers one call of `c`: fills *r (free r->msg with json_object_put()) and
 * returns 0, or returns a negative errno for a failure of the daemon (the
 * caller closes the connection). An unknown method is answered
 * MethodNotFound.
 */
int method_call(Broker *b, const Caller *c, const VarlinkCall *call, MethodReply *r);
