// Programmatic dependent launch (sm_90 and newer): a kernel launched with the
// programmatic-stream-serialization attribute (quant/cuda/pdl.py) may start while the
// kernel before it on the stream still runs.  Every kernel therefore calls PDL_WAIT()
// before it reads anything an earlier kernel writes, and before it writes anything at all;
// what it does before that may only read memory no kernel of the step writes: the
// weights and constants, the step's inputs (copied in before its first kernel, which
// goes out plain: pdl.fence), and KV entries of positions an earlier step wrote.
// PDL_TRIGGER() lets the next kernel's blocks start (onto free SMs) once every block of
// this one has passed it; a kernel that never calls it triggers as it exits.
// Below sm_90 both are nothing, and a kernel launched without the attribute finds its
// wait already satisfied, so the same code serves every launch.
#pragma once
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;\n" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory")
#else
#define PDL_WAIT() do { } while (0)
#define PDL_TRIGGER() do { } while (0)
#endif
// LLAMBA_PDL_EARLY: trigger at a kernel's first instruction (two kernels ahead may be
// resident, waiting) rather than after its wait (one ahead)
#if defined(LLAMBA_PDL_EARLY) && LLAMBA_PDL_EARLY
#define PDL_ENTER() do { PDL_TRIGGER(); PDL_WAIT(); } while (0)
#define PDL_EARLY_TRIGGER() PDL_TRIGGER()
#define PDL_LATE_TRIGGER() do { } while (0)
#else
#define PDL_ENTER() do { PDL_WAIT(); PDL_TRIGGER(); } while (0)
#define PDL_EARLY_TRIGGER() do { } while (0)
#define PDL_LATE_TRIGGER() PDL_TRIGGER()
#endif
