"""Guided decoding: grammars (llguidance) and the token masks of a speculative step."""
