/* Adversarial checks of launcher/_native/jobobject.c against the real
 * Win32 API (run under wine64 by tests/test_windows_jobobject.py).
 *
 * Built with x86_64-w64-mingw32-gcc together with jobobject.c and winproc.c,
 * as cffi would build them (their headers are what the extension
 * includes). The program is its own helper: run with a role argument it
 * becomes a worker, grandchild or escaper. Run with no argument it is the harness and prints
 * one line per check:
 *
 *     CHECK <name> ok|FAIL key=value ...
 *     SUMMARY checks=N failed=M
 *
 * Helpers leave evidence the harness reads independently of the code under
 * test: each creates an empty file `<tag>.<pid>` in the working directory
 * (its "mark"), and escapers write what happened to `<tag>.result`. The
 * harness opens every marked pid itself and asks IsProcessInJob and
 * WaitForSingleObject, so the job API is never its own witness.
 */
#ifndef _WIN32_WINNT
#define _WIN32_WINNT 0x0A00
#endif
#include <windows.h>
#include <tlhelp32.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jobobject.h"
#include "winproc.h"

#define MAXP 256
#define LONG_SLEEP_MS 60000

static char self_utf8[MAX_PATH * 3];
static int n_checks, n_failed, n_skipped;
static const char *wine_version;   /* non-NULL under Wine */

/* -- helpers shared by roles and harness --------------------------------- */

static void mark(const char *tag) {
    char name[128];
    HANDLE f;
    snprintf(name, sizeof name, "%s.%lu", tag, (unsigned long)GetCurrentProcessId());
    f = CreateFileA(name, GENERIC_WRITE, 0, NULL, CREATE_ALWAYS, FILE_ATTRIBUTE_NORMAL, NULL);
    if (f != INVALID_HANDLE_VALUE) CloseHandle(f);
}

