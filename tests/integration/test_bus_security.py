"""The Redis bus with auth on (a real redis-server with an ACL user and the default user off):
credentials from the environment or a file, never the config; a wrong password or an
unauthenticated publisher is refused; a router that cannot authenticate keeps serving on its
stale state; forged events (another instance's id, a replayed sequence) never steer placement.
The cluster's own ACL rule (``deploy/redis-bus.acl``) lets the bus run and refuses all else; the
bus runs over TLS with the certificates ``deploy/node-setup.sh`` makes."""

from __future__ import annotations

import logging
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from cachemap.events import InstanceEvents, Stored, encode_message
from engines.bus.base import InProcessBus
from engines.bus.redis_bus import RedisStreamBus
from engines.config import BusConfig
from engines.deployment import open_buses
from engines.profile import LatencyProfile
from router.placement import PlacementRequest
from router.settings import RouterSettings
from router.state import RouterState
from tests.integration.conftest import REDIS_PASSWORD, REDIS_USER
from tests.support import redis_server

PROFILE = LatencyProfile.load("cpu-tiny-llama")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def node_acl() -> list[str]:
    """The server arguments of the cluster's bus user: ``deploy/redis-bus.acl``'s rule, read as
    ``deploy/node-setup.sh`` reads it (its one line that is not a comment)."""
    lines = (DEPLOY / "redis-bus.acl").read_text().splitlines()
    rule = " ".join(x for x in lines if x.strip() and not x.lstrip().startswith("#")).split()
    return ["--user", "default", "off", "--user", REDIS_USER, "on", f">{REDIS_PASSWORD}", *rule]


@pytest.fixture(scope="module")
def node_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis whose bus user has exactly the cluster's ACL rule."""
    with redis_server(
        tmp_path_factory.mktemp("redis-node"),
        *node_acl(),
        username=REDIS_USER,
        password=REDIS_PASSWORD,
    ) as url:
        yield url


@contextmanager
def tls_redis(workdir: Path) -> Iterator[tuple[str, Path]]:
    """A TLS-only redis-server (the cluster's: ACL rule, certificates by ``node-setup.sh tls``);
    yields its ``rediss://`` URL and the CA's certificate."""
    certs = workdir / "tls"
    subprocess.run(
        ["bash", str(DEPLOY / "node-setup.sh"), "tls", str(certs), "localhost", "127.0.0.1"],
        check=True,
        timeout=60,
    )
    with redis_server(
        workdir, *node_acl(), username=REDIS_USER, password=REDIS_PASSWORD, tls=certs
    ) as url:
        yield url, certs / "ca.crt"


def bus_config(url: str, **extra: object) -> BusConfig:
    return BusConfig.model_validate(
        {"backend": "redis", "redis_url": url, "name": f"kvroute-{uuid.uuid4().hex[:8]}", **extra}
    )


