"""Test-only stand-in for ``sgl_kernel.speculative`` (see the package docstring): the one op SGLang
0.5.23 imports from it on CPU (``kernels/ops/speculative/reconstruct_tree.py``).

``reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrieve_index,
retrieve_next_token, retrieve_next_sibling, batch_size, draft_token_num)`` fills the four outputs in
place, with the semantics that file's docstring states (per request ``b``, node ``t``, ``n`` draft
tokens): strict ancestors ``tree_mask[b, t, j] & (j < t)``; ``positions = #ancestors +
verified_seq_len[b]``; ``retrieve_index = b * n + t``; parent = the largest ancestor (else -1);
``retrieve_next_token`` = the first child (smallest ``k > t`` with ``t`` an ancestor of ``k``, else
-1); ``retrieve_next_sibling`` = the smallest ``k > t`` with the same parent, else -1, and -1 when
``t`` has no parent.
"""

from __future__ import annotations

from sgl_kernel import _missing, _reconstruct

reconstruct_indices_from_tree_mask = _reconstruct


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(f"speculative.{name}")
