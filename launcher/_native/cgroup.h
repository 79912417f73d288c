#ifndef CT_CGROUP_H
#define CT_CGROUP_H
#include <stdint.h>
int ct_cgroup_signal_members(const char *dir, const char *cg_path, int sig, int also_cont,
                             int *n_sent, int *n_failed);
int ct_inotify_open(void);
int ct_inotify_watch(int fd, const char *path, uint32_t mask);
int ct_inotify_unwatch(int fd, int wd);
#endif
