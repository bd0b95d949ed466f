/*
 * A fake libcuda.so.1 for tests: the CUDA driver API surface gpusnap uses, with the
 * checkpoint API, behaving as NVIDIA documents it and as NVIDIA's trackers report it
 * (docs/gpu.md, "The fake driver", cites each rule).
 *
 * A node is a directory ($GPUSNAP_FAKE_CUDA_ROOT) holding node.json. Device memory of a
 * process is anonymous memory of that process at the addresses cuMemAlloc returns; what a
 * node shares is its accounting: one small usage file per process under the root, summed
 * under a flock that is held only inside a call. Between calls a process holds no file of
 * the node open, so CRIU can dump it in any state, and a checkpointed process holds nothing
 * of its node at all (it may be restored on another one).
 *
 * The checkpoint calls reach a target process through its mailbox, a static struct of this
 * library in the target, read and written with process_vm_readv/writev (the caller needs
 * ptrace rights over the target, as the real driver does) and a real-time signal that wakes
 * the target's restore thread, which does the work inside the target.
 */
#ifndef GPUSNAP_FAKE_CUDA_H
#define GPUSNAP_FAKE_CUDA_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- CUDA types, laid out as cuda.h (13.4) lays them out ------------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef int CUprocessState;
typedef unsigned long long CUdeviceptr;
typedef uint64_t cuuint64_t;
typedef struct fake_ctx *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_green *CUgreenCtx;
typedef struct fake_operation *CUcheckpointOperationHandle;
typedef struct { char bytes[16]; } CUuuid;

typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    cuuint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct {
    cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

typedef struct {
    CUuuid oldUuid;
    CUuuid newUuid;
} CUcheckpointGpuPair;

typedef struct {
    CUdeviceptr devPtr;
    size_t size;
    CUstream stream;
} CUcheckpointCustomStoragePerDeviceData;

typedef struct {
    CUcheckpointOperationHandle handle;
    CUcheckpointCustomStoragePerDeviceData *perDeviceData;
    unsigned int deviceCount;
} CUcheckpointCustomStorageInfo;

typedef struct {
    CUcheckpointCustomStorageInfo **customStorageInfo_out;
    char reserved[56];
} CUcheckpointCheckpointArgs;

typedef struct {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    unsigned int padding0;
    CUcheckpointCustomStorageInfo **customStorageInfo_out;
    char reserved[40];
} CUcheckpointRestoreArgs;

/* "All Args structs stay 64 bytes": cuda.h 13.4 and cuda-bindings 13.5 (cydriver.pxd). */
_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "LockArgs");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "UnlockArgs");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "CheckpointArgs");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "RestoreArgs");
_Static_assert(offsetof(CUcheckpointRestoreArgs, customStorageInfo_out) == 16, "RestoreArgs");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "GpuPair");
_Static_assert(sizeof(CUcheckpointCustomStoragePerDeviceData) == 24, "PerDeviceData");

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3,
    CU_PROCESS_STATE_CHECKPOINTING = 4,
    CU_PROCESS_STATE_RESTORING = 5,
};

#define CU_STREAM_NON_BLOCKING 0x1u
#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define CU_MEMHOSTREGISTER_ALL_FLAGS 0xfu /* PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY */

/* ---- the node ---------------------------------------------------------------------------- */

#define MAX_GPUS 16
#define MAX_PAIRS 64
#define ROOT_ENV "GPUSNAP_FAKE_CUDA_ROOT"

struct gpu {
    char uuid_text[64];    /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    unsigned char uuid[16];
    char name[256];
    uint64_t total_memory;
    int cc_major, cc_minor;
    char pci_bus_id[64];
    int pci_domain, pci_bus, pci_device;
};

struct node_cfg {
    char root[PATH_MAX];      /* absolute, resolved */
    int driver_version;       /* e.g. 13000 */
    char driver_version_string[64];
    int custom_storage;       /* the CUDA 13.4 custom-storage calls exist */
    double copy_gbps;         /* device copy rate; <= 0: no pacing */
    uint64_t context_memory;  /* device bytes a context holds (optional key) */
    int ngpus;
    struct gpu gpus[MAX_GPUS];
};

/* node.c */
int node_load(const char *root, struct node_cfg *cfg, char *err, size_t errlen);
int node_visible(const struct node_cfg *cfg, int visible[MAX_GPUS]);
int node_gpu_by_uuid(const struct node_cfg *cfg, const unsigned char uuid[16]);
int node_lock(const char *root);
void node_unlock(int fd);
void node_used(const char *root, const struct node_cfg *cfg, uint64_t used[MAX_GPUS]);
int node_publish(const char *root, const uint64_t mine[MAX_GPUS]);
uint64_t proc_starttime(int pid);
int same_process(int pid, uint64_t start);
int parse_uuid(const char *text, unsigned char out[16]);
char *read_file(const char *path, size_t *len);

/* json.c: just enough JSON for node.json */
enum json_type { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ };
struct json {
    enum json_type type;
    double num;
    int boolean;
    char *str;
    struct json *items;  /* array items or object values */
    char **keys;         /* object keys */
    int n;
};
struct json *json_parse(const char *text, char *err, size_t errlen);
void json_free(struct json *v);
const struct json *json_get(const struct json *obj, const char *key);

/* ---- process-wide state of this library ---------------------------------------------------- */

struct fake_ctx {
    uint32_t magic;
    int ordinal;
    int refcount;       /* primary context retains */
    struct fake_stream *default_stream;
};

struct alloc {
    CUdeviceptr ptr;
    size_t size;        /* as asked */
    size_t mapped;      /* page-rounded length of its mapping */
    int ordinal;
    void *staged;       /* host copy while CHECKPOINTED (host-staged) */
};

