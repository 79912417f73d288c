#define _GNU_SOURCE
/* Descriptors across execve: every one >= 3 marked close-on-exec (the
 * spawn child) or closed (the init), except those to keep. Async-signal-
 * safe: runs in a child between clone and execve. */
#include "fds.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

static int is_kept(const int *keep, int nkeep, int fd) {
    for (int i = 0; i < nkeep; i++) {
        if (keep[i] == fd) return 1;
        if (keep[i] > fd) return 0;
    }
    return 0;
}

static int set_cloexec(int fd, int on) {
    int fl = fcntl(fd, F_GETFD);
    if (fl < 0) return -errno;
    int want = on ? (fl | FD_CLOEXEC) : (fl & ~FD_CLOEXEC);
    if (want != fl && fcntl(fd, F_SETFD, want) < 0) return -errno;
    return 0;
}

struct ct_dirent64 {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

/* Mark close-on-exec, or close. */
static int drop_fd(int fd, int closing) {
    if (!closing) return set_cloexec(fd, 1);
    return close(fd) < 0 && errno != EINTR ? -errno : 0;
}

/* The fallback of _posixsubprocess (_close_open_fds_safe): list this
 * process's own table. The directory is opened here, in the child: one
 * opened before the clone would list the parent's table ("self" is
 * resolved at open time), which other threads keep changing. Returns how
 * many descriptors it dropped. */
static int drop_by_scan(const int *keep, int nkeep, int closing) {
    char buf[4096];
    int dropped = 0;
    int dfd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return -errno;
    for (;;) {
        long n = syscall(SYS_getdents64, dfd, buf, sizeof buf);
        if (n < 0) {
            int e = errno;
            close(dfd);
            return -e;
        }
        if (n == 0) break;
        for (long off = 0; off < n;) {
            struct ct_dirent64 *d = (struct ct_dirent64 *)(buf + off);
            off += d->d_reclen;
            int fd = 0, digits = 0;
            for (const char *p = d->d_name; *p; p++) {
                if (*p < '0' || *p > '9') {
                    digits = 0;
                    break;
                }
                fd = fd * 10 + (*p - '0');
                digits++;
            }
            if (!digits || fd < 3 || fd == dfd || is_kept(keep, nkeep, fd)) continue;
            int rc = drop_fd(fd, closing);
            if (rc < 0 && rc != -EBADF) {
                close(dfd);
                return rc;
            }
            dropped++;
        }
    }
    close(dfd);
    return dropped;
}

static int drop_by_loop(const int *keep, int nkeep, int closing) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0) return -errno;
    long max = rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (1L << 30) ? (1L << 20) : (long)rl.rlim_cur;
    for (long fd = 3; fd < max; fd++) {
        if (is_kept(keep, nkeep, (int)fd)) continue;
        int rc = drop_fd((int)fd, closing);
        if (rc < 0 && rc != -EBADF) return rc;
    }
    return 0;
}

static int fds_except(const int *keep, int nkeep, int how, int closing) {
    int rc;
    for (int i = 0; i < nkeep; i++) {
        if (keep[i] < 3 || (i && keep[i] <= keep[i - 1])) return -EINVAL;
        if (!closing && (rc = set_cloexec(keep[i], 0)) < 0) return rc;
    }
    if (how == 0) {
        unsigned int lo = 3;
        int fallback = 0;
        for (int i = 0; i <= nkeep && !fallback; i++) {
            unsigned int hi = i < nkeep ? (unsigned int)keep[i] - 1 : ~0U;
            if (hi >= lo && syscall(SYS_close_range, lo, hi, closing ? 0U : CLOSE_RANGE_CLOEXEC) < 0) {
                /* ENOSYS before 5.9, EINVAL for the flag before 5.11 */
                if (errno != ENOSYS && errno != EINVAL) return -errno;
                fallback = 1;
            }
            if (i < nkeep) lo = (unsigned int)keep[i] + 1;
        }
        if (!fallback) return 0;
        how = 1;
    }
    if (how == 1) {
        /* Closing while listing can make getdents skip entries: list
         * again until a pass finds nothing left to close. */
        for (int pass = 0; pass < 8; pass++) {
            rc = drop_by_scan(keep, nkeep, closing);
            if (rc == 0 || (rc > 0 && !closing)) return 0;
            if (rc < 0) break;
        }
        if (rc >= 0) return 0;
        if (rc != -ENOENT && rc != -EACCES && rc != -ENOTDIR) return rc;
    }
    return drop_by_loop(keep, nkeep, closing);
}

int ct_fds_cloexec_except(const int *keep, int nkeep, int how) {
    return fds_except(keep, nkeep, how, 0);
}

int ct_fds_close_except(const int *keep, int nkeep) {
    return fds_except(keep, nkeep, 0, 1);
}