def test_the_acl_user_publishes_with_a_password_from_the_environment(
    secured_redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_REDIS_PASSWORD", REDIS_PASSWORD)
    events, loads = open_buses(bus_config(secured_redis_url, redis_username=REDIS_USER))
    assert events.publish(b"e0") == 0 and loads.publish(b"l0") == 0
    assert events.read(0).items == [b"e0"]


def test_a_password_file_works_and_a_url_with_a_password_is_refused(
    secured_redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVROUTE_REDIS_PASSWORD", raising=False)
    secret = tmp_path / "redis.pw"
    secret.write_text(REDIS_PASSWORD + "\n")
    cfg = bus_config(secured_redis_url, redis_username=REDIS_USER, redis_password_file=str(secret))
    events, _ = open_buses(cfg)
    assert events.publish(b"x") == 0
    with pytest.raises(ValueError, match="redis_url: holds a password"):
        bus_config(secured_redis_url.replace("//", f"//{REDIS_USER}:{REDIS_PASSWORD}@"))
    with pytest.raises(ValueError, match="redis_password_file"):
        open_buses(bus_config(secured_redis_url, redis_password_file=str(tmp_path / "nope")))


def test_wrong_or_missing_credentials_are_refused(
    secured_redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = f"kvroute-{uuid.uuid4().hex[:8]}"
    wrong = RedisStreamBus(secured_redis_url, stream, username=REDIS_USER, password="wrong")
    anonymous = RedisStreamBus(secured_redis_url, stream)  # an unauthenticated publisher
    for bus in (wrong, anonymous):
        with pytest.raises(redis.AuthenticationError):
            bus.publish(b"forged")
    outside = RedisStreamBus(  # the right user, but outside its key pattern
        secured_redis_url, "other-stream", username=REDIS_USER, password=REDIS_PASSWORD
    )
    with pytest.raises(redis.exceptions.NoPermissionError):
        outside.publish(b"x")
    good = RedisStreamBus(secured_redis_url, stream, username=REDIS_USER, password=REDIS_PASSWORD)
    assert good.end() == 0  # nothing the refused publishers sent landed


def test_a_router_that_cannot_authenticate_says_so_and_keeps_serving(
    secured_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    stream = f"kvroute-{uuid.uuid4().hex[:8]}"
    events = RedisStreamBus(secured_redis_url, stream, password="wrong")
    loads = RedisStreamBus(secured_redis_url, stream + "-loads", password="wrong")
    state = RouterState(RouterSettings(), PROFILE, kv_bus=events, load_bus=loads)
    state.sync_instances(["a", "b"])
    state.cache_map.store("b", "GPU", [1, 2, 3])  # what it knew before the bus went away
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            state.pump(now=1.0)
    assert state.bus_errors == 3
    warnings = [r.getMessage() for r in caplog.records]
    stale = [w for w in warnings if "routing on stale state" in w]
    assert len(stale) == 1 and "username-password" in stale[0]  # said once, with the cause
    placed = state.place(PlacementRequest("r", 64, [1, 2, 3, 4]), now=1.0)
    assert placed.instance_id == "b"  # still routes by the prefix it knew


def test_forged_events_never_steer_placement() -> None:
    """Events under an instance id the router does not serve are never a candidate's, and a
    replayed (old) sequence of a real instance is dropped as a duplicate."""
    kv, loads = InProcessBus(), InProcessBus()
    state = RouterState(RouterSettings(), PROFILE, kv_bus=kv, load_bus=loads)
    state.sync_instances(["a", "b"])
    prefix = [11, 12, 13, 14]
    kv.publish(encode_message(InstanceEvents("a", 0, 0.0, [Stored("GPU", [99], None, 0)])))
    kv.publish(encode_message(InstanceEvents("evil", 0, 0.0, [Stored("GPU", prefix, None, 0)])))
    kv.publish(encode_message(InstanceEvents("a", 0, 0.0, [Stored("GPU", prefix, None, 0)])))
    state.pump(now=0.5)
    assert state.core.ingestor.duplicates == 1  # the replay of a's sequence 0
    assert state.cache_map.match(prefix).get("a") is None
    chosen = {
        state.place(PlacementRequest(f"r{i}", 64, prefix), now=0.5).instance_id for i in range(4)
    }
    assert "evil" not in chosen and chosen <= {"a", "b"}


def test_the_clusters_acl_user_runs_the_bus_and_nothing_else(
    node_redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With exactly ``deploy/redis-bus.acl``: every bus operation works (a fresh server has no
    publish script, so SCRIPT LOAD runs too); admin commands and keys outside ``kvroute*``
    are refused."""
    name = f"kvroute-{uuid.uuid4().hex[:8]}"
    cfg = bus_config(node_redis_url, name=name, redis_username=REDIS_USER)
    monkeypatch.setenv("KVROUTE_REDIS_PASSWORD", REDIS_PASSWORD)
    events, loads = open_buses(cfg)
    assert events.publish(b"e0") == 0 and events.publish_many([b"e1", b"e2"]) == 2
    assert events.publish_pair([b"e3"], loads, [b"l0"]) == (3, 0)
    got, got_loads = events.read_pair(1, loads, 0)
    assert got.items == [b"e1", b"e2", b"e3"] and got_loads.items == [b"l0"]
    assert events.end() == 4
    assert isinstance(events, RedisStreamBus)
    events.request_resync("engine-0")
    assert events.take_resync("engine-0") and not events.take_resync("engine-0")
    db1 = RedisStreamBus(
        node_redis_url.removesuffix("/0") + "/1",
        name,
        username=REDIS_USER,
        password=REDIS_PASSWORD,
    )
    assert db1.publish(b"x") == 0  # a redis_url's database (SELECT)

    raw = redis.Redis.from_url(node_redis_url, username=REDIS_USER, password=REDIS_PASSWORD)
    refused = [
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "save", "60 1"),
        ("ACL", "LIST"),
        ("ACL", "SETUSER", REDIS_USER, "+@all"),
        ("SAVE",),
        ("BGSAVE",),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("KEYS", "*"),
        ("KEYS", "kvroute*"),
        ("SHUTDOWN",),
        ("SCRIPT", "FLUSH"),
        ("EVAL", "return redis.call('FLUSHALL')", "0"),
        ("PUBLISH", "kvroute", "x"),
        ("SET", f"{name}:next", "0"),  # a kvroute key, but not a command the bus sends
        ("DEL", f"{name}-kv-events"),
        ("GET", "other"),  # outside kvroute*
        ("XADD", "other", "*", "d", "x"),
    ]
    for cmd in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            raw.execute_command(*cmd)
    assert raw.ping()
    assert events.end() == 4  # nothing refused changed the log


def test_the_bus_runs_over_tls_with_the_clusters_certificates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster's TLS set-up (``node-setup.sh tls``, the config's ``rediss://`` URL and
    ``redis_ca_file``): the bus publishes and reads; a client without TLS, or one that does
    not trust the CA, gets nothing."""
    monkeypatch.setenv("KVROUTE_REDIS_PASSWORD", REDIS_PASSWORD)
    with tls_redis(tmp_path) as (url, ca):
        cfg = bus_config(url, redis_username=REDIS_USER, redis_ca_file=str(ca))
        events, loads = open_buses(cfg)
        assert events.publish(b"over tls") == 0 and loads.publish(b"load") == 0
        assert events.read(0).items == [b"over tls"]
        # redis_tls on a redis:// URL: the same TLS connection
        plain_url = url.replace("rediss://", "redis://")
        tls_flag = RedisStreamBus(
            plain_url,
            cfg.events_name,
            username=REDIS_USER,
            password=REDIS_PASSWORD,
            ssl=True,
            ssl_ca_certs=str(ca),
        )
        assert tls_flag.read(0).items == [b"over tls"]
        no_tls = RedisStreamBus(
            plain_url, cfg.events_name, username=REDIS_USER, password=REDIS_PASSWORD
        )
        untrusted = RedisStreamBus(  # the system's CAs: they never signed this server
            url, cfg.events_name, username=REDIS_USER, password=REDIS_PASSWORD
        )
        for bus in (no_tls, untrusted):
            with pytest.raises(redis.ConnectionError):
                bus.read(0)
