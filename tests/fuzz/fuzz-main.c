/* SPDX-License-Identifier: MIT */

/*
 * Runs a fuzz target over inputs without libFuzzer: for compilers that have
 * none (gcc), so that the seed corpus and saved crashes are checked in every
 * build. Each argument is an input file, or a directory whose files are
 * inputs (in name order). Exits non-zero if there were no inputs; a failing
 * input aborts, as under libFuzzer.
 */

#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static unsigned n_inputs;

static void run_file(const char *path) {
        FILE *f = fopen(path, "re");
        uint8_t *data = NULL;
        size_t size = 0, alloc = 0;

        if (!f) {
                fprintf(stderr, "%s: %s\n", path, strerror(errno));
                exit(1);
        }
        for (;;) {
                size_t n;

                if (size == alloc) {
                        alloc = alloc ? alloc * 2 : 4096;
                        data = realloc(data, alloc);
                        if (!data) {
                                fprintf(stderr, "out of memory\n");
                                exit(1);
                        }
                }
                n = fread(data + size, 1, alloc - size, f);
                if (n == 0)
                        break;
                size += n;
        }
        if (ferror(f)) {
                fprintf(stderr, "%s: read error\n", path);
                exit(1);
        }
        fclose(f);
        fprintf(stderr, "Running %s (%zu bytes)\n", path, size);
        LLVMFuzzerTestOneInput(data, size);
        free(data);
        n_inputs++;
}

static int by_name(const struct dirent **a, const struct dirent **b) {
        return strcmp((*a)->d_name, (*b)->d_name);
}

static void run_path(const char *path) {
        struct dirent **names;
        struct stat st;
        int n;

        if (stat(path, &st) < 0) {
                fprintf(stderr, "%s: %s\n", path, strerror(errno));
                exit(1);
        }
        if (!S_ISDIR(st.st_mode)) {
                run_file(path);
                return;
        }
        n = scandir(path, &names, NULL, by_name);
        if (n < 0) {
                fprintf(stderr, "%s: %s\n", path, strerror(errno));
                exit(1);
        }
        for (int i = 0; i < n; i++) {
                char *p;

                if (names[i]->d_name[0] != '.') {
                        if (asprintf(&p, "%s/%s", path, names[i]->d_name) < 0) {
                                fprintf(stderr, "out of memory\n");
                                exit(1);
                        }
                        run_path(p);
                        free(p);
                }
                free(names[i]);
        }
        free(names);
}

int main(int argc, char **argv) {
        LLVMFuzzerInitialize(&argc, &argv);
        for (int i = 1; i < argc; i++)
                run_path(argv[i]);
        if (n_inputs == 0) {
                fprintf(stderr, "No inputs.\n");
                return 1;
        }
        printf("%u inputs, every check passed\n", n_inputs);
        return 0;
}
