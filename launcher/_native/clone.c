#define _GNU_SOURCE
/* Starting a child: clone3, and the CLONE_VM|CLONE_VFORK start of the
 * spawn child (ct_vfork_exec), which then runs the set-up of child.c.
 * Why the calling thread sleeps until the child has exec'd or exited, and
 * how the parent then tells which: spawn.c. Returns a pid, or -1/errno. */
#include "clone.h"

#include <errno.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif

struct ct_clone_args {  /* struct clone_args, version 2 (88 bytes) */
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size,
        tls, set_tid, set_tid_size, cgroup;
};

static long raw_clone3(uint64_t flags, int *pidfd, int cgroup_fd);

/* -- clone3, or the legacy clone where clone3 is refused ----------------
 *
 * Docker's default seccomp profile answers clone3 with ENOSYS (unless the
 * container has CAP_SYS_ADMIN) "so that libc falls back to clone"; other
 * profiles answered EPERM; kernels before 5.3 have no clone3. glibc's
 * posix_spawn and fork fall back to clone on ENOSYS (__clone_internal);
 * so does this file. What the legacy clone cannot do is CLONE_INTO_CGROUP
 * (its flags are 32 bits, kernel/fork.c): a spawn into a cgroup then
 * fails with ENOSYS, and Python places the child by the join before exec
 * instead (linux.py, _spawn). The legacy clone's namespace flags meet the
 * filter on their own (Docker refuses them: EPERM).
 *
 * Whether clone3 is refused is probed by calling it with no arguments: the
 * kernel answers EINVAL (a size below CLONE_ARGS_SIZE_VER0, before any
 * permission check: copy_clone_args_from_user), a filter answers first
 * with its own errno. The probe runs once per process, when a real clone3
 * first fails with ENOSYS or EPERM: so an EPERM the kernel meant (a
 * namespace this caller may not make) is returned as it is, and a filter
 * installed after an earlier success is still found. A refusal is kept for
 * good (a seccomp filter can never be removed). */
static int clone3_refused;     /* 0, or the errno clone3 is refused with */

int ct_clone3_probe(void) {
    int saved = errno;
    long r = syscall(SYS_clone3, NULL, (size_t)0);
    int e = r < 0 ? errno : 0;
    errno = saved;
    return e == EINVAL ? 0 : -(e ? e : EIO);
}

int ct_clone3_refused(void) {
    return clone3_refused;
}

/* Whether a clone3 that failed with `e` was refused as such (then the
 * legacy clone is tried): only ENOSYS and EPERM, and only when the probe
 * agrees. errno is kept. */
static int refused_now(int e) {
    if (clone3_refused) return 1;
    if (e != ENOSYS && e != EPERM) return 0;
    int p = ct_clone3_probe();
    if (p < 0) clone3_refused = -p;
    return clone3_refused != 0;
}

#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif

/* The legacy clone, fork-like (no new stack: the child returns here on a
 * copy of ours). The pidfd comes back through parent_tid, the third
 * argument on x86_64 and on CLONE_BACKWARDS architectures alike. */
static long legacy_clone(uint64_t flags, int *pidfd) {
    unsigned long f = (unsigned long)(flags & 0xffffffffULL) | SIGCHLD | (pidfd ? CLONE_PIDFD : 0);
    return syscall(SYS_clone, f, NULL, pidfd, NULL, NULL);
}

long ct_raw_clone3(uint64_t flags, int *pidfd, int cgroup_fd) {
    if (clone3_refused) {
        if (cgroup_fd >= 0) {
            errno = ENOSYS;      /* CLONE_INTO_CGROUP needs clone3: the caller joins instead */
            return -1;
        }
        return legacy_clone(flags, pidfd);
    }
    long r = raw_clone3(flags, pidfd, cgroup_fd);
    if (r >= 0 || !refused_now(errno)) return r;
    if (cgroup_fd >= 0) {
        errno = ENOSYS;
        return -1;
    }
    return legacy_clone(flags, pidfd);
}

