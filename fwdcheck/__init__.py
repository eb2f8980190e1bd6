"""fwdcheck: forward-pass sanity checks for transformer code.

Importing the package is cheap (no torch): the CLI's --help and --version must answer instantly.
"""

__version__ = "0.1.0"


def check_model(model, checks=None, **options):
    """Run the checks on an nn.Module and return a Report; see fwdcheck.api.check_model."""
    from fwdcheck.api import check_model as _check_model  # imported on use: `import fwdcheck` stays torch-free

    return _check_model(model, checks, **options)
