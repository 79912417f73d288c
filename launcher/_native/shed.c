#define _GNU_SOURCE
/* What a wall's init keeps of its supervisor's memory: what it needs.
 *
 * The init is a clone of the supervisor without CLONE_VM, and it never
 * execs: until it exits, every page of the supervisor it inherited is
 * shared copy-on-write with it. The supervisor then pays a copy on the
 * first write to each such page (writing 32 MiB of a live bytearray took
 * 19.7 ms with an init alive, 0.53 ms without), and the init holds on to
 * the old copies: a library caller with a large heap grows by that heap
 * for as long as a run lives, once per live run.
 *
 * So the init first copies what it needs (the spawn's arguments and all
 * they point to: paths, argv, envp, descriptors) into a fresh mapping of
 * its own, then unmaps the large private anonymous mappings it inherited
 * (the malloc heap, Python's arenas, large buffers, other threads'
 * stacks). A page the supervisor writes afterwards is mapped by it alone,
 * and the write fault reuses the page in place (do_wp_page,
 * wp_can_reuse_anon_folio in mm/memory.c: nothing is copied for a page no
 * other process maps).
 *
 * Kept: every file mapping (code, the libraries' data), every anonymous
 * mapping under 1 MiB (the libraries' .bss among them: glibc's state stays
 * whole), the mapping this thread's stack is in, the one its TLS is in
 * (glibc's thread descriptor: errno, the stack guard), [stack], and the
 * copy. The init and the worker it forks run only our code, with system
 * calls and no allocation (init.c, child.c); unmapped rather than
 * MADV_DONTNEED, so that a dependency missed here faults at once instead
 * of reading zeros. */
#include "shed.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CT_SHED_MIN (1UL << 20)     /* anonymous mappings smaller than this are kept */
#define CT_SHED_MAX_RANGES 8192

struct arena {
    char *base;     /* NULL: only measure */
    size_t used;
};

static void *put(struct arena *ar, const void *src, size_t n) {
    size_t at = (ar->used + 15) & ~(size_t)15;
    ar->used = at + n;
    if (!ar->base) return (void *)(uintptr_t)1;   /* non-NULL, never dereferenced */
    if (src) memcpy(ar->base + at, src, n);
    return ar->base + at;
}

static char *put_str(struct arena *ar, const char *s) {
    return s ? put(ar, s, strlen(s) + 1) : NULL;
}

/* n < 0: NULL-terminated. */
static char **put_strv(struct arena *ar, const char *const *v, int n) {
    if (!v) return NULL;
    int count = 0;
    if (n < 0) {
        while (v[count]) count++;
    } else {
        count = n;
    }
    char **out = put(ar, NULL, sizeof(char *) * (size_t)(count + (n < 0 ? 1 : 0)));
    for (int i = 0; i < count; i++) {
        char *s = put_str(ar, v[i]);
        if (ar->base) out[i] = s;
    }
    if (ar->base && n < 0) out[count] = NULL;
    return out;
}

static void *put_ints(struct arena *ar, const void *v, int n, size_t size) {
    return (v && n > 0) ? put(ar, v, size * (size_t)n) : NULL;
}

