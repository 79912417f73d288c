#ifndef CT_PROCSCAN_H
#define CT_PROCSCAN_H

#include <stddef.h>

/* What a /proc entry could not tell us. Set in ct_proc.flags; the errno that
 * caused a *_DENIED or *_UNREADABLE flag is kept beside it. */
enum {
    CT_PROC_STAT_UNREADABLE = 1 << 0,   /* /proc/<pid>/stat failed: stat_errno; no other field is valid */
    CT_PROC_COMM_TRUNCATED = 1 << 1,    /* comm longer than the buffer: a prefix is kept */
    CT_PROC_CGROUP_DENIED = 1 << 2,     /* /proc/<pid>/cgroup: EACCES or EPERM (cgroup_errno) */
    CT_PROC_CGROUP_UNREADABLE = 1 << 3, /* /proc/<pid>/cgroup: any other errno (cgroup_errno) */
    CT_PROC_CGROUP_ABSENT = 1 << 4,     /* no "0::" line: no cgroup v2 hierarchy */
    CT_PROC_CGROUP_TRUNCATED = 1 << 5,  /* v2 path longer than the buffer: cgroup holds a prefix only */
};

#define CT_PROC_COMM_MAX 64     /* /proc/<pid>/stat may show up to 64 bytes (kworker names) */
#define CT_PROC_CGROUP_MAX 512

struct ct_proc {
    int pid;
    int ppid;
    int pgid;
    int sid;
    char state;
    unsigned long long start_time;  /* field 22 of /proc/<pid>/stat, clock ticks since boot */
    int flags;                      /* CT_PROC_* */
    int stat_errno;
    int cgroup_errno;
    char comm[CT_PROC_COMM_MAX];        /* NUL-terminated; raw bytes, any but NUL */
    char cgroup[CT_PROC_CGROUP_MAX];    /* NUL-terminated v2 path, "" unless read */
};

/* ct_procscan_read flags */
enum {
    CT_PROCSCAN_CGROUP = 1 << 0,   /* fill cgroup (else it is "") */
    CT_PROCSCAN_NO_WALK = 1 << 1,  /* read every /proc/<pid>/cgroup rather than walk the hierarchy */
};

/* How a scan went: for tests and benchmarks, never needed for the result. */
struct ct_procscan_stats {
    int threads;          /* threads that read /proc/<pid> files, the caller's included */
    int walked;           /* the cgroup hierarchy was walked */
    int cgroups_walked;   /* cgroup.procs files read */
    int cgroup_mapped;    /* entries whose cgroup came from the walk */
    int cgroup_fallback;  /* entries whose /proc/<pid>/cgroup was read (or whose stat failed) */
    int walk_errno;       /* first error met by the walk (its subtree fell back), EXDEV if /proc
                             belongs to another pid namespace, 0 if none */
    long long walk_ns;    /* wall time of the cgroup walk */
    long long list_ns;    /* wall time of listing /proc (beside the walk when threaded) */
    long long read_ns;    /* wall time from both being done to the last entry read */
};

/* Fill out[0..cap) with one entry per process in /proc. threads is the
 * number of threads to read with, 0 to choose. Returns 0 with *n entries,
 * -ENOSPC when cap was too small (*n is then the number of pids seen, a
 * size hint for the retry; nothing was read), or -errno when /proc itself
 * failed. stats may be NULL. */
int ct_procscan_read(struct ct_proc *out, int cap, int *n, int flags, int threads,
                     struct ct_procscan_stats *stats);

/* The same entries as columns, for a caller that converts them in bulk.
 * Every array is the caller's, of n entries unless said otherwise. */
struct ct_procscan_cols {
    int *ids;                        /* 4n: pid, ppid, pgid, sid, each a column of n */
    unsigned long long *start_time;
    char *state;
    char *comm;                      /* n * (CT_PROC_COMM_MAX + 1) bytes: every comm, each ended by NUL */
    size_t comm_len;                 /* out: bytes written to comm */
    int *cgroup;                     /* out: index of the first entry whose cgroup is the same bytes */
    int *odd;                        /* out: indexes of the entries with a flag in odd_mask */
    int n_odd;                       /* out */
};

/* Lay out in[0..n) as columns. Returns 0, or -ENOMEM. */
int ct_procscan_pack(const struct ct_proc *in, int n, int odd_mask, struct ct_procscan_cols *cols);

/* A clone of the /proc mount alone, without anything mounted below it
 * (open_tree(2) OPEN_TREE_CLONE, not AT_RECURSIVE; 5.2), into *fd_out.
 * Returns 0, or -errno (EPERM without CAP_SYS_ADMIN). */
int ct_proc_view_take(int *fd_out);
#endif
