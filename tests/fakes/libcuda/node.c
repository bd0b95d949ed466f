/* The node: node.json, CUDA_VISIBLE_DEVICES, and the per-node device-memory accounting.
 *
 * Accounting: each process with device resources on a node has one usage file,
 * ROOT/.fake-cuda/usage/PID, naming its start time and its bytes per GPU of that node. Free
 * memory is a GPU's total minus the bytes of every live process (same start time, not a
 * zombie), so a process that dies frees its memory as a GPU does, and a process CRIU restores
 * (same pid, new start time) counts only once it has re-registered at cuCheckpointProcessRestore.
 * Changes are made under a flock of ROOT/.fake-cuda/lock held only within one call. */
#include "fake.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define USAGE_MAGIC 0x6167617375636667ull

struct usage {
    uint64_t magic;
    int32_t pid;
    int32_t ngpus;
    uint64_t starttime;
    uint64_t bytes[MAX_GPUS];
};

/* A whole file, NUL-terminated (malloc'd), or NULL. */
char *read_file(const char *path, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n + 1 >= cap) {
            char *more = realloc(buf, cap *= 2);
            if (!more) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = more;
        }
        ssize_t r = read(fd, buf + n, cap - n - 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            free(buf);
            buf = NULL;
            break;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    if (buf) {
        buf[n] = '\0';
        if (len)
            *len = n;
    }
    return buf;
}

int parse_uuid(const char *text, unsigned char out[16]) {
    const char *s = text;
    if (!strncasecmp(s, "GPU-", 4) || !strncasecmp(s, "MIG-", 4))
        s += 4;
    int n = 0;
    for (; *s && n < 32; s++) {
        if (*s == '-')
            continue;
        if (!isxdigit((unsigned char)*s))
            return -1;
        int v = isdigit((unsigned char)*s) ? *s - '0' : tolower((unsigned char)*s) - 'a' + 10;
        if (n % 2 == 0)
            out[n / 2] = (unsigned char)(v << 4);
        else
            out[n / 2] |= (unsigned char)v;
        n++;
    }
    return (n == 32 && *s == '\0') ? 0 : -1;
}

static int want_num(const struct json *obj, const char *key, double *out, int required,
                    char *err, size_t errlen) {
    const struct json *v = json_get(obj, key);
    if (!v) {
        if (required)
            snprintf(err, errlen, "missing \"%s\"", key);
        return required ? -1 : 0;
    }
    if (v->type != J_NUM) {
        snprintf(err, errlen, "\"%s\" must be a number", key);
        return -1;
    }
    *out = v->num;
    return 0;
}

static int want_str(const struct json *obj, const char *key, char *out, size_t outlen,
                    int required, char *err, size_t errlen) {
    const struct json *v = json_get(obj, key);
    if (!v) {
        if (required)
            snprintf(err, errlen, "missing \"%s\"", key);
        return required ? -1 : 0;
    }
    if (v->type != J_STR || strlen(v->str) >= outlen) {
        snprintf(err, errlen, "\"%s\" must be a string shorter than %zu", key, outlen);
        return -1;
    }
    strcpy(out, v->str);
    return 0;
}

static int load_gpu(const struct json *g, struct gpu *out, int i, char *err, size_t errlen) {
    char sub[200] = "";
    double total = 0;
    memset(out, 0, sizeof(*out));
    if (g->type != J_OBJ) {
        snprintf(err, errlen, "gpus[%d] must be an object", i);
        return -1;
    }
    if (want_str(g, "uuid", out->uuid_text, sizeof(out->uuid_text), 1, sub, sizeof(sub)) ||
        parse_uuid(out->uuid_text, out->uuid) ||
        want_str(g, "name", out->name, sizeof(out->name), 1, sub, sizeof(sub)) ||
        want_num(g, "total_memory", &total, 1, sub, sizeof(sub)) || total <= 0 ||
        want_str(g, "pci_bus_id", out->pci_bus_id, sizeof(out->pci_bus_id), 1, sub, sizeof(sub))) {
        snprintf(err, errlen, "gpus[%d]: %s", i, sub[0] ? sub : "bad uuid or total_memory");
        return -1;
    }
    out->total_memory = (uint64_t)total;
    const struct json *cc = json_get(g, "compute_capability");
    if (!cc || cc->type != J_ARR || cc->n != 2 || cc->items[0].type != J_NUM ||
        cc->items[1].type != J_NUM) {
        snprintf(err, errlen, "gpus[%d]: \"compute_capability\" must be [major, minor]", i);
        return -1;
    }
    out->cc_major = (int)cc->items[0].num;
    out->cc_minor = (int)cc->items[1].num;
    unsigned dom = 0, bus = 0, dev = 0, fn = 0;
    if (sscanf(out->pci_bus_id, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) != 4) {
        snprintf(err, errlen, "gpus[%d]: \"pci_bus_id\" must look like 0000:19:00.0", i);
        return -1;
    }
    out->pci_domain = (int)dom;
    out->pci_bus = (int)bus;
    out->pci_device = (int)dev;
    return 0;
}

