/* The target side of the checkpoint API: the mailbox and the restore thread.
 *
 * cuInit starts the restore thread (named "cuda" + hex digits, as the driver's is); it
 * sleeps in sigtimedwait on a real-time signal that only it waits for, so a caller wakes
 * it with tgkill after writing a request into MB. The thread does the work in this process:
 * lock the API gate, move device memory to host memory and release it, bring it back on the
 * caller's node, unlock. The mailbox, the host copies and the thread are ordinary process
 * state: CRIU dumps and restores them with the rest. */
#include "fake.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct mailbox MB;

static struct {
    int active;
    int kind;            /* OP_CS_CHECKPOINT or OP_CS_RESTORE */
    uint64_t id;
    pid_t owner;
    uint64_t owner_start;
    int ndev;
    struct seg *segs[MAX_GPUS];
} T_op;
static uint64_t next_op_id;

static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t start_cv = PTHREAD_COND_INITIALIZER;

int wake_signal(void) {
    return SIGRTMAX - 5;
}

static void set_state(int state) {
    __atomic_store_n(&MB.state, state, __ATOMIC_RELEASE);
}

/* ---- lock / unlock -------------------------------------------------------------------------- */

static CUresult do_lock(const struct request *req) {
    CUresult r = CUDA_SUCCESS;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += req->timeout_ms / 1000;
    until.tv_nsec += (long)(req->timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&G.gate_mu);
    if (MB.state != CU_PROCESS_STATE_RUNNING) {
        r = CUDA_ERROR_ILLEGAL_STATE;
    } else {
        G.locking = 1; /* new calls wait from now on */
        while ((G.in_api || G.pending) && r == CUDA_SUCCESS) {
            if (req->timeout_ms == 0)
                pthread_cond_wait(&G.gate_cv, &G.gate_mu);
            else if (pthread_cond_timedwait(&G.gate_cv, &G.gate_mu, &until) == ETIMEDOUT &&
                     (G.in_api || G.pending))
                r = CUDA_ERROR_NOT_READY; /* documented: the process is left RUNNING */
        }
        G.locking = 0;
        if (r == CUDA_SUCCESS) {
            G.locked = 1;
            set_state(CU_PROCESS_STATE_LOCKED);
        }
        pthread_cond_broadcast(&G.gate_cv);
    }
    pthread_mutex_unlock(&G.gate_mu);
    return r;
}

static CUresult do_unlock(void) {
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G.gate_mu);
    if (MB.state != CU_PROCESS_STATE_LOCKED) {
        r = CUDA_ERROR_ILLEGAL_STATE;
    } else {
        G.locked = 0;
        set_state(CU_PROCESS_STATE_RUNNING);
        pthread_cond_broadcast(&G.gate_cv);
    }
    pthread_mutex_unlock(&G.gate_mu);
    return r;
}

/* ---- device memory in and out ---------------------------------------------------------------- */

/* Give the device memory back to the node: the pages go, the addresses stay reserved. */
static void release_device_memory(void) {
    for (int i = 0; i < G.nallocs; i++) {
        void *p = (void *)(uintptr_t)G.allocs[i].ptr;
        madvise(p, G.allocs[i].mapped, MADV_DONTNEED);
        mprotect(p, G.allocs[i].mapped, PROT_NONE);
    }
    G.released = 1;
    publish_usage();
}

static void drop_staged(void) {
    for (int i = 0; i < G.nallocs; i++)
        if (G.allocs[i].staged) {
            munmap(G.allocs[i].staged, G.allocs[i].mapped);
            G.allocs[i].staged = NULL;
        }
}

static CUresult do_checkpoint(void) {
    if (MB.state != CU_PROCESS_STATE_LOCKED)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&G.mu);
    CUresult r = CUDA_SUCCESS;
    for (int i = 0; i < G.nallocs && r == CUDA_SUCCESS; i++) {
        struct alloc *a = &G.allocs[i];
        void *host = mmap(NULL, a->mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (host == MAP_FAILED) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        struct timespec start;
        now(&start);
        memcpy(host, (void *)(uintptr_t)a->ptr, a->size);
        paced_wait(&start, a->size);
        a->staged = host;
    }
    if (r != CUDA_SUCCESS) {
        drop_staged(); /* nothing released yet: the process stays LOCKED on its GPUs */
    } else {
        release_device_memory();
        G.contents_external = 0;
        set_state(CU_PROCESS_STATE_CHECKPOINTED);
    }
    pthread_mutex_unlock(&G.mu);
    return r;
}

