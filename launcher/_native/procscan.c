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
 * Opening /proc/<pid>/cgroup for every process costs as much as the stat
 * reads themselves, so cgroups are learnt the other way round: before any
 * stat is read, the cgroup v2 hierarchy is walked once and every
 * cgroup.procs read into a pid -> path map (walk_hierarchy below). A map
 * entry is only trusted for a process that provably existed before the walk
 * began (its start time is older), because such a process, alive when its
 * stat is read after the walk, was alive throughout the walk, so the pid the
 * walk saw was this process and not an earlier holder of the number. Every
 * other process -- younger, unlisted (zombies are not in cgroup.procs),
 * listed twice (it moved during the walk) or under a threaded domain --
 * has its /proc/<pid>/cgroup read as before, under the same directory as
 * its stat.
 *
 * Files are read with read() into stack buffers; no stdio and no allocation
 * in the per-process loop, because it runs once per process on hosts with
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
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
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

/* ---- the cgroup v2 hierarchy, walked once -------------------------------- */

/* cgroup.procs of a busy cgroup can be hundreds of kilobytes; it is parsed
 * as a stream through this buffer, so no size is assumed. */
#define PROCS_BUF 65536
/* Deeper cgroups are not walked; their processes fall back to per-process
 * reads. The bound only keeps open directories (one per level) finite. */
#define WALK_MAX_DEPTH 128

struct cg_entry {
    int pid;
    int path;  /* offset of the NUL-terminated path in walk.paths; -1: ask /proc/<pid>/cgroup */
};

struct walk {
    struct cg_entry *ents;
    size_t n, cap;
    char *paths;           /* every directory's path, NUL-terminated, back to back */
    size_t plen, pcap;
    char *path;            /* the directory being read, as /proc/<pid>/cgroup prints it */
    size_t pathlen, pathcap;
    char *buf;             /* PROCS_BUF bytes */
    int dirs;              /* cgroup.procs files read */
    int err;               /* first error; the subtree it hit fell back */
};

static void walk_note(struct walk *w, int err) {
    if (!w->err) w->err = err;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q) return -ENOMEM;
    *p = q;
    *cap = c;
    return 0;
}

static int path_set(struct walk *w, const char *s, size_t len) {
    if (grow((void **)&w->path, &w->pathcap, len + 1, 1) < 0) return -ENOMEM;
    memcpy(w->path, s, len);
    w->path[len] = 0;
    w->pathlen = len;
    return 0;
}

/* "/" + "a" is "/a", "/x" + "a" is "/x/a": the kernel's path join. */
static int path_push(struct walk *w, const char *name) {
    size_t k = strlen(name);
    size_t sep = (w->pathlen == 1 && w->path[0] == '/') ? 0 : 1;
    if (grow((void **)&w->path, &w->pathcap, w->pathlen + sep + k + 1, 1) < 0) return -ENOMEM;
    if (sep) w->path[w->pathlen++] = '/';
    memcpy(w->path + w->pathlen, name, k + 1);
    w->pathlen += k;
    return 0;
}

static int push_pid(struct walk *w, long pid, int path) {
    /* pid 0: a process outside our pid namespace (task_pid_vnr). */
    if (pid <= 0 || pid > INT_MAX) return 0;
    if (grow((void **)&w->ents, &w->cap, w->n + 1, sizeof *w->ents) < 0) return -ENOMEM;
    w->ents[w->n].pid = (int)pid;
    w->ents[w->n].path = path;
    w->n++;
    return 0;
}

/* Reads one cgroup.procs (one pid per line) into the map. On any failure
 * the entries it added are taken back, so a half-read file maps nobody. */