int node_load(const char *root, struct node_cfg *cfg, char *err, size_t errlen) {
    char path[PATH_MAX + 16], jerr[160];
    memset(cfg, 0, sizeof(*cfg));
    if (!realpath(root, cfg->root)) {
        snprintf(err, errlen, "%s: %s", root, strerror(errno));
        return -1;
    }
    snprintf(path, sizeof(path), "%s/node.json", cfg->root);
    char *text = read_file(path, NULL);
    if (!text) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    struct json *doc = json_parse(text, jerr, sizeof(jerr));
    free(text);
    if (!doc || doc->type != J_OBJ) {
        snprintf(err, errlen, "%s: %s", path, doc ? "not a JSON object" : jerr);
        if (doc) {
            json_free(doc);
            free(doc);
        }
        return -1;
    }
    char sub[200] = "";
    double version = 0, gbps = 20, ctxmem = 0;
    int rc = -1;
    const struct json *cs = json_get(doc, "custom_storage");
    const struct json *gpus = json_get(doc, "gpus");
    if (want_num(doc, "driver_version", &version, 1, sub, sizeof(sub)) ||
        want_str(doc, "driver_version_string", cfg->driver_version_string,
                 sizeof(cfg->driver_version_string), 1, sub, sizeof(sub)) ||
        want_num(doc, "copy_gbps", &gbps, 0, sub, sizeof(sub)) ||
        want_num(doc, "context_memory", &ctxmem, 0, sub, sizeof(sub))) {
        snprintf(err, errlen, "%s: %s", path, sub);
    } else if (cs && cs->type != J_BOOL) {
        snprintf(err, errlen, "%s: \"custom_storage\" must be true or false", path);
    } else if (!gpus || gpus->type != J_ARR || gpus->n > MAX_GPUS) {
        snprintf(err, errlen, "%s: \"gpus\" must be a list of at most %d GPUs", path, MAX_GPUS);
    } else {
        cfg->driver_version = (int)version;
        cfg->custom_storage = cs ? cs->boolean : 0;
        cfg->copy_gbps = gbps;
        cfg->context_memory = ctxmem > 0 ? (uint64_t)ctxmem : 0;
        cfg->ngpus = gpus->n;
        rc = 0;
        for (int i = 0; i < gpus->n && rc == 0; i++) {
            if (load_gpu(&gpus->items[i], &cfg->gpus[i], i, sub, sizeof(sub))) {
                snprintf(err, errlen, "%s: %s", path, sub);
                rc = -1;
            }
            for (int j = 0; j < i && rc == 0; j++)
                if (!memcmp(cfg->gpus[i].uuid, cfg->gpus[j].uuid, 16)) {
                    snprintf(err, errlen, "%s: gpus[%d] repeats the uuid of gpus[%d]", path, i, j);
                    rc = -1;
                }
        }
    }
    json_free(doc);
    free(doc);
    return rc;
}

int node_gpu_by_uuid(const struct node_cfg *cfg, const unsigned char uuid[16]) {
    for (int i = 0; i < cfg->ngpus; i++)
        if (!memcmp(cfg->gpus[i].uuid, uuid, 16))
            return i;
    return -1;
}

/* CUDA_VISIBLE_DEVICES as the driver reads it: indices or UUID prefixes, comma separated;
 * the list ends at the first entry that names no GPU (or one already listed). Unset: all. */
int node_visible(const struct node_cfg *cfg, int visible[MAX_GPUS]) {
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    int n = 0;
    if (!env) {
        for (int i = 0; i < cfg->ngpus; i++)
            visible[n++] = i;
        return n;
    }
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", env);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && n < MAX_GPUS;
         tok = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*tok))
            tok++;
        char *end = tok + strlen(tok);
        while (end > tok && isspace((unsigned char)end[-1]))
            *--end = '\0';
        int found = -1;
        if (!strncasecmp(tok, "GPU-", 4)) {
            for (int i = 0; i < cfg->ngpus; i++)
                if (!strncasecmp(cfg->gpus[i].uuid_text, tok, strlen(tok))) {
                    if (found >= 0) {
                        found = -2; /* ambiguous prefix */
                        break;
                    }
                    found = i;
                }
        } else if (*tok && strspn(tok, "0123456789") == strlen(tok)) {
            long v = strtol(tok, NULL, 10);
            found = v < cfg->ngpus ? (int)v : -1;
        }
        if (found < 0)
            break;
        for (int j = 0; j < n; j++)
            if (visible[j] == found)
                found = -1;
        if (found < 0)
            break;
        visible[n++] = found;
    }
    return n;
}

