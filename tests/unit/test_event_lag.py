"""A router replica knows when its cache map is behind the engines' KV events, and says so."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cachemap.events import InstanceEvents, Stored, encode_message
from engines.bus.base import MAX_READ_ITEMS, InProcessBus
from engines.bus.liveness import LAG_WARN_S
from router.dispatch import Dispatcher
from router.metrics import RouterMetrics
from router.settings import RouterSettings
from router.state import RouterState


def batch(seq: int, ts: float) -> bytes:
    return encode_message(InstanceEvents("e0", seq, ts, [Stored("GPU", [100 + seq], None, 0)]))


def gauges(state: RouterState) -> dict[str, float]:
    """The lag series of ``/metrics`` as the ingress renders them for ``state``."""
    m = RouterMetrics()
    m.observe(Dispatcher(state, client=None))  # type: ignore[arg-type]  # no engine is called
    text = m.render().decode()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("kvroute_kv_event")
    }


def test_event_age_at_apply_and_the_behind_flag() -> None:
    kv, loads = InProcessBus(1 << 14), InProcessBus()
    state = RouterState(RouterSettings("round_robin"), kv_bus=kv, load_bus=loads)
    core = state.core
    watcher = core.watcher
    assert watcher is not None
    kv.publish(batch(0, 100.0))
    kv.publish(batch(1, 100.4))
    core.pump(100.5)
    assert abs(watcher.event_lag_s - 0.5) < 1e-9 and not watcher.behind  # the oldest one's age
    assert gauges(state) == {
        "kvroute_kv_event_lag_seconds": 0.5,
        "kvroute_kv_events_behind": 0.0,
        "kvroute_kv_event_gaps": 0.0,
    }
    kv.publish(batch(2, 101.0))
    core.pump(101.0 + LAG_WARN_S + 0.5)  # applied late: the map was routing on stale state
    assert watcher.behind and watcher.event_lag_s == LAG_WARN_S + 0.5
    assert gauges(state)["kvroute_kv_events_behind"] == 1.0
    core.pump(200.0)  # nothing new, nothing waiting: caught up
    assert watcher.event_lag_s == 0.0 and not watcher.behind
    assert core.cache_map.match([102])


def test_a_full_read_means_more_is_waiting() -> None:
    kv, loads = InProcessBus(1 << 14), InProcessBus()
    core = RouterState(RouterSettings("round_robin"), kv_bus=kv, load_bus=loads).core
    watcher = core.watcher
    assert watcher is not None
    for seq in range(MAX_READ_ITEMS + 10):
        kv.publish(batch(seq, 10.0))
    core.pump(10.0)  # fresh events, but a full read: behind
    assert watcher.event_lag_s == 0.0 and watcher.behind
    core.pump(10.0)  # the last ten
    assert not watcher.behind
    assert core.ingestor.gaps == 0
