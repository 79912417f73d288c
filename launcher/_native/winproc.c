/* The worker as a Windows process: created inside the run's job before its
 * first instruction, and observed by its handle (status, identity, console).
 *
 * The worker is created suspended, in the job already where Windows allows
 * it (PROC_THREAD_ATTRIBUTE_JOB_LIST, Windows 10: the process is born in the
 * job), else by AssignProcessToJobObject while its only thread has not run.
 * Either way IsProcessInJob is checked before ResumeThread, so the claim
 * "in the job before its first instruction" is observed, not assumed. A
 * child that cannot be placed is terminated while still suspended. Never a
 * breakaway flag: the job (jobobject.c) allows none.
 *
 * Windows only (build.py compiles it for win32): the Win32 API throughout.
 */
#include "winproc.h"

#ifndef _WIN32
#error "winproc.c is Windows code: build.py lists it for win32 only"
#endif
#ifndef _WIN32_WINNT
#define _WIN32_WINNT 0x0A00
#endif
#include <windows.h>
#include <tlhelp32.h>
#include <string.h>

#ifndef PROC_THREAD_ATTRIBUTE_JOB_LIST
#define PROC_THREAD_ATTRIBUTE_JOB_LIST ProcThreadAttributeValue(13, FALSE, TRUE, FALSE)
#endif
#ifndef ERROR_PROCESS_NOT_IN_JOB
#define ERROR_PROCESS_NOT_IN_JOB 759L
#endif

static int last_error(void) {
    DWORD e = GetLastError();
    return e ? (int)e : (int)ERROR_GEN_FAILURE;
}

/* UTF-8 (len bytes, or NUL-terminated when len < 0) to a heap UTF-16 copy. */
static int widen(const char *s, int len, wchar_t **out) {
    int n;
    *out = NULL;
    if (s == NULL) return 0;
    n = MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, s, len, NULL, 0);
    if (n <= 0) return last_error();
    *out = HeapAlloc(GetProcessHeap(), 0, (SIZE_T)(n + 1) * sizeof(wchar_t));
    if (*out == NULL) return ERROR_NOT_ENOUGH_MEMORY;
    if (MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, s, len, *out, n) != n) {
        int e = last_error();
        HeapFree(GetProcessHeap(), 0, *out);
        *out = NULL;
        return e;
    }
    (*out)[n] = L'\0';
    return 0;
}

static void wfree(wchar_t *p) {
    if (p) HeapFree(GetProcessHeap(), 0, p);
}

/* An attribute list holding the job (if job != NULL) and the handles the
 * child may inherit (if n > 0). `job` and `handles` must outlive the list. */
static int make_attrs(const HANDLE *job, HANDLE *handles, int n, LPPROC_THREAD_ATTRIBUTE_LIST *out) {
    SIZE_T size = 0;
    DWORD count = (job ? 1 : 0) + (n > 0 ? 1 : 0);
    LPPROC_THREAD_ATTRIBUTE_LIST l;
    int e;
    *out = NULL;
    if (count == 0) return 0;
    InitializeProcThreadAttributeList(NULL, count, 0, &size);
    l = HeapAlloc(GetProcessHeap(), 0, size);
    if (l == NULL) return ERROR_NOT_ENOUGH_MEMORY;
    if (!InitializeProcThreadAttributeList(l, count, 0, &size)) {
        e = last_error();
        HeapFree(GetProcessHeap(), 0, l);
        return e;
    }
    if ((job && !UpdateProcThreadAttribute(l, 0, PROC_THREAD_ATTRIBUTE_JOB_LIST, (PVOID)job,
                                           sizeof(HANDLE), NULL, NULL)) ||
        (n > 0 && !UpdateProcThreadAttribute(l, 0, PROC_THREAD_ATTRIBUTE_HANDLE_LIST, handles,
                                             (SIZE_T)n * sizeof(HANDLE), NULL, NULL))) {
        e = last_error();
        DeleteProcThreadAttributeList(l);
        HeapFree(GetProcessHeap(), 0, l);
        return e;
    }
    *out = l;
    return 0;
}

