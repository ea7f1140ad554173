"""The Redis bus with auth on (a real redis-server with an ACL user and the default user off):
credentials from the environment or a file, never the config; a wrong password or an
unauthenticated publisher is refused; a router that cannot authenticate keeps serving on its
stale state; forged events (another instance's id, a replayed sequence) never steer placement."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
import redis

from cachemap.bus import InProcessBus
from cachemap.events import InstanceEvents, Stored, encode_message
from engines.bus_redis import RedisStreamBus
from engines.config import BusConfig
from engines.deployment import open_buses
from engines.sim import LatencyProfile
from router.placement import PlacementRequest
from router.state import RouterState
from tests.integration.conftest import REDIS_PASSWORD, REDIS_USER

PROFILE = LatencyProfile.load("cpu-tiny-llama")


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
    state = RouterState("kv_ttft", PROFILE, block_size=16, kv_bus=events, load_bus=loads)
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
    state = RouterState("kv_ttft", PROFILE, block_size=16, kv_bus=kv, load_bus=loads)
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
