#define _GNU_SOURCE
/* The PID-namespace wall, the supervisor's side: clone3 of the init into
 * its new namespaces (CLONE_NEWPID, and CLONE_NEWUSER, CLONE_NEWNS as
 * asked), the uid/gid maps the parent writes for CT_USERNS_MAP, and the
 * init's messages read back. The init itself, and why the wall holds:
 * init.c. Returns 0 or -errno; policy is Python's (wall.py).
 */
#include "wall.h"
#include "clone.h"
#include "child.h"
#include "spawn.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <time.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef CLONE_NEWPID
#define CLONE_NEWPID 0x20000000
#endif
#ifndef CLONE_NEWUSER
#define CLONE_NEWUSER 0x10000000
#endif
#ifndef CLONE_NEWIPC
#define CLONE_NEWIPC 0x08000000
#endif
#ifndef CLONE_NEWNS
#define CLONE_NEWNS 0x00020000
#endif

static int write_maps(int pidfd, const struct ct_wall_args *w) {
    char path[64], *p;
    long pid = -1;
    int rc = ct_pid_via_fdinfo(pidfd, &pid);
    if (rc < 0) return rc;
    if (pid <= 0) return -ESRCH;
    memcpy(path, "/proc/", 6);
    p = ct_put_int(path + 6, pid);
    memcpy(p, "/uid_map", 9);
    if ((rc = ct_write_file(path, w->uid_map ? w->uid_map : "")) < 0) return rc;
    memcpy(p, "/gid_map", 9);
    return ct_write_file(path, w->gid_map ? w->gid_map : "");
}

/* The init's start time and PID namespace, read while it is our unreaped
 * child (its pid cannot name another process) and before it can exit (an
 * exited init has no ns links left): what run.json describes it by, read
 * here in a few system calls rather than by Python's file objects while the
 * init sheds its memory on the other CPU. -1 / 0 when unreadable. */
static void init_identity(long pid, struct ct_wall_result *r) {
    char path[48];
    struct stat st;
    r->init_start = -1;
    r->init_ns = 0;
    int proc = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (proc < 0) return;
    long long start = -1;
    if (ct_start_time_at(proc, pid, &start) == 0) r->init_start = start;
    char *p = ct_put_int(path, pid);
    memcpy(p, "/ns/pid", 8);
    if (fstatat(proc, path, &st, 0) == 0) r->init_ns = (unsigned long long)st.st_ino;
    close(proc);
}

/* The go byte to an init that may be gone already (a read end closed):
 * EPIPE, never a SIGPIPE that kills a caller whose SIGPIPE is SIG_DFL
 * (set in C, where Python's table never sees it): blocked around the write
 * in this thread, and the one the write raised taken off again, unless this
 * thread already blocked SIGPIPE with one pending (the caller's; ours merges
 * into it). wall.py's write_go, for the go written from Python. */
static int write_go(int fd) {
    sigset_t pipe_set, old, pending;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
    int theirs = sigismember(&old, SIGPIPE) && sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE);
    int rc = ct_write_all(fd, "G", 1) < 0 ? -errno : 0;
    if (rc == -EPIPE && !theirs) {
        struct timespec zero = {0, 0};
        sigtimedwait(&pipe_set, NULL, &zero);
    }
    if (!sigismember(&old, SIGPIPE)) pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

int ct_wall_spawn(const struct ct_spawn_args *a, const struct ct_wall_args *w, struct ct_wall_result *r) {
    int sv[2], sync[2] = {-1, -1}, pidfd = -1, rc = 0;
    sigset_t all, old;
    r->init_pid = -1;
    r->init_pidfd = -1;
    r->report_fd = -1;
    r->stage = CT_STAGE_NONE;
    r->child_errno = 0;
    r->go_fd = -1;

    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
        r->stage = CT_STAGE_CLONE;
        return -errno;
    }
    if ((w->userns == CT_USERNS_MAP || w->hold) && pipe2(sync, O_CLOEXEC) < 0) {
        rc = -errno;
        close(sv[0]);
        close(sv[1]);
        r->stage = CT_STAGE_CLONE;
        return rc;
    }
    uint64_t flags = CLONE_NEWPID;
    if (w->userns != CT_USERNS_NONE) flags |= CLONE_NEWUSER;
    if (w->mount_proc) flags |= CLONE_NEWNS;
    /* A sealed run's SysV IPC objects and POSIX message queues die with its
     * own IPC namespace: in the host's, a sealed worker left shared memory
     * (pinned, counted to no live cgroup) that a later run given the same
     * dynamic uid could attach (ipc_namespaces(7)). */
    if (w->userns == CT_USERNS_MAP) flags |= CLONE_NEWIPC;

    /* The init starts with every signal blocked and keeps them so. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    long pid = ct_raw_clone3(flags, &pidfd, a->cgroup_fd);
    if (pid == 0) {
        close(sv[0]);
        if (sync[1] >= 0) close(sync[1]);
        ct_init_main(a, w, sv[1], sync[0]);
    }
    int clone_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    close(sv[1]);
    if (sync[0] >= 0) close(sync[0]);
    if (pid < 0) {
        close(sv[0]);
        if (sync[1] >= 0) close(sync[1]);
        r->stage = CT_STAGE_CLONE;
        return -clone_errno;
    }
    if (w->userns == CT_USERNS_MAP) {
        if ((rc = write_maps(pidfd, w)) == 0 && !w->hold) rc = write_go(sync[1]);
        if (rc < 0 || !w->hold) {
            close(sync[1]);
            sync[1] = -1;
        }
        if (rc < 0) {
            struct ct_spawn_result dead;
            syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, NULL, 0);
            ct_reap(pidfd, &dead);
            close(pidfd);
            close(sv[0]);
            r->stage = CT_STAGE_USERNS;
            r->child_errno = -rc;
            return rc;
        }
    }
    int fl = fcntl(sv[0], F_GETFL);
    if (fl >= 0) fcntl(sv[0], F_SETFL, fl | O_NONBLOCK);
    init_identity(pid, r);
    r->init_pid = (int)pid;
    r->init_pidfd = pidfd;
    r->report_fd = sv[0];
    r->go_fd = sync[1];      /* -1 unless hold */
    return 0;
}

int ct_init_recv(int fd, struct ct_init_msg *m, int *passed_fd) {
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int) * 4)];
    } ctl;
    struct iovec iov = {m, sizeof *m};
    struct msghdr mh;
    *passed_fd = -1;
    for (;;) {
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = ctl.buf;
        mh.msg_controllen = sizeof ctl.buf;
        ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return -errno;
        }
        if (n == 0) return 2;
        for (struct cmsghdr *ch = CMSG_FIRSTHDR(&mh); ch; ch = CMSG_NXTHDR(&mh, ch)) {
            if (ch->cmsg_level != SOL_SOCKET || ch->cmsg_type != SCM_RIGHTS) continue;
            int nfd = (int)((ch->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < nfd; i++) {
                int got;
                memcpy(&got, CMSG_DATA(ch) + i * sizeof(int), sizeof(int));
                if (*passed_fd < 0)
                    *passed_fd = got;
                else
                    close(got);   /* more than we asked for: never ours to keep */
            }
        }
        if (n != (ssize_t)sizeof *m || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
            if (*passed_fd >= 0) close(*passed_fd);
            *passed_fd = -1;
            return -EPROTO;
        }
        return 1;
    }
}
