// The CPU allocator's own ledger: every block a tensor gets, counted for the owner whose work asked for it.
//
// Installed in torch's default CPU allocator itself (every CPU tensor's storage then passes through
// `Ledger::allocate`: the ops' blocks, asked of `GetCPUAllocator()`, and the blocks Python's storage
// constructors ask of `GetDefaultCPUAllocator()` by name, as `copy.deepcopy` and unpickling do).  A thread names the owner of its work with `kv_enter`; a block allocated while
// a thread works for owner N is N's until it is freed, on whatever thread and whenever that happens.  Per
// owner: the bytes live now, the highest they went since `kv_reset_peak`, and the blocks live.  Owner 0 is
// nobody (nothing is recorded: the shared pass's activations, the measurement's own work, other threads).
// kvdirect_app/ledger.py builds this file with the machine's C++ compiler against torch's headers and loads it.
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace {

struct Owner {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> blocks{0};
};

constexpr int32_t kOwners = 1 << 20;  // ids are handed out and taken back by ledger.py
Owner owners[kOwners];                // zero pages until an owner is used
thread_local int32_t current = 0;

struct Block {
  int64_t bytes;
  int32_t owner;
};

std::mutex table_mutex;
std::unordered_map<void*, Block> table;  // the blocks of owners other than 0
c10::Allocator* base = nullptr;          // torch's default allocator, as it was (a copy of it: see kv_install)
c10::DeleterFnPtr base_delete = nullptr;
alignas(alignof(std::max_align_t)) unsigned char base_copy[sizeof(void*)];

void release(void* ptr) {
  Block block{0, 0};
  {
    std::lock_guard<std::mutex> guard(table_mutex);
    auto it = table.find(ptr);
    if (it != table.end()) {
      block = it->second;
      table.erase(it);
    }
  }
  if (block.owner) {
    owners[block.owner].live -= block.bytes;
    owners[block.owner].blocks -= 1;
  }
  base_delete(ptr);
}

struct Ledger final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr data = base->allocate(n);
    void* ptr = data.get();
    data.release_context();  // torch's block, freed by `release` through torch's own deleter
    int32_t who = current;
    if (who && n) {
      {
        std::lock_guard<std::mutex> guard(table_mutex);
        table[ptr] = Block{static_cast<int64_t>(n), who};
      }
      Owner& owner = owners[who];
      int64_t now = (owner.live += static_cast<int64_t>(n));
      owner.blocks += 1;
      int64_t high = owner.peak.load();
      while (now > high && !owner.peak.compare_exchange_weak(high, now)) {
      }
    }
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

Ledger ledger;

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

int32_t kv_owners() { return kOwners; }
int32_t kv_enter(int32_t owner) {
  int32_t before = current;
  current = owner;
  return before;
}
int64_t kv_live(int32_t owner) { return owners[owner].live.load(); }
int64_t kv_peak(int32_t owner) { return owners[owner].peak.load(); }
int64_t kv_blocks(int32_t owner) { return owners[owner].blocks.load(); }
void kv_reset_peak(int32_t owner) { owners[owner].peak.store(owners[owner].live.load()); }
}
