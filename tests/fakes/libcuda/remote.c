/* Another process's memory: process_vm_readv/writev, and the custom-storage mappings.
 *
 * With custom storage the driver maps a target's device memory onto the caller's GPUs: one
 * contiguous range per GPU. Here that range is an inaccessible reservation in the caller
 * whose bytes are the target's allocations, in address order; copies to or from it go to
 * the target with process_vm_*, so the caller needs ptrace rights over the target, as with
 * the real driver (without them: CUDA_ERROR_OPERATING_SYSTEM). */
#include "fake.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>

struct rmap {
    uintptr_t base;
    size_t size;
    pid_t tgid;
    size_t nseg;
    struct seg *segs;
    struct rmap *next;
};

static struct rmap *rmaps;
static pthread_mutex_t rmu = PTHREAD_MUTEX_INITIALIZER;

/* 0, or the errno of the first failed transfer. */
int remote_rw(pid_t pid, uintptr_t addr, void *buf, size_t n, int write) {
    size_t done = 0;
    while (done < n) {
        struct iovec local = {(char *)buf + done, n - done};
        struct iovec remote = {(void *)(addr + done), n - done};
        ssize_t k = write ? process_vm_writev(pid, &local, 1, &remote, 1, 0)
                          : process_vm_readv(pid, &local, 1, &remote, 1, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return errno;
        if (k == 0)
            return EFAULT;
        done += (size_t)k;
    }
    return 0;
}

static struct rmap *find(uintptr_t p, size_t n) {
    for (struct rmap *m = rmaps; m; m = m->next)
        if (p >= m->base && p - m->base < m->size && n <= m->size - (p - m->base))
            return m;
    return NULL;
}

int rmap_covers(uintptr_t p, size_t n) {
    pthread_mutex_lock(&rmu);
    int found = find(p, n) != NULL;
    pthread_mutex_unlock(&rmu);
    return found;
}

static CUresult os_error(int e) {
    return (e == EPERM || e == EACCES) ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_ERROR_ILLEGAL_ADDRESS;
}

/* Copy between `local` and [offset, offset+n) of mapping m. */
static CUresult through(struct rmap m, size_t offset, void *local, size_t n, int write) {
    size_t at = 0;
    for (size_t i = 0; i < m.nseg && n; i++) {
        size_t len = m.segs[i].len;
        if (offset >= at + len) {
            at += len;
            continue;
        }
        size_t skip = offset - at;
        size_t k = len - skip < n ? len - skip : n;
        int e = remote_rw(m.tgid, (uintptr_t)(m.segs[i].addr + skip), local, k, write);
        if (e)
            return os_error(e);
        local = (char *)local + k;
        offset += k;
        n -= k;
        at += len;
    }
    return n ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

CUresult rmap_copy(uintptr_t dst, uintptr_t src, size_t n) {
    pthread_mutex_lock(&rmu);
    struct rmap *d = find(dst, n), *s = find(src, n);
    struct rmap dm = d ? *d : (struct rmap){0}, sm = s ? *s : (struct rmap){0};
    pthread_mutex_unlock(&rmu);
    if (d && s) {
        void *bounce = malloc(n);
        if (!bounce)
            return CUDA_ERROR_OUT_OF_MEMORY;
        CUresult r = through(sm, src - sm.base, bounce, n, 0);
        if (r == CUDA_SUCCESS)
            r = through(dm, dst - dm.base, bounce, n, 1);
        free(bounce);
        return r;
    }
    if (d)
        return through(dm, dst - dm.base, (void *)src, n, 1);
    if (s)
        return through(sm, src - sm.base, (void *)dst, n, 0);
    return CUDA_ERROR_INVALID_VALUE;
}

uintptr_t rmap_create(pid_t tgid, const struct seg *segs, size_t nseg, size_t size) {
    struct rmap *m = calloc(1, sizeof(*m));
    if (!m)
        return 0;
    m->segs = malloc(sizeof(*segs) * (nseg ? nseg : 1));
    void *base = mmap(NULL, size ? size : 1, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (!m->segs || base == MAP_FAILED) {
        if (base != MAP_FAILED)
            munmap(base, size ? size : 1);
        free(m->segs);
        free(m);
        return 0;
    }
    memcpy(m->segs, segs, sizeof(*segs) * nseg);
    m->base = (uintptr_t)base;
    m->size = size;
    m->tgid = tgid;
    m->nseg = nseg;
    pthread_mutex_lock(&rmu);
    m->next = rmaps;
    rmaps = m;
    pthread_mutex_unlock(&rmu);
    return m->base;
}

void rmap_destroy(uintptr_t base) {
    pthread_mutex_lock(&rmu);
    for (struct rmap **pp = &rmaps; *pp; pp = &(*pp)->next)
        if ((*pp)->base == base) {
            struct rmap *m = *pp;
            *pp = m->next;
            munmap((void *)m->base, m->size ? m->size : 1);
            free(m->segs);
            free(m);
            break;
        }
    pthread_mutex_unlock(&rmu);
}
