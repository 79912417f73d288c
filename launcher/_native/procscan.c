#define _GNU_SOURCE
/* One pass over /proc: identity, tree and cgroup of every process.
 *
 * The scan is a snapshot of a moving system. A pid listed by getdents may be
 * reaped before we open it, and then reused: so when two files are read, the
 * /proc/<pid> directory is opened once and both are opened relative to it.
 * The directory's inode holds the struct pid it was made for, not the
 * number; once that task is reaped, lookups under it fail with ENOENT even
 * if the number is reused (fs/proc/base.c, get_proc_task). Both files
 * therefore describe one process, or the entry is dropped as gone.
 *
 * Files are read with read() into stack buffers; no stdio and no allocation
 * in the loop, because the loop runs once per process on hosts with
 * thousands of them.
 *
 * Policy (what a missing cgroup or a denied stat means) is Python's; this
 * file returns 0 or -errno and fills out-parameters.
 */
#include "procscan.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

/* A /proc/<pid>/stat line is comm (at most 64 bytes) plus 50 numbers of at
 * most 20 digits; everything we need ends at field 22, well inside this. */
#define STAT_BUF 1024
#define CGROUP_BUF 4096

/* The task went away between readdir and read: procfs reports ENOENT at
 * open and ESRCH on read of a reaped task. */
static int gone(int err) {
    return err == ENOENT || err == ESRCH;
}

static int parse_pid(const char *s) {
    long v = 0;
    if (*s < '1' || *s > '9') return -1;  /* ".", "self", "thread-self", "sys"... */
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return -1;
        v = v * 10 + (*s - '0');
        if (v > INT_MAX) return -1;
    }
    return (int)v;
}

static ssize_t read_retry(int fd, char *buf, size_t len) {
    ssize_t n;
    do {
        n = read(fd, buf, len);
    } while (n < 0 && errno == EINTR);
    return n;
}

/* Reads one space-prefixed decimal field; the kernel prints some stat fields
 * signed (tpgid is -1 without a terminal), so a sign is accepted. */
static const char *next_field(const char *s, const char *end, long long *out) {
    int neg = 0;
    unsigned long long v = 0;
    if (s >= end || *s != ' ') return NULL;
    s++;
    if (s < end && *s == '-') {
        neg = 1;
        s++;
    }
    const char *start = s;
    while (s < end && *s >= '0' && *s <= '9') v = v * 10 + (unsigned long long)(*s++ - '0');
    if (s == start) return NULL;
    *out = neg ? -(long long)v : (long long)v;
    return s;
}

/* comm may hold spaces, parentheses and even newlines (prctl(PR_SET_NAME)
 * takes any bytes), so it ends at the LAST ')' of the line: everything after
 * it is numeric (proc(5) and fs/proc/array.c, do_task_stat). */
static int parse_stat(const char *buf, size_t len, struct ct_proc *p) {
    const char *end = buf + len;
    const char *lp = memchr(buf, '(', len);
    const char *rp = memrchr(buf, ')', len);
    if (!lp || !rp || rp < lp) return -EPROTO;

    size_t clen = (size_t)(rp - lp - 1);
    if (clen >= sizeof p->comm) {
        clen = sizeof p->comm - 1;
        p->flags |= CT_PROC_COMM_TRUNCATED;
    }
    memcpy(p->comm, lp + 1, clen);
    p->comm[clen] = 0;

    const char *s = rp + 1;
    if (end - s < 2 || s[0] != ' ') return -EPROTO;
    p->state = s[1];
    s += 2;
    for (int field = 4; field <= 22; field++) {
        long long v;
        if (!(s = next_field(s, end, &v))) return -EPROTO;
        switch (field) {
        case 4: p->ppid = (int)v; break;
        case 5: p->pgid = (int)v; break;
        case 6: p->sid = (int)v; break;
        case 22: p->start_time = (unsigned long long)v; break;
        }
    }
    return 0;
}

