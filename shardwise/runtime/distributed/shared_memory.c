/* All-gather and reduce-scatter between processes of one host through a shared segment
 * (shared_memory.py builds and loads this file; it explains the protocol's why).
 *
 * Segment: one header line per rank, then one slot per rank of `slot_bytes`.
 * Rank r's header holds two counters that only r writes:
 *   ready: the last round whose data r has put in its slot;
 *   done:  the last round in which r has finished reading every peer's slot.
 * Round k on rank r: wait until every peer's done >= k - 1 (they no longer read r's slot),
 * fill r's slot, publish ready = k, then for each peer wait ready >= k and read its slot,
 * then publish done = k. Counters are 32-bit and compared modulo 2^32. Waits spin briefly,
 * then sleep on a futex in slices; between slices they check that the peer process still
 * exists, and they give up at the deadline, naming the peer. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#define PAUSE() __builtin_ia32_pause()
#else
#define PAUSE() ((void)0)
#endif

#define HEADER_BYTES 128
/* A round copies megabytes: a futex wake-up costs little beside it, and spinning takes a
 * loaded core from compute. */
#define SPINS 200
#define MAX_MEMBERS 64 /* shared_memory.py uses the segment for groups up to this size */
#define SLICE_NS 100000000L /* 0.1 s */

enum { OK = 0, TIMED_OUT = 1, PEER_GONE = 2 };
enum { FLOAT32 = 0, FLOAT64 = 1, BFLOAT16 = 2 };

typedef struct {
    uint32_t ready;
    uint32_t done;
    int32_t pid;
} header_t;

typedef struct {
    char *base;
    int rank;
    int size;
    int64_t slot_bytes;
    uint32_t round;
    double timeout;
    int failed_peer; /* the member a failed wait waited for */
} channel_t;

static header_t *header(channel_t *c, int member) {
    return (header_t *)(c->base + (int64_t)member * HEADER_BYTES);
}

static char *slot(channel_t *c, int member) {
    return c->base + (int64_t)c->size * HEADER_BYTES + (int64_t)member * c->slot_bytes;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Wait until *word has reached `target` (modulo 2^32). */
static int wait_for(channel_t *c, int peer, uint32_t *word, uint32_t target) {
    for (int spin = 0; spin < SPINS; spin++) {
        if ((int32_t)(__atomic_load_n(word, __ATOMIC_ACQUIRE) - target) >= 0) return OK;
        PAUSE();
    }
    double deadline = now() + c->timeout;
    struct timespec slice = {0, SLICE_NS};
    for (;;) {
        uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if ((int32_t)(seen - target) >= 0) return OK;
        syscall(SYS_futex, word, FUTEX_WAIT, seen, &slice, NULL, 0);
        if ((int32_t)(__atomic_load_n(word, __ATOMIC_ACQUIRE) - target) >= 0) return OK;
        c->failed_peer = peer;
        int32_t pid = __atomic_load_n(&header(c, peer)->pid, __ATOMIC_ACQUIRE);
        if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) return PEER_GONE;
        if (now() > deadline) return TIMED_OUT;
    }
}

