// The CPU allocator's own ledger: every block a tensor gets, counted for the owner whose work asked for it, and the
// blocks a numpy array or a Python object gets beside it.
//
// Installed in torch's default CPU allocator itself (every CPU tensor's storage then passes through
// `Ledger::allocate`: the ops' blocks, asked of `GetCPUAllocator()`, and the blocks Python's storage
// constructors ask of `GetDefaultCPUAllocator()` by name, as `copy.deepcopy` and unpickling do).  A thread names
// the owner of its work with `kv_enter`; a block allocated while a thread works for owner N is N's until it is
// freed, on whatever thread and whenever that happens.  Owner 0 is no one's work: a torch block allocated outside
// every owner's work (another thread, code outside every region) is counted there, as unattributed, never dropped.
//
// Beside torch's: numpy's array data (a `PyDataMem_Handler` put in place of numpy's default one, so in every
// thread and every Python context: `kv_numpy_install`) and Python's buffers (a hook on Python's memory domain,
// process-wide: a list's array of items), counted per owner as "outside torch"; Python's blocks only for a named
// owner (every thread's would otherwise be unattributed noise).  Per owner: torch's live bytes, the highest they
// went since `kv_reset_peak` and torch's live blocks (the figures compared with a strategy's formula, like for
// like), and the live bytes outside torch beside them.  Process-wide, `kv_from_malloc`: the live bytes of every
// block counted that the C allocator handed out (the cross-check of ledger.py compares them with glibc's count).
// kvdirect_app/measure/ledger.py builds this file with the machine's C++ compiler against torch's (and, where numpy is
// there, Python's and numpy's) headers and loads it.
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

#ifdef KV_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#ifdef KV_NUMPY
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>
#endif

namespace {

struct Owner {
  std::atomic<int64_t> live{0};     // torch's blocks
  std::atomic<int64_t> outside{0};  // numpy's data and Python's objects
  std::atomic<int64_t> peak{0};     // the highest torch's live bytes went
  std::atomic<int64_t> blocks{0};   // torch's blocks
};

constexpr int32_t kOwners = 1 << 20;  // ids are handed out and taken back by ledger.py; 0 is unattributed
Owner owners[kOwners];                // zero pages until an owner is used
thread_local int32_t current = 0;
// Live bytes of the blocks counted here that came from the C allocator (torch's and numpy's, Python's buffers above
// pymalloc's threshold), every owner's.
std::atomic<int64_t> from_malloc{0};

struct Block {
  int64_t bytes;
  int32_t owner;
};

void grow(Owner& owner, int64_t torch_bytes, int64_t outside_bytes) {
  owner.outside += outside_bytes;
  if (!torch_bytes) return;
  int64_t now = (owner.live += torch_bytes);
  int64_t high = owner.peak.load();
  while (now > high && !owner.peak.compare_exchange_weak(high, now)) {
  }
}

std::mutex table_mutex;
std::unordered_map<void*, Block> table;  // torch's blocks, of every owner (0: unattributed)
c10::Allocator* base = nullptr;          // torch's default allocator, as it was (a copy of it: see kv_install)
c10::DeleterFnPtr base_delete = nullptr;
alignas(alignof(std::max_align_t)) unsigned char base_copy[sizeof(void*)];

void release(void* ptr) {
  Block block{0, -1};
  {
    std::lock_guard<std::mutex> guard(table_mutex);
    auto it = table.find(ptr);
    if (it != table.end()) {
      block = it->second;
      table.erase(it);
    }
  }
  if (block.owner >= 0) {
    owners[block.owner].live -= block.bytes;
    owners[block.owner].blocks -= 1;
    from_malloc -= block.bytes;
  }
  base_delete(ptr);
}

struct Ledger final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr data = base->allocate(n);
    void* ptr = data.get();
    data.release_context();  // torch's block, freed by `release` through torch's own deleter
    int32_t who = current;
    if (n) {
      {
        std::lock_guard<std::mutex> guard(table_mutex);
        table[ptr] = Block{static_cast<int64_t>(n), who};
      }
      owners[who].blocks += 1;
      from_malloc += static_cast<int64_t>(n);
      grow(owners[who], static_cast<int64_t>(n), 0);
    }
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

Ledger ledger;

// --- outside torch -------------------------------------------------------------------------------------------------
// Blocks outside torch of an owner: (address -> bytes, owner).  Python's object and memory domains are called with
// the GIL held, so their table needs no lock of its own; numpy may allocate without the GIL, so its table has one.
struct Outside {
  std::unordered_map<void*, Block> table;
  std::mutex* lock;      // null: the GIL serialises every call
  int64_t small;         // blocks of at most this many bytes come from elsewhere than the C allocator (pymalloc)

