#define _GNU_SOURCE
/* The PID-namespace wall: our own init at pid 1 of a new PID namespace.
 *
 * A process cannot leave its PID namespace, whatever its privileges or
 * clone flags (setns(CLONE_NEWPID) only changes where later children go,
 * and only downwards). When the init exits, the kernel SIGKILLs every
 * other member and holds the init's exit until they are all gone:
 * exit_notify -> forget_original_parent -> find_child_reaper, which for the
 * namespace's child_reaper calls zap_pid_ns_processes (kernel/exit.c,
 * kernel/pid_namespace.c). zap_pid_ns_processes first disables pid
 * allocation (nothing can enter any more), SIGKILLs every member, reaps
 * its own children, then sleeps until pid_allocated has dropped to the
 * init's own, which also covers zombies of parents outside (setns+fork),
 * "that gives the invariant that when the init process of a pid namespace
 * is reaped all of the processes in the pid namespace are gone" (its own
 * comment). Only then does exit_notify make the init a zombie, which is
 * when its pidfd polls readable (pidfd_poll: task->exit_state set), for
 * its parent and for any other holder of a pidfd alike.
 *
 * The init is started one of two ways (wall.c), and never allocates:
 * - exec'd from its own image (ct_init_from_image: this file built without
 *   libc, initbin/), where this process can and no user namespace is asked
 *   for: it names itself ct/init and maps its arguments from the memfd the
 *   supervisor wrote them to; nothing of the supervisor's memory is shared;
 * - or forked from the supervisor (ct_init_main): it names itself ct/init,
 *   copies its arguments and unmaps the large private mappings it
 *   inherited (shed.c: else every page of a library caller's heap stays
 *   shared copy-on-write for the run's life);
 * then, either way:
 * - it closes every descriptor the supervisor had except the few it needs
 *   (a library caller's pipes and locks must not stay open for the run's
 *   life);
 * - user namespace: SELF writes setgroups "deny" and "U U 1" maps for
 *   itself (user_namespaces(7): an unprivileged writer may map only its own
 *   ids, and gid_map only after setgroups is denied); MAP waits until the
 *   parent, which holds CAP_SETUID where the maps point, has written them,
 *   then becomes uid/gid 0 with no supplementary groups;
 * - mount namespace: every mount private, then a fresh /proc (both only
 *   noted if refused: a /proc of the host's namespace still works for us,
 *   ps just shows more);
 * - joins its cgroups (join fds, as in child.c; but the run's v1 pids
 *   cgroup is the worker's to join, so --pids-max does not count this
 *   init), forks the
 *   worker with the same child set-up as a plain spawn (ct_child_exec) and
 *   learns exactly whether it exec'd (ct_child_settle), then reports EXEC, passing the
 *   worker's pidfd over the socket (and its pid as the supervisor's /proc
 *   names it, read through a /proc handle kept from before the remount), or
 *   FAILED;
 * - then sleeps in signalfd with every signal blocked: SIGCHLD reaps all
 *   (the worker's status is reported as EXIT); once the worker is reaped
 *   and waitpid says ECHILD, it reports EMPTY with the CPU time of every
 *   member it reaped, and exits 0. A signal sent from outside the
 *   namespace arrives with si_pid 0 (send_signal_locked zeroes it when the
 *   sender has no pid in the init's namespace) and is forwarded to every
 *   member with kill(-1, sig) (kill_something_info skips pid 1 and anything
 *   without a pid in our namespace), then SIGCONT so a stopped member can
 *   act on it. A signal from a member carries its pid and is dropped: with
 *   the signal blocked it is queued (sig_ignored never ignores a blocked
 *   signal), so the init has to filter it itself. SIGKILL from a member is
 *   dropped by the kernel (sig_task_ignored: SIGNAL_UNKILLABLE with SIG_DFL
 *   and no force); from outside it kills the init, and the kernel then
 *   empties the namespace;
 * - die with the owner (ct_wall_args.owner_pidfd >= 0): the init also polls
 *   a pidfd of the supervisor process, kept through close_all_but and
 *   across the exec of the image; a pidfd of a thread-group leader polls
 *   readable only once the whole process has exited (pidfd_poll), and then
 *   the init exits, so the kernel empties the namespace as above. Not the
 *   report socket: the supervisor closes it once the worker runs.
 *
 * Messages are fixed-size (struct ct_init_msg) on a SOCK_SEQPACKET pair,
 * sent with MSG_DONTWAIT: the reaper never blocks on its supervisor, and
 * the supervisor never waits for an EOF (the init's pidfd is the word on
 * whether it lives). The supervisor's side (the clone into the new
 * namespaces, the maps it writes, reading the messages) is wall.c.
 *
 * Measured on this kernel (Linux 6.18, 2 shared cores; tests/test_wall.py,
 * benchmarks/bench_wall.py):
 * (a) SIGKILL to the init of a tree holding a setsid daemon, a SIGTERM
 *     ignorer, a SIGSTOPped process and a member that moved itself into
 *     another cgroup: waitid on the init returned, and the test's own /proc
 *     scan, made right after, found none of them. SIGKILL to the init until
 *     it was reaped: 4.7 ms with 5 setsid members, 7.2 ms with 200, 36.8 ms
 *     with 1,000 (none left each time).
 * (b) An adopter (not the init's parent) holding pidfd_open(init): with one
 *     member held in a frozen v1 freezer cgroup after the SIGKILL (a frozen
 *     task cannot finish dying), its pidfd stayed unreadable for the whole
 *     1 s the test waited, and the parent's waitid(WNOHANG) found nothing;
 *     the pidfd became readable only after the thaw, with no member left.
 *     Not shown, because it cannot end: a member that never finishes dying
 *     (a zombie whose parent outside the namespace, after setns+fork, never
 *     reaps it) keeps the init unreaped for ever; the supervisor then sees
 *     "not empty", which is the truth.
 * (c) Cost (bench_wall.py, medians of 300, /bin/true, no cgroup): spawn
 *     until the worker exec'd 0.22 ms plain, 0.92 ms behind the wall,
 *     1.11 ms with a fresh /proc, 1.11 ms with a user namespace too; the
 *     whole cycle to the init reaped 0.79 / 1.67 / 1.84 / 1.85 ms. Where it
 *     goes: the init runs its first instruction 0.44 ms after the call (the
 *     clone copies the caller's page tables: the init is a fork of a
 *     Python process), its own set-up takes 14 us, the worker's vfork and
 *     exec 130 us, the clean-up 50 us, and the supervisor wakes up about
 *     0.2 ms after EXEC was sent. While the init lived with the pages it
 *     inherited, the supervisor paid a copy-on-write fault the first time it
 *     wrote each page it still shared with it: writing 32 MiB took 23 ms
 *     instead of 0.6 ms (shed.c now unmaps them). Even so, the supervisor
 *     takes 770-840 minor faults per walled `launcher.run` of /bin/true
 *     (getrusage): the clone write-protects its private pages, and its
 *     first write to each afterwards faults, a copy while the init still
 *     maps the page (docs/performance.md, "Where launcher.run's time goes").
 *     The init's own set-up (mounts, /proc, signalfd) comes before the hold,
 *     overlapping with the supervisor's description of it.
 */
