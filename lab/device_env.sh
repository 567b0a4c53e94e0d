# Sourced by the scripts that build fusedattn on a CUDA machine
# (gpu_check.sh, ab_bench.sh): the target and the compiler.
# TORCH_CUDA_ARCH_LIST defaults to 9.0a (Hopper); set it for other GPUs.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export PYTHONUNBUFFERED=1
# Build with the system compiler when there is one. The lent H200 image sets
# CXX=/opt/gcc/bin/g++, a wrapper whose library came out with its own copy of
# parts of libstdc++ (std::ostream among them): the first error message the
# operators formatted crashed the process (seen 2026-11-30). FUSEDATTN_KEEP_CXX=1
# keeps the CC/CXX already set.
if [ -x /usr/bin/g++ ] && [ -z "${FUSEDATTN_KEEP_CXX:-}" ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi
