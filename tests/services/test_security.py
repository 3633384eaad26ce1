"""Tandem's optional security with real processes on 127.0.0.1 and real gRPC: a prefill/decode pair and a router on
mutual TLS, a decode with a bootstrap allow-list, and the profiler kept in its directory."""

from __future__ import annotations

import os
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jinja2
import openai
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import TlsConfig
from tandem.common.launcher.certs import make_deployment_certs, make_self_signed
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.tls import blocking_channel
from tandem.common.tokenizer import load_tokenizer
from tests.common.rpc.helpers import free_port
from tests.services.pd_helpers import PDPair, output_ids, pd_reference_engine
from tests.services.router.conftest import RouterProcess, readiness, wait_until

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "tell me about the sea"}]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> TlsConfig:
    files = make_deployment_certs(str(tmp_path_factory.mktemp("tls")))
    return TlsConfig(files.ca_file, files.cert_file, files.key_file)


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("profiles"))


@pytest.fixture(scope="module")
def pair(tiny_llama, certs, profile_root):
    boot = free_port()
    pd = PDPair(tiny_llama, "--profile-dir", profile_root, tls=certs, prefill_extra=("--bootstrap-port", str(boot)),
                decode_extra=("--allowed-bootstrap", f"127.0.0.1:{boot}"))
    yield pd
    pd.close()


@pytest.fixture(scope="module")
def router(pair, tiny_llama, certs):
    proc = RouterProcess("--prefill", f"grpc://{pair.prefill.address},{pair.prefill.bootstrap_port}",
                         "--decode", f"grpc://{pair.decode.address}", "--model-path", tiny_llama,
                         "--served-model-name", "tiny", "--tls-ca-file", certs.tls_ca_file,
                         "--tls-cert-file", certs.tls_cert_file, "--tls-key-file", certs.tls_key_file)
    wait_until(lambda: readiness(proc) == 200, 60, "router readiness over mutual TLS")
    yield proc
    assert proc.stop() == 0, "router did not shut down cleanly:\n" + "".join(proc.log[-40:])


def test_a_tls_stack_serves_greedy_output_equal_to_the_offline_engine(router, pair, tiny_llama):
    """The offline engine is what PD without TLS equals (test_disaggregated); so TLS changes no token."""
    info = load_tokenizer(tiny_llama)
    text = jinja2.Template(info.chat_template).render(messages=MESSAGES, add_generation_prompt=True,
                                                      bos_token=info.bos_token)
    ids = info.tokenizer.encode(text, add_special_tokens=False).ids
    with pd_reference_engine(tiny_llama) as engine:
        req = GenerateRequest(engine.new_rid(), ids, SamplingParams(max_new_tokens=12, temperature=0.0))
        want = engine.submit(req).result().sequences[0].output_ids
    with openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == info.tokenizer.decode(want, skip_special_tokens=True)
    # And the pair's own legs, driven like the router drives them (the bootstrap hop on mutual TLS too).
    (p_resp, d_resp), = pair.run_legs([pair.request("direct", ids, max_new_tokens=12)])
    assert output_ids(d_resp) == want and output_ids(p_resp) == want[:1]
    pair.wait_both_free()


@pytest.mark.parametrize("credential", ["none", "self-signed"])
def test_a_client_without_a_ca_signed_certificate_reaches_no_worker_rpc(pair, certs, credential, tmp_path):
    if credential == "none":
        channels = [grpc.insecure_channel(w.address) for w in (pair.prefill, pair.decode)]
    else:
        cert, key = make_self_signed(str(tmp_path), "intruder")
        foreign = TlsConfig(certs.tls_ca_file, cert, key)  # trusts the workers, but the CA never signed its cert
        channels = [blocking_channel(w.address, foreign) for w in (pair.prefill, pair.decode)]
    for channel in channels:
        stub = pb_grpc.SglangSchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as flush:
            stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=5)
        assert flush.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as generate:
            list(stub.Generate(pair.request("intruder", [5, 6, 7]), timeout=5))
        assert generate.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
    assert pair.p_stub.FlushCache(common_pb2.FlushCacheRequest()).success  # with the CA's certificate: served


