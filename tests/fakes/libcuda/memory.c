/* Device memory, copies, memset, streams, host registration.
 *
 * An allocation is an anonymous mapping of this process at the address cuMemAlloc returns
 * (so a restore puts memory back "at the original virtual addresses"). Every copy takes
 * bytes / copy_gbps. Synchronous copies first wait for the context's blocking streams, as
 * copies on the legacy default stream do; *Async ones go to the stream (streams.c). */
#include "fake.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

struct hostreg {
    uintptr_t base;
    size_t size;
    struct hostreg *next;
};

static size_t page_round(size_t n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (n + page - 1) / page * page;
}

struct alloc *alloc_containing(CUdeviceptr p, size_t n) {
    for (int i = 0; i < G.nallocs; i++) {
        struct alloc *a = &G.allocs[i];
        if (p >= a->ptr && n <= a->size && p - a->ptr <= a->size - n)
            return a;
    }
    return NULL;
}

static int device_range_ok(CUdeviceptr p, size_t n) {
    pthread_mutex_lock(&G.mu);
    int ok = alloc_containing(p, n) != NULL;
    pthread_mutex_unlock(&G.mu);
    return ok || rmap_covers((uintptr_t)p, n);
}

static void drop_alloc(int i) {
    munmap((void *)(uintptr_t)G.allocs[i].ptr, G.allocs[i].mapped);
    if (G.allocs[i].staged)
        munmap(G.allocs[i].staged, G.allocs[i].mapped);
    G.allocs[i] = G.allocs[--G.nallocs];
}

void free_ordinal_allocs(int ordinal) {
    for (int i = G.nallocs - 1; i >= 0; i--)
        if (G.allocs[i].ordinal == ordinal)
            drop_alloc(i);
}

/* The current context, or INVALID_CONTEXT: memory calls need one (docs: "no context is
 * bound to the calling CPU thread"). */
CUresult need_ctx(struct fake_ctx **out) {
    struct fake_ctx *ctx = current_ctx();
    CUresult r = ctx_check(ctx);
    if (r == CUDA_SUCCESS)
        *out = ctx;
    return r;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t n) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_ctx *ctx;
    if ((r = need_ctx(&ctx)) != CUDA_SUCCESS || !dptr || n == 0) {
        gate_exit();
        return r != CUDA_SUCCESS ? r : CUDA_ERROR_INVALID_VALUE;
    }
    int g = ordinal_gpu(ctx->ordinal);
    pthread_mutex_lock(&G.mu);
    int fd = node_lock(G.cfg.root);
    void *p = MAP_FAILED;
    if (fd < 0)
        r = CUDA_ERROR_OPERATING_SYSTEM;
    else if (!room_locked(g, n))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    else if (G.nallocs == G.allocs_cap) {
        int cap = G.allocs_cap ? G.allocs_cap * 2 : 64;
        struct alloc *more = realloc(G.allocs, sizeof(*more) * (size_t)cap);
        if (!more)
            r = CUDA_ERROR_OUT_OF_MEMORY;
        else {
            G.allocs = more;
            G.allocs_cap = cap;
        }
    }
    if (r == CUDA_SUCCESS) {
        size_t mapped = page_round(n);
        p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
        if (p == MAP_FAILED) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            G.allocs[G.nallocs++] = (struct alloc){(CUdeviceptr)(uintptr_t)p, n, mapped, ctx->ordinal, NULL};
            if (publish_locked() < 0) {
                drop_alloc(G.nallocs - 1);
                r = CUDA_ERROR_OPERATING_SYSTEM;
            } else {
                *dptr = (CUdeviceptr)(uintptr_t)p;
            }
        }
    }
    node_unlock(fd);
    pthread_mutex_unlock(&G.mu);
    gate_exit();
    return r;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_ctx *ctx;
    if ((r = need_ctx(&ctx)) == CUDA_SUCCESS) {
        pthread_mutex_lock(&G.mu);
        r = CUDA_ERROR_INVALID_VALUE;
        for (int i = 0; i < G.nallocs; i++)
            if (G.allocs[i].ptr == dptr) {
                drop_alloc(i);
                publish_usage();
                r = CUDA_SUCCESS;
                break;
            }
        pthread_mutex_unlock(&G.mu);
    }
    gate_exit();
    return r;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_ctx *ctx;
    if ((r = need_ctx(&ctx)) == CUDA_SUCCESS && (!free_bytes || !total_bytes))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        int g = ordinal_gpu(ctx->ordinal);
        uint64_t used[MAX_GPUS];
        int fd = node_lock(G.cfg.root);
        node_used(G.cfg.root, &G.cfg, used);
        node_unlock(fd);
        uint64_t total = G.cfg.gpus[g].total_memory;
        *total_bytes = (size_t)total;
        *free_bytes = (size_t)(used[g] < total ? total - used[g] : 0);
    }
    gate_exit();
    return r;
}

/* ---- moving bytes ------------------------------------------------------------------------- */

