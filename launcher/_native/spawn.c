#define _GNU_SOURCE
/* Spawning a worker straight into its cgroup.
 *
 * clone3(CLONE_INTO_CGROUP | CLONE_PIDFD) places the child in the leaf as
 * part of the fork, so the worker never runs an instruction elsewhere
 * (clone(2), "CLONE_INTO_CGROUP"). Between clone and execve the child only
 * makes async-signal-safe system calls: no malloc, no stdio, no locks.
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
 *   trampoline exists (x86_64, aarch64: ct_vfork_exec), else with fork's
 *   copy-on-write memory.
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
#include "seal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <linux/capability.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif
#ifndef P_PIDFD
#define P_PIDFD 3
#endif

struct ct_clone_args {  /* struct clone_args, version 2 (88 bytes) */
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size,
        tls, set_tid, set_tid_size, cgroup;
};

long ct_raw_clone3(uint64_t flags, int *pidfd, int cgroup_fd) {
    struct ct_clone_args ca;
    memset(&ca, 0, sizeof ca);
    ca.flags = flags;
    if (pidfd) {
        ca.flags |= CLONE_PIDFD;
        ca.pidfd = (uint64_t)(uintptr_t)pidfd;
    }
    ca.exit_signal = SIGCHLD;
    if (cgroup_fd >= 0) {
        ca.flags |= CLONE_INTO_CGROUP;
        ca.cgroup = (uint64_t)cgroup_fd;
    }
    return syscall(SYS_clone3, &ca, sizeof ca);
}

/* clone3 with CLONE_VM|CLONE_VFORK, the child running fn(arg) on a stack
 * of its own: the way glibc's posix_spawn and CPython's _posixsubprocess
 * (vfork) start a program. Without CLONE_VM, clone copies the page tables
 * of the whole caller (a Python process: 15 to 30 MB of mappings) and the
 * child's exec then tears that copy down again; measured here, a 25 MB
 * caller's /bin/true went from 216 to 42 us until the exec's EOF. The
 * child shares our memory until it execs or exits, while only the calling
 * thread sleeps: it writes nothing of ours but its own stack, the calling
 * thread's errno (that thread is asleep) and, on a first call through the
 * PLT, the GOT entry the dynamic linker resolves (the same value any thread
 * would write). Signal dispositions stay its own (no CLONE_SIGHAND), and
 * every signal is blocked until just before execve. The trampoline is
 * needed because the child returns from the system call on the new stack,
 * where no C caller's frame exists. */
#if defined(__x86_64__) || defined(__aarch64__)
#define CT_HAVE_CLONE_VM 1
long ct_clone3_vm_asm(struct ct_clone_args *ca, size_t size, void (*fn)(void *), void *arg)
    __attribute__((visibility("hidden")));
#if defined(__x86_64__)
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".type ct_clone3_vm_asm,@function\n"
    "ct_clone3_vm_asm:\n"
    "    mov %rdx, %r8\n"          /* fn: r8 and r9 survive syscall */
    "    mov %rcx, %r9\n"          /* arg */
    "    mov $435, %eax\n"         /* SYS_clone3 */
    "    syscall\n"
    "    test %rax, %rax\n"
    "    jnz 1f\n"
    "    xor %ebp, %ebp\n"         /* the child: rsp is the top of its stack */
    "    mov %r9, %rdi\n"
    "    call *%r8\n"
    "    mov $127, %edi\n"         /* fn never returns; if it did */
    "    mov $60, %eax\n"          /* SYS_exit */
    "    syscall\n"
    "    hlt\n"
    "1:  ret\n"
    ".size ct_clone3_vm_asm, .-ct_clone3_vm_asm\n");
