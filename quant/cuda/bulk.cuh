// Bulk copies (sm_90+): one thread copies a whole slot of shared memory from global
// memory with one instruction and the slot's mbarrier counts the bytes in.  Used by
// the decode megakernel (runtime/backend/cuda_mega.cu) and the stream benchmarks.
#pragma once
// Hopper and later (sm_90, also Blackwell's consumer parts): thread 0 copies a whole slot with
// one instruction (cp.async.bulk, the TMA engine's 1-D copy) and the slot's mbarrier counts
// its bytes in, so no thread spends issue slots or registers on the copy
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bulk_init(unsigned long long* bar, int S) {
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(smem_addr(bar + s)));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
#else
    __trap();
#endif
}
// the slot's mbarrier told to expect nb bytes (and arrived on), once the slot's last reads
// through the generic proxy are ordered before the async proxy's writes
__device__ __forceinline__ void bulk_expect(unsigned long long* bar, unsigned nb) {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n"
                 :: "r"(smem_addr(bar)), "r"(nb) : "memory");
#endif
}
// nb bytes from g to smem, counted in by bar
__device__ __forceinline__ void bulk_load(void* smem, const void* g, unsigned nb, unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_addr(smem)), "l"(g), "r"(nb), "r"(smem_addr(bar)) : "memory");
#endif
}
__device__ __forceinline__ void bulk_copy(void* smem, const void* g, unsigned nb, unsigned long long* bar) {
    bulk_expect(bar, nb);
    bulk_load(smem, g, nb, bar);
}
// nb bytes from g asked of the L2 (no shared memory, no barrier): a later bulk copy of them hits the L2
__device__ __forceinline__ void bulk_prefetch_l2(const void* g, unsigned nb) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(g), "r"(nb) : "memory");
#endif
}
__device__ __forceinline__ void bulk_none(unsigned long long* bar) {      // a slot with nothing to copy
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" :: "r"(smem_addr(bar)) : "memory");
#endif
}
__device__ __forceinline__ void bulk_wait(unsigned long long* bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
    unsigned ok;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    } while (!ok);
#endif
}