  void forget(Block block) {
    if (block.owner < 0) return;
    owners[block.owner].outside -= block.bytes;
    if (block.bytes > small) from_malloc -= block.bytes;
  }

  void add(void* ptr, size_t n, int32_t who) {
    if (!ptr) return;
    if (lock) {
      std::lock_guard<std::mutex> guard(*lock);
      table[ptr] = Block{static_cast<int64_t>(n), who};
    } else {
      table[ptr] = Block{static_cast<int64_t>(n), who};
    }
    if (static_cast<int64_t>(n) > small) from_malloc += static_cast<int64_t>(n);
    grow(owners[who], 0, static_cast<int64_t>(n));
  }

  // The block's (bytes, owner) if it was counted, removed from the table (and from its owner's count when `drop`);
  // owner -1 if not.
  Block take(void* ptr, bool drop) {
    Block block{0, -1};
    if (!ptr) return block;
    if (lock) {
      std::lock_guard<std::mutex> guard(*lock);
      block = find(ptr);
    } else {
      block = find(ptr);
    }
    if (drop) forget(block);
    return block;
  }

  void put_back(void* ptr, Block block) {
    if (block.owner < 0) return;
    if (lock) {
      std::lock_guard<std::mutex> guard(*lock);
      table[ptr] = block;
    } else {
      table[ptr] = block;
    }
  }

 private:
  Block find(void* ptr) {
    if (table.empty()) return Block{0, -1};
    auto it = table.find(ptr);
    if (it == table.end()) return Block{0, -1};
    Block block = it->second;
    table.erase(it);
    return block;
  }
};

#ifdef KV_PYTHON
Outside py_blocks{{}, nullptr, 512};  // pymalloc's SMALL_REQUEST_THRESHOLD
PyMemAllocatorEx py_base;  // Python's memory domain's allocator as it was: the hooks call it
PyMemAllocatorEx py_hook;
bool py_installed = false;

void* py_malloc(void* ctx, size_t n) {
  auto* a = static_cast<PyMemAllocatorEx*>(ctx);
  void* p = a->malloc(a->ctx, n);
  if (current > 0) py_blocks.add(p, n, current);
  return p;
}

void* py_calloc(void* ctx, size_t count, size_t size) {
  auto* a = static_cast<PyMemAllocatorEx*>(ctx);
  void* p = a->calloc(a->ctx, count, size);
  if (current > 0) py_blocks.add(p, count * size, current);
  return p;
}

void* py_realloc(void* ctx, void* ptr, size_t n) {
  auto* a = static_cast<PyMemAllocatorEx*>(ctx);
  Block was = py_blocks.take(ptr, false);
  void* p = a->realloc(a->ctx, ptr, n);
  if (!p) {  // the old block stands, still counted
    py_blocks.put_back(ptr, was);
    return p;
  }
  py_blocks.forget(was);
  int32_t who = was.owner >= 0 ? was.owner : current;  // a block moved stays its owner's
  if (who > 0) py_blocks.add(p, n, who);
  return p;
}

void py_free(void* ctx, void* ptr) {
  auto* a = static_cast<PyMemAllocatorEx*>(ctx);
  py_blocks.take(ptr, true);
  a->free(a->ctx, ptr);
}
#endif

#ifdef KV_NUMPY
std::mutex np_mutex;
Outside np_blocks{{}, &np_mutex, -1};

void* np_malloc(void*, size_t n) {
  void* p = std::malloc(n ? n : 1);
  np_blocks.add(p, n, current);
  return p;
}

void* np_calloc(void*, size_t count, size_t size) {
  void* p = std::calloc(count ? count : 1, size ? size : 1);
  np_blocks.add(p, count * size, current);
  return p;
}

void* np_realloc(void*, void* ptr, size_t n) {
  Block was = np_blocks.take(ptr, false);
  void* p = std::realloc(ptr, n ? n : 1);
  if (!p) {
    np_blocks.put_back(ptr, was);
    return p;
  }
  np_blocks.forget(was);
  np_blocks.add(p, n, was.owner >= 0 ? was.owner : current);
  return p;
}

void np_free(void*, void* ptr, size_t) {
  np_blocks.take(ptr, true);
  std::free(ptr);
}

PyDataMem_Handler np_handler = {"kvdirect_ledger", 1, {nullptr, np_malloc, np_calloc, np_realloc, np_free}};
bool np_installed = false;
#endif

}  // namespace

