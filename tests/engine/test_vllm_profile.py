"""``kvroute profile``: the fit on known coefficients, argument errors, and a quick real run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from deploy.cli import main
from engines.profile import LatencyProfile
from engines.profiling import Measurements, fit, nnls

pytestmark = pytest.mark.engine


def test_nnls_clamps_negative_coefficients() -> None:
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert np.allclose(nnls(a, np.array([3.0, 5.0, 7.0])), [1.0, 2.0])
    # The unconstrained slope would be negative: it is dropped and the mean refitted.
    assert np.allclose(nnls(a, np.array([3.0, 2.0, 1.0])), [2.0, 0.0])


def test_fit_recovers_known_coefficients() -> None:
    base, over, tok, attn, seq, ctx = 2.0, 5.0, 0.01, 1e-6, 0.2, 1e-4
    m = Measurements()
    for n, c in [(32, 0), (512, 0), (2048, 0), (64, 1024), (512, 3072), (256, 512)]:
        ms = base + over + tok * n + attn * n * (c + n / 2)
        m.prefill.append({"uncached": n, "context": c, "ms": ms})
    for b, context in [(1, 200), (8, 2000), (32, 30000), (16, 4000)]:
        m.decode.append({"batch": b, "context": context, "ms": base + seq * b + ctx * context})
    f = fit(m)
    got = [f[k] for k in ("base_ms", "request_overhead_ms", "token_ms", "attn_ms", "seq_ms")]
    assert np.allclose(got, [base, over, tok, attn, seq], rtol=1e-6)
    assert f["ctx_ms"] == pytest.approx(ctx, rel=1e-6)
    assert f["prefill_median_rel_err"] < 1e-9 and f["decode_median_rel_err"] < 1e-9


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--block-size", "48"], "--block-size"),
        (["--kv-space-gib", "0"], "--kv-space-gib"),
        (["--repeats", "0"], "--repeats"),
        (["--model", "/nonexistent/model"], "--model"),
    ],
)
def test_bad_arguments_name_the_field(argv, field, capsys) -> None:
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute profile: error:") and field in err


@pytest.mark.slow
def test_quick_profile_of_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "tiny.json"
    assert main(["profile", "--quick", "--repeats", "2", "--name", "t", "--out", str(out)]) == 0
    profile = LatencyProfile.load(out)
    assert (profile.name, profile.block_size) == ("t", 32)
    # 2 K/V x 2 layers x 1 KV head x head_dim 64 x 2 bytes (bf16)
    assert profile.kv_bytes_per_token == 512
    assert profile.kv_capacity_tokens > 0 and profile.kv_capacity_tokens % 32 == 0
    data = json.loads(out.read_text())
    pre = {(p["uncached"], p["context"]): p["ms"] for p in data["measurements"]["prefill"]}
    # The warmed 1,024-token prefix was a hit: only the 64 new tokens were computed.
    assert set(pre) == {(32, 0), (2048, 0), (64, 1024)}
    # NOTE: measured, not compared: on two shared cores a 2,048-token prefill of the tiny model
    # timed under a 32-token one in CI (58.9 against 68.1 ms); how well a profile predicts is
    # benchmarks/plan_validate.py's to measure, not a test's to assert
    assert all(math.isfinite(ms) and ms > 0 for ms in pre.values())
    # the fit is a valid model (non-negative terms: a longer prefill never costs less) that
    # prices a request at all; its slope may come out 0 when noise inverts the two points, as it
    # did in CI (both terms 0.0), and so may the step's own cost when noise puts it all in the
    # request overhead (CI again: prefill_s(32) 0.0), so the TTFT is what must be positive
    short, long = profile.prefill_s(32), profile.prefill_s(2048)
    assert math.isfinite(long) and 0 <= short <= long
    assert profile.ttft_s(32) > 0
    assert [d["batch"] for d in data["measurements"]["decode"]] == [1, 1, 8, 8]
    assert all(d["ms"] > 0 for d in data["measurements"]["decode"])
    assert data["request_overhead_ms"] >= 0
