/* A prototype, for benchmarks/bench_wall_proto.py only: the smallest init of
 * a PID namespace that needs no libc (so no start-up: glibc's asks `cpuid`
 * dozens of times, 0.5 ms in this VM). It names itself, makes every mount
 * private and mounts a fresh /proc, says "ready" on fd 3, then reaps every
 * child until it has none and fd 4 (the supervisor's "no more workers")
 * reads EOF, and exits 0. The worker is not its child: the supervisor
 * spawns it into this namespace itself (setns), as bench_wall_proto.py
 * measures. Given a program (argv[1], its arguments after it), it starts
 * that itself instead, as today's init starts the worker (vfork and exec),
 * reaps every child until it has none, and exits 0: the exec'd init alone,
 * with the worker still its child. Not the product's init
 * (launcher/_native/init.c). */
#include <linux/mount.h>
#include <linux/prctl.h>
#include <linux/wait.h>
#include <linux/poll.h>
#include <asm/unistd.h>

#if !defined(__x86_64__)
#error "prototype: x86_64 only"
#endif

static long sc6(long n, long a, long b, long c, long d, long e, long f) {
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}
#define SC(n, a, b, c, d, e, f) sc6(__NR_##n, (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), (long)(f))

#ifndef MS_REC
#define MS_REC 16384
#endif
#ifndef MS_PRIVATE
#define MS_PRIVATE (1 << 18)
#endif
#define ECHILD 10
#define EINTR 4

/* vfork, and in the child execve then exit_group(127), in one asm block:
 * the child runs on the parent's stack and must not touch it. */
static long vfork_exec(const char *path, char **argv, char **envp) {
    long ret;
    __asm__ volatile("mov $58, %%eax\n\tsyscall\n\t"          /* vfork */
                     "test %%rax, %%rax\n\tjnz 1f\n\t"
                     "mov %1, %%rdi\n\tmov %2, %%rsi\n\tmov %3, %%rdx\n\t"
                     "mov $59, %%eax\n\tsyscall\n\t"            /* execve */
                     "mov $127, %%edi\n\tmov $231, %%eax\n\tsyscall\n"   /* exit_group */
                     "1:"
                     : "=&a"(ret) : "r"(path), "r"(argv), "r"(envp) : "rcx", "r11", "rdi", "rsi", "rdx", "memory");
    return ret;
}

void init_main(long *sp) __attribute__((noreturn, used));
void init_main(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    char **envp = argv + argc + 1;
    SC(prctl, PR_SET_NAME, "ct/init", 0, 0, 0, 0);
    if (SC(mount, 0, "/", 0, MS_REC | MS_PRIVATE, 0, 0) == 0)
        SC(mount, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, 0, 0);
    SC(write, 3, "R", 1, 0, 0, 0);
    SC(close, 3, 0, 0, 0, 0, 0);
    if (argc > 1) {
        if (vfork_exec(argv[1], argv + 1, envp) < 0) SC(exit_group, 126, 0, 0, 0, 0, 0);
        while (SC(wait4, -1, 0, __WALL, 0, 0, 0) != -ECHILD) {
        }
        SC(exit_group, 0, 0, 0, 0, 0, 0);
    }
    int open = 1;
    for (;;) {
        long r;
        do {
            r = SC(wait4, -1, 0, WNOHANG | __WALL, 0, 0, 0);
        } while (r > 0);
        if (r == -ECHILD && !open) SC(exit_group, 0, 0, 0, 0, 0, 0);
        struct pollfd p = {4, POLLIN, 0};
        if (open) {
            /* wake for the supervisor's EOF, or every 1 ms for orphans to reap
               (the product's init sleeps in signalfd for SIGCHLD instead) */
            if (SC(poll, &p, 1, 1, 0, 0, 0) > 0) {
                char b;
                if (SC(read, 4, &b, 1, 0, 0, 0) <= 0) open = 0;
            }
        } else {
            SC(poll, 0, 0, 1, 0, 0, 0);
        }
    }
}

__asm__(".text\n.globl _start\n_start:\n  xor %rbp, %rbp\n  mov %rsp, %rdi\n  and $-16, %rsp\n  call init_main\n  hlt\n");
