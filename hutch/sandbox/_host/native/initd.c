/* hutch-init: a sandbox's init (pid 1) once its root is built, in C.
 *
 * init.py builds the root and locks the process down (no_new_privs, capabilities, seccomp), then execs this
 * binary (an fd the zygote opened) in place of itself: from then on the init holds a few pages of its own
 * instead of a Python interpreter's copy-on-write heap. It serves the daemon exactly as init.Init.serve does:
 * the same messages (initwire: one JSON object per SOCK_SEQPACKET packet, fds as SCM_RIGHTS, a memfd for a
 * message over MAX_PACKET), the same replies, errors and error texts.
 *
 * argv: hutch-init <ctl fd> <upper fd> <user kept: 0|1>. "user kept": the sandbox's user (USER_ID) rode in as
 * the effective and saved ids (init._exec_native); the effective ones go back to 0 here, the saved stay 1000.
 *
 * What reaches it from inside the sandbox is file names and sizes, directory trees and the exit of its
 * processes; the daemon's messages carry paths and commands a client chose. Every length is checked: strings
 * live in heap buffers sized to them, every output goes through a growing buffer with a hard bound.
 *
 * Build: gcc -static -Os -Wall -Wextra -D_FORTIFY_SOURCE=2 -fstack-protector-strong (scripts/setup.sh).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#define MAX_PACKET 60000
#define MAX_FDS 8
#define MAX_MSG (64u << 20)      /* bytes of one message (a memfd's), either way */
#define MAX_DEPTH 32             /* JSON nesting */
#define MAX_TREE_DEPTH 2048      /* directories deep a recursive remove goes */
#define MAX_PTYS 64
#define USER_ID 1000
#define MAX_PROCS 65536

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define RESOLVE_NO_MAGICLINKS 0x02
#ifndef TIOCGPTPEER
#define TIOCGPTPEER 0x5441
#endif

struct open_how_ { uint64_t flags, mode, resolve; };

/* ---- small helpers ------------------------------------------------------------------------------ */

static void die(const char *what) {
    dprintf(2, "hutch-init: %s: %s\n", what, strerror(errno));
    _exit(1);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { dprintf(2, "hutch-init: out of memory\n"); _exit(1); }
    return p;
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) { dprintf(2, "hutch-init: out of memory\n"); _exit(1); }
    return q;
}

/* A growing byte buffer; `bad` once it would pass MAX_MSG (the reply is then an error instead). */
typedef struct { char *p; size_t n, cap; int bad; } buf_t;

static void b_add(buf_t *b, const void *s, size_t n) {
    if (b->bad) return;
    if (n > MAX_MSG || b->n + n > MAX_MSG) { b->bad = 1; return; }
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        b->p = xrealloc(b->p, cap);
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void b_str(buf_t *b, const char *s) { b_add(b, s, strlen(s)); }
static void b_fmt(buf_t *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) { b->bad = 1; return; }
    b_add(b, tmp, (size_t)n);
}
static void b_free(buf_t *b) { free(b->p); b->p = NULL; b->n = b->cap = 0; b->bad = 0; }

/* ---- UTF-8 with surrogateescape (Python's os.fsdecode) -------------------------------------------- */

/* The code point at s[*i] as Python decodes file names: a valid UTF-8 sequence, else U+DC00 + the byte. */
static uint32_t next_cp(const unsigned char *s, size_t n, size_t *i) {
    unsigned char c = s[*i];
    if (c < 0x80) { (*i)++; return c; }
    size_t need = 0;
    uint32_t cp = 0, min = 0;
    if (c >= 0xC2 && c <= 0xDF) { need = 1; cp = c & 0x1F; min = 0x80; }
    else if (c >= 0xE0 && c <= 0xEF) { need = 2; cp = c & 0x0F; min = 0x800; }
    else if (c >= 0xF0 && c <= 0xF4) { need = 3; cp = c & 0x07; min = 0x10000; }
    if (need) {
        size_t k;
        for (k = 1; k <= need; k++) {
            if (*i + k >= n || (s[*i + k] & 0xC0) != 0x80) break;
            cp = (cp << 6) | (s[*i + k] & 0x3F);
        }
        if (k > need && cp >= min && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF)) {
            *i += need + 1;
            return cp;
        }
    }
    (*i)++;
    return 0xDC00 + c;
}

/* A JSON string of bytes, as json.dumps (ensure_ascii) writes os.fsdecode(bytes). */
static void b_jstr(buf_t *b, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    b_add(b, "\"", 1);
    for (size_t i = 0; i < n && !b->bad;) {
        uint32_t cp = next_cp(u, n, &i);
        switch (cp) {
        case '"': b_add(b, "\\\"", 2); continue;
        case '\\': b_add(b, "\\\\", 2); continue;
        case '\n': b_add(b, "\\n", 2); continue;
        case '\r': b_add(b, "\\r", 2); continue;
        case '\t': b_add(b, "\\t", 2); continue;
        case '\b': b_add(b, "\\b", 2); continue;
        case '\f': b_add(b, "\\f", 2); continue;
        }
        if (cp >= 0x20 && cp < 0x7F) { char ch = (char)cp; b_add(b, &ch, 1); }
        else if (cp < 0x10000) b_fmt(b, "\\u%04x", cp);
        else {
            uint32_t v = cp - 0x10000;
            b_fmt(b, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
        }
    }
    b_add(b, "\"", 1);
}
static void b_jcstr(buf_t *b, const char *s) { b_jstr(b, s, strlen(s)); }

/* Python's repr() of the string (as the error texts quote a command or directory), close enough: printable
 * ASCII and other code points as they are, controls and escaped bytes as \x.. / \u... */
static void b_repr(buf_t *b, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    int has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    b_add(b, &q, 1);
    for (size_t i = 0; i < n && !b->bad;) {
        size_t start = i;
        uint32_t cp = next_cp(u, n, &i);
        if (cp == (uint32_t)q || cp == '\\') { char ch = (char)cp; b_add(b, "\\", 1); b_add(b, &ch, 1); }
        else if (cp == '\n') b_add(b, "\\n", 2);
        else if (cp == '\r') b_add(b, "\\r", 2);
        else if (cp == '\t') b_add(b, "\\t", 2);
        else if (cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp <= 0xA0)) b_fmt(b, "\\x%02x", cp);
        else if (cp >= 0xD800 && cp <= 0xDFFF) b_fmt(b, "\\u%04x", cp);
        else b_add(b, s + start, i - start);
    }
    b_add(b, &q, 1);
}

/* ---- JSON in -------------------------------------------------------------------------------------- */

enum { J_NULL, J_FALSE, J_TRUE, J_NUM, J_STR, J_ARR, J_OBJ };

typedef struct jv {
    int type;
    char *s; size_t n;          /* J_STR: bytes (os.fsencode of the string), NUL-terminated; bad: not encodable */
    int bad;
    long long i; int is_int;    /* J_NUM */
    struct jv *items;           /* J_ARR / J_OBJ: values; J_OBJ: keys alongside */
    struct jv *keys;
    size_t len;
} jv;

typedef struct { const char *p, *end; int err; } jp;

static void jskip(jp *j) { while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++; }

static int hex4(const char *p, const char *end, uint32_t *out) {
    if (end - p < 4) return -1;
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) {
        char c = p[k];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return -1;
    }
    *out = v;
    return 0;
}