static int read_procs(struct walk *w, int dfd, int path) {
    size_t first = w->n;
    int fd = openat(dfd, "cgroup.procs", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    long v = 0;
    int digits = 0, rc = 0;
    for (;;) {
        /* A kernfs seq_file read may return less than asked at any point;
         * only 0 means the end. */
        ssize_t k = read_retry(fd, w->buf, PROCS_BUF);
        if (k < 0) {
            rc = -errno;
            break;
        }
        if (k == 0) break;
        for (ssize_t i = 0; i < k; i++) {
            char c = w->buf[i];
            if (c >= '0' && c <= '9') {
                if (v <= INT_MAX) v = v * 10 + (c - '0');
                digits++;
            } else {
                if (digits && (rc = push_pid(w, v, path)) < 0) break;
                v = 0;
                digits = 0;
            }
        }
        if (rc < 0) break;
    }
    if (!rc && digits) rc = push_pid(w, v, path);
    close(fd);
    w->dirs++;
    if (rc < 0) w->n = first;
    return rc;
}

static long add_path(struct walk *w) {
    if (w->plen + w->pathlen + 1 > INT_MAX) return -ENOMEM;
    if (grow((void **)&w->paths, &w->pcap, w->plen + w->pathlen + 1, 1) < 0) return -ENOMEM;
    long off = (long)w->plen;
    memcpy(w->paths + w->plen, w->path, w->pathlen + 1);
    w->plen += w->pathlen + 1;
    return off;
}

/* Walks the directory dfd (taken: closed here), whose path is w->path.
 * Returns -EOPNOTSUPP if it is a threaded cgroup, 0 otherwise.
 *
 * A threaded domain's cgroup.procs lists every process of its threaded
 * subtree, while /proc/<pid>/cgroup names the cgroup of the process's
 * leader thread, which may be a threaded child; the children's own
 * cgroup.procs refuse to be read (cgroup-v2.rst, "Threads";
 * kernel/cgroup/cgroup.c, cgroup_procs_start). So the refusal is the
 * signal: a cgroup with a threaded child maps none of its pids, and they
 * are read one by one. */
static int walk_dir(struct walk *w, int dfd, int depth) {
    size_t first = w->n;
    long off = add_path(w);
    if (off < 0) {
        walk_note(w, ENOMEM);
        close(dfd);
        return 0;
    }
    int rc = read_procs(w, dfd, (int)off);
    if (rc == -EOPNOTSUPP) {
        close(dfd);
        return rc;
    }
    /* ENOENT: removed while we walked; its processes are elsewhere now. */
    if (rc < 0 && rc != -ENOENT && rc != -ENODEV) walk_note(w, -rc);
    size_t own_end = w->n;
    if (depth >= WALK_MAX_DEPTH) {
        walk_note(w, ELOOP);
        close(dfd);
        return 0;
    }
    DIR *d = fdopendir(dfd);
    if (!d) {
        walk_note(w, errno);
        close(dfd);
        return 0;
    }
    int threaded_child = 0;
    size_t len = w->pathlen;
    for (;;) {
        errno = 0;
        struct dirent *e = readdir(d);
        if (!e) {
            if (errno && errno != ENOENT) walk_note(w, errno);
            break;
        }
        /* kernfs reports d_type; DT_UNKNOWN is only tried as a directory. */
        if (e->d_type != DT_DIR && e->d_type != DT_UNKNOWN) continue;
        const char *nm = e->d_name;
        if (nm[0] == '.' && (!nm[1] || (nm[1] == '.' && !nm[2]))) continue;
        int cfd = openat(dirfd(d), nm, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (cfd < 0) {
            if (errno != ENOENT && errno != ENOTDIR) walk_note(w, errno);
            continue;
        }
        if (path_push(w, nm) < 0) {
            walk_note(w, ENOMEM);
            close(cfd);
            continue;
        }
        if (walk_dir(w, cfd, depth + 1) == -EOPNOTSUPP) threaded_child = 1;
        w->pathlen = len;
        w->path[len] = 0;
    }
    closedir(d);
    if (threaded_child)
        for (size_t i = first; i < own_end; i++) w->ents[i].path = -1;
    return 0;
}

/* mountinfo escapes space, tab, newline and backslash as \ooo (proc(5)). */
static size_t unescape(char *s) {
    char *o = s;
    for (char *c = s; *c; c++) {
        if (c[0] == '\\' && c[1] >= '0' && c[1] <= '3' && c[2] >= '0' && c[2] <= '7' && c[3] >= '0' &&
            c[3] <= '7') {
            *o++ = (char)((c[1] - '0') * 64 + (c[2] - '0') * 8 + (c[3] - '0'));
            c += 3;
        } else {
            *o++ = *c;
        }
    }
    *o = 0;
    return (size_t)(o - s);
}

static int read_whole(const char *path, char **out, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (grow((void **)&buf, &cap, n + 8192, 1) < 0) {
            free(buf);
            close(fd);
            return -ENOMEM;
        }
        ssize_t k = read_retry(fd, buf + n, cap - n - 1);
        if (k < 0) {
            int err = errno;
            free(buf);
            close(fd);
            return -err;
        }
        if (k == 0) break;
        n += (size_t)k;
    }
    close(fd);
    buf[n] = 0;
    *out = buf;
    *len = n;
    return 0;
}

struct mount2 {
    char *point;  /* where it is mounted */
    char *root;   /* mountinfo field 4: the mount's root, as /proc/<pid>/cgroup would print it */
};

/* root is at or under other: "/a/b" is under "/a" and "/"; "/ab" is not. */
static int under(const char *root, const char *other) {
    size_t k = strlen(other);
    if (k == 1 && other[0] == '/') return 1;
    return strncmp(root, other, k) == 0 && (root[k] == 0 || root[k] == '/');
}

/* Every process /proc/<pid>/cgroup would place in the v2 hierarchy is in
 * some cgroup.procs below a cgroup2 mount whose root is an ancestor of its
 * cgroup. Both the mount root (field 4) and /proc/<pid>/cgroup are printed
 * relative to the reader's cgroup namespace (kernel/cgroup/cgroup.c,
 * cgroup_show_path and proc_cgroup_show), so root + the path below the
 * mount point is exactly the string /proc/<pid>/cgroup shows. One mount of
 * root "/" covers everything; without one, every mount is walked except
 * those another walked mount already covers. */
static void walk_hierarchy(struct walk *w) {
    char *info = NULL;
    size_t len = 0;
    int rc = read_whole("/proc/self/mountinfo", &info, &len);
    if (rc < 0) {
        walk_note(w, -rc);
        return;
    }
    struct mount2 m[64];
    int nm = 0;
    for (char *line = info; line && *line && nm < (int)(sizeof m / sizeof *m);) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        /* id parent maj:min root point options [optional...] - fstype ... */
        char *f[7];
        int k = 0;
        char *save = NULL;
        for (char *t = strtok_r(line, " ", &save); t; t = k < 6 ? strtok_r(NULL, " ", &save) : NULL) f[k++] = t;
        if (k == 6) {
            char *t;
            while ((t = strtok_r(NULL, " ", &save)) && strcmp(t, "-") != 0) {}
            if (t && (t = strtok_r(NULL, " ", &save)) && strcmp(t, "cgroup2") == 0) {
                unescape(f[3]);
                unescape(f[4]);
                m[nm].root = f[3];
                m[nm].point = f[4];
                if (strcmp(f[3], "/") == 0) {
                    m[0] = m[nm];
                    nm = 1;
                    break;
                }
                nm++;
            }
        }
        line = nl ? nl + 1 : NULL;
    }
    for (int i = 0; i < nm; i++) {
        int covered = 0;
        for (int j = 0; j < i && !covered; j++) covered = under(m[i].root, m[j].root);
        for (int j = i + 1; j < nm && !covered; j++) covered = under(m[i].root, m[j].root) && !under(m[j].root, m[i].root);
        if (covered) continue;
        int dfd = open(m[i].point, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd < 0) {
            walk_note(w, errno);
            continue;
        }
        if (path_set(w, m[i].root, strlen(m[i].root)) < 0) {
            walk_note(w, ENOMEM);
            close(dfd);
            continue;
        }
        walk_dir(w, dfd, 0);
    }
    free(info);
}