static void write_result(const char *tag, const char *text) {
    char name[128];
    FILE *f;
    snprintf(name, sizeof name, "%s.result", tag);
    f = fopen(name, "a");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* CreateProcess of ourselves with `args`, outside any job of ours. */
static BOOL spawn_self(const char *args, DWORD flags, PROCESS_INFORMATION *pi) {
    char cmd[MAX_PATH * 3 + 256];
    STARTUPINFOA si;
    ZeroMemory(&si, sizeof si);
    si.cb = sizeof si;
    snprintf(cmd, sizeof cmd, "\"%s\" %s", self_utf8, args);
    return CreateProcessA(NULL, cmd, NULL, NULL, FALSE, flags, NULL, NULL, &si, pi);
}

static void close_pi(PROCESS_INFORMATION *pi) {
    CloseHandle(pi->hThread);
    CloseHandle(pi->hProcess);
}

/* -- roles ---------------------------------------------------------------- */

/* chain DEPTH TOP MS TAG: mark, start `chain DEPTH-1`, then exit with 7 if
 * DEPTH == TOP (the worker leaves its descendants behind), else sleep MS. */
static int role_chain(int depth, int top, DWORD ms, const char *tag) {
    mark(tag);
    if (depth > 0) {
        char args[128];
        PROCESS_INFORMATION pi;
        snprintf(args, sizeof args, "chain %d %d %lu %s", depth - 1, top, (unsigned long)ms, tag);
        if (spawn_self(args, 0, &pi)) close_pi(&pi);
    }
    if (depth == top) return 7;
    Sleep(ms);
    return 0;
}

/* breakaway TAG: ask to leave the job for a child; say what happened. */
static int role_breakaway(const char *tag) {
    char args[64], text[64];
    PROCESS_INFORMATION pi;
    mark(tag);
    snprintf(args, sizeof args, "marksleep %s", tag);
    if (spawn_self(args, CREATE_BREAKAWAY_FROM_JOB, &pi)) {
        snprintf(text, sizeof text, "created %lu\n", (unsigned long)pi.dwProcessId);
        close_pi(&pi);
    } else {
        snprintf(text, sizeof text, "refused %lu\n", (unsigned long)GetLastError());
    }
    write_result(tag, text);
    Sleep(LONG_SLEEP_MS);
    return 0;
}

/* nest TAG: make a job of our own that allows (silent) breakaway, put a
 * child in it (nested inside the launcher's job), and let that child try
 * both ways out: a plain child (silent breakaway) and an explicit one. */
static int role_nest(const char *tag) {
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION li;
    PROCESS_INFORMATION pi;
    HANDLE j2;
    char args[64], text[96];
    mark(tag);
    j2 = CreateJobObjectW(NULL, NULL);
    ZeroMemory(&li, sizeof li);
    li.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_BREAKAWAY_OK | JOB_OBJECT_LIMIT_SILENT_BREAKAWAY_OK;
    if (j2 == NULL || !SetInformationJobObject(j2, JobObjectExtendedLimitInformation, &li, sizeof li)) {
        snprintf(text, sizeof text, "nest-job-failed %lu\n", (unsigned long)GetLastError());
        write_result(tag, text);
    }
    snprintf(args, sizeof args, "escaper %s", tag);
    if (!spawn_self(args, CREATE_SUSPENDED, &pi)) {
        snprintf(text, sizeof text, "escaper-create-failed %lu\n", (unsigned long)GetLastError());
        write_result(tag, text);
        Sleep(LONG_SLEEP_MS);
        return 0;
    }
    if (j2 && !AssignProcessToJobObject(j2, pi.hProcess)) {
        snprintf(text, sizeof text, "nest-assign-failed %lu\n", (unsigned long)GetLastError());
        write_result(tag, text);
    } else {
        write_result(tag, "nested\n");
    }
    ResumeThread(pi.hThread);
    close_pi(&pi);
    Sleep(LONG_SLEEP_MS);
    return 0;
}

static int role_escaper(const char *tag) {
    PROCESS_INFORMATION pi;
    char args[64], text[64];
    mark(tag);
    snprintf(args, sizeof args, "marksleep %s", tag);
    if (spawn_self(args, 0, &pi)) close_pi(&pi);   /* silent breakaway from the inner job */
    if (spawn_self(args, CREATE_BREAKAWAY_FROM_JOB, &pi)) {
        snprintf(text, sizeof text, "explicit-created %lu\n", (unsigned long)pi.dwProcessId);
        close_pi(&pi);
    } else {
        snprintf(text, sizeof text, "explicit-refused %lu\n", (unsigned long)GetLastError());
    }
    write_result(tag, text);
    Sleep(LONG_SLEEP_MS);
    return 0;
}

/* steal PID TAG: what any process running as the supervisor's user can do.
 * Open the supervisor (PID) for PROCESS_DUP_HANDLE, copy out every handle
 * value until one is a job that holds us, allow breakaway on it, and start
 * a child outside. This is why `sealed` is false for a same-user worker. */
static int role_steal(DWORD parent_pid, const char *tag) {
    HANDLE parent = OpenProcess(PROCESS_DUP_HANDLE, FALSE, parent_pid);
    char text[96];
    ULONG_PTR v;
    mark(tag);
    if (parent == NULL) {
        snprintf(text, sizeof text, "no-dup-access %lu\n", (unsigned long)GetLastError());
        write_result(tag, text);
        Sleep(LONG_SLEEP_MS);
        return 0;
    }
    for (v = 4; v < 0x10000; v += 4) {
        HANDLE dup;
        BOOL in = FALSE;
        if (!DuplicateHandle(parent, (HANDLE)v, GetCurrentProcess(), &dup,
                             JOB_OBJECT_SET_ATTRIBUTES | JOB_OBJECT_QUERY, FALSE, 0))
            continue;
        if (IsProcessInJob(GetCurrentProcess(), dup, &in) && in) {
            JOBOBJECT_EXTENDED_LIMIT_INFORMATION li;
            PROCESS_INFORMATION pi;
            char args[64];
            ZeroMemory(&li, sizeof li);
            li.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_BREAKAWAY_OK;
            if (!SetInformationJobObject(dup, JobObjectExtendedLimitInformation, &li, sizeof li)) {
                snprintf(text, sizeof text, "set-limits-refused %lu\n", (unsigned long)GetLastError());
            } else {
                snprintf(args, sizeof args, "marksleep %s", tag);
                if (spawn_self(args, CREATE_BREAKAWAY_FROM_JOB, &pi)) {
                    snprintf(text, sizeof text, "escaped %lu\n", (unsigned long)pi.dwProcessId);
                    close_pi(&pi);
                } else {
                    snprintf(text, sizeof text, "breakaway-refused %lu\n", (unsigned long)GetLastError());
                }
            }
            write_result(tag, text);
            CloseHandle(dup);
            Sleep(LONG_SLEEP_MS);
            return 0;
        }
        CloseHandle(dup);
    }
    write_result(tag, "job-handle-not-found\n");
    Sleep(LONG_SLEEP_MS);
    return 0;
}

/* storm TAG GEN: mark, start two `storm GEN-1`, sleep. */
static int role_storm(const char *tag, int gen) {
    mark(tag);
    if (gen > 0) {
        char args[64];
        PROCESS_INFORMATION pi;
        snprintf(args, sizeof args, "storm %s %d", tag, gen - 1);
        for (int i = 0; i < 2; i++)
            if (spawn_self(args, 0, &pi)) close_pi(&pi);
    }
    Sleep(LONG_SLEEP_MS);
    return 0;
}

/* supervisor TAG: what `contain` does, in a process the harness will kill:
 * a job with KILL_ON_JOB_CLOSE holding a tree. */
static int role_supervisor(const char *tag) {
    struct ct_job_spawn_args a;
    struct ct_job_spawn_result r;
    uintptr_t job;
    char cmd[MAX_PATH * 3 + 64];
    mark(tag);
    if (ct_job_create(&job)) return 3;
    memset(&a, 0, sizeof a);
    snprintf(cmd, sizeof cmd, "\"%s\" chain 1 -1 %d %s", self_utf8, LONG_SLEEP_MS, tag);
    a.job = job;
    a.command_line = cmd;
    a.try_job_list = 1;
    if (ct_job_spawn(&a, &r)) return 4;
    Sleep(LONG_SLEEP_MS);
    return 0;
}

static int role_spin(DWORD ms) {
    ULONGLONG end = GetTickCount64() + ms;
    volatile unsigned long x = 0;
    while (GetTickCount64() < end) x++;
    return 0;
}

static int role_injob(void) {
    BOOL in = FALSE;
    if (!IsProcessInJob(GetCurrentProcess(), NULL, &in)) return 12;
    return in ? 10 : 11;
}

/* -- harness -------------------------------------------------------------- */

#define SKIP 2   /* a check's third outcome: what Wine does not implement */

static void check(const char *name, int ok, const char *fmt, ...) {
    va_list ap;
    n_checks++;
    if (!ok) n_failed++;
    if (ok == SKIP) n_skipped++;
    printf("CHECK %s %s", name, ok == SKIP ? "skip" : ok ? "ok" : "FAIL");
    if (fmt && *fmt) {
        putchar(' ');
        va_start(ap, fmt);
        vprintf(fmt, ap);
        va_end(ap);
    }
    putchar('\n');
    fflush(stdout);
}

static int job_spawn(uintptr_t job, const char *args, int try_job_list, struct ct_job_spawn_result *r) {
    struct ct_job_spawn_args a;
    char cmd[MAX_PATH * 3 + 256];
    memset(&a, 0, sizeof a);
    snprintf(cmd, sizeof cmd, "\"%s\" %s", self_utf8, args);
    a.job = job;
    a.command_line = cmd;
    a.try_job_list = try_job_list;
    return ct_job_spawn(&a, r);
}

/* Pids marked with `tag` so far. */
static int marks(const char *tag, DWORD *pids, int cap) {
    WIN32_FIND_DATAA fd;
    char pattern[128];
    HANDLE h;
    int n = 0;
    snprintf(pattern, sizeof pattern, "%s.*", tag);
    h = FindFirstFileA(pattern, &fd);
    if (h == INVALID_HANDLE_VALUE) return 0;
    do {
        const char *dot = strrchr(fd.cFileName, '.');
        char *end;
        unsigned long pid = dot ? strtoul(dot + 1, &end, 10) : 0;
        if (dot && pid && *end == '\0' && n < cap) pids[n++] = (DWORD)pid;
    } while (FindNextFileA(h, &fd));
    FindClose(h);
    return n;
}

static int wait_marks(const char *tag, DWORD *pids, int want, DWORD timeout_ms) {
    ULONGLONG end = GetTickCount64() + timeout_ms;
    int n;
    while ((n = marks(tag, pids, MAXP)) < want && GetTickCount64() < end) Sleep(20);
    return n;
}

static int wait_result(const char *tag, char *buf, size_t cap, DWORD timeout_ms) {
    char name[128];
    ULONGLONG end = GetTickCount64() + timeout_ms;
    snprintf(name, sizeof name, "%s.result", tag);
    buf[0] = '\0';
    while (GetTickCount64() < end) {
        FILE *f = fopen(name, "r");
        if (f) {
            size_t n = fread(buf, 1, cap - 1, f);
            buf[n] = '\0';
            fclose(f);
            if (n > 0) return 1;
        }
        Sleep(20);
    }
    return 0;
}

/* The harness's own view: ActiveProcesses straight from the API. */
static long active_by_query(uintptr_t job) {
    JOBOBJECT_BASIC_ACCOUNTING_INFORMATION bi;
    if (!QueryInformationJobObject((HANDLE)job, JobObjectBasicAccountingInformation, &bi, sizeof bi, NULL))
        return -1;
    return (long)bi.ActiveProcesses;
}

/* PROCESS_QUERY_INFORMATION, not the limited right: Wine's IsProcessInJob
 * asks for it (server/process.c, process_in_job). */
static HANDLE open_pid(DWORD pid) {
    return OpenProcess(SYNCHRONIZE | PROCESS_QUERY_INFORMATION, FALSE, pid);
}

/* 1 in the job, 0 outside, -1 cannot tell. */
static int in_job(HANDLE p, uintptr_t job) {
    BOOL in = FALSE;
    if (p == NULL || !IsProcessInJob(p, (HANDLE)job, &in)) return -1;
    return in ? 1 : 0;
}

static void make_job(uintptr_t *job, uintptr_t *port) {
    int rc = ct_job_create(job);
    if (rc == 0) rc = ct_job_port_create(*job, port);
    if (rc) {
        printf("CHECK setup FAIL ct_job_create/port rc=%d\n", rc);
        exit(2);
    }
}

static void drop_job(uintptr_t job, uintptr_t port) {
    ct_job_terminate(job, 1);
    ct_job_close_take(port);
    ct_job_close_take(job);
}

static void t_limits(void) {
    uintptr_t job, port;
    uint32_t flags = 0;
    int rc;
    make_job(&job, &port);
    int ok;
    rc = ct_job_limits(job, &flags);
    ok = rc == 0 && (flags & JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE) &&
         !(flags & (JOB_OBJECT_LIMIT_BREAKAWAY_OK | JOB_OBJECT_LIMIT_SILENT_BREAKAWAY_OK));
    /* Wine's NtQueryInformationJobObject zero-fills the limit classes
     * (dlls/ntdll/unix/sync.c): the limits are enforced (kill_on_job_close,
     * breakaway_flag_cannot_leave) but cannot be read back. */
    if (!ok && wine_version && rc == 0 && flags == 0) ok = SKIP;
    check("limits_kill_on_close_no_breakaway", ok, "rc=%d flags=0x%lx%s", rc, (unsigned long)flags,
          ok == SKIP ? " gap=wine_query_limits_zero_filled" : "");
    drop_job(job, port);
}

static void t_first_instruction(const char *name, int try_job_list, int want_via) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    uint32_t code = 0;
    int rc, exited = 0, running = 1;
    make_job(&job, &port);
    rc = job_spawn(job, "injob", try_job_list, &r);
    if (rc == 0) {
        ct_job_process_wait(r.process, 10000, &exited);
        ct_job_process_status(r.process, &running, &code);
        ct_job_close_take(r.process);
    }
    /* exit 10: the worker's own IsProcessInJob said yes */
    check(name, rc == 0 && r.via == want_via && exited && code == 10,
          "rc=%d via=%d job_list_error=%d exit=%lu", rc, r.via, r.job_list_error, (unsigned long)code);
    drop_job(job, port);
}