static void put_utf8(buf_t *b, uint32_t cp) {
    char t[4];
    if (cp < 0x80) { t[0] = (char)cp; b_add(b, t, 1); }
    else if (cp < 0x800) { t[0] = (char)(0xC0 | (cp >> 6)); t[1] = (char)(0x80 | (cp & 0x3F)); b_add(b, t, 2); }
    else if (cp < 0x10000) { t[0] = (char)(0xE0 | (cp >> 12)); t[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        t[2] = (char)(0x80 | (cp & 0x3F)); b_add(b, t, 3); }
    else { t[0] = (char)(0xF0 | (cp >> 18)); t[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        t[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); t[3] = (char)(0x80 | (cp & 0x3F)); b_add(b, t, 4); }
}

static void jstring(jp *j, jv *v) {
    buf_t b = {0};
    j->p++;   /* the opening quote */
    v->type = J_STR;
    while (j->p < j->end && *j->p != '"') {
        unsigned char c = (unsigned char)*j->p;
        if (c < 0x20) { j->err = 1; break; }
        if (c != '\\') { b_add(&b, j->p, 1); j->p++; continue; }
        if (j->end - j->p < 2) { j->err = 1; break; }
        char e = j->p[1];
        j->p += 2;
        switch (e) {
        case '"': b_add(&b, "\"", 1); break;
        case '\\': b_add(&b, "\\", 1); break;
        case '/': b_add(&b, "/", 1); break;
        case 'b': b_add(&b, "\b", 1); break;
        case 'f': b_add(&b, "\f", 1); break;
        case 'n': b_add(&b, "\n", 1); break;
        case 'r': b_add(&b, "\r", 1); break;
        case 't': b_add(&b, "\t", 1); break;
        case 'u': {
            uint32_t cp, lo;
            if (hex4(j->p, j->end, &cp)) { j->err = 1; break; }
            j->p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF && j->end - j->p >= 6 && j->p[0] == '\\' && j->p[1] == 'u'
                    && !hex4(j->p + 2, j->end, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
                j->p += 6;
                put_utf8(&b, 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00));
            } else if (cp >= 0xDC80 && cp <= 0xDCFF) {   /* surrogateescape: the byte itself */
                char ch = (char)(cp - 0xDC00);
                b_add(&b, &ch, 1);
            } else if (cp >= 0xD800 && cp <= 0xDFFF) {
                v->bad = 1;   /* a lone surrogate no file name or argument can hold */
            } else {
                put_utf8(&b, cp);
            }
            break;
        }
        default: j->err = 1;
        }
        if (j->err) break;
    }
    if (j->p >= j->end) j->err = 1;
    else j->p++;   /* the closing quote */
    if (b.bad) j->err = 1;
    if (!b.p) { b.p = xmalloc(1); b.p[0] = 0; }
    v->s = b.p;
    v->n = b.n;
}

static void jvalue(jp *j, jv *v, int depth);

static void jcontainer(jp *j, jv *v, int depth, int obj) {
    size_t cap = 0;
    v->type = obj ? J_OBJ : J_ARR;
    j->p++;
    jskip(j);
    if (j->p < j->end && *j->p == (obj ? '}' : ']')) { j->p++; return; }
    while (!j->err) {
        if (v->len == cap) {
            cap = cap ? cap * 2 : 8;
            if (cap > (MAX_MSG / sizeof(jv))) { j->err = 1; return; }
            v->items = xrealloc(v->items, cap * sizeof(jv));
            if (obj) v->keys = xrealloc(v->keys, cap * sizeof(jv));
        }
        memset(&v->items[v->len], 0, sizeof(jv));
        if (obj) {
            memset(&v->keys[v->len], 0, sizeof(jv));
            jskip(j);
            if (j->p >= j->end || *j->p != '"') { j->err = 1; return; }
            jstring(j, &v->keys[v->len]);
            jskip(j);
            if (j->err || j->p >= j->end || *j->p != ':') { j->err = 1; v->len++; return; }
            j->p++;
        }
        jvalue(j, &v->items[v->len], depth + 1);
        v->len++;
        jskip(j);
        if (j->p < j->end && *j->p == ',') { j->p++; continue; }
        if (j->p < j->end && *j->p == (obj ? '}' : ']')) { j->p++; return; }
        j->err = 1;
    }
}

static void jvalue(jp *j, jv *v, int depth) {
    jskip(j);
    if (depth > MAX_DEPTH || j->p >= j->end) { j->err = 1; return; }
    char c = *j->p;
    if (c == '"') { jstring(j, v); return; }
    if (c == '{' || c == '[') { jcontainer(j, v, depth, c == '{'); return; }
    if (j->end - j->p >= 4 && !memcmp(j->p, "null", 4)) { v->type = J_NULL; j->p += 4; return; }
    if (j->end - j->p >= 4 && !memcmp(j->p, "true", 4)) { v->type = J_TRUE; j->p += 4; return; }
    if (j->end - j->p >= 5 && !memcmp(j->p, "false", 5)) { v->type = J_FALSE; j->p += 5; return; }
    if (c == '-' || (c >= '0' && c <= '9')) {
        char tmp[64];
        size_t k = 0;
        int is_int = 1;
        while (j->p < j->end && k < sizeof tmp - 1 && *j->p && strchr("+-0123456789.eE", *j->p)) {
            if (*j->p == '.' || *j->p == 'e' || *j->p == 'E') is_int = 0;
            tmp[k++] = *j->p++;
        }
        tmp[k] = 0;
        if (j->p < j->end && *j->p && strchr("+-0123456789.eE", *j->p)) { j->err = 1; return; }
        v->type = J_NUM;
        errno = 0;
        char *endp;
        if (is_int) {
            v->i = strtoll(tmp, &endp, 10);
            v->is_int = errno == 0 && *endp == 0;
        } else {
            double d = strtod(tmp, &endp);
            v->is_int = 0;
            v->i = (d > -9e18 && d < 9e18) ? (long long)d : 0;
        }
        if (*endp) j->err = 1;
        return;
    }
    j->err = 1;
}

static void jfree(jv *v) {
    if (v->type == J_STR) free(v->s);
    for (size_t k = 0; k < v->len; k++) {
        jfree(&v->items[k]);
        if (v->keys) jfree(&v->keys[k]);
    }
    free(v->items);
    free(v->keys);
    memset(v, 0, sizeof *v);
}

/* The value of `key` (the last one, as json.loads keeps), or NULL. */
static jv *jget(jv *o, const char *key) {
    if (!o || o->type != J_OBJ) return NULL;
    size_t kl = strlen(key);
    for (size_t k = o->len; k-- > 0;)
        if (o->keys[k].n == kl && !memcmp(o->keys[k].s, key, kl)) return &o->items[k];
    return NULL;
}

static int truthy(jv *v) {
    if (!v) return 0;
    switch (v->type) {
    case J_TRUE: return 1;
    case J_NUM: return v->i != 0 || !v->is_int;
    case J_STR: return v->n > 0;
    case J_ARR: case J_OBJ: return v->len > 0;
    default: return 0;
    }
}

/* ---- the wire ------------------------------------------------------------------------------------ */

static int CTL = -1;

static void close_all(int *fds, int n) { for (int k = 0; k < n; k++) if (fds[k] >= 0) close(fds[k]); }

/* Send one message (a memfd beyond MAX_PACKET); the daemon gone: the sandbox ends with this process. */
static void send_msg(buf_t *m, const int *fds, int nfds) {
    int all[MAX_FDS + 1], n = 0, mfd = -1;
    const char *data = m->p;
    size_t len = m->n;
    if (len > MAX_PACKET) {
        mfd = memfd_create("hutch-msg", MFD_CLOEXEC);
        if (mfd < 0) die("memfd_create");
        for (size_t off = 0; off < len;) {
            ssize_t w = write(mfd, m->p + off, len - off);
            if (w < 0) { if (errno == EINTR) continue; die("write memfd"); }
            off += (size_t)w;
        }
        if (lseek(mfd, 0, SEEK_SET) < 0) die("lseek");
        all[n++] = mfd;
        data = "{\"_memfd\":1}";
        len = strlen(data);
    }
    for (int k = 0; k < nfds && n < MAX_FDS; k++) all[n++] = fds[k];
    struct iovec iov = {(void *)data, len};
    union { char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)]; struct cmsghdr align; } u;
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (n) {
        memset(&u, 0, sizeof u);
        mh.msg_control = u.buf;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n);
        memcpy(CMSG_DATA(c), all, sizeof(int) * (size_t)n);
    }
    ssize_t r;
    do r = sendmsg(CTL, &mh, MSG_NOSIGNAL); while (r < 0 && errno == EINTR);
    if (mfd >= 0) close(mfd);
    if (r < 0) _exit(0);   /* the daemon is gone: ending pid 1 ends the sandbox */
}

