// Per-row validation status written by every kernel that reads data-dependent indices or values.
//
// Kernels never read out of bounds, whatever the data: a row that fails validation writes a status here and
// fills its outputs with sentinels (-1 indices, 0 lengths, false masks, zero attention outputs; compact_kv leaves an
// invalid row's cache rows untouched). The glue then either raises an error
// naming the argument, batch row and node (validate=true) or leaves the sentinels (validate=false). Keeping one
// status per row (instead of one global flag) makes the reported error deterministic on both devices: the glue
// reports the lowest failing row.
#pragma once

#include <cstdint>

namespace specdec {

enum StatusCode : int64_t {
  kOk = 0,
  kRootNotMinusOne = 1,       // parents[b, 0] != -1; value = parents[b, 0]
  kParentNotEarlier = 2,      // parents[b, node] not in [0, node); value = parents[b, node]
  kTokenOutOfRange = 3,       // tokens[b, node] not in [0, vocab); value = the token
  kNonFiniteLogits = 4,       // logits[b, node, :] holds NaN or +inf; value = first offending vocabulary index
  kNoValidToken = 5,          // logits[b, node, :] is all -inf; value = -1
  kBadTemperature = 6,        // temperature[b] negative, NaN or +inf; value = 0
  kBadTopP = 7,               // top_p[b] not in (0, 1]; value = 0
  kBadDraftProb = 8,          // draft_probs[b, node, token] negative or NaN; value = the token
  kBadPrefixLen = 9,          // tree_attention: prefix_lens[b] < 0 or prefix_lens[b] + N > S; value = prefix_lens[b]
  kBadLength = 10,            // compact_kv: lengths[b] not in [0, L]; value = lengths[b]
  kBadDstStart = 11,          // compact_kv: dst_start[b] < 0 or dst_start[b] + lengths[b] > S; value = dst_start[b]
  kBadSrcPosition = 12,       // compact_kv: src_positions[b, i] not in [0, S) (i < lengths[b]); node = i, value = it
  kBadWriteSlot = 13,         // draft_decoder_layer: write_slots[b, t] not in [0, S); node = t, value = the slot
  kBadSelected = 14,          // advance_tree_frontier: selected[b, s] not in [0, F * K); node = s, value = it
  kBadColumn = 15,            // advance_tree_frontier: column[b, l] not in [0, C); node = l, value = it
  kBadCandidateParent = 16,   // select_tree_nodes: kept candidate c's parent not kept and earlier; node = c
  kBadTopK = 17,              // top_k[b] < 0; value = top_k[b]
  kBadUniform = 18,           // uniforms not in [0, 1) (or NaN); node = the column (-1 for a [B] vector)
  kBadTreePrefixLen = 19,     // build_tree: prefix_lens[b] < 0 or prefix_lens[b] + N - 1 > INT64_MAX; value = it
  // The recurrent tree ops (recurrent_params.h).
  kBadLogDecay = 20,          // log_decay[h] NaN, infinite or > 0; node = h
  kBadPathNode = 21,          // path[b, t] not in [0, N) (t < lengths[b]); node = t, value = it
};

// One row's status: `code` (a StatusCode), the tree `node` (or logits row) it concerns, and the offending value.
struct RowStatus {
  int64_t code;
  int64_t node;
  int64_t value;
};

}  // namespace specdec
