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
    FailedLoginLimiter,
    TLSFiles,
    TooManyFailures,
    averaging_run_id,
    hash_password,
    load_allowlist,
    load_or_create_signing_key,
    make_self_signed_certificate,
    request_token,
    save_allowlist,
    verify_password,
)
from common.errors import ConfigError, PeerError
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
def tls(tmp_path_factory) -> TLSFiles:
    """A self-signed certificate for the loopback address, as ``auth_server.py make-certificate`` writes it."""
    folder = tmp_path_factory.mktemp("tls")
    files = TLSFiles(folder / "auth.crt", folder / "auth.key")
    make_self_signed_certificate(files.certificate, files.key, ["127.0.0.1", "localhost"])
    return files


@pytest.fixture(scope="module")
def server(tls):
    service = AuthorizationService(make_allowlist(), RSAPrivateKey(), timedelta(minutes=10))
    running = AuthServer(service, tls).start()
    running.ca_file = str(tls.certificate)  # what peers pass as --auth-ca
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
    reply = request_token(server.url, "alice", PASSWORDS["alice"], key, server.ca_file)
    assert reply.token.username == "alice" and reply.token.public_key == key.to_bytes()
    assert server.url.startswith("https://") and len(reply.run_secret) == 32
    with pytest.raises(AccessDenied, match="'mallory' is not on this run's allowlist"):
        request_token(server.url, "mallory", "anything", key, server.ca_file)
    with pytest.raises(AccessDenied, match="wrong password for user 'bob'"):
        request_token(server.url, "bob", "guess", key, server.ca_file)
    with pytest.raises(AccessDenied, match="access for user 'carol' expired on"):
        request_token(server.url, "carol", PASSWORDS["carol"], key, server.ca_file)


def test_the_password_only_travels_over_verified_tls(server):
    key = RSAPrivateKey().get_public_key()
    with pytest.raises(ConfigError, match="must be reached over https://"):
        request_token(server.url.replace("https://", "http://"), "alice", PASSWORDS["alice"], key, server.ca_file)
    # without the self-signed certificate this machine trusts nothing the server presents
    with pytest.raises(PeerError, match="certificate this peer does not trust.*--auth-ca"):
        request_token(server.url, "alice", PASSWORDS["alice"], key)
    # a certificate made for another host name does not vouch for this address
    other = server.ca_file.replace("auth.crt", "other.crt")
    make_self_signed_certificate(Path(other), Path(other.replace(".crt", ".key")), ["auth.example.org"])
    with pytest.raises(PeerError, match="does not trust"):
        request_token(server.url, "alice", PASSWORDS["alice"], key, other)


def test_a_restarted_server_keeps_its_signing_key_and_run_secret(tmp_path, tls):
    key_file = tmp_path / "token_signing.key"
    peer_key = RSAPrivateKey()
    replies = []
    for _restart in range(2):
        service = AuthorizationService(make_allowlist(), load_or_create_signing_key(key_file), timedelta(minutes=10))
        running = AuthServer(service, tls).start()
        try:
            replies.append(
                request_token(
                    running.url, "alice", PASSWORDS["alice"], peer_key.get_public_key(), str(tls.certificate)
                )
            )
        finally:
            running.shutdown()
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    first, second = replies
    assert first.server_public_key.to_bytes() == second.server_public_key.to_bytes()
    assert first.run_secret == second.run_secret
    # a peer that pinned the key before the restart still accepts tokens issued before and after it
    pinned = AllowlistTokenAuthorizer("https://unused", "bob", "x", server_public_key=first.server_public_key)
    assert pinned.is_token_valid(first.token) and pinned.is_token_valid(second.token)
    # a different key (a lost key file) invalidates them, as it must
    other = AuthorizationService(make_allowlist(), RSAPrivateKey(), timedelta(minutes=10))
    stranger = AllowlistTokenAuthorizer("https://unused", "bob", "x", server_public_key=other.public_key)
    assert not stranger.is_token_valid(first.token)
    assert other.run_secret != first.run_secret


def test_failed_logins_are_limited_per_username_and_per_address():
    now = [1000.0]
    limiter = FailedLoginLimiter(per_username=3, per_address=5, window_seconds=60, max_tracked=4, clock=lambda: now[0])
    for _attempt in range(3):
        limiter.check("bob", "10.0.0.1")
        limiter.record_failure("bob", "10.0.0.1")
    with pytest.raises(TooManyFailures, match="too many failed logins for user 'bob': try again in 60 s"):
        limiter.check("bob", "10.0.0.2")  # another address does not help the guesser
    limiter.check("alice", "10.0.0.1")  # the address is not locked yet: 3 of 5
    for user in ("u1", "u2"):
        limiter.record_failure(user, "10.0.0.1")
    with pytest.raises(TooManyFailures, match="address 10.0.0.1"):
        limiter.check("alice", "10.0.0.1")  # one address guessing many usernames
    now[0] += 61
    limiter.check("bob", "10.0.0.1")  # the window has passed
    assert len(limiter.failures) <= 4  # bounded memory

    service = AuthorizationService(make_allowlist(), RSAPrivateKey(), timedelta(minutes=10), limiter)
    key = RSAPrivateKey().get_public_key().to_bytes()
    for _attempt in range(3):
        with pytest.raises(AccessDenied, match="wrong password"):
            service.issue("bob", "guess", key, address="10.0.0.9")
    with pytest.raises(TooManyFailures):  # even the right password is not checked while locked out
        service.issue("bob", PASSWORDS["bob"], key, address="10.0.0.9")
    now[0] += 61
    assert service.issue("bob", PASSWORDS["bob"], key, address="10.0.0.9").username == "bob"