/* One message: 1 and its parsed object with its fds; 0 at end of file; -1 for one that is not a message. */
static int recv_msg(jv *out, int *fds, int *nfds) {
    static char data[MAX_PACKET + 1024];
    union { char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)]; struct cmsghdr align; } u;
    struct iovec iov = {data, sizeof data};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = u.buf;
    mh.msg_controllen = sizeof u.buf;
    ssize_t r;
    do r = recvmsg(CTL, &mh, MSG_CMSG_CLOEXEC); while (r < 0 && errno == EINTR);
    *nfds = 0;
    if (r < 0) return 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len < CMSG_LEN(0)) continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t x = 0; x < k; x++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + x * sizeof(int), sizeof fd);
            if (*nfds < MAX_FDS) fds[(*nfds)++] = fd;
            else close(fd);
        }
    }
    if (r == 0) { close_all(fds, *nfds); *nfds = 0; return 0; }
    char *text = data, *heap = NULL;
    size_t len = (size_t)r;
    jp j = {data, data + len, 0};
    memset(out, 0, sizeof *out);
    jvalue(&j, out, 0);
    jskip(&j);
    if (j.err || j.p != j.end || out->type != J_OBJ) { jfree(out); return -1; }
    if (truthy(jget(out, "_memfd"))) {
        jfree(out);
        if (*nfds < 1) return -1;
        int mfd = fds[0];
        memmove(fds, fds + 1, sizeof(int) * (size_t)(*nfds - 1));
        (*nfds)--;
        size_t cap = 1 << 16;
        len = 0;
        heap = xmalloc(cap);
        for (;;) {
            if (len == cap) {
                if (cap >= MAX_MSG) { close(mfd); free(heap); return -1; }
                cap *= 2;
                heap = xrealloc(heap, cap);
            }
            ssize_t g = read(mfd, heap + len, cap - len);
            if (g < 0 && errno == EINTR) continue;
            if (g < 0) { close(mfd); free(heap); return -1; }
            if (g == 0) break;
            len += (size_t)g;
        }
        close(mfd);
        text = heap;
        j.p = text;
        j.end = text + len;
        j.err = 0;
        memset(out, 0, sizeof *out);
        jvalue(&j, out, 0);
        jskip(&j);
        free(heap);
        if (j.err || j.p != j.end || out->type != J_OBJ) { jfree(out); return -1; }
    }
    return 1;
}

/* ---- replies ------------------------------------------------------------------------------------- */

static jv *MSG;   /* the message being served */

static void reply_start(buf_t *b) {
    jv *rid = jget(MSG, "rid");
    b_str(b, "{\"rid\":");
    if (rid && rid->type == J_NUM && rid->is_int) b_fmt(b, "%lld", rid->i);
    else if (rid && rid->type == J_STR) b_jstr(b, rid->s, rid->n);
    else b_str(b, "null");
}

static void reply_ok(const int *fds, int nfds) {
    buf_t b = {0};
    reply_start(&b);
    b_str(&b, ",\"ok\":true}");
    send_msg(&b, fds, nfds);
    b_free(&b);
}

/* {"rid", "ok": false, "error": cls, "message": msg} (message: raw text, escaped here). */
static void reply_fail(const char *cls, buf_t *message) {
    buf_t b = {0};
    reply_start(&b);
    b_str(&b, ",\"ok\":false,\"error\":");
    b_jcstr(&b, cls);
    b_str(&b, ",\"message\":");
    b_jstr(&b, message->p ? message->p : "", message->n);
    b_str(&b, "}");
    send_msg(&b, NULL, 0);
    b_free(&b);
}

/* init._ERRNO_CLASS and init._error's fixes */
static const char *errno_class(int e) {
    switch (e) {
    case ENOENT: case ENOTDIR: return "NotFoundError";
    case EISDIR: case EEXIST: case ENOTEMPTY: case EACCES: case EPERM: case EROFS: case ELOOP: case ENAMETOOLONG:
    case ENOEXEC: case EINVAL: case EXDEV: case ENXIO: case ENODEV: case EFBIG: case EMLINK: case EOVERFLOW:
        return "ConfigError";
    case ENOSPC: case EDQUOT: return "StateError";
    case EBUSY: case ETXTBSY: return "StateError";
    default: return "SandboxError";
    }
}

static const char *errno_fix(int e) {
    switch (e) {
    case ENOENT: return "check the path (it is inside the sandbox) or create it first";
    case ENOTDIR: return "a parent of the path is not a directory";
    case EISDIR: return "it is a directory; use files.list, or give a file path";
    case ENOTEMPTY: return "the directory is not empty; pass recursive=True to remove it with its contents";
    case ENOSPC: case EDQUOT: return "the sandbox's disk limit is reached; create it with a larger disk= or remove files";
    case EACCES: return "the sandbox's root has no capabilities, so only files it owns or may access are reachable";
    case EROFS: return "that path is on a read-only mount";
    case EINVAL: return "only regular files can be read this way (a file of /proc or /sys is made as it is read: "
                        "run('cat', path) reads it)";
    case ELOOP: return "the path leads through a /proc link of a process or too many symlinks; give a plain path";
    case EBUSY: return "it is a mount point or in use; what the sandbox was created with stays until it ends";
    case ETXTBSY: return "a running program is that file; end the command first";
    case ENXIO: case ENODEV: return "it is a device or socket, not a file";
    default: return "check the path and try again";
    }
}

