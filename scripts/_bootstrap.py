"""Put the repository root on sys.path so ``python scripts/<name>.py`` works from anywhere."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
