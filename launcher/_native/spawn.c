#define _GNU_SOURCE
/* Spawning a worker straight into its cgroup.
 *
 * clone3(CLONE_INTO_CGROUP | CLONE_PIDFD) places the child in the leaf as
 * part of the fork, so the worker never runs an instruction elsewhere
 * (clone(2), "CLONE_INTO_CGROUP"). Between clone and execve the child only
 * makes async-signal-safe system calls: no malloc, no stdio, no locks
 * (its set-up: child.c; the clone itself: clone.c). This file is the
 * parent's side: the handshake, and deciding exec or death.
 *
 * The handshake depends on no file descriptor's EOF. A report pipe closed at
 * exec also stays open in every process that another thread of the caller
 * forks meanwhile (O_CLOEXEC protects only against exec), so "EOF means
 * exec'd" waited for seconds in a library caller that forks, and a child
 * killed after its "alive" message but before execve read as an exec
 * (issue 11). Instead:
 *
 * - CLONE_VFORK: the calling thread sleeps until the child has exec'd or
 *   exited (kernel/fork.c: wait_for_vfork_done; the child completes
 *   vfork_done in mm_release, called from exec_mmap in begin_new_exec and
 *   from exit_mm in do_exit). Other threads run on. With CLONE_VM where a
 *   trampoline exists (x86_64, aarch64: ct_vfork_exec in clone.c), else
 *   with fork's copy-on-write memory.
 * - The child writes each stage it enters, and a failure's errno, as
 *   fixed-size messages to the report pipe; once released, the parent reads
 *   what is there without blocking. A child killed at any point leaves the
 *   last stage it entered.
 * - Whether it exec'd is read from the kernel, exactly: the child first
 *   names itself CT_SPAWN_MARKER, which contains '/', and execve renames
 *   every task to a basename (see spawn.h). The release comes from
 *   exec_mmap (exec) or exit_mm (exit), and either way the rest follows on
 *   its own: the rename in begin_new_exec, after the point of no return, or
 *   exit_notify making it a zombie. So the parent waits for the first of
 *   "comm is no longer the marker" (exec'd) and "the pidfd polls readable
 *   with the marker still set" (died before exec: a failed spawn, with the
 *   last stage it reported). The child stays unreaped until then, so its
 *   pid cannot be reused meanwhile; the pid is looked up through the
 *   pidfd's fdinfo, which names it as the /proc mount sees it
 *   (pidfd_show_fdinfo). The pipe's EOF only wakes the parent up for that
 *   look; when another thread's fork holds a writer, it looks every 1 ms.
 *
 * Cost, measured here (/bin/true from a Python process, posix.spawn until
 * it returns, 10th/50th percentile on a shared 2-core host): the EOF
 * handshake of before 243/258 us; this one without CLONE_VM 294/340 us
 * (the vfork sleep and wake-up, the /proc reads, and the wait for the
 * same point of the exec: its tail, mostly tearing down the child's copy
 * of the caller's page tables); with CLONE_VM 98/126 us.
 *
 * Policy (which leaf, what to do on failure) is Python's; this file returns
 * 0 or -errno and fills out-parameters.
 */
#include "spawn.h"
#include "child.h"
#include "clone.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef P_PIDFD
#define P_PIDFD 3
#endif

static ssize_t read_small_at(int dirfd, const char *path, char *buf, size_t size) {
    int fd = openat(dirfd, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    size_t n = 0;
    while (n < size - 1) {
        ssize_t got = read(fd, buf + n, size - 1 - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            int e = errno;
            close(fd);
            return -e;
        }
        if (got == 0) break;
        n += (size_t)got;
    }
    close(fd);
    buf[n] = 0;
    return (ssize_t)n;
}

static ssize_t read_small(const char *path, char *buf, size_t size) {
    return read_small_at(AT_FDCWD, path, buf, size);
}

char *ct_put_int(char *p, long v) {
    char tmp[24];
    int n = 0;
    if (v < 0) {
        *p++ = '-';
        v = -v;
    }
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n) *p++ = tmp[--n];
    *p = 0;
    return p;
}

static long parse_long(const char *p, const char **end) {
    long v = 0;
    int neg = 0;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    while (*p >= '0' && *p <= '9') v = v * 10 + (*p++ - '0');
    if (end) *end = p;
    return neg ? -v : v;
}

/* Field 22 of <dirfd>/<pid>/stat (the start time in clock ticks after
 * boot, the same in every namespace): the fields after comm start after
 * its LAST ')' (proc(5)). Async-signal-safe: the init reads it for a worker
 * that is still its unreaped child, so the supervisor gets the worker's
 * identity even when the worker is gone before it could look. */
