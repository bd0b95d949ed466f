/* cuGetProcAddress: how cuda-bindings finds every entry point (it dlsyms only
 * cuGetProcAddress_v2 and cuDriverGetVersion). A name resolves to the newest ABI introduced
 * at or before the requested CUDA version; the custom-storage call exists only on a node
 * with "custom_storage": true (a driver without it says "not found", as drivers before it do
 * for the 13040 request). */
#include "fake.h"

#include <string.h>

typedef void (*fn_t)(void);

/* Declared here with loose types: the table only stores addresses. */
#define ENTRY(name, since, impl) {name, since, (fn_t)impl}
#define DECL(impl) extern void impl(void)

DECL(cuInit); DECL(cuDriverGetVersion); DECL(cuGetErrorName); DECL(cuGetErrorString);
DECL(cuDeviceGet); DECL(cuDeviceGetCount); DECL(cuDeviceGetName); DECL(cuDeviceGetUuid);
DECL(cuDeviceGetUuid_v2); DECL(cuDeviceTotalMem_v2); DECL(cuDeviceGetAttribute);
DECL(cuDeviceGetPCIBusId); DECL(cuDevicePrimaryCtxRetain); DECL(cuDevicePrimaryCtxRelease);
DECL(cuDevicePrimaryCtxRelease_v2); DECL(cuDevicePrimaryCtxGetState); DECL(cuCtxSetCurrent);
DECL(cuCtxGetCurrent); DECL(cuCtxGetDevice); DECL(cuCtxGetDevice_v2); DECL(cuCtxSynchronize);
DECL(cuCtxSynchronize_v2); DECL(cuMemAlloc_v2); DECL(cuMemFree_v2); DECL(cuMemGetInfo_v2);
DECL(cuMemcpyHtoD_v2); DECL(cuMemcpyDtoH_v2); DECL(cuMemcpyDtoD_v2); DECL(cuMemcpyHtoDAsync_v2);
DECL(cuMemcpyDtoHAsync_v2); DECL(cuMemcpyDtoDAsync_v2); DECL(cuMemsetD8_v2); DECL(cuMemsetD8Async);
DECL(cuMemHostRegister); DECL(cuMemHostRegister_v2); DECL(cuMemHostUnregister);
DECL(cuStreamCreate); DECL(cuStreamDestroy_v2); DECL(cuStreamSynchronize); DECL(cuStreamQuery);
DECL(cuStreamGetCtx); DECL(cuStreamGetCtx_v2); DECL(cuCheckpointProcessGetRestoreThreadId);
DECL(cuCheckpointProcessGetState); DECL(cuCheckpointProcessLock); DECL(cuCheckpointProcessCheckpoint);
DECL(cuCheckpointProcessRestore); DECL(cuCheckpointProcessUnlock); DECL(cuCheckpointOperationComplete);
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
                                    cuuint64_t flags, int *status);
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags);

static const struct {
    const char *name;
    int since;     /* the CUDA version that introduced this ABI of the name */
    fn_t fn;
} TABLE[] = {
    ENTRY("cuInit", 2000, cuInit),
    ENTRY("cuDriverGetVersion", 2020, cuDriverGetVersion),
    ENTRY("cuGetErrorName", 6000, cuGetErrorName),
    ENTRY("cuGetErrorString", 6000, cuGetErrorString),
    ENTRY("cuGetProcAddress", 11030, cuGetProcAddress),
    ENTRY("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    ENTRY("cuDeviceGet", 2000, cuDeviceGet),
    ENTRY("cuDeviceGetCount", 2000, cuDeviceGetCount),
    ENTRY("cuDeviceGetName", 2000, cuDeviceGetName),
    ENTRY("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
    ENTRY("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
    ENTRY("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    ENTRY("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    ENTRY("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId),
    ENTRY("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    ENTRY("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease),
    ENTRY("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    ENTRY("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
    ENTRY("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    ENTRY("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    ENTRY("cuCtxGetDevice", 2000, cuCtxGetDevice),
    ENTRY("cuCtxGetDevice", 13000, cuCtxGetDevice_v2),
    ENTRY("cuCtxSynchronize", 2000, cuCtxSynchronize),
    ENTRY("cuCtxSynchronize", 13000, cuCtxSynchronize_v2),
    ENTRY("cuMemAlloc", 3020, cuMemAlloc_v2),
    ENTRY("cuMemFree", 3020, cuMemFree_v2),
    ENTRY("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    ENTRY("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    ENTRY("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
    ENTRY("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2),
    ENTRY("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2),
    ENTRY("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2),
    ENTRY("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2),
    ENTRY("cuMemsetD8", 3020, cuMemsetD8_v2),
    ENTRY("cuMemsetD8Async", 3020, cuMemsetD8Async),
    ENTRY("cuMemHostRegister", 4000, cuMemHostRegister),
    ENTRY("cuMemHostRegister", 6050, cuMemHostRegister_v2),
    ENTRY("cuMemHostUnregister", 4000, cuMemHostUnregister),
    ENTRY("cuStreamCreate", 2000, cuStreamCreate),
    ENTRY("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    ENTRY("cuStreamSynchronize", 2000, cuStreamSynchronize),
    ENTRY("cuStreamQuery", 2000, cuStreamQuery),
    ENTRY("cuStreamGetCtx", 9020, cuStreamGetCtx),
    ENTRY("cuStreamGetCtx", 12050, cuStreamGetCtx_v2),
    ENTRY("cuCheckpointProcessGetRestoreThreadId", 12080, cuCheckpointProcessGetRestoreThreadId),
    ENTRY("cuCheckpointProcessGetState", 12080, cuCheckpointProcessGetState),
    ENTRY("cuCheckpointProcessLock", 12080, cuCheckpointProcessLock),
    ENTRY("cuCheckpointProcessCheckpoint", 12080, cuCheckpointProcessCheckpoint),
    ENTRY("cuCheckpointProcessRestore", 12080, cuCheckpointProcessRestore),
    ENTRY("cuCheckpointProcessUnlock", 12080, cuCheckpointProcessUnlock),
    ENTRY("cuCheckpointOperationComplete", 13040, cuCheckpointOperationComplete),
};

enum { PROC_SUCCESS = 0, PROC_SYMBOL_NOT_FOUND = 1, PROC_VERSION_NOT_SUFFICIENT = 2 };

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
                                    cuuint64_t flags, int *status) {
    if (!symbol || !pfn || flags > 2) /* DEFAULT, LEGACY_STREAM, PER_THREAD_DEFAULT_STREAM */
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    int custom = load_config() == CUDA_SUCCESS && G.cfg.custom_storage;
    int best = -1, exists = 0;
    for (size_t i = 0; i < sizeof(TABLE) / sizeof(TABLE[0]); i++) {
        if (strcmp(TABLE[i].name, symbol))
            continue;
        if (!strcmp(symbol, "cuCheckpointOperationComplete") && !custom)
            continue;
        exists = 1;
        if (TABLE[i].since <= cuda_version && (best < 0 || TABLE[i].since > TABLE[best].since))
            best = (int)i;
    }
    if (best < 0) {
        if (status)
            *status = exists ? PROC_VERSION_NOT_SUFFICIENT : PROC_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = (void *)TABLE[best].fn;
    if (status)
        *status = PROC_SUCCESS;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, NULL);
}
