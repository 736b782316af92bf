"""From sampled tokens to text chunks: the output processor, incremental detokenizer and stop strings."""

from tokenflow.output.detokenizer import IncrementalDetokenizer
from tokenflow.output.processor import OutputProcessor
from tokenflow.output.stops import StopStringMatcher

__all__ = ("IncrementalDetokenizer", "OutputProcessor", "StopStringMatcher")