def test_the_server_answers_a_locked_out_user_with_429(tls):
    limiter = FailedLoginLimiter(per_username=2, per_address=10)
    running = AuthServer(
        AuthorizationService(make_allowlist(), RSAPrivateKey(), timedelta(minutes=10), limiter), tls
    ).start()
    key = RSAPrivateKey().get_public_key()
    try:
        for _attempt in range(2):
            with pytest.raises(AccessDenied, match="wrong password"):
                request_token(running.url, "bob", "guess", key, str(tls.certificate))
        with pytest.raises(AccessDenied, match="refused 'bob': too many failed logins for user 'bob'"):
            request_token(running.url, "bob", PASSWORDS["bob"], key, str(tls.certificate))
        assert request_token(running.url, "alice", PASSWORDS["alice"], key, str(tls.certificate)).token
    finally:
        running.shutdown()


def _authorizer(server, username: str) -> AllowlistTokenAuthorizer:
    authorizer = AllowlistTokenAuthorizer(
        server.url, username, PASSWORDS[username], local_private_key=RSAPrivateKey(), ca_file=server.ca_file
    )
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
            "--auth-ca",
            server.ca_file,
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


async def _ask_to_join(maddrs, leader, prefix: str, schema_hash: bytes):
    """An outsider's direct request to ``leader``'s averager: no DHT, no token, only a libp2p connection."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.p2p import P2P
    from hivemind.proto import averaging_pb2

    p2p = await P2P.create(initial_peers=maddrs)
    try:
        stub = DecentralizedAverager.get_stub(p2p, leader, namespace=prefix)
        request = averaging_pb2.JoinRequest(
            schema_hash=schema_hash, expiration=get_dht_time() + 5, gather=b"", group_key=f"{prefix}.0b"
        )
        stream = await stub.rpc_join_group(request)
        reply = await asyncio.wait_for(anext(stream), timeout=10)
        return averaging_pb2.MessageCode.Name(reply.code)
    except Exception as error:  # what the outsider sees when the peer has no handler of that name
        return f"refused: {error}"
    finally:
        await p2p.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_without_the_run_secret_an_outsider_cannot_reach_the_averagers(server):
    """hivemind checks tokens on DHT requests only; averaging handlers answer whoever names them. The run secret
    tags every averaging prefix, so an outsider who knows the run id (it is public) cannot name them."""
    import hivemind
    import torch

    run_id = "moderated_run"
    alice, bob = _authorizer(server, "alice"), _authorizer(server, "bob")
    tagged = averaging_run_id(run_id, alice)
    assert tagged == averaging_run_id(run_id, bob) != run_id and averaging_run_id(run_id, None) == run_id
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], authorizer=alice, start=True)
    second = hivemind.DHT(
        initial_peers=[str(address) for address in first.get_visible_maddrs()],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        authorizer=bob,
        start=True,
    )
    options = dict(prefix=f"{tagged}_grad_averager", target_group_size=2, min_matchmaking_time=3.0, start=True)
    averagers = [
        hivemind.DecentralizedAverager([torch.full((4,), value)], dht=dht, request_timeout=1.0, **options)
        for value, dht in ((0.0, first), (2.0, second))
    ]
    try:
        # the authorized peers find each other through the DHT and average under the tagged prefix
        steps = [averager.step(wait=False, timeout=30) for averager in averagers]
        assert all(len(step.result()) == 2 for step in steps)
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, torch.ones(4))

        maddrs = [str(address) for address in first.get_visible_maddrs()]
        schema = averagers[0].schema_hash  # derivable by anyone who has the model's code and config
        guesses = {
            prefix: asyncio.run(_ask_to_join(maddrs, first.peer_id, prefix, schema))
            for prefix in (f"{run_id}_grad_averager", f"{tagged}_grad_averager")
        }
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()
    # the prefix an outsider can build from the public run id names no handler on the authorized peer
    assert (
        guesses[f"{run_id}_grad_averager"].startswith("refused:") and "protocol" in guesses[f"{run_id}_grad_averager"]
    ), guesses
    # the same request under the tagged prefix reaches the handler and gets an answer although it carries no
    # token: the run secret, not hivemind, is what keeps outsiders out of averaging
    assert not guesses[f"{tagged}_grad_averager"].startswith("refused:"), guesses