static void publish(uint32_t *word, uint32_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    syscall(SYS_futex, word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

/* Start a round: every peer has finished reading this rank's slot. */
static int begin_round(channel_t *c) {
    c->round++;
    for (int peer = 0; peer < c->size; peer++) {
        if (peer == c->rank) continue;
        int status = wait_for(c, peer, &header(c, peer)->done, c->round - 1);
        if (status != OK) return status;
    }
    return OK;
}

int sw_open(const char *path, int64_t bytes, int create, void **mapped) {
    int fd = open(path, O_RDWR | (create ? O_CREAT | O_EXCL : 0), 0600);
    if (fd < 0) return errno;
    if (create) {
        int status = posix_fallocate(fd, 0, bytes); /* reserve now: a full /dev/shm fails here, not later */
        if (status != 0) {
            close(fd);
            unlink(path);
            return status;
        }
    }
    void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int error = errno;
    close(fd);
    if (base == MAP_FAILED) {
        if (create) unlink(path);
        return error;
    }
    *mapped = base;
    return 0;
}

void sw_close(void *base, int64_t bytes) { munmap(base, bytes); }

int64_t sw_channel_bytes(void) { return sizeof(channel_t); }

void sw_channel_init(channel_t *c, void *base, int rank, int size, int64_t slot_bytes, double timeout) {
    c->base = base;
    c->rank = rank;
    c->size = size;
    c->slot_bytes = slot_bytes;
    c->round = 0;
    c->timeout = timeout;
    c->failed_peer = -1;
    __atomic_store_n(&header(c, rank)->pid, (int32_t)getpid(), __ATOMIC_RELEASE);
}

int sw_failed_peer(channel_t *c) { return c->failed_peer; }

/* outputs[m] receives member m's `nbytes` (outputs[rank] is filled from `shard` unless it is `shard`). */
int sw_all_gather(channel_t *c, const char *shard, char **outputs, int64_t nbytes) {
    if (outputs[c->rank] != shard) memmove(outputs[c->rank], shard, nbytes);
    for (int64_t offset = 0; offset < nbytes; offset += c->slot_bytes) {
        int64_t piece = nbytes - offset < c->slot_bytes ? nbytes - offset : c->slot_bytes;
        int status = begin_round(c);
        if (status != OK) return status;
        memcpy(slot(c, c->rank), shard + offset, piece);
        publish(&header(c, c->rank)->ready, c->round);
        for (int step = 1; step < c->size; step++) {
            int peer = (c->rank + step) % c->size;
            status = wait_for(c, peer, &header(c, peer)->ready, c->round);
            if (status != OK) return status;
            memcpy(outputs[peer] + offset, slot(c, peer), piece);
        }
        publish(&header(c, c->rank)->done, c->round);
    }
    return OK;
}

static float bf16_to_float(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float result;
    memcpy(&result, &bits, 4);
    return result;
}

static uint16_t float_to_bf16(float value) { /* round to nearest even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* One element of `dtype` divided by `divisor` as torch's `div_` by a number does it: in
 * the element's own precision for float32 and float64, through float32 and rounded back
 * for bfloat16; so dividing while copying gives the bits a division before it gave. */
static float divided32(float value, double divisor) { return value / (float)divisor; }

static void copy_divided(int dtype, const char *source, char *target, int64_t count, double divisor) {
    if (divisor == 1.0) {
        memcpy(target, source, count * (dtype == FLOAT64 ? 8 : dtype == FLOAT32 ? 4 : 2));
    } else if (dtype == FLOAT32) {
        float d = (float)divisor;
        for (int64_t i = 0; i < count; i++) ((float *)target)[i] = ((const float *)source)[i] / d;
    } else if (dtype == FLOAT64) {
        for (int64_t i = 0; i < count; i++) ((double *)target)[i] = ((const double *)source)[i] / divisor;
    } else {
        for (int64_t i = 0; i < count; i++)
            ((uint16_t *)target)[i] = float_to_bf16(divided32(bf16_to_float(((const uint16_t *)source)[i]), divisor));
    }
}

/* out[i] = sum over members m in order of sources[m][i] (out may be sources[rank]),
 * member `divided`'s values first divided by `divisor` (the others arrive divided). */
static void sum_members(int dtype, int size, const char **sources, char *out, int64_t count, int divided,
                        double divisor) {
    if (dtype == FLOAT32) {
        float *o = (float *)out;
        float d = (float)divisor;
        for (int64_t i = 0; i < count; i++) {
            float total = ((const float *)sources[0])[i];
            if (divided == 0) total = total / d;
            for (int m = 1; m < size; m++) {
                float value = ((const float *)sources[m])[i];
                total += m == divided ? value / d : value;
            }
            o[i] = total;
        }
    } else if (dtype == FLOAT64) {
        double *o = (double *)out;
        for (int64_t i = 0; i < count; i++) {
            double total = ((const double *)sources[0])[i];
            if (divided == 0) total = total / divisor;
            for (int m = 1; m < size; m++) {
                double value = ((const double *)sources[m])[i];
                total += m == divided ? value / divisor : value;
            }
            o[i] = total;
        }
    } else {
        uint16_t *o = (uint16_t *)out;
        for (int64_t i = 0; i < count; i++) {
            float total = 0.0f;
            for (int m = 0; m < size; m++) {
                uint16_t value = ((const uint16_t *)sources[m])[i];
                float term = m == divided ? bf16_to_float(float_to_bf16(divided32(bf16_to_float(value), divisor)))
                                          : bf16_to_float(value);
                total = m == 0 ? term : total + term;
            }
            o[i] = float_to_bf16(total);
        }
    }
}

/* full: `size` chunks of `count` elements; output (count elements, may alias chunk `rank`)
 * receives the sum of every member's chunk `rank`, each member's values divided by
 * `divisor` first (1: as they are). Each round moves up to a sub-slot (slot_bytes / size)
 * per destination, divided as it is copied in. */
int sw_reduce_scatter(channel_t *c, const char *full, char *output, int64_t count, int dtype, double divisor) {
    int64_t element = dtype == FLOAT64 ? 8 : dtype == FLOAT32 ? 4 : 2;
    int64_t sub_slot = (c->slot_bytes / c->size) / 64 * 64;
    int64_t per_round = sub_slot / element;
    const char *sources[MAX_MEMBERS];
    for (int64_t first = 0; first < count; first += per_round) {
        int64_t n = count - first < per_round ? count - first : per_round;
        int status = begin_round(c);
        if (status != OK) return status;
        for (int member = 0; member < c->size; member++)
            if (member != c->rank)
                copy_divided(dtype, full + (member * count + first) * element, slot(c, c->rank) + member * sub_slot,
                             n, divisor);
        publish(&header(c, c->rank)->ready, c->round);
        for (int step = 1; step < c->size; step++) {
            int peer = (c->rank + step) % c->size;
            status = wait_for(c, peer, &header(c, peer)->ready, c->round);
            if (status != OK) return status;
        }
        for (int member = 0; member < c->size; member++)
            sources[member] = member == c->rank ? full + (c->rank * count + first) * element
                                                : slot(c, member) + c->rank * sub_slot;
        sum_members(dtype, c->size, sources, output + first * element, n, divisor == 1.0 ? -1 : c->rank, divisor);
        publish(&header(c, c->rank)->done, c->round);
    }
    return OK;
}

/* In place: data (count elements) becomes the sum over members. Per piece, two rounds:
 * a reduce-scatter (member m sums chunk m of the piece, in member order, so every rank
 * ends with the same bits), then an all-gather of the summed chunks. */
int sw_all_reduce(channel_t *c, char *data, int64_t count, int dtype) {
    int64_t element = dtype == FLOAT64 ? 8 : dtype == FLOAT32 ? 4 : 2;
    int64_t sub_slot = (c->slot_bytes / c->size) / 64 * 64;
    int64_t per_member = sub_slot / element;
    const char *sources[MAX_MEMBERS];
    for (int64_t first = 0; first < count; first += per_member * c->size) {
        int64_t n = count - first < per_member * c->size ? count - first : per_member * c->size;
        int64_t chunk = (n + c->size - 1) / c->size;
#define START(m) ((m) * chunk < n ? (m) * chunk : n)
#define LENGTH(m) (START((m) + 1) - START(m))
        int status = begin_round(c);
        if (status != OK) return status;
        for (int member = 0; member < c->size; member++)
            if (member != c->rank)
                memcpy(slot(c, c->rank) + member * sub_slot, data + (first + START(member)) * element,
                       LENGTH(member) * element);
        publish(&header(c, c->rank)->ready, c->round);
        for (int step = 1; step < c->size; step++) {
            int peer = (c->rank + step) % c->size;
            status = wait_for(c, peer, &header(c, peer)->ready, c->round);
            if (status != OK) return status;
        }
        char *mine = data + (first + START(c->rank)) * element;
        for (int member = 0; member < c->size; member++)
            sources[member] = member == c->rank ? mine : slot(c, member) + c->rank * sub_slot;
        sum_members(dtype, c->size, sources, mine, LENGTH(c->rank), -1, 1.0);
        publish(&header(c, c->rank)->done, c->round);

        status = begin_round(c);
        if (status != OK) return status;
        memcpy(slot(c, c->rank), mine, LENGTH(c->rank) * element);
        publish(&header(c, c->rank)->ready, c->round);
        for (int step = 1; step < c->size; step++) {
            int peer = (c->rank + step) % c->size;
            status = wait_for(c, peer, &header(c, peer)->ready, c->round);
            if (status != OK) return status;
            memcpy(data + (first + START(peer)) * element, slot(c, peer), LENGTH(peer) * element);
        }
        publish(&header(c, c->rank)->done, c->round);
#undef START
#undef LENGTH
    }
    return OK;
}

/* A board over a segment's headers without slots (shared_region.py: data every member
 * reads in place). `field` 0 is `ready` (the member's published version), 1 is `done`
 * (the barriers it has reached); only the member itself writes its own. */
static uint32_t *board_word(channel_t *c, int member, int field) {
    return field ? &header(c, member)->done : &header(c, member)->ready;
}

void sw_board_publish(channel_t *c, int field, uint32_t value) { publish(board_word(c, c->rank, field), value); }

/* Wait until every peer's `field` has reached `target` (modulo 2^32). */
int sw_board_wait(channel_t *c, int field, uint32_t target) {
    for (int step = 1; step < c->size; step++) {
        int peer = (c->rank + step) % c->size;
        int status = wait_for(c, peer, board_word(c, peer, field), target);
        if (status != OK) return status;
    }
    return OK;
}
