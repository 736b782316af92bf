"""Old home of the metrics: kept as an alias of `tokenflow.serve.metrics`."""

from tokenflow.serve.metrics import *  # noqa: F403
from tokenflow.serve.metrics import __all__  # noqa: F401
