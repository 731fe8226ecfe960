// Fixed-order linears: out[r][n] = dot(x[r], w[n]) (+ bias[n]), every output one dot product in one order.
//
// The order (the same for every path, every row count, every thread count, every call):
//   * 16 partial sums, lane l holding the products of the inputs k = l, l+16, l+32, ... accumulated in increasing
//     k by fused multiply-adds from +0 (inputs past the end are zeros on both sides: fma(0, 0, s));
//   * the lanes summed as a fixed tree: l + (l+8) for l < 8, then l + (l+4), then l + (l+2), then 0 + 1;
//   * the bias added last, then the result rounded once to the output's type (bf16: to nearest, ties to even).
// AVX-512 holds the 16 lanes in one register, AVX2 in two, the scalar path in an array: the same operations on
// the same numbers, so the three give the same bits (tests/kernels/test_dots.py checks them against each other).
//
// Threads split the output columns, never a reduction: each output is computed whole by one thread, so the
// thread count changes who computes it, not its bits.  Each thread reads its columns' weights once for a block of
// rows (a tile of up to 4 rows x 6 columns in registers), so a decode step's few rows cost one read of the weights.
//
// The threads are a team of our own (`Team`), not OpenMP's: a call is cut into tasks (a chunk of column tiles; one
// (query, head) of the attention) that the caller and the team's helpers claim one at a time from a shared count.
// The caller starts at once and returns when every task is done; it waits only for a task a helper has claimed
// and is computing, never for a helper that has not come: a helper whose core is busy with another process, or
// that is still waking, joins late or not at all and the caller does its share.  (An OpenMP region waits at its
// barrier for every thread of the team, whether or not that thread's core is free: beside one busy process a
// step of ~200 regions took 2.9x as long.)  After its last task a helper spins for a short while (the next call of
// a step usually comes within it), then sleeps until a call large enough to be worth waking it.
//
// Built with the machine's compiler by `dots.py` (no -ffast-math, -ffp-contract=off): no reassociation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>
#include <pthread.h>
#include <vector>
#include <thread>
#include <vector>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KV_X86 1
#endif

