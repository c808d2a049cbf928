"""Run each hivemind fix's regression test with the fix and with it left out (``pytest --without-patch NAME``) and
write what happened: the test must pass with the fix and fail without it (common/README.md, the patch table).

    .venv/bin/python scripts/experiments/patch_regressions.py --output paper_results/core/patch_regressions.json
    .venv/bin/python scripts/experiments/patch_regressions.py --only finish_progress_tracker_tasks --output x.json

It tests the checkout it lies in (a clone with /work/main's .venv linked tests the clone). Each run is one pytest
process (the patches are installed once per process), so a run takes its test's time plus about 10 s of imports on 2
cores. Multi-process tests among them: run it under ``flock /work/heavy.lock``.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
# this checkout's code and commit, not those of the checkout the virtual environment has installed (a clone shares
# /work/main's .venv); pytest runs here too
sys.path.insert(0, str(CHECKOUT))

from common.tools.provenance import ROOT, git_commit, load_average, machine_description  # noqa: E402

logger = logging.getLogger("patch_regressions")

# fix -> the tests that show its fault (``common/README.md``'s patch table)
REGRESSION_TESTS = {
    "deliver_whole_streams": [
        "tests/core/test_whole_streams.py",
        "tests/core/test_state_integrity.py::test_a_stream_whose_server_dies_mid_stream_raises_instead_of_ending",
        "tests/core/test_hivemind_patches.py::test_a_stream_broken_while_this_side_writes_is_cut_short",
    ],
    "verify_state_downloads": [
        "tests/core/test_hivemind_patches.py::test_a_state_download_corrupted_in_transit_is_refused"
    ],
    "keep_inbound_stream_handlers_alive": ["tests/core/test_inbound_streams.py"],
    "close_averager_p2p_on_shutdown": ["tests/core/test_averager_sockets.py"],
    "finish_abandoned_executor_maps": ["tests/core/test_executor_map.py"],
    "stream_results_to_zero_share_full_peers": [
        "tests/core/test_hivemind_patches.py::test_a_slow_full_peer_with_no_share_gets_results_while_it_sends"
    ],
    "read_8bit_tensors_with_numpy_2": ["tests/core/test_compression.py"],
    "report_vanished_handle_senders": [
        "tests/core/test_fault_tolerance.py::"
        "test_a_handle_whose_sender_vanished_mid_handoff_is_a_connection_error_not_a_dead_dht"
    ],
    "identity_check_uses_the_start_timeout": [
        "tests/core/test_hivemind_patches.py::test_the_identity_check_starts_its_daemon_with_the_callers_timeout"
    ],
    "servicers_collect_their_own_handlers": [
        "tests/core/test_hivemind_patches.py::test_a_servicer_subclass_calls_its_peers_under_the_name_it_registers"
    ],
    "finish_progress_tracker_tasks": [
        "tests/core/test_hivemind_patches.py::test_a_progress_tracker_leaves_no_task_pending_when_it_shuts_down"
    ],
    "skip_nonfinite_steps": ["tests/core/test_nonfinite_step_guard.py"],
    "client_mode_argument": [
        "tests/core/test_hivemind_patches.py::test_a_client_mode_peer_builds_its_optimizer_in_client_mode"
    ],
    "grad_buffers_for_scaler": [
        "tests/core/test_hivemind_patches.py::test_an_fp16_step_applies_the_unscaled_average_of_every_micro_batch"
    ],
}


def run_pytest(tests, without, timeout: float) -> dict:
    command = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider"]
    command += [argument for name in without for argument in ("--without-patch", name)]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        returncode, output = None, (expired.stdout or b"").decode(errors="replace")
    lines = [line for line in output.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "failed" in line)), "")
    return {
        "command": " ".join(["pytest", *command[3:]]),
        "returncode": returncode,
        "seconds": round(time.monotonic() - started, 1),
        "summary": summary.strip("= "),
        "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
    }


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--only", action="append", default=[], help="this fix only (repeatable)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    args = parser.parse_args()
    unknown = set(args.only) - set(REGRESSION_TESTS)
    if unknown:
        print(f"error: no regression test known for {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    fixes = args.only or list(REGRESSION_TESTS)
    rows = []
    for name in fixes:
        row = {"fix": name, "tests": REGRESSION_TESTS[name]}
        row["with_fix"] = run_pytest(REGRESSION_TESTS[name], (), args.timeout)
        row["without_fix"] = run_pytest(REGRESSION_TESTS[name], (name,), args.timeout)
        row["shown"] = row["with_fix"]["returncode"] == 0 and row["without_fix"]["returncode"] not in (0, None)
        logger.info(f"{name}: with {row['with_fix']['summary']!r}, without {row['without_fix']['summary']!r}")
        rows.append(row)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"2-core x86_64 CPU container, no GPU ({machine_description()})",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "load_average_at_end": load_average(),
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    logger.info(f"{sum(row['shown'] for row in rows)}/{len(rows)} fixes shown; written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
