#ifndef CT_CLONE_H
#define CT_CLONE_H
#include <stdint.h>

#include "child.h"

/* Starting a child (clone.c; not exported to Python). */
long ct_raw_clone3(uint64_t flags, int *pidfd, int cgroup_fd);
/* Start a child that runs ct_child_exec(a, rep); the calling thread sleeps
 * until it exec'd or exited (CLONE_VFORK). Returns its pid, or -1/errno. */
long ct_vfork_exec(const struct ct_spawn_args *a, struct ct_report *rep, int *pidfd, int cgroup_fd);
/* Start a child with CLONE_VM|CLONE_VFORK|CLONE_PIDFD and `flags` that runs
 * fn(arg) on a stack of its own, which must exec or _exit; the calling
 * thread sleeps until it did. Returns its pid, or -1/errno (ENOSYS: no
 * CLONE_VM start on this architecture). */
long ct_vfork_call(uint64_t flags, int *pidfd, int cgroup_fd, void (*fn)(void *), void *arg);
#endif
