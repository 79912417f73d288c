#ifndef CT_SEAL_H
#define CT_SEAL_H

/* Child-side steps of the seal (called between clone and execve, so only
 * async-signal-safe system calls), and a probe for `contain doctor`.
 * Each returns 0 or -errno. */

/* New mount and cgroup namespaces, every mount private; each path in
 * `cg2` (a cgroup2 mount) is detached and replaced by a fresh cgroup2 mount
 * of the new cgroup namespace (rooted at the caller's own cgroup), read-only;
 * each path in `ro` is bind-remounted read-only. */
int ct_seal_child_mounts(const char *const *cg2, int ncg2, const char *const *ro, int nro);

/* Enter a new user namespace whose uid and gid maps are the identity over
 * the full range, written by a short-lived helper that stays in the parent
 * namespace (only a writer holding CAP_SETUID there may map more than its
 * own id: user_namespaces(7), "Defining user and group ID mappings"). */
int ct_seal_child_userns(void);

/* Probe: fork a throwaway child that tries the namespace steps above
 * (CT_PROBE_* bits). 0 when every requested step worked, else -errno. */
#define CT_PROBE_MOUNTNS 1
#define CT_PROBE_USERNS 2
int ct_seal_probe(int what);
#endif
