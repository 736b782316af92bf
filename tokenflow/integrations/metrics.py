"""Deprecated: the old home of `tokenflow.serve.metrics`, kept as an alias for this release."""

import warnings

from tokenflow.serve.metrics import *  # noqa: F403
from tokenflow.serve.metrics import __all__  # noqa: F401

warnings.warn("tokenflow.integrations.metrics moved to tokenflow.serve.metrics", DeprecationWarning, stacklevel=2)
