#ifndef CT_WINPROC_H
#define CT_WINPROC_H
/* The worker as a Windows process: spawned inside a job (jobobject.h),
 * then known by its handle.
 *
 * Windows only. Handles cross into Python as uintptr_t. Every function
 * returns 0 or the GetLastError() code (a positive DWORD). Strings are
 * UTF-8; the command line is already quoted (Python's
 * subprocess.list2cmdline, the MSVCRT rules). */
#include <stdint.h>

/* Where ct_job_spawn failed. */
enum {
    CT_JOB_STAGE_NONE = 0,
    CT_JOB_STAGE_ARGS = 1,     /* UTF-8 conversion, allocation */
    CT_JOB_STAGE_ATTRS = 2,    /* the STARTUPINFOEX attribute list */
    CT_JOB_STAGE_CREATE = 3,   /* CreateProcessW */
    CT_JOB_STAGE_ASSIGN = 4,   /* AssignProcessToJobObject (fallback path) */
    CT_JOB_STAGE_VERIFY = 5,   /* IsProcessInJob said no, or could not say */
    CT_JOB_STAGE_RESUME = 6,   /* ResumeThread */
};

/* How the worker entered the job. */
enum {
    CT_JOB_VIA_NONE = 0,
    CT_JOB_VIA_JOB_LIST = 1,   /* PROC_THREAD_ATTRIBUTE_JOB_LIST: atomic, Windows 10+ */
    CT_JOB_VIA_SUSPENDED = 2,  /* CREATE_SUSPENDED + AssignProcessToJobObject + ResumeThread */
};

struct ct_job_spawn_args {
    uintptr_t job;             /* borrowed */
    const char *application;   /* NULL: the first token of command_line */
    const char *command_line;  /* quoted (list2cmdline) */
    const char *environment;   /* "K=V\0K=V\0\0", env_len bytes; NULL: inherit */
    uint32_t env_len;
    const char *cwd;           /* NULL: inherit */
    uintptr_t stdio[3];        /* borrowed; 0: the caller's own std handle */
    int new_process_group;     /* CREATE_NEW_PROCESS_GROUP (for CTRL_BREAK) */
    int try_job_list;          /* 1: PROC_THREAD_ATTRIBUTE_JOB_LIST first */
};

struct ct_job_spawn_result {
    uintptr_t process;         /* owned by the caller: ct_job_close_take */
    uint32_t pid;              /* also set on failure once a child existed */
    int via;                   /* CT_JOB_VIA_* */
    int stage;                 /* CT_JOB_STAGE_* of a failure */
    int job_list_error;        /* why the job-list path was not used; 0: it was, -1: not tried */
};

/* 100 ns units; creation and exit are FILETIMEs (since 1601, UTC). */
struct ct_job_times {
    uint64_t creation_100ns;
    uint64_t exit_100ns;       /* 0 while running */
    uint64_t kernel_100ns;
    uint64_t user_100ns;
};

int ct_job_spawn(const struct ct_job_spawn_args *a, struct ct_job_spawn_result *r);
int ct_job_ctrl_break(uint32_t process_group);
int ct_job_process_wait(uintptr_t process, uint32_t timeout_ms, int *exited);
int ct_job_process_status(uintptr_t process, int *running, uint32_t *exit_code);
int ct_job_process_open(uint32_t pid, uintptr_t *process);
int ct_job_process_times(uintptr_t process, struct ct_job_times *t);
int ct_job_console_pids(uint32_t *pids, uint32_t cap, uint32_t *count);

/* One process of a Toolhelp snapshot (ct_proc_snapshot). */
#define CT_WINPROC_NAME_MAX 780    /* MAX_PATH UTF-16 units as UTF-8, at most 3 bytes each */
struct ct_winproc {
    uint32_t pid;
    uint32_t ppid;             /* as the snapshot says: may name an exited parent whose pid was reused */
    uint32_t threads;          /* 0: exited, its object kept by an open handle */
    int times_error;           /* 0, or why creation_100ns could not be read (GetLastError) */
    uint64_t creation_100ns;   /* FILETIME; with pid, the process's identity */
    char name[CT_WINPROC_NAME_MAX + 1];   /* the image's file name, UTF-8 */
};
int ct_proc_snapshot(struct ct_winproc *out, uint32_t cap, uint32_t *count);
#endif
