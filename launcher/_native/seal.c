#define _GNU_SOURCE
/* The seal: what keeps a worker from leaving its cgroup.
 *
 * Leaving a cgroup v2 takes write permission on the common ancestor's
 * cgroup.procs, checked on the file's inode (cgroup-v2.rst, "Delegation
 * Containment"). A worker running as uid 0 owns those files, so it needs no
 * capability at all; it only needs to reach them. Measured on this kernel:
 *
 * - A read-only bind of the cgroup2 mount stops write(2) (EROFS) but not
 *   clone3(CLONE_INTO_CGROUP) with an O_PATH fd of a directory above the run:
 *   that check (cgroup_may_write) asks inode_permission, which ignores the
 *   mount's read-only flag. So the host hierarchy must be absent, not only
 *   read-only: each cgroup2 mount is detached and replaced by a fresh mount
 *   made inside a new cgroup namespace, whose root is the run's own leaf.
 * - /proc/<pid>/root of any process outside leads back to the host mount.
 *   Dropping CAP_SYS_PTRACE closes it only for targets whose capabilities
 *   are not a subset of the worker's (cap_ptrace_access_check); a root
 *   process without capabilities stays walkable, and through it the worker
 *   moved itself. A user namespace closes it for every process outside:
 *   across user namespaces the same check needs CAP_SYS_PTRACE in the
 *   target's namespace. The identity map keeps file access as it was.
 * - Mounts are made private, not slave: a cgroup2 mount made on the host
 *   after the spawn must not propagate into the worker's namespace.
 *
 * Everything here runs in the child between clone and execve: system calls
 * only, no allocation, no locks.
 */
#include "seal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CGROUP2_SUPER_MAGIC
#define CGROUP2_SUPER_MAGIC 0x63677270
#endif
#ifndef ST_RDONLY
#define ST_RDONLY 1
#endif

struct ct_seal_clone_args {  /* struct clone_args, version 0 (64 bytes) */
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls;
};

/* fork(2) without glibc's atfork handlers: safe in a clone3 child. */
static long seal_fork(void) {
    struct ct_seal_clone_args ca;
    memset(&ca, 0, sizeof ca);
    ca.exit_signal = SIGCHLD;
    return syscall(SYS_clone3, &ca, sizeof ca);
}

static int remount_ro(const char *path) {
    struct statfs st;
    unsigned long flags = MS_REMOUNT | MS_BIND | MS_RDONLY;
    if (statfs(path, &st) < 0) return -errno;
    /* A bind remount must restate the per-mount flags it keeps. */
    if (st.f_flags & ST_NOSUID) flags |= MS_NOSUID;
    if (st.f_flags & ST_NODEV) flags |= MS_NODEV;
    if (st.f_flags & ST_NOEXEC) flags |= MS_NOEXEC;
    if (st.f_flags & ST_NOATIME) flags |= MS_NOATIME;
    if (st.f_flags & ST_NODIRATIME) flags |= MS_NODIRATIME;
    if (st.f_flags & ST_RELATIME) flags |= MS_RELATIME;
    if (mount(NULL, path, NULL, flags, NULL) < 0) return -errno;
    return 0;
}