CUresult run_op(const struct op *op) {
    struct timespec start;
    now(&start);
    CUresult r = CUDA_SUCCESS;
    if (op->memset) {
        if (rmap_covers(op->dst, op->n)) {
            unsigned char buf[65536];
            memset(buf, op->value, sizeof(buf));
            for (size_t done = 0; done < op->n && r == CUDA_SUCCESS;) {
                size_t k = op->n - done < sizeof(buf) ? op->n - done : sizeof(buf);
                r = rmap_copy(op->dst + done, (uintptr_t)buf, k);
                done += k;
            }
        } else {
            memset((void *)op->dst, op->value, op->n);
        }
    } else if (rmap_covers(op->dst, op->n) || rmap_covers(op->src, op->n)) {
        r = rmap_copy(op->dst, op->src, op->n);
    } else {
        memmove((void *)op->dst, (const void *)op->src, op->n);
    }
    paced_wait(&start, op->n);
    return r;
}

enum { H2D, D2H, D2D, SET };

static CUresult transfer(int kind, uintptr_t dst, uintptr_t src, size_t n, unsigned char value,
                         int async, CUstream h) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_ctx *ctx;
    struct fake_stream *s = NULL;
    if ((r = need_ctx(&ctx)) != CUDA_SUCCESS)
        goto out;
    if (async && (r = stream_lookup(h, &s)) != CUDA_SUCCESS)
        goto out;
    if (n == 0)
        goto out;
    int dst_dev = kind == H2D || kind == D2D || kind == SET;
    int src_dev = kind == D2H || kind == D2D;
    if ((!dst_dev && !dst) || (!src_dev && kind != SET && !src) ||
        (dst_dev && !device_range_ok(dst, n)) || (src_dev && !device_range_ok(src, n))) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    struct op op = {NULL, kind == SET, dst, src, n, value};
    if (async) {
        r = enqueue(s, &op);
    } else {
        wait_blocking_streams(ctx);
        r = run_op(&op);
    }
out:
    gate_exit();
    return r;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    FAULTED("cuMemcpyHtoD", 0, transfer(H2D, (uintptr_t)dst, (uintptr_t)src, n, 0, 0, NULL));
}
EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    FAULTED("cuMemcpyDtoH", 0, transfer(D2H, (uintptr_t)dst, (uintptr_t)src, n, 0, 0, NULL));
}
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    FAULTED("cuMemcpyDtoD", 0, transfer(D2D, (uintptr_t)dst, (uintptr_t)src, n, 0, 0, NULL));
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    FAULTED("cuMemcpyHtoDAsync", 0, transfer(H2D, (uintptr_t)dst, (uintptr_t)src, n, 0, 1, s));
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    FAULTED("cuMemcpyDtoHAsync", 0, transfer(D2H, (uintptr_t)dst, (uintptr_t)src, n, 0, 1, s));
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    FAULTED("cuMemcpyDtoDAsync", 0, transfer(D2D, (uintptr_t)dst, (uintptr_t)src, n, 0, 1, s));
}
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
    return transfer(SET, (uintptr_t)dst, 0, n, value, 0, NULL);
}
EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream s) {
    return transfer(SET, (uintptr_t)dst, 0, n, value, 1, s);
}

/* ---- page-locked host memory ------------------------------------------------------------- */

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_ctx *ctx;
    uintptr_t base = (uintptr_t)p;
    if ((r = need_ctx(&ctx)) == CUDA_SUCCESS && (!p || n == 0 || (flags & ~CU_MEMHOSTREGISTER_ALL_FLAGS)))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        pthread_mutex_lock(&G.mu);
        for (struct hostreg *h = G.hostregs; h; h = h->next)
            if (base < h->base + h->size && h->base < base + n)
                r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
        struct hostreg *h = r == CUDA_SUCCESS ? malloc(sizeof(*h)) : NULL;
        if (r == CUDA_SUCCESS && !h)
            r = CUDA_ERROR_OUT_OF_MEMORY;
        if (h) {
            *h = (struct hostreg){base, n, G.hostregs};
            G.hostregs = h;
        }
        pthread_mutex_unlock(&G.mu);
    }
    gate_exit();
    return r;
}

EXPORT CUresult cuMemHostRegister(void *p, size_t n, unsigned int flags) {
    return cuMemHostRegister_v2(p, n, flags);
}

EXPORT CUresult cuMemHostUnregister(void *p) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_ctx *ctx;
    if ((r = need_ctx(&ctx)) == CUDA_SUCCESS) {
        r = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
        pthread_mutex_lock(&G.mu);
        for (struct hostreg **pp = &G.hostregs; *pp; pp = &(*pp)->next)
            if ((*pp)->base == (uintptr_t)p) {
                struct hostreg *h = *pp;
                *pp = h->next;
                free(h);
                r = CUDA_SUCCESS;
                break;
            }
        pthread_mutex_unlock(&G.mu);
    }
    gate_exit();
    return r;
}
