#ifndef CT_CHILD_H
#define CT_CHILD_H
#include <stddef.h>
#include <stdint.h>

#include "spawn.h"

/* The child's set-up between clone and execve (child.c), shared by spawn.c
 * and init.c (not exported to Python). The child reports each stage it
 * enters, and a failure, as fixed-size messages on a pipe; the parent
 * reads them without blocking once the vfork release says the child has
 * exec'd or exited (EOF is only a wake-up, never the verdict). */
struct ct_msg {
    int32_t stage;      /* the stage entered (or failed) */
    int32_t err;        /* errno of a failure */
    int32_t candidate;
    int32_t failed;     /* 1: the child reported a failure and called _exit */
};
struct ct_report {
    int fd;             /* the pipe's write end, in the child */
};
__attribute__((noreturn)) void ct_child_exec(const struct ct_spawn_args *a, struct ct_report *rep);
int ct_child_join(const struct ct_spawn_args *a);
int ct_write_all(int fd, const char *s, size_t n);
#endif
