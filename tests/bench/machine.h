/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What the GPU benchmarks say about the machine they ran on, in their header: the date, the kernel, the CPU
 * model and how many CPUs are online, the GPU (device 0) with its memory, the driver library, the CUDA version
 * it reports and, on NVIDIA's driver, the kernel module's version (/proc/driver/nvidia/version). Numbers
 * without this are not comparable.
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "driver.h"
#include "size.h"

/* The value of the first line of `path` that starts with `key` (after its ':', or the whole line), or "". */
static inline void machine_read_line(const char *path, const char *key, char *buf, size_t len) {
        char line[512];
        FILE *f = fopen(path, "re");

        buf[0] = 0;
        while (f && fgets(line, sizeof(line), f))
                if (strncmp(line, key, strlen(key)) == 0) {
                        char *v = strchr(line, ':');

                        snprintf(buf, len, "%s", v ? v + 1 + strspn(v + 1, " \t") : line);
                        buf[strcspn(buf, "\n")] = 0;
                        break;
                }
        if (f)
                fclose(f);
}

/*
 * Loads the driver (the simulated one under $VMMBROKER_LIBCUDA) and makes device 0's primary context
 * current, as every GPU benchmark starts; on any failure prints why, as PROG, and exits.
 */
static inline void machine_open_device(const char *prog, CudaDriver **ret_cu, CUdevice *ret_dev, CUcontext *ret_ctx) {
        char *message = NULL;
        CUresult r;

        if (cuda_driver_open(ret_cu, NULL, &message) < 0) {
                fprintf(stderr, "%s: %s\n", prog, message ?: "cannot load the driver");
                exit(EXIT_FAILURE);
        }
        r = (*ret_cu)->cuDeviceGet(ret_dev, 0);
        if (r == CUDA_SUCCESS)
                r = (*ret_cu)->cuDevicePrimaryCtxRetain(ret_ctx, *ret_dev);
        if (r == CUDA_SUCCESS)
                r = (*ret_cu)->cuCtxSetCurrent(*ret_ctx);
        if (r != CUDA_SUCCESS) {
                fprintf(stderr, "%s: device 0's primary context: %s\n", prog, cuda_result_name(*ret_cu, r));
                exit(EXIT_FAILURE);
        }
}

/* Prints "PROG: date, kernel, CPUs" and "gpu: ..." lines. */
static inline void machine_print(const char *prog, CudaDriver *cu) {
        char model[256], nvrm[512], name[256] = "unknown", date[64], total[FORMAT_SIZE_MAX] = "?";
        time_t now = time(NULL);
        struct utsname u;
        size_t bytes = 0;
        CUdevice dev;

        machine_read_line("/proc/cpuinfo", "model name", model, sizeof(model));
        /* "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  ..." */
        machine_read_line("/proc/driver/nvidia/version", "NVRM version", nvrm, sizeof(nvrm));
        if (cu->cuDeviceGet(&dev, 0) == CUDA_SUCCESS) {
                (void)cu->cuDeviceGetName(name, sizeof(name), dev);
                if (cu->cuDeviceTotalMem(&bytes, dev) == CUDA_SUCCESS)
                        format_size(bytes, total, sizeof(total));
        }
        uname(&u);
        strftime(date, sizeof(date), "%Y-%m-%d %H:%M:%S %Z", localtime(&now));
        printf("%s: %s, Linux %s, %ld CPUs online, %s\n", prog, date, u.release, sysconf(_SC_NPROCESSORS_ONLN),
               model[0] ? model : "CPU model unknown");
        printf("gpu: device 0 %s, %s; driver %s (CUDA %d.%d)%s%s\n", name, total, cu->path, cu->version / 1000,
               cu->version % 1000 / 10, nvrm[0] ? "; " : "", nvrm);
}
