/* The `job-object` container: a Windows Job Object that holds the worker
 * from before its first instruction (the spawn itself is winproc.c).
 *
 * The job never allows breakaway: with JOB_OBJECT_LIMIT_BREAKAWAY_OK or
 * _SILENT_BREAKAWAY_OK a descendant leaves the job by asking (or silently),
 * which is how libuv's children escape (libuv#3179). KILL_ON_JOB_CLOSE makes
 * the supervisor's death (its last handle closing) kill the tree.
 *
 * Completion-port messages are "not guaranteed" (Microsoft's page on
 * JOBOBJECT_ASSOCIATE_COMPLETION_PORT): they only wake us. Emptiness is
 * decided by QueryInformationJobObject(JobObjectBasicAccountingInformation)
 * .ActiveProcesses == 0, read again after every wake-up.
 *
 * Windows only (build.py compiles it for win32): the Win32 API throughout.
 */
#include "jobobject.h"

#ifndef _WIN32
#error "jobobject.c is Windows code: build.py lists it for win32 only"
#endif
#ifndef _WIN32_WINNT
#define _WIN32_WINNT 0x0A00
#endif
#include <windows.h>
#include <aclapi.h>
#include <sddl.h>
#include <stdio.h>
#include <string.h>
#include <wchar.h>

/* What the handle the owner keeps may do (ct_job_restrict): watch, list,
 * kill, assign (the spawn), read the descriptor. Never SET_ATTRIBUTES. */
#define CT_JOB_KEPT_ACCESS \
    (JOB_OBJECT_QUERY | JOB_OBJECT_TERMINATE | JOB_OBJECT_ASSIGN_PROCESS | SYNCHRONIZE | READ_CONTROL)

/* The limit flags every job of ours carries (ct_job_create); writing the
 * resource limits (ct_job_set_limits) keeps them. */
#define CT_JOB_BASE_LIMITS (JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE | JOB_OBJECT_LIMIT_DIE_ON_UNHANDLED_EXCEPTION)

/* Re-query ActiveProcesses at least this often even if no message comes. */
#define CT_JOB_REQUERY_MS 100

static int last_error(void) {
    DWORD e = GetLastError();
    return e ? (int)e : (int)ERROR_GEN_FAILURE;
}

/* The job's security descriptor. A process that takes a handle to the job
 * (it duplicates one out of the supervisor, as the harness's `steal` role
 * does, or opens a named job by its name) must not be able to allow
 * breakaway: the handle the owner keeps has CT_JOB_KEPT_ACCESS only
 * (ct_job_restrict), and asking DuplicateHandle or OpenJobObjectW for more
 * is an access check against this descriptor (ObDuplicateObject), which
 * grants no right that changes the job. The owner of an object may always
 * change its DACL, so the owner is SYSTEM where this token may say so (an
 * administrator's), and OWNER RIGHTS (S-1-3-4, Windows Vista+) keeps a user
 * owner to reading it. Whether that holds for this token is observed, not
 * assumed (ct_job_probe).
 *
 * A named job (ct_job_create_named) also grants this token's user
 * CT_JOB_OPEN_ACCESS, so that an adopter (the same user, after the owner
 * died) can open it by name, terminate it and observe it empty. A process
 * of the tree can open it too: with no more than it could already take out
 * of the supervisor (PROCESS_DUP_HANDLE, same user), and never a right
 * that allows breakaway. */
static const wchar_t *const job_sddl[2] = {L"O:SYD:P(A;;RC;;;OW)", L"D:P(A;;RC;;;OW)"};

/* What an opener of a named job gets: watch, list and kill it. */
#define CT_JOB_OPEN_ACCESS (JOB_OBJECT_QUERY | JOB_OBJECT_TERMINATE | SYNCHRONIZE | READ_CONTROL)

