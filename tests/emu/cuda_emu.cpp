// dflash.cpp — the fiber scheduler, barriers and cp.async queues of the CUDA emulator
// (tests/emu/cuda_emu.hpp). Invariant: exactly one fiber runs at a time; a fiber gives the CPU
// back only inside a barrier (block or warp) or when it exits, and the scheduler resumes fibers
// in a fixed order, so every run of a launch interleaves the same way.
#include "cuda_emu.hpp"

#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <vector>

namespace emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;

struct CopyOp {
  void* dst;
  unsigned char bytes[16];
};

struct Fiber {
  ucontext_t ctx{};
  std::unique_ptr<char[]> stack;
  Dim3 tid;
  bool done = false;
  bool ready = true;                       // runnable (not waiting in a barrier)
  std::deque<std::vector<CopyOp>> groups;  // committed cp.async groups, oldest first
  std::vector<CopyOp> open;                // copies not yet committed
};

// A barrier of `expected` participants: the last to arrive releases the others.
struct Barrier {
  std::vector<int> waiting;
  int expected = 0;
};

struct Cta {
  std::vector<Fiber> fibers;
  ucontext_t sched{};
  int cur = -1;
  int live = 0;
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<std::vector<unsigned char>> slots;  // per warp: 32 lanes × 64 bytes
  const std::function<void()>* body = nullptr;
};

Cta* g_cta = nullptr;
Dim3 g_block, g_grid, g_bdim;
std::vector<char> g_smem_storage;
char* g_smem = nullptr;

[[noreturn]] void die(const char* what) {
  std::fprintf(
      stderr, "cuda_emu: %s (block %u,%u thread %u)\n", what, g_block.x, g_block.y,
      g_cta && g_cta->cur >= 0 ? g_cta->fibers[static_cast<size_t>(g_cta->cur)].tid.x : 0u);
  std::abort();
}

Fiber& self() {
  return g_cta->fibers[static_cast<size_t>(g_cta->cur)];
}

// Blocks the running fiber until its barrier releases it.
void wait_released() {
  Fiber& f = self();
  f.ready = false;
  swapcontext(&f.ctx, &g_cta->sched);
}

void arrive(Barrier& b) {
  if (static_cast<int>(b.waiting.size()) + 1 == b.expected) {
    for (int i : b.waiting) g_cta->fibers[static_cast<size_t>(i)].ready = true;
    b.waiting.clear();
    return;  // the last arrival goes on
  }
  b.waiting.push_back(g_cta->cur);
  wait_released();
}

void apply(std::vector<CopyOp>& group) {
  for (CopyOp& op : group) std::memcpy(op.dst, op.bytes, 16);
  group.clear();
}

void fiber_entry() {
  (*g_cta->body)();
  Fiber& f = self();
  if (!f.open.empty() || !f.groups.empty()) {
    // Copies never waited for still land (as on the GPU, where they complete eventually).
    for (auto& g : f.groups) apply(g);
    apply(f.open);
  }
  f.done = true;
  --g_cta->live;
  // A __syncthreads now waits for one thread fewer.
  Barrier& b = g_cta->block;
  b.expected = g_cta->live;
  if (!b.waiting.empty() && static_cast<int>(b.waiting.size()) == b.expected) {
    for (int i : b.waiting) g_cta->fibers[static_cast<size_t>(i)].ready = true;
    b.waiting.clear();
  }
  // uc_link returns to the scheduler.
}

void run_cta(int threads, const std::function<void()>& body) {
  Cta cta;
  g_cta = &cta;
  cta.body = &body;
  cta.fibers.resize(static_cast<size_t>(threads));
  cta.live = threads;
  cta.block.expected = threads;
  const int n_warps = (threads + 31) / 32;
  cta.warps.resize(static_cast<size_t>(n_warps));
  for (int w = 0; w < n_warps; ++w) cta.warps[static_cast<size_t>(w)].expected = 32;
  cta.slots.assign(static_cast<size_t>(n_warps), std::vector<unsigned char>(32 * 64));
  for (int i = 0; i < threads; ++i) {
    Fiber& f = cta.fibers[static_cast<size_t>(i)];
    f.tid.x = static_cast<unsigned>(i);
    f.stack = std::make_unique<char[]>(kStackBytes);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &cta.sched;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  while (cta.live > 0) {
    bool ran = false;
    for (int i = 0; i < threads; ++i) {
      Fiber& f = cta.fibers[static_cast<size_t>(i)];
      if (f.done || !f.ready) continue;
      cta.cur = i;
      ran = true;
      swapcontext(&cta.sched, &f.ctx);
      cta.cur = -1;
    }
    if (!ran) die("deadlock: every live thread waits in a barrier no thread can complete");
  }
  g_cta = nullptr;
}

}  // namespace

const Dim3& thread_idx() {
  return self().tid;
}
const Dim3& block_idx() {
  return g_block;
}
const Dim3& grid_dim() {
  return g_grid;
}
const Dim3& block_dim() {
  return g_bdim;
}
char* dynamic_smem() {
  return g_smem;
}

void launch(Dim3 grid, Dim3 block, int smem_bytes, const std::function<void()>& kernel) {
  if (block.y != 1 || block.z != 1) die("only 1-D blocks");
  g_grid = grid;
  g_bdim = block;
  g_smem_storage.assign(static_cast<size_t>(smem_bytes) + 128, 0);
  g_smem = g_smem_storage.data() + (128 - reinterpret_cast<uintptr_t>(g_smem_storage.data()) % 128);
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        g_block = Dim3{x, y, z};
        std::memset(g_smem, 0xA5, static_cast<size_t>(smem_bytes));  // stale data looks wrong
        run_cta(static_cast<int>(block.x), kernel);
      }
    }
  }
}

void syncthreads() {
  arrive(g_cta->block);
}

void warp_exchange(const void* mine, int n, void* all) {
  if (n > 64) die("warp_exchange: more than 64 bytes");
  const unsigned t = self().tid.x, w = t / 32, lane = t % 32;
  std::vector<unsigned char>& slots = g_cta->slots[w];
  std::memcpy(slots.data() + lane * 64, mine, static_cast<size_t>(n));
  arrive(g_cta->warps[w]);
  for (int l = 0; l < 32; ++l)
    std::memcpy(static_cast<unsigned char*>(all) + l * n, slots.data() + l * 64,
                static_cast<size_t>(n));
  // Nobody may overwrite the slots before every lane has read them.
  arrive(g_cta->warps[w]);
}

void cp_async16(void* smem, const void* src, bool pred) {
  CopyOp op{smem, {}};
  if (pred) std::memcpy(op.bytes, src, 16);
  self().open.push_back(op);
}

void cp_async_commit() {
  Fiber& f = self();
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}

void cp_async_wait(int pending) {
  Fiber& f = self();
  while (static_cast<int>(f.groups.size()) > pending) {
    apply(f.groups.front());
    f.groups.pop_front();
  }
}

}  // namespace emu