static int read_stat(int dirfd, const char *path, struct ct_proc *p) {
    char buf[STAT_BUF];
    int fd = openat(dirfd, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    /* One read is enough: stat is a single seq_file record and the fields
     * we parse fit the buffer even if the tail of the line does not. */
    ssize_t n = read_retry(fd, buf, sizeof buf);
    int err = errno;
    close(fd);
    if (n < 0) return -err;
    return parse_stat(buf, (size_t)n, p);
}

/* The v2 entry is the line "0::<path>"; on hybrid hosts the v1 lines come
 * first, in any number and of any length (cgroups(7)). The file is scanned
 * as a stream so that no line length is assumed, and reading stops at the
 * newline that ends the v2 line, which saves the read() that would report
 * EOF. */
static int read_cgroup(int piddir, struct ct_proc *p) {
    char buf[CGROUP_BUF];
    size_t out = 0;
    int col = 0;   /* bytes of "0::" matched at the start of this line; -1 skips to the newline */
    int found = 0, done = 0;

    int fd = openat(piddir, "cgroup", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    while (!done) {
        ssize_t n = read_retry(fd, buf, sizeof buf);
        if (n < 0) {
            int err = errno;
            close(fd);
            return -err;
        }
        if (n == 0) break;
        const char *c = buf, *e = buf + n;
        while (c < e) {
            if (found) {
                const char *nl = memchr(c, '\n', (size_t)(e - c));
                size_t k = (size_t)((nl ? nl : e) - c);
                if (k > sizeof p->cgroup - 1 - out) {
                    k = sizeof p->cgroup - 1 - out;
                    p->flags |= CT_PROC_CGROUP_TRUNCATED;
                }
                memcpy(p->cgroup + out, c, k);
                out += k;
                if (nl) {
                    done = 1;
                    break;
                }
                c = e;
            } else if (col < 0) {
                const char *nl = memchr(c, '\n', (size_t)(e - c));
                if (!nl) break;
                c = nl + 1;
                col = 0;
            } else if (*c == "0::"[col]) {
                c++;
                if (++col == 3) found = 1;
            } else {
                col = -1;
            }
        }
    }
    close(fd);
    p->cgroup[out] = 0;
    if (!found) p->flags |= CT_PROC_CGROUP_ABSENT;
    return 0;
}

static int fail_stat(struct ct_proc *p, int err) {
    if (gone(err)) return 0;
    p->flags |= CT_PROC_STAT_UNREADABLE;
    p->stat_errno = err;
    return 1;
}

/* Returns 1 if the entry is filled, 0 if the process is gone. */
static int read_one(int procfd, const char *name, int pid, int want_cgroup, struct ct_proc *p) {
    memset(p, 0, offsetof(struct ct_proc, comm));
    p->comm[0] = 0;
    p->cgroup[0] = 0;
    p->pid = pid;

    if (!want_cgroup) {
        /* A single file has no partner to disagree with, so "<pid>/stat" is
         * opened directly: the directory open would cost ~15% of the scan. */
        char path[32];
        size_t len = strlen(name);
        if (len > sizeof path - sizeof "/stat") return fail_stat(p, ENAMETOOLONG);
        memcpy(path, name, len);
        memcpy(path + len, "/stat", sizeof "/stat");
        int rc = read_stat(procfd, path, p);
        return rc < 0 ? fail_stat(p, -rc) : 1;
    }

    int piddir = openat(procfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (piddir < 0) return fail_stat(p, errno);
    int rc = read_stat(piddir, "stat", p);
    if (rc < 0) {
        close(piddir);
        return fail_stat(p, -rc);
    }
    rc = read_cgroup(piddir, p);
    close(piddir);
    if (rc < 0) {
        if (gone(-rc)) return 0;
        p->flags |= (rc == -EACCES || rc == -EPERM) ? CT_PROC_CGROUP_DENIED : CT_PROC_CGROUP_UNREADABLE;
        p->cgroup_errno = -rc;
        p->cgroup[0] = 0;
    }
    return 1;
}

int ct_procscan_read(struct ct_proc *out, int cap, int *n, int want_cgroup) {
    int count = 0, seen = 0, full = 0;
    *n = 0;
    int procfd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (procfd < 0) return -errno;
    DIR *d = fdopendir(procfd);
    if (!d) {
        int err = errno;
        close(procfd);
        return -err;
    }
    struct dirent *e;
    for (;;) {
        errno = 0;
        if (!(e = readdir(d))) break;
        int pid = parse_pid(e->d_name);
        if (pid < 0) continue;
        seen++;
        /* Out of room: keep counting so the caller can size the retry. */
        if (count >= cap) {
            full = 1;
            continue;
        }
        count += read_one(procfd, e->d_name, pid, want_cgroup, &out[count]);
    }
    int err = errno;
    closedir(d);
    if (err) return -err;
    if (full) {
        *n = seen;
        return -ENOSPC;
    }
    *n = count;
    return 0;
}