#include "init.h"
#include "child.h"
#include "clone.h"
#include "fds.h"
#include "shed.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void init_send(int sock, int kind, int a, int b, int c, int d, int64_t x, int64_t y, int pass_fd) {
    struct ct_init_msg m;
    memset(&m, 0, sizeof m);
    m.kind = kind;
    m.a = a;
    m.b = b;
    m.c = c;
    m.d = d;
    m.x = x;
    m.y = y;
    struct iovec iov = {&m, sizeof m};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (pass_fd >= 0) {
        memset(&ctl, 0, sizeof ctl);
        mh.msg_control = ctl.buf;
        mh.msg_controllen = sizeof ctl.buf;
        struct cmsghdr *ch = CMSG_FIRSTHDR(&mh);
        ch->cmsg_level = SOL_SOCKET;
        ch->cmsg_type = SCM_RIGHTS;
        ch->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(ch), &pass_fd, sizeof(int));
    }
    while (sendmsg(sock, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
}

static __attribute__((noreturn)) void init_fail(int sock, int stage, int err) {
    init_send(sock, CT_EV_FAILED, stage, err, -1, 0, 0, 0, -1);
    _exit(0);
}

int ct_write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    int rc = ct_write_all(fd, text, strlen(text));
    close(fd);
    return rc;
}

