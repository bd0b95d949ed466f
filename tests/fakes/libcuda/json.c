/* Just enough JSON to read node.json: objects, arrays, strings (with \uXXXX as '?' unless
 * ASCII), numbers, true/false/null. Errors say where. */
#include "fake.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct parser {
    const char *s;
    const char *start;
    char *err;
    size_t errlen;
};

static int fail(struct parser *p, const char *what) {
    if (p->err && !p->err[0])
        snprintf(p->err, p->errlen, "%s at offset %ld", what, (long)(p->s - p->start));
    return -1;
}

static void skip(struct parser *p) {
    while (isspace((unsigned char)*p->s))
        p->s++;
}

static int value(struct parser *p, struct json *out, int depth);

static int string(struct parser *p, char **out) {
    if (*p->s != '"')
        return fail(p, "expected a string");
    p->s++;
    size_t cap = 16, n = 0;
    char *buf = malloc(cap);
    if (!buf)
        return fail(p, "out of memory");
    for (;;) {
        char c = *p->s++;
        if (c == '\0') {
            free(buf);
            return fail(p, "unterminated string");
        }
        if (c == '"')
            break;
        if (c == '\\') {
            char e = *p->s++;
            switch (e) {
            case '"': case '\\': case '/': c = e; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            case 'u': {
                unsigned v = 0;
                for (int i = 0; i < 4; i++) {
                    char h = *p->s++;
                    if (!isxdigit((unsigned char)h)) {
                        free(buf);
                        return fail(p, "bad \\u escape");
                    }
                    v = v * 16 + (unsigned)(isdigit((unsigned char)h) ? h - '0' : (tolower(h) - 'a' + 10));
                }
                c = v < 0x80 ? (char)v : '?';
                break;
            }
            default:
                free(buf);
                return fail(p, "bad escape");
            }
        }
        if (n + 2 > cap) {
            cap *= 2;
            char *more = realloc(buf, cap);
            if (!more) {
                free(buf);
                return fail(p, "out of memory");
            }
            buf = more;
        }
        buf[n++] = c;
    }
    buf[n] = '\0';
    *out = buf;
    return 0;
}

static int push(struct json *v, struct json *item, char *key) {
    struct json *items = realloc(v->items, sizeof(*items) * (size_t)(v->n + 1));
    if (!items)
        return -1;
    v->items = items;
    if (v->type == J_OBJ) {
        char **keys = realloc(v->keys, sizeof(*keys) * (size_t)(v->n + 1));
        if (!keys)
            return -1;
        v->keys = keys;
        v->keys[v->n] = key;
    }
    v->items[v->n++] = *item;
    return 0;
}

static int container(struct parser *p, struct json *out, int depth, char close) {
    out->type = close == '}' ? J_OBJ : J_ARR;
    p->s++;
    skip(p);
    if (*p->s == close) {
        p->s++;
        return 0;
    }
    for (;;) {
        char *key = NULL;
        struct json item = {0};
        skip(p);
        if (close == '}') {
            if (string(p, &key) < 0)
                return -1;
            skip(p);
            if (*p->s != ':') {
                free(key);
                return fail(p, "expected ':'");
            }
            p->s++;
        }
        if (value(p, &item, depth + 1) < 0 || push(out, &item, key) < 0) {
            free(key);
            json_free(&item);
            return fail(p, "bad value");
        }
        skip(p);
        if (*p->s == ',') {
            p->s++;
            continue;
        }
        if (*p->s == close) {
            p->s++;
            return 0;
        }
        return fail(p, close == '}' ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int value(struct parser *p, struct json *out, int depth) {
    if (depth > 32)
        return fail(p, "nested too deeply");
    skip(p);
    memset(out, 0, sizeof(*out));
    char c = *p->s;
    if (c == '{')
        return container(p, out, depth, '}');
    if (c == '[')
        return container(p, out, depth, ']');
    if (c == '"') {
        out->type = J_STR;
        return string(p, &out->str);
    }
    if (!strncmp(p->s, "true", 4) || !strncmp(p->s, "false", 5)) {
        out->type = J_BOOL;
        out->boolean = c == 't';
        p->s += out->boolean ? 4 : 5;
        return 0;
    }
    if (!strncmp(p->s, "null", 4)) {
        out->type = J_NULL;
        p->s += 4;
        return 0;
    }
    if (c == '-' || isdigit((unsigned char)c)) {
        char *end;
        out->type = J_NUM;
        out->num = strtod(p->s, &end);
        if (end == p->s)
            return fail(p, "bad number");
        p->s = end;
        return 0;
    }
    return fail(p, "unexpected character");
}

struct json *json_parse(const char *text, char *err, size_t errlen) {
    struct parser p = {text, text, err, errlen};
    struct json *v = calloc(1, sizeof(*v));
    if (err && errlen)
        err[0] = '\0';
    if (!v)
        return NULL;
    if (value(&p, v, 0) < 0) {
        json_free(v);
        free(v);
        return NULL;
    }
    skip(&p);
    if (*p.s) {
        fail(&p, "trailing characters");
        json_free(v);
        free(v);
        return NULL;
    }
    return v;
}

void json_free(struct json *v) {
    if (!v)
        return;
    for (int i = 0; i < v->n; i++) {
        json_free(&v->items[i]);
        if (v->keys)
            free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
    memset(v, 0, sizeof(*v));
}

const struct json *json_get(const struct json *obj, const char *key) {
    if (!obj || obj->type != J_OBJ)
        return NULL;
    for (int i = 0; i < obj->n; i++)
        if (!strcmp(obj->keys[i], key))
            return &obj->items[i];
    return NULL;
}
