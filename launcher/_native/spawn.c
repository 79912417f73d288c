#define _GNU_SOURCE
/* Spawning a worker straight into its cgroup.
 *
 * clone3(CLONE_INTO_CGROUP | CLONE_PIDFD) places the child in the leaf as
 * part of the fork, so the worker never runs an instruction elsewhere
 * (clone(2), "CLONE_INTO_CGROUP"). Between clone and execve the child only
 * makes async-signal-safe system calls: no malloc, no stdio, no locks.
 *
 * The child reports through a close-on-exec pipe: first an "alive" message,
 * then, only on failure, the stage and errno. EOF after "alive" means execve
 * succeeded; EOF before it means the child died before running our code,
 * which on kernels with the cgroup.kill fork bug (KERNEL-NOTES.md) is the
 * SIGKILL delivered at birth into a leaf that was once killed.
 *
 * Policy (which leaf, what to do on failure) is Python's; this file returns
 * 0 or -errno and fills out-parameters.
 */
#include "spawn.h"
#include "seal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif
#ifndef ST_RDONLY
#define ST_RDONLY 1
#endif

struct ct_msg {
    int32_t stage;
    int32_t err;
};

struct ct_clone_args {  /* struct clone_args, version 2 (88 bytes) */
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size,
        tls, set_tid, set_tid_size, cgroup;
};

static void child_report(int fd, int stage, int err) {
    struct ct_msg m = {stage, err};
    ssize_t n;
    do {
        n = write(fd, &m, sizeof m);
    } while (n < 0 && errno == EINTR);
}

static __attribute__((noreturn)) void child_fail(int fd, int stage, int err) {
    child_report(fd, stage, err);
    _exit(127);
}

/* Move stdio sources out of 0..2 first so that no dup2 clobbers a source
 * that a later dup2 still needs (the same dance as _posixsubprocess). */
static int child_stdio(const int stdio[3]) {
    int src[3];
    for (int i = 0; i < 3; i++) {
        src[i] = stdio[i];
        if (src[i] >= 0 && src[i] < 3 && src[i] != i) {
            src[i] = fcntl(src[i], F_DUPFD_CLOEXEC, 3);
            if (src[i] < 0) return -errno;
        }
    }
    for (int i = 0; i < 3; i++) {
        if (src[i] < 0) continue;
        if (src[i] == i) {
            int fl = fcntl(i, F_GETFD);
            if (fl < 0 || fcntl(i, F_SETFD, fl & ~FD_CLOEXEC) < 0) return -errno;
        } else if (dup2(src[i], i) < 0) {
            return -errno;
        }
    }
    return 0;
}

/* The seal's mount steps live in seal.c (see there for why each one). */
static int child_seal(const struct ct_spawn_args *a) {
    int rc = ct_seal_child_mounts((const char *const *)a->cg2_paths, a->ncg2, a->ro_paths, a->nro);
    if (rc < 0) return rc;
    if (a->userns) return ct_seal_child_userns();
    return 0;
}