/* init._error: an OSError of a call, named by its path (or the op) */
static void reply_errno(int e) {
    jv *path = jget(MSG, "path"), *op = jget(MSG, "op");
    buf_t m = {0}, b = {0};
    if (path && path->type == J_STR && path->n) b_add(&m, path->s, path->n);
    else if (op && op->type == J_STR) b_add(&m, op->s, op->n);
    b_str(&m, ": ");
    b_str(&m, strerror(e));
    b_str(&m, "; ");
    b_str(&m, errno_fix(e));
    b_str(&m, ".");
    reply_start(&b);
    b_str(&b, ",\"ok\":false,\"error\":");
    b_jcstr(&b, errno_class(e));
    b_str(&b, ",\"message\":");
    b_jstr(&b, m.p, m.n);
    b_fmt(&b, ",\"errno\":%d}", e);
    send_msg(&b, NULL, 0);
    b_free(&b);
    b_free(&m);
}

static void reply_bad(const char *what) {
    buf_t m = {0};
    b_str(&m, "the init could not read the request (");
    b_str(&m, what);
    b_str(&m, "); this is a bug of the daemon.");
    reply_fail("SandboxError", &m);
    b_free(&m);
}

/* A string argument of the message: its bytes, or NULL (and a reply sent) when missing or not one. */
static const char *str_arg(const char *key, size_t *n) {
    jv *v = jget(MSG, key);
    if (!v || v->type != J_STR || v->bad || strlen(v->s) != v->n) {
        if (v && v->type == J_STR) { errno = EINVAL; return NULL; }
        errno = 0;
        return NULL;
    }
    if (n) *n = v->n;
    return v->s;
}

/* The path argument; on failure the reply is sent and NULL returned. */
static const char *path_arg(void) {
    const char *p = str_arg("path", NULL);
    if (!p) {
        if (errno == EINVAL) reply_errno(EINVAL);
        else reply_bad("no path");
    }
    return p;
}

/* ---- paths (init._open, _parent, _makedirs) --------------------------------------------------------- */

static int open2(const char *path, int flags, int dirfd) {
    struct open_how_ how = {(uint64_t)(flags | O_CLOEXEC), 0, RESOLVE_NO_MAGICLINKS};
    long r = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
    return (int)r;
}

/* os.path.split(path.rstrip("/") or "/"): head into `head` (malloc'd, "/" if empty), returns the name. */
static const char *split_path(const char *path, char **head) {
    size_t n = strlen(path);
    while (n > 0 && path[n - 1] == '/') n--;
    if (n == 0) { *head = strdup("/"); return ""; }
    size_t slash = n;
    while (slash > 0 && path[slash - 1] != '/') slash--;
    size_t h = slash;
    size_t all = 1;
    for (size_t k = 0; k < h; k++) if (path[k] != '/') all = 0;
    if (!all) while (h > 0 && path[h - 1] == '/') h--;
    *head = xmalloc(h + 2);
    if (h == 0) strcpy(*head, "/");
    else { memcpy(*head, path, h); (*head)[h] = 0; }
    static char name[PATH_MAX + 1];
    size_t nl = n - slash;
    if (nl > PATH_MAX) nl = PATH_MAX;   /* the kernel refuses it (ENAMETOOLONG) as it would the whole */
    memcpy(name, path + slash, nl);
    name[nl] = 0;
    return name;
}

/* init._parent: an O_PATH fd of the directory holding the last name, and that name (copied to `name`). */
static int parent_of(const char *path, char *name, size_t cap) {
    char *head;
    const char *nm = split_path(path, &head);
    if (strlen(nm) >= cap) { free(head); errno = ENAMETOOLONG; return -1; }
    strcpy(name, nm);
    int fd = open2(head, O_PATH | O_DIRECTORY, AT_FDCWD);
    int e = errno;
    free(head);
    errno = e;
    return fd;
}

/* init._makedirs: os.makedirs(path, exist_ok=True) one directory fd at a time; an O_PATH fd of it. */
static int makedirs(const char *path) {
    int fd = open2("/", O_PATH | O_DIRECTORY, AT_FDCWD);
    if (fd < 0) return -1;
    char *copy = strdup(path);
    if (!copy) { close(fd); errno = ENOMEM; return -1; }
    char *save = NULL;
    for (char *part = strtok_r(copy, "/", &save); part; part = strtok_r(NULL, "/", &save)) {
        int nfd = open2(part, O_PATH | O_DIRECTORY, fd);
        if (nfd < 0 && errno == ENOENT) {
            if (mkdirat(fd, part, 0777) < 0 && errno != EEXIST) { int e = errno; close(fd); free(copy); errno = e; return -1; }
            nfd = open2(part, O_PATH | O_DIRECTORY, fd);
        }
        int e = errno;
        close(fd);
        if (nfd < 0) { free(copy); errno = e; return -1; }
        fd = nfd;
    }
    free(copy);
    return fd;
}

/* ---- the files API --------------------------------------------------------------------------------- */

static const char *kind_of(mode_t m) {
    return S_ISDIR(m) ? "dir" : S_ISREG(m) ? "file" : S_ISLNK(m) ? "symlink" : "other";
}

/* A float as Python's repr() writes it: the shortest text that reads back the same, with ".0" if integral. */
static void b_float(buf_t *b, double d) {
    char tmp[64];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, d);
        if (strtod(tmp, NULL) == d) break;
    }
    if (!strpbrk(tmp, ".eEn")) strcat(tmp, ".0");
    b_str(b, tmp);
}

/* init._entry */
static void b_entry(buf_t *b, const char *path, size_t plen, const struct stat *st) {
    size_t n = plen;
    while (n > 0 && path[n - 1] == '/') n--;
    size_t s = n;
    while (s > 0 && path[s - 1] != '/') s--;
    b_str(b, "{\"name\":");
    if (n - s) b_jstr(b, path + s, n - s);
    else b_str(b, "\"/\"");
    b_str(b, ",\"path\":");
    b_jstr(b, path, plen);
    b_str(b, ",\"type\":\"");
    b_str(b, kind_of(st->st_mode));
    b_fmt(b, "\",\"size\":%lld,\"mode\":%u,\"mtime\":", (long long)st->st_size, (unsigned)(st->st_mode & 07777));
    b_float(b, (double)st->st_mtim.tv_sec + (double)st->st_mtim.tv_nsec * 1e-9);
    b_fmt(b, ",\"uid\":%u,\"gid\":%u}", (unsigned)st->st_uid, (unsigned)st->st_gid);
}

/* init._PSEUDO_FS: a file of /proc or /sys (the files API does not read those) */
static int pseudo_fs(int fd) {
    struct statfs s;
    return fstatfs(fd, &s) == 0 && (s.f_type == 0x9FA0 /* PROC_SUPER_MAGIC */ || s.f_type == 0x62656572 /* SYSFS_MAGIC */);
}

static void op_read(void) {
    const char *path = path_arg();
    if (!path) return;
    /* init.op_read: a file of /proc or /sys first, through an O_PATH fd (before its own permissions count) */
    int fd = open2(path, O_PATH, AT_FDCWD);
    if (fd < 0) { reply_errno(errno); return; }
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && pseudo_fs(fd)) { close(fd); reply_errno(EINVAL); return; }
    close(fd);
    fd = open2(path, O_RDONLY | O_NONBLOCK | O_NOCTTY, AT_FDCWD);
    if (fd < 0) { reply_errno(errno); return; }
    if (fstat(fd, &st) < 0) { int e = errno; close(fd); reply_errno(e); return; }
    if (!S_ISREG(st.st_mode) || pseudo_fs(fd)) { close(fd); reply_errno(S_ISDIR(st.st_mode) ? EISDIR : EINVAL); return; }
    buf_t b = {0};
    reply_start(&b);
    b_fmt(&b, ",\"ok\":true,\"size\":%lld}", (long long)st.st_size);
    send_msg(&b, &fd, 1);
    b_free(&b);
    close(fd);
}

