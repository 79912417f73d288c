#define _GNU_SOURCE
/* The child's set-up between clone and execve, shared by a plain spawn
 * (spawn.c) and the worker the init forks (init.c): the comm marker,
 * signal dispositions, placement, stdio, chdir, process group or session,
 * the seal, capabilities, credentials, no_new_privs, descriptors, the
 * signal mask, then the exec candidates (the ENOEXEC shell included).
 *
 * Only async-signal-safe system calls: no malloc, no stdio, no locks (with
 * CLONE_VM the child runs in the caller's memory: clone.c). Each stage
 * entered, and a failure's errno, goes to the report pipe (struct ct_msg);
 * the parent's reading of it is in spawn.c. Policy is Python's: a failure
 * is reported and the child exits 127.
 */
#include "child.h"
#include "fds.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

static void rep_write(struct ct_report *rep, int stage, int err, int cand, int failed) {
    struct ct_msg m = {stage, err, cand, failed};
    ssize_t n;
    do {
        n = write(rep->fd, &m, sizeof m);   /* <= PIPE_BUF: atomic, never partial */
    } while (n < 0 && errno == EINTR);
}

static void rep_stage(struct ct_report *rep, int stage) {
    rep_write(rep, stage, 0, -1, 0);
}

static __attribute__((noreturn)) void child_fail(struct ct_report *rep, int stage, int err, int cand) {
    rep_write(rep, stage, err, cand, 1);
    _exit(127);
}

/* Every disposition back to SIG_DFL except the ones to keep ignored.
 * execve would reset handled signals by itself (flush_signal_handlers) but
 * keeps SIG_IGN, and a pending signal must not run a handler of the
 * parent's between here and execve. The mask stays full until the end.
 * Signals 32 and 33 are glibc's own (nptl), refused by sigaction and
 * never ignored by anyone. */
static void child_signals(uint64_t ignore) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    for (int s = 1; s < NSIG && s <= 64; s++) {
        if (s == SIGKILL || s == SIGSTOP || (s > 31 && s < SIGRTMIN)) continue;
        sa.sa_handler = (ignore >> (s - 1)) & 1 ? SIG_IGN : SIG_DFL;
        sigaction(s, &sa, NULL);
    }
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