static int ordinal_used(int o) {
    if (G.ctx[o].refcount > 0)
        return 1;
    for (int i = 0; i < G.nallocs; i++)
        if (G.allocs[i].ordinal == o)
            return 1;
    return 0;
}

static int in_list(const unsigned char (*list)[16], uint32_t n, const unsigned char uuid[16]) {
    for (uint32_t i = 0; i < n && i < MAX_GPUS; i++)
        if (!memcmp(list[i], uuid, 16))
            return 1;
    return 0;
}

/* Where each ordinal lands on `cfg` given the pairs; INVALID_VALUE unless the pairs name
 * every GPU of that node as a target, every GPU this process used as a source, and each
 * used GPU lands on one of the same chip (driver docs; cuda.core's checkpoint.restore). */
static CUresult remap(const struct request *req, const struct node_cfg *cfg, int out[MAX_GPUS]) {
    int paired_new[MAX_GPUS] = {0};
    if (req->npairs > MAX_PAIRS)
        return CUDA_ERROR_INVALID_VALUE;
    for (uint32_t i = 0; i < req->npairs; i++) {
        int g = node_gpu_by_uuid(cfg, req->pairs[i][1]);
        if (g < 0 || paired_new[g]++)
            return CUDA_ERROR_INVALID_VALUE;
        for (uint32_t j = 0; j < i; j++)
            if (!memcmp(req->pairs[i][0], req->pairs[j][0], 16))
                return CUDA_ERROR_INVALID_VALUE;
    }
    if (req->npairs && (int)req->npairs != cfg->ngpus)
        return CUDA_ERROR_INVALID_VALUE; /* a pair for every GPU of the node */
    for (int o = 0; o < G.nvisible; o++) {
        int old = G.visible[o];
        out[o] = -1;
        if (old < 0)
            continue;
        const struct gpu *from = &G.cfg.gpus[old];
        int to = -1;
        for (uint32_t i = 0; i < req->npairs; i++)
            if (!memcmp(req->pairs[i][0], from->uuid, 16))
                to = node_gpu_by_uuid(cfg, req->pairs[i][1]);
        if (to < 0 && !req->npairs)
            to = node_gpu_by_uuid(cfg, from->uuid); /* no pairs: back onto the same GPUs */
        if (ordinal_used(o) && (to < 0 || strcmp(cfg->gpus[to].name, from->name)))
            return CUDA_ERROR_INVALID_VALUE;
        out[o] = to;
    }
    return CUDA_SUCCESS;
}