static int replace_cgroup2(const char *path) {
    struct statfs st;
    /* Detach every cgroup2 mount stacked on this point (MNT_DETACH takes
     * the mounts below it too), until something else shows through. */
    for (int i = 0; i < 16; i++) {
        if (umount2(path, MNT_DETACH) < 0) return -errno;
        if (statfs(path, &st) < 0) return -errno;
        if (st.f_type != CGROUP2_SUPER_MAGIC) break;
    }
    if (st.f_type == CGROUP2_SUPER_MAGIC) return -EBUSY;
    /* Made from inside the new cgroup namespace, the mount's root is the
     * namespace's root: the run's leaf. Mount options stay per-mount; the
     * superblock (shared with the host) is never reconfigured, and no
     * cgroup2 option is passed (outside the initial cgroup namespace the
     * kernel ignores them anyway, apply_cgroup_root_flags). */
    if (mount("cgroup2", path, "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RELATIME, NULL) < 0)
        return -errno;
    return remount_ro(path);
}

int ct_seal_child_mounts(const char *const *cg2, int ncg2, const char *const *ro, int nro) {
    int rc;
    if (unshare(CLONE_NEWNS | CLONE_NEWCGROUP) < 0) return -errno;
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) return -errno;
    for (int i = 0; i < ncg2; i++) {
        if ((rc = replace_cgroup2(cg2[i])) < 0) return rc;
    }
    for (int i = 0; i < nro; i++) {
        if ((rc = remount_ro(ro[i])) < 0) return rc;
    }
    return 0;
}

static char *put_uint(char *p, unsigned long v) {
    char tmp[24];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n) *p++ = tmp[--n];
    return p;
}

static int write_map(long pid, const char *name) {
    static const char identity[] = "0 0 4294967295\n";
    char path[64], *p = path;
    memcpy(p, "/proc/", 6);
    p = put_uint(p + 6, (unsigned long)pid);
    *p++ = '/';
    size_t n = strlen(name);
    memcpy(p, name, n + 1);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    ssize_t w = write(fd, identity, sizeof identity - 1);
    int e = errno;
    close(fd);
    if (w != (ssize_t)(sizeof identity - 1)) return -(w < 0 ? e : EIO);
    return 0;
}

int ct_seal_child_userns(void) {
    int p[2], status = 0, rc = 0;
    long self = syscall(SYS_getpid);
    if (pipe2(p, O_CLOEXEC) < 0) return -errno;
    long helper = seal_fork();
    if (helper < 0) {
        int e = errno;
        close(p[0]);
        close(p[1]);
        return -e;
    }
    if (helper == 0) {
        /* Still in the parent user namespace, with CAP_SETUID there. */
        char b;
        ssize_t n;
        close(p[1]);
        do {
            n = read(p[0], &b, 1);
        } while (n < 0 && errno == EINTR);
        if (n != 1) _exit(ECANCELED);
        if ((rc = write_map(self, "uid_map")) < 0) _exit(-rc & 0xff);
        if ((rc = write_map(self, "gid_map")) < 0) _exit(-rc & 0xff);
        _exit(0);
    }
    close(p[0]);
    if (unshare(CLONE_NEWUSER) < 0) {
        rc = -errno;
    } else {
        ssize_t n;
        do {
            n = write(p[1], "1", 1);
        } while (n < 0 && errno == EINTR);
        if (n != 1) rc = -(n < 0 ? errno : EIO);
    }
    close(p[1]);  /* EOF tells a waiting helper to give up */
    while (syscall(SYS_wait4, helper, &status, 0, NULL) < 0) {
        if (errno != EINTR) {
            if (!rc) rc = -errno;
            return rc;
        }
    }
    if (!rc && !(WIFEXITED(status) && WEXITSTATUS(status) == 0))
        rc = -(WIFEXITED(status) ? WEXITSTATUS(status) : ECHILD);
    return rc;
}

int ct_seal_probe(int what) {
    sigset_t all, old;
    int status = 0;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    long pid = seal_fork();
    if (pid == 0) {
        int rc = 0;
        if ((what & CT_PROBE_MOUNTNS) && unshare(CLONE_NEWNS | CLONE_NEWCGROUP) < 0) rc = -errno;
        if (!rc && (what & CT_PROBE_MOUNTNS) && mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
            rc = -errno;
        if (!rc && (what & CT_PROBE_USERNS)) rc = ct_seal_child_userns();
        _exit(rc < 0 ? (-rc & 0xff) : 0);
    }
    int e = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) return -e;
    while (waitpid((pid_t)pid, &status, __WALL) < 0) {
        if (errno != EINTR) return -errno;
    }
    if (WIFEXITED(status)) return -WEXITSTATUS(status);
    return -ECHILD;
}
