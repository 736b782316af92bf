"""Streaming text: incremental detokenization and stop-string matching, once per token."""

from tokenflow.text.detokenizer import IncrementalDetokenizer
from tokenflow.text.stops import StopStringMatcher

__all__ = ("IncrementalDetokenizer", "StopStringMatcher")