/* "S-1-5-..." of this process's token user, LocalFree'd by the caller. */
static int token_user_sid(wchar_t **out) {
    HANDLE token = NULL;
    DWORD n = 0;
    TOKEN_USER *tu = NULL;
    int rc = 0;
    *out = NULL;
    if (!OpenProcessToken(GetCurrentProcess(), TOKEN_QUERY, &token)) return last_error();
    GetTokenInformation(token, TokenUser, NULL, 0, &n);
    tu = n ? (TOKEN_USER *)HeapAlloc(GetProcessHeap(), 0, n) : NULL;
    if (tu == NULL) rc = n ? ERROR_NOT_ENOUGH_MEMORY : last_error();
    else if (!GetTokenInformation(token, TokenUser, tu, n, &n)) rc = last_error();
    else if (!ConvertSidToStringSidW(tu->User.Sid, out)) rc = last_error();
    if (tu) HeapFree(GetProcessHeap(), 0, tu);
    CloseHandle(token);
    return rc;
}

/* UTF-8 to a heap UTF-16 copy (NUL-terminated input). */
static int widen_name(const char *s, wchar_t **out) {
    int n;
    *out = NULL;
    n = MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, s, -1, NULL, 0);
    if (n <= 0) return last_error();
    *out = (wchar_t *)HeapAlloc(GetProcessHeap(), 0, (SIZE_T)n * sizeof(wchar_t));
    if (*out == NULL) return ERROR_NOT_ENOUGH_MEMORY;
    if (MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, s, -1, *out, n) <= 0) {
        int e = last_error();
        HeapFree(GetProcessHeap(), 0, *out);
        *out = NULL;
        return e;
    }
    return 0;
}

/* `name` NULL: an anonymous job. Otherwise a job of that name, which must
 * not exist yet: ERROR_ALREADY_EXISTS if it does (someone squats the name;
 * CreateJobObjectW would hand us their job). */
int ct_job_create_named(uintptr_t *job, const char *name) {
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION li;
    SECURITY_ATTRIBUTES sa;
    PSECURITY_DESCRIPTOR sd = NULL;
    HANDLE j = NULL;
    wchar_t *wname = NULL, *user = NULL, sddl[512];
    int i, e = 0;
    *job = 0;
    if (name != NULL) {
        if ((e = widen_name(name, &wname))) return e;
        if ((e = token_user_sid(&user))) {
            HeapFree(GetProcessHeap(), 0, wname);
            return e;
        }
    }
    /* No inheritable handle: the tree cannot inherit it. */
    for (i = 0; i < 2 && j == NULL; i++) {
        if (user != NULL)
            _snwprintf(sddl, 511, L"%ls(A;;0x%lx;;;%ls)", job_sddl[i], (unsigned long)CT_JOB_OPEN_ACCESS, user);
        else
            _snwprintf(sddl, 511, L"%ls", job_sddl[i]);
        sddl[511] = 0;
        if (!ConvertStringSecurityDescriptorToSecurityDescriptorW(sddl, SDDL_REVISION_1, &sd, NULL)) {
            e = last_error();
            break;
        }
        sa.nLength = sizeof sa;
        sa.lpSecurityDescriptor = sd;
        sa.bInheritHandle = FALSE;
        j = CreateJobObjectW(&sa, wname);
        e = j == NULL ? last_error() : (GetLastError() == ERROR_ALREADY_EXISTS ? ERROR_ALREADY_EXISTS : 0);
        LocalFree(sd);
        if (e == ERROR_ALREADY_EXISTS) {
            CloseHandle(j);
            j = NULL;
            break;
        }
        if (j == NULL && e != ERROR_INVALID_OWNER) break;   /* only the owner falls back */
    }
    if (wname) HeapFree(GetProcessHeap(), 0, wname);
    if (user) LocalFree(user);
    if (j == NULL) return e ? e : ERROR_GEN_FAILURE;
    ZeroMemory(&li, sizeof li);
    li.BasicLimitInformation.LimitFlags = CT_JOB_BASE_LIMITS;
    if (!SetInformationJobObject(j, JobObjectExtendedLimitInformation, &li, sizeof li)) {
        e = last_error();
        CloseHandle(j);
        return e;
    }
    *job = (uintptr_t)j;
    return 0;
}

int ct_job_create(uintptr_t *job) {
    return ct_job_create_named(job, NULL);
}

/* A named job of ours, for an adopter: CT_JOB_OPEN_ACCESS, what its
 * descriptor grants this user. ERROR_FILE_NOT_FOUND when no job of that
 * name exists: no handle to it is left anywhere (a name lives as long as a
 * handle does), so KILL_ON_JOB_CLOSE has ended its tree. */
