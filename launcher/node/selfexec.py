"""The command line that runs this launcher again as a helper process (the node's disk server, ssh's
ProxyCommand), whatever directory it is started from.

`python -m launcher` puts the working directory first on sys.path, so a `diskkit/` or `launcher/`
directory there would be imported instead of the installed packages (with an editable install the
installed ones are found last). `-P` (Python 3.11's safe path) leaves the working directory off
sys.path and keeps PYTHONPATH, which is how a checkout that is not installed is named.
"""

from __future__ import annotations

import sys


def launcher_argv() -> list[str]:
    return [sys.executable, "-P", "-m", "launcher"]
