/* Streams: each runs its work in order on a thread of its own, so a copy enqueued with an
 * *Async call is in flight after the call returns, and a lock waits for it to drain (the
 * driver "waits for already-submitted work"). */
#include "fake.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>

#define STREAM_MAGIC 0x5374726du

static void pending_add(int delta) {
    pthread_mutex_lock(&G.gate_mu);
    G.pending += delta;
    if (G.pending == 0)
        pthread_cond_broadcast(&G.gate_cv);
    pthread_mutex_unlock(&G.gate_mu);
}

static void *executor(void *arg) {
    struct fake_stream *s = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    prctl(PR_SET_NAME, "cuda-stream", 0, 0, 0);
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->destroyed)
            pthread_cond_wait(&s->cv, &s->mu);
        if (!s->head)
            break; /* destroyed and drained */
        struct op *op = s->head;
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->mu);
        CUresult r = run_op(op);
        free(op);
        pthread_mutex_lock(&s->mu);
        s->busy = 0;
        if (r != CUDA_SUCCESS && s->error == CUDA_SUCCESS)
            s->error = r; /* reported by the next synchronize, as the driver does */
        pthread_cond_broadcast(&s->cv);
        pending_add(-1);
    }
    pthread_mutex_unlock(&s->mu);
    s->magic = 0;
    free(s);
    return NULL;
}

static struct fake_stream *stream_new(struct fake_ctx *ctx, unsigned int flags) {
    struct fake_stream *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->magic = STREAM_MAGIC;
    s->ctx = ctx;
    s->flags = flags;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    return s;
}

CUresult enqueue(struct fake_stream *s, const struct op *src) {
    struct op *op = malloc(sizeof(*op));
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *op = *src;
    op->next = NULL;
    pthread_mutex_lock(&s->mu);
    if (!s->started) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int e = pthread_create(&s->thread, &attr, executor, s);
        pthread_attr_destroy(&attr);
        if (e) {
            pthread_mutex_unlock(&s->mu);
            free(op);
            return CUDA_ERROR_OPERATING_SYSTEM;
        }
        s->started = 1;
    }
    pending_add(1);
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}

CUresult stream_sync(struct fake_stream *s) {
    pthread_mutex_lock(&s->mu);
    while (s->head || s->busy)
        pthread_cond_wait(&s->cv, &s->mu);
    CUresult r = s->error;
    s->error = CUDA_SUCCESS;
    pthread_mutex_unlock(&s->mu);
    return r;
}

/* A stream handle as the driver reads it: NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD
 * name the default stream of the current context. Call with G.mu held. */
CUresult resolve(CUstream h, struct fake_stream **out) {
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct fake_ctx *ctx;
        CUresult r = need_ctx(&ctx);
        if (r != CUDA_SUCCESS)
            return r;
        if (!ctx->default_stream && !(ctx->default_stream = stream_new(ctx, 0)))
            return CUDA_ERROR_OUT_OF_MEMORY;
        *out = ctx->default_stream;
        return CUDA_SUCCESS;
    }
    for (struct fake_stream *s = G.streams; s; s = s->next)
        if (s == h) {
            if (ctx_check(s->ctx) != CUDA_SUCCESS)
                return CUDA_ERROR_INVALID_CONTEXT;
            *out = s;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;
}

/* Before a synchronous copy: the work of the context's blocking streams comes first. */
void wait_blocking_streams(struct fake_ctx *ctx) {
    struct fake_stream *list[256];
    int n = 0;
    pthread_mutex_lock(&G.mu);
    if (ctx->default_stream)
        list[n++] = ctx->default_stream;
    for (struct fake_stream *s = G.streams; s && n < 256; s = s->next)
        if (s->ctx == ctx && !(s->flags & CU_STREAM_NON_BLOCKING))
            list[n++] = s;
    pthread_mutex_unlock(&G.mu);
    for (int i = 0; i < n; i++) {
        pthread_mutex_lock(&list[i]->mu);
        while (list[i]->head || list[i]->busy)
            pthread_cond_wait(&list[i]->cv, &list[i]->mu);
        pthread_mutex_unlock(&list[i]->mu);
    }
}

