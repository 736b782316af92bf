"""Structured outputs: grammars compiled from a request's constraint, and the token masks they give."""
