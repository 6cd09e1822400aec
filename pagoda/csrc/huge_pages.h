// Packed weights in 2 MiB pages.
//
// At a few activation rows the tile GEMMs stream each weight from memory once a step, and in 4 KiB
// pages every 4 KiB of it is a TLB miss and a page walk beside the load. Linux backs anonymous
// memory with 2 MiB pages (transparent huge pages) where the mapping asks for them, which its
// common default ("madvise") requires; the same tiles then stream 1.16x as fast at one row on the
// AVX-512 EPYC (benchmarks/README.md, "Packed weights in 2 MiB pages").
#pragma once

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <cstdint>

namespace pagoda {

constexpr int64_t HUGE_PAGE = 2 << 20;

// A zero-filled uint8 tensor of `bytes`: from one huge page on, anonymous memory aligned to 2 MiB
// and advised MADV_HUGEPAGE; below that, or where the mapping fails, torch's own allocation.
inline at::Tensor huge_page_zeros(int64_t bytes) {
#if defined(MADV_HUGEPAGE)
  if (bytes >= HUGE_PAGE) {
    const size_t length = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    void* raw = mmap(nullptr, length + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {  // 2 MiB more than needed, the unaligned head and the tail given back
      auto* base = static_cast<uint8_t*>(raw);
      const size_t head = (HUGE_PAGE - reinterpret_cast<uintptr_t>(base) % HUGE_PAGE) % HUGE_PAGE;
      if (head > 0) munmap(base, head);
      munmap(base + head + length, HUGE_PAGE - head);
      madvise(base + head, length, MADV_HUGEPAGE);  // advice: where refused, 4 KiB pages still work
      return at::from_blob(base + head, {bytes}, [length](void* p) { munmap(p, length); },
                           at::TensorOptions().dtype(at::kByte));
    }
  }
#endif
  return at::zeros({bytes}, at::kByte);
}

}  // namespace pagoda