/* ---- streams ------------------------------------------------------------------------------ */

CUresult stream_create_in(struct fake_ctx *ctx, unsigned int flags, struct fake_stream **out) {
    struct fake_stream *s = stream_new(ctx, flags);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&G.mu);
    s->next = G.streams;
    G.streams = s;
    pthread_mutex_unlock(&G.mu);
    *out = s;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(CUstream *ph, unsigned int flags) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_ctx *ctx;
    if ((r = need_ctx(&ctx)) == CUDA_SUCCESS && (!ph || (flags & ~CU_STREAM_NON_BLOCKING)))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS)
        r = stream_create_in(ctx, flags, ph);
    gate_exit();
    return r;
}

/* The driver returns at once; the stream's work finishes first, then it is gone. */
static void stream_release(struct fake_stream *s) {
    pthread_mutex_lock(&s->mu);
    s->destroyed = 1;
    int started = s->started;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (!started) {
        s->magic = 0;
        free(s);
    }
}

static int unlink_stream(struct fake_stream *h) {
    for (struct fake_stream **pp = &G.streams; *pp; pp = &(*pp)->next)
        if (*pp == h) {
            *pp = h->next;
            return 1;
        }
    return 0;
}

int stream_destroy(struct fake_stream *h) {
    pthread_mutex_lock(&G.mu);
    int found = h && h != CU_STREAM_LEGACY && h != CU_STREAM_PER_THREAD && unlink_stream(h);
    pthread_mutex_unlock(&G.mu);
    if (found)
        stream_release(h);
    return found;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream h) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    int found = stream_destroy(h);
    gate_exit();
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

void streams_of_ctx_drop(struct fake_ctx *ctx) {
    struct fake_stream *drop[256];
    int n = 0;
    pthread_mutex_lock(&G.mu);
    for (struct fake_stream *s = G.streams, *next; s && n < 255; s = next) {
        next = s->next;
        if (s->ctx == ctx) {
            unlink_stream(s);
            drop[n++] = s;
        }
    }
    if (ctx->default_stream) {
        drop[n++] = ctx->default_stream;
        ctx->default_stream = NULL;
    }
    pthread_mutex_unlock(&G.mu);
    for (int i = 0; i < n; i++)
        stream_release(drop[i]);
}

/* resolve, taking G.mu for it. */
CUresult stream_lookup(CUstream h, struct fake_stream **out) {
    pthread_mutex_lock(&G.mu);
    CUresult r = resolve(h, out);
    pthread_mutex_unlock(&G.mu);
    return r;
}

/* fn on the stream behind h, inside the API gate. */
static CUresult with_stream(CUstream h, CUresult (*fn)(struct fake_stream *)) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_stream *s = NULL;
    if ((r = stream_lookup(h, &s)) == CUDA_SUCCESS)
        r = fn(s);
    gate_exit();
    return r;
}

/* cuStreamQuery: NOT_READY while work is queued or running, else its sticky error. */
static CUresult stream_query(struct fake_stream *s) {
    pthread_mutex_lock(&s->mu);
    CUresult r = (s->head || s->busy) ? CUDA_ERROR_NOT_READY : s->error;
    pthread_mutex_unlock(&s->mu);
    return r;
}

EXPORT CUresult cuStreamSynchronize(CUstream h) {
    return with_stream(h, stream_sync);
}

EXPORT CUresult cuStreamQuery(CUstream h) {
    return with_stream(h, stream_query);
}

EXPORT CUresult cuStreamGetCtx(CUstream h, CUcontext *pctx) {
    CUresult r = ready_args(pctx != NULL);
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_stream *s = NULL;
    if ((r = stream_lookup(h, &s)) == CUDA_SUCCESS)
        *pctx = s->ctx;
    return r;
}

EXPORT CUresult cuStreamGetCtx_v2(CUstream h, CUcontext *pctx, CUgreenCtx *pgreen) {
    CUresult r = cuStreamGetCtx(h, pctx);
    if (r == CUDA_SUCCESS && pgreen)
        *pgreen = NULL;
    return r;
}