static void t_assign_failure(const char *name, int try_job_list, const char *tag) {
    struct ct_job_spawn_result r;
    DWORD pids[MAXP];
    HANDLE not_a_job = CreateEventW(NULL, TRUE, FALSE, NULL);
    HANDLE child = NULL;
    char args[64];
    int rc, alive = 0, ran;
    snprintf(args, sizeof args, "mark %s", tag);
    rc = job_spawn((uintptr_t)not_a_job, args, try_job_list, &r);
    if (r.pid) {
        child = open_pid(r.pid);
        alive = child && WaitForSingleObject(child, 0) == WAIT_TIMEOUT;
    }
    Sleep(300);   /* a child that had been resumed would have marked by now */
    ran = marks(tag, pids, MAXP);
    check(name, rc != 0 && r.process == 0 && !alive && ran == 0,
          "rc=%d stage=%d child_pid=%lu child_alive=%d child_ran=%d", rc, r.stage, (unsigned long)r.pid,
          alive, ran);
    if (child) CloseHandle(child);
    CloseHandle(not_a_job);
}

static void t_exit_code(uint32_t want) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    struct ct_job_wait_result w;
    char args[64], name[64];
    uint32_t code = 0;
    int rc, running = 1;
    long q;
    make_job(&job, &port);
    memset(&w, 0, sizeof w);
    snprintf(args, sizeof args, "exit %lu", (unsigned long)want);
    rc = job_spawn(job, args, 1, &r);
    if (rc == 0) rc = ct_job_wait_empty(job, port, 10000, &w);
    q = active_by_query(job);
    if (r.process) {
        ct_job_process_status(r.process, &running, &code);
        ct_job_close_take(r.process);
    }
    snprintf(name, sizeof name, "exit_code_passthrough_%lu", (unsigned long)want);
    check(name, rc == 0 && w.empty && q == 0 && !running && code == want,
          "rc=%d empty=%d port_zero=%d active_by_query=%ld exit=%lu", rc, w.empty, w.port_zero, q,
          (unsigned long)code);
    drop_job(job, port);
}