static void free_attrs(LPPROC_THREAD_ATTRIBUTE_LIST l) {
    if (l) {
        DeleteProcThreadAttributeList(l);
        HeapFree(GetProcessHeap(), 0, l);
    }
}

/* The child has run nothing (it is suspended): end it and wait for it. */
static void discard_suspended(PROCESS_INFORMATION *pi) {
    TerminateProcess(pi->hProcess, 1);
    WaitForSingleObject(pi->hProcess, 5000);
    CloseHandle(pi->hThread);
    CloseHandle(pi->hProcess);
}

int ct_job_spawn(const struct ct_job_spawn_args *a, struct ct_job_spawn_result *r) {
    static const DWORD std_ids[3] = {STD_INPUT_HANDLE, STD_OUTPUT_HANDLE, STD_ERROR_HANDLE};
    wchar_t *app = NULL, *cmd = NULL, *env = NULL, *cwd = NULL;
    HANDLE job = (HANDLE)a->job;
    HANDLE std[3] = {NULL, NULL, NULL};
    HANDLE inherit[3];
    int ninherit = 0;
    LPPROC_THREAD_ATTRIBUTE_LIST attrs = NULL;
    STARTUPINFOEXW si;
    PROCESS_INFORMATION pi;
    DWORD flags;
    BOOL inside = FALSE;
    int rc, i;

    memset(r, 0, sizeof *r);
    r->stage = CT_JOB_STAGE_ARGS;
    if (a->command_line == NULL) return ERROR_INVALID_PARAMETER;
    if ((rc = widen(a->application, -1, &app)) || (rc = widen(a->command_line, -1, &cmd)) ||
        (rc = widen(a->cwd, -1, &cwd)))
        goto out;
    if (a->environment && (rc = widen(a->environment, (int)a->env_len, &env))) goto out;

    /* Only our own inheritable duplicates of the three std handles are
     * inherited (PROC_THREAD_ATTRIBUTE_HANDLE_LIST), as CPython's
     * subprocess does: no other handle of the supervisor leaks in. */
    for (i = 0; i < 3; i++) {
        HANDLE src = a->stdio[i] ? (HANDLE)a->stdio[i] : GetStdHandle(std_ids[i]);
        if (src == NULL || src == INVALID_HANDLE_VALUE) continue;
        if (!DuplicateHandle(GetCurrentProcess(), src, GetCurrentProcess(), &std[i], 0, TRUE,
                             DUPLICATE_SAME_ACCESS)) {
            rc = last_error();
            goto out;
        }
        inherit[ninherit++] = std[i];
    }
    ZeroMemory(&si, sizeof si);
    si.StartupInfo.cb = sizeof si;
    if (ninherit > 0) {
        si.StartupInfo.dwFlags = STARTF_USESTDHANDLES;
        si.StartupInfo.hStdInput = std[0];
        si.StartupInfo.hStdOutput = std[1];
        si.StartupInfo.hStdError = std[2];
    }
    /* Suspended on both paths: placement is verified before the first
     * instruction runs. */
    flags = EXTENDED_STARTUPINFO_PRESENT | CREATE_UNICODE_ENVIRONMENT | CREATE_SUSPENDED;
    if (a->new_process_group) flags |= CREATE_NEW_PROCESS_GROUP;

    r->job_list_error = -1;
    if (a->try_job_list) {
        r->stage = CT_JOB_STAGE_ATTRS;
        r->job_list_error = make_attrs(&job, inherit, ninherit, &attrs);
        if (r->job_list_error == 0) {
            si.lpAttributeList = attrs;
            r->stage = CT_JOB_STAGE_CREATE;
            if (CreateProcessW(app, cmd, NULL, NULL, ninherit > 0, flags, env, cwd,
                               &si.StartupInfo, &pi)) {
                r->via = CT_JOB_VIA_JOB_LIST;
            } else {
                rc = last_error();
                /* Only "this attribute is not understood" falls back; any
                 * other failure is the command's own (not found, denied). */
                if (rc != ERROR_INVALID_PARAMETER && rc != ERROR_NOT_SUPPORTED) goto out;
                r->job_list_error = rc;
                rc = 0;
            }
            free_attrs(attrs);
            attrs = NULL;
        }
    }
    if (r->via == CT_JOB_VIA_NONE) {
        r->stage = CT_JOB_STAGE_ATTRS;
        if ((rc = make_attrs(NULL, inherit, ninherit, &attrs))) goto out;
        si.lpAttributeList = attrs;
        r->stage = CT_JOB_STAGE_CREATE;
        if (!CreateProcessW(app, cmd, NULL, NULL, ninherit > 0, flags, env, cwd, &si.StartupInfo,
                            &pi)) {
            rc = last_error();
            goto out;
        }
        r->pid = pi.dwProcessId;
        r->stage = CT_JOB_STAGE_ASSIGN;
        if (!AssignProcessToJobObject(job, pi.hProcess)) {
            rc = last_error();
            discard_suspended(&pi);
            goto out;
        }
        r->via = CT_JOB_VIA_SUSPENDED;
    }
    r->pid = pi.dwProcessId;
    r->stage = CT_JOB_STAGE_VERIFY;
    if (!IsProcessInJob(pi.hProcess, job, &inside)) {
        rc = last_error();
        discard_suspended(&pi);
        goto out;
    }
    if (!inside) {
        rc = ERROR_PROCESS_NOT_IN_JOB;
        discard_suspended(&pi);
        goto out;
    }
    r->stage = CT_JOB_STAGE_RESUME;
    if (ResumeThread(pi.hThread) == (DWORD)-1) {
        rc = last_error();
        discard_suspended(&pi);
        goto out;
    }
    CloseHandle(pi.hThread);
    r->process = (uintptr_t)pi.hProcess;
    r->stage = CT_JOB_STAGE_NONE;
    rc = 0;
out:
    free_attrs(attrs);
    for (i = 0; i < 3; i++)
        if (std[i]) CloseHandle(std[i]);
    wfree(app);
    wfree(cmd);
    wfree(env);
    wfree(cwd);
    return rc;
}

