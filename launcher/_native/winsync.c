/* Windows waiting and file primitives: one completion port that every
 * input of the owner loop posts to, named events for cross-process pokes,
 * the console control hook, and the owner lock.
 *
 * Why a completion port and not WaitForMultipleObjects: the Job Object
 * reports to a completion port only (JOBOBJECT_ASSOCIATE_COMPLETION_PORT),
 * and a port is not a waitable object. So the other inputs are turned into
 * packets on that same port: RegisterWaitForSingleObject runs a callback on
 * a thread-pool wait thread when the worker's process handle or the cancel
 * event is signalled, and the callback posts (PostQueuedCompletionStatus).
 * The owner blocks in GetQueuedCompletionStatusEx with its next deadline as
 * the timeout: no polling loop.
 *
 * Packets are wake-ups, never evidence: the job's messages are "not
 * guaranteed" (Microsoft's page on JOBOBJECT_ASSOCIATE_COMPLETION_PORT), so
 * emptiness is always a QueryInformationJobObject, and a process exit is
 * always the handle's signalled state, read again by the caller.
 */
#include "winsync.h"

#ifndef _WIN32
#error "winsync.c is Windows code: build.py lists it for win32 only"
#endif
#ifndef _WIN32_WINNT
#define _WIN32_WINNT 0x0A00
#endif
#include <windows.h>
#include <aclapi.h>
#include <string.h>

#define CT_SYNC_BATCH 64
/* Stop draining after this many batches: a flood of packets must not keep
 * the owner from looking at its inputs. */
#define CT_SYNC_MAX_BATCHES 16
#define CT_SYNC_CTRL_PORTS 64

static int last_error(void) {
    DWORD e = GetLastError();
    return e ? (int)e : (int)ERROR_GEN_FAILURE;
}

static int widen(const char *s, wchar_t *out, int cap) {
    int n = MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, s, -1, out, cap);
    return n > 0 ? 0 : last_error();
}

int ct_sync_port_create(uintptr_t *port) {
    HANDLE p = CreateIoCompletionPort(INVALID_HANDLE_VALUE, NULL, 0, 1);
    *port = (uintptr_t)p;
    return p ? 0 : last_error();
}

int ct_sync_post(uintptr_t port, uintptr_t key, uint32_t value) {
    return PostQueuedCompletionStatus((HANDLE)port, value, key, NULL) ? 0 : last_error();
}

static void count(struct ct_sync_wait_result *r, const OVERLAPPED_ENTRY *e, uintptr_t job) {
    r->packets++;
    if (job && e->lpCompletionKey == (ULONG_PTR)job) {
        r->job_messages++;
        switch (e->dwNumberOfBytesTransferred) {
        case JOB_OBJECT_MSG_NEW_PROCESS: r->job_new_process++; break;
        case JOB_OBJECT_MSG_EXIT_PROCESS: r->job_exit_process++; break;
        case JOB_OBJECT_MSG_ABNORMAL_EXIT_PROCESS: r->job_abnormal_exit++; break;
        case JOB_OBJECT_MSG_ACTIVE_PROCESS_ZERO: r->job_active_zero++; break;
        case JOB_OBJECT_MSG_JOB_MEMORY_LIMIT: r->job_memory_limit++; break;
        case JOB_OBJECT_MSG_ACTIVE_PROCESS_LIMIT: r->job_process_limit++; break;
        default: break;
        }
        return;
    }
    switch (e->lpCompletionKey) {
    case CT_SYNC_KEY_PROCESS: r->process_exits++; break;
    case CT_SYNC_KEY_EVENT: r->events++; break;
    case CT_SYNC_KEY_WAKE: r->wakes++; break;
    case CT_SYNC_KEY_CTRL:
        r->ctrls++;
        r->last_ctrl = e->dwNumberOfBytesTransferred;
        break;
    default: r->other++; break;
    }
}