/* The worker starts a child that starts a grandchild, and exits: what it
 * left behind must still be in the job, and TerminateJobObject must empty
 * it, confirmed by query and by every process handle. */
static void t_tree(void) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    struct ct_job_wait_result w;
    struct ct_job_accounting acc;
    DWORD pids[MAXP];
    HANDLE h[MAXP];
    uint64_t listed_pids[8];
    uint32_t assigned = 0, listed = 0, code = 0, small_assigned = 0, small_listed = 0;
    char args[64];
    int rc, n, i, inside = 0, outside = 0, unknown = 0, running = 1, in_list = 0, exited = 0;
    int signalled = 0, code99 = 0, small_rc;
    long q;
    ULONGLONG t0;

    make_job(&job, &port);
    memset(&w, 0, sizeof w);
    snprintf(args, sizeof args, "chain 2 2 %d t_tree", LONG_SLEEP_MS);
    rc = job_spawn(job, args, 1, &r);
    n = rc == 0 ? wait_marks("t_tree", pids, 3, 10000) : 0;
    for (i = 0; i < n; i++) h[i] = open_pid(pids[i]);
    if (rc == 0) {
        ct_job_process_wait(r.process, 10000, &exited);
        ct_job_process_status(r.process, &running, &code);
    }
    for (i = 0; i < n; i++) {
        int v = in_job(h[i], job);
        if (pids[i] == r.pid) continue;   /* the worker has exited; its handle says nothing */
        inside += v == 1;
        outside += v == 0;
        unknown += v == -1;
    }
    ct_job_accounting(job, &acc);
    ct_job_pids(job, listed_pids, 8, &assigned, &listed);
    for (i = 0; i < n; i++)
        for (uint32_t k = 0; k < listed; k++)
            if (listed_pids[k] == pids[i]) in_list++;
    small_rc = ct_job_pids(job, listed_pids, 1, &small_assigned, &small_listed);
    check("worker_exit_code_with_descendants_alive", rc == 0 && exited && code == 7,
          "rc=%d exit=%lu", rc, (unsigned long)code);
    check("grandchildren_in_job",
          rc == 0 && n == 3 && inside == 2 && outside == 0 && acc.active == 2 && acc.total == 3 &&
              listed == 2 && in_list == 2,
          "marked=%d inside=%d outside=%d unknown=%d active=%lu total=%lu listed=%lu in_list=%d", n, inside,
          outside, unknown, (unsigned long)acc.active, (unsigned long)acc.total, (unsigned long)listed, in_list);
    check("pid_list_more_data", small_rc == ERROR_MORE_DATA && small_assigned == 2 && small_listed == 1,
          "rc=%d assigned=%lu listed=%lu", small_rc, (unsigned long)small_assigned, (unsigned long)small_listed);

    t0 = GetTickCount64();
    rc = ct_job_terminate(job, 99);
    if (rc == 0) rc = ct_job_wait_empty(job, port, 10000, &w);
    q = active_by_query(job);
    for (i = 0; i < n; i++) {
        DWORD c = 0;
        if (pids[i] == r.pid) continue;
        if (h[i] && WaitForSingleObject(h[i], 0) == WAIT_OBJECT_0) signalled++;
        if (h[i] && GetExitCodeProcess(h[i], &c) && c == 99) code99++;
    }
    check("terminate_job_empties_tree", rc == 0 && w.empty && q == 0 && signalled == 2 && code99 == 2,
          "rc=%d empty=%d active_by_query=%ld handles_signalled=%d exit99=%d ms=%llu", rc, w.empty, q,
          signalled, code99, (unsigned long long)(GetTickCount64() - t0));
    /* The port's word is taken only with the query's confirmation. */
    check("port_zero_confirmed_by_query", w.port_zero && w.empty && q == 0 && w.queries >= 1,
          "port_zero=%d queries=%lu new_process_msgs=%lu exit_msgs=%lu abnormal_msgs=%lu", w.port_zero,
          (unsigned long)w.queries, (unsigned long)w.new_processes, (unsigned long)w.exits,
          (unsigned long)w.abnormal_exits);
    for (i = 0; i < n; i++)
        if (h[i]) CloseHandle(h[i]);
    if (r.process) ct_job_close_take(r.process);
    drop_job(job, port);
}

