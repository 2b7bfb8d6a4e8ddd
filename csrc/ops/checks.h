// Argument checks and status reporting shared by the CPU and CUDA glue.
//
// Every public entry point checks its arguments here first, so messages are uniform: they name the argument,
// what was expected, and what was given.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <sstream>
#include <string>

#include "../kernels/common/status.h"

namespace specdec::glue {

inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// `name` has dtype `dtype`.
inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

// `name` is a float tensor of one of the supported float dtypes (float32, float16, bfloat16).
inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", d);
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim, const char* layout) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions ", layout, ", got shape ",
              shape_str(t));
}

// `t` has exactly the given sizes; `layout` names the dimensions for the message, e.g. "[B, N]".
inline void check_shape(const char* op, const char* name, const at::Tensor& t, std::initializer_list<int64_t> sizes,
                        const char* layout) {
  TORCH_CHECK(t.sizes().equals(sizes), op, ": ", name, " must have shape ", layout, " = ", at::IntArrayRef(sizes),
              ", got ", shape_str(t));
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; all tensors must be on one device");
}

// Large float matrices are read in place: they need unit stride in the last (vocabulary) dimension only.
inline void check_unit_last_stride(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
              " must have unit stride in its last dimension (rows may be strided), got strides ", t.strides());
}

// Raises the first failing row's status (rows in order) as a ValueError naming the argument, row and node.
// `status` is the [B, 3] int64 tensor the kernel wrote (code, node, value per row); on CUDA this reads it back,
// which synchronises with the device, so callers skip it when validate=false.
void raise_on_bad_status(const char* op, const at::Tensor& status);

// Status buffer for `rows` rows on `like`'s device, written entirely by the kernel (no initialisation needed).
inline at::Tensor new_status(int64_t rows, const at::Tensor& like) {
  return at::empty({rows, 3}, like.options().dtype(at::kLong));
}

inline RowStatus* status_ptr(const at::Tensor& status) {
  static_assert(sizeof(RowStatus) == 3 * sizeof(int64_t), "RowStatus must be three int64");
  return reinterpret_cast<RowStatus*>(status.data_ptr<int64_t>());
}

}  // namespace specdec::glue