static long raw_clone3(uint64_t flags, int *pidfd, int cgroup_fd) {
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
long ct_clone_vm_asm(unsigned long flags, void *stack_top, int *parent_tid, void (*fn)(void *), void *arg)
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
/* The legacy clone(flags, stack_top, parent_tid, 0, 0) the same way, where
 * clone3 is refused; the child gets every register but rcx and r11, and
 * rsp = stack_top. arg rides in r8, the tls argument, which the kernel
 * reads only with CLONE_SETTLS. */
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".type ct_clone_vm_asm,@function\n"
    "ct_clone_vm_asm:\n"
    "    mov %rcx, %r9\n"          /* fn */
    "    xor %r10d, %r10d\n"       /* child_tid: none */
    "    mov $56, %eax\n"          /* SYS_clone */
    "    syscall\n"
    "    test %rax, %rax\n"
    "    jnz 1f\n"
    "    xor %ebp, %ebp\n"
    "    mov %r8, %rdi\n"
    "    call *%r9\n"
    "    mov $127, %edi\n"
    "    mov $60, %eax\n"
    "    syscall\n"
    "    hlt\n"
    "1:  ret\n"
    ".size ct_clone_vm_asm, .-ct_clone_vm_asm\n");
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
__asm__(
    ".text\n"
    ".p2align 2\n"
    ".type ct_clone_vm_asm,%function\n"
    "ct_clone_vm_asm:\n"
    "    mov x9, x3\n"             /* fn */
    "    mov x10, x4\n"            /* arg */
    "    mov x3, xzr\n"            /* tls */
    "    mov x4, xzr\n"            /* child_tid */
    "    mov x8, #220\n"           /* SYS_clone */
    "    svc #0\n"
    "    cbnz x0, 1f\n"
    "    mov x29, xzr\n"
    "    mov x30, xzr\n"
    "    mov x0, x10\n"
    "    blr x9\n"
    "    mov x0, #127\n"
    "    mov x8, #93\n"
    "    svc #0\n"
    "1:  ret\n"
    ".size ct_clone_vm_asm, .-ct_clone_vm_asm\n");
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

long ct_vfork_call(uint64_t flags, int *pidfd, int cgroup_fd, void (*fn)(void *), void *arg) {
#ifdef CT_HAVE_CLONE_VM
    if (clone3_refused && cgroup_fd >= 0) {
        errno = ENOSYS;          /* CLONE_INTO_CGROUP needs clone3: the caller joins instead */
        return -1;
    }
    void *stack = mmap(NULL, CT_CHILD_STACK, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK | MAP_NORESERVE, -1, 0);
    if (stack == MAP_FAILED) return -1;
    struct ct_clone_args ca;
    mprotect(stack, 4096, PROT_NONE);   /* a guard page below the stack */
    memset(&ca, 0, sizeof ca);
    ca.flags = CLONE_VM | CLONE_VFORK | CLONE_PIDFD | flags;
    ca.pidfd = (uint64_t)(uintptr_t)pidfd;
    ca.exit_signal = SIGCHLD;
    ca.stack = (uint64_t)(uintptr_t)stack;
    ca.stack_size = CT_CHILD_STACK;
    if (cgroup_fd >= 0) {
        ca.flags |= CLONE_INTO_CGROUP;
        ca.cgroup = (uint64_t)cgroup_fd;
    }
    long ret = clone3_refused ? -ENOSYS : ct_clone3_vm_asm(&ca, sizeof ca, fn, arg);
    if (ret < 0 && ret > -4096 && refused_now((int)-ret)) {
        if (cgroup_fd >= 0)
            ret = -ENOSYS;
        else if (flags >> 32)
            ret = -EINVAL;       /* no such flag for the legacy clone */
        else
            ret = ct_clone_vm_asm((unsigned long)(CLONE_VM | CLONE_VFORK | CLONE_PIDFD | flags) | SIGCHLD,
                                  (char *)stack + CT_CHILD_STACK, pidfd, fn, arg);
    }
    /* Released: the child exec'd (its mm is another) or exited. */
    munmap(stack, CT_CHILD_STACK);
    if (ret < 0 && ret > -4096) {
        errno = (int)-ret;
        return -1;
    }
    return ret;
#else
    errno = ENOSYS;
    return -1;
#endif
}

long ct_vfork_exec(const struct ct_spawn_args *a, struct ct_report *rep, int *pidfd, int cgroup_fd) {
#ifdef CT_HAVE_CLONE_VM
    struct vfork_ctx ctx = {a, rep};
    long ret = ct_vfork_call(0, pidfd, cgroup_fd, vfork_child, &ctx);
    if (ret >= 0 || errno != ENOMEM) return ret;
    /* no stack could be mapped: the copying vfork below */
#endif
    long pid = ct_raw_clone3(CLONE_VFORK, pidfd, cgroup_fd);
    if (pid == 0) ct_child_exec(a, rep);
    return pid;
}