namespace {

constexpr int LANES = 16;
constexpr int TILE_COLS = 6;    // columns of a register tile (AVX-512); AVX2 and scalar use their own tiles
constexpr int TILE_ROWS = 4;    // rows of a register tile
constexpr int64_t BLOCK_BYTES = 192 * 1024;  // rows of x per block: kept in L2 while a thread walks its columns

enum Path { AUTO = 0, SCALAR = 1, AVX2 = 2, AVX512 = 3 };

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest, ties to even (torch's conversion); NaN stays NaN
    if (std::isnan(f)) return 0x7fc0;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return uint16_t(u >> 16);
}

template <bool BF16>
inline float weight_at(const void* w, int64_t i) {
    if constexpr (BF16) return bf16_to_f32(static_cast<const uint16_t*>(w)[i]);
    else return static_cast<const float*>(w)[i];
}

template <bool BF16>
inline void store(void* out, int64_t i, float v) {
    if constexpr (BF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(v);
    else static_cast<float*>(out)[i] = v;
}

inline float tree(const float* a) {  // the fixed tree over 16 lanes
    float b[8], c[4];
    for (int l = 0; l < 8; ++l) b[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; ++l) c[l] = b[l] + b[l + 4];
    float d0 = c[0] + c[2], d1 = c[1] + c[3];
    return d0 + d1;
}

struct Call {
    const float* x;   // (m, k) float32
    const void* w;    // (n, k) float32 or bf16
    const void* bias; // (n,) like w, or null
    void* out;        // (m, n) float32 or bf16
    int64_t m, k, n;
};

constexpr int64_t MAX_HEAD_DIM = 512;

struct Attn {
    const void* q;    // (heads, nq, d): strides q_sh, q_sq; float32 or bf16 like k and v
    const void* k;    // (kv_heads, t, d): strides k_sh, k_st
    const void* v;    // (kv_heads, t, d): strides v_sh, v_st
    float* out;       // (nq, heads, d) float32
    int64_t heads, kv_heads, nq, t, d, q_sh, q_sq, k_sh, k_st, v_sh, v_st, end, window;
    float scaling, softcap;
    int bf16;
};

// Several lanes' attention in one call (a decode step's lanes at one layer): lane l's (query, head) tasks come
// after those of the lanes before it, each computed by `attention_task` on that lane's own `Attn` as a call of its
// own would (so a lane's bits are those of its own call), on the claiming worker's scratch row of `max_t` scores.
struct Lanes {
    const Attn* lanes;
    int64_t count, per_lane, max_t;  // per_lane = nq * heads tasks, the same for every lane
    float* scratch;                   // (threads, max_t) float32
};


// --- the team ---------------------------------------------------------------------------------------------------
// One call at a time runs on the team (a second caller, from another thread, runs its call alone).  A call's state
// is one 64-bit word: the call's number (high 32 bits) and the tasks not yet claimed (low 32); a task is claimed by
// taking one off that count in the same call's number, so a helper late from an earlier call claims nothing of the
// next.  The caller waits for `done` to reach the task count: only tasks claimed by someone count towards it.
using TaskFn = void (*)(const void* ctx, int64_t task, int worker);

// A call's work in units of about one multiply-add (a weight read from memory counts 4): one thread does some 40
// units a nanosecond here (SmolLM2's 576 x 576 linear over 7 rows, 3.6 M units, in ~90 us).  A call of less work
// than WAKE_WORK (~50 us) never wakes a sleeping helper: the wake-up would bring it after the call is done (a
// spinning helper still takes a share of any call of two tasks or more).
constexpr int64_t WAKE_WORK = 2 * 1024 * 1024;
// The attention's work per element of a head a query reads (a key's score, its exponential, its value's share): one
// thread takes ~1 ns for it here, 40 units (9 heads over 70 keys of 64, a decode step's call for one lane: ~48 us;
// seven lanes in one call: ~270 us, worth a helper's wake-up).
constexpr int64_t ATTENTION_UNITS = 40;
constexpr int SPIN_US = 100;  // a helper spins this long after its last task, then sleeps

inline void relax() {
#ifdef KV_X86
    _mm_pause();
#endif
}

class Team {
  public:
    // Runs fn(ctx, task, worker) for task 0 .. tasks-1 on the caller (worker 0) and on helpers 1 .. threads-1;
    // `work`: the whole call's, in WAKE_WORK's units.
    void run(int threads, int64_t tasks, int64_t work, TaskFn fn, const void* ctx) {
        if (threads > tasks) threads = int(tasks);
        std::unique_lock<std::mutex> own(submit_, std::try_to_lock);
        if (threads <= 1 || !own.owns_lock()) {
            for (int64_t i = 0; i < tasks; ++i) fn(ctx, i, 0);
            return;
        }
        grow(threads - 1);
        fn_ = fn, ctx_ = ctx;
        workers_.store(threads, std::memory_order_relaxed);
        const bool wake = work >= WAKE_WORK;
        big_.store(wake, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        const uint64_t call = (word_.load(std::memory_order_relaxed) >> 32) + 1;
        word_.store((call << 32) | uint64_t(tasks), std::memory_order_seq_cst);  // publishes fn_, ctx_ and workers_
        if (wake && sleeping_.load(std::memory_order_seq_cst) > 0) {
            { std::lock_guard<std::mutex> lock(sleep_); }
            wake_.notify_all();
        }
        int64_t mine = 0;
        for (int64_t task; (task = claim(call, 0)) >= 0; ++mine) fn(ctx, task, 0);
        done_.fetch_add(mine, std::memory_order_acq_rel);
        while (done_.load(std::memory_order_acquire) < tasks) relax();  // only claimed tasks are left
    }

    static Team* instance();

    // While set, helpers take no task: a helper whose core another process holds, as the tests make it.
    static inline std::atomic<bool> held{false};

  private:
    // A task of call `call` (its index), or -1 when none is left (or the call is another's).
    int64_t claim(uint64_t call, int worker) {
        uint64_t word = word_.load(std::memory_order_acquire);
        for (;;) {
            const uint64_t left = word & 0xffffffffu;
            if ((word >> 32) != call || left == 0) return -1;
            if (worker >= workers_.load(std::memory_order_relaxed)) return -1;  // beyond this call's threads
            if (word_.compare_exchange_weak(word, word - 1, std::memory_order_acq_rel, std::memory_order_acquire))
                return int64_t(left - 1);
        }
    }

    void grow(int helpers) {
        while (int(helpers_.size()) < helpers) {
            const int worker = int(helpers_.size()) + 1;
            helpers_.emplace_back([this, worker] { help(worker); });
            helpers_.back().detach();
        }
    }

    void help(int worker) {
        uint64_t seen = word_.load(std::memory_order_acquire) >> 32;
        for (;;) {
            uint64_t word = word_.load(std::memory_order_acquire);
            if ((word >> 32) == seen) {  // no new call: spin a while, then sleep
                const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
                int spins = 0;
                while ((word = word_.load(std::memory_order_acquire)) >> 32 == seen) {
                    relax();
                    if (++spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
                }
                if ((word >> 32) == seen) {
                    std::unique_lock<std::mutex> lock(sleep_);
                    sleeping_.fetch_add(1, std::memory_order_seq_cst);
                    wake_.wait(lock, [&] {
                        word = word_.load(std::memory_order_seq_cst);
                        return (word >> 32) != seen && big_.load(std::memory_order_relaxed);
                    });
                    sleeping_.fetch_sub(1, std::memory_order_seq_cst);
                }
            }
            const uint64_t call = word >> 32;
            seen = call;
            while (held.load(std::memory_order_relaxed)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            int64_t mine = 0;
            for (int64_t task; (task = claim(call, worker)) >= 0; ++mine) fn_(ctx_, task, worker);
            if (mine) done_.fetch_add(mine, std::memory_order_acq_rel);
        }
    }

    std::mutex submit_, sleep_;
    std::condition_variable wake_;
    std::vector<std::thread> helpers_;
    std::atomic<uint64_t> word_{0};
    std::atomic<int64_t> done_{0};
    std::atomic<int> sleeping_{0};
    TaskFn fn_ = nullptr;  // the call in progress: written before `word_` publishes it, read after a claim
    const void* ctx_ = nullptr;
    std::atomic<int> workers_{1};
    std::atomic<bool> big_{false};  // the call in progress wakes sleeping helpers
};

// The process's team, made at its first call; never freed (its helpers are detached and sleep until the process
// ends).  The child of a fork has none of the parent's helpers: it makes a team of its own.
std::atomic<Team*> g_team{nullptr};
std::mutex g_making;

Team* Team::instance() {
    Team* team = g_team.load(std::memory_order_acquire);
    if (team != nullptr) return team;
    std::lock_guard<std::mutex> lock(g_making);
    team = g_team.load(std::memory_order_acquire);
    if (team == nullptr) {
        team = new Team();
        static const int registered = pthread_atfork(nullptr, nullptr, [] {
            new (&g_making) std::mutex();
            g_team.store(nullptr, std::memory_order_relaxed);
        });
        (void)registered;
        g_team.store(team, std::memory_order_release);
    }
    return team;
}

// A task of a linear: a chunk of column tiles, for every block of rows.  Tile(call, r0, rows, c0, cols) computes a
// rows x cols tile whole.  A chunk is about CHUNK_WORK of work (a weight read counting 4, a multiply-add 1): a few
// microseconds, so that a helper that joins late still takes a share, and one whose core is taken from it mid-task
// holds the caller for one chunk at most.
constexpr int64_t CHUNK_WORK = 256 * 1024;

template <int COLS, typename Tile>
struct Linear {
    const Call* c;
    Tile tile;
    int64_t tiles, chunk, block;

    static void task(const void* self, int64_t i, int) {
        const Linear& L = *static_cast<const Linear*>(self);
        const Call& c = *L.c;
        const int64_t first = i * L.chunk, last = std::min(L.tiles, first + L.chunk);
        for (int64_t r0 = 0; r0 < c.m; r0 += L.block) {
            const int64_t r1 = std::min(c.m, r0 + L.block);
            for (int64_t j = first; j < last; ++j) {
                const int64_t c0 = j * COLS, cols = std::min<int64_t>(COLS, c.n - c0);
                for (int64_t r = r0; r < r1; r += TILE_ROWS)
                    L.tile(c, r, int(std::min<int64_t>(TILE_ROWS, r1 - r)), c0, int(cols));
            }
        }
    }
};

template <int COLS, typename Tile>
void run(const Call& c, int threads, Tile tile) {
    const int64_t tiles = (c.n + COLS - 1) / COLS;
    const int64_t block = std::max<int64_t>(TILE_ROWS, BLOCK_BYTES / (4 * c.k) / TILE_ROWS * TILE_ROWS);
    const int64_t chunk = std::max<int64_t>(1, CHUNK_WORK / (c.k * COLS * (4 + c.m)));
    const Linear<COLS, Tile> job{&c, tile, tiles, chunk, block};
    Team::instance()->run(threads, (tiles + chunk - 1) / chunk, c.n * c.k * (4 + c.m), &Linear<COLS, Tile>::task, &job);
}

// --- scalar: the reference order, one lane at a time ------------------------------------------------------------
template <bool BF16>
void scalar_tile(const Call& c, int64_t r0, int rows, int64_t c0, int cols) {
    for (int i = 0; i < rows; ++i) {
        const float* x = c.x + (r0 + i) * c.k;
        for (int j = 0; j < cols; ++j) {
            const int64_t n = c0 + j, base = n * c.k;
            float acc[LANES] = {0.0f};
            for (int64_t k0 = 0; k0 < c.k; k0 += LANES)
                for (int l = 0; l < LANES; ++l) {
                    const int64_t k = k0 + l;
                    const float a = k < c.k ? x[k] : 0.0f, b = k < c.k ? weight_at<BF16>(c.w, base + k) : 0.0f;
                    acc[l] = std::fma(a, b, acc[l]);
                }
            float v = tree(acc);
            if (c.bias) v = v + weight_at<BF16>(c.bias, n);
            store<BF16>(c.out, (r0 + i) * c.n + n, v);
        }
    }
}

#ifdef KV_X86
// --- AVX-512: one register per output ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")

template <bool BF16>
inline __m512 load512(const void* w, int64_t i, __mmask16 mask) {
    if constexpr (BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(w) + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
        return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(w) + i);
    }
}

inline float tree512(__m512 a) {
    __m256 lo = _mm512_castps512_ps256(a);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    __m256 b = _mm256_add_ps(lo, hi);                                          // l + (l+8)
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));  // l + (l+4)
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));                            // l + (l+2)
    __m128 e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));                         // 0 + 1
    return _mm_cvtss_f32(e);
}