struct fake {
    int initialized;
    int forked;         /* a fork child: CUDA is not usable there */
    CUresult init_result;
    pid_t pid;
    struct node_cfg cfg;
    int visible[MAX_GPUS];     /* ordinal -> node GPU index, -1 once lost by a restore */
    unsigned char old_uuid[MAX_GPUS][16];
    int nvisible;
    struct fake_ctx ctx[MAX_GPUS];
    pthread_mutex_t mu;        /* allocations, contexts, streams, registrations, cfg */
    struct alloc *allocs;
    int nallocs, allocs_cap;
    int released;              /* device resources released (checkpointed) */
    int contents_external;     /* checkpointed through custom storage: no host copy */
    struct fake_stream *streams;
    struct hostreg *hostregs;
    /* the lock gate */
    pthread_mutex_t gate_mu;
    pthread_cond_t gate_cv;
    int locking, locked, in_api, pending;
};
extern struct fake G;

/* runtime.c */
CUresult ready(void);
CUresult ready_args(int args_ok); /* ready, then INVALID_VALUE unless args_ok */
CUresult gate_enter(void);
void gate_exit(void);
struct fake_ctx *current_ctx(void);
CUresult ctx_check(struct fake_ctx *ctx);
int ordinal_gpu(int ordinal);
void usage_of(uint64_t mine[MAX_GPUS]);
int publish_usage(void);
int publish_locked(void);
int room_locked(int g, uint64_t extra);
void paced_wait(const struct timespec *start, uint64_t bytes);
void now(struct timespec *ts);
CUresult load_config(void);

/* memory.c, streams.c */
struct fake_stream {
    uint32_t magic;
    struct fake_ctx *ctx;
    unsigned int flags;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct op *head, *tail;
    int busy, destroyed, started;
    CUresult error;
    pthread_t thread;
    struct fake_stream *next;
};
struct op {
    struct op *next;
    int memset;
    uintptr_t dst, src;
    size_t n;
    unsigned char value;
};
struct alloc *alloc_containing(CUdeviceptr p, size_t n);
CUresult need_ctx(struct fake_ctx **out);
CUresult run_op(const struct op *op);
void free_ordinal_allocs(int ordinal);
void streams_of_ctx_drop(struct fake_ctx *ctx);
CUresult stream_sync(struct fake_stream *s);
CUresult enqueue(struct fake_stream *s, const struct op *op);
CUresult resolve(CUstream h, struct fake_stream **out);
CUresult stream_lookup(CUstream h, struct fake_stream **out); /* resolve under G.mu */
void wait_blocking_streams(struct fake_ctx *ctx);
CUresult stream_create_in(struct fake_ctx *ctx, unsigned int flags, struct fake_stream **out);
int stream_destroy(struct fake_stream *s);

/* remote.c: process_vm_* and custom-storage mappings in the caller */
int remote_rw(pid_t pid, uintptr_t addr, void *buf, size_t n, int write);
struct seg { uint64_t addr, len; };
struct rmap;
int rmap_covers(uintptr_t p, size_t n);
CUresult rmap_copy(uintptr_t dst, uintptr_t src, size_t n);
uintptr_t rmap_create(pid_t tgid, const struct seg *segs, size_t nseg, size_t size);
void rmap_destroy(uintptr_t base);

/* target.c: the mailbox and the restore thread */
#define MB_MAGIC 0x6770736e61706375ull /* "gpsnapcu" */
#define MB_LAYOUT 1
enum {
    OP_LOCK = 1,
    OP_CHECKPOINT,
    OP_RESTORE,
    OP_UNLOCK,
    OP_CS_CHECKPOINT,
    OP_CS_RESTORE,
    OP_CS_COMPLETE,
};
struct request {
    int32_t op;
    uint32_t timeout_ms;
    int32_t caller_pid;
    uint32_t npairs;
    uint64_t caller_start;
    uint64_t operation;          /* OP_CS_COMPLETE: the operation's id */
    uint32_t nctx;               /* custom storage: GPUs whose primary context the caller retains */
    uint32_t pad;
    unsigned char ctx_uuids[MAX_GPUS][16];
    unsigned char pairs[MAX_PAIRS][2][16];
    char root[PATH_MAX];         /* the caller's node, for a restore */
};
struct cs_device {
    unsigned char uuid[16];
    uint64_t size;
    uint64_t nseg;
    uint64_t segs;               /* address, in the target, of nseg struct seg */
};
struct response {
    int32_t result;
    uint32_t ndev;
    uint64_t operation;
    struct cs_device dev[MAX_GPUS];
};
struct mailbox {
    uint64_t magic;
    uint32_t layout;
    int32_t pid;
    int32_t tid;                 /* the restore thread */
    int32_t has_context;         /* has held a context: a CUDA process */
    int32_t state;
    int32_t poisoned;            /* a restore failed for lack of memory (cuda-checkpoint #44) */
    uint64_t req_seq;
    uint64_t resp_seq;
    struct request req;
    struct response resp;
};
extern struct mailbox MB;
int start_restore_thread(void);
int wake_signal(void);

/* faults.c: node.json "faults", a test knob */
int fault_before(const char *call, int pid, CUresult *out);
CUresult fault_after(const char *call, int pid, CUresult result);
#define FAULTED(call, pid, expr)                                                                   \
    do {                                                                                           \
        CUresult fault_result_;                                                                    \
        if (fault_before(call, pid, &fault_result_))                                               \
            return fault_result_;                                                                  \
        return fault_after(call, pid, (expr));                                                     \
    } while (0)

/* errors.c */
const char *error_name(CUresult e);
const char *error_string(CUresult e);

#endif