extern "C" {

// 0: installed (or already); 1: torch's CPU allocator is not its default, or hands out blocks the ledger cannot
// follow.
//
// torch's default CPU allocator is one object that holds nothing but its virtual table (it keeps no state: a
// block's size goes to the profiler's reporter, its memory to the C allocator).  So a copy of its pointer to that
// table is a working copy of it (`base`), and the object itself, given the ledger's table, dispatches to the
// ledger: everything that asks torch for a CPU block, by either name, now passes through `Ledger::allocate`.
int kv_install() {
  if (base) return 0;
  c10::Allocator* standard = c10::GetDefaultCPUAllocator();
  if (c10::GetCPUAllocator() != standard) return 1;
  c10::DataPtr probe = standard->allocate(64);
  bool simple = standard->raw_deleter() && probe.get() == probe.get_context() &&
                probe.get_deleter() == standard->raw_deleter();
  probe.clear();
  if (!simple) return 1;
  std::memcpy(base_copy, static_cast<void*>(standard), sizeof(void*));
  base = reinterpret_cast<c10::Allocator*>(base_copy);
  base_delete = base->raw_deleter();
  std::memcpy(static_cast<void*>(standard), static_cast<void*>(&ledger), sizeof(void*));
  return 0;
}

// Python's memory domain through the hooks (call with the GIL held: ctypes.PyDLL).  0: done (or already); -1:
// built without Python's headers.  The memory domain holds Python's buffers: a list's array of items (a list of a
// tensor's values is one), an array's data.  The object domain (the objects themselves) is left alone: Python
// keeps freed objects in free lists and hands them out again without asking the allocator, so whose they are
// cannot be told (a lane would be charged for another's floats and tuples).  The raw domain is called without
// the GIL.
int kv_python_install() {
#ifdef KV_PYTHON
  if (py_installed) return 0;
  PyMem_GetAllocator(PYMEM_DOMAIN_MEM, &py_base);
  py_hook = {&py_base, py_malloc, py_calloc, py_realloc, py_free};
  PyMem_SetAllocator(PYMEM_DOMAIN_MEM, &py_hook);
  py_installed = true;
  return 0;
#else
  return -1;
#endif
}

// numpy's data allocations through the ledger, in every thread and every Python context (with the GIL held).
// numpy keeps its handler in a context variable whose default is one capsule, `PyDataMem_DefaultHandler`: the
// capsule's pointer is set to the ledger's handler, so every context that set none of its own (a new thread, a fresh
// `contextvars.Context`) allocates through it.  Both handlers are the C allocator's: an array allocated before is
// freed through the ledger's by `free`, as numpy's would.  0: in place (or already); -1: built without numpy; -2:
// numpy's C API could not be had.
int kv_numpy_install() {
#ifdef KV_NUMPY
  if (np_installed) return 0;
  if (PyArray_ImportNumPyAPI() < 0 || !PyDataMem_DefaultHandler ||
      PyCapsule_SetPointer(PyDataMem_DefaultHandler, &np_handler) < 0) {
    PyErr_Clear();
    return -2;
  }
  np_installed = true;
  return 0;
#else
  return -1;
#endif
}

int32_t kv_owners() { return kOwners; }
int32_t kv_current() { return current; }
int64_t kv_from_malloc() { return from_malloc.load(); }
int32_t kv_enter(int32_t owner) {
  int32_t before = current;
  current = owner;
  return before;
}
int64_t kv_live(int32_t owner) { return owners[owner].live.load(); }
int64_t kv_outside(int32_t owner) { return owners[owner].outside.load(); }
int64_t kv_peak(int32_t owner) { return owners[owner].peak.load(); }
int64_t kv_blocks(int32_t owner) { return owners[owner].blocks.load(); }
void kv_reset_peak(int32_t owner) { owners[owner].peak.store(owners[owner].live.load()); }
}
