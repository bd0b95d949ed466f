/* cuInit, versions, device queries, primary contexts, the current context, and the lock
 * gate every call that touches device state passes. */
#include "fake.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct fake G = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .gate_mu = PTHREAD_MUTEX_INITIALIZER,
    .gate_cv = PTHREAD_COND_INITIALIZER,
};

#define CTX_MAGIC 0x43747843u

static __thread struct fake_ctx *t_current;
static pthread_once_t config_once = PTHREAD_ONCE_INIT;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CUresult config_result = CUDA_ERROR_NO_DEVICE;

static void read_config(void) {
    char err[PATH_MAX + 256];
    const char *root = getenv(ROOT_ENV);
    if (!root || !*root)
        return; /* no node: as a machine with the library but no GPU */
    if (node_load(root, &G.cfg, err, sizeof(err)) < 0) {
        fprintf(stderr, "fake libcuda: %s\n", err);
        return;
    }
    config_result = CUDA_SUCCESS;
}

CUresult load_config(void) {
    pthread_once(&config_once, read_config);
    return config_result;
}

static void after_fork_in_child(void) {
    G.forked = 1; /* CUDA state does not survive fork: the child has no restore thread */
}

static void do_init(void) {
    G.init_result = load_config();
    if (G.init_result != CUDA_SUCCESS)
        return;
    G.nvisible = node_visible(&G.cfg, G.visible);
    if (G.nvisible == 0 || G.cfg.ngpus == 0) {
        G.init_result = CUDA_ERROR_NO_DEVICE;
        return;
    }
    for (int i = 0; i < MAX_GPUS; i++) {
        G.ctx[i].magic = CTX_MAGIC;
        G.ctx[i].ordinal = i;
    }
    G.pid = getpid();
    pthread_atfork(NULL, NULL, after_fork_in_child);
    if (start_restore_thread() < 0) {
        G.init_result = CUDA_ERROR_OPERATING_SYSTEM;
        return;
    }
    G.initialized = 1;
}

EXPORT CUresult cuInit(unsigned int flags) {
    CUresult injected;
    if (fault_before("cuInit", 0, &injected))
        return injected;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (G.forked)
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_once(&init_once, do_init);
    return G.init_result;
}

CUresult ready(void) {
    return (G.initialized && !G.forked) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* ready(), then INVALID_VALUE where the caller's arguments are unusable (args_ok false). */
CUresult ready_args(int args_ok) {
    CUresult r = ready();
    if (r == CUDA_SUCCESS && !args_ok)
        r = CUDA_ERROR_INVALID_VALUE;
    return r;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = load_config();
    if (r != CUDA_SUCCESS)
        return r;
    *version = G.cfg.driver_version;
    return CUDA_SUCCESS;
}

/* ---- the lock gate ----------------------------------------------------------------------
 * A locked process's calls that launch work or manage resources block until it is unlocked
 * (cuda-checkpoint README); a lock waits for calls in flight and for submitted stream work. */

CUresult gate_enter(void) {
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&G.gate_mu);
    while (G.locked || G.locking)
        pthread_cond_wait(&G.gate_cv, &G.gate_mu);
    G.in_api++;
    pthread_mutex_unlock(&G.gate_mu);
    return CUDA_SUCCESS;
}

void gate_exit(void) {
    pthread_mutex_lock(&G.gate_mu);
    if (--G.in_api == 0)
        pthread_cond_broadcast(&G.gate_cv);
    pthread_mutex_unlock(&G.gate_mu);
}

/* ---- copy pacing: copies take bytes / copy_gbps ------------------------------------------ */

void now(struct timespec *ts) {
    clock_gettime(CLOCK_MONOTONIC, ts);
}

void paced_wait(const struct timespec *start, uint64_t bytes) {
    double gbps = G.cfg.copy_gbps;
    if (gbps <= 0 || bytes == 0)
        return;
    double secs = (double)bytes / (gbps * 1e9);
    struct timespec until = *start;
    long long ns = (long long)(secs * 1e9);
    until.tv_sec += (time_t)(ns / 1000000000LL);
    until.tv_nsec += (long)(ns % 1000000000LL);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR)
        ;
}

/* ---- devices ------------------------------------------------------------------------------ */

int ordinal_gpu(int ordinal) {
    if (ordinal < 0 || ordinal >= G.nvisible)
        return -1;
    return G.visible[ordinal];
}

/* The GPU behind dev once the driver is ready and dev names one; then INVALID_VALUE where
 * the caller's out arguments are unusable (args_ok false): the device is checked first. */
