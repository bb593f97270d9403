/* OpenMP team sizes of a process, for issue 16 (two identical CPU runs that differ by an ulp).

   The leading explanation of that residual is a torch reduction running on an OpenMP team of
   another size than asked. This LD_PRELOAD library wraps GOMP_parallel (GNU OpenMP, which
   torch's x86 wheels use) and counts, per calling thread (the process's main thread or another),
   the team size every parallel region got, and lists regions that got fewer threads than their
   caller asked for. Nested regions (MKL inside a torch parallel loop) get one thread by design
   and are listed too; compare the counts between a run that differs and one that does not.

   Build and run (torch's own libgomp, which torch loads privately, must be named):
     gcc -O2 -shared -fPIC -o /tmp/omp_teams.so ops/diag/omp_teams.c -ldl
     LD_PRELOAD=/tmp/omp_teams.so GOMP_SHIM_OUT=/tmp/teams \
       GOMP_SHIM_LIB=$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib/libgomp.so.1 \
       harness train ...
   Each process writes /tmp/teams.PID at exit (a process that ends with os._exit, as a
   distributed one does, writes nothing).
*/
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef void (*real_fn)(void (*)(void*), void*, unsigned, unsigned);
static real_fn real_parallel;
static int (*p_thread_num)(void), (*p_num_threads)(void), (*p_max_threads)(void);
struct ctx { void (*fn)(void*); void *data; int expected; unsigned requested; long tid; };
#define MAXLOG 4096
static atomic_long n_regions, n_main, n_other;
static atomic_long n_short;
static struct { long tid; int expected; unsigned requested; int got; } shortlog[64];
static atomic_long hist[3][17];  /* [main, other][team] */

static void init(void) {
    const char *lib = getenv("GOMP_SHIM_LIB");
    void *h = dlopen(lib ? lib : "libgomp.so.1", RTLD_NOLOAD | RTLD_LAZY);
    if (!h) h = dlopen(lib ? lib : "libgomp.so.1", RTLD_LAZY);
    real_parallel = (real_fn)dlsym(h, "GOMP_parallel");
    p_thread_num = dlsym(h, "omp_get_thread_num");
    p_num_threads = dlsym(h, "omp_get_num_threads");
    p_max_threads = dlsym(h, "omp_get_max_threads");
}

static void tramp(void *p) {
    struct ctx *c = p;
    if (p_thread_num() == 0) {
        int n = p_num_threads();
        int want = c->requested ? (int)c->requested : c->expected;
        int is_main = c->tid == getpid();
        atomic_fetch_add(&hist[is_main ? 0 : 1][n > 16 ? 16 : n], 1);
        if (n < want && n < c->expected) {
            long k = atomic_fetch_add(&n_short, 1);
            if (k < 64) { shortlog[k].tid = c->tid; shortlog[k].expected = c->expected; shortlog[k].requested = c->requested; shortlog[k].got = n; }
        }
    }
    c->fn(c->data);
}

void GOMP_parallel(void (*fn)(void*), void *data, unsigned num_threads, unsigned flags) {
    if (!real_parallel) init();
    struct ctx c = {fn, data, p_max_threads(), num_threads, syscall(SYS_gettid)};
    atomic_fetch_add(&n_regions, 1);
    real_parallel(tramp, &c, num_threads, flags);
}

__attribute__((destructor)) static void report(void) {
    const char *out = getenv("GOMP_SHIM_OUT");
    if (!out || !real_parallel) return;
    char path[512]; snprintf(path, sizeof path, "%s.%d", out, getpid());
    FILE *f = fopen(path, "w"); if (!f) return;
    fprintf(f, "regions %ld short %ld\n", (long)n_regions, (long)n_short);
    for (int w = 0; w < 2; w++) { fprintf(f, w ? "other" : "main"); for (int i = 0; i < 17; i++) if (hist[w][i]) fprintf(f, " %d:%ld", i, (long)hist[w][i]); fprintf(f, "\n"); }
    for (long k = 0; k < n_short && k < 64; k++)
        fprintf(f, "short tid=%ld main=%d expected=%d requested=%u got=%d\n", shortlog[k].tid, shortlog[k].tid == getpid(), shortlog[k].expected, shortlog[k].requested, shortlog[k].got);
    fclose(f);
}
