#ifndef CT_WINSYNC_H
#define CT_WINSYNC_H
/* Windows waiting and file primitives for the owner loop and the run
 * directory (launcher/_platform/winsync.py, winfs.py).
 *
 * Windows only. Handles cross into Python as uintptr_t; every function
 * returns 0 or the GetLastError() code. Strings are UTF-8.
 *
 * The owner loop blocks in one place: GetQueuedCompletionStatusEx on the
 * run's I/O completion port, the port the Job Object already posts its
 * messages to. Everything else that must wake it posts a packet there:
 * a thread-pool wait on the worker's process handle, one on a named event
 * that cancel requesters set, an in-process post, and (optionally) the
 * console control handler. Keys are odd; the job posts with its handle
 * value as the key, and handle values are multiples of 4. */
#include <stdint.h>

enum {
    CT_SYNC_KEY_PROCESS = 1,   /* a watched process handle was signalled (it exited) */
    CT_SYNC_KEY_EVENT = 3,     /* a watched event was set (a cross-process poke) */
    CT_SYNC_KEY_WAKE = 5,      /* ct_sync_post from this process */
    CT_SYNC_KEY_CTRL = 7,      /* a console control event; the byte count is its type */
};

/* What one ct_sync_wait dequeued (zeroed by each call). */
struct ct_sync_wait_result {
    uint32_t packets;
    uint32_t job_messages;      /* key == the job: a JOB_OBJECT_MSG_* in the byte count */
    uint32_t job_new_process;
    uint32_t job_exit_process;
    uint32_t job_abnormal_exit;
    uint32_t job_active_zero;
    uint32_t process_exits;
    uint32_t events;
    uint32_t wakes;
    uint32_t ctrls;
    uint32_t last_ctrl;         /* CTRL_C_EVENT 0, CTRL_BREAK_EVENT 1, CTRL_CLOSE_EVENT 2, ... */
    uint32_t other;
    uint32_t job_memory_limit;  /* JOB_OBJECT_MSG_JOB_MEMORY_LIMIT: an allocation failed at the job's limit */
    uint32_t job_process_limit; /* JOB_OBJECT_MSG_ACTIVE_PROCESS_LIMIT: a process refused at the job's limit */
};

int ct_sync_port_create(uintptr_t *port);
int ct_sync_post(uintptr_t port, uintptr_t key, uint32_t value);
/* Block until the first packet or timeout_ms (INFINITE: 0xFFFFFFFF), then
 * take whatever else is queued without blocking. A timeout is not an error. */
int ct_sync_wait(uintptr_t port, uintptr_t job, uint32_t timeout_ms, struct ct_sync_wait_result *r);

/* RegisterWaitForSingleObject on `object`; each time it is signalled a
 * packet with `key` is posted to `port` (once: only the first time, for a
 * process handle that stays signalled). The port and the object must
 * outlive the watch; ct_sync_unwatch_take waits for a running callback. */
int ct_sync_watch(uintptr_t port, uintptr_t object, uintptr_t key, int once, uintptr_t *watch);
int ct_sync_unwatch_take(uintptr_t watch);

/* An auto-reset named event (`Local\...`). existed = 1 if the name was taken
 * already: the handle then refers to someone else's object. */
int ct_sync_event_create(const char *name, uintptr_t *event, int *existed);
/* Open the named event for EVENT_MODIFY_STATE, set it, close it.
 * ERROR_FILE_NOT_FOUND: nobody holds that name. */
int ct_sync_event_set(const char *name);
/* Whether the owner in the object's security descriptor is this process's
 * user or its default owner (an elevated administrator's objects are owned
 * by BUILTIN\Administrators): 1 yes, 0 no, -1 the descriptor names no owner.
 * se_type: SE_FILE_OBJECT 1, SE_KERNEL_OBJECT 6. */
int ct_sync_owned_by_caller(uintptr_t handle, int se_type, int *mine);

/* Forward console control events to `port` as CT_SYNC_KEY_CTRL packets
 * (on = 0: stop). The handler returns FALSE, so CPython's own handling
 * (KeyboardInterrupt, signal.SIGBREAK) still runs after it. */
int ct_sync_ctrl_forward(uintptr_t port, int on);

/* LockFileEx on byte 0 of `file` (one byte: the owner lock). exclusive = 0
 * takes a shared lock (the probe); fail_immediately = 1 returns
 * ERROR_LOCK_VIOLATION instead of waiting. */
int ct_sync_lock(uintptr_t file, int exclusive, int fail_immediately);
int ct_sync_unlock(uintptr_t file);
/* An exclusive lock of the byte at `offset` (appenders serialise on one far
 * past the data), and its release. */
int ct_sync_lock_at(uintptr_t file, uint64_t offset, int fail_immediately);
int ct_sync_unlock_at(uintptr_t file, uint64_t offset);
#endif
