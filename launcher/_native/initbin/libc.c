#define _GNU_SOURCE
/* What init.c, child.c and the parts of clone.c, fds.c, spawn.c they use
 * need of a libc, for the init image (entry.c): thin system calls with
 * glibc's prototypes (its headers give the types and constants), errno as
 * one global (the image has one thread; a vfork child shares it while its
 * parent sleeps), and the string functions the compiler may call. No
 * allocation, no locale, no stdio. x86_64 only. Where glibc's structures
 * differ from the kernel's (sigaction, sigset_t's size), the kernel's are
 * used. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
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

#if !defined(__x86_64__)
#error "the init image is built for x86_64 only"
#endif

static int err_value;

int *__errno_location(void) {
    return &err_value;
}

static long raw6(long n, long a, long b, long c, long d, long e, long f) {
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}

static long ret_errno(long r) {
    if (r < 0 && r > -4096) {
        err_value = (int)-r;
        return -1;
    }
    return r;
}

#define SC(n, a, b, c, d, e, f) ret_errno(raw6((n), (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), (long)(f)))

long syscall(long n, ...) {
    va_list ap;
    va_start(ap, n);
    long a = va_arg(ap, long), b = va_arg(ap, long), c = va_arg(ap, long);
    long d = va_arg(ap, long), e = va_arg(ap, long), f = va_arg(ap, long);
    va_end(ap);
    return SC(n, a, b, c, d, e, f);
}

void _exit(int status) {
    for (;;) raw6(SYS_exit_group, status, 0, 0, 0, 0, 0);
}

int open(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    int mode = (flags & (O_CREAT | __O_TMPFILE)) ? va_arg(ap, int) : 0;
    va_end(ap);
    return (int)SC(SYS_openat, AT_FDCWD, path, flags, mode, 0, 0);
}

int openat(int dirfd, const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    int mode = (flags & (O_CREAT | __O_TMPFILE)) ? va_arg(ap, int) : 0;
    va_end(ap);
    return (int)SC(SYS_openat, dirfd, path, flags, mode, 0, 0);
}

int close(int fd) { return (int)SC(SYS_close, fd, 0, 0, 0, 0, 0); }
ssize_t read(int fd, void *buf, size_t n) { return SC(SYS_read, fd, buf, n, 0, 0, 0); }
ssize_t write(int fd, const void *buf, size_t n) { return SC(SYS_write, fd, buf, n, 0, 0, 0); }
int dup2(int old, int new_fd) { return (int)SC(SYS_dup2, old, new_fd, 0, 0, 0, 0); }
int pipe2(int fds[2], int flags) { return (int)SC(SYS_pipe2, fds, flags, 0, 0, 0, 0); }
int chdir(const char *path) { return (int)SC(SYS_chdir, path, 0, 0, 0, 0, 0); }
int kill(pid_t pid, int sig) { return (int)SC(SYS_kill, pid, sig, 0, 0, 0, 0); }
pid_t setsid(void) { return (pid_t)SC(SYS_setsid, 0, 0, 0, 0, 0, 0); }
int setpgid(pid_t pid, pid_t pgid) { return (int)SC(SYS_setpgid, pid, pgid, 0, 0, 0, 0); }
int poll(struct pollfd *fds, nfds_t n, int timeout) { return (int)SC(SYS_poll, fds, n, timeout, 0, 0, 0); }
int execve(const char *path, char *const argv[], char *const envp[]) {
    return (int)SC(SYS_execve, path, argv, envp, 0, 0, 0);
}
int mount(const char *src, const char *target, const char *type, unsigned long flags, const void *data) {
    return (int)SC(SYS_mount, src, target, type, flags, data, 0);
}
ssize_t sendmsg(int fd, const struct msghdr *m, int flags) { return SC(SYS_sendmsg, fd, m, flags, 0, 0, 0); }
pid_t waitpid(pid_t pid, int *status, int options) { return (pid_t)SC(SYS_wait4, pid, status, options, 0, 0, 0); }
int waitid(idtype_t type, id_t id, siginfo_t *info, int options) {
    return (int)SC(SYS_waitid, type, id, info, options, 0, 0);
}
int getrusage(int who, struct rusage *ru) { return (int)SC(SYS_getrusage, who, ru, 0, 0, 0, 0); }
int getrlimit(__rlimit_resource_t resource, struct rlimit *rl) { return (int)SC(SYS_prlimit64, 0, resource, 0, rl, 0, 0); }
char *getcwd(char *buf, size_t size) {
    return SC(SYS_getcwd, buf, size, 0, 0, 0, 0) < 0 ? NULL : buf;
}

int prctl(int option, ...) {
    va_list ap;
    va_start(ap, option);
    unsigned long a = va_arg(ap, unsigned long), b = va_arg(ap, unsigned long);
    unsigned long c = va_arg(ap, unsigned long), d = va_arg(ap, unsigned long);
    va_end(ap);
    return (int)SC(SYS_prctl, option, a, b, c, d, 0);
}

int fcntl(int fd, int cmd, ...) {
    va_list ap;
    va_start(ap, cmd);
    long arg = va_arg(ap, long);
    va_end(ap);
    return (int)SC(SYS_fcntl, fd, cmd, arg, 0, 0, 0);
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    long r = raw6(SYS_mmap, (long)addr, (long)len, prot, flags, fd, off);
    if (r < 0 && r > -4096) {
        err_value = (int)-r;
        return MAP_FAILED;
    }
    return (void *)r;
}
int munmap(void *addr, size_t len) { return (int)SC(SYS_munmap, addr, len, 0, 0, 0, 0); }
int mprotect(void *addr, size_t len, int prot) { return (int)SC(SYS_mprotect, addr, len, prot, 0, 0, 0); }

/* The kernel's sigset is 64 bits; glibc's sigset_t is larger, its first
 * word the same bits. */