int ct_start_time_at(int dirfd, long pid, long long *start) {
    char path[32], buf[1024];
    ct_put_int(path, pid);
    size_t n = strlen(path);
    memcpy(path + n, "/stat", 6);
    int fd = openat(dirfd, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    ssize_t got = read(fd, buf, sizeof buf - 1);
    int e = errno;
    close(fd);
    if (got <= 0) return got < 0 ? -e : -EIO;
    buf[got] = 0;
    char *rp = NULL;
    for (char *q = buf; *q; q++)
        if (*q == ')') rp = q;
    if (!rp) return -EIO;
    const char *p = rp + 2;      /* field 3, the state */
    for (int field = 3; field < 22; field++) {
        while (*p && *p != ' ') p++;
        if (!*p) return -EIO;
        p++;
    }
    long long v = 0;
    if (*p < '0' || *p > '9') return -EIO;
    while (*p >= '0' && *p <= '9') v = v * 10 + (*p++ - '0');
    *start = v;
    return 0;
}

/* The pid of the pidfd's process as this /proc mount names it, -1 once it
 * has been reaped. */
int ct_pid_via_fdinfo(int pidfd, long *pid) {
    return ct_pid_via_fdinfo_at(AT_FDCWD, "/proc/", pidfd, pid);
}

/* The same through a /proc of another namespace (`proc` + "self/..."). */
int ct_pid_via_fdinfo_at(int dirfd, const char *proc, int pidfd, long *pid) {
    char path[80], buf[512];
    size_t pl = strlen(proc);
    if (pl > 32) return -ENAMETOOLONG;
    memcpy(path, proc, pl);
    memcpy(path + pl, "self/fdinfo/", 12);
    ct_put_int(path + pl + 12, pidfd);
    ssize_t n = read_small_at(dirfd, path, buf, sizeof buf);
    if (n < 0) return (int)n;
    const char *line = strstr(buf, "\nPid:");
    if (!line) return -ENOTSUP;
    *pid = parse_long(line + 5, NULL);
    return 0;
}

/* 1 if the comm of `pid` is the marker, 0 if not, or -errno. comm is read
 * under task_lock (proc_pid_get_comm) and never touches the task's mm: a
 * read of /proc/<pid>/stat here can take a reference to the old mm in the
 * middle of exec_mmap and then pay for tearing down the parent's copy of
 * it (measured: 2 ms with 300 MB). */
static int comm_is_marker(const char *path) {
    char buf[64];
    ssize_t n = read_small(path, buf, sizeof buf);
    if (n < 0) return (int)n;
    if (n > 0 && buf[n - 1] == '\n') buf[--n] = 0;
    return n == (ssize_t)sizeof CT_SPAWN_MARKER - 1 && memcmp(buf, CT_SPAWN_MARKER, (size_t)n) == 0;
}

static int pidfd_exited(int pidfd) {
    struct pollfd p = {pidfd, POLLIN, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & POLLIN);
}

/* Everything the child wrote before the release; *eof once its writer is
 * gone (no other process held one). */
static void drain(int rd, struct ct_msg *last, struct ct_msg *fail, int *eof) {
    struct ct_msg buf[32];
    for (;;) {
        ssize_t n = read(rd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n == 0) *eof = 1;
        if (n <= 0) return;
        for (size_t i = 0; i < (size_t)n / sizeof buf[0]; i++) {
            *last = buf[i];
            if (buf[i].failed && !fail->failed) *fail = buf[i];
        }
    }
}

/* Wait until the child has visibly exec'd (comm renamed: *died = 0) or
 * died with the marker still set (*died = 1). The release came from
 * exec_mmap or exit_mm; either way the rest follows without waiting on
 * anything of ours: the rename near the end of begin_new_exec, or
 * exit_notify making it a zombie (the pidfd then polls readable:
 * pidfd_poll). `exited` is sampled before comm, so a zombie's comm, which
 * no longer changes, decides.
 *
 * Nothing signals the rename itself, so the report pipe's EOF (its writer
 * is closed by do_close_on_exec just before the rename, or at exit) is the
 * wake-up: a hint, never the verdict. If another thread's fork holds a
 * copy of the writer, the look is repeated every millisecond instead.
 * The first look comes after that wake-up: the child usually runs on this
 * CPU (it took over while this thread slept), and reading /proc before it
 * is done only delays it; so does a tight or sched_yield loop, measured
 * several times slower. */
static int exec_or_death(int pidfd, int rd, int eof, int *died) {
    char path[64];
    long pid = -1;
    int rc, spins = 0;
    path[0] = 0;
    for (;;) {
        if (!eof || spins >= 64) {
            struct pollfd pf[2] = {{pidfd, POLLIN, 0}, {rd, POLLIN, 0}};
            int n = poll(pf, eof ? 1 : 2, 1);
            if (n > 0 && !eof && (pf[1].revents & (POLLIN | POLLHUP))) {
                struct ct_msg last, fail = {0, 0, -1, 0};
                drain(rd, &last, &fail, &eof);
            }
        } else {
            spins++;    /* after EOF the rename is a few instructions away */
        }
        if (!path[0]) {
            if ((rc = ct_pid_via_fdinfo(pidfd, &pid)) < 0) return rc;
            if (pid <= 0) return -ECHILD;   /* reaped by another waiter of this process */
            memcpy(path, "/proc/", 6);
            char *p = ct_put_int(path + 6, pid);
            memcpy(p, "/comm", 6);
        }
        int ex = pidfd_exited(pidfd);
        int m = comm_is_marker(path);
        if (m < 0) return m;
        /* Unreaped (signal 0 reaches a zombie too), so the pid read above
         * and the /proc entry were this child's. */
        if (syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) < 0) return -ECHILD;
        if (!m || ex) {
            *died = m;
            return 0;
        }
    }
}