int ct_write_all(int fd, const char *s, size_t n) {
    while (n) {
        ssize_t w = write(fd, s, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        s += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Whether `text` (n bytes) holds `line` as a whole line. */
static int has_line(const char *text, size_t n, const char *line) {
    size_t len = strlen(line);
    const char *p = text, *end = text + n;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t l = nl ? (size_t)(nl - p) : (size_t)(end - p);
        if (l == len && memcmp(p, line, len) == 0) return 1;
        p += l + 1;
    }
    return 0;
}

/* Placement by the child itself: writing "0" to a cgroup.procs moves the
 * writer (cgroup_procs_write_start: pid 0 is current), to a v1 `tasks` file
 * the writing thread (the whole of this single-threaded child, without the
 * global lock's RCU grace period: _runcgroups.join_fds), with the permission
 * of whoever opened the file (cgroup_procs_write_permission uses the
 * open-time f_cred). Then /proc/self/cgroup must name where it went: the
 * kernel's word, not ours, before anything of the worker runs. */
int ct_child_join(const struct ct_spawn_args *a) {
    char buf[16384];
    int rc;
    for (int i = 0; i < a->njoin; i++) {
        if ((rc = ct_write_all(a->join_fds[i], "0", 1)) < 0) return rc;
    }
    if (a->ncg_expect <= 0) return 0;
    int fd = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    size_t n = 0;
    for (;;) {
        ssize_t got = read(fd, buf + n, sizeof buf - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            rc = -errno;
            close(fd);
            return rc;
        }
        if (got == 0) break;
        n += (size_t)got;
        if (n == sizeof buf) {
            close(fd);
            return -EOVERFLOW;
        }
    }
    close(fd);
    for (int i = 0; i < a->ncg_expect; i++) {
        if (!has_line(buf, n, a->cg_expect[i])) return -EXDEV;  /* not where it was sent */
    }
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

/* Nothing survives execve: the bounding set emptied (PR_CAPBSET_DROP needs
 * CAP_SETPCAP: done where permitted), ambient and inheritable cleared. For
 * a uid-0 worker, execve computes P' = (I & F(I)) | (F(P) & bounding) |
 * ambient with F(I) = F(P) = all (capabilities(7), "Capabilities and
 * execution of programs by root"), so I and the bounding set must both be
 * empty for it to run without capabilities. */
static int child_clear_caps(void) {
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    for (int c = 0; c < 64; c++) {
        if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL && errno != EPERM)
            return -errno;
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        return -errno;
    if (syscall(SYS_capget, &hdr, data) < 0) return -errno;
    data[0].inheritable = data[1].inheritable = 0;
    if (syscall(SYS_capset, &hdr, data) < 0) return -errno;
    return 0;
}
static int exists(const char *path) {
    return syscall(SYS_faccessat, AT_FDCWD, path, F_OK) == 0;
}

/* Like execvp: ENOENT and ENOTDIR move on to the next candidate, and so do
 * EACCES and an ENOENT from a file that exists (its #! interpreter or ELF
 * loader is missing), remembered to be reported if nothing runs; any
 * other error ends the search (glibc's __execvpe does the same). ENOEXEC
 * runs the candidate with the shell, as execvp does. In a PATH search, an
 * EACCES from a candidate this user cannot even see (a directory of PATH it
 * may not search: root's /root/.local/bin for `--user nobody` or --seal)
 * is not found, as bash and dash judge it (they stat each candidate as the
 * user), rather than glibc's "Permission denied" naming a file that is not
 * there: 127, not 126. */
static __attribute__((noreturn)) void child_exec(const struct ct_spawn_args *a, struct ct_report *rep) {
    int saved = ENOENT, saved_cand = -1;
    for (int i = 0; i < a->npaths; i++) {
        const char *path = a->paths[i];
        execve(path, a->argv, a->envp);
        int e = errno;
        if (e == ENOEXEC && a->shell && a->shell_argv) {
            a->shell_argv[1] = (char *)path;
            execve(a->shell, a->shell_argv, a->envp);
            child_fail(rep, CT_STAGE_EXEC, ENOEXEC, i);
        }
        if (e == ENOTDIR || (e == ENOENT && !exists(path))) continue;
        if (e == EACCES && a->path_search && !exists(path)) continue;
        if (e == EACCES || e == ENOENT) {
            if (saved_cand < 0) {
                saved = e;
                saved_cand = i;
            }
            continue;
        }
        child_fail(rep, CT_STAGE_EXEC, e, i);
    }
    child_fail(rep, CT_STAGE_EXEC, saved, saved_cand);
}

void ct_child_exec(const struct ct_spawn_args *a, struct ct_report *rep) {
    int rc;
    /* First the marker, then the stage: a child killed between the two
     * has stage NONE and counts as never having run. */
    prctl(PR_SET_NAME, CT_SPAWN_MARKER, 0, 0, 0);
    rep_stage(rep, CT_STAGE_START);
    child_signals(a->sig_ignore);
    if (a->set_nofile) {
        /* The caller's descriptor limit, which `contain run` raised for
         * itself only (as systemd raises its own and not its services'). */
        struct { uint64_t cur, max; } rl = {a->nofile_cur, a->nofile_max};
        if (syscall(SYS_prlimit64, 0, RLIMIT_NOFILE, &rl, NULL) < 0) child_fail(rep, CT_STAGE_START, errno, -1);
    }

    if (a->njoin > 0 || a->ncg_expect > 0) {
        rep_stage(rep, CT_STAGE_JOIN);
        if ((rc = ct_child_join(a)) < 0) child_fail(rep, CT_STAGE_JOIN, -rc, -1);
    }
    rep_stage(rep, CT_STAGE_STDIO);
    if ((rc = child_stdio(a->stdio)) < 0) child_fail(rep, CT_STAGE_STDIO, -rc, -1);
    if (a->cwd) {
        rep_stage(rep, CT_STAGE_CHDIR);
        if (chdir(a->cwd) < 0) child_fail(rep, CT_STAGE_CHDIR, errno, -1);
    }
    if (a->new_session || a->new_pgroup) {
        rep_stage(rep, CT_STAGE_PGROUP);
        if (a->new_session) {
            if (setsid() < 0) child_fail(rep, CT_STAGE_PGROUP, errno, -1);
        } else if (setpgid(0, 0) < 0) {
            child_fail(rep, CT_STAGE_PGROUP, errno, -1);
        }
    }
    if (a->ndrop > 0) {
        rep_stage(rep, CT_STAGE_CAPS);
        if ((rc = child_drop_caps(a)) < 0) child_fail(rep, CT_STAGE_CAPS, -rc, -1);
    }
    if (a->uid >= 0 || a->gid >= 0 || a->no_new_privs || a->clear_caps) {
        rep_stage(rep, CT_STAGE_CREDS);
        if (a->uid >= 0 && syscall(SYS_setgroups, (size_t)a->ngroups, a->groups) < 0)
            child_fail(rep, CT_STAGE_CREDS, errno, -1);
        if (a->gid >= 0 && syscall(SYS_setresgid, a->gid, a->gid, a->gid) < 0)
            child_fail(rep, CT_STAGE_CREDS, errno, -1);
        if (a->uid >= 0 && syscall(SYS_setresuid, a->uid, a->uid, a->uid) < 0)
            child_fail(rep, CT_STAGE_CREDS, errno, -1);
        if (a->clear_caps && (rc = child_clear_caps()) < 0) child_fail(rep, CT_STAGE_CREDS, -rc, -1);
        if (a->no_new_privs && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
            child_fail(rep, CT_STAGE_CREDS, errno, -1);
    }
    rep_stage(rep, CT_STAGE_FDS);
    if ((rc = ct_fds_cloexec_except(a->pass_fds, a->npass, 0)) < 0) child_fail(rep, CT_STAGE_FDS, -rc, -1);

    rep_stage(rep, CT_STAGE_SIGNALS);
    sigset_t none;
    sigemptyset(&none);
    if (sigprocmask(SIG_SETMASK, &none, NULL) < 0) child_fail(rep, CT_STAGE_SIGNALS, errno, -1);

    rep_stage(rep, CT_STAGE_EXEC);
    child_exec(a, rep);
}