int ct_sync_wait(uintptr_t port, uintptr_t job, uint32_t timeout_ms, struct ct_sync_wait_result *r) {
    OVERLAPPED_ENTRY e[CT_SYNC_BATCH];
    ULONG n = 0, i;
    DWORD ms = timeout_ms;
    int batch;
    memset(r, 0, sizeof *r);
    for (batch = 0; batch < CT_SYNC_MAX_BATCHES; batch++) {
        if (!GetQueuedCompletionStatusEx((HANDLE)port, e, CT_SYNC_BATCH, &n, ms, FALSE)) {
            DWORD err = GetLastError();
            if (err == WAIT_TIMEOUT) return 0;
            return err ? (int)err : ERROR_GEN_FAILURE;
        }
        for (i = 0; i < n; i++) count(r, &e[i], job);
        if (n < CT_SYNC_BATCH) return 0;
        ms = 0;   /* the first batch was full: take what else is queued, without blocking */
    }
    return 0;
}

struct watch {
    HANDLE port;
    ULONG_PTR key;
    HANDLE wait;
};

/* On a thread-pool wait thread (WT_EXECUTEINWAITTHREAD): post and return. */
static VOID CALLBACK on_signalled(PVOID ctx, BOOLEAN timed_out) {
    struct watch *w = ctx;
    (void)timed_out;   /* INFINITE: never */
    PostQueuedCompletionStatus(w->port, 0, w->key, NULL);
}

int ct_sync_watch(uintptr_t port, uintptr_t object, uintptr_t key, int once, uintptr_t *watch) {
    struct watch *w;
    ULONG flags = WT_EXECUTEINWAITTHREAD | (once ? WT_EXECUTEONLYONCE : 0);
    *watch = 0;
    w = HeapAlloc(GetProcessHeap(), HEAP_ZERO_MEMORY, sizeof *w);
    if (w == NULL) return ERROR_NOT_ENOUGH_MEMORY;
    w->port = (HANDLE)port;
    w->key = key;
    if (!RegisterWaitForSingleObject(&w->wait, (HANDLE)object, on_signalled, w, INFINITE, flags)) {
        int e = last_error();
        HeapFree(GetProcessHeap(), 0, w);
        return e;
    }
    *watch = (uintptr_t)w;
    return 0;
}

int ct_sync_unwatch_take(uintptr_t watch) {
    struct watch *w = (struct watch *)watch;
    int rc = 0;
    if (w == NULL) return ERROR_INVALID_PARAMETER;
    /* INVALID_HANDLE_VALUE: return only once no callback runs any more, so
     * nothing posts to a port the caller is about to close. */
    if (!UnregisterWaitEx(w->wait, INVALID_HANDLE_VALUE)) rc = last_error();
    HeapFree(GetProcessHeap(), 0, w);
    return rc;
}

int ct_sync_event_create(const char *name, uintptr_t *event, int *existed) {
    wchar_t wname[MAX_PATH];
    HANDLE h;
    int rc;
    *event = 0;
    *existed = 0;
    if ((rc = widen(name, wname, MAX_PATH))) return rc;
    /* Auto-reset: each SetEvent satisfies the registered wait once, and the
     * wait resets it, so a poke is one packet rather than a stream. */
    h = CreateEventW(NULL, FALSE, FALSE, wname);
    if (h == NULL) return last_error();
    *existed = GetLastError() == ERROR_ALREADY_EXISTS;
    *event = (uintptr_t)h;
    return 0;
}

int ct_sync_event_set(const char *name) {
    wchar_t wname[MAX_PATH];
    HANDLE h;
    int rc;
    if ((rc = widen(name, wname, MAX_PATH))) return rc;
    h = OpenEventW(EVENT_MODIFY_STATE, FALSE, wname);
    if (h == NULL) return last_error();
    rc = SetEvent(h) ? 0 : last_error();
    CloseHandle(h);
    return rc;
}

int ct_sync_owned_by_caller(uintptr_t handle, int se_type, int *mine) {
    union {
        TOKEN_USER user;
        TOKEN_OWNER owner;
        unsigned char bytes[512];
    } tu, to;
    PSID owner = NULL;
    PSECURITY_DESCRIPTOR sd = NULL;
    HANDLE tok = NULL;
    DWORD len, e;
    int rc = 0;
    *mine = 0;
    e = GetSecurityInfo((HANDLE)handle, (SE_OBJECT_TYPE)se_type, OWNER_SECURITY_INFORMATION, &owner, NULL,
                        NULL, NULL, &sd);
    if (e != ERROR_SUCCESS) return (int)e;
    if (!OpenProcessToken(GetCurrentProcess(), TOKEN_QUERY, &tok) ||
        !GetTokenInformation(tok, TokenUser, &tu, sizeof tu, &len) ||
        !GetTokenInformation(tok, TokenOwner, &to, sizeof to, &len)) {
        rc = last_error();
    } else if (owner == NULL) {
        *mine = -1;   /* no owner recorded (Wine keeps none for objects made without a descriptor) */
    } else {
        *mine = EqualSid(owner, tu.user.User.Sid) || EqualSid(owner, to.owner.Owner);
    }
    if (tok) CloseHandle(tok);
    LocalFree(sd);
    return rc;
}