int ct_job_open(const char *name, uintptr_t *job) {
    wchar_t *wname = NULL;
    HANDLE j;
    int e;
    *job = 0;
    if ((e = widen_name(name, &wname))) return e;
    j = OpenJobObjectW(CT_JOB_OPEN_ACCESS, FALSE, wname);
    e = j == NULL ? last_error() : 0;
    HeapFree(GetProcessHeap(), 0, wname);
    if (j == NULL) return e;
    *job = (uintptr_t)j;
    return 0;
}

int ct_job_restrict(uintptr_t *job) {
    HANDLE kept;
    if (!DuplicateHandle(GetCurrentProcess(), (HANDLE)*job, GetCurrentProcess(), &kept, CT_JOB_KEPT_ACCESS,
                         FALSE, DUPLICATE_CLOSE_SOURCE))
        return last_error();
    *job = (uintptr_t)kept;
    return 0;
}

/* Every privilege of the process token enabled (mode 1), or put back as it
 * was (mode 0, from *saved). The access check of DuplicateHandle uses the
 * target process's primary token, so a thread token would not do. */
static int privileges(int mode, HANDLE token, TOKEN_PRIVILEGES **saved, uint32_t *enabled) {
    DWORD n = 0;
    TOKEN_PRIVILEGES *all;
    if (mode == 0) {
        if (*saved == NULL) return 0;
        AdjustTokenPrivileges(token, FALSE, *saved, 0, NULL, NULL);
        HeapFree(GetProcessHeap(), 0, *saved);
        *saved = NULL;
        return 0;
    }
    GetTokenInformation(token, TokenPrivileges, NULL, 0, &n);
    if (n == 0) return last_error();
    all = HeapAlloc(GetProcessHeap(), 0, n);
    *saved = HeapAlloc(GetProcessHeap(), 0, n);
    if (all == NULL || *saved == NULL) {
        if (all) HeapFree(GetProcessHeap(), 0, all);
        if (*saved) HeapFree(GetProcessHeap(), 0, *saved);
        *saved = NULL;
        return ERROR_NOT_ENOUGH_MEMORY;
    }
    if (!GetTokenInformation(token, TokenPrivileges, all, n, &n)) {
        int e = last_error();
        HeapFree(GetProcessHeap(), 0, all);
        HeapFree(GetProcessHeap(), 0, *saved);
        *saved = NULL;
        return e;
    }
    for (DWORD i = 0; i < all->PrivilegeCount; i++) {
        if (!(all->Privileges[i].Attributes & SE_PRIVILEGE_ENABLED)) (*enabled)++;
        all->Privileges[i].Attributes |= SE_PRIVILEGE_ENABLED;
    }
    if (!AdjustTokenPrivileges(token, FALSE, all, n, *saved, &n)) {
        int e = last_error();
        HeapFree(GetProcessHeap(), 0, all);
        HeapFree(GetProcessHeap(), 0, *saved);
        *saved = NULL;
        return e;
    }
    HeapFree(GetProcessHeap(), 0, all);
    return 0;
}

int ct_job_probe(uintptr_t job, uint32_t *obtained, uint32_t *enabled) {
    static const DWORD rights[3] = {JOB_OBJECT_SET_ATTRIBUTES, WRITE_DAC, WRITE_OWNER};
    HANDLE token = NULL, dup;
    TOKEN_PRIVILEGES *saved = NULL;
    int rc, i;
    *obtained = *enabled = 0;
    if (!OpenProcessToken(GetCurrentProcess(), TOKEN_ADJUST_PRIVILEGES | TOKEN_QUERY, &token))
        return last_error();
    if ((rc = privileges(1, token, &saved, enabled))) {
        CloseHandle(token);
        return rc;
    }
    for (i = 0; i < 3; i++) {
        if (DuplicateHandle(GetCurrentProcess(), (HANDLE)job, GetCurrentProcess(), &dup, rights[i], FALSE, 0)) {
            *obtained |= rights[i];
            CloseHandle(dup);
        } else if (GetLastError() != ERROR_ACCESS_DENIED) {
            rc = last_error();
        }
    }
    privileges(0, token, &saved, enabled);
    CloseHandle(token);
    return rc;
}

