// Argument checks and status reporting shared by the CPU and CUDA glue.
//
// Every public entry point checks its arguments here first, so messages are uniform: they name the argument,
// what was expected, and what was given. Every argument error (shape, dtype, device, range, data) is a ValueError
// in Python (docs/ARCHITECTURE.md, "Errors"): checks use SPECDEC_CHECK, never a bare TORCH_CHECK.
//
// Range checks are written so that no intermediate can overflow int64 (`a + b <= c` wraps for a near 2^63 and
// passes): compare against differences of values already known to be in range, or use the helpers below.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <c10/util/safe_numerics.h>

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

#include "../kernels/common/status.h"

// TORCH_CHECK that raises ValueError: every argument error of an op.
#define SPECDEC_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

namespace specdec::glue {

inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// `name` has dtype `dtype`.
inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype) {
  SPECDEC_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

// `name` is a float tensor of one of the supported float dtypes (float32, float16, bfloat16).
inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  const auto d = t.scalar_type();
  SPECDEC_CHECK(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, op, ": ", name,
                " must be float32, float16 or bfloat16, got ", d);
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim, const char* layout) {
  SPECDEC_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions ", layout, ", got shape ",
                shape_str(t));
}

// `t` has exactly the given sizes; `layout` names the dimensions for the message, e.g. "[B, N]".
inline void check_shape(const char* op, const char* name, const at::Tensor& t, std::initializer_list<int64_t> sizes,
                        const char* layout) {
  SPECDEC_CHECK(t.sizes().equals(sizes), op, ": ", name, " must have shape ", layout, " = ", at::IntArrayRef(sizes),
                ", got ", shape_str(t));
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                              const char* ref_name) {
  SPECDEC_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
                ref.device(), "; all tensors must be on one device");
}

// a * b for sizes computed from arguments (workspace and buffer sizes): a ValueError instead of a wrapped product.
inline int64_t checked_mul(const char* op, const char* what, int64_t a, int64_t b) {
  int64_t out = 0;
  SPECDEC_CHECK(a >= 0 && b >= 0 && !c10::mul_overflows(a, b, &out), op, ": ", what, " = ", a, " * ", b,
                " overflows int64");
  return out;
}

inline int64_t checked_add(const char* op, const char* what, int64_t a, int64_t b) {
  int64_t out = 0;
  SPECDEC_CHECK(a >= 0 && b >= 0 && !c10::add_overflows(a, b, &out), op, ": ", what, " = ", a, " + ", b,
                " overflows int64");
  return out;
}

// ceil(a / b) for a >= 0, b >= 1, without the a + b - 1 that wraps near 2^63.
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Where `t`'s elements lie: the bytes [first, last) of an address space (strides are non-negative in torch). A
// real tensor's space is its device's addresses; a meta tensor has no data, only a storage and an offset into it,
// so each meta storage is a space of its own: views of one meta storage overlap exactly where the same views of a
// real one would, and a meta call is refused where the real call is.
struct MemorySpan {
  const void* space;
  uintptr_t first, last;
};

inline MemorySpan memory_span(const at::Tensor& t) {
  const bool meta = t.is_meta();
  const void* space = meta && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  const auto first = meta ? static_cast<uintptr_t>(t.storage_offset()) * t.element_size()
                          : reinterpret_cast<uintptr_t>(t.const_data_ptr());
  if (t.numel() == 0 || (meta && space == nullptr)) return {space, first, first};
  uint64_t span = 1;  // elements from the first to the last one, inclusive
  for (int64_t d = 0; d < t.dim(); ++d) span += static_cast<uint64_t>(t.size(d) - 1) * t.stride(d);
  return {space, first, first + span * t.element_size()};
}

inline bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.device() != b.device()) return false;
  const auto sa = memory_span(a), sb = memory_span(b);
  return sa.space == sb.space && sa.first < sb.last && sb.first < sa.last;
}

// `written` (an output the op writes in place) shares no memory with `other`: an aliased argument would be read
// after being partly overwritten (or written twice), so the result would depend on the kernel's order.
inline void check_no_overlap(const char* op, const char* written, const at::Tensor& w, const char* other_name,
                             const at::Tensor& other) {
  SPECDEC_CHECK(!overlaps(w, other), op, ": ", written, " and ", other_name,
                " share memory (the same tensor, or overlapping views of one storage); ", written,
                " is written in place, so it must not alias another argument");
}

// Large float matrices are read in place: they need unit stride in the last (vocabulary) dimension only.
inline void check_unit_last_stride(const char* op, const char* name, const at::Tensor& t) {
  SPECDEC_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
                " must have unit stride in its last dimension (rows may be strided), got strides ", t.strides());
}

// Raises the first failing row's status (rows in order) as a ValueError naming the argument, row and node.
// `status` is the [B, 3] int64 tensor the kernel wrote (code, node, value per row); on CUDA this reads it back,
// which synchronises with the device, so callers skip it when validate=false.
void raise_on_bad_status(const char* op, const at::Tensor& status);

// A tensor's data; nullptr for a meta tensor, which has none (torch refuses to point at it). Only the meta
// backend (ops_meta.cpp), which runs no kernel, ever gets these nullptrs.
template <typename T>
const T* const_data(const at::Tensor& t) {
  return t.is_meta() ? nullptr : t.const_data_ptr<T>();
}
template <typename T>
T* mutable_data(const at::Tensor& t) {
  return t.is_meta() ? nullptr : t.data_ptr<T>();
}
inline const void* const_data(const at::Tensor& t) { return t.is_meta() ? nullptr : t.const_data_ptr(); }
inline void* mutable_data(const at::Tensor& t) { return t.is_meta() ? nullptr : t.data_ptr(); }

// Status buffer for `rows` rows on `like`'s device, written entirely by the kernel (no initialisation needed).
inline at::Tensor new_status(int64_t rows, const at::Tensor& like) {
  return at::empty({rows, 3}, like.options().dtype(at::kLong));
}

inline RowStatus* status_ptr(const at::Tensor& status) {
  static_assert(sizeof(RowStatus) == 3 * sizeof(int64_t), "RowStatus must be three int64");
  return reinterpret_cast<RowStatus*>(mutable_data<int64_t>(status));
}

}  // namespace specdec::glue
