/* SPDX-License-Identifier: MIT */

/*
 * with-daemon COMMAND [ARGS...]: starts vmmbrokerd ($VMMBROKER_DAEMON) on a
 * private socket, waits for its READY=1, runs COMMAND with VMMBROKER_SOCKET
 * pointing at it, then stops the daemon. Exits with COMMAND's status, or 1
 * if the daemon did not start or did not exit cleanly.
 */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

int main(int argc, char *argv[]) {
        Harness h;
        pid_t pid;
        int k, status;

        if (argc < 2) {
                fprintf(stderr, "Usage: %s COMMAND [ARGS...]\n", argv[0]);
                return 2;
        }
        k = harness_start(&h, NULL);
        if (k < 0) {
                fprintf(stderr, "with-daemon: vmmbrokerd did not start: %s\n", strerror(-k));
                return 1;
        }
        pid = fork();
        if (pid == 0) {
                setenv("VMMBROKER_SOCKET", h.socket, 1);
                execvp(argv[1], argv + 1);
                fprintf(stderr, "with-daemon: cannot run %s: %m\n", argv[1]);
                _exit(127);
        }
        status = harness_wait(pid);
        k = harness_stop(&h);
        if (k != 0) {
                fprintf(stderr, "with-daemon: vmmbrokerd exited with status %d\n", k);
                return 1;
        }
        return status;
}