int ct_job_owner_is_system(uintptr_t job, int *system) {
    PSID owner = NULL, sys = NULL;
    PSECURITY_DESCRIPTOR sd = NULL;
    SID_IDENTIFIER_AUTHORITY nt = SECURITY_NT_AUTHORITY;
    DWORD e;
    *system = 0;
    e = GetSecurityInfo((HANDLE)job, SE_KERNEL_OBJECT, OWNER_SECURITY_INFORMATION, &owner, NULL, NULL, NULL, &sd);
    if (e != ERROR_SUCCESS) return (int)e;
    if (owner != NULL && AllocateAndInitializeSid(&nt, 1, SECURITY_LOCAL_SYSTEM_RID, 0, 0, 0, 0, 0, 0, 0, &sys)) {
        *system = EqualSid(owner, sys) ? 1 : 0;
        FreeSid(sys);
    } else if (owner == NULL) {
        *system = -1;
    }
    LocalFree(sd);
    return 0;
}

/* The job this process itself runs in, if any: whether it is in one, and
 * that job's limit flags (QueryInformationJobObject(NULL) names it). */
int ct_job_self(int *in_job, uint32_t *limit_flags) {
    BOOL in = FALSE;
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION li;
    *in_job = 0;
    *limit_flags = 0;
    if (!IsProcessInJob(GetCurrentProcess(), NULL, &in)) return last_error();
    *in_job = in ? 1 : 0;
    if (!in) return 0;
    if (!QueryInformationJobObject(NULL, JobObjectExtendedLimitInformation, &li, sizeof li, NULL))
        return last_error();
    *limit_flags = li.BasicLimitInformation.LimitFlags;
    return 0;
}

/* Associate before the first process is assigned, or its NEW_PROCESS
 * message is never sent. The completion key is the job handle. */
int ct_job_port_create(uintptr_t job, uintptr_t *port) {
    JOBOBJECT_ASSOCIATE_COMPLETION_PORT acp;
    HANDLE p;
    *port = 0;
    p = CreateIoCompletionPort(INVALID_HANDLE_VALUE, NULL, 0, 1);
    if (p == NULL) return last_error();
    acp.CompletionKey = (PVOID)job;
    acp.CompletionPort = p;
    if (!SetInformationJobObject((HANDLE)job, JobObjectAssociateCompletionPortInformation, &acp,
                                 sizeof acp)) {
        int e = last_error();
        CloseHandle(p);
        return e;
    }
    *port = (uintptr_t)p;
    return 0;
}

int ct_job_limits(uintptr_t job, uint32_t *limit_flags) {
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION li;
    *limit_flags = 0;
    if (!QueryInformationJobObject((HANDLE)job, JobObjectExtendedLimitInformation, &li, sizeof li,
                                   NULL))
        return last_error();
    *limit_flags = li.BasicLimitInformation.LimitFlags;
    return 0;
}

int ct_job_accounting(uintptr_t job, struct ct_job_accounting *out) {
    JOBOBJECT_BASIC_ACCOUNTING_INFORMATION bi;
    memset(out, 0, sizeof *out);
    if (!QueryInformationJobObject((HANDLE)job, JobObjectBasicAccountingInformation, &bi, sizeof bi,
                                   NULL))
        return last_error();
    out->user_100ns = (uint64_t)bi.TotalUserTime.QuadPart;
    out->kernel_100ns = (uint64_t)bi.TotalKernelTime.QuadPart;
    out->active = bi.ActiveProcesses;
    out->total = bi.TotalProcesses;
    out->terminated = bi.TotalTerminatedProcesses;
    return 0;
}

/* Returns ERROR_MORE_DATA when `assigned` > `cap` (retry with a larger
 * buffer); the list is a snapshot, processes come and go around it. */
int ct_job_pids(uintptr_t job, uint64_t *pids, uint32_t cap, uint32_t *assigned, uint32_t *listed) {
    JOBOBJECT_BASIC_PROCESS_ID_LIST *l;
    DWORD size = (DWORD)(sizeof *l + (SIZE_T)(cap ? cap : 1) * sizeof(ULONG_PTR));
    int rc = 0;
    uint32_t i;
    *assigned = *listed = 0;
    l = HeapAlloc(GetProcessHeap(), HEAP_ZERO_MEMORY, size);
    if (l == NULL) return ERROR_NOT_ENOUGH_MEMORY;
    if (!QueryInformationJobObject((HANDLE)job, JobObjectBasicProcessIdList, l, size, NULL)) {
        rc = last_error();
        if (rc != ERROR_MORE_DATA) goto out;
    }
    *assigned = l->NumberOfAssignedProcesses;
    *listed = l->NumberOfProcessIdsInList < cap ? l->NumberOfProcessIdsInList : cap;
    for (i = 0; i < *listed; i++) pids[i] = (uint64_t)l->ProcessIdList[i];
    if (*assigned > *listed) rc = ERROR_MORE_DATA;
out:
    HeapFree(GetProcessHeap(), 0, l);
    return rc;
}