/* os.path.dirname(path) or "/" */
static char *dirname_of(const char *path) {
    size_t n = strlen(path), s = n;
    while (s > 0 && path[s - 1] != '/') s--;
    size_t h = s, all = 1;
    for (size_t k = 0; k < h; k++) if (path[k] != '/') all = 0;
    if (!all) while (h > 0 && path[h - 1] == '/') h--;
    char *out = xmalloc(h + 2);
    if (h == 0) strcpy(out, "/");
    else { memcpy(out, path, h); out[h] = 0; }
    return out;
}

static void op_write_open(void) {
    const char *path = path_arg();
    if (!path) return;
    jv *mode = jget(MSG, "mode");
    if (!mode || mode->type != J_NUM || !mode->is_int) { reply_bad("no mode"); return; }
    char *parent = dirname_of(path);
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    int dfd = makedirs(parent);
    if (dfd < 0) { int e = errno; free(parent); reply_errno(e); return; }
    struct stat st;
    if (fstatat(dfd, base, &st, 0) == 0 && S_ISDIR(st.st_mode)) { close(dfd); free(parent); reply_errno(EISDIR); return; }
    unsigned char rnd[6];
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) { int e = errno; close(dfd); free(parent); reply_errno(e); return; }
    char name[64];
    snprintf(name, sizeof name, ".hutch-write-%02x%02x%02x%02x%02x%02x", rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
    int fd = openat(dfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    int e = errno;
    close(dfd);
    if (fd < 0) { free(parent); reply_errno(e); return; }
    if (fchmod(fd, (mode_t)(mode->i & 07777)) < 0) { e = errno; close(fd); free(parent); reply_errno(e); return; }
    buf_t tmp = {0}, b = {0};
    b_str(&tmp, parent);
    if (tmp.n == 0 || tmp.p[tmp.n - 1] != '/') b_str(&tmp, "/");
    b_str(&tmp, name);
    reply_start(&b);
    b_str(&b, ",\"ok\":true,\"tmp\":");
    b_jstr(&b, tmp.p, tmp.n);
    b_str(&b, "}");
    send_msg(&b, &fd, 1);
    b_free(&b);
    b_free(&tmp);
    close(fd);
    free(parent);
}

static void op_write_commit(void) {
    const char *path = path_arg();
    if (!path) return;
    const char *tmp = str_arg("tmp", NULL);
    if (!tmp) { reply_bad("no tmp"); return; }
    char sname[PATH_MAX + 1], dname[PATH_MAX + 1];
    int src = parent_of(tmp, sname, sizeof sname);
    if (src < 0) { reply_errno(errno); return; }
    int dst = parent_of(path, dname, sizeof dname);
    if (dst < 0) { int e = errno; close(src); reply_errno(e); return; }
    int r = renameat(src, sname, dst, dname), e = errno;
    close(dst);
    close(src);
    if (r < 0) reply_errno(e);
    else reply_ok(NULL, 0);
}

static void op_write_abort(void) {
    const char *tmp = str_arg("tmp", NULL);
    if (!tmp) { reply_bad("no tmp"); return; }
    char name[PATH_MAX + 1];
    int dfd = parent_of(tmp, name, sizeof name);
    if (dfd < 0) { reply_errno(errno); return; }
    int r = unlinkat(dfd, name, 0), e = errno;
    close(dfd);
    if (r < 0 && e != ENOENT) reply_errno(e);
    else reply_ok(NULL, 0);
}

static int UPPER = -1;

static void op_upper(void) {
    int fd = fcntl(UPPER, F_DUPFD_CLOEXEC, 3);
    if (fd < 0) { reply_errno(errno); return; }
    reply_ok(&fd, 1);
    close(fd);
}

static void op_stat(void) {
    const char *path = path_arg();
    if (!path) return;
    int fd = open2(path, O_PATH | O_NOFOLLOW, AT_FDCWD);
    if (fd < 0) { reply_errno(errno); return; }
    struct stat st;
    int r = fstat(fd, &st), e = errno;
    close(fd);
    if (r < 0) { reply_errno(e); return; }
    buf_t b = {0};
    reply_start(&b);
    b_str(&b, ",\"ok\":true,\"entry\":");
    b_entry(&b, path, strlen(path), &st);
    b_str(&b, "}");
    send_msg(&b, NULL, 0);
    b_free(&b);
}

typedef struct { char *name; size_t n; struct stat st; } dent_t;

/* Python's str ordering of the decoded names: code point by code point. */
static int cmp_names(const void *a, const void *b) {
    const dent_t *x = a, *y = b;
    size_t i = 0, k = 0;
    while (i < x->n && k < y->n) {
        uint32_t p = next_cp((const unsigned char *)x->name, x->n, &i);
        uint32_t q = next_cp((const unsigned char *)y->name, y->n, &k);
        if (p != q) return p < q ? -1 : 1;
    }
    return (i < x->n) - (k < y->n);
}

/* The names in an open directory (its fd is consumed); -1 and errno on failure. */
static long read_names(int fd, dent_t **out, int want_stat) {
    DIR *d = fdopendir(fd);
    if (!d) { int e = errno; close(fd); errno = e; return -1; }
    size_t n = 0, cap = 0, bytes = 0;
    dent_t *v = NULL;
    struct dirent *de;
    errno = 0;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        size_t len = strlen(de->d_name);
        bytes += len + sizeof(dent_t);
        if (bytes > MAX_MSG) { closedir(d); for (size_t k = 0; k < n; k++) free(v[k].name); free(v); errno = E2BIG; return -1; }
        if (want_stat) {
            struct stat st;
            if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
                if (errno == ENOENT) { errno = 0; continue; }
                int e = errno;
                closedir(d);
                for (size_t k = 0; k < n; k++) free(v[k].name);
                free(v);
                errno = e;
                return -1;
            }
            if (n == cap) { cap = cap ? cap * 2 : 32; v = xrealloc(v, cap * sizeof *v); }
            v[n].st = st;
        } else {
            if (n == cap) { cap = cap ? cap * 2 : 32; v = xrealloc(v, cap * sizeof *v); }
            /* is it a directory (DirEntry.is_dir(follow_symlinks=False)): d_type, or lstat where unknown */
            memset(&v[n].st, 0, sizeof v[n].st);
            if (de->d_type == DT_DIR) v[n].st.st_mode = S_IFDIR;
            else if (de->d_type == DT_UNKNOWN) {
                struct stat st;
                if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0) v[n].st.st_mode = st.st_mode;
            }
        }
        v[n].name = xmalloc(len + 1);
        memcpy(v[n].name, de->d_name, len + 1);
        v[n].n = len;
        n++;
        errno = 0;
    }
    int e = errno;
    closedir(d);
    if (e) { for (size_t k = 0; k < n; k++) free(v[k].name); free(v); errno = e; return -1; }
    *out = v;
    return (long)n;
}

static void free_names(dent_t *v, long n) { for (long k = 0; k < n; k++) free(v[k].name); free(v); }

