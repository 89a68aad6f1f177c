"""`python -m shardformer.check MODEL [--tp 2 --pp 2 ...]`: the policy checker under the name ColossalAI users and
the coverage issue know it; the same program as `python -m hp_check` (see `hp_check/cli.py` for its arguments and
exit statuses).

The checker drives the whole plugin (it boosts the model and trains it against the unsharded one), so it lives in
the top-level package `hp_check`, above `booster_plugin`. This module is only an entry point: nothing in
`shardformer` imports it, and it reaches the checker by name when run, so importing `shardformer` never loads the
layers above it.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("hp_check", run_name="__main__", alter_sys=True)