int ct_job_contains(uintptr_t job, uint32_t pid, int *inside) {
    BOOL in = FALSE;
    HANDLE p;
    int rc = 0;
    *inside = 0;
    /* Windows accepts the limited right for IsProcessInJob; Wine asks for
     * PROCESS_QUERY_INFORMATION (server/process.c, process_in_job). */
    p = OpenProcess(PROCESS_QUERY_INFORMATION, FALSE, pid);
    if (p == NULL && GetLastError() == ERROR_ACCESS_DENIED)
        p = OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, FALSE, pid);
    if (p == NULL) return last_error();
    if (!IsProcessInJob(p, (HANDLE)job, &in))
        rc = last_error();
    else
        *inside = in ? 1 : 0;
    CloseHandle(p);
    return rc;
}

static void count_message(struct ct_job_wait_result *r, DWORD msg) {
    switch (msg) {
    case JOB_OBJECT_MSG_NEW_PROCESS: r->new_processes++; break;
    case JOB_OBJECT_MSG_EXIT_PROCESS: r->exits++; break;
    case JOB_OBJECT_MSG_ABNORMAL_EXIT_PROCESS: r->abnormal_exits++; break;
    case JOB_OBJECT_MSG_ACTIVE_PROCESS_ZERO: r->port_zero = 1; break;
    case JOB_OBJECT_MSG_JOB_MEMORY_LIMIT: r->memory_limit++; break;
    case JOB_OBJECT_MSG_ACTIVE_PROCESS_LIMIT: r->process_limit++; break;
    default: break;
    }
}

/* One message, or a timeout (returns 0 and sets *got = 0). */
static int next_message(HANDLE port, uintptr_t job, DWORD ms, struct ct_job_wait_result *r, int *got) {
    DWORD msg = 0;
    ULONG_PTR key = 0;
    LPOVERLAPPED ov = NULL;
    *got = 0;
    if (GetQueuedCompletionStatus(port, &msg, &key, &ov, ms)) {
        *got = 1;
        if (key == (ULONG_PTR)job) count_message(r, msg);
        return 0;
    }
    if (ov == NULL && GetLastError() == WAIT_TIMEOUT) return 0;
    return last_error();
}

int ct_job_wait_empty(uintptr_t job, uintptr_t port, uint32_t timeout_ms, struct ct_job_wait_result *r) {
    ULONGLONG start = GetTickCount64();
    int rc, got;
    for (;;) {
        struct ct_job_accounting acc;
        ULONGLONG waited;
        DWORD slice;
        /* Drain what is queued, so a long run's messages do not pile up. */
        if (port) {
            do {
                if ((rc = next_message((HANDLE)port, job, 0, r, &got))) return rc;
            } while (got);
        }
        if ((rc = ct_job_accounting(job, &acc))) return rc;
        r->queries++;
        r->active = acc.active;
        if (acc.active == 0) {
            r->empty = 1;
            return 0;
        }
        waited = GetTickCount64() - start;
        if (timeout_ms != INFINITE && waited >= timeout_ms) return 0;
        slice = CT_JOB_REQUERY_MS;
        if (timeout_ms != INFINITE && timeout_ms - waited < slice) slice = (DWORD)(timeout_ms - waited);
        if (port) {
            if ((rc = next_message((HANDLE)port, job, slice, r, &got))) return rc;
        } else {
            Sleep(slice);
        }
    }
}

int ct_job_terminate(uintptr_t job, uint32_t exit_code) {
    return TerminateJobObject((HANDLE)job, exit_code) ? 0 : last_error();
}

int ct_job_close_take(uintptr_t handle) {
    return CloseHandle((HANDLE)handle) ? 0 : last_error();
}