template <bool BF16, int R, int C>
void tile512(const Call& c, int64_t r0, int64_t c0) {
    using W = std::conditional_t<BF16, uint16_t, float>;
    const int64_t k = c.k;
    const W* w[C];
    const float* x[R];
    __m512 acc[R][C];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) w[j] = static_cast<const W*>(c.w) + (c0 + j) * k;
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
        x[i] = c.x + (r0 + i) * k;
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
    }
    for (int64_t k0 = 0; k0 < k; k0 += LANES) {
        const __mmask16 mask = k - k0 >= LANES ? __mmask16(0xffff) : __mmask16((1u << (k - k0)) - 1);
        __m512 v[C];
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) v[j] = load512<BF16>(w[j], k0, mask);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            const __m512 a = _mm512_maskz_loadu_ps(mask, x[i] + k0);
#pragma GCC unroll 8
            for (int j = 0; j < C; ++j) acc[i][j] = _mm512_fmadd_ps(a, v[j], acc[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) {
            float s = tree512(acc[i][j]);
            if (c.bias) s = s + weight_at<BF16>(c.bias, c0 + j);
            store<BF16>(c.out, (r0 + i) * c.n + c0 + j, s);
        }
}

template <bool BF16, int R>
void cols512(const Call& c, int64_t r0, int64_t c0, int cols) {
    switch (cols) {
        case 6: return tile512<BF16, R, 6>(c, r0, c0);
        case 5: return tile512<BF16, R, 5>(c, r0, c0);
        case 4: return tile512<BF16, R, 4>(c, r0, c0);
        case 3: return tile512<BF16, R, 3>(c, r0, c0);
        case 2: return tile512<BF16, R, 2>(c, r0, c0);
        default: return tile512<BF16, R, 1>(c, r0, c0);
    }
}

