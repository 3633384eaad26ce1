"""`/v1/embeddings` on a real router in front of a real `tandem worker`, through the official `openai` client:
equal to the engine's embeddings (themselves checked against HF in tests/common/scheduler/test_embedder.py)."""

from __future__ import annotations

import base64
import struct

import openai
import pytest
from tokenizers import Tokenizer

from tests.services.router.test_http_unified import post

pytestmark = pytest.mark.e2e

TEXTS = ["The little cat sat on the", "héllo wörld", "a"]


@pytest.fixture(scope="module")
def expected(tiny_llama):
    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine

    tok = Tokenizer.from_file(f"{tiny_llama}/tokenizer.json")
    ids = [tok.encode(t).ids for t in TEXTS]
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=4096, page_size=4, max_context_len=1024)
    with Engine(config) as engine:
        outs = [engine.embed(f"e{i}", p).result(timeout=60) for i, p in enumerate(ids)]
    return ids, [o.embedding for o in outs]


def close(a, b) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_openai_client_embeddings_equal_the_engine(client, expected):
    ids, vectors = expected
    reply = client.embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == "tiny"
    assert all(close(d.embedding, v) for d, v in zip(reply.data, vectors))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(i) for i in ids)
    one = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=64)
    assert len(one.data) == 1 and close(one.data[0].embedding, vectors[0])
    by_ids = client.embeddings.create(model="tiny", input=ids[1])
    assert close(by_ids.data[0].embedding, vectors[1])


def test_base64_encoding_and_token_id_lists(router, expected):
    ids, vectors = expected
    status, body = post(router, "/v1/embeddings", {"input": ids, "encoding_format": "base64"})
    assert status == 200, body
    for item, want in zip(body["data"], vectors):
        raw = base64.b64decode(item["embedding"])
        assert close(struct.unpack(f"<{len(raw) // 4}f", raw), want)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": []}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [[5, 10**6]]}, "input"),
    ({"input": "x", "user": "u1"}, "user"),
    ({"input": "x", "model": "other"}, "model"),
])
def test_bad_requests_name_the_field(router, body, param):
    status, reply = post(router, "/v1/embeddings", body)
    assert status in (400, 404), reply
    assert reply["error"]["param"] == param and reply["error"]["message"]


def test_openai_client_sees_a_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="tiny", input="x", dimensions=3)


def test_router_grpc_embed(router, expected):
    import grpc

    from tandem.common.proto_gen.tandem import router_pb2 as rpb
    from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc

    ids, vectors = expected
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        stub = rpb_grpc.RouterStub(channel)
        reply = stub.Embed(rpb.EmbedRequest(model="tiny", texts=TEXTS), timeout=60)
        assert [e.index for e in reply.data] == [0, 1, 2] and reply.model == "tiny"
        assert all(close(list(e.values), v) for e, v in zip(reply.data, vectors))
        assert reply.prompt_tokens == sum(len(i) for i in ids)
        by_ids = stub.Embed(rpb.EmbedRequest(token_ids=[rpb.TokenIds(ids=ids[2])]), timeout=60)
        assert close(list(by_ids.data[0].values), vectors[2])
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(rpb.EmbedRequest(texts=["x"], dimensions=5), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dimensions" in err.value.details()