static void t_breakaway(void) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    DWORD pids[MAXP];
    char buf[256], how[32] = "";
    unsigned long num = 0;
    int rc, n, i, outside = 0, unknown = 0;
    make_job(&job, &port);
    rc = job_spawn(job, "breakaway t_brk", 1, &r);
    wait_result("t_brk", buf, sizeof buf, 10000);
    sscanf(buf, "%31s %lu", how, &num);
    n = wait_marks("t_brk", pids, strcmp(how, "created") == 0 ? 2 : 1, 5000);
    for (i = 0; i < n; i++) {
        HANDLE p = open_pid(pids[i]);
        int v = in_job(p, job);
        outside += v == 0;
        unknown += v == -1;
        if (p) CloseHandle(p);
    }
    check("breakaway_flag_cannot_leave", rc == 0 && how[0] && outside == 0 && unknown == 0,
          "result=%s code_or_pid=%lu marked=%d outside=%d unknown=%d active=%ld", how[0] ? how : "none", num, n,
          outside, unknown, active_by_query(job));
    if (r.process) ct_job_close_take(r.process);
    drop_job(job, port);
}

static void t_nested_silent_breakaway(void) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    DWORD pids[MAXP];
    char buf[512], *p;
    int rc, n, i, outside = 0, unknown = 0, want;
    make_job(&job, &port);
    rc = job_spawn(job, "nest t_nest", 1, &r);
    wait_result("t_nest", buf, sizeof buf, 10000);
    /* the escaper's line comes last */
    for (i = 0; i < 100 && !strstr(buf, "explicit-"); i++) {
        Sleep(50);
        wait_result("t_nest", buf, sizeof buf, 1000);
    }
    want = strstr(buf, "explicit-created") ? 4 : 3;
    n = wait_marks("t_nest", pids, want, 5000);
    for (i = 0; i < n; i++) {
        HANDLE h = open_pid(pids[i]);
        int v = in_job(h, job);
        outside += v == 0;
        unknown += v == -1;
        if (h) CloseHandle(h);
    }
    for (p = buf; *p; p++)
        if (*p == '\n' || *p == ' ') *p = *p == '\n' ? ';' : ':';
    check("nested_job_silent_breakaway_stays_in", rc == 0 && n == want && outside == 0 && unknown == 0,
          "marked=%d want=%d outside=%d unknown=%d active=%ld result=%s", n, want, outside, unknown,
          active_by_query(job), buf);
    if (r.process) ct_job_close_take(r.process);
    drop_job(job, port);
}