static int child_drop_caps(const struct ct_spawn_args *a) {
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    for (int i = 0; i < a->ndrop; i++) {
        if (prctl(PR_CAPBSET_DROP, a->drop_caps[i], 0, 0, 0) < 0 && errno != EINVAL)
            return -errno;
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        return -errno;
    if (syscall(SYS_capget, &hdr, data) < 0) return -errno;
    for (int i = 0; i < a->ndrop; i++) {
        int c = a->drop_caps[i];
        if (c < 0 || c >= 64) continue;
        uint32_t bit = 1u << (c % 32);
        data[c / 32].effective &= ~bit;
        data[c / 32].permitted &= ~bit;
        data[c / 32].inheritable &= ~bit;
    }
    if (syscall(SYS_capset, &hdr, data) < 0) return -errno;
    return 0;
}

static __attribute__((noreturn)) void child_main(const struct ct_spawn_args *a, int err_fd,
                                                  int hold_rd, const sigset_t *oldmask) {
    int rc;
    child_report(err_fd, CT_STAGE_NONE, 0);  /* alive */

    /* Caught signals go back to default before they are unblocked; Python
     * ignores SIGPIPE and SIGXFSZ, which a worker must not inherit. */
    for (int s = 1; s < NSIG; s++) {
        struct sigaction sa;
        if (s == SIGKILL || s == SIGSTOP) continue;
        if (sigaction(s, NULL, &sa) < 0) continue;
        if (sa.sa_handler != SIG_DFL && (sa.sa_handler != SIG_IGN || s == SIGPIPE || s == SIGXFSZ)) {
            sa.sa_handler = SIG_DFL;
            sa.sa_flags = 0;
            sigemptyset(&sa.sa_mask);
            sigaction(s, &sa, NULL);
        }
    }

    if (a->hold) {
        char b;
        ssize_t n;
        do {
            n = read(hold_rd, &b, 1);
        } while (n < 0 && errno == EINTR);
        if (n != 1) child_fail(err_fd, CT_STAGE_HOLD, n < 0 ? errno : ECANCELED);
    }
    if ((rc = child_stdio(a->stdio)) < 0) child_fail(err_fd, CT_STAGE_STDIO, -rc);
    if (a->cwd && chdir(a->cwd) < 0) child_fail(err_fd, CT_STAGE_CHDIR, errno);
    if (a->new_session) {
        if (setsid() < 0) child_fail(err_fd, CT_STAGE_PGROUP, errno);
    } else if (a->new_pgroup) {
        if (setpgid(0, 0) < 0) child_fail(err_fd, CT_STAGE_PGROUP, errno);
    }
    if (a->seal && (rc = child_seal(a)) < 0) child_fail(err_fd, CT_STAGE_SEAL, -rc);
    if (a->ndrop > 0 && (rc = child_drop_caps(a)) < 0) child_fail(err_fd, CT_STAGE_CAPS, -rc);
    if (a->uid >= 0 || a->gid >= 0) {
        if (a->uid >= 0 && syscall(SYS_setgroups, (size_t)a->ngroups, a->groups) < 0)
            child_fail(err_fd, CT_STAGE_CREDS, errno);
        if (a->gid >= 0 && syscall(SYS_setresgid, a->gid, a->gid, a->gid) < 0)
            child_fail(err_fd, CT_STAGE_CREDS, errno);
        if (a->uid >= 0 && syscall(SYS_setresuid, a->uid, a->uid, a->uid) < 0)
            child_fail(err_fd, CT_STAGE_CREDS, errno);
    }
    if (a->no_new_privs && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        child_fail(err_fd, CT_STAGE_CREDS, errno);

    /* Every inherited descriptor but stdio closes at exec (PEP 446 makes
     * Python's own fds close-on-exec already; this catches the rest). */
    syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC);
    sigprocmask(SIG_SETMASK, oldmask, NULL);

    /* Like execvpe: ENOENT/ENOTDIR move on to the next candidate; any other
     * error is the one to report, unless a later candidate executes. */
    int saved = ENOENT;
    for (int i = 0; i < a->npaths; i++) {
        execve(a->paths[i], a->argv, a->envp);
        if (errno != ENOENT && errno != ENOTDIR && saved == ENOENT) saved = errno;
    }
    child_fail(err_fd, CT_STAGE_EXEC, saved);
}

static void close_if(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* Read the child's report after the alive message. Returns 0 once execve
 * succeeded (EOF), or -errno with r->stage set. */
static int read_outcome(struct ct_spawn_result *r, int alive_seen) {
    struct ct_msg m;
    for (;;) {
        ssize_t n = read(r->err_fd, &m, sizeof m);
        if (n < 0 && errno == EINTR) continue;
        if (n == (ssize_t)sizeof m && m.stage == CT_STAGE_NONE && !alive_seen) {
            alive_seen = 1;
            if (r->hold_fd >= 0) return 0;  /* held: the caller places it, then finishes */
            continue;
        }
        if (n == 0 && alive_seen) return 0;
        if (n == (ssize_t)sizeof m) {
            r->stage = m.stage;
            r->child_errno = m.err;
        } else {
            r->stage = CT_STAGE_BIRTH;
            r->child_errno = n < 0 ? errno : ECHILD;
        }
        return -(r->child_errno ? r->child_errno : EIO);
    }
}

static void reap_failed(struct ct_spawn_result *r) {
    siginfo_t si;
    /* The child has exited or is about to: it either reported a failure and
     * called _exit, or was killed. Reap it so no zombie is left. */
    if (r->pidfd >= 0) {
        while (waitid((idtype_t)P_PIDFD, (id_t)r->pidfd, &si, WEXITED) < 0 && errno == EINTR) {
        }
    }
    close_if(&r->pidfd);
    close_if(&r->err_fd);
    close_if(&r->hold_fd);
}

int ct_spawn(const struct ct_spawn_args *a, struct ct_spawn_result *r) {
    int errp[2], holdp[2] = {-1, -1};
    sigset_t all, old;
    struct ct_clone_args ca;
    long pid;
    int pidfd = -1;

    r->pid = -1;
    r->pidfd = -1;
    r->err_fd = -1;
    r->hold_fd = -1;
    r->stage = CT_STAGE_NONE;
    r->child_errno = 0;

    if (pipe2(errp, O_CLOEXEC) < 0) {
        r->stage = CT_STAGE_CLONE;
        return -errno;
    }
    if (a->hold && pipe2(holdp, O_CLOEXEC) < 0) {
        int e = errno;
        close(errp[0]);
        close(errp[1]);
        r->stage = CT_STAGE_CLONE;
        return -e;
    }

    memset(&ca, 0, sizeof ca);
    ca.flags = CLONE_PIDFD;
    ca.pidfd = (uint64_t)(uintptr_t)&pidfd;
    ca.exit_signal = SIGCHLD;
    if (a->cgroup_fd >= 0) {
        ca.flags |= CLONE_INTO_CGROUP;
        ca.cgroup = (uint64_t)a->cgroup_fd;
    }

    /* No handler may run in the child between clone and execve: block
     * everything here and let the child restore the mask at exec. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid = syscall(SYS_clone3, &ca, sizeof ca);
    if (pid == 0) child_main(a, errp[1], holdp[0], &old);
    int clone_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);

    close(errp[1]);
    close_if(&holdp[0]);
    if (pid < 0) {
        close(errp[0]);
        close_if(&holdp[1]);
        r->stage = CT_STAGE_CLONE;
        return -clone_errno;
    }
    r->pid = (int)pid;
    r->pidfd = pidfd;
    r->err_fd = errp[0];
    r->hold_fd = holdp[1];

    int rc = read_outcome(r, 0);
    if (rc < 0) {
        reap_failed(r);
        return rc;
    }
    if (r->hold_fd < 0) close_if(&r->err_fd);
    return 0;
}

/* Release a held child and wait for its exec. */
int ct_spawn_finish(struct ct_spawn_result *r) {
    char b = 1;
    ssize_t n;
    if (r->hold_fd < 0 || r->err_fd < 0) return -EBADF;
    do {
        n = write(r->hold_fd, &b, 1);
    } while (n < 0 && errno == EINTR);
    close_if(&r->hold_fd);
    int rc = read_outcome(r, 1);
    if (rc < 0) {
        reap_failed(r);
        return rc;
    }
    close_if(&r->err_fd);
    return 0;
}

/* Orphans of the tree reparent to us instead of init, so the supervisor can
 * reap them (prctl(2), PR_SET_CHILD_SUBREAPER). Process-wide: only the CLI
 * supervisor, which owns its process, turns it on. */
int ct_set_child_subreaper(int on) {
    return prctl(PR_SET_CHILD_SUBREAPER, on ? 1 : 0, 0, 0, 0) < 0 ? -errno : 0;
}