/* Reaches only console processes of the group that share our console;
 * the caller treats it as a polite request, never as evidence. */
int ct_job_ctrl_break(uint32_t process_group) {
    return GenerateConsoleCtrlEvent(CTRL_BREAK_EVENT, process_group) ? 0 : last_error();
}

int ct_job_process_wait(uintptr_t process, uint32_t timeout_ms, int *exited) {
    DWORD w = WaitForSingleObject((HANDLE)process, timeout_ms);
    *exited = 0;
    if (w == WAIT_OBJECT_0) {
        *exited = 1;
        return 0;
    }
    if (w == WAIT_TIMEOUT) return 0;
    return last_error();
}

/* The handle's signalled state, not STILL_ACTIVE (259), says whether the
 * process runs: 259 is also a valid exit code. */
int ct_job_process_status(uintptr_t process, int *running, uint32_t *exit_code) {
    DWORD code = 0;
    int rc, exited;
    *running = 0;
    *exit_code = 0;
    if ((rc = ct_job_process_wait(process, 0, &exited))) return rc;
    if (!exited) {
        *running = 1;
        return 0;
    }
    if (!GetExitCodeProcess((HANDLE)process, &code)) return last_error();
    *exit_code = code;
    return 0;
}

/* -- the worker as a process: identity, times, console ---------------------- */

/* SYNCHRONIZE to see it exit, the query right for GetProcessTimes and
 * GetExitCodeProcess. Wine wants PROCESS_QUERY_INFORMATION where Windows
 * accepts the limited right (as for IsProcessInJob). The handle pins the
 * pid: Windows does not reuse it while a handle is open. */
