#ifndef CT_CLONE_H
#define CT_CLONE_H
#include <stdint.h>

#include "child.h"

/* Starting a child (clone.c; not exported to Python). */
long ct_raw_clone3(uint64_t flags, int *pidfd, int cgroup_fd);
/* Start a child that runs ct_child_exec(a, rep); the calling thread sleeps
 * until it exec'd or exited (CLONE_VFORK). Returns its pid, or -1/errno. */
long ct_vfork_exec(const struct ct_spawn_args *a, struct ct_report *rep, int *pidfd, int cgroup_fd);
#endif