static char *put_map(char *p, long inside, long outside) {
    p = ct_put_int(p, inside);
    *p++ = ' ';
    p = ct_put_int(p, outside);
    memcpy(p, " 1\n", 4);
    return p + 3;
}

static int self_maps(const struct ct_wall_args *w) {
    char map[64];
    int rc;
    if ((rc = ct_write_file("/proc/self/setgroups", "deny")) < 0) return rc;
    put_map(map, w->uid, w->uid);
    if ((rc = ct_write_file("/proc/self/uid_map", map)) < 0) return rc;
    put_map(map, w->gid, w->gid);
    return ct_write_file("/proc/self/gid_map", map);
}

static void sort_ints(int *v, int n) {
    for (int i = 1; i < n; i++) {
        int x = v[i], j = i - 1;
        while (j >= 0 && v[j] > x) {
            v[j + 1] = v[j];
            j--;
        }
        v[j + 1] = x;
    }
}

/* Keep `extra` and what the worker's set-up still needs; close the rest. */
static int close_all_but(const struct ct_spawn_args *a, const int *extra, int nextra) {
    int keep[8 + a->njoin + a->npass];
    int n = 0;
    for (int i = 0; i < nextra; i++) keep[n++] = extra[i];
    for (int i = 0; i < 3; i++) keep[n++] = a->stdio[i];
    for (int i = 0; i < a->njoin; i++) keep[n++] = a->join_fds[i];
    for (int i = 0; i < a->npass; i++) keep[n++] = a->pass_fds[i];
    sort_ints(keep, n);
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (keep[i] < 3 || (m && keep[m - 1] == keep[i])) continue;
        keep[m++] = keep[i];
    }
    return ct_fds_close_except(keep, m);
}

static int is_user_sent(const struct signalfd_siginfo *si) {
    int code = si->ssi_code;
    return code == SI_USER || code == SI_QUEUE || code == SI_TKILL;
}

static __attribute__((noreturn)) void init_run(const struct ct_spawn_args *a, const struct ct_wall_args *w,
                                                int sock, int sync_rd);

/* A descriptor 0-2 that is closed here (a caller's closed stdout; or one
 * the exec of the image closed: close-on-exec in the supervisor, such as the
 * CLI's placeholder) stays closed for the worker, and out of the init's own
 * hands: its own descriptors must not land there, where it later points
 * 0-2 at /dev/null. A placeholder holds each place, opened the wrong way
 * round and close-on-exec, as the CLI's (_cli.py). */
static void hold_closed_stdio(void) {
    for (int fd = 0; fd < 3; fd++) {
        if (fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
        int p = open("/dev/null", (fd == 0 ? O_WRONLY : O_RDONLY) | O_CLOEXEC);
        if (p >= 0 && p != fd) close(p);     /* lower ones are open: cannot differ */
    }
}

void ct_init_main(const struct ct_spawn_args *a, const struct ct_wall_args *w, int sock, int sync_rd) {
    int rc;
    /* First of all: a zombie init whose comm is not this never ran our
     * code (killed at birth: the cgroup.kill fork bug). No message for it:
     * each message is a wake-up of the supervisor. */
    prctl(PR_SET_NAME, CT_INIT_NAME, 0, 0, 0);
    hold_closed_stdio();
    if (w->die_with_parent) prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    /* Then let go of the supervisor's memory: from here on the init and its
     * worker use only the copy of their arguments (shed.c). */
    int unmapped = 0;
    if ((rc = ct_shed(&a, &w, &unmapped)) < 0) init_send(sock, CT_EV_NOTE, CT_NOTE_SHED, -rc, 0, 0, 0, 0, -1);
    init_run(a, w, sock, sync_rd);
}

/* The exec'd init (initbin/entry.c): nothing of the supervisor's memory to
 * let go of. Its arguments come in `args_fd` (shed.c, ct_args_image),
 * with pointers as offsets: mapped here, and moved to where they are. */
void ct_init_from_image(int sock, int sync_rd, int args_fd, size_t len) {
    prctl(PR_SET_NAME, CT_INIT_NAME, 0, 0, 0);
    /* Close-on-exec again, as in the supervisor: the exec of this image
     * needed them open, the worker's must not keep them (one of them at 0-2,
     * where a caller had closed its own, would otherwise be the worker's
     * stdio: the report socket in the worker's hands). */
    fcntl(sock, F_SETFD, FD_CLOEXEC);
    if (sync_rd >= 0) fcntl(sync_rd, F_SETFD, FD_CLOEXEC);
    hold_closed_stdio();
    char *at = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, args_fd, 0);
    int e = errno;
    close(args_fd);
    if (at == MAP_FAILED) init_fail(sock, CT_STAGE_INIT, e);
    struct ct_spawn_args *a;
    struct ct_wall_args *w;
    if (ct_args_relocate(at, len, 0, &a, &w) < 0) init_fail(sock, CT_STAGE_INIT, EINVAL);
    if (w->owner_pidfd >= 0) fcntl(w->owner_pidfd, F_SETFD, FD_CLOEXEC);
    if (w->die_with_parent) prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    init_run(a, w, sock, sync_rd);
}