/* One pass: with ar->base NULL it only measures. */
static void copy_args(struct arena *ar, const struct ct_spawn_args *a, const struct ct_wall_args *w,
                      struct ct_spawn_args **ao, struct ct_wall_args **wo) {
    struct ct_spawn_args *na = put(ar, a, sizeof *a);
    struct ct_wall_args *nw = put(ar, w, sizeof *w);
    const char *const *paths = (const char *const *)put_strv(ar, a->paths, a->npaths);
    char *const *argv = put_strv(ar, (const char *const *)a->argv, -1);
    char *const *envp = put_strv(ar, (const char *const *)a->envp, -1);
    const char *cwd = put_str(ar, a->cwd);
    const int *join = put_ints(ar, a->join_fds, a->njoin, sizeof(int));
    const char *const *expect = (const char *const *)put_strv(ar, a->cg_expect, a->ncg_expect);
    const unsigned int *groups = put_ints(ar, a->groups, a->ngroups, sizeof(unsigned int));
    const int *drop = put_ints(ar, a->drop_caps, a->ndrop, sizeof(int));
    const int *pass = put_ints(ar, a->pass_fds, a->npass, sizeof(int));
    const char *shell = put_str(ar, a->shell);
    char **shell_argv = put_strv(ar, (const char *const *)a->shell_argv, -1);
    const char *uid_map = put_str(ar, w->uid_map);
    const char *gid_map = put_str(ar, w->gid_map);
    const char *hide = put_str(ar, w->hide);
    if (!ar->base) return;
    na->paths = paths;
    na->argv = argv;
    na->envp = envp;
    na->cwd = cwd;
    na->join_fds = join;
    na->cg_expect = expect;
    na->groups = groups;
    na->drop_caps = drop;
    na->pass_fds = pass;
    na->shell = shell;
    na->shell_argv = shell_argv;
    nw->uid_map = uid_map;
    nw->gid_map = gid_map;
    nw->hide = hide;
    *ao = na;
    *wo = nw;
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static const char *parse_hex(const char *p, const char *end, uintptr_t *v) {
    uintptr_t x = 0;
    int d, any = 0;
    while (p < end && (d = hexval((unsigned char)*p)) >= 0) {
        x = x * 16 + (uintptr_t)d;
        p++;
        any = 1;
    }
    *v = x;
    return any ? p : NULL;
}

static const char *skip_field(const char *p, const char *end) {
    while (p < end && *p == ' ') p++;
    while (p < end && *p != ' ') p++;
    return p;
}

struct keep {
    uintptr_t addr[3];
    uintptr_t arena_lo, arena_hi;
};

/* One line of /proc/self/maps (proc(5)): "lo-hi perms offset dev inode   path". */
static int sheddable(const char *p, const char *end, const struct keep *k, uintptr_t *lo, uintptr_t *hi) {
    p = parse_hex(p, end, lo);
    if (!p || p >= end || *p != '-') return 0;
    p = parse_hex(p + 1, end, hi);
    if (!p || p + 5 > end || p[0] != ' ') return 0;
    const char *perms = p + 1;
    if (perms[1] != 'w' || perms[3] != 'p') return 0;      /* private and writable */
    p = skip_field(p, end);           /* perms */
    p = skip_field(p, end);           /* offset */
    p = skip_field(p, end);           /* dev */
    while (p < end && *p == ' ') p++;
    if (p >= end || *p != '0' || (p + 1 < end && p[1] != ' ')) return 0;   /* inode 0: no file */
    p++;
    while (p < end && *p == ' ') p++;
    size_t plen = (size_t)(end - p);
    int heap = plen == 6 && memcmp(p, "[heap]", 6) == 0;
    int anon = plen == 0 || heap || (plen > 6 && memcmp(p, "[anon:", 6) == 0);
    if (!anon) return 0;              /* [stack], [vdso], [vvar], ... */
    if (!heap && *hi - *lo < CT_SHED_MIN) return 0;
    for (int i = 0; i < 3; i++)
        if (k->addr[i] >= *lo && k->addr[i] < *hi) return 0;
    if (k->arena_lo < *hi && k->arena_hi > *lo) return 0;
    return 1;
}

int ct_shed(const struct ct_spawn_args **a, const struct ct_wall_args **w, int *n_unmapped) {
    struct arena ar = {NULL, 0};
    struct ct_spawn_args *na;
    struct ct_wall_args *nw;
    *n_unmapped = 0;
    copy_args(&ar, *a, *w, &na, &nw);
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t ranges_at = (ar.used + 15) & ~(size_t)15;
    size_t size = (ranges_at + sizeof(uintptr_t) * 2 * CT_SHED_MAX_RANGES + 65536 + page - 1) & ~(page - 1);
    char *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return -errno;
    ar.base = base;
    ar.used = 0;
    copy_args(&ar, *a, *w, &na, &nw);
    uintptr_t *ranges = (uintptr_t *)(base + ranges_at);
    char *buf = (char *)(ranges + 2 * CT_SHED_MAX_RANGES);
    size_t cap = 65536;

    int local;
    struct keep k;
    k.addr[0] = (uintptr_t)&local;              /* this thread's stack */
    k.addr[1] = (uintptr_t)&errno;              /* its TLS, next to glibc's thread descriptor */
    k.addr[2] = (uintptr_t)__builtin_frame_address(0);
    k.arena_lo = (uintptr_t)base;
    k.arena_hi = (uintptr_t)base + size;

    int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        *a = na;          /* the copy is complete: use it all the same */
        *w = nw;
        return -e;
    }
    int n = 0, rc = 0;
    size_t have = 0;
    for (;;) {
        ssize_t got = read(fd, buf + have, cap - have);
        if (got < 0) {
            if (errno == EINTR) continue;
            rc = -errno;
            break;
        }
        have += (size_t)got;
        size_t start = 0;
        for (size_t i = 0; i < have; i++) {
            if (buf[i] != '\n') continue;
            uintptr_t lo, hi;
            if (n < CT_SHED_MAX_RANGES && sheddable(buf + start, buf + i, &k, &lo, &hi)) {
                ranges[2 * n] = lo;
                ranges[2 * n + 1] = hi;
                n++;
            }
            start = i + 1;
        }
        memmove(buf, buf + start, have - start);
        have -= start;
        if (got == 0 || have == cap) break;    /* EOF, or a line longer than the buffer */
    }
    close(fd);
    *a = na;
    *w = nw;
    if (rc < 0) return rc;
    for (int i = 0; i < n; i++) {
        if (munmap((void *)ranges[2 * i], ranges[2 * i + 1] - ranges[2 * i]) == 0) (*n_unmapped)++;
    }
    return 0;
}

