#ifndef CT_SPAWN_H
#define CT_SPAWN_H
#include <sys/types.h>

/* Where a spawn failed. The child reports its stage and errno through a
 * close-on-exec pipe; the parent turns them into 126/127/125. */
enum {
    CT_STAGE_NONE = 0,
    CT_STAGE_CLONE = 1,   /* clone3 itself failed (parent side) */
    CT_STAGE_BIRTH = 2,   /* the child died before running our code (e.g. the cgroup.kill bug) */
    CT_STAGE_HOLD = 3,    /* the parent never released a held child */
    CT_STAGE_STDIO = 4,
    CT_STAGE_CHDIR = 5,
    CT_STAGE_PGROUP = 6,
    CT_STAGE_SEAL = 7,
    CT_STAGE_CAPS = 8,
    CT_STAGE_CREDS = 9,
    CT_STAGE_EXEC = 10,
};

struct ct_spawn_args {
    const char *const *paths;   /* executables to try in order (PATH search is Python's) */
    int npaths;
    char *const *argv;
    char *const *envp;
    const char *cwd;            /* NULL: inherit */
    int cgroup_fd;              /* -1: spawn in the caller's cgroup (fallback path) */
    int hold;                   /* 1: the child waits before exec until ct_spawn_finish */
    int stdio[3];               /* -1: inherit */
    int new_pgroup;
    int new_session;
    long uid;                   /* -1: keep */
    long gid;                   /* -1: keep */
    const unsigned int *groups; /* used when uid != -1 */
    int ngroups;
    int seal;                   /* new mount + cgroup namespace, ro_paths read-only */
    const char *const *ro_paths;
    int nro;
    const int *drop_caps;       /* dropped from bounding, effective, permitted, inheritable */
    int ndrop;
    int no_new_privs;
    const char *const *cg2_paths; /* cgroup2 mounts replaced by the run's own view (seal.c) */
    int ncg2;
    int userns;                 /* seal: identity-mapped user namespace (seal.c) */
};

struct ct_spawn_result {
    int pid;
    int pidfd;
    int err_fd;    /* open only while a held child awaits ct_spawn_finish */
    int hold_fd;   /* idem */
    int stage;     /* CT_STAGE_* of a failure */
    int child_errno;
};

int ct_spawn(const struct ct_spawn_args *a, struct ct_spawn_result *r);
int ct_spawn_finish(struct ct_spawn_result *r);
int ct_set_child_subreaper(int on);
#endif
