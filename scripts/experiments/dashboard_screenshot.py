"""A screenshot of the monitor's live page during the local demo, written to paper_results/dashboard/.

Runs ``scripts/local_swarm.py`` (the demo: its page is on by default), waits until the monitor has recorded
``--after-steps`` global steps, and photographs the page with headless Chromium (Debian's ``chromium``, installed
by scripts/setup_env.sh); then it stops the demo (SIGTERM: the launcher stops its peers and writes its report).

    python scripts/experiments/dashboard_screenshot.py [--trainers 3] [--aux 1] [--after-steps 12] [key=value ...]
"""

import argparse
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.dashboard import HEADLESS_CHROMIUM_FLAGS, URL_FILE
from common.errors import UserError, exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.metrics import HistoryWriter
from common.swarm import ROOT, stop_process_group

logger = logging.getLogger("dashboard_screenshot")
CONFIG = "configs/albert/tiny.yaml"
CHROMIUM_FLAGS = [*HEADLESS_CHROMIUM_FLAGS, "--hide-scrollbars"]


def screenshot(url: str, path: Path, width: int, height: int) -> None:
    """Load the page, let it fetch its snapshot and draw (virtual time: timers run, the network is waited for)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise UserError("chromium is not installed (scripts/setup_env.sh installs it as root)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "--virtual-time-budget=10000",
                f"--screenshot={path}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )


@exit_on_user_error
def main() -> None:
    stop = StopFlag().install()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--aux", type=int, default=1)
    parser.add_argument("--after-steps", type=int, default=12, help="photograph once this many steps are recorded")
    parser.add_argument("--output", default="outputs/dashboard_demo", help="the demo's run folder")
    parser.add_argument("--results", default="paper_results/dashboard")
    parser.add_argument("--size", default="1400x2000", help="browser window WIDTHxHEIGHT")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    setup_logging("dashboard_screenshot")
    width, height = (int(part) for part in args.size.split("x"))
    output, results = ROOT / args.output, ROOT / args.results
    results.mkdir(parents=True, exist_ok=True)
    if output.exists():
        shutil.rmtree(output)  # a fresh run: the page must show this demo, not a resumed one
    command = [sys.executable, "scripts/local_swarm.py", "--config", CONFIG, "--trainers", str(args.trainers)]
    command += ["--aux", str(args.aux), "--output", str(output), *args.overrides]
    output.mkdir(parents=True)
    log_path = output / "local_swarm.log"
    with log_path.open("w") as log:
        demo = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url_file, history = output / "monitor" / URL_FILE, HistoryWriter(output / "monitor")
        while len(history.read()) < args.after_steps:
            if demo.poll() is not None or stop.is_set():
                raise UserError(f"the demo ended before {args.after_steps} steps were recorded: see {log_path}")
            time.sleep(1.0)
        url = url_file.read_text().strip()
        shot = results / "dashboard.png"
        screenshot(url, shot, width, height)
        logger.info(f"screenshot of {url} at {len(history.read())} recorded steps: {shot}")
    finally:
        stop_process_group(demo, grace_seconds=120.0)
    logger.info(f"the demo ended with exit code {demo.returncode} (log: {log_path})")


if __name__ == "__main__":
    main()
