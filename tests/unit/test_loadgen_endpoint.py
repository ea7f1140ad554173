"""What ``kvroute loadgen`` fits to an endpoint (``loadgen.endpoint``), its request headers, and
the output-directory check every command with ``--report`` runs before its run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadgen.args import check_output_dir
from loadgen.endpoint import fit_ids, fit_plan, parse_headers, redacted_argv
from loadgen.traces import TraceRequest
from loadgen.workloads import build_schedule


def test_headers_from_the_key_and_the_header_flags() -> None:
    assert parse_headers(None, None) == {}
    assert parse_headers(None, "") == {}  # --api-key '' sends none, whatever the env says
    assert parse_headers(["X-Tenant:  blue ", "x-empty:"], "sk-1") == {
        "Authorization": "Bearer sk-1",
        "X-Tenant": "blue",
        "x-empty": "",
    }
    # a --header of the same name (any case) replaces the key's Authorization
    assert parse_headers(["authorization: Basic abc"], "sk-1") == {"authorization": "Basic abc"}
    assert parse_headers(["X-Time: 12:30"], None) == {"X-Time": "12:30"}


@pytest.mark.parametrize("bad", ["no colon", ": value", "Two Words: v", "X-A\n: v", "é: v"])
def test_a_malformed_header_names_the_flag(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^--header: expected 'Name: value'"):
        parse_headers([bad], None)


def test_recorded_argv_hides_keys_and_header_values() -> None:
    argv = ["--url", "u", "--api-key", "sk-1", "--header", "X-Key: s3", "--header=X-B: s4",
            "--api-key=sk-2"]  # fmt: skip
    out = redacted_argv(argv)
    assert out == ["--url", "u", "--api-key", "***", "--header", "X-Key: ***",
                   "--header=X-B: ***", "--api-key=***"]  # fmt: skip


def test_token_ids_move_into_the_vocabulary_only_where_left_at_defaults() -> None:
    # nothing to do where the defaults fit
    assert fit_ids(None, None, 32_000, 30_000, 1_000) == (30_000, 1_000, None)
    # the tiny model: both defaults move; ids stay clear of the lowest ids
    vocab, offset, note = fit_ids(None, None, 512, 30_000, 1_000)
    assert (vocab, offset) == (480, 32) and note is not None and "512" in note
    assert fit_ids(None, 10, 512, 30_000, 1_000)[:2] == (502, 10)  # the given offset stays
    assert fit_ids(400, None, 512, 30_000, 1_000)[:2] == (400, 112)  # the given range stays
    with pytest.raises(ValueError, match=r"^--vocab-size and --token-offset: .* 512"):
        fit_ids(500, 100, 512, 30_000, 1_000)
    with pytest.raises(ValueError, match=r"^--token-offset: "):
        fit_ids(None, 600, 512, 30_000, 1_000)


def plan_of(*lengths: tuple[int, int]) -> list:  # type: ignore[type-arg]
    reqs = []
    for i, (n_in, n_out) in enumerate(lengths):
        blocks = tuple(range(-(-n_in // 16)))  # every request shares its leading blocks
        reqs.append(TraceRequest(i * 0.1, n_in, n_out, blocks))
    return build_schedule(reqs)


def test_prompts_are_cut_from_the_right_to_fit_the_context() -> None:
    plan = plan_of((100, 10), (1000, 100), (1000, 3000), (5000, 10))
    fit = fit_plan(plan, 1024, 16)
    got = [(p.req.input_length, p.req.output_length) for p in fit.plan]
    # fits: untouched; prompt too long: cut to the context less its reply; a reply of more
    # than a quarter of the context: capped at the quarter first
    assert got == [(100, 10), (924, 100), (768, 256), (1014, 10)]
    assert (fit.cut, fit.capped) == (3, 1)
    assert fit.plan[0] is plan[0]
    for p, q in zip(plan, fit.plan, strict=True):
        n = q.req.input_length
        assert len(q.req.hash_ids) == -(-n // 16)  # the prompt still fills its blocks
        assert q.req.hash_ids == p.req.hash_ids[: len(q.req.hash_ids)]  # shared prefix kept
        assert q.offset_s == p.offset_s and q.index == p.index


def test_text_prompts_are_cut_by_the_servers_tokens_per_word() -> None:
    # 4 tokens a word and 20 tokens of template: 1024 - 100 - 20 - slack, over 4 * margin
    fit = fit_plan(plan_of((1000, 100), (150, 100)), 1024, 16, words=(4.0, 20.0))
    n = fit.plan[0].req.input_length
    assert 4.0 * n + 20 + 100 <= 1024 and n > 150
    assert fit.plan[1].req.input_length == 150 and fit.cut == 1


def test_output_dir_is_created_or_refused_naming_the_flag(tmp_path: Path) -> None:
    made = check_output_dir(str(tmp_path / "a" / "b"), "--report")
    assert made.is_dir() and list(made.iterdir()) == []  # the write check leaves nothing
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"^--report: .* exists and is not a directory"):
        check_output_dir(str(afile), "--report")
    with pytest.raises(ValueError, match=r"^--report: cannot write to directory .*/file/r"):
        check_output_dir(str(afile / "r"), "--report")
    assert afile.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_dir_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        for path in (ro, ro / "sub"):
            with pytest.raises(ValueError, match=r"^--report: cannot write to directory"):
                check_output_dir(str(path), "--report")
    finally:
        ro.chmod(0o700)
