/* SPDX-License-Identifier: MIT */
/*
 * deny-wx: run a command under the seccomp filter that systemd installs for
 * MemoryDenyWriteExecute=yes (src/shared/seccomp-util.c,
 * seccomp_memory_deny_write_execute): mmap() asking for PROT_WRITE|PROT_EXEC,
 * mprotect()/pkey_mprotect() asking for PROT_EXEC and shmat() with SHM_EXEC
 * fail with EPERM. This lets a GPU host check whether the NVIDIA driver's
 * libcuda works under that setting without a systemd service:
 *
 *     deny-wx vmmbrokerd --check
 *
 * x86-64 and aarch64 only (the architectures CUDA ships for).
 */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/shm.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#define ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define ARCH AUDIT_ARCH_AARCH64
#else
#error "deny-wx supports x86-64 and aarch64"
#endif

#define ARG_LO(n) (offsetof(struct seccomp_data, args[n]))  /* little-endian: low 32 bits first */
#define DENY BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA))
#define ALLOW BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)

int main(int argc, char *argv[]) {
        struct sock_filter filter[] = {
                BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
                BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH, 1, 0),
                BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
                BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
                BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mmap, 4, 0),
                BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mprotect, 8, 0),
                BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_pkey_mprotect, 7, 0),
                BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_shmat, 10, 0),
                ALLOW,
                /* mmap: prot (arg 2) has both PROT_WRITE and PROT_EXEC */
                BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG_LO(2)),
                BPF_STMT(BPF_ALU | BPF_AND | BPF_K, PROT_WRITE | PROT_EXEC),
                BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, PROT_WRITE | PROT_EXEC, 0, 1),
                DENY,
                ALLOW,
                /* mprotect, pkey_mprotect: prot (arg 2) has PROT_EXEC */
                BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG_LO(2)),
                BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, PROT_EXEC, 0, 1),
                DENY,
                ALLOW,
                /* shmat: shmflg (arg 2) has SHM_EXEC */
                BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG_LO(2)),
                BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, SHM_EXEC, 0, 1),
                DENY,
                ALLOW,
        };
        struct sock_fprog prog = { .len = sizeof(filter) / sizeof(filter[0]), .filter = filter };

        if (argc < 2) {
                fprintf(stderr, "usage: %s COMMAND [ARGUMENT...]\n", argv[0]);
                return 2;
        }
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 ||
            prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) < 0) {
                fprintf(stderr, "%s: cannot install the seccomp filter: %s\n", argv[0], strerror(errno));
                return 1;
        }
        execvp(argv[1], argv + 1);
        fprintf(stderr, "%s: cannot run %s: %s\n", argv[0], argv[1], strerror(errno));
        return 127;
}
