/* A generation loop whose weights and KV cache live in device memory, for the container tests.
 *
 *   cudaloop OUT_DIR STEPS INTERVAL_MS WEIGHTS_MIB
 *
 * It loads libcuda.so.1 (the fake of tests/fakes/libcuda, bind-mounted with its node), copies
 * WEIGHTS_MIB of seeded bytes to the GPU and frees the host copy, so the device holds the only
 * copy. Each step reads bytes of the weights and of a KV-cache row chosen by its state, both
 * from the device, writes a new row to the device cache, and appends "step token state" to
 * OUT_DIR/tokens (truncated to its own length first, as genloop.py does: a run restored from an
 * older checkpoint rewrites what came after it). The stream is a hash chain over everything
 * read, so a restore that lost or changed one byte of device memory diverges. OUT_DIR/device
 * holds the UUID the process sees its GPU as, rewritten each step. "done" ends the stream.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { char bytes[16]; } CUuuid;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(void **, int);
static CUresult (*cuCtxSetCurrent)(void *);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
static CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*cuDeviceGetUuid)(CUuuid *, int);

#define ROW 64
#define CHECK(call)                                                                                \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_) {                                                                                  \
            fprintf(stderr, "cudaloop: %s failed: %d\n", #call, r_);                               \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "cudaloop: %s: %s\n", name, dlerror());
        exit(2);
    }
    return p;
}

static uint64_t mix(uint64_t h, uint64_t v) { /* splitmix64 of h ^ v */
    uint64_t z = h ^ v;
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void put(const char *path, off_t *length, const char *text) {
    int fd = open(path, O_WRONLY | O_CREAT, 0644); /* opened per write: CRIU holds no fd of it */
    if (fd < 0 || ftruncate(fd, *length) < 0 || pwrite(fd, text, strlen(text), *length) < 0) {
        perror(path);
        exit(2);
    }
    close(fd);
    *length += (off_t)strlen(text);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: cudaloop OUT_DIR STEPS INTERVAL_MS WEIGHTS_MIB\n");
        return 2;
    }
    long steps = atol(argv[2]), interval_ms = atol(argv[3]);
    size_t size = (size_t)atol(argv[4]) << 20;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "cudaloop: %s\n", dlerror());
        return 2;
    }
    cuInit = sym(lib, "cuInit");
    cuDeviceGet = sym(lib, "cuDeviceGet");
    cuDevicePrimaryCtxRetain = sym(lib, "cuDevicePrimaryCtxRetain");
    cuCtxSetCurrent = sym(lib, "cuCtxSetCurrent");
    cuMemAlloc = sym(lib, "cuMemAlloc_v2");
    cuMemcpyHtoD = sym(lib, "cuMemcpyHtoD_v2");
    cuMemcpyDtoH = sym(lib, "cuMemcpyDtoH_v2");
    cuDeviceGetUuid = sym(lib, "cuDeviceGetUuid");

    int dev;
    void *ctx;
    CUdeviceptr weights, cache;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuMemAlloc(&weights, size));
    CHECK(cuMemAlloc(&cache, (size_t)(steps + 1) * ROW));
    uint64_t *host = malloc(size);
    uint64_t seed = 1234;
    for (size_t i = 0; i < size / 8; i++)
        host[i] = seed = mix(seed, i);
    CHECK(cuMemcpyHtoD(weights, host, size));
    free(host); /* from here the device holds the only copy */

    char tokens[4096], device[4096];
    snprintf(tokens, sizeof(tokens), "%s/tokens", argv[1]);
    snprintf(device, sizeof(device), "%s/device", argv[1]);
    off_t length = 0;
    put(tokens, &length, "");
    uint64_t h = 0x70726f6d7074ull; /* "prompt" */
    for (long step = 1; step <= steps; step++) {
        uint64_t w[4] = {0}, row[ROW / 8] = {0};
        for (int i = 0; i < 4; i++) {
            size_t at = (size_t)(mix(h, (uint64_t)i) % (size / 8)) * 8;
            CHECK(cuMemcpyDtoH(&w[i], weights + at, 8));
            h = mix(h, w[i]);
        }
        if (step > 1) {
            CHECK(cuMemcpyDtoH(row, cache + (CUdeviceptr)((h % (uint64_t)(step - 1)) * ROW), ROW));
            for (int i = 0; i < ROW / 8; i++)
                h = mix(h, row[i]);
        }
        h = mix(h, (uint64_t)step);
        for (int i = 0; i < ROW / 8; i++)
            row[i] = mix(h, (uint64_t)(100 + i));
        CHECK(cuMemcpyHtoD(cache + (CUdeviceptr)((step - 1) * ROW), row, ROW));

        char line[128];
        snprintf(line, sizeof(line), "%ld %llu %016llx\n", step,
                 (unsigned long long)(h % 32000), (unsigned long long)h);
        put(tokens, &length, line);
        CUuuid uuid;
        CHECK(cuDeviceGetUuid(&uuid, dev));
        const unsigned char *u = (const unsigned char *)uuid.bytes;
        char text[64];
        snprintf(text, sizeof(text),
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n",
                 u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12],
                 u[13], u[14], u[15]);
        off_t zero = 0;
        put(device, &zero, text);
        if (interval_ms) {
            struct timespec ts = {interval_ms / 1000, (interval_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        }
    }
    put(tokens, &length, "done\n");
    return 0;
}
