/* Drives ct_procscan_read in every mode and thread count, for a build
 * under ThreadSanitizer or AddressSanitizer (tests/test_scan_sanitizers.py).
 * Exits non-zero on a failed call or an impossible result; the sanitizers
 * report races and memory errors themselves. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "procscan.h"

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 100, cap = 1 << 16, n;
    struct ct_proc *out = malloc(sizeof *out * (size_t)cap);
    int *pids = malloc(sizeof *pids * (size_t)cap);
    struct ct_procscan_stats st;
    static const int modes[] = {CT_PROCSCAN_CGROUP, CT_PROCSCAN_CGROUP | CT_PROCSCAN_NO_WALK, 0};
    if (!out || !pids) return 2;
    for (int r = 0; r < rounds; r++) {
        int flags = modes[r % 3], threads = r % 5; /* 0: chosen by the scan */
        int rc = ct_procscan_read(out, cap, &n, flags, threads, &st);
        if (rc) {
            fprintf(stderr, "round %d: rc %d\n", r, rc);
            return 1;
        }
        for (int i = 0; i < n; i++) {
            if (out[i].pid <= 0 || !out[i].state || (out[i].flags & CT_PROC_STAT_UNREADABLE)) {
                fprintf(stderr, "round %d: bad entry %d (pid %d)\n", r, i, out[i].pid);
                return 1;
            }
            pids[i] = out[i].pid;
        }
        qsort(pids, (size_t)n, sizeof *pids, cmp_int);
        for (int i = 1; i < n; i++) {
            if (pids[i] == pids[i - 1]) {
                fprintf(stderr, "round %d: pid %d twice\n", r, pids[i]);
                return 1;
            }
        }
    }
    if (ct_procscan_read(out, 1, &n, CT_PROCSCAN_CGROUP, 4, &st) != -ENOSPC || n < 2) {
        fprintf(stderr, "no ENOSPC for a buffer of 1\n");
        return 1;
    }
    free(out);
    free(pids);
    puts("ok");
    return 0;
}
