/* The caller side of the checkpoint API: cuCheckpointProcess* on another process, and
 * cuCheckpointOperationComplete.
 *
 * The target is found through /proc (as cuda-checkpoint does, NVIDIA/cuda-checkpoint#41): its
 * mailbox is where this same library file is mapped in it, at the offset MB has here. A pid
 * that does not exist: CUDA_ERROR_INVALID_VALUE; one without this library or without cuInit:
 * CUDA_ERROR_NOT_INITIALIZED (GetState answers RUNNING for a process that ran cuInit but never
 * held a context; everything else needs a context). Callers of one target are serialized with
 * a flock on /proc/TGID, which the caller holds, never the target. */
#include "fake.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#define OP_MAGIC 0x4f704f70u

struct fake_operation {
    uint32_t magic;
    int kind;
    pid_t tgid;
    uint64_t id;
    CUcheckpointCustomStorageInfo *info;
    struct fake_operation *next;
};

static struct fake_operation *operations;
static pthread_mutex_t ops_mu = PTHREAD_MUTEX_INITIALIZER;

struct target {
    pid_t tgid;
    pid_t nspid; /* tgid in the target's own pid namespace: what it knows itself as */
    uintptr_t mb;
};

/* ---- finding the target -------------------------------------------------------------------- */

struct mapping {
    unsigned long dev_major, dev_minor, ino;
    uintptr_t base;
};

static int find_mapping(pid_t pid, uintptr_t containing, struct mapping *m) {
    char path[64], line[PATH_MAX + 256];
    snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    int found = 0;
    struct mapping want = *m;
    while (fgets(line, sizeof(line), f)) {
        unsigned long start, end, off, maj, min, ino;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s %lx %lx:%lx %lu", &start, &end, perms, &off, &maj, &min, &ino) != 7 ||
            ino == 0)
            continue;
        if (containing) {
            if (containing >= start && containing < end) {
                *m = (struct mapping){maj, min, ino, 0};
                found = 1;
                break;
            }
        } else if (maj == want.dev_major && min == want.dev_minor && ino == want.ino && off == 0) {
            m->base = start;
            found = 1;
            break;
        }
    }
    fclose(f);
    return found ? 0 : -1;
}

static pthread_once_t self_once = PTHREAD_ONCE_INIT;
static struct mapping self;

static void find_self(void) {
    if (find_mapping(getpid(), (uintptr_t)&find_self, &self) == 0)
        find_mapping(getpid(), 0, &self);
}

static pid_t tgid_of(int pid) {
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    pid_t tgid = -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "Tgid: %d", &tgid) == 1)
            break;
    fclose(f);
    return tgid;
}

/* The id of task PATH (/proc/N or /proc/N/task/M) in its innermost pid namespace: the last
 * number of "NSpid:". A process in a container knows itself (getpid, gettid) by these, the
 * caller on the host by the others; the real driver takes host ids for both (cuda-checkpoint
 * is run from the host on containers' processes). -1 when it cannot be read. */
static pid_t innermost_id(const char *status_path) {
    char line[256];
    FILE *f = fopen(status_path, "re");
    if (!f)
        return -1;
    pid_t id = -1;
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, "NSpid:", 6))
            continue;
        char *last = strrchr(line, '\t');
        id = (pid_t)strtol(last ? last : line + 6, NULL, 10);
        break;
    }
    fclose(f);
    return id;
}

/* The caller's (host) id of the target's thread that knows itself as ``ns_tid``. */
static pid_t host_tid(pid_t tgid, pid_t ns_tid) {
    char path[96];
    snprintf(path, sizeof(path), "/proc/%d/task/%d/status", (int)tgid, (int)ns_tid);
    if (innermost_id(path) == ns_tid)
        return ns_tid; /* the same pid namespace: the ids are the same */
    snprintf(path, sizeof(path), "/proc/%d/task", (int)tgid);
    DIR *d = opendir(path);
    if (!d)
        return -1;
    pid_t found = -1;
    struct dirent *e;
    while (found < 0 && (e = readdir(d)) != NULL) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9')
            continue;
        pid_t tid = (pid_t)strtol(e->d_name, NULL, 10);
        snprintf(path, sizeof(path), "/proc/%d/task/%d/status", (int)tgid, (int)tid);
        if (innermost_id(path) == ns_tid)
            found = tid;
    }
    closedir(d);
    return found;
}

static CUresult errno_result(int e) {
    if (e == ESRCH)
        return CUDA_ERROR_INVALID_VALUE; /* gone */
    if (e == EPERM || e == EACCES)
        return CUDA_ERROR_OPERATING_SYSTEM; /* no ptrace rights over it */
    return CUDA_ERROR_NOT_INITIALIZED;
}

