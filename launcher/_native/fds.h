#ifndef CT_FDS_H
#define CT_FDS_H

/* Mark every descriptor >= 3 close-on-exec except `keep` (ascending, each
 * >= 3), which are made inheritable. `how`: 0 close_range, falling back to
 * a /proc/self/fd scan, then to a loop up to RLIMIT_NOFILE; 1 the scan;
 * 2 the loop. Async-signal-safe: for a child between clone and execve. */
int ct_fds_cloexec_except(const int *keep, int nkeep, int how);
/* The same, closing them (the init; not exported to Python). */
int ct_fds_close_except(const int *keep, int nkeep);
#endif