int ct_job_process_open(uint32_t pid, uintptr_t *process) {
    HANDLE h;
    *process = 0;
    h = OpenProcess(SYNCHRONIZE | PROCESS_QUERY_INFORMATION, FALSE, pid);
    if (h == NULL && GetLastError() == ERROR_ACCESS_DENIED)
        h = OpenProcess(SYNCHRONIZE | PROCESS_QUERY_LIMITED_INFORMATION, FALSE, pid);
    if (h == NULL) return last_error();
    *process = (uintptr_t)h;
    return 0;
}

static uint64_t ft64(FILETIME f) {
    return ((uint64_t)f.dwHighDateTime << 32) | f.dwLowDateTime;
}

/* Creation time is what makes a pid an identity (pid + creation time); exit
 * time is 0 while the process runs. */
int ct_job_process_times(uintptr_t process, struct ct_job_times *t) {
    FILETIME c, e, k, u;
    memset(t, 0, sizeof *t);
    if (!GetProcessTimes((HANDLE)process, &c, &e, &k, &u)) return last_error();
    t->creation_100ns = ft64(c);
    t->exit_100ns = ft64(e);
    t->kernel_100ns = ft64(k);
    t->user_100ns = ft64(u);
    return 0;
}

/* The processes attached to our console: a CTRL_BREAK_EVENT can reach only
 * those. No console at all fails (ERROR_INVALID_HANDLE, typically). A
 * list longer than `cap` returns ERROR_MORE_DATA with the true count. */
int ct_job_console_pids(uint32_t *pids, uint32_t cap, uint32_t *count) {
    DWORD n;
    *count = 0;
    n = GetConsoleProcessList((LPDWORD)pids, cap ? cap : 1);
    if (n == 0) return last_error();
    *count = n;
    return n > cap ? ERROR_MORE_DATA : 0;
}

/* -- every process: a Toolhelp snapshot ---------------------------------------- */

/* The snapshot is taken at once (CreateToolhelp32Snapshot copies the
 * system's process list), then each entry's creation time is read by a
 * handle opened by pid: the only thing that tells a process from a later
 * one given the same pid. A process that exits in between, or one this
 * token may not open (System, protected processes), keeps its entry with
 * times_error set. More processes than `cap`: ERROR_MORE_DATA with the
 * true count in *count (the first `cap` are filled). */
int ct_proc_snapshot(struct ct_winproc *out, uint32_t cap, uint32_t *count) {
    HANDLE snap, h;
    PROCESSENTRY32W e;
    uint32_t n = 0;
    FILETIME c, x, k, u;
    *count = 0;
    snap = CreateToolhelp32Snapshot(TH32CS_SNAPPROCESS, 0);
    if (snap == INVALID_HANDLE_VALUE) return last_error();
    e.dwSize = sizeof e;
    if (!Process32FirstW(snap, &e)) {
        int rc = last_error();
        CloseHandle(snap);
        return rc == ERROR_NO_MORE_FILES ? 0 : rc;
    }
    do {
        if (n < cap) {
            struct ct_winproc *p = &out[n];
            int len;
            memset(p, 0, sizeof *p);
            p->pid = e.th32ProcessID;
            p->ppid = e.th32ParentProcessID;
            p->threads = e.cntThreads;
            e.szExeFile[MAX_PATH - 1] = 0;
            len = WideCharToMultiByte(CP_UTF8, 0, e.szExeFile, -1, p->name, CT_WINPROC_NAME_MAX + 1, NULL, NULL);
            if (len <= 0) p->name[0] = 0;
            /* Wine wants PROCESS_QUERY_INFORMATION for GetProcessTimes
             * where Windows accepts the limited right (ct_job_process_open). */
            h = OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, FALSE, e.th32ProcessID);
            if (h == NULL) h = OpenProcess(PROCESS_QUERY_INFORMATION, FALSE, e.th32ProcessID);
            if (h == NULL) {
                p->times_error = last_error();
            } else {
                if (GetProcessTimes(h, &c, &x, &k, &u)) p->creation_100ns = ft64(c);
                else p->times_error = last_error();
                CloseHandle(h);
            }
        }
        n++;
    } while (Process32NextW(snap, &e));
    CloseHandle(snap);
    *count = n;
    return n > cap ? ERROR_MORE_DATA : 0;
}