/* -- The arguments of an exec'd init ----------------------------------------
 *
 * An init that is exec'd (wall.c: the image built from initbin/) has none
 * of the supervisor's memory: its arguments go over in a memfd, laid out
 * as the copy above, with every pointer an offset from the start (no
 * address of the supervisor's goes with them: the init's command line is
 * world-readable). The init maps it wherever it can and adds where
 * (ct_args_relocate). */

int ct_args_image(const struct ct_spawn_args *a, const struct ct_wall_args *w, int *memfd, size_t *len,
                  struct stat *st) {
    struct arena ar = {NULL, 0};
    struct ct_spawn_args *na;
    struct ct_wall_args *nw;
    copy_args(&ar, a, w, &na, &nw);
    size_t size = (ar.used + 4095) & ~(size_t)4095;
#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif
    int fd = (int)syscall(SYS_memfd_create, "ct-init-args", MFD_CLOEXEC | MFD_NOEXEC_SEAL);
    if (fd < 0 && errno == EINVAL) fd = (int)syscall(SYS_memfd_create, "ct-init-args", MFD_CLOEXEC);
    if (fd < 0) return -errno;
    if (fstat(fd, st) < 0 || ftruncate(fd, (off_t)size) < 0) {
        int e = errno;
        close(fd);
        return -e;
    }
    char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        close(fd);
        return -e;
    }
    ar.base = p;
    ar.used = 0;
    copy_args(&ar, a, w, &na, &nw);
    ct_args_relocate(p, size, 1, &na, &nw);     /* offsets from the start */
    munmap(p, size);
    *memfd = fd;
    *len = size;
    return 0;
}

static const void *moved(const void *p, intptr_t d) {
    return p ? (const char *)p + d : NULL;
}

/* A vector's elements moved by d, then the pointer to it: the vector is
 * at `*vp` now, or at `*vp + d` where its pointers are offsets yet (the
 * init's side: `to_offsets` 0). */
static void move_strv(void *vp, int n, intptr_t d, int to_offsets) {
    char ***pv = vp;
    if (!*pv) return;
    char **v = to_offsets ? *pv : (char **)((char *)*pv + d);
    for (int i = 0; n < 0 ? v[i] != NULL : i < n; i++) v[i] = (char *)moved(v[i], d);
    *pv = (char **)moved(*pv, d);
}

int ct_args_relocate(char *at, size_t len, int to_offsets, struct ct_spawn_args **ao, struct ct_wall_args **wo) {
    size_t wat = (sizeof(struct ct_spawn_args) + 15) & ~(size_t)15;
    if (len < wat + sizeof(struct ct_wall_args)) return -EINVAL;
    intptr_t d = to_offsets ? -(intptr_t)(uintptr_t)at : (intptr_t)(uintptr_t)at;
    struct ct_spawn_args *a = (struct ct_spawn_args *)at;
    struct ct_wall_args *w = (struct ct_wall_args *)(at + wat);
    move_strv(&a->paths, a->npaths, d, to_offsets);
    move_strv(&a->argv, -1, d, to_offsets);
    move_strv(&a->envp, -1, d, to_offsets);
    move_strv(&a->cg_expect, a->ncg_expect, d, to_offsets);
    move_strv(&a->shell_argv, -1, d, to_offsets);
    a->cwd = moved(a->cwd, d);
    a->join_fds = moved(a->join_fds, d);
    a->groups = moved(a->groups, d);
    a->drop_caps = moved(a->drop_caps, d);
    a->pass_fds = moved(a->pass_fds, d);
    a->shell = moved(a->shell, d);
    w->uid_map = moved(w->uid_map, d);
    w->gid_map = moved(w->gid_map, d);
    w->hide = moved(w->hide, d);
    *ao = a;
    *wo = w;
    return 0;
}
