#ifndef CT_JOBOBJECT_H
#define CT_JOBOBJECT_H
/* Windows Job Objects: the `job-object` container (the worker's spawn and
 * process handle are winproc.h).
 *
 * Windows only. Handles cross into Python as uintptr_t. Every function
 * returns 0 or the GetLastError() code (a positive DWORD). */
#include <stdint.h>

struct ct_job_accounting {
    uint64_t user_100ns;       /* total user time of every process ever in the job */
    uint64_t kernel_100ns;
    uint32_t active;           /* ActiveProcesses: the only authoritative emptiness */
    uint32_t total;
    uint32_t terminated;
};

/* Counters are added to, so one struct can follow a run across calls. */
struct ct_job_wait_result {
    int empty;                 /* ActiveProcesses == 0 was observed by query */
    int port_zero;             /* JOB_OBJECT_MSG_ACTIVE_PROCESS_ZERO arrived */
    uint32_t active;           /* the last ActiveProcesses read */
    uint32_t new_processes;    /* JOB_OBJECT_MSG_NEW_PROCESS */
    uint32_t exits;            /* JOB_OBJECT_MSG_EXIT_PROCESS */
    uint32_t abnormal_exits;   /* JOB_OBJECT_MSG_ABNORMAL_EXIT_PROCESS */
    uint32_t queries;          /* QueryInformationJobObject calls made */
    uint32_t memory_limit;     /* JOB_OBJECT_MSG_JOB_MEMORY_LIMIT */
    uint32_t process_limit;    /* JOB_OBJECT_MSG_ACTIVE_PROCESS_LIMIT */
};

/* The extended limits as QueryInformationJobObject reads them back. */
struct ct_job_limit_values {
    uint32_t flags;                 /* LimitFlags */
    uint32_t active_process_limit;  /* ActiveProcessLimit */
    uint64_t job_memory_limit;      /* JobMemoryLimit, bytes of commit */
    uint64_t process_memory_limit;  /* ProcessMemoryLimit */
};

/* A job that kills its tree when its last handle closes and allows no
 * breakaway, with a descriptor that grants nobody the right to change that
 * (see jobobject.c). */
int ct_job_create(uintptr_t *job);
int ct_job_create_named(uintptr_t *job, const char *name);
int ct_job_open(const char *name, uintptr_t *job);
/* Replace *job by a handle that can watch, kill and assign, but not change
 * the job's limits: call after ct_job_port_create, before the spawn. */
int ct_job_restrict(uintptr_t *job);
/* With every privilege of this process's token enabled (then put back),
 * ask DuplicateHandle for JOB_OBJECT_SET_ATTRIBUTES, WRITE_DAC and
 * WRITE_OWNER on `job`: *obtained is the mask of those granted (what any
 * process of this token could get), *enabled how many privileges were off. */
int ct_job_probe(uintptr_t job, uint32_t *obtained, uint32_t *enabled);
/* 1 if the job's owner is LocalSystem, 0 another SID, -1 none recorded. */
int ct_job_owner_is_system(uintptr_t job, int *system);
/* Whether this process runs in a job, and that job's limit flags. */
int ct_job_self(int *in_job, uint32_t *limit_flags);
int ct_job_port_create(uintptr_t job, uintptr_t *port);
int ct_job_limits(uintptr_t job, uint32_t *limit_flags);
int ct_job_accounting(uintptr_t job, struct ct_job_accounting *out);
int ct_job_pids(uintptr_t job, uint64_t *pids, uint32_t cap, uint32_t *assigned, uint32_t *listed);
int ct_job_contains(uintptr_t job, uint32_t pid, int *inside);
int ct_job_wait_empty(uintptr_t job, uintptr_t port, uint32_t timeout_ms, struct ct_job_wait_result *r);
int ct_job_terminate(uintptr_t job, uint32_t exit_code);
int ct_job_close_take(uintptr_t handle);
int ct_job_memory(uintptr_t job, uint64_t *peak_job, uint64_t *peak_process);
/* The resource limits, with the handle ct_job_create returned (before
 * ct_job_restrict): the base flags plus JOB_MEMORY (job_memory != 0) and
 * ACTIVE_PROCESS (active_processes != 0). */
int ct_job_set_limits(uintptr_t job, uint64_t job_memory, uint32_t active_processes);
int ct_job_read_limits(uintptr_t job, struct ct_job_limit_values *out);
/* JOB_OBJECT_CPU_RATE_CONTROL_ENABLE | HARD_CAP, `rate` in 1/100 % of all CPUs. */
int ct_job_set_cpu_rate(uintptr_t job, uint32_t rate);
int ct_job_read_cpu_rate(uintptr_t job, uint32_t *control_flags, uint32_t *rate);
/* GetActiveProcessorCount(ALL_PROCESSOR_GROUPS). */
int ct_job_cpu_count(uint32_t *n);
#endif
