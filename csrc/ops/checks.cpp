#include "checks.h"

namespace specdec::glue {

namespace {

// Same wording as specdec_ext/ops/reference.py:status_message (tests compare them).
std::string status_message(const char* op, int64_t b, const RowStatus& s) {
  std::ostringstream m;
  m << op << ": ";
  const std::string where = s.node >= 0 ? "logits[" + std::to_string(b) + ", " + std::to_string(s.node)
                                        : "logits[" + std::to_string(b);
  switch (s.code) {
    case kRootNotMinusOne:
      m << "parents[" << b << ", 0] must be -1 (node 0 is the root), got " << s.value;
      break;
    case kParentNotEarlier:
      m << "parents[" << b << ", " << s.node << "] = " << s.value << " is not an earlier node: expected 0 <= parent < "
        << s.node << " (nodes are topologically ordered and only node 0 is a root)";
      break;
    case kTokenOutOfRange:
      m << "tokens[" << b << ", " << s.node << "] = " << s.value << " is out of range for the vocabulary";
      break;
    case kNonFiniteLogits:
      m << where << ", " << s.value << "] is NaN or +inf";
      break;
    case kNoValidToken:
      m << where << "] is -inf everywhere: no token can be chosen";
      break;
    case kBadTemperature:
      m << "temperature[" << b << "] must be finite and >= 0 (0 = greedy)";
      break;
    case kBadTopP:
      m << "top_p[" << b << "] must be in (0, 1]";
      break;
    case kBadDraftProb:
      m << "draft_probs[" << b << ", " << s.node << ", " << s.value << "] is negative or NaN";
      break;
    case kBadPrefixLen:
      m << "prefix_lens[" << b << "] = " << s.value
        << " is out of range: need 0 <= prefix_lens[b] <= S - N (the tree nodes' keys and values sit at "
           "prefix_lens[b] + j)";
      break;
    case kBadLength:
      m << "lengths[" << b << "] = " << s.value << " is out of range: need 0 <= lengths[b] <= L";
      break;
    case kBadDstStart:
      m << "dst_start[" << b << "] = " << s.value << " is out of range: need 0 <= dst_start[b] <= S - lengths[b]";
      break;
    case kBadSrcPosition:
      m << "src_positions[" << b << ", " << s.node << "] = " << s.value << " is out of range [0, S)";
      break;
    case kBadSelected:
      m << "selected[" << b << ", " << s.node << "] = " << s.value << " is out of range [0, F * top_k)";
      break;
    case kBadColumn:
      m << "column[" << b << ", " << s.node << "] = " << s.value << " is out of range [0, C) (C: the ancestor "
        << "table's columns)";
      break;
    case kBadCandidateParent:
      m << "parents[" << b << ", " << s.node << "] = " << s.value << ": candidate " << s.node
        << " is kept but its parent is not a kept earlier candidate";
      break;
    case kBadWriteSlot:
      m << "write_slots[" << b << ", " << s.node << "] = " << s.value
        << " is out of range [0, S) (S: the cache's positions)";
      break;
    case kBadTopK:
      m << "top_k[" << b << "] = " << s.value << " must be >= 0 (0 = no top-k)";
      break;
    case kBadUniform:
      m << (s.node >= 0 ? "uniforms[" + std::to_string(b) + ", " + std::to_string(s.node) + "]"
                        : "uniforms[" + std::to_string(b) + "]")
        << " must be in [0, 1) (a torch.rand draw)";
      break;
    case kBadTreePrefixLen:
      m << "prefix_lens[" << b << "] = " << s.value
        << " is out of range: need 0 <= prefix_lens[b] <= 2^63 - N (position ids prefix_lens[b] + depth must fit "
           "int64)";
      break;
    case kBadLogDecay:
      m << "log_decay[" << s.node << "] must be finite and <= 0 (a decay exp(log_decay) in (0, 1])";
      break;
    case kBadPathNode:
      m << "path[" << b << ", " << s.node << "] = " << s.value << " is out of range [0, N) (N: the tree's nodes)";
      break;
    default:
      m << "row " << b << ": unknown status " << s.code;
  }
  return m.str();
}

}  // namespace

void raise_on_bad_status(const char* op, const at::Tensor& status) {
  if (status.is_meta()) return;  // meta tensors carry no data to check (ops_meta.cpp runs the argument checks only)
  const at::Tensor host = status.device().is_cpu() ? status : status.to(at::kCPU);
  const auto* rows = reinterpret_cast<const RowStatus*>(host.const_data_ptr<int64_t>());
  for (int64_t b = 0; b < host.size(0); ++b) {
    if (rows[b].code != kOk) TORCH_CHECK_VALUE(false, status_message(op, b, rows[b]));
  }
}

}  // namespace specdec::glue