/* Not a containment failure to hide: the documented reason for
 * `sealed: false`. The check holds when the escape is observed, so the
 * docs' claim is re-tested on every run. */
static void t_same_user_steal(void) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    char args[64], buf[256], how[32] = "";
    unsigned long num = 0;
    uint32_t flags_after = 0;
    int rc, outside = -1;
    make_job(&job, &port);
    snprintf(args, sizeof args, "steal %lu t_steal", (unsigned long)GetCurrentProcessId());
    rc = job_spawn(job, args, 1, &r);
    wait_result("t_steal", buf, sizeof buf, 20000);
    sscanf(buf, "%31s %lu", how, &num);
    ct_job_limits(job, &flags_after);
    if (strcmp(how, "escaped") == 0) {
        DWORD pids[MAXP];
        int n = wait_marks("t_steal", pids, 2, 5000), i;
        for (i = 0; i < n; i++) {
            HANDLE h;
            if (pids[i] != num) continue;
            h = OpenProcess(SYNCHRONIZE | PROCESS_QUERY_INFORMATION | PROCESS_TERMINATE, FALSE, pids[i]);
            outside = in_job(h, job) == 0;
            if (h) {
                TerminateProcess(h, 1);   /* outside the job: nothing else will end it */
                CloseHandle(h);
            }
        }
    }
    check("same_user_worker_can_steal_job_handle", rc == 0 && outside == 1,
          "result=%s pid_or_error=%lu escaped_outside=%d limits_after=0x%lx", how[0] ? how : "none", num, outside,
          (unsigned long)flags_after);
    if (r.process) ct_job_close_take(r.process);
    drop_job(job, port);
}

/* The same thief against the handle the owner really keeps (ct_job_restrict):
 * no handle value of the supervisor duplicates to SET_ATTRIBUTES, so the
 * job cannot be told to allow breakaway, and nothing leaves it. The probe
 * (every privilege of this token enabled) says the same from inside. */
static void t_restricted_steal(void) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    char args[64], buf[256], how[32] = "";
    unsigned long num = 0;
    uint32_t obtained = 0, enabled = 0;
    int rc, prc, marked;
    DWORD pids[MAXP];
    make_job(&job, &port);
    rc = ct_job_restrict(&job);
    prc = ct_job_probe(job, &obtained, &enabled);
    snprintf(args, sizeof args, "steal %lu t_rsteal", (unsigned long)GetCurrentProcessId());
    if (rc == 0) rc = job_spawn(job, args, 1, &r);
    wait_result("t_rsteal", buf, sizeof buf, 20000);
    sscanf(buf, "%31s %lu", how, &num);
    marked = wait_marks("t_rsteal", pids, 1, 5000);
    check("restricted_job_handle_cannot_be_stolen",
          rc == 0 && prc == 0 && obtained == 0 && marked == 1 && strcmp(how, "escaped") != 0,
          "result=%s detail=%lu probe_rc=%d obtained=0x%lx privileges_enabled=%lu marked=%d", how[0] ? how : "none",
          num, prc, (unsigned long)obtained, (unsigned long)enabled, marked);
    if (rc == 0 && r.process) ct_job_close_take(r.process);
    drop_job(job, port);
}

static void t_kill_on_close(void) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    DWORD pids[MAXP];
    HANDLE h[MAXP];
    char args[64];
    int rc, n, i, signalled = 0;
    ULONGLONG t0;
    make_job(&job, &port);
    snprintf(args, sizeof args, "chain 1 -1 %d t_close", LONG_SLEEP_MS);
    rc = job_spawn(job, args, 1, &r);
    n = rc == 0 ? wait_marks("t_close", pids, 2, 10000) : 0;
    for (i = 0; i < n; i++) h[i] = open_pid(pids[i]);
    t0 = GetTickCount64();
    ct_job_close_take(port);
    ct_job_close_take(job);   /* the last handle: KILL_ON_JOB_CLOSE */
    for (i = 0; i < n; i++)
        if (h[i] && WaitForSingleObject(h[i], 10000) == WAIT_OBJECT_0) signalled++;
    check("kill_on_job_close", rc == 0 && n == 2 && signalled == 2, "rc=%d marked=%d signalled=%d ms=%llu", rc, n,
          signalled, (unsigned long long)(GetTickCount64() - t0));
    for (i = 0; i < n; i++)
        if (h[i]) CloseHandle(h[i]);
    if (r.process) ct_job_close_take(r.process);
}

