#ifndef CT_INIT_H
#define CT_INIT_H
#include <stddef.h>
#include <stdint.h>

#include "spawn.h"

/* The PID-namespace wall (init.c): a tiny init of our own at pid 1 of a new
 * PID namespace, which forks the worker and reaps every member. */

enum {
    CT_USERNS_NONE = 0,   /* no user namespace (a root caller) */
    CT_USERNS_SELF = 1,   /* the caller's euid/egid mapped to themselves (unprivileged) */
    CT_USERNS_MAP = 2,    /* the parent writes the uid/gid maps it is given */
};

/* The init's messages to the supervisor (struct ct_init_msg.kind). */
enum {
    CT_EV_STARTED = 1,    /* (unused: a zombie init named ct/init ran our code) */
    CT_EV_EXEC = 2,       /* a = the worker's pid in the namespace, b = its pid in the caller's
                           * /proc (-1: unknown), x = its start time (proc(5) field 22, -1:
                           * unknown); the worker's pidfd rides along */
    CT_EV_FAILED = 3,     /* a = stage, b = errno, c = candidate, d = signal (the worker never ran) */
    CT_EV_EXIT = 4,       /* a = the worker's pid in the namespace, b = its wait status */
    CT_EV_NOTE = 5,       /* a = CT_NOTE_*, b = errno: something that did not work but is not fatal */
    CT_EV_EMPTY = 6,      /* no member left, the init exits 0: x/y = user/system CPU of every
                           * member it reaped (us), c = their largest max RSS (KiB) */
    CT_EV_FORWARDED = 7,  /* a = the signal forwarded to every member, b = errno of kill(-1) */
};

enum {
    CT_NOTE_MOUNT_PRIVATE = 1,  /* mounts could not be made private: no /proc of our own */
    CT_NOTE_MOUNT_PROC = 2,     /* a fresh /proc could not be mounted */
    CT_NOTE_DEVNULL = 3,        /* the init could not point its own stdio at /dev/null */
    CT_NOTE_SHED = 4,           /* the init kept the supervisor's memory (copy-on-write until it ends) */
    CT_NOTE_HIDE = 5,           /* the directory to hide could not be covered: the worker can reach it */
};

/* The init's comm from its first instruction of ours on. */
#define CT_INIT_NAME "ct/init"

struct ct_wall_args {
    int userns;            /* CT_USERNS_* */
    long uid;              /* SELF: the caller's euid and egid, mapped to themselves */
    long gid;
    const char *uid_map;   /* MAP: written by the parent to /proc/<init>/uid_map, gid_map */
    const char *gid_map;
    int mount_proc;        /* a mount namespace with every mount private and a fresh /proc */
    int die_with_parent;   /* PR_SET_PDEATHSIG(SIGKILL) on the init (dies with the calling thread) */
    int hold;              /* the init waits for the caller's go (ct_wall_result.go_fd) before it does
                              anything for the worker: the caller describes the init durably first */
    const char *hide;      /* with mount_proc: a directory the worker must not reach (the state
                              directory): an empty tmpfs of the init's is mounted over it */
    int exec_init;         /* exec the init from its image where this process can (wall.c), else fork it */
    int worker_joins;      /* the last this many of join_fds are the worker's to join, not the init's:
                              the run's v1 pids cgroup, whose limit must not count the init */
    int owner_pidfd;       /* die with the owner: a pidfd of the supervisor process (pidfd_open of its
                              thread-group leader: readable once the whole process has exited, not one
                              thread), or -1. When it polls readable the init exits, and the kernel
                              kills every member of the namespace (zap_pid_ns_processes) */
};

struct ct_init_msg {
    int32_t kind;
    int32_t a, b, c, d;
    int32_t pad;
    int64_t x, y;
};

/* Shared with wall.c (not exported to Python). The init: never returns.
 * `sock`: its end of the message pair; `sync_rd`: CT_USERNS_MAP's "maps
 * written" pipe, or -1. */
__attribute__((noreturn)) void ct_init_main(const struct ct_spawn_args *a, const struct ct_wall_args *w,
                                            int sock, int sync_rd);
/* The same init, exec'd from its own image (initbin/): its arguments in a
 * memfd (shed.h, ct_args_image). */
__attribute__((noreturn)) void ct_init_from_image(int sock, int sync_rd, int args_fd, size_t len);
int ct_write_file(const char *path, const char *text);
#endif
