"""PD on an MoE model: a prefill worker at --tp-size 2 --ep-size 2 WRITEs its KV (attention heads split as under
TP; experts hold no KV) into a decode worker of two single-rank replicas (--dp-size 2);
then a single-rank prefill into a decode of two replicas that are each an EP-2 group; greedy output through the
router equals the offline engine's and no page stays taken on any rank."""

from __future__ import annotations

import pytest

from tests.common.rpc.helpers import engine_greedy
from tests.services.pd_helpers import pd_reference_engine
from tests.services.test_disaggregated_dp_tp import (MAX_NEW, PROMPTS, RANK_FLAGS, TIMEOUTS, check_through_router,
                                                     close_pair)
from tests.services.pd_helpers import PDPair

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def moe_model(model_factory) -> str:
    return model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def expected(moe_model):
    with pd_reference_engine(moe_model) as engine:
        return [engine_greedy(engine, p, MAX_NEW).sequences[0].output_ids for p in PROMPTS]


def _shape(dp: int, tp: int, ep: int) -> tuple:
    return ("--dp-size", str(dp), "--tp-size", str(tp), "--ep-size", str(ep), "--load-balance-method",
            "round_robin", *RANK_FLAGS)


@pytest.mark.parametrize("prefill, decode", [((1, 2, 2), (2, 1, 1)), ((1, 1, 1), (2, 2, 2))])
def test_pd_at_different_ep_through_router(moe_model, expected, prefill, decode):
    pair = PDPair(moe_model, *TIMEOUTS, prefill_extra=_shape(*prefill), decode_extra=_shape(*decode), timeout=300)
    try:
        check_through_router(pair, moe_model, expected)
    finally:
        close_pair(pair)
    assert (pair.decode.proc.returncode, pair.prefill.proc.returncode) == (0, 0)
