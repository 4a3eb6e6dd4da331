"""``python -m dew``: the ``dew`` command (:mod:`dew.cli`).

``python -m`` puts the current directory first on the import path; it is taken off
before anything is imported, so a ``.py`` file beside a recipe or a run folder
(``yaml.py``, ``numpy.py``) is not run by the command, as with the ``dew`` script."""

import os
import sys

if sys.path and not sys.flags.safe_path and os.path.abspath(sys.path[0] or ".") == os.getcwd():
    del sys.path[0]

from dew.cli import entry  # noqa: E402

if __name__ == "__main__":
    entry()