void ct_reap(int pidfd, struct ct_spawn_result *r) {
    siginfo_t si;
    memset(&si, 0, sizeof si);
    while (waitid((idtype_t)P_PIDFD, (id_t)pidfd, &si, WEXITED) < 0) {
        if (errno != EINTR) return;
    }
    if (si.si_code == CLD_EXITED) {
        r->wstatus = (si.si_status & 0xff) << 8;
    } else {
        r->signal = si.si_status;
        r->wstatus = si.si_status & 0x7f;
    }
}

int ct_child_settle(int pid, int pidfd, int rd, struct ct_spawn_result *r) {
    struct ct_msg last = {CT_STAGE_NONE, 0, -1, 0}, fail = {0, 0, -1, 0};
    int rc = 0, died = 0, eof = 0;
    r->pid = pid;
    r->pidfd = pidfd;
    drain(rd, &last, &fail, &eof);
    if (fail.failed) {
        r->stage = fail.stage;
        r->child_errno = fail.err;
        r->candidate = fail.candidate;
        rc = -(r->child_errno ? r->child_errno : EIO);
    } else if (last.stage == CT_STAGE_NONE) {
        r->stage = CT_STAGE_BIRTH;   /* released without running our first line: it died */
        rc = -ECHILD;
    } else if ((rc = exec_or_death(pidfd, rd, eof, &died)) < 0) {
        /* Neither exec nor death can be confirmed: make it a death. */
        r->stage = CT_STAGE_VERIFY;
        r->child_errno = -rc;
        syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, NULL, 0);
    } else if (died) {
        r->stage = last.stage;       /* killed (or exited) before execve */
        rc = -ECANCELED;
    } else {
        return 0;                    /* exec'd: comm renamed */
    }
    ct_reap(pidfd, r);
    close(pidfd);
    r->pidfd = -1;
    return rc;
}

int ct_spawn(const struct ct_spawn_args *a, struct ct_spawn_result *r) {
    sigset_t all, old;
    int pidfd = -1;

    r->pid = -1;
    r->pidfd = -1;
    r->stage = CT_STAGE_NONE;
    r->child_errno = 0;
    r->candidate = -1;
    r->signal = 0;
    r->wstatus = 0;

    /* The child's report channel (and, by its EOF, a wake-up at exec). */
    int pp[2];
    if (pipe2(pp, O_CLOEXEC | O_NONBLOCK) < 0) {
        r->stage = CT_STAGE_CLONE;
        return -errno;
    }
    struct ct_report rep = {pp[1]};

    /* No handler may run in the child before execve: block everything here;
     * the child empties its mask last. With CLONE_VFORK this thread sleeps
     * until the child has exec'd or exited. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    long pid = ct_vfork_exec(a, &rep, &pidfd, a->cgroup_fd);
    int rc;
    if (pid < 0) {
        r->stage = CT_STAGE_CLONE;
        rc = -errno;
    } else {
        close(pp[1]);
        pp[1] = -1;
        rc = ct_child_settle((int)pid, pidfd, pp[0], r);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    close(pp[0]);
    if (pp[1] >= 0) close(pp[1]);
    return rc;
}

/* Bit s-1 set for every signal s whose disposition is SIG_IGN now. */
uint64_t ct_sig_ignored_mask(void) {
    uint64_t mask = 0;
    struct sigaction sa;
    for (int s = 1; s < NSIG && s <= 64; s++) {
        if (sigaction(s, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN) mask |= 1ULL << (s - 1);
    }
    return mask;
}

/* Orphans of the tree reparent to us instead of init, so the supervisor can
 * reap them (prctl(2), PR_SET_CHILD_SUBREAPER). Process-wide: only the CLI
 * supervisor, which owns its process, turns it on. */
int ct_set_child_subreaper(int on) {
    return prctl(PR_SET_CHILD_SUBREAPER, on ? 1 : 0, 0, 0, 0) < 0 ? -errno : 0;
}

/* PR_SET_DUMPABLE: 0 makes this process's memory and registers out of
 * reach of ptrace, process_vm_writev and /proc/<pid>/mem for any process
 * without CAP_SYS_PTRACE over it, same uid included (ptrace(2), "Ptrace
 * access mode checking"). 0 or -errno. */
int ct_set_dumpable(int on) {
    return prctl(PR_SET_DUMPABLE, on ? 1 : 0, 0, 0, 0) < 0 ? -errno : 0;
}

/* 1 if this process is a child subreaper, 0 if not, or -errno. */
int ct_get_child_subreaper(void) {
    int on = 0;
    return prctl(PR_GET_CHILD_SUBREAPER, &on, 0, 0, 0) < 0 ? -errno : (on != 0);
}
