/* The kernels' thread pool: one job at a time, split into parts that threads take as they come
   free; every wait is short spin, then a sleep on a condition variable.

   Why not OpenMP: libgomp's threads spin at the end of a parallel region. With another process
   busy on one of two cores, the spinning thread keeps its core from ever going idle, so the
   scheduler never moves the preempted thread (the one everybody waits for) to it; a product of
   milliseconds then waits for the other process's time slices (issue 29 measured 32 s against
   1.7 s on one thread). A thread that sleeps instead leaves its core idle, the scheduler's idle
   balancing pulls the preempted thread over, and the job ends at the speed of the free core.
   Waking a sleeping thread costs tens of microseconds, though (more in a virtual machine, where
   a sleeping CPU is a halted one), which is the length of a small product: so a thread first
   spins for at most SPIN_NS (a fraction of a scheduler's time slice, so a spinning thread never
   holds a core long), which covers the gap between the products of a training step. */

#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "common.h"

#define MAX_WORKERS 255
#define SPIN_NS 20000L /* the longest spin before a wait sleeps */

static long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void relax(void)
{
#ifdef HBFP_X86
    _mm_pause();
#endif
}

typedef struct {
    hbfp_task fn;
    void *ctx;
    long parts;
    int helpers;          /* pool threads that may take part (their index < helpers) */
    int active;           /* pool threads inside the job (under `lock`) */
    atomic_long next;     /* the next part to take */
    atomic_long done;     /* parts finished */
    atomic_int result;
} job_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;      /* a new job for the workers */
static pthread_cond_t finished = PTHREAD_COND_INITIALIZER;  /* the job is done and left */
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time */
static job_t *current;
static atomic_ulong generation;
static int workers;       /* pool threads started */

static void run_parts(job_t *job)
{
    unsigned fp = hbfp_fp_enter();
    long p;
    while ((p = atomic_fetch_add(&job->next, 1)) < job->parts) {
        int r = job->fn(job->ctx, p);
        if (r)
            atomic_fetch_or(&job->result, r);
        if (atomic_fetch_add(&job->done, 1) + 1 == job->parts) {
            pthread_mutex_lock(&lock);
            pthread_cond_broadcast(&finished);
            pthread_mutex_unlock(&lock);
        }
    }
    hbfp_fp_leave(fp);
}

static void *worker(void *arg)
{
    int index = (int)(long)arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&lock);
    for (;;) {
        if (atomic_load(&generation) == seen) { /* spin a little (without the lock) for the next job */
            pthread_mutex_unlock(&lock);
            long until = now_ns() + SPIN_NS;
            for (int i = 0; atomic_load_explicit(&generation, memory_order_acquire) == seen; i++) {
                relax();
                if ((i & 63) == 63 && now_ns() > until)
                    break;
            }
            pthread_mutex_lock(&lock);
        }
        while (atomic_load(&generation) == seen)
            pthread_cond_wait(&wake, &lock);
        seen = atomic_load(&generation);
        job_t *job = current;
        if (job == NULL || index >= job->helpers)
            continue;
        /* the caller waits for `active` to fall to 0 before its job (on its stack) is gone */
        job->active++;
        pthread_mutex_unlock(&lock);
        run_parts(job);
        pthread_mutex_lock(&lock);
        if (--job->active == 0 && atomic_load(&job->done) == job->parts)
            pthread_cond_broadcast(&finished);
    }
    return NULL;
}

/* After fork() only the forking thread exists in the child: the pool starts again there. */
static void child_after_fork(void)
{
    pthread_mutex_init(&lock, NULL);
    pthread_mutex_init(&caller, NULL);
    pthread_cond_init(&wake, NULL);
    pthread_cond_init(&finished, NULL);
    current = NULL;
    workers = 0;
}

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init_once(void)
{
    pthread_atfork(NULL, NULL, child_after_fork);
}

/* Starts pool threads up to `want` (under `lock`); returns how many there are. */
static int grow(int want)
{
    if (want > MAX_WORKERS)
        want = MAX_WORKERS;
    while (workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, (void *)(long)workers);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        workers++;
    }
    return workers;
}

#ifdef _OPENMP
#include <omp.h>

/* A region whose caller, its own parts done, waited longer than this for the other threads
   (and longer than it worked) stalled: a thread of its team ran late. */
#define STALL_NS 1000000L
/* A region that starts within this of the last one's end finds the team's threads awake (an
   OpenMP thread spins a while before it sleeps): if it stalls, a thread was preempted, another
   process holds a core. (After a quiet spell a thread may take longer than STALL_NS to wake.) */
#define WARM_NS 1000000L
/* Then the parts run on the caller's thread alone for this long, and a region tries again. */
#define BACKOFF_NS 100000000L

static atomic_long serial_until; /* now_ns() before which every job runs on the caller's thread */
static atomic_long last_end;     /* when the last region ended */

