// The one op registry: every schema of specdec_ext lives here, and nowhere else.
//
// Implementations attach by dispatch key in ops_cpu.cpp and (in a CUDA build) ops_cuda.cu, so a CPU-only build
// still has every schema. Fakes (meta implementations for torch.compile) are registered in Python:
// specdec_ext/ops/fakes.py. Argument names are public API: they appear in error messages and keyword calls.
//
// The same schemas form a second library, specdec_ext_checks, whose only kernels are Meta ones (ops_meta.cpp): the
// glue's argument checks with no kernel behind them. The fakes call it for tensors with concrete shapes, so that a
// call on meta tensors (which the dispatcher sends to the fake, also when meta is mixed with other devices) is
// refused by the very checks that refuse it on CPU and CUDA.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "../kernels/cpu/kernels.h"

namespace {

void define_ops(torch::Library& m) {
  // Tree topology from parents[B, N].
  m.def(
      "build_tree(Tensor parents, Tensor prefix_lens, bool validate=True) -> (Tensor depth, Tensor position_ids, "
      "Tensor first_child, Tensor next_sibling, Tensor retrieve_paths, Tensor num_leaves)");
  m.def("tree_ancestor_mask(Tensor parents, bool packed=False, bool validate=True) -> Tensor");

  // Dynamic-tree bookkeeping (EAGLE-2 growth): the next frontier from expand_tree_step's selection, and the final
  // tree from all candidates.
  m.def(
      "advance_tree_frontier(Tensor cand_tokens, Tensor cand_scores, Tensor selected, Tensor ancestors, "
      "int self_column, Tensor column, bool validate=True) -> (Tensor tokens, Tensor scores, Tensor parents, "
      "Tensor ancestors_out, Tensor mask)");
  m.def(
      "select_tree_nodes(Tensor tokens, Tensor scores, Tensor parents, Tensor roots, int num_nodes, "
      "bool validate=True) -> (Tensor tree_tokens, Tensor tree_parents)");

  // Verification of a draft tree (a chain is a width-1 tree) against target logits[B, N, V].
  m.def(
      "verify_tree_greedy(Tensor logits, Tensor tokens, Tensor parents, bool validate=True) -> (Tensor accepted, "
      "Tensor accept_len, Tensor next_token)");
  m.def(
      "verify_tree_sampling(Tensor logits, Tensor tokens, Tensor parents, Tensor? draft_probs, Tensor uniforms, "
      "Tensor temperature, Tensor top_k, Tensor top_p, bool validate=True) -> (Tensor accepted, Tensor accept_len, "
      "Tensor next_token)");
  m.def(
      "verify_tree_typical(Tensor logits, Tensor tokens, Tensor parents, Tensor uniforms, Tensor temperature, "
      "float posterior_threshold, float posterior_alpha, bool validate=True) -> (Tensor accepted, "
      "Tensor accept_len, Tensor next_token)");

  // Fused draft sampling.
  m.def(
      "sample_tokens(Tensor logits, Tensor uniforms, Tensor temperature, Tensor top_k, Tensor top_p, "
      "bool validate=True) -> (Tensor tokens, Tensor probs)");
  m.def(
      "expand_tree_step(Tensor logits, Tensor parent_scores, int top_k, int num_select, bool validate=True) -> "
      "(Tensor cand_tokens, Tensor cand_scores, Tensor selected)");

  // Attention of the tree nodes over the KV cache, and KV-cache compaction after acceptance (in place).
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor prefix_lens, Tensor tree_mask, float scale, "
      "bool validate=True) -> Tensor");
  m.def(
      "compact_kv(Tensor(a!)[] caches, Tensor src_positions, Tensor dst_start, Tensor lengths, int seq_dim, "
      "bool validate=True) -> ()");

  // Linear layers over a weight packed once (the few-row products of decoding and verification): y = x @ W^T + b.
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
  // The same with int8 weights (per-output-channel scales) and input rows quantised per call: drafters' products.
  m.def("pack_linear_weight_int8(Tensor weight) -> (Tensor packed, Tensor scales)");
  m.def("packed_linear_int8(Tensor x, Tensor packed_weight, Tensor scales, Tensor? bias) -> Tensor");
  // And with int4 weights (a float scale per output channel, a 6-bit multiplier per group of 32 inputs).
  m.def("pack_linear_weight_int4(Tensor weight) -> (Tensor packed, Tensor group_scales, Tensor scales)");
  m.def("packed_linear_int4(Tensor x, Tensor packed_weight, Tensor group_scales, Tensor scales, Tensor? bias) -> "
        "Tensor");