template <bool BF16>
void avx512_tile(const Call& c, int64_t r0, int rows, int64_t c0, int cols) {
    switch (rows) {
        case 4: return cols512<BF16, 4>(c, r0, c0, cols);
        case 3: return cols512<BF16, 3>(c, r0, c0, cols);
        case 2: return cols512<BF16, 2>(c, r0, c0, cols);
        default: return cols512<BF16, 1>(c, r0, c0, cols);
    }
}

template <bool BF16>
void avx512_call(const Call& c, int threads) {
    run<TILE_COLS>(c, threads, avx512_tile<BF16>);
}

#pragma GCC pop_options

// --- AVX2: two registers per output (lanes 0-7 and 8-15) --------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")

constexpr int AVX2_COLS = 3;

inline __m256i mask8(int64_t left) {  // lanes below `left` (0..8) set
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(std::max<int64_t>(left, 0), 8))), lanes);
}

template <bool BF16>
inline __m256 load256(const void* w, int64_t i, int64_t left) {  // 8 values from i, zeros past `left`
    if (left >= 8) {
        if constexpr (BF16) {
            __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else {
            return _mm256_loadu_ps(static_cast<const float*>(w) + i);
        }
    }
    alignas(32) float part[8] = {0.0f};
    for (int64_t l = 0; l < left; ++l) part[l] = weight_at<BF16>(w, i + l);
    return _mm256_load_ps(part);
}

inline __m256 loadx(const float* x, int64_t left) {
    return left >= 8 ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, mask8(left));
}

