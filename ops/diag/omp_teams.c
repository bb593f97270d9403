/* OpenMP team sizes of a process, for issue 16 (two identical CPU runs that differ by an ulp).

   The leading explanation of that residual is a torch reduction running on an OpenMP team of
   another size than asked. This LD_PRELOAD library wraps GOMP_parallel (GNU OpenMP, which
   torch's x86 wheels use) and counts, per calling thread (the process's main thread or another),
   the team size every parallel region got, lists regions that got fewer threads than their
   caller asked for, and counts the SSE control words (MXCSR: rounding, flush-to-zero,
   denormals-are-zero) the team's threads computed under. Nested regions (MKL inside a torch
   parallel loop) get one thread by design and are listed too; compare the counts between a run
   that differs and one that does not.

   Build and run (torch's own libgomp, which torch loads privately, must be named):
     gcc -O2 -shared -fPIC -o /tmp/omp_teams.so ops/diag/omp_teams.c -ldl
     LD_PRELOAD=/tmp/omp_teams.so GOMP_SHIM_OUT=/tmp/teams \
       GOMP_SHIM_LIB=$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib/libgomp.so.1 \
       harness train ...
   Each process writes /tmp/teams.PID at exit (a process that ends with os._exit, as a
   distributed one does, writes nothing), and appends a line to /tmp/teams.short the moment a
   region outside nesting gets fewer threads than asked: a SIGKILLed process (the one that
   differed in issue 16's failures) leaves that witness too.
*/
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <xmmintrin.h>

typedef void (*real_fn)(void (*)(void*), void*, unsigned, unsigned);
static real_fn real_parallel;
static int (*p_thread_num)(void), (*p_num_threads)(void), (*p_max_threads)(void), (*p_active_level)(void);
struct ctx { void (*fn)(void*); void *data; int expected; unsigned requested; long tid; int nested; };
static atomic_long n_regions;
static atomic_long n_short;
static struct { long tid; int expected; unsigned requested; int got; } shortlog[64];
static atomic_long hist[3][17];  /* [main, other][team] */
/* The SSE control word (rounding, flush-to-zero, denormals-are-zero) each thread computed under:
   a worker thread inherits its creator's at creation, and a different one changes results. */
static atomic_uint csr_seen[8];
static atomic_long csr_count[8];

static void note_csr(void) {
    unsigned csr = _mm_getcsr() & ~0x3fu;  /* without the sticky exception flags */
    for (int i = 0; i < 8; i++) {
        unsigned expected = 0;
        if (atomic_load(&csr_seen[i]) == csr + 1 || atomic_compare_exchange_strong(&csr_seen[i], &expected, csr + 1)) {
            atomic_fetch_add(&csr_count[i], 1);
            return;
        }
    }
}

static void init(void) {
    const char *lib = getenv("GOMP_SHIM_LIB");
    void *h = dlopen(lib ? lib : "libgomp.so.1", RTLD_NOLOAD | RTLD_LAZY);
    if (!h) h = dlopen(lib ? lib : "libgomp.so.1", RTLD_LAZY);
    real_parallel = (real_fn)dlsym(h, "GOMP_parallel");
    p_thread_num = dlsym(h, "omp_get_thread_num");
    p_num_threads = dlsym(h, "omp_get_num_threads");
    p_max_threads = dlsym(h, "omp_get_max_threads");
    p_active_level = dlsym(h, "omp_get_active_level");
}

/* A team smaller than asked outside nesting is written at once to GOMP_SHIM_OUT.short (one line,
   appended): a SIGKILLed process never reaches the report at exit. */
static void log_short_now(const struct ctx *c, int got) {
    const char *out = getenv("GOMP_SHIM_OUT");
    if (!out) return;
    char path[512]; snprintf(path, sizeof path, "%s.short", out);
    FILE *f = fopen(path, "a"); if (!f) return;
    fprintf(f, "pid=%d tid=%ld main=%d expected=%d requested=%u got=%d region=%ld\n", getpid(), c->tid,
            c->tid == getpid(), c->expected, c->requested, got, (long)n_regions);
    fclose(f);
}

static void tramp(void *p) {
    struct ctx *c = p;
    note_csr();
    if (p_thread_num() == 0) {
        int n = p_num_threads();
        int want = c->requested ? (int)c->requested : c->expected;
        int is_main = c->tid == getpid();
        atomic_fetch_add(&hist[is_main ? 0 : 1][n > 16 ? 16 : n], 1);
        if (n < want && n < c->expected) {
            long k = atomic_fetch_add(&n_short, 1);
            if (k < 64) { shortlog[k].tid = c->tid; shortlog[k].expected = c->expected; shortlog[k].requested = c->requested; shortlog[k].got = n; }
            if (!c->nested) log_short_now(c, n);
        }
    }
    c->fn(c->data);
}

void GOMP_parallel(void (*fn)(void*), void *data, unsigned num_threads, unsigned flags) {
    if (!real_parallel) init();
    struct ctx c = {fn, data, p_max_threads(), num_threads, syscall(SYS_gettid), p_active_level() > 0};
    atomic_fetch_add(&n_regions, 1);
    real_parallel(tramp, &c, num_threads, flags);
}

__attribute__((destructor)) static void report(void) {
    const char *out = getenv("GOMP_SHIM_OUT");
    if (!out || !real_parallel) return;
    char path[512]; snprintf(path, sizeof path, "%s.%d", out, getpid());
    FILE *f = fopen(path, "w"); if (!f) return;
    fprintf(f, "regions %ld short %ld\n", (long)n_regions, (long)n_short);
    for (int i = 0; i < 8 && csr_seen[i]; i++) fprintf(f, "mxcsr %#x regions-threads %ld\n", csr_seen[i] - 1, (long)csr_count[i]);
    for (int w = 0; w < 2; w++) { fprintf(f, w ? "other" : "main"); for (int i = 0; i < 17; i++) if (hist[w][i]) fprintf(f, " %d:%ld", i, (long)hist[w][i]); fprintf(f, "\n"); }
    for (long k = 0; k < n_short && k < 64; k++)
        fprintf(f, "short tid=%ld main=%d expected=%d requested=%u got=%d\n", shortlog[k].tid, shortlog[k].tid == getpid(), shortlog[k].expected, shortlog[k].requested, shortlog[k].got);
    fclose(f);
}