static SRWLOCK ctrl_lock = SRWLOCK_INIT;
static HANDLE ctrl_ports[CT_SYNC_CTRL_PORTS];
static int ctrl_installed;

/* Handlers run last-registered first, on a thread of their own. CPython's C
 * runtime installs its handler at start-up (signal(SIGINT)), so ours runs
 * before it; returning FALSE passes the event on to it. */
static BOOL WINAPI ctrl_handler(DWORD type) {
    int i;
    AcquireSRWLockShared(&ctrl_lock);
    for (i = 0; i < CT_SYNC_CTRL_PORTS; i++)
        if (ctrl_ports[i]) PostQueuedCompletionStatus(ctrl_ports[i], type, CT_SYNC_KEY_CTRL, NULL);
    ReleaseSRWLockShared(&ctrl_lock);
    return FALSE;
}

int ct_sync_ctrl_forward(uintptr_t port, int on) {
    int i, rc = 0, done = 0;
    AcquireSRWLockExclusive(&ctrl_lock);
    if (on) {
        if (!ctrl_installed) {
            if (SetConsoleCtrlHandler(ctrl_handler, TRUE))
                ctrl_installed = 1;
            else
                rc = last_error();
        }
        for (i = 0; rc == 0 && !done && i < CT_SYNC_CTRL_PORTS; i++)
            if (ctrl_ports[i] == NULL || ctrl_ports[i] == (HANDLE)port) {
                ctrl_ports[i] = (HANDLE)port;
                done = 1;
            }
        if (rc == 0 && !done) rc = ERROR_NO_SYSTEM_RESOURCES;
    } else {
        for (i = 0; i < CT_SYNC_CTRL_PORTS; i++)
            if (ctrl_ports[i] == (HANDLE)port) ctrl_ports[i] = NULL;
    }
    ReleaseSRWLockExclusive(&ctrl_lock);
    return rc;
}

int ct_sync_lock(uintptr_t file, int exclusive, int fail_immediately) {
    OVERLAPPED ov;
    DWORD flags = (exclusive ? LOCKFILE_EXCLUSIVE_LOCK : 0) | (fail_immediately ? LOCKFILE_FAIL_IMMEDIATELY : 0);
    ZeroMemory(&ov, sizeof ov);   /* offset 0 */
    return LockFileEx((HANDLE)file, flags, 0, 1, 0, &ov) ? 0 : last_error();
}

int ct_sync_unlock(uintptr_t file) {
    OVERLAPPED ov;
    ZeroMemory(&ov, sizeof ov);
    return UnlockFileEx((HANDLE)file, 0, 1, 0, &ov) ? 0 : last_error();
}

/* One byte at `offset` (far past any data: appenders serialise on it, and
 * readers of the data never touch it, since Windows byte-range locks are
 * mandatory). Waits unless fail_immediately. */
int ct_sync_lock_at(uintptr_t file, uint64_t offset, int fail_immediately) {
    OVERLAPPED ov;
    DWORD flags = LOCKFILE_EXCLUSIVE_LOCK | (fail_immediately ? LOCKFILE_FAIL_IMMEDIATELY : 0);
    ZeroMemory(&ov, sizeof ov);
    ov.Offset = (DWORD)offset;
    ov.OffsetHigh = (DWORD)(offset >> 32);
    return LockFileEx((HANDLE)file, flags, 0, 1, 0, &ov) ? 0 : last_error();
}

int ct_sync_unlock_at(uintptr_t file, uint64_t offset) {
    OVERLAPPED ov;
    ZeroMemory(&ov, sizeof ov);
    ov.Offset = (DWORD)offset;
    ov.OffsetHigh = (DWORD)(offset >> 32);
    return UnlockFileEx((HANDLE)file, 0, 1, 0, &ov) ? 0 : last_error();
}
