"""The run report's compute utilisation (common.report, common.trainer.TrainingSummary)."""

from common.report import swarm_used_share
from common.trainer import TrainingSummary


def summary(samples: int, used: int, wall: float = 10.0, gradients: float = 4.0) -> TrainingSummary:
    return TrainingSummary(
        peer_name="p",
        global_steps=3,
        samples=samples,
        wall_seconds=wall,
        compute_seconds=gradients + 1.0,
        skipped_nonfinite=0,
        stopped_by="max_global_steps",
        samples_used=used,
        gradient_seconds=gradients,
    )


def test_a_summary_states_its_shares_of_samples_and_time():
    record = summary(samples=200, used=150).to_json()
    assert record["used_share"] == 0.75 and record["compute_share"] == 0.4
    assert summary(samples=0, used=0, wall=0.0).to_json()["used_share"] == 0.0


def test_the_swarm_share_weights_trainers_by_what_they_computed():
    summaries = [summary(100, 100).to_json(), summary(300, 150).to_json()]
    assert swarm_used_share(summaries) == 250 / 400
    assert swarm_used_share([]) is None
