"""A module that does not import: it needs a package that is not installed."""

import fwdcheck_no_such_dependency_xyz  # noqa: F401


def build():  # never reached
    pass
