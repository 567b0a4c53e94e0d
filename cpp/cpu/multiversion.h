// FUSEDATTN_MULTIVERSION before a function compiles it for AVX-512, AVX2 and
// baseline x86-64, and the best one is picked when the library loads (GCC's
// function multi-versioning): the build stays portable while hot loops use the
// widest vectors. Elsewhere it compiles the function once.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FUSEDATTN_MULTIVERSION __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define FUSEDATTN_MULTIVERSION
#endif
