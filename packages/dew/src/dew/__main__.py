"""``python -m dew``: the ``dew`` command (:mod:`dew.cli`)."""

from dew.cli import entry

if __name__ == "__main__":
    entry()
