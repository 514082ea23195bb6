/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The daemon's configuration: vmmbroker.conf and its drop-ins, then the
 * command line on top. The file is systemd-style INI:
 *
 *     [Broker]
 *     Capacity=80%
 *     AdminGroup=gpu-admins
 *
 *     [Limits]                  (every user)
 *     MaxBytes=80%
 *
 *     [Group:ml]                (members of a group; the most generous group wins)
 *     MaxBytes=100%
 *
 *     [User:alice]              (one user; beats the groups)
 *     MaxLeases=4096
 *
 * Each key has one parser, used for the file and for the matching command-line
 * option alike, so both accept exactly the same values. An empty value resets
 * a key to its default. Every problem is reported with its place: "FILE:LINE:"
 * for the files, "--option:" for the command line.
 */

#include <stdbool.h>
#include <stdio.h>

#include "manager.h"

#define CONFIG_MAX_DEVICES 64

typedef struct Config {
        ManagerConfig manager;          /* what the daemon runs with; points into the fields below */
        char *socket_path;
        int devices[CONFIG_MAX_DEVICES];
        char *admin_group;
        UserLimits *limits;             /* the section being read: [Limits], or a [User:]/[Group:] rule's */
} Config;

/* Sets every key to its default. */
void config_init(Config *c);
void config_done(Config *c);

/*
 * Reads `path`, then `path`.d/\*.conf in lexical order. A missing file or
 * directory is not an error. Returns 0, or a negative errno with a message for
 * a person (naming the file and line) in *ret_message.
 */
int config_load(Config *c, const char *path, char **ret_message);

/*
 * Sets `key` of [Broker] as the file would, e.g. from a command-line option;
 * `where` names the source in the message ("--capacity"). Returns 0 or
 * -EINVAL with *ret_message.
 */
int config_set(Config *c, const char *key, const char *value, const char *where, char **ret_message);

/* Writes the effective configuration in the file's own format. */
void config_print(const Config *c, FILE *f);
