"""Speculative acceptance in one place.

* :mod:`shared.protocol.acceptance.rule` - the rule itself (ratio test, greedy match, tree walk),
the
  reference verdicts of one block on the host (``verify_block``, ``verify_tree``), the
  client's recovery (``recover_token``) and :func:`accepted_by_rule`, with which the client
  checks every verdict it gets back;
* :mod:`shared.protocol.acceptance.batched` - the verifier's entry point :func:`decide`: every
block of
  one forward decided next to the rows, through the same rule, bit-equal to the reference
  (``tests/test_acceptance.py``).
"""

from shared.protocol.acceptance.batched import decide
from shared.protocol.acceptance.rule import (
    Block,
    Verdict,
    accept_drafts,
    accept_greedy,
    accept_tree,
    accepted_by_rule,
    ratio_test,
    recover_token,
    verify_block,
    verify_tree,
)

__all__ = ["Block", "Verdict", "accept_drafts", "accept_greedy", "accept_tree",
           "accepted_by_rule", "decide", "ratio_test", "recover_token", "verify_block",
           "verify_tree"]
