/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fdpass.h"
#include "macro.h"

void close_many(int *fds, size_t n) {
        for (size_t i = 0; i < n; i++)
                fds[i] = safe_close(fds[i]);
}

ssize_t fd_send(int sock, const void *buf, size_t len, const int *fds, size_t n_fds) {
        union {
                struct cmsghdr align;
                char buf[CMSG_SPACE(sizeof(int) * FDPASS_MAX_FDS)];
        } control;
        struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
        struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
        ssize_t n;

        if (len == 0 || n_fds > FDPASS_MAX_FDS)
                return -EINVAL;
        if (n_fds > 0) {
                struct cmsghdr *c;

                memset(&control, 0, sizeof(control));
                msg.msg_control = control.buf;
                msg.msg_controllen = CMSG_SPACE(sizeof(int) * n_fds);
                c = CMSG_FIRSTHDR(&msg);
                c->cmsg_level = SOL_SOCKET;
                c->cmsg_type = SCM_RIGHTS;
                c->cmsg_len = CMSG_LEN(sizeof(int) * n_fds);
                memcpy(CMSG_DATA(c), fds, sizeof(int) * n_fds);
        }
        do
                n = sendmsg(sock, &msg, MSG_NOSIGNAL);
        while (n < 0 && errno == EINTR);
        return n < 0 ? -errno : n;
}

ssize_t fd_recv(int sock, void *buf, size_t len, int *fds, size_t max_fds, size_t *ret_n_fds) {
        union {
                struct cmsghdr align;
                char buf[CMSG_SPACE(sizeof(int) * FDPASS_MAX_FDS)];
        } control;
        struct iovec iov = { .iov_base = buf, .iov_len = len };
        struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
        size_t n_fds = 0;
        bool bad = false;
        ssize_t n;

        if (max_fds > FDPASS_MAX_FDS)
                max_fds = FDPASS_MAX_FDS;
        /*
         * Always offer room for the kernel's maximum: a peer that sends more
         * than the caller wants must show up as an error here, not silently
         * lose fds to MSG_CTRUNC accounting.
         */
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof(control.buf);
        do
                n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
        while (n < 0 && errno == EINTR);
        if (n < 0)
                return -errno;

        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
                size_t k;

                if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
                        bad = true;
                        continue;
                }
                k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (size_t i = 0; i < k; i++) {
                        int fd;

                        memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                        if (n_fds < max_fds)
                                fds[n_fds++] = fd;
                        else {
                                safe_close(fd);
                                bad = true;
                        }
                }
        }
        if (bad || (msg.msg_flags & MSG_CTRUNC)) {
                close_many(fds, n_fds);
                if (ret_n_fds)
                        *ret_n_fds = 0;
                return -EPROTO;
        }
        if (ret_n_fds)
                *ret_n_fds = n_fds;
        else
                close_many(fds, n_fds);
        return n;
}
