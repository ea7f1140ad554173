"""The PD connector's pure parts (``engines.pd.protocol``): settings, ``kv_transfer_params``
parsing, control messages and the lease ledger."""

from __future__ import annotations

import threading
import time

import pytest

from engines.pd.protocol import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    Connect,
    ConnectorSettings,
    ConnectReply,
    ParamsError,
    ProtocolError,
    Pull,
    PullReply,
    Release,
    SendLedger,
    decode_message,
    encode_message,
    kv_transfer_config,
    parse_pull_params,
)

PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "eng-p",
    "remote_request_id": "req-1-abc",
    "remote_block_ids": [4, 5, 9],
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_num_tokens": 70,
    "tp_size": 1,
    "transfer_mode": "kvroute-pull",
    "remote_prefill_cached_tokens": 0,
    "kvroute": {"category": "text_2"},
}


# -- settings and the kv_transfer_config helper


def test_settings_defaults_and_unknown_keys() -> None:
    s = ConnectorSettings.from_extra({"port": 5600, "lease_s": 2, "someone_elses": "x"})
    assert (s.host, s.port, s.backend, s.lease_s, s.timeout_s) == (
        "127.0.0.1",
        5600,
        "auto",
        2.0,
        30.0,
    )
    assert ConnectorSettings.from_extra(None) == ConnectorSettings()


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"port": 0}, "'port'"),
        ({"port": "5600"}, "'port'"),
        ({"host": ""}, "'host'"),
        ({"backend": "ucx"}, "'backend'"),
        ({"lease_s": 0}, "'lease_s'"),
        ({"timeout_s": True}, "'timeout_s'"),
        ({"connect_timeout_s": float("inf")}, "'connect_timeout_s'"),
        ({"chunk_bytes": 0}, "'chunk_bytes'"),
        ({"pull_threads": 1.5}, "'pull_threads'"),
    ],
)
def test_settings_errors_name_the_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ParamsError, match=key):
        ConnectorSettings.from_extra(extra)


def test_kv_transfer_config_for_prefill_and_decode() -> None:
    prefill = kv_transfer_config(port=5600, lease_s=60, kv_load_failure_policy="fail")
    assert prefill == {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "host": "127.0.0.1",
            "port": 5600,
            "backend": "auto",
            "lease_s": 60,
            "timeout_s": 30.0,
            "connect_timeout_s": 10.0,
        },
    }
    decode = kv_transfer_config(port=None, host="10.0.0.8", backend="nccl", engine_id="d-0")
    assert decode["kv_connector_extra_config"]["port"] is None
    assert decode["engine_id"] == "d-0"
    with pytest.raises(ParamsError, match="'backend'"):
        kv_transfer_config(port=1, backend="tcp")  # type: ignore[arg-type]
    with pytest.raises(ParamsError, match="kv_load_failure_policy"):
        kv_transfer_config(port=1, kv_load_failure_policy="retry")  # type: ignore[arg-type]


def test_kv_transfer_config_is_what_vllm_takes() -> None:
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(**kv_transfer_config(port=5600, kv_load_failure_policy="recompute"))
    assert ktc.kv_connector == CONNECTOR_NAME and ktc.kv_load_failure_policy == "recompute"
    assert ktc.is_kv_producer and ktc.is_kv_consumer
    assert ktc.get_from_extra_config("port", None) == 5600


# -- kv_transfer_params


def test_parse_pull_params_ignores_unknown_keys() -> None:
    pull = parse_pull_params(PARAMS)
    assert pull is not None
    assert (pull.engine_id, pull.request_id, pull.block_ids) == ("eng-p", "req-1-abc", (4, 5, 9))
    assert (pull.host, pull.port, pull.tp_size, pull.num_tokens) == ("10.0.0.7", 5600, 1, 70)
    assert pull.endpoint(1) == "tcp://10.0.0.7:5601"
    assert parse_pull_params({**PARAMS, "remote_host": "::1"}).endpoint(0) == "tcp://[::1]:5600"  # type: ignore[union-attr]
    # one list per KV cache group (HMA-style) with one group
    assert parse_pull_params({**PARAMS, "remote_block_ids": [[4, 5]]}).block_ids == (4, 5)  # type: ignore[union-attr]


