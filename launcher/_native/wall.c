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
#include "shed.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <time.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/mman.h>
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

/* `fd` moved to a number above 2 (close-on-exec), the old one closed; -1
 * with errno on failure (then `fd` is closed too). */
static int above_stdio(int fd) {
    if (fd > 2) return fd;
    int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    int e = errno;
    close(fd);
    errno = e;
    return moved;
}

/* -- The exec'd init -------------------------------------------------------
 *
 * The init as a program of its own (initbin/: init.c built without libc,
 * its bytes in ct_init_image), exec'd from a CLONE_VM|CLONE_VFORK child
 * the way posix_spawn starts a program: no copy of this process's page
 * tables, and nothing of its memory shared copy-on-write afterwards (the
 * fork below costs 0.25-0.44 ms and a write fault on every page the
 * supervisor touches later: docs/performance.md). Its arguments go in a
 * memfd (shed.c, ct_args_image); the descriptors it and the worker need
 * are inherited across the exec. Where any of it is missing or refused
 * (no image for this architecture, memfd_create or exec of a memfd refused,
 * vm.memfd_noexec, an LSM), the init is forked as before. */

#ifndef MFD_EXEC
#define MFD_EXEC 0x0010U
#endif
#ifndef F_SEAL_SEAL
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#define F_SEAL_WRITE 0x0008
#endif
#define CT_IMAGE_SEALS (F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE)

struct image_ref {
    int fd;
    dev_t dev;
    ino_t ino;
};

static int is_our_image(const struct image_ref *r) {
    struct stat st;
    return fstat(r->fd, &st) == 0 && st.st_dev == r->dev && st.st_ino == r->ino &&
           fcntl(r->fd, F_GET_SEALS) == CT_IMAGE_SEALS && (unsigned long)st.st_size == ct_init_image_len;
}

/* A sealed memfd of the image, made for one spawn and closed after it
 * (the exec holds its own reference): nothing of contain's stays open in
 * the caller between runs. About 20 us: memfd_create, 24 KB written, the
 * seals. 0, or -errno. The exec'ing child checks it again (exec_child). */
