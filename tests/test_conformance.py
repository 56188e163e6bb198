"""The conformance suite (shipped in ``cakeops.testing``) on every in-tree backend.

A third-party backend runs the same classes with ``pytest --pyargs cakeops.testing``.
"""

from cakeops.testing.test_causal_dot_product import (  # noqa: F401
    TestCausalDotProduct,
    TestCausalDotProductBadInput,
)
from cakeops.testing.test_moe_experts import TestMoEExperts, TestMoEExpertsBadInput  # noqa: F401
from cakeops.testing.test_rmsnorm_silu_gate import (  # noqa: F401
    TestRMSNormSiLUGate,
    TestRMSNormSiLUGateBadInput,
)