/* Peak commit of the job and of its largest process. Wine zero-fills this
 * class (dlls/ntdll/unix/sync.c): Python decides what a 0 means. */
int ct_job_memory(uintptr_t job, uint64_t *peak_job, uint64_t *peak_process) {
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION li;
    *peak_job = *peak_process = 0;
    if (!QueryInformationJobObject((HANDLE)job, JobObjectExtendedLimitInformation, &li, sizeof li,
                                   NULL))
        return last_error();
    *peak_job = (uint64_t)li.PeakJobMemoryUsed;
    *peak_process = (uint64_t)li.PeakProcessMemoryUsed;
    return 0;
}

/* The resource limits (the record's `limits`), written with the handle
 * ct_job_create returned, before ct_job_restrict takes SET_ATTRIBUTES
 * away and before anything is assigned. The whole extended class is
 * written: CT_JOB_BASE_LIMITS, plus JOB_MEMORY when job_memory != 0 and
 * ACTIVE_PROCESS when active_processes != 0. Not read-modify-write: a
 * query that zero-fills (Wine) would otherwise drop KILL_ON_JOB_CLOSE. */
int ct_job_set_limits(uintptr_t job, uint64_t job_memory, uint32_t active_processes) {
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION li;
    ZeroMemory(&li, sizeof li);
    li.BasicLimitInformation.LimitFlags = CT_JOB_BASE_LIMITS;
    if (job_memory) {
        li.BasicLimitInformation.LimitFlags |= JOB_OBJECT_LIMIT_JOB_MEMORY;
        li.JobMemoryLimit = (SIZE_T)job_memory;
    }
    if (active_processes) {
        li.BasicLimitInformation.LimitFlags |= JOB_OBJECT_LIMIT_ACTIVE_PROCESS;
        li.BasicLimitInformation.ActiveProcessLimit = active_processes;
    }
    return SetInformationJobObject((HANDLE)job, JobObjectExtendedLimitInformation, &li, sizeof li) ? 0
                                                                                                   : last_error();
}

int ct_job_read_limits(uintptr_t job, struct ct_job_limit_values *out) {
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION li;
    memset(out, 0, sizeof *out);
    if (!QueryInformationJobObject((HANDLE)job, JobObjectExtendedLimitInformation, &li, sizeof li, NULL))
        return last_error();
    out->flags = li.BasicLimitInformation.LimitFlags;
    out->active_process_limit = li.BasicLimitInformation.ActiveProcessLimit;
    out->job_memory_limit = (uint64_t)li.JobMemoryLimit;
    out->process_memory_limit = (uint64_t)li.ProcessMemoryLimit;
    return 0;
}

/* A hard cap on the job's CPU: `rate` in 1/100 of a percent of all the
 * machine's processors (1..10000), JOB_OBJECT_CPU_RATE_CONTROL_ENABLE |
 * HARD_CAP (Windows 8 and later). */
int ct_job_set_cpu_rate(uintptr_t job, uint32_t rate) {
    JOBOBJECT_CPU_RATE_CONTROL_INFORMATION ci;
    ZeroMemory(&ci, sizeof ci);
    ci.ControlFlags = JOB_OBJECT_CPU_RATE_CONTROL_ENABLE | JOB_OBJECT_CPU_RATE_CONTROL_HARD_CAP;
    ci.CpuRate = rate;
    return SetInformationJobObject((HANDLE)job, JobObjectCpuRateControlInformation, &ci, sizeof ci) ? 0
                                                                                                    : last_error();
}

int ct_job_read_cpu_rate(uintptr_t job, uint32_t *control_flags, uint32_t *rate) {
    JOBOBJECT_CPU_RATE_CONTROL_INFORMATION ci;
    *control_flags = *rate = 0;
    if (!QueryInformationJobObject((HANDLE)job, JobObjectCpuRateControlInformation, &ci, sizeof ci, NULL))
        return last_error();
    *control_flags = ci.ControlFlags;
    *rate = ci.CpuRate;
    return 0;
}

/* The processors CpuRate is a share of: every active one, in every group. */
int ct_job_cpu_count(uint32_t *n) {
    *n = GetActiveProcessorCount(ALL_PROCESSOR_GROUPS);
    return *n ? 0 : last_error();
}
