#ifndef CT_WALL_H
#define CT_WALL_H
#include "init.h"

/* The PID-namespace wall, the supervisor's side (wall.c): start the init
 * (init.c) and read its messages (struct ct_init_msg, CT_EV_*: init.h). */

struct ct_wall_result {
    int init_pid;          /* in the caller's PID namespace */
    int init_pidfd;        /* a child's pidfd: waitid works */
    int report_fd;         /* nonblocking, close-on-exec: read with ct_init_recv */
    int stage;             /* of a failure of ct_wall_spawn itself (clone, maps) */
    int child_errno;
    int go_fd;             /* with hold: write one byte to let the init go on, then close; -1 otherwise */
    long long init_start;  /* the init's start time (proc(5) field 22), -1: unread */
    unsigned long long init_ns;  /* the inode of its /proc/<pid>/ns/pid, 0: unread */
    int init_execd;        /* 1: the init was exec'd from its image (initbin/), 0: forked */
};

/* The init image (build.py generates it; length 0: none, the init is forked). */
extern const unsigned char ct_init_image[];
extern const unsigned long ct_init_image_len;

int ct_wall_spawn(const struct ct_spawn_args *a, const struct ct_wall_args *w, struct ct_wall_result *r);
/* 1: a message (and *passed_fd, or -1), 0: none now, 2: the init's end is
 * closed (a hint only: the init's pidfd says whether it exited), -errno. */
int ct_init_recv(int fd, struct ct_init_msg *m, int *passed_fd);
#endif
