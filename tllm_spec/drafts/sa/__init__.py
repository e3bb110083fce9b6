"""Suffix-automaton (SA) drafting: drafts copied from the request's own text, no draft model."""
