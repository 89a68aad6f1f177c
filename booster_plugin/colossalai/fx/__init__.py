"""`colossalai.fx`: only `is_compatible_with_meta`, which tests read to decide whether to try lazy (meta) init."""
__all__ = ["is_compatible_with_meta"]


def is_compatible_with_meta() -> bool:
    """Whether torch's meta tensors can stand for parameters (ColossalAI: torch >= 1.12; here always: torch 2)."""
    return True
