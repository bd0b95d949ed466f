/* Fault injection: a test knob, not driver behaviour. node.json may hold
 *
 *   "faults": [{"call": "cuCheckpointProcessCheckpoint", "pid": 1234, "error":
 *               "CUDA_ERROR_UNKNOWN", "hang_s": 0, "after": false, "times": 1}]
 *
 * The next `times` calls of `call` (on `pid`, if given) in any process of the node hang
 * `hang_s` seconds and then fail with `error` (if given) — before doing anything, or with
 * "after": true once the call has done its work (a driver that acted and never answered).
 * "until": PATH makes the hang last until PATH exists (at most hang_s seconds when hang_s > 0),
 * so a test can act while a call is held, at a moment it knows: the claim file below exists.
 * node.json is read at every such call, so a test can add faults while processes run; each
 * occurrence is claimed once by creating ROOT/.fake-cuda/faults/INDEX.N, so the count holds
 * across processes and restarts. Hooked into cuInit, the copies, and the checkpoint calls. */
#include "fake.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static CUresult code_of(const char *name) {
    for (CUresult e = 0; e < 1000; e++) {
        const char *n = error_name(e);
        if (n && !strcmp(n, name))
            return e;
    }
    return CUDA_ERROR_UNKNOWN;
}

static int claim(const char *root, int index, int times) {
    char dir[PATH_MAX + 64], path[PATH_MAX + 96];
    snprintf(dir, sizeof(dir), "%s/.fake-cuda", root);
    mkdir(dir, 0755);
    snprintf(dir, sizeof(dir), "%s/.fake-cuda/faults", root);
    mkdir(dir, 0755);
    for (int k = 0; k < times; k++) {
        snprintf(path, sizeof(path), "%s/%d.%d", dir, index, k);
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd >= 0) {
            close(fd);
            return 1;
        }
        if (errno != EEXIST)
            return 0;
    }
    return 0;
}

/* Whether a fault applies to this call now; fills what it does. */
static int find(const char *call, int pid, int after, CUresult *error, double *hang_s,
                char until[PATH_MAX]) {
    if (load_config() != CUDA_SUCCESS)
        return 0;
    char path[PATH_MAX + 16];
    snprintf(path, sizeof(path), "%s/node.json", G.cfg.root);
    char *text = read_file(path, NULL);
    if (!text)
        return 0;
    struct json *doc = json_parse(text, NULL, 0);
    free(text);
    const struct json *faults = json_get(doc, "faults");
    int found = 0;
    for (int i = 0; faults && faults->type == J_ARR && i < faults->n && !found; i++) {
        const struct json *f = &faults->items[i];
        const struct json *c = json_get(f, "call"), *p = json_get(f, "pid"), *a = json_get(f, "after");
        const struct json *t = json_get(f, "times"), *e = json_get(f, "error"), *h = json_get(f, "hang_s");
        const struct json *u = json_get(f, "until");
        if (!c || c->type != J_STR || strcmp(c->str, call))
            continue;
        if (p && p->type == J_NUM && (int)p->num != pid)
            continue;
        if ((a && a->type == J_BOOL && a->boolean) != after)
            continue;
        if (!claim(G.cfg.root, i, t && t->type == J_NUM ? (int)t->num : 1))
            continue;
        *error = e && e->type == J_STR ? code_of(e->str) : CUDA_SUCCESS;
        *hang_s = h && h->type == J_NUM ? h->num : 0;
        snprintf(until, PATH_MAX, "%s", u && u->type == J_STR ? u->str : "");
        found = 1;
    }
    if (doc) {
        json_free(doc);
        free(doc);
    }
    return found;
}

static void hang(double seconds, const char *until) {
    if (until[0]) {
        struct timespec start, t, tick = {0, 10000000L};
        clock_gettime(CLOCK_MONOTONIC, &start);
        while (access(until, F_OK) < 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if (seconds > 0 && (double)(t.tv_sec - start.tv_sec) + (t.tv_nsec - start.tv_nsec) / 1e9 >= seconds)
                break;
            nanosleep(&tick, NULL);
        }
        return;
    }
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (seconds > 0 && nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

int fault_before(const char *call, int pid, CUresult *out) {
    CUresult error;
    double hang_s;
    char until[PATH_MAX];
    if (!find(call, pid, 0, &error, &hang_s, until))
        return 0;
    hang(hang_s, until);
    *out = error;
    return error != CUDA_SUCCESS;
}

CUresult fault_after(const char *call, int pid, CUresult result) {
    CUresult error;
    double hang_s;
    char until[PATH_MAX];
    if (result != CUDA_SUCCESS || !find(call, pid, 1, &error, &hang_s, until))
        return result;
    hang(hang_s, until);
    return error;
}