static int cmp_ent(const void *a, const void *b) {
    int x = ((const struct cg_entry *)a)->pid, y = ((const struct cg_entry *)b)->pid;
    return (x > y) - (x < y);
}

/* Sorts the map by pid. A pid listed twice (it moved during the walk, or
 * two walked mounts overlap) keeps its path only if both listings agree. */
static void walk_index(struct walk *w) {
    if (!w->n) return;
    qsort(w->ents, w->n, sizeof *w->ents, cmp_ent);
    size_t j = 0;
    for (size_t i = 0; i < w->n; i++) {
        struct cg_entry *e = &w->ents[i];
        if (j && w->ents[j - 1].pid == e->pid) {
            struct cg_entry *k = &w->ents[j - 1];
            if (k->path != e->path &&
                (k->path < 0 || e->path < 0 || strcmp(w->paths + k->path, w->paths + e->path) != 0))
                k->path = -1;
            continue;
        }
        w->ents[j++] = *e;
    }
    w->n = j;
}

static const char *walk_lookup(const struct walk *w, int pid) {
    size_t lo = 0, hi = w->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int v = w->ents[mid].pid;
        if (v == pid) return w->ents[mid].path < 0 ? NULL : w->paths + w->ents[mid].path;
        if (v < pid) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

static void walk_free(struct walk *w) {
    free(w->ents);
    free(w->paths);
    free(w->path);
    free(w->buf);
}

/* The walk's pids are those of our pid namespace (cgroup.procs prints
 * task_pid_vnr), the scan's those of the namespace /proc was mounted for;
 * the map is only usable when the two are the same. */
static int proc_is_ours(int procfd) {
    char buf[16];
    ssize_t k = readlinkat(procfd, "self", buf, sizeof buf - 1);
    if (k <= 0) return 0;
    buf[k] = 0;
    return parse_pid(buf) == (int)getpid();
}

/* Clock ticks since boot as /proc/<pid>/stat field 22 counts them
 * (CLOCK_BOOTTIME in USER_HZ units; both sides see our time namespace). */
static unsigned long long boot_ticks(void) {
    struct timespec ts;
    long hz = sysconf(_SC_CLK_TCK);
    if (hz <= 0 || clock_gettime(CLOCK_BOOTTIME, &ts) < 0) return 0;
    return (unsigned long long)ts.tv_sec * (unsigned long long)hz +
           (unsigned long long)ts.tv_nsec * (unsigned long long)hz / 1000000000ull;
}

/* ---- the per-process pass ----------------------------------------------- */

struct scan {
    int procfd;
    int flags;
    const int *pids;
    int count;
    const struct walk *map;            /* NULL: read every /proc/<pid>/cgroup */
    unsigned long long born_before;    /* map entries hold for start_time below this */
};

static void fmt_pid(char *dst, int pid) {
    char tmp[12];
    int k = 0;
    do {
        tmp[k++] = (char)('0' + pid % 10);
        pid /= 10;
    } while (pid);
    while (k) *dst++ = tmp[--k];
    *dst = 0;
}

static void copy_path(struct ct_proc *p, const char *path) {
    size_t k = strlen(path);
    if (k > sizeof p->cgroup - 1) {
        k = sizeof p->cgroup - 1;
        p->flags |= CT_PROC_CGROUP_TRUNCATED;
    }
    memcpy(p->cgroup, path, k);
    p->cgroup[k] = 0;
}

/* Fills *p for entry i; an entry whose process is gone gets pid 0.
 * Returns 1 if the cgroup came from the map. */
static int read_entry(const struct scan *s, int i, struct ct_proc *p) {
    int pid = s->pids[i];
    char name[12];
    fmt_pid(name, pid);
    int want = s->flags & CT_PROCSCAN_CGROUP;
    if (!want || s->map) {
        if (!read_one(s->procfd, name, pid, 0, p)) {
            p->pid = 0;
            return 0;
        }
        if (!want || (p->flags & CT_PROC_STAT_UNREADABLE)) return 0;
        /* A start time of 0 cannot be told from a failed clock read. */
        const char *path = walk_lookup(s->map, pid);
        if (path && p->start_time + 1 < s->born_before) {
            copy_path(p, path);
            return 1;
        }
    }
    if (!read_one(s->procfd, name, pid, 1, p)) p->pid = 0;
    return 0;
}

static int list_pids(int procfd, int **pids, int *count) {
    int fd = openat(procfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);  /* its own offset */
    if (fd < 0) return -errno;
    DIR *d = fdopendir(fd);
    if (!d) {
        int err = errno;
        close(fd);
        return -err;
    }
    int *v = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    for (;;) {
        errno = 0;
        struct dirent *e = readdir(d);
        if (!e) {
            rc = -errno;
            break;
        }
        int pid = parse_pid(e->d_name);
        if (pid < 0) continue;
        if (grow((void **)&v, &cap, n + 1, sizeof *v) < 0) {
            rc = -ENOMEM;
            break;
        }
        v[n++] = pid;
    }
    closedir(d);
    if (rc < 0 || n > INT_MAX) {
        free(v);
        return rc < 0 ? rc : -EOVERFLOW;
    }
    *pids = v;
    *count = (int)n;
    return 0;
}

/* ---- threads ------------------------------------------------------------ */

/* Copies only the bytes that mean something: the fixed fields and the two
 * strings up to their NULs, about three cache lines of the struct's ten. */
static void copy_entry(struct ct_proc *dst, const struct ct_proc *src) {
    memcpy(dst, src, offsetof(struct ct_proc, comm));
    size_t k = strnlen(src->comm, sizeof src->comm - 1);
    memcpy(dst->comm, src->comm, k);
    dst->comm[k] = 0;
    k = strnlen(src->cgroup, sizeof src->cgroup - 1);
    memcpy(dst->cgroup, src->cgroup, k);
    dst->cgroup[k] = 0;
}


/* Nearly all of the scan is kernel time (procfs lookups, do_task_stat,
 * css_task_iter for cgroup.procs), which runs in parallel across CPUs. So
 * a worker lists /proc while the caller walks the cgroups (both must be
 * done before the first stat is read), and then the caller and the
 * workers share the pids, CHUNK at a time.
 *
 * On a busy host a thread may wait a whole timeslice (milliseconds) to
 * run, so the caller does not wait for a worker that is not running:
 * - if the listing is not there when the walk ends, the caller lists /proc
 *   itself, and the first listing published is used;
 * - a worker reads an entry into its own stack, then claims the entry with
 *   a compare-and-swap (OPEN -> WRITING), copies it into out[] and marks it
 *   DONE. When no chunk is left to claim, the caller takes every entry
 *   still OPEN in the workers' chunks, last first, and reads it itself; a
 *   worker that then finds its entry taken drops its read. The caller
 *   waits only for an entry caught in WRITING, a copy of a few hundred
 *   bytes, and returns once every entry is DONE or its own, so no worker
 *   writes to out[] afterwards.
 * Workers are detached and everything else they touch (procfd, pid list,
 * map) belongs to a reference-counted pass freed by the last holder, so a
 * worker that starts late, or runs on after the caller has returned,
 * touches only that. */
#define MAX_THREADS 4
#define CHUNK 16
/* Below this many processes a second thread does not pay for itself.
 * Measured on an idle 2-CPU VM (benchmarks/bench_scan.py --crossover, C
 * scan with cgroups, one thread vs two): 0.86x at 100 processes,
 * 1.02-1.07x from 150 to 300, 1.31-1.37x from 400 to 1,000, 1.5x at
 * 3,000. With no idle CPU, two threads measured 0.98-1.02x at any count. */
#define MIN_THREADED_PIDS 256

/* pass.state[i], for the entries of the workers' chunks. */
enum { OPEN, BY_CALLER, WRITING, DONE, DONE_MAPPED /* its cgroup came from the walk */ };

struct listing {
    int *pids;
    int count;
    int rc;
    long long ns;  /* how long it took */
};

struct pass {
    /* Set before any worker starts. */
    int procfd, flags, want_walk;
    atomic_int list_claimed;            /* a worker took the listing job */
    _Atomic(struct listing *) listed;   /* the first listing finished */
    /* Set by the caller before go; read-only after. */
    struct walk w;
    struct scan s;
    struct ct_proc *out;                /* the caller's; written by a worker only in WRITING */
    _Atomic unsigned char *state;
    pthread_mutex_t lock;               /* with cond: workers wait for go */
    pthread_cond_t cond;
    int go;                             /* under lock: 0 not yet; 1 read; -1 workers have nothing to do */
    atomic_int next;                    /* first unclaimed entry */
    atomic_int refs;                    /* the caller and every started worker */
    long long walk_ns;
};

static void listing_free(struct listing *l) {
    if (!l) return;
    free(l->pids);
    free(l);
}

static void pass_release(struct pass *ps) {
    if (atomic_fetch_sub(&ps->refs, 1) != 1) return;
    listing_free(atomic_load(&ps->listed));
    walk_free(&ps->w);
    free((void *)ps->state);
    close(ps->procfd);
    pthread_cond_destroy(&ps->cond);
    pthread_mutex_destroy(&ps->lock);
    free(ps);
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

/* Lists /proc and publishes the result unless another listing was first. */
static void list_job(struct pass *ps) {
    long long t0 = now_ns();
    struct listing *l = calloc(1, sizeof *l), *none = NULL;
    if (!l) return;  /* the caller lists, or reports ENOMEM */
    l->rc = list_pids(ps->procfd, &l->pids, &l->count);
    l->ns = now_ns() - t0;
    if (!atomic_compare_exchange_strong(&ps->listed, &none, l)) listing_free(l);
}

static void walk_job(struct pass *ps) {
    long long t0 = now_ns();
    if (!proc_is_ours(ps->procfd)) {
        ps->w.err = EXDEV;
    } else if (!(ps->w.buf = malloc(PROCS_BUF))) {
        ps->w.err = ENOMEM;
    } else {
        /* Taken before the walk starts, and every stat is read after it
         * ends: see the comment at the top. */
        ps->s.born_before = boot_ticks();
        walk_hierarchy(&ps->w);
        walk_index(&ps->w);
        ps->s.map = &ps->w;
    }
    ps->walk_ns = now_ns() - t0;
}

static void *worker(void *arg) {
    struct pass *ps = arg;
    if (atomic_exchange(&ps->list_claimed, 1) == 0 && !atomic_load(&ps->listed)) list_job(ps);
    pthread_mutex_lock(&ps->lock);
    while (!ps->go) pthread_cond_wait(&ps->cond, &ps->lock);
    int go = ps->go > 0;
    pthread_mutex_unlock(&ps->lock);
    int count = ps->s.count;
    while (go) {
        int lo = atomic_fetch_add(&ps->next, CHUNK);
        if (lo >= count) break;
        int hi = count - lo > CHUNK ? lo + CHUNK : count;
        for (int i = lo; i < hi; i++) {
            struct ct_proc p;
            unsigned char open = OPEN;
            if (atomic_load(&ps->state[i]) != OPEN) continue;  /* the caller took it */
            int m = read_entry(&ps->s, i, &p);
            if (!atomic_compare_exchange_strong(&ps->state[i], &open, WRITING)) continue;
            copy_entry(&ps->out[i], &p);
            /* The copy happens-before the caller's load of DONE
             * (sequentially consistent atomics). */
            atomic_store(&ps->state[i], m ? DONE_MAPPED : DONE);
        }
    }
    pass_release(ps);
    return NULL;
}

/* Tasks on the whole machine from the fourth field of /proc/loadavg,
 * "running/total" (proc(5)); running includes ourselves. 0 if unknown. */
static void loadavg_tasks(int *running, int *total) {
    char buf[128];
    *running = *total = 0;
    int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t k = read_retry(fd, buf, sizeof buf - 1);
    close(fd);
    if (k <= 0) return;
    buf[k] = 0;
    const char *c = buf;
    for (int sp = 0; *c && sp < 3; c++) sp += *c == ' ';
    int r = 0, t = 0;
    for (; *c >= '0' && *c <= '9'; c++) r = r * 10 + (*c - '0');
    if (*c++ != '/') return;
    for (; *c >= '0' && *c <= '9'; c++) t = t * 10 + (*c - '0');
    *running = r;
    *total = t;
}

/* Chosen before /proc is listed, so from what loadavg says: one thread if
 * the machine has fewer tasks (threads included) than MIN_THREADED_PIDS,
 * else one per CPU we may run on that has nothing else to run, up to
 * MAX_THREADS: a thread sent to a busy CPU gains little. */
static int auto_threads(void) {
    int running, total;
    loadavg_tasks(&running, &total);
    if (total && total < MIN_THREADED_PIDS) return 1;
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    int idle = cpus - (running > 1 ? running - 1 : 0);
    return idle < 1 ? 1 : idle > MAX_THREADS ? MAX_THREADS : idle;
}

/* Starts up to n - 1 detached workers; returns how many started. */
static int start_workers(struct pass *ps, int n) {
    int started = 0;
    pthread_attr_t attr;
    if (n < 2 || pthread_attr_init(&attr) != 0) return 0;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    /* Signals stay with the threads Python knows: the workers block them
     * all (they inherit the mask in force at pthread_create). */
    sigset_t all, old;
    sigfillset(&all);
    if (pthread_sigmask(SIG_SETMASK, &all, &old) == 0) {
        for (; started < n - 1; started++) {
            pthread_t tid;
            atomic_fetch_add(&ps->refs, 1);
            if (pthread_create(&tid, &attr, worker, ps) != 0) {
                atomic_fetch_sub(&ps->refs, 1);
                break;
            }
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    pthread_attr_destroy(&attr);
    return started;
}

static void set_go(struct pass *ps, int go) {
    pthread_mutex_lock(&ps->lock);
    ps->go = go;
    pthread_cond_broadcast(&ps->cond);
    pthread_mutex_unlock(&ps->lock);
}

/* The caller's share: chunks while any are left, then every entry of the
 * workers' chunks that no one has published, last first (a worker goes
 * forwards through its chunk, so the two meet rather than collide). The
 * caller marks its own chunks in mine[], private to it, rather than in
 * state[], so that during the reads only workers write to state[] and its
 * cache lines do not bounce between CPUs. Returns the entries it mapped. */
static int caller_reads(struct pass *ps, struct ct_proc *out, unsigned char *mine) {
    int count = ps->s.count, mapped = 0;
    if (!ps->state) {
        for (int i = 0; i < count; i++) mapped += read_entry(&ps->s, i, &out[i]);
        return mapped;
    }
    for (;;) {
        int lo = atomic_fetch_add(&ps->next, CHUNK);
        if (lo >= count) break;
        int hi = count - lo > CHUNK ? lo + CHUNK : count;
        mine[lo / CHUNK] = 1;
        for (int i = lo; i < hi; i++) mapped += read_entry(&ps->s, i, &out[i]);
    }
    for (int i = count - 1; i >= 0; i--) {
        if (mine[i / CHUNK]) continue;
        unsigned char st = OPEN;
        if (atomic_compare_exchange_strong(&ps->state[i], &st, BY_CALLER)) {
            mapped += read_entry(&ps->s, i, &out[i]);
            continue;
        }
        while (st == WRITING) {
            sched_yield();
            st = atomic_load(&ps->state[i]);
        }
        mapped += st == DONE_MAPPED;
    }
    return mapped;
}

int ct_procscan_read(struct ct_proc *out, int cap, int *n, int flags, int threads,
                     struct ct_procscan_stats *stats) {
    struct ct_procscan_stats st = {0};
    int rc;
    *n = 0;
    if (stats) *stats = st;
    struct pass *ps = calloc(1, sizeof *ps);
    if (!ps) return -ENOMEM;
    if ((ps->procfd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
        rc = -errno;
        free(ps);
        return rc;
    }
    ps->flags = flags;
    ps->want_walk = (flags & CT_PROCSCAN_CGROUP) && !(flags & CT_PROCSCAN_NO_WALK);
    ps->s = (struct scan){.procfd = ps->procfd, .flags = flags};
    pthread_mutex_init(&ps->lock, NULL);
    pthread_cond_init(&ps->cond, NULL);
    atomic_init(&ps->list_claimed, !ps->want_walk);  /* nothing to do beside it: the caller lists */
    atomic_init(&ps->listed, NULL);
    atomic_init(&ps->next, 0);
    atomic_init(&ps->refs, 1);

    int started = start_workers(ps, threads > 0 ? threads : auto_threads());
    st.threads = 1 + started;
    if (ps->want_walk) walk_job(ps);
    if (!atomic_load(&ps->listed)) list_job(ps);
    struct listing *l = atomic_load(&ps->listed);
    st.walked = ps->s.map != NULL;
    st.cgroups_walked = ps->w.dirs;
    st.walk_errno = ps->w.err;
    st.walk_ns = ps->walk_ns;
    st.list_ns = l ? l->ns : 0;

    if (!l || l->rc < 0) {
        rc = l ? l->rc : -ENOMEM;
        set_go(ps, -1);
    } else if (l->count > cap) {
        /* Nothing read: the caller retries with room for this many. */
        *n = l->count;
        rc = -ENOSPC;
        set_go(ps, -1);
    } else {
        long long t0 = now_ns();
        ps->s.pids = l->pids;
        ps->s.count = l->count;
        int share = started && !(threads <= 0 && l->count < MIN_THREADED_PIDS);
        unsigned char *mine = NULL;
        if (share) {
            ps->out = out;
            ps->state = calloc((size_t)l->count + 1, 1);  /* all OPEN */
            mine = calloc((size_t)l->count / CHUNK + 1, 1);
            if (!ps->state || !mine) {
                free((void *)ps->state);
                free(mine);
                ps->state = NULL;
                mine = NULL;
                share = 0;
            }
        }
        set_go(ps, share ? 1 : -1);
        int mapped = caller_reads(ps, out, mine);
        /* Every entry is the caller's or DONE: no worker writes out[] now. */
        int k = 0;
        for (int i = 0; i < l->count; i++) {
            if (!out[i].pid) continue;
            if (k != i) copy_entry(&out[k], &out[i]);
            k++;
        }
        free(mine);
        st.cgroup_mapped = mapped;
        if (flags & CT_PROCSCAN_CGROUP) st.cgroup_fallback = k - st.cgroup_mapped;
        st.read_ns = now_ns() - t0;
        *n = k;
        rc = 0;
    }
    if (stats) *stats = st;
    pass_release(ps);
    return rc;
}

/* ---- handing the entries to Python -------------------------------------- */

/* Python builds one tuple per process. Reading the fields of 3,000 structs
 * through cffi costs ~1 us each (as much as a third of the scan), while
 * whole columns convert in single C-level calls (ffi.unpack, one decode and
 * split of all the comms). So the entries are laid out again as columns,
 * and each distinct cgroup path is named once, by the first entry that has
 * it, so that Python decodes it once. */
static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;  /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

int ct_procscan_pack(const struct ct_proc *in, int n, int odd_mask, struct ct_procscan_cols *c) {
    size_t slots = 16;
    while (slots < (size_t)n * 2) slots *= 2;
    int *table = malloc(slots * sizeof *table);
    if (!table) return -ENOMEM;
    memset(table, 0xff, slots * sizeof *table);  /* -1: empty */
    char *comm = c->comm;
    c->n_odd = 0;
    for (int i = 0; i < n; i++) {
        const struct ct_proc *p = &in[i];
        c->ids[i] = p->pid;
        c->ids[n + i] = p->ppid;
        c->ids[2 * n + i] = p->pgid;
        c->ids[3 * n + i] = p->sid;
        c->start_time[i] = p->start_time;
        c->state[i] = p->state;
        size_t k = strnlen(p->comm, sizeof p->comm);
        memcpy(comm, p->comm, k);
        comm[k] = 0;
        comm += k + 1;
        if (p->flags & odd_mask) c->odd[c->n_odd++] = i;
        size_t h = (size_t)hash_str(p->cgroup) & (slots - 1);
        while (table[h] >= 0 && strcmp(in[table[h]].cgroup, p->cgroup) != 0) h = (h + 1) & (slots - 1);
        if (table[h] < 0) table[h] = i;
        c->cgroup[i] = table[h];
    }
    c->comm_len = (size_t)(comm - c->comm);
    free(table);
    return 0;
}

/* Whoever shares our mount namespace with CAP_SYS_ADMIN (an unwalled root
 * worker) can bind-mount a file over /proc/<pid>/stat or /cgroup and make a
 * live escaper read as another process, or gone. A path walk crosses every
 * mount, from a held /proc descriptor too; a detached clone of the /proc
 * mount alone has none below it (open_tree(2), OPEN_TREE_CLONE without
 * AT_RECURSIVE). The same procfs instance: the same pids. */
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif

int ct_proc_view_take(int *fd_out) {
    long fd = syscall(SYS_open_tree, AT_FDCWD, "/proc", OPEN_TREE_CLONE | O_CLOEXEC);
    if (fd < 0) return -errno;
    *fd_out = (int)fd;
    return 0;
}