def test_the_decode_refuses_a_bootstrap_server_outside_its_allow_list(pair):
    with socket.socket() as trap:  # a listener the decode must never connect to
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.settimeout(0.5)
        request = pair.request("elsewhere", [5, 6, 7])
        request.disaggregated_params.bootstrap_port = trap.getsockname()[1]
        with pytest.raises(grpc.RpcError) as refused:
            list(pair.d_stub.Generate(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"127.0.0.1:{trap.getsockname()[1]} is not in this decode's --allowed-bootstrap" in refused.value.details()
        with pytest.raises(socket.timeout):
            trap.accept()


def test_the_profiler_writes_only_under_its_directory(pair, profile_root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, os.path.join(profile_root, "link"))
    root = os.path.realpath(profile_root)
    for escape in ("/etc", os.path.join(profile_root, "..", "sibling"), "../sibling", "link"):
        reply = pair.p_stub.StartProfile(common_pb2.StartProfileRequest(output_dir=escape))
        assert not reply.success, escape
        assert f"outside the profile directory {root}" in reply.message
    assert not os.listdir(outside)
    started = pair.d_stub.StartProfile(common_pb2.StartProfileRequest(output_dir="run-1"))
    assert started.success and os.path.join(root, "run-1") in started.message
    stopped = pair.d_stub.StopProfile(common_pb2.StopProfileRequest())
    assert stopped.success and stopped.message.startswith(os.path.join(root, "run-1") + os.sep)


def test_the_router_serves_https_and_grpc_over_tls_with_ssl_flags(pair, certs, tiny_llama):
    import http.client
    import ssl
    import urllib.error
    import urllib.request

    from tandem.common.proto_gen.tandem import router_pb2 as rpb
    from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc

    proc = RouterProcess("--prefill", f"grpc://{pair.prefill.address},{pair.prefill.bootstrap_port}",
                         "--decode", f"grpc://{pair.decode.address}", "--model-path", tiny_llama,
                         "--served-model-name", "tiny", "--tls-ca-file", certs.tls_ca_file,
                         "--tls-cert-file", certs.tls_cert_file, "--tls-key-file", certs.tls_key_file,
                         "--ssl-certfile", certs.tls_cert_file, "--ssl-keyfile", certs.tls_key_file)
    try:
        trusted = ssl.create_default_context(cafile=certs.tls_ca_file)
        https = f"https://127.0.0.1:{proc.port}"

        def ready() -> bool:
            try:
                with urllib.request.urlopen(https + "/readiness", timeout=5, context=trusted) as resp:
                    return resp.status == 200
            except urllib.error.HTTPError:
                return False

        wait_until(ready, 60, "router readiness over HTTPS")
        with pytest.raises((OSError, http.client.HTTPException)):  # plaintext HTTP is not served on that port
            urllib.request.urlopen(f"http://127.0.0.1:{proc.port}/readiness", timeout=5)
        credentials = grpc.ssl_channel_credentials(root_certificates=open(certs.tls_ca_file, "rb").read())
        with grpc.secure_channel(f"127.0.0.1:{proc.grpc_port}", credentials) as channel:
            models = rpb_grpc.RouterStub(channel).ListModels(rpb.ListModelsRequest(), timeout=10)
        assert [m.id for m in models.models] == ["tiny"]
    finally:
        assert proc.stop() == 0, "router did not shut down cleanly:\n" + "".join(proc.log[-40:])


def _refused_at_once(stub, request) -> grpc.RpcError:
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, timeout=30))
    assert time.monotonic() - start < 5, "refused only after a timeout"  # --bootstrap-timeout is 30 s here
    return refused.value


def test_a_duplicate_room_is_refused_at_once_on_both_workers_and_the_first_request_completes(pair):
    prompt = [5, 17, 42, 99, 7, 300, 12, 8, 64, 250]
    with ThreadPoolExecutor(max_workers=2) as pool:
        for first_leg, second_stub in (("prefill", pair.p_stub), ("decode", pair.d_stub)):
            room = random.randrange(0, 2**31)
            first, second = (pair.request(f"{first_leg}-{n}", prompt, room=room) for n in ("first", "second"))
            # The first request's leg on this worker waits for its other leg, holding the room...
            stubs = {"prefill": pair.p_stub, "decode": pair.d_stub}
            waiting = pool.submit(lambda: list(stubs[first_leg].Generate(first, timeout=60)))
            time.sleep(1.0)
            # ... so a second request naming the same room fails there at once,
            error = _refused_at_once(second_stub, second)
            assert error.code() == grpc.StatusCode.ALREADY_EXISTS, error.details()
            assert ("tandem-failure-kind", "room_in_use") in tuple(error.trailing_metadata() or ())
            assert f"bootstrap_room {room} is in use" in error.details()
            # ... and the first completes once its other leg arrives.
            other = "decode" if first_leg == "prefill" else "prefill"
            rest = list(stubs[other].Generate(first, timeout=60))
            legs = {first_leg: waiting.result(), other: rest}
            decoded = output_ids(legs["decode"])
            assert decoded and output_ids(legs["prefill"]) == decoded[:1]
    pair.wait_both_free()
