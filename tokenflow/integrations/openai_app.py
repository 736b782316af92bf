"""Deprecated: the old home of `tokenflow.serve.openai_app`, kept as an alias for this release."""

import warnings

from tokenflow.serve.openai_app import *  # noqa: F403
from tokenflow.serve.openai_app import __all__  # noqa: F401

warnings.warn("tokenflow.integrations.openai_app moved to tokenflow.serve.openai_app", DeprecationWarning, stacklevel=2)
