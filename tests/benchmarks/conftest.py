"""The scripts of benchmarks/ importable by name (benchmarks/ is not a package)."""
import os
import sys

from support import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