#else
__asm__(
    ".text\n"
    ".p2align 2\n"
    ".type ct_clone3_vm_asm,%function\n"
    "ct_clone3_vm_asm:\n"
    "    mov x9, x2\n"             /* fn: svc preserves everything but x0 */
    "    mov x10, x3\n"            /* arg */
    "    mov x8, #435\n"           /* SYS_clone3 */
    "    svc #0\n"
    "    cbnz x0, 1f\n"
    "    mov x29, xzr\n"
    "    mov x30, xzr\n"
    "    mov x0, x10\n"
    "    blr x9\n"
    "    mov x0, #127\n"
    "    mov x8, #93\n"            /* SYS_exit */
    "    svc #0\n"
    "1:  ret\n"
    ".size ct_clone3_vm_asm, .-ct_clone3_vm_asm\n");
#endif
#endif

#define CT_CHILD_STACK (256 * 1024)

struct vfork_ctx {
    const struct ct_spawn_args *a;
    struct ct_report *rep;
};

static void vfork_child(void *p) {
    struct vfork_ctx *c = p;
    ct_child_exec(c->a, c->rep);
}

long ct_vfork_exec(const struct ct_spawn_args *a, struct ct_report *rep, int *pidfd, int cgroup_fd) {
#ifdef CT_HAVE_CLONE_VM
    void *stack = mmap(NULL, CT_CHILD_STACK, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK | MAP_NORESERVE, -1, 0);
    if (stack != MAP_FAILED) {
        struct ct_clone_args ca;
        struct vfork_ctx ctx = {a, rep};
        mprotect(stack, 4096, PROT_NONE);   /* a guard page below the stack */
        memset(&ca, 0, sizeof ca);
        ca.flags = CLONE_VM | CLONE_VFORK | CLONE_PIDFD;
        ca.pidfd = (uint64_t)(uintptr_t)pidfd;
        ca.exit_signal = SIGCHLD;
        ca.stack = (uint64_t)(uintptr_t)stack;
        ca.stack_size = CT_CHILD_STACK;
        if (cgroup_fd >= 0) {
            ca.flags |= CLONE_INTO_CGROUP;
            ca.cgroup = (uint64_t)cgroup_fd;
        }
        long ret = ct_clone3_vm_asm(&ca, sizeof ca, vfork_child, &ctx);
        /* Released: the child exec'd (its mm is another) or exited. */
        munmap(stack, CT_CHILD_STACK);
        if (ret < 0 && ret > -4096) {
            errno = (int)-ret;
            return -1;
        }
        return ret;
    }
#endif
    long pid = ct_raw_clone3(CLONE_VFORK, pidfd, cgroup_fd);
    if (pid == 0) ct_child_exec(a, rep);
    return pid;
}

/* -- the child ------------------------------------------------------------ */

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
 * writer (cgroup_procs_write_start: pid 0 is current), with the permission
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

static int is_kept(const int *keep, int nkeep, int fd) {
    for (int i = 0; i < nkeep; i++) {
        if (keep[i] == fd) return 1;
        if (keep[i] > fd) return 0;
    }
    return 0;
}

static int set_cloexec(int fd, int on) {
    int fl = fcntl(fd, F_GETFD);
    if (fl < 0) return -errno;
    int want = on ? (fl | FD_CLOEXEC) : (fl & ~FD_CLOEXEC);
    if (want != fl && fcntl(fd, F_SETFD, want) < 0) return -errno;
    return 0;
}

