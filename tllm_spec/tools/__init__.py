"""Tooling above the core: benchmarks, acceptance evaluation, reports, random-weight models, the demo pair's
recipe. The core never imports it."""