inline float tree256(__m256 lo, __m256 hi) {
    __m256 b = _mm256_add_ps(lo, hi);                                          // l + (l+8)
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));  // l + (l+4)
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));                            // l + (l+2)
    __m128 e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));                         // 0 + 1
    return _mm_cvtss_f32(e);
}

template <bool BF16, int R, int C>
void tile256(const Call& c, int64_t r0, int64_t c0) {
    using W = std::conditional_t<BF16, uint16_t, float>;
    const int64_t k = c.k;
    const W* w[C];
    const float* x[R];
    __m256 lo[R][C], hi[R][C];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) w[j] = static_cast<const W*>(c.w) + (c0 + j) * k;
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
        x[i] = c.x + (r0 + i) * k;
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    }
    for (int64_t k0 = 0; k0 < k; k0 += LANES) {
        const int64_t left = k - k0;
        __m256 v[C];
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) v[j] = load256<BF16>(w[j], k0, left);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            const __m256 a = loadx(x[i] + k0, left);
#pragma GCC unroll 8
            for (int j = 0; j < C; ++j) lo[i][j] = _mm256_fmadd_ps(a, v[j], lo[i][j]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) v[j] = load256<BF16>(w[j], k0 + 8, left - 8);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            const __m256 a = left > 8 ? loadx(x[i] + k0 + 8, left - 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
            for (int j = 0; j < C; ++j) hi[i][j] = _mm256_fmadd_ps(a, v[j], hi[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) {
            float s = tree256(lo[i][j], hi[i][j]);
            if (c.bias) s = s + weight_at<BF16>(c.bias, c0 + j);
            store<BF16>(c.out, (r0 + i) * c.n + c0 + j, s);
        }
}

template <bool BF16, int R>
void cols256(const Call& c, int64_t r0, int64_t c0, int cols) {
    switch (cols) {
        case 3: return tile256<BF16, R, 3>(c, r0, c0);
        case 2: return tile256<BF16, R, 2>(c, r0, c0);
        default: return tile256<BF16, R, 1>(c, r0, c0);
    }
}

template <bool BF16>
void avx2_tile(const Call& c, int64_t r0, int rows, int64_t c0, int cols) {
    for (int i = 0; i < rows; i += 2) {  // tiles of 2 rows x 3 columns: 12 accumulators in 16 registers
        if (rows - i >= 2) cols256<BF16, 2>(c, r0 + i, c0, cols);
        else cols256<BF16, 1>(c, r0 + i, c0, cols);
    }
}

template <bool BF16>
void avx2_call(const Call& c, int threads) {
    run<AVX2_COLS>(c, threads, avx2_tile<BF16>);
}

#pragma GCC pop_options

bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"); }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
bool has_avx512() { return false; }
bool has_avx2() { return false; }
#endif

template <bool BF16>
void scalar_call(const Call& c, int threads) {
    run<TILE_COLS>(c, threads, scalar_tile<BF16>);
}

namespace scalar_attention {
#include "dots_attention.inc"
}

#ifdef KV_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2_attention {
#include "dots_attention.inc"
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace avx512_attention {
#include "dots_attention.inc"
}
#pragma GCC pop_options
#endif

}  // namespace

