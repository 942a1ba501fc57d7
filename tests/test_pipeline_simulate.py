"""The simulator: textbook bubbles, activation memory, zero-bubble and interleaving gains, deadlocks, bad schedules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise import pipeline as pp
from shardwise.pipeline import DeadlockError, Schedule, ScheduleError

SIZES = [(2, 4), (2, 8), (4, 4), (4, 8), (8, 16), (3, 5)]


@pytest.mark.parametrize("p, m", SIZES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubbles_are_textbook_exactly(name, p, m):
    result = pp.simulate(name, n_stages=p, n_microbatches=m, forward=1.0, backward=1.0)
    assert result.bubble == (p - 1) / (m + p - 1)  # exact: unit costs make every sum an integer
    assert result.makespan == 2 * (m + p - 1)
    result = pp.simulate(name, n_stages=p, n_microbatches=m)  # F = 1, B = 2: same fraction
    assert result.bubble == (p - 1) / (m + p - 1)


@pytest.mark.parametrize("p, m", SIZES)
def test_peak_inflight_is_p_for_1f1b_and_m_for_gpipe(p, m):
    assert pp.simulate("1f1b", p, m).peak_inflight == p
    assert pp.simulate("1f1b", p, m).peak_inflight_per_rank == tuple(p - r for r in range(p))
    assert pp.simulate("gpipe", p, m).peak_inflight == m


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_divides_the_bubble_time_by_v(p, m, v):
    plain = pp.simulate("1f1b", p, m)
    inter = pp.simulate("interleaved_1f1b", p, m, virtual_stages=v)
    assert inter.bubble_time == pytest.approx(plain.bubble_time / v, rel=1e-12)
    assert inter.bubble < plain.bubble
    assert inter.makespan == pytest.approx(3 * m + 3 * (p - 1) / v, rel=1e-12)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_zb_h1_cuts_the_bubble_to_a_third_with_1f1b_memory(p, m):
    plain = pp.simulate("1f1b", p, m)
    zb = pp.simulate("zb_h1", p, m)  # backward 2 split evenly: I = W = 1
    assert zb.bubble_time == plain.bubble_time / 3  # (p-1)(F+I-W) against (p-1)(F+B)
    assert zb.bubble == (p - 1) / (3 * m + p - 1)
    assert zb.peak_inflight == p


def test_p4_m8_numbers_quoted_in_the_docs():
    bubbles = {
        "gpipe": pp.simulate("gpipe", 4, 8).bubble,
        "1f1b": pp.simulate("1f1b", 4, 8).bubble,
        "interleaved_1f1b": pp.simulate("interleaved_1f1b", 4, 8, virtual_stages=2).bubble,
        "zb_h1": pp.simulate("zb_h1", 4, 8).bubble,
    }
    assert bubbles == pytest.approx({"gpipe": 3 / 11, "1f1b": 3 / 11, "interleaved_1f1b": 3 / 19, "zb_h1": 1 / 9})


def test_a_hand_broken_schedule_is_rejected_as_a_deadlock():
    # Rank 0 wants microbatch 0's gradient before sending microbatch 1; rank 1 wants microbatch 1 before
    # sending that gradient.
    broken = Schedule.from_text(
        [
            "0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1",
            "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
        ],
        n_microbatches=2,
    )
    with pytest.raises(DeadlockError, match=r"deadlocks: rank 0: 0B0 waits for 1SEND_B0 from rank 1; rank 1: 1F1 "
                                            r"waits for 0SEND_F1 from rank 0") as info:
        pp.simulate(broken)
    assert set(info.value.blocked) == {0, 1}
    fixed = Schedule.from_text(
        ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
         "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1"],
        n_microbatches=2,
    )
    assert pp.simulate(fixed).bubble > 0


@pytest.mark.parametrize(
    "lines, match",
    [
        (["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"], r"unmatched send, rank 1 never posts 1RECV_F0"),
        (["0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], r"unmatched receive, rank 0 never sends 0SEND_F0"),
        (["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1SEND_B0"], r"needs a full backward 1B0 or both 1I0 and 1W0"),
        (["0F0 0SEND_F0 0RECV_B0 0B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], r"action 0B0 appears twice"),
        (["0B0 0F0 0SEND_F0 0RECV_B0", "1RECV_F0 1F0 1B0 1SEND_B0"], r"backward comes before its forward"),
        (["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1RECV_F0 1B0 1SEND_B0"], r"1RECV_F0 is posted after the pass"),
        (["0F0 0SEND_F0 0RECV_B0 0B0 1F0", "1RECV_F0 1F0 1B0 1SEND_B0"], r"stage 1 lives on rank 1"),
        (["0F0 0SEND_F0 0RECV_B0 0I0 0W0", "1RECV_F0 1F0 1W0 1I0 1SEND_B0"], r"1W0 comes before 1I0"),
    ],
)
def test_malformed_schedules_are_rejected_naming_the_action(lines, match):
    with pytest.raises(ScheduleError, match=match):
        pp.simulate(Schedule.from_text(lines, n_microbatches=1))


def test_costs_per_stage_latency_and_uneven_split():
    even = pp.simulate("1f1b", 2, 4)
    slow_last = pp.simulate("1f1b", 2, 4, forward=[1.0, 2.0], backward=[2.0, 4.0])
    assert slow_last.makespan > even.makespan
    # Rank 0 waits a round trip (2 hops) for each of its m gradients: 1F1B exposes the latency m times.
    assert pp.simulate("1f1b", 2, 4, latency=0.5).makespan == even.makespan + 4 * 0.5
    for share in (0.0, 0.25, 0.5):  # ZB-H1's bubble is (p-1)(F + I - W) while W <= I
        i, w = 2.0 * (1 - share), 2.0 * share
        assert pp.simulate("zb_h1", 4, 8, weight_share=share).bubble_time == 3 * (1.0 + i - w)
    with pytest.raises(ValueError, match="is a name, so n_stages and n_microbatches are required"):
        pp.simulate("1f1b")
    with pytest.raises(ValueError, match=r"forward must be a number or 2 non-negative per-stage numbers"):
        pp.simulate("1f1b", 2, 4, forward=[1.0])


def test_single_rank_pipeline_hands_tensors_over_locally():
    result = pp.simulate("interleaved_1f1b", 1, 2, virtual_stages=2)
    assert result.bubble == 0.0
    assert not any(not a.is_compute for acts in result.schedule.actions for a in acts)


def test_gantt_png_is_written(tmp_path):
    result = pp.simulate("zb_h1", 4, 8)
    path = result.plot(tmp_path / "zb.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(result.timeline.of_rank(0)) == 3 * 8


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), k=st.integers(1, 4))
def test_zero_bubble_and_interleaving_never_lose_to_1f1b(p, k):
    m = p * k
    plain = pp.simulate("1f1b", p, m)
    assert pp.simulate("zb_h1", p, m).bubble_time < plain.bubble_time
    assert pp.simulate("interleaved_1f1b", p, m, virtual_stages=2).bubble_time < plain.bubble_time
    assert pp.simulate("gpipe", p, m).bubble == pytest.approx(plain.bubble, rel=1e-12)


# ---- unbuffered (rendezvous) point-to-point: NCCL's rules ----------------------------------------------------------

_GRID = [(name, p, m, v) for name, vs in (("gpipe", [1]), ("1f1b", [1]), ("zb_h1", [1]), ("interleaved_1f1b", [2, 3]),
                                         ("forward_only", [1, 2, 3]))
         for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16) for v in vs]


@pytest.mark.parametrize("name", sorted({g[0] for g in _GRID}))
def test_every_schedule_runs_with_unbuffered_untagged_point_to_point(name):
    ran = 0
    for _, p, m, v in (g for g in _GRID if g[0] == name):
        try:
            sched = pp.build_schedule(name, p, m, v)
        except ValueError:  # a shape the schedule does not support (m < p for 1f1b, ...)
            continue
        result = pp.simulate(sched, p2p="rendezvous", latency=0.1)
        assert len(result.timeline.events) == sum(a.is_compute for acts in sched.actions for a in acts)
        assert result.makespan >= pp.simulate(sched, latency=0.1).makespan - 1e-9  # a rendezvous never speeds up
        ran += 1
    assert ran >= 10


def test_rendezvous_mode_finds_the_1f1b_deadlock_of_receives_posted_one_action_early():
    # The pattern: rank 0 posts recv(grad 0) before send(act 1) while rank 1 posts recv(act 1) before
    # send(grad 0). Buffered sends hide it; NCCL's unbuffered, in-order stream deadlocks.
    early = Schedule.from_text(["0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
                                "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1"], n_microbatches=2)
    assert pp.simulate(early).bubble > 0  # fine with buffered sends
    with pytest.raises(DeadlockError, match=r"unbuffered \(rendezvous\).*rank 0: 0B0 waits for its receive.*"
                                            r"rank 1: 1F1 waits for its receive") as info:
        pp.simulate(early, p2p="rendezvous")
    assert set(info.value.blocked) == {0, 1}
    assert pp.simulate(pp.build_schedule("1f1b", 2, 2), p2p="rendezvous").bubble > 0


def test_rendezvous_mode_checks_that_untagged_messages_match_in_order():
    # Rank 0 sends microbatch 0 then 1; rank 1 receives 1 first: with tags this works, without it swaps tensors.
    # (Message #1 of the pair is the metadata that precedes the first activation.)
    crossed = Schedule.from_text(["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                                  "1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1"], n_microbatches=2)
    with pytest.raises(ScheduleError, match=r"matched in posting order \(no tags\), but message #2 is send "
                                            r"activation of stage 0 microbatch 0 to rank 1 on rank 0 and recv "
                                            r"activation of stage 0 microbatch 1 from rank 0 on rank 1"):
        pp.simulate(crossed, p2p="rendezvous")
    with pytest.raises(ValueError, match=r"p2p='nccl' is not a point-to-point model; allowed \['buffered', "
                                         r"'rendezvous'\]"):
        pp.simulate("1f1b", 2, 2, p2p="nccl")
