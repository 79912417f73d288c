#ifndef CT_CLONE_H
#define CT_CLONE_H
#include <stdint.h>

#include "child.h"

/* 0 if this process may use clone3, else -errno of its refusal (a
 * seccomp filter's ENOSYS or EPERM, or a kernel without it). Probed anew. */
int ct_clone3_probe(void);
/* 0, or the errno clone3 was found refused with (then every clone here is
 * the legacy clone, and none can enter a cgroup at clone time). */
int ct_clone3_refused(void);
/* A fork-like clone3 (the legacy clone where clone3 is refused: then a
 * cgroup_fd >= 0 fails with ENOSYS). Returns 0 in the child. */
long ct_raw_clone3(uint64_t flags, int *pidfd, int cgroup_fd);
/* Start a child that runs ct_child_exec(a, rep); the calling thread sleeps
 * until it exec'd or exited (CLONE_VFORK). Returns its pid, or -1/errno. */
long ct_vfork_exec(const struct ct_spawn_args *a, struct ct_report *rep, int *pidfd, int cgroup_fd);
/* Start a child with CLONE_VM|CLONE_VFORK|CLONE_PIDFD and `flags` that runs
 * fn(arg) on a stack of its own, which must exec or _exit; the calling
 * thread sleeps until it did. Returns its pid, or -1/errno (ENOSYS: no
 * CLONE_VM start on this architecture, or clone3 refused and a cgroup_fd
 * given). */
long ct_vfork_call(uint64_t flags, int *pidfd, int cgroup_fd, void (*fn)(void *), void *arg);
#endif