extern "C" {

// Helpers hold off (1) or take tasks again (0): the tests' stand-in for a helper whose core is busy.
void kv_team_hold(int on) { Team::held.store(on != 0); }

// The paths this CPU runs: bit 1 scalar, bit 2 AVX2, bit 3 AVX-512.
int kv_dots_paths() {
    return (1 << SCALAR) | (has_avx2() ? 1 << AVX2 : 0) | (has_avx512() ? 1 << AVX512 : 0);
}

// The path `kv_dots` takes for `path` (AUTO: the widest this CPU runs), or -1 where it cannot run here.
int kv_dots_path(int path) {
    const int paths = kv_dots_paths();
    if (path == AUTO) return (paths >> AVX512) & 1 ? AVX512 : (paths >> AVX2) & 1 ? AVX2 : SCALAR;
    return path >= SCALAR && path <= AVX512 && ((paths >> path) & 1) ? path : -1;
}

// out (m, n) = x (m, k, float32) @ w (n, k)^T + bias, w, bias and out float32 (bf16 = 0) or bf16 (bf16 = 1).
// Returns the path taken, or -1 (a path this CPU does not run; nothing written).
int kv_dots(const float* x, int64_t m, int64_t k, const void* w, const void* bias, int64_t n, void* out, int bf16,
            int threads, int path) {
    const int taken = kv_dots_path(path);
    if (taken < 0) return -1;
    if (m == 0 || n == 0) return taken;
    const Call c{x, w, bias, out, m, k, n};
#ifdef KV_X86
    if (taken == AVX512) bf16 ? avx512_call<true>(c, threads) : avx512_call<false>(c, threads);
    else if (taken == AVX2) bf16 ? avx2_call<true>(c, threads) : avx2_call<false>(c, threads);
    else
#endif
        bf16 ? scalar_call<true>(c, threads) : scalar_call<false>(c, threads);
    return taken;
}

// `count` lanes' causal attention at one layer (one lane: a call of its own), each (query, head) computed whole by
// one thread in the fixed order of dots_attention.inc, so a lane's bits do not depend on the others.  Lane l's row of
// `table` (count x 9 int64): its queries' address (strides q_sh, q_sq), its keys' and values' addresses, its key
// count t, the position its keys end at, then the keys' strides (head, token) and the values'; it writes (nq, heads,
// d) float32 at out + l * nq * heads * d.  The same heads, kv_heads, nq, d, window, scaling and softcap for every
// lane; `scratch` holds max_t scores a thread.  Returns the path taken, or -1.
int kv_attention_lanes(int64_t count, const int64_t* table, float* out, float* scratch, int64_t max_t, int64_t heads,
                       int64_t kv_heads, int64_t nq, int64_t d, int64_t q_sh, int64_t q_sq, int64_t window,
                       float scaling, float softcap, int bf16, int threads, int path) {
    const int taken = kv_dots_path(path);
    if (taken < 0 || d > MAX_HEAD_DIM || kv_heads < 1 || heads % kv_heads || count < 0) return -1;
    std::vector<Attn> lanes;
    lanes.reserve(count);
    int64_t work = 0;
    for (int64_t l = 0; l < count; ++l) {
        const int64_t* r = table + l * 9;
        const int64_t t = r[3], end = r[4];
        if (nq > t || t > max_t || end < t) return -1;
        lanes.push_back(Attn{reinterpret_cast<const void*>(r[0]), reinterpret_cast<const void*>(r[1]),
                             reinterpret_cast<const void*>(r[2]), out + l * nq * heads * d, heads, kv_heads, nq, t, d,
                             q_sh, q_sq, r[5], r[6], r[7], r[8], end, window, scaling, softcap, bf16});
        work += nq * heads * t * d * ATTENTION_UNITS;
    }
    if (count == 0) return taken;
    const Lanes all{lanes.data(), count, nq * heads, max_t, scratch};
#ifdef KV_X86
    if (taken == AVX512) avx512_attention::lanes_call(all, work, threads);
    else if (taken == AVX2) avx2_attention::lanes_call(all, work, threads);
    else
#endif
        scalar_attention::lanes_call(all, work, threads);
    return taken;
}

}  // extern "C"
