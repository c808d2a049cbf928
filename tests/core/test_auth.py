"""Authorization server, allowlist and the hivemind token authorizer; signed, schema-checked metrics records."""

import asyncio
import dataclasses
import secrets
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from common.auth import (
    AccessDenied,
    AllowlistEntry,
    AllowlistTokenAuthorizer,
    AuthorizationService,
    AuthServer,
    hash_password,
    load_allowlist,
    request_token,
    save_allowlist,
    verify_password,
)
from common.identity import peer_id_of, peer_id_of_record_owner
from common.metrics import PeerMetrics, StepAggregator, StepRecord, make_validators, metrics_key

ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {"alice": "correct horse", "bob": "battery staple", "carol": "late volunteer"}


def make_allowlist() -> dict:
    past = datetime.now(timezone.utc) - timedelta(days=1)
    return {
        "alice": AllowlistEntry("alice", hash_password(PASSWORDS["alice"])),
        "bob": AllowlistEntry("bob", hash_password(PASSWORDS["bob"])),
        "carol": AllowlistEntry("carol", hash_password(PASSWORDS["carol"]), access_expires=past),
    }


@pytest.fixture(scope="module")
def server():
    service = AuthorizationService(make_allowlist(), RSAPrivateKey(), timedelta(minutes=10))
    running = AuthServer(service).start()
    yield running
    running.shutdown()


def test_password_hash_round_trip_and_allowlist_file(tmp_path):
    stored = hash_password("secret")
    assert verify_password("secret", stored) and not verify_password("Secret", stored)
    save_allowlist(make_allowlist(), tmp_path / "allowlist.json")
    loaded = load_allowlist(tmp_path / "allowlist.json")
    assert set(loaded) == {"alice", "bob", "carol"} and loaded["carol"].access_expires is not None
    assert "secret" not in (tmp_path / "allowlist.json").read_text()


def test_server_issues_tokens_only_to_allowlisted_users_with_the_right_password(server):
    key = RSAPrivateKey().get_public_key()
    token, server_key = request_token(server.url, "alice", PASSWORDS["alice"], key)
    assert token.username == "alice" and token.public_key == key.to_bytes()
    with pytest.raises(AccessDenied, match="'mallory' is not on this run's allowlist"):
        request_token(server.url, "mallory", "anything", key)
    with pytest.raises(AccessDenied, match="wrong password for user 'bob'"):
        request_token(server.url, "bob", "guess", key)
    with pytest.raises(AccessDenied, match="access for user 'carol' expired on"):
        request_token(server.url, "carol", PASSWORDS["carol"], key)


def _authorizer(server, username: str) -> AllowlistTokenAuthorizer:
    authorizer = AllowlistTokenAuthorizer(server.url, username, PASSWORDS[username], local_private_key=RSAPrivateKey())
    authorizer.fetch_token()
    return authorizer


def _signed_request(token, private_key: RSAPrivateKey) -> dht_pb2.PingRequest:
    """What ``TokenAuthorizerBase.sign_request`` sends, but with a token of our choosing (no refresh)."""
    request = dht_pb2.PingRequest()
    request.auth.client_access_token.CopyFrom(token)
    request.auth.time = get_dht_time()
    request.auth.nonce = secrets.token_bytes(8)
    request.auth.signature = private_key.sign(request.SerializeToString())
    return request