static CUresult device_gpu(CUdevice dev, int args_ok, const struct gpu **out) {
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    int g = ordinal_gpu(dev);
    if (g < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!args_ok)
        return CUDA_ERROR_INVALID_VALUE;
    *out = &G.cfg.gpus[g];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    CUresult r = ready_args(device != NULL);
    if (r != CUDA_SUCCESS)
        return r;
    if (ordinal_gpu(ordinal) < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    CUresult r = ready_args(count != NULL);
    if (r == CUDA_SUCCESS)
        *count = G.nvisible;
    return r;
}

/* cuDeviceGetName and cuDeviceGetPCIBusId: one of the GPU's strings, cut to len bytes. */
static CUresult device_string(CUdevice dev, char *out, int len, size_t field) {
    const struct gpu *g;
    CUresult r = device_gpu(dev, out && len > 0, &g);
    if (r == CUDA_SUCCESS)
        snprintf(out, (size_t)len, "%s", (const char *)g + field);
    return r;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    return device_string(dev, name, len, offsetof(struct gpu, name));
}

EXPORT CUresult cuDeviceGetPCIBusId(char *pci_bus_id, int len, CUdevice dev) {
    return device_string(dev, pci_bus_id, len, offsetof(struct gpu, pci_bus_id));
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    const struct gpu *g;
    CUresult r = device_gpu(dev, uuid != NULL, &g);
    if (r == CUDA_SUCCESS)
        memcpy(uuid->bytes, g->uuid, 16);
    return r;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    return cuDeviceGetUuid_v2(uuid, dev);
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    const struct gpu *g;
    CUresult r = device_gpu(dev, bytes != NULL, &g);
    if (r == CUDA_SUCCESS)
        *bytes = (size_t)g->total_memory;
    return r;
}

enum {
    ATTR_MAX_THREADS_PER_BLOCK = 1,
    ATTR_WARP_SIZE = 10,
    ATTR_MULTIPROCESSOR_COUNT = 16,
    ATTR_COMPUTE_MODE = 20,
    ATTR_PCI_BUS_ID = 33,
    ATTR_PCI_DEVICE_ID = 34,
    ATTR_UNIFIED_ADDRESSING = 41,
    ATTR_PCI_DOMAIN_ID = 50,
    ATTR_CC_MAJOR = 75,
    ATTR_CC_MINOR = 76,
    ATTR_MAX = 162,
};

EXPORT CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    const struct gpu *g;
    CUresult r = device_gpu(dev, pi && attrib > 0 && attrib < ATTR_MAX, &g);
    if (r != CUDA_SUCCESS)
        return r;
    switch (attrib) {
    case ATTR_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case ATTR_WARP_SIZE: *pi = 32; break;
    case ATTR_MULTIPROCESSOR_COUNT: *pi = 132; break;
    case ATTR_COMPUTE_MODE: *pi = 0; break; /* CU_COMPUTEMODE_DEFAULT */
    case ATTR_PCI_BUS_ID: *pi = g->pci_bus; break;
    case ATTR_PCI_DEVICE_ID: *pi = g->pci_device; break;
    case ATTR_PCI_DOMAIN_ID: *pi = g->pci_domain; break;
    case ATTR_UNIFIED_ADDRESSING: *pi = 1; break;
    case ATTR_CC_MAJOR: *pi = g->cc_major; break;
    case ATTR_CC_MINOR: *pi = g->cc_minor; break;
    default: *pi = 0; break; /* an attribute this fake does not model */
    }
    return CUDA_SUCCESS;
}

/* ---- accounting ---------------------------------------------------------------------------- */

/* This process's device bytes per GPU of its node: allocations plus context_memory per
 * retained primary context; nothing once checkpointed (its GPU resources are released). */
void usage_of(uint64_t mine[MAX_GPUS]) {
    memset(mine, 0, sizeof(uint64_t) * MAX_GPUS);
    if (G.released)
        return;
    for (int o = 0; o < G.nvisible; o++) {
        int g = ordinal_gpu(o);
        if (g >= 0 && G.ctx[o].refcount > 0)
            mine[g] += G.cfg.context_memory;
    }
    for (int i = 0; i < G.nallocs; i++) {
        int g = ordinal_gpu(G.allocs[i].ordinal);
        if (g >= 0)
            mine[g] += G.allocs[i].size;
    }
}

/* Publish this process's usage; publish_locked is for callers already under node_lock (a
 * second flock of the lock file from this process would wait on itself). */
int publish_locked(void) {
    uint64_t mine[MAX_GPUS];
    usage_of(mine);
    return node_publish(G.cfg.root, mine);
}

int publish_usage(void) {
    int fd = node_lock(G.cfg.root);
    if (fd < 0)
        return -1;
    int rc = publish_locked();
    node_unlock(fd);
    return rc;
}

/* Whether GPU g of this node has `extra` bytes free now (call under node_lock). */
int room_locked(int g, uint64_t extra) {
    uint64_t used[MAX_GPUS];
    node_used(G.cfg.root, &G.cfg, used);
    return used[g] + extra <= G.cfg.gpus[g].total_memory;
}

/* ---- contexts ------------------------------------------------------------------------------ */