static CUresult do_restore(const struct request *req, int custom) {
    char err[PATH_MAX + 256];
    if (MB.state != CU_PROCESS_STATE_CHECKPOINTED)
        return CUDA_ERROR_ILLEGAL_STATE;
    if (MB.poisoned)
        return CUDA_ERROR_OPERATING_SYSTEM; /* cuda-checkpoint #44: every later restore fails */
    if (!custom && G.contents_external)
        return CUDA_ERROR_ILLEGAL_STATE; /* its memory was copied out by a custom storage */
    struct node_cfg *cfg = malloc(sizeof(*cfg));
    if (!cfg)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (node_load(req->root, cfg, err, sizeof(err)) < 0) {
        fprintf(stderr, "fake libcuda: restore onto %s: %s\n", req->root, err);
        free(cfg);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    int to[MAX_GPUS];
    CUresult r = remap(req, cfg, to);
    pthread_mutex_lock(&G.mu);
    uint64_t need[MAX_GPUS] = {0};
    for (int o = 0; o < G.nvisible && r == CUDA_SUCCESS; o++) {
        if (to[o] >= 0 && G.ctx[o].refcount > 0)
            need[to[o]] += cfg->context_memory;
        if (custom && to[o] < 0 && ordinal_used(o))
            r = CUDA_ERROR_INVALID_VALUE;
    }
    for (int i = 0; i < G.nallocs && r == CUDA_SUCCESS; i++) {
        int g = to[G.allocs[i].ordinal];
        need[g] += G.allocs[i].size;
        if (custom && !in_list(req->ctx_uuids, req->nctx, cfg->gpus[g].uuid))
            r = CUDA_ERROR_INVALID_CONTEXT; /* the caller must retain those primary contexts */
    }
    int fd = r == CUDA_SUCCESS ? node_lock(cfg->root) : -1;
    if (r == CUDA_SUCCESS && fd < 0)
        r = CUDA_ERROR_OPERATING_SYSTEM;
    if (r == CUDA_SUCCESS) {
        uint64_t used[MAX_GPUS];
        node_used(cfg->root, cfg, used);
        for (int g = 0; g < cfg->ngpus; g++)
            if (need[g] && used[g] + need[g] > cfg->gpus[g].total_memory)
                r = CUDA_ERROR_OUT_OF_MEMORY;
        if (r == CUDA_ERROR_OUT_OF_MEMORY) {
            MB.poisoned = 1; /* the driver keeps no way back (cuda-checkpoint #44) */
        } else {
            /* Re-home: from here on this process lives on the caller's node. */
            G.cfg = *cfg;
            memcpy(G.visible, to, sizeof(to));
            G.released = 0;
            publish_locked();
        }
    }
    node_unlock(fd);
    free(cfg);
    for (int i = 0; i < G.nallocs && r == CUDA_SUCCESS; i++) {
        struct alloc *a = &G.allocs[i];
        mprotect((void *)(uintptr_t)a->ptr, a->mapped, PROT_READ | PROT_WRITE);
        if (!custom) {
            struct timespec start;
            now(&start);
            memcpy((void *)(uintptr_t)a->ptr, a->staged, a->size);
            paced_wait(&start, a->size);
        }
    }
    if (r == CUDA_SUCCESS && !custom) {
        drop_staged();
        set_state(CU_PROCESS_STATE_LOCKED);
    }
    pthread_mutex_unlock(&G.mu);
    return r;
}

/* ---- custom storage ------------------------------------------------------------------------ */

static int by_address(const void *a, const void *b) {
    const struct alloc *x = a, *y = b;
    return x->ptr < y->ptr ? -1 : x->ptr > y->ptr;
}

/* One contiguous range per GPU that holds data: this process's allocations on it, in
 * address order. The segment lists stay put until the operation completes. */
static CUresult publish_layout(struct response *resp, int kind, const struct request *req) {
    qsort(G.allocs, (size_t)G.nallocs, sizeof(*G.allocs), by_address);
    int ndev = 0;
    for (int o = 0; o < G.nvisible; o++) {
        int g = ordinal_gpu(o), nseg = 0;
        uint64_t size = 0;
        for (int i = 0; i < G.nallocs; i++)
            nseg += G.allocs[i].ordinal == o;
        if (g < 0 || nseg == 0)
            continue;
        struct seg *segs = malloc(sizeof(*segs) * (size_t)nseg);
        if (!segs)
            return CUDA_ERROR_OUT_OF_MEMORY;
        nseg = 0;
        for (int i = 0; i < G.nallocs; i++)
            if (G.allocs[i].ordinal == o) {
                segs[nseg++] = (struct seg){G.allocs[i].ptr, G.allocs[i].size};
                size += G.allocs[i].size;
            }
        memcpy(resp->dev[ndev].uuid, G.cfg.gpus[g].uuid, 16);
        resp->dev[ndev].size = size;
        resp->dev[ndev].nseg = (uint64_t)nseg;
        resp->dev[ndev].segs = (uint64_t)(uintptr_t)segs;
        T_op.segs[ndev++] = segs;
    }
    T_op.active = 1;
    T_op.kind = kind;
    T_op.id = ++next_op_id;
    T_op.owner = req->caller_pid;
    T_op.owner_start = req->caller_start;
    T_op.ndev = ndev;
    resp->ndev = (uint32_t)ndev;
    resp->operation = T_op.id;
    return CUDA_SUCCESS;
}

static void end_operation(void) {
    for (int i = 0; i < T_op.ndev; i++)
        free(T_op.segs[i]);
    memset(&T_op, 0, sizeof(T_op));
}

static CUresult do_cs_checkpoint(const struct request *req, struct response *resp) {
    if (MB.state != CU_PROCESS_STATE_LOCKED || T_op.active)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&G.mu);
    CUresult r = CUDA_SUCCESS;
    for (int i = 0; i < G.nallocs && r == CUDA_SUCCESS; i++) {
        int g = ordinal_gpu(G.allocs[i].ordinal);
        if (g < 0 || !in_list(req->ctx_uuids, req->nctx, G.cfg.gpus[g].uuid))
            r = CUDA_ERROR_INVALID_CONTEXT; /* the caller must retain those primary contexts */
    }
    if (r == CUDA_SUCCESS && (r = publish_layout(resp, OP_CS_CHECKPOINT, req)) == CUDA_SUCCESS)
        set_state(CU_PROCESS_STATE_CHECKPOINTING);
    pthread_mutex_unlock(&G.mu);
    return r;
}

