#define _GNU_SOURCE
/* What a seccomp filter answers for the calls that make namespaces and
 * mounts, without making any, and whether PR_SET_CHILD_SUBREAPER is
 * allowed: for `contain doctor` inside a container.
 *
 * A filter answers at syscall entry, before the kernel looks at the
 * arguments (Documentation/userspace-api/seccomp_filter.rst). So each call
 * is made with the namespace flags a filter looks for plus arguments the
 * kernel itself rejects before any permission check: clone with
 * CLONE_SIGHAND but not CLONE_VM (copy_process: EINVAL), unshare with a
 * bit it does not know (check_unshare_flags: EINVAL), mount with no target
 * (user_path_at of NULL: EFAULT). That answer means the call got past any
 * filter; anything else (Docker's default profile: EPERM) is the filter's.
 * Nothing is made either way. The caller compares; this file only asks.
 *
 * The calls run in a child of their own: a filter may kill rather than
 * answer (SECCOMP_RET_KILL_PROCESS), and the subreaper flag must not stay
 * on the caller (a library caller's process). The answers come back
 * through a shared page: the caller may have SIGCHLD ignored (then the
 * child is reaped by the kernel and its status is lost). */
#include "refusals.h"

#include "clone.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef P_PIDFD
#define P_PIDFD 3
#endif
#ifndef PR_SET_CHILD_SUBREAPER
#define PR_SET_CHILD_SUBREAPER 36
#define PR_GET_CHILD_SUBREAPER 37
#endif

static int answer(long r) {
    return r < 0 ? -errno : 0;
}

static void ask(volatile struct ct_refusals *r) {
    unsigned long ns = CLONE_NEWPID | CLONE_NEWUSER | CLONE_NEWNS;
    /* No new stack and no CLONE_VM: should a kernel ever accept it, the
     * grandchild returns here on a copy of this child and exits at once. */
    long c = syscall(SYS_clone, ns | CLONE_SIGHAND | SIGCHLD, NULL, NULL, NULL, NULL);
    if (c == 0) _exit(0);
    r->clone_ns = answer(c);
    r->unshare_ns = answer(syscall(SYS_unshare, ns | 1UL));
    r->mount = answer(syscall(SYS_mount, NULL, NULL, NULL, 0UL, NULL));
    int got = 0;
    long s = prctl(PR_SET_CHILD_SUBREAPER, 1UL, 0UL, 0UL, 0UL);
    if (s == 0) s = prctl(PR_GET_CHILD_SUBREAPER, (unsigned long)&got, 0UL, 0UL, 0UL);
    r->subreaper = s < 0 ? -errno : (got == 1 ? 0 : -EINVAL);
}

int ct_refusals_probe(struct ct_refusals *out) {
    volatile struct ct_refusals *r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) return -errno;
    r->clone_ns = r->unshare_ns = r->mount = r->subreaper = 1;
    r->died_signal = 0;
    int pidfd = -1;
    long pid = ct_raw_clone3(0, &pidfd, -1);
    if (pid < 0) {
        int e = errno;
        munmap((void *)r, sizeof *r);
        return -e;
    }
    if (pid == 0) {
        ask(r);
        _exit(0);
    }
    siginfo_t si;
    memset(&si, 0, sizeof si);
    int w;
    do w = waitid((idtype_t)P_PIDFD, (id_t)pidfd, &si, WEXITED);
    while (w < 0 && errno == EINTR);
    /* ECHILD: reaped by the kernel (SIGCHLD ignored), after it exited. */
    int died = (w == 0 && si.si_code != CLD_EXITED) ? si.si_status : 0;
    close(pidfd);
    memcpy(out, (const void *)r, sizeof *out);
    out->died_signal = died;
    munmap((void *)r, sizeof *r);
    return 0;
}