static void t_supervisor_death(void) {
    PROCESS_INFORMATION pi;
    DWORD pids[MAXP];
    HANDLE h[MAXP];
    int n, i, tree = 0, signalled = 0;
    ULONGLONG t0;
    if (!spawn_self("supervisor t_sup", 0, &pi)) {
        check("supervisor_death_kills_tree", 0, "create=%lu", (unsigned long)GetLastError());
        return;
    }
    n = wait_marks("t_sup", pids, 3, 10000);   /* the supervisor and a two-process tree */
    for (i = 0; i < n; i++) h[i] = pids[i] == pi.dwProcessId ? NULL : open_pid(pids[i]);
    t0 = GetTickCount64();
    TerminateProcess(pi.hProcess, 9);   /* a crash: nobody calls TerminateJobObject */
    WaitForSingleObject(pi.hProcess, 10000);
    for (i = 0; i < n; i++) {
        if (!h[i]) continue;
        tree++;
        if (WaitForSingleObject(h[i], 10000) == WAIT_OBJECT_0) signalled++;
        CloseHandle(h[i]);
    }
    check("supervisor_death_kills_tree", n == 3 && tree == 2 && signalled == 2,
          "marked=%d tree=%d signalled=%d ms=%llu", n, tree, signalled, (unsigned long long)(GetTickCount64() - t0));
    close_pi(&pi);
}

/* The harness's own census, through toolhelp rather than the job: every
 * other process running our executable, how many are alive, and how many
 * of those the job holds. */
static void census(uintptr_t job, int *alive, int *alive_in_job) {
    wchar_t self[MAX_PATH], *base;
    PROCESSENTRY32W e;
    HANDLE snap;
    *alive = *alive_in_job = 0;
    GetModuleFileNameW(NULL, self, MAX_PATH);
    base = wcsrchr(self, L'\\') ? wcsrchr(self, L'\\') + 1 : self;
    snap = CreateToolhelp32Snapshot(TH32CS_SNAPPROCESS, 0);
    if (snap == INVALID_HANDLE_VALUE) {
        *alive = -1;
        return;
    }
    e.dwSize = sizeof e;
    if (Process32FirstW(snap, &e)) do {
        HANDLE h;
        if (e.th32ProcessID == GetCurrentProcessId() || _wcsicmp(e.szExeFile, base) != 0) continue;
        h = open_pid(e.th32ProcessID);
        if (h == NULL) continue;   /* gone between the snapshot and the open */
        if (WaitForSingleObject(h, 0) == WAIT_TIMEOUT) {
            (*alive)++;
            if (in_job(h, job) == 1) (*alive_in_job)++;
        }
        CloseHandle(h);
    } while (Process32NextW(snap, &e));
    CloseHandle(snap);
}

/* TerminateJobObject while the tree is still forking: whatever was born
 * during the kill must be in the job and die too. */
static void t_storm(void) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    struct ct_job_wait_result w;
    DWORD pids[MAXP];
    int rc, n_before, n, i, rounds = 0, alive = 0, unknown = 0, ok, c_alive, c_in_job;
    long q;
    make_job(&job, &port);
    memset(&w, 0, sizeof w);
    rc = job_spawn(job, "storm t_storm 4", 1, &r);
    n_before = rc == 0 ? wait_marks("t_storm", pids, 6, 10000) : 0;
    while (rc == 0 && rounds < 3) {
        rounds++;
        if ((rc = ct_job_terminate(job, 1))) break;
        if ((rc = ct_job_wait_empty(job, port, 5000, &w))) break;
        if (w.empty) break;
    }
    Sleep(300);   /* a process that escaped would go on marking */
    q = active_by_query(job);
    n = marks("t_storm", pids, MAXP);
    for (i = 0; i < n; i++) {
        HANDLE h = open_pid(pids[i]);
        if (h == NULL) {
            if (GetLastError() != ERROR_INVALID_PARAMETER) unknown++;   /* INVALID_PARAMETER: no such pid */
            continue;
        }
        if (WaitForSingleObject(h, 0) != WAIT_OBJECT_0) alive++;
        CloseHandle(h);
    }
    census(job, &c_alive, &c_in_job);
    ok = rc == 0 && w.empty && q == 0 && alive == 0 && unknown == 0 && c_alive == 0;
    /* Wine, about one run in thirty: a child whose creation raced the kill
     * stays counted in ActiveProcesses although no process of ours is alive
     * by toolhelp. The wait must then say "not empty" (it did, or ok would
     * hold): the owner loop reports UNCONFIRMED and retries, never REAPED. */
    if (!ok && wine_version && rc == 0 && !w.empty && q > 0 && alive == 0 && unknown == 0 && c_alive == 0)
        ok = SKIP;
    check("terminate_during_spawn_storm", ok,
          "rc=%d marked_at_kill=%d marked_total=%d rounds=%d empty=%d active_by_query=%ld alive=%d unknown=%d "
          "census_alive=%d census_in_job=%d new_process_msgs=%lu%s",
          rc, n_before, n, rounds, w.empty, q, alive, unknown, c_alive, c_in_job, (unsigned long)w.new_processes,
          ok == SKIP ? " gap=wine_active_count_stuck_after_kill_during_creation" : "");
    if (r.process) ct_job_close_take(r.process);
    drop_job(job, port);
}

