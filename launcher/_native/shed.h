#ifndef CT_SHED_H
#define CT_SHED_H
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#include "init.h"
#include "spawn.h"

/* Used by the wall's init only (not exported to Python): copy *a and *w,
 * with everything they point to, into a fresh mapping and point them at
 * the copy, then unmap the large private anonymous mappings inherited from
 * the supervisor (shed.c says which and why). Returns 0, or -errno: then
 * nothing was unmapped, and *a, *w are unchanged or point at a complete
 * copy. *n_unmapped: how many mappings went. */
int ct_shed(const struct ct_spawn_args **a, const struct ct_wall_args **w, int *n_unmapped);

/* The same copy for an init that is exec'd: written into a new memfd
 * (close-on-exec, *len bytes, *st its identity) with every pointer an
 * offset from its start;
 * and the copy at `at` with its pointers made offsets from `at`
 * (`to_offsets`), or made addresses again from offsets (the init's side).
 * 0, or -errno. */
int ct_args_image(const struct ct_spawn_args *a, const struct ct_wall_args *w, int *memfd, size_t *len,
                  struct stat *st);
int ct_args_relocate(char *at, size_t len, int to_offsets, struct ct_spawn_args **a, struct ct_wall_args **w);
#endif