struct ct_dirent64 {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

/* Mark close-on-exec, or close. */
static int drop_fd(int fd, int closing) {
    if (!closing) return set_cloexec(fd, 1);
    return close(fd) < 0 && errno != EINTR ? -errno : 0;
}

/* The fallback of _posixsubprocess (_close_open_fds_safe): list this
 * process's own table. The directory is opened here, in the child: one
 * opened before the clone would list the parent's table ("self" is
 * resolved at open time), which other threads keep changing. Returns how
 * many descriptors it dropped. */
static int drop_by_scan(const int *keep, int nkeep, int closing) {
    char buf[4096];
    int dropped = 0;
    int dfd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return -errno;
    for (;;) {
        long n = syscall(SYS_getdents64, dfd, buf, sizeof buf);
        if (n < 0) {
            int e = errno;
            close(dfd);
            return -e;
        }
        if (n == 0) break;
        for (long off = 0; off < n;) {
            struct ct_dirent64 *d = (struct ct_dirent64 *)(buf + off);
            off += d->d_reclen;
            int fd = 0, digits = 0;
            for (const char *p = d->d_name; *p; p++) {
                if (*p < '0' || *p > '9') {
                    digits = 0;
                    break;
                }
                fd = fd * 10 + (*p - '0');
                digits++;
            }
            if (!digits || fd < 3 || fd == dfd || is_kept(keep, nkeep, fd)) continue;
            int rc = drop_fd(fd, closing);
            if (rc < 0 && rc != -EBADF) {
                close(dfd);
                return rc;
            }
            dropped++;
        }
    }
    close(dfd);
    return dropped;
}

static int drop_by_loop(const int *keep, int nkeep, int closing) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0) return -errno;
    long max = rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (1L << 30) ? (1L << 20) : (long)rl.rlim_cur;
    for (long fd = 3; fd < max; fd++) {
        if (is_kept(keep, nkeep, (int)fd)) continue;
        int rc = drop_fd((int)fd, closing);
        if (rc < 0 && rc != -EBADF) return rc;
    }
    return 0;
}

static int fds_except(const int *keep, int nkeep, int how, int closing) {
    int rc;
    for (int i = 0; i < nkeep; i++) {
        if (keep[i] < 3 || (i && keep[i] <= keep[i - 1])) return -EINVAL;
        if (!closing && (rc = set_cloexec(keep[i], 0)) < 0) return rc;
    }
    if (how == 0) {
        unsigned int lo = 3;
        int fallback = 0;
        for (int i = 0; i <= nkeep && !fallback; i++) {
            unsigned int hi = i < nkeep ? (unsigned int)keep[i] - 1 : ~0U;
            if (hi >= lo && syscall(SYS_close_range, lo, hi, closing ? 0U : CLOSE_RANGE_CLOEXEC) < 0) {
                /* ENOSYS before 5.9, EINVAL for the flag before 5.11 */
                if (errno != ENOSYS && errno != EINVAL) return -errno;
                fallback = 1;
            }
            if (i < nkeep) lo = (unsigned int)keep[i] + 1;
        }
        if (!fallback) return 0;
        how = 1;
    }
    if (how == 1) {
        /* Closing while listing can make getdents skip entries: list
         * again until a pass finds nothing left to close. */
        for (int pass = 0; pass < 8; pass++) {
            rc = drop_by_scan(keep, nkeep, closing);
            if (rc == 0 || (rc > 0 && !closing)) return 0;
            if (rc < 0) break;
        }
        if (rc >= 0) return 0;
        if (rc != -ENOENT && rc != -EACCES && rc != -ENOTDIR) return rc;
    }
    return drop_by_loop(keep, nkeep, closing);
}

int ct_fds_cloexec_except(const int *keep, int nkeep, int how) {
    return fds_except(keep, nkeep, how, 0);
}

int ct_fds_close_except(const int *keep, int nkeep) {
    return fds_except(keep, nkeep, 0, 1);
}

static int exists(const char *path) {
    return syscall(SYS_faccessat, AT_FDCWD, path, F_OK) == 0;
}

/* Like execvp: ENOENT and ENOTDIR move on to the next candidate, and so do
 * EACCES and an ENOENT from a file that exists (its #! interpreter or ELF
 * loader is missing), remembered to be reported if nothing runs; any
 * other error ends the search (glibc's __execvpe does the same). ENOEXEC
 * runs the candidate with the shell, as execvp does. */
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
    if (a->seal) {
        rep_stage(rep, CT_STAGE_SEAL);
        if ((rc = child_seal(a)) < 0) child_fail(rep, CT_STAGE_SEAL, -rc, -1);
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

/* -- the parent ----------------------------------------------------------- */

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