static void op_list(void) {
    const char *path = path_arg();
    if (!path) return;
    int fd = open2(path, O_RDONLY | O_DIRECTORY, AT_FDCWD);
    if (fd < 0) { reply_errno(errno); return; }
    dent_t *v = NULL;
    long n = read_names(fd, &v, 1);
    if (n < 0) { reply_errno(errno == E2BIG ? ENOMEM : errno); return; }
    qsort(v, (size_t)n, sizeof *v, cmp_names);
    size_t plen = strlen(path);
    buf_t b = {0}, p = {0};
    reply_start(&b);
    b_str(&b, ",\"ok\":true,\"entries\":[");
    for (long k = 0; k < n && !b.bad; k++) {
        p.n = 0;
        b_add(&p, path, plen);
        if (plen == 0 || path[plen - 1] != '/') b_add(&p, "/", 1);
        b_add(&p, v[k].name, v[k].n);
        if (k) b_str(&b, ",");
        b_entry(&b, p.p, p.n, &v[k].st);
    }
    b_str(&b, "]}");
    free_names(v, n);
    b_free(&p);
    if (b.bad) { b_free(&b); reply_errno(ENOMEM); return; }
    send_msg(&b, NULL, 0);
    b_free(&b);
}

/* init._rm_contents: by directory fds, never following a symlink; the names read before recursing, so one
 * fd per level is open. */
static int rm_contents(int dfd, int depth) {
    if (depth > MAX_TREE_DEPTH) { errno = ELOOP; return -1; }
    int rfd = fcntl(dfd, F_DUPFD_CLOEXEC, 3);
    if (rfd < 0) return -1;
    dent_t *v = NULL;
    long n = read_names(rfd, &v, 0);
    if (n < 0) return -1;
    for (long k = 0; k < n; k++) {
        if (S_ISDIR(v[k].st.st_mode)) {
            int fd = openat(dfd, v[k].name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0) goto fail;
            int r = rm_contents(fd, depth + 1), e = errno;
            close(fd);
            if (r < 0) { errno = e; goto fail; }
            if (unlinkat(dfd, v[k].name, AT_REMOVEDIR) < 0) goto fail;
        } else if (unlinkat(dfd, v[k].name, 0) < 0) goto fail;
    }
    free_names(v, n);
    return 0;
fail:;
    int e = errno;
    free_names(v, n);
    errno = e;
    return -1;
}

static void op_remove(void) {
    const char *path = path_arg();
    if (!path) return;
    size_t n = strlen(path);
    while (n > 0 && path[n - 1] == '/') n--;
    if (n == 0) { reply_errno(EPERM); return; }   /* refusing to remove / */
    char name[PATH_MAX + 1];
    int dfd = parent_of(path, name, sizeof name);
    if (dfd < 0) { reply_errno(errno); return; }
    struct stat st;
    int r;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) r = -1;
    else if (S_ISDIR(st.st_mode)) {
        if (truthy(jget(MSG, "recursive"))) {
            int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            r = fd < 0 ? -1 : rm_contents(fd, 0);
            if (fd >= 0) { int e = errno; close(fd); errno = e; }
            if (r == 0) r = unlinkat(dfd, name, AT_REMOVEDIR);
        } else r = unlinkat(dfd, name, AT_REMOVEDIR);
    } else r = unlinkat(dfd, name, 0);
    int e = errno;
    close(dfd);
    if (r < 0) reply_errno(e);
    else reply_ok(NULL, 0);
}

static void op_mkdir(void) {
    const char *path = path_arg();
    if (!path) return;
    if (truthy(jget(MSG, "parents"))) {
        int fd = makedirs(path);
        if (fd < 0) { reply_errno(errno); return; }
        close(fd);
    } else {
        char name[PATH_MAX + 1];
        int dfd = parent_of(path, name, sizeof name);
        if (dfd < 0) { reply_errno(errno); return; }
        int r = mkdirat(dfd, name, 0777), e = errno;
        close(dfd);
        if (r < 0) { reply_errno(e); return; }
    }
    reply_ok(NULL, 0);
}

/* ---- processes --------------------------------------------------------------------------------- */

static int USER_KEPT = 0;
typedef struct { pid_t pid; char *eid; size_t n; } proc_t;
static proc_t *PROCS;
static size_t NPROCS, CAPPROCS;
static pid_t MAIN_PID = -1;

static void procs_add(pid_t pid, const char *eid, size_t n) {
    if (NPROCS == CAPPROCS) {
        CAPPROCS = CAPPROCS ? CAPPROCS * 2 : 16;
        PROCS = xrealloc(PROCS, CAPPROCS * sizeof *PROCS);
    }
    PROCS[NPROCS].pid = pid;
    PROCS[NPROCS].eid = xmalloc(n + 1);
    memcpy(PROCS[NPROCS].eid, eid, n + 1);
    PROCS[NPROCS].n = n;
    NPROCS++;
}

static void fail_text(const char *cls, const char *a, const char *arg, size_t argn, const char *c, const char *d) {
    buf_t m = {0};
    b_str(&m, a);
    if (arg) b_repr(&m, arg, argn);
    if (c) b_str(&m, c);
    if (d) b_str(&m, d);
    reply_fail(cls, &m);
    b_free(&m);
}

/* init._which: execvp's search, a name with a slash as is. */
static char *which(const char *name, const char *path) {
    if (strchr(name, '/')) return strdup(name);
    const char *p = path;
    for (;;) {
        const char *end = strchr(p, ':');
        size_t dl = end ? (size_t)(end - p) : strlen(p);
        buf_t c = {0};
        if (dl == 0) b_str(&c, ".");
        else b_add(&c, p, dl);
        if (c.p && c.p[c.n - 1] != '/') b_str(&c, "/");
        b_str(&c, name);
        struct stat st;
        if (!c.bad && c.p && stat(c.p, &st) == 0 && S_ISREG(st.st_mode) && access(c.p, X_OK) == 0) return c.p;
        b_free(&c);
        if (!end) return NULL;
        p = end + 1;
    }
}

/* ptys.open_pty: a pty of the sandbox's devpts, its slave owned by `uid`, sized rows x cols. */
static int open_pty(unsigned uid, unsigned rows, unsigned cols, int *slave) {
    if (uid) {
        if (setresgid(-1, uid, -1) < 0 || setresuid(-1, uid, -1) < 0) { int e = errno; if (setresgid(-1, 0, -1) < 0) die("setresgid back to 0"); errno = e; return -1; }
    }
    int master = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC), e = errno;
    if (uid) {
        if (setresuid(-1, 0, -1) < 0 || setresgid(-1, 0, -1) < 0) die("setresuid back to 0");
    }
    if (master < 0) { errno = e; return -1; }
    int zero = 0;
    struct winsize ws = {(unsigned short)rows, (unsigned short)cols, 0, 0};
    if (ioctl(master, TIOCSPTLCK, &zero) < 0 || ioctl(master, TIOCSWINSZ, &ws) < 0) { e = errno; close(master); errno = e; return -1; }
    int s = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (s < 0) { e = errno; close(master); errno = e; return -1; }
    *slave = s;
    return master;
}