static CUresult read_header(const struct target *t, struct mailbox *hdr) {
    int e = remote_rw(t->tgid, t->mb, hdr, offsetof(struct mailbox, req), 0);
    if (e)
        return errno_result(e);
    if (__atomic_load_n(&hdr->magic, __ATOMIC_ACQUIRE) != MB_MAGIC || hdr->layout != MB_LAYOUT ||
        hdr->pid != t->nspid)
        return CUDA_ERROR_NOT_INITIALIZED; /* no cuInit there, or a fork child of a CUDA process */
    return CUDA_SUCCESS;
}

static CUresult locate(int pid, struct target *t, struct mailbox *hdr) {
    pthread_once(&self_once, find_self);
    if (pid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    t->tgid = tgid_of(pid);
    if (t->tgid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    char status[64];
    snprintf(status, sizeof(status), "/proc/%d/status", (int)t->tgid);
    t->nspid = innermost_id(status);
    if (t->nspid <= 0)
        t->nspid = t->tgid; /* no NSpid line (kernels before 4.1): one namespace */
    struct mapping there = self;
    if (!self.base || find_mapping(t->tgid, 0, &there) < 0)
        return CUDA_ERROR_NOT_INITIALIZED; /* this driver is not loaded there */
    t->mb = there.base + ((uintptr_t)&MB - self.base);
    return read_header(t, hdr);
}

static void backoff(long *ns) {
    struct timespec ts = {0, *ns};
    nanosleep(&ts, NULL);
    if (*ns < 5000000L)
        *ns *= 2;
}

/* Send one request and wait, however long it takes, for the target's answer (a hung target
 * hangs its caller, as the real driver does; the caller's own deadline is the bound). */
static CUresult call(int pid, struct request *req, struct response *resp) {
    struct target t;
    struct mailbox hdr;
    CUresult r = locate(pid, &t, &hdr);
    if (r != CUDA_SUCCESS)
        return r;
    if (!hdr.has_context)
        return CUDA_ERROR_NOT_INITIALIZED; /* cuInit but no context: nothing to checkpoint */
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d", (int)t.tgid);
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_INVALID_VALUE;
    while (flock(fd, LOCK_EX) < 0 && errno == EINTR)
        ;
    req->caller_pid = (int32_t)getpid();
    req->caller_start = proc_starttime(getpid());
    long wait_ns = 50000;
    /* A caller killed mid-request leaves it to finish: wait for the target to answer it. */
    while ((r = read_header(&t, &hdr)) == CUDA_SUCCESS && hdr.resp_seq != hdr.req_seq)
        backoff(&wait_ns);
    uint64_t seq = hdr.req_seq + 1;
    int e = 0;
    if (r == CUDA_SUCCESS) {
        e = remote_rw(t.tgid, t.mb + offsetof(struct mailbox, req), req, sizeof(*req), 1);
        if (!e)
            e = remote_rw(t.tgid, t.mb + offsetof(struct mailbox, req_seq), &seq, sizeof(seq), 1);
        pid_t tid = e ? -1 : host_tid(t.tgid, hdr.tid);
        if (!e && tid < 0)
            e = ESRCH;
        if (!e && syscall(SYS_tgkill, t.tgid, tid, wake_signal()) < 0)
            e = errno;
        r = e ? errno_result(e) : CUDA_SUCCESS;
    }
    wait_ns = 50000;
    while (r == CUDA_SUCCESS) {
        uint64_t done = 0;
        e = remote_rw(t.tgid, t.mb + offsetof(struct mailbox, resp_seq), &done, sizeof(done), 0);
        if (e) {
            r = errno_result(e);
        } else if (done == seq) {
            e = remote_rw(t.tgid, t.mb + offsetof(struct mailbox, resp), resp, sizeof(*resp), 0);
            r = e ? errno_result(e) : resp->result;
            break;
        } else {
            backoff(&wait_ns);
        }
    }
    close(fd);
    return r;
}

/* ---- the entry points ------------------------------------------------------------------------ */

static int zeroed(const void *p, size_t n) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        if (c[i])
            return 0;
    return 1;
}

/* locate, for a query whose out argument must not be NULL (checked first). */
static CUresult locate_for(int pid, const void *out, struct target *t, struct mailbox *hdr) {
    return out ? locate(pid, t, hdr) : CUDA_ERROR_INVALID_VALUE;
}

static CUresult CheckpointProcessGetState_impl(int pid, CUprocessState *state) {
    struct target t;
    struct mailbox hdr;
    CUresult r = locate_for(pid, state, &t, &hdr);
    if (r == CUDA_SUCCESS)
        *state = hdr.state;
    return r;
}

static CUresult CheckpointProcessGetRestoreThreadId_impl(int pid, int *tid) {
    struct target t;
    struct mailbox hdr;
    CUresult r = locate_for(pid, tid, &t, &hdr);
    if (r == CUDA_SUCCESS && !hdr.has_context)
        r = CUDA_ERROR_NOT_INITIALIZED;
    if (r == CUDA_SUCCESS && (*tid = host_tid(t.tgid, hdr.tid)) < 0)
        r = CUDA_ERROR_INVALID_VALUE;
    return r;
}

static CUresult CheckpointProcessLock_impl(int pid, CUcheckpointLockArgs *args) {
    struct request req = {.op = OP_LOCK};
    struct response resp;
    if (args) {
        if (args->reserved0 || !zeroed(args->reserved1, sizeof(args->reserved1)))
            return CUDA_ERROR_INVALID_VALUE; /* "Reserved for future use, must be zero" */
        req.timeout_ms = args->timeoutMs;
    }
    return call(pid, &req, &resp);
}

static CUresult CheckpointProcessUnlock_impl(int pid, CUcheckpointUnlockArgs *args) {
    struct request req = {.op = OP_UNLOCK};
    struct response resp;
    if (args && !zeroed(args, sizeof(*args)))
        return CUDA_ERROR_INVALID_VALUE;
    return call(pid, &req, &resp);
}

/* GPUs whose primary context this process retains: custom storage maps onto those. */
static void retained_contexts(struct request *req) {
    req->nctx = 0;
    for (int o = 0; o < G.nvisible; o++) {
        int g = ordinal_gpu(o);
        if (g >= 0 && G.ctx[o].refcount > 0)
            memcpy(req->ctx_uuids[req->nctx++], G.cfg.gpus[g].uuid, 16);
    }
}

static int ordinal_of(const unsigned char uuid[16]) {
    for (int o = 0; o < G.nvisible; o++) {
        int g = ordinal_gpu(o);
        if (g >= 0 && !memcmp(G.cfg.gpus[g].uuid, uuid, 16))
            return o;
    }
    return -1;
}

static void free_info(CUcheckpointCustomStorageInfo *info) {
    for (unsigned i = 0; i < info->deviceCount; i++) {
        if (info->perDeviceData[i].devPtr)
            rmap_destroy((uintptr_t)info->perDeviceData[i].devPtr);
        if (info->perDeviceData[i].stream)
            stream_destroy(info->perDeviceData[i].stream);
    }
    free(info->perDeviceData);
    free(info);
}

/* The target's memory is now mapped here: build the info the driver hands back. */
static CUresult map_operation(pid_t tgid, int kind, const struct response *resp,
                              CUcheckpointCustomStorageInfo **out) {
    struct fake_operation *op = calloc(1, sizeof(*op));
    CUcheckpointCustomStorageInfo *info = calloc(1, sizeof(*info));
    CUcheckpointCustomStoragePerDeviceData *per = calloc(resp->ndev ? resp->ndev : 1, sizeof(*per));
    if (!op || !info || !per) {
        free(op);
        free(info);
        free(per);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    info->perDeviceData = per;
    info->handle = op;
    CUresult r = CUDA_SUCCESS;
    for (uint32_t i = 0; i < resp->ndev && r == CUDA_SUCCESS; i++) {
        const struct cs_device *d = &resp->dev[i];
        struct seg *segs = malloc(sizeof(*segs) * (size_t)(d->nseg ? d->nseg : 1));
        int o = ordinal_of(d->uuid);
        if (!segs || o < 0) {
            free(segs);
            r = segs ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        int e = remote_rw(tgid, (uintptr_t)d->segs, segs, sizeof(*segs) * d->nseg, 0);
        uintptr_t base = e ? 0 : rmap_create(tgid, segs, d->nseg, d->size);
        free(segs);
        info->deviceCount = i + 1;
        if (!base) {
            r = e ? errno_result(e) : CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        per[i].devPtr = (CUdeviceptr)base;
        per[i].size = d->size;
        /* "a stream in that GPU's primary context" for enqueuing the copies */
        r = stream_create_in(&G.ctx[o], CU_STREAM_NON_BLOCKING, &per[i].stream);
    }
    if (r != CUDA_SUCCESS) {
        free_info(info);
        free(op);
        return r;
    }
    op->magic = OP_MAGIC;
    op->kind = kind;
    op->tgid = tgid;
    op->id = resp->operation;
    op->info = info;
    pthread_mutex_lock(&ops_mu);
    op->next = operations;
    operations = op;
    pthread_mutex_unlock(&ops_mu);
    *out = info;
    return CUDA_SUCCESS;
}

static CUresult custom_storage_call(int pid, struct request *req, CUcheckpointCustomStorageInfo **out) {
    CUresult r = ready(); /* unlike the other checkpoint calls, custom storage needs cuInit */
    if (r != CUDA_SUCCESS)
        return r;
    if (!G.cfg.custom_storage)
        return CUDA_ERROR_INVALID_VALUE; /* a pre-13.4 driver: that field is reserved, nonzero */
    pid_t tgid = tgid_of(pid);
    if (tgid == getpid())
        return CUDA_ERROR_NOT_SUPPORTED; /* checkpointing the calling process itself */
    struct response resp;
    retained_contexts(req);
    r = call(pid, req, &resp);
    if (r == CUDA_SUCCESS)
        r = map_operation(tgid, req->op, &resp, out);
    return r;
}

static CUresult CheckpointProcessCheckpoint_impl(int pid, CUcheckpointCheckpointArgs *args) {
    struct request req = {.op = OP_CHECKPOINT};
    struct response resp;
    if (args && !zeroed(args->reserved, sizeof(args->reserved)))
        return CUDA_ERROR_INVALID_VALUE;
    if (args && args->customStorageInfo_out) {
        req.op = OP_CS_CHECKPOINT;
        return custom_storage_call(pid, &req, args->customStorageInfo_out);
    }
    return call(pid, &req, &resp);
}

static CUresult CheckpointProcessRestore_impl(int pid, CUcheckpointRestoreArgs *args) {
    struct request req = {.op = OP_RESTORE};
    struct response resp;
    /* "requires persistence mode to be enabled or cuInit to have been called" (the fake has
     * no persistence mode); the caller's node is where the process will live. */
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (args) {
        if (args->padding0 || !zeroed(args->reserved, sizeof(args->reserved)) ||
            (args->gpuPairsCount && !args->gpuPairs) || args->gpuPairsCount > MAX_PAIRS)
            return CUDA_ERROR_INVALID_VALUE;
        req.npairs = args->gpuPairsCount;
        for (unsigned i = 0; i < args->gpuPairsCount; i++) {
            memcpy(req.pairs[i][0], args->gpuPairs[i].oldUuid.bytes, 16);
            memcpy(req.pairs[i][1], args->gpuPairs[i].newUuid.bytes, 16);
        }
    }
    snprintf(req.root, sizeof(req.root), "%s", G.cfg.root);
    if (args && args->customStorageInfo_out) {
        req.op = OP_CS_RESTORE;
        return custom_storage_call(pid, &req, args->customStorageInfo_out);
    }
    return call(pid, &req, &resp);
}

static CUresult CheckpointOperationComplete_impl(CUcheckpointOperationHandle handle) {
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (!G.cfg.custom_storage)
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&ops_mu);
    struct fake_operation **pp = &operations;
    while (*pp && *pp != handle)
        pp = &(*pp)->next;
    struct fake_operation *op = *pp;
    pthread_mutex_unlock(&ops_mu);
    if (!op || op->magic != OP_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    /* "will first synchronize on the streams returned" */
    for (unsigned i = 0; i < op->info->deviceCount && r == CUDA_SUCCESS; i++)
        r = stream_sync(op->info->perDeviceData[i].stream);
    if (r != CUDA_SUCCESS)
        return r;
    struct request req = {.op = OP_CS_COMPLETE, .operation = op->id};
    struct response resp;
    r = call(op->tgid, &req, &resp);
    pthread_mutex_lock(&ops_mu);
    for (pp = &operations; *pp; pp = &(*pp)->next)
        if (*pp == op) {
            *pp = op->next;
            break;
        }
    pthread_mutex_unlock(&ops_mu);
    free_info(op->info);
    op->magic = 0;
    free(op);
    return r;
}

/* The exported entry points: the calls above, under the fault knob (faults.c). Each
 * CHECKPOINT_ENTRY(name, type) defines cu<name>(int pid, type arg) as name##_impl(pid, arg). */
#define CHECKPOINT_ENTRY(name, arg_type)                                                           \
    EXPORT CUresult cu##name(int pid, arg_type arg) {                                              \
        FAULTED("cu" #name, pid, name##_impl(pid, arg));                                           \
    }

CHECKPOINT_ENTRY(CheckpointProcessGetState, CUprocessState *)
CHECKPOINT_ENTRY(CheckpointProcessGetRestoreThreadId, int *)
CHECKPOINT_ENTRY(CheckpointProcessLock, CUcheckpointLockArgs *)
CHECKPOINT_ENTRY(CheckpointProcessUnlock, CUcheckpointUnlockArgs *)
CHECKPOINT_ENTRY(CheckpointProcessCheckpoint, CUcheckpointCheckpointArgs *)
CHECKPOINT_ENTRY(CheckpointProcessRestore, CUcheckpointRestoreArgs *)

EXPORT CUresult cuCheckpointOperationComplete(CUcheckpointOperationHandle handle) {
    FAULTED("cuCheckpointOperationComplete", 0, CheckpointOperationComplete_impl(handle));
}
