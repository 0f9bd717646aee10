"""The command-line programs: `m2po-train` (`train`), `m2po-export` (`export`) and `m2po-study`
(`study`). Each is `python -m m2po_jax.cli.<name>` too.
"""