static void child_exec(const char *prog, char **argv, char **envp, const int *streams, const int *fds, int nfds,
                       int tty, unsigned uid, int report) {
    int err;
    if (setsid() < 0) goto fail;
    if (tty >= 0) {
        if (ioctl(tty, TIOCSCTTY, 0) < 0) goto fail;
        for (int t = 0; t < 3; t++) if (dup2(tty, t) < 0) goto fail;
    } else {
        int k = 0;
        for (int t = 0; t < 3; t++) {
            int src;
            if (streams[t]) src = k < nfds ? fds[k++] : -1;
            else src = open("/dev/null", O_RDWR | O_CLOEXEC);
            if (src < 0) { if (!errno) errno = EBADF; goto fail; }
            if (src == t) { if (fcntl(t, F_SETFD, 0) < 0) goto fail; }
            else if (dup2(src, t) < 0) goto fail;
        }
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    for (int s = 1; s < 65; s++) if (s != SIGKILL && s != SIGSTOP) sigaction(s, &sa, NULL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (uid) {
        if (setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0) goto fail;
    }
    execve(prog, argv, envp);
fail:
    err = errno;
    char t[16];
    int n = snprintf(t, sizeof t, "%d", err);
    if (n > 0) { ssize_t w = write(report, t, (size_t)n); (void)w; }
    _exit(127);
}

/* Fork and exec; the pid, or -1 and errno (of the fork, or of the child's failed set-up or execve). */
static pid_t spawn(const char *prog, char **argv, char **envp, const int *streams, const int *fds, int nfds,
                   int tty, unsigned uid) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) return -1;
    pid_t pid = fork();
    if (pid < 0) { int e = errno; close(p[0]); close(p[1]); errno = e; return -1; }
    if (pid == 0) { close(p[0]); child_exec(prog, argv, envp, streams, fds, nfds, tty, uid, p[1]); }
    close(p[1]);
    char t[16];
    ssize_t n;
    do n = read(p[0], t, sizeof t - 1); while (n < 0 && errno == EINTR);
    close(p[0]);
    if (n > 0) {
        t[n] = 0;
        int status;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
        errno = atoi(t);
        return -1;
    }
    return pid;
}

static void free_vec(char **v) { if (!v) return; for (char **p = v; *p; p++) free(*p); free(v); }

static void op_exec(int *fds, int *nfds) {
    jv *argv = jget(MSG, "argv"), *env = jget(MSG, "env"), *cwd = jget(MSG, "cwd"), *streams = jget(MSG, "streams");
    jv *eid = jget(MSG, "eid"), *pty = jget(MSG, "pty"), *uidv = jget(MSG, "uid");
    if (!argv || argv->type != J_ARR || argv->len == 0 || !env || env->type != J_OBJ || !cwd || cwd->type != J_STR
            || !streams || streams->type != J_ARR || streams->len != 3 || !eid || eid->type != J_STR) {
        reply_bad("exec needs argv, env, cwd, streams and eid");
        return;
    }
    for (size_t k = 0; k < argv->len; k++) if (argv->items[k].type != J_STR) { reply_bad("argv holds a non-string"); return; }
    for (size_t k = 0; k < env->len; k++) if (env->items[k].type != J_STR) { reply_bad("env holds a non-string"); return; }
    long long uid = uidv && uidv->type == J_NUM ? uidv->i : 0;
    if (uid < 0 || uid > 0x7fffffff) { reply_bad("uid out of range"); return; }
    /* NUL bytes (or strings no C string can be): refused as init._spawn refuses them */
    int bad = strlen(cwd->s) != cwd->n || cwd->bad;
    for (size_t k = 0; k < argv->len && !bad; k++) bad = strlen(argv->items[k].s) != argv->items[k].n || argv->items[k].bad;
    for (size_t k = 0; k < env->len && !bad; k++) {
        jv *key = &env->keys[k], *val = &env->items[k];
        bad = !key->n || memchr(key->s, '=', key->n) || strlen(key->s) != key->n || key->bad
              || strlen(val->s) != val->n || val->bad;
    }
    if (bad) {
        fail_text("ConfigError", "argv, env and workdir may not hold NUL bytes, nor an env name '=' or be empty; "
                  "fix the command.", NULL, 0, NULL, NULL);
        return;
    }
    int master = -1, slave = -1;
    unsigned puid = (unsigned)uid;
    if (truthy(pty)) {
        if (pty->type != J_ARR || pty->len != 2 || pty->items[0].type != J_NUM || pty->items[1].type != J_NUM
                || pty->items[0].i < 0 || pty->items[0].i > 65535 || pty->items[1].i < 0 || pty->items[1].i > 65535) {
            reply_bad("pty must be [rows, cols]");
            return;
        }
        master = open_pty(USER_KEPT ? puid : 0, (unsigned)pty->items[0].i, (unsigned)pty->items[1].i, &slave);
        if (master < 0) {
            if (errno != ENOSPC) { reply_errno(errno); return; }
            buf_t m = {0};
            b_fmt(&m, "the sandbox holds all the %d terminals it may have open; end some of its terminal sessions first.",
                  MAX_PTYS);
            reply_fail("SandboxError", &m);
            b_free(&m);
            return;
        }
    }
    /* env: name=value, in order (the daemon sends a dict: no name twice) */
    char **envp = xmalloc((env->len + 1) * sizeof(char *));
    size_t ne = 0;
    for (size_t k = 0; k < env->len; k++) {
        jv *key = &env->keys[k], *val = &env->items[k];
        char *s = xmalloc(key->n + val->n + 2);
        memcpy(s, key->s, key->n);
        s[key->n] = '=';
        memcpy(s + key->n + 1, val->s, val->n + 1);
        envp[ne++] = s;
    }
    envp[ne] = NULL;
    char **av = xmalloc((argv->len + 1) * sizeof(char *));
    for (size_t k = 0; k < argv->len; k++) av[k] = strdup(argv->items[k].s);
    av[argv->len] = NULL;
    const char *name = argv->items[0].s;
    size_t namen = argv->items[0].n;
    const char *path = "";
    jv *pv = jget(env, "PATH");
    if (pv) path = pv->s;
    char *prog = which(name, path);
    pid_t pid = -1;
    if (!prog) {
        fail_text("NotFoundError", "program ", name, namen,
                  " was not found in the sandbox; check the name or install it in the image.", NULL);
        goto out;
    }
    int fd = open2(cwd->s, O_PATH | O_DIRECTORY, AT_FDCWD);
    if (fd < 0 || fchdir(fd) < 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        buf_t m = {0};
        b_str(&m, "working directory ");
        b_repr(&m, cwd->s, cwd->n);
        b_str(&m, ": ");
        b_str(&m, strerror(e));
        b_str(&m, "; create it or pass another workdir.");
        reply_fail(e == ENOENT || e == ENOTDIR ? "NotFoundError" : "ConfigError", &m);
        b_free(&m);
        goto out;
    }
    close(fd);
    int want[3];
    for (int t = 0; t < 3; t++) want[t] = truthy(&streams->items[t]);
    pid = spawn(prog, av, envp, want, fds, *nfds, slave, puid);
    int e = errno;
    if (chdir("/") < 0) { /* "/" is always there */ }
    if (pid < 0) {
        if (e == EAGAIN || e == ENOMEM)
            fail_text("SandboxError", "program ", name, namen, " could not be started: the sandbox is at its pids or "
                      "memory limit; end some of its processes or create it with larger limits.", NULL);
        else {
            buf_t m = {0};
            b_str(&m, "program ");
            b_repr(&m, name, namen);
            b_str(&m, " could not be started: ");
            b_str(&m, strerror(e));
            b_str(&m, "; check it is an executable for this machine.");
            reply_fail(e == ENOENT ? "NotFoundError" : "ConfigError", &m);
            b_free(&m);
        }
        goto out;
    }
    procs_add(pid, eid->s, eid->n);
    if (truthy(jget(MSG, "main"))) MAIN_PID = pid;
    {
        buf_t b = {0};
        reply_start(&b);
        b_fmt(&b, ",\"ok\":true,\"pid\":%d}", (int)pid);
        send_msg(&b, master >= 0 ? &master : NULL, master >= 0 ? 1 : 0);
        b_free(&b);
    }
    goto out;
out:
    if (master >= 0) close(master);
    if (slave >= 0) close(slave);
    free(prog);
    free_vec(envp);
    free_vec(av);
}

