#define _GNU_SOURCE
/* A prototype, for benchmarks/bench_wall_proto.py only (loaded by ctypes):
 * one whole cycle of a PID-namespace wall made the other way round. The
 * init is started as posix_spawn starts a program (CLONE_VM|CLONE_VFORK,
 * then exec of init_nolibc: no copy of the caller's page tables, nothing
 * shared copy-on-write with it afterwards), and the worker is not forked by
 * the init: the caller spawns it itself, into the init's namespaces (setns
 * of this thread's pid_ns_for_children, and of the child's mount
 * namespace), so the worker is the caller's own child and needs none of
 * the init's spawn code. Root only (setns of a PID namespace this thread's
 * user namespace owns). Returns 0 or -errno; no cgroup, as bench_wall.py's
 * contenders. Not the product's spawn (launcher/_native/wall.c). */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

struct init_start {
    const char *init;
    int ready_wr, hold_rd;
};

static int init_child(void *arg) {
    struct init_start *s = arg;
    if (dup2(s->ready_wr, 3) < 0 || dup2(s->hold_rd, 4) < 0) _exit(126);
    char *argv[] = {"ct/init", NULL};
    char *envp[] = {NULL};
    execve(s->init, argv, envp);
    _exit(127);
}

static char stack[64 * 1024] __attribute__((aligned(16)));

int proto_cycle(const char *init, const char *worker) {
    int ready[2], hold[2], rc = 0;
    if (pipe2(ready, O_CLOEXEC) < 0) return -errno;
    if (pipe2(hold, O_CLOEXEC) < 0) return -errno;
    struct init_start s = {init, ready[1], hold[0]};
    pid_t ipid = clone(init_child, stack + sizeof stack, CLONE_VM | CLONE_VFORK | CLONE_NEWPID | CLONE_NEWNS | SIGCHLD, &s);
    close(ready[1]);
    close(hold[0]);
    if (ipid < 0) {
        rc = -errno;
        close(ready[0]);
        close(hold[1]);
        return rc;
    }
    char b;
    if (read(ready[0], &b, 1) != 1) rc = -EPROTO;     /* mounted its /proc */
    close(ready[0]);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/ns/pid", (int)ipid);
    int pidns = open(path, O_RDONLY | O_CLOEXEC);
    snprintf(path, sizeof path, "/proc/%d/ns/mnt", (int)ipid);
    int mntns = open(path, O_RDONLY | O_CLOEXEC);
    int own = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);
    if (rc == 0 && (pidns < 0 || mntns < 0 || own < 0)) rc = -errno;
    if (rc == 0 && setns(pidns, CLONE_NEWPID) < 0) rc = -errno;
    if (rc == 0) {
        pid_t w = vfork();
        if (w == 0) {
            if (setns(mntns, CLONE_NEWNS) < 0) _exit(126);
            char *argv[] = {(char *)worker, NULL};
            char *envp[] = {"PATH=/usr/bin:/bin", NULL};
            execve(worker, argv, envp);
            _exit(127);
        }
        if (setns(own, CLONE_NEWPID) < 0 && rc == 0) rc = -errno;
        if (w < 0) {
            rc = -errno;
        } else {
            int st;
            while (waitpid(w, &st, 0) < 0 && errno == EINTR) {
            }
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = -ECHILD;
        }
    }
    close(hold[1]);           /* no more workers: the init exits once it has no children */
    int st;
    while (waitpid(ipid, &st, 0) < 0 && errno == EINTR) {
    }
    if (pidns >= 0) close(pidns);
    if (mntns >= 0) close(mntns);
    if (own >= 0) close(own);
    return rc;
}

/* The exec'd init alone: started as above, but given the worker, which it
 * starts itself (vfork and exec, as today's init does), so the worker is
 * still the init's child and only the init is this process's. Waits for
 * the init, which exits once it has reaped every child. 0 or -errno. */
struct exec_init {
    const char *init, *worker;
};

static int exec_init_child(void *arg) {
    struct exec_init *s = arg;
    char *argv[] = {"ct/init", (char *)s->worker, NULL};
    char *envp[] = {"PATH=/usr/bin:/bin", NULL};
    execve(s->init, argv, envp);
    _exit(127);
}

int proto_exec_init(const char *init, const char *worker) {
    struct exec_init s = {init, worker};
    pid_t ipid = clone(exec_init_child, stack + sizeof stack, CLONE_VM | CLONE_VFORK | CLONE_NEWPID | CLONE_NEWNS | SIGCHLD, &s);
    if (ipid < 0) return -errno;
    int st;
    while (waitpid(ipid, &st, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -ECHILD;
}