#define KSIGSET 8

int sigemptyset(sigset_t *s) {
    memset(s, 0, sizeof *s);
    return 0;
}
int sigfillset(sigset_t *s) {
    memset(s, 0xff, sizeof *s);
    return 0;
}
int sigprocmask(int how, const sigset_t *set, sigset_t *old) {
    return (int)SC(SYS_rt_sigprocmask, how, set, old, KSIGSET, 0, 0);
}
int signalfd(int fd, const sigset_t *mask, int flags) {
    return (int)SC(SYS_signalfd4, fd, mask, KSIGSET, flags, 0, 0);
}
int __libc_current_sigrtmin(void) {
    return 34;      /* glibc keeps 32 and 33 for itself: what the supervisor's libc says too */
}

struct ksigaction {
    void *handler;
    unsigned long flags;
    void *restorer;
    uint64_t mask;
};

/* Only SIG_DFL and SIG_IGN are ever set here (child.c): no handler runs,
 * so no restorer is needed. */
int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    struct ksigaction k, ko;
    if (act) {
        k.handler = (void *)act->sa_handler;
        k.flags = (unsigned long)act->sa_flags & ~0x04000000UL;   /* SA_RESTORER: none */
        k.restorer = NULL;
        memcpy(&k.mask, &act->sa_mask, sizeof k.mask);
    }
    long r = SC(SYS_rt_sigaction, sig, act ? &k : NULL, old ? &ko : NULL, KSIGSET, 0, 0);
    if (r == 0 && old) {
        memset(old, 0, sizeof *old);
        old->sa_handler = (void (*)(int))ko.handler;
        old->sa_flags = (int)ko.flags;
        memcpy(&old->sa_mask, &ko.mask, sizeof ko.mask);
    }
    return (int)r;
}

void *memset(void *d, int c, size_t n) {
    unsigned char *p = d;
    while (n--) *p++ = (unsigned char)c;
    return d;
}
void *memcpy(void *d, const void *s, size_t n) {
    unsigned char *p = d;
    const unsigned char *q = s;
    while (n--) *p++ = *q++;
    return d;
}
void *memmove(void *d, const void *s, size_t n) {
    unsigned char *p = d;
    const unsigned char *q = s;
    if (p < q) {
        while (n--) *p++ = *q++;
    } else {
        while (n--) p[n] = q[n];
    }
    return d;
}
int memcmp(const void *a, const void *b, size_t n) {
    const unsigned char *p = a, *q = b;
    for (; n; n--, p++, q++)
        if (*p != *q) return *p - *q;
    return 0;
}
void *memchr(const void *s, int c, size_t n) {
    const unsigned char *p = s;
    for (; n; n--, p++)
        if (*p == (unsigned char)c) return (void *)p;
    return NULL;
}
size_t strlen(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}
int strncmp(const char *a, const char *b, size_t n) {
    for (; n; n--, a++, b++) {
        if (*a != *b) return (unsigned char)*a - (unsigned char)*b;
        if (!*a) return 0;
    }
    return 0;
}
char *strstr(const char *h, const char *n) {
    size_t ln = strlen(n);
    for (; *h; h++)
        if (strncmp(h, n, ln) == 0) return (char *)h;
    return ln ? NULL : (char *)h;
}