/* ptys.session_members, and the kill itself (init.op_kill) */
static void op_kill(void) {
    jv *eid = jget(MSG, "eid"), *sig = jget(MSG, "signal");
    if (!eid || eid->type != J_STR || !sig || sig->type != J_NUM) {
        if (jget(MSG, "rid")) reply_bad("kill needs eid and signal");
        return;
    }
    int s = (int)sig->i;
    if (USER_KEPT && setresuid(-1, USER_ID, -1) < 0) die("setresuid");
    for (size_t k = 0; k < NPROCS; k++) {
        if (PROCS[k].n != eid->n || memcmp(PROCS[k].eid, eid->s, eid->n)) continue;
        pid_t pid = PROCS[k].pid;
        kill(-pid, s);
        kill(pid, s);
        if (!truthy(jget(MSG, "session"))) continue;
        DIR *d = opendir("/proc");
        if (!d) continue;
        struct dirent *de;
        while ((de = readdir(d))) {
            char *end;
            long other = strtol(de->d_name, &end, 10);
            if (*end || end == de->d_name || other <= 0) continue;
            char path[64], text[1024];
            snprintf(path, sizeof path, "/proc/%ld/stat", other);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0) continue;
            ssize_t n = read(fd, text, sizeof text - 1);
            close(fd);
            if (n <= 0) continue;
            text[n] = 0;
            char *rp = strrchr(text, ')');   /* after the command's name, whatever it holds */
            int ppid, pgrp, sid;
            char state;
            if (rp && sscanf(rp + 1, " %c %d %d %d", &state, &ppid, &pgrp, &sid) == 4 && sid == pid)
                kill((pid_t)other, s);
        }
        closedir(d);
    }
    if (USER_KEPT && setresuid(-1, 0, -1) < 0) die("setresuid");
    if (jget(MSG, "rid")) reply_ok(NULL, 0);
}

static int WAKE[2] = {-1, -1};

static void on_sigchld(int s) {
    (void)s;
    int e = errno;
    ssize_t w = write(WAKE[1], "c", 1);
    (void)w;
    errno = e;
}

static void reap(void) {
    char tmp[64];
    while (read(WAKE[0], tmp, sizeof tmp) > 0) {}
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) return;
        int found = -1;
        for (size_t k = 0; k < NPROCS; k++) if (PROCS[k].pid == pid) { found = (int)k; break; }
        buf_t b = {0};
        if (pid == MAIN_PID) {
            b_fmt(&b, "{\"op\":\"main_exit\",\"status\":%d}", status);
            send_msg(&b, NULL, 0);
            _exit(0);
        }
        if (found >= 0) {
            b_str(&b, "{\"op\":\"exec_exit\",\"eid\":");
            b_jstr(&b, PROCS[found].eid, PROCS[found].n);
            b_fmt(&b, ",\"status\":%d}", status);
            send_msg(&b, NULL, 0);
            b_free(&b);
            free(PROCS[found].eid);
            PROCS[found] = PROCS[--NPROCS];
        }
    }
}

/* ---- main ------------------------------------------------------------------------------------- */

static int parse_fd(const char *s) {
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || end == s || v < -1 || v > 1 << 20) { dprintf(2, "hutch-init: bad fd %s\n", s); _exit(2); }
    return (int)v;
}

int main(int argc, char **argv) {
    if (argc != 4) { dprintf(2, "usage: hutch-init CTL_FD UPPER_FD USER_KEPT (started by the sandbox's init)\n"); return 2; }
    CTL = parse_fd(argv[1]);
    UPPER = parse_fd(argv[2]);
    USER_KEPT = !strcmp(argv[3], "1");
    /* Not dumpable, first: init._lockdown's reasons (nothing of the sandbox runs yet, nor until "ready") */
    if (prctl(PR_SET_DUMPABLE, 0) < 0) die("PR_SET_DUMPABLE");
    prctl(PR_SET_NAME, "hutch-init");
    if (USER_KEPT) {   /* (0, 1000, 1000) -> (0, 0, 1000), as init._keep_user left them */
        if (setresgid(-1, 0, -1) < 0 || setresuid(-1, 0, -1) < 0) die("setresuid");
    }
    if (fcntl(CTL, F_SETFD, FD_CLOEXEC) < 0) die("ctl fd");
    if (UPPER >= 0 && fcntl(UPPER, F_SETFD, FD_CLOEXEC) < 0) die("upper fd");
    if (pipe2(WAKE, O_NONBLOCK | O_CLOEXEC) < 0) die("pipe2");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigchld;
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    sa.sa_handler = SIG_IGN;
    sa.sa_flags = 0;
    sigaction(SIGPIPE, &sa, NULL);
    {
        buf_t b = {0};
        b_str(&b, "{\"op\":\"ready\"}");
        send_msg(&b, NULL, 0);
        b_free(&b);
    }
    for (;;) {
        struct pollfd pf[2] = {{CTL, POLLIN, 0}, {WAKE[0], POLLIN, 0}};
        int r = poll(pf, 2, -1);
        if (r < 0) { if (errno == EINTR) continue; die("poll"); }
        if (pf[1].revents) reap();
        if (!pf[0].revents) continue;
        jv msg;
        int fds[MAX_FDS], nfds = 0;
        int got = recv_msg(&msg, fds, &nfds);
        if (got == 0) _exit(0);   /* the daemon is gone: ending pid 1 ends the sandbox */
        if (got < 0) { close_all(fds, nfds); dprintf(2, "hutch-init: a message that is not one; ignored\n"); continue; }
        MSG = &msg;
        jv *op = jget(&msg, "op");
        const char *o = op && op->type == J_STR ? op->s : "?";
        if (!jget(&msg, "rid") && strcmp(o, "kill")) { /* a call nobody waits for (only kill is sent so): dropped */ }
        else if (!strcmp(o, "exec")) op_exec(fds, &nfds);
        else if (!strcmp(o, "kill")) op_kill();
        else if (!strcmp(o, "read")) op_read();
        else if (!strcmp(o, "write_open")) op_write_open();
        else if (!strcmp(o, "write_commit")) op_write_commit();
        else if (!strcmp(o, "write_abort")) op_write_abort();
        else if (!strcmp(o, "upper")) op_upper();
        else if (!strcmp(o, "stat")) op_stat();
        else if (!strcmp(o, "list")) op_list();
        else if (!strcmp(o, "remove")) op_remove();
        else if (!strcmp(o, "mkdir")) op_mkdir();
        else if (jget(&msg, "rid")) reply_bad("unknown op");
        close_all(fds, nfds);
        MSG = NULL;
        jfree(&msg);
    }
}