def test_parse_pull_params_none_without_a_pull() -> None:
    assert parse_pull_params(None) is None
    assert parse_pull_params({}) is None
    assert parse_pull_params({"do_remote_decode": True, "kvroute": {}}) is None
    assert parse_pull_params({**PARAMS, "do_remote_prefill": False}) is None


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"remote_engine_id": None}, "remote_engine_id"),
        ({"remote_request_id": ""}, "remote_request_id"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids"),
        ({"remote_block_ids": [[1], [2]]}, "remote_block_ids"),
        ({"remote_host": 7}, "remote_host"),
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_port": "5600"}, "remote_port"),
        ({"tp_size": 0}, "tp_size"),
        ({"remote_num_tokens": -1}, "remote_num_tokens"),
        ({"remote_backend": "ucx"}, "remote_backend"),
    ],
)
def test_parse_pull_params_errors_name_the_key(change: dict[str, object], key: str) -> None:
    with pytest.raises(ParamsError, match=f"'{key}'"):
        parse_pull_params({**PARAMS, **change})


def test_parse_pull_params_missing_key() -> None:
    for key in ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host"):
        params = {k: v for k, v in PARAMS.items() if k != key}
        with pytest.raises(ParamsError, match=f"'{key}'.*missing"):
            parse_pull_params(params)


# -- control messages


def test_messages_round_trip() -> None:
    for msg in (
        Connect("pair-1", "eng-d", "127.0.0.1", 41000, "gloo"),
        ConnectReply("pair-1", False, "eng-p", "backend differs"),
        Pull("pair-1", "req-1", 3),
        PullReply("req-1", False, "lease expired", refused=True),
        Release("req-2"),
    ):
        assert decode_message(encode_message(msg)) == msg


@pytest.mark.parametrize("data", [b"", b"\x00garbage", b"\x82\xa4type\xa3bad\xa1x\x01"])
def test_foreign_messages_raise(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_message(data)


# -- the lease ledger


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pull_then_finish_reports_once() -> None:
    ledger = SendLedger()
    ledger.add("r1", [3, 4], lease_s=60)
    assert ledger.claim("r1") == [3, 4]
    assert "already being pulled" in str(ledger.claim("r1"))
    assert ledger.take_finished() == set()  # claimed: held until sent
    assert ledger.finish("r1")
    assert ledger.take_finished() == {"r1"}
    assert ledger.take_finished() == set()
    assert "already pulled" in str(ledger.claim("r1"))
    assert ledger.holding() == 0


def test_lease_expires_unclaimed_blocks_only() -> None:
    clock = Clock()
    ledger = SendLedger(clock=clock)
    ledger.add("old", [1], lease_s=5)
    ledger.add("pulled", [2], lease_s=5)
    assert ledger.claim("pulled") == [2]
    clock.now += 4.9
    assert ledger.take_finished() == set()
    clock.now += 0.2
    assert ledger.take_finished() == {"old"}
    assert ledger.expired == 1
    reason = ledger.claim("old")
    assert isinstance(reason, str) and "lease expired" in reason
    assert ledger.why_gone("old") is not None and "lease expired" in str(ledger.why_gone("old"))
    assert ledger.why_gone("pulled") is None  # claimed, still held while sending
    assert ledger.holding() == 1


def test_release_frees_unless_claimed() -> None:
    ledger = SendLedger()
    ledger.add("a", [1], lease_s=60)
    ledger.add("b", [2], lease_s=60)
    assert ledger.claim("b") == [2]
    assert ledger.release("a") and not ledger.release("b") and not ledger.release("zzz")
    assert ledger.take_finished() == {"a"}
    assert "released" in str(ledger.claim("a"))


def test_claim_waits_for_a_late_add_and_gives_up() -> None:
    ledger = SendLedger()
    timer = threading.Timer(0.2, ledger.add, args=("late", [7, 8], 60))
    timer.start()
    t0 = time.monotonic()
    assert ledger.claim("late", wait_s=5) == [7, 8]
    assert time.monotonic() - t0 < 4
    t0 = time.monotonic()
    assert "not held here" in str(ledger.claim("never", wait_s=0.3))
    assert 0.25 < time.monotonic() - t0 < 3
    assert ledger.why_gone("never") is None


def test_ledger_forgets_old_reasons() -> None:
    ledger = SendLedger(remember=2)
    for rid in ("a", "b", "c"):
        ledger.add(rid, [1], lease_s=60)
        ledger.release(rid)
    assert ledger.why_gone("a") is None and ledger.why_gone("c") is not None
