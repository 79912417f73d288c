#ifndef CT_REFUSALS_H
#define CT_REFUSALS_H

/* What a process here may do that a container's seccomp profile commonly
 * refuses, asked in a throwaway child (refusals.c says how each is asked).
 * Each field: 1 no answer (the child died first), else the call's 0 or
 * -errno, as the call answered it. */
struct ct_refusals {
    int clone_ns;     /* clone(CLONE_NEWPID|CLONE_NEWUSER|CLONE_NEWNS|CLONE_SIGHAND): -EINVAL is the kernel's */
    int unshare_ns;   /* unshare(CLONE_NEWPID|CLONE_NEWUSER|CLONE_NEWNS|1): -EINVAL is the kernel's */
    int mount;        /* mount(NULL, NULL, NULL, 0, NULL): -EFAULT is the kernel's */
    int subreaper;    /* prctl(PR_SET_CHILD_SUBREAPER, 1), then PR_GET says 1: 0 */
    int died_signal;  /* the child was killed by this signal (a filter that kills), else 0 */
};

/* Fill `r` from a child of our own (made with ct_raw_clone3, reaped here).
 * 0, or -errno when no child could be made. */
int ct_refusals_probe(struct ct_refusals *r);
#endif
