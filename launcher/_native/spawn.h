#ifndef CT_SPAWN_H
#define CT_SPAWN_H
#include <stdint.h>
#include <sys/types.h>

/* Where a spawn failed. The child reports the stage it enters, and on a
 * failure its errno, on the report pipe (struct ct_msg); the parent reads
 * them once the vfork release says the child has exec'd or exited. */
enum {
    CT_STAGE_NONE = 0,
    CT_STAGE_CLONE = 1,     /* clone3 itself failed (parent side) */
    CT_STAGE_BIRTH = 2,     /* the child died before running our code (e.g. the cgroup.kill bug) */
    CT_STAGE_START = 3,     /* our code ran; signal dispositions reset */
    CT_STAGE_JOIN = 4,      /* placement: "0" written to each join fd, /proc/self/cgroup verified */
    CT_STAGE_STDIO = 5,
    CT_STAGE_CHDIR = 6,
    CT_STAGE_PGROUP = 7,
    CT_STAGE_SEAL = 8,          /* (not reached any more: the seal is the wall's user namespace, init.c) */
    CT_STAGE_CAPS = 9,
    CT_STAGE_CREDS = 10,
    CT_STAGE_FDS = 11,      /* close-on-exec marking, pass_fds made inheritable */
    CT_STAGE_SIGNALS = 12,  /* the signal mask emptied */
    CT_STAGE_EXEC = 13,
    CT_STAGE_VERIFY = 14,   /* the parent could not tell whether the child exec'd (it is killed) */
    /* The PID-namespace wall (init.c): the init's own steps. */
    CT_STAGE_USERNS = 15,   /* user namespace maps */
    CT_STAGE_INIT = 16,     /* the init's set-up (signals, signalfd, mounts that must work) */
    CT_STAGE_FORK = 17,     /* the init could not fork the worker */
};

/* The comm of a child between clone and execve. execve sets comm to the
 * basename of the file it ran (kbasename(bprm->filename) in fs/exec.c),
 * which never contains '/'; PR_SET_NAME by the child's own code, or a write
 * to /proc/<pid>/comm from its own thread group (proc_pid_set_comm refuses
 * every other writer), are the only other ways to change it. */
#define CT_SPAWN_MARKER "ct/spawn"

struct ct_spawn_args {
    const char *const *paths;   /* executables to try in order (PATH search is Python's) */
    int npaths;
    char *const *argv;
    char *const *envp;
    const char *cwd;            /* NULL: inherit */
    int cgroup_fd;              /* -1: spawn in the caller's cgroup */
    const int *join_fds;        /* the child writes "0" to each (cgroup.procs of v2 or v1) */
    int njoin;
    const char *const *cg_expect; /* lines /proc/self/cgroup must contain after joining */
    int ncg_expect;
    int stdio[3];               /* -1: inherit */
    int new_pgroup;
    int new_session;
    long uid;                   /* -1: keep */
    long gid;                   /* -1: keep */
    const unsigned int *groups; /* used when uid != -1 */
    int ngroups;
    const int *drop_caps;       /* dropped from bounding, effective, permitted, inheritable */
    int ndrop;
    int no_new_privs;
    uint64_t sig_ignore;        /* bit s-1 set: signal s is SIG_IGN in the worker; all others SIG_DFL */
    const int *pass_fds;        /* ascending, each >= 3: left open across exec */
    int npass;
    const char *shell;          /* ENOEXEC: run the candidate as shell_argv with this (NULL: don't) */
    char **shell_argv;          /* {"sh", <slot the child fills with the candidate>, argv[1], ..., NULL} */
    int clear_caps;             /* empty the bounding set, clear ambient (as far as permitted) */
    int path_search;            /* paths came from a PATH search (argv[0] has no slash) */
    int set_nofile;             /* set RLIMIT_NOFILE to nofile_cur/nofile_max before exec (the caller's,
                                   where `contain run` raised its own: spawnreq.raise_own_limit) */
    uint64_t nofile_cur;
    uint64_t nofile_max;
};

struct ct_spawn_result {
    int pid;
    int pidfd;
    int stage;       /* CT_STAGE_* of a failure */
    int child_errno;
    int candidate;   /* exec: index in paths of the candidate the error is about, -1: none existed */
    int signal;      /* the child was killed by this signal before exec (0: it was not) */
    int wstatus;     /* the reaped child's wait status, for a failure */
};

int ct_spawn(const struct ct_spawn_args *a, struct ct_spawn_result *r);
int ct_set_child_subreaper(int on);
int ct_get_child_subreaper(void);
int ct_set_dumpable(int on);
uint64_t ct_sig_ignored_mask(void);

/* Shared with init.c and wall.c (not exported to Python): the parent's
 * side of the handshake (the child's is child.h). */
int ct_child_settle(int pid, int pidfd, int rd, struct ct_spawn_result *r);
void ct_reap(int pidfd, struct ct_spawn_result *r);
char *ct_put_int(char *p, long v);
int ct_pid_via_fdinfo(int pidfd, long *pid);
int ct_pid_via_fdinfo_at(int dirfd, const char *proc, int pidfd, long *pid);
int ct_start_time_at(int dirfd, long pid, long long *start);
#endif