/* Every directory above the one to hide, bound onto itself: a mount point
 * cannot be renamed, replaced or removed from the mount namespace it is
 * mounted in (vfs_rename and vfs_rmdir: is_local_mountpoint -> EBUSY,
 * whatever path names it), so a worker that owns a parent of the state
 * directory (~/.local/state/contain: it owns ~/.local) cannot move it
 * aside and plant another state directory, with a forged record, where
 * readers outside look. Recursive (MS_REC): submounts stay visible, and a
 * locked one may only be bound with its parent. Top down, and before the
 * tmpfs below them is mounted. 0 or -errno. */
static int pin_ancestors(const char *path) {
    char buf[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf || path[0] != '/') return -EINVAL;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i < n; i++) {
        if (buf[i] != '/' || buf[i - 1] == '/') continue;
        buf[i] = '\0';
        int r = mount(buf, buf, NULL, MS_BIND | MS_REC, NULL);
        buf[i] = '/';
        if (r < 0) return -errno;
    }
    return 0;
}

static void init_run(const struct ct_spawn_args *a, const struct ct_wall_args *w, int sock, int sync_rd) {
    int rc;
    int extra[3] = {sock, -1, -1}, nextra = 1;
    if (sync_rd >= 0) extra[nextra++] = sync_rd;
    if (w->owner_pidfd >= 0) extra[nextra++] = w->owner_pidfd;
    if ((rc = close_all_but(a, extra, nextra)) < 0) init_fail(sock, CT_STAGE_INIT, -rc);
    /* SIGCHLD at SIG_DFL: a library caller's SIG_IGN (kept across the fork
     * and the exec) has the kernel reap our children itself, and the
     * worker's exit is never seen (waitpid: ECHILD): the init never ends. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    if (sigaction(SIGCHLD, &dfl, NULL) < 0) init_fail(sock, CT_STAGE_INIT, errno);

    if (w->userns == CT_USERNS_SELF) {
        if ((rc = self_maps(w)) < 0) init_fail(sock, CT_STAGE_USERNS, -rc);
    } else if (w->userns == CT_USERNS_MAP) {
        char b;
        ssize_t n;
        do {
            n = read(sync_rd, &b, 1);
        } while (n < 0 && errno == EINTR);
        if (n != 1) init_fail(sock, CT_STAGE_USERNS, n < 0 ? errno : ECANCELED);
        /* Root of the namespace, without the supervisor's supplementary
         * groups: those are host gids and would keep their access. */
        if (syscall(SYS_setresgid, 0, 0, 0) < 0) init_fail(sock, CT_STAGE_USERNS, errno);
        if (syscall(SYS_setgroups, 0, NULL) < 0) init_fail(sock, CT_STAGE_USERNS, errno);
        if (syscall(SYS_setresuid, 0, 0, 0) < 0) init_fail(sock, CT_STAGE_USERNS, errno);
    }
    /* The v1 joins before the hold, through each cgroup's `tasks` file: this
     * init is single-threaded, and a thread moving itself skips the global
     * cgroup_threadgroup_rwsem whose first taking after a quiet spell waits
     * for an RCU grace period (5-15 ms here; _runcgroups.join_fds). Nothing
     * of the worker's runs before they are done. */
    int worker_joins = w->worker_joins < 0 ? 0 : w->worker_joins > a->njoin ? a->njoin : w->worker_joins;
    struct ct_spawn_args ia = *a;
    ia.njoin = a->njoin - worker_joins;
    if (ia.njoin > 0 || ia.ncg_expect > 0) {
        if ((rc = ct_child_join(&ia)) < 0) init_fail(sock, CT_STAGE_JOIN, -rc);
    }
    /* The supervisor's /proc, kept until EXEC: through it the worker's pidfd
     * names the worker's pid as the supervisor sees it, which goes with
     * EXEC. Once the init has reaped a worker that exits at once (often, for
     * /bin/true, before the supervisor has read EXEC), its pidfd names no
     * pid any more. */
    int hostproc = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (w->mount_proc) {
        /* Private first: a /proc mounted over a shared / would propagate
         * back into the host's mount namespace. */
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) {
            init_send(sock, CT_EV_NOTE, CT_NOTE_MOUNT_PRIVATE, errno, 0, 0, 0, 0, -1);
            if (w->hide) init_send(sock, CT_EV_NOTE, CT_NOTE_HIDE, errno, 0, 0, 0, 0, -1);
        } else {
            if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
                init_send(sock, CT_EV_NOTE, CT_NOTE_MOUNT_PROC, errno, 0, 0, 0, 0, -1);
            /* The state directory, out of the worker's reach: an empty tmpfs
             * over it, in this (now private) mount namespace only. The worker
             * runs without capabilities and cannot unmount it, nor can it in
             * a namespace of its own (the mount is locked there:
             * copy_mnt_ns -> lock_mnt_tree). Only behind a user namespace of
             * the caller's own uid, whose worker would otherwise own the state
             * directory (wall.py decides). */
            int pinned = w->hide ? pin_ancestors(w->hide) : 0;
            if (pinned < 0) init_send(sock, CT_EV_NOTE, CT_NOTE_HIDE, -pinned, 0, 0, 0, 0, -1);
            if (w->hide && mount("tmpfs", w->hide, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                 "mode=0700,size=64m") < 0) {
                init_send(sock, CT_EV_NOTE, CT_NOTE_HIDE, errno, 0, 0, 0, 0, -1);
            } else if (w->hide) {
                /* A working directory inside it still names the directory
                 * under the tmpfs: the worker starts in the tmpfs instead. */
                char cwd[4096];
                size_t hl = strlen(w->hide);
                if (getcwd(cwd, sizeof cwd) && strncmp(cwd, w->hide, hl) == 0 && (cwd[hl] == '/' || !cwd[hl]) &&
                    chdir(w->hide) < 0)
                    init_send(sock, CT_EV_NOTE, CT_NOTE_HIDE, errno, 0, 0, 0, 0, -1);
            }
        }
    }

    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);   /* already so since the clone; made sure */
    int sfd = signalfd(-1, &all, SFD_CLOEXEC);
    if (sfd < 0) init_fail(sock, CT_STAGE_INIT, errno);
    int pp[2];
    if (pipe2(pp, O_CLOEXEC | O_NONBLOCK) < 0) init_fail(sock, CT_STAGE_FORK, errno);

    /* The hold comes last of the init's own set-up (its namespaces, its
     * /proc, its descriptors: nothing of the worker's), so that all of it
     * overlaps with the caller describing this init durably (the private
     * mounts and the fresh /proc cost 0.13 ms in bench_wall.py). An EOF (the
     * caller died first) ends the namespace before the worker began. */
    if (w->hold && w->userns != CT_USERNS_MAP) {
        char b;
        ssize_t n;
        do {
            n = read(sync_rd, &b, 1);
        } while (n < 0 && errno == EINTR);
        if (n != 1) init_fail(sock, CT_STAGE_INIT, n < 0 ? errno : ECANCELED);
    }
    if (sync_rd >= 0) close(sync_rd);

    /* The worker: the set-up of a plain spawn, minus the placement done
     * here for the whole namespace. The run's v1 pids cgroup the worker
     * joins itself before exec (w->worker_joins, the last join fds), so
     * that --pids-max N counts the tree's tasks and not this init (with the
     * init inside, --pids-max 1 could not fork the worker). Joining moves a
     * task whatever the limit (pids.max binds forks, not migration:
     * pids.rst). The memory cgroup stays the init's: a vfork child that
     * joins one at its limit faults for ever (_runcgroups.worker_joins_itself). */
    struct ct_spawn_args wa = *a;
    wa.cgroup_fd = -1;
    wa.join_fds = a->join_fds + ia.njoin;
    wa.njoin = worker_joins;
    wa.ncg_expect = 0;
    struct ct_report rep = {pp[1]};
    int wpidfd = -1;
    long wpid = ct_vfork_exec(&wa, &rep, &wpidfd, -1);
    if (wpid < 0) init_fail(sock, CT_STAGE_FORK, errno);
    close(pp[1]);
    struct ct_spawn_result res;
    memset(&res, 0, sizeof res);
    res.candidate = -1;
    rc = ct_child_settle((int)wpid, wpidfd, pp[0], &res);
    close(pp[0]);
    if (rc < 0) {
        init_send(sock, CT_EV_FAILED, res.stage, res.child_errno, res.candidate, res.signal, res.wstatus, 0, -1);
        _exit(0);
    }
    /* Hold nothing of the supervisor's any more (before saying EXEC, so
     * that the supervisor never sees an init that does): stdio to
     * /dev/null, the worker's descriptors closed, cwd at / (a workspace
     * check must not find the init in it). */
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0 || dup2(null, 0) < 0 || dup2(null, 1) < 0 || dup2(null, 2) < 0)
        init_send(sock, CT_EV_NOTE, CT_NOTE_DEVNULL, errno, 0, 0, 0, 0, -1);
    long host_pid = -1;
    long long start = -1;
    if (hostproc < 0 || ct_pid_via_fdinfo_at(hostproc, "", wpidfd, &host_pid) < 0) host_pid = -1;
    if (host_pid > 0 && ct_start_time_at(hostproc, host_pid, &start) < 0) start = -1;
    int owner = w->owner_pidfd;
    int keep[4] = {sock, sfd, wpidfd, owner};
    sort_ints(keep, owner >= 0 ? 4 : 3);
    ct_fds_close_except(keep, owner >= 0 ? 4 : 3);    /* hostproc too */
    if (chdir("/") < 0) {
    }
    init_send(sock, CT_EV_EXEC, (int)wpid, (int)host_pid, 0, 0, start, 0, wpidfd);
    close(wpidfd);

    int worker_done = 0;
    for (;;) {
        /* Reap everything that is ready; SIGCHLD only says "look". */
        for (;;) {
            int st = 0;
            pid_t p = waitpid(-1, &st, WNOHANG | __WALL);
            if (p > 0) {
                if (p == wpid) {
                    worker_done = 1;
                    init_send(sock, CT_EV_EXIT, (int)p, st, 0, 0, 0, 0, -1);
                }
                continue;
            }
            if (p < 0 && errno == EINTR) continue;
            if (p < 0 && errno == ECHILD && worker_done) {
                struct rusage ru;
                memset(&ru, 0, sizeof ru);
                getrusage(RUSAGE_CHILDREN, &ru);
                init_send(sock, CT_EV_EMPTY, 0, 0, (int)ru.ru_maxrss, 0,
                          (int64_t)ru.ru_utime.tv_sec * 1000000 + ru.ru_utime.tv_usec,
                          (int64_t)ru.ru_stime.tv_sec * 1000000 + ru.ru_stime.tv_usec, -1);
                _exit(0);
            }
            break;
        }
        /* Die with the owner: its pidfd polls readable once the whole
         * supervisor process has exited (pidfd_poll: the thread group is
         * empty), whatever killed it. The init then exits, and the kernel
         * kills every member of the namespace before the init is reaped
         * (zap_pid_ns_processes, above). Not the report socket: the
         * supervisor closes it once the worker runs (Init.quiet). */
        if (owner >= 0) {
            struct pollfd pf[2] = {{sfd, POLLIN, 0}, {owner, POLLIN, 0}};
            if (poll(pf, 2, -1) < 0) continue;
            if (pf[1].revents) _exit(0);
            if (!(pf[0].revents & POLLIN)) continue;
        }
        struct signalfd_siginfo si;
        ssize_t n = read(sfd, &si, sizeof si);
        if (n != (ssize_t)sizeof si) continue;
        int sig = (int)si.ssi_signo;
        if (sig == SIGCHLD) continue;
        if (si.ssi_pid != 0 || !is_user_sent(&si)) continue;   /* from a member, or the kernel */
        int err = kill(-1, sig) < 0 ? errno : 0;
        if (sig != SIGCONT && sig != SIGTSTP && sig != SIGTTIN && sig != SIGTTOU && sig != SIGWINCH)
            kill(-1, SIGCONT);
        init_send(sock, CT_EV_FORWARDED, sig, err, 0, 0, 0, 0, -1);
    }
}