static CUresult do_cs_restore(const struct request *req, struct response *resp) {
    if (T_op.active)
        return CUDA_ERROR_ILLEGAL_STATE;
    CUresult r = do_restore(req, 1);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&G.mu);
    r = publish_layout(resp, OP_CS_RESTORE, req);
    pthread_mutex_unlock(&G.mu);
    set_state(r == CUDA_SUCCESS ? CU_PROCESS_STATE_RESTORING : CU_PROCESS_STATE_FAILED);
    return r;
}

static CUresult do_cs_complete(const struct request *req) {
    if (!T_op.active || T_op.id != req->operation || T_op.owner != req->caller_pid)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&G.mu);
    if (T_op.kind == OP_CS_CHECKPOINT) {
        release_device_memory();
        drop_staged();
        G.contents_external = 1;
        set_state(CU_PROCESS_STATE_CHECKPOINTED);
    } else {
        drop_staged();
        G.contents_external = 0;
        set_state(CU_PROCESS_STATE_LOCKED);
    }
    pthread_mutex_unlock(&G.mu);
    end_operation();
    return CUDA_SUCCESS;
}

/* The process holding an operation's mappings died without completing it. Assumed, not
 * documented: the driver abandons the operation (checkpoint -> LOCKED, restore ->
 * CHECKPOINTED, keeping whatever host copy there was). */
static void abandon_if_orphaned(void) {
    if (!T_op.active || same_process(T_op.owner, T_op.owner_start))
        return;
    pthread_mutex_lock(&G.mu);
    if (T_op.kind == OP_CS_CHECKPOINT) {
        set_state(CU_PROCESS_STATE_LOCKED);
    } else {
        release_device_memory();
        set_state(CU_PROCESS_STATE_CHECKPOINTED);
    }
    pthread_mutex_unlock(&G.mu);
    end_operation();
}

/* ---- the thread ----------------------------------------------------------------------------- */

static void serve(uint64_t seq) {
    struct request req;
    struct response resp;
    memcpy(&req, &MB.req, sizeof(req));
    memset(&resp, 0, sizeof(resp));
    switch (req.op) {
    case OP_LOCK: resp.result = do_lock(&req); break;
    case OP_CHECKPOINT: resp.result = do_checkpoint(); break;
    case OP_RESTORE: resp.result = do_restore(&req, 0); break;
    case OP_UNLOCK: resp.result = do_unlock(); break;
    case OP_CS_CHECKPOINT: resp.result = do_cs_checkpoint(&req, &resp); break;
    case OP_CS_RESTORE: resp.result = do_cs_restore(&req, &resp); break;
    case OP_CS_COMPLETE: resp.result = do_cs_complete(&req); break;
    default: resp.result = CUDA_ERROR_INVALID_VALUE; break;
    }
    memcpy(&MB.resp, &resp, sizeof(resp));
    __atomic_store_n(&MB.resp_seq, seq, __ATOMIC_RELEASE);
}

static void *restore_main(void *arg) {
    (void)arg;
    sigset_t all, wake;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    sigemptyset(&wake);
    sigaddset(&wake, wake_signal());
    char name[16];
    snprintf(name, sizeof(name), "cuda%08x", (unsigned)getpid());
    prctl(PR_SET_NAME, name, 0, 0, 0);
    pthread_mutex_lock(&start_mu);
    MB.tid = (int32_t)syscall(SYS_gettid);
    pthread_cond_broadcast(&start_cv);
    pthread_mutex_unlock(&start_mu);
    for (;;) {
        /* Poll faster while an operation's owner may die (custom storage). */
        struct timespec wait = T_op.active ? (struct timespec){0, 100000000L} : (struct timespec){1, 0};
        sigtimedwait(&wake, NULL, &wait); /* EINTR (e.g. after a CRIU restore) and EAGAIN: look anyway */
        abandon_if_orphaned();
        uint64_t seq = __atomic_load_n(&MB.req_seq, __ATOMIC_ACQUIRE);
        if (seq != __atomic_load_n(&MB.resp_seq, __ATOMIC_ACQUIRE))
            serve(seq);
    }
    return NULL;
}

int start_restore_thread(void) {
    MB.layout = MB_LAYOUT;
    MB.pid = (int32_t)getpid();
    MB.state = CU_PROCESS_STATE_RUNNING;
    pthread_t thread;
    pthread_attr_t attr;
    sigset_t all, old;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* the thread starts with every signal blocked */
    int e = pthread_create(&thread, &attr, restore_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (e)
        return -1;
    pthread_mutex_lock(&start_mu);
    while (!MB.tid)
        pthread_cond_wait(&start_cv, &start_mu);
    pthread_mutex_unlock(&start_mu);
    __atomic_store_n(&MB.magic, MB_MAGIC, __ATOMIC_RELEASE);
    return 0;
}
