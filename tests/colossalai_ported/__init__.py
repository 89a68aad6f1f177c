"""Copies of ColossalAI's own tests (https://github.com/hpcaitech/ColossalAI, Apache License 2.0), ported by the
README's rule alone (plus, where marked, the CPU-only rule of benchmarks/port_colossalai_tests.py)."""