CUresult ctx_check(struct fake_ctx *ctx) {
    if (!ctx || ctx < &G.ctx[0] || ctx >= &G.ctx[MAX_GPUS] || ctx->magic != CTX_MAGIC)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx->refcount <= 0 || ordinal_gpu(ctx->ordinal) < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

struct fake_ctx *current_ctx(void) {
    return t_current;
}

/* Into the API gate, then G.mu, for the primary context of dev; INVALID_DEVICE (holding
 * neither) where dev names no GPU. */
static CUresult primary_enter(CUdevice dev, struct fake_ctx **ctx) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    if (ordinal_gpu(dev) < 0) {
        gate_exit();
        return CUDA_ERROR_INVALID_DEVICE;
    }
    pthread_mutex_lock(&G.mu);
    *ctx = &G.ctx[dev];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CUresult r = ready_args(pctx != NULL);
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_ctx *ctx;
    if ((r = primary_enter(dev, &ctx)) != CUDA_SUCCESS)
        return r;
    if (ctx->refcount == 0) {
        /* A context holds device memory of its own (context_memory): charge it now. */
        int fd = node_lock(G.cfg.root);
        if (fd < 0)
            r = CUDA_ERROR_OPERATING_SYSTEM;
        else if (!room_locked(ordinal_gpu(dev), G.cfg.context_memory))
            r = CUDA_ERROR_OUT_OF_MEMORY;
        else {
            ctx->refcount = 1;
            if (publish_locked() < 0) {
                ctx->refcount = 0;
                r = CUDA_ERROR_OPERATING_SYSTEM;
            }
        }
        node_unlock(fd);
    } else {
        ctx->refcount++;
    }
    if (r == CUDA_SUCCESS) {
        MB.has_context = 1;
        *pctx = ctx;
    }
    pthread_mutex_unlock(&G.mu);
    gate_exit();
    return r;
}

static CUresult primary_release(CUdevice dev) {
    struct fake_ctx *ctx;
    CUresult r = primary_enter(dev, &ctx);
    if (r != CUDA_SUCCESS)
        return r;
    if (ctx->refcount <= 0) {
        r = CUDA_ERROR_INVALID_CONTEXT;
    } else if (--ctx->refcount == 0) {
        /* The primary context is destroyed with its last release: its memory goes too. */
        pthread_mutex_unlock(&G.mu);
        streams_of_ctx_drop(ctx);
        pthread_mutex_lock(&G.mu);
        free_ordinal_allocs(dev);
        publish_usage();
    }
    pthread_mutex_unlock(&G.mu);
    gate_exit();
    return r;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    return primary_release(dev);
}

EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    return primary_release(dev);
}

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    CUresult r = ready_args(flags && active);
    if (r != CUDA_SUCCESS)
        return r;
    if (ordinal_gpu(dev) < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *flags = 0;
    *active = G.ctx[dev].refcount > 0;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (ctx && (ctx < &G.ctx[0] || ctx >= &G.ctx[MAX_GPUS] || ctx->magic != CTX_MAGIC))
        return CUDA_ERROR_INVALID_CONTEXT;
    t_current = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    CUresult r = ready_args(pctx != NULL);
    if (r == CUDA_SUCCESS)
        *pctx = t_current;
    return r;
}

EXPORT CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx) {
    CUresult r = ready_args(device != NULL);
    if (r != CUDA_SUCCESS)
        return r;
    if (!ctx)
        ctx = t_current;
    if ((r = ctx_check(ctx)) != CUDA_SUCCESS)
        return r;
    *device = ctx->ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *device) {
    return cuCtxGetDevice_v2(device, NULL);
}

static CUresult ctx_synchronize(CUcontext ctx) {
    CUresult r = gate_enter();
    if (r != CUDA_SUCCESS)
        return r;
    if (!ctx)
        ctx = t_current;
    if ((r = ctx_check(ctx)) == CUDA_SUCCESS) {
        pthread_mutex_lock(&G.mu);
        struct fake_stream *list[256];
        int n = 0;
        if (ctx->default_stream)
            list[n++] = ctx->default_stream;
        for (struct fake_stream *s = G.streams; s && n < 256; s = s->next)
            if (s->ctx == ctx)
                list[n++] = s;
        pthread_mutex_unlock(&G.mu);
        for (int i = 0; i < n; i++) {
            CUresult e = stream_sync(list[i]);
            if (r == CUDA_SUCCESS)
                r = e;
        }
    }
    gate_exit();
    return r;
}

EXPORT CUresult cuCtxSynchronize(void) {
    return ctx_synchronize(NULL);
}

EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx) {
    return ctx_synchronize(ctx);
}

EXPORT CUresult cuGetErrorName(CUresult error, const char **pstr) {
    if (!pstr)
        return CUDA_ERROR_INVALID_VALUE;
    *pstr = error_name(error);
    return *pstr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **pstr) {
    if (!pstr)
        return CUDA_ERROR_INVALID_VALUE;
    *pstr = error_string(error);
    return *pstr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
