#define _GNU_SOURCE
/* The wall's init as a program of its own, built without libc.
 *
 * Why: an init that is a fork of the supervisor (wall.c's other path)
 * costs the clone a copy of a Python process's page tables (0.25-0.44 ms
 * here) and taxes the supervisor with a write fault on every private page
 * it writes afterwards (770-840 per walled run of /bin/true). A program
 * exec'd from a CLONE_VM|CLONE_VFORK child, as posix_spawn starts one,
 * shares nothing with the supervisor. It is built without libc because
 * glibc's start-up asks `cpuid` dozens of times and this VM traps each
 * (0.53 ms for a static glibc program that only exits, 0.06 ms without
 * libc: docs/performance.md).
 *
 * It is the same init (init.c, and child.c for the worker it forks), with
 * the few system-call wrappers those use (libc.c), and this entry: argv is
 * {"ct/init", sock, sync_rd, args_fd, len}, all set by wall.c,
 * whose descriptors it inherits across the exec. Linux x86_64 only (build.py
 * builds no image elsewhere, and wall.c then forks the init as before). */
#include <stddef.h>
#include <stdint.h>

#include "../init.h"

static long num(const char *s) {
    long v = 0;
    if (!*s) return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return -1;
        v = v * 10 + (*s - '0');
    }
    return v;
}

void ct_image_main(long *sp) __attribute__((noreturn, used));
void ct_image_main(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    if (argc != 5) {
        __asm__ volatile("syscall" : : "a"(231), "D"(125) : "rcx", "r11", "memory");   /* exit_group */
        __builtin_unreachable();
    }
    long sock = num(argv[1]), sync_rd = argv[2][0] == '-' ? -1 : num(argv[2]);
    long args_fd = num(argv[3]), len = num(argv[4]);
    ct_init_from_image((int)sock, (int)sync_rd, (int)args_fd, (size_t)len);
}

__asm__(".text\n.globl _start\n.type _start,@function\n_start:\n"
        "  xor %rbp, %rbp\n  mov %rsp, %rdi\n  and $-16, %rsp\n  call ct_image_main\n  hlt\n");