static int init_image(struct image_ref *r) {
    struct stat st;
    if (ct_init_image_len == 0) return -ENOEXEC;
    int fd = (int)syscall(SYS_memfd_create, "ct-init", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_EXEC);
    if (fd < 0 && errno == EINVAL) fd = (int)syscall(SYS_memfd_create, "ct-init", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return -errno;
    int rc = ct_write_all(fd, (const char *)ct_init_image, ct_init_image_len);
    if (rc == 0 && fcntl(fd, F_ADD_SEALS, CT_IMAGE_SEALS) < 0) rc = -errno;
    if (rc == 0 && fstat(fd, &st) < 0) rc = -errno;
    if (rc < 0) {
        close(fd);
        return rc;
    }
    r->fd = fd;
    r->dev = st.st_dev;
    r->ino = st.st_ino;
    return 0;
}

struct exec_ctx {
    struct image_ref image;
    struct image_ref args;
    char *argv[6];
    char *envp[1];
    const int *keep;
    int nkeep;
    int err;
};

/* The CLONE_VM child: what the init and its worker need survives the
 * exec (close-on-exec cleared in this child's own descriptor table). Not
 * 0-2 as such: one that is close-on-exec here (the CLI's placeholder for a
 * descriptor its caller closed) is closed for the worker too, and the init
 * holds its place (ct_init_from_image). */
static void exec_child(void *p) {
    struct exec_ctx *c = p;
    /* Checked again here, in this child's own copy of the table, which
     * nobody else can change: in the supervisor another thread may close
     * the number and reuse it between init_image's check and the clone
     * (a file of someone else's was then exec'd as the init; or mapped as its
     * arguments, naming the worker's program, credentials, descriptors). */
    struct stat st;
    if (!is_our_image(&c->image) || fstat(c->args.fd, &st) < 0 || st.st_dev != c->args.dev ||
        st.st_ino != c->args.ino) {
        c->err = ESTALE;
        _exit(127);
    }
    for (int i = 0; i < c->nkeep; i++)
        if (c->keep[i] >= 0) fcntl(c->keep[i], F_SETFD, 0);
    syscall(SYS_execveat, c->image.fd, "", c->argv, c->envp, AT_EMPTY_PATH);
    c->err = errno;
    _exit(127);
}

/* The init exec'd into the new namespaces: its pid, or -1 with *fallback
 * set and nothing left running: fork it instead (a failed clone too, its
 * stack unmappable say: the fork's clone then says what the kernel says). */
static long spawn_execd(const struct ct_spawn_args *a, uint64_t flags, int sock, int sync_rd, int *pidfd,
                        const struct ct_wall_args *w, int *fallback) {
    *fallback = 1;
    struct image_ref image;
    if (init_image(&image) < 0) return -1;
    int args_fd = -1;
    size_t len = 0;
    struct stat args_st;
    if (ct_args_image(a, w, &args_fd, &len, &args_st) < 0 || (args_fd = above_stdio(args_fd)) < 0) {
        close(image.fd);
        return -1;
    }
    int keep[8 + a->njoin + a->npass];
    int n = 0;
    keep[n++] = sock;
    keep[n++] = sync_rd;
    keep[n++] = args_fd;
    keep[n++] = w->owner_pidfd;     /* -1, or die with the owner (init.c) */
    for (int i = 0; i < 3; i++) keep[n++] = a->stdio[i];
    for (int i = 0; i < a->njoin; i++) keep[n++] = a->join_fds[i];
    for (int i = 0; i < a->npass; i++) keep[n++] = a->pass_fds[i];
    char s_sock[24], s_sync[24], s_args[24], s_len[24];
    *ct_put_int(s_sock, sock) = 0;
    if (sync_rd >= 0)
        *ct_put_int(s_sync, sync_rd) = 0;
    else
        memcpy(s_sync, "-1", 3);
    *ct_put_int(s_args, args_fd) = 0;
    *ct_put_int(s_len, (long)len) = 0;
    struct exec_ctx c = {image, {args_fd, args_st.st_dev, args_st.st_ino},
                         {CT_INIT_NAME, s_sock, s_sync, s_args, s_len, NULL}, {NULL}, keep, n, 0};
    long pid = ct_vfork_call(flags, pidfd, a->cgroup_fd, exec_child, &c);
    int e = errno;
    close(args_fd);
    close(image.fd);
    if (pid < 0) {
        errno = e;
        return -1;
    }
    if (c.err != 0) {
        /* The exec was refused: the child is gone (it exited), reaped here. */
        struct ct_spawn_result dead;
        ct_reap(*pidfd, &dead);
        close(*pidfd);
        *pidfd = -1;
        return -1;
    }
    *fallback = 0;
    return pid;
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
    /* The init's ends above 0-2: a caller that closed its stdin and stdout
     * would otherwise hand the init its report socket as fd 1, which the
     * init points at /dev/null once the worker runs (and the report is
     * lost: the spawn waited out its timeout and failed). */
    sv[1] = above_stdio(sv[1]);
    if (sync[0] >= 0) sync[0] = above_stdio(sync[0]);
    if (sv[1] < 0 || (w->userns == CT_USERNS_MAP || w->hold ? sync[0] < 0 : 0)) {
        rc = -errno;
        close(sv[0]);
        if (sv[1] >= 0) close(sv[1]);
        if (sync[0] >= 0) close(sync[0]);
        if (sync[1] >= 0) close(sync[1]);
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
    long pid = -1;
    int fallback = 1;
    r->init_execd = 0;
    /* Not with a user namespace: an exec there, before the maps exist,
     * takes every capability in it away (the namespace's root is unmapped
     * yet: cap_bprm_creds_from_file), and the init then cannot become its
     * root, nor write its own maps. */
    if (w->exec_init && w->userns == CT_USERNS_NONE) pid = spawn_execd(a, flags, sv[1], sync[0], &pidfd, w, &fallback);
    if (pid > 0)
        r->init_execd = 1;
    else if (fallback)
        pid = ct_raw_clone3(flags, &pidfd, a->cgroup_fd);
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