/* With OpenMP (built with -fopenmp): the parts on the OpenMP runtime already loaded (torch's),
   so that the threads that run torch's operations run these too, taking parts as they come.
   A region ends when every thread of its team has arrived, a thread the OS has not run yet
   included: where another process keeps a core busy, each region would wait for that thread's
   turn (a time slice, milliseconds, against a product of tens of microseconds). So a region
   that found its team awake (WARM_NS) and whose caller waited long for the others (STALL_NS)
   makes the next BACKOFF_NS of jobs run on the caller's thread, at the speed of one core
   rather than of the busy one. */
int hbfp_parallel(hbfp_task fn, void *ctx, long parts, int threads)
{
    if (parts <= 0)
        return 0;
    int result = 0;
    long start = threads <= 1 || parts == 1 ? 0 : now_ns();
    if (start == 0 || start < atomic_load_explicit(&serial_until, memory_order_relaxed)) {
        unsigned fp = hbfp_fp_enter();
        for (long p = 0; p < parts; p++)
            result |= fn(ctx, p);
        hbfp_fp_leave(fp);
        return result;
    }
    long caller_done = 0;
#pragma omp parallel num_threads(threads) reduction(| : result)
    {
        unsigned fp = hbfp_fp_enter();
#pragma omp for schedule(dynamic, 1) nowait
        for (long p = 0; p < parts; p++)
            result |= fn(ctx, p);
        hbfp_fp_leave(fp);
        if (omp_get_thread_num() == 0)
            caller_done = now_ns();
    }
    long end = now_ns(), waited = end - caller_done;
    int warm = start - atomic_load_explicit(&last_end, memory_order_relaxed) < WARM_NS;
    if (warm && waited > STALL_NS && waited > caller_done - start)
        atomic_store_explicit(&serial_until, end + BACKOFF_NS, memory_order_relaxed);
    atomic_store_explicit(&last_end, end, memory_order_relaxed);
    return result;
}
#else
int hbfp_parallel(hbfp_task fn, void *ctx, long parts, int threads)
{
    if (parts <= 0)
        return 0;
    if (threads <= 1 || parts == 1) {
        unsigned fp = hbfp_fp_enter();
        int result = 0;
        for (long p = 0; p < parts; p++)
            result |= fn(ctx, p);
        hbfp_fp_leave(fp);
        return result;
    }
    pthread_once(&once, init_once);
    /* A second caller (another Python thread) waits for the pool rather than sharing it. */
    pthread_mutex_lock(&caller);
    job_t job = {fn, ctx, parts, 0, 0};
    atomic_init(&job.next, 0);
    atomic_init(&job.done, 0);
    atomic_init(&job.result, 0);
    pthread_mutex_lock(&lock);
    int helpers = threads - 1 < parts - 1 ? threads - 1 : (int)(parts - 1);
    job.helpers = grow(helpers) < helpers ? workers : helpers;
    current = &job;
    atomic_fetch_add(&generation, 1);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);

    run_parts(&job);

    long until = now_ns() + SPIN_NS;
    for (int i = 0; atomic_load_explicit(&job.done, memory_order_acquire) < parts; i++) {
        relax();
        if ((i & 63) == 63 && now_ns() > until)
            break;
    }
    pthread_mutex_lock(&lock);
    while (atomic_load(&job.done) < parts || job.active > 0)
        pthread_cond_wait(&finished, &lock);
    current = NULL;
    pthread_mutex_unlock(&lock);
    pthread_mutex_unlock(&caller);
    return atomic_load(&job.result);
}
#endif

/* ---- each thread's own buffers ------------------------------------------------------------ */

typedef struct {
    void *mem[HBFP_BUFFERS];
    size_t bytes[HBFP_BUFFERS];
} buffers_t;

static pthread_key_t buffers_key;
static int buffers_keyed; /* the key was made (else no buffer: HBFP_ENOMEM for its users) */
static pthread_once_t buffers_once = PTHREAD_ONCE_INIT;

static void buffers_free(void *p)
{
    buffers_t *t = p;
    for (int i = 0; i < HBFP_BUFFERS; i++)
        free(t->mem[i]);
    free(t);
}

static void buffers_init(void)
{
    buffers_keyed = pthread_key_create(&buffers_key, buffers_free) == 0;
}

void *hbfp_thread_buffer(int slot, size_t bytes)
{
    pthread_once(&buffers_once, buffers_init);
    if (!buffers_keyed || slot < 0 || slot >= HBFP_BUFFERS)
        return NULL;
    buffers_t *t = pthread_getspecific(buffers_key);
    if (t == NULL) {
        t = calloc(1, sizeof(*t));
        if (t == NULL || pthread_setspecific(buffers_key, t) != 0) {
            free(t);
            return NULL;
        }
    }
    if (bytes > t->bytes[slot] || t->mem[slot] == NULL) {
        free(t->mem[slot]);
        t->mem[slot] = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
        t->bytes[slot] = t->mem[slot] ? bytes : 0;
    }
    return t->mem[slot];
}