  // A drafter's decoder layer (EAGLE, a draft LM) over a few new positions per row, weights packed (each float, or
  // int8 / int4 with its scales), its K/V written into its cache at explicit slots (in place).
  m.def(
      "draft_decoder_layer(Tensor x, Tensor? input_norm_weight, int input_norm_segments, Tensor residual, "
      "Tensor qkv_weight, Tensor? qkv_bias, Tensor o_weight, Tensor norm_weight, Tensor gate_up_weight, "
      "Tensor down_weight, Tensor position_ids, Tensor inv_freq, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor write_slots, Tensor mask, int num_heads, int intermediate_size, float eps, "
      "Tensor? qkv_scales=None, Tensor? o_scales=None, Tensor? gate_up_scales=None, Tensor? down_scales=None, "
      "Tensor? qkv_group_scales=None, Tensor? o_group_scales=None, Tensor? gate_up_group_scales=None, "
      "Tensor? down_group_scales=None, bool validate=True) -> Tensor");

  // Recurrent layers of hybrid targets over a draft tree (csrc/kernels/common/recurrent_params.h), and the commits
  // that advance their saved states along the accepted path (in place; several layers at once as more heads).
  m.def(
      "tree_linear_attention(Tensor q, Tensor k, Tensor v, Tensor state, Tensor log_decay, Tensor parents, "
      "bool validate=True) -> Tensor");
  m.def(
      "commit_linear_state(Tensor(a!) state, Tensor k, Tensor v, Tensor log_decay, Tensor path, Tensor lengths, "
      "bool validate=True) -> ()");
  m.def(
      "tree_causal_conv1d(Tensor x, Tensor conv_state, Tensor weight, Tensor? bias, Tensor parents, "
      "str? activation=None, bool validate=True) -> Tensor");
  m.def("commit_conv_state(Tensor(a!) conv_state, Tensor x, Tensor path, Tensor lengths, bool validate=True) -> ()");
  m.def(
      "tree_gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, Tensor parents, "
      "bool validate=True) -> Tensor");
  m.def(
      "commit_gated_delta_state(Tensor(a!) state, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor path, "
      "Tensor lengths, bool validate=True) -> ()");
  m.def(
      "tree_selective_state(Tensor x, Tensor dt, Tensor A, Tensor Bm, Tensor Cm, Tensor D, Tensor state, "
      "Tensor parents, bool validate=True) -> Tensor");
  m.def(
      "commit_selective_state(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor Bm, Tensor path, "
      "Tensor lengths, bool validate=True) -> ()");
}

}  // namespace

TORCH_LIBRARY(specdec_ext, m) { define_ops(m); }
TORCH_LIBRARY(specdec_ext_checks, m) { define_ops(m); }

// A plain Python module so that `import specdec_ext._C` loads the library (and runs the registrations above).
namespace {

PyObject* built_with_cuda(PyObject*, PyObject*) {
#ifdef SPECDEC_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

// packed_linear_path("float32" | "bfloat16" | "float16"): the CPU code path of packed_linear on this machine.
PyObject* packed_linear_path(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  const std::string dtype(name);
  const char* path = nullptr;
  if (dtype == "float32") path = specdec::cpu::PackedLinearPath<float>();
  if (dtype == "bfloat16") path = specdec::cpu::PackedLinearPath<specdec::bf16>();
  if (dtype == "float16") path = specdec::cpu::PackedLinearPath<specdec::f16>();
  if (path == nullptr) {
    PyErr_Format(PyExc_ValueError, "packed_linear_path: dtype must be 'float32', 'bfloat16' or 'float16', got %R",
                 arg);
    return nullptr;
  }
  return PyUnicode_FromString(path);
}

// packed_linear_int8_path(): the CPU code path of packed_linear_int8 on this machine.
PyObject* packed_linear_int8_path(PyObject*, PyObject*) {
  return PyUnicode_FromString(specdec::cpu::PackedLinearInt8Path());
}

// packed_linear_int4_path(): the CPU code path of packed_linear_int4 on this machine.
PyObject* packed_linear_int4_path(PyObject*, PyObject*) {
  return PyUnicode_FromString(specdec::cpu::PackedLinearInt4Path());
}

PyMethodDef module_methods[] = {
    {"built_with_cuda", built_with_cuda, METH_NOARGS, "True when this build contains the CUDA kernels."},
    {"packed_linear_path", packed_linear_path, METH_O,
     "The CPU code path of packed_linear for a dtype name: 'avx512', 'avx512_bf16', 'avx2' or 'generic'."},
    {"packed_linear_int8_path", packed_linear_int8_path, METH_NOARGS,
     "The CPU code path of packed_linear_int8: 'avx512_vnni', 'avx2' or 'generic'."},
    {"packed_linear_int4_path", packed_linear_int4_path, METH_NOARGS,
     "The CPU code path of packed_linear_int4: 'avx512_vnni', 'avx2' or 'generic'."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "specdec_ext kernels (ops live in torch.ops.specdec_ext)",
                          -1, module_methods};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