static void t_accounting(void) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    struct ct_job_wait_result w;
    struct ct_job_accounting acc;
    int rc, ok;
    make_job(&job, &port);
    memset(&w, 0, sizeof w);
    memset(&acc, 0, sizeof acc);
    rc = job_spawn(job, "spin 300", 1, &r);
    if (rc == 0) rc = ct_job_wait_empty(job, port, 10000, &w);
    if (rc == 0) rc = ct_job_accounting(job, &acc);
    ok = rc == 0 && w.empty && acc.user_100ns + acc.kernel_100ns > 0 && acc.total == 1;
    /* Wine fills only TotalProcesses and ActiveProcesses (sync.c). */
    if (!ok && wine_version && rc == 0 && w.empty && acc.total == 1 && acc.user_100ns + acc.kernel_100ns == 0)
        ok = SKIP;
    check("accounting_cpu_time", ok, "rc=%d user_ms=%llu kernel_ms=%llu total=%lu terminated=%lu%s", rc,
          (unsigned long long)(acc.user_100ns / 10000), (unsigned long long)(acc.kernel_100ns / 10000),
          (unsigned long)acc.total, (unsigned long)acc.terminated,
          ok == SKIP ? " gap=wine_accounting_times_zero" : "");
    if (r.process) ct_job_close_take(r.process);
    drop_job(job, port);
}

static void t_not_found(void) {
    uintptr_t job, port;
    struct ct_job_spawn_result r;
    struct ct_job_spawn_args a;
    long q;
    int rc;
    make_job(&job, &port);
    memset(&a, 0, sizeof a);
    a.job = job;
    a.command_line = "\"C:\\no\\such\\program.exe\" x";
    a.try_job_list = 1;
    rc = ct_job_spawn(&a, &r);
    q = active_by_query(job);
    check("spawn_not_found_is_reported", rc == ERROR_FILE_NOT_FOUND || rc == ERROR_PATH_NOT_FOUND,
          "rc=%d stage=%d process=%llu active=%ld", rc, r.stage, (unsigned long long)r.process, q);
    drop_job(job, port);
}

static int harness(void) {
    ULONGLONG t0 = GetTickCount64();
    typedef const char *(*version_fn)(void);
    version_fn wine_get_version =
        (version_fn)(void *)GetProcAddress(GetModuleHandleA("ntdll.dll"), "wine_get_version");
    wine_version = wine_get_version ? wine_get_version() : NULL;
    printf("PLATFORM wine=%s\n", wine_version ? wine_version : "no");
    t_limits();
    t_first_instruction("first_instruction_in_job_job_list", 1, CT_JOB_VIA_JOB_LIST);
    t_first_instruction("first_instruction_in_job_suspended", 0, CT_JOB_VIA_SUSPENDED);
    t_assign_failure("assign_failure_discards_child", 0, "t_af0");
    t_assign_failure("assign_failure_discards_child_job_list", 1, "t_af1");
    t_not_found();
    t_exit_code(0);
    t_exit_code(42);
    t_exit_code(259);          /* STILL_ACTIVE: must not read as running */
    t_exit_code(0xC0000005u);  /* an NTSTATUS, above INT_MAX */
    t_tree();
    t_breakaway();
    t_nested_silent_breakaway();
    t_same_user_steal();
    t_restricted_steal();
    t_kill_on_close();
    t_supervisor_death();
    t_storm();
    t_accounting();
    printf("SUMMARY checks=%d failed=%d skipped=%d ms=%llu\n", n_checks, n_failed, n_skipped,
           (unsigned long long)(GetTickCount64() - t0));
    fflush(stdout);
    return n_failed ? 1 : 0;
}

int main(int argc, char **argv) {
    wchar_t wpath[MAX_PATH];
    GetModuleFileNameW(NULL, wpath, MAX_PATH);
    WideCharToMultiByte(CP_UTF8, 0, wpath, -1, self_utf8, sizeof self_utf8, NULL, NULL);
    if (argc < 2) return harness();
    if (!strcmp(argv[1], "injob")) return role_injob();
    if (!strcmp(argv[1], "exit") && argc > 2) return (int)strtoul(argv[2], NULL, 10);
    if (!strcmp(argv[1], "mark") && argc > 2) {
        mark(argv[2]);
        return 0;
    }
    if (!strcmp(argv[1], "marksleep") && argc > 2) {
        mark(argv[2]);
        Sleep(LONG_SLEEP_MS);
        return 0;
    }
    if (!strcmp(argv[1], "chain") && argc > 5)
        return role_chain(atoi(argv[2]), atoi(argv[3]), strtoul(argv[4], NULL, 10), argv[5]);
    if (!strcmp(argv[1], "breakaway") && argc > 2) return role_breakaway(argv[2]);
    if (!strcmp(argv[1], "nest") && argc > 2) return role_nest(argv[2]);
    if (!strcmp(argv[1], "escaper") && argc > 2) return role_escaper(argv[2]);
    if (!strcmp(argv[1], "steal") && argc > 3) return role_steal(strtoul(argv[2], NULL, 10), argv[3]);
    if (!strcmp(argv[1], "storm") && argc > 3) return role_storm(argv[2], atoi(argv[3]));
    if (!strcmp(argv[1], "supervisor") && argc > 2) return role_supervisor(argv[2]);
    if (!strcmp(argv[1], "spin") && argc > 2) return role_spin(strtoul(argv[2], NULL, 10));
    fprintf(stderr, "unknown role %s\n", argv[1]);
    return 64;
}