static void state_dir(const char *root, char *out, size_t len, const char *leaf) {
    snprintf(out, len, "%s/.fake-cuda%s%s", root, leaf ? "/" : "", leaf ? leaf : "");
}

int node_lock(const char *root) {
    char path[PATH_MAX + 64];
    state_dir(root, path, sizeof(path), NULL);
    mkdir(path, 0755);
    state_dir(root, path, sizeof(path), "usage");
    mkdir(path, 0755);
    state_dir(root, path, sizeof(path), "lock");
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    while (flock(fd, LOCK_EX) < 0)
        if (errno != EINTR) {
            close(fd);
            return -1;
        }
    return fd;
}

void node_unlock(int fd) {
    if (fd >= 0)
        close(fd); /* drops the flock */
}

/* Boot-time offset of this process's time namespace, in clock ticks. CRIU restores a
 * process into a time namespace of its own (so its clocks continue), and /proc shows start
 * times shifted by the reader's offset: subtract it so every process compares host times. */
static int64_t boottime_offset_ticks(void) {
    char *text = read_file("/proc/self/timens_offsets", NULL);
    int64_t ticks = 0;
    if (text) {
        char *line = strstr(text, "boottime");
        long long sec = 0, nsec = 0;
        if (line && sscanf(line, "boottime %lld %lld", &sec, &nsec) == 2)
            ticks = (int64_t)((sec * 1000000000LL + nsec) / (1000000000LL / sysconf(_SC_CLK_TCK)));
        free(text);
    }
    return ticks;
}

/* Start time (clock ticks since host boot) of a live process; 0 if gone or a zombie. */
uint64_t proc_starttime(int pid) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    char *text = read_file(path, NULL);
    if (!text)
        return 0;
    char *p = strrchr(text, ')');
    uint64_t start = 0;
    if (p && p[1] == ' ' && p[2] != 'Z' && p[2] != 'X') {
        /* fields after the comm: state is field 3, starttime field 22 */
        char *save = NULL, *tok = strtok_r(p + 2, " ", &save);
        for (int field = 3; tok && field < 22; field++)
            tok = strtok_r(NULL, " ", &save);
        if (tok)
            start = strtoull(tok, NULL, 10) - (uint64_t)boottime_offset_ticks();
    }
    free(text);
    return start;
}

/* Whether `pid` is still the process that started at `start` (one tick of rounding slack). */
int same_process(int pid, uint64_t start) {
    uint64_t now_start = proc_starttime(pid);
    if (!now_start || !start)
        return 0;
    return now_start + 1 >= start && start + 1 >= now_start;
}

void node_used(const char *root, const struct node_cfg *cfg, uint64_t used[MAX_GPUS]) {
    char dir[PATH_MAX + 64], path[PATH_MAX + 384];
    memset(used, 0, sizeof(uint64_t) * MAX_GPUS);
    state_dir(root, dir, sizeof(dir), "usage");
    DIR *d = opendir(dir);
    if (!d)
        return;
    for (struct dirent *e; (e = readdir(d));) {
        if (strchr(e->d_name, '.'))
            continue; /* ".", "..", and a PID.tmp being written */
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        struct usage u;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t r = read(fd, &u, sizeof(u));
        close(fd);
        if (r != (ssize_t)sizeof(u) || u.magic != USAGE_MAGIC || !same_process(u.pid, u.starttime)) {
            unlink(path); /* its process is gone: its memory is free again */
            continue;
        }
        for (int i = 0; i < cfg->ngpus && i < u.ngpus; i++)
            used[i] += u.bytes[i];
    }
    closedir(d);
}

/* Write (or, with nothing held, remove) this process's usage file; call under node_lock. */
int node_publish(const char *root, const uint64_t mine[MAX_GPUS]) {
    char path[PATH_MAX + 128], tmp[PATH_MAX + 160], leaf[32];
    pid_t pid = getpid();
    snprintf(leaf, sizeof(leaf), "usage/%d", (int)pid);
    state_dir(root, path, sizeof(path), leaf);
    int any = 0;
    for (int i = 0; i < MAX_GPUS; i++)
        any |= mine[i] != 0;
    if (!any) {
        unlink(path);
        return 0;
    }
    struct usage u = {USAGE_MAGIC, (int32_t)pid, MAX_GPUS, proc_starttime(pid), {0}};
    memcpy(u.bytes, mine, sizeof(u.bytes));
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    ssize_t w = write(fd, &u, sizeof(u));
    close(fd);
    if (w != (ssize_t)sizeof(u) || rename(tmp, path) < 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}
