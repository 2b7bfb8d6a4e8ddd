// Launch-error check shared by the CUDA launchers.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace specdec::cuda {

// Throws (as a C++ exception the glue turns into a Python RuntimeError) when the last launch failed.
inline void check_launch(const char* name) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("specdec_ext CUDA: launching ") + name +
                                                 " failed: " + cudaGetErrorString(e));
}

}  // namespace specdec::cuda