def test_dht_requests_need_a_current_token_from_this_server(server):
    client, servicer = _authorizer(server, "alice"), _authorizer(server, "bob")
    request = dht_pb2.PingRequest()
    asyncio.run(client.sign_request(request, None))
    assert asyncio.run(servicer.validate_request(request))
    assert not asyncio.run(servicer.validate_request(request)), "a replayed request must be refused"

    response = dht_pb2.PingResponse()
    asyncio.run(servicer.sign_response(response, request))
    assert asyncio.run(client.validate_response(response, request))

    peer_key = RSAPrivateKey()
    rogue_server = AuthorizationService(make_allowlist(), RSAPrivateKey(), timedelta(minutes=10))
    forged = rogue_server.issue("alice", PASSWORDS["alice"], peer_key.get_public_key().to_bytes())
    assert not asyncio.run(servicer.validate_request(_signed_request(forged, peer_key)))

    expired_issuer = AuthorizationService(make_allowlist(), server_private_key(server), timedelta(seconds=-1))
    expired = expired_issuer.issue("alice", PASSWORDS["alice"], peer_key.get_public_key().to_bytes())
    assert not asyncio.run(servicer.validate_request(_signed_request(expired, peer_key)))

    stolen = client._local_access_token  # alice's valid token, presented by someone without alice's key
    assert not asyncio.run(servicer.validate_request(_signed_request(stolen, peer_key)))


def server_private_key(server: AuthServer) -> RSAPrivateKey:
    return server.httpd.RequestHandlerClass.service.private_key


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "username, password, message",
    [
        ("mallory", "x", "user 'mallory' is not on this run's allowlist"),
        ("bob", "wrong", "wrong password for user 'bob'"),
        ("carol", PASSWORDS["carol"], "access for user 'carol' expired on"),
    ],
)
def test_volunteer_refusals_are_one_line_errors(server, tmp_path, username, password, message):
    result = subprocess.run(
        [
            sys.executable,
            "scripts/volunteer.py",
            "--config",
            "configs/sahajbert/tiny.yaml",
            "--auth-server",
            server.url,
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/1/p2p/QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC",
            f"training.output_dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,  # slow imports on a loaded machine
        env={"PATH": "/usr/bin:/bin", "DEDLOC_USERNAME": username, "DEDLOC_PASSWORD": password},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: authorization server refused") and message in last_line


def _metrics_record(run_id: str, owner_public_key: bytes, value: dict, signer: RSAPrivateKey) -> DHTRecord:
    record = DHTRecord(
        key=DHTID.generate(source=metrics_key(run_id)).to_bytes(),
        subkey=MSGPackSerializer.dumps(owner_public_key),
        value=MSGPackSerializer.dumps(value),
        expiration_time=get_dht_time() + 60,
    )
    signing = CompositeValidator(make_validators(run_id, RSASignatureValidator(signer)))
    return dataclasses.replace(record, value=signing.sign_value(record))


def test_forged_or_malformed_metrics_records_are_refused_and_not_counted():
    run_id, honest_key, forger_key = "sahajbert_test", RSAPrivateKey(), RSAPrivateKey()
    honest_public = RSASignatureValidator(honest_key).local_public_key
    good = PeerMetrics(
        peer_name="alice", role="trainer", recent=[StepRecord(step=3, samples=16, loss=7.5, seconds=1.0, time=1.0)]
    ).dict()
    node_validator = CompositeValidator(make_validators(run_id, RSASignatureValidator(RSAPrivateKey())))

    honest = _metrics_record(run_id, honest_public, good, honest_key)
    forged = _metrics_record(run_id, honest_public, {**good, "peer_name": "alice-forged"}, forger_key)
    malformed = _metrics_record(
        run_id, honest_public, {**good, "recent": [{**good["recent"][0], "loss": "low"}]}, honest_key
    )
    accepted = [record for record in (honest, forged, malformed) if node_validator.validate(record)]
    assert accepted == [honest]

    aggregator = StepAggregator()
    for record in accepted:
        value = MSGPackSerializer.loads(node_validator.strip_value(record))
        for step in PeerMetrics.parse_obj(value).recent:
            aggregator.add(peer_id_of_record_owner(record.subkey), value["peer_name"], step)
    aggregator.add("nan-peer-id", "nan-peer", StepRecord(step=3, samples=16, loss=float("nan"), seconds=1.0, time=1.0))
    (aggregate,) = aggregator.pop_ready(flush=True)
    alice = peer_id_of(honest_key.get_public_key())  # counted under the signer's peer id, shown as its name
    assert aggregate.contributions == {alice: 16} and aggregate.names == {alice: "alice"} and aggregate.loss == 7.5
