"""Old home of the OpenAI app: kept as an alias of `tokenflow.serve.openai_app`."""

from tokenflow.serve.openai_app import *  # noqa: F403
from tokenflow.serve.openai_app import __all__  # noqa: F401
