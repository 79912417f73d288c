#define _GNU_SOURCE
/* Signalling every member of a cgroup subtree, by identity.
 *
 * cgroup.procs is a snapshot and can list exiting tasks (cgroup-v2.rst); a
 * pid read from it may be reused before it is signalled (pid_max is small).
 * So each pid is pinned with pidfd_open first, then /proc/<pid>/cgroup is
 * re-read: only a process still inside `cg_path` is signalled, through the
 * pidfd. The hard stop is cgroup.kill; this is the polite SIGTERM pass.
 */
#include "cgroup.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/syscall.h>
#include <unistd.h>

static int in_cgroup(int pid, const char *cg_path, size_t cg_len) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/cgroup", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    /* The v2 line is "0::<path>" (cgroups(7)); on hybrid hosts v1 lines come first. */
    for (char *line = buf; line && *line; ) {
        char *nl = strchr(line, '\n');
        if (strncmp(line, "0::", 3) == 0) {
            const char *p = line + 3;
            return strncmp(p, cg_path, cg_len) == 0 && (p[cg_len] == '/' || p[cg_len] == '\n' || p[cg_len] == 0);
        }
        line = nl ? nl + 1 : NULL;
    }
    return 0;
}

static void signal_procs(int dfd, const char *cg_path, size_t cg_len, int sig, int also_cont,
                         int *n_sent, int *n_failed) {
    int fd = openat(dfd, "cgroup.procs", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        (*n_failed)++;
        return;
    }
    FILE *f = fdopen(fd, "r");
    if (!f) {
        close(fd);
        (*n_failed)++;
        return;
    }
    int pid;
    while (fscanf(f, "%d", &pid) == 1) {
        int pfd = (int)syscall(SYS_pidfd_open, pid, 0);
        if (pfd < 0) continue;  /* already gone: nothing to signal */
        if (in_cgroup(pid, cg_path, cg_len)) {
            if (syscall(SYS_pidfd_send_signal, pfd, sig, NULL, 0) == 0) {
                (*n_sent)++;
                if (also_cont) syscall(SYS_pidfd_send_signal, pfd, SIGCONT, NULL, 0);
            } else if (errno != ESRCH) {
                (*n_failed)++;
            }
        }
        close(pfd);
    }
    fclose(f);
}

static int walk(int dfd, const char *cg_path, size_t cg_len, int sig, int also_cont,
                int *n_sent, int *n_failed, int depth) {
    signal_procs(dfd, cg_path, cg_len, sig, also_cont, n_sent, n_failed);
    if (depth > 64) return 0;
    int dup = fcntl(dfd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) return -errno;
    DIR *d = fdopendir(dup);
    if (!d) {
        close(dup);
        return -errno;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_type != DT_DIR || e->d_name[0] == '.') continue;
        int sub = openat(dfd, e->d_name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (sub < 0) continue;
        walk(sub, cg_path, cg_len, sig, also_cont, n_sent, n_failed, depth + 1);
        close(sub);
    }
    closedir(d);
    return 0;
}

int ct_cgroup_signal_members(const char *dir, const char *cg_path, int sig, int also_cont,
                             int *n_sent, int *n_failed) {
    *n_sent = 0;
    *n_failed = 0;
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return -errno;
    int rc = walk(dfd, cg_path, strlen(cg_path), sig, also_cont, n_sent, n_failed, 0);
    close(dfd);
    return rc;
}

int ct_inotify_open(void) {
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    return fd < 0 ? -errno : fd;
}

int ct_inotify_watch(int fd, const char *path, uint32_t mask) {
    int wd = inotify_add_watch(fd, path, mask);
    return wd < 0 ? -errno : wd;
}

/* Remove a watch before closing its inotify fd: closing an instance that
 * still holds a mark waits in fsnotify_destroy_group() for the mark reaper
 * and an SRCU grace period (fs/notify/mark.c), measured at 8-16 ms a close
 * here; a mark removed first is destroyed asynchronously (0.1 ms median). */
int ct_inotify_unwatch(int fd, int wd) {
    return inotify_rm_watch(fd, wd) < 0 ? -errno : 0;
}
